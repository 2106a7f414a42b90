"""Interactive explorers for the notebooks, built on ipywidgets (notebooks 03-05).

Each explorer is a thin shell: controls whose changes call one drawing function
(``draw_*`` here), which draws with :mod:`grpo_lab.teaching.plots` into a
standalone matplotlib ``Figure`` it owns (pyplot never sees it) and returns it.
The explorer renders that figure to PNG bytes and puts them in a
``widgets.Image``, replacing the previous picture in one step: there is no
shared pyplot state between two redraws and no moment at which the chart is
cleared but not yet drawn. Tests call the ``draw_*`` functions directly, and
drive the controls to read the image each change produced.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ipywidgets as widgets
import torch
from matplotlib.figure import Figure

from grpo_lab.advantages import (
    ADVANTAGE_NORMALIZERS,
    BASELINES,
    TOKEN_NORMALIZERS,
    compute_group_normalized_rewards,
)
from grpo_lab.teaching.plots import (
    figure_png,
    plot_advantages,
    plot_clipped_objective,
    plot_token_and_sequence_ratios,
)

# Published recipes as (baseline, advantage normalizer).
RECIPES = {
    "GRPO": ("mean", "std"),
    "Dr. GRPO": ("mean", "none"),
    "RFT": ("none", "none"),
    "MaxRL": ("mean", "mean"),
}


def recipe_name(baseline: str, advantage_normalizer: str) -> str:
    """The published method that a (baseline, normalizer) pair is, or 'custom'."""
    for name, recipe in RECIPES.items():
        if recipe == (baseline, advantage_normalizer):
            return name
    return "custom"


def chart_explorer(
    controls: Mapping[str, widgets.ValueWidget],
    draw: Callable[..., Figure],
    caption: Callable[..., str] | None = None,
) -> tuple[widgets.Image, widgets.Label]:
    """An image that shows ``draw(**values)``, redrawn whenever a control changes.

    ``values`` maps each name of ``controls`` to that control's value. ``caption``
    (same arguments) gives the text of the label under the image. The image is
    drawn once before this returns.
    """
    image = widgets.Image(format="png")
    label = widgets.Label()

    def redraw(_change: Any = None) -> None:
        values = {name: control.value for name, control in controls.items()}
        if caption is not None:
            label.value = caption(**values)
        image.value = figure_png(draw(**values))

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return image, label


def _ordered_rewards(rewards: Mapping[str, float]) -> list[float]:
    """Values of r0, r1, ..., r10 in index order (r10 after r2)."""
    return [rewards[key] for key in sorted(rewards, key=lambda k: int(k[1:]))]


def advantages_caption(
    baseline: str = "mean", advantage_normalizer: str = "std", **rewards: float
) -> str:
    """'<recipe>: advantages = [...]' for rewards r0, r1, ... of one group."""
    ordered = _ordered_rewards(rewards)
    advantages, _ = compute_group_normalized_rewards(
        torch.tensor(ordered), len(ordered), baseline, 1e-6, advantage_normalizer
    )
    return (
        f"{recipe_name(baseline, advantage_normalizer)}: advantages = "
        f"{[round(a, 3) for a in advantages.tolist()]}"
    )


def draw_advantages(
    baseline: str = "mean", advantage_normalizer: str = "std", **rewards: float
) -> Figure:
    """Drawing of :func:`advantage_explorer`: rewards r0, r1, ... of one group."""
    return plot_advantages(
        _ordered_rewards(rewards), baseline, advantage_normalizer, standalone=True
    )


def advantage_explorer(rewards: Sequence[float] = (1.0, 0.0, 0.0, 1.0)) -> widgets.VBox:
    """One slider per response of a group, and the baseline/normalizer choice."""
    if len(rewards) < 2:
        raise ValueError(f"rewards must hold at least 2 values, got {len(rewards)}")
    sliders = {
        f"r{index}": widgets.FloatSlider(
            value=float(value), min=0.0, max=1.0, step=0.05, description=f"r{index}"
        )
        for index, value in enumerate(rewards)
    }
    baseline = widgets.Dropdown(options=BASELINES, value="mean", description="baseline")
    # One group of rewards and no responses: the token-weighted normalizers
    # have no token counts to weigh by (notebook 10 shows them).
    per_response = [n for n in ADVANTAGE_NORMALIZERS if n not in TOKEN_NORMALIZERS]
    normalizer = widgets.Dropdown(
        options=per_response, value="std", description="normalizer"
    )
    controls = {"baseline": baseline, "advantage_normalizer": normalizer, **sliders}
    image, label = chart_explorer(controls, draw_advantages, advantages_caption)
    # The chart first, so that it shows right under the cell; its controls below.
    return widgets.VBox(
        [
            image,
            label,
            widgets.HBox([baseline, normalizer]),
            widgets.VBox(list(sliders.values())),
        ]
    )


def draw_clipped_objective(cliprange: float = 0.2) -> Figure:
    """Drawing of :func:`cliprange_explorer`."""
    return plot_clipped_objective(cliprange, standalone=True)


def cliprange_explorer(cliprange: float = 0.2) -> widgets.VBox:
    """A cliprange slider over the clipped objective and its gradient."""
    slider = widgets.FloatSlider(
        value=cliprange, min=0.01, max=0.8, step=0.01, description="cliprange ε"
    )
    image, _ = chart_explorer({"cliprange": slider}, draw_clipped_objective)
    return widgets.VBox([slider, image])


def example_token_log_ratios(
    response_length: int, outlier_ratio: float, seed: int = 0
) -> list[float]:
    """Small token log-ratios (std 0.05) and one outlier token whose ratio is
    ``outlier_ratio``: the picture behind GSPO's sequence ratio."""
    if response_length < 1:
        raise ValueError(f"response_length must be at least 1, got {response_length}")
    if not outlier_ratio > 0:
        raise ValueError(f"outlier_ratio must be positive, got {outlier_ratio}")
    generator = torch.Generator().manual_seed(seed)
    log_ratios = 0.05 * torch.randn(response_length, generator=generator)  # (T,)
    log_ratios[response_length // 2] = math.log(outlier_ratio)
    return log_ratios.tolist()


def draw_token_and_sequence_ratios(
    response_length: int = 12, outlier_ratio: float = 2.0
) -> Figure:
    """Drawing of :func:`gspo_explorer`."""
    log_ratios = example_token_log_ratios(response_length, outlier_ratio)
    return plot_token_and_sequence_ratios(log_ratios, standalone=True)


def gspo_explorer(
    response_length: int = 12, outlier_ratio: float = 2.0
) -> widgets.VBox:
    """Sliders for the response length and one outlier token's ratio."""
    length = widgets.IntSlider(
        value=response_length, min=1, max=64, description="length |o|"
    )
    outlier = widgets.FloatLogSlider(
        value=outlier_ratio, base=10, min=-1, max=1, step=0.02, description="outlier w"
    )
    image, _ = chart_explorer(
        {"response_length": length, "outlier_ratio": outlier},
        draw_token_and_sequence_ratios,
    )
    return widgets.VBox([widgets.HBox([length, outlier]), image])
