"""Checkpoints: complete state, atomic files, skipping broken files, exact resume."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_lab.training import checkpoint as checkpoints
from grpo_lab.training.metrics import read_metrics, step_records, without_timing


def tiny_model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def test_round_trip_restores_weights_optimizer_and_every_rng(tmp_path):
    model, optimizer = tiny_model_and_optimizer()
    config = {"lr": 0.1, "task_options": {"n_digits": 5}}
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    path = checkpoints.save_checkpoint(tmp_path, 7, model, optimizer, config, 12)
    expected_draws = draws()
    assert path == tmp_path / "checkpoints" / "step_000007.pt"

    other_model, other_optimizer = tiny_model_and_optimizer(seed=5)
    found_path, payload = checkpoints.latest_checkpoint(tmp_path)
    state = checkpoints.restore_checkpoint(
        payload, found_path, other_model, other_optimizer
    )
    assert (state.step, state.metrics_offset, state.config) == (7, 12, config)
    assert draws() == expected_draws
    for name, tensor in model.state_dict().items():
        assert torch.equal(other_model.state_dict()[name], tensor)
    moments = optimizer.state_dict()["state"][0]["exp_avg_sq"]
    assert torch.equal(other_optimizer.state_dict()["state"][0]["exp_avg_sq"], moments)


def test_no_temporary_files_and_only_the_newest_are_kept(tmp_path):
    model, optimizer = tiny_model_and_optimizer()
    for step in (2, 4, 6):
        checkpoints.save_checkpoint(
            tmp_path, step, model, optimizer, {}, 0, keep_last=2
        )
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names == ["step_000004.pt", "step_000006.pt"]


def test_a_broken_newest_checkpoint_is_reported_and_the_older_one_named(tmp_path):
    model, optimizer = tiny_model_and_optimizer()
    checkpoints.save_checkpoint(tmp_path, 3, model, optimizer, {}, 5)
    (tmp_path / "checkpoints" / "step_000009.pt").write_bytes(b"not a checkpoint")
    (tmp_path / "checkpoints" / ".step_000010.pt.123.tmp").write_bytes(b"partial")
    with pytest.warns(checkpoints.CheckpointWarning) as warned:
        path, payload = checkpoints.latest_checkpoint(tmp_path)
    assert path.name == "step_000003.pt" and payload["metrics_offset"] == 5
    broken, resumed = (str(w.message) for w in warned)
    assert "step_000009.pt does not load (UnpicklingError" in broken
    assert "trying step_000003.pt" in broken
    assert "resuming from" in resumed and "step_000003.pt (step 3)" in resumed


def test_when_no_checkpoint_loads_each_one_is_named(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "step_000002.pt").write_bytes(b"garbage")
    torch.save({"step": 4}, folder / "step_000004.pt")
    with (
        pytest.warns(checkpoints.CheckpointWarning) as warned,
        pytest.raises(checkpoints.CheckpointError) as raised,
    ):
        checkpoints.latest_checkpoint(tmp_path)
    assert "trying step_000002.pt" in str(warned[0].message)
    assert "no older one" in str(warned[1].message)
    message = str(raised.value)
    assert "step_000004.pt: ValueError" in message and "lacks" in message
    assert "step_000002.pt: UnpicklingError" in message
    assert message.index("step_000004") < message.index("step_000002")


def test_retention_keeps_the_newest_checkpoints_that_load(tmp_path):
    model, optimizer = tiny_model_and_optimizer()
    checkpoints.save_checkpoint(tmp_path, 2, model, optimizer, {}, 0)
    folder = tmp_path / "checkpoints"
    for step in (4, 5):
        (folder / f"step_{step:06d}.pt").write_bytes(b"corrupt")
    checkpoints.save_checkpoint(tmp_path, 6, model, optimizer, {}, 0, keep_last=2)
    # Step 2 is the only good one before step 6: counting broken files would
    # have deleted it and kept step 5.
    assert sorted(os.listdir(folder)) == [
        "step_000002.pt",
        "step_000004.pt",
        "step_000005.pt",
        "step_000006.pt",
    ]
    checkpoints.save_checkpoint(tmp_path, 8, model, optimizer, {}, 0, keep_last=2)
    assert sorted(os.listdir(folder)) == ["step_000006.pt", "step_000008.pt"]
    (folder / "step_000012.pt").write_bytes(b"from an abandoned run")
    checkpoints.save_checkpoint(tmp_path, 10, model, optimizer, {}, 0, keep_last=1)
    assert sorted(os.listdir(folder)) == ["step_000010.pt", "step_000012.pt"]


def test_a_new_checkpoint_that_does_not_load_back_deletes_nothing(
    tmp_path, monkeypatch
):
    model, optimizer = tiny_model_and_optimizer()
    checkpoints.save_checkpoint(tmp_path, 2, model, optimizer, {}, 0)
    monkeypatch.setattr(torch, "save", lambda payload, handle: handle.write(b"bad"))
    with pytest.raises(checkpoints.CheckpointError, match="does not load back"):
        checkpoints.save_checkpoint(tmp_path, 4, model, optimizer, {}, 0, keep_last=1)
    assert [p.name for p in checkpoints.list_checkpoints(tmp_path)] == [
        "step_000002.pt",
        "step_000004.pt",
    ]
    checkpoints.verify_checkpoint(tmp_path / "checkpoints" / "step_000002.pt")


def test_a_failed_write_names_the_file_and_keeps_the_previous(tmp_path, monkeypatch):
    model, optimizer = tiny_model_and_optimizer()
    previous = checkpoints.save_checkpoint(tmp_path, 2, model, optimizer, {}, 7)
    previous_bytes = previous.read_bytes()

    def full_disk(payload, handle):
        handle.write(b"PK partial")
        raise RuntimeError(
            "[enforce fail at inline_container.cc:626] . unexpected pos 4160 vs 4054"
        )

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(checkpoints.CheckpointError) as raised:
        checkpoints.save_checkpoint(tmp_path, 4, model, optimizer, {}, 9, keep_last=1)
    message = str(raised.value)
    assert (
        f"could not write checkpoint {tmp_path}/checkpoints/step_000004.pt" in message
    )
    assert "enforce fail at inline_container.cc" in message
    assert "newest: step_000002.pt" in message
    assert os.listdir(tmp_path / "checkpoints") == ["step_000002.pt"]  # no temp file
    assert previous.read_bytes() == previous_bytes
    monkeypatch.undo()
    assert checkpoints.latest_checkpoint(tmp_path)[1]["metrics_offset"] == 7


def test_the_step_of_a_checkpoint_name(tmp_path):
    assert checkpoints.checkpoint_step(tmp_path / "step_000042.pt") == 42
    with pytest.raises(ValueError, match=r"must be named step_XXXXXX\.pt"):
        checkpoints.checkpoint_step("model.pt")


def test_no_checkpoint_gives_none(tmp_path):
    assert checkpoints.latest_checkpoint(tmp_path) is None
    assert checkpoints.list_checkpoints(tmp_path) == []


def test_bad_files_and_arguments_raise(tmp_path):
    model, optimizer = tiny_model_and_optimizer()
    torch.save({"step": 1}, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match="lacks"):
        checkpoints.load_checkpoint_file(tmp_path / "partial.pt")
    path = checkpoints.save_checkpoint(tmp_path, 1, model, optimizer, {}, 0)
    payload = torch.load(path, weights_only=True)
    payload["format_version"] = 99
    torch.save(payload, tmp_path / "future.pt")
    with pytest.raises(ValueError, match="format_version must be 1"):
        checkpoints.load_checkpoint_file(tmp_path / "future.pt")
    with pytest.raises(ValueError, match="step must be >= 0"):
        checkpoints.save_checkpoint(tmp_path, -1, model, optimizer, {}, 0)
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        checkpoints.save_checkpoint(tmp_path, 1, model, optimizer, {}, 0, keep_last=0)


# --- the save_pretrained folder beside each checkpoint ---------------------------


def test_a_mid_run_checkpoint_folder_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2, load_tokenizer
    from grpo_lab.training.config import TrainConfig
    from grpo_lab.training.loop import train

    config = TrainConfig.for_profile(
        "smoke", run_dir=str(tmp_path / "run"), checkpoint_every=1
    )
    train(config, progress=False)
    folder = tmp_path / "run" / "checkpoints" / "step_000001"
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    # The model at step 1, as the .pt checkpoint holds it.
    payload = checkpoints.load_checkpoint_file(folder.with_suffix(".pt"))
    run_tokenizer = build_char_tokenizer()
    sizes = {
        "hidden_size": config.tiny_hidden_size,
        "num_layers": config.tiny_num_layers,
        "intermediate_size": config.tiny_intermediate_size,
    }
    at_step = build_tiny_qwen2(run_tokenizer, seed=config.seed, **sizes)
    probe = torch.tensor([[2, 3, 4]])  # (1, 3)
    with torch.no_grad():
        untrained_logits = at_step(probe).logits
    at_step.load_state_dict(payload["model"])
    at_step.eval()

    text = "54321 reversed"
    ids = run_tokenizer(text, return_tensors="pt").input_ids  # (1, T)
    assert load_tokenizer(str(folder))(text).input_ids == ids[0].tolist()
    # AutoTokenizer opens it as a Qwen2 tokenizer (the config's model type),
    # which gives every character the run's id and decodes them back.
    auto_tokenizer = AutoTokenizer.from_pretrained(folder)
    assert auto_tokenizer(text).input_ids == ids[0].tolist()
    assert auto_tokenizer.decode(ids[0]) == text
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, at_step(ids).logits)  # (1, T, V)
        assert not torch.equal(loaded(probe).logits, untrained_logits)  # warmed up
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step_000001", "step_000001.pt", "step_000002", "step_000002.pt"]


def test_retention_deletes_each_folder_with_its_file(
    tmp_path, tiny_qwen2, char_tokenizer
):
    optimizer = torch.optim.AdamW(tiny_qwen2.parameters())
    folder = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        checkpoints.save_checkpoint(
            tmp_path, step, tiny_qwen2, optimizer, {}, 0, tokenizer=char_tokenizer
        )
    assert sorted(os.listdir(folder)) == [
        "step_000004",
        "step_000004.pt",
        "step_000006",
        "step_000006.pt",
    ]
    assert (folder / "step_000006" / "model.safetensors").is_file()
    assert (folder / "step_000006" / "tokenizer.json").is_file()
    (folder / "step_000005").mkdir()  # a folder whose file was never written
    checkpoints.save_checkpoint(
        tmp_path, 8, tiny_qwen2, optimizer, {}, 0, keep_last=1, tokenizer=char_tokenizer
    )
    assert sorted(os.listdir(folder)) == ["step_000008", "step_000008.pt"]


def test_saving_a_step_again_replaces_its_folder_whole(
    tmp_path, tiny_qwen2, char_tokenizer
):
    optimizer = torch.optim.AdamW(tiny_qwen2.parameters())
    path = checkpoints.save_checkpoint(
        tmp_path, 3, tiny_qwen2, optimizer, {}, 0, tokenizer=char_tokenizer
    )
    stale = checkpoints.pretrained_dir(path) / "stale.txt"
    stale.write_text("from the first save")
    with torch.no_grad():
        tiny_qwen2.model.embed_tokens.weight.add_(1.0)
    checkpoints.save_checkpoint(
        tmp_path, 3, tiny_qwen2, optimizer, {}, 0, tokenizer=char_tokenizer
    )
    assert not stale.exists()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "step_000003",
        "step_000003.pt",
    ]
    from safetensors.torch import load_file

    saved = load_file(checkpoints.pretrained_dir(path) / "model.safetensors")
    embedding = tiny_qwen2.model.embed_tokens.weight
    assert torch.equal(saved["model.embed_tokens.weight"], embedding)


def test_a_failed_folder_write_leaves_no_folder_and_the_previous_checkpoint(
    tmp_path, tiny_qwen2, char_tokenizer, monkeypatch
):
    optimizer = torch.optim.AdamW(tiny_qwen2.parameters())
    checkpoints.save_checkpoint(
        tmp_path, 2, tiny_qwen2, optimizer, {}, 0, tokenizer=char_tokenizer
    )

    def full_disk(folder, **kwargs):
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tiny_qwen2, "save_pretrained", full_disk)
    with pytest.raises(checkpoints.CheckpointError) as raised:
        checkpoints.save_checkpoint(
            tmp_path, 4, tiny_qwen2, optimizer, {}, 0, keep_last=1,
            tokenizer=char_tokenizer,
        )  # fmt: skip
    assert "could not write checkpoint" in str(raised.value)
    assert "No space left on device" in str(raised.value)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "step_000002",
        "step_000002.pt",
    ]
    assert (tmp_path / "checkpoints" / "step_000002" / "model.safetensors").is_file()

    monkeypatch.undo()  # now the folder is written and the .pt file fails

    def full_disk_at_the_file(payload, handle):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk_at_the_file)
    with pytest.raises(checkpoints.CheckpointError):
        checkpoints.save_checkpoint(
            tmp_path, 4, tiny_qwen2, optimizer, {}, 0, tokenizer=char_tokenizer
        )
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "step_000002",
        "step_000002.pt",
    ]


def test_the_folder_of_a_checkpoint_is_named_after_its_step(tmp_path):
    folder = checkpoints.pretrained_dir(tmp_path / "step_000042.pt")
    assert folder == tmp_path / "step_000042"
    with pytest.raises(ValueError, match=r"must be named step_XXXXXX\.pt"):
        checkpoints.pretrained_dir(tmp_path / "model.pt")


# A run small enough to finish in seconds; eval and checkpoints every 2 steps.
TINY_RUN_FLAGS = [
    "--profile", "cpu",
    "--tiny-hidden-size", "32",
    "--tiny-num-layers", "1",
    "--tiny-intermediate-size", "64",
    "--task-options", '{"n_digits": 3}',
    "--steps", "8",
    "--rollout-batch-size", "32",
    "--group-size", "4",
    "--train-batch-size", "32",
    "--max-new-tokens", "5",
    "--lr", "3e-3",
    "--eval-every", "2",
    "--eval-size", "16",
    "--checkpoint-every", "2",
    "--sft-max-steps", "3",
    "--sft-eval-every", "3",
    "--sft-eval-size", "8",
    "--sft-batch-size", "8",
    "--no-progress",
]  # fmt: skip


def run_cli(arguments: list[str], cwd: Path) -> subprocess.Popen:
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "grpo_lab.cli", "train", *arguments],
        cwd=cwd,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def comparable(run_dir: Path) -> list[dict]:
    return [without_timing(record) for record in read_metrics(run_dir)]


def kill_after_second_checkpoint_and_resume(
    flags: list[str], run_dir: Path, cwd: Path
) -> int:
    """Start a long run of ``flags`` in ``run_dir``, SIGKILL it once step 4's
    checkpoint exists, resume it to 8 steps; the metrics lines at the kill."""
    process = run_cli([*flags, "--run-dir", str(run_dir), "--steps", "400"], cwd)
    second_checkpoint = run_dir / "checkpoints" / "step_000004.pt"
    deadline = time.monotonic() + 300
    while not second_checkpoint.exists() and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    lines_at_kill = len(read_metrics(run_dir))
    resumed = run_cli(["--resume", str(run_dir), "--steps", "8", "--no-progress"], cwd)
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    return lines_at_kill


@pytest.mark.slow
def test_a_run_killed_with_sigkill_resumes_to_the_same_metrics(tmp_path):
    # Uninterrupted reference run.
    reference = tmp_path / "reference"
    finished = run_cli([*TINY_RUN_FLAGS, "--run-dir", str(reference)], tmp_path)
    output, _ = finished.communicate(timeout=300)
    assert finished.returncode == 0, output

    # The same run, killed once its second checkpoint after step 0 exists,
    # then resumed with the reference's step count.
    killed = tmp_path / "killed"
    lines_at_kill = kill_after_second_checkpoint_and_resume(
        TINY_RUN_FLAGS, killed, tmp_path
    )
    assert json.loads((killed / "config.json").read_text())["steps"] == 8
    assert 1 <= lines_at_kill < len(read_metrics(killed))
    assert len(step_records(read_metrics(killed))) == 9  # steps 0..8
    assert comparable(killed) == comparable(reference)


# A child that starts an atomic checkpoint write and blocks in the middle of it,
# after the temporary file is open, until it is killed.
KILLED_WRITER = """
import sys, time
from pathlib import Path
import torch
from grpo_lab.training import checkpoint

