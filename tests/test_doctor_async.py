"""The doctor's asynchronous rules: each fires on a run made that way and stays
silent on a healthy asynchronous run."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_lab.training.doctor import Run, diagnose, trl_record
from grpo_lab.training.doctor.reading import VERL_KEYS

ASYNC_RULES = (
    "staleness-at-bound",
    "many-dropped-groups",
    "dropped-groups-long",
    "correction-mostly-clipped",
)
CONFIG = {"max_staleness": 2, "rollout_batch_size": 32, "group_size": 4}  # 8 groups


def healthy_line(step: int) -> dict:
    """A step of a healthy asynchronous run: mostly fresh groups, one dropped
    group in four steps, of ordinary length, few corrected tokens."""
    line = {
        "step": step,
        "async/staleness_mean": 0.5,
        "async/staleness_max": 1.0 if step % 3 else 2.0,
        "async/dropped_groups_stale": 1.0 if step % 4 == 0 else 0.0,
        "async/kept_response_length_mean": 20.0,
        "rollout/is_token_corrected_fraction": 0.05,
    }
    if step % 4 == 0:
        line["async/dropped_response_length_mean"] = 21.0
    return line


def run_of(lines: list[dict], config: dict | None = CONFIG) -> Run:
    return Run(Path("synthetic"), "grpo_lab", lines, config=config)


def async_findings(run: Run) -> dict[str, object]:
    return {f.rule: f for f in diagnose(run).findings if f.rule in ASYNC_RULES}


def healthy() -> list[dict]:
    return [healthy_line(step) for step in range(1, 13)]


def test_a_healthy_asynchronous_run_has_no_asynchronous_findings():
    assert async_findings(run_of(healthy())) == {}


def test_a_synchronous_run_skips_the_asynchronous_rules_and_says_why():
    lines = [{"step": s, "train/reward_mean": 0.5} for s in range(1, 5)]
    skipped = diagnose(run_of(lines)).skipped
    assert "synchronous" in skipped["staleness-at-bound"]
    assert "synchronous" in skipped["many-dropped-groups"]


def test_staleness_at_its_bound_most_steps_is_found():
    lines = healthy()
    for line in lines[:8]:
        line["async/staleness_max"] = 2.0
    found = async_findings(run_of(lines))
    assert set(found) == {"staleness-at-bound"}
    summary = found["staleness-at-bound"].summary
    assert "10 of 12 steps" in summary  # steps 1-8, and 9 and 12 as healthy


def test_many_dropped_groups_are_found():
    lines = healthy()
    for line in lines:  # 3 dropped for 8 kept: 27% of the groups
        line["async/dropped_groups_stale"] = 3.0
    found = async_findings(run_of(lines))
    assert "many-dropped-groups" in found
    assert "27%" in found["many-dropped-groups"].summary
    assert "many-dropped-groups" not in async_findings(run_of(healthy()))


def test_dropped_groups_biased_to_long_responses_are_found():
    lines = healthy()
    for line in lines:
        if line["step"] % 4 == 0:
            line["async/dropped_response_length_mean"] = 35.0  # 1.75x the kept
    found = async_findings(run_of(lines))
    assert set(found) == {"dropped-groups-long"}
    assert found["dropped-groups-long"].evidence == [(4, 1.75), (8, 1.75), (12, 1.75)]


def test_a_correction_clipping_most_tokens_is_found():
    lines = healthy()
    for line in lines[2:]:
        line["rollout/is_token_corrected_fraction"] = 0.7
    assert set(async_findings(run_of(lines))) == {"correction-mostly-clipped"}


def test_trl_and_verl_staleness_metrics_map_onto_ours():
    record = trl_record(
        {
            "step": 4,
            "sample/staleness_mean": 1.5,
            "sample/staleness_max": 4.0,
            "sample/dropped_stale_total": 2.0,
        }
    )
    assert record["async/staleness_max"] == 4.0
    assert record["async/dropped_groups_stale"] == 2.0
    assert VERL_KEYS["training/off_policy/evicted_samples"] == (
        "async/dropped_groups_stale"
    )


@pytest.mark.parametrize("config", [None, {"group_size": 4}])
def test_a_run_without_the_settings_skips_the_rules_that_need_them(config):
    skipped = diagnose(run_of(healthy(), config=config)).skipped
    assert "max_staleness" in skipped["staleness-at-bound"]
    assert "groups per step" in skipped["many-dropped-groups"]
