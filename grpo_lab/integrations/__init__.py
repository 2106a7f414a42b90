"""Hand a grpo_lab run to a distributed trainer: TRL's GRPOTrainer (``trl/``) or
verl (``verl/``), and to the Hugging Face Hub (``hub``).

Each engine's package translates a :class:`~grpo_lab.training.config.TrainConfig`
into that library's settings and writes a launch folder; grpo_lab itself never
builds a distributed engine. The other libraries are imported lazily.

``trl/``, one module per job (each imports only those before it):

- ``translation``: the translation table (``TRANSLATIONS``) and ``to_trl_config``;
  imports neither trl nor datasets; ``batch_rules``: TRL's own batch checks;
- ``names``: the table read backwards, TRL's names in a config file;
- ``trainer``: ``GrpoLabTrainer`` (a ``GRPOTrainer`` subclass), the
  dataset, the reward function and the ``peft_config`` a TRL run is handed;
- ``tools``: a tool-using task's ``rollout_func``;
- ``launch``: the launch folder ``grpo-lab export trl`` writes;
- ``parity``: one TRL step on fixed completions (tests, benchmarks).

``verl/``: ``algorithms`` (the plugin verl loads: losses and advantage
estimators), ``settings`` (one row per field: its overrides and note),
``launch`` (the launch folder), ``tools`` and ``calculator`` (tool use in
verl's agent loop). Shared by both: ``cluster`` (the machines a launch folder
is written for) and ``unrowed`` (a field with no row in an engine's table is
refused unless it has no effect).
"""
