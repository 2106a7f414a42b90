"""Training curves of a run, drawn from its ``metrics.jsonl``.

``plot_run_curves(history)`` returns a matplotlib ``Figure`` with one panel per
quantity a GRPO run is judged by: reward, held-out accuracy, token entropy,
clip fraction and response length. ``grpo-lab plot RUN_DIR`` saves it as
``RUN_DIR/curves.png``. :func:`curve` reads one metric's (steps, values) and is
the only copy of that logic. Taught in ``notebooks/08_training_loop.ipynb``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from grpo_lab.training.metrics import read_metrics

# (panel title, [(metrics key, legend label), ...]); a panel shows what exists.
CURVE_PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "reward",
        (
            ("train/reward_mean", "reward"),
            ("train/format_reward_mean", "format reward"),
        ),
    ),
    (
        "held-out accuracy",
        (
            ("eval/accuracy_greedy", "greedy"),
            ("eval/accuracy_sampled", "sampled"),
        ),
    ),
    ("token entropy (nats)", (("loss/token_entropy", "entropy"),)),
    ("clip fraction", (("loss/clip_fraction", "clipped tokens"),)),
    (
        "response length (tokens)",
        (
            ("train/response_length", "train"),
            ("eval/response_length", "eval (greedy)"),
        ),
    ),
)


def curve(
    history: Sequence[Mapping[str, Any]], key: str
) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the GRPO lines that logged a number for it.

    The one reader of a metric's curve: run plots, the explorer's comparisons and
    the notebooks all call it. SFT lines (no ``step``) and values that are not
    numbers (``None`` stands for a non-finite value in ``metrics.jsonl``) are left
    out; steps come back as ``int`` and values as ``float``.
    """
    steps, values = [], []
    for record in history:
        value = record.get(key)
        if "step" in record and isinstance(value, (int, float)):
            steps.append(int(record["step"]))
            values.append(float(value))
    return steps, values


def plot_run_curves(
    history: Sequence[Mapping[str, Any]], title: str | None = None
) -> Figure:
    """One panel per quantity in :data:`CURVE_PANELS`; a missing one says so."""
    if not any("step" in record for record in history):
        raise ValueError("history must contain at least one GRPO line with a 'step'")
    figure = Figure(figsize=(4 * len(CURVE_PANELS), 3.2))
    axes = figure.subplots(1, len(CURVE_PANELS))
    for axis, (panel_title, series) in zip(axes, CURVE_PANELS):
        drawn = False
        for key, label in series:
            steps, values = curve(history, key)
            if steps:
                axis.plot(
                    steps, values, marker="." if len(steps) < 40 else None, label=label
                )
                drawn = True
        if drawn:
            axis.legend(fontsize=8)
        else:
            axis.text(
                0.5,
                0.5,
                "not logged in this run",
                ha="center",
                va="center",
                transform=axis.transAxes,
                color="grey",
            )
        axis.set(title=panel_title, xlabel="GRPO step")
        axis.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    return figure


def save_run_curves(run_dir: str | os.PathLike, file_name: str = "curves.png") -> Path:
    """Draw ``run_dir``'s metrics and save them as ``run_dir / file_name``."""
    run_dir = Path(run_dir)
    history = read_metrics(run_dir)
    if not history:
        raise ValueError(f"run_dir {str(run_dir)!r} has no metrics.jsonl lines")
    path = run_dir / file_name
    plot_run_curves(history, title=run_dir.name).savefig(path, dpi=100)
    return path
