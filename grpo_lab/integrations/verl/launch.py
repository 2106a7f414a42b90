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
verl's defaults). Nothing written holds an absolute path. The overrides are
those of :mod:`grpo_lab.integrations.verl.settings`, one row per field.

The actor's attention is chosen where the run starts, not at export: run.sh
asks :func:`launch_attention` on the machine it runs on, which names
flash-attn's kernel where ``flash_attn`` is installed and PyTorch's ``sdpa``
elsewhere (verl's own default, ``flash_attention_2``, fails at model load
without flash-attn). Every machine of a Ray cluster has the same install, so
the head machine's answer holds for its workers.

The vLLM rollout runs with tensor parallel size 1 (verl's default is 2, and
verl 0.9.1 starts ``n_gpus // tensor_parallel`` rollout replicas: none on one
GPU), so that every GPU count works; raise it by hand for a model that does not
fit one GPU.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo_lab.integrations.cluster import (
    MODEL_DIR,
    TASK_FILES_DIR,
    TEACHER_DIR,
    Cluster,
    portable_config,
)
from grpo_lab.integrations.verl.algorithms import VERL_VERSION
from grpo_lab.integrations.verl.settings import (  # noqa: F401 (read from here too)
    ACTOR,
    EXPORTED_SETTINGS,
    MODEL,
    MODEL_PATH,
    NOT_TRAINING_SETTINGS,
    ROLLOUT,
    TEACHER_PATH,
    exported_fields,
    launch_overrides,
    lora_overrides,
)
from grpo_lab.integrations.verl.tools import (
    TOOL_CONFIG_FILE,
    TOOL_CONFIG_PATH,
    tool_config_text,
    tool_overrides,
)

# Overrides that name a file or folder: relative to the launch folder in
# overrides.txt, made absolute by run.sh where the folder is.
PATH_OVERRIDES = (
    "data.train_files",
    "data.val_files",
    "reward.custom_reward_function.path",
    "trainer.default_local_dir",
    TOOL_CONFIG_PATH,
)


def format_override(key: str, value: Any) -> str:
    """One Hydra command-line override: key=value in Hydra's grammar."""
    return f"{key}={_hydra_value(value)}"


def _hydra_value(value: Any) -> str:
    if value is None:
        return "null"
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
    launch_overrides(config, cluster=cluster)  # refused before anything is written
    out = Path(out_dir)
    train, evaluation = _task_examples(config)
    longest = max(len(e.prompt) for e in train + evaluation)
    max_prompt = longest + (256 if config.chat_template else 16)
    overrides = launch_overrides(config, cluster=cluster, max_prompt_length=max_prompt)
    overrides.update(tool_overrides(config))  # a tool-using task: verl's agent loop
    (out / "data").mkdir(parents=True, exist_ok=True)
    portable, copied = portable_config(config, out)
    overrides[MODEL_PATH] = portable.model  # model/ when it was a local folder
    if portable.teacher is not None:
        overrides[TEACHER_PATH] = portable.teacher  # teacher/ when local
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
    if tool_config_text(config) is not None:
        files[out / TOOL_CONFIG_FILE] = tool_config_text(config)
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
        "extra_info=None, **kwargs):\n" + _SCORE_BODIES[config.reward_aggregation]
    )


# compute_score's body for each reward_aggregation: the task's total, the sum
# of its parts, or the total with its parts (verl's gdpo reads the parts by key).
_SCORE_BODIES = {
    "reward": (
        '    """reward_fn(response, ground_truth)["reward"] of the task."""\n'
        '    return float(TASK.reward_fn(solution_str, ground_truth)["reward"])\n'
    ),
    "sum_then_normalize": (
        '    """The sum of the task reward\'s format and answer parts."""\n'
        "    result = TASK.reward_fn(solution_str, ground_truth)\n"
        '    return float(result["format_reward"]) + float(result["answer_reward"])\n'
    ),
    "normalize_then_sum_tokens": (
        '    """The task reward ("score") and its parts, for verl\'s gdpo."""\n'
        "    result = TASK.reward_fn(solution_str, ground_truth)\n"
        '    parts = ("format_reward", "answer_reward")\n'
        '    return {"score": float(result["reward"]),\n'
        "            **{key: float(result[key]) for key in parts}}\n"
    ),
}


def _script_line(key: str, value: Any) -> str:
    """One run.sh argument; a path override is made absolute with $HERE."""
    copied = (key, value) in ((MODEL_PATH, MODEL_DIR), (TEACHER_PATH, TEACHER_DIR))
    if key in PATH_OVERRIDES or copied:
        return f'"{key}=$HERE/{value}"'
    return shlex.quote(format_override(key, value))


# --- the actor's attention, chosen on the machine that runs ----------------------

# verl 0.9.1 builds the actor and the reference model with the attention named
# by model.override_config.attn_implementation, "flash_attention_2" when unset
# (HFModelConfig.__post_init__, verl/workers/config/model.py), and transformers
# refuses that at load where flash-attn is not installed. "++" adds the key to
# verl's empty override_config, or replaces one given before it.
ATTENTION = f"{MODEL}.override_config.attn_implementation"
REMOVE_PADDING = f"{MODEL}.use_remove_padding"


