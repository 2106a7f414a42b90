"""The run doctor: each rule on a run made to fail that way, TRL logs, the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from grpo_lab.cli import main as cli
from grpo_lab.tasks import get_task
from grpo_lab.training import doctor, loop
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.doctor import (
    config_lint,
    diagnose,
    format_report,
    load_run,
    trl_record,
)
from grpo_lab.training.metrics import append_metrics


def rules_found(diagnosis) -> dict[str, str]:
    return {f.rule: f.severity for f in diagnosis.findings}


def only(diagnosis, rule: str):
    (finding,) = [f for f in diagnosis.findings if f.rule == rule]
    return finding


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


def test_a_loss_and_gradient_at_0_are_an_error(tmp_path):
    # The smoke run with a KL penalty: no response is right, so every advantage
    # is 0 and the policy stays the reference (KL 0); the loop still steps and
    # logs loss 0 with gradient norm 0 (trl#3857's log). Without a KL penalty
    # the loop skips such a step and logs no loss at all.
    run_dir = smoke_run(tmp_path, "dead", kl_coef=0.1)
    finding = only(diagnose(run_dir), "loss-near-zero")
    assert finding.severity == "error" and "nothing trained" in finding.summary
    assert finding.evidence == [(1, 0.0), (2, 0.0)]


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
def healthy_run(healthy_runs) -> Path:
    """The first of the healthy cpu-profile runs below (seed 0, 40 steps): one
    set of real runs serves every healthy check."""
    return healthy_runs[0]


@pytest.mark.slow
def test_a_healthy_cpu_profile_run_has_no_findings(healthy_run):
    diagnosis = diagnose(healthy_run)
    assert diagnosis.findings == [], format_report(diagnosis)
    assert diagnosis.steps == HEALTHY_CHANGES["steps"]


@pytest.mark.slow
def test_the_cli_prints_a_healthy_run_as_text_and_json(healthy_run, capsys):
    assert cli.main(["doctor", str(healthy_run)]) == 0
    text = capsys.readouterr().out
    assert f"(grpo_lab, {HEALTHY_CHANGES['steps']} steps): no findings" in text
    assert cli.main(["doctor", str(healthy_run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"] == []


def test_the_cli_prints_findings_as_text_and_json(tmp_path, capsys):
    records = [{"rollout/clipped_fraction": 1.0, "train/reward_mean": 0.0}] * 3
    run_dir = crafted_run(tmp_path, records)
    assert cli.main(["doctor", str(run_dir)]) == 1  # an [error] finding
    text = capsys.readouterr().out
    assert "[error] responses-truncated:" in text
    assert (
        "evidence (rollout/clipped_fraction): step 1: 1, step 2: 1, step 3: 1" in text
    )
    assert "likely cause: " in text and "try: " in text and "not checked:" in text
    assert cli.main(["doctor", str(run_dir / "metrics.jsonl"), "--json"]) == 1
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


# --- damaged files: read line by line, each bad line named, never a traceback ----------


def good_line(step: int, **values) -> str:
    record = {"step": step, "train/reward_mean": 0.3, "loss/loss": 0.01, **values}
    return json.dumps(record)


def write_run(root: Path, lines: list, config=None) -> Path:
    """A run folder whose metrics.jsonl holds ``lines`` (str, or bytes as is)."""
    root.mkdir(parents=True, exist_ok=True)
    data = b"".join(
        line if isinstance(line, bytes) else (line + "\n").encode() for line in lines
    )
    (root / "metrics.jsonl").write_bytes(data)
    if config is not None:
        text = config if isinstance(config, str) else json.dumps(config)
        (root / "config.json").write_text(text)
    return root


GOOD = [good_line(1), good_line(2)]

# name -> (files to write, the line numbers named unreadable; None: refused in
# one line, with this text in the message)
DAMAGED = {
    "bare number line": (lambda r: write_run(r, ["5", *GOOD]), [1]),
    "step as a string": (lambda r: write_run(r, [good_line("3"), *GOOD]), [1]),
    "step null": (lambda r: write_run(r, [good_line(None), *GOOD]), [1]),
    "step true": (lambda r: write_run(r, [*GOOD, good_line(True)]), [3]),
    "step 2.5 and -1": (
        lambda r: write_run(r, [good_line(2.5), good_line(-1), *GOOD]),
        [1, 2],
    ),
    "config.json a list": (lambda r: write_run(r, GOOD, config=[1, 2]), ["config"]),
    "config.json cut short": (
        lambda r: write_run(r, GOOD, config='{"lr": 0.0'),
        ["config"],
    ),
    "config.json wrong types": (
        lambda r: write_run(
            r, GOOD, config={"lr": "abc", "max_grad_norm": [1], "model": 3}
        ),
        [],
    ),
    "rewards of 1e308": (
        lambda r: write_run(
            r, [good_line(s, **{"train/reward_mean": 1e308}) for s in range(1, 9)]
        ),
        [],
    ),
    "truncated JSON mid-file": (
        lambda r: write_run(r, [GOOD[0], '{"step": 2, "train/rew', good_line(3)]),
        [2],
    ),
    "last line cut short": (
        lambda r: write_run(r, [*GOOD, b'{"step": 3, "loss/lo']),
        [3],
    ),
    "binary garbage": (
        lambda r: write_run(r, [GOOD[0], bytes(range(11, 256)) + b"\n", GOOD[1]]),
        [2],
    ),
    "bytes that are not UTF-8": (
        lambda r: write_run(
            r, [b'{"step": 1, "train/reward_mean": \xff\xfe}\n', GOOD[1]]
        ),
        [1],
    ),
    "empty metrics.jsonl": (lambda r: write_run(r, []), "has none"),
    "only garbage": (lambda r: write_run(r, [b"\x00\x01\x02\n"]), "has none"),
    "missing metrics.jsonl": (
        lambda r: (r.mkdir(), (r / "config.json").write_text("{}")),
        "holds neither",
    ),
    "metrics.jsonl is a folder": (
        lambda r: (r.mkdir(), (r / "metrics.jsonl").mkdir()),
        "could not be read",
    ),
    "NaN and Infinity tokens": (
        lambda r: write_run(
            r, ['{"step": 1, "train/reward_mean": NaN, "loss/loss": Infinity}']
        ),
        [],
    ),
    "a nested dict where a float belongs": (
        lambda r: write_run(r, [good_line(1, **{"loss/loss": {"a": 1}}), GOOD[1]]),
        [1],
    ),
    "a list where a float belongs": (
        lambda r: write_run(r, [good_line(1, **{"train/reward_mean": [0.1]})]),
        "has none",
    ),
    "a 2 MB line": (
        lambda r: write_run(r, [GOOD[0], '{"x": "' + "a" * 2_000_000 + '"}']),
        [2],
    ),
    "JSON lists and strings": (
        lambda r: write_run(r, ["[1, 2]", '"text"', "null", *GOOD]),
        [1, 2, 3],
    ),
    "nesting deeper than Python recurses": (
        lambda r: write_run(r, ["[" * 100_000 + "]" * 100_000, *GOOD]),
        [1],
    ),
    "an integer of 5000 digits": (
        lambda r: write_run(r, ['{"step": ' + "9" * 5000 + "}", *GOOD]),
        [1],
    ),
    "an integer past the float range": (
        lambda r: write_run(
            r, [good_line(s, **{"loss/gradient_norm": 10**400}) for s in (1, 2, 3)]
        ),
        [],
    ),
    "a step logged twice": (lambda r: write_run(r, [*GOOD, good_line(2)]), [2]),
    "trainer_state.json a list": (
        lambda r: (r.mkdir(), (r / "trainer_state.json").write_text("[1]")),
        "log_history list",
    ),
    "trainer_state.json damaged entries": (
        lambda r: (
            r.mkdir(),
            (r / "trainer_state.json").write_text(
                json.dumps(
                    trl_state(
                        [
                            trl_entry(1),
                            "x",
                            {**trl_entry(2), "step": "2"},
                            trl_entry(3, reward={"mean": 1}),
                            trl_entry(4, grad_norm=1e308),
                        ]
                    )
                )
            ),
        ),
        ["log_history[1]", "log_history[2]", "log_history[3]"],
    ),
    "a verl console log with broken pairs": (
        lambda r: (
            r.mkdir(),
            (r / "train.log").write_text(
                "starting\nstep:1 - critic/score/mean:0.5 - actor/pg_loss:oops\n"
                "step:2 - critic/score/mean:0.5\nstep:x - critic/score/mean:0.1\n"
            ),
        ),
        [2, 4],
    ),
}


def damaged_path(root: Path) -> Path:
    logs = list(root.glob("*.log")) if root.is_dir() else []
    return logs[0] if logs else root


@pytest.mark.parametrize("name", DAMAGED)
def test_a_damaged_file_is_read_without_a_traceback(name, tmp_path, capsys):
    write, expected = DAMAGED[name]
    root = tmp_path / "run"
    write(root)
    path = damaged_path(root)
    code = cli.main(["doctor", str(path), "--json"])
    captured = capsys.readouterr()
    if isinstance(expected, str):  # nothing to diagnose: one line, exit 2
        assert code == 2 and captured.out == ""
        (line,) = captured.err.splitlines()
        assert expected in line, line
        return
    assert code in (0, 1), captured.err
    report = json.loads(captured.out)  # strict JSON: no NaN or Infinity tokens
    named = " | ".join(report["unreadable"])
    assert len(report["unreadable"]) == len(expected), named
    for where in expected:
        marker = f"line {where}:" if isinstance(where, int) else where
        assert marker in named, named
    failed = [why for why in report["skipped"].values() if "failed" in why]
    assert failed == []


def test_there_are_25_kinds_of_damaged_files():
    assert len(DAMAGED) >= 25


def test_unreadable_lines_are_named_in_the_text_report(tmp_path, capsys):
    write_run(tmp_path / "run", ["5", good_line("3"), *GOOD])
    cli.main(["doctor", str(tmp_path / "run")])
    text = capsys.readouterr().out
    assert "unreadable (2, left out):" in text
    assert "metrics.jsonl line 1: a JSON number, not an object" in text
    assert "metrics.jsonl line 2: step must be a whole number >= 0, got '3'" in text


def test_huge_rewards_give_finite_json_and_a_non_finite_finding(tmp_path, capsys):
    lines = [good_line(s, **{"train/reward_mean": 1e308}) for s in range(1, 9)]
    lines.append(good_line(9, **{"train/reward_mean": None}))
    write_run(tmp_path / "run", lines)
    assert cli.main(["doctor", str(tmp_path / "run"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert "non-finite" in {f["rule"] for f in report["findings"]}


# --- the new rules, each on a reproduction ------------------------------------------------


def test_a_loss_at_0_with_a_gradient_is_said_to_be_expected(tmp_path, monkeypatch):
    # A real run: the grpo objective, two train batches per rollout batch. The
    # ratio is 1 (then ~1) when the loss is taken and the advantages are centred
    # per group, so the loss is ~1e-8 while the gradient norm is ~0.4.
    run_dir = tiny_run(
        tmp_path,
        monkeypatch,
        "ratio_one",
        steps=6,
        train_batch_size=16,
        importance_reweighting_method="grpo",
        cliprange=0.2,
    )
    finding = only(diagnose(run_dir), "loss-near-zero")
    assert finding.severity == "info"
    assert "expected" in finding.summary and "watch the reward" in finding.advice


def test_trl_s_loss_at_0_is_expected_when_grad_norm_is_not(tmp_path):
    # TRL's own log as in trl#3452: loss 0.0 every step, grad_norm 0.2-0.5.
    entries = [
        trl_entry(step, loss=0.0, grad_norm=0.2 + 0.05 * step, reward=0.3)
        for step in range(1, 7)
    ]
    (tmp_path / "trainer_state.json").write_text(json.dumps(trl_state(entries)))
    assert rules_found(diagnose(tmp_path))["loss-near-zero"] == "info"


def late_lr_jump(monkeypatch, after: int, lr: float) -> None:
    """The run's learning rate jumps to ``lr`` after step ``after``."""
    schedule = loop.learning_rate_at
    monkeypatch.setattr(
        loop,
        "learning_rate_at",
        lambda config, step: lr if step > after else schedule(config, step),
    )