class Stall:
    def __reduce__(self):
        print("writing", flush=True)
        time.sleep(600)
        return (int, ())

path = Path(sys.argv[1]) / "checkpoints" / "step_000004.pt"
path.parent.mkdir(parents=True, exist_ok=True)
checkpoint.atomic_torch_save({"weights": torch.zeros(1000), "stall": Stall()}, path)
"""


def killed_write_leftovers(run_dir: Path) -> list[Path]:
    """Kill a checkpoint write half way; the temporary files it left behind."""
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(run_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline() == "writing\n"
    finally:
        process.kill()
        process.communicate(timeout=60)
    return sorted((run_dir / "checkpoints").glob(".*.tmp"))


def test_a_killed_write_leaves_a_temporary_file_the_next_start_removes(tmp_path):
    leftovers = killed_write_leftovers(tmp_path)
    assert [p.name.split(".")[1:3] for p in leftovers] == [["step_000004", "pt"]]
    assert not (tmp_path / "checkpoints" / "step_000004.pt").exists()
    assert checkpoints.remove_leftover_temporaries(tmp_path) == leftovers
    assert sorted(os.listdir(tmp_path / "checkpoints")) == []


def test_only_temporary_names_are_removed(tmp_path):
    model, optimizer = tiny_model_and_optimizer()
    checkpoints.save_checkpoint(tmp_path, 2, model, optimizer, {}, 0)
    folder = tmp_path / "checkpoints"
    planted = [
        folder / ".step_000004.pt.4242.tmp",
        folder / ".step_000004.4242.old",
        tmp_path / ".reference_model.pt.17.tmp",
        tmp_path / ".final_model.17.tmp",
    ]
    for path in planted[:3]:
        path.write_bytes(b"half")
    planted[3].mkdir()
    (planted[3] / "model.safetensors").write_bytes(b"half")
    kept = ["config.json", ".lock", "notes.tmp", ".hidden", "metrics.jsonl"]
    for name in kept:
        (tmp_path / name).write_text("{}")
    removed = checkpoints.remove_leftover_temporaries(tmp_path)
    assert sorted(removed) == sorted(planted)
    assert not any(path.exists() for path in planted)
    assert sorted(os.listdir(folder)) == ["step_000002.pt"]
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "checkpoints"])


@pytest.mark.slow
def test_a_resumed_run_starts_by_removing_a_killed_writes_leftovers(tmp_path):
    from grpo_lab.training import loop
    from grpo_lab.training.config import TrainConfig

    config = TrainConfig.for_profile(
        "smoke", run_dir=str(tmp_path / "run"), checkpoint_every=1
    )
    loop.train(config, progress=False)
    leftovers = killed_write_leftovers(tmp_path / "run")
    assert leftovers
    resumed = dataclasses.replace(config, resume=True, steps=3)
    loop.train(resumed, progress=False)
    assert not any(path.exists() for path in leftovers)
    names = os.listdir(tmp_path / "run" / "checkpoints")
    assert not [name for name in names if name.startswith(".")]
