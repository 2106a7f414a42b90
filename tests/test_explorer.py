"""Tests for grpo_lab.teaching.explorer: cache keys, cached runs, sweeps, plots."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import tempfile
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

import ipywidgets as widgets
import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg

from grpo_lab.teaching import explorer
from grpo_lab.teaching.curves import curve
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.loop import RunResult


class FakeTrain:
    """Stands in for grpo_lab.training.train: reward_mean = lr * step, logged."""

    def __init__(self, fail: bool = False, during=None):
        self.configs: list[TrainConfig] = []
        self.progress: list[bool] = []
        self.fail = fail
        self.during = during  # called while "training", to look at the widget

    def __call__(self, config: TrainConfig, progress: bool = True) -> RunResult:
        self.configs.append(config)
        self.progress.append(progress)
        if self.during is not None:
            self.during()
        Path(config.run_dir).mkdir(parents=True)
        (Path(config.run_dir) / "weights.bin").write_bytes(b"0" * 10)
        if self.fail:
            raise RuntimeError("training crashed")
        history = [{"sft/loss": 2.0}]  # an SFT line: no step
        history += [
            {"step": step, "train/reward_mean": config.lr * step} for step in (1, 2, 3)
        ]
        history.append({"step": 3, "eval/accuracy_greedy": 0.5})
        return RunResult(run_dir=Path(config.run_dir), history=history)


@pytest.fixture
def base_config() -> TrainConfig:
    return TrainConfig.for_profile("cpu", steps=3, max_new_tokens=7)


def test_cache_key_is_sha256_of_sorted_json_without_location(base_config):
    values = base_config.to_dict()
    del values["run_dir"], values["resume"]
    text = json.dumps(values, sort_keys=True, separators=(",", ":"))
    expected = hashlib.sha256(text.encode()).hexdigest()[:16]
    assert explorer.config_cache_key(base_config) == expected


def test_cache_key_ignores_run_dir_and_field_order(base_config):
    moved = dataclasses.replace(base_config, run_dir="/elsewhere", resume=True)
    reordered = TrainConfig.from_dict(dict(reversed(base_config.to_dict().items())))
    key = explorer.config_cache_key(base_config)
    assert explorer.config_cache_key(moved) == key
    assert explorer.config_cache_key(reordered) == key


@pytest.mark.parametrize(
    "change",
    [{"lr": 3e-3}, {"group_size": 4}, {"seed": 1}, {"task_options": {"n_digits": 4}}],
)
def test_cache_key_changes_with_any_field_that_changes_the_run(base_config, change):
    changed = dataclasses.replace(base_config, **change)
    assert explorer.config_cache_key(changed) != explorer.config_cache_key(base_config)


def test_run_cached_trains_once_then_reads_the_cache(base_config, tmp_path):
    fake = FakeTrain()
    first = explorer.run_cached(base_config, tmp_path, fake, label="base")
    second = explorer.run_cached(base_config, tmp_path, fake, label="again")
    assert len(fake.configs) == 1
    assert (first.from_cache, second.from_cache) == (False, True)
    assert second.history == first.history
    assert second.label == "again" and second.key == first.key
    # The cache keeps config and metrics only: no weights, no temporary folders.
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.key]
    entry = tmp_path / first.key
    assert sorted(p.name for p in entry.iterdir()) == ["config.json", "history.json"]
    stored = json.loads((entry / "config.json").read_text())
    assert stored["lr"] == base_config.lr and "run_dir" not in stored


def test_run_cached_trains_in_a_fresh_folder_inside_the_cache(base_config, tmp_path):
    fake = FakeTrain()
    explorer.run_cached(dataclasses.replace(base_config, run_dir="x"), tmp_path, fake)
    trained = fake.configs[0]
    assert Path(trained.run_dir).parent.parent == tmp_path
    assert trained.resume is False


def test_run_cached_different_config_trains_again(base_config, tmp_path):
    fake = FakeTrain()
    explorer.run_cached(base_config, tmp_path, fake)
    other = explorer.run_cached(
        dataclasses.replace(base_config, lr=0.01), tmp_path, fake
    )
    assert len(fake.configs) == 2 and not other.from_cache
    # reward_mean = lr * step: the second run's own history was stored.
    assert curve(other.history, "train/reward_mean")[1] == [
        0.01,
        0.02,
        0.03,
    ]


def test_run_cached_leaves_no_entry_when_training_fails(base_config, tmp_path):
    with pytest.raises(RuntimeError, match="crashed"):
        explorer.run_cached(base_config, tmp_path, FakeTrain(fail=True))
    assert list(tmp_path.iterdir()) == []
    fake = FakeTrain()
    assert not explorer.run_cached(base_config, tmp_path, fake).from_cache


def test_sweep_varies_one_field_and_labels_runs(base_config, tmp_path):
    fake = FakeTrain()
    runs = explorer.sweep(base_config, "lr", [1e-3, 3e-3], tmp_path, fake)
    assert [run.label for run in runs] == ["lr=0.001", "lr=0.003"]
    assert [c.lr for c in fake.configs] == [1e-3, 3e-3]
    assert all(c.group_size == base_config.group_size for c in fake.configs)
    again = explorer.sweep(base_config, "lr", [3e-3], tmp_path, fake)
    assert again[0].from_cache and len(fake.configs) == 2


@pytest.mark.parametrize("field", ["learning_rate", "run_dir"])
def test_sweep_rejects_fields_that_do_not_change_a_run(base_config, tmp_path, field):
    with pytest.raises(ValueError, match=f"field must be .*got '{field}'"):
        explorer.sweep(base_config, field, [1], tmp_path, FakeTrain())


def test_sweep_rejects_no_values(base_config, tmp_path):
    with pytest.raises(ValueError, match="values must hold"):
        explorer.sweep(base_config, "lr", [], tmp_path, FakeTrain())


def test_ablation_configs_change_one_idea_each(base_config):
    configs = explorer.ablation_configs(base_config, off_policy_epochs=2)
    assert list(configs) == [
        "baseline",
        "no std normalization",
        "constant normalization",
        "off-policy epochs, clip",
        "off-policy epochs, no clip",
    ]
    base = base_config.to_dict()

    def changed(name):
        values = configs[name].to_dict()
        return {key: values[key] for key in values if values[key] != base[key]}

    assert changed("baseline") == {}
    assert changed("no std normalization") == {"advantage_normalizer": "none"}
    # C = train_batch_size * max_new_tokens = 256 * 7 = 1792
    assert changed("constant normalization") == {
        "loss_normalization": "constant",
        "normalization_constant": 1792,
    }
    assert changed("off-policy epochs, clip") == {
        "epochs_per_rollout_batch": 2,
        "importance_reweighting_method": "grpo",
        "cliprange": 0.2,
    }
    assert changed("off-policy epochs, no clip")["importance_reweighting_method"] == (
        "noclip"
    )
    assert all(config.off_policy for config in list(configs.values())[3:])


def test_ablation_configs_rejects_bad_arguments(base_config):
    with pytest.raises(ValueError, match="off_policy_epochs must be at least 2"):
        explorer.ablation_configs(base_config, off_policy_epochs=1)
    with pytest.raises(ValueError, match="cliprange must be positive, got 0"):
        explorer.ablation_configs(base_config, cliprange=0)


def test_run_ablations_labels_by_name(base_config, tmp_path):
    configs = explorer.ablation_configs(base_config)
    runs = explorer.run_ablations(configs, tmp_path, FakeTrain())
    assert [run.label for run in runs] == list(configs)
    assert len({run.key for run in runs}) == len(configs)


def test_plot_comparison_draws_one_line_per_run(base_config, tmp_path):
    runs = explorer.sweep(base_config, "lr", [1e-3, 1e-2], tmp_path, FakeTrain())
    figure = explorer.plot_comparison(runs, "train/reward_mean")
    lines = figure.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["lr=0.001", "lr=0.01"]
    assert list(lines[1].get_xdata()) == [1, 2, 3]
    assert list(lines[1].get_ydata()) == pytest.approx([0.01, 0.02, 0.03])
    assert figure.axes[0].get_ylabel() == "train/reward_mean"


def test_plot_comparison_rejects_a_metric_no_run_logged(base_config, tmp_path):
    runs = explorer.sweep(base_config, "lr", [1e-3], tmp_path, FakeTrain())
    with pytest.raises(ValueError, match="got 'eval/accuracy'"):
        explorer.plot_comparison(runs, "eval/accuracy")


def test_plot_comparison_notes_loss_diagnostics_no_update_logged(base_config, tmp_path):
    # Runs whose every update was skipped log no loss/ diagnostics at all.
    runs = explorer.sweep(base_config, "lr", [1e-3], tmp_path, FakeTrain())
    figure = explorer.plot_comparison(runs, "loss/token_entropy")
    (axis,) = figure.axes
    assert [len(line.get_xdata()) for line in axis.get_lines()] == [0]
    assert "not logged" in axis.texts[0].get_text()


def test_final_values(base_config, tmp_path):
    runs = explorer.sweep(base_config, "lr", [1e-3, 1e-2], tmp_path, FakeTrain())
    assert explorer.final_values(runs, "train/reward_mean") == pytest.approx(
        {"lr=0.001": 0.003, "lr=0.01": 0.03}
    )


def test_config_from_settings_drops_settings_that_do_not_matter(base_config):
    with_clip = {"importance_reweighting_method": "none", "cliprange": 0.3}
    config = explorer.config_from_settings(base_config, with_clip)
    assert config.cliprange is None
    assert explorer.config_cache_key(config) == explorer.config_cache_key(
        explorer.config_from_settings(base_config, {"cliprange": 0.1})
    )
    constant = explorer.config_from_settings(
        base_config, {"loss_normalization": "constant"}
    )
    assert constant.normalization_constant == 256 * 7


def test_config_from_settings_rejects_unknown_and_inconsistent(base_config):
    with pytest.raises(ValueError, match=r"settings must be some of .*\['warmup'\]"):
        explorer.config_from_settings(base_config, {"warmup": 3})
    # Off-policy epochs without an importance ratio: the config's own error.
    with pytest.raises(ValueError, match="importance_reweighting_method must be"):
        explorer.config_from_settings(base_config, {"epochs_per_rollout_batch": 2})


def test_widget_callback_runs_once_per_setting(base_config, tmp_path):
    fake = FakeTrain()
    results: list[explorer.CachedRun] = []
    settings = {"lr": 3e-3, "importance_reweighting_method": "none", "cliprange": 0.2}
    run = explorer.run_from_settings(base_config, settings, tmp_path, results, fake)
    again = explorer.run_from_settings(base_config, settings, tmp_path, results, fake)
    assert run.label == "lr=0.003" and again.from_cache
    assert len(results) == 1 and len(fake.configs) == 1
    figure = explorer.show_comparison(results, ["train/reward_mean"])
    assert figure is not None and len(figure.axes) == 1
    assert explorer.show_comparison([], ["train/reward_mean"]) is None


def test_comparison_figures_stay_outside_pyplot(base_config, tmp_path):
    runs = explorer.sweep(base_config, "lr", [1e-3, 1e-2], tmp_path, FakeTrain())
    before = plt.get_fignums()
    figure = explorer.comparison_figure(runs, ["train/reward_mean"])
    explorer.plot_comparison(runs, "train/reward_mean")
    explorer.show_comparison(runs, ["train/reward_mean"])
    assert plt.get_fignums() == before
    assert [line.get_label() for line in figure.axes[0].get_lines()] == [
        "lr=0.001",
        "lr=0.01",
    ]


def parts(widget: widgets.VBox) -> dict:
    """The explorer widget's controls, button, status, progress area and chart."""
    dropdowns = {
        child.description: child
        for row in widget.children[:2]
        for child in row.children
        if isinstance(child, widgets.Dropdown)
    }
    button, status = widget.children[2].children
    progress_area, chart = widget.children[3:]
    assert isinstance(progress_area, widgets.Output)
    assert isinstance(chart, widgets.Image)
    return {
        "dropdowns": dropdowns,
        "button": button,
        "status": status,
        "progress": progress_area,
        "chart": chart,
    }


