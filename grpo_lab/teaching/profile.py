"""The sizes of a notebook's worked examples, for the profile the run uses.

The profile itself (cpu, small-gpu, gpu or smoke) is chosen in one place,
:func:`grpo_lab.training.config.chosen_profile` (``$GRPO_LAB_PROFILE``, else the
machine), and a notebook's training runs take ``TrainConfig.for_profile`` of
it. What is left here is each notebook's own demo sizes (a vocabulary for a
memory plot, a batch of worked examples), given as cpu sizes plus what the gpu,
small-gpu and smoke profiles change. A notebook that gives no small-gpu sizes runs
its gpu sizes there: its demos are small for any GPU (the largest, notebook 02's
logits, is 8 x 256 x 32768 floats, 268 MB, on a 16 GB T4).
"""

from __future__ import annotations

from typing import Any

from grpo_lab.training.config import PROFILES, chosen_profile


def sizes_for_profile(
    cpu: dict[str, Any],
    gpu: dict[str, Any] | None = None,
    smoke: dict[str, Any] | None = None,
    profile: str | None = None,
    *,
    small_gpu: dict[str, Any] | None = None,
    **named: dict[str, Any],
) -> dict[str, Any]:
    """The sizes of the chosen profile; ``gpu``, ``small_gpu``, ``smoke`` override
    ``cpu``, and ``small_gpu`` defaults to ``gpu`` (a 16 GB GPU runs the gpu demos).

    The small-gpu sizes may also be passed under the profile's own name, as
    ``sizes_for_profile(**TRAINING_LOOP_SIZES)`` does (``"small-gpu"``). The
    result's ``"profile"`` is the profile name, for ``TrainConfig.for_profile``.
    """
    unexpected = set(named) - {"small-gpu"}
    if unexpected:
        raise ValueError(
            f"sizes are given per profile {PROFILES}, got {sorted(unexpected)}"
        )
    small_gpu = named.get("small-gpu", small_gpu)
    profile = chosen_profile() if profile is None else profile
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    overrides = {
        "cpu": {},
        "gpu": gpu or {},
        "small-gpu": (gpu or {}) if small_gpu is None else small_gpu,
        "smoke": smoke or {},
    }[profile]
    unknown = set(overrides) - set(cpu)
    if unknown:
        raise ValueError(
            f"{profile} sizes may only override cpu sizes, got {sorted(unknown)}"
        )
    return {**cpu, **overrides, "profile": profile}


# notebooks/08_training_loop.ipynb: sizes_for_profile(**TRAINING_LOOP_SIZES).
# The main run keeps three checkpoints, step 0 (after the warm-up), its middle and
# its last step (checkpoint_every = half the run, keep_checkpoints = 3; the gpu
# profile has no warm-up, so two), for the sampled responses and pass@k at the
# start, middle and end of RL. The reward-hacking demo trains on
# hackable_addition twice (lenient, then strict reward) with hack_overrides: a
# short warm-up (5% right) and room for 16 characters, where the lenient run
# learns to dump digits within 80 steps (strict accuracy 0.00 vs 0.12 strict).
# The contrast run on addition takes contrast_overrides["addition"] on top of
# overrides: 200 steps, half the reversal run's. The lr is constant and each
# step's sampling is seeded from (seed, step), so these are the first 200 steps
# of the 400-step run, which already show addition climbing slowly.
TRAINING_LOOP_SIZES: dict[str, dict[str, Any]] = {
    "cpu": {
        "overrides": {"checkpoint_every": 200, "keep_checkpoints": 3},
        "min_accuracy_gain": 0.4,
        "contrast_run": True,
        "contrast_overrides": {"addition": {"steps": 200}},
        "sample_prompts": 4,
        "samples_per_prompt": 3,
        "pass_at_k_prompts": 64,
        "pass_at_k_samples": 16,
        "hack_overrides": {
            "steps": 80,
            "sft_target_accuracy": 0.05,
            "eval_every": 20,
            "eval_size": 64,
            "checkpoint_every": 0,
        },
        "hack_task_options": {"room": 16},
        "hack_eval_prompts": 100,
    },
    "gpu": {
        "overrides": {"checkpoint_every": 100},
        "min_accuracy_gain": 0.05,
        "pass_at_k_prompts": 128,
        "pass_at_k_samples": 8,
    },
    # A 16 GB T4: the small-gpu training profile, half the gpu's pass@k prompts
    # (hf sampling, no vLLM). No gain is asserted: that run is not measured yet.
    "small-gpu": {
        "overrides": {"checkpoint_every": 100},
        "min_accuracy_gain": None,
        "pass_at_k_prompts": 64,
        "pass_at_k_samples": 8,
    },
    "smoke": {
        "overrides": {"checkpoint_every": 1, "keep_checkpoints": 3},
        "min_accuracy_gain": None,
        "contrast_run": False,
        "sample_prompts": 2,
        "samples_per_prompt": 2,
        "pass_at_k_prompts": 4,
        "pass_at_k_samples": 4,
        "hack_overrides": {"steps": 2, "eval_every": 1, "checkpoint_every": 0},
        "hack_eval_prompts": 8,
    },
}


