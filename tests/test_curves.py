"""Run curves: one panel per quantity, drawn from metrics lines."""

from __future__ import annotations

import pytest

from grpo_lab.teaching.curves import (
    CURVE_PANELS,
    curve,
    plot_run_curves,
    save_run_curves,
)
from grpo_lab.training.metrics import append_metrics

HISTORY = [
    {"sft/step": 1, "sft/loss": 2.0},
    {"step": 0, "eval/accuracy_greedy": 0.3, "eval/accuracy_sampled": 0.2},
    {"step": 1, "train/reward_mean": 0.25, "loss/token_entropy": 1.5,
     "train/response_length": 6.0},
    {"step": 2, "train/reward_mean": 0.5, "loss/token_entropy": 1.2,
     "train/response_length": 5.5, "eval/accuracy_greedy": 0.6,
     "eval/accuracy_sampled": None},
]  # fmt: skip


def test_curve_reads_steps_that_carry_the_key():
    assert curve(HISTORY, "train/reward_mean") == ([1, 2], [0.25, 0.5])
    # None (a non-finite value in the file) is left out; SFT lines have no step.
    assert curve(HISTORY, "eval/accuracy_sampled") == ([0], [0.2])
    assert curve(HISTORY, "loss/clip_fraction") == ([], [])


def test_curve_keeps_numbers_only_and_returns_int_steps_float_values():
    history = [
        {"sft/loss": 1.0},  # no step: an SFT line
        {"step": 1.0, "x": 2},
        {"step": 2, "x": "n/a"},
        {"step": 3, "x": None},
        {"step": 4, "x": 0.5},
    ]
    steps, values = curve(history, "x")
    assert (steps, values) == ([1, 4], [2.0, 0.5])
    assert all(type(s) is int for s in steps) and all(type(v) is float for v in values)


def test_curve_is_the_one_copy_the_explorer_uses():
    from grpo_lab.teaching import explorer

    assert explorer.curve is curve
    assert not hasattr(explorer, "metric_curve")


def test_plot_has_a_panel_per_quantity_and_marks_missing_ones():
    figure = plot_run_curves(HISTORY, title="run")
    axes = figure.axes
    assert len(axes) == len(CURVE_PANELS) == 5
    titles = [axis.get_title() for axis in axes]
    assert titles[0] == "reward" and titles[3] == "clip fraction"
    reward_line = axes[0].get_lines()[0]
    assert list(reward_line.get_xdata()) == [1, 2]
    assert list(reward_line.get_ydata()) == [0.25, 0.5]
    assert len(axes[1].get_lines()) == 2  # greedy and sampled accuracy
    assert not axes[3].get_lines()
    assert "not logged" in axes[3].texts[0].get_text()


def test_plot_needs_grpo_lines():
    with pytest.raises(ValueError, match="history must contain"):
        plot_run_curves([{"sft/step": 1}])


def test_save_writes_a_png(tmp_path):
    for record in HISTORY:
        append_metrics(tmp_path, record)
    path = save_run_curves(tmp_path)
    assert path == tmp_path / "curves.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no metrics"):
        save_run_curves(tmp_path / "empty")
