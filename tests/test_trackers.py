"""Trackers beside metrics.jsonl: the setting, the lines they get, failures, resume.

TensorBoard and Trackio are run for real and read back (they are in the dev
extra); W&B and MLflow run against fake modules that record each call.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

from grpo_lab.cli import main as cli
from grpo_lab.training import loop
from grpo_lab.training import run_dir as run_dirs
from grpo_lab.training import trackers as tracking
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.metrics import append_metrics, read_metrics, truncate_metrics
from grpo_lab.training.parsers import parse_report_to

# What a run logs, in miniature: warm-up lines, then GRPO lines (a None is a
# non-finite value in metrics.jsonl).
LINES = [
    {"sft/step": 1, "sft/loss": 4.5},
    {"sft/step": 2, "sft/loss": 4.25, "sft/accuracy_sampled": 0.0},
    {"step": 0, "eval/accuracy_greedy": 0.125},
    {"step": 1, "train/reward_mean": 0.5, "loss/clip_fraction": None},
    {"step": 2, "train/reward_mean": 0.75, "eval/accuracy_greedy": 0.25},
]


def expected_calls(lines: list[dict[str, Any]]) -> list[tuple[str, int, dict]]:
    """(step key, step, values) per line: what every tracker must be sent."""
    calls = []
    for line in lines:
        key = "step" if "step" in line else "sft/step"
        values = {k: v for k, v in line.items() if k != key and v is not None}
        calls.append((key, line[key], values))
    return calls


class RecordingTracker:
    """A tracker that records what it is sent; fails on call ``fail_on``."""

    def __init__(self, context: tracking.TrackerContext, fail_on: int = 0) -> None:
        self.context, self.fail_on = context, fail_on
        self.calls: list[tuple[str, int, dict]] = []
        self.closed = False

    def log(self, step_key: str, step: int, values: dict[str, float]) -> None:
        if len(self.calls) + 1 == self.fail_on:
            raise ConnectionError("the server went away")
        self.calls.append((step_key, step, values))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_wandb(monkeypatch) -> types.SimpleNamespace:
    """A ``wandb`` module whose run records define_metric, log and finish."""
    calls: dict[str, list] = {"init": [], "define_metric": [], "log": [], "finish": []}
    run = types.SimpleNamespace(
        define_metric=lambda name, **kw: calls["define_metric"].append((name, kw)),
        log=lambda data: calls["log"].append(dict(data)),
        finish=lambda: calls["finish"].append(True),
    )

    def init(**kwargs):
        calls["init"].append(kwargs)
        return run

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return types.SimpleNamespace(calls=calls, run=run)


@pytest.fixture
def fake_mlflow(monkeypatch) -> dict[str, list]:
    """An ``mlflow`` module that records runs, params, metrics and end_run."""
    calls: dict[str, list] = {
        "experiment": [],
        "start_run": [],
        "params": [],
        "metrics": [],
        "end_run": [],
    }

    def start_run(run_id=None, run_name=None):
        calls["start_run"].append({"run_id": run_id, "run_name": run_name})
        info = types.SimpleNamespace(run_id=run_id or "mlflow-run-1")
        return types.SimpleNamespace(info=info)

    module = types.SimpleNamespace(
        set_experiment=calls["experiment"].append,
        start_run=start_run,
        log_params=calls["params"].append,
        log_metrics=lambda values, step: calls["metrics"].append((step, values)),
        end_run=lambda: calls["end_run"].append(True),
    )
    monkeypatch.setitem(sys.modules, "mlflow", module)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    return calls


def smoke_config(run_dir: Path, **overrides: Any) -> TrainConfig:
    return TrainConfig.for_profile("smoke", run_dir=str(run_dir), **overrides)


def write_lines(run_dir: Path, lines: list[dict[str, Any]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for line in lines:
        append_metrics(run_dir, line)


# --- the setting ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("none", ()),
        (None, ()),
        ("tensorboard", ("tensorboard",)),
        (" TensorBoard , wandb ", ("tensorboard", "wandb")),
        (["trackio", "mlflow", "trackio"], ("trackio", "mlflow")),
    ],
)
def test_report_to_takes_a_name_a_comma_list_or_a_list(value, names):
    assert parse_report_to(value) == names


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("tensorbord", r"report_to must name trackers from \('none', 'tensorboard'"),
        ("", "report_to must name trackers"),
        ("none,wandb", "report_to 'none' cannot be combined with trackers"),
        (3, "report_to must be a comma-separated string or a list"),
        (["wandb", 1], "report_to must be a comma-separated string or a list"),
    ],
)
def test_a_bad_report_to_is_refused_when_the_config_is_built(value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(report_to=value)


def test_a_tracker_that_is_not_installed_is_refused_naming_its_extra(monkeypatch):
    asked = []

    def find_spec(name, *args):
        asked.append(name)
        return None

    monkeypatch.delitem(sys.modules, "mlflow", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ValueError) as refused:
        TrainConfig(report_to="mlflow")
    assert str(refused.value) == (
        "report_to 'mlflow' needs the mlflow package, which is not installed: "
        "pip install 'grpo-lab[mlflow]', or leave mlflow out of report_to"
    )
    assert asked == ["mlflow"]


def test_the_command_line_refuses_a_missing_tracker_in_one_line(
    monkeypatch, tmp_path, capsys
):
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    run_dir = tmp_path / "run"
    argv = ["train", "--profile", "smoke", "--report-to", "wandb"]
    assert cli.main([*argv, "--run-dir", str(run_dir)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("grpo-lab train: report_to 'wandb' needs the wandb package")
    assert "pip install 'grpo-lab[wandb]'" in error and error.count("\n") == 1
    assert not run_dir.exists()


def test_an_installed_tracker_is_found_without_being_imported(monkeypatch):
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert TrainConfig(report_to="wandb").report_to == "wandb"
    assert "wandb" not in sys.modules


def test_a_resume_may_add_or_drop_trackers(fake_wandb, tmp_path):
    saved = TrainConfig(report_to="none").to_dict()
    resumed = TrainConfig(report_to=["wandb"], steps=500)
    changes = run_dirs.check_resume_config(saved, resumed, tmp_path / "config.json")
    assert changes == {"report_to": ("none", ["wandb"]), "steps": (400, 500)}


# --- what trackers are sent -----------------------------------------------------------


def test_trackers_get_every_line_under_its_step_without_nones(tmp_path):
    write_lines(tmp_path, LINES[:3])
    opened: list[RecordingTracker] = []

    def opener(context):
        opened.append(RecordingTracker(context))
        return opened[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
        patch.setitem(sys.modules, "mlflow", types.ModuleType("mlflow"))
        config = smoke_config(tmp_path, report_to="wandb,mlflow")
    run = tracking.open_trackers(
        config, tmp_path, None, {"wandb": opener, "mlflow": opener}
    )
    assert [t.calls for t in opened] == [expected_calls(LINES[:3])] * 2  # catch-up
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps(LINES[3]) + "\n" + json.dumps(LINES[4])[:12])
    run.sync()  # the half-written line waits for its newline
    assert opened[0].calls == expected_calls(LINES[:4])
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps(LINES[4])[12:] + "\n")
    run.sync()
    run.close()
    assert [t.calls for t in opened] == [expected_calls(LINES)] * 2
    assert all(t.closed for t in opened) and opened[0].context.run_name == tmp_path.name


def test_a_failing_tracker_is_reported_once_and_the_others_go_on(tmp_path):
    write_lines(tmp_path, LINES[:2])
    healthy: list[RecordingTracker] = []

    def broken_opener(context):
        raise PermissionError("no API key configured")

    def opener(context):
        healthy.append(RecordingTracker(context, fail_on=3 if healthy else 0))
        return healthy[-1]

    with pytest.MonkeyPatch.context() as patch:
        for name in ("wandb", "mlflow", "trackio"):
            patch.setitem(sys.modules, name, types.ModuleType(name))
        config = smoke_config(tmp_path, report_to="wandb,mlflow,trackio")
    openers = {"wandb": broken_opener, "mlflow": opener, "trackio": opener}
    with pytest.warns(tracking.TrackerWarning) as warned:
        run = tracking.open_trackers(config, tmp_path, None, openers)
        write_lines(tmp_path, LINES[2:])
        run.sync()
        run.close()
    messages = [str(w.message) for w in warned]
    assert messages == [
        "report_to 'wandb' could not start (PermissionError: no API key configured); "
        "the run goes on without it, and metrics.jsonl has every line",
        "report_to 'trackio' failed (ConnectionError: the server went away); the run "
        "goes on without it, and metrics.jsonl has every line",
    ]
    mlflow, trackio = healthy
    assert mlflow.calls == expected_calls(LINES) and mlflow.closed
    assert trackio.calls == expected_calls(LINES[:2]) and not trackio.closed


def test_wandb_gets_each_line_with_its_step_axis_and_resumes_its_run(
    fake_wandb, tmp_path
):
    calls = fake_wandb.calls
    write_lines(tmp_path, LINES[:4])
    config = smoke_config(tmp_path, report_to="wandb")
    tracking.open_trackers(config, tmp_path, None).close()
    (first,) = calls["init"]
    assert first["resume"] == "allow" and first["dir"] == str(tmp_path)
    assert first["name"] == tmp_path.name and first["config"]["report_to"] == "wandb"
    assert tracking.read_tracker_ids(tmp_path) == {"wandb": first["id"]}
    assert calls["log"] == [
        {key: value for key, value in line.items() if value is not None}
        for line in LINES[:4]
    ]
    assert calls["define_metric"] == [
        ("sft/*", {"step_metric": "sft/step"}),
        ("eval/*", {"step_metric": "step"}),
        ("train/*", {"step_metric": "step"}),
    ]
    assert calls["finish"] == [True]

    truncate_metrics(tmp_path, 3)  # a resume from the step-0 checkpoint
    run = tracking.open_trackers(config, tmp_path, 0)
    write_lines(tmp_path, LINES[3:])
    run.sync()
    run.close()
    assert calls["init"][1]["id"] == first["id"]  # the same run, continued
    assert [line.get("step") for line in calls["log"][4:]] == [1, 2]


def test_a_new_run_in_the_folder_starts_a_new_wandb_run(fake_wandb, tmp_path):
    tracking.write_tracker_ids(tmp_path, {"wandb": "old-run"})
    tracking.open_trackers(smoke_config(tmp_path, report_to="wandb"), tmp_path, None)
    (started,) = fake_wandb.calls["init"]
    assert started["id"] != "old-run"
    assert tracking.read_tracker_ids(tmp_path)["wandb"] == started["id"]


def test_mlflow_gets_params_once_and_each_line_at_its_step(fake_mlflow, tmp_path):
    write_lines(tmp_path, LINES)
    config = smoke_config(tmp_path, report_to="mlflow")
    tracking.open_trackers(config, tmp_path, None).close()
    assert fake_mlflow["experiment"] == ["grpo-lab"]
    assert fake_mlflow["start_run"] == [{"run_id": None, "run_name": tmp_path.name}]
    (params,) = fake_mlflow["params"]
    assert params["lr"] == "0.0003" and params["task_options"] == '{"n_digits": 5}'
    assert fake_mlflow["metrics"] == [(s, v) for _, s, v in expected_calls(LINES)]
    assert fake_mlflow["end_run"] == [True]

    tracking.open_trackers(config, tmp_path, 2).close()  # resumed: nothing new
    assert fake_mlflow["start_run"][1] == {"run_id": "mlflow-run-1", "run_name": None}
    assert len(fake_mlflow["params"]) == 1 and len(fake_mlflow["metrics"]) == 5


# --- TensorBoard and Trackio, read back -----------------------------------------------


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def jsonl_scalars(
    lines: list[dict[str, Any]], step_key: str
) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard must show for the lines of one step axis."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for key, step, values in expected_calls(lines):
        if key == step_key:
            for tag, value in values.items():
                scalars.setdefault(tag, []).append((step, pytest.approx(value)))
    return scalars


@pytest.fixture
def trackio_store(tmp_path, monkeypatch) -> Path:
    """A fresh Trackio store in tmp_path (its folder is read when it is imported)."""
    pytest.importorskip("trackio")
    store = tmp_path / "trackio-store"
    monkeypatch.setenv("TRACKIO_DIR", str(store))
    monkeypatch.delenv("TRACKIO_PROJECT", raising=False)
    for name in [n for n in sys.modules if n == "trackio" or n.startswith("trackio.")]:
        monkeypatch.delitem(sys.modules, name)
    return store


@pytest.mark.slow
def test_a_run_reads_back_the_same_from_tensorboard_and_trackio(
    tmp_path, trackio_store
):
    pytest.importorskip("tensorboard")
    run_dir = tmp_path / "run"
    config = smoke_config(run_dir, report_to="tensorboard,trackio")
    with warnings.catch_warnings():
        warnings.simplefilter("error", tracking.TrackerWarning)
        loop.train(config, progress=False)
    lines = read_metrics(run_dir)
    assert [line.get("step") for line in lines] == [None, None, 0, 1, 2]

    board = run_dir / "tensorboard"
    assert tensorboard_scalars(board / "grpo") == jsonl_scalars(lines, "step")
    assert tensorboard_scalars(board / "sft") == jsonl_scalars(lines, "sft/step")

    from trackio.sqlite_storage import SQLiteStorage

    assert str(trackio_store) in str(SQLiteStorage.get_project_db_path("grpo-lab"))
    logged = SQLiteStorage.get_logs("grpo-lab", run="run")
    sent = [
        (row.pop("step"), {k: v for k, v in row.items() if k != "timestamp"})
        for row in logged
    ]
    assert sent == [(step, values) for _, step, values in expected_calls(lines)]


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path):
    pytest.importorskip("tensorboard")
    config = smoke_config(tmp_path, report_to="tensorboard")
    first = [{"step": s, "train/reward_mean": s / 10} for s in range(4)]
    write_lines(tmp_path, first)
    tracking.open_trackers(config, tmp_path, None).close()

    truncate_metrics(tmp_path, 2)  # back to the checkpoint at step 1
    again = [{"step": s, "train/reward_mean": s / 10 + 1} for s in (2, 3, 4)]
    run = tracking.open_trackers(config, tmp_path, 1)
    write_lines(tmp_path, again)
    run.sync()
    run.close()
    shown = tensorboard_scalars(tmp_path / "tensorboard" / "grpo")
    assert shown == jsonl_scalars(first[:2] + again, "step")
    assert len(list((tmp_path / "tensorboard" / "grpo").iterdir())) == 2


# --- through train() ------------------------------------------------------------------


def test_a_tracker_failing_mid_run_loses_nothing_and_mlflow_gets_every_line(
    tmp_path, fake_wandb, fake_mlflow, monkeypatch
):
    logged = fake_wandb.calls["log"]

    def log_then_fail(data):
        if len(logged) == 3:
            raise ConnectionError("wandb.ai is unreachable")
        logged.append(dict(data))

    monkeypatch.setattr(fake_wandb.run, "log", log_then_fail)
    run_dir = tmp_path / "run"
    config = smoke_config(run_dir, report_to="wandb,mlflow", checkpoint_every=1)
    with pytest.warns(tracking.TrackerWarning, match="'wandb' failed") as warned:
        result = loop.train(config, progress=False)
    assert len([w for w in warned if w.category is tracking.TrackerWarning]) == 1
    lines = read_metrics(run_dir)
    assert result.history == lines and len(lines) == 5
    assert (run_dir / "final_model" / "model.safetensors").exists()
    assert len(logged) == 3 and fake_wandb.calls["finish"] == []
    assert fake_mlflow["metrics"] == [(s, v) for _, s, v in expected_calls(lines)]
    assert fake_mlflow["end_run"] == [True]


def test_a_resumed_run_continues_its_tracker_run_with_the_new_lines_only(
    tmp_path, fake_mlflow
):
    run_dir = tmp_path / "run"
    loop.train(smoke_config(run_dir, report_to="mlflow", checkpoint_every=1), False)
    resumed = smoke_config(
        run_dir, report_to="mlflow", checkpoint_every=1, steps=3, resume=True
    )
    loop.train(resumed, progress=False)
    assert [call["run_id"] for call in fake_mlflow["start_run"]] == [
        None,
        "mlflow-run-1",
    ]
    lines = read_metrics(run_dir)
    assert [line.get("step") for line in lines] == [None, None, 0, 1, 2, 3]
    assert fake_mlflow["metrics"] == [(s, v) for _, s, v in expected_calls(lines)]
