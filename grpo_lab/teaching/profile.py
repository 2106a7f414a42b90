"""The sizes of a notebook's worked examples, for the profile the run uses.

The profile itself (cpu, gpu or smoke) is chosen in one place,
:func:`grpo_lab.training.config.chosen_profile` (``$GRPO_LAB_PROFILE``, else the
machine), and a notebook's training runs take ``TrainConfig.for_profile`` of
it. What is left here is each notebook's own demo sizes (a vocabulary for a
memory plot, a batch of worked examples), given as cpu sizes plus what the gpu
and smoke profiles change.
"""

from __future__ import annotations

from typing import Any

from grpo_lab.training.config import PROFILES, chosen_profile


def sizes_for_profile(
    cpu: dict[str, Any],
    gpu: dict[str, Any] | None = None,
    smoke: dict[str, Any] | None = None,
    profile: str | None = None,
) -> dict[str, Any]:
    """The sizes of the chosen profile; ``gpu`` and ``smoke`` override ``cpu``.

    The result's ``"profile"`` is the profile name, for ``TrainConfig.for_profile``.
    """
    profile = chosen_profile() if profile is None else profile
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    overrides = {"cpu": {}, "gpu": gpu or {}, "smoke": smoke or {}}[profile]
    unknown = set(overrides) - set(cpu)
    if unknown:
        raise ValueError(
            f"{profile} sizes may only override cpu sizes, got {sorted(unknown)}"
        )
    return {**cpu, **overrides, "profile": profile}
