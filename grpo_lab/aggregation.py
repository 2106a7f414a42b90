"""Loss aggregation: a (B, T) per-token loss reduced to one number, and how
microbatches add up to the batch's.

Three normalizations (``LOSS_NORMALIZATIONS``): per-sequence mean (GRPO),
a constant (Dr. GRPO) and the token mean (DAPO); the scale of one microbatch's
loss so that accumulated gradients equal the full batch's
(:func:`microbatch_loss_scale`); and :class:`DiagnosticAccumulator`, which
weights each microbatch's diagnostics by its tokens. Taught in
``notebooks/06_loss_aggregation.ipynb`` (the scale and the accumulator in
``notebooks/07_training_step.ipynb``).
"""

from __future__ import annotations

from typing import Literal

import torch

from grpo_lab.losses import CLIP_SIDE_KEYS, OBJECTIVE_RECORDS, is_positive_number

LOSS_NORMALIZATIONS = ("sequence", "constant", "token")


def check_loss_normalization(
    loss_normalization: str, normalization_constant: float | None
) -> None:
    """The one check of a loss normalization and its constant."""
    if loss_normalization not in LOSS_NORMALIZATIONS:
        raise ValueError(
            f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, "
            f"got {loss_normalization!r}"
        )
    if loss_normalization == "constant" and not is_positive_number(
        normalization_constant
    ):
        raise ValueError(
            "normalization_constant must be positive for constant normalization, "
            f"got {normalization_constant!r}"
        )


def microbatch_loss_scale(
    loss_normalization: str,
    microbatch_rows: int,
    batch_rows: int,
    *,
    microbatch_tokens: int | None = None,
    batch_tokens: int | None = None,
) -> float:
    """What one microbatch's aggregated loss is multiplied by before backward.

    sequence: a mean over b rows, weighted b / B, sums over microbatches to the
              mean over all B rows;
    constant: each microbatch already divides by the same constant: weight 1;
    token:    a mean over the microbatch's n response tokens, weighted n / N with
              N the response tokens of the whole batch, sums to the batch's
              token mean (DAPO), however unevenly the tokens split.
    Either way the accumulated gradient equals the full batch's. Rows skipped
    by the caller still count in B and N. A batch with no response token
    (N = 0) scales by 0: there is no token to average. Taught in
    ``notebooks/07_training_step.ipynb``.
    """
    if loss_normalization == "sequence":
        if not _is_count(batch_rows) or batch_rows < 1:
            raise ValueError(
                f"batch_rows must be a positive int (rows per batch), got "
                f"{batch_rows!r}"
            )
        if not _is_count(microbatch_rows) or not 0 <= microbatch_rows <= batch_rows:
            raise ValueError(
                f"microbatch_rows must be an int in [0, batch_rows ({batch_rows})]: "
                f"a microbatch is part of its batch, got {microbatch_rows!r}"
            )
        return microbatch_rows / batch_rows
    if loss_normalization == "token":
        if not (_is_count(microbatch_tokens) and _is_count(batch_tokens)):
            raise ValueError(
                "microbatch_tokens and batch_tokens must be token counts for token "
                f"normalization, got {microbatch_tokens!r} and {batch_tokens!r}"
            )
        if batch_tokens < 0 or not 0 <= microbatch_tokens <= batch_tokens:
            raise ValueError(
                f"batch_tokens must be >= microbatch_tokens ({microbatch_tokens}) "
                f"and >= 0, got {batch_tokens!r}"
            )
        return microbatch_tokens / max(batch_tokens, 1)
    if loss_normalization != "constant":
        raise ValueError(
            f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, "
            f"got {loss_normalization!r}"
        )
    return 1.0


def _is_count(value: object) -> bool:
    """A plain int (or an int-like 0-dim integer tensor is not accepted)."""
    return isinstance(value, int) and not isinstance(value, bool)


