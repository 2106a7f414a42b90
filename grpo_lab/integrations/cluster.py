"""The cluster a launch folder is written for, and what both exports share.

``grpo-lab export trl|verl --gpus N --nodes M`` writes a folder for M machines
of N GPUs each (N x M processes, one per GPU). This module holds that choice
(:class:`Cluster`, validated once), the split of a global batch over the
processes (:func:`split_rows`, and :func:`working_process_counts` for the
refusal that names the counts that work), and the install lines both launch
READMEs print (a source checkout or a built wheel: grpo-lab is not on PyPI).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The largest process count a refusal lists.
MAX_LISTED_PROCESSES = 64


@dataclass(frozen=True)
class Cluster:
    """``gpus`` GPUs on each of ``nodes`` machines; one process per GPU."""

    gpus: int = 1
    nodes: int = 1

    def __post_init__(self) -> None:
        for flag, value in (("--gpus", self.gpus), ("--nodes", self.nodes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{flag} must be a positive int, got {value!r}")

    @property
    def world_size(self) -> int:
        """Processes in all: GPUs per node x nodes."""
        return self.gpus * self.nodes


def split_rows(rows: int, processes: int, max_rows: int) -> tuple[int, int] | None:
    """(rows per process and micro-step, accumulation steps) that hold ``rows``.

    per x processes x steps = rows, with per <= ``max_rows`` (the memory of one
    grpo_lab microbatch) and per as large as it can be; None when ``processes``
    does not divide ``rows``.
    """
    if rows % processes:
        return None
    share = rows // processes
    per = max(d for d in range(1, min(share, max_rows) + 1) if share % d == 0)
    return per, share // per


def working_process_counts(fits: Callable[[int], bool]) -> list[int]:
    """The process counts up to :data:`MAX_LISTED_PROCESSES` for which ``fits``."""
    return [n for n in range(1, MAX_LISTED_PROCESSES + 1) if fits(n)]


def refusal_counts(fits: Callable[[int], bool]) -> str:
    """ "works with N processes: 1, 2, 4, ..." for a refusal message."""
    counts = working_process_counts(fits)
    listed = ", ".join(str(n) for n in counts) or "none"
    limit = MAX_LISTED_PROCESSES
    return f"it splits over {listed} processes (GPUs x nodes, up to {limit})"


SOURCE_INSTALL = """\
grpo-lab is not on PyPI: install it from a source checkout (the folder with
its `pyproject.toml`) or from a wheel built there:

```
pip install "PATH/TO/grpo-lab{extras}"             # from a source checkout,
pip wheel --no-deps PATH/TO/grpo-lab -w dist       # or build a wheel there
pip install "$(ls dist/grpo_lab-*.whl){extras}"    # and install that
```
"""


def source_install(extras: str = "") -> str:
    """The README lines that install grpo-lab (``extras``: "[bench,vllm]" or "")."""
    return SOURCE_INSTALL.format(extras=extras)


# --- the task's local files travel with the folder --------------------------------

TASK_FILES_DIR = "task_files"


def portable_task_options(
    task_options: dict[str, Any], out_dir: Path
) -> tuple[dict[str, Any], list[Path]]:
    """``task_options`` with every value that names a local file copied to
    ``out_dir/task_files/`` and replaced by that path relative to ``out_dir``.

    Returns the new options and the files written; other values are kept.
    """
    options, written = dict(task_options), []
    for key, value in task_options.items():
        if not isinstance(value, str) or not Path(value).is_file():
            continue
        target = out_dir / TASK_FILES_DIR / f"{key}_{Path(value).name}"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(value, target)
        options[key] = target.relative_to(out_dir).as_posix()
        written.append(target)
    return options, written


def resolve_task_options(task_options: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The launch folder's ``task_options`` with its relative file paths made
    absolute against ``folder`` (where the folder is now)."""
    resolved = dict(task_options)
    for key, value in task_options.items():
        if isinstance(value, str) and value.startswith(f"{TASK_FILES_DIR}/"):
            resolved[key] = str(Path(folder) / value)
    return resolved


def portable_config(config: Any, out_dir: Path) -> tuple[Any, list[Path]]:
    """``config`` as a launch folder holds it: no run_dir (the folder is the
    run's home), task files copied in (:func:`portable_task_options`), a local
    model folder copied to ``model/`` (:func:`copy_local_model`)."""
    options, written = portable_task_options(config.task_options, out_dir)
    config, models = copy_local_model(config, out_dir)
    portable = dataclasses.replace(config, run_dir=None, task_options=options)
    return portable, [*written, *models]


# --- a run folder's warmed-up start, and the model copied in -------------------

MODEL_DIR = "model"


def warmed_up_config(run_dir: str | Path) -> Any:
    """The TrainConfig of the run in ``run_dir``, starting where its GRPO steps
    started: from the warm-up's checkpoint (step 0) with ``sft_max_steps`` 0.

    Raises ``ValueError`` naming what is missing (no config.json, a warm-up
    whose step-0 checkpoint is gone).
    """
    from grpo_lab.training import checkpoint as checkpoints
    from grpo_lab.training.config import TrainConfig
    from grpo_lab.training.run_dir import CONFIG_FILE

    config_file = Path(run_dir) / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(
            f"RUN_DIR must be a folder grpo-lab train wrote, got {str(run_dir)!r} "
            f"(no {CONFIG_FILE})"
        )
    config = TrainConfig.from_dict(json.loads(config_file.read_text()))
    changes: dict[str, Any] = {"run_dir": None, "resume": False}
    if config.sft_max_steps > 0:
        start = checkpoints.pretrained_dir(checkpoints.checkpoint_path(run_dir, 0))
        if not (start / "config.json").is_file():
            raise ValueError(
                f"RUN_DIR must hold the warm-up's checkpoint {start} (step 0), "
                "which keep_checkpoints may have deleted; got none"
            )
        changes.update(model=str(start), sft_max_steps=0)
    return dataclasses.replace(config, **changes)


def copy_local_model(config: Any, out_dir: Path) -> tuple[Any, list[Path]]:
    """A config whose model is a local folder: the folder copied to
    ``out_dir/model`` and the model named ``"model"`` (relative to the folder)."""
    if config.model == "tiny" or not Path(config.model).is_dir():
        return config, []
    target = out_dir / MODEL_DIR
    copy_folder(Path(config.model), target)
    return dataclasses.replace(config, model=MODEL_DIR), [target]


def copy_folder(source: Path, target: Path, progress: bool | None = None) -> None:
    """``shutil.copytree`` with a bar counting the bytes copied (a model's
    weights can take minutes); ``progress=None`` shows it on a terminal only."""
    from tqdm.auto import tqdm

    total = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    disable = None if progress is None else not progress
    with tqdm(
        total=total,
        desc=f"copying {source.name}",
        unit="B",
        unit_scale=True,
        disable=disable,
    ) as bar:

        def copy_and_count(file: str, destination: str) -> None:
            shutil.copy2(file, destination)
            bar.update(Path(file).stat().st_size)

        shutil.copytree(source, target, copy_function=copy_and_count)
