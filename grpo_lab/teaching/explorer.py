"""Short GRPO runs, cached on disk by their full config, compared side by side.

A run is identified by its config: ``config_cache_key`` hashes the config's JSON
(sorted keys; ``run_dir`` and ``resume`` left out, since they say where a run is
written, not what it computes). ``run_cached`` trains once per key and keeps the
metrics (not the weights) under ``cache_dir/<key>/``, so revisiting a setting is
instant. ``sweep`` varies one field, ``ablation_configs`` builds the classic
ablations, ``plot_comparison`` overlays one metric of several runs, and
``explorer_widget`` wires all of it to dropdowns and a Run button. Every widget
callback is a plain function here, so tests call it with a fake ``train``.

The cache lives in ``default_cache_dir()`` unless a ``cache_dir`` is given:
``$GRPO_LAB_RUNS_DIR/explorer_cache``, or a per-user folder under the system's
temporary directory, so the explorer runs from a read-only folder too. Runs
show ``tqdm.auto`` progress bars (``progress=False`` turns them off); figures are
standalone ``Figure`` objects that pyplot never sees.
Taught in ``notebooks/09_hyperparameter_explorer.ipynb``.
"""

from __future__ import annotations

import dataclasses
import getpass
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import ipywidgets as widgets
from IPython.display import Image, display
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from tqdm.auto import tqdm
from transformers.utils import CONFIG_NAME as MODEL_CONFIG_FILE

from grpo_lab.teaching.curves import curve
from grpo_lab.teaching.plots import figure_png
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.loop import RunResult
from grpo_lab.training.run_dir import CONFIG_FILE

# Fields that say where a run is written, not what it computes.
CACHE_EXCLUDED_FIELDS = ("run_dir", "resume")
# What the cache keeps of a run: its config and every metrics line.
CACHED_HISTORY_FILE = "history.json"
# The environment variable naming the folder that holds the explorer's cache.
RUNS_DIR_VARIABLE = "GRPO_LAB_RUNS_DIR"
# The label of the Run button; its layout makes room for all of it.
RUN_BUTTON_LABEL = "Run (or load from cache)"

TrainFunction = Callable[..., RunResult]
Result = TypeVar("Result")


def default_runs_dir() -> Path:
    """$GRPO_LAB_RUNS_DIR if set, else ``<system temp dir>/grpo_lab-<user>``.

    The temporary-directory default is writable wherever the notebooks are read
    from (a read-only course folder, an installed package).
    """
    configured = os.environ.get(RUNS_DIR_VARIABLE, "").strip()
    if configured:
        return Path(configured).expanduser()
    return Path(tempfile.gettempdir()) / f"grpo_lab-{_user_name()}"


