"""Experiment trackers beside ``metrics.jsonl``: TensorBoard, W&B, Trackio, MLflow.

``report_to`` names them: ``"none"`` (the default), one name, a comma-separated
string (``"tensorboard,wandb"``) or a list. ``metrics.jsonl`` stays the record
of a run; a tracker is sent its lines, read back from the file as they are
written, so it shows exactly what the file holds. Each line goes under its
step: ``step`` for GRPO lines, ``sft/step`` for warm-up lines. Its numbers are
sent as they are; a ``None`` (a non-finite value) is left out, and the step
key itself is the axis, not a value.

Each tracker is an optional extra (``pip install 'grpo-lab[wandb]'``), imported
only when a run asks for it. Asking for one that is not installed is refused
when the config is built, naming the extra. A tracker that fails during a run
(a lost connection, a full disk) is reported once with a
:class:`TrackerWarning` and dropped; training and ``metrics.jsonl`` go on.

A resumed run continues its tracker runs:

- TensorBoard writes to the same ``RUN_DIR/tensorboard/grpo`` (warm-up lines
  to ``RUN_DIR/tensorboard/sft``), and marks the resumed step, so TensorBoard
  hides what the interrupted session logged after its checkpoint.
- W&B reopens the run whose id ``RUN_DIR/trackers.json`` keeps
  (``resume="allow"``); MLflow reopens its run id from the same file; Trackio
  continues the run of the same name. Steps logged after the checkpoint by the
  interrupted session are logged again.

Project names follow each tool's own variable: ``WANDB_PROJECT``,
``MLFLOW_EXPERIMENT_NAME``, ``TRACKIO_PROJECT`` (default ``grpo-lab``).
"""

from __future__ import annotations

import json
import os
import secrets
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from grpo_lab.training.metrics import metrics_size, read_metrics_from
from grpo_lab.training.parsers import parse_report_to

if TYPE_CHECKING:
    from grpo_lab.training.config import TrainConfig

TRACKERS_FILE = "trackers.json"
TENSORBOARD_DIR = "tensorboard"
DEFAULT_PROJECT = "grpo-lab"
# The key that holds a line's step: GRPO lines, then warm-up lines.
STEP_KEYS = ("step", "sft/step")


class TrackerWarning(UserWarning):
    """A tracker that could not start or failed during a run, and was dropped."""


# --- what a tracker is sent -----------------------------------------------------------


def tracker_step(record: Mapping[str, Any]) -> tuple[str, int] | None:
    """(step key, step) of a metrics line; None for a line without either key."""
    for key in STEP_KEYS:
        if isinstance(record.get(key), int):
            return key, record[key]
    return None


