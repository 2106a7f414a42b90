"""Training: one config dataclass, the GRPO loop, SFT warm-up, checkpoints, metrics.

``train(TrainConfig.for_profile("cpu"))`` runs the whole loop on a laptop CPU.
Taught in ``notebooks/`` on the training loop.
"""

from grpo_lab.training.config import TrainConfig, default_profile
from grpo_lab.training.loop import RunResult, train
from grpo_lab.training.metrics import read_metrics

__all__ = ["RunResult", "TrainConfig", "default_profile", "read_metrics", "train"]
