"""The exported launch loads its actor in verl 0.9.1's own engine, on the CPU.

run.sh is run with ``python -m verl.trainer.main_ppo`` caught by a stub (every
other ``python`` call is the real one), so the overrides are exactly those a
cluster's verl would get, the attention chosen by run.sh on this machine. They
are composed with verl's ``ppo_trainer.yaml``, and the actor is built as
``ActorRolloutRefWorker.init_model`` (verl/workers/engine_workers.py) builds it:
``HFModelConfig`` and ``FSDPActorConfig`` from the composed config, the model's
remove-padding copied into the engine config, then the FSDP engine's
constructor and ``_build_module`` (verl/workers/engine/fsdp/transformer_impl.py:
``from_pretrained`` with the config's attention, verl's monkey patches). Only
the FSDP wrapping and the optimizer (``_build_fsdp_module``, CUDA-only) are left
out. verl has no CPU platform, so one is set through its platform plugin point
(``verl.plugin.platform.set_platform``) for the length of this module.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    import verl
except ImportError:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("verl is not installed (make .venv-verl)", allow_module_level=True)

from hydra import compose, initialize_config_dir
from tensordict import TensorDict
from verl.plugin.platform import PlatformBase, platform_manager
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass

from grpo_lab.integrations.verl.launch import write_launch_folder
from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.training.config import TrainConfig

ATTENTION_KEY = "actor_rollout_ref.model.override_config.attn_implementation"


class CPUPlatform(PlatformBase):
    """verl's platform interface answered for the CPU (gloo, no device)."""

    device_name = "cpu"
    vendor_name = "cpu"
    device_module = torch.cpu

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


@pytest.fixture(scope="module")
def on_cpu(tmp_path_factory):
    """verl on the CPU platform, in a one-process gloo group."""
    before = platform_manager._current_platform
    platform_manager.set_platform(CPUPlatform())
    store = tmp_path_factory.mktemp("gloo") / "store"
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    yield
    torch.distributed.destroy_process_group()
    platform_manager._current_platform = before


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A launch folder of a tiny local Qwen2 (copied into its model/)."""
    root = tmp_path_factory.mktemp("actor")
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(
        tokenizer, hidden_size=32, num_layers=2, intermediate_size=64, seed=0
    )
    model.save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    config = TrainConfig.for_profile(
        "gpu",
        model=str(root / "tiny"),
        task="reverse",
        task_options={"n_digits": 3},
        steps=2,
        eval_size=8,
        sft_max_steps=0,
        train_batch_size=16,
        gradient_accumulation_steps=2,
    )
    write_launch_folder(config, root / "launch")
    return root / "launch"


def run_sh_overrides(folder: Path, tmp_path: Path) -> list[str]:
    """The Hydra overrides run.sh hands ``python -m verl.trainer.main_ppo``."""
    caught = tmp_path / "main_ppo_arguments.txt"
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "python").write_text(
        "#!/bin/sh\n"
        'if [ "$1 $2" = "-m verl.trainer.main_ppo" ]; then\n'
        f'  shift 2; printf "%s\\n" "$@" > "{caught}"; exit 0\n'
        "fi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    (stub / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}{os.pathsep}{os.environ['PATH']}"}
    root = str(Path(__file__).resolve().parents[2])  # this checkout's grpo_lab
    paths = [root, os.environ.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    subprocess.run([str(folder / "run.sh")], env=env, check=True)
    return caught.read_text().splitlines()


def compose_overrides(overrides: list[str]):
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def build_actor(cfg):
    """(engine, module): init_model's actor, up to the FSDP wrapping."""
    from verl.workers.config import HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    model_config: HFModelConfig = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    actor_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    actor_config.model_config = model_config
    engine_config = actor_config.engine
    engine_config.use_remove_padding = model_config.get("use_remove_padding", False)
    engine = FSDPEngineWithLMHead(
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=actor_config.optim,
        checkpoint_config=actor_config.checkpoint,
    )
    module = engine._build_module()
    engine.module = module
    return engine, module


