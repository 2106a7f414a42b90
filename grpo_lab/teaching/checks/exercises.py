"""Which package function each exercise check compares against.

One row per check: the check's name, then the dotted paths of the functions
that compute its answer, wherever they live: the package function the
exercise asks the student to write (the first path, the one messages name),
the package's counterparts of the exercises it composes, the check module's
own helpers that compute the expected value, and library routes (``generate``).
A check refuses a student function that is or wraps one of them
(:func:`grpo_lab.teaching.checks.framework.refuse_package_function`), hides
them while the student's function runs (:mod:`grpo_lab.teaching.checks.reach`;
the grader hides the same in its kernel), and the notebook scan in the tests
refuses a cell that shows one of them above the exercise's check.
"""

from __future__ import annotations

PACKAGE_COUNTERPARTS: dict[str, tuple[str, ...]] = {
    "check_greedy_continuation": (
        "transformers.GenerationMixin.generate",
        # generate is a torch.no_grad() closure: what it wraps is hidden.
        "transformers.GenerationMixin.generate.__wrapped__",
        "grpo_lab.teaching.checks.setup.reference_continuation",
        "grpo_lab.teaching.checks.setup._greedy_ids",
        "grpo_lab.teaching.checks.setup._slips",  # the answer, within a slip's text
        # the package's own sampling loop, greedy at temperature 0
        "grpo_lab.rollouts.mismatch.MismatchRolloutBackend._sample_tokens",
    ),
    "check_response_mask": ("grpo_lab.masks.pad_prompt_and_response_ids",),
    "check_response_log_probs": (
        "grpo_lab.logprobs.get_response_log_probs",
        "grpo_lab.teaching.checks.logprobs.reference_token_log_probs",
        "grpo_lab.teaching.checks.logprobs.reference_response_log_probs",
    ),
    "check_token_entropy": (
        "grpo_lab.logprobs.compute_entropy",
        # its token_entropy, on the check's own fixed-logits model (02a's)
        "grpo_lab.logprobs.get_response_log_probs",
        "grpo_lab.teaching.checks.logprobs.reference_mean_token_entropy",
    ),
    "check_group_normalized_advantages": (
        "grpo_lab.advantages.compute_group_normalized_rewards",
        "grpo_lab.advantages.compute_rollout_rewards",  # its rewards, composed here
        "grpo_lab.advantages.rollout_advantages",
        "grpo_lab.teaching.checks.advantages.reference_batch_advantages",
        "grpo_lab.teaching.checks.advantages._slip",  # its slips' advantages
    ),
    "check_clipped_loss": (
        "grpo_lab.losses.compute_policy_gradient_loss",
        "grpo_lab.losses.grpo_clip_loss",  # also OBJECTIVES["grpo"]
    ),
    "check_sequence_ratio": (
        "grpo_lab.losses.compute_policy_gradient_loss",
        "grpo_lab.teaching.checks.gspo.reference_sequence_ratio",
    ),
    # --- 05-gspo_loss (composes 05-sequence_ratio, 04's clip, 06's mean) ---
    "check_gspo_loss": (
        "grpo_lab.losses.gspo_clip_loss",
        "grpo_lab.losses.compute_policy_gradient_loss",
        "grpo_lab.aggregation.aggregate_loss_across_microbatch",  # 06a, composed here
        "grpo_lab.train_step.microbatch_loss",
        "grpo_lab.teaching.checks.gspo.reference_gspo_loss",
        "grpo_lab.teaching.checks.gspo.reference_sequence_ratio",  # 05a, composed here
        "grpo_lab.teaching.checks.gspo._gspo_slips",  # a slip's sign, turned around
        "grpo_lab.losses.grpo_clip_loss",  # its clipped surrogate (04)
    ),
    # --- end 05-gspo_loss ---
    # --- 06-aggregate_loss ---
    "check_aggregate_loss": (
        "grpo_lab.aggregation.aggregate_loss_across_microbatch",
        "grpo_lab.aggregation.reduce_masked_loss",  # what it returns
        "grpo_lab.teaching.checks.aggregation._aggregation_slips",  # a slip, times B
    ),
    # --- end 06-aggregate_loss ---
    "check_grpo_loss": (
        "grpo_lab.train_step.microbatch_loss",
        "grpo_lab.losses.compute_policy_gradient_loss",
        "grpo_lab.aggregation.aggregate_loss_across_microbatch",
        "grpo_lab.teaching.checks.aggregation.reference_grpo_loss",
        "grpo_lab.losses.grpo_clip_loss",  # its clipped surrogate (04)
    ),
    "check_microbatch_losses": (
        "grpo_lab.aggregation.microbatch_loss_scale",
        "grpo_lab.aggregation.aggregate_loss_across_microbatch",
        "grpo_lab.teaching.checks.train_step.reference_microbatch_losses",
    ),
    "check_active_rows": ("grpo_lab.train_step.policy_gradient_update",),
    "check_microbatch_train_step": (
        "grpo_lab.train_step.policy_gradient_update",
        "grpo_lab.train_step.grpo_train_step",
        "grpo_lab.train_step.microbatch_loss",
    ),
    "check_train_batch_slices": (
        "grpo_lab.training.loop.train_batch_rows",
        "grpo_lab.teaching.checks.loop._reference_slices",
    ),
    "check_rollout_batch_update": (
        "grpo_lab.training.loop.grpo_update",
        "grpo_lab.train_step.policy_gradient_update",
        "grpo_lab.teaching.checks.loop.reference_rollout_batch_update",
        "grpo_lab.teaching.checks.loop._reference_slices",  # 08a, composed here
        "grpo_lab.training.loop.train_batch_rows",
        "grpo_lab.losses.compute_policy_gradient_loss",  # 04, composed here
        "grpo_lab.losses.grpo_clip_loss",
        "grpo_lab.aggregation.aggregate_loss_across_microbatch",  # 06a, composed here
    ),
    # --- 08-robust_reward (the sampling side: a reward the hacks cannot game) ---
    "check_robust_reward": (
        "grpo_lab.rewards.exact_match_reward",
        "grpo_lab.tasks.toy.AdditionTask.reward_fn",
        "grpo_lab.tasks.hackable.HackableAdditionTask.reward_fn",
    ),
    # --- end 08-robust_reward ---
    "check_cache_key": ("grpo_lab.teaching.explorer.config_cache_key",),
    "check_dapo_kl_loss": (
        "grpo_lab.train_step.microbatch_loss",
        "grpo_lab.losses.compute_policy_gradient_loss",
        "grpo_lab.losses.grpo_clip_loss",  # its clipped surrogate (04)
        "grpo_lab.aggregation.aggregate_loss_across_microbatch",  # its token mean (06a)
        "grpo_lab.kl.kl_importance_weights",  # its ratio weight of k3
        "grpo_lab.teaching.checks.family.reference_dapo_kl_loss",
        "grpo_lab.teaching.checks.family._slip_losses",
    ),
    "check_device_token_loss": (
        "grpo_lab.aggregation.aggregate_loss_across_microbatch",
        "grpo_lab.aggregation.microbatch_loss_scale",
        "grpo_lab.teaching.checks.scaling.reference_device_token_loss",
    ),
    "check_multi_turn_mask": (
        "grpo_lab.rollouts.multiturn.pad_prompt_and_segment_ids",
        "grpo_lab.rollouts.multiturn.segment_model_flags",
        "grpo_lab.rollouts.multiturn.multi_turn_token_batch",
        "grpo_lab.teaching.checks.turns._written",  # its slips' masks, unshifted
    ),
    "check_lora_linear": (
        "grpo_lab.lora.lora_linear",
        "grpo_lab.teaching.checks.lora._slips",  # a slip's scale, turned around
    ),
    "check_distillation_loss": (
        "grpo_lab.distillation.distillation_token_loss",
        "grpo_lab.distillation.reverse_kl_per_token",
        "grpo_lab.kl.compute_kl_penalty",
        "grpo_lab.kl.kl_estimate",
        "grpo_lab.teaching.checks.distillation.reference_distillation_loss",
    ),
    "check_corrected_loss": (
        "grpo_lab.train_step.microbatch_loss",
        "grpo_lab.sampler_correction.sampler_correction_weights",
        "grpo_lab.sampler_correction.correction_weights",
        "grpo_lab.sampler_correction.sampler_weights",  # its unchecked form
        "grpo_lab.sampler_correction.sampler_weights_and_metrics",
        "grpo_lab.teaching.checks.mismatch.reference_corrected_loss",
        "grpo_lab.losses.compute_policy_gradient_loss",  # its clipped terms (04)
        "grpo_lab.losses.grpo_clip_loss",
    ),
    "check_admitted_loss": (
        "grpo_lab.training.staleness.within_bound",
        "grpo_lab.training.staleness.admit",
        "grpo_lab.train_step.microbatch_loss",
        "grpo_lab.sampler_correction.sampler_correction_weights",
        "grpo_lab.sampler_correction.correction_weights",
        "grpo_lab.sampler_correction.sampler_weights",
        "grpo_lab.sampler_correction.sampler_weights_and_metrics",
        "grpo_lab.losses.compute_policy_gradient_loss",
        "grpo_lab.aggregation.aggregate_loss_across_microbatch",
        "grpo_lab.teaching.checks.asynchronous.reference_admitted_loss",
    ),
}


def counterpart_names(check_name: str) -> tuple[str, ...]:
    """The short names (last dotted part) of a check's package counterparts."""
    return tuple(path.rsplit(".", 1)[1] for path in PACKAGE_COUNTERPARTS[check_name])
