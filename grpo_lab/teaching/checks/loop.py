"""Checks for ``notebooks/08_training_loop.ipynb`` and ``09_hyperparameter_explorer``.

08a: cut a rollout batch into train batches that keep every group whole.
08b: the whole update of one rollout batch (what ``grpo_update`` schedules):
     old log-probs when, and only when, training goes off-policy, then epochs of
     train batches, one clipped, per-response-mean optimizer step each.
09:  a cache key for a run config (:func:`grpo_lab.teaching.explorer.config_cache_key`),
     the same again in a fresh Python process.
"""

from __future__ import annotations

import dataclasses
import os
import string
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch

from grpo_lab.aggregation import aggregate_loss_across_microbatch
from grpo_lab.losses import compute_policy_gradient_loss
from grpo_lab.teaching.checks import framework, reach
from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    assert_close,
    exercise_check,
)


@exercise_check("Exercise 08-update_rollout_batch (the update of one rollout batch)")
def check_rollout_batch_update(
    student_fn: Callable[..., Any], cases: CaseCount
) -> None:
    """``student_fn(score, optimizer_step, advantages, response_mask, group_size,
    train_batch_size, epochs_per_rollout_batch, cliprange)`` -> None.

    ``score(rows)`` gives the current policy's log-probs (b, T) of those rows of
    the rollout batch; ``optimizer_step(loss)`` back-propagates a scalar and
    takes one SGD step. Compared with the reference, step by step: how many
    optimizer steps, each step's gradient by the policy's parameters and the
    parameters after it, and how many rows were scored. A loss's *value* is not
    compared: on-policy, -A log pi and the clipped form with old log-probs
    ``log_probs.detach()`` (as TRL writes it) have the same gradient. The policy
    is linear in parameters every row shares, so each step moves them all. An
    answer that follows one of the usual wrong schedules is told which.
    """
    for case in _update_cases():
        with cases.case():
            _check_one_update(student_fn, case)


@dataclasses.dataclass(frozen=True)
class _UpdateCase:
    rollout_batch_size: int
    group_size: int
    train_batch_size: int
    epochs: int
    cliprange: float
    seed: int

    def describe(self) -> str:
        return (
            f"rollout_batch_size={self.rollout_batch_size}, group_size="
            f"{self.group_size}, train_batch_size={self.train_batch_size}, "
            f"epochs_per_rollout_batch={self.epochs}, cliprange={self.cliprange}"
        )


def _update_cases() -> list[_UpdateCase]:
    return [
        _UpdateCase(8, 4, 8, 1, 0.2, 0),  # one optimizer step: on-policy
        _UpdateCase(8, 2, 4, 1, 0.2, 1),  # two train batches
        # Both, with a tighter clip: each wrong schedule differs here, so the
        # first failure names the one it follows.
        _UpdateCase(12, 2, 4, 2, 0.1, 3),
        _UpdateCase(8, 4, 8, 2, 0.2, 2),  # two epochs
    ]


_VOCABULARY = 5
_LEARNING_RATE = 2.0  # large, so that later steps see ratios past the clip


