"""Run metrics as JSONL: one flat dict per line, appended as training goes.

Keys are flat and namespaced (``train/reward_mean``, ``loss/clip_fraction``,
``eval/accuracy_greedy``, ``sft/loss``, ``time/step_seconds``), so plots, tests
and notebooks all read the same file with :func:`read_metrics`.
Taught in ``notebooks/`` on the training loop.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

METRICS_FILE = "metrics.jsonl"


def metrics_path(run_dir: str | os.PathLike) -> Path:
    """``run_dir / "metrics.jsonl"``."""
    return Path(run_dir) / METRICS_FILE


def to_plain_number(value: Any) -> Any:
    """A JSON-ready scalar: 0-d tensors and numpy numbers become Python floats.

    Non-finite floats become None (JSON has no NaN).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"value must be a scalar tensor, got shape {tuple(value.shape)}"
            )
        value = value.item()
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def flatten_metrics(prefix: str, metadata: Mapping[str, Any]) -> dict[str, Any]:
    """``{"loss": t}`` with prefix "loss" -> ``{"loss/loss": float(t)}``."""
    return {
        f"{prefix}/{key}": to_plain_number(value) for key, value in metadata.items()
    }


def mean_metrics(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Key-wise mean of several flat dicts (keys missing from some are averaged
    over the dicts that have them)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for record in records:
        for key, value in record.items():
            value = to_plain_number(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                sums[key] = sums.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}


def append_metrics(run_dir: str | os.PathLike, record: Mapping[str, Any]) -> None:
    """Append ``record`` as one JSON line (a single write, then flush)."""
    line = json.dumps({key: to_plain_number(v) for key, v in record.items()})
    with open(metrics_path(run_dir), "a", encoding="utf-8") as handle:
        handle.write(line + "\n")
        handle.flush()


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete line of ``run_dir/metrics.jsonl`` ([] when there is none).

    A last line cut short by a crash is skipped; a broken line elsewhere raises
    ``ValueError`` naming its line number.
    """
    path = metrics_path(run_dir)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == len(lines):  # an unterminated final line
                break
            raise ValueError(f"{path} line {number} is not JSON: {error}") from error
    return records


def read_metrics_from(
    run_dir: str | os.PathLike, offset: int
) -> tuple[list[dict[str, Any]], int]:
    """The complete lines after byte ``offset`` of metrics.jsonl, and the new offset.

    A last line still being written (no newline yet) is left for the next call,
    so following the file line by line sees each line once. ``offset`` must be
    0 or a previous call's result.
    """
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"offset must be an int >= 0, got {offset!r}")
    path = metrics_path(run_dir)
    if not path.exists():
        return [], offset
    with open(path, "rb") as handle:
        handle.seek(offset)
        data = handle.read()
    complete = data[: data.rfind(b"\n") + 1]
    lines = complete.decode("utf-8").split("\n")
    records = [json.loads(line) for line in lines if line.strip()]
    return records, offset + len(complete)


def metrics_size(run_dir: str | os.PathLike) -> int:
    """Bytes in the metrics file (0 when there is none)."""
    path = metrics_path(run_dir)
    return path.stat().st_size if path.exists() else 0


def count_metric_lines(run_dir: str | os.PathLike) -> int:
    """Complete (newline-terminated) lines in the metrics file."""
    path = metrics_path(run_dir)
    return path.read_bytes().count(b"\n") if path.exists() else 0


def truncate_metrics(run_dir: str | os.PathLike, line_count: int) -> None:
    """Keep the first ``line_count`` lines; drop lines written after a checkpoint."""
    if line_count < 0:
        raise ValueError(f"line_count must be >= 0, got {line_count}")
    path = metrics_path(run_dir)
    if not path.exists():
        if line_count:
            raise ValueError(
                f"line_count must be 0 when {path} does not exist, got {line_count}"
            )
        return
    complete_lines = path.read_bytes().split(b"\n")[:-1]
    if len(complete_lines) < line_count:
        raise ValueError(
            f"line_count must be at most the {len(complete_lines)} lines of {path}, "
            f"got {line_count}"
        )
    kept = complete_lines[:line_count]
    temporary = path.with_suffix(".jsonl.tmp")
    with open(temporary, "wb") as handle:
        handle.write(b"".join(line + b"\n" for line in kept))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def step_records(history: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The GRPO lines of a history (those with a ``step``), SFT lines left out."""
    return [dict(record) for record in history if "step" in record]


def without_timing(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` less its wall-clock keys (``time/...``), for exact comparisons."""
    return {key: value for key, value in record.items() if not key.startswith("time/")}
