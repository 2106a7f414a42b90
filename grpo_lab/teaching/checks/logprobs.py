"""Checks for ``notebooks/02_logprobs_and_entropy.ipynb``.

Exercises: the log-probability of each whole response from logits, labels and
the response mask (02a), and the mean entropy of the response tokens (02b, what
a run logs as ``loss/token_entropy``, with its gradient). The references are the
package functions :func:`grpo_lab.logprobs.get_response_log_probs` (run on
fixed logits, its token log-probs summed over the response) and
:func:`grpo_lab.logprobs.compute_entropy` (in float32, averaged over the
response tokens); values and gradients with respect to the logits are compared
(both quantities are trained through). Both take bfloat16 logits too (the
answer must be float32 and as exact as float32 arithmetic), and 02a measures
what the answer keeps for backward: nothing the size of the logits.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from grpo_lab.logprobs import compute_entropy, get_response_log_probs
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    assert_close,
    assert_value_and_gradient,
    exercise_check,
)
from grpo_lab.teaching.memory import saved_for_backward_bytes


class _FixedLogits(torch.nn.Module):
    """A stand-in model whose forward returns given logits, whatever the input."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.logits)


def reference_token_log_probs(
    logits: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """The package's log p(label) for given logits (B, T, V) and labels (B, T)."""
    model = _FixedLogits(logits)
    return get_response_log_probs(model, labels, labels, logits_chunk_size=0)[
        "log_probs"
    ]


def reference_response_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """log p(response) per row (B,): the package's float32 token log-probs of
    the labels, summed over the response positions."""
    token_log_probs = reference_token_log_probs(logits, labels)  # (B, T), float32
    return torch.where(response_mask.bool(), token_log_probs, 0.0).sum(dim=-1)


# Saved-for-backward bytes beyond the logits above which an answer is taken to
# keep a (B, T, V)-sized tensor: the memory case's logits are 2 x 8 x 512
# float32 (32 KiB), while gather - logsumexp keeps only (B, T)-sized tensors.
_SAVED_BYTES_LIMIT = 4096


def _response_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    random_logits = torch.randn(2, 4, 6, generator=generator)  # (B, T, V)
    random_labels = torch.randint(0, 6, (2, 4), generator=generator)  # (B, T)
    # Row 0: one prompt label, a 3-token response; row 1: a 2-token response, padded.
    random_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])
    # Logits in the thousands: exp() overflows, a stable logsumexp does not.
    large_logits = torch.tensor([[[1000.0, 999.0, 990.0], [-5.0, 0.0, 2000.0]]])
    large_labels, large_mask = torch.tensor([[1, 0]]), torch.tensor([[1, 1]])
    # bfloat16 logits near 12: their logsumexp is 18 to 21, where bfloat16's
    # spacing is 2**-3, so one taken in bfloat16 is off by up to 0.05 a token.
    half_logits = (12 + 3 * torch.randn(2, 3, 40, generator=generator)).bfloat16()
    half_labels = torch.randint(0, 40, (2, 3), generator=generator)
    half_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    return [
        ("random logits (2, 4, 6)", random_logits, random_labels, random_mask),
        ("logits around 1000 (overflow test)", large_logits, large_labels, large_mask),
        ("bfloat16 logits (2, 3, 40) near 12", half_logits, half_labels, half_mask),
    ]


def _named_slip(
    received: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
) -> str:
    """The classic mistake a wrong ``received`` matches, or "" when none does."""
    if not isinstance(received, torch.Tensor) or received.shape != mask.shape[:1]:
        return ""
    token = reference_token_log_probs(logits.detach(), labels)  # (B, T)
    response = torch.where(mask.bool(), token, 0.0)  # (B, T)
    if _close(received, response.sum(-1)):
        return ""
    slips = {
        "the mean over the response's tokens is taken: a response's probability "
        "is the product of its tokens' probabilities": response.sum(-1) / mask.sum(-1),
        "response_mask is not applied: prompt and padding labels are summed "
        "too": token.sum(-1),
    }
    found = next((slip for slip, value in slips.items() if _close(received, value)), "")
    if logits.dtype == torch.bfloat16 and not found:
        labelled = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)
        in_half = labelled - torch.logsumexp(logits, dim=-1)  # (B, T), bfloat16
        summed = [(in_half * mask).sum(-1).float(), (in_half.float() * mask).sum(-1)]
        if any(_close(received, value) for value in summed):  # (B,) each
            found = "logsumexp is taken in bfloat16: upcast the logits to float32 first"
    return found


