"""The conda environment, the Makefile and pyproject.toml install the same thing."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

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
