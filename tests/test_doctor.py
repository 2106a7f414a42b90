"""The run doctor: each rule on a run made to fail that way, TRL logs, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from grpo_lab import cli
from grpo_lab.tasks import get_task
from grpo_lab.training import doctor, loop
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.doctor import diagnose, format_report, load_run, trl_record
from grpo_lab.training.metrics import append_metrics


def rules_found(diagnosis) -> dict[str, str]:
    return {f.rule: f.severity for f in diagnosis.findings}


# --- real tiny runs made to fail -------------------------------------------------------


def smoke_run(tmp_path: Path, name: str, **overrides) -> Path:
    run_dir = tmp_path / name
    config = TrainConfig.for_profile(
        "smoke", run_dir=str(run_dir), eval_every=0, **overrides
    )
    loop.train(config, progress=False)
    return run_dir


def test_a_max_new_tokens_too_short_is_diagnosed_as_truncation(tmp_path):
    # Reversing 5 digits needs 6 tokens; 2 cut every response.
    run_dir = smoke_run(tmp_path, "short", max_new_tokens=2, steps=3)
    diagnosis = diagnose(run_dir)
    found = rules_found(diagnosis)
    assert found["responses-truncated"] == "error"
    (finding,) = [f for f in diagnosis.findings if f.rule == "responses-truncated"]
    assert finding.evidence == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert "max_new_tokens" in finding.advice


def test_a_task_the_model_cannot_solve_is_diagnosed_as_no_signal(tmp_path):
    # The smoke model never reverses a number: every group of 2 scores 0, 0.
    run_dir = smoke_run(tmp_path, "hard", group_size=2, steps=3)
    diagnosis = diagnose(run_dir)
    assert rules_found(diagnosis)["no-signal"] == "error"
    assert diagnosis.steps == 3


class FormatOnly:
    """The reverse task rewarded for its format alone: signal from the start."""

    def __init__(self, task) -> None:
        self.task = task

    def __getattr__(self, name):
        return getattr(self.task, name)

    def reward_fn(self, response, truth):
        scores = self.task.reward_fn(response, truth)
        return {**scores, "reward": scores["format_reward"]}


def tiny_run(tmp_path, monkeypatch, name: str, **overrides) -> Path:
    """A 1-layer model on 3-digit reversal, rewarded for format (a few seconds)."""
    monkeypatch.setattr(
        loop,
        "build_task",
        lambda config, tokenizer: FormatOnly(
            get_task(config.task, **config.task_options)
        ),
    )
    settings = {
        "run_dir": str(tmp_path / name),
        "task_options": {"n_digits": 3},
        "tiny_hidden_size": 32,
        "tiny_num_layers": 1,
        "tiny_intermediate_size": 64,
        "rollout_batch_size": 32,
        "group_size": 4,
        "train_batch_size": 32,
        "steps": 10,
        "sft_max_steps": 30,
        "sft_eval_every": 10,
        "eval_every": 0,
        "checkpoint_every": 0,
        "eval_size": 50,
    }
    loop.train(TrainConfig.for_profile("cpu", **{**settings, **overrides}), False)
    return tmp_path / name


def test_a_learning_rate_of_0_3_is_diagnosed(tmp_path, monkeypatch):
    # One step at lr 0.3 wrecks the model: it stops ending its answers, every
    # group then scores 0, and nothing trains again.
    run_dir = tiny_run(tmp_path, monkeypatch, "lr", lr=0.3)
    found = rules_found(diagnose(run_dir))
    assert found["learning-rate-out-of-range"] == "error"
    assert {"responses-truncated", "no-signal"} <= set(found)


# --- crafted metrics where a real run cannot be made in seconds ---------------------------


def crafted_run(tmp_path, records, name="crafted", **config) -> Path:
    """metrics.jsonl lines written as the loop writes them, and a config.json."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    for step, record in enumerate(records, start=1):
        append_metrics(run_dir, {"step": step, **record})
    settings = TrainConfig.for_profile("cpu", **config)
    (run_dir / "config.json").write_text(settings.to_json())
    return run_dir