def _close(received: torch.Tensor, value: torch.Tensor) -> bool:
    return torch.allclose(received.detach().double(), value.double(), atol=1e-3)


def _one_response_case(
    student_fn: Callable[..., torch.Tensor],
    name: str,
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    inputs = f"{name}, labels={labels.tolist()}, response_mask={mask.tolist()}"
    received = student_fn(logits.clone(), labels.clone(), mask.clone())
    if isinstance(received, torch.Tensor) and received.dtype != torch.float32:
        raise ExerciseFailed(
            f"For {inputs}: the log-probs must be float32, got {received.dtype} "
            "(upcast the logits before the logsumexp)"
        )
    slip = _named_slip(received, logits, labels, mask)
    if slip:
        raise ExerciseFailed(f"{slip}. For {inputs}")
    if logits.dtype == torch.bfloat16:  # the value only: bfloat16 has no useful grad
        expected = reference_response_log_probs(logits, labels, mask)
        assert_close(received, expected, inputs, atol=1e-4)
        return
    reference_logits = logits.clone().requires_grad_(True)
    expected = reference_response_log_probs(reference_logits, labels, mask)
    student_logits = logits.clone().requires_grad_(True)
    received = student_fn(student_logits, labels.clone(), mask.clone())
    assert_value_and_gradient(
        received, expected, student_logits, reference_logits, inputs, "logits", 1e-4
    )


def _memory_case(student_fn: Callable[..., torch.Tensor]) -> None:
    """The value on larger logits; what the answer keeps for backward is told,
    not graded (the memory section that teaches it is optional)."""
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 8, 512, generator=generator, requires_grad=True)
    labels = torch.randint(0, 512, (2, 8), generator=generator)  # (B, T)
    mask = torch.ones(2, 8, dtype=torch.long)  # (B, T)
    saved, received = saved_for_backward_bytes(
        lambda: student_fn(logits, labels, mask), (logits,)
    )
    expected = reference_response_log_probs(logits.detach(), labels, mask)
    assert_close(received, expected, "logits (2, 8, 512), every label a response")
    if saved > _SAVED_BYTES_LIMIT:
        print(
            f"note (the optional memory section): the answer keeps {saved:,} bytes "
            f"for backward beyond the logits' {logits.numel() * 4:,}, a (B, T, V) "
            "tensor such as log_softmax's output; gather the label's logit and "
            "subtract a logsumexp to keep only (B, T)"
        )


@exercise_check("Exercise 02-response_log_probs (the log-probability of a response)")
def check_response_log_probs(
    student_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    cases: CaseCount,
) -> None:
    """``student_fn(logits (B, T, V), labels (B, T), response_mask (B, T))`` ->
    log p(response) (B,) in float32, trained through (value and gradient). What
    it keeps for backward is reported, not graded: the section on that memory
    is optional."""
    for name, logits, labels, mask in _response_cases():
        with cases.case():
            _one_response_case(student_fn, name, logits, labels, mask)
    with cases.case():
        _memory_case(student_fn)


# --- 02-token_entropy: the mean entropy of the response tokens -------------------


def reference_mean_token_entropy(
    logits: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """The entropy of each position's next-token distribution (float32, from
    the package's :func:`compute_entropy`), averaged over the response tokens
    of the whole batch: every response token weighs the same. A scalar."""
    entropy = compute_entropy(logits.float())  # (B, T)
    response = response_mask.bool()  # (B, T)
    return torch.where(response, entropy, 0.0).sum() / response.sum()


def _entropy_cases() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    # Row 0: one prompt label, then 3 response tokens; row 1: a 1-token response,
    # then padding. The per-response mean weighs row 1's token 3 times as much.
    random_logits = 2 * torch.randn(2, 4, 6, generator=generator)  # (B, T, V)
    random_mask = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0]])
    # A certain token (probabilities e^-200 underflow to 0: log(0) * 0 = nan) and
    # logits around 100 (exp() overflows float32 past 88).
    large_logits = torch.tensor(
        [[[200.0, 0.0, 0.0], [100.0, 99.0, 90.0], [0.0, 0.5, 1.0]]]
    )
    large_mask = torch.tensor([[1, 1, 0]])
    # bfloat16 logits near 12 with a spread of 3: an entropy taken in bfloat16
    # (its logsumexp near 20, where bfloat16's spacing is 2**-3) is off by ~0.05.
    half_logits = (12 + 3 * torch.randn(2, 3, 40, generator=generator)).bfloat16()
    half_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    return [
        (
            "random logits (2, 4, 6), responses of 3 and 1 tokens",
            random_logits,
            random_mask,
        ),
        ("a certain token and logits around 100", large_logits, large_mask),
        ("bfloat16 logits (2, 3, 40) near 12", half_logits, half_mask),
    ]


