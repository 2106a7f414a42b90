"""Every notebook's parameters cell runs under every profile, on the machine it
would be chosen on: no GPU (cpu, smoke), a 16 GB T4 (small-gpu) and an 80 GB GPU
(gpu), with CUDA and its memory faked where the profile code reads them."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from grpo_lab.teaching.profile import (
    EXPLORER_SIZES,
    TRAINING_LOOP_SIZES,
    sizes_for_profile,
)
from grpo_lab.training.config import PROFILE_VARIABLE, PROFILES, chosen_profile

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
GIB = 1024**3
# The GPU each profile is meant for: (name, total memory in bytes); None: no GPU.
MACHINES = {
    "cpu": None,
    "smoke": None,
    "small-gpu": ("Tesla T4", 15 * GIB),  # 15.0 GiB as torch reports a T4
    "gpu": ("NVIDIA H100 80GB HBM3", 80 * GIB),
}


def fake_machine(monkeypatch, gpu: tuple[str, int] | None) -> None:
    """torch.cuda as it looks on ``gpu`` (no GPU when None)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu is not None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(gpu is not None))
    if gpu is None:
        return
    name, total = gpu
    properties = types.SimpleNamespace(name=name, total_memory=total, major=7)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: properties)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *_: (total, total))


def parameters_cell(path: Path) -> str:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    (cell,) = [c for c in cells if "parameters" in c["metadata"].get("tags", [])]
    return "".join(cell["source"])


def run_parameters_cell(path: Path) -> dict:
    namespace: dict = {}
    exec(compile(parameters_cell(path), str(path), "exec"), namespace)
    return namespace["sizes"]


@pytest.mark.parametrize("profile", PROFILES)
def test_the_machine_of_each_profile_chooses_it(profile, monkeypatch):
    fake_machine(monkeypatch, MACHINES[profile])
    monkeypatch.delenv(PROFILE_VARIABLE, raising=False)
    expected = {"smoke": "cpu"}.get(profile, profile)  # smoke is only ever asked for
    assert chosen_profile() == expected
    monkeypatch.setenv(PROFILE_VARIABLE, profile)
    assert chosen_profile() == profile


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_parameters_cell_runs_under_every_profile(
    path, profile, monkeypatch, capsys
):
    fake_machine(monkeypatch, MACHINES[profile])
    monkeypatch.setenv(PROFILE_VARIABLE, profile)
    sizes = run_parameters_cell(path)
    assert sizes["profile"] == profile
    if profile in ("cpu", "smoke"):
        return
    # On its own machine, without the variable, the profile is chosen by memory.
    monkeypatch.delenv(PROFILE_VARIABLE)
    assert run_parameters_cell(path) == sizes


@pytest.mark.parametrize("table", [TRAINING_LOOP_SIZES, EXPLORER_SIZES])
def test_the_training_notebooks_name_their_small_gpu_sizes(table):
    assert set(table) == set(PROFILES)
    small, gpu = (sizes_for_profile(**table, profile=p) for p in ("small-gpu", "gpu"))
    assert small != {**gpu, "profile": "small-gpu"}  # its own sizes, not gpu's


def test_small_gpu_takes_the_gpu_sizes_unless_given():
    cpu, gpu = {"batch": 4, "length": 8}, {"batch": 64}
    assert sizes_for_profile(cpu, gpu, profile="small-gpu") == {
        "batch": 64,
        "length": 8,
        "profile": "small-gpu",
    }
    given = sizes_for_profile(cpu, gpu, profile="small-gpu", small_gpu={"batch": 16})
    assert given["batch"] == 16
    assert sizes_for_profile(cpu, gpu, profile="gpu")["batch"] == 64


def test_sizes_for_profile_refuses_unknown_names_and_sizes():
    with pytest.raises(ValueError, match=r"sizes are given per profile .*\['gpus'\]"):
        sizes_for_profile({"batch": 4}, gpus={"batch": 8})
    with pytest.raises(ValueError, match=r"small-gpu sizes may only override cpu "):
        sizes_for_profile({"batch": 4}, small_gpu={"width": 8}, profile="small-gpu")
    with pytest.raises(ValueError, match=r"profile must be one of .*got 'tpu'"):
        sizes_for_profile({"batch": 4}, profile="tpu")