def test_a_kl_spike_is_found(tmp_path, monkeypatch):
    # A real run with a KL penalty whose lr jumps to 0.3 after step 4: the KL to
    # the reference goes from ~1e-3 to ~0.3 in one step.
    late_lr_jump(monkeypatch, after=4, lr=0.3)
    run_dir = tiny_run(tmp_path, monkeypatch, "kl", steps=7, kl_coef=0.05)
    finding = only(diagnose(run_dir), "kl-spike")
    assert finding.metric == "loss/kl_mean" and finding.evidence[0][0] == 6
    assert finding.evidence[0][1] > 0.01


def test_a_kl_that_grows_steadily_is_not_a_spike(tmp_path):
    records = [{"loss/kl_mean": 0.002 * 1.3**step} for step in range(20)]
    diagnosis = diagnose(crafted_run(tmp_path, records))
    assert "kl-spike" not in rules_found(diagnosis)
    assert "kl-spike" not in diagnosis.skipped


class Interleaved:
    """A backend whose rollouts come prompt-minor (P1_G1, P2_G1, ...): R1-V#67."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def generate(self, prompts, group_size, sampling):
        rollouts = self.backend.generate(prompts, group_size, sampling)
        order = [
            i * group_size + j for j in range(group_size) for i in range(len(prompts))
        ]
        fields = ("prompts", "responses", "prompt_token_ids", "response_token_ids")
        changes = {
            name: [getattr(rollouts, name)[k] for k in order]
            for name in (*fields, "sampler_log_probs")
            if getattr(rollouts, name) is not None
        }
        return dataclasses.replace(rollouts, **changes)


def test_groups_of_mixed_prompts_are_found(tmp_path, monkeypatch):
    # A real smoke run whose backend interleaves the groups: every group of 4
    # holds 4 different prompts, and GRPO's group mean is a batch mean.
    build = loop.build_policy

    def interleaved_policy(config):
        policy = build(config)
        policy.backend = Interleaved(policy.backend)
        return policy

    monkeypatch.setattr(loop, "build_policy", interleaved_policy)
    finding = only(diagnose(smoke_run(tmp_path, "mixed")), "group-sanity")
    assert finding.severity == "error"
    assert finding.evidence == [(1, 1.0), (2, 1.0)]


def test_prompt_major_groups_pass_the_group_check(tmp_path):
    diagnosis = diagnose(smoke_run(tmp_path, "grouped"))
    assert "group-sanity" not in rules_found(diagnosis)
    assert "group-sanity" not in diagnosis.skipped


def test_a_late_reward_collapse_is_found(tmp_path):
    # Crafted as the loop writes it: a collapse after learning needs hundreds of
    # cpu-profile steps, not seconds. The reward climbs 0.3 -> 0.8 over 30
    # steps, then falls to 0.1 over the last 8 (Search-R1#89's shape).
    rewards = [0.3 + 0.5 * step / 30 for step in range(30)] + [0.5, 0.3] + [0.1] * 6
    records = [{"train/reward_mean": reward} for reward in rewards]
    finding = only(diagnose(crafted_run(tmp_path, records)), "late-reward-collapse")
    assert finding.severity == "error"
    assert finding.evidence[0][1] > 0.75 and finding.evidence[-1] == (38, 0.1)
    learned = [{"train/reward_mean": reward} for reward in rewards[:30]]
    quiet = diagnose(crafted_run(tmp_path, learned, name="learned"))
    assert "late-reward-collapse" not in rules_found(quiet)


def length_records(lengths, clipped, rewards) -> list[dict]:
    return [
        {
            "train/response_length": length,
            "rollout/clipped_fraction": cut,
            "train/reward_mean": reward,
        }
        for length, cut, reward in zip(lengths, clipped, rewards)
    ]


def test_lengths_that_run_away_are_found(tmp_path):
    # Crafted: the tiny model's answers are 4 tokens long and cut at 5 from the
    # start, so no real run of seconds can double its length. Lengths climb 40
    # -> 200 tokens as the cut share reaches 90% and the reward falls.
    count = 20
    lengths = [40 + 160 * step / (count - 1) for step in range(count)]
    clipped = [0.9 * step / (count - 1) for step in range(count)]
    rewards = [0.5 - 0.3 * step / (count - 1) for step in range(count)]
    records = length_records(lengths, clipped, rewards)
    finding = only(diagnose(crafted_run(tmp_path, records)), "length-runaway")
    assert finding.severity == "error" and "while the reward fell" in finding.summary
    steady = length_records([40.0] * count, [0.05] * count, rewards)
    quiet = diagnose(crafted_run(tmp_path, steady, name="steady"))
    assert "length-runaway" not in rules_found(quiet)


def test_lengths_that_collapse_are_found(tmp_path):
    # Crafted for the same reason: 120 -> 20 tokens with a flat reward is an
    # error; with a rising reward (brevity paid on purpose?) a warning.
    count = 20
    lengths = [120 - 100 * step / (count - 1) for step in range(count)]
    flat = length_records(lengths, [0.0] * count, [0.4] * count)
    finding = only(diagnose(crafted_run(tmp_path, flat)), "length-collapse")
    assert finding.severity == "error"
    rising = [0.2 + 0.6 * step / count for step in range(count)]
    paid = length_records(lengths, [0.0] * count, rising)
    diagnosis = diagnose(crafted_run(tmp_path, paid, name="paid"))
    assert only(diagnosis, "length-collapse").severity == "warning"


def test_cispo_without_a_high_clip_is_linted(tmp_path):
    # A real smoke run: CISPO off-policy (two train batches), cliprange_high None.
    run_dir = smoke_run(
        tmp_path,
        "cispo",
        train_batch_size=8,
        importance_reweighting_method="cispo",
        cliprange=0.2,
    )
    finding = only(diagnose(run_dir), "config-lint")
    assert "cliprange_high" in finding.summary and "1 + 0.2" in finding.summary


def test_gspo_with_token_mean_and_a_token_clip_is_linted(tmp_path):
    config = {
        "train_batch_size": 128,
        "importance_reweighting_method": "gspo",
        "cliprange": 0.2,
        "loss_normalization": "token",
    }
    run_dir = crafted_run(tmp_path, [{"train/reward_mean": 0.3}], **config)
    finding = only(diagnose(run_dir), "config-lint")
    assert "loss_normalization 'token'" in finding.summary
    assert "cliprange 0.2" in finding.summary
    paper = {**config, "cliprange": 3e-4, "loss_normalization": "sequence"}
    clean = crafted_run(tmp_path, [{"train/reward_mean": 0.3}], name="paper", **paper)
    assert "config-lint" not in rules_found(diagnose(clean))


NEW_RULES = (
    "loss-near-zero",
    "kl-spike",
    "group-sanity",
    "late-reward-collapse",
    "length-runaway",
    "length-collapse",
    "config-lint",
)


def test_each_new_rule_cites_a_public_thread():
    for name in NEW_RULES:
        rule = doctor.RULES[name]
        text = rule.__doc__ or ""
        if name == "config-lint":  # each lint cites its own
            text = " ".join(lint.__doc__ for lint in config_lint.LINTS)
        assert re.search(r"[\w-]+/[\w.-]+#\d+", text), name


# --- verl's metric logs ---------------------------------------------------------------


def verl_metrics(step: int, **changes) -> dict:
    """One step of verl's metrics under verl's own names (metric_utils.py's
    compute_data_metrics, the actor's update metrics, rollout_corr_helper.py)."""
    metrics = {
        "global_seqlen/mean": 458966.5,
        "actor/entropy": 0.41,
        "actor/pg_clipfrac": 0.004,
        "actor/ppo_kl": 0.0004,
        "actor/pg_clipfrac_lower": 0.0,
        "actor/pg_loss": 0.042,
        "actor/kl_loss": 0.0013,
        "actor/kl_coef": 0.001,
        "actor/grad_norm": 0.13,
        "actor/lr": 1e-6,
        "training/global_step": step,
        "training/epoch": 0,
        "critic/score/mean": 0.02,
        "critic/score/max": 1.0,
        "critic/score/min": 0.0,
        "critic/rewards/mean": 0.02,
        "critic/advantages/mean": -0.004,
        "critic/advantages/max": 1.79,
        "critic/advantages/min": -1.79,
        "critic/returns/mean": -0.004,
        "response_length/mean": 1010.0,
        "response_length/max": 1024.0,
        "response_length/min": 380.0,
        "response_length/clip_ratio": 0.95,
        "response_length_non_aborted/mean": 1010.0,
        "response/aborted_ratio": 0.0,
        "prompt_length/mean": 180.0,
        "prompt_length/clip_ratio": 0.0,
        "rollout_corr/kl": 0.0007,
        "rollout_corr/k3_kl": 0.0011,
        "rollout_corr/ppl_ratio": 1.001,
        "rollout_corr/rollout_is_mean": 1.0,
        "timing_s/gen": 42.0,
        "perf/throughput": 1520.3,
    }
    return {**metrics, **changes}


def verl_steps(count: int = 8) -> list[dict]:
    """A verl run that truncates, clips a third of its tokens, and whose
    update KL (actor/ppo_kl) jumps at step 6."""
    return [
        verl_metrics(
            step,
            **{
                "actor/pg_clipfrac": 0.3,
                "actor/ppo_kl": 0.08 if step == 6 else 0.0004,
            },
        )
        for step in range(1, count + 1)
    ]


def console_line(step: int, metrics: dict) -> str:
    """verl's console logger line (aggregate_logger.concat_dict_to_str) behind
    Ray's prefix."""
    pairs = [f"step:{step}", *(f"{k}:{v:.3f}" for k, v in metrics.items())]
    return "(TaskRunner pid=222265) " + " - ".join(pairs)


def test_a_verl_console_log_is_read(tmp_path):
    steps = verl_steps()
    lines = ["(TaskRunner pid=222265) Training Progress:  0%|", "step:0 - val:0.1"]
    lines += [console_line(step, m) for step, m in enumerate(steps, start=1)]
    log = tmp_path / "verl_console.log"
    log.write_text("\n".join(lines) + "\n")
    run = load_run(log)
    assert run.kind == "verl" and len(run.history) == 8 and run.unreadable == []
    assert run.history[0]["rollout/clipped_fraction"] == 0.95
    assert run.history[0]["loss/clip_fraction"] == 0.3
    assert run.history[5]["loss/ppo_kl"] == 0.08
    assert run.history[0]["rollout/is_ratio_mean"] == 1.0
    diagnosis = diagnose(log)
    found = rules_found(diagnosis)
    assert found["responses-truncated"] == "error"
    assert found["clip-fraction-high"] == "warning"
    assert only(diagnosis, "kl-spike").metric == "loss/ppo_kl"
    assert "group-sanity" not in found and "group-sanity" not in diagnosis.skipped


def test_a_verl_file_logger_jsonl_gives_the_same_diagnosis(tmp_path):
    steps = verl_steps()
    console = tmp_path / "console.log"
    console.write_text(
        "\n".join(console_line(s, m) for s, m in enumerate(steps, 1)) + "\n"
    )
    # verl's file logger: one {"step", "data"} line per step, often named
    # metrics.jsonl by VERL_FILE_LOGGER_PATH.
    (tmp_path / "verl").mkdir()
    jsonl = tmp_path / "verl" / "metrics.jsonl"
    jsonl.write_text(
        "".join(
            json.dumps({"step": s, "data": m}) + "\n" for s, m in enumerate(steps, 1)
        )
    )
    from_file = diagnose(tmp_path / "verl")
    assert from_file.kind == "verl" and from_file.steps == 8
    assert rules_found(from_file) == rules_found(diagnose(console))


def test_verl_groups_of_one_response_are_found(tmp_path):
    # Search-R1#88: each copy of a prompt got its own uid, so verl's GRPO gave
    # every response advantage = its raw score (a group of one: mean 0, std 1).
    steps = [
        verl_metrics(
            s, **{"critic/score/mean": 0.3 + 0.01 * s, "critic/advantages/mean": 0.3}
        )
        for s in range(1, 7)
    ]
    log = tmp_path / "metrics.jsonl"
    log.write_text(
        "".join(
            json.dumps({"step": s, "data": m}) + "\n" for s, m in enumerate(steps, 1)
        )
    )
    finding = only(diagnose(log), "group-sanity")
    assert finding.severity == "error" and "its own group" in finding.summary


# --- the new rules stay silent on healthy runs -----------------------------------------

HEALTHY_SEEDS = (0, 1, 2)
# The cpu profile cut to its first 40 GRPO steps (the full 400 take ~35 s a
# seed on two cores; three of them would be the slowest test of the suite; by
# step 40 the reward has risen by ~0.2), with a small KL penalty so that
# kl-spike has a KL to watch.
HEALTHY_CHANGES = {"steps": 40, "kl_coef": 0.01, "eval_every": 0}


@pytest.fixture(scope="session")
def healthy_runs(tmp_path_factory) -> list[Path]:
    """Three real cpu-profile-like runs (seeds 0, 1, 2), made once per session."""
    root = tmp_path_factory.mktemp("healthy_seeds")
    runs = []
    for seed in HEALTHY_SEEDS:
        run_dir = root / f"seed{seed}"
        config = TrainConfig.for_profile(
            "cpu", run_dir=str(run_dir), seed=seed, **HEALTHY_CHANGES
        )
        loop.train(config, progress=False)
        runs.append(run_dir)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(HEALTHY_SEEDS)))
