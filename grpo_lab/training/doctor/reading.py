"""Reading a run for the doctor: grpo_lab's metrics.jsonl, TRL's
trainer_state.json and verl's metric logs, whatever state the files are in.

Every line is read on its own: a line that is not JSON, not an object, has no
usable ``step`` or holds a value that is not a number where a number belongs is
left out and named, with its line number, in ``Run.unreadable``; the rest of the
file is diagnosed. Only a path that holds no step at all is refused (ValueError).

verl's logs come in two forms (``trainer.logger``): ``console`` prints one line
per step, ``step:12 - actor/pg_clipfrac:0.004 - critic/score/mean:0.512 - ...``
(``verl/utils/logger/aggregate_logger.py``, values with 3 decimals, often behind
a Ray prefix such as ``(TaskRunner pid=42)``), and ``file`` appends one JSON line
per step, ``{"step": 12, "data": {...}}``, to ``VERL_FILE_LOGGER_PATH``. Their
keys (``verl/trainer/ppo/metric_utils.py``, ``rollout_corr_helper.py``, the
actor's update metrics) are mapped onto this package's names by
:data:`VERL_KEYS`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from grpo_lab.training.doctor.findings import Run, is_finite_number
from grpo_lab.training.metrics import METRICS_FILE

TRL_STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.json"
# peft's adapter file: a TRL run with peft_config saves it in each checkpoint.
ADAPTER_CONFIG_FILE = "adapter_config.json"
# A line longer than this is named and skipped, not parsed (no metrics line of
# grpo_lab, TRL or verl comes near it: a step of verl's is a few kB).
MAX_LINE_CHARS = 1_000_000
# The namespaces whose values are numbers (or null for a non-finite one).
NUMERIC_PREFIXES = ("train/", "loss/", "rollout/", "eval/", "async/")

# TRL 1.16's GRPOTrainer log keys (trl/trainer/grpo_trainer.py) -> ours.
TRL_KEYS = {
    "reward": "train/reward_mean",
    "frac_reward_zero_std": "train/equal_reward_group_fraction",
    "completions/mean_length": "train/response_length",
    "completions/max_length": "train/response_length_max",
    "completions/clipped_ratio": "rollout/clipped_fraction",
    "completions/mean_terminated_length": "rollout/terminated_length_mean",
    "entropy": "loss/token_entropy",
    "clip_ratio/region_mean": "loss/clip_fraction",
    "loss": "loss/loss",
    "grad_norm": "loss/gradient_norm",
    "kl": "loss/kl_mean",
    "learning_rate": "train/learning_rate",
    "sampling/sampling_logp_difference/mean": "rollout/sampler_log_prob_diff_mean",
    "sampling/sampling_logp_difference/max": "rollout/sampler_log_prob_diff_max",
    "sampling/importance_sampling_ratio/min": "rollout/is_ratio_min",
    "sampling/importance_sampling_ratio/mean": "rollout/is_ratio_mean",
    "sampling/importance_sampling_ratio/max": "rollout/is_ratio_max",
    # trl/experimental/async_grpo/async_grpo_trainer.py (the async trainer).
    "sample/staleness_mean": "async/staleness_mean",
    "sample/staleness_max": "async/staleness_max",
    "sample/dropped_stale_total": "async/dropped_groups_stale",
    "sample/rollout_queue_size": "async/queue_depth",
    "perf/rollout_wait_s": "async/trainer_wait_seconds",
}

# verl's metric keys -> ours. critic/score is the task's score before any KL
# penalty in the reward (critic/rewards has it); actor/kl_loss is the KL to the
# reference (use_kl_loss), actor/ppo_kl the update's own KL(old || new), kept
# as loss/ppo_kl; critic/advantages/mean is a token mean over the batch.
VERL_KEYS = {
    "critic/score/mean": "train/reward_mean",
    "critic/advantages/mean": "train/advantage_mean",
    "response_length/mean": "train/response_length",
    "response_length/max": "train/response_length_max",
    "response_length/clip_ratio": "rollout/clipped_fraction",
    "actor/pg_clipfrac": "loss/clip_fraction",
    "actor/pg_loss": "loss/loss",
    "actor/entropy": "loss/token_entropy",
    "actor/grad_norm": "loss/gradient_norm",
    "actor/kl_loss": "loss/kl_mean",
    "actor/ppo_kl": "loss/ppo_kl",
    "actor/lr": "train/learning_rate",
    "rollout_corr/rollout_is_mean": "rollout/is_ratio_mean",
    "rollout_corr/rollout_is_min": "rollout/is_ratio_min",
    "rollout_corr/rollout_is_max": "rollout/is_ratio_max",
    "rollout_corr/kl": "rollout/sampler_kl",
    # verl/trainer/ppo/v1/replay_buffer.py: prompt groups evicted as too stale.
    "training/off_policy/evicted_samples": "async/dropped_groups_stale",
}
# verl names the step twice: the console's "step:N" and training/global_step.
VERL_STEP_KEY = "training/global_step"
VERL_CONSOLE_LINE = re.compile(r"(?:^|\s)step:(\S+) - (.*)$")
# The console prints 3 decimals: an RL learning rate (1e-6) shows as 0.000, so
# the console's actor/lr is not read.
VERL_CONSOLE_SKIPPED = frozenset({"actor/lr"})


class Unreadable(ValueError):
    """A line (or entry) that is left out, with the reason."""


# --- entry points -----------------------------------------------------------


def load_run(path: str | Path) -> Run:
    """The run at ``path``: a grpo_lab run folder or its metrics.jsonl, a TRL
    output folder, one of its ``checkpoint-*`` folders or a trainer_state.json,
    or a verl metric log (the ``file`` logger's JSONL or the console's output).

    Raises ValueError naming the path when it holds none of them, or no step.
    """
    path = Path(path)
    try:
        return _load(path)
    except OSError as error:  # unreadable, a folder where a file belongs, ...
        raise ValueError(f"RUN_DIR could not be read: {error}") from error


def _load(path: Path) -> Run:
    if path.is_file():
        if path.name == TRL_STATE_FILE:
            return _load_trl(path)
        return _load_log_file(path)
    if not path.is_dir():
        raise ValueError(f"RUN_DIR must be an existing folder, got {str(path)!r}")
    if (path / METRICS_FILE).exists():
        return _load_log_file(path / METRICS_FILE)
    if (path / TRL_STATE_FILE).is_file():
        return _load_trl(path / TRL_STATE_FILE)
    checkpoints = sorted(
        path.glob(f"checkpoint-*/{TRL_STATE_FILE}"), key=_checkpoint_number
    )
    if checkpoints:  # the latest checkpoint's state holds the whole log
        return _load_trl(checkpoints[-1])
    raise ValueError(
        f"RUN_DIR must hold {METRICS_FILE} (grpo-lab train or verl's file "
        f"logger) or {TRL_STATE_FILE} (TRL, also in a checkpoint-* folder), and "
        f"{str(path)!r} holds neither"
    )


def _checkpoint_number(state: Path) -> int:
    digits = state.parent.name.removeprefix("checkpoint-")
    return int(digits) if digits.isdigit() else -1


def _load_log_file(path: Path) -> Run:
    """metrics.jsonl of grpo_lab or verl, or a verl console log."""
    lines = read_lines(path)
    if any(VERL_CONSOLE_LINE.search(line) for _, line in lines):
        return _load_verl_console(path, lines)
    parsed, unreadable = parse_json_lines(path.name, lines)
    if any(_is_verl_record(value) for _, value in parsed):
        return _finish(path, "verl", _verl_json_records(path.name, parsed, unreadable))
    if path.name != METRICS_FILE and not any(isinstance(v, dict) for _, v in parsed):
        raise ValueError(
            f"RUN_DIR must be a run folder, {METRICS_FILE}, {TRL_STATE_FILE} or a "
            f"verl metric log, got the file {str(path)!r}"
        )
    records = []
    for number, value in parsed:
        try:
            record = grpo_lab_record(value)
        except Unreadable as why:
            unreadable.append(f"{path.name} line {number}: {why}")
            continue
        if record is not None:
            records.append((f"{path.name} line {number}", record))
    run = _finish(path, "grpo_lab", (records, unreadable))
    run.config = read_config(path.parent / CONFIG_FILE, run.unreadable)
    return run


def _finish(path: Path, kind: str, read: tuple[list, list[str]]) -> Run:
    """The run from (place, record) pairs: step 0 dropped, one record per step."""
    records, unreadable = read
    by_step: dict[int, tuple[str, dict]] = {}
    for place, record in records:
        step = record["step"]
        if step == 0:  # step 0: evaluation only
            continue
        if step in by_step:
            unreadable.append(
                f"{by_step[step][0]}: step {step} again at {place}; the later "
                "line is kept"
            )
        by_step[step] = (place, record)
    history = [by_step[step][1] for step in sorted(by_step)]
    if not history:
        raise ValueError(
            f"RUN_DIR must hold at least one GRPO step, and {str(path)!r} has none"
            + (
                f" ({len(unreadable)} unreadable lines; the first: {unreadable[0]})"
                if unreadable
                else ""
            )
        )
    logged = [record["step"] for _, record in records if record["step"] != 0]
    return Run(path, kind, history, unreadable=unreadable, logged_steps=logged)


# --- lines ------------------------------------------------------------------


def read_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of each non-blank line; bytes that are not UTF-8
    become U+FFFD, so such a line fails to parse and is named."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    return [
        (number, line.rstrip("\r"))
        for number, line in enumerate(text.split("\n"), start=1)
        if line.strip()
    ]


def parse_json_lines(
    name: str, lines: list[tuple[int, str]]
) -> tuple[list[tuple[int, Any]], list[str]]:
    """(line number, value) of each line that is JSON, and the others named."""
    parsed, unreadable = [], []
    for number, line in lines:
        try:
            parsed.append((number, parse_json_line(line)))
        except Unreadable as why:
            unreadable.append(f"{name} line {number}: {why}")
    return parsed, unreadable


def parse_json_line(line: str) -> Any:
    if len(line) > MAX_LINE_CHARS:
        raise Unreadable(f"{len(line)} characters, over the {MAX_LINE_CHARS} read")
    try:
        return json.loads(line)
    except RecursionError:
        raise Unreadable("nested too deeply to read") from None
    except ValueError as error:  # not JSON, or an integer of thousands of digits
        raise Unreadable(f"not JSON ({_short(error)})") from None


def _short(error: BaseException) -> str:
    return str(error).split("\n")[0][:120]


# --- records ----------------------------------------------------------------


def grpo_lab_record(value: Any) -> dict[str, Any] | None:
    """One metrics.jsonl line as a record (None: a warm-up line, no ``step``)."""
    if not isinstance(value, dict):
        raise Unreadable(f"a JSON {_json_type(value)}, not an object")
    if "step" not in value:
        return None  # an SFT line (sft/step) or a header: not a GRPO step
    return {"step": whole_step(value["step"]), **numeric_values(value)}


def whole_step(value: Any) -> int:
    """``value`` as a step number >= 0, or Unreadable saying why not."""
    if isinstance(value, float) and is_finite_number(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Unreadable(f"step must be a whole number >= 0, got {_brief(value)}")
    return value


def numeric_values(record: dict[str, Any], keys: dict[str, str] | None = None):
    """The record's values as floats (None stays None: a non-finite number).

    With ``keys``, only those keys, renamed; without, every key, and a value of
    our numeric namespaces that is not a number raises Unreadable.
    """
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key == "step":
            continue
        name = keys.get(key) if keys is not None else key
        if name is None:
            continue
        number = _as_number(value)
        if number is _NOT_A_NUMBER:
            if keys is not None or str(key).startswith(NUMERIC_PREFIXES):
                raise Unreadable(f"{key} is {_brief(value)}, not a number")
            out[name] = value
        else:
            out[name] = number
    return out


_NOT_A_NUMBER = object()


def _as_number(value: Any) -> Any:
    """A float (inf and nan kept), None for null, or _NOT_A_NUMBER."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _NOT_A_NUMBER
    try:
        return float(value)
    except OverflowError:  # an int past 1.8e308: as JSON's 1e999, infinite
        return float("inf") if value > 0 else float("-inf")


