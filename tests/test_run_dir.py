"""The run folder: one writer, no overwrite, resumes that keep the run's settings."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from grpo_lab.training import checkpoint as checkpoints
from grpo_lab.training import loop
from grpo_lab.training import run_dir as run_dirs
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.metrics import read_metrics, without_timing


def tiny_config(run_dir: Path, **overrides) -> TrainConfig:
    settings = {
        "run_dir": str(run_dir),
        "tiny_hidden_size": 32,
        "tiny_num_layers": 1,
        "tiny_intermediate_size": 64,
        "task_options": {"n_digits": 3},
        "max_new_tokens": 5,
        "rollout_batch_size": 16,
        "group_size": 4,
        "train_batch_size": 16,
        "steps": 2,
        "eval_every": 1,
        "eval_size": 4,
        "checkpoint_every": 1,
        "sft_max_steps": 0,
    }
    return TrainConfig.for_profile("cpu", **{**settings, **overrides})


@contextlib.contextmanager
def held_by_another_process(run_dir: Path) -> Iterator[int]:
    """A forked child holds the lock on ``run_dir``; yields its PID, then kill -9s it."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: lock, say so, wait to be killed
        try:
            os.close(read_end)
            run_dirs.lock_run_dir(run_dir)
            os.write(write_end, b"locked")
            time.sleep(120)
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        assert os.read(read_end, 6) == b"locked", "the child could not lock"
        yield pid
    finally:
        os.close(read_end)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def lock_in_a_child(run_dir: Path) -> bool:
    """Whether a forked child can take the lock on ``run_dir`` right now."""
    pid = os.fork()
    if pid == 0:
        try:
            run_dirs.lock_run_dir(run_dir)
            os._exit(0)
        except run_dirs.RunDirError:
            os._exit(1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


# --- the lock -----------------------------------------------------------------------


def test_a_second_process_is_refused_with_the_holders_pid(tmp_path):
    with held_by_another_process(tmp_path) as holder:
        assert (tmp_path / run_dirs.LOCK_FILE).read_text().strip() == str(holder)
        with pytest.raises(run_dirs.RunDirError, match=f"in use by process {holder}"):
            run_dirs.lock_run_dir(tmp_path)
        assert not run_dirs.holds_run_dir(tmp_path)
    # kill -9 ended the holder, and the kernel dropped its lock with it.
    run_dirs.lock_run_dir(tmp_path)
    assert (tmp_path / run_dirs.LOCK_FILE).read_text().strip() == str(os.getpid())
    run_dirs.release_run_dir(tmp_path)


def test_the_lock_is_reentrant_in_a_process_until_released(tmp_path):
    first = run_dirs.lock_run_dir(tmp_path)
    assert run_dirs.lock_run_dir(tmp_path) is first
    assert not lock_in_a_child(tmp_path)
    run_dirs.release_run_dir(tmp_path)
    assert not run_dirs.holds_run_dir(tmp_path)
    assert lock_in_a_child(tmp_path)
    run_dirs.release_run_dir(tmp_path)  # releasing twice does nothing


def test_the_lock_of_a_deleted_folder_is_dropped(tmp_path):
    temporary = tmp_path / "temporary"
    temporary.mkdir()
    lock = run_dirs.lock_run_dir(temporary)
    temporary.joinpath(run_dirs.LOCK_FILE).unlink()
    temporary.rmdir()
    run_dirs.lock_run_dir(tmp_path)  # any later lock forgets the deleted folder
    assert not run_dirs.holds_run_dir(temporary) and lock.handle.closed
    run_dirs.release_run_dir(tmp_path)


def test_train_refuses_a_run_dir_another_process_writes(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with held_by_another_process(run_dir) as holder:
        with pytest.raises(run_dirs.RunDirError, match=f"process {holder}"):
            loop.train(tiny_config(run_dir), progress=False)
        with pytest.raises(run_dirs.RunDirError, match=f"process {holder}"):
            loop.train(tiny_config(run_dir, resume=True), progress=False)
    assert not (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / "config.json").exists()


# --- opening a folder ---------------------------------------------------------------


def test_a_new_folder_gets_config_json_and_an_old_run_is_not_overwritten(tmp_path):
    config = tiny_config(tmp_path / "run")
    run_dir = run_dirs.open_run_dir(config)
    saved = run_dirs.read_saved_config(run_dir)
    assert saved == {**config.to_dict(), "inert_settings": {}}
    assert run_dirs.holds_run_dir(run_dir)
    run_dirs.release_run_dir(run_dir)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(run_dirs.RunDirError, match="already holds a run"):
        run_dirs.open_run_dir(config)
    assert not run_dirs.holds_run_dir(run_dir)  # a refusal leaves no lock behind


def test_a_folder_that_cannot_be_created_is_refused(tmp_path):
    (tmp_path / "a_file").write_text("x")
    for path in (tmp_path / "a_file", tmp_path / "a_file" / "run"):
        with pytest.raises(run_dirs.RunDirError, match="cannot be created"):
            run_dirs.open_run_dir(tiny_config(path))


def test_default_run_dirs_are_new_folders(tmp_path):
    first = run_dirs.new_run_dir("reverse", parent=tmp_path)
    second = run_dirs.new_run_dir("reverse", parent=tmp_path)
    assert first != second and first.is_dir() and second.is_dir()
    assert first.name.startswith("reverse-")


def test_a_missing_or_broken_config_json_is_named(tmp_path):
    with pytest.raises(run_dirs.RunDirError, match=r"config\.json does not exist"):
        run_dirs.read_saved_config(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(run_dirs.RunDirError, match="cannot be read"):
        run_dirs.read_saved_config(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(run_dirs.RunDirError, match="must hold a JSON object"):
        run_dirs.read_saved_config(tmp_path)


# --- resuming -----------------------------------------------------------------------


def test_resume_refuses_each_changed_setting_with_old_and_new_values(tmp_path):
    saved = tiny_config(tmp_path).to_dict()
    changed = tiny_config(
        tmp_path / "elsewhere", lr=1e-3, group_size=8, seed=3, resume=True, steps=9
    )
    with pytest.raises(run_dirs.RunDirError) as refused:
        run_dirs.check_resume_config(saved, changed, "config.json")
    problem = refused.value.problem  # the text before "(how to fix)"
    for part in ("lr 0.0003 -> 0.001", "group_size 4 -> 8", "seed 0 -> 3"):
        assert part in problem, problem
    assert "steps" not in problem and "run_dir" not in problem  # allowed, ignored
    allowed = tiny_config(tmp_path, steps=9, eval_every=2, checkpoint_every=0)
    assert run_dirs.check_resume_config(saved, allowed, "config.json") == {
        "steps": (2, 9),
        "eval_every": (1, 2),
        "checkpoint_every": (1, 0),
    }
    older = {k: v for k, v in saved.items() if k != "lr"}  # a field added later
    assert run_dirs.config_changes(older, tiny_config(tmp_path, lr=1e-3)) == {}


def test_resume_with_changed_settings_is_refused_before_anything_is_written(tmp_path):
    config = tiny_config(tmp_path / "run")
    loop.train(config, progress=False)
    before = {
        p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()
    }
    for change in ({"lr": 1e-3}, {"task": "addition", "task_options": {}}):
        resumed = dataclasses.replace(config, resume=True, **change)
        with pytest.raises(run_dirs.RunDirError, match="resuming would change"):
            loop.train(resumed, progress=False)
    after = {
        p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()
    }
    assert after == before


def test_an_allowed_change_is_recorded_in_resumes_jsonl(tmp_path):
    reference = loop.train(tiny_config(tmp_path / "reference", steps=3), progress=False)
    config = tiny_config(tmp_path / "run")
    loop.train(config, progress=False)
    result = loop.train(
        dataclasses.replace(config, resume=True, steps=3), progress=False
    )
    assert [without_timing(r) for r in result.history] == [
        without_timing(r) for r in reference.history
    ]
    (record,) = run_dirs.read_resumes(result.run_dir)
    assert record["step"] == 2 and record["checkpoint"] == "checkpoints/step_000002.pt"
    assert record["changes"] == {"steps": {"from": 2, "to": 3}}
    assert run_dirs.read_saved_config(result.run_dir)["steps"] == 3


def test_every_checkpoint_corrupt_stops_and_leaves_the_metrics(tmp_path):
    config = tiny_config(tmp_path / "run")
    loop.train(config, progress=False)
    run_dir = tmp_path / "run"
    for path in checkpoints.list_checkpoints(run_dir):
        path.write_bytes(b"corrupt")
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    resumed = dataclasses.replace(config, resume=True, steps=4)
    with (
        pytest.warns(checkpoints.CheckpointWarning) as warned,
        pytest.raises(checkpoints.CheckpointError, match=r"no checkpoint in .* loads"),
    ):
        loop.train(resumed, progress=False)
    assert [str(w.message).split(" does not load")[0][-14:] for w in warned] == [
        "step_000002.pt",
        "step_000001.pt",
    ]
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before
    assert [p.read_bytes() for p in checkpoints.list_checkpoints(run_dir)] == [
        b"corrupt",
        b"corrupt",
    ]
    assert run_dirs.read_saved_config(run_dir)["steps"] == 2
    assert run_dirs.read_resumes(run_dir) == []


def test_a_corrupt_newest_checkpoint_falls_back_to_the_older_one(tmp_path):
    reference = loop.train(tiny_config(tmp_path / "reference"), progress=False)
    config = tiny_config(tmp_path / "run", checkpoint_every=1)
    loop.train(config, progress=False)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000002.pt").write_bytes(b"corrupt")
    with pytest.warns(checkpoints.CheckpointWarning) as warned:
        result = loop.train(dataclasses.replace(config, resume=True), progress=False)
    messages = [
        str(w.message) for w in warned if w.category is checkpoints.CheckpointWarning
    ]
    assert "step_000002.pt does not load" in messages[0]
    assert "trying step_000001.pt" in messages[0]
    assert "resuming from" in messages[1] and "step_000001.pt" in messages[1]
    assert [without_timing(r) for r in result.history] == [
        without_timing(r) for r in reference.history
    ]
    assert run_dirs.read_resumes(run_dir)[0]["step"] == 1


def test_metric_lines_without_a_checkpoint_are_not_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    loop.train(tiny_config(run_dir, checkpoint_every=0), progress=False)
    for path in checkpoints.list_checkpoints(run_dir):
        path.unlink()
    lines = len(read_metrics(run_dir))
    with pytest.raises(run_dirs.RunDirError, match=f"has {lines} metric lines"):
        loop.train(tiny_config(run_dir, resume=True), progress=False)
    assert len(read_metrics(run_dir)) == lines
    (run_dir / "metrics.jsonl").unlink()  # as the message says: start over
    result = loop.train(tiny_config(run_dir, resume=True), progress=False)
    assert [r["step"] for r in result.history] == [0, 1, 2]


@pytest.mark.slow
def test_two_command_line_runs_in_one_folder(tmp_path):
    from grpo_lab.cli import main as cli

    run_dir = tmp_path / "run"
    flags = [
        "--profile", "cpu", "--tiny-hidden-size", "32", "--tiny-num-layers", "1",
        "--tiny-intermediate-size", "64", "--task-options", '{"n_digits": 3}',
        "--max-new-tokens", "5", "--rollout-batch-size", "16", "--group-size", "4",
        "--train-batch-size", "16", "--eval-size", "4", "--sft-max-steps", "0",
        "--checkpoint-every", "1", "--no-progress", "--run-dir", str(run_dir),
    ]  # fmt: skip
    first = subprocess.Popen(
        [sys.executable, "-m", "grpo_lab.cli", "train", *flags, "--steps", "1000"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not checkpoints.list_checkpoints(run_dir):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        for argv in (
            ["train", *flags, "--steps", "2"],
            ["train", "--resume", str(run_dir)],
        ):
            assert cli.main(argv) == 2
    finally:
        first.kill()
        first.wait()
    assert not run_dirs.holds_run_dir(run_dir)
    steps = [r["step"] for r in read_metrics(run_dir) if "step" in r]
    assert len(steps) == len(set(steps))  # no step written twice
    assert json.loads((run_dir / "config.json").read_text())["steps"] == 1000
