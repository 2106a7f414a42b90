"""Every field of a training run: one dataclass, read like a manual.

Fields are grouped in sections; each field's help text is stored with it (what
``grpo-lab train --help`` prints). The dataclass defaults are the ``cpu``
profile (:mod:`~grpo_lab.training.config.profiles` lists what the others
change). :class:`~grpo_lab.training.config.train_config.TrainConfig` is these
fields with their behaviour: built from a profile, validated, saved.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from grpo_lab.advantages import (
    ADVANTAGE_NORMALIZERS,
    BASELINES,
    NAN_REWARD_POLICIES,
    REWARD_AGGREGATIONS,
)
from grpo_lab.aggregation import LOSS_NORMALIZATIONS
from grpo_lab.distillation import DISTILLATION_ESTIMATORS, DISTILLATION_FORMS
from grpo_lab.kl import KL_ESTIMATORS
from grpo_lab.losses import OBJECTIVE_RECORDS
from grpo_lab.rollouts import BACKEND_RECORDS
from grpo_lab.rollouts.mismatch import PERTURBATIONS
from grpo_lab.sampler_correction import (
    CORRECTION_MODES,
    DEFAULT_CAP,
    DEFAULT_HIGH,
    DEFAULT_LOW,
)
from grpo_lab.training.staleness import ADMISSION_POLICIES

PROFILES = ("cpu", "gpu", "small-gpu", "smoke")
PROFILE_VARIABLE = "GRPO_LAB_PROFILE"
DTYPES = ("float32", "bfloat16", "float16")
INERT_SETTINGS_KEY = "inert_settings"

SECTIONS = (
    "run",
    "model",
    "task",
    "batches and schedule",
    "optimizer",
    "advantages and loss",
    "sampling",
    "sampler mismatch",
    "asynchronous rollouts",
    "evaluation and checkpoints",
    "warm-up",
    "device and memory",
    "dynamic sampling and length",
    "on-policy distillation",
)


def setting(default: Any, section: str, help: str, choices: tuple = ()) -> Any:
    """A dataclass field with its section, help text and allowed values."""
    metadata = {"section": section, "help": help, "choices": choices}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainFields:
    """The fields of one GRPO run (:class:`TrainConfig` adds what a run does
    with them). Sizes count responses unless the name says prompts."""

    # --- run -------------------------------------------------------------------
    profile: str = setting(
        "cpu",
        "run",
        "Which defaults this run started from: cpu (tiny model), gpu (a 1.5B "
        "model with vLLM), small-gpu (a 0.5B instruct model on a 16 GB GPU) or "
        "smoke (the cpu run at its smallest).",
        PROFILES,
    )
    seed: int = setting(
        0,
        "run",
        "Seed of the model weights, the prompt draws and every sampler, in "
        "[0, 2**32 - 1].",
    )
    run_dir: str | None = setting(
        None,
        "run",
        "Where config.json, metrics.jsonl and checkpoints go "
        "(None: runs/<task>-<time>).",
    )
    resume: bool = setting(
        False,
        "run",
        "Continue from the latest checkpoint in run_dir instead of starting over.",
    )
    # --- model -----------------------------------------------------------------
    model: str = setting(
        "tiny",
        "model",
        'A hub name or a local path; "tiny" builds a Qwen2-shaped character model '
        "locally.",
    )
    tiny_hidden_size: int = setting(128, "model", 'Hidden size of the "tiny" model.')
    tiny_num_layers: int = setting(2, "model", 'Decoder layers of the "tiny" model.')
    tiny_intermediate_size: int = setting(
        512, "model", 'MLP width of the "tiny" model.'
    )
    lora_rank: int = setting(
        0,
        "model",
        "Rank r of LoRA adapters on the policy (peft; arXiv:2106.09685): only the "
        "adapters train, the base weights stay frozen (0: full fine-tuning, where "
        "the other lora_ settings are refused unless left at their defaults).",
    )
    lora_alpha: float = setting(
        32.0,
        "model",
        "LoRA alpha: each update B A is scaled by lora_alpha / lora_rank (32 at "
        "every rank, as in TRL's 'LoRA Without Regret' recipe).",
    )
    lora_dropout: float = setting(
        0.0, "model", "Dropout on each adapter's input, in [0, 1) (0: none)."
    )
    lora_target_modules: str | list[str] = setting(  # noqa: RUF009 (a str default)
        "all-linear",
        "model",
        "Layers that get adapters: all-linear (every linear layer but the output "
        "head) or module names, a list or comma-separated (q_proj,v_proj).",
    )
    lora_train_norms: bool = setting(
        True,
        "model",
        "With lora_rank > 0, also train a copy of every RMSNorm gain (peft's "
        "modules_to_save; the frozen originals stay the KL reference): the tiny "
        "model's adapters reach 0.9 with them.",
    )
    lora_lr: float = setting(
        2e-3,
        "model",
        "AdamW learning rate of the adapters when lora_rank > 0, in place of lr "
        "(LoRA wants several times full fine-tuning's rate; the warm-up, which "
        "trains the full model, keeps sft_lr).",
    )
    # --- task ------------------------------------------------------------------
    task: str = setting(
        "reverse",
        "task",
        "Task name for grpo_lab.tasks.get_task (reverse, addition, countdown, "
        "gsm8k, math).",
    )
    # setting() returns a field with a default_factory: each config gets a copy.
    task_options: dict[str, Any] = setting(  # noqa: RUF009
        {"n_digits": 5},
        "task",
        'Keyword options for the task, as JSON: {"n_digits": 5} or '
        '{"train_path": "train.jsonl", "eval_path": "test.jsonl"}.',
    )
    chat_template: bool = setting(
        False,
        "task",
        "Wrap each prompt in the tokenizer's chat template as a user turn "
        "(instruct models); off: the task's plain prompt (base models).",
    )
    # --- batches and schedule --------------------------------------------------
    steps: int = setting(
        400,
        "batches and schedule",
        "GRPO steps (one rollout batch each), at most 1000000.",
    )
    rollout_batch_size: int = setting(
        256,
        "batches and schedule",
        "Responses sampled per step: prompts per step times group_size.",
    )
    group_size: int = setting(
        8,
        "batches and schedule",
        "Responses sampled per prompt (G); advantages are normalized within a group.",
    )
    train_batch_size: int = setting(
        256,
        "batches and schedule",
        "Responses per optimizer step; smaller than rollout_batch_size is "
        "off-policy (every step after the first sees an older policy's samples).",
    )
    epochs_per_rollout_batch: int = setting(
        1,
        "batches and schedule",
        "Passes over each rollout batch; more than one is off-policy.",
    )
    gradient_accumulation_steps: int = setting(
        1,
        "batches and schedule",
        "Microbatches per optimizer step (train_batch_size / microbatch size); "
        "the gradient is the full batch's whatever the split.",
    )
    # --- optimizer -------------------------------------------------------------
    lr: float = setting(3e-4, "optimizer", "AdamW learning rate (after warm-up).")
    lr_warmup_steps: int = setting(
        0,
        "optimizer",
        "Steps over which the learning rate ramps linearly from lr / warm-up to "
        "lr: Adam's first updates move every weight by about lr whatever its "
        "gradient's noise.",
    )
    weight_decay: float = setting(0.0, "optimizer", "AdamW weight decay.")
    adam_beta2: float = setting(
        0.999,
        "optimizer",
        "AdamW beta2; lower values adapt faster to the noisy policy gradient.",
    )
    max_grad_norm: float | None = setting(
        1.0,
        "optimizer",
        "Clip the gradient to this L2 norm before each optimizer step "
        "(None: no clipping; must be > 0).",
    )
    # --- advantages and loss ---------------------------------------------------
    baseline: str = setting(
        "mean",
        "advantages and loss",
        "Group baseline: mean (GRPO), none (raw reward, RFT-like) or "
        "leave_one_out (the mean of the other G - 1 rewards, RLOO).",
        BASELINES,
    )
    advantage_normalizer: str = setting(
        "std",
        "advantages and loss",
        "Advantage scale: std (GRPO), none (Dr. GRPO, arXiv:2503.20783), mean "
        "(MaxRL, arXiv:2602.02710), batch_std (the whole rollout batch's std, "
        "TRL's scale_rewards='batch') or token_whiten (REINFORCE++, "
        "arXiv:2501.03262: whiten over every response token of the batch; with "
        "baseline none it is verl's reinforce_plus_plus).",
        ADVANTAGE_NORMALIZERS,
    )
    advantage_eps: float = setting(
        1e-6,
        "advantages and loss",
        "Added to the normalizer so a group with equal rewards does not divide by 0.",
    )
    reward_aggregation: str = setting(
        "reward",
        "advantages and loss",
        "What the advantages are made of: reward (the task's total), or its "
        "format and answer parts, weight 1 each: sum_then_normalize (sum, then "
        "the baseline and normalizer), normalize_then_sum (GDPO, "
        "arXiv:2601.05242: normalize each part in its group, sum, whiten over "
        "the batch's responses, as TRL) or normalize_then_sum_tokens (whiten "
        "over its tokens, as verl's gdpo).",
        REWARD_AGGREGATIONS,
    )
    nan_rewards: str = setting(
        "propagate",
        "advantages and loss",
        "A NaN reward (an unscorable response): propagate (the step refuses a "
        "non-finite loss) or ignore (left out of its group's statistics, "
        "advantage 0, as TRL does with None rewards).",
        NAN_REWARD_POLICIES,
    )
    importance_reweighting_method: str = setting(
        "none",
        "advantages and loss",
        "Objective: none (on-policy REINFORCE); noclip, grpo (PPO clip), gspo "
        "(sequence ratio, arXiv:2507.18071), cispo (clipped, detached weights, "
        "arXiv:2506.13585), sapo (soft gate, arXiv:2511.20347), gmpo "
        "(geometric mean, arXiv:2507.20673), luspo (gspo times the length, "
        "arXiv:2602.05261), vespo (gamma-weighted sequence ratio, "
        "arXiv:2602.10693), dppo_tv or dppo_kl (a trust region on the token's "
        "probability, arXiv:2602.04879), clip_cov or kl_cov (covariance-selected "
        "tokens, arXiv:2505.22617) weigh by pi / pi_old and need an off-policy "
        "schedule.",
        OBJECTIVE_RECORDS,
    )
    cliprange: float | None = setting(
        None,
        "advantages and loss",
        "Clip range eps (the lower one when cliprange_high is set) for grpo (0.2 "
        "is usual), gspo and luspo (3e-4 in its paper), cispo, clip_cov, gmpo "
        "(on log pi / pi_old: 0.4 in its paper) and dppo_tv / dppo_kl (a bound "
        "on the probability's shift or binary KL, not on the ratio).",
    )
    cliprange_high: float | None = setting(
        None,
        "advantages and loss",
        "Upper clip range (DAPO's clip-higher, 0.28 in its paper, "
        "arXiv:2503.14476); None: the same as cliprange.",
    )
    ratio_cap: float | None = setting(
        None,
        "advantages and loss",
        "Dual clip for grpo, gspo and luspo: cap the unclipped ratio term at "
        "this value, above 1 + the upper clip range (INTELLECT-2, "
        "arXiv:2505.07291; TRL's delta); for dppo_tv / dppo_kl the cap of their "
        "truncated weight (above 1); None: no cap.",
    )
    sapo_temperature_pos: float = setting(
        1.0,
        "advantages and loss",
        "SAPO gate temperature for tokens with a positive advantage.",
    )
    sapo_temperature_neg: float = setting(
        1.05,
        "advantages and loss",
        "SAPO gate temperature for tokens with a zero or negative advantage.",
    )
    off_policy_mask_threshold: float | None = setting(
        None,
        "advantages and loss",
        "Off-policy sequence mask (DeepSeek-V3.2, arXiv:2512.02556; TRL's "
        "off_policy_mask_threshold): a response with a negative advantage whose "
        "mean log(pi_old / pi) is above this gets no loss; None: no mask.",
    )
    vespo_k_pos: float = setting(
        2.0,
        "advantages and loss",
        "VESPO (arXiv:2602.10693) gamma weight's power k for A >= 0: how fast "
        "responses whose sequence ratio is below 1 are down-weighted.",
    )
    vespo_lambda_pos: float = setting(
        3.0,
        "advantages and loss",
        "VESPO gamma weight's rate lambda for A >= 0: how fast responses whose "
        "sequence ratio is above 1 are down-weighted (>= 1e-4).",
    )
    vespo_k_neg: float = setting(
        3.0,
        "advantages and loss",
        "VESPO gamma weight's power k for A < 0.",
    )
    vespo_lambda_neg: float = setting(
        2.0,
        "advantages and loss",
        "VESPO gamma weight's rate lambda for A < 0 (>= 1e-4).",
    )
    covariance_fraction: float = setting(
        2e-4,
        "advantages and loss",
        "Clip-Cov / KL-Cov (arXiv:2505.22617): the share of a microbatch's "
        "tokens selected by the covariance of advantage and log-prob (verl's "
        "clip_cov_ratio / kl_cov_ratio; at least one token).",
    )
    clip_cov_low: float = setting(
        1.0,
        "advantages and loss",
        "Clip-Cov: a token is drawn only if its covariance is above this "
        "(verl's clip_cov_lb).",
    )
    clip_cov_high: float = setting(
        5.0,
        "advantages and loss",
        "Clip-Cov: ... and below this (verl's clip_cov_ub).",
    )
    kl_cov_coef: float = setting(
        0.1,
        "advantages and loss",
        "KL-Cov: the coefficient of |log pi / pi_old| on the selected tokens "
        "(verl's ppo_kl_coef).",
    )
    loss_normalization: str = setting(
        "sequence",
        "advantages and loss",
        "Loss divisor: sequence (mean over each response, GRPO), constant "
        "(sum over tokens / normalization_constant, Dr. GRPO) or token (the mean "
        "over every response token of the train batch, DAPO).",
        LOSS_NORMALIZATIONS,
    )
    normalization_constant: int | None = setting(
        None,
        "advantages and loss",
        "Divisor of the constant loss normalization (tokens).",
    )
    kl_coef: float = setting(
        0.0,
        "advantages and loss",
        "beta of a per-token KL penalty to a frozen copy of the policy taken at "
        "step 0 (DeepSeekMath, arXiv:2402.03300; 0: no penalty, no reference "
        "model).",
    )
    kl_estimator: str = setting(
        "k3",
        "advantages and loss",
        "KL estimator per sampled token: k1 (log ratio), k2 (half its square) or "
        "k3 (r - 1 - log r, DeepSeekMath's).",
        KL_ESTIMATORS,
    )
    kl_importance_weighting: bool = setting(
        False,
        "advantages and loss",
        "Weigh each token's KL by pi / pi_old (TRL's use_bias_correction_kl, "
        "DeepSeek-V3.2, arXiv:2512.02556).",
    )
    entropy_coef: float = setting(
        0.0,
        "advantages and loss",
        "Entropy bonus: subtract this times each token's entropy (with its "
        "gradient) from the loss (0: none).",
    )
    top_entropy_quantile: float = setting(
        1.0,
        "advantages and loss",
        "Only tokens in this top fraction of each microbatch's entropies get the "
        "policy gradient (0.2 in arXiv:2506.01939; 1.0: every token).",
    )
    # --- sampling --------------------------------------------------------------
    temperature: float = setting(
        1.0,
        "sampling",
        "Sampling temperature for rollouts; scoring uses logits / temperature too.",
    )
    top_p: float = setting(
        1.0,
        "sampling",
        "Nucleus mass for rollouts in (0, 1] (1.0: the full distribution).",
    )
    max_new_tokens: int | None = setting(
        None,
        "sampling",
        "Longest response in tokens (None: the task's own max_new_tokens).",
    )
    backend: str = setting(
        "hf",
        "sampling",
        "Rollout backend: hf (generate on the policy), vllm (vLLM's engine, on "
        "a GPU or with vLLM's CPU build) or mismatch (a deliberately perturbed "
        "sampler, see 'sampler mismatch').",
        BACKEND_RECORDS,
    )
    rollout_max_batch_size: int | None = setting(
        None,
        "sampling",
        "Most sequences the hf backend generates at once (None: the whole batch).",
    )
    vllm_gpu_memory_utilization: float = setting(
        0.3, "sampling", "Fraction of GPU memory the vllm engine may take, in (0, 1]."
    )
    share_prompt_prefix: bool | str = setting(
        True,
        "sampling",
        "Run each prompt once per group, not once per response, when sampling "
        "(hf backend) and scoring (without gradient checkpointing); auto samples as "
        "true does and shares a scored microbatch only when that skips enough "
        "prompt positions to pay for its second pass (grpo_lab.prefix_sharing).",
        (False, True, "auto"),
    )
    # --- sampler mismatch ------------------------------------------------------
    mismatch: str = setting(
        "none",
        "sampler mismatch",
        "Perturbation the mismatch backend samples from (needs backend mismatch): "
        "bf16 or fp16 logits, top_p nucleus, temperature at sampling only, stale "
        "weights, or Gaussian logit noise; none samples the policy itself.",
        PERTURBATIONS,
    )
    mismatch_scale: float | None = setting(
        None,
        "sampler mismatch",
        "Size of the perturbation: top_p's nucleus mass, temperature's sampling "
        "temperature, noise's standard deviation (None: 0.9, 0.7, 0.5).",
    )
    mismatch_sync_every: int = setting(
        1,
        "sampler mismatch",
        "stale only: the sampler's weights are refreshed on every k-th sync (1: "
        "every step, no staleness).",
    )
    sampler_correction: str = setting(
        "none",
        "sampler mismatch",
        "Importance-sampling correction by pi_trainer / pi_sampler per token or "
        "per response (product of token ratios): token_/sequence_truncate "
        "(TIS: min(ratio, cap)) or token_/sequence_mask (MIS, IcePop: 0 outside "
        "[low, high]); TRL's vllm_importance_sampling_mode. none: no correction.",
        CORRECTION_MODES,
    )
    sampler_correction_cap: float = setting(
        DEFAULT_CAP,
        "sampler mismatch",
        "Truncate modes: the weight is min(ratio, cap), cap > 0 "
        "(TRL's vllm_importance_sampling_clip_max).",
    )
    sampler_correction_low: float = setting(
        DEFAULT_LOW,
        "sampler mismatch",
        "Mask modes: ratios below this get weight 0, >= 0 "
        "(TRL's vllm_importance_sampling_clip_min; 0: no lower bound).",
    )
    sampler_correction_high: float = setting(
        DEFAULT_HIGH,
        "sampler mismatch",
        "Mask modes: ratios above this get weight 0, > low "
        "(TRL's vllm_importance_sampling_clip_max).",
    )
    # --- asynchronous rollouts ----------------------------------------------------
    max_staleness: int = setting(
        0,
        "asynchronous rollouts",
        "Asynchronous GRPO: a rollout worker process samples with its own copy of "
        "the policy while the trainer trains; a group may be trained on at most "
        "this many optimizer steps after the weights that sampled it (TRL's "
        "max_staleness; 0: the synchronous loop, no worker).",
    )
    async_admission: str = setting(
        "drop",
        "asynchronous rollouts",
        "A group older than max_staleness: drop it (it is never trained on) or "
        "pace the worker so that it never samples one (it waits for newer "
        "weights instead).",
        ADMISSION_POLICIES,
    )
    weight_sync_every: int = setting(
        1,
        "asynchronous rollouts",
        "The trainer sends its weights to the rollout worker every this many "
        "optimizer steps (TRL's weight_sync_steps); at most max_staleness + 1.",
    )
    async_queue_size: int = setting(
        2,
        "asynchronous rollouts",
        "Rollout batches of scored groups the queue between worker and trainer "
        "holds; a worker with a full queue waits.",
    )
    # --- evaluation and checkpoints ---------------------------------------------
    eval_every: int = setting(
        10,
        "evaluation and checkpoints",
        "Evaluate on held-out prompts every this many steps and after the last "
        "(0: never, not even after the last step).",
    )
    eval_size: int = setting(
        200, "evaluation and checkpoints", "Held-out prompts per evaluation."
    )
    checkpoint_every: int = setting(
        25,
        "evaluation and checkpoints",
        "Save a checkpoint every this many steps (0: only at the end).",
    )
    keep_checkpoints: int = setting(
        2,
        "evaluation and checkpoints",
        "Checkpoints kept on disk, the newest ones; older ones are deleted once a "
        "new one loads back.",
    )
    report_to: str | list[str] = setting(  # noqa: RUF009 (a str default)
        "none",
        "evaluation and checkpoints",
        "Experiment trackers sent every metrics.jsonl line: none, or tensorboard, "
        "wandb, trackio, mlflow (a list or comma-separated); each is an extra: "
        "pip install 'grpo-lab[tensorboard]'.",
    )
    # --- warm-up ---------------------------------------------------------------
    sft_max_steps: int = setting(
        400,
        "warm-up",
        "Supervised warm-up: most optimizer steps (0 skips the warm-up).",
    )
    sft_target_accuracy: float = setting(
        0.25,
        "warm-up",
        "Supervised warm-up: stop once held-out accuracy reaches this.",
    )
    sft_eval_temperature: float = setting(
        1.0,
        "warm-up",
        "Supervised warm-up: temperature of that accuracy check (0: greedy decoding).",
    )
    sft_batch_size: int = setting(
        32, "warm-up", "Supervised warm-up: demonstrations per optimizer step."
    )
    sft_lr: float = setting(1e-3, "warm-up", "Supervised warm-up: AdamW learning rate.")
    sft_eval_every: int = setting(
        5, "warm-up", "Supervised warm-up: measure accuracy every this many steps."
    )
    sft_eval_size: int = setting(
        64, "warm-up", "Supervised warm-up: held-out prompts per accuracy check."
    )
    # --- device and memory -----------------------------------------------------
    device: str = setting(
        "cpu",
        "device and memory",
        'Torch device of the policy: "cpu", "cuda", "cuda:1".',
    )
    dtype: str = setting(
        "float32",
        "device and memory",
        "Parameter (and optimizer state) dtype; keep float32 for small learning "
        "rates: a bfloat16 weight cannot register an update smaller than about "
        "1/256 of itself.",
        DTYPES,
    )
    autocast_dtype: str | None = setting(
        None,
        "device and memory",
        "Compute dtype for forward and backward under torch.autocast (None: dtype).",
        (None, *DTYPES[1:]),
    )
    gradient_checkpointing: bool = setting(
        False,
        "device and memory",
        "Recompute activations in backward to save memory (real models).",
    )
    logits_chunk_size: int = setting(
        0,
        "device and memory",
        "Output-head chunk (positions) when scoring; 0 runs the model's forward.",
    )
    num_threads: int | None = setting(
        None,
        "device and memory",
        "Torch CPU threads (None: 1 for the tiny model, where more threads only "
        "contend, else torch's default).",
    )
    # --- dynamic sampling and length -------------------------------------------
    dynamic_sampling: bool = setting(
        False,
        "dynamic sampling and length",
        "Drop groups whose rewards are all equal (no signal) and sample more "
        "prompts until the rollout batch is full of groups with signal (DAPO, "
        "arXiv:2503.14476).",
    )
    dynamic_sampling_max_rounds: int = setting(
        10,
        "dynamic sampling and length",
        "Most sampling rounds per step with dynamic_sampling, the first included; "
        "when reached, the step tops the batch up with equal-reward groups.",
    )
    mask_truncated_completions: bool = setting(
        False,
        "dynamic sampling and length",
        "Responses cut at max_new_tokens (no EOS, no stop string) get response "
        "mask 0 and leave the loss (TRL's option of that name).",
    )
    overlong_buffer: int | None = setting(
        None,
        "dynamic sampling and length",
        "DAPO's soft overlong punishment: the last this many tokens before "
        "max_new_tokens lower the reward linearly to -overlong_penalty "
        "(None: no punishment).",
    )
    overlong_penalty: float = setting(
        1.0,
        "dynamic sampling and length",
        "Scale of the soft overlong punishment (>= 0; DAPO uses 1).",
    )
    # --- on-policy distillation ------------------------------------------------
    teacher: str | None = setting(
        None,
        "on-policy distillation",
        "The frozen teacher that scores the student's samples: a run folder (its "
        "final_model), a save_pretrained folder or a hub name. It must share the "
        "student's tokenizer (None: no teacher).",
    )
    distillation: str = setting(
        "none",
        "on-policy distillation",
        "How the teacher's per-token KL d_t trains the student: none, loss (d_t "
        "as a direct loss, TRL's DistillationTrainer) or reward (-d_t as each "
        "token's advantage, verl's use_policy_gradient; Thinking Machines' "
        "on-policy distillation).",
        DISTILLATION_FORMS,
    )
    distillation_estimator: str = setting(
        "k3",
        "on-policy distillation",
        "Estimator of KL(student || teacher) per sampled token: k1, k2 or k3 "
        "(k1 only as a reward; as a loss k2 follows the reverse KL, k3 the "
        "forward KL).",
        DISTILLATION_ESTIMATORS,
    )
    distillation_coef: float = setting(
        1.0,
        "on-policy distillation",
        "Weight of the distillation term in each token's loss.",
    )
    distillation_task_reward: bool = setting(
        False,
        "on-policy distillation",
        "Keep GRPO's task objective beside the distillation term (GRPO + OPD, "
        "verl's use_task_rewards); off: the teacher alone trains the student.",
    )

    def __post_init__(self) -> None:
        """Nothing here: :class:`TrainConfig` validates (the dataclass calls
        this hook only when the class it decorates defines it)."""


def field_help(name: str) -> str:
    """The help text stored with a field."""
    return _field(name).metadata["help"]


def check_field_names(values: dict[str, Any]) -> None:
    names = {f.name for f in dataclasses.fields(TrainFields)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(
            f"unknown TrainConfig field(s) {unknown}; expected some of {sorted(names)}"
        )


def _field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(TrainFields) if f.name == name)
