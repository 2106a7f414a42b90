"""Training: one config dataclass, the GRPO loop, SFT warm-up, checkpoints, metrics.

``train(TrainConfig.for_profile("cpu"))`` runs the whole loop on a laptop CPU.
Taught in ``notebooks/`` on the training loop.
"""

# Imported on first use (PEP 562): ``grpo_lab.training.checkpoint`` and the
# torch-free command-line help must not load the loop and its torch.
_PUBLIC = {
    "RunResult": "grpo_lab.training.loop",
    "train": "grpo_lab.training.loop",
    "TrainConfig": "grpo_lab.training.config",
    "default_profile": "grpo_lab.training.config",
    "read_metrics": "grpo_lab.training.metrics",
}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'grpo_lab.training' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


__all__ = ["RunResult", "TrainConfig", "default_profile", "read_metrics", "train"]