def _entropy_slip(
    received: torch.Tensor, logits: torch.Tensor, response_mask: torch.Tensor
) -> str:
    """The classic mistake a wrong ``received`` matches, or "" when none does."""
    if not isinstance(received, torch.Tensor) or received.numel() != 1:
        return ""
    if received.isnan().any():
        return (
            "the result is NaN: a probability that underflows to 0 has log -inf, "
            "and 0 * -inf is NaN; write the entropy without the log of a softmax"
        )
    entropy = compute_entropy(logits.detach().float())  # (B, T)
    response = response_mask.bool()
    token_mean = torch.where(response, entropy, 0.0).sum() / response.sum()
    if _close(received, token_mean):
        return ""
    per_response = torch.where(response, entropy, 0.0).sum(-1) / response.sum(-1)
    slips = {
        "the mean of each response's mean is taken: every response token must "
        "weigh the same, in a short response as in a long one": per_response.mean(),
        "response_mask is not applied: prompt and padding positions are averaged "
        "too": entropy.mean(),
        "the entropy has the wrong sign (H = -sum p log p is never negative)": (
            -token_mean
        ),
        "the entropy is in bits: use the natural log (nats)": token_mean
        / torch.log(torch.tensor(2.0)),
    }
    found = next((slip for slip, value in slips.items() if _close(received, value)), "")
    if logits.dtype == torch.bfloat16 and not found:
        return "the entropy is taken in bfloat16: upcast the logits to float32 first"
    return found


def _one_entropy_case(
    student_fn: Callable[..., torch.Tensor],
    name: str,
    logits: torch.Tensor,
    mask: torch.Tensor,
) -> None:
    inputs = f"{name}, response_mask={mask.tolist()}"
    student_logits = logits.clone().requires_grad_(True)
    received = student_fn(student_logits, mask.clone())
    if isinstance(received, torch.Tensor) and received.dtype != torch.float32:
        raise ExerciseFailed(
            f"For {inputs}: the entropy must be float32, got {received.dtype} "
            "(upcast the logits first)"
        )
    slip = _entropy_slip(received, logits, mask)
    if slip:
        raise ExerciseFailed(f"{slip}. For {inputs}")
    if isinstance(received, torch.Tensor) and received.ndim != 0:
        raise ExerciseFailed(
            f"For {inputs}: expected a scalar (a 0-dimensional tensor), got shape "
            f"{tuple(received.shape)}"
        )
    if logits.dtype == torch.bfloat16:  # the value only: bfloat16 has no useful grad
        expected = reference_mean_token_entropy(logits, mask)
        assert_close(received, expected, inputs, atol=1e-4)
        return
    reference_logits = logits.clone().requires_grad_(True)
    expected = reference_mean_token_entropy(reference_logits, mask)
    try:
        assert_value_and_gradient(
            received, expected, student_logits, reference_logits, inputs, "logits", 1e-4
        )
    except ExerciseFailed:
        gradient = student_logits.grad
        if gradient is not None and gradient.abs().max() < 1e-6:
            raise ExerciseFailed(
                f"For {inputs}: the value is right but its gradient is zero: the "
                "probabilities that weigh the logits were detached, and the "
                "entropy's gradient flows through them too"
            ) from None
        raise


@exercise_check("Exercise 02-token_entropy (the mean entropy of the response tokens)")
def check_token_entropy(
    student_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    cases: CaseCount,
) -> None:
    """``student_fn(logits (B, T, V), response_mask (B, T))`` -> the mean
    entropy of the response tokens, a float32 scalar in nats, with its gradient
    with respect to the logits (an entropy bonus trains through it)."""
    for name, logits, mask in _entropy_cases():
        with cases.case():
            _one_entropy_case(student_fn, name, logits, mask)
