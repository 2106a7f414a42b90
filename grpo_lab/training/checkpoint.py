"""Checkpoints that survive a crash, and resuming a run exactly where it stopped.

A checkpoint holds the model and optimizer state, every RNG state (Python,
NumPy, torch CPU, CUDA when present), the step, the config and how many metric
lines had been written. It is written atomically: a temporary file in the same
folder, flushed and fsynced, then ``os.replace``d onto its final name, so a
checkpoint file is either complete or absent. Resuming loads the newest
checkpoint that loads and truncates metric lines written after it.
Taught in ``notebooks/`` on the training loop.
"""

from __future__ import annotations

import os
import pickle
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_FORMAT_VERSION = 1
_CHECKPOINT_NAME = re.compile(r"^step_(\d{6,})\.pt$")
_REQUIRED_KEYS = ("format_version", "step", "model", "optimizer", "rng", "config")


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
) -> Path:
    """Write ``checkpoints/step_XXXXXX.pt`` atomically; keep the newest few."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "step": step,
        "metrics_offset": metrics_offset,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": capture_rng_states(),
        "config": config,
    }
    path = folder / f"step_{step:06d}.pt"
    atomic_torch_save(payload, path)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


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


def load_checkpoint_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint (tensors and plain types only: ``weights_only=True``)."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    missing = [key for key in _REQUIRED_KEYS if key not in payload]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing}")
    if payload["format_version"] != CHECKPOINT_FORMAT_VERSION:
        raise ValueError(
            f"checkpoint format_version must be {CHECKPOINT_FORMAT_VERSION}, "
            f"got {payload['format_version']!r} in {path}"
        )
    return payload


def latest_checkpoint(
    run_dir: str | os.PathLike,
) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads, with its payload; None when none does."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load_checkpoint_file(path)
        except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError):
            continue
    return None


def restore_checkpoint(
    payload: dict[str, Any],
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> CheckpointState:
    """Load model, optimizer and RNG states from ``payload``; say where to go on."""
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    restore_rng_states(payload["rng"])
    return CheckpointState(
        step=payload["step"],
        metrics_offset=payload["metrics_offset"],
        config=payload["config"],
        path=path,
    )
