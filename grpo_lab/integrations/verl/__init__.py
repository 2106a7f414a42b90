"""A grpo_lab run on verl 0.9.1: one module per job (see
:mod:`grpo_lab.integrations`). Importing this package imports no verl."""
