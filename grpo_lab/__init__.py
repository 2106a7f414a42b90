"""grpo_lab: Group Relative Policy Optimization, one idea at a time.

The core (masks, log-probs, advantages, losses, train step) imports torch and
itself only; tasks, rewards, rollouts and training sit above it; teaching
helpers sit on top.
"""

from grpo_lab.advantages import (
    compute_group_normalized_rewards,
    compute_rollout_rewards,
)
from grpo_lab.logprobs import (
    compute_entropy,
    get_response_log_probs,
)
from grpo_lab.losses import (
    aggregate_loss_across_microbatch,
    compute_policy_gradient_loss,
)
from grpo_lab.masks import (
    masked_mean,
    masked_normalize,
    pad_prompt_and_response_ids,
    tokenize_prompt_and_output,
)
from grpo_lab.train_step import grpo_train_step, policy_gradient_update

__all__ = [
    "aggregate_loss_across_microbatch",
    "compute_entropy",
    "compute_group_normalized_rewards",
    "compute_policy_gradient_loss",
    "compute_rollout_rewards",
    "get_response_log_probs",
    "grpo_train_step",
    "masked_mean",
    "masked_normalize",
    "pad_prompt_and_response_ids",
    "policy_gradient_update",
    "tokenize_prompt_and_output",
]
__version__ = "0.1.0"
