"""The conda environment, the Makefile and pyproject.toml install the same thing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _conda_pip_lines() -> list[str]:
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_sections = [d for d in environment["dependencies"] if isinstance(d, dict)]
    assert len(pip_sections) == 1, "environment.yml needs exactly one pip section"
    return pip_sections[0]["pip"]


def _makefile_variable(name: str) -> str:
    match = re.search(rf"^{name} \?= (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, f"Makefile defines no {name}"
    return match.group(1).strip()


def _base_requirement(name: str) -> Requirement:
    for line in _pyproject()["project"]["dependencies"]:
        requirement = Requirement(line)
        if requirement.name == name:
            return requirement
    raise AssertionError(f"pyproject.toml does not depend on {name}")


def test_conda_installs_the_package_with_the_makefile_extras():
    editable = [line for line in _conda_pip_lines() if line.startswith("-e ")]
    assert len(editable) == 1
    extras = re.fullmatch(r"-e \.\[([a-z,]+)\]", editable[0]).group(1).split(",")
    assert sorted(extras) == sorted(_makefile_variable("EXTRAS").split(","))
    declared = _pyproject()["project"]["optional-dependencies"]
    assert set(extras) <= set(declared)


def test_conda_and_makefile_pin_the_same_torch_inside_the_package_range():
    conda_torch = [line for line in _conda_pip_lines() if line.startswith("torch")]
    assert conda_torch == [_makefile_variable("TORCH")]
    pinned = Requirement(conda_torch[0]).specifier
    (pinned_version,) = [spec.version for spec in pinned]
    assert _base_requirement("torch").specifier.contains(pinned_version)


def test_conda_takes_torch_from_the_makefiles_cpu_index():
    indexes = [line for line in _conda_pip_lines() if line.startswith("--")]
    match = re.search(
        r"^TORCH_CPU_INDEX := (.+)$", (ROOT / "Makefile").read_text(), re.M
    )
    assert indexes == [f"--extra-index-url {match.group(1).strip()}"]


def test_conda_python_satisfies_requires_python():
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    python = next(d for d in environment["dependencies"] if str(d).startswith("python"))
    version = python.split("=", 1)[1]
    assert SpecifierSet(_pyproject()["project"]["requires-python"]).contains(version)


def test_vllm_extra_agrees_with_the_base_pins():
    # vllm 0.31.0 pins torch==2.13.0 and transformers>=5.10.4,<5.18.
    (vllm,) = [
        Requirement(r) for r in _pyproject()["project"]["optional-dependencies"]["vllm"]
    ]
    assert str(vllm.specifier) == "==0.31.0"
    assert _base_requirement("torch").specifier.contains("2.13.0")
    transformers = _base_requirement("transformers").specifier
    assert transformers.contains("5.10.4") and not transformers.contains("5.18.0")


# --- how `make` builds the environment ---------------------------------------

FAKE_PYTHON = """#!/bin/sh
# Records each call; a torch install through an extra index fails, as if the
# index could not be reached and nothing else served torch.
echo "$*" >> "{log}"
case "$*" in *--extra-index-url*) exit 1 ;; esac
exit 0
"""


def _plain_environment() -> dict[str, str]:
    """This process's environment less the flags an outer `make test` passes down."""
    outer = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")
    return {key: value for key, value in os.environ.items() if key not in outer}


def _build_with_fake_python(tmp_path: Path, nvidia_smi: bool) -> tuple[str, list[str]]:
    """Run the Makefile's environment build with a stand-in python; what make
    printed and the stand-in's calls."""
    if shutil.which("make") is None:
        pytest.skip("needs make")
    venv, tools = tmp_path / "venv", tmp_path / "tools"
    (venv / "bin").mkdir(parents=True)
    tools.mkdir()
    log = tmp_path / "calls.log"
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON.format(log=log))
    python.chmod(0o755)
    if nvidia_smi:
        (tools / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (tools / "nvidia-smi").chmod(0o755)
    path = f"{tools}:/usr/bin:/bin"
    if not nvidia_smi and shutil.which("nvidia-smi", path=path):
        pytest.skip("this machine has nvidia-smi in /usr/bin or /bin")
    done = subprocess.run(
        ["make", "--no-print-directory", f"VENV={venv}", f"{venv}/.grpo-lab-installed"],
        cwd=ROOT,
        env={**_plain_environment(), "PATH": path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (venv / ".grpo-lab-installed").exists()
    return done.stdout, log.read_text().splitlines()


def test_cpu_machine_asks_the_cpu_index_briefly_then_falls_back(tmp_path):
    printed, calls = _build_with_fake_python(tmp_path, nvidia_smi=False)
    torch = _makefile_variable("TORCH")
    index, plain, package = calls
    # First the CPU wheel index, with a short timeout and no retries...
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in index
    timeout = int(re.search(r"--timeout (\d+)", index).group(1))
    assert timeout <= 30 and "--retries 0" in index and index.endswith(torch)
    # ...and, when that fails, pip with its own settings; then the package.
    assert plain == f"-m pip install --progress-bar on {torch}"
    assert (
        package
        == f"-m pip install --progress-bar on -e .[{_makefile_variable('EXTRAS')}]"
    )
    # Every step says what it does.
    assert [line for line in printed.splitlines() if line.startswith("==> [")] == [
        f"==> [1/3] Python environment in {tmp_path / 'venv'}",
        f"==> [2/3] {torch} from https://download.pytorch.org/whl/cpu "
        "(the largest download)",
        f"==> [3/3] grpo-lab (editable) with the extras [{_makefile_variable('EXTRAS')}]",
    ]


def test_gpu_machine_takes_torch_from_pips_own_index(tmp_path):
    printed, calls = _build_with_fake_python(tmp_path, nvidia_smi=True)
    assert calls[0] == f"-m pip install --progress-bar on {_makefile_variable('TORCH')}"
    assert len(calls) == 2 and "pip's configured index" in printed


def test_environment_build_is_not_silent():
    makefile = (ROOT / "Makefile").read_text()
    assert "--quiet" not in makefile and " -q " not in makefile
    assert "PIP_INSTALL := $(PY) -m pip install --progress-bar on" in makefile


def test_make_lab_listens_on_localhost_and_allows_root_as_root():
    if shutil.which("make") is None:
        pytest.skip("needs make")
    dry_run = subprocess.run(
        ["make", "-n", "-o", ".venv/.grpo-lab-installed", "lab", "LAB_ARGS=--x=1"],
        cwd=ROOT,
        env=_plain_environment(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    write, serve = dry_run.splitlines()  # the student's copies, then the server
    assert write == ".venv/bin/grpo-lab notebooks my_notebooks"
    assert serve.startswith(".venv/bin/jupyter lab ")
    assert "my_notebooks/" in serve.split() and "notebooks/" not in serve.split()
    assert "--ServerApp.ip=127.0.0.1" in dry_run.split()
    assert ("--allow-root" in dry_run.split()) == (os.geteuid() == 0)
    assert dry_run.endswith("--x=1")
