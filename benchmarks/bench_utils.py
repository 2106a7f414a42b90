"""Helpers shared by the benchmark scripts: machine facts, peak memory, JSON output."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

BENCHMARK_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCHMARK_DIR.parent
DEFAULT_OUT_DIR = BENCHMARK_DIR / "out"


def machine_info() -> dict:
    """nproc, CPU model, load average, torch/transformers versions, GPU name."""
    import transformers

    info = {
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "load_average": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = None
    return info


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    match = re.search(r"^model name\s*:\s*(.+)$", text, flags=re.MULTILINE)
    return match.group(1).strip() if match else "unknown"


def _proc_status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, flags=re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1))


class PeakMemory:
    """Peak memory of a block above the memory held when it starts.

    CPU: resident set size of this process (reset the high-water mark through
    /proc/self/clear_refs, then read VmHWM). CUDA: torch.cuda.max_memory_allocated.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self._baseline = _proc_status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _proc_status_kib("VmHWM") * 1024
        self.peak_bytes = max(0, peak - self._baseline)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_json(path: Path, payload: dict) -> Path:
    """Write atomically: a temporary file renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    temporary.replace(path)
    return path


def command_line(script: str, argv: list[str] | None = None) -> str:
    """The command that produced a result, relative to the repository root."""
    path = Path(script).resolve()
    try:
        script_text = str(path.relative_to(REPO_ROOT))
    except ValueError:
        script_text = str(path)
    arguments = sys.argv[1:] if argv is None else list(argv)
    return " ".join([".venv/bin/python", script_text, *arguments])


def run_worker(arguments: list[str], timeout: float = 1800) -> dict:
    """Run one case in a fresh Python process; its last stdout line is JSON."""
    completed = subprocess.run(
        [sys.executable, *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    if completed.returncode != 0:
        raise RuntimeError(
            f"worker {arguments} failed ({completed.returncode}):\n"
            f"{completed.stderr[-4000:]}"
        )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A Markdown table: columns are (key, header) pairs."""
    header = "| " + " | ".join(title for _, title in columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    lines = [header, rule]
    for row in rows:
        cells = [_cell(row.get(key)) for key, _ in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) < 1e-3 or abs(value) >= 1e5:
            return f"{value:.2e}"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)
