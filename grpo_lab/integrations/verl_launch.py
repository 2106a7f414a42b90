"""The launch folder of ``grpo-lab export verl``: one GPU to many nodes.

:func:`write_launch_folder` turns a ``TrainConfig`` into a verl 0.9.1 launch for
M machines of N GPUs (``trainer.nnodes``, ``trainer.n_gpus_per_node``):
``overrides.txt`` (one Hydra override per line, paths relative to the folder),
``run.sh`` (``python -m verl.trainer.main_ppo`` with them, the paths made
absolute where the folder is when it runs), ``ray_cluster.sh`` (the Ray cluster
of several machines), ``data/`` (the task's prompts as JSONL, written from the
task's local files or the hub at export, and ``reward.py``), ``task_files/``
(the task's local files, which reward.py builds the task from) and README.md
(install lines, launch, what maps where and what the export changed from
verl's defaults). Nothing written holds an absolute path.

The vLLM rollout runs with tensor parallel size 1 (verl's default is 2, and
verl 0.9.1 starts ``n_gpus // tensor_parallel`` rollout replicas: none on one
GPU), so that every GPU count works; raise it by hand for a model that does not
fit one GPU.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo_lab.integrations.cluster import (
    MODEL_DIR,
    TASK_FILES_DIR,
    Cluster,
    portable_config,
    refusal_counts,
    source_install,
    split_rows,
)
from grpo_lab.integrations.verl import (
    DEFAULT_ADVANTAGE_EPS,
    LOSS_PREFIX,
    VERL_VERSION,
    estimator_name,
)
from grpo_lab.training.parsers import parse_report_to

# Fields with no counterpart in a verl run, and why nothing is lost.
NOT_TRAINING_SETTINGS = {
    "profile": "the name of the defaults the config started from; every value "
    "is exported field by field",
    "tiny_hidden_size": "shape of the locally built 'tiny' model, which verl "
    "cannot load (model 'tiny' is refused)",
    "tiny_num_layers": "shape of the 'tiny' model (refused, see tiny_hidden_size)",
    "tiny_intermediate_size": "shape of the 'tiny' model (refused, see "
    "tiny_hidden_size)",
    "rollout_max_batch_size": "memory knob of grpo_lab's hf sampler; verl's "
    "engine batches generation itself",
    "share_prompt_prefix": "speed-up of grpo_lab's sampling and scoring with "
    "identical results",
    "logits_chunk_size": "memory knob of grpo_lab's scoring with identical results",
    "num_threads": "CPU threads of grpo_lab's own process",
    "sft_target_accuracy": "read by the supervised warm-up only, which must be "
    "off (sft_max_steps 0) to export",
    "sft_eval_temperature": "warm-up only (see sft_target_accuracy)",
    "sft_batch_size": "warm-up only (see sft_target_accuracy)",
    "sft_lr": "warm-up only (see sft_target_accuracy)",
    "sft_eval_every": "warm-up only (see sft_target_accuracy)",
    "sft_eval_size": "warm-up only (see sft_target_accuracy)",
    "mismatch_scale": "read only by grpo_lab's mismatch backend (mismatch must "
    "be none)",
    "mismatch_sync_every": "read only by the mismatch backend (see mismatch_scale)",
    "sampler_correction_cap": "read only with sampler_correction, which must be "
    "none to export",
    "sampler_correction_low": "see sampler_correction_cap",
    "sampler_correction_high": "see sampler_correction_cap",
    "dynamic_sampling_max_rounds": "read only with dynamic_sampling, which must "
    "be False to export",
    "overlong_penalty": "read only with overlong_buffer, which must be None",
}
# report_to names and verl's trainer.logger backends (verl 0.9.1 has all four).
TRACKERS = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "trackio": "trackio",
}
PLAIN_PROMPT_TEMPLATE = "{% for message in messages %}{{ message.content }}{% endfor %}"
_TORCH_TO_VERL_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"


def _refuse(name: str, expected: str, value: object) -> ValueError:
    return ValueError(f"{name} must be {expected} to export to verl, got {value!r}")


def _check_exportable(config: Any) -> None:
    """Refuse every setting verl cannot carry, naming it."""
    refusals = (
        (
            "model",
            config.model != "tiny",
            "a hub name or a local path (not 'tiny', which grpo_lab builds locally)",
        ),
        (
            "advantage_eps",
            config.advantage_eps == DEFAULT_ADVANTAGE_EPS,
            f"{DEFAULT_ADVANTAGE_EPS} (verl passes no epsilon to a registered "
            "estimator)",
        ),
        ("nan_rewards", config.nan_rewards == "propagate", "'propagate'"),
        (
            "kl_importance_weighting",
            not config.kl_importance_weighting,
            "False (verl's KL loss has no importance weight)",
        ),
        (
            "top_entropy_quantile",
            config.top_entropy_quantile == 1.0,
            "1.0 (verl trains on every token)",
        ),
        (
            "sft_max_steps",
            config.sft_max_steps == 0,
            "0 (verl has no supervised "
            "warm-up: run it with grpo_lab and export the warmed-up model's path)",
        ),
        (
            "device",
            str(config.device).startswith("cuda"),
            "a CUDA device (verl trains on GPUs)",
        ),
        (
            "mismatch",
            config.mismatch == "none",
            "'none' (the mismatch backend is grpo_lab's CPU simulator)",
        ),
        (
            "sampler_correction",
            config.sampler_correction == "none",
            "'none' (verl's own algorithm.rollout_correction is not mapped; set it "
            "in overrides.txt by hand)",
        ),
        (
            "dynamic_sampling",
            not config.dynamic_sampling,
            "False (verl's algorithm.filter_groups is not mapped)",
        ),
        (
            "mask_truncated_completions",
            not config.mask_truncated_completions,
            "False (not mapped to verl)",
        ),
        (
            "overlong_buffer",
            config.overlong_buffer is None,
            "None (verl's overlong reward shaping is not mapped)",
        ),
    )
    for name, ok, expected in refusals:
        if not ok:
            raise _refuse(name, expected, getattr(config, name))


def _loss_aggregation(config: Any) -> dict[str, Any]:
    if config.loss_normalization == "token":
        return {f"{ACTOR}.loss_agg_mode": "token-mean"}
    if config.loss_normalization == "sequence":
        return {f"{ACTOR}.loss_agg_mode": "seq-mean-token-mean"}
    constant, rows = config.normalization_constant, config.train_batch_size
    if constant % rows:
        raise _refuse(
            "normalization_constant",
            f"a multiple of train_batch_size ({rows}) (verl divides by its batch "
            "size times an integer loss_scale_factor)",
            constant,
        )
    return {
        f"{ACTOR}.loss_agg_mode": "seq-mean-token-sum-norm",
        f"{ACTOR}.loss_scale_factor": int(constant // rows),
    }


def _objective_overrides(config: Any) -> dict[str, Any]:
    method = config.importance_reweighting_method
    values: dict[str, Any] = {
        f"{ACTOR}.policy_loss.loss_mode": f"{LOSS_PREFIX}{method}",
        "algorithm.adv_estimator": estimator_name(
            config.baseline, config.advantage_normalizer
        ),
        f"{ACTOR}.clip_ratio_c": math.inf
        if config.ratio_cap is None
        else config.ratio_cap,
        f"{ACTOR}.tau_pos": config.sapo_temperature_pos,
        f"{ACTOR}.tau_neg": config.sapo_temperature_neg,
        **_loss_aggregation(config),
    }
    if config.cliprange is not None:
        high = (
            config.cliprange if config.cliprange_high is None else config.cliprange_high
        )
        values[f"{ACTOR}.clip_ratio"] = config.cliprange
        values[f"{ACTOR}.clip_ratio_low"] = config.cliprange
        values[f"{ACTOR}.clip_ratio_high"] = high
    kl = config.kl_coef > 0
    values.update(
        {
            "algorithm.use_kl_in_reward": False,
            f"{ACTOR}.use_kl_loss": kl,
            f"{ACTOR}.kl_loss_coef": config.kl_coef,
            f"{ACTOR}.kl_loss_type": {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}[
                config.kl_estimator
            ],
            f"{ACTOR}.entropy_coeff": config.entropy_coef,
        }
    )
    return values


def _fits(config: Any, processes: int) -> bool:
    """verl 0.9.1's batch rules on ``processes`` GPUs: the rollout batch and the
    train batch (responses) divide by them (``validate_config`` and its engine
    workers' mini-batch split)."""
    return (
        config.rollout_batch_size % processes == 0
        and config.train_batch_size % processes == 0
    )


def _batch_overrides(config: Any, cluster: Cluster) -> dict[str, Any]:
    processes = cluster.world_size
    if not _fits(config, processes):
        raise _refuse(
            "train_batch_size",
            f"a batch whose rollout_batch_size ({config.rollout_batch_size}) and "
            f"train_batch_size divide by the {processes} GPUs; "
            + refusal_counts(lambda n: _fits(config, n)),
            config.train_batch_size,
        )
    micro = config.train_batch_size // config.gradient_accumulation_steps
    per_gpu, _ = split_rows(config.train_batch_size, processes, micro)
    return {
        "data.train_batch_size": config.prompts_per_step,
        f"{ROLLOUT}.n": config.group_size,
        f"{ACTOR}.ppo_mini_batch_size": config.train_batch_size // config.group_size,
        f"{ACTOR}.ppo_epochs": config.epochs_per_rollout_batch,
        f"{ACTOR}.ppo_micro_batch_size_per_gpu": per_gpu,
        f"{ACTOR}.use_dynamic_bsz": False,
        f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu": per_gpu,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": per_gpu,
        f"{ROLLOUT}.tensor_model_parallel_size": 1,
        "trainer.total_training_steps": config.steps,
        "trainer.n_gpus_per_node": cluster.gpus,
        "trainer.nnodes": cluster.nodes,
    }


def _optimizer_overrides(config: Any) -> dict[str, Any]:
    clip = math.inf if config.max_grad_norm is None else config.max_grad_norm
    return {
        f"{ACTOR}.optim.lr": config.lr,
        f"{ACTOR}.optim.lr_warmup_steps": config.lr_warmup_steps,
        f"{ACTOR}.optim.weight_decay": config.weight_decay,
        f"{ACTOR}.optim.betas": [0.9, config.adam_beta2],
        f"{ACTOR}.optim.clip_grad": clip,
    }


MODEL_PATH = "actor_rollout_ref.model.path"
# Overrides that name a file or folder: relative to the launch folder in
# overrides.txt, made absolute by run.sh where the folder is.
PATH_OVERRIDES = (
    "data.train_files",
    "data.val_files",
    "reward.custom_reward_function.path",
    "trainer.default_local_dir",
)


def _run_overrides(config: Any, max_prompt: int) -> dict[str, Any]:
    compute = config.autocast_dtype or config.dtype
    trackers = [TRACKERS[name] for name in parse_report_to(config.report_to)]
    values: dict[str, Any] = {
        MODEL_PATH: config.model,
        "actor_rollout_ref.model.enable_gradient_checkpointing": (
            config.gradient_checkpointing
        ),
        f"{ACTOR}.fsdp_config.model_dtype": _TORCH_TO_VERL_DTYPE[config.dtype],
        f"{ACTOR}.fsdp_config.dtype": compute,
        f"{ROLLOUT}.name": "vllm",
        f"{ROLLOUT}.temperature": config.temperature,
        f"{ROLLOUT}.top_p": config.top_p,
        f"{ROLLOUT}.gpu_memory_utilization": config.vllm_gpu_memory_utilization,
        f"{ROLLOUT}.seed": config.seed,
        f"{ACTOR}.data_loader_seed": config.seed,
        "data.seed": config.seed,
        "data.train_files": "data/train.jsonl",
        "data.val_files": "data/val.jsonl",
        "data.max_prompt_length": max_prompt,
        "data.max_response_length": _max_new_tokens(config),
        "reward.custom_reward_function.path": "data/reward.py",
        "reward.custom_reward_function.name": "compute_score",
        "trainer.test_freq": config.eval_every if config.eval_every else -1,
        "trainer.val_before_train": bool(config.eval_every),
        "trainer.save_freq": config.checkpoint_every or config.steps,
        "trainer.max_actor_ckpt_to_keep": config.keep_checkpoints,
        "trainer.resume_mode": "auto" if config.resume else "disable",
        "trainer.default_local_dir": "checkpoints",
        "trainer.logger": ["console", *trackers],
    }
    if not config.chat_template:
        values["actor_rollout_ref.model.custom_chat_template"] = PLAIN_PROMPT_TEMPLATE
    return values


def _max_new_tokens(config: Any) -> int:
    if config.max_new_tokens is not None:
        return config.max_new_tokens
    from grpo_lab.tasks import get_task

    return get_task(config.task, **config.task_options).max_new_tokens


# Every TrainConfig field exported, and where (the test walks them all).
EXPORTED_SETTINGS = {
    "seed": "data.seed, actor.data_loader_seed, rollout.seed, the data files' draws",
    "run_dir": "not written (a path of this machine): trainer.default_local_dir is "
    "the folder's checkpoints/",
    "resume": "trainer.resume_mode (auto / disable)",
    "model": "actor_rollout_ref.model.path",
    "task": "data/train.jsonl, data/val.jsonl and data/reward.py",
    "task_options": "the task the data files and reward.py build",
    "chat_template": "off: model.custom_chat_template passes the prompt as is",
    "steps": "trainer.total_training_steps",
    "rollout_batch_size": "data.train_batch_size (prompts) x rollout.n",
    "group_size": "rollout.n",
    "train_batch_size": "actor.ppo_mini_batch_size (prompts) x rollout.n",
    "epochs_per_rollout_batch": "actor.ppo_epochs",
    "gradient_accumulation_steps": "actor.ppo_micro_batch_size_per_gpu",
    "lr": "actor.optim.lr",
    "lr_warmup_steps": "actor.optim.lr_warmup_steps",
    "weight_decay": "actor.optim.weight_decay",
    "adam_beta2": "actor.optim.betas[1]",
    "max_grad_norm": "actor.optim.clip_grad (None: inf)",
    "baseline": "algorithm.adv_estimator",
    "advantage_normalizer": "algorithm.adv_estimator",
    "advantage_eps": "refused unless 1e-6 (the estimators' epsilon)",
    "nan_rewards": "refused unless 'propagate'",
    "importance_reweighting_method": "actor.policy_loss.loss_mode",
    "cliprange": "actor.clip_ratio, actor.clip_ratio_low",
    "cliprange_high": "actor.clip_ratio_high",
    "ratio_cap": "actor.clip_ratio_c (None: inf)",
    "sapo_temperature_pos": "actor.tau_pos",
    "sapo_temperature_neg": "actor.tau_neg",
    "loss_normalization": "actor.loss_agg_mode",
    "normalization_constant": "actor.loss_scale_factor (x train_batch_size)",
    "kl_coef": "actor.use_kl_loss, actor.kl_loss_coef",
    "kl_estimator": "actor.kl_loss_type (kl, mse, low_var_kl)",
    "kl_importance_weighting": "refused unless False",
    "entropy_coef": "actor.entropy_coeff",
    "top_entropy_quantile": "refused unless 1.0",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "max_new_tokens": "data.max_response_length (None: the task's)",
    "backend": "rollout.name vllm (verl samples with its own engine)",
    "vllm_gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "eval_every": "trainer.test_freq (0: -1), trainer.val_before_train",
    "eval_size": "data/val.jsonl's prompts",
    "checkpoint_every": "trainer.save_freq (0: steps, the end only)",
    "keep_checkpoints": "trainer.max_actor_ckpt_to_keep",
    "report_to": "trainer.logger",
    "sft_max_steps": "refused unless 0",
    "device": "refused unless CUDA; --gpus and --nodes give trainer.n_gpus_per_node "
    "and trainer.nnodes",
    "dtype": "actor.fsdp_config.model_dtype",
    "autocast_dtype": "actor.fsdp_config.dtype (None: dtype)",
    "gradient_checkpointing": "actor_rollout_ref.model.enable_gradient_checkpointing",
    "mismatch": "refused unless 'none'",
    "sampler_correction": "refused unless 'none'",
    "dynamic_sampling": "refused unless False",
    "mask_truncated_completions": "refused unless False",
    "overlong_buffer": "refused unless None",
}


def launch_overrides(
    config: Any, *, cluster: Cluster | None = None, max_prompt_length: int = 512
) -> dict[str, Any]:
    """Every Hydra override of verl's ppo_trainer a run of ``config`` on
    ``cluster`` (default: one GPU) needs; paths are relative to the folder."""
    _check_exportable(config)
    cluster = cluster or Cluster()
    return {
        **_run_overrides(config, max_prompt_length),
        **_batch_overrides(config, cluster),
        **_optimizer_overrides(config),
        **_objective_overrides(config),
        **lora_overrides(config),
    }


def format_override(key: str, value: Any) -> str:
    """One Hydra command-line override: key=value in Hydra's grammar."""
    return f"{key}={_hydra_value(value)}"


def _hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    text = str(value)
    if text and all(c.isalnum() or c in "/._-~" for c in text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_launch_folder(
    config: Any, out_dir: str | Path, *, gpus: int = 1, nodes: int = 1
) -> list[Path]:
    """Write a verl 0.9.1 launch of ``config`` for ``nodes`` machines of
    ``gpus`` GPUs to ``out_dir``; return the files (see the module docstring).

    The prompts (steps x prompts_per_step and eval_size, drawn with the seed)
    are written now, from the task's local files when its options name them.
    A setting verl cannot carry raises ValueError naming it before anything
    is written.
    """
    cluster = Cluster(gpus, nodes)
    _check_exportable(config)
    out = Path(out_dir)
    train, evaluation = _task_examples(config)
    longest = max(len(e.prompt) for e in train + evaluation)
    max_prompt = longest + (256 if config.chat_template else 16)
    overrides = launch_overrides(config, cluster=cluster, max_prompt_length=max_prompt)
    (out / "data").mkdir(parents=True, exist_ok=True)
    portable, copied = portable_config(config, out)
    overrides[MODEL_PATH] = portable.model  # model/ when it was a local folder
    lines = [format_override(k, v) for k, v in overrides.items()]
    files = {
        out / "overrides.txt": "\n".join(lines) + "\n",
        out / "run.sh": _run_script(overrides, cluster),
        out / "ray_cluster.sh": _ray_script(cluster),
        out / "README.md": _readme(config, overrides, cluster),
        out / "data" / "train.jsonl": _jsonl(train, config.task, "train"),
        out / "data" / "val.jsonl": _jsonl(evaluation, config.task, "val"),
        out / "data" / "reward.py": _reward_module(portable),
    }
    for path, text in files.items():
        path.write_text(text)
    for script in ("run.sh", "ray_cluster.sh"):
        (out / script).chmod(0o755)
    return [*files, *copied]


def _task_examples(config: Any) -> tuple[list, list]:
    from grpo_lab.tasks import get_task

    task = get_task(config.task, **config.task_options)
    train = task.train(config.steps * config.prompts_per_step, config.seed)
    evaluation = task.eval(max(config.eval_size, 1), config.seed)
    return train, evaluation


def _jsonl(examples: list, task: str, split: str) -> str:
    rows = [
        {
            "data_source": f"grpo_lab/{task}",
            "prompt": [{"role": "user", "content": example.prompt}],
            "ability": task,
            "reward_model": {"style": "rule", "ground_truth": example.ground_truth},
            "extra_info": {"split": split, "index": i},
        }
        for i, example in enumerate(examples)
    ]
    return "".join(json.dumps(row) + "\n" for row in rows)


def _reward_module(config: Any) -> str:
    """data/reward.py: the task's reward, the task built where the folder is."""
    return (
        '"""The grpo_lab task reward for verl\'s reward manager."""\n\n'
        "from pathlib import Path\n\n"
        "from grpo_lab.integrations.cluster import resolve_task_options\n"
        "from grpo_lab.tasks import get_task\n\n"
        "FOLDER = Path(__file__).resolve().parents[1]  # the launch folder\n"
        f"OPTIONS = resolve_task_options({config.task_options!r}, FOLDER)\n"
        f"TASK = get_task({config.task!r}, **OPTIONS)\n\n\n"
        "def compute_score(data_source, solution_str, ground_truth, "
        "extra_info=None, **kwargs):\n"
        '    """reward_fn(response, ground_truth)["reward"] of the task."""\n'
        '    return float(TASK.reward_fn(solution_str, ground_truth)["reward"])\n'
    )


def _script_line(key: str, value: Any) -> str:
    """One run.sh argument; a path override is made absolute with $HERE."""
    if key in PATH_OVERRIDES or (key == MODEL_PATH and value == MODEL_DIR):
        return f'"{key}=$HERE/{value}"'
    return shlex.quote(format_override(key, value))


def _run_script(overrides: Mapping[str, Any], cluster: Cluster) -> str:
    arguments = " \\\n    ".join(_script_line(k, v) for k, v in overrides.items())
    ray = (
        "# Several machines: start the Ray cluster first (./ray_cluster.sh), then\n"
        "# run this on the head machine; verl joins the running cluster.\n"
        'export RAY_ADDRESS="${RAY_ADDRESS:-auto}"\n'
        if cluster.nodes > 1
        else ""
    )
    return (
        "#!/usr/bin/env bash\n"
        f"# A verl {VERL_VERSION} run of a grpo_lab config on {cluster.nodes} "
        f"machine(s) of {cluster.gpus} GPU(s);\n"
        "# needs verl and grpo-lab in one environment (see README.md).\n"
        "set -euo pipefail\n"
        'HERE="$(cd "$(dirname "$0")" && pwd)"\n'
        'cd "$HERE"\n'
        "# verl logs a plugin that fails to import at debug level only; importing\n"
        "# it here as an external module makes a broken install fail loudly.\n"
        'export VERL_USE_EXTERNAL_MODULES="${VERL_USE_EXTERNAL_MODULES:-'
        'grpo_lab.integrations.verl}"\n'
        f"{ray}"
        "python -m verl.trainer.main_ppo \\\n"
        f"    {arguments} \\\n"
        '    "$@"\n'
    )


RAY_PORT = 6379


def ray_start_commands(cluster: Cluster) -> dict[str, str]:
    """The ``ray start`` line of the head machine and of every other one."""
    return {
        "head": f"ray start --head --port={RAY_PORT} --num-gpus={cluster.gpus}",
        "worker": f'ray start --address="$HEAD_ADDRESS:{RAY_PORT}" '
        f"--num-gpus={cluster.gpus}",
    }


def _ray_script(cluster: Cluster) -> str:
    commands = ray_start_commands(cluster)
    return (
        "#!/usr/bin/env bash\n"
        f"# The Ray cluster of {cluster.nodes} machine(s) of {cluster.gpus} GPU(s):\n"
        "#   ./ray_cluster.sh head                  on the head machine (runs run.sh)\n"
        "#   ./ray_cluster.sh worker HEAD_ADDRESS   on each of the others\n"
        "# One machine needs none of this: run.sh starts a local Ray itself.\n"
        "set -euo pipefail\n"
        'case "${1:-}" in\n'
        f"  head) exec {commands['head']} ;;\n"
        '  worker) HEAD_ADDRESS="${2:?give the head machine\'s address}"\n'
        f"    exec {commands['worker']} ;;\n"
        '  *) echo "usage: $0 head | worker HEAD_ADDRESS" >&2; exit 2 ;;\n'
        "esac\n"
    )


# verl 0.9.1's ppo_trainer.yaml defaults of settings the export changes
# (tests/verl checks each against verl's composed config).
VERL_DEFAULTS = {
    f"{ROLLOUT}.tensor_model_parallel_size": 2,
    f"{ACTOR}.clip_ratio_c": 3.0,
    f"{ACTOR}.loss_agg_mode": "token-mean",
    f"{ACTOR}.policy_loss.loss_mode": "vanilla",
    "algorithm.adv_estimator": "gae",
    "algorithm.use_kl_in_reward": False,
    f"{ACTOR}.use_kl_loss": False,
    f"{ACTOR}.kl_loss_type": "low_var_kl",
    f"{ACTOR}.entropy_coeff": 0,
    f"{ACTOR}.optim.weight_decay": 0.01,
    f"{ACTOR}.optim.clip_grad": 1.0,
    f"{ACTOR}.ppo_epochs": 1,
    f"{ROLLOUT}.n": 1,
    f"{ROLLOUT}.temperature": 1.0,
    "trainer.n_gpus_per_node": 8,
    "trainer.nnodes": 1,
}


def default_changes(overrides: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, verl's default, exported) where the export leaves verl's default."""
    return [
        (key, default, overrides[key])
        for key, default in VERL_DEFAULTS.items()
        if key in overrides and overrides[key] != default
    ]


VERL_INSTALL = """\
verl's vLLM comes with `verl[vllm]` (its own torch and vllm pins), so install
verl first and grpo-lab into the same environment without grpo-lab's `vllm`
extra (which pins another vllm):

```
pip install "verl[vllm]=={version}"
pip install "transformers>=5.10.4,<5.11"           # verl's and grpo-lab's range
"""


def _install(cluster: Cluster) -> str:
    ray = "" if cluster.nodes == 1 else " on every machine"
    return (
        f"## Install{ray}\n\n"
        + VERL_INSTALL.format(version=VERL_VERSION)
        + source_install().split("```\n", 1)[1]
        + "\nTested here: the overrides compose with verl 0.9.1's "
        "`ppo_trainer.yaml` and pass its `validate_config` (transformers 5.10.4, "
        "ray 2.60.0, hydra-core 1.3.8, torch 2.13.0); grpo_lab's losses and "
        "estimators match verl's in float64. No GPU run was made.\n"
    )


def _launch(cluster: Cluster) -> str:
    if cluster.nodes == 1:
        return (
            f"## Launch\n\n`./run.sh` on the machine with {cluster.gpus} GPU(s). "
            "Extra Hydra overrides may follow: `./run.sh trainer.total_epochs=2`.\n"
        )
    commands = ray_start_commands(cluster)
    return (
        f"## Launch on {cluster.nodes} machines\n\n"
        "The folder must be at the same path on every machine (a shared file "
        "system, or a copy): verl's workers read `data/` wherever Ray places "
        "them.\n\n```\n"
        f"{commands['head']}                       # the head machine\n"
        f"HEAD_ADDRESS=... {commands['worker']}   # every other machine\n"
        "./run.sh                                  # the head machine\n"
        "```\n\n(`./ray_cluster.sh head` and `./ray_cluster.sh worker "
        "HEAD_ADDRESS` run the same lines.)\n"
    )


def _readme(config: Any, overrides: Mapping[str, Any], cluster: Cluster) -> str:
    method = config.importance_reweighting_method
    changes = "\n".join(
        f"| `{key}` | `{default!r}` | `{value!r}` |"
        for key, default, value in default_changes(overrides)
    )
    return (
        f"# verl {VERL_VERSION} launch\n\n"
        f"`./run.sh` trains `{config.model}` on the task `{config.task}` with "
        f"verl's PPO trainer on {cluster.nodes} machine(s) of {cluster.gpus} "
        f"GPU(s), grpo_lab's objective `{method}` "
        f"(`{overrides[f'{ACTOR}.policy_loss.loss_mode']}`, "
        f"`loss_agg_mode={overrides[f'{ACTOR}.loss_agg_mode']}`) and advantages "
        f"`{overrides['algorithm.adv_estimator']}`.\n\n"
        + _install(cluster)
        + "\n"
        + _launch(cluster)
        + "\nFiles: `overrides.txt` (one Hydra override per line; paths relative "
        "to this folder, which run.sh makes absolute), `data/train.jsonl` and "
        "`data/val.jsonl` (the prompts, written at export), `data/reward.py` (the "
        f"reward), `{TASK_FILES_DIR}/` (the task's local files, if any), "
        "`checkpoints/` (written by the run).\n\n"
        "## What the export changed from verl's defaults\n\n"
        "| override | verl's default | exported |\n|---|---|---|\n"
        f"{changes}\n\n"
        "The rollout's tensor parallel size is 1: verl's 2 would start no "
        "rollout engine on one GPU. `clip_ratio_c` is grpo_lab's `ratio_cap` "
        "(inf: none), where verl's default dual clip is 3.0.\n\n"
        "Approximate in verl: the k3 KL (`low_var_kl`) clamps each token's value "
        "to [-10, 10]; the learning-rate warm-up starts from 0; responses stop at "
        "EOS only, not at the task's stop strings; `data.max_prompt_length` is the "
        "longest prompt in characters plus a margin, and verl refuses a longer "
        "tokenized prompt.\n"
    )


def exported_fields() -> dict[str, str]:
    """Every TrainConfig field with where it goes (or why it has no place)."""
    return {**EXPORTED_SETTINGS, **NOT_TRAINING_SETTINGS}


# --- LoRA -------------------------------------------------------------------------

MODEL = "actor_rollout_ref.model"
EXPORTED_SETTINGS.update(
    {
        "lora_rank": "actor_rollout_ref.model.lora_rank (0: full fine-tuning)",
        "lora_alpha": "actor_rollout_ref.model.lora_alpha",
        "lora_target_modules": "actor_rollout_ref.model.target_modules",
        "lora_dropout": "refused unless 0 (not exported)",
        "lora_lr": "actor.optim.lr when lora_rank > 0",
    }
)


def lora_overrides(config: Any) -> dict[str, Any]:
    """verl's LoRA settings for ``config``'s adapters (none at rank 0)."""
    if config.lora_rank == 0:
        return {}
    if config.lora_dropout != 0:
        raise _refuse(
            "lora_dropout", "0 (dropout is not exported)", config.lora_dropout
        )
    targets = config.lora_settings().target_modules
    return {
        f"{MODEL}.lora_rank": config.lora_rank,
        f"{MODEL}.lora_alpha": config.lora_alpha,
        f"{MODEL}.target_modules": targets
        if isinstance(targets, str)
        else list(targets),
        f"{ACTOR}.optim.lr": config.lora_lr,
    }