def _json_type(value: Any) -> str:
    names = {list: "list", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _brief(value: Any) -> str:
    text = repr(value)
    kind = type(value).__name__
    return f"{text[:40]}... ({kind})" if len(text) > 40 else f"{text} ({kind})"


# --- config.json --------------------------------------------------------------


def read_config(path: Path, unreadable: list[str]) -> dict[str, Any] | None:
    """config.json (or peft's adapter_config.json) as a dict, or None (the
    reason added to ``unreadable``)."""
    if not path.is_file():
        return None
    try:
        config = parse_json_line(path.read_bytes().decode("utf-8", errors="replace"))
    except Unreadable as why:
        unreadable.append(f"{path.name}: {why}; the config checks are skipped")
        return None
    if not isinstance(config, dict):
        unreadable.append(
            f"{path.name}: a JSON {_json_type(config)}, not an object; the "
            "config checks are skipped"
        )
        return None
    return config


# --- TRL ----------------------------------------------------------------------


def _load_trl(state_path: Path) -> Run:
    try:
        state = parse_json_line(
            state_path.read_bytes().decode("utf-8", errors="replace")
        )
    except Unreadable as why:
        raise ValueError(
            f"RUN_DIR's {TRL_STATE_FILE} must be TRL's JSON with a log_history, "
            f"and {str(state_path)!r} is not ({why})"
        ) from None
    log = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(log, list):
        raise ValueError(
            f"RUN_DIR's {TRL_STATE_FILE} must be TRL's JSON with a log_history "
            f"list, and {str(state_path)!r} is not"
        )
    records, unreadable = [], []
    for number, entry in enumerate(log):
        place = f"{TRL_STATE_FILE} log_history[{number}]"
        try:
            record = trl_record(entry, strict=True)
        except Unreadable as why:
            unreadable.append(f"{place}: {why}")
            continue
        if record is not None:
            records.append((place, record))
    run = _finish(state_path, "trl", (records, unreadable))
    for folder in (state_path.parent, state_path.parent.parent):
        if (folder / ADAPTER_CONFIG_FILE).is_file():
            run.adapter_config = read_config(
                folder / ADAPTER_CONFIG_FILE, run.unreadable
            )
            break
    return run


def trl_record(entry: Any, strict: bool = False) -> dict[str, Any] | None:
    """One TRL log_history entry under our names (None: no training metrics).

    With ``strict``, a bad step or value raises Unreadable instead of None.
    """
    try:
        if not isinstance(entry, dict):
            raise Unreadable(f"a JSON {_json_type(entry)}, not an object")
        if "step" not in entry or not set(entry) & set(TRL_KEYS):
            return None  # a summary (train_runtime, ...) or an evaluation
        return {"step": whole_step(entry["step"]), **numeric_values(entry, TRL_KEYS)}
    except Unreadable:
        if strict:
            raise
        return None


# --- verl -----------------------------------------------------------------------


def _is_verl_record(value: Any) -> bool:
    """A verl line: the file logger's ``{"step": N, "data": ...}`` (whatever
    ``data`` holds: a line of another shape is named, not read as grpo_lab's),
    or verl's keys at the top."""
    if not isinstance(value, dict):
        return False
    if "data" in value and "step" in value:
        return True
    return VERL_STEP_KEY in value or any(key in VERL_KEYS for key in value)


def verl_record(metrics: dict[str, Any], step: Any) -> dict[str, Any]:
    """One step of verl metrics under our names; Unreadable when unusable."""
    step = metrics.get(VERL_STEP_KEY, step)
    return {"step": whole_step(step), **numeric_values(metrics, VERL_KEYS)}


def _verl_json_records(name: str, parsed: list, unreadable: list[str]):
    records = []
    for number, value in parsed:
        try:
            if not isinstance(value, dict):
                raise Unreadable(f"a JSON {_json_type(value)}, not an object")
            data = value.get("data", value)
            if not isinstance(data, dict):
                raise Unreadable(f"data is {_brief(data)}, not an object")
            records.append(
                (f"{name} line {number}", verl_record(data, value.get("step")))
            )
        except Unreadable as why:
            unreadable.append(f"{name} line {number}: {why}")
    return records, unreadable


def _load_verl_console(path: Path, lines: list[tuple[int, str]]) -> Run:
    records, unreadable = [], []
    for number, line in lines:
        match = VERL_CONSOLE_LINE.search(line)
        if match is None:
            continue  # the console's other output: not a metrics line
        place = f"{path.name} line {number}"
        try:
            metrics = console_pairs(match.group(2))
            metrics = {
                k: v for k, v in metrics.items() if k not in VERL_CONSOLE_SKIPPED
            }
            records.append((place, verl_record(metrics, _console_step(match))))
        except Unreadable as why:
            unreadable.append(f"{place}: {why}")
    return _finish(path, "verl", (records, unreadable))


def _console_step(match: re.Match) -> Any:
    text = match.group(1)
    return int(text) if text.isdigit() else text


def console_pairs(text: str) -> dict[str, Any]:
    """``a:0.1 - b:2`` -> {"a": 0.1, "b": 2.0}; a pair that is not key:number
    raises Unreadable."""
    metrics: dict[str, Any] = {}
    for pair in text.split(" - "):
        key, colon, number = pair.strip().rpartition(":")
        if not colon or not key:
            raise Unreadable(f"{pair[:40]!r} is not key:number")
        try:
            metrics[key] = float(number)
        except ValueError:
            raise Unreadable(f"{key} is {number[:40]!r}, not a number") from None
    return metrics
