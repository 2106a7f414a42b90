"""Every setting of a training run: one dataclass, read like a manual.

Fields are grouped in sections (run · model · task · batches and schedule ·
optimizer · advantages and loss · sampling · evaluation and checkpoints ·
warm-up · device and memory · dynamic sampling and length). Each field's help
text is stored with it and is what ``grpo-lab train --help`` prints. The
dataclass defaults are the ``cpu`` profile; the others list only what they
change:

- ``cpu``: a 2-layer character model learns to reverse 5-digit strings on a
  laptop CPU in about a minute;
- ``gpu``: Qwen2.5-Math-1.5B on GSM8K with vLLM rollouts;
- ``small-gpu``: Qwen2.5-0.5B-Instruct on GSM8K on one 16 GB GPU (a T4);
- ``smoke``: the cpu run at the smallest sizes that still execute every line
  (tests, notebook checks).

Command-line flags (``grpo-lab train --lr 3e-4``) and notebook overrides
(``for_profile("cpu", lr=3e-4)``) write to the same fields, and every setting is
checked once, when the config is built (:func:`validate_config`), by the same
validator functions the core calls for direct callers: a run that cannot work
is refused here, not at step 1. Taught in ``notebooks/08_training_loop.ipynb``.

One job per module, imported in this order (each imports only those above it):

- ``fields``: ``TrainFields``, the dataclass of every field, its sections and
  help texts;
- ``profiles``: what each profile changes from the defaults (data only);
- ``validation``: :func:`validate_config` and its ``_check_*`` functions;
- ``inert``: :func:`inert_settings`, the settings that do nothing in a config;
- ``train_config``: ``TrainConfig``, the fields with what a run does with them
  (``for_profile``, validation when built, ``update_settings``, ``to_json``);
- ``memory``: the GPU memory a run needs, and the profile this machine runs;
- ``command_line``: the fields as ``--flags``, and :func:`field_value`, the one
  parser of a flag's text and a config file's value.
"""

from grpo_lab.training.config.command_line import (
    add_config_arguments,
    config_from_arguments,
    field_value,
)
from grpo_lab.training.config.fields import (
    DTYPES,
    INERT_SETTINGS_KEY,
    PROFILE_VARIABLE,
    PROFILES,
    SECTIONS,
    TrainFields,
    field_help,
    setting,
)
from grpo_lab.training.config.inert import inert_settings
from grpo_lab.training.config.memory import (
    KNOWN_ARCHITECTURES,
    KNOWN_PARAMETER_COUNTS,
    SHARDABLE_COPIES,
    activation_bytes,
    chosen_profile,
    default_profile,
    lora_parameter_count_of,
    profile_fits,
    training_memory_bytes,
)
from grpo_lab.training.config.profiles import (
    CPU_CHANGES,
    CPU_TASK_CHANGES,
    GPU_CHANGES,
    PROFILE_CHANGES,
    SMALL_GPU_CHANGES,
    SMOKE_CHANGES,
)
from grpo_lab.training.config.train_config import TrainConfig
from grpo_lab.training.config.validation import validate_config

__all__ = [
    "CPU_CHANGES",
    "CPU_TASK_CHANGES",
    "DTYPES",
    "GPU_CHANGES",
    "INERT_SETTINGS_KEY",
    "KNOWN_ARCHITECTURES",
    "KNOWN_PARAMETER_COUNTS",
    "PROFILES",
    "PROFILE_CHANGES",
    "PROFILE_VARIABLE",
    "SECTIONS",
    "SHARDABLE_COPIES",
    "SMALL_GPU_CHANGES",
    "SMOKE_CHANGES",
    "TrainConfig",
    "TrainFields",
    "activation_bytes",
    "add_config_arguments",
    "chosen_profile",
    "config_from_arguments",
    "default_profile",
    "field_help",
    "field_value",
    "inert_settings",
    "lora_parameter_count_of",
    "profile_fits",
    "setting",
    "training_memory_bytes",
    "validate_config",
]
