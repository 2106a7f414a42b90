"""The launch folder of ``grpo-lab export trl``: one GPU to many nodes.

:func:`write_launch_folder` writes, for a cluster
(:class:`~grpo_lab.integrations.cluster.Cluster`) of N GPUs on each of M
machines:

- ``grpo_config.json`` (``to_trl_config`` for the training processes) and
  ``train_config.json`` (the run, with no machine's paths in it);
- ``train.py`` (builds the task's data and reward and trains);
- ``accelerate/*.yaml``: one GPU (``single_gpu``, for one process) or DDP
  (``multi_gpu``), DeepSpeed ZeRO-1/2/3 and FSDP, every one with the run's
  process count and machine count, as TRL's own ``accelerate_configs`` are;
- ``launch.sh`` (``accelerate launch``; on several machines with
  ``MACHINE_RANK`` and ``MAIN_PROCESS_IP``);
- with ``vllm_mode="server"``, ``vllm_serve.sh`` (``trl vllm-serve``) and the GPU
  split: on one machine the last GPU serves and the others train; on several,
  the server is one more machine of N GPUs;
- README.md: how to install (a checkout or a wheel, with the tested versions),
  how to launch, and every GRPOConfig argument whose value differs from TRL's
  default, TRL's vLLM importance-sampling correction among them.

Nothing written holds an absolute path: the folder can be copied to a cluster.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from grpo_lab.errors import UserError
from grpo_lab.integrations.cluster import Cluster, portable_config, source_install
from grpo_lab.integrations.trl import distillation
from grpo_lab.integrations.trl.translation import (
    TESTED_TRL_VERSION,
    grpo_lab_trainer_reasons,
    to_trl_config,
)
from grpo_lab.integrations.unrowed import field_defaults
from grpo_lab.training.config import TrainConfig

VLLM_MODES = ("colocate", "server")
# TRL 1.16's defaults (GRPOConfig.vllm_server_port and vllm_group_port, as
# VLLMClient's server_port and group_port in trl/generation/vllm_client.py):
# the server's HTTP port, and the port of the NCCL group of the weight sync,
# which the trainer opens on machine 0 (VLLMClient.init_communicator).
VLLM_SERVER_PORT = 8000
VLLM_GROUP_PORT = 51216
MAIN_PROCESS_PORT = 29500
# Versions the folder was tested with (CPU dry runs of train.py).
TESTED_VERSIONS = {
    "trl": TESTED_TRL_VERSION,
    "accelerate": "1.15.0",
    "transformers": "5.17.0",
    "torch": "2.13.0",
}
# GRPOConfig fields whose default is set in __post_init__ (TRL 1.16's docs).
POST_INIT_DEFAULTS = {"bf16": True}

TRAIN_SCRIPT = '''"""Train train_config.json's run on TRL's GRPOTrainer (TRL {version}).

    ./launch.sh {default_config}                       # see README.md
    python train.py --model PATH --max-steps 1 --use-cpu      # a dry run

grpo_config.json holds the GRPOConfig arguments that ``grpo-lab export trl``
translated from train_config.json for {processes} process(es); with another
process count the per-device batch and the accumulation steps are set again so
that the global batch stays the config's.
"""

import argparse
import json
import os
from pathlib import Path

from trl import GRPOConfig, GRPOTrainer

from grpo_lab.integrations.cluster import resolve_task_options
from grpo_lab.integrations.trl.translation import data_parallel_batch
from grpo_lab.integrations.trl.trainer import (
    hand_generate_the_tokenizer,
    peft_config_for,
    task_dataset,
    trainer_class_for,
    trl_reward_functions,
)
from grpo_lab.integrations.trl.tools import tool_trainer_keywords
from grpo_lab.models import load_tokenizer
from grpo_lab.tasks import get_task
from grpo_lab.training.config import TrainConfig

HERE = Path(__file__).resolve().parent
# A CPU dry run: no vLLM engine (nor its stop strings), no autocast, float32.
CPU_ARGUMENTS = {{
    "use_cpu": True,
    "use_vllm": False,
    "bf16": False,
    "fp16": False,
    "gradient_checkpointing": False,
    "model_init_kwargs": {{"dtype": "float32"}},
}}


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train on TRL's GRPOTrainer.")
    parser.add_argument("--model", help="a model folder or hub name to use instead")
    parser.add_argument("--max-steps", type=int, help="stop after N optimizer steps")
    parser.add_argument("--use-cpu", action="store_true", help="run on the CPU")
    parser.add_argument("--output-dir", default=str(HERE / "output"))
    return parser.parse_args()


def model_path(config: TrainConfig, given: str | None) -> str:
    """--model, else the folder's own copy (tiny_model/, model/), else the name."""
    if given:
        return given
    local = HERE / ("tiny_model" if config.model == "tiny" else config.model)
    return str(local) if local.is_dir() else config.model


