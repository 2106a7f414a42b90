"""Widget drawings (plain functions) and the explorers of notebooks 03-05, driven."""

from __future__ import annotations

import io
import math

import matplotlib

matplotlib.use("Agg")

import ipywidgets as widgets
import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.figure import Figure

from grpo_lab.teaching.widgets import (
    RECIPES,
    advantage_explorer,
    advantages_caption,
    chart_explorer,
    cliprange_explorer,
    draw_advantages,
    draw_clipped_objective,
    draw_token_and_sequence_ratios,
    example_token_log_ratios,
    gspo_explorer,
    recipe_name,
)

UPDATES = 20


def drawn_fraction(png: bytes) -> float:
    """Share of the image's pixels that are not the white figure background."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "the image must be a PNG"
    pixels = matplotlib.image.imread(io.BytesIO(png))[..., :3]  # (H, W, 3)
    return float(np.mean(np.any(pixels < 0.95, axis=-1)))


def image_of(explorer: widgets.VBox) -> widgets.Image:
    (image,) = [
        child for child in explorer.children if isinstance(child, widgets.Image)
    ]
    return image


def test_recipe_names():
    assert recipe_name("mean", "std") == "GRPO"
    assert recipe_name("mean", "none") == "Dr. GRPO"
    assert recipe_name("none", "none") == "RFT"
    assert recipe_name("mean", "mean") == "MaxRL"
    assert recipe_name("none", "std") == "custom"
    assert len(set(RECIPES.values())) == 4


def test_advantages_caption_names_the_recipe_and_values():
    # Sliders arrive as keyword arguments r0..r3, in any order; r10 sorts after r2.
    caption = advantages_caption("mean", "none", r1=0.0, r0=1.0, r2=0.0, r3=0.0)
    # Dr. GRPO: mean 0.25 -> 0.75, -0.25, -0.25, -0.25
    assert caption == "Dr. GRPO: advantages = [0.75, -0.25, -0.25, -0.25]"
    caption = advantages_caption(
        "none", "none", **{f"r{i}": float(i == 10) for i in range(11)}
    )
    assert caption.endswith("[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]")


def test_drawings_are_standalone_figures_pyplot_never_sees():
    before = plt.get_fignums()
    figures = [
        draw_advantages("mean", "std", r0=1.0, r1=0.0),
        draw_clipped_objective(0.1),
        draw_token_and_sequence_ratios(response_length=4, outlier_ratio=0.5),
    ]
    assert all(isinstance(figure, Figure) and figure.axes for figure in figures)
    assert plt.get_fignums() == before
    assert "ratio" in figures[2].axes[0].get_ylabel()
    # r1 then r0 as keywords: the bars are in index order, r0 = 1 first.
    heights = [bar.get_height() for bar in figures[0].axes[0].patches]
    assert heights == pytest.approx([1.0, 0.0])


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


def test_explorers_show_a_drawn_image_as_soon_as_they_are_built():
    for explorer in (
        advantage_explorer((1.0, 0.0, 0.5)),
        cliprange_explorer(0.3),
        gspo_explorer(8, 3.0),
    ):
        assert isinstance(explorer, widgets.VBox)
        assert drawn_fraction(image_of(explorer).value) > 0.02


def test_advantage_explorer_has_one_slider_per_response():
    explorer = advantage_explorer((1.0, 0.0, 0.0, 1.0, 0.5))
    # The chart comes first (right under the cell, not below the controls).
    assert isinstance(explorer.children[0], widgets.Image)
    sliders = explorer.children[3].children
    assert [s.value for s in sliders] == [1.0, 0.0, 0.0, 1.0, 0.5]
    label = explorer.children[1]
    # GRPO over (1, 0, 0, 1, 0.5): mean 0.5, std 0.5: advantages +-1, 0.
    assert label.value == "GRPO: advantages = [1.0, -1.0, -1.0, 1.0, 0.0]"
    with pytest.raises(ValueError, match="at least 2"):
        advantage_explorer((1.0,))


def drive(control: widgets.ValueWidget, values, image: widgets.Image) -> list[bytes]:
    """Set ``control`` to each value in turn; the image shown after each change."""
    shown = []
    for value in values:
        control.value = value
        shown.append(image.value)
    return shown


def assert_every_image_is_drawn_and_new(shown: list[bytes], first: bytes) -> None:
    assert len(shown) >= UPDATES
    fractions = [drawn_fraction(png) for png in shown]
    assert min(fractions) > 0.02, f"a blank chart among {fractions}"
    # Every change of the setting redrew the picture.
    assert all(a != b for a, b in zip([first, *shown], shown))


@pytest.mark.slow
def test_every_advantage_explorer_update_draws_a_chart():
    before = plt.get_fignums()
    explorer = advantage_explorer((1.0, 0.0, 0.0, 0.0))
    image = image_of(explorer)
    baseline, normalizer = explorer.children[2].children
    first_slider = explorer.children[3].children[0]
    label = explorer.children[1]
    first = image.value
    shown = drive(first_slider, [0.05 * (i % 19) for i in range(1, UPDATES + 1)], image)
    assert_every_image_is_drawn_and_new(shown, first)
    captions = set()
    for base in ("none", "mean"):
        baseline.value = base
        for norm in normalizer.options:
            normalizer.value = norm
            assert drawn_fraction(image.value) > 0.02
            captions.add(label.value.split(":")[0])
    assert {"RFT", "Dr. GRPO", "GRPO", "MaxRL"} <= captions
    assert plt.get_fignums() == before


@pytest.mark.slow
def test_every_cliprange_explorer_update_draws_a_chart():
    before = plt.get_fignums()
    explorer = cliprange_explorer(0.2)
    image = image_of(explorer)
    first = image.value
    values = [round(0.03 + 0.035 * i, 2) for i in range(UPDATES)]
    shown = drive(explorer.children[0], values, image)
    assert_every_image_is_drawn_and_new(shown, first)
    assert plt.get_fignums() == before


@pytest.mark.slow
def test_every_gspo_explorer_update_draws_a_chart():
    before = plt.get_fignums()
    explorer = gspo_explorer(12, 2.0)
    image = image_of(explorer)
    length, outlier = explorer.children[0].children
    first = image.value
    half = UPDATES // 2
    shown = drive(length, [1 + 6 * i for i in range(half)], image)
    shown += drive(outlier, [0.1 * 1.25**i for i in range(half)], image)
    assert_every_image_is_drawn_and_new(shown, first)
    assert plt.get_fignums() == before


def test_chart_explorer_redraws_on_each_change_with_the_control_values():
    calls = []

    def draw(width: float) -> Figure:
        calls.append(width)
        figure = Figure(figsize=(1, 1))
        figure.subplots().plot([0, width], [0, 1])
        return figure

    slider = widgets.FloatSlider(value=1.0, min=0.0, max=5.0)
    image, label = chart_explorer(
        {"width": slider}, draw, caption=lambda width: f"w={width}"
    )
    assert calls == [1.0] and label.value == "w=1.0"
    slider.value = 2.5
    assert calls == [1.0, 2.5] and label.value == "w=2.5"
    assert drawn_fraction(image.value) > 0.0
