"""The rollout interface: prompts in, a group of sampled responses per prompt out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from grpo_lab.logprobs import check_temperature


@dataclass(frozen=True)
class SamplingSettings:
    """How responses are sampled. No top-k: samples follow the policy exactly."""

    # Softmax temperature; scoring uses logits / temperature to match.
    temperature: float = 1.0
    # Nucleus mass; 1.0 samples from the full distribution.
    top_p: float = 1.0
    # Longest response, in tokens.
    max_new_tokens: int = 64
    # Generation stops after any of these strings (the string is kept).
    stop_strings: tuple[str, ...] = ()
    # Seed for the sampler; None leaves the global generator alone.
    seed: int | None = None


@dataclass
class Rollouts:
    """B·G responses, prompt-major: responses[i * G + j] answers prompts[i * G + j]."""

    prompts: list[str]
    responses: list[str]
    # Token ids exactly as sampled (the response ids include a sampled EOS), or None
    # when the backend returns text only.
    prompt_token_ids: list[list[int]] | None = None
    response_token_ids: list[list[int]] | None = None
    # The backend's own log-probs of the sampled tokens, when it reports them.
    sampler_log_probs: list[list[float]] | None = None


class RolloutBackend(Protocol):
    """Samples groups of responses; ``sync`` loads the policy's current weights."""

    def generate(
        self, prompts: list[str], group_size: int, sampling: SamplingSettings
    ) -> Rollouts: ...

    def sync(self, policy: torch.nn.Module) -> None: ...


def load_current_weights(backend: RolloutBackend, policy: torch.nn.Module) -> None:
    """Make ``backend`` sample from ``policy``'s weights from now on.

    ``sync`` after an RL step may lag on purpose (the stale simulator refreshes
    only every k-th sync); outside RL steps (the warm-up's evaluations, after
    the warm-up, after a resume) a backend with ``refresh`` loads the weights
    at once, any other is synced.
    """
    getattr(backend, "refresh", backend.sync)(policy)


def check_generate_arguments(
    prompts: Sequence[str], group_size: int, sampling: SamplingSettings
) -> None:
    """ValueError naming the first bad argument of ``generate``."""
    if not prompts:
        raise ValueError("prompts must not be empty, got []")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    check_sampling_settings(
        sampling.temperature,
        sampling.top_p,
        sampling.max_new_tokens,
        prefix="sampling.",
    )


def check_sampling_settings(
    temperature: float, top_p: float, max_new_tokens: int | None, prefix: str = ""
) -> None:
    """The one check of a sampler's temperature (0: greedy), top-p and length.

    ``TrainConfig`` and every backend's ``generate`` call it; ``prefix`` names
    where the values came from in the message (``"sampling."``).
    """
    check_temperature(temperature, name=f"{prefix}temperature", allow_greedy=True)
    if not (
        isinstance(top_p, (int, float))
        and not isinstance(top_p, bool)
        and 0 < top_p <= 1
    ):
        raise ValueError(f"{prefix}top_p must be in (0, 1], got {top_p!r}")
    if max_new_tokens is not None and not (
        isinstance(max_new_tokens, int)
        and not isinstance(max_new_tokens, bool)
        and max_new_tokens >= 1
    ):
        raise ValueError(
            f"{prefix}max_new_tokens must be a positive int, got {max_new_tokens!r}"
        )
