"""tests/verl runs in the verl environment only (``make test`` sets the switch).

verl 0.9.1 needs transformers < 5.11, which the main environment does not have,
so the main run collects nothing here; ``make test`` runs this folder a second
time with ``.venv-verl/bin/python`` and ``GRPO_LAB_VERL_TESTS=1``.
"""

import os

if not os.environ.get("GRPO_LAB_VERL_TESTS"):
    collect_ignore_glob = ["test_*.py"]
