"""Checkpoints that survive a crash, and resuming a run exactly where it stopped.

A checkpoint holds the model and optimizer state, every RNG state (Python,
NumPy, torch CPU, CUDA when present), the step, the config and how many metric
lines had been written. It is written atomically: a temporary file in the same
folder, flushed and fsynced, then ``os.replace``d onto its final name, so a
checkpoint file is either complete or absent, and a failed write (a full disk)
leaves every earlier checkpoint as it was.

Given the tokenizer, a checkpoint also holds a ``save_pretrained`` folder
beside its file, ``checkpoints/step_XXXXXX/`` (model and tokenizer), which
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
open (the tiny model's character tokenizer keeps its exact ids with
``grpo_lab.models.load_tokenizer``). It is written first, into a temporary
folder renamed into place, so it too is either complete or absent, and
retention deletes it with its file.

Only checkpoints that load count. A new checkpoint is read back before any
older one is deleted, and retention keeps the newest ``keep_last`` checkpoints
that load, so it never deletes the last good one in favour of broken files.
Resuming takes the newest checkpoint that loads; each one that does not is
reported (a :class:`CheckpointWarning` naming the file and its error) and the
next older one is tried. When none loads, :class:`CheckpointError` says so.
Taught in ``notebooks/`` on the training loop.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpo_lab.errors import UserError

CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_FORMAT_VERSION = 1
_CHECKPOINT_NAME = re.compile(r"^step_(\d{6,})\.pt$")
_PRETRAINED_NAME = re.compile(r"^step_(\d{6,})$")
# A temporary sibling of an atomic write (".step_000042.pt.1234.tmp", a folder
# ".final_model.1234.old"): what a killed write leaves behind.
_TEMPORARY_NAME = re.compile(r"^\..+\.\d+\.(tmp|old)$")
# Colour and bold codes some error messages carry.
_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*m")
_REQUIRED_KEYS = ("format_version", "step", "model", "optimizer", "rng", "config")


class CheckpointError(UserError):
    """A checkpoint could not be written, or no checkpoint of a run loads."""


class CheckpointWarning(UserWarning):
    """A checkpoint file that does not load, skipped for an older one."""


@dataclass(frozen=True)
class CheckpointState:
    """What a loaded checkpoint tells the loop: where to continue from."""

    # The last completed GRPO step.
    step: int
    # Metric lines written up to and including that step.
    metrics_offset: int
    # The config the run was saved with (a plain dict).
    config: dict[str, Any]
    # The checkpoint file it came from.
    path: Path


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    """``run_dir / "checkpoints"``."""
    return Path(run_dir) / CHECKPOINT_DIR


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    """The checkpoint file of ``step``: ``run_dir/checkpoints/step_000042.pt``."""
    return checkpoint_dir(run_dir) / f"step_{step:06d}.pt"


def capture_rng_states() -> dict[str, Any]:
    """Every RNG state a run draws from, in plain types and tensors."""
    numpy_state = np.random.get_state()
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [
            numpy_state[0],
            numpy_state[1].tolist(),
            *(int(v) if i < 2 else float(v) for i, v in enumerate(numpy_state[2:])),
        ],
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["torch_cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_states` returned."""
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state(
        (name, np.array(keys, dtype=np.uint32), position, has_gauss, cached)
    )
    torch.set_rng_state(states["torch_cpu"])
    if "torch_cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda"])


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: dict[str, Any],
    metrics_offset: int,
    keep_last: int = 2,
    *,
    tokenizer: Any = None,
    pretrained: Any = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> Path:
    """Write ``checkpoints/step_XXXXXX.pt`` atomically, read it back, keep a few.

    With a ``tokenizer`` the model (a transformers ``PreTrainedModel``) and the
    tokenizer are first saved with ``save_pretrained`` into the folder
    ``checkpoints/step_XXXXXX/`` (:func:`save_pretrained_atomically`).
    Retention (:func:`remove_old_checkpoints`) runs only once the new file
    loads. A write that fails raises :class:`CheckpointError` naming the file;
    earlier checkpoints are untouched. ``pretrained``: the object whose
    ``save_pretrained`` writes that folder in place of ``model`` (a LoRA run's
    ``PeftModel``: the folder then holds the adapter). A ``grad_scaler``'s
    state (float16's loss scale) is saved too, so a resume scales as the run did.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    folder = checkpoint_dir(run_dir)
    payload = {
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "step": step,
        "metrics_offset": metrics_offset,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": capture_rng_states(),
        "config": config,
    }
    if grad_scaler is not None:
        payload["grad_scaler"] = grad_scaler.state_dict()
    path = checkpoint_path(run_dir, step)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if tokenizer is not None:
            save_pretrained_atomically(
                model if pretrained is None else pretrained,
                tokenizer,
                pretrained_dir(path),
            )
        atomic_torch_save(payload, path)
    except (OSError, RuntimeError) as error:
        if tokenizer is not None and not path.exists():
            shutil.rmtree(pretrained_dir(path), ignore_errors=True)
        raise CheckpointError(
            f"could not write checkpoint {path}: {describe_error(error)}",
            f"free space on that disk or make {folder} writable; "
            f"{_earlier_checkpoints(run_dir, path)}",
        ) from error
    try:
        verify_checkpoint(path)
    except Exception as error:
        raise CheckpointError(
            f"checkpoint {path} was written but does not load back: "
            f"{describe_error(error)}",
            f"check the disk holding {folder}; {_earlier_checkpoints(run_dir, path)}",
        ) from error
    remove_old_checkpoints(run_dir, path, keep_last)
    return path


def remove_old_checkpoints(
    run_dir: str | os.PathLike, newest: Path, keep_last: int
) -> list[Path]:
    """Delete the checkpoints older than the ``keep_last`` newest ones that load.

    Counting starts at ``newest`` (just written and read back) and walks to older
    steps; a file that does not load is not counted, so broken files never push
    the last good checkpoint out. Files with a later step than ``newest`` are
    left alone. Returns the deleted paths.
    """
    newest_step = checkpoint_step(newest)
    older = [p for p in list_checkpoints(run_dir) if checkpoint_step(p) < newest_step]
    kept, removed = 1, []
    for path in reversed(older):
        if kept >= keep_last:
            path.unlink(missing_ok=True)
            shutil.rmtree(pretrained_dir(path), ignore_errors=True)
            removed.append(path)
        elif _loads(path):
            kept += 1
    _remove_orphan_folders(run_dir, newest_step)
    return removed


def _remove_orphan_folders(run_dir: str | os.PathLike, newest_step: int) -> None:
    """Delete pretrained folders older than ``newest_step`` whose file is gone."""
    folder = checkpoint_dir(run_dir)
    for path in folder.iterdir():
        match = _PRETRAINED_NAME.match(path.name)
        if (
            match
            and int(match.group(1)) < newest_step
            and path.is_dir()
            and not path.with_name(f"{path.name}.pt").exists()
        ):
            shutil.rmtree(path, ignore_errors=True)


def pretrained_dir(checkpoint_path: str | os.PathLike) -> Path:
    """The ``save_pretrained`` folder of a checkpoint: ``step_000042.pt`` ->
    ``step_000042/``."""
    checkpoint_step(checkpoint_path)  # the name must be a checkpoint's
    return Path(checkpoint_path).with_suffix("")


def save_pretrained_atomically(model: Any, tokenizer: Any, folder: Path) -> None:
    """``save_pretrained`` model and tokenizer into a temporary sibling, then rename.

    A folder already there (the same step saved again) is moved aside first and
    deleted once the new one is in place; a failed save leaves no partial folder.
    """
    temporary = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    previous = folder.with_name(f".{folder.name}.{os.getpid()}.old")
    for leftover in (temporary, previous):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        with quiet_transformers():
            model.save_pretrained(temporary)
            tokenizer.save_pretrained(temporary)
        _fsync_files(temporary)
        if folder.exists():
            os.replace(folder, previous)
        os.replace(temporary, folder)
        _fsync_directory(folder.parent)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
        shutil.rmtree(previous, ignore_errors=True)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No "Writing model shards" bar from transformers (at every checkpoint, in an
    export); the setting is restored after."""
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