class _TinyPolicy:
    """A linear policy shared by every row: logits (B, T, V) = features (B, T, F)
    @ weights (F, V), the only parameters; its log-probs of fixed sampled
    tokens; SGD steps on it; a log of what was asked of it."""

    def __init__(
        self, features: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        self.features = features  # (B, T, F)
        self.weights = weights.clone().requires_grad_(True)  # (F, V)
        self.tokens = tokens  # (B, T)
        self.optimizer = torch.optim.SGD([self.weights], lr=_LEARNING_RATE)
        self.rows_scored = 0
        self.gradients: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []  # the weights after each step

    def score(self, rows: Any) -> torch.Tensor:
        index = torch.arange(self.tokens.shape[0])[rows]
        self.rows_scored += int(index.numel())
        logits = self.features[index] @ self.weights  # (b, T, V)
        log_probs = torch.log_softmax(logits, dim=-1)  # (b, T, V)
        return log_probs.gather(-1, self.tokens[index].unsqueeze(-1)).squeeze(-1)

    def optimizer_step(self, loss: Any) -> None:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ExerciseFailed(
                f"optimizer_step expects the scalar loss of one train batch, got "
                f"{type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if hasattr(loss, "shape") else "")
            )
        if not loss.requires_grad:
            raise ExerciseFailed(
                "the loss passed to optimizer_step carries no gradient to the "
                "policy (was it computed under torch.no_grad(), or detached?)"
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        gradient = self.weights.grad
        self.gradients.append(
            torch.zeros_like(self.weights) if gradient is None else gradient.clone()
        )
        self.optimizer.step()
        self.after.append(self.weights.detach().clone())


def _case_tensors(case: _UpdateCase) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(case.seed)
    size, length = case.rollout_batch_size, 4
    features = torch.randn(size, length, 3, generator=generator).double()
    weights = torch.randn(3, _VOCABULARY, generator=generator).double()
    tokens = torch.randint(_VOCABULARY, (size, length), generator=generator)
    lengths = torch.randint(1, length + 1, (size,), generator=generator)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()  # (B, T)
    advantages = torch.randn(size, generator=generator).double()  # (B,)
    return features, weights, tokens, mask, advantages


# The usual wrong schedules, each with what to say about it.
_WRONG_SCHEDULES = {
    "fresh_old": (
        "the ratio is 1 at every step: the old log-probs were scored again "
        "before each train batch (or never kept), so the clip never acts; "
        "score them once, before the first update, under torch.no_grad()"
    ),
    "old_per_epoch": (
        "the old log-probs were scored again at the start of each epoch: they "
        "are the policy that sampled the rollout batch, scored once, before the "
        "first update, and kept for every epoch"
    ),
    "epochs_inside": (
        "each train batch's epochs ran back to back: an epoch is one pass over "
        "every train batch, so loop over epochs outside the train batches"
    ),
}


def reference_rollout_batch_update(
    policy: _TinyPolicy,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    case: _UpdateCase,
    schedule: str = "right",
) -> None:
    """grpo_update's schedule with the package's loss pieces: old log-probs
    scored once, before the first update, only when some step follows another;
    epochs of group-aligned train batches; one optimizer step each. Another
    ``schedule`` (a key of ``_WRONG_SCHEDULES``) is one of the usual slips."""
    size = case.rollout_batch_size
    batches = _reference_slices(size, case.train_batch_size)
    off_policy = case.epochs > 1 or len(batches) > 1
    steps = [rows for _epoch in range(case.epochs) for rows in batches]
    if schedule == "epochs_inside":
        steps = [rows for rows in batches for _epoch in range(case.epochs)]
    old_log_probs = None
    for rows in steps:
        fresh = old_log_probs is None or (
            schedule == "old_per_epoch" and rows == batches[0]
        )
        if off_policy and schedule != "fresh_old" and fresh:
            with torch.no_grad():
                old_log_probs = policy.score(slice(0, size))  # (B, T)
        log_probs = policy.score(rows)  # (b, T)
        per_token, _ = compute_policy_gradient_loss(
            advantages[rows],
            log_probs,
            "grpo" if off_policy else "none",
            log_probs.detach() if old_log_probs is None else old_log_probs[rows],
            case.cliprange,
            response_mask[rows],
        )  # (b, T)
        loss = aggregate_loss_across_microbatch(
            per_token, response_mask[rows], "sequence"
        )
        policy.optimizer_step(loss)


def _same_steps(received: _TinyPolicy, expected: _TinyPolicy) -> bool:
    return len(received.after) == len(expected.after) and all(
        torch.allclose(got, want, atol=1e-5, rtol=1e-4)
        for got, want in zip(received.after, expected.after, strict=True)
    )


def _which_schedule(
    received: _TinyPolicy,
    expected: _TinyPolicy,
    case: _UpdateCase,
    tensors: tuple[torch.Tensor, ...],
) -> str | None:
    features, weights, tokens, mask, advantages = tensors
    for schedule, message in _WRONG_SCHEDULES.items():
        wrong = _TinyPolicy(features, weights, tokens)
        reference_rollout_batch_update(wrong, advantages, mask, case, schedule)
        if not _same_steps(wrong, expected) and _same_steps(received, wrong):
            return message
    return None


def _check_one_update(student_fn: Callable[..., Any], case: _UpdateCase) -> None:
    tensors = _case_tensors(case)
    features, weights, tokens, mask, advantages = tensors
    expected = _TinyPolicy(features, weights, tokens)
    reference_rollout_batch_update(expected, advantages, mask, case)
    received = _TinyPolicy(features, weights, tokens)
    student_fn(
        received.score,
        received.optimizer_step,
        advantages.clone(),
        mask.clone(),
        case.group_size,
        case.train_batch_size,
        case.epochs,
        case.cliprange,
    )
    inputs = case.describe()
    if not _same_steps(received, expected):
        schedule = _which_schedule(received, expected, case, tensors)
        if schedule is not None:
            raise ExerciseFailed(f"For {inputs}: {schedule}")
    if len(received.after) != len(expected.after):
        raise ExerciseFailed(
            f"For {inputs}: expected {len(expected.after)} optimizer steps (one "
            f"per train batch of {case.train_batch_size} rows, per epoch), got "
            f"{len(received.after)}"
        )
    for step in range(len(expected.after)):
        assert_close(
            received.gradients[step],
            expected.gradients[step],
            f"{inputs}, the gradient of optimizer step {step + 1}",
        )
        assert_close(
            received.after[step],
            expected.after[step],
            f"{inputs}, the parameters after optimizer step {step + 1}",
        )
    if received.rows_scored != expected.rows_scored:
        raise ExerciseFailed(
            f"For {inputs}: every step is right, but {received.rows_scored} rows "
            f"were scored where {expected.rows_scored} are needed (a forward pass "
            "the update never uses, or a batch scored twice)"
        )


def _reference_slices(rollout_batch_size: int, train_batch_size: int) -> list[slice]:
    return [
        slice(start, start + train_batch_size)
        for start in range(0, rollout_batch_size, train_batch_size)
    ]


def _rows(slices: Any, rollout_batch_size: int) -> list[list[int]]:
    return [list(range(rollout_batch_size))[piece] for piece in slices]


@exercise_check("Exercise 08-train_batch_slices (group-aligned train batches)")
def check_train_batch_slices(
    student_fn: Callable[[int, int, int], list[slice]], cases: CaseCount
) -> None:
    """``student_fn(rollout_batch_size, train_batch_size, group_size) -> [slice]``."""
    for rollout, train, group in [(16, 8, 4), (12, 4, 2), (8, 8, 4), (24, 6, 3)]:
        with cases.case():
            inputs = (
                f"rollout_batch_size={rollout}, train_batch_size={train}, "
                f"group_size={group}"
            )
            expected = _rows(_reference_slices(rollout, train), rollout)
            received = _rows(student_fn(rollout, train, group), rollout)
            if received != expected:
                raise ExerciseFailed(
                    f"For {inputs}: expected the rows {expected}, got {received} "
                    "(each train batch must hold whole groups of consecutive rows)"
                )
    with cases.case():
        _check_a_split_group_is_refused(student_fn)


def _check_a_split_group_is_refused(
    student_fn: Callable[[int, int, int], list[slice]],
) -> None:
    try:
        student_fn(16, 6, 4)
    except ValueError:
        return
    raise ExerciseFailed(
        "For rollout_batch_size=16, train_batch_size=6, group_size=4: expected a "
        "ValueError (a train batch of 6 rows would split a group of 4), got none"
    )


def _example_config() -> dict[str, Any]:
    return {
        "lr": 0.001,
        "group_size": 8,
        "task": "reverse",
        "task_options": {"n_digits": 5, "eval_fraction": 0.1},
        "cliprange": None,
        "epochs_per_rollout_batch": 1,
        "run_dir": "runs/a",
        "resume": False,
    }


def _key(student_fn: Callable[[dict[str, Any]], str], config: dict[str, Any]) -> str:
    key = student_fn(dict(config))
    if not isinstance(key, str) or len(key) < 8:
        raise ExerciseFailed(
            f"For config={config}: expected a hexadecimal string of at least 8 "
            f"characters, got {key!r}"
        )
    if set(key) - set(string.hexdigits):
        raise ExerciseFailed(
            f"For config={config}: expected hexadecimal characters only (a hash "
            f"digest, safe as a folder name), got {key!r}"
        )
    return key


@exercise_check("Exercise 09-cache_key (a cache key for a run)")
def check_cache_key(
    student_fn: Callable[[dict[str, Any]], str], cases: CaseCount
) -> None:
    """``student_fn(config_dict) -> str``: same run, same key, in this process
    and in a fresh one; other run, other key."""
    config = _example_config()
    with cases.case():
        _key(student_fn, config)
    with cases.case():
        _check_key_order_is_ignored(student_fn, config)
    for moved in ({"run_dir": "runs/b"}, {"resume": True}):
        with cases.case():
            other = _key(student_fn, {**config, **moved})
            if other != _key(student_fn, config):
                raise ExerciseFailed(
                    f"For config={config} with {moved}: expected the same key "
                    f"{_key(student_fn, config)!r} (where a run is written does not "
                    f"change what it computes), got {other!r}"
                )
    changes = [
        {"lr": 0.003},
        {"group_size": 4},
        {"cliprange": 0.2},
        {"epochs_per_rollout_batch": 2},
        {"task_options": {"n_digits": 4, "eval_fraction": 0.1}},
    ]
    for change in changes:
        with cases.case():
            other = _key(student_fn, {**config, **change})
            if other == _key(student_fn, config):
                raise ExerciseFailed(
                    f"For config={config} with {change}: expected a different key "
                    f"(it trains a different run), got the same {other!r}"
                )
    with cases.case():
        _check_key_is_stable_across_processes(student_fn, config)


def _check_key_order_is_ignored(
    student_fn: Callable[[dict[str, Any]], str], config: dict[str, Any]
) -> None:
    key = _key(student_fn, config)
    reordered = dict(reversed(list(config.items())))
    reordered["task_options"] = dict(reversed(list(config["task_options"].items())))
    if _key(student_fn, reordered) != key:
        raise ExerciseFailed(
            f"For the same config with its keys in another order ({reordered}): "
            f"expected the key {key!r} again, got {_key(student_fn, reordered)!r}"
        )


# Loads the reach module from its file (argv[1]) alone, hides the check's
# counterparts (argv[2:]) in this process, then reads a pickled (function,
# config) from stdin and prints the key's repr. It imports nothing of the
# package that the student's function does not import.
_KEY_IN_A_FRESH_PROCESS = (
    "import sys, dill, importlib.util; "
    "spec = importlib.util.spec_from_file_location('grpo_lab_reach', sys.argv[1]); "
    "reach = importlib.util.module_from_spec(spec); spec.loader.exec_module(reach); "
    "reach.hide_in_this_process(sys.argv[2:]); "
    "fn, config = dill.loads(sys.stdin.buffer.read()); print(repr(fn(config)))"
)


def _check_key_is_stable_across_processes(
    student_fn: Callable[[dict[str, Any]], str], config: dict[str, Any]
) -> None:
    """The key computed again in two fresh Python processes, with different
    string-hash seeds (a cache on disk is read by later runs): Python's
    built-in ``hash()`` of a string changes from one process to the next."""
    key = _key(student_fn, config)
    for seed in ("1", "2"):
        other = _key_in_a_fresh_process(student_fn, config, seed)
        if other != repr(key):
            raise ExerciseFailed(
                f"For config={config}: expected the key {key!r} again in a fresh "
                f"Python process (PYTHONHASHSEED={seed}), got {other}: a cache on "
                "disk is read by later processes, so the key must not depend on "
                "the process (Python's hash() of a string does)"
            )


def _key_in_a_fresh_process(
    student_fn: Callable[[dict[str, Any]], str], config: dict[str, Any], seed: str
) -> str:
    import dill

    try:
        payload = dill.dumps(
            (framework.as_written(student_fn), dict(config)), recurse=True
        )
    except Exception as error:
        raise ExerciseFailed(
            f"the key function could not be sent to a fresh process to compute "
            f"the key again ({type(error).__name__}: {error}); keep it a plain "
            "function of the config"
        ) from error
    environment = {
        **os.environ,
        "PYTHONHASHSEED": seed,
        "PYTHONPATH": os.pathsep.join(path for path in sys.path if path),
    }
    finished = subprocess.run(
        [
            *framework.fresh_python(),
            *["-c", _KEY_IN_A_FRESH_PROCESS, reach.__file__],
            *framework.hidden_places("check_cache_key"),
        ],
        input=payload,
        capture_output=True,
        env=environment,
        timeout=120,
        check=False,
    )
    if finished.returncode != 0:
        last_line = (finished.stderr.decode(errors="replace").strip() or "?").split(
            "\n"
        )[-1]
        raise ExerciseFailed(
            f"For config={config}: the key function failed in a fresh Python "
            f"process ({last_line})"
        )
    printed = finished.stdout.decode(errors="replace").strip().splitlines()
    return printed[-1] if printed else "nothing"
