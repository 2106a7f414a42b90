"""grpo_lab: Group Relative Policy Optimization, one idea at a time.

The core (masks, log-probs, advantages, losses, train step) imports torch and
itself only; tasks, rewards, rollouts and training sit above it; teaching
helpers sit on top.
"""

# Where each public name lives; imported on first use (PEP 562), so that
# ``import grpo_lab.cli.main`` for ``grpo-lab --help`` does not load torch.
_PUBLIC = {
    "compute_group_normalized_rewards": "grpo_lab.advantages",
    "compute_rollout_rewards": "grpo_lab.advantages",
    "compute_entropy": "grpo_lab.logprobs",
    "get_response_log_probs": "grpo_lab.logprobs",
    "aggregate_loss_across_microbatch": "grpo_lab.aggregation",
    "compute_policy_gradient_loss": "grpo_lab.losses",
    "masked_mean": "grpo_lab.masks",
    "masked_normalize": "grpo_lab.masks",
    "pad_prompt_and_response_ids": "grpo_lab.masks",
    "tokenize_prompt_and_output": "grpo_lab.masks",
    "grpo_train_step": "grpo_lab.train_step",
    "policy_gradient_update": "grpo_lab.train_step",
}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'grpo_lab' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


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
