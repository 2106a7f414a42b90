"""An exported TRL folder trains on 2 processes, and TRL's global batch is the config's.

``grpo-lab export trl --gpus 2`` writes the folder; torchrun starts its
train.py on 2 CPU processes (``--use-cpu``: accelerate's MULTI_CPU state, gloo)
for 2 optimizer steps of the tiny model the export saved beside it. A wrapper
runs train.py unchanged with two observers: the reward function records every
row it scores (rank, prompt, completion length), and ``GRPOTrainer.train``
records the batch settings TRL runs with and the process group's backend. The
global batch is then read from what TRL did: the rows scored per generation
round and per optimizer step over both processes, the groups of
``num_generations`` completions of one prompt, and TRL's own count of the
tokens it consumed (``num_input_tokens_seen``, gathered over the processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from grpo_lab.cli import main as cli
from grpo_lab.models import load_tokenizer
from grpo_lab.training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
PROCESSES = 2
STEPS = 2

# train.py run as __main__ with its reward function and GRPOTrainer.train
# observed; each process appends JSON lines to OBSERVED.
WRAPPER = """\
import json, os, runpy, sys

import torch
from trl import GRPOTrainer

import grpo_lab.integrations.trl.trainer as trainer_module

OBSERVED = os.environ["OBSERVED"]
RANK = int(os.environ["RANK"])


def record(**values):
    with open(OBSERVED, "a") as file:
        file.write(json.dumps({"rank": RANK, **values}) + "\\n")


make_reward = trainer_module.trl_reward_function


def recording_reward_function(task):
    reward = make_reward(task)

    def recorded(prompts, completions, completion_ids, **kwargs):
        record(kind="rows", prompts=list(prompts),
               completion_lengths=[len(ids) for ids in completion_ids])
        return reward(prompts, completions, completion_ids=completion_ids, **kwargs)

    recorded.__name__ = reward.__name__
    return recorded


trainer_module.trl_reward_function = recording_reward_function
train = GRPOTrainer.train


def recording_train(self, *args, **kwargs):
    record(kind="trainer", processes=self.accelerator.num_processes,
           backend=torch.distributed.get_backend(),
           per_device_train_batch_size=self.args.per_device_train_batch_size,
           gradient_accumulation_steps=self.args.gradient_accumulation_steps,
           generation_batch_size=self.args.generation_batch_size,
           num_generations=self.num_generations)
    return train(self, *args, **kwargs)


GRPOTrainer.train = recording_train
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

EXPORT = [
    "--profile", "cpu", "--task-options", '{"n_digits": 3}',
    "--rollout-batch-size", "8", "--train-batch-size", "8", "--group-size", "4",
    "--gradient-accumulation-steps", "4", "--max-new-tokens", "6",
    "--eval-every", "0", "--sft-max-steps", "0", "--gpus", str(PROCESSES),
]  # fmt: skip


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """(folder, observations, trainer_state) of the 2-process run."""
    root = tmp_path_factory.mktemp("trl_processes")
    folder = root / "trl_run"
    assert cli.main(["export", "trl", *EXPORT, "--out", str(folder)]) == 0
    (root / "wrapper.py").write_text(WRAPPER)
    observed = root / "observed.jsonl"
    env = {**os.environ, "OBSERVED": str(observed), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")])
    )
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={PROCESSES}", str(root / "wrapper.py"),
        str(folder / "train.py"), "--use-cpu", "--max-steps", str(STEPS),
        "--output-dir", str(root / "output"),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in observed.read_text().splitlines()]
    state_file = root / "output" / f"checkpoint-{STEPS}" / "trainer_state.json"
    return folder, rows, json.loads(state_file.read_text())


@pytest.mark.slow
def test_two_processes_train_the_configs_global_batch(two_process_run):
    folder, observed, state = two_process_run
    config = TrainConfig.from_dict(
        json.loads((folder / "train_config.json").read_text())
    )
    exported = json.loads((folder / "grpo_config.json").read_text())
    trainers = [o for o in observed if o["kind"] == "trainer"]
    scored = [o for o in observed if o["kind"] == "rows"]

    # Both processes ran in one gloo group with the exported per-process batch.
    assert sorted(t["rank"] for t in trainers) == [0, 1]
    for trainer in trainers:
        assert trainer["processes"] == PROCESSES and trainer["backend"] == "gloo"
        assert trainer["num_generations"] == config.group_size
        assert trainer["generation_batch_size"] == config.rollout_batch_size
        for key in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            assert trainer[key] == exported[key]
        global_batch = (
            trainer["per_device_train_batch_size"]
            * trainer["processes"]
            * trainer["gradient_accumulation_steps"]
        )
        assert global_batch == config.train_batch_size

    # What TRL did: STEPS optimizer steps; each generation round scores
    # rollout_batch_size rows over the processes, in groups of group_size.
    assert state["global_step"] == STEPS
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == [
        1,
        2,
    ]
    assert {o["rank"] for o in scored} == {0, 1}
    by_rank = {rank: [o for o in scored if o["rank"] == rank] for rank in (0, 1)}
    assert len(by_rank[0]) == len(by_rank[1])  # generation rounds
    for round_rows in zip(by_rank[0], by_rank[1], strict=True):
        prompts = Counter(p for rows in round_rows for p in rows["prompts"])
        assert sum(prompts.values()) == config.rollout_batch_size
        assert set(prompts.values()) == {config.group_size}
    rows = sum(len(o["prompts"]) for o in scored)
    assert rows == STEPS * config.train_batch_size

    # TRL's own token count over the processes covers exactly these rows.
    tokenizer = load_tokenizer(str(folder / "tiny_model"))
    tokens = sum(
        len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) + length
        for o in scored
        for prompt, length in zip(o["prompts"], o["completion_lengths"], strict=True)
    )
    assert state["num_input_tokens_seen"] == tokens