def aggregate_loss_across_microbatch(
    per_token_policy_gradient_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_normalization: Literal["sequence", "constant", "token"] = "sequence",
    normalization_constant: int | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar: its inputs checked, then
    :func:`reduce_masked_loss` (the formulas)."""
    check_aggregation_inputs(
        per_token_policy_gradient_loss, mask, loss_normalization, normalization_constant
    )
    return reduce_masked_loss(
        per_token_policy_gradient_loss, mask, loss_normalization, normalization_constant
    )


def reduce_masked_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_normalization: str,
    normalization_constant: float | None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar (inputs already checked).

    sequence: mean over responses of (sum_t loss * mask / max(|o_i|, 1))   (GRPO)
    constant: sum over all tokens of loss * mask / normalization_constant
              (Dr. GRPO: no per-response length divisor, hence no length bias)
    token:    sum over all tokens of loss * mask / max(sum of mask, 1)
              (DAPO's token mean: every token weighs the same, whatever its
              response's length; TRL's bnpo on one batch). Across microbatches
              the train step rescales by the batch's token count
              (:func:`microbatch_loss_scale`), so the result stays the full
              batch's token mean.
    ``normalization_constant`` is read by constant only.
    """
    # A masked-out position adds 0 whatever it holds (even inf or NaN).
    masked_loss = torch.where(mask != 0, per_token_loss * mask, 0.0)  # (B, T)
    if loss_normalization == "sequence":
        response_lengths = mask.sum(dim=1).clamp_min(1)  # (B,)
        return (masked_loss.sum(dim=1) / response_lengths).mean()
    if loss_normalization == "token":
        return masked_loss.sum() / mask.sum().clamp_min(1)
    return masked_loss.sum() / normalization_constant


def check_aggregation_inputs(
    per_token_policy_gradient_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_normalization: str,
    normalization_constant: float | None,
) -> None:
    """A (B, T) loss with B >= 1, a mask of its shape, a known normalization."""
    for name, value in (
        ("per_token_policy_gradient_loss", per_token_policy_gradient_loss),
        ("mask", mask),
    ):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(value).__name__}")
    if per_token_policy_gradient_loss.ndim != 2:
        raise ValueError(
            "per_token_policy_gradient_loss must have shape (batch_size, "
            f"sequence_length), got {tuple(per_token_policy_gradient_loss.shape)}"
        )
    if mask.shape != per_token_policy_gradient_loss.shape:
        raise ValueError(
            f"mask must have shape {tuple(per_token_policy_gradient_loss.shape)}, "
            f"got {tuple(mask.shape)}"
        )
    if per_token_policy_gradient_loss.shape[0] == 0:
        raise ValueError(
            "per_token_policy_gradient_loss must hold at least one response, got 0 rows"
        )
    check_loss_normalization(loss_normalization, normalization_constant)


# The objectives' diagnostics that are counts: summed across microbatches.
COUNT_KEYS = frozenset(
    key
    for key in frozenset(CLIP_SIDE_KEYS).union(
        *(record.keys for record in OBJECTIVE_RECORDS.values())
    )
    if key.endswith("_count") or key == "clip_total"
)


class DiagnosticAccumulator:
    """Adds up an update's microbatch diagnostics (the train step's).

    Each microbatch's means are weighted by its token count (ratio means by
    ``importance_ratio_count``), so the result is the mean over every scored
    token of the batch, whatever the split into microbatches; counts
    (``COUNT_KEYS``) are summed and the clip fractions recomputed from them.
    """

    def __init__(self, device: torch.device):
        zero = torch.zeros((), dtype=torch.float32, device=device)
        self.loss, self.entropy_sum = zero, zero.clone()
        self.token_count = torch.zeros((), dtype=torch.long, device=device)
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}
        # pi_old of the scored rows, in order, when sampler log-probs are given.
        self.trainer_log_probs: list[torch.Tensor] = []

    def add(
        self,
        loss: torch.Tensor,
        entropy_sum: torch.Tensor,
        token_count: torch.Tensor,
        loss_metadata: dict[str, torch.Tensor],
    ) -> None:
        self.loss = self.loss + loss
        self.entropy_sum = self.entropy_sum + entropy_sum
        self.token_count = self.token_count + token_count
        for key, value in loss_metadata.items():
            if key in COUNT_KEYS:
                self.counts[key] = self.counts.get(key, torch.zeros_like(value)) + value
            elif key.endswith("_mean"):
                weight = (
                    loss_metadata["importance_ratio_count"]
                    if "importance_ratio" in key
                    else token_count
                )
                self._add_weighted(key, value, weight)

    def _add_weighted(
        self, key: str, value: torch.Tensor, weight: torch.Tensor
    ) -> None:
        self.sums[key] = self.sums.get(key, torch.zeros_like(value)) + value * weight
        self.weights[key] = self.weights.get(key, torch.zeros_like(weight)) + weight

    def summary(self) -> dict[str, torch.Tensor | float]:
        metadata: dict[str, torch.Tensor | float] = {
            key: value / self.weights[key].clamp_min(1)
            for key, value in self.sums.items()
        }
        metadata.update(self.counts)
        if "clip_total" in self.counts:
            total = self.counts["clip_total"].clamp_min(1)
            for side in ("", "_low", "_high"):
                if f"clip{side}_count" in self.counts:
                    metadata[f"clip{side}_fraction"] = (
                        self.counts[f"clip{side}_count"] / total
                    )
        metadata.update(
            loss=self.loss.detach(),
            token_entropy=(self.entropy_sum / self.token_count.clamp_min(1)).detach(),
            response_token_count=self.token_count.detach(),
            entropy_count=self.token_count.detach(),
        )
        return metadata