def tracker_values(record: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics line, less its step keys and its Nones."""
    return {
        key: value
        for key, value in record.items()
        if key not in STEP_KEYS
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    }


@dataclass
class TrackerContext:
    """What a tracker needs to open: the run, and whether it continues one."""

    # The run folder.
    run_dir: Path
    # The run's config (TrainConfig.to_dict()).
    config: dict[str, Any]
    # The checkpoint step a resumed run continues from; None for a new run.
    resumed_from: int | None
    # Run ids kept in RUN_DIR/trackers.json; an opener may add its own.
    ids: dict[str, str] = field(default_factory=dict)

    @property
    def run_name(self) -> str:
        """The run folder's name, used as each tracker's run name."""
        return self.run_dir.resolve().name

    def kept_id(self, name: str) -> str | None:
        """The id ``name`` stored for this run folder; None for a new run."""
        return None if self.resumed_from is None else self.ids.get(name)


class Tracker(Protocol):
    """One experiment tracker: sent every metrics line, closed at the end."""

    def log(self, step_key: str, step: int, values: dict[str, float]) -> None:
        """Record ``values`` at ``step`` (of ``step_key``'s axis)."""

    def close(self) -> None:
        """Flush and finish."""


# --- the adapters ---------------------------------------------------------------------


class TensorBoardTracker:
    """Event files under ``RUN_DIR/tensorboard/grpo`` and ``.../sft``."""

    def __init__(self, context: TrackerContext) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer_class = SummaryWriter
        self._folder = context.run_dir / TENSORBOARD_DIR
        self._resumed_from = context.resumed_from
        self._writers: dict[str, Any] = {}
        self._writer("step")  # the folder exists from the start

    def _writer(self, step_key: str) -> Any:
        """The writer of one axis; its first event hides later-stepped old ones."""
        if step_key not in self._writers:
            warm_up = step_key != "step"
            if self._resumed_from is None:
                purge_step = 0  # a new run: nothing an earlier attempt wrote shows
            else:
                purge_step = None if warm_up else self._resumed_from + 1
            self._writers[step_key] = self._writer_class(
                log_dir=str(self._folder / ("sft" if warm_up else "grpo")),
                purge_step=purge_step,
            )
        return self._writers[step_key]

    def log(self, step_key: str, step: int, values: dict[str, float]) -> None:
        writer = self._writer(step_key)
        for key, value in values.items():
            writer.add_scalar(key, value, global_step=step)
        writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()


class WandbTracker:
    """A Weights & Biases run; its id is kept so that a resume continues it.

    Each namespace (``train/``, ``eval/``, ``sft/`` ...) is plotted against its
    line's step key, logged with it, so warm-up and GRPO steps never collide.
    """

    def __init__(self, context: TrackerContext) -> None:
        import wandb

        run_id = context.kept_id("wandb") or secrets.token_hex(4)
        context.ids["wandb"] = run_id
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT),
            name=context.run_name,
            id=run_id,
            resume="allow",
            dir=str(context.run_dir),
            config=context.config,
        )
        self._defined: set[str] = set()

    def log(self, step_key: str, step: int, values: dict[str, float]) -> None:
        for key in values:
            pattern = key.split("/", 1)[0] + "/*" if "/" in key else key
            if pattern not in self._defined:
                self._run.define_metric(pattern, step_metric=step_key)
                self._defined.add(pattern)
        self._run.log({step_key: step, **values})

    def close(self) -> None:
        self._run.finish()


class TrackioTracker:
    """A Trackio run (local store by default) named after the run folder."""

    def __init__(self, context: TrackerContext) -> None:
        import trackio

        self._trackio = trackio
        kept = context.kept_id("trackio")
        name = kept or context.run_name
        context.ids["trackio"] = name
        trackio.init(
            project=os.environ.get("TRACKIO_PROJECT", DEFAULT_PROJECT),
            name=name,
            config=context.config,
            resume="allow" if kept else "never",
            embed=False,
        )

    def log(self, step_key: str, step: int, values: dict[str, float]) -> None:
        self._trackio.log(values, step=step)

    def close(self) -> None:
        self._trackio.finish()