def rising_reward(count: int) -> list[float]:
    return [0.3 + 0.6 * step / count for step in range(count)]


def test_entropy_collapse_without_learning_is_found(tmp_path):
    records = [
        {"train/reward_mean": 0.3, "loss/token_entropy": entropy}
        for entropy in (1.2, 0.6, 0.2, 0.08, 0.05)
    ]
    diagnosis = diagnose(crafted_run(tmp_path, records))
    (finding,) = [f for f in diagnosis.findings if f.rule == "entropy-collapse"]
    assert finding.evidence == [(1, 1.2), (4, 0.08), (5, 0.05)]
    # The same entropies with the reward climbing: a policy sure of right answers.
    for record, reward in zip(records, rising_reward(5)):
        record["train/reward_mean"] = reward
    learned = diagnose(crafted_run(tmp_path, records, name="learned"))
    assert "entropy-collapse" not in rules_found(learned)


def test_entropy_explosion_is_found(tmp_path):
    records = [{"loss/token_entropy": e} for e in (0.4, 0.5, 0.7, 1.3, 2.9)]
    found = rules_found(diagnose(crafted_run(tmp_path, records)))
    assert found["entropy-explosion"] == "error"
    calm = [{"loss/token_entropy": e} for e in (0.4, 0.5, 0.45, 0.6)]
    assert "entropy-explosion" not in rules_found(
        diagnose(crafted_run(tmp_path, calm, name="calm"))
    )


def test_a_clip_fraction_persistently_high_is_found(tmp_path):
    off_policy = {
        "train_batch_size": 128,
        "importance_reweighting_method": "grpo",
        "cliprange": 0.2,
    }
    records = [
        {"loss/clip_fraction": c, "loss/importance_ratio_mean": 1.1}
        for c in (0.05, 0.3, 0.35, 0.4)
    ]
    diagnosis = diagnose(crafted_run(tmp_path, records, **off_policy))
    (finding,) = [f for f in diagnosis.findings if f.rule == "clip-fraction-high"]
    assert [step for step, _ in finding.evidence] == [2, 3, 4]
    # Off-policy, a ratio away from 1 is expected: the on-policy rule skips it.
    assert "ratio-not-one-on-policy" in diagnosis.skipped


def test_a_ratio_away_from_1_on_an_on_policy_run_is_found(tmp_path):
    records = [{"rollout/is_ratio_mean": r} for r in (1.0, 1.0005, 1.08, 0.9)]
    diagnosis = diagnose(crafted_run(tmp_path, records))
    (finding,) = [f for f in diagnosis.findings if f.rule == "ratio-not-one-on-policy"]
    assert finding.evidence == [(3, 1.08), (4, 0.9)]


def test_a_jump_in_the_sampler_trainer_gap_is_found(tmp_path):
    gaps = [0.004, 0.005, 0.004, 0.005, 0.06, 0.005]
    records = [{"rollout/sampler_log_prob_diff_mean": g} for g in gaps]
    diagnosis = diagnose(crafted_run(tmp_path, records))
    (finding,) = [f for f in diagnosis.findings if f.rule == "sampler-gap-jump"]
    assert finding.evidence == [(5, 0.06)]


def test_reward_flat_while_the_loss_moves_is_found(tmp_path):
    records = [
        {"train/reward_mean": 0.40 + 0.01 * (step % 2), "loss/loss": loss}
        for step, loss in enumerate((0.02, -0.2, 0.15, -0.05, 0.3, -0.1))
    ]
    found = rules_found(diagnose(crafted_run(tmp_path, records)))
    assert found["reward-flat-loss-moves"] == "warning"