def _fsync_files(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def _loads(path: Path) -> bool:
    try:
        verify_checkpoint(path)
    except Exception:
        return False
    return True


def _earlier_checkpoints(run_dir: str | os.PathLike, failed: Path) -> str:
    earlier = [path for path in list_checkpoints(run_dir) if path != failed]
    if not earlier:
        return "no earlier checkpoint exists"
    return f"earlier checkpoints were left as they were (newest: {earlier[-1].name})"


def atomic_torch_save(payload: Any, path: Path) -> None:
    """``torch.save`` to a temporary sibling, fsync, ``os.replace``, fsync the dir."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_directory(path.parent)


def remove_leftover_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Delete the temporary files and folders a killed write left in ``run_dir``
    and its ``checkpoints/`` (names ``.<name>.<pid>.tmp`` or ``.old``); returns
    them. Call it only while holding the run folder's lock: no other writer is
    then at work, so every such name is a leftover.
    """
    removed = []
    for folder in (Path(run_dir), checkpoint_dir(run_dir)):
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if not _TEMPORARY_NAME.match(path.name):
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _fsync_directory(folder: Path) -> None:
    if os.name != "posix":
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint files of a run, oldest step first (temporary files ignored)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in folder.iterdir()
        if (match := _CHECKPOINT_NAME.match(path.name))
    ]
    return [path for _, path in sorted(found)]


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step in a checkpoint's file name: ``step_000042.pt`` -> 42."""
    match = _CHECKPOINT_NAME.match(Path(path).name)
    if match is None:
        raise ValueError(f"path must be named step_XXXXXX.pt, got {str(path)!r}")
    return int(match.group(1))