def verl_log_probs(engine, module, sequences, remove_padding: bool) -> list:
    """forward_step's body (without autocast): verl packs or pads the batch."""
    nested = torch.nested.as_nested_tensor(sequences, layout=torch.jagged)
    positions = [torch.arange(len(s)) for s in sequences]
    micro_batch = TensorDict(
        {
            "input_ids": nested,
            "position_ids": torch.nested.as_nested_tensor(
                positions, layout=torch.jagged
            ),
            "temperature": torch.ones(len(sequences)),
        },
        batch_size=[len(sequences)],
    )
    tu.assign_non_tensor(micro_batch, use_remove_padding=remove_padding)
    with torch.no_grad():
        inputs, arguments = engine.prepare_model_inputs(micro_batch)
        output = module(**inputs, use_cache=False)
        result = engine.prepare_model_outputs(output, arguments, micro_batch, None)
    return list(result["log_probs"].unbind())


def hf_log_probs(model_dir: Path, sequences) -> list:
    """Each sequence alone through transformers in float64 (eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float64, attn_implementation="eager"
    )
    out = []
    with torch.no_grad():
        for ids in sequences:
            logits = model(ids[None]).logits[0, :-1]
            out.append(logits.log_softmax(-1).gather(-1, ids[1:, None])[:, 0])
    return out


def prompts(folder: Path, tokenizer, count: int) -> list[torch.Tensor]:
    lines = (folder / "data" / "train.jsonl").read_text().splitlines()[:count]
    texts = [json.loads(line)["prompt"][0]["content"] for line in lines]
    # Different lengths, so that packing and padding differ.
    return [torch.tensor(tokenizer.encode(t + t[: i + 1])) for i, t in enumerate(texts)]


@pytest.fixture(scope="module")
def run_sh_arguments(exported, tmp_path_factory) -> list[str]:
    return run_sh_overrides(exported, tmp_path_factory.mktemp("run_sh"))


def test_the_actor_loads_with_run_shs_attention_and_its_packed_forward_is_exact(
    on_cpu, exported, run_sh_arguments
):
    assert importlib.util.find_spec("flash_attn") is None  # as on CI
    engine, module = build_actor(compose_overrides(run_sh_arguments))
    assert f"++{ATTENTION_KEY}=sdpa" in run_sh_arguments
    assert "++actor_rollout_ref.model.use_remove_padding=true" in run_sh_arguments
    assert module.config._attn_implementation == "sdpa"
    assert engine.use_remove_padding
    sequences = prompts(exported, engine.model_config.tokenizer, 3)
    assert len({len(s) for s in sequences}) == 3
    packed = verl_log_probs(engine, module, sequences, remove_padding=True)
    padded = verl_log_probs(engine, module, sequences, remove_padding=False)
    expected = hf_log_probs(exported / "model", sequences)
    for ours, unpacked, reference in zip(packed, padded, expected, strict=True):
        # Position t holds log p(token t+1); the last one wraps to the next row.
        assert torch.allclose(ours[:-1].double(), reference, atol=1e-5, rtol=0)
        assert torch.allclose(unpacked[:-1].double(), reference, atol=1e-5, rtol=0)


def test_verls_default_attention_does_not_load_without_flash_attn(
    on_cpu, run_sh_arguments
):
    """Without run.sh's attention line verl asks for flash-attn, which is absent."""
    default = [line for line in run_sh_arguments if ATTENTION_KEY not in line]
    with pytest.raises(ImportError, match="FlashAttention2 has been toggled on"):
        build_actor(compose_overrides(default))


def test_the_launch_asks_for_flash_attn_where_the_machine_has_it(tmp_path, monkeypatch):
    from grpo_lab.integrations.verl.launch import launch_attention

    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))  # flash_attn is now importable
    assert launch_attention() == [
        f"++{ATTENTION_KEY}=flash_attention_2",
        "++actor_rollout_ref.model.use_remove_padding=true",
    ]
