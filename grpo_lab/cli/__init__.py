"""The ``grpo-lab`` command (``main``): train, export, plot, push, merge; the
course's commands (``course``); the flags as data, read without torch (``flags``);
a run's settings from a YAML or JSON file (``config_file``)."""