def test_a_non_finite_value_is_found(tmp_path):
    # The loop writes NaN and inf as null; both show as non-finite.
    records = [
        {"train/reward_mean": 0.3, "loss/loss": 0.1},
        {"train/reward_mean": math.nan, "loss/loss": math.inf},
    ]
    diagnosis = diagnose(crafted_run(tmp_path, records))
    (finding,) = [f for f in diagnosis.findings if f.rule == "non-finite"]
    assert finding.severity == "error"
    assert finding.evidence == [(2, None), (2, None)]
    assert "loss/loss" in finding.summary and "train/reward_mean" in finding.summary


def test_gradient_norms_out_of_range_are_found(tmp_path):
    spiky = [{"loss/gradient_norm": g} for g in (0.3, 0.4, 0.35, 9.0, 0.3)]
    (finding,) = [
        f
        for f in diagnose(crafted_run(tmp_path, spiky)).findings
        if f.rule == "gradient-norm-out-of-range"
    ]
    assert finding.evidence == [(4, 9.0)]
    clipped = [{"loss/gradient_norm": g} for g in (40.0, 55.0, 61.0)]
    (finding,) = [
        f
        for f in diagnose(crafted_run(tmp_path, clipped, name="clipped")).findings
        if f.rule == "gradient-norm-out-of-range"
    ]
    assert "every step is clipped" in finding.summary


def test_a_learning_rate_too_low_for_a_pretrained_model(tmp_path):
    records = [{"train/reward_mean": 0.2}]
    low = crafted_run(tmp_path, records, lr=1e-9)
    assert rules_found(diagnose(low))["learning-rate-out-of-range"] == "warning"
    gpu = crafted_run(tmp_path, records, name="gpu", model="some/model", lr=3e-4)
    assert rules_found(diagnose(gpu))["learning-rate-out-of-range"] == "error"


# --- TRL's trainer_state.json ------------------------------------------------------------


def trl_state(entries: list[dict]) -> dict:
    """A trainer_state.json as transformers writes it (TRL's keys in log_history)."""
    return {
        "best_global_step": None,
        "epoch": 0.5,
        "global_step": len(entries),
        "log_history": entries,
        "logging_steps": 1,
        "max_steps": len(entries),
        "num_input_tokens_seen": 0,
        "trial_name": None,
    }


def trl_entry(step: int, **values) -> dict:
    entry = {
        "clip_ratio/high_max": 0.0,
        "clip_ratio/high_mean": 0.0,
        "clip_ratio/low_mean": 0.0,
        "clip_ratio/low_min": 0.0,
        "clip_ratio/region_mean": 0.0,
        "completions/clipped_ratio": 1.0,
        "completions/max_length": 256.0,
        "completions/max_terminated_length": 0.0,
        "completions/mean_length": 256.0,
        "completions/mean_terminated_length": 0.0,
        "completions/min_length": 256.0,
        "completions/min_terminated_length": 0.0,
        "entropy": 0.9,
        "epoch": step / 100,
        "frac_reward_zero_std": 1.0,
        "grad_norm": 0.0,
        "learning_rate": 1e-6,
        "loss": 0.0,
        "num_tokens": 4096.0 * step,
        "reward": 0.0,
        "reward_std": 0.0,
        "rewards/accuracy_reward/mean": 0.0,
        "rewards/accuracy_reward/std": 0.0,
        "step": step,
        "step_time": 1.5,
    }
    return {**entry, **values}


def test_a_trl_log_maps_onto_our_names():
    record = trl_record(
        trl_entry(3, **{"sampling/importance_sampling_ratio/mean": 0.98})
    )
    assert record["step"] == 3
    assert record["rollout/clipped_fraction"] == 1.0
    assert record["train/equal_reward_group_fraction"] == 1.0
    assert record["loss/token_entropy"] == 0.9
    assert record["train/learning_rate"] == 1e-6
    assert record["rollout/is_ratio_mean"] == 0.98
    assert set(record) <= {"step", *doctor.TRL_KEYS.values()}
    summary = {"step": 5, "train_runtime": 12.0, "train_loss": 0.0}
    assert trl_record(summary) is None


