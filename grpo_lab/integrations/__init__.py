"""Hand a grpo_lab run to a distributed trainer: TRL's GRPOTrainer (``trl``) or
verl (``verl``).

Each module translates a :class:`~grpo_lab.training.config.TrainConfig` into
the other library's settings and writes a launch folder; grpo_lab itself never
builds a distributed engine. The other libraries are imported lazily.

TRL's integration is split by job, one module each (each imports only those
before it):

- ``trl``: the translation table (``TRANSLATIONS``) and ``to_trl_config``;
  imports neither trl nor datasets; ``trl_batch_rules``: TRL's own batch checks;
- ``trl_names``: the table read backwards, TRL's names in a config file;
- ``trl_trainer``: ``GrpoLabTrainer`` (a ``GRPOTrainer`` subclass), the
  dataset, the reward function and the ``peft_config`` a TRL run is handed;
- ``trl_launch``: the launch folder ``grpo-lab export trl`` writes;
- ``trl_parity``: one TRL step on fixed completions (tests, benchmarks).

verl's: ``verl`` (the plugin verl loads: losses and advantage estimators),
``verl_settings`` (one row per field: its overrides and note) and
``verl_launch`` (the launch folder). A field with no row in either engine's
table is refused unless it has no effect (``unrowed``).
"""
