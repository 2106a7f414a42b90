"""The benchmark harness: one parser, one runner, one result-file writer.

A benchmark is a module with a docstring (its method and usage), ``FLAGS``
(its own flags at full size: see ``parser``), ``QUICK`` (the values ``--quick``
puts in their place; a flag given explicitly still wins), ``measure(arguments,
save) -> report`` and, if it runs cases in fresh processes, ``worker(spec)``.
``main`` parses, records the machine (CPU, GPU, versions, torch threads, git
commit, load average and UTC time at the start and at each write) and the exact
command line, writes the result file at every ``save(report)`` (a stopped run
keeps what it measured) and at the end, and prints it once, as RESULTS.md
shows it. A report holds ``title``, ``description`` (the method), ``tables``
(each from ``table``), ``notes`` and any raw data; render_results.check_result
is the result file's schema.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

import torch
from render_results import SCHEMA_VERSION, check_result, render_section

BENCHMARK_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCHMARK_DIR.parent
OUT_DIR = BENCHMARK_DIR / "out"  # git-ignored scratch
Save = Callable[[dict], None]


class Flag(NamedTuple):
    """A flag's default with its choices or help (a bare default needs none)."""

    default: object
    choices: tuple | None = None
    help: str | None = None


def parser(doc: str, name: str, flags: dict) -> argparse.ArgumentParser:
    """The common flags, then one per entry of ``flags`` (``seq_lens`` is
    ``--seq-lens``): typed as its default, one or more values for a list, a
    switch for False, JSON for a dict. ``--seed`` (0) unless flags has seeds."""
    result = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    result.add_argument("--out", type=Path, default=OUT_DIR / f"{name}.json")
    result.add_argument(
        "--quick", "--smoke", action="store_true",
        help="small sizes that run in seconds (explicit flags still win)",
    )  # fmt: skip
    result.add_argument("--worker", help=argparse.SUPPRESS)
    common = {} if "seeds" in flags else {"seed": 0}
    for key, flag in (common | flags).items():
        flag = flag if isinstance(flag, Flag) else Flag(flag)
        option, default = "--" + key.replace("_", "-"), flag.default
        if default is False:
            result.add_argument(option, action="store_true", help=flag.help)
            continue
        many = isinstance(default, list)
        sample = default[0] if many else default
        kind = json.loads if isinstance(default, dict) else type(sample)
        result.add_argument(
            option, type=kind, nargs="+" if many else None, default=default,
            choices=flag.choices, help=flag.help,
        )  # fmt: skip
    return result


def parse_arguments(parser, quick: dict, argv=None) -> argparse.Namespace:
    """Parse argv; with --quick, ``quick`` stands in for the defaults it names."""
    arguments = parser.parse_args(argv)
    if arguments.quick:  # argparse fills only the attributes a namespace lacks
        arguments = parser.parse_args(argv, argparse.Namespace(**quick))
    return arguments


def table(columns: list[tuple[str, str]], rows: list[dict], title="", notes="") -> dict:
    """One table of a report: (key, header) columns, rows, a title and notes."""
    columns = [list(column) for column in columns]
    return {"title": title, "columns": columns, "rows": rows, "notes": notes}


def arguments_of(benchmark, argv=None) -> argparse.Namespace:
    """A benchmark module's flags parsed from argv."""
    name = Path(benchmark.__file__).stem
    flags = parser(benchmark.__doc__, name, benchmark.FLAGS)
    return parse_arguments(flags, benchmark.QUICK, argv)


def main(benchmark, argv=None) -> dict | None:
    """Parse, measure, write and print a benchmark module's result file.

    ``--worker SPEC`` instead prints ``benchmark.worker(json.loads(SPEC))``.
    """
    arguments = arguments_of(benchmark, argv)
    if arguments.worker:
        print(json.dumps(benchmark.worker(json.loads(arguments.worker))))
        return None
    command = command_line(benchmark.__file__, argv)
    machine = {**machine_facts(), **moment("start")}
    settings = {k: v for k, v in vars(arguments).items() if k not in {"out", "worker"}}

    def save(report: dict, complete: bool = False) -> dict:
        result = {
            "schema": SCHEMA_VERSION, "benchmark": Path(benchmark.__file__).stem,
            "command": shlex.join(command), "argv": command,
            "machine": {**machine, **moment("end")}, "settings": settings,
            "complete": complete, **report,
        }  # fmt: skip
        write_json(arguments.out, check_result(result, str(arguments.out)))
        return result

    result = save(benchmark.measure(arguments, save), complete=True)
    print(render_section(result))
    print(f"wrote {arguments.out}")
    return result


