"""Course administration: student copies, the shipped notebooks, the grader and
its sandbox, the rubric, nbgrader metadata, the solutions key and the
instructor's kit. It builds on the notebook helpers (``grpo_lab.teaching``,
whose exercise checks the grader runs); nothing in ``teaching`` imports it."""
