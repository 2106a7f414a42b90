"""One step of TRL on fixed completions, for the parity tests and benchmarks.

TRL samples its own completions; these helpers feed it given ones, so that its
first loss and gradients can be compared with grpo_lab's (float64) in
``tests/test_trl_parity.py``, ``tests/test_integrations_trl.py`` and
``benchmarks/``. Nothing in a run imports this module.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from trl import GRPOTrainer

from grpo_lab.integrations.trl.trainer import trainer_class_for
from grpo_lab.integrations.trl.translation import to_trl_config
from grpo_lab.training.config import TrainConfig

# --- one step of TRL on fixed completions ------------------------------------------

# The GRPOConfig arguments that decide the first step's loss and gradients.
TRL_LOSS_ARGUMENTS = (
    "loss_type",
    "importance_sampling_level",
    "epsilon",
    "epsilon_high",
    "delta",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "off_policy_mask_threshold",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "beta",
    "use_bias_correction_kl",
    "entropy_coef",
    "top_entropy_quantile",
    "temperature",
    "scale_rewards",
)


@dataclass
class TrlFirstStep:
    """TRL's first optimizer step on fixed completions.

    ``inputs`` is TRL's batch (advantages, masks, old and reference log-probs,
    in its (B, C) completion layout), ``losses`` its loss of each accumulation
    microbatch (their sum is the step's loss), ``log_prob_gradients`` the
    gradient of that sum by each completion token's log-prob (B, C), and
    ``parameter_gradients`` the model's gradients, zeros where there are none;
    ``trainer`` is the trainer that computed them.
    """

    trainer: Any
    inputs: dict[str, Any]
    losses: list[torch.Tensor]
    log_prob_gradients: torch.Tensor
    parameter_gradients: list[torch.Tensor]

    @property
    def loss(self) -> torch.Tensor:
        """The step's loss: the sum over accumulation microbatches."""
        return torch.stack(self.losses).sum()


def fixed_completions_trainer(
    arguments: dict[str, Any],
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    completion_ids: list[list[int]],
    rewards: list[float | None],
    output_dir: str | Path,
    *,
    trainer_class: type | None = None,
    extra_rewards: tuple[list[float | None], ...] = (),
    **trainer_keywords: Any,
) -> Any:
    """A CPU ``GRPOTrainer`` (or ``trainer_class``) whose rollouts are given.

    ``arguments`` are GRPOConfig fields (``gradient_accumulation_steps``
    defaults to 1); ``prompts`` has one entry per completion, grouped, and the
    whole batch is one rollout batch, split into that many microbatches. TRL's
    ``rollout_func`` returns ``completion_ids`` and the reward function
    ``rewards``: nothing is generated, and TRL computes the advantages. Each
    list of ``extra_rewards`` is one more reward function's rewards (TRL's
    ``multi_objective_aggregation`` combines them).
    """
    from datasets import Dataset
    from trl import GRPOConfig

    if len(prompts) != len(completion_ids) or len(rewards) != len(completion_ids):
        raise ValueError(
            "prompts, completion_ids and rewards must have one entry per "
            f"completion, got {len(prompts)}, {len(completion_ids)}, {len(rewards)}"
        )
    prompt_ids = {p: tokenizer.encode(p, add_special_tokens=False) for p in prompts}

    def rollout(batch_prompts: list, trainer: Any) -> dict[str, list]:
        return {
            "prompt_ids": [prompt_ids[_prompt_text(p)] for p in batch_prompts],
            "completion_ids": [list(ids) for ids in completion_ids],
            "logprobs": [[0.0] * len(ids) for ids in completion_ids],
        }

    def reward(prompts: list, completions: list, **kwargs: Any) -> list:
        return list(rewards)

    def fixed(values: list[float | None], number: int) -> Callable[..., list]:
        def extra(prompts: list, completions: list, **kwargs: Any) -> list:
            return list(values)

        extra.__name__ = f"reward_{number}"
        return extra

    reward_funcs = [reward] + [fixed(v, i + 1) for i, v in enumerate(extra_rewards)]

    fields = {"gradient_accumulation_steps": 1, **arguments}
    accumulation = fields["gradient_accumulation_steps"]
    defaults = {
        "per_device_train_batch_size": len(completion_ids) // accumulation,
        "use_cpu": True,
        "report_to": [],
        "save_strategy": "no",
        "bf16": False,  # GRPOConfig's default autocasts to bfloat16, even on CPU
    }
    args = GRPOConfig(output_dir=str(output_dir), **{**defaults, **fields})
    dataset = Dataset.from_dict({"prompt": sorted(set(prompts))})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = (trainer_class or GRPOTrainer)(
            model=model,
            reward_funcs=reward_funcs if extra_rewards else reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_func=rollout,
            **trainer_keywords,
        )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    return trainer


def _prompt_text(prompt: Any) -> str:
    return prompt["prompt"] if isinstance(prompt, dict) else prompt


OffPolicyLogProbs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def trl_first_step(
    trainer: Any,
    prompts: list[str],
    *,
    old_log_probs: OffPolicyLogProbs | None = None,
    reference_log_probs: OffPolicyLogProbs | None = None,
    sampler_log_probs: OffPolicyLogProbs | None = None,
    beta: float = 0.0,
) -> TrlFirstStep:
    """TRL's advantages and loss for ``trainer``'s fixed completions, backpropagated.

    TRL's scorer is replaced by the naive one, log_softmax(logits / T) of the
    completion tokens, so that a float64 model stays float64 (TRL's fused head
    keeps float32 statistics). ``old_log_probs(current, completion_mask)``
    gives the old policy's (B, C) log-probs from the current ones (None: TRL's
    own, the current ones detached); ``reference_log_probs`` likewise the
    reference model's, read when ``beta`` (TRL's KL coefficient) is not 0;
    ``sampler_log_probs`` the sampler's (TRL's ``sampling_per_token_logps``,
    which its off-policy sequence mask prefers to pi_old). None: no sampler
    log-probs, as with transformers' generation (the fixed rollout's
    placeholder zeros are dropped).
    """
    from trl.trainer.utils import split_tensor_dict

    captured: list[torch.Tensor] = []
    trainer._get_per_token_logps_and_entropies = _naive_scorer(trainer, captured)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = trainer._generate_and_score_completions(
            [{"prompt": p} for p in prompts]
        )
    mask = inputs["completion_mask"].double()  # (B, C)
    inputs.pop("sampling_per_token_logps", None)
    given = {
        "old_per_token_logps": old_log_probs,
        "ref_per_token_logps": reference_log_probs,
        "sampling_per_token_logps": sampler_log_probs,
    }
    if any(make is not None for make in given.values()):
        current = _current_log_probs(trainer, inputs)  # (B, C)
        for key, make in given.items():
            if make is not None:
                inputs[key] = make(current, mask) * mask
    inputs["advantages"] = inputs["advantages"].double()
    trainer.beta = beta  # TRL only loads a reference model by name; given here
    losses = []
    for chunk in split_tensor_dict(inputs, trainer.current_gradient_accumulation_steps):
        loss = trainer._compute_loss(trainer.model, chunk)
        loss.backward()
        losses.append(loss.detach())
    gradients = torch.cat([c.grad for c in captured], dim=0)  # (B, C)
    parameters = [
        torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for p in trainer.model.parameters()
    ]
    return TrlFirstStep(trainer, inputs, losses, gradients, parameters)


def _naive_scorer(trainer: Any, captured: list[torch.Tensor]) -> Callable[..., tuple]:
    """TRL's scorer in the model's dtype; keeps each differentiable result."""

    def score(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logits = logits[:, -logits_to_keep - 1 : -1] / trainer.temperature  # (B, C, V)
        log_softmax = torch.log_softmax(logits, dim=-1)  # (B, C, V)
        labels = input_ids[:, -logits_to_keep:]  # (B, C)
        log_probs = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, C)
        if log_probs.requires_grad:
            log_probs.retain_grad()
            captured.append(log_probs)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)  # (B, C)
        return log_probs, entropy, None

    return score