def main() -> None:
    options = parse_arguments()
    config = TrainConfig.from_dict(json.loads((HERE / "train_config.json").read_text()))
    arguments = json.loads((HERE / "grpo_config.json").read_text())
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    arguments.update(data_parallel_batch(config, processes))
    if arguments.get("vllm_mode") == "server":
        arguments["vllm_server_host"] = os.environ.get("VLLM_SERVER_HOST", "127.0.0.1")
    if options.max_steps is not None:
        arguments["max_steps"] = options.max_steps
    if options.use_cpu:
        if arguments.get("use_vllm"):
            arguments["generation_kwargs"] = None  # vLLM's stop settings
        arguments.update(CPU_ARGUMENTS)
    grpo_config = GRPOConfig(output_dir=options.output_dir, **arguments)

    task = get_task(config.task, **resolve_task_options(config.task_options, HERE))
    model = model_path(config, options.model)
    prompts = config.steps * config.prompts_per_step
    chat = {{"chat_template": config.chat_template}}
    train_dataset = task_dataset(task, "train", prompts, config.seed, **chat)
    eval_dataset = None
    if config.eval_every:
        eval_dataset = task_dataset(task, "eval", config.eval_size, config.seed, **chat)
    trainer_class = trainer_class_for(config, num_processes=processes)
    extra = {{}} if trainer_class is GRPOTrainer else {{"train_config": config}}
    trainer = trainer_class(
        model=model,
        reward_funcs=trl_reward_functions(task, config),
        args=grpo_config,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=load_tokenizer(model),
        peft_config=peft_config_for(config),
        **extra,
        **tool_trainer_keywords(config),  # a tool-using task's multi-turn rollout
    )
    hand_generate_the_tokenizer(trainer)  # transformers' stop_strings need it
    trainer.train(resume_from_checkpoint=True if config.resume else None)
    trainer.save_model(str(Path(options.output_dir) / "final_model"))


if __name__ == "__main__":
    main()
