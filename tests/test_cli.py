"""The grpo-lab command line: train flags, resume, plot, student notebooks."""

from __future__ import annotations

import json
import sys
import types

import pytest

from grpo_lab import cli
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.metrics import append_metrics


def parse(argv):
    return cli.build_parser().parse_args(argv)


def test_train_flags_build_the_config():
    config = cli.train_config(parse(["train", "--profile", "cpu", "--lr", "3e-4"]))
    assert config == TrainConfig.for_profile("cpu", lr=3e-4)


def test_resume_loads_the_saved_config_and_applies_new_flags(tmp_path):
    saved = TrainConfig.for_profile("cpu", lr=3e-4, steps=10, run_dir="elsewhere")
    (tmp_path / "config.json").write_text(saved.to_json())
    config = cli.train_config(
        parse(["train", "--resume", str(tmp_path), "--steps", "20"])
    )
    assert config.lr == 3e-4 and config.steps == 20
    assert config.resume and config.run_dir == str(tmp_path)
    with pytest.raises(SystemExit, match="does not exist"):
        cli.train_config(parse(["train", "--resume", str(tmp_path / "missing")]))


def test_bad_settings_exit_with_the_message(capsys):
    with pytest.raises(SystemExit, match="group_size must divide"):
        cli.main(["train", "--profile", "cpu", "--group-size", "3"])
    with pytest.raises(SystemExit):
        cli.main(["train", "--no-such-flag"])
    assert "unrecognized arguments" in capsys.readouterr().err


def test_train_runs_and_reports(tmp_path, capsys):
    code = cli.main(
        ["train", "--profile", "cpu", "--run-dir", str(tmp_path / "run"),
         "--tiny-hidden-size", "32", "--tiny-num-layers", "1",
         "--task-options", '{"n_digits": 3}', "--max-new-tokens", "5",
         "--steps", "1", "--rollout-batch-size", "16", "--group-size", "4",
         "--train-batch-size", "16", "--eval-size", "4", "--sft-max-steps", "0",
         "--no-progress"]
    )  # fmt: skip
    assert code == 0
    output = capsys.readouterr().out
    assert "held-out accuracy greedy" in output and "run written to" in output
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["steps"] == 1 and saved["run_dir"] == str(tmp_path / "run")


def test_plot_writes_curves(tmp_path, capsys):
    append_metrics(tmp_path, {"step": 1, "train/reward_mean": 0.5})
    assert cli.main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").exists()
    with pytest.raises(SystemExit, match="no metrics"):
        cli.main(["plot", str(tmp_path / "empty")])


def test_student_notebooks_calls_the_writer(tmp_path, monkeypatch, capsys):
    calls = []
    fake = types.ModuleType("grpo_lab.teaching.student")
    fake.write_student_notebooks = lambda source, out: (
        calls.append((source, out)) or [out]
    )
    monkeypatch.setitem(sys.modules, "grpo_lab.teaching.student", fake)
    source = tmp_path / "notebooks"
    source.mkdir()
    assert (
        cli.main(["student-notebooks", str(tmp_path / "out"), "--source", str(source)])
        == 0
    )
    assert calls == [(source, str(tmp_path / "out"))]
    assert "1 student notebooks written" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="is not a folder"):
        cli.main(["student-notebooks", "out", "--source", str(tmp_path / "missing")])
