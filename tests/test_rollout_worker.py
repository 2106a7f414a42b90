"""The asynchronous rollout worker: same samples as the synchronous loop, version
tags, the staleness bound under both admission policies, kill -9 of either
side, and resume. Each run is the smoke profile; a worker process costs a few
seconds of imports (spawn)."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from grpo_lab.training import loop
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.metrics import read_metrics
from grpo_lab.training.rollout_worker import (
    RolloutSampler,
    RolloutWorkerDied,
    write_weights,
)

ROOT = Path(__file__).resolve().parents[1]


def same_run_module():
    """benchmarks/same_run.py, the comparison of two runs this test reuses."""
    spec = importlib.util.spec_from_file_location(
        "same_run", ROOT / "benchmarks" / "same_run.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smoke(run_dir: Path, **overrides) -> TrainConfig:
    # The smoke model answers nothing right after 2 warm-up steps: the entropy
    # bonus is what moves its weights every step.
    values = {
        "steps": 3,
        "eval_every": 0,
        "sft_max_steps": 2,
        "entropy_coef": 0.05,
        "run_dir": str(run_dir),
    }
    return TrainConfig.for_profile("smoke", **{**values, **overrides})


def step_lines(run_dir: Path) -> list[dict]:
    return [line for line in read_metrics(run_dir) if line.get("step", 0) > 0]


def slow_updates(monkeypatch, seconds: float) -> None:
    """Every GRPO update takes ``seconds`` longer: the worker runs ahead."""
    update = loop.grpo_update

    def slow(*arguments, **keywords):
        time.sleep(seconds)
        return update(*arguments, **keywords)

    monkeypatch.setattr(loop, "grpo_update", slow)


def test_staleness_0_is_the_synchronous_run_bit_for_bit(tmp_path, monkeypatch):
    plain = loop.train(smoke(tmp_path / "plain", checkpoint_every=1), progress=False)
    monkeypatch.setattr(loop, "rollout_worker", lambda *a: pytest.fail("a worker"))
    with pytest.warns(UserWarning, match="max_staleness is 0"):
        zero = loop.train(
            smoke(
                tmp_path / "zero",
                checkpoint_every=1,
                max_staleness=0,
                async_admission="pace",
                weight_sync_every=2,
                async_queue_size=3,
            ),
            progress=False,
        )
    same_run = same_run_module()
    assert (
        same_run.compare(plain.run_dir, zero.run_dir, "time/", ["rng", "config"]) == 0
    )
    assert len(step_lines(zero.run_dir)) == 3
    first, last = sorted((zero.run_dir / "checkpoints").glob("*.pt"))
    before = torch.load(first, weights_only=False)["model"]
    after = torch.load(last, weights_only=False)["model"]
    assert any(not torch.equal(before[k], after[k]) for k in before)  # it trained
    assert not any(key.startswith("async/") for key in step_lines(zero.run_dir)[0])


def test_the_worker_samples_the_synchronous_batch_and_tags_its_version(tmp_path):
    config = smoke(tmp_path / "run", max_staleness=1)
    policy = loop.build_policy(config)
    task = loop.build_task(config, policy.tokenizer)
    weights = tmp_path / "weights.pt"
    write_weights(weights, policy.model, version=3)
    sampler = RolloutSampler(config, weights)
    groups = sampler.sample_batch(4)
    assert [g.version for g in groups] == [3] * config.prompts_per_step
    rollouts, examples = loop.sample_round(config, task, policy, 4, 0)
    assert [g.example for g in groups] == examples  # the loop's step-4 prompts
    sampled = [ids for g in groups for ids in g.rollouts.response_token_ids]
    assert sampled == rollouts.response_token_ids  # and its step-4 samples
    with torch.no_grad():
        for parameter in policy.model.parameters():
            parameter.add_(0.5)
    write_weights(weights, policy.model, version=5)

    class Published:
        value = 5

    stop = multiprocessing.get_context("spawn").Event()
    sampler.wait_for_weights(7, Published, stop)  # drop: loads what is there
    assert [g.version for g in sampler.sample_batch(7)] == [5] * 4
    changed = sampler.sample_batch(7)[0].rollouts.sampler_log_probs
    assert changed != groups[0].rollouts.sampler_log_probs


def test_a_paced_worker_waits_for_new_enough_weights(tmp_path):
    config = smoke(tmp_path / "run", max_staleness=1, async_admission="pace")
    policy = loop.build_policy(config)
    weights = tmp_path / "weights.pt"
    write_weights(weights, policy.model, version=2)
    sampler = RolloutSampler(config, weights)

    class Published:
        value = 2

    stop = multiprocessing.get_context("spawn").Event()
    assert sampler.wait_for_weights(4, Published, stop) < 1.0  # 4 - 1 - 1 = 2
    stop.set()  # batch 5 needs version 3: it would wait until told to stop
    started = time.perf_counter()
    sampler.wait_for_weights(5, Published, stop)
    assert time.perf_counter() - started < 1.0 and sampler.version == 2


@pytest.mark.slow
def test_drop_keeps_the_bound_and_a_killed_worker_stops_a_run_that_resumes(
    tmp_path, monkeypatch
):
    run_dir = tmp_path / "drop"
    config = smoke(
        run_dir, steps=6, max_staleness=1, async_queue_size=3, checkpoint_every=1
    )
    slow_updates(monkeypatch, 0.5)
    update = loop.grpo_update

    def kill_the_worker_at_step_4(config, *arguments, **keywords):
        record = update(config, *arguments, **keywords)
        if len(step_lines(run_dir)) == 3:
            (worker,) = multiprocessing.active_children()
            os.kill(worker.pid, signal.SIGKILL)
        return record

    monkeypatch.setattr(loop, "grpo_update", kill_the_worker_at_step_4)
    with pytest.raises(RolloutWorkerDied, match="exited with code -9"):
        loop.train(config, progress=False)
    assert multiprocessing.active_children() == []
    lines = step_lines(run_dir)
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    assert all(line["async/staleness_max"] <= 1 for line in lines)
    assert sum(line["async/dropped_groups_stale"] for line in lines) > 0
    dropped = [line for line in lines if line["async/dropped_groups_stale"]]
    assert all("async/dropped_response_length_mean" in line for line in dropped)
    assert not (run_dir / "rollout_weights.pt").exists()

    monkeypatch.setattr(loop, "grpo_update", update)
    resumed = loop.train(TrainConfig.from_dict({**config.to_dict(), "resume": True}))
    assert [line["step"] for line in step_lines(resumed.run_dir)] == list(range(1, 7))
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_pace_keeps_the_bound_without_dropping(tmp_path, monkeypatch):
    slow_updates(monkeypatch, 0.5)
    config = smoke(
        tmp_path / "pace",
        steps=5,
        max_staleness=1,
        async_admission="pace",
        weight_sync_every=2,
        async_queue_size=3,
        sampler_correction="token_truncate",
    )
    lines = step_lines(loop.train(config, progress=False).run_dir)
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    # The correction reweights by pi_trainer / pi_sampler, the sampler a step old:
    # the ratios move off 1 once the weights have moved.
    assert all("rollout/is_token_corrected_fraction" in line for line in lines)
    stale = [
        line["async/sampler_gap_staleness_1"]
        for line in lines[1:]
        if "async/sampler_gap_staleness_1" in line
    ]
    assert stale and max(stale) > 0
    assert lines[0]["async/sampler_gap_staleness_0"] < 1e-4  # the same weights
    assert all(line["async/dropped_groups_stale"] == 0 for line in lines)
    assert all(line["async/staleness_max"] <= 1 for line in lines)
    assert max(line["async/staleness_max"] for line in lines) == 1
    assert sum(line["async/worker_wait_seconds"] for line in lines) > 0.5


TRAINER_SCRIPT = """
import time
from grpo_lab.training import loop
from grpo_lab.training.config import TrainConfig

