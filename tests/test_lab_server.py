"""`make lab` starts a JupyterLab that answers on localhost, also as root.

The test runs `make lab` itself (the Makefile's LAB_COMMAND, the one command line
both use), with this test environment as the VENV and the environment build
skipped (`make -o STAMP`), plus a free port, a known token and --no-browser
through LAB_ARGS. It fetches /api/status with the token, lists the notebooks the
server serves, and stops the server.
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


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.skipif(
    not (VENV / "bin" / "jupyter").exists(), reason="needs the lab extra"
)
def test_make_lab_serves_the_notebooks_on_localhost(tmp_path):
    port = _free_port()
    stamp = VENV / ".grpo-lab-installed"
    lab_args = f"--no-browser --port={port} --IdentityProvider.token={TOKEN}"
    outer_make = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")
    environment = {
        **{key: value for key, value in os.environ.items() if key not in outer_make},
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),  # no user settings
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
    }
    log_path = tmp_path / "lab.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [*MAKE_LAB, "-o", str(stamp), f"VENV={VENV}", f"LAB_ARGS={lab_args}"],
            cwd=ROOT,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
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
        # The token is required, and the server serves notebooks/.
        assert _get(f"{base}/api/contents")[0] == 403
        code, listing = _get(f"{base}/api/contents?token={TOKEN}")
        assert code == 200
        served = {item["name"] for item in json.loads(listing)["content"]}
        assert "03_rewards_and_advantages.ipynb" in served
        # make printed the command line it ran: localhost only, root allowed as root.
        assert "--ServerApp.ip=127.0.0.1" in output
        assert ("--allow-root" in output) == (os.geteuid() == 0)
        # Course notebooks are saved without outputs (the server imported the hook).
        hook = "grpo_lab.teaching.output_policy.strip_outputs_before_save"
        assert f"--ContentsManager.pre_save_hook={hook}" in output
        assert f"http://127.0.0.1:{port}/" in output
    finally:
        _stop(server)
    assert server.returncode is not None