# notebooks/09_hyperparameter_explorer.ipynb: sizes_for_profile(**EXPLORER_SIZES).
# Runs start from TrainConfig.for_profile(sizes["run_profile"]) plus
# base_overrides: on a CPU 60 steps of 16 prompts x 8 responses (a few seconds
# each), from one supervised warm-up shared by every run so that runs start with
# a signal; the gpu profile runs the cpu profile's sizes (400 steps of 32 x 8) on
# the GPU, small-gpu (a T4) half of them (200 steps, 2 epochs); smoke runs 2
# steps. The length-normalization runs train the scratchpad task, whose
# responses are 7 to 27 tokens long, for 20 steps: enough to see both run (the
# measured comparison is benchmarks/length_bias.py).
EXPLORER_SIZES: dict[str, dict[str, Any]] = {
    "cpu": {
        "run_profile": "cpu",
        "base_overrides": {
            "steps": 60,
            "rollout_batch_size": 128,
            "train_batch_size": 128,
            "sft_max_steps": 0,
            "eval_size": 100,
            "checkpoint_every": 0,
        },
        "warm_up_overrides": {"sft_eval_every": 20, "sft_eval_size": 32},
        "lr_values": [1e-4, 3e-4, 1e-3],
        "off_policy_epochs": 2,
        "length_task_options": {"n_digits": 5, "max_restated": 20},
        "length_overrides": {"steps": 20, "eval_size": 50},
        # The graded experiment: n samples of each held-out prompt from the warm
        # start, regrouped into groups of every size up to n (a few seconds).
        "group_prompts": 64,
        "group_samples": 16,
    },
    "gpu": {
        "base_overrides": {"checkpoint_every": 0, "sft_max_steps": 0},
        "warm_up_overrides": {},
        "off_policy_epochs": 4,
    },
    "small-gpu": {
        "base_overrides": {"steps": 200, "checkpoint_every": 0, "sft_max_steps": 0},
        "warm_up_overrides": {},
        "off_policy_epochs": 2,
    },
    "smoke": {
        "run_profile": "smoke",
        "base_overrides": {
            "lr": 1e-4,
            "rollout_batch_size": 8,
            "train_batch_size": 8,
            "sft_max_steps": 0,
        },
        "warm_up_overrides": {},
        "lr_values": [1e-4],
        "group_prompts": 8,
        "group_samples": 4,
    },
}


# notebooks/13_lora_for_rl.ipynb: sizes_for_profile(**LORA_SIZES). Every run
# trains the tiny model (the point is the adapters, on any device) from one
# shared warm-up, notebook 09's (the same config, so the same cached model):
# full fine-tuning at lr, LoRA of each rank in `ranks` at lora_lr, then a high
# rank at a high rate. Each run is `steps` GRPO steps of 16 prompts x 8
# responses, evaluated every 10 steps on 100 held-out prompts; smoke runs 2
# steps of the smoke model.
LORA_SIZES: dict[str, dict[str, Any]] = {
    "cpu": {
        "run_profile": "cpu",
        "warm_up_overrides": {"sft_eval_every": 20, "sft_eval_size": 32},
        "base_overrides": {
            "steps": 30,
            "rollout_batch_size": 128,
            "train_batch_size": 128,
            "sft_max_steps": 0,
            "eval_every": 10,
            "eval_size": 100,
            "checkpoint_every": 0,
        },
        "ranks": [1, 8],
        "high_rank": 64,
        "high_lora_lr": 3e-2,
    },
    "smoke": {
        "run_profile": "smoke",
        "warm_up_overrides": {},
        "base_overrides": {
            "rollout_batch_size": 8,
            "train_batch_size": 8,
            "sft_max_steps": 0,
            "checkpoint_every": 0,
        },
        "ranks": [1],
        "high_rank": 4,
    },
}


