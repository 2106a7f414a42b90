"""The run folder: one writer at a time, never overwritten, resumed as it was run.

A run folder holds ``config.json``, ``metrics.jsonl``, ``checkpoints/``,
``final_model/`` and ``resumes.jsonl``. Three rules keep what it records true:

1. One process writes it at a time. :func:`lock_run_dir` takes an exclusive
   ``fcntl.flock`` on ``RUN_DIR/.lock`` and writes its PID there; another
   process is refused with that PID. The kernel drops the lock when its holder
   ends, however it ends (kill -9 included), so no stale lock outlives a run.
   Within one process the lock is re-entrant (a notebook may resume the run it
   just interrupted) and is held until :func:`release_run_dir` or the process
   exits.
2. A run resumes with the settings it was started with. Only
   ``RESUMABLE_FIELDS`` may change: how many steps to train, how often to
   evaluate and checkpoint, and the trackers (``report_to``). None of them
   changes what a step computes (every draw is seeded from the seed, the
   purpose and the step). Any other change is
   refused with each field's saved and requested value; every resume appends a
   line to ``resumes.jsonl`` with the checkpoint it started from and the
   fields it changed.
3. A resume never starts over on top of recorded metrics. When checkpoints
   exist and none loads, or metric lines exist and no checkpoint does, it stops
   and says so, leaving the folder as it was.

Errors here are :class:`RunDirError`, a ``ValueError`` the command line prints
as one line. Taught in ``notebooks/`` on the training loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from grpo_lab.errors import UserError
from grpo_lab.training import checkpoint as checkpoints
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.metrics import (
    METRICS_FILE,
    count_metric_lines,
    truncate_metrics,
)

try:
    import fcntl
except ImportError:  # not POSIX: runs are not locked
    fcntl = None

CONFIG_FILE = "config.json"
LOCK_FILE = ".lock"
RESUMES_FILE = "resumes.jsonl"
DEFAULT_PARENT = Path("runs")
# Fields a resume may change: they set how long to train, how often to
# evaluate and checkpoint, and which trackers see the metrics, never what a
# step computes.
RESUMABLE_FIELDS = (
    "steps",
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "report_to",
)
# Fields that name the run folder and the resume itself, not the run.
_UNCOMPARED_FIELDS = ("run_dir", "resume")


class RunDirError(UserError, ValueError):
    """A run folder that cannot be used as asked: in use, already a run, unwritable,
    or a resume that would change the run."""


@dataclass
class RunDirLock:
    """An exclusive ``flock`` on a run folder's lock file, held by this process."""

    # The run folder, resolved.
    run_dir: Path
    # The open lock file; closing it releases the lock.
    handle: TextIO | None


# Locks this process holds, by resolved run folder: a process-wide fact. A
# forked child starts with none of them: it is another writer.
_HELD_LOCKS: dict[Path, RunDirLock] = {}
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_HELD_LOCKS.clear)


# --- the lock -------------------------------------------------------------------


def lock_run_dir(run_dir: str | os.PathLike) -> RunDirLock:
    """Lock ``run_dir`` for this process (it must exist); refuse if another holds it.

    The lock file holds the holder's PID, so the refusal can name it.
    """
    _forget_deleted_folders()
    key = Path(run_dir).resolve()
    if key in _HELD_LOCKS:
        return _HELD_LOCKS[key]
    if fcntl is None:
        lock = RunDirLock(key, None)
    else:
        lock = RunDirLock(key, _acquire(key / LOCK_FILE))
    _HELD_LOCKS[key] = lock
    return lock


def _acquire(path: Path) -> TextIO:
    try:
        handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (held open)
    except OSError as error:
        raise RunDirError(
            f"run_dir {str(path.parent)!r} cannot be written: "
            f"{checkpoints.describe_error(error)}",
            "choose a folder you can write to as run_dir",
        ) from error
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise RunDirError(
            f"run_dir {str(path.parent)!r} is in use by process {holder}",
            "wait for that run to finish or stop it; two processes writing one "
            "run folder would log every step twice",
        ) from None
    except OSError as error:  # a filesystem without locks (some network mounts)
        warnings.warn(
            f"run_dir {str(path.parent)!r} cannot be locked "
            f"({checkpoints.describe_error(error)}); make sure no other process "
            "writes it",
            RuntimeWarning,
            stacklevel=3,
        )
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def release_run_dir(run_dir: str | os.PathLike) -> None:
    """Drop this process's lock on ``run_dir`` (nothing when it holds none)."""
    lock = _HELD_LOCKS.pop(Path(run_dir).resolve(), None)
    if lock is not None and lock.handle is not None:
        lock.handle.close()


