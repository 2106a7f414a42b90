"""``grpo-lab --help`` and every ``grpo-lab CMD --help`` answer without torch, and
show each setting's default and profile values."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_lab.cli import flags as cli_flags
from grpo_lab.cli import main as cli
from grpo_lab.training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = [[], *([name] for name in cli.COMMANDS)]
# Modules that take seconds to import; none may load for --help.
HEAVY = ("torch", "transformers", "numpy", "matplotlib")


def imported_modules(arguments: list[str]) -> tuple[set[str], str]:
    """The modules ``python -X importtime -m grpo_lab.cli ARGS`` imports, and its
    output."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "grpo_lab.cli", *arguments],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "import time:" in line]
    names = {line.rsplit("|", 1)[-1].strip() for line in lines}
    return names, done.stdout


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "grpo-lab")
def test_help_imports_no_torch(command):
    modules, output = imported_modules([*command, "--help"])
    assert "grpo_lab.cli.flags" in modules  # the importtime lines were read
    loaded = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert loaded == [], f"--help imported {loaded[:5]}"
    assert output.startswith("usage: grpo-lab")


def test_the_stored_flag_table_is_current():
    # Fails after TrainConfig changes: run `python -m grpo_lab.cli.flags`.
    assert cli_flags.stored_table() == cli_flags.flag_table()


def test_a_stale_table_is_not_used(monkeypatch):
    monkeypatch.setattr(cli_flags, "config_digest", lambda: "another config.py")
    assert cli_flags.stored_table() is None
    assert cli_flags.current_table() == {
        **cli_flags.flag_table(),
        "config_sha256": "another config.py",
    }


def test_train_help_shows_defaults_and_profile_values(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    cpu, gpu = TrainConfig.for_profile("cpu"), TrainConfig.for_profile("gpu")
    assert cpu.lr != gpu.lr
    assert f"(default: {cpu.lr}; gpu: {gpu.lr}" in text
    assert "--seed SEED Seed of the model weights" in text
    assert f"(default: {cpu.seed})" in text
    assert "--profile {cpu,gpu,small-gpu,smoke}" in text
    assert "(default: chosen by the machine, or $GRPO_LAB_PROFILE)" in text


def test_other_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["grade", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "seconds one exercise may take (default: 60)" in text
    assert text.count("(default: 60") == 1  # said once, not twice


def test_flags_parse_to_the_field_types():
    arguments = cli.build_parser().parse_args(
        ["train", "--lr", "1e-3", "--max-new-tokens", "none", "--steps", "7"]
    )
    assert (arguments.lr, arguments.max_new_tokens, arguments.steps) == (1e-3, None, 7)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["train", "--steps", "seven"])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::grpo_lab.training.sft.WarmUpWarning")
def test_train_shows_progress_for_the_warm_up_steps_and_evaluation(tmp_path, capsys):
    smoke = ["train", "--profile", "smoke", "--steps", "1"]  # 2 warm-up steps
    assert cli.main([*smoke, "--run-dir", str(tmp_path / "shown")]) == 0
    bars = capsys.readouterr().err
    assert "SFT warm-up: 100%" in bars and "2/2" in bars
    assert "GRPO: 100%" in bars and "1/1" in bars
    assert "evaluation at step 0" in bars and "evaluation at step 1" in bars
    assert (
        cli.main([*smoke, "--no-progress", "--run-dir", str(tmp_path / "quiet")]) == 0
    )
    assert "it/s" not in capsys.readouterr().err