def drawn_fraction(png: bytes) -> float:
    """Share of the image's pixels that are not the white figure background."""
    pixels = matplotlib.image.imread(io.BytesIO(png))[..., :3]  # (H, W, 3)
    return float(np.mean(np.any(pixels < 0.95, axis=-1)))


def test_explorer_widget_builds_without_running(base_config, tmp_path):
    fake = FakeTrain()
    widget = explorer.explorer_widget(base_config, tmp_path, train_fn=fake)
    assert fake.configs == []
    found = parts(widget)
    assert set(found["dropdowns"]) == set(explorer.WIDGET_CHOICES)
    assert found["chart"].layout.display == "none"  # no runs yet: no chart
    found["button"].click()
    assert len(fake.configs) == 1 and fake.progress == [True]
    assert found["chart"].layout.display is None
    assert drawn_fraction(found["chart"].value) > 0.02


def test_run_button_fits_its_label_and_is_not_squeezed(base_config, tmp_path):
    button = parts(explorer.explorer_widget(base_config, tmp_path))["button"]
    assert button.description == explorer.RUN_BUTTON_LABEL
    # ipywidgets' fixed default width cuts the label off; auto fits its text.
    assert button.layout.width == "auto"
    assert button.layout.flex == "0 0 auto"
    assert float(button.layout.min_width.removesuffix("em")) >= 0.6 * len(
        explorer.RUN_BUTTON_LABEL
    )


