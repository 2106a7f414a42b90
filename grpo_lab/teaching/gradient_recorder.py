"""An optimizer that records the gradient it is handed: the oracle of every
gradient check in notebook 07, the tests and the benchmarks.

``GradientRecorder(model.parameters())`` in place of AdamW makes an update
function show the exact gradient it would step on. With ``lr=0`` (the default)
the parameters never move; with ``lr > 0`` it is plain SGD, so a test can also
see that a step changed the weights. Taught in
``notebooks/07_training_step.ipynb``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class GradientRecorder(torch.optim.SGD):
    """SGD (``lr=0``: no update) that keeps a copy of its last step's gradients.

    ``gradients`` holds one tensor per parameter (zeros where a parameter got
    no gradient); ``gradient`` is the same, flattened into one (N,) vector.
    Both are ``None`` until ``step`` runs, and ``steps`` counts the calls.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 0.0):
        super().__init__(params, lr=lr)
        self.steps = 0
        self.gradients: list[torch.Tensor] | None = None

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        self.gradients = [
            torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for group in self.param_groups
            for p in group["params"]
        ]
        return super().step(closure)

    @property
    def gradient(self) -> torch.Tensor | None:
        """Every recorded gradient, flattened and concatenated: (N,)."""
        if self.gradients is None:
            return None
        return torch.cat([g.flatten() for g in self.gradients])