def command_line(script: str, argv: list[str] | None) -> list[str]:
    """The command as typed at the repository root, with no absolute path of
    this machine: paths inside the repository relative to it, the interpreter
    as its virtual environment's (``.venv/bin/python``), any other absolute
    path as its file name (``portable_path``)."""
    arguments = sys.argv[1:] if argv is None else [str(a) for a in argv]
    return [_interpreter(), _relative(script), *map(portable_path, arguments)]


def _interpreter() -> str:
    inside = _relative(sys.executable)
    if not os.path.isabs(inside):
        return inside
    name = Path(sys.executable).name
    if sys.prefix != sys.base_prefix:  # a virtual environment, named as here
        return f"{Path(sys.prefix).name}/bin/{name}"
    return name


def portable_path(text: str) -> str:
    """``text`` relative to the repository when it is an absolute path inside
    it, its file name when it is one outside it, else unchanged."""
    if not os.path.isabs(text):
        return text
    inside = _relative(text)
    return inside if not os.path.isabs(inside) else Path(text).name


def _relative(path: str) -> str:
    try:
        return str(Path(os.path.abspath(path)).relative_to(REPO_ROOT))
    except ValueError:
        return path


def machine_facts() -> dict:
    """What a figure depends on: hardware, versions, threads and commit."""
    facts = {
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **{package: _version(package) for package in ("transformers", "trl")},
        "torch_threads": torch.get_num_threads(),
        **git_state(),
    }
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
    return facts


def moment(when: str) -> dict:
    """The load average (1, 5, 15 minutes) and UTC time, keyed by ``when``."""
    return {
        f"load_average_{when}": [round(v, 2) for v in os.getloadavg()],
        f"utc_{when}": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    match = re.search(r"^model name\s*:\s*(.+)$", text, flags=re.MULTILINE)
    return match.group(1).strip() if match else platform.processor() or "unknown"


def git_state() -> dict:
    """The checkout's commit, and whether tracked files differ from it."""

    def git(*arguments: str) -> str:
        return subprocess.run(
            ["git", *arguments], cwd=REPO_ROOT, capture_output=True, text=True,
            check=True,
        ).stdout.strip()  # fmt: skip

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return {"git_commit": None}
    return {"git_commit": commit, "git_dirty": dirty}


def write_json(path: Path, payload: dict) -> Path:
    """Write atomically: a temporary file renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    temporary.replace(path)
    return path


def run_worker(script: str, spec: dict, timeout: float = 1800) -> dict:
    """``script --worker SPEC`` in a fresh Python process; its last line is JSON."""
    completed = subprocess.run(
        [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    if completed.returncode != 0:
        raise RuntimeError(
            f"worker {spec} failed ({completed.returncode}):\n"
            f"{completed.stderr[-4000:]}"
        )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def device_label(device: str) -> str:
    return "GPU" if torch.device(device).type == "cuda" else "CPU"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, function, *args, **kwargs) -> tuple[object, float]:
    """``function(*args, **kwargs)`` and its wall seconds, the device synchronised."""
    synchronize(device)
    start = time.perf_counter()
    result = function(*args, **kwargs)
    synchronize(device)
    return result, time.perf_counter() - start


def random_qwen2(seed: int = 0, **config):
    """A randomly initialised Qwen2 with tied embeddings (float32)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(tie_word_embeddings=True, **config)
    return AutoModelForCausalLM.from_config(config)


class PeakMemory:
    """Peak memory of a block above the memory held when it starts.

    CPU: resident set size of this process (reset the high-water mark through
    /proc/self/clear_refs, then read VmHWM). CUDA: torch.cuda.max_memory_allocated.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes = 0

    def __enter__(self) -> PeakMemory:
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self._baseline = _proc_status_bytes("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _proc_status_bytes("VmHWM")
        self.peak_bytes = max(0, peak - self._baseline)


def _proc_status_bytes(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, flags=re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1)) * 1024
