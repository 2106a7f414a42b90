"""Figures and HTML tables for the notebooks: plain functions that return them.

Every function takes explicit numbers and returns a matplotlib ``Figure`` (or an
HTML string) without showing it, so a test can call it and a widget can redraw
it. Notebooks 00-05, 08 and 14 use them.

By default a figure is made through pyplot, so that ``plt.show()`` in a notebook
cell shows it. ``standalone=True`` makes a ``Figure`` that pyplot never sees:
widget callbacks draw into one they own, render it with :func:`figure_png`, and
no global figure state is shared between two redraws.
"""

from __future__ import annotations

import html
import io
from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from grpo_lab.advantages import compute_group_normalized_rewards
from grpo_lab.losses import compute_policy_gradient_loss

PROMPT_COLOUR = "#e8e8e8"
RESPONSE_COLOUR = "#b7e4c7"
PAD_COLOUR = "#ffffff"
# Pixels per inch of the PNG images the widgets show.
PNG_DPI = 100


def new_figure(figsize: tuple[float, float], *, standalone: bool = False) -> Figure:
    """A figure of ``figsize`` inches: through pyplot, or outside it if standalone.

    Its layout is tightened each time it is drawn (one drawing pass per picture,
    where a ``tight_layout()`` call would add one of its own).
    """
    if standalone:
        return Figure(figsize=figsize, layout="tight")
    return plt.figure(figsize=figsize, layout="tight")