def test_a_trl_run_in_a_checkpoint_folder_is_diagnosed(tmp_path):
    entries = [trl_entry(step) for step in range(1, 6)]
    entries.append({"epoch": 0.05, "step": 5, "train_runtime": 9.1, "train_loss": 0.0})
    for step, name in ((2, "checkpoint-2"), (5, "checkpoint-5")):
        (tmp_path / name).mkdir()
        state = trl_state(entries[:step] if step == 2 else entries)
        (tmp_path / name / "trainer_state.json").write_text(json.dumps(state))
    run = load_run(tmp_path)
    assert run.kind == "trl" and run.source.parent.name == "checkpoint-5"
    diagnosis = diagnose(tmp_path)
    found = rules_found(diagnosis)
    assert found["responses-truncated"] == "error"
    assert found["no-signal"] == "error"
    assert diagnosis.skipped["ratio-not-one-on-policy"].startswith("the schedule")
    assert diagnose(tmp_path / "checkpoint-2" / "trainer_state.json").steps == 2


# --- a healthy run, and the command line --------------------------------------------------


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory) -> Path:
    """The cpu profile's real run (about a minute on two cores), made once."""
    run_dir = tmp_path_factory.mktemp("healthy") / "run"
    loop.train(TrainConfig.for_profile("cpu", run_dir=str(run_dir)), progress=False)
    return run_dir


@pytest.mark.slow
def test_a_healthy_cpu_profile_run_has_no_findings(healthy_run):
    diagnosis = diagnose(healthy_run)
    assert diagnosis.findings == [], format_report(diagnosis)
    assert diagnosis.steps == 400


@pytest.mark.slow
def test_the_cli_prints_a_healthy_run_as_text_and_json(healthy_run, capsys):
    assert cli.main(["doctor", str(healthy_run)]) == 0
    text = capsys.readouterr().out
    assert "(grpo_lab, 400 steps): no findings" in text
    assert cli.main(["doctor", str(healthy_run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"] == []


def test_the_cli_prints_findings_as_text_and_json(tmp_path, capsys):
    records = [{"rollout/clipped_fraction": 1.0, "train/reward_mean": 0.0}] * 3
    run_dir = crafted_run(tmp_path, records)
    assert cli.main(["doctor", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert "[error] responses-truncated:" in text
    assert (
        "evidence (rollout/clipped_fraction): step 1: 1, step 2: 1, step 3: 1" in text
    )
    assert "likely cause: " in text and "try: " in text and "not checked:" in text
    assert cli.main(["doctor", str(run_dir / "metrics.jsonl"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (finding,) = [f for f in report["findings"] if f["rule"] == "responses-truncated"]
    assert finding["evidence"] == [[1, 1.0], [2, 1.0], [3, 1.0]]
    assert set(finding) == {
        "rule",
        "severity",
        "metric",
        "evidence",
        "summary",
        "cause",
        "advice",
    }


BAD_RUN_DIRS = {
    "missing folder": ("missing", "must be an existing folder"),
    "empty folder": ("empty", "holds neither"),
    "another file": ("notes.txt", "got the file"),
    "no GRPO step": ("warm_up_only", "has none"),
    "broken trainer state": ("broken", "must be TRL's JSON"),
}


@pytest.mark.parametrize("name", BAD_RUN_DIRS)
def test_a_bad_run_dir_is_one_line_and_exit_2(name, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "warm_up_only").mkdir()
    append_metrics(tmp_path / "warm_up_only", {"sft/step": 1, "sft/loss": 2.0})
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "trainer_state.json").write_text("{not json")
    path, expected = BAD_RUN_DIRS[name]
    assert cli.main(["doctor", str(tmp_path / path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpo-lab doctor: "), captured.err
    assert expected in lines[0] and lines[0].endswith(")")
    assert captured.out == ""
