"""Checks for ``notebooks/08_training_loop.ipynb`` and ``09_hyperparameter_explorer``.

08a: when does a rollout batch need old log-probs (training goes off-policy)?
08b: cut a rollout batch into train batches that keep every group whole.
09:  a cache key for a run config (:func:`grpo_lab.teaching.explorer.config_cache_key`),
     the same again in a fresh Python process.
"""

from __future__ import annotations

import os
import string
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from grpo_lab.teaching.checks.framework import (
    CaseCount,
    ExerciseFailed,
    assert_close,
    exercise_check,
)


@exercise_check("Exercise 08a (when old log-probs are needed)")
def check_needs_old_log_probs(
    student_fn: Callable[[int, int, int], bool], cases: CaseCount
) -> None:
    """``student_fn(epochs, train_batch_size, rollout_batch_size) -> bool``."""
    # (epochs, train batch, rollout batch) -> off-policy?
    settings = [
        (1, 256, 256, False),  # one step per rollout batch: the ratio is exactly 1
        (2, 256, 256, True),  # the second epoch sees responses of an older policy
        (1, 128, 256, True),  # the second train batch comes after one update
        (4, 64, 256, True),
    ]
    for epochs, train_batch_size, rollout_batch_size, expected in settings:
        with cases.case():
            received = student_fn(epochs, train_batch_size, rollout_batch_size)
            assert_close(
                bool(received),
                expected,
                f"epochs_per_rollout_batch={epochs}, train_batch_size="
                f"{train_batch_size}, rollout_batch_size={rollout_batch_size}",
            )


def _reference_slices(rollout_batch_size: int, train_batch_size: int) -> list[slice]:
    return [
        slice(start, start + train_batch_size)
        for start in range(0, rollout_batch_size, train_batch_size)
    ]


def _rows(slices: Any, rollout_batch_size: int) -> list[list[int]]:
    return [list(range(rollout_batch_size))[piece] for piece in slices]


@exercise_check("Exercise 08b (group-aligned train batches)")
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


@exercise_check("Exercise 09 (a cache key for a run)")
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


# Reads a pickled (function, config) from stdin and prints the key's repr.
_KEY_IN_A_FRESH_PROCESS = (
    "import sys, dill; fn, config = dill.loads(sys.stdin.buffer.read()); "
    "print(repr(fn(config)))"
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
        payload = dill.dumps((student_fn, dict(config)), recurse=True)
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
        [sys.executable, "-c", _KEY_IN_A_FRESH_PROCESS],
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