def test_the_new_rules_stay_silent_on_healthy_runs(healthy_runs, index):
    diagnosis = diagnose(healthy_runs[index])
    report = format_report(diagnosis)
    assert doctor.reward_change(load_run(healthy_runs[index])) > 0.1, report
    for rule in NEW_RULES:  # each one checked, and silent
        assert rule not in rules_found(diagnosis), report
        assert rule not in diagnosis.skipped, report
    assert diagnosis.findings == [], report


# --- multi-turn runs: tool output trained, episodes cut by the turn budget ------------


class CalculatorScript:
    """An hf-like backend that writes the calculator's right episode: the call
    ``<calc>a*b</calc>``, then, after the tool's reply, the reply and EOS."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def _turn(self, context_ids: list[int]) -> tuple[list[int], list[float], str]:
        context = self.tokenizer.decode(context_ids)
        if "</out>" in context:
            text = context.split("<out>")[-1].split("</out>")[0]
            ids = [*self.tokenizer.encode(text, add_special_tokens=False), 1]
        else:
            text = "<calc>" + context.split("=")[0] + "</calc>"
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids, [-0.5] * len(ids), text

    def generate(self, prompts, group_size, sampling):
        from grpo_lab.rollouts.base import Rollouts

        rows = [p for p in prompts for _ in range(group_size)]
        prompt_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in rows]
        ids, values, texts = self.continue_ids(prompt_ids, sampling)
        return Rollouts(rows, texts, prompt_ids, ids, values)

    def continue_ids(self, context_ids, sampling):
        turns = [self._turn(list(ids)) for ids in context_ids]
        return tuple([list(column) for column in zip(*turns)])

    def sync(self, policy) -> None:
        pass


def scripted_calculator_run(tmp_path, monkeypatch, name, **overrides) -> Path:
    """A real smoke-sized calculator run whose policy is scripted right."""
    monkeypatch.setattr(
        loop,
        "build_backend",
        lambda config, model, tokenizer: CalculatorScript(tokenizer),
    )
    return smoke_run(tmp_path, name, task="calculator", steps=3, **overrides)


def test_a_healthy_multi_turn_run_fires_neither_tool_rule(tmp_path, monkeypatch):
    diagnosis = diagnose(scripted_calculator_run(tmp_path, monkeypatch, "healthy"))
    for rule in ("tool-output-trained", "turn-budget-truncates"):
        assert rule not in rules_found(diagnosis), format_report(diagnosis)
        assert rule not in diagnosis.skipped  # checked, and silent
    fractions = doctor.series(
        load_run(tmp_path / "healthy"), "tools/turn_limit_fraction"
    )
    assert [value for _, value in fractions] == [0.0, 0.0, 0.0]


def test_training_on_tool_output_is_an_error(tmp_path, monkeypatch):
    # The classic bug: the single-turn mask (prompt vs response) over the
    # multi-turn response trains the tool's reply and its tags.
    from grpo_lab.masks import pad_prompt_and_response_ids
    from grpo_lab.rollouts.multiturn import segment_model_flags

    def single_turn_mask(rollouts, tokenizer):
        # every response token counted as sampled (a log-prob of 0 at the tool's)
        rollouts.sampler_log_probs = [
            [-0.5 if flag else 0.0 for flag in segment_model_flags(row)]
            for row in rollouts.segments
        ]
        return pad_prompt_and_response_ids(
            rollouts.prompt_token_ids,
            rollouts.response_token_ids,
            tokenizer.pad_token_id,
        )

    monkeypatch.setattr(loop, "rollout_token_batch", single_turn_mask)
    diagnosis = diagnose(scripted_calculator_run(tmp_path, monkeypatch, "bug"))
    finding = only(diagnosis, "tool-output-trained")
    assert finding.severity == "error"
    assert finding.evidence == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert "model-sampled tokens" in finding.advice


def test_a_turn_limit_that_cuts_most_episodes_is_found(tmp_path, monkeypatch):
    # One model turn: every call is in the last allowed turn, so none is run.
    run_dir = scripted_calculator_run(
        tmp_path, monkeypatch, "one_turn", task_options={"max_turns": 1}
    )
    finding = only(diagnose(run_dir), "turn-budget-truncates")
    assert finding.evidence == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert finding.severity == "error"  # no answer is ever graded right: reward flat
    assert "max_turns" in finding.advice


def test_the_tool_rules_skip_a_single_turn_run(tmp_path):
    diagnosis = diagnose(smoke_run(tmp_path, "single", steps=1))
    assert "tool-output-trained" in diagnosis.skipped
    assert "turn-budget-truncates" in diagnosis.skipped


def test_the_tool_rules_cite_a_public_thread():
    for name in ("tool-output-trained", "turn-budget-truncates"):
        assert re.search(r"[\w-]+/[\w.-]+#\d+", doctor.RULES[name].__doc__), name


def test_a_run_from_a_saved_tiny_model_gets_the_tiny_learning_rate_range(tmp_path):
    # A run started from another run's checkpoint names a folder, not "tiny".
    records = [{"train/reward_mean": 0.2}]
    for name, width in (("tiny", 128), ("wide", 1536)):
        folder = tmp_path / f"{name}_model"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"hidden_size": width}))
        run = crafted_run(tmp_path, records, name=name, model=str(folder), lr=5e-4)
        found = rules_found(diagnose(run))
        assert ("learning-rate-out-of-range" in found) == (name == "wide"), found


# --- on-policy distillation -------------------------------------------------------


def distilled_records(teacher, student, kl, rewards) -> list[dict]:
    return [
        {
            "loss/teacher_log_prob_mean": t,
            "loss/student_log_prob_mean": s,
            "loss/distillation_kl_mean": k,
            "train/reward_mean": r,
        }
        for t, s, k, r in zip(teacher, student, kl, rewards)
    ]


def test_a_teacher_far_below_the_student_is_found(tmp_path):
    """A teacher 4.5 nats per token below the student, and staying there."""
    records = distilled_records(
        [-6.0, -6.2, -5.9, -6.1, -6.0, -6.0], [-1.5] * 6, [4.5] * 6, rising_reward(6)
    )
    diagnosis = diagnose(crafted_run(tmp_path, records))
    (finding,) = [f for f in diagnosis.findings if f.rule == "teacher-off-distribution"]
    assert finding.severity == "warning"
    assert [step for step, _ in finding.evidence] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    "teacher",
    [
        [-1.9, -2.0, -1.8, -2.1, -2.0, -1.9],  # 0.5 below: a teacher on its ground
        [-4.5, -4.0, -3.0, -2.2, -2.0, -1.9],  # 3 below, closing: distillation works
    ],
)
def test_a_teacher_near_the_student_or_closing_in_is_not_flagged(tmp_path, teacher):
    records = distilled_records(teacher, [-1.5] * 6, [0.4] * 6, rising_reward(6))
    diagnosis = diagnose(crafted_run(tmp_path, records))
    assert "teacher-off-distribution" not in rules_found(diagnosis)


def test_a_kl_falling_while_the_reward_stays_flat_is_found(tmp_path):
    kl = [1.0, 0.8, 0.5, 0.3, 0.15, 0.1]
    records = distilled_records([-2.0] * 6, [-1.8] * 6, kl, [0.3] * 6)
    found = rules_found(diagnose(crafted_run(tmp_path, records)))
    assert found["kl-falls-reward-flat"] == "warning"
    # The same KL with the reward rising: the student learns the skill.
    learning = distilled_records([-2.0] * 6, [-1.8] * 6, kl, rising_reward(6))
    assert "kl-falls-reward-flat" not in rules_found(
        diagnose(crafted_run(tmp_path, learning, name="learning"))
    )


def test_the_distillation_rules_skip_a_run_without_a_teacher(tmp_path):
    diagnosis = diagnose(crafted_run(tmp_path, [{"train/reward_mean": 0.3}] * 4))
    assert "teacher-off-distribution" in diagnosis.skipped
    assert "kl-falls-reward-flat" in diagnosis.skipped


# --- LoRA's learning rate, a flat reward with signal, the order of steps ------------------


def flat_with_signal(count: int, equal_fraction: float = 0.2) -> list[dict]:
    """Reward 0.30 +- 0.01 (alternating) while 1 - ``equal_fraction`` of the
    groups carry signal."""
    return [
        {
            "train/reward_mean": 0.30 + (0.01 if step % 2 else -0.01),
            "train/equal_reward_group_fraction": equal_fraction,
            "loss/loss": 0.0,
            "loss/gradient_norm": 0.05,
        }
        for step in range(count)
    ]


def test_lora_s_learning_rate_band_is_ten_times_full_fine_tuning_s(tmp_path):
    records = [{"train/reward_mean": 0.2}]
    pretrained = {"model": "some/model", "lora_rank": 16}
    low = crafted_run(tmp_path, records, name="low", **pretrained, lora_lr=5e-7)
    finding = only(diagnose(low), "learning-rate-out-of-range")
    assert (finding.severity, finding.metric) == ("warning", "lora_lr")
    assert "below 1e-06 for LoRA (rank 16) on a pretrained model" in finding.summary
    assert "LoRA Without Regret" in finding.cause
    # The same rate without adapters is in full fine-tuning's band.
    full = crafted_run(tmp_path, records, name="full", model="some/model", lr=5e-7)
    assert "learning-rate-out-of-range" not in rules_found(diagnose(full))
    # 5e-4: an error for full fine-tuning, inside LoRA's band.
    high = crafted_run(tmp_path, records, name="high", **pretrained, lora_lr=5e-4)
    assert "learning-rate-out-of-range" not in rules_found(diagnose(high))
    full = crafted_run(tmp_path, records, name="full_high", model="some/model", lr=5e-4)
    assert rules_found(diagnose(full))["learning-rate-out-of-range"] == "error"
    healthy = crafted_run(tmp_path, records, name="ok", **pretrained, lora_lr=5e-5)
    assert "learning-rate-out-of-range" not in rules_found(diagnose(healthy))


def test_a_trl_lora_run_at_full_fine_tuning_s_rate_is_found_by_its_adapter_file(
    tmp_path,
):
    """The reported run: TRL, LoRA at lr 5e-7, 100 steps, reward 0.30 +- 0.01
    while 80% of groups carry signal. peft's adapter_config.json in the
    checkpoint says the run trains adapters."""
    entries = [
        trl_entry(
            step,
            learning_rate=5e-7,
            reward=record["train/reward_mean"],
            frac_reward_zero_std=0.2,
            grad_norm=0.05,
            **{"completions/clipped_ratio": 0.0},
        )
        for step, record in enumerate(flat_with_signal(100), start=1)
    ]
    folder = tmp_path / "checkpoint-100"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps(trl_state(entries)))
    found = rules_found(diagnose(tmp_path))
    assert "learning-rate-out-of-range" not in found  # in full fine-tuning's band
    assert found["reward-flat-with-signal"] == "warning"
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 32})
    )
    assert load_run(tmp_path).adapter_config["r"] == 16
    finding = only(diagnose(tmp_path), "learning-rate-out-of-range")
    assert finding.severity == "warning" and "LoRA (rank 16)" in finding.summary


def test_a_reward_flat_while_groups_carry_signal_is_found(tmp_path):
    flat = only(
        diagnose(crafted_run(tmp_path, flat_with_signal(60), name="flat")),
        "reward-flat-with-signal",
    )
    assert flat.severity == "warning"
    assert "over the last 50 steps while 80% of groups carried signal" in flat.summary
    # Rising reward with the same signal: silent.
    rising = [
        {**record, "train/reward_mean": reward}
        for record, reward in zip(flat_with_signal(60), rising_reward(60), strict=True)
    ]
    found = rules_found(diagnose(crafted_run(tmp_path, rising, name="rising")))
    assert "reward-flat-with-signal" not in found
    # Flat with no signal is the no-signal rule's, not this one's.
    none = crafted_run(tmp_path, flat_with_signal(60, 0.95), name="none")
    found = rules_found(diagnose(none))
    assert "reward-flat-with-signal" not in found and "no-signal" in found
    # Too short to tell: skipped, and said so.
    short = diagnose(crafted_run(tmp_path, flat_with_signal(30), name="short"))
    assert short.skipped["reward-flat-with-signal"].startswith("fewer than 50")


def test_steps_logged_out_of_order_are_found(tmp_path):
    reversed_run = write_run(tmp_path / "reversed", [good_line(s) for s in (3, 2, 1)])
    finding = only(diagnose(reversed_run), "steps-out-of-order")
    assert finding.severity == "warning"
    assert finding.evidence == [(2, 3.0), (1, 2.0)]
    assert "goes back 2 time(s) (step 2 right after step 3)" in finding.summary
    assert [r["step"] for r in load_run(reversed_run).history] == [1, 2, 3]
    in_order = write_run(tmp_path / "in_order", [good_line(s) for s in (1, 2, 3)])
    assert "steps-out-of-order" not in rules_found(diagnose(in_order))


def test_a_verl_line_whose_data_is_a_list_is_named(tmp_path):
    """verl's file logger writes {"step": N, "data": {...}}; a line of another
    shape is named under unreadable, never read as grpo_lab's or dropped."""

    def verl_log(name: str, shapes: dict[int, type]) -> Path:
        lines = []
        for step, shape in shapes.items():
            data = verl_metrics(step)
            logged = [data] if shape is list else data
            lines.append(json.dumps({"step": step, "data": logged}))
        path = tmp_path / name
        path.write_text("\n".join(lines) + "\n")
        return path

    run = load_run(verl_log("mixed.jsonl", {1: dict, 2: list, 3: dict}))
    assert run.kind == "verl" and [r["step"] for r in run.history] == [1, 3]
    (unreadable,) = run.unreadable
    assert unreadable.startswith("mixed.jsonl line 2: data is [{")
    assert unreadable.endswith("(list), not an object")
    with pytest.raises(ValueError, match=r"2 unreadable lines; the first: lists"):
        load_run(verl_log("lists.jsonl", {1: list, 2: list}))
    healthy = load_run(verl_log("healthy.jsonl", {1: dict, 2: dict}))
    assert healthy.unreadable == [] and len(healthy.history) == 2
