"""Checks for ``notebooks/07_training_step.ipynb``.

Exercise 1: the losses gradient accumulation backpropagates: the batch split
into microbatches, each reduced (sequence, token or constant normalization) and
scaled so that their gradients add up to the whole batch's, as
:func:`grpo_lab.train_step.policy_gradient_update` does it (compared value and
gradient, microbatch by microbatch).

Exercise 2: which responses need a forward and backward pass at all (the ones
whose advantage is not exactly zero).

Exercise 3: the whole microbatch step with gradient accumulation, against
:func:`grpo_lab.train_step.policy_gradient_update` on a copy of a tiny model.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch

from grpo_lab.aggregation import aggregate_loss_across_microbatch, microbatch_loss_scale
from grpo_lab.logprobs import get_response_log_probs
from grpo_lab.losses import compute_policy_gradient_loss
from grpo_lab.masks import tokenize_prompt_and_output
from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    assert_close,
    exercise_check,
)
from grpo_lab.teaching.gradient_recorder import GradientRecorder
from grpo_lab.train_step import policy_gradient_update

MicrobatchLosses = Callable[..., Any]


def reference_microbatch_losses(
    per_token_loss: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    loss_normalization: str,
    normalization_constant: float | None = None,
) -> list[torch.Tensor]:
    """The scaled loss of each microbatch of ceil(B / K) consecutive rows, as
    :func:`grpo_lab.train_step.policy_gradient_update` backpropagates them."""
    batch_rows = per_token_loss.shape[0]
    batch_tokens = int(response_mask.sum())
    size = -(-batch_rows // gradient_accumulation_steps)
    losses = []
    for rows in torch.arange(batch_rows).split(size):
        mask = response_mask[rows]  # (b, T)
        loss = aggregate_loss_across_microbatch(
            per_token_loss[rows], mask, loss_normalization, normalization_constant
        )
        scale = microbatch_loss_scale(
            loss_normalization,
            len(rows),
            batch_rows,
            microbatch_tokens=int(mask.sum()),
            batch_tokens=batch_tokens,
        )
        losses.append(loss * scale)
    return losses


# (per-response lengths over T = 4, K, normalization, constant). B = 5 in K = 2
# gives microbatches of 3 and 2 rows (shares 3/5 and 2/5, not 1/K); K = 3 gives
# 2, 2 and 1 (ceil, not floor); the token cases split the tokens unevenly
# (7 of 10 in the first half), so a share of rows is not a share of tokens.
_LOSS_CASES = (
    ((4, 1, 3, 2, 4), 2, "sequence", None),
    ((2, 3, 1, 4, 1), 3, "sequence", None),
    ((4, 3, 1, 2), 2, "token", None),
    ((1, 4, 2, 4, 3), 2, "token", None),
    ((4, 1, 3, 2, 4), 2, "constant", 8.0),
    ((3, 2, 4), 1, "sequence", None),
)


def _loss_case(lengths: tuple[int, ...], seed: int) -> tuple[torch.Tensor, Any]:
    generator = torch.Generator().manual_seed(seed)
    per_token_loss = torch.randn(len(lengths), 4, generator=generator)  # (B, T)
    mask = (torch.arange(4) < torch.tensor(lengths).unsqueeze(1)).long()  # (B, T)
    return per_token_loss, mask


def _loss_slips(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    steps: int,
    normalization: str,
    constant: float | None,
) -> dict[str, list[float]]:
    """What the classic mistakes return on one case (values only)."""
    size = -(-per_token_loss.shape[0] // steps)
    parts = list(zip(per_token_loss.split(size), mask.split(size), strict=True))
    means = [
        aggregate_loss_across_microbatch(loss, m, normalization, constant).item()
        for loss, m in parts
    ]
    share = [len(m) / len(mask) for _, m in parts]
    scaled = [value * w for value, w in zip(means, share, strict=True)]
    # The most specific first: an even split makes a share of rows equal 1/K.
    by_rows = "scaled by its share of the rows: "
    slips = {}
    if normalization == "token":
        slip = "under the token mean a microbatch counts for its share of the tokens"
        slips[by_rows + slip] = scaled
    if normalization == "constant":
        slip = "under the constant normalization each microbatch divides by it"
        slips[by_rows + slip] = scaled
    slips["no scale: each microbatch's own loss, so the accumulated loss is a sum"] = (
        means
    )
    slips[f"scaled by 1/K = 1/{len(parts)} instead of each microbatch's share"] = [
        value / len(parts) for value in means
    ]
    return slips


def _same_values(received: list[Any], values: list[float]) -> bool:
    return len(received) == len(values) and all(
        abs(a.detach().item() - b) <= 1e-5 + 1e-4 * abs(b)
        for a, b in zip(received, values, strict=True)
    )


def _check_losses_case(
    student_fn: MicrobatchLosses, case: tuple[Any, ...], seed: int
) -> None:
    lengths, steps, normalization, constant = case
    per_token_loss, mask = _loss_case(lengths, seed)
    inputs = (
        f"B={len(lengths)} responses of lengths {list(lengths)}, "
        f"gradient_accumulation_steps={steps}, "
        f"loss_normalization={normalization!r}, normalization_constant={constant}"
    )
    student_loss = per_token_loss.clone().requires_grad_(True)
    received = student_fn(student_loss, mask.clone(), steps, normalization, constant)
    reference_loss = per_token_loss.clone().requires_grad_(True)
    expected = reference_microbatch_losses(
        reference_loss, mask, steps, normalization, constant
    )
    if not isinstance(received, list | tuple) or len(received) != len(expected):
        count = len(received) if isinstance(received, list | tuple) else "no list"
        raise ExerciseFailed(
            f"expected {len(expected)} losses, one per microbatch of "
            f"ceil(B / K) = {-(-len(lengths) // steps)} rows, got {count}. "
            f"For {inputs}"
        )
    scalars = all(isinstance(x, torch.Tensor) and x.numel() == 1 for x in received)
    if scalars and not _same_values(received, [x.item() for x in expected]):
        slips = _loss_slips(per_token_loss, mask, steps, normalization, constant)
        for slip, wrong in slips.items():
            if _same_values(received, wrong):
                raise ExerciseFailed(f"{slip}. For {inputs}")
    for index, (loss, wanted) in enumerate(zip(received, expected, strict=True)):
        where = f"{inputs}, microbatch {index}"
        _check_one_microbatch_loss(loss, wanted, student_loss, reference_loss, where)


def _check_one_microbatch_loss(
    loss: Any,
    wanted: torch.Tensor,
    student_loss: torch.Tensor,
    reference_loss: torch.Tensor,
    where: str,
) -> None:
    """One microbatch: its value, and its gradient w.r.t. the per-token loss
    (zero outside its own rows)."""
    assert_close(loss, wanted.detach(), where)
    if not loss.requires_grad:
        raise ExerciseFailed(
            f"For {where}: the loss carries no gradient to per_token_loss (was "
            "something detached, or computed under torch.no_grad()?)"
        )
    (expected,) = torch.autograd.grad(wanted, reference_loss, retain_graph=True)
    (received,) = torch.autograd.grad(
        loss, student_loss, retain_graph=True, allow_unused=True
    )
    if received is None:
        received = torch.zeros_like(expected)
    assert_close(received, expected, f"{where} (gradient w.r.t. per_token_loss)")


@exercise_check("Exercise 07a (the losses of gradient accumulation)")
def check_microbatch_losses(student_fn: MicrobatchLosses, cases: CaseCount) -> None:
    """``student_fn(per_token_loss (B, T), response_mask (B, T),
    gradient_accumulation_steps, loss_normalization, normalization_constant)``
    -> the list of scaled microbatch losses whose backward passes add up to
    the full batch's gradient. Values and gradients are compared microbatch by
    microbatch, under the sequence, token and constant normalizations."""
    for seed, case in enumerate(_LOSS_CASES):
        with cases.case():
            _check_losses_case(student_fn, case, seed)


@exercise_check("Exercise 07b (responses that need a backward pass)")
def check_active_rows(
    student_fn: Callable[[torch.Tensor], torch.Tensor], cases: CaseCount
) -> None:
    """``student_fn(advantages) -> indices`` (1-D long tensor, ascending)."""
    for advantages in (
        torch.tensor([0.0, 1.2, 0.0, -0.7]),  # negative advantages count too
        torch.tensor([0.0, 0.0, 0.0]),  # a group where every reward is equal
        torch.tensor([0.5, -0.5, 1e-7, 2.0]),  # tiny but nonzero is still active
    ):
        with cases.case():
            _check_active_rows_case(student_fn, advantages)


def _check_active_rows_case(
    student_fn: Callable[[torch.Tensor], torch.Tensor], advantages: torch.Tensor
) -> None:
    expected = torch.nonzero(advantages != 0, as_tuple=False).flatten()
    received = student_fn(advantages.clone())
    if not isinstance(received, torch.Tensor):
        raise ExerciseFailed(
            f"For advantages={advantages.tolist()}: expected a tensor of indices, "
            f"got {type(received).__name__}"
        )
    if received.dtype.is_floating_point or received.dtype == torch.bool:
        raise ExerciseFailed(
            f"For advantages={advantages.tolist()}: expected integer indices "
            f"{expected.tolist()}, got a {received.dtype} tensor "
            f"{received.tolist()}"
        )
    assert_close(
        received.flatten(), expected, f"advantages={advantages.tolist()}", atol=0
    )


TrainStep = Callable[..., Any]

# (rows of the problem used, gradient_accumulation_steps, clip the gradient?).
# Rows 1, 2, 3 in 2 microbatches of ceil(3 / 2) = 2 rows put the advantage 1.5
# alone in the short one, whose share is 1/3, not the configured 2/3.
_STEP_CASES = (
    ((0, 1, 2, 3), 2, False),
    ((0, 1, 2), 2, False),
    ((1, 2, 3), 2, False),
    ((0, 1, 2, 3), 1, False),
    ((0, 1, 2, 3), 2, True),
    ((3, 0, 1), 2, True),
)


@exercise_check("Exercise 07c (a microbatch train step)")
def check_microbatch_train_step(student_fn: TrainStep, cases: CaseCount) -> None:
    """``student_fn(model, optimizer, batch, advantages,
    gradient_accumulation_steps, max_grad_norm)``: one on-policy step
    (per-token loss -A_i log pi, per-response mean) accumulated over
    microbatches of ceil(B / steps) rows, then one ``optimizer.step()``.

    The check hands it a tiny model and plain SGD (lr 1), and compares the
    gradient after the last backward (before any clip) and the parameters after
    the step with :func:`grpo_lab.train_step.policy_gradient_update` on a copy.
    """
    model, full_batch, full_advantages = _tiny_step_problem()
    for rows, steps, clips in _STEP_CASES:
        picked = torch.tensor(rows)
        batch = {key: value[picked] for key, value in full_batch.items()}
        with cases.case():
            _check_step_case(
                student_fn, model, batch, full_advantages[picked], steps, clips
            )


def _check_step_case(
    student_fn: TrainStep,
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    advantages: torch.Tensor,
    steps: int,
    clips: bool,
) -> None:
    unclipped = _reference_step(model, batch, advantages, steps, None)[0]
    max_grad_norm = float(unclipped.norm()) / 4 if clips else None
    inputs = (
        f"a tiny model, B={advantages.shape[0]} responses of lengths "
        f"{batch['response_mask'].sum(dim=1).tolist()}, advantages="
        f"{advantages.tolist()}, gradient_accumulation_steps={steps}, "
        f"max_grad_norm={max_grad_norm}"
    )
    _, expected_parameters = _reference_step(
        model, batch, advantages, steps, max_grad_norm
    )
    student_model = copy.deepcopy(model)
    optimizer = GradientRecorder(student_model.parameters(), lr=1.0)
    with _LastGradient(student_model) as last:
        _run_step(
            student_fn,
            (student_model, optimizer, batch, advantages, steps, max_grad_norm),
        )
    _check_step_count(optimizer.steps, inputs)
    _check_accumulated_gradient(
        last.gradient(), model, batch, advantages, steps, clips, inputs
    )
    received = torch.cat([p.detach().flatten() for p in student_model.parameters()])
    if not torch.allclose(received, expected_parameters, atol=1e-6, rtol=1e-4):
        hint = (
            "clip the accumulated gradient once, after the last backward and "
            "before optimizer.step(): torch.nn.utils.clip_grad_norm_("
            "model.parameters(), max_grad_norm)"
            if clips
            else "the optimizer must step on the accumulated gradient as it is"
        )
        raise ExerciseFailed(
            f"For {inputs}: the gradient before clipping is right, but the "
            f"parameters after the step are not (largest difference "
            f"{(received - expected_parameters).abs().max():.2e}); {hint}"
        )


def _run_step(student_fn: TrainStep, arguments: tuple[Any, ...]) -> None:
    """Run the student's step; a loss without a gradient gets its own message."""
    try:
        student_fn(*arguments)
    except RuntimeError as error:
        if "does not require grad" not in str(error):
            raise
        raise ExerciseFailed(
            "backward() found a loss that carries no gradient to the model (were "
            "the log-probs computed under torch.no_grad(), or detached?)"
        ) from error