def attention_overrides(*, flash_attn_installed: bool) -> dict[str, Any]:
    """The actor's attention and remove-padding overrides for a machine with
    or without flash-attn.

    Remove-padding stays on (verl's default) under both: verl's FSDP engine
    packs a micro-batch into one row with ``attention_mask=None``, restarting
    ``position_ids`` at each sequence (``prepare_model_inputs`` in
    verl/workers/engine/fsdp/transformer_impl.py); flash-attn reads the
    sequence bounds from them, and under ``sdpa`` transformers builds the
    block-diagonal causal mask from them (``find_packed_sequence_indices`` in
    transformers/masking_utils.py), so no sequence attends to another.
    tests/verl checks the packed log-probs against padded ones under sdpa.
    """
    implementation = "flash_attention_2" if flash_attn_installed else "sdpa"
    return {ATTENTION: implementation, REMOVE_PADDING: True}


def launch_attention() -> list[str]:
    """run.sh's attention overrides for the machine this runs on (Hydra lines)."""
    installed = importlib.util.find_spec("flash_attn") is not None
    overrides = attention_overrides(flash_attn_installed=installed)
    return ["++" + format_override(key, value) for key, value in overrides.items()]


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
        'grpo_lab.integrations.verl.algorithms}"\n'
        f"{ray}"
        "# The actor's attention: flash-attn where this machine has it, else\n"
        "# sdpa (grpo_lab.integrations.verl.launch.launch_attention).\n"
        'attention="$(python -m grpo_lab.integrations.verl.launch attention)"\n'
        'mapfile -t ATTENTION <<< "$attention"\n'
        "python -m verl.trainer.main_ppo \\\n"
        f"    {arguments} \\\n"
        '    "${ATTENTION[@]}" \\\n'
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


# verl 0.9.1's `vllm` extra pins transformers==5.9.0 (its METADATA), below
# grpo-lab's floor of 5.10.4, so pip cannot resolve the two together. The
# install line takes that extra's parts itself: verl's core dependencies
# (`verl-core`) and its vLLM, 0.24.0 (which pins torch 2.11.0), with
# transformers 5.10.x, inside verl's own range (>=5.5.3,<5.11). One pip command,
# so that pip resolves all of it at once (tests/test_verl_install.py runs it
# with --dry-run).
VERL_REQUIREMENTS = (
    f"verl[verl-core]=={VERL_VERSION}",
    "vllm==0.24.0",
    "transformers>=5.10.4,<5.11",
)
GRPO_LAB_SOURCE = "PATH/TO/grpo-lab"


def install_line(source: str = GRPO_LAB_SOURCE) -> str:
    """The one pip command that installs verl, its vLLM and grpo-lab (from
    ``source``: a checkout or a built wheel) into one environment."""
    return "pip install " + " ".join(f'"{r}"' for r in (*VERL_REQUIREMENTS, source))


def _install(cluster: Cluster) -> str:
    ray = "" if cluster.nodes == 1 else " on every machine"
    return (
        f"## Install{ray}\n\n"
        "verl, its vLLM and grpo-lab go into one environment in one command, "
        "so that pip resolves them together:\n\n"
        f"```\n{install_line()}\n```\n\n"
        f"`{GRPO_LAB_SOURCE}` is a grpo-lab source checkout (the folder with its "
        "`pyproject.toml`; grpo-lab is not on PyPI) or a wheel built there "
        f"(`pip wheel --no-deps {GRPO_LAB_SOURCE} -w dist`, then "
        '`"$(ls dist/grpo_lab-*.whl)"` in its place). `verl[vllm]` is not '
        "used: it pins transformers 5.9.0, below grpo-lab's 5.10.4, so the line "
        "names that extra's parts (verl's core dependencies, vllm 0.24.0 and "
        "with it torch 2.11.0) with transformers 5.10, inside verl's range "
        "(< 5.11); grpo-lab's own `vllm` extra (vllm 0.31.0) is left out.\n\n"
        "flash-attn is optional: where it is installed "
        "(`pip install flash-attn --no-build-isolation`), run.sh loads the actor "
        "with it, and elsewhere with PyTorch's `sdpa` (both with verl's "
        "remove-padding); the choice is made by run.sh on the machine it runs "
        "on, which must have the same install as the other machines.\n\n"
        "Tested here: the install line resolves under `pip install --dry-run`; "
        "the overrides compose with verl 0.9.1's `ppo_trainer.yaml` and pass its "
        "`validate_config`; verl's FSDP engine builds the actor from this "
        "folder's overrides with `sdpa` and its packed forward matches "
        "transformers (on the CPU); grpo_lab's losses and estimators match "
        "verl's in float64. No GPU run was made.\n"
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


def main(arguments: list[str]) -> int:
    """``python -m grpo_lab.integrations.verl.launch attention``: print
    :func:`launch_attention`'s overrides, one a line (run.sh reads them)."""
    if arguments != ["attention"]:
        print(f"usage: python -m {__spec__.name} attention", file=sys.stderr)
        return 2
    print("\n".join(launch_attention()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
