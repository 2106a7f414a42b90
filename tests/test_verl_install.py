"""The verl install line the launch README prints resolves under pip, as written.

``pip install --dry-run --ignore-installed`` resolves the line for a fresh
environment of this Python against the package index (pip reads each wheel's
metadata, downloads no wheel), with this checkout in the place of
PATH/TO/grpo-lab. It runs in the main environment (the export needs no verl),
but not beside the other tests: it waits on the index for minutes on a busy
machine and uses little CPU, so it is marked ``index``, and ``make test`` runs it
in the background beside the environment builds (``-m index``) while the main
run leaves it out (``-m "not index"``).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_lab.integrations.verl.launch import (
    GRPO_LAB_SOURCE,
    install_line,
    write_launch_folder,
)
from grpo_lab.training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def readme_install_line(folder: Path) -> str:
    lines = (folder / "README.md").read_text().splitlines()
    (line,) = [line for line in lines if line.startswith("pip install")]
    return line


def test_the_readmes_print_the_one_install_line(tmp_path):
    config = TrainConfig.for_profile("gpu", task="reverse", eval_size=8)
    write_launch_folder(config, tmp_path / "launch")
    assert readme_install_line(tmp_path / "launch") == install_line()
    assert install_line() in (ROOT / "docs" / "scaling_out.md").read_text()
    assert "verl[vllm]" not in install_line()


@pytest.mark.index
def test_the_install_line_resolves_under_pip(tmp_path):
    words = shlex.split(install_line().replace(GRPO_LAB_SOURCE, str(ROOT)))
    assert words[:2] == ["pip", "install"]
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet"]
    command += ["--ignore-installed", "--report", str(report), *words[2:]]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    chosen = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert chosen["verl"] == "0.9.1" and chosen["vllm"] == "0.24.0"
    assert chosen["torch"] == "2.11.0"  # vllm 0.24.0's pin
    assert chosen["transformers"].startswith("5.10.")
    assert chosen["grpo-lab"] == "0.1.0"