def _forget_deleted_folders() -> None:
    """Release the locks on folders that were deleted (temporary runs)."""
    for key in [key for key in _HELD_LOCKS if not key.is_dir()]:
        release_run_dir(key)


def holds_run_dir(run_dir: str | os.PathLike) -> bool:
    """Whether this process holds the lock on ``run_dir``."""
    return Path(run_dir).resolve() in _HELD_LOCKS


# --- opening a run folder ---------------------------------------------------------


def open_run_dir(config: TrainConfig) -> Path:
    """Create and lock the run folder; check it against ``config``.

    A folder without a run gets ``config.json``. A folder with a run (metric
    lines or checkpoints) is refused unless ``config.resume``; a resume is
    checked against the saved ``config.json`` here, before any model is built,
    and writes nothing yet (:func:`resume_run_dir` does, once a checkpoint has
    loaded). ``run_dir=None`` creates ``runs/<task>-<UTC time>``.
    """
    run_dir = (
        new_run_dir(config.task) if config.run_dir is None else Path(config.run_dir)
    )
    _make_folder(run_dir)
    locked_before = holds_run_dir(run_dir)
    lock_run_dir(run_dir)
    try:
        _check_folder(run_dir, config)
    except BaseException:
        if not locked_before:
            release_run_dir(run_dir)
        raise
    return run_dir


def _check_folder(run_dir: Path, config: TrainConfig) -> None:
    if not has_run(run_dir):
        write_config(run_dir, dataclasses.replace(config, run_dir=str(run_dir)))
        return
    if not config.resume:
        raise RunDirError(
            f"run_dir {str(run_dir)!r} already holds a run",
            "resume it with grpo-lab train --resume RUN_DIR or resume=True, or "
            "choose another run_dir",
        )
    if (run_dir / CONFIG_FILE).exists():
        check_resume_config(read_saved_config(run_dir), config, run_dir / CONFIG_FILE)


def new_run_dir(task: str, parent: str | os.PathLike = DEFAULT_PARENT) -> Path:
    """Create and return ``parent/<task>-<UTC time>`` (a suffix when that exists)."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    for attempt in itertools.count(1):
        suffix = "" if attempt == 1 else f"-{attempt}"
        candidate = Path(parent) / f"{task}-{stamp}{suffix}"
        try:
            candidate.mkdir(parents=True)
        except FileExistsError:
            continue
        except OSError as error:
            raise _unwritable(candidate, error) from error
        return candidate
    raise AssertionError("unreachable")  # pragma: no cover


def _make_folder(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _unwritable(run_dir, error) from error


def _unwritable(run_dir: Path, error: OSError) -> RunDirError:
    return RunDirError(
        f"run_dir {str(run_dir)!r} cannot be created: "
        f"{error.strerror or checkpoints.describe_error(error)}",
        "choose a folder you can write to as run_dir",
    )


def has_run(run_dir: str | os.PathLike) -> bool:
    """Whether ``run_dir`` holds a run: a metrics file or a checkpoint."""
    return (Path(run_dir) / METRICS_FILE).exists() or bool(
        checkpoints.list_checkpoints(run_dir)
    )


def read_saved_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``run_dir/config.json`` as a dict; RunDirError when missing or unreadable."""
    path = Path(run_dir) / CONFIG_FILE
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunDirError(
            f"{path} does not exist",
            "resume a folder that grpo-lab train wrote, or start a new run",
        ) from None
    except (OSError, ValueError) as error:
        raise RunDirError(
            f"{path} cannot be read: {checkpoints.describe_error(error)}",
            "restore the run's config.json, or start a new run",
        ) from error
    if not isinstance(saved, dict):
        raise RunDirError(
            f"{path} must hold a JSON object, got {type(saved).__name__}",
            "restore the run's config.json, or start a new run",
        )
    return saved