'''

ACCELERATE_COMMON = {
    "compute_environment": "LOCAL_MACHINE",
    "debug": False,
    "downcast_bf16": "no",
    "machine_rank": 0,
    "main_training_function": "main",
    "rdzv_backend": "static",
    "same_network": True,
    "tpu_env": [],
    "tpu_use_cluster": False,
    "tpu_use_sudo": False,
    "use_cpu": False,
}
# DeepSpeed and FSDP sections as TRL 1.16's trl/accelerate_configs hold them
# (zero1 without its gradient_accumulation_steps: HF's Trainer sets it).
DEEPSPEED_STAGES = {
    1: {"zero3_init_flag": False},
    2: {
        "offload_optimizer_device": "none",
        "offload_param_device": "none",
        "zero3_init_flag": False,
    },
    3: {
        "offload_optimizer_device": "none",
        "offload_param_device": "none",
        "zero3_init_flag": True,
        "zero3_save_16bit_model": True,
    },
}
FSDP2 = {
    "fsdp_activation_checkpointing": False,
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "fsdp_cpu_ram_efficient_loading": True,
    "fsdp_offload_params": False,
    "fsdp_reshard_after_forward": True,
    "fsdp_state_dict_type": "FULL_STATE_DICT",
    "fsdp_version": 2,
}


@dataclasses.dataclass(frozen=True)
class TrlLaunch:
    """Where the processes go: the cluster, and who samples (vLLM's mode)."""

    cluster: Cluster
    vllm_mode: str = "colocate"

    @property
    def server(self) -> bool:
        return self.vllm_mode == "server"

    @property
    def training_machines(self) -> int:
        return self.cluster.nodes

    @property
    def training_gpus_per_machine(self) -> int:
        """One machine serving: its last GPU is the server's."""
        one_machine_server = self.server and self.cluster.nodes == 1
        return self.cluster.gpus - (1 if one_machine_server else 0)

    @property
    def processes(self) -> int:
        return self.training_gpus_per_machine * self.training_machines


def check_launch(config: TrainConfig, launch: TrlLaunch) -> None:
    """Refuse a vLLM mode the run cannot use, naming it."""
    if launch.vllm_mode not in VLLM_MODES:
        raise ValueError(
            f"--vllm-mode must be one of {VLLM_MODES}, got {launch.vllm_mode!r}"
        )
    if launch.server and config.backend != "vllm":
        raise ValueError(
            f"--vllm-mode server needs backend 'vllm', got {config.backend!r}"
        )
    if launch.server and launch.processes < 1:
        raise ValueError(
            "--vllm-mode server on one machine needs --gpus 2 or more (one GPU "
            f"serves, the others train), got --gpus {launch.cluster.gpus}"
        )


def launch_arguments(config: TrainConfig, launch: TrlLaunch) -> dict[str, Any]:
    """``to_trl_config`` for the launch's training processes, and its vLLM mode.

    The folder is for the launch's GPUs, so a config whose device is the CPU
    (the cpu profile) exports no ``use_cpu``: accelerate gives each process
    its GPU, and ``train.py --use-cpu`` is the CPU run.
    """
    try:
        arguments = to_trl_config(config, num_processes=launch.processes)
    except UserError as error:
        if not (launch.server and launch.cluster.nodes == 1):
            raise
        raise UserError(
            f"{error.problem}; with --vllm-mode server one of the {launch.cluster.gpus}"
            f" GPUs serves and {launch.processes} train",
            "give --gpus one more than a count that splits, or --nodes 2 and up "
            "(the server gets a machine of its own)",
        ) from error
    if arguments.get("use_cpu"):
        del arguments["use_cpu"]
    if launch.server:
        arguments["vllm_mode"] = "server"
        arguments["vllm_server_port"] = VLLM_SERVER_PORT
        arguments["vllm_group_port"] = VLLM_GROUP_PORT
        arguments.pop("vllm_gpu_memory_utilization", None)  # the server's flag
    return arguments


def accelerate_configs(
    config: TrainConfig, launch: TrlLaunch | None = None
) -> dict[str, dict[str, Any]]:
    """accelerate 1.x ``accelerate config`` files, each with the launch's
    process and machine counts: one GPU or DDP, ZeRO-1/2/3 and FSDP."""
    launch = launch or TrlLaunch(Cluster())
    precision = {"bfloat16": "bf16", "float16": "fp16"}.get(config.autocast_dtype)
    common = {
        **ACCELERATE_COMMON,
        "mixed_precision": precision or "no",
        "num_machines": launch.training_machines,
        "num_processes": launch.processes,
    }
    if launch.training_machines > 1:
        common["main_process_port"] = MAIN_PROCESS_PORT
    configs: dict[str, dict[str, Any]] = {}
    if launch.processes == 1:
        configs["single_gpu.yaml"] = {**common, "distributed_type": "NO"}
    else:
        configs["multi_gpu.yaml"] = {**common, "distributed_type": "MULTI_GPU"}
    for stage, section in DEEPSPEED_STAGES.items():
        configs[f"deepspeed_zero{stage}.yaml"] = {
            **common,
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {
                "deepspeed_multinode_launcher": "standard",
                "zero_stage": stage,
                **section,
            },
        }
    configs["fsdp.yaml"] = {
        **common,
        "distributed_type": "FSDP",
        "fsdp_config": FSDP2,
    }
    return configs


def _gpu_list(first: int, count: int) -> str:
    return ",".join(str(i) for i in range(first, first + count))


def _launch_script(launch: TrlLaunch, default_config: str) -> str:
    multi = launch.training_machines > 1
    flags = (
        ' --machine_rank "${MACHINE_RANK:?set MACHINE_RANK to 0..'
        f'{launch.training_machines - 1}}}" '
        '--main_process_ip "${MAIN_PROCESS_IP:?set MAIN_PROCESS_IP to machine '
        "0's address}\" "
        f'--main_process_port "${{MAIN_PROCESS_PORT:-{MAIN_PROCESS_PORT}}}"'
        if multi
        else ""
    )
    gpus = ""
    if launch.server and not multi:
        visible = _gpu_list(0, launch.processes)
        gpus = f'export CUDA_VISIBLE_DEVICES="${{TRAIN_GPUS:-{visible}}}"\n'
    return (
        "#!/usr/bin/env bash\n"
        "# ./launch.sh [CONFIG] [train.py options]: CONFIG is one of\n"
        f"# accelerate/*.yaml without .yaml (default {default_config}).\n"
        "set -euo pipefail\n"
        'cd "$(dirname "$0")"\n'
        f'config="${{1:-{default_config}}}"\n'
        "shift || true\n"
        f"{gpus}"
        f'exec accelerate launch --config_file "accelerate/$config.yaml"{flags} '
        'train.py "$@"\n'
    )


def _serve_script(config: TrainConfig, launch: TrlLaunch) -> str:
    multi = launch.cluster.nodes > 1
    serving = launch.cluster.gpus if multi else 1
    first = 0 if multi else launch.processes
    model = "tiny_model" if config.model == "tiny" else config.model
    dtype = config.autocast_dtype or config.dtype
    command = [
        "trl",
        "vllm-serve",
        "--model",
        '"$model"',
        "--tensor-parallel-size",
        "1",
        "--data-parallel-size",
        str(serving),
        "--dtype",
        dtype,
        "--host",
        "0.0.0.0",
        "--port",
        str(VLLM_SERVER_PORT),
    ]
    return (
        "#!/usr/bin/env bash\n"
        "# TRL's vLLM server for this run (start it before ./launch.sh).\n"
        "set -euo pipefail\n"
        'cd "$(dirname "$0")"\n'
        f'model="${{MODEL:-{model}}}"\n'
        f'export CUDA_VISIBLE_DEVICES="${{VLLM_GPUS:-{_gpu_list(first, serving)}}}"\n'
        f"exec {' '.join(command)}\n"
    )


def engine_default_changes(arguments: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(argument, TRL's default, exported value) for every GRPOConfig argument
    the export sets to something other than TRL 1.16's default."""
    from trl import GRPOConfig

    defaults = {**field_defaults(GRPOConfig), **POST_INIT_DEFAULTS}
    return [
        (name, defaults[name], value)
        for name, value in sorted(arguments.items())
        if name in defaults and defaults[name] != value
    ]


def _defaults_note(arguments: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| `{name}` | `{default!r}` | `{value!r}` |"
        for name, default, value in engine_default_changes(arguments)
    )
    correction = arguments.get("vllm_importance_sampling_correction")
    is_note = (
        "TRL's vLLM importance-sampling correction is **off** "
        "(`vllm_importance_sampling_correction=False`; TRL's default is on): "
        "grpo_lab's `sampler_correction` is `none`, so the export turns it off "
        "to train what grpo_lab trains. Set `sampler_correction` (with backend "
        "vllm) to export one of TRL's four modes."
        if correction is False
        else "TRL's vLLM importance-sampling correction is **on**, with the mode "
        "and bounds of grpo_lab's `sampler_correction` (see the table)."
    )
    return (
        "## What the export changed from TRL's defaults\n\n"
        f"{is_note}\n\n"
        "Every GRPOConfig argument `grpo_config.json` sets to another value than "
        f"TRL {TESTED_TRL_VERSION}'s default:\n\n"
        "| argument | TRL's default | exported |\n|---|---|---|\n"
        f"{rows}\n"
    )


def _launch_section(launch: TrlLaunch, names: list[str]) -> str:
    default = _default_config(names)
    lines = [f"./launch.sh {Path(name).stem}" for name in names]
    text = (
        f"## Launch\n\n{launch.processes} training process(es) on "
        f"{launch.training_machines} machine(s). From this folder, with any of "
        "the accelerate configs (one line each):\n\n```\n"
        + "\n".join(lines)
        + "\n```\n\n`./launch.sh NAME` runs `accelerate launch --config_file "
        f"accelerate/NAME.yaml train.py` (default: `{default}`):\n\n```\n"
        + "\n".join(
            f"accelerate launch --config_file accelerate/{name} train.py"
            for name in names
        )
        + "\n```\n"
    )
    if launch.training_machines > 1:
        text += (
            f"\nOn each of the {launch.training_machines} machines (the same "
            "folder on each), with machine 0's address:\n\n```\n"
            + "\n".join(
                f"MACHINE_RANK={rank} MAIN_PROCESS_IP=ADDRESS_OF_MACHINE_0 "
                f"./launch.sh {default}"
                for rank in range(launch.training_machines)
            )
            + f"\n```\n\nthat is `accelerate launch ... --machine_rank R "
            f"--main_process_ip ADDRESS --main_process_port {MAIN_PROCESS_PORT} "
            "train.py`.\n"
        )
    if launch.server:
        text += _server_section(launch)
    return text


def _server_section(launch: TrlLaunch) -> str:
    if launch.cluster.nodes == 1:
        split = (
            f"GPU {launch.processes} serves (`./vllm_serve.sh`, TRL's `trl "
            f"vllm-serve`), GPUs {_gpu_list(0, launch.processes)} train "
            f"(`./launch.sh` sets CUDA_VISIBLE_DEVICES)."
        )
        start = "./vllm_serve.sh &\n./launch.sh"
    else:
        split = (
            f"the server is one more machine with {launch.cluster.gpus} GPUs "
            "(`./vllm_serve.sh` there, vLLM data-parallel over them); the "
            f"{launch.cluster.nodes} training machines reach it at VLLM_SERVER_HOST."
        )
        start = (
            "./vllm_serve.sh                               # on the server machine\n"
            "VLLM_SERVER_HOST=ADDRESS_OF_SERVER MACHINE_RANK=R "
            "MAIN_PROCESS_IP=ADDRESS_OF_MACHINE_0 ./launch.sh"
        )
    return (
        "\n## vLLM server mode\n\n"
        f'`vllm_mode="server"`: {split} train.py connects to '
        f"VLLM_SERVER_HOST (default 127.0.0.1) on port {VLLM_SERVER_PORT}. "
        "The server takes the whole GPU, so `vllm_gpu_memory_utilization` is "
        "not exported (pass `--gpu-memory-utilization` to vllm_serve.sh's "
        "command to change vLLM's 0.9).\n\n"
        f"```\n{start}\n```\n\n" + _ports_note(launch)
    )


def _ports_note(launch: TrlLaunch) -> str:
    """Which side must reach which port (TRL 1.16: trl/generation/)."""
    rendezvous = (
        f"The training machines reach machine 0 on port {MAIN_PROCESS_PORT} "
        "(accelerate's rendezvous, `--main_process_port`). "
        if launch.training_machines > 1
        else ""
    )
    return (
        "**Ports.** Only the first training process, on machine 0, talks to "
        "the server (TRL builds its `VLLMClient` on the main process only: "
        "`VLLMGeneration` in trl/generation/vllm_generation.py): it must reach "
        f"VLLM_SERVER_HOST on port {VLLM_SERVER_PORT}, the server's HTTP port "
        "(`vllm_server_port`, vllm_serve.sh's `--port`). The weight sync goes "
        "the other way: after each optimizer step the trainer sends the weights "
        "over an NCCL group in which it is rank 0, opened on machine 0 at the "
        "address vLLM's `get_ip` gives there (VLLM_HOST_IP when set) and port "
        f"{VLLM_GROUP_PORT} (`vllm_group_port`; `VLLMClient.init_communicator` "
        "in trl/generation/vllm_client.py), so every vLLM worker of the server "
        f"must reach machine 0 on port {VLLM_GROUP_PORT}; NCCL then opens more "
        "connections between the two machines on ports of its own choosing, "
        "so nothing between them may block those. "
        + rendezvous
        + "On one machine all of this stays on the machine: the ports must only "
        "be free.\n"
    )


def _default_config(names: list[str]) -> str:
    preferred = ("single_gpu.yaml", "deepspeed_zero3.yaml")
    return Path(next(n for n in preferred if n in names)).stem


def _install_section(config: TrainConfig) -> str:
    extras = "[bench,vllm]" if config.backend == "vllm" else "[bench]"
    versions = ", ".join(f"{name} {v}" for name, v in TESTED_VERSIONS.items())
    return (
        "## Install\n\n"
        + source_install(extras)
        + "\nThe `bench` extra installs trl==1.16.0 and `vllm` vllm==0.31.0. "
        f"Tested with {versions} (train.py's CPU dry run). DeepSpeed, for the "
        "`deepspeed_*` configs, is not in either extra: `pip install deepspeed`.\n"
    )


def _readme(
    config: TrainConfig,
    launch: TrlLaunch,
    arguments: dict[str, Any],
    names: list[str],
) -> str:
    reasons = grpo_lab_trainer_reasons(config, num_processes=launch.processes)
    trainer = (
        "GrpoLabTrainer (a GRPOTrainer subclass) for: " + ", ".join(reasons)
        if reasons
        else "trl.GRPOTrainer itself"
    )
    return (
        "# A grpo_lab run on TRL's GRPOTrainer\n\n"
        f"Written by `grpo-lab export trl` for TRL {TESTED_TRL_VERSION}, for "
        f"{launch.cluster.nodes} machine(s) of {launch.cluster.gpus} GPU(s). "
        "`train_config.json` is the run's TrainConfig; `grpo_config.json` holds "
        f"the GRPOConfig arguments translated from it for {launch.processes} "
        f"training process(es) (the global batch is the config's). The trainer "
        f"is {trainer}.\n\n"
        + _install_section(config)
        + "\n"
        + _launch_section(launch, names)
        + _cpu_device_note(config, launch)
        + "\nA dry run on the CPU with a small local model:\n\n```\n"
        "python train.py --model PATH --max-steps 1 --use-cpu\n```\n\n"
        "Checkpoints and the final model go to `output/` (`--output-dir DIR`).\n\n"
        + _defaults_note(arguments)
    )


def _cpu_device_note(config: TrainConfig, launch: TrlLaunch) -> str:
    if torch.device(config.device).type != "cpu":
        return ""
    return (
        f"\nThe config's device is the CPU, but this folder is for {launch.processes} "
        "GPU process(es): `use_cpu` is not exported, so accelerate gives each "
        "process its GPU; `python train.py --use-cpu` runs on the CPU.\n"
    )


def write_launch_folder(
    config: TrainConfig,
    out_dir: str | Path,
    *,
    gpus: int = 1,
    nodes: int = 1,
    vllm_mode: str = "colocate",
) -> list[Path]:
    """Write ``out_dir`` for TRL on ``nodes`` machines of ``gpus`` GPUs each:
    train.py, launch.sh, grpo_config.json, train_config.json,
    accelerate/*.yaml, README.md (vllm_serve.sh in server mode; tiny_model/
    for the tiny model; task_files/ for a task's local files).

    Raises ``UserError`` (a setting TRL cannot run, or a batch that does not
    split over the processes) or ``ValueError`` (a launch option) before
    writing anything. A run with a teacher is written for TRL's
    DistillationTrainer instead (:mod:`grpo_lab.integrations.trl.distillation`).
    """
    import yaml

    if config.teacher is not None:  # on-policy distillation: another trainer
        if (gpus, nodes) != (1, 1):
            raise ValueError(
                f"--gpus and --nodes must be 1 for an on-policy distillation run "
                f"(its folder is written for one process), got {gpus} x {nodes}"
            )
        return distillation.write_launch_folder(config, out_dir)
    launch = TrlLaunch(Cluster(gpus, nodes), vllm_mode)
    check_launch(config, launch)
    arguments = launch_arguments(config, launch)  # refuse first
    out_dir = Path(out_dir)
    (out_dir / "accelerate").mkdir(parents=True, exist_ok=True)
    portable, written = portable_config(config, out_dir)
    files = {
        out_dir / "grpo_config.json": json.dumps(arguments, indent=2, sort_keys=True),
        out_dir / "train_config.json": portable.to_json(),
    }
    configs = accelerate_configs(config, launch)
    for name, values in configs.items():
        files[out_dir / "accelerate" / name] = yaml.safe_dump(values, sort_keys=True)
    default = _default_config(list(configs))
    script = TRAIN_SCRIPT.format(
        version=TESTED_TRL_VERSION,
        default_config=default,
        processes=launch.processes,
    )
    files[out_dir / "train.py"] = script
    files[out_dir / "launch.sh"] = _launch_script(launch, default)
    if launch.server:
        files[out_dir / "vllm_serve.sh"] = _serve_script(portable, launch)
    files[out_dir / "README.md"] = _readme(config, launch, arguments, list(configs))
    for path, text in files.items():
        path.write_text(text if text.endswith("\n") else text + "\n")
        if path.suffix == ".sh":
            path.chmod(0o755)
    written = [*files, *written]
    if config.model == "tiny":
        written.append(_save_tiny_model(config, out_dir / "tiny_model"))
    return written


def _save_tiny_model(config: TrainConfig, folder: Path) -> Path:
    from grpo_lab.training.loop import tiny_model

    model, tokenizer = tiny_model(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
