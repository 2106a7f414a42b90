"""``python -m grpo_lab.cli``: the ``grpo-lab`` command."""

import sys

from grpo_lab.cli.main import main

sys.exit(main())