def write_config(run_dir: str | os.PathLike, config: TrainConfig) -> None:
    """Write ``config.json`` atomically (a temporary file, then a rename)."""
    path = Path(run_dir) / CONFIG_FILE
    temporary = path.with_name(f".{CONFIG_FILE}.tmp")
    try:
        temporary.write_text(config.to_json() + "\n", encoding="utf-8")
        temporary.replace(path)
    except OSError as error:
        raise RunDirError(
            f"could not write {path}: {checkpoints.describe_error(error)}",
            "free space on that disk or make the folder writable",
        ) from error


# --- resuming ---------------------------------------------------------------------


def config_changes(
    saved: Mapping[str, Any], config: TrainConfig
) -> dict[str, tuple[Any, Any]]:
    """``{field: (saved value, new value)}`` for each field ``config`` changes.

    Fields missing from ``saved`` (written by an older version) and the fields
    naming the folder (``run_dir``, ``resume``) are not compared.
    """
    requested = _plain(config.to_dict())
    return {
        name: (saved[name], value)
        for name, value in requested.items()
        if name in saved
        and name not in _UNCOMPARED_FIELDS
        and _plain(saved[name]) != value
    }


def check_resume_config(
    saved: Mapping[str, Any], config: TrainConfig, source: str | os.PathLike
) -> dict[str, tuple[Any, Any]]:
    """The allowed changes of a resume; RunDirError naming every refused one.

    ``source`` names where ``saved`` came from (config.json or a checkpoint).
    """
    changes = config_changes(saved, config)
    refused = {k: v for k, v in changes.items() if k not in RESUMABLE_FIELDS}
    if refused:
        listed = ", ".join(
            f"{name} {old!r} -> {new!r}" for name, (old, new) in refused.items()
        )
        raise RunDirError(
            f"resuming would change the run saved in {source}: {listed}",
            f"only {', '.join(RESUMABLE_FIELDS)} may change on resume; start a new "
            "run_dir to train with other settings",
        )
    return changes


def checkpoint_to_resume(
    run_dir: str | os.PathLike, config: TrainConfig
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint a resume continues from, checked against ``config``.

    None when there is nothing to lose by starting over: no checkpoint and no
    metric line. Checkpoints that exist and none loads raise
    :class:`~grpo_lab.training.checkpoint.CheckpointError`; metric lines without
    a checkpoint raise :class:`RunDirError`. Either way nothing is changed.
    """
    found = checkpoints.latest_checkpoint(run_dir)
    if found is None:
        lines = count_metric_lines(run_dir)
        if lines:
            raise RunDirError(
                f"run_dir {str(run_dir)!r} has {lines} metric lines but no "
                "checkpoint to resume from: the run stopped before its first one",
                f"delete {Path(run_dir) / METRICS_FILE} to start this run over, "
                "or choose another run_dir",
            )
        return None
    path, payload = found
    check_resume_config(payload["config"], config, path)
    return found


def resume_run_dir(
    run_dir: str | os.PathLike,
    config: TrainConfig,
    state: checkpoints.CheckpointState,
) -> dict[str, tuple[Any, Any]]:
    """Bring the folder back to ``state``: metrics cut to it, config.json, a record.

    Metric lines written after the checkpoint are dropped, ``config.json`` gets
    ``config`` (with the allowed changes), and ``resumes.jsonl`` gains a line:
    the time, the checkpoint, its step, and ``{field: {"from": ..., "to": ...}}``
    for each changed field. Returns the changes.
    """
    run_dir = Path(run_dir)
    try:
        truncate_metrics(run_dir, state.metrics_offset)
    except ValueError as error:
        raise RunDirError(
            f"{run_dir / METRICS_FILE} does not match {state.path}: {error}",
            "restore the run's metrics.jsonl, or start a new run_dir",
        ) from error
    changes = check_resume_config(state.config, config, state.path)
    write_config(run_dir, dataclasses.replace(config, run_dir=str(run_dir)))
    record = {
        "resumed_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "checkpoint": f"{checkpoints.CHECKPOINT_DIR}/{state.path.name}",
        "step": state.step,
        "changes": {
            name: {"from": old, "to": new} for name, (old, new) in changes.items()
        },
    }
    line = json.dumps(record)
    with open(run_dir / RESUMES_FILE, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")
    return changes


def read_resumes(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The lines of ``resumes.jsonl``, oldest first ([] before any resume)."""
    path = Path(run_dir) / RESUMES_FILE
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _plain(value: Any) -> Any:
    """``value`` as JSON gives it back (tuples become lists), for comparing."""
    return json.loads(json.dumps(value))
