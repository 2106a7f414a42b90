"""A grpo_lab run on TRL's ``GRPOTrainer``: one module per job (see
:mod:`grpo_lab.integrations`)."""