def _tiny_step_problem() -> tuple[torch.nn.Module, dict[str, torch.Tensor], Any]:
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(
        tokenizer, hidden_size=16, num_layers=1, intermediate_size=32, seed=0
    )
    prompts = ["12>", "345>", "67>", "8>"]
    responses = ["21", "5431", "7", "888"]
    batch = tokenize_prompt_and_output(prompts, responses, tokenizer)
    advantages = torch.tensor([1.0, -0.5, 0.0, 1.5])  # (B,): one zero advantage
    return model, batch, advantages


def _reference_step(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    advantages: torch.Tensor,
    steps: int,
    max_grad_norm: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The package's step on a copy: (gradient it steps on, parameters after)."""
    reference = copy.deepcopy(model)
    recorder = GradientRecorder(reference.parameters(), lr=1.0)
    policy_gradient_update(reference, recorder, steps, max_grad_norm, batch, advantages)
    parameters = torch.cat([p.detach().flatten() for p in reference.parameters()])
    return recorder.gradient, parameters


class _LastGradient:
    """Keeps each parameter's .grad as it stands after every backward, before
    anything (a clip, a step) changes it in place."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.parameters = list(model.parameters())
        self.latest: dict[int, torch.Tensor] = {}
        self.handles: list[Any] = []

    def __enter__(self) -> _LastGradient:
        for index, parameter in enumerate(self.parameters):
            self.handles.append(
                parameter.register_post_accumulate_grad_hook(
                    functools.partial(self._keep, index)
                )
            )
        return self

    def _keep(self, index: int, parameter: torch.Tensor) -> None:
        self.latest[index] = parameter.grad.detach().clone()

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def gradient(self) -> torch.Tensor:
        return torch.cat(
            [
                self.latest.get(index, torch.zeros_like(p)).flatten()
                for index, p in enumerate(self.parameters)
            ]
        )


def _check_step_count(steps_taken: int, inputs: str) -> None:
    if steps_taken == 1:
        return
    if steps_taken == 0:
        raise ExerciseFailed(f"For {inputs}: optimizer.step() was never called")
    raise ExerciseFailed(
        f"For {inputs}: optimizer.step() was called {steps_taken} times; step once, "
        "after every microbatch's backward has added its gradient (stepping per "
        "microbatch is K small updates, not one batch update)"
    )


def _check_accumulated_gradient(
    received: torch.Tensor,
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    advantages: torch.Tensor,
    steps: int,
    clips: bool,
    inputs: str,
) -> None:
    """The gradient after the last backward against the full batch's, naming
    the classic accumulation mistakes."""
    pieces = _microbatch_gradients(model, batch, advantages, steps)
    batch_size = advantages.shape[0]
    shares = [rows / batch_size for rows, _ in pieces]
    expected = sum(share * gradient for share, (_, gradient) in zip(shares, pieces))
    if torch.allclose(received, expected, atol=1e-6, rtol=1e-4):
        return
    count = len(pieces)
    mistakes = {
        "no scale: each microbatch's mean loss is backpropagated as it is, so the "
        f"gradient is the sum of {count} microbatch means (scale each by "
        "microbatch rows / B)": sum(gradient for _, gradient in pieces),
        f"each microbatch is scaled by 1/K = 1/{count} instead of its share of the "
        "batch, rows / B (they differ when microbatches are unequal)": sum(
            gradient / count for _, gradient in pieces
        ),
        "only the last microbatch's gradient is left: zero the gradients once, "
        "before the loop, not inside it": shares[-1] * pieces[-1][1],
        "each microbatch is scaled by the configured size ceil(B / K) / B, but "
        "the last one is shorter: scale each by its own rows / B": sum(
            pieces[0][0] / batch_size * gradient for _, gradient in pieces
        ),
    }
    for mistake, wrong in mistakes.items():
        if torch.allclose(received, wrong, atol=1e-6, rtol=1e-4):
            raise ExerciseFailed(f"For {inputs}: {mistake}")
    if clips:
        raise ExerciseFailed(
            f"For {inputs}: the gradient after the last backward is not the "
            "accumulated one (it is right without clipping): was it clipped "
            "before every microbatch had added its share? Clip once, after the loop"
        )
    raise ExerciseFailed(
        f"For {inputs}: the gradient after the last backward differs from the "
        f"full batch's (norm expected {expected.norm():.6f}, got "
        f"{received.norm():.6f}, largest difference "
        f"{(received - expected).abs().max():.2e})"
    )


def _microbatch_gradients(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    advantages: torch.Tensor,
    steps: int,
) -> list[tuple[int, torch.Tensor]]:
    """(rows, gradient of that microbatch's own mean loss) per microbatch."""
    reference = copy.deepcopy(model)
    size = -(-advantages.shape[0] // steps)
    pieces = []
    for rows in torch.arange(advantages.shape[0]).split(size):
        reference.zero_grad(set_to_none=True)
        log_probs = get_response_log_probs(
            reference, batch["input_ids"][rows], batch["labels"][rows]
        )["log_probs"]  # (b, T)
        per_token_loss, _ = compute_policy_gradient_loss(advantages[rows], log_probs)
        aggregate_loss_across_microbatch(
            per_token_loss, batch["response_mask"][rows]
        ).backward()
        gradient = torch.cat(
            [
                torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten()
                for p in reference.parameters()
            ]
        )
        pieces.append((len(rows), gradient))
    return pieces
