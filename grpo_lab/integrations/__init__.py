"""Hand a grpo_lab run to a distributed trainer: TRL's GRPOTrainer (``trl``) or
verl (``verl``).

Each module translates a :class:`~grpo_lab.training.config.TrainConfig` into
the other library's settings and writes a launch folder; grpo_lab itself never
builds a distributed engine. The other libraries are imported lazily.
"""