def test_run_button_is_disabled_while_running(base_config, tmp_path):
    seen = []
    fake = FakeTrain(during=lambda: seen.append(found["button"].disabled))
    widget = explorer.explorer_widget(base_config, tmp_path, train_fn=fake)
    found = parts(widget)
    assert not found["button"].disabled
    found["button"].click()
    assert seen == [True] and not found["button"].disabled
    assert found["status"].value.endswith(": trained")


def test_run_button_is_enabled_again_after_a_failure(base_config, tmp_path):
    seen = []
    fake = FakeTrain(fail=True, during=lambda: seen.append(found["button"].disabled))
    found = parts(explorer.explorer_widget(base_config, tmp_path, train_fn=fake))
    # Outside a kernel ipywidgets logs the callback's exception instead of raising.
    found["button"].click()
    assert seen == [True] and not found["button"].disabled
    assert found["status"].value == "failed: RuntimeError: training crashed"
    # A setting the config refuses: not run, and the button still works.
    found["dropdowns"]["epochs_per_rollout_batch"].value = 2
    found["dropdowns"]["importance_reweighting_method"].value = "none"
    found["button"].click()
    assert found["status"].value.startswith("not run: ")
    assert not found["button"].disabled


@pytest.mark.slow
def test_every_run_redraws_a_chart(base_config, tmp_path):
    # 20 clicks over different settings (and repeats, read from the cache).
    fake = FakeTrain()
    results = explorer.sweep(base_config, "lr", [1e-3], tmp_path, fake)
    found = parts(
        explorer.explorer_widget(base_config, tmp_path, results=results, train_fn=fake)
    )
    before = plt.get_fignums()
    first = found["chart"].value
    assert drawn_fraction(first) > 0.02  # existing results are drawn at once
    shown = []
    lrs = explorer.WIDGET_CHOICES["lr"]
    for click in range(20):
        found["dropdowns"]["lr"].value = lrs[click % len(lrs)]
        found["button"].click()
        shown.append(found["chart"].value)
    assert min(drawn_fraction(png) for png in shown) > 0.02
    # 4 settings, one of which (lr 1e-3) is the sweep's run: the sweep's run and
    # the 16 repeated clicks are read from the cache.
    assert len(results) == 4 and len(fake.configs) == 4
    # A new run adds a line; a cached one, already compared, leaves the chart.
    assert shown[0] != first and shown[1] != shown[0] and shown[3] != shown[1]
    assert shown[4:] == [shown[3]] * 16
    assert plt.get_fignums() == before