def slow(update):
    def run(*arguments, **keywords):
        time.sleep(1.0)
        return update(*arguments, **keywords)
    return run

if __name__ == "__main__":
    loop.grpo_update = slow(loop.grpo_update)
    config = TrainConfig.from_dict(json.loads(CONFIG))
    loop.train(config, progress=False)
"""


def children_of(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is ``pid``, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_trainer_takes_its_worker_with_it_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "run"
    config = smoke(run_dir, steps=30, max_staleness=1, checkpoint_every=1)
    script = tmp_path / "trainer.py"
    script.write_text(
        "import json\nCONFIG = "
        + repr(json.dumps(config.to_dict()))
        + "\n"
        + textwrap.dedent(TRAINER_SCRIPT)
    )
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    trainer = subprocess.Popen([sys.executable, str(script)], env=environment)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and trainer.poll() is None:
            if (run_dir / "metrics.jsonl").exists() and step_lines(run_dir):
                break
            time.sleep(0.2)
        assert trainer.poll() is None and step_lines(run_dir)
        children = children_of(trainer.pid)
        assert children  # the worker (and multiprocessing's resource tracker)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(map(alive, children)):
            time.sleep(0.1)
        assert not any(map(alive, children))
    finally:
        trainer.kill()
        trainer.wait()
    finished = len(step_lines(run_dir))
    resumed = TrainConfig.from_dict(
        {**config.to_dict(), "resume": True, "steps": finished + 1}
    )
    lines = step_lines(loop.train(resumed, progress=False).run_dir)
    assert [line["step"] for line in lines] == list(range(1, finished + 2))


def test_an_asynchronous_run_leaves_one_thread_to_its_worker(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    model = {"model": "org/model"}  # a real model: torch's thread count
    assert loop.thread_count(TrainConfig.for_profile("smoke", **model)) == 4
    asynchronous = TrainConfig.for_profile("smoke", max_staleness=1, **model)
    assert loop.thread_count(asynchronous) == 3
    assert loop.thread_count(TrainConfig.for_profile("smoke", max_staleness=1)) == 1