class MlflowTracker:
    """An MLflow run; its run id is kept so that a resume continues it.

    The experiment is ``MLFLOW_EXPERIMENT_NAME`` (or ``..._ID``) when set, else
    ``grpo-lab``; the tracking URI is MLflow's own (``MLFLOW_TRACKING_URI``).
    The config goes in as parameters once, when the run starts.
    """

    def __init__(self, context: TrackerContext) -> None:
        import mlflow

        self._mlflow = mlflow
        kept = context.kept_id("mlflow")
        if kept is not None:
            mlflow.start_run(run_id=kept)
            return
        if not (
            os.environ.get("MLFLOW_EXPERIMENT_NAME")
            or os.environ.get("MLFLOW_EXPERIMENT_ID")
        ):
            mlflow.set_experiment(DEFAULT_PROJECT)
        run = mlflow.start_run(run_name=context.run_name)
        context.ids["mlflow"] = run.info.run_id
        mlflow.log_params({key: _param(v) for key, v in context.config.items()})

    def log(self, step_key: str, step: int, values: dict[str, float]) -> None:
        self._mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def _param(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


OPENERS: dict[str, Callable[[TrackerContext], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "trackio": TrackioTracker,
    "mlflow": MlflowTracker,
}


# --- the trackers of a run ------------------------------------------------------------


@dataclass
class Trackers:
    """The open trackers of a run, and how much of metrics.jsonl they were sent."""

    # The run folder whose metrics.jsonl they follow.
    run_dir: Path
    # Open trackers by name; one that fails is removed.
    active: dict[str, Tracker]
    # Bytes of metrics.jsonl sent so far.
    offset: int = 0

    def sync(self) -> None:
        """Send every complete line written since the last call."""
        if not self.active:
            self.offset = metrics_size(self.run_dir)
            return
        records, self.offset = read_metrics_from(self.run_dir, self.offset)
        for record in records:
            self.send(record)

    def send(self, record: Mapping[str, Any]) -> None:
        """Send one metrics line to each tracker; drop one that fails."""
        found = tracker_step(record)
        if found is None:
            return
        step_key, step = found
        values = tracker_values(record)
        for name, tracker in list(self.active.items()):
            try:
                tracker.log(step_key, step, values)
            except Exception as error:
                del self.active[name]
                _warn_dropped(name, "failed", error)

    def close(self) -> None:
        """Close every tracker (a failure to close is reported, not raised)."""
        for name, tracker in self.active.items():
            try:
                tracker.close()
            except Exception as error:
                _warn_dropped(name, "could not finish", error)
        self.active.clear()


def open_trackers(
    config: TrainConfig,
    run_dir: str | os.PathLike,
    resumed_from: int | None,
    openers: Mapping[str, Callable[[TrackerContext], Tracker]] = OPENERS,
) -> Trackers:
    """Open the trackers ``config.report_to`` names; send them what they have not seen.

    A new run (``resumed_from`` None) sends every line already in
    metrics.jsonl (the warm-up and step-0 evaluation); a resumed run sends only
    lines written from now on. A tracker that cannot start is reported with a
    :class:`TrackerWarning` and left out. Ids that let a resume continue a
    tracker run are saved in ``RUN_DIR/trackers.json``.
    """
    run_dir = Path(run_dir)
    names = parse_report_to(config.report_to)
    context = TrackerContext(
        run_dir, config.to_dict(), resumed_from, read_tracker_ids(run_dir)
    )
    kept = dict(context.ids)
    active: dict[str, Tracker] = {}
    for name in names:
        try:
            active[name] = openers[name](context)
        except Exception as error:
            _warn_dropped(name, "could not start", error)
    if context.ids != kept:
        write_tracker_ids(run_dir, context.ids)
    start = 0 if resumed_from is None else metrics_size(run_dir)
    trackers = Trackers(run_dir, active, offset=start)
    trackers.sync()
    return trackers


def read_tracker_ids(run_dir: str | os.PathLike) -> dict[str, str]:
    """``RUN_DIR/trackers.json`` ({} when missing or unreadable)."""
    path = Path(run_dir) / TRACKERS_FILE
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def write_tracker_ids(run_dir: str | os.PathLike, ids: Mapping[str, str]) -> None:
    """Write ``RUN_DIR/trackers.json`` atomically (a temporary file, a rename)."""
    path = Path(run_dir) / TRACKERS_FILE
    temporary = path.with_name(f".{TRACKERS_FILE}.tmp")
    try:
        temporary.write_text(json.dumps(dict(ids), indent=2) + "\n", encoding="utf-8")
        temporary.replace(path)
    except OSError as error:
        warnings.warn(
            f"could not write {path} ({error}); a resume will start new tracker runs",
            TrackerWarning,
            stacklevel=2,
        )


def _warn_dropped(name: str, what: str, error: BaseException) -> None:
    message = " ".join(str(error).split()) or type(error).__name__
    warnings.warn(
        f"report_to {name!r} {what} ({type(error).__name__}: {message}); the run "
        "goes on without it, and metrics.jsonl has every line",
        TrackerWarning,
        stacklevel=3,
    )