def _current_log_probs(trainer: Any, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            inputs["completion_ids"].shape[1],
        )[0]  # (B, C)


def trl_first_step_loss(
    config: TrainConfig,
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    completion_ids: list[list[int]],
    rewards: list[float | None],
    output_dir: str | Path,
    *,
    old_log_probs: OffPolicyLogProbs | None = None,
    reference_log_probs: OffPolicyLogProbs | None = None,
) -> TrlFirstStep:
    """TRL's first step of ``config``'s loss on fixed completions and rewards.

    The loss settings are ``to_trl_config(config)``'s (:data:`TRL_LOSS_ARGUMENTS`,
    with its group size and completion length), on the trainer class
    :func:`trainer_class_for` picks; the batch is one optimizer step
    (``gradient_accumulation_steps`` microbatches). See :func:`trl_first_step`
    for the rest. It is the TRL side of the parity tests and of notebook 12.
    """
    arguments = to_trl_config(config)
    fields = {k: arguments[k] for k in TRL_LOSS_ARGUMENTS if k in arguments}
    beta = fields.pop("beta")
    for name in ("num_generations", "max_completion_length"):
        fields[name] = arguments[name]
    fields["gradient_accumulation_steps"] = config.gradient_accumulation_steps
    trainer_class = trainer_class_for(config)
    keywords = {} if trainer_class is GRPOTrainer else {"train_config": config}
    trainer = fixed_completions_trainer(
        fields,
        model,
        tokenizer,
        prompts,
        completion_ids,
        rewards,
        output_dir,
        trainer_class=trainer_class,
        **keywords,
    )
    return trl_first_step(
        trainer,
        prompts,
        old_log_probs=old_log_probs,
        reference_log_probs=reference_log_probs,
        beta=beta,
    )
