"""Teaching figures, HTML tables and memory measurements (notebooks 01-05)."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

import matplotlib.image
import matplotlib.pyplot as plt
import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.text import Annotation

from grpo_lab.teaching.memory import PeakTensorMemory, saved_for_backward_bytes
from grpo_lab.teaching.plots import (
    PNG_DPI,
    PROMPT_COLOUR,
    RESPONSE_COLOUR,
    clipped_objective_curves,
    figure_png,
    new_figure,
    plot_advantages,
    plot_clipped_objective,
    plot_grpo_loop,
    plot_memory_against_chunk_size,
    plot_pass_at_k,
    plot_token_and_sequence_ratios,
    response_mask_table,
)


def test_mask_table_colours_each_token_by_its_mask():
    table = response_mask_table([["1", ">", "2", "<pad>"]], [[0, 1, 1, 0]])
    cells = table.split("</table>")[0].split("<td")[1:]
    assert [RESPONSE_COLOUR in cell for cell in cells] == [False, True, True, False]
    assert PROMPT_COLOUR in cells[0] and PROMPT_COLOUR not in cells[3]
    assert "&gt;" in cells[1]  # tokens are escaped


def test_mask_table_shows_newlines_and_row_labels():
    table = response_mask_table([["a", "\n"]], [[0, 1]], row_labels=["<x>"])
    assert "\\n" in table and "&lt;x&gt;" in table


def test_mask_table_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"same \(B, T\) shape"):
        response_mask_table([["a", "b"]], [[1]])


def test_clipped_curves_by_hand():
    # eps = 0.2. A = +1: objective min(w, clip(w)) -> 0.5, 1, 1.2; gradient 1, 1, 0.
    # A = -1: min(-w, -clip(w)) -> -0.8, -1, -1.5; gradient 0, -1, -1.
    ratios = torch.tensor([0.5, 1.0, 1.5])
    objective, gradient = clipped_objective_curves(ratios, 1.0, 0.2)
    assert torch.allclose(objective, torch.tensor([0.5, 1.0, 1.2]))
    assert torch.allclose(gradient, torch.tensor([1.0, 1.0, 0.0]))
    objective, gradient = clipped_objective_curves(ratios, -1.0, 0.2)
    assert torch.allclose(objective, torch.tensor([-0.8, -1.0, -1.5]))
    assert torch.allclose(gradient, torch.tensor([0.0, -1.0, -1.0]))


@pytest.mark.parametrize(
    "draw",
    [
        lambda: plot_advantages([1.0, 0.0, 0.0, 1.0]),
        lambda: plot_advantages([1.0, 1.0], "none", "none"),
        lambda: plot_clipped_objective(0.3),
        lambda: plot_token_and_sequence_ratios([0.0, 0.7, -0.1]),
        lambda: plot_memory_against_chunk_size([4, 8], [100, 200], 400),
        lambda: plot_pass_at_k({"before": [0.2, 0.5], "after": [0.8, 0.9]}),
    ],
)
def test_figures_are_returned_not_shown(draw):
    figure = draw()
    assert isinstance(figure, Figure) and figure.axes
    plt.close(figure)


STANDALONE_DRAWINGS = [
    lambda **kw: plot_advantages([1.0, 0.0, 0.0, 1.0], **kw),
    lambda **kw: plot_clipped_objective(0.3, **kw),
    lambda **kw: plot_token_and_sequence_ratios([0.0, 0.7, -0.1], **kw),
    lambda **kw: plot_memory_against_chunk_size([4, 8], [100, 200], 400, **kw),
]


@pytest.mark.parametrize("draw", STANDALONE_DRAWINGS)
def test_default_figures_go_through_pyplot_for_plt_show(draw):
    # Notebooks 02 and 04 call a plot function and then plt.show().
    before = set(plt.get_fignums())
    figure = draw()
    assert set(plt.get_fignums()) - before == {figure.number}
    plt.close(figure)


@pytest.mark.parametrize("draw", STANDALONE_DRAWINGS)
def test_standalone_figures_stay_outside_pyplot(draw):
    before = plt.get_fignums()
    figure = draw(standalone=True)
    assert plt.get_fignums() == before
    assert figure.axes and figure.get_layout_engine() is not None


def test_new_figure_has_the_asked_size():
    figure = new_figure((3.0, 2.0), standalone=True)
    assert tuple(figure.get_size_inches()) == (3.0, 2.0)


def test_figure_png_renders_the_drawing():
    figure = new_figure((2.0, 1.0), standalone=True)
    figure.subplots().plot([0, 1], [0, 1], linewidth=8, color="black")
    png = figure_png(figure)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(io.BytesIO(png))  # (H, W, 4)
    assert pixels.shape[:2] == (1 * PNG_DPI, 2 * PNG_DPI)
    assert (pixels[..., :3] < 0.2).all(axis=-1).mean() > 0.01  # the black line
    empty = matplotlib.image.imread(io.BytesIO(figure_png(new_figure((2.0, 1.0)))))
    assert empty[..., :3].min() == 1.0  # nothing drawn: all white
    plt.close("all")


def test_the_loop_diagram_names_its_four_stages_in_order():
    figure = plot_grpo_loop()
    texts = figure.axes[0].texts
    labels = [text.get_text().split("\n")[0] for text in texts if text.get_text()]
    assert labels == ["sample", "reward", "advantage", "update"]
    arrows = [text for text in texts if isinstance(text, Annotation)]
    assert len(arrows) == 4  # update leads back to sample
    plt.close(figure)


def test_advantage_bars_are_the_package_advantages():
    figure = plot_advantages([1.0, 0.0, 0.0, 1.0])
    assert [axis.get_ylabel() for axis in figure.axes] == ["reward", "advantage"]
    heights = [bar.get_height() for bar in figure.axes[1].patches]
    # mean 0.5, sample std sqrt(1/3): A = +-0.866
    assert heights == pytest.approx([0.866, -0.866, -0.866, 0.866], abs=1e-3)
    plt.close(figure)


def test_sequence_ratio_in_title_is_the_geometric_mean():
    # log-ratios log 2 and log 0.5: geometric mean 1.
    figure = plot_token_and_sequence_ratios([0.6931471805599453, -0.6931471805599453])
    assert "s = 1.00000" in figure.axes[0].get_title()
    plt.close(figure)


def test_saved_bytes_see_the_log_softmax_copy_but_not_the_inputs():
    logits = torch.randn(2, 3, 100, requires_grad=True)  # 2400 bytes
    labels = torch.zeros(2, 3, dtype=torch.long)
    naive, _ = saved_for_backward_bytes(
        lambda: torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)),
        (logits,),
    )
    lean, _ = saved_for_backward_bytes(
        lambda: (
            logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            - torch.logsumexp(logits, -1)
        ),
        (logits,),
    )
    assert naive >= 2 * 3 * 100 * 4  # the (B, T, V) log_softmax output
    assert lean < 2 * 3 * 100 * 4


def test_peak_memory_counts_live_temporaries():
    x = torch.ones(1000)  # created outside: not counted
    with PeakTensorMemory() as memory:
        y = x * 2  # 4000 bytes
        z = y * 3  # 4000 more while y is alive
        del y, z
        w = x + 1  # y and z are freed: the peak stays 8000
    assert memory.peak_bytes == 8000
    assert memory.live_bytes == 4000
    del w


def test_pass_at_k_plot_draws_each_curve_with_its_gap():
    figure = plot_pass_at_k(
        {"before RL": [0.25, 0.5, 0.75], "after RL": [0.9, 0.95, 1.0]}
    )
    lines = figure.axes[0].get_lines()
    assert [list(line.get_ydata()) for line in lines] == [
        [0.25, 0.5, 0.75],
        [0.9, 0.95, 1.0],
    ]
    assert list(lines[0].get_xdata()) == [1, 2, 3]
    labels = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert labels == ["before RL (gap 0.50)", "after RL (gap 0.10)"]
    plt.close(figure)
    with pytest.raises(ValueError, match="curves"):
        plot_pass_at_k({})
