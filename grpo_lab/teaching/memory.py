"""Measure tensor memory without a GPU: for ``notebooks/02_logprobs_and_entropy.ipynb``.

Two views of the same question, "how many bytes does scoring cost?":

- :func:`saved_for_backward_bytes`: the bytes autograd keeps between forward and
  backward (``torch.autograd.graph.saved_tensors_hooks``), counting each storage
  once and leaving out storages that existed before (the inputs).
- :class:`PeakTensorMemory`: the peak of live tensor bytes during forward *and*
  backward, tracked op by op with a ``TorchDispatchMode``. Unlike the hooks it
  also sees the logits that activation checkpointing recomputes in backward.

Both count tensor storages only (not allocator overhead), on any device, and
return integers that do not depend on timing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def saved_for_backward_bytes(
    compute: Callable[[], Any], existing: tuple[torch.Tensor, ...] = ()
) -> tuple[int, Any]:
    """Run ``compute()``; return (bytes saved for backward, its result).

    Storages of the ``existing`` tensors (e.g. the logits passed in) are not
    counted: they are alive whether or not autograd keeps them.
    """
    excluded = {tensor.untyped_storage().data_ptr() for tensor in existing}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = compute()
    return sum(storages.values()), result


class PeakTensorMemory(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the ``with`` block.

    Usage: ``with PeakTensorMemory() as memory: loss.backward()`` then
    ``memory.peak_bytes``. A storage counts from the op that creates it until
    the last tensor using it is freed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.peak_bytes = 0
        self.live_bytes = 0
        self._owners: dict[int, int] = {}
        self._sizes: dict[int, int] = {}

    def _release(self, key: int) -> None:
        self._owners[key] -= 1
        if self._owners[key] == 0:
            self.live_bytes -= self._sizes.pop(key)
            del self._owners[key]

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self._owners:
            self._owners[key] = 0
            self._sizes[key] = storage.nbytes()
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._owners[key] += 1
        weakref.finalize(tensor, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in tree_flatten(result)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)
        return result