def figure_png(figure: Figure, dpi: int = PNG_DPI) -> bytes:
    """``figure`` rendered as PNG bytes (what a ``widgets.Image`` shows)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def response_mask_table(
    tokens: Sequence[Sequence[str]],
    response_mask: Sequence[Sequence[int]],
    pad_token: str = "<pad>",
    row_labels: Sequence[str] | None = None,
) -> str:
    """An HTML table of tokens: green where response_mask = 1 (trained), grey
    prompt, white padding. (B, T) tokens and mask of the same shape."""
    if len(tokens) != len(response_mask) or any(
        len(row) != len(mask_row) for row, mask_row in zip(tokens, response_mask)
    ):
        raise ValueError(
            "tokens and response_mask must have the same (B, T) shape, got "
            f"{[len(r) for r in tokens]} and {[len(r) for r in response_mask]}"
        )
    labels = list(row_labels) if row_labels is not None else None
    rows = []
    for index, (row, mask_row) in enumerate(zip(tokens, response_mask)):
        cells = [
            _mask_cell(token, flag, pad_token) for token, flag in zip(row, mask_row)
        ]
        label = html.escape(labels[index]) if labels else f"row {index}"
        rows.append(
            f"<tr><th style='padding:2px 6px'>{label}</th>{''.join(cells)}</tr>"
        )
    legend = (
        f"<span style='background:{RESPONSE_COLOUR};padding:2px 6px'>response_mask = 1 "
        f"(trained)</span> <span style='background:{PROMPT_COLOUR};padding:2px 6px'>"
        "prompt (mask 0)</span> <span style='border:1px solid #ccc;padding:2px 6px'>"
        "padding (mask 0)</span>"
    )
    return (
        "<table style='border-collapse:collapse;font-family:monospace'>"
        + "".join(rows)
        + f"</table><div style='margin-top:4px'>{legend}</div>"
    )


def _mask_cell(token: str, flag: int, pad_token: str) -> str:
    if flag:
        colour = RESPONSE_COLOUR
    elif token == pad_token:
        colour = PAD_COLOUR
    else:
        colour = PROMPT_COLOUR
    shown = html.escape(repr(token)[1:-1]) if token != pad_token else "·"
    return (
        f"<td style='background:{colour};color:#000;border:1px solid #ccc;"
        f"padding:2px 5px;text-align:center'>{shown}</td>"
    )


# Who wrote a token, for :func:`author_table` (notebook 14).
AUTHOR_COLOURS = {
    "prompt": PROMPT_COLOUR,
    "model": RESPONSE_COLOUR,
    "tool": "#f4c7a1",
    "separator": "#f9e79f",
}


def author_table(
    tokens: Sequence[str],
    authors: Sequence[str],
    response_mask: Sequence[int],
) -> str:
    """An HTML table of one sequence: each token coloured by who wrote it
    (``AUTHOR_COLOURS``), with the response mask written under it.

    ``tokens``, ``authors`` and ``response_mask`` have one entry per position.
    """
    if not len(tokens) == len(authors) == len(response_mask):
        raise ValueError(
            "tokens, authors and response_mask must have one entry per position, "
            f"got {len(tokens)}, {len(authors)} and {len(response_mask)}"
        )
    unknown = sorted(set(authors) - set(AUTHOR_COLOURS))
    if unknown:
        raise ValueError(
            f"authors must be among {sorted(AUTHOR_COLOURS)}, got {unknown}"
        )
    style = "border:1px solid #ccc;padding:2px 5px;text-align:center;color:#000"
    token_cells = "".join(
        f"<td style='background:{AUTHOR_COLOURS[a]};{style}'>"
        f"{html.escape(repr(t)[1:-1])}</td>"
        for t, a in zip(tokens, authors)
    )
    mask_cells = "".join(f"<td style='{style}'>{int(m)}</td>" for m in response_mask)
    legend = " ".join(
        f"<span style='background:{colour};padding:2px 6px'>{author}</span>"
        for author, colour in AUTHOR_COLOURS.items()
    )
    return (
        "<table style='border-collapse:collapse;font-family:monospace'>"
        f"<tr><th style='padding:2px 6px'>label</th>{token_cells}</tr>"
        f"<tr><th style='padding:2px 6px'>mask</th>{mask_cells}</tr>"
        f"</table><div style='margin-top:4px'>{legend}</div>"
    )


def episode_author_table(
    labels: Sequence[str],
    prompt_length: int,
    segments: Sequence,
    response_mask: Sequence[int],
) -> str:
    """:func:`author_table` of one multi-turn episode: the prompt's
    ``prompt_length`` tokens, then its ``segments`` (each with a ``role`` and its
    ``token_ids``); each label is coloured by the author of the token it holds.
    """
    written = ["prompt"] * prompt_length
    written += [segment.role for segment in segments for _ in segment.token_ids]
    return author_table(labels, written[1 : len(labels) + 1], response_mask)


def plot_advantages(
    rewards: Sequence[float],
    baseline: str = "mean",
    advantage_normalizer: str = "std",
    advantage_eps: float = 1e-6,
    *,
    standalone: bool = False,
) -> Figure:
    """Bar chart of one group's rewards and its advantages under one recipe."""
    raw_rewards = torch.tensor(list(rewards), dtype=torch.float32)  # (G,)
    advantages, _ = compute_group_normalized_rewards(
        raw_rewards, len(rewards), baseline, advantage_eps, advantage_normalizer
    )
    figure = new_figure((8, 3), standalone=standalone)
    reward_axis, advantage_axis = figure.subplots(1, 2)
    positions = range(len(rewards))
    reward_axis.bar(positions, raw_rewards.tolist(), color="#6c8ebf")
    reward_axis.set(
        title="rewards r_i", xlabel="response i", ylabel="reward", ylim=(-0.05, 1.05)
    )
    colours = ["#2a9d8f" if a >= 0 else "#e76f51" for a in advantages.tolist()]
    advantage_axis.bar(positions, advantages.tolist(), color=colours)
    advantage_axis.axhline(0, color="black", linewidth=0.8)
    advantage_axis.set(
        title=f"advantages (baseline={baseline}, normalizer={advantage_normalizer})",
        xlabel="response i",
        ylabel="advantage",
    )
    advantage_axis.title.set_fontsize(9)
    return figure


