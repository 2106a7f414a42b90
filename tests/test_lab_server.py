"""`make lab` starts a JupyterLab that answers on localhost, also as root, and
serves the student's own folder of student copies: no solution, hidden test or
model answer anywhere in it.

The test runs `make lab` itself (the Makefile's commands), with this test
environment as the VENV and the environment build skipped (`make -o STAMP`),
the student's folder in a temporary directory (LAB_DIR), plus a free port, a
known token and --no-browser through LAB_ARGS. It fetches /api/status with the
token, walks everything the server's contents API lists, saves a student's edit
through it, stops the server, and runs `make lab` again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_shipped_notebooks import NOTEBOOKS, assert_no_solution_and_no_answer

from grpo_lab.instructor.student import BEGIN_HIDDEN, END_HIDDEN

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)
TOKEN = "grpo-lab-test-token"
STARTUP_SECONDS = 120
MAKE_LAB = ["make", "--no-print-directory", "lab"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, b""


def _put(url: str, model: dict) -> int:
    request = urllib.request.Request(
        url, data=json.dumps(model).encode(), method="PUT",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status


def _walk(base: str, path: str = "") -> dict[str, dict]:
    """Every file the contents API lists under ``path``: its path -> its model
    (with content)."""
    code, body = _get(f"{base}/api/contents/{path}?token={TOKEN}&content=1")
    assert code == 200, path
    model = json.loads(body)
    if model["type"] != "directory":
        return {model["path"]: model}
    found = {}
    for item in model["content"]:
        found.update(_walk(base, item["path"]))
    return found


def hidden_test_lines() -> dict[str, list[str]]:
    """``{notebook: the lines of its hidden-test blocks}`` (8+ characters each)."""
    found = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text("utf-8"))["cells"]:
            source = "".join(cell["source"])
            for block in source.split(BEGIN_HIDDEN)[1:]:
                lines = block.split(END_HIDDEN, 1)[0].splitlines()
                kept = [line.strip() for line in lines if len(line.strip()) >= 8]
                found.setdefault(path.name, []).extend(kept)
    return found


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM to make and the server (their own process group), then SIGKILL."""
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=20)


def _make_lab(tmp_path: Path, *arguments: str, **popen) -> subprocess.Popen:
    stamp = VENV / ".grpo-lab-installed"
    outer_make = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")
    environment = {
        **{key: value for key, value in os.environ.items() if key not in outer_make},
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),  # no user settings
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
    }
    command = [*MAKE_LAB, "-o", str(stamp), f"VENV={VENV}", *arguments]
    return subprocess.Popen(command, cwd=ROOT, env=environment, **popen)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.skipif(
    not (VENV / "bin" / "jupyter").exists(), reason="needs the lab extra"
)
def test_make_lab_serves_the_students_copies_on_localhost(tmp_path):
    port = _free_port()
    lab_dir = tmp_path / "my_notebooks"
    lab_args = f"--no-browser --port={port} --IdentityProvider.token={TOKEN}"
    log_path = tmp_path / "lab.log"
    with log_path.open("wb") as log:
        server = _make_lab(
            tmp_path, f"LAB_DIR={lab_dir}", f"LAB_ARGS={lab_args}",
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        status = None
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline and server.poll() is None:
            try:
                status, body = _get(f"{base}/api/status?token={TOKEN}")
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        output = log_path.read_text(errors="replace")
        assert status == 200, f"no answer from the lab server; its output:\n{output}"
        assert "started" in json.loads(body)
        # The token is required; the server serves the student's folder, written
        # on this first run, and nothing else.
        assert _get(f"{base}/api/contents")[0] == 403
        served = _walk(base)
        assert sorted(served) == NOTEBOOKS
        assert all(f"added {name}" in output for name in NOTEBOOKS)
        texts = {path: json.dumps(model["content"]) for path, model in served.items()}
        assert_no_solution_and_no_answer(texts)
        for name, lines in hidden_test_lines().items():
            assert BEGIN_HIDDEN not in texts[name]
            shown = [line for line in lines if json.dumps(line)[1:-1] in texts[name]]
            assert len(shown) < len(lines), f"{name} shows its hidden tests"
        # make printed the command line it ran: localhost only, root allowed as root.
        assert "--ServerApp.ip=127.0.0.1" in output
        assert ("--allow-root" in output) == (os.geteuid() == 0)
        assert f"http://127.0.0.1:{port}/" in output
        # The student writes an answer and saves it, as the browser does.
        name = "03_rewards_and_advantages.ipynb"
        notebook = served[name]["content"]
        notebook["cells"][-1]["source"] += "\nMy own answer."
        model = {"type": "notebook", "format": "json", "content": notebook}
        assert _put(f"{base}/api/contents/{name}?token={TOKEN}", model) == 200
    finally:
        _stop(server)
    assert server.returncode is not None
    saved = (lab_dir / name).read_text()
    assert "My own answer." in saved
    # A second `make lab` (the server replaced by `true`) keeps the student's work.
    again = _make_lab(
        tmp_path, f"LAB_DIR={lab_dir}", "LAB_COMMAND=true",
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    output, _ = again.communicate(timeout=60)
    assert again.returncode == 0, output
    assert f"{len(NOTEBOOKS)} already current" in output
    assert (lab_dir / name).read_text() == saved


def test_only_the_instructors_lab_serves_the_course_source():
    """`make -n` prints the commands: the student's lab names LAB_DIR and not the
    course source; the instructor's names notebooks/ and its save hook."""
    dry = ["make", "--no-print-directory", "-n", f"VENV={VENV}", "-o"]
    stamp = str(VENV / ".grpo-lab-installed")

    def commands(target: str) -> str:
        run = subprocess.run(
            [*dry, stamp, target], cwd=ROOT, capture_output=True, text=True,
            check=True, env={k: v for k, v in os.environ.items() if "MAKE" not in k},
        )  # fmt: skip
        return run.stdout

    student = commands("lab")
    assert "grpo-lab notebooks my_notebooks\n" in student
    assert "jupyter lab" in student and " my_notebooks/" in student
    assert "notebooks/" not in student.replace("my_notebooks/", "")
    instructor = commands("lab-instructor")
    assert " notebooks/ " in instructor and "pre_save_hook" in instructor
    assert "grpo-lab notebooks" not in instructor
