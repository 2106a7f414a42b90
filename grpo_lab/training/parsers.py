"""One parser for each setting that more than one door reads.

``report_to`` and ``device`` are read by the config (when it is built), the
command line, the training loop and both integrations (TRL, verl). Each is
parsed here, once, so that every door accepts and refuses the same values with
the same message: ``report_to="TensorBoard"`` is ``("tensorboard",)``
everywhere, and ``device="gpu"`` is refused everywhere with the same words.

Torch is imported inside the device functions, so that reading ``report_to``
(the trackers, ``grpo-lab --help``) does not load it.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Tracker name -> the module it imports; its extra has the same name.
TRACKER_MODULES = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "trackio": "trackio",
    "mlflow": "mlflow",
}
REPORT_TO_CHOICES = ("none", *TRACKER_MODULES)
DEVICE_HINT = "use --device cpu (or the cpu profile), or a visible cuda:N"


# --- report_to ------------------------------------------------------------------------


def parse_report_to(value: Any) -> tuple[str, ...]:
    """The tracker names in ``value``, in order, without repeats (() for none).

    ``value`` is None, a string of comma-separated names or a list of names, in
    any case ("TensorBoard" is "tensorboard"); "none" stands alone. Raises
    ``ValueError`` naming ``report_to`` otherwise.
    """
    if value is None:
        return ()
    if isinstance(value, str):
        names = [name.strip().lower() for name in value.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        names = [name.strip().lower() for name in value]
    else:
        raise ValueError(
            "report_to must be a comma-separated string or a list of names from "
            f"{REPORT_TO_CHOICES}, got {value!r}"
        )
    unknown = [name for name in names if name not in REPORT_TO_CHOICES]
    if unknown or not names:
        raise ValueError(
            f"report_to must name trackers from {REPORT_TO_CHOICES}, got {value!r}"
        )
    if "none" in names and len(set(names)) > 1:
        raise ValueError(
            f"report_to 'none' cannot be combined with trackers, got {value!r}"
        )
    return tuple(dict.fromkeys(name for name in names if name != "none"))


def check_report_to(value: Any) -> tuple[str, ...]:
    """:func:`parse_report_to`, and each tracker's package must be installed.

    Installed means importable: ``importlib.util.find_spec`` finds it (it is
    not imported here). The message names the extra that installs it.
    """
    names = parse_report_to(value)
    for name in names:
        if not is_installed(TRACKER_MODULES[name]):
            raise ValueError(
                f"report_to {name!r} needs the {TRACKER_MODULES[name]} package, "
                f"which is not installed: pip install 'grpo-lab[{name}]', or leave "
                f"{name} out of report_to"
            )
    return names


def is_installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    if module in sys.modules:
        return True
    return importlib.util.find_spec(module) is not None


# --- device ---------------------------------------------------------------------------


def parse_device(value: Any) -> torch.device:
    """``value`` as a ``torch.device``, or ``ValueError`` naming ``device``.

    Only the spelling is checked ("cuda:0" parses on a machine without a GPU);
    :func:`check_device_available` checks the machine.
    """
    import torch

    try:
        return torch.device(value)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ValueError(
            f"device must be a torch device such as 'cpu' or 'cuda:0', got {value!r}"
        ) from error


def check_device_available(value: Any) -> torch.device:
    """:func:`parse_device`, and the device exists on this machine.

    A CUDA device needs a visible GPU of its index; "mps" needs Apple's backend.
    Raises ``ValueError`` saying what is missing (before any model loads).
    """
    import torch

    device = parse_device(value)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            raise ValueError(
                f"device {value!r} is not available: {count} CUDA devices are visible"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {value!r} is not available")
    return device
