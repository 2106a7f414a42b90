"""The one exception type for problems the person running grpo-lab can fix.

A setting, a path, a data file, the state of a run folder, a full disk: each is
a :class:`UserError`, whose text reads "<what went wrong> (<how to fix it>)".
The command line prints such an error as one line and exits with status 2;
every other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem outside the code: ``problem`` says what, ``fix`` says what to do."""

    def __init__(self, problem: str, fix: str = "") -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} ({fix})" if fix else problem)
