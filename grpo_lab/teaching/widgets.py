"""Interactive explorers for the notebooks, built on ipywidgets.

Each explorer is a thin shell: sliders wired by ``widgets.interactive_output``
into an ``Output`` widget, so nothing blocks and no figure leaks into the cell's
own output. The callback behind each one is a plain function here
(``show_*``) that draws with :mod:`grpo_lab.teaching.plots`, displays the
figure, closes it and returns it, so tests call it directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
from IPython.display import display
from matplotlib.figure import Figure

from grpo_lab.advantages import (
    ADVANTAGE_NORMALIZERS,
    BASELINES,
    compute_group_normalized_rewards,
)
from grpo_lab.teaching.plots import (
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


def _show(figure: Figure) -> Figure:
    display(figure)
    plt.close(figure)
    return figure


def recipe_name(baseline: str, advantage_normalizer: str) -> str:
    """The published method that a (baseline, normalizer) pair is, or 'custom'."""
    for name, recipe in RECIPES.items():
        if recipe == (baseline, advantage_normalizer):
            return name
    return "custom"


def show_advantages(
    baseline: str = "mean", advantage_normalizer: str = "std", **rewards: float
) -> Figure:
    """Callback of :func:`advantage_explorer`: rewards r0, r1, ... of one group."""
    ordered = [rewards[key] for key in sorted(rewards, key=lambda k: int(k[1:]))]
    advantages, _ = compute_group_normalized_rewards(
        torch.tensor(ordered), len(ordered), baseline, 1e-6, advantage_normalizer
    )
    print(
        f"{recipe_name(baseline, advantage_normalizer)}: advantages = "
        f"{[round(a, 3) for a in advantages.tolist()]}"
    )
    return _show(plot_advantages(ordered, baseline, advantage_normalizer))


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
    normalizer = widgets.Dropdown(
        options=ADVANTAGE_NORMALIZERS, value="std", description="normalizer"
    )
    controls = {"baseline": baseline, "advantage_normalizer": normalizer, **sliders}
    output = widgets.interactive_output(show_advantages, controls)
    return widgets.VBox(
        [
            widgets.HBox([baseline, normalizer]),
            widgets.VBox(list(sliders.values())),
            output,
        ]
    )


def show_clipped_objective(cliprange: float = 0.2) -> Figure:
    """Callback of :func:`cliprange_explorer`."""
    return _show(plot_clipped_objective(cliprange))


def cliprange_explorer(cliprange: float = 0.2) -> widgets.VBox:
    """A cliprange slider over the clipped objective and its gradient."""
    slider = widgets.FloatSlider(
        value=cliprange, min=0.01, max=0.8, step=0.01, description="cliprange ε"
    )
    output = widgets.interactive_output(show_clipped_objective, {"cliprange": slider})
    return widgets.VBox([slider, output])


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


def show_token_and_sequence_ratios(
    response_length: int = 12, outlier_ratio: float = 2.0
) -> Figure:
    """Callback of :func:`gspo_explorer`."""
    log_ratios = example_token_log_ratios(response_length, outlier_ratio)
    return _show(plot_token_and_sequence_ratios(log_ratios))


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
    output = widgets.interactive_output(
        show_token_and_sequence_ratios,
        {"response_length": length, "outlier_ratio": outlier},
    )
    return widgets.VBox([widgets.HBox([length, outlier]), output])
