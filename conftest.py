"""Parallel test workers share the CPU: one torch thread per worker.

``pytest -n 2`` starts two workers, and each notebook test starts a kernel. With
torch's default of one thread per core in every one of them, two cores run four
or more spinning threads, and a notebook cell that takes 5 s alone took over
200 s. Each xdist worker, and every kernel or subprocess it starts, uses one
thread instead. A run without xdist keeps torch's default.
"""

import os

import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
