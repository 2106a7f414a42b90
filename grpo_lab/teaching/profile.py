"""Which size of every notebook to run: one choice, made in one place.

``cpu`` is a laptop or CI run, ``gpu`` a full run on a CUDA device, and
``smoke`` the smallest sizes that still execute every cell (used when student
copies are executed in tests). ``GRPO_LAB_PROFILE`` overrides the choice.
"""

from __future__ import annotations

import os
from typing import Any

import torch

PROFILES = ("cpu", "gpu", "smoke")
PROFILE_VARIABLE = "GRPO_LAB_PROFILE"


def notebook_profile() -> str:
    """``$GRPO_LAB_PROFILE`` if set, else ``gpu`` with CUDA and ``cpu`` without."""
    chosen = os.environ.get(PROFILE_VARIABLE)
    if chosen is None:
        return "gpu" if torch.cuda.is_available() else "cpu"
    if chosen not in PROFILES:
        raise ValueError(
            f"{PROFILE_VARIABLE} must be one of {PROFILES}, got {chosen!r}"
        )
    return chosen


def sizes_for_profile(
    cpu: dict[str, Any],
    gpu: dict[str, Any] | None = None,
    smoke: dict[str, Any] | None = None,
    profile: str | None = None,
) -> dict[str, Any]:
    """The sizes of the chosen profile; ``gpu`` and ``smoke`` override ``cpu``."""
    profile = notebook_profile() if profile is None else profile
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    overrides = {"cpu": {}, "gpu": gpu or {}, "smoke": smoke or {}}[profile]
    unknown = set(overrides) - set(cpu)
    if unknown:
        raise ValueError(
            f"{profile} sizes may only override cpu sizes, got {sorted(unknown)}"
        )
    return {**cpu, **overrides, "profile": profile}
