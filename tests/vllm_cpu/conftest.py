"""tests/vllm_cpu runs vLLM's real engine (its CPU build) in .venv-vllm only.

The main environment has no vLLM, so the main run collects nothing here;
``make test`` runs this folder a second time with ``.venv-vllm/bin/python``,
``GRPO_LAB_VLLM_TESTS=1`` and ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine
core in the test process, as the backend needs for its weight sync). Each test
module starts its engines once (module fixtures): the first start in a process
takes 10-20 s on two cores, later ones about a second.
"""

from __future__ import annotations

import importlib.util
import os

if not os.environ.get("GRPO_LAB_VLLM_TESTS"):
    collect_ignore_glob = ["test_*.py"]
elif importlib.util.find_spec("vllm") is None:
    raise RuntimeError(
        "GRPO_LAB_VLLM_TESTS is set but vllm is not importable: run tests/vllm_cpu "
        "with .venv-vllm/bin/python (make test-vllm)"
    )
else:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