def clipped_objective_curves(
    ratios: torch.Tensor, advantage: float, cliprange: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token objective min(A w, A clip(w)) and its derivative d/dw, read
    off the package loss by autograd. (N,) ratios -> two (N,) tensors."""
    log_ratios = ratios.log().unsqueeze(0).requires_grad_(True)  # (1, N)
    old_log_probs = torch.zeros_like(log_ratios)  # (1, N)
    loss, _ = compute_policy_gradient_loss(
        torch.tensor([advantage]), log_ratios, "grpo", old_log_probs, cliprange
    )
    objective = -loss  # (1, N)
    (gradient_wrt_log_ratio,) = torch.autograd.grad(objective.sum(), log_ratios)
    # d objective / d w = d objective / d log w * (1 / w)
    gradient = gradient_wrt_log_ratio / ratios.unsqueeze(0)  # (1, N)
    return objective.detach()[0], gradient.detach()[0]


def plot_clipped_objective(
    cliprange: float = 0.2, max_ratio: float = 2.0, *, standalone: bool = False
) -> Figure:
    """Objective and gradient against the ratio w, for A = +1 and A = -1."""
    ratios = torch.linspace(0.01, max_ratio, 400)  # (N,)
    figure = new_figure((9, 5.5), standalone=standalone)
    axes = figure.subplots(2, 2, sharex=True)
    for column, advantage in enumerate((1.0, -1.0)):
        objective, gradient = clipped_objective_curves(ratios, advantage, cliprange)
        unclipped = advantage * ratios
        axes[0, column].plot(
            ratios, unclipped, "--", color="grey", label="A·w (no clip)"
        )
        axes[0, column].plot(
            ratios, objective, color="#264653", label="min(A·w, A·clip(w))"
        )
        axes[1, column].plot(ratios, gradient, color="#e76f51")
        for axis in axes[:, column]:
            axis.axvspan(1 - cliprange, 1 + cliprange, color="#b7e4c7", alpha=0.5)
            axis.axvline(1.0, color="black", linewidth=0.6)
        axes[0, column].set_title(f"A = {advantage:+.0f}")
        axes[0, column].legend(fontsize=8)
        axes[1, column].set_xlabel("ratio w = π / π_old")
    axes[0, 0].set_ylabel("objective (maximised)")
    axes[1, 0].set_ylabel("d objective / d w")
    figure.suptitle(f"PPO/GRPO clipping, cliprange ε = {cliprange:g} (green: 1 ± ε)")
    return figure


def plot_token_and_sequence_ratios(
    token_log_ratios: Sequence[float],
    token_cliprange: float = 0.2,
    sequence_cliprange: float = 3e-4,
    *,
    standalone: bool = False,
) -> Figure:
    """Token ratios w_t (bars) against GSPO's sequence ratio s (line), with each
    method's clip band: tokens are clipped one by one, the sequence as a whole."""
    log_ratios = torch.tensor(list(token_log_ratios), dtype=torch.float64)  # (T,)
    token_ratios = log_ratios.exp()
    sequence_ratio = log_ratios.mean().exp().item()
    figure = new_figure((8, 3.2), standalone=standalone)
    axis = figure.subplots()
    outside = (token_ratios - 1).abs() > token_cliprange
    colours = ["#e76f51" if flag else "#6c8ebf" for flag in outside.tolist()]
    positions = range(len(token_ratios))
    axis.bar(positions, (token_ratios - 1).tolist(), bottom=1.0, color=colours)
    axis.axhspan(1 - token_cliprange, 1 + token_cliprange, color="#b7e4c7", alpha=0.4)
    axis.axhline(sequence_ratio, color="#264653", linewidth=2)
    inside = abs(sequence_ratio - 1) <= sequence_cliprange
    axis.set(
        xlabel="response token t",
        ylabel="ratio",
        title=(
            f"token ratios (bars; red = outside 1 ± {token_cliprange:g}) and sequence "
            f"ratio s = {sequence_ratio:.5f} (line; "
            f"{'inside' if inside else 'outside'} 1 ± {sequence_cliprange:g})"
        ),
    )
    axis.title.set_fontsize(9)
    return figure


def plot_pass_at_k(
    curves: dict[str, Sequence[float]],
    *,
    standalone: bool = False,
) -> Figure:
    """pass@k against k = 1..n, one line per label (e.g. "before RL", "after RL").

    Each curve is ``grpo_lab.training.evaluation.pass_at_k_curve``: its first
    point is pass@1 (mean accuracy), its last the share of prompts solved by at
    least one of n samples. The gap between the two is what sampling more buys.
    """
    if not curves or any(len(values) == 0 for values in curves.values()):
        raise ValueError(f"curves must map labels to non-empty lists, got {curves!r}")
    figure = new_figure((6, 3.4), standalone=standalone)
    axis = figure.subplots()
    for label, values in curves.items():
        ks = range(1, len(values) + 1)
        gap = values[-1] - values[0]
        axis.plot(ks, list(values), marker="o", label=f"{label} (gap {gap:.2f})")
    axis.set(xlabel="k (samples per prompt)", ylabel="pass@k", ylim=(-0.02, 1.02))
    axis.set_xscale("log", base=2)
    axis.legend()
    return figure


def plot_memory_against_chunk_size(
    chunk_sizes: Sequence[int],
    peak_bytes: Sequence[int],
    full_bytes: int,
    *,
    standalone: bool = False,
) -> Figure:
    """Peak live tensor bytes of chunked scoring (forward and backward), against
    the chunk size, next to the unchunked figure."""
    figure = new_figure((6, 3.2), standalone=standalone)
    axis = figure.subplots()
    mebibytes = [value / 2**20 for value in peak_bytes]
    axis.plot(list(chunk_sizes), mebibytes, "o-", label="chunked + checkpointed head")
    axis.axhline(
        full_bytes / 2**20, color="#e76f51", linestyle="--", label="no chunking"
    )
    axis.set(
        xscale="log",
        xlabel="logits_chunk_size (positions per chunk)",
        ylabel="peak live tensors (MiB)",
        title="peak memory of the log-prob computation",
    )
    axis.legend(fontsize=8)
    return figure


GRPO_LOOP_STAGES = (
    ("sample", "G responses per prompt\nfrom the current policy"),
    ("reward", "score each response\n(e.g. 1 if the answer is right)"),
    ("advantage", "compare with the group:\n(r_i - mean) / std"),
    ("update", "one optimizer step on the\nclipped, advantage-weighted loss"),
)


def plot_grpo_loop(*, standalone: bool = False) -> Figure:
    """The GRPO loop as four boxes on a circle: sample -> reward -> advantage ->
    update, and back to sample with the updated policy (notebook 00)."""
    figure = new_figure((6.5, 4.2), standalone=standalone)
    axis = figure.subplots()
    centres = [(0.5, 0.82), (0.86, 0.5), (0.5, 0.18), (0.14, 0.5)]
    for (name, detail), (x, y) in zip(GRPO_LOOP_STAGES, centres):
        axis.text(
            x,
            y,
            f"{name}\n{detail}",
            ha="center",
            va="center",
            fontsize=8,
            bbox={"boxstyle": "round,pad=0.5", "facecolor": RESPONSE_COLOUR},
        )
    for start, end in zip(centres, centres[1:] + centres[:1]):
        axis.annotate(
            "",
            xy=(0.62 * end[0] + 0.38 * start[0], 0.62 * end[1] + 0.38 * start[1]),
            xytext=(0.38 * end[0] + 0.62 * start[0], 0.38 * end[1] + 0.62 * start[1]),
            arrowprops={"arrowstyle": "-|>", "color": "black"},
        )
    axis.set(xlim=(0, 1), ylim=(0, 1), title="one GRPO step, repeated")
    axis.axis("off")
    return figure