def _user_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no user name (e.g. a container's bare uid)
        return str(os.getuid()) if hasattr(os, "getuid") else "user"


def default_cache_dir() -> Path:
    """The cache when none is given: ``default_runs_dir() / "explorer_cache"``."""
    return default_runs_dir() / "explorer_cache"


def _cache_dir(cache_dir: str | Path | None) -> Path:
    return default_cache_dir() if cache_dir is None else Path(cache_dir)


@dataclass(frozen=True)
class CachedRun:
    """One finished run: its config, its metrics lines and where they came from."""

    # A short name for legends, e.g. "lr=0.003" or "baseline".
    label: str
    # The config the run was trained with.
    config: TrainConfig
    # The run's metrics lines (SFT lines have no "step").
    history: list[dict[str, Any]]
    # config_cache_key(config): the folder name under the cache dir.
    key: str
    # True when the metrics were read from the cache instead of trained.
    from_cache: bool


def config_cache_key(config: TrainConfig) -> str:
    """sha256 of the config's JSON (sorted keys, minus run_dir and resume), 16 hex."""
    values = {
        key: value
        for key, value in config.to_dict().items()
        if key not in CACHE_EXCLUDED_FIELDS
    }
    text = json.dumps(values, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def run_cached(
    config: TrainConfig,
    cache_dir: str | Path | None = None,
    train_fn: TrainFunction | None = None,
    label: str | None = None,
    progress: bool = True,
) -> CachedRun:
    """The run of ``config``: read from ``cache_dir/<key>/`` or trained and stored.

    ``cache_dir`` defaults to :func:`default_cache_dir`. ``train_fn(config,
    progress=...) -> RunResult`` defaults to :func:`grpo_lab.training.train`, whose
    progress bar ``progress`` turns on. Training happens in a temporary folder
    that is renamed into place only when it succeeded, so a crash leaves no entry.
    """
    key = config_cache_key(config)
    entry = _cache_dir(cache_dir) / key
    label = key if label is None else label
    if (entry / CACHED_HISTORY_FILE).exists():
        history = json.loads((entry / CACHED_HISTORY_FILE).read_text(encoding="utf-8"))
        return CachedRun(label, config, history, key, from_cache=True)
    history = _train_into_entry(config, entry, train_fn, progress)
    return CachedRun(label, config, history, key, from_cache=False)


def _train_into_entry(
    config: TrainConfig, entry: Path, train_fn: TrainFunction | None, progress: bool
) -> list[dict[str, Any]]:
    if train_fn is None:
        from grpo_lab.training.loop import train as train_fn
    entry.parent.mkdir(parents=True, exist_ok=True)
    workspace = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        run_config = dataclasses.replace(
            config, run_dir=str(workspace / "run"), resume=False
        )
        result = train_fn(run_config, progress=progress)
        history = [dict(record) for record in result.history]
        staged = workspace / "entry"
        staged.mkdir()
        (staged / CONFIG_FILE).write_text(
            json.dumps(_cacheable_fields(config), indent=2, sort_keys=True) + "\n",
            encoding="utf-8",
        )
        (staged / CACHED_HISTORY_FILE).write_text(
            json.dumps(history) + "\n", encoding="utf-8"
        )
        if not (entry / CACHED_HISTORY_FILE).exists():
            shutil.rmtree(entry, ignore_errors=True)  # a stale, incomplete entry
            staged.replace(entry)
        return history
    finally:
        shutil.rmtree(workspace, ignore_errors=True)


def _cacheable_fields(config: TrainConfig) -> dict[str, Any]:
    return {
        key: value
        for key, value in config.to_dict().items()
        if key not in CACHE_EXCLUDED_FIELDS
    }


def sweep(
    base_config: TrainConfig,
    field: str,
    values: Sequence[Any],
    cache_dir: str | Path | None = None,
    train_fn: TrainFunction | None = None,
    progress: bool = True,
) -> list[CachedRun]:
    """One cached run per value of ``field``, everything else as in ``base_config``.

    ``progress`` shows a bar over the runs and each training run's own bar.
    """
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    if field not in names or field in CACHE_EXCLUDED_FIELDS:
        raise ValueError(
            f"field must be a TrainConfig field that changes the run, got {field!r}"
        )
    if len(values) == 0:
        raise ValueError("values must hold at least one value, got []")
    return [
        run_cached(
            dataclasses.replace(base_config, **{field: value}),
            cache_dir,
            train_fn,
            label=f"{field}={value}",
            progress=progress,
        )
        for value in _runs_bar(values, f"sweep of {field}", progress)
    ]


def _runs_bar(items: Sequence[Any], description: str, progress: bool) -> Any:
    """``items``, wrapped in a ``tqdm.auto`` bar counting runs when ``progress``."""
    return tqdm(items, desc=description, unit="run", disable=not progress)


def ablation_configs(
    base_config: TrainConfig, off_policy_epochs: int = 4, cliprange: float = 0.2
) -> dict[str, TrainConfig]:
    """The classic ablations of one base config, each changing one idea.

    baseline:                the base config (on-policy GRPO as configured)
    no std normalization:    advantage_normalizer="none"        (Dr. GRPO, nb 03)
    constant normalization:  loss_normalization="constant",
                             C = train_batch_size * max_new_tokens (Dr. GRPO, nb 06)
    off-policy epochs, clip: epochs_per_rollout_batch > 1, PPO clip (nb 04)
    off-policy, no clip:     the same epochs with the unclipped ratio ("noclip")
    """
    if off_policy_epochs < 2:
        raise ValueError(
            f"off_policy_epochs must be at least 2 to go off-policy, "
            f"got {off_policy_epochs}"
        )
    if cliprange <= 0:
        raise ValueError(f"cliprange must be positive, got {cliprange}")
    max_new_tokens = base_config.max_new_tokens or _task_max_new_tokens(base_config)
    changes = {
        "baseline": {},
        "no std normalization": {"advantage_normalizer": "none"},
        "constant normalization": {
            "loss_normalization": "constant",
            "normalization_constant": base_config.train_batch_size * max_new_tokens,
        },
        "off-policy epochs, clip": {
            "epochs_per_rollout_batch": off_policy_epochs,
            "importance_reweighting_method": "grpo",
            "cliprange": cliprange,
        },
        "off-policy epochs, no clip": {
            "epochs_per_rollout_batch": off_policy_epochs,
            "importance_reweighting_method": "noclip",
            "cliprange": None,
        },
    }
    return {
        name: dataclasses.replace(base_config, **change)
        for name, change in changes.items()
    }


def _task_max_new_tokens(config: TrainConfig) -> int:
    from grpo_lab.tasks import get_task

    return get_task(config.task, **config.task_options).max_new_tokens


def run_ablations(
    configs: dict[str, TrainConfig],
    cache_dir: str | Path | None = None,
    train_fn: TrainFunction | None = None,
    progress: bool = True,
) -> list[CachedRun]:
    """``run_cached`` for each named config, labelled by its name."""
    return [
        run_cached(config, cache_dir, train_fn, label=name, progress=progress)
        for name, config in _runs_bar(list(configs.items()), "ablations", progress)
    ]


def plot_comparison(
    results: Sequence[CachedRun], metric: str, axis: Axes | None = None
) -> Figure:
    """One line per run: ``metric`` against the GRPO step, on ``axis`` or on a
    new standalone figure."""
    curves = {run.label: curve(run.history, metric) for run in results}
    logged = any(steps for steps, _ in curves.values())
    # loss/* diagnostics are left out of steps whose update was skipped (every
    # group's rewards equal), so a short run may never log them.
    if not logged and not metric.startswith("loss/"):
        raise ValueError(
            f"metric must be logged by at least one run, got {metric!r}; "
            "read_metrics(run_dir) shows the keys a run logged"
        )
    if axis is None:
        figure = Figure(figsize=(6.4, 3.6))
        axis = figure.subplots()
    else:
        figure = axis.figure
    if not logged:
        axis.text(
            0.5,
            0.5,
            "not logged: a skipped update logs no loss/ diagnostics",
            ha="center",
            va="center",
            transform=axis.transAxes,
            color="grey",
        )
    for label, (steps, values) in curves.items():
        sparse = len(steps) < 0.5 * max(len(s) for s, _ in curves.values())
        axis.plot(
            steps,
            values,
            marker="o" if sparse or len(steps) < 12 else None,
            label=label,
        )
    axis.set_xlabel("GRPO step")
    axis.set_ylabel(metric)
    axis.legend(fontsize=8)
    return figure


def final_values(results: Sequence[CachedRun], metric: str) -> dict[str, float | None]:
    """The last logged value of ``metric`` for each run (None if never logged)."""
    finals: dict[str, float | None] = {}
    for run in results:
        _, values = curve(run.history, metric)
        finals[run.label] = values[-1] if values else None
    return finals


# --- the widget -----------------------------------------------------------------

# The settings the widget offers, with the choices it offers for each.
WIDGET_CHOICES: dict[str, tuple[Any, ...]] = {
    "lr": (1e-4, 3e-4, 1e-3, 3e-3),
    "group_size": (2, 4, 8, 16),
    "cliprange": (0.1, 0.2, 0.3),
    "importance_reweighting_method": ("none", "noclip", "grpo", "gspo"),
    "advantage_normalizer": ("std", "none", "mean"),
    "loss_normalization": ("sequence", "constant"),
    "epochs_per_rollout_batch": (1, 2, 4),
}


def config_from_settings(
    base_config: TrainConfig, settings: dict[str, Any]
) -> TrainConfig:
    """``base_config`` with the widget's settings, made consistent.

    cliprange only matters for "grpo"/"gspo" and is dropped otherwise, so
    settings that train the same run share one cache entry; "constant" gets
    C = train_batch_size * max_new_tokens. Inconsistent settings (off-policy
    epochs without a ratio) raise the config's own ``ValueError``.
    """
    unknown = sorted(set(settings) - set(WIDGET_CHOICES))
    if unknown:
        raise ValueError(
            f"settings must be some of {sorted(WIDGET_CHOICES)}, got {unknown}"
        )
    values = dict(settings)
    method = values.get(
        "importance_reweighting_method", base_config.importance_reweighting_method
    )
    if method not in ("grpo", "gspo"):
        values["cliprange"] = None
    if values.get("loss_normalization", base_config.loss_normalization) == "constant":
        max_new_tokens = base_config.max_new_tokens or _task_max_new_tokens(base_config)
        values["normalization_constant"] = base_config.train_batch_size * max_new_tokens
    else:
        values["normalization_constant"] = None
    return dataclasses.replace(base_config, **values)


def settings_label(config: TrainConfig, base_config: TrainConfig) -> str:
    """The widget settings in which ``config`` differs from ``base_config``."""
    changed = [
        f"{name}={getattr(config, name)}"
        for name in WIDGET_CHOICES
        if getattr(config, name) != getattr(base_config, name)
    ]
    return ", ".join(changed) or "base"


def run_from_settings(
    base_config: TrainConfig,
    settings: dict[str, Any],
    cache_dir: str | Path | None,
    results: list[CachedRun],
    train_fn: TrainFunction | None = None,
    *,
    progress: bool = True,
) -> CachedRun:
    """The widget's callback: run (or read) one setting and add it to ``results``.

    ``cache_dir=None`` is :func:`default_cache_dir`.
    """
    config = config_from_settings(base_config, settings)
    run = run_cached(
        config,
        cache_dir,
        train_fn,
        label=settings_label(config, base_config),
        progress=progress,
    )
    if all(existing.key != run.key for existing in results):
        results.append(run)
    return run


def comparison_figure(
    results: Sequence[CachedRun], metrics: Sequence[str]
) -> Figure | None:
    """``metrics`` of ``results`` side by side on one standalone figure (None if
    there are no results)."""
    if not results:
        return None
    figure = Figure(figsize=(5.2 * len(metrics), 3.6))
    axes = figure.subplots(1, len(metrics), squeeze=False)
    for axis, metric in zip(axes[0], metrics):
        plot_comparison(results, metric, axis=axis)
    figure.tight_layout()
    return figure


def show_comparison(
    results: Sequence[CachedRun], metrics: Sequence[str]
) -> Figure | None:
    """Display :func:`comparison_figure` as a PNG image and return the figure."""
    figure = comparison_figure(results, metrics)
    if figure is not None:
        display(Image(data=figure_png(figure), format="png"))
    return figure


def explorer_widget(
    base_config: TrainConfig,
    cache_dir: str | Path | None = None,
    metrics: Sequence[str] = ("train/reward_mean", "eval/accuracy_greedy"),
    results: list[CachedRun] | None = None,
    train_fn: TrainFunction | None = None,
) -> widgets.VBox:
    """Dropdowns for each setting and a Run button; runs are compared below.

    Nothing runs until the button is pressed, so displaying it never blocks.
    While a run trains, the button is disabled (and enabled again afterwards,
    also when the run fails) and its progress bar shows in the widget. The
    comparison of ``results`` is a PNG image, redrawn after each run.
    ``cache_dir=None`` is :func:`default_cache_dir`.
    """
    results = [] if results is None else results
    controls = {
        name: widgets.Dropdown(
            options=list(choices),
            value=_closest_choice(getattr(base_config, name), choices),
            description=name,
            style={"description_width": "initial"},
        )
        for name, choices in WIDGET_CHOICES.items()
    }
    button = widgets.Button(
        description=RUN_BUTTON_LABEL,
        icon="play",
        # Wide enough for the whole label, and never squeezed by the status text.
        layout=widgets.Layout(width="auto", min_width="16em", flex="0 0 auto"),
    )
    status = widgets.Label()
    progress_area = widgets.Output()
    chart = widgets.Image(format="png")

    def redraw() -> None:
        figure = comparison_figure(results, metrics)
        if figure is not None:
            chart.value = figure_png(figure)
        chart.layout.display = None if figure is not None else "none"

    def on_click(_button: widgets.Button) -> None:
        settings = {name: control.value for name, control in controls.items()}
        button.disabled = True
        status.value = "running…"
        try:
            run = _inside(
                progress_area,
                lambda: run_from_settings(
                    base_config, settings, cache_dir, results, train_fn
                ),
            )
        except ValueError as error:
            status.value = f"not run: {error}"
            return
        except Exception as error:
            status.value = f"failed: {type(error).__name__}: {error}"
            raise
        finally:
            button.disabled = False
        status.value = f"{run.label}: {'from cache' if run.from_cache else 'trained'}"
        redraw()

    button.on_click(on_click)
    redraw()
    return widgets.VBox(
        [
            widgets.HBox(list(controls.values())[:4]),
            widgets.HBox(list(controls.values())[4:]),
            widgets.HBox([button, status]),
            progress_area,
            chart,
        ]
    )


def _inside(area: widgets.Output, work: Callable[[], Result]) -> Result:
    """``work()`` with what it displays (progress bars) shown in ``area``.

    An exception propagates to the caller: ``Output`` would otherwise print and
    swallow it inside a kernel.
    """
    failure: Exception | None = None
    with area:
        area.clear_output()
        try:
            result = work()
        except Exception as error:
            failure = error
    if failure is not None:
        raise failure
    return result


def _closest_choice(value: Any, choices: Sequence[Any]) -> Any:
    if value in choices:
        return value
    if isinstance(value, (int, float)) and all(
        isinstance(choice, (int, float)) for choice in choices
    ):
        return min(choices, key=lambda choice: abs(choice - value))
    return choices[len(choices) // 2]


def warmed_up_model(
    config: TrainConfig, cache_dir: str | Path | None = None, progress: bool = True
) -> str:
    """A folder holding ``config``'s model after the supervised warm-up alone.

    Short explorer runs start from it (``model=<folder>``, ``sft_max_steps=0``):
    every run then begins where GRPO has a signal (a model that never samples a
    correct answer gets all-zero advantages), and the warm-up is paid once per
    warm-up config. Written to a temporary folder and renamed into place.
    ``cache_dir=None`` is :func:`default_cache_dir`; ``progress`` shows a bar
    over the warm-up's steps.
    """
    folder = _cache_dir(cache_dir) / f"warm-{config_cache_key(config)}"
    if (folder / MODEL_CONFIG_FILE).exists():
        return str(folder)
    from grpo_lab.tasks import get_task
    from grpo_lab.training.loop import build_policy, save_final_model, warm_up_settings
    from grpo_lab.training.sft import warm_up

    policy = build_policy(config)
    task = get_task(config.task, **config.task_options)
    settings = warm_up_settings(config, task)
    with tqdm(
        total=settings.max_steps, desc="SFT warm-up", disable=not progress
    ) as bar:
        warm_up(
            policy.model,
            policy.tokenizer,
            policy.backend,
            task,
            settings,
            log=lambda record: bar.update(1),  # only the model is kept, not metrics
        )
    folder.parent.mkdir(parents=True, exist_ok=True)
    workspace = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    save_final_model(policy, workspace)
    try:
        workspace.rename(folder)
    except OSError:  # another process put the same warm-up in place first
        shutil.rmtree(workspace, ignore_errors=True)
        if not (folder / MODEL_CONFIG_FILE).exists():
            raise
    return str(folder)