def test_default_cache_dir_is_writable_temp_or_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(explorer.RUNS_DIR_VARIABLE, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    default = explorer.default_cache_dir()
    assert default.parent.parent == tmp_path / "tmp"
    assert default.name == "explorer_cache"
    assert default.parent.name.startswith("grpo_lab-")
    monkeypatch.setenv(explorer.RUNS_DIR_VARIABLE, str(tmp_path / "mine"))
    assert explorer.default_cache_dir() == tmp_path / "mine" / "explorer_cache"
    monkeypatch.setenv(explorer.RUNS_DIR_VARIABLE, "")
    assert explorer.default_cache_dir() == default


def test_runs_without_a_cache_dir_write_nothing_in_the_working_folder(
    base_config, tmp_path, monkeypatch
):
    # Notebook 09 from a read-only folder: nothing may land in the working folder.
    working = tmp_path / "course"
    working.mkdir()
    monkeypatch.chdir(working)
    monkeypatch.setenv(explorer.RUNS_DIR_VARIABLE, str(tmp_path / "runs"))
    fake = FakeTrain()
    run = explorer.run_cached(base_config, train_fn=fake)
    explorer.sweep(base_config, "lr", [1e-3], train_fn=fake)
    explorer.run_ablations({"base": base_config}, train_fn=fake)
    parts(explorer.explorer_widget(base_config, train_fn=fake))["button"].click()
    assert list(working.iterdir()) == []
    cache = tmp_path / "runs" / "explorer_cache"
    assert (cache / run.key / "history.json").exists()
    assert Path(fake.configs[0].run_dir).is_relative_to(cache)


def test_runs_show_progress_bars_unless_told_not_to(base_config, tmp_path, capsys):
    fake = FakeTrain()
    explorer.sweep(base_config, "lr", [1e-3, 3e-3], tmp_path, fake)
    assert fake.progress == [True, True]
    assert "sweep of lr" in capsys.readouterr().err  # tqdm's bar over the runs
    explorer.sweep(base_config, "lr", [1e-2], tmp_path, fake, progress=False)
    explorer.run_ablations({"b": base_config}, tmp_path / "b", fake, progress=False)
    assert fake.progress[2:] == [False, False]
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_real_tiny_run_is_cached(tmp_path):
    config = TrainConfig.for_profile(
        "cpu",
        steps=2,
        rollout_batch_size=8,
        group_size=4,
        train_batch_size=8,
        tiny_hidden_size=16,
        sft_max_steps=0,
        eval_every=1,
        eval_size=4,
        checkpoint_every=0,
    )
    first = explorer.run_cached(config, tmp_path)
    second = explorer.run_cached(config, tmp_path)
    assert not first.from_cache and second.from_cache
    steps, rewards = curve(first.history, "train/reward_mean")
    assert steps == [1, 2] and all(0.0 <= r <= 1.0 for r in rewards)
    assert second.history == first.history
    entry = tmp_path / first.key
    assert sorted(p.name for p in entry.iterdir()) == ["config.json", "history.json"]


@pytest.mark.slow
def test_warmed_up_model_is_built_once_and_loads(tmp_path, monkeypatch):
    warm_up_config = TrainConfig.for_profile(
        "cpu",
        tiny_hidden_size=16,
        sft_max_steps=2,
        sft_eval_every=1,
        sft_eval_size=4,
    )
    folder = explorer.warmed_up_model(warm_up_config, tmp_path)
    assert Path(folder).parent == tmp_path
    assert (Path(folder) / "config.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    def no_second_warm_up(config):
        raise AssertionError("the warm-up ran again")

    monkeypatch.setattr("grpo_lab.training.loop.build_policy", no_second_warm_up)
    assert explorer.warmed_up_model(warm_up_config, tmp_path) == folder

    from grpo_lab.models import load_pretrained

    model, tokenizer = load_pretrained(folder, dtype="float32")
    assert model.config.hidden_size == 16
    assert tokenizer.decode(tokenizer.encode("12 34")) == "12 34"


def test_a_long_run_label_wraps_in_one_legend_below_the_panels(base_config, tmp_path):
    runs = explorer.sweep(base_config, "lr", [1e-3, 1e-2], tmp_path, FakeTrain())
    # A Run of several changed settings: a 91-character label.
    label = (
        "objective=gspo, baseline=leave_one_out, advantage_normalizer=none, "
        "loss_normalization=token"
    )
    assert len(label) == 91
    runs[1] = dataclasses.replace(runs[1], label=label)
    metrics = ["train/reward_mean", "eval/accuracy_greedy"]
    figure = explorer.comparison_figure(runs, metrics)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()  # the layout is settled by drawing
    renderer = canvas.get_renderer()
    (legend,) = figure.legends
    assert not any(axis.get_legend() for axis in figure.axes)
    assert [text.get_text() for text in legend.get_texts()] == [
        "lr=0.001",
        "objective=gspo, baseline=leave_one_out,\nadvantage_normalizer=none, "
        "loss_normalization=token",
    ]
    box = legend.get_window_extent(renderer)
    whole = figure.bbox
    assert whole.x0 <= box.x0 and box.x1 <= whole.x1
    assert whole.y0 <= box.y0 and box.y1 <= whole.y1  # not cropped
    for axis in figure.axes:
        assert not box.overlaps(axis.get_tightbbox(renderer))  # covers no panel
    # The image as the notebook shows it, for a person to look at.
    out = Path(tempfile.gettempdir()) / "grpo_lab_comparison_legend.png"
    out.write_bytes(explorer.figure_png(figure))


def test_trained_model_is_trained_once_and_keeps_its_final_model(tmp_path, monkeypatch):
    config = TrainConfig.for_profile("smoke", eval_every=2)
    folder, history = explorer.trained_model(config, tmp_path, progress=False)
    assert Path(folder).parent == tmp_path
    assert (Path(folder) / "final_model" / "config.json").exists()
    assert [r["step"] for r in history if "eval/accuracy_sampled" in r] == [0, 2]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    def no_second_run(config, progress=True):
        raise AssertionError("the run trained again")

    monkeypatch.setattr("grpo_lab.training.loop.train", no_second_run)
    assert explorer.trained_model(config, tmp_path) == (folder, history)
