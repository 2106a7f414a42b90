"""Widget callbacks (plain functions) and explorer construction (notebooks 03-05)."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import ipywidgets as widgets
import pytest
from matplotlib.figure import Figure

from grpo_lab.teaching.widgets import (
    RECIPES,
    advantage_explorer,
    cliprange_explorer,
    example_token_log_ratios,
    gspo_explorer,
    recipe_name,
    show_advantages,
    show_clipped_objective,
    show_token_and_sequence_ratios,
)


def test_recipe_names():
    assert recipe_name("mean", "std") == "GRPO"
    assert recipe_name("mean", "none") == "Dr. GRPO"
    assert recipe_name("none", "none") == "RFT"
    assert recipe_name("mean", "mean") == "MaxRL"
    assert recipe_name("none", "std") == "custom"
    assert len(set(RECIPES.values())) == 4


def test_show_advantages_prints_the_recipe_and_values(capsys):
    # Sliders arrive as keyword arguments r0..r3, in any order; r10 sorts after r2.
    figure = show_advantages("mean", "none", r1=0.0, r0=1.0, r2=0.0, r3=0.0)
    assert isinstance(figure, Figure)
    printed = capsys.readouterr().out
    # Dr. GRPO: mean 0.25 -> 0.75, -0.25, -0.25, -0.25
    assert "Dr. GRPO: advantages = [0.75, -0.25, -0.25, -0.25]" in printed
    show_advantages("none", "none", **{f"r{i}": float(i == 10) for i in range(11)})
    assert "[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]" in (
        capsys.readouterr().out
    )


def test_show_clipped_objective_and_gspo_callbacks():
    assert isinstance(show_clipped_objective(0.1), Figure)
    figure = show_token_and_sequence_ratios(response_length=4, outlier_ratio=0.5)
    assert "ratio" in figure.axes[0].get_ylabel()


def test_example_log_ratios_place_the_outlier_in_the_middle():
    log_ratios = example_token_log_ratios(5, 2.0)
    assert len(log_ratios) == 5
    assert log_ratios[2] == pytest.approx(math.log(2.0))
    assert max(abs(v) for i, v in enumerate(log_ratios) if i != 2) < 0.3
    assert log_ratios == example_token_log_ratios(5, 2.0)  # deterministic


@pytest.mark.parametrize(
    ("arguments", "message"),
    [((0, 2.0), "response_length must be at least 1"), ((3, 0.0), "outlier_ratio")],
)
def test_example_log_ratios_reject_bad_input(arguments, message):
    with pytest.raises(ValueError, match=message):
        example_token_log_ratios(*arguments)


def test_explorers_are_widget_boxes_with_an_output():
    for explorer in (
        advantage_explorer((1.0, 0.0, 0.5)),
        cliprange_explorer(0.3),
        gspo_explorer(8, 3.0),
    ):
        assert isinstance(explorer, widgets.VBox)
        assert isinstance(explorer.children[-1], widgets.Output)


def test_advantage_explorer_has_one_slider_per_response():
    explorer = advantage_explorer((1.0, 0.0, 0.0, 1.0, 0.5))
    sliders = explorer.children[1].children
    assert [s.value for s in sliders] == [1.0, 0.0, 0.0, 1.0, 0.5]
    with pytest.raises(ValueError, match="at least 2"):
        advantage_explorer((1.0,))
