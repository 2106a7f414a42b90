"""Every notebook runs under every profile's sizes, on the machine that profile is
chosen on, until the first real CUDA or Hub call, and that call is the only
reason it stops.

The GPU profiles' machines are faked in the kernel as tests/test_notebook_profiles.py
fakes them in-process (a T4 for small-gpu, an H100 for gpu): ``torch.cuda`` says
a GPU is there, so the notebook takes its GPU sizes and its GPU code paths, and
the first tensor that really goes to the GPU raises (this torch has none, or the
test does not use it). The Hub is offline (``HF_HUB_OFFLINE=1``), so the first
download raises too. ``STOPS`` names, per profile, each notebook that stops and
the cell and the reason; every other notebook runs to its end. The cpu profile's
sizes run to the end in ``make test`` (nbval over notebooks/).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
import torch
from jupyter_client.manager import start_new_kernel

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(path.name for path in NOTEBOOK_DIR.glob("*.ipynb"))
GIB = 1024**3
# The machine each profile is chosen on: (GPU name, total memory in bytes, major
# compute capability); None: no GPU.
MACHINES = {
    "smoke": None,
    "small-gpu": ("Tesla T4", 15 * GIB, 7),
    "gpu": ("NVIDIA H100 80GB HBM3", 80 * GIB, 9),
}
FAKE_GPU = """\
import types, torch
_name, _total, _major = {gpu!r}
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.get_device_properties = lambda *_: types.SimpleNamespace(
    name=_name, total_memory=_total, major=_major, minor=0
)
torch.cuda.get_device_name = lambda *_: _name
torch.cuda.get_device_capability = lambda *_: (_major, 0)
torch.cuda.mem_get_info = lambda *_: (_total, _total)
torch.cuda.is_bf16_supported = lambda *_, **__: _major >= 8
del types, torch
"""
# What a real CUDA call or a Hub download raises here, by reason.
REASONS = {
    "cuda": r"Torch not compiled with CUDA enabled|Found no NVIDIA driver|"
    r"No CUDA GPUs are available|CUDA driver",
    "hub": r"offline mode|HF_HUB_OFFLINE|LocalEntryNotFoundError|"
    r"couldn't connect to 'https://huggingface.co'",
}
# profile -> {notebook: (id of the cell that stops, reason)}; the rest run to the end.
# 08 loads the profile's Hub model; 09's explorer, 13's comparison and 15's
# teacher train the tiny model on the profile's device.
GPU_STOPS = {
    "08_training_loop.ipynb": ("cell-12", "hub"),
    "09_hyperparameter_explorer.ipynb": ("cell-02", "cuda"),
    "13_lora_for_rl.ipynb": ("13-15", "cuda"),
    "15_on_policy_distillation.ipynb": ("opd-16", "cuda"),
}
STOPS: dict[str, dict[str, tuple[str, str]]] = {
    "smoke": {},
    "small-gpu": GPU_STOPS,
    "gpu": GPU_STOPS,
}


# The small-gpu case runs the notebooks that size or choose anything by it: those
# that name small-gpu sizes or a size table of grpo_lab/teaching/profile.py, or
# read the machine (with $GRPO_LAB_PROFILE set, the package reads it nowhere
# else: grpo_lab.training.config.memory chooses a profile only without it). Every other notebook's small-gpu sizes are its gpu sizes
# (sizes_for_profile's default) on the same faked code paths, so its gpu case
# covers both; test_a_skipped_small_gpu_case_has_the_gpu_sizes holds that true.
SIZED_BY_SMALL_GPU_WORDS = ("small-gpu", "small_gpu", "_SIZES")
MACHINE_READING_WORDS = (
    "chosen_profile", "get_device_properties", "get_device_name", "mem_get_info",
    "get_device_capability", "is_bf16_supported", "device_count",
    'sizes["profile"])', "training.config.memory",
)  # fmt: skip


def small_gpu_runs_as_gpu(name: str) -> bool:
    source = (NOTEBOOK_DIR / name).read_text().replace('\\"', '"')
    words = SIZED_BY_SMALL_GPU_WORDS + MACHINE_READING_WORDS
    return not any(word in source for word in words)


CASES = [
    (name, profile)
    for name in NOTEBOOKS
    for profile in MACHINES
    if not (profile == "small-gpu" and small_gpu_runs_as_gpu(name))
]


def run_until_stopped(path: Path, profile: str, cell_timeout: float = 600.0):
    """Run ``path``'s code cells in a fresh kernel under ``profile`` on its faked
    machine; None when every cell ran, else (cell id, error name, error text) of
    the first cell that raised."""
    notebook = nbformat.read(path, as_version=4)
    environment = {
        **os.environ,
        "GRPO_LAB_PROFILE": profile,
        "HF_HUB_OFFLINE": "1",
        "MPLBACKEND": "agg",
    }
    manager, client = start_new_kernel(cwd=str(path.parent), env=environment)
    try:
        cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
        if MACHINES[profile] is not None:
            fake = nbformat.v4.new_code_cell(FAKE_GPU.format(gpu=MACHINES[profile]))
            fake.id = "fake-gpu"
            cells.insert(0, fake)
        for cell in cells:
            reply = client.execute_interactive(
                cell.source, allow_stdin=False, timeout=cell_timeout,
                output_hook=lambda message: None,
            )  # fmt: skip
            content = reply["content"]
            if content["status"] != "ok":
                return cell.get("id"), content["ename"], content["evalue"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return None


@pytest.mark.slow
@pytest.mark.parametrize(("name", "profile"), CASES)
def test_every_notebook_runs_under_every_profile(name, profile, tmp_path):
    # The notebooks write their runs beside themselves: a copy in tmp_path.
    path = tmp_path / name
    path.write_bytes((NOTEBOOK_DIR / name).read_bytes())
    stopped = run_until_stopped(path, profile)
    expected = STOPS[profile].get(name)
    if expected is None:
        assert stopped is None, f"{name} on {profile} stopped at {stopped}"
        return
    cell_id, reason = expected
    assert stopped is not None, f"{name} on {profile} ran to the end"
    assert stopped[0] == cell_id, f"{name} on {profile} stopped at {stopped}"
    assert re.search(REASONS[reason], f"{stopped[1]}: {stopped[2]}"), stopped


def sizes_under(name: str, profile: str, monkeypatch) -> dict:
    """``sizes`` as the notebook's first cell that calls sizes_for_profile
    leaves it, under ``profile`` (line magics left out)."""
    notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    (cell, *_) = [c for c in notebook.cells if "sizes_for_profile(" in c.source]
    source = "\n".join(
        line for line in cell.source.splitlines() if not line.startswith("%")
    )
    monkeypatch.setenv("GRPO_LAB_PROFILE", profile)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as faked
    namespace: dict = {}
    exec(compile(source, name, "exec"), namespace)
    return {key: value for key, value in namespace["sizes"].items() if key != "profile"}


@pytest.mark.parametrize(
    "name", [name for name in NOTEBOOKS if small_gpu_runs_as_gpu(name)]
)
def test_a_skipped_small_gpu_case_has_the_gpu_sizes(name, monkeypatch, capsys):
    assert sizes_under(name, "small-gpu", monkeypatch) == sizes_under(
        name, "gpu", monkeypatch
    )


def test_the_small_gpu_case_runs_where_sizes_differ():
    # 08, 09, 13 and 15 size their runs by profile tables; 00 names the profiles.
    running = {name[:2] for name, profile in CASES if profile == "small-gpu"}
    assert {"00", "08", "09", "13", "15"} <= running
