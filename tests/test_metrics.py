"""Metrics JSONL: plain numbers, crash-tolerant reading, truncation on resume."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_lab.training.metrics import (
    append_metrics,
    count_metric_lines,
    flatten_metrics,
    mean_metrics,
    metrics_path,
    read_metrics,
    step_records,
    to_plain_number,
    truncate_metrics,
    without_timing,
)


def test_round_trip_turns_tensors_into_floats(tmp_path):
    append_metrics(tmp_path, {"step": 1, "loss/loss": torch.tensor(0.5)})
    append_metrics(tmp_path, {"step": 2, "loss/loss": float("nan")})
    assert read_metrics(tmp_path) == [
        {"step": 1, "loss/loss": 0.5},
        {"step": 2, "loss/loss": None},  # JSON has no NaN
    ]
    assert count_metric_lines(tmp_path) == 2


def test_reading_a_missing_file_gives_nothing(tmp_path):
    assert read_metrics(tmp_path) == []
    assert count_metric_lines(tmp_path) == 0


def test_a_line_cut_short_by_a_crash_is_skipped(tmp_path):
    metrics_path(tmp_path).write_text('{"step": 1}\n{"step": 2, "loss/lo')
    assert read_metrics(tmp_path) == [{"step": 1}]
    assert count_metric_lines(tmp_path) == 1


def test_a_broken_line_in_the_middle_raises(tmp_path):
    metrics_path(tmp_path).write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(tmp_path)


def test_truncate_keeps_the_first_lines(tmp_path):
    for step in range(5):
        append_metrics(tmp_path, {"step": step})
    metrics_path(tmp_path).write_text(metrics_path(tmp_path).read_text() + '{"par')
    truncate_metrics(tmp_path, 3)
    assert read_metrics(tmp_path) == [{"step": 0}, {"step": 1}, {"step": 2}]
    assert metrics_path(tmp_path).read_text().endswith("}\n")
    with pytest.raises(ValueError, match="line_count must be at most the 3 lines"):
        truncate_metrics(tmp_path, 4)
    with pytest.raises(ValueError, match="line_count must be >= 0"):
        truncate_metrics(tmp_path, -1)
    truncate_metrics(tmp_path, 0)
    assert read_metrics(tmp_path) == []


def test_mean_and_flatten():
    # loss: (1 + 3) / 2 = 2; clip only in the second record: 0.5 / 1.
    mean = mean_metrics([{"loss": torch.tensor(1.0)}, {"loss": 3.0, "clip": 0.5}])
    assert mean == {"loss": 2.0, "clip": 0.5}
    assert flatten_metrics("loss", {"loss": torch.tensor(2.0)}) == {"loss/loss": 2.0}


def test_plain_numbers_and_filters():
    assert to_plain_number(torch.tensor(3)) == 3
    assert math.isclose(to_plain_number(torch.tensor(0.25)), 0.25)
    with pytest.raises(ValueError, match="scalar tensor"):
        to_plain_number(torch.zeros(2))
    history = [{"sft/step": 1}, {"step": 1, "time/step_seconds": 2.0, "a": 1}]
    assert step_records(history) == [{"step": 1, "time/step_seconds": 2.0, "a": 1}]
    assert without_timing(history[1]) == {"step": 1, "a": 1}