# notebooks/15_on_policy_distillation.ipynb: sizes_for_profile(**OPD_SIZES). One
# shared warm-up (notebook 09's, the same cached model) starts everything: the
# teacher is GRPO from it for `teacher_overrides` steps; the students (GRPO, OPD,
# GRPO + OPD) run `base_overrides` from it; the wrong teacher is the warm-up of
# `wrong_task`, a teacher of another task sharing the tokenizer. smoke runs 2
# steps of the smoke model.
OPD_SIZES: dict[str, dict[str, Any]] = {
    "cpu": {
        "run_profile": "cpu",
        "warm_up_overrides": {"sft_eval_every": 20, "sft_eval_size": 32},
        "teacher_overrides": {
            "steps": 150,
            "rollout_batch_size": 128,
            "train_batch_size": 128,
            "sft_max_steps": 0,
            "eval_every": 150,
            "eval_size": 100,
            "checkpoint_every": 0,
        },
        "base_overrides": {
            "steps": 40,
            "rollout_batch_size": 128,
            "train_batch_size": 128,
            "sft_max_steps": 0,
            "eval_every": 10,
            "eval_size": 100,
            "checkpoint_every": 0,
        },
        "wrong_task": "addition",
    },
    "smoke": {
        "run_profile": "smoke",
        "warm_up_overrides": {},
        "teacher_overrides": {
            "rollout_batch_size": 8,
            "train_batch_size": 8,
            "sft_max_steps": 0,
            "checkpoint_every": 0,
        },
        "base_overrides": {
            "rollout_batch_size": 8,
            "train_batch_size": 8,
            "sft_max_steps": 0,
            "checkpoint_every": 0,
        },
    },
}


# notebooks/16_asynchronous_grpo.ipynb: sizes_for_profile(**ASYNC_SIZES). The
# synchronous and the asynchronous run start from notebook 09's warm-up (the
# same cached model) and draw the same prompts; the rollout worker samples on
# the CPU (docs/asynchronous.md), so every profile runs them on the CPU, and
# the GPU profiles run fewer, smaller steps. `lengths_*`: the addition toy's groups
# whose answer lengths the dropping-vs-pacing simulation streams; `bias_*`: the
# exact gradient at one position after each number of stale steps. smoke runs
# 2 steps of the smoke model.
ASYNC_SIZES: dict[str, dict[str, Any]] = {
    "cpu": {
        "run_profile": "cpu",
        "warm_up_overrides": {"sft_eval_every": 20, "sft_eval_size": 32},
        "run_overrides": {
            "steps": 12,
            "rollout_batch_size": 64,
            "train_batch_size": 64,
            "sft_max_steps": 0,
            "eval_every": 12,
            "eval_size": 32,
            "checkpoint_every": 0,
        },
        "async_overrides": {
            "max_staleness": 1,
            "async_admission": "pace",
            "weight_sync_every": 1,
            "sampler_correction": "token_truncate",
        },
        "lengths_max_value": 100,
        "lengths_groups": 256,
        "bias_steps": 4,
        "bias_lr": 2.0,
        "seed": 0,
    },
    # The worker samples on the CPU whatever the machine: a third of the cpu
    # sizes' steps, of half the batch, keep the notebook short where a GPU is
    # idle through it (and in the test that runs it under each GPU profile).
    "gpu": {
        "run_overrides": {
            "steps": 4,
            "rollout_batch_size": 32,
            "train_batch_size": 32,
            "sft_max_steps": 0,
            "eval_every": 4,
            "eval_size": 16,
            "checkpoint_every": 0,
        },
        "lengths_groups": 128,
    },
    "smoke": {
        "run_profile": "smoke",
        "warm_up_overrides": {},
        "run_overrides": {"sft_max_steps": 0, "checkpoint_every": 0},
        "lengths_groups": 32,
    },
}
