"""The rollout-side settings through `grpo-lab train`: sampler mismatch and its
correction, dynamic sampling, truncated-response masking and the overlong
penalty each finish a smoke run and log their metrics; bad combinations exit 2
with one line naming the setting."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from grpo_lab.cli import main as cli
from grpo_lab.rollouts import BACKEND_RECORDS
from grpo_lab.training.dynamic_sampling import DynamicSamplingWarning

SMOKE = ["train", "--profile", "smoke", "--steps", "2", "--no-progress"]
# Two updates per rollout batch of 16: old log-probs are scored once for the
# whole batch, so the gap and correction metrics are logged on every step,
# even one where every group's rewards are equal (nothing to update).
OFF_POLICY = [
    "--train-batch-size", "8", "--importance-reweighting-method", "grpo",
    "--cliprange", "0.2",
]  # fmt: skip
GAP_KEYS = {"rollout/sampler_log_prob_diff_mean", "rollout/sampler_log_prob_diff_max"}
CORRECTION_KEYS = {
    "rollout/is_ratio_min", "rollout/is_ratio_mean", "rollout/is_ratio_max",
    "rollout/is_token_corrected_fraction", "rollout/is_sequence_corrected_fraction",
}  # fmt: skip
DYNAMIC_SAMPLING_KEYS = {
    "rollout/dynamic_sampling_rounds", "rollout/dynamic_sampling_gave_up",
    "rollout/kept_group_fraction",
}  # fmt: skip
TRUNCATION_KEYS = {
    "rollout/clipped_fraction", "rollout/terminated_length_mean",
    "rollout/truncated_length_mean",
}  # fmt: skip


def train_steps(run_dir: Path, *flags: str) -> list[dict]:
    """Run `grpo-lab train` on the smoke profile; the GRPO step records."""
    code = cli.main([*SMOKE, "--run-dir", str(run_dir), *flags])
    assert code == 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [record for record in map(json.loads, lines) if "step" in record]
    updates = [record for record in steps if "train/reward_mean" in record]
    assert [record["step"] for record in updates] == [1, 2]
    return updates


def test_a_stale_sampler_with_token_truncation_logs_the_gap_and_the_weights(
    tmp_path,
):
    flags = [
        "--backend", "mismatch", "--mismatch", "stale", "--mismatch-sync-every", "2",
        "--sampler-correction", "token_truncate", "--sampler-correction-cap", "1.5",
        *OFF_POLICY,
    ]  # fmt: skip
    for record in train_steps(tmp_path / "run", *flags):
        assert set(record) >= GAP_KEYS | CORRECTION_KEYS
        assert 0 <= record["rollout/is_ratio_min"] <= record["rollout/is_ratio_mean"]
        assert record["rollout/is_ratio_mean"] <= record["rollout/is_ratio_max"]
        # Truncation caps the weights, not the ratios; it never drops a response.
        assert 0 <= record["rollout/is_token_corrected_fraction"] <= 1
        assert record["rollout/is_sequence_corrected_fraction"] == 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (saved["mismatch"], saved["mismatch_sync_every"]) == ("stale", 2)
    assert saved["sampler_correction"] == "token_truncate"


def test_dynamic_sampling_logs_its_rounds(tmp_path):
    flags = ["--dynamic-sampling", "--dynamic-sampling-max-rounds", "2"]
    # The smoke model earns no reward: no group has signal, every step gives up.
    with pytest.warns(DynamicSamplingWarning, match="dynamic_sampling_max_rounds"):
        records = train_steps(tmp_path / "run", *flags)
    for record in records:
        assert set(record) >= DYNAMIC_SAMPLING_KEYS
        assert record["rollout/dynamic_sampling_rounds"] == 2
        assert record["rollout/dynamic_sampling_gave_up"] == 1
        assert record["rollout/kept_group_fraction"] == 0


def test_masked_truncations_and_the_overlong_penalty_log_their_metrics(tmp_path):
    flags = ["--mask-truncated-completions", "--overlong-buffer", "2"]
    records = train_steps(tmp_path / "run", *flags, "--max-new-tokens", "4")
    for record in records:
        assert set(record) >= TRUNCATION_KEYS | {"train/overlong_penalty_mean"}
        assert 0 <= record["rollout/clipped_fraction"] <= 1
        assert record["train/overlong_penalty_mean"] <= 0
        assert record["train/response_length_max"] <= 4


# Each: the flags, and the start of the one line the command prints.
BAD_COMBINATIONS = {
    "mask range upside down": (
        ["--sampler-correction", "sequence_mask", "--sampler-correction-low", "4",
         "--sampler-correction-high", "2"],
        "sampler_correction_low must be below sampler_correction_high",
    ),
    "overlong buffer past the response length": (
        ["--overlong-buffer", "5", "--max-new-tokens", "4"],
        "overlong_buffer must be at most max_new_tokens (4)",
    ),
    "a correction without sampler log-probs": (
        ["--backend", "hf", "--sampler-correction", "token_truncate"],
        "sampler_correction 'token_truncate' needs the sampler's log-probs",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", BAD_COMBINATIONS)
def test_a_bad_combination_exits_2_with_one_line_naming_it(
    name, tmp_path, monkeypatch, capsys
):
    flags, expected = BAD_COMBINATIONS[name]
    # Every backend reports sampler log-probs; hf is made one that does not.
    hf = dataclasses.replace(BACKEND_RECORDS["hf"], sampler_log_probs=False)
    monkeypatch.setitem(BACKEND_RECORDS, "hf", hf)
    code = cli.main([*SMOKE, "--run-dir", str(tmp_path / "run"), *flags])
    error = capsys.readouterr().err
    lines = [line for line in error.splitlines() if ": warning: " not in line]
    assert code == 2 and "Traceback" not in error
    assert len(lines) == 1 and lines[0].startswith("grpo-lab train: "), error
    assert expected in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