def load_checkpoint_file(
    path: str | os.PathLike, *, mmap: bool = False
) -> dict[str, Any]:
    """Read a checkpoint (tensors and plain types only: ``weights_only=True``).

    ``mmap=True`` maps the tensors instead of reading them: a cheap check that
    the file is complete and holds every required key.
    """
    payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    if not isinstance(payload, dict):
        raise ValueError(
            f"checkpoint {path} must hold a dict, got {type(payload).__name__}"
        )
    missing = [key for key in _REQUIRED_KEYS if key not in payload]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing}")
    if payload["format_version"] != CHECKPOINT_FORMAT_VERSION:
        raise ValueError(
            f"checkpoint format_version must be {CHECKPOINT_FORMAT_VERSION}, "
            f"got {payload['format_version']!r} in {path}"
        )
    return payload


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise what loading ``path`` raises; return quietly when it loads.

    Tries the cheap memory-mapped load first, and a full load only when that
    fails (a filesystem without mmap), so a sound file is never called broken.
    """
    try:
        load_checkpoint_file(path, mmap=True)
    except Exception:
        load_checkpoint_file(path)


def latest_checkpoint(
    run_dir: str | os.PathLike,
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads, with its payload; None when there is none.

    Each file that does not load is reported with a :class:`CheckpointWarning`
    (its name, its error, the file tried next). When checkpoint files exist but
    none of them loads, :class:`CheckpointError` lists them all.
    """
    candidates = list(reversed(list_checkpoints(run_dir)))
    failures = []
    for index, path in enumerate(candidates):
        try:
            payload = load_checkpoint_file(path)
        except Exception as error:
            failures.append(f"{path.name}: {describe_error(error)}")
            following = candidates[index + 1 : index + 2]
            then = f"trying {following[0].name}" if following else "no older one"
            warnings.warn(
                f"checkpoint {path} does not load ({describe_error(error)}); {then}",
                CheckpointWarning,
                stacklevel=2,
            )
            continue
        if failures:
            warnings.warn(
                f"resuming from {path} (step {payload['step']}), the newest "
                "checkpoint that loads",
                CheckpointWarning,
                stacklevel=2,
            )
        return path, payload
    if failures:
        raise CheckpointError(
            f"no checkpoint in {checkpoint_dir(run_dir)} loads: " + "; ".join(failures),
            "nothing was changed; put back a checkpoint that loads, or start a "
            "new run in another run_dir",
        )
    return None


def describe_error(error: BaseException, limit: int = 160) -> str:
    """``"TypeName: first line of the message"``, cut to ``limit`` characters.

    An unpickling error (the file is not a checkpoint, or is damaged) gets a
    short sentence instead of torch's advice about ``weights_only``.
    """
    if isinstance(error, pickle.UnpicklingError):
        return f"{type(error).__name__}: not a checkpoint, or a damaged one"
    lines = _TERMINAL_CODES.sub("", str(error)).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def restore_checkpoint(
    payload: dict[str, Any],
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> CheckpointState:
    """Load model, optimizer and RNG states from ``payload``; say where to go on."""
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    if grad_scaler is not None and "grad_scaler" in payload:
        grad_scaler.load_state_dict(payload["grad_scaler"])
    restore_rng_states(payload["rng"])
    return CheckpointState(
        step=payload["step"],
        metrics_offset=payload["metrics_offset"],
        config=payload["config"],
        path=path,
    )
