"""grpo_lab's losses and estimators inside verl 0.9.1, and the exported launch.

Runs with the verl environment (``make test``); with CI=true a missing verl is a
failure, not a skip. Every loss is fetched from verl's own registry after verl
loaded the plugin from its entry point, and compared in float64 (values and
gradients) with grpo_lab's functions and, where they coincide, verl's built-ins.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

try:
    import verl  # loads the entry points of "verl.plugins"
except ImportError:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("verl is not installed (make .venv-verl)", allow_module_level=True)

# Recorded before anything here imports the plugin: verl itself loaded it.
LOADED_BY_VERL = "grpo_lab.integrations.verl.algorithms" in sys.modules

from hydra import compose, initialize_config_dir  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402

from grpo_lab.advantages import compute_group_normalized_rewards  # noqa: E402
from grpo_lab.aggregation import aggregate_loss_across_microbatch  # noqa: E402
from grpo_lab.losses import (  # noqa: E402
    CAPPED_METHODS,
    EVERY_ROW_METHODS,
    OBJECTIVES,
    TRUNCATED_METHODS,
    compute_policy_gradient_loss,
)
from grpo_lab.training.config import TrainConfig  # noqa: E402

# GRPO_LAB_VERL_NOTES=FILE writes the table of differences there after the module.
NOTES = os.environ.get("GRPO_LAB_VERL_NOTES")
PARITY: dict[str, tuple[float, float]] = {}
B, T, G = 8, 7, 4
CLIP = {"grpo": 0.2, "gspo": 0.05, "cispo": 0.2, "gmpo": 0.4}


def actor_config(**changes) -> FSDPActorConfig:
    if isinstance(changes.get("policy_loss"), dict):  # verl's own class, built
        changes["policy_loss"] = PolicyLossConfig(**changes["policy_loss"])
    values = {
        "strategy": "fsdp",
        "rollout_n": G,
        "ppo_micro_batch_size_per_gpu": 2,
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "clip_ratio_c": 3.0,
        **changes,
    }
    return FSDPActorConfig(**values)


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6, 2, 7, 4])
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    old = -torch.rand(B, T, generator=generator, dtype=torch.float64) * 2
    log_prob = old + torch.randn(B, T, generator=generator, dtype=torch.float64) * 0.6
    log_prob[1, 0] = old[1, 0] + 2.0  # a ratio above the dual-clip cap
    rows = torch.randn(B, 1, generator=generator, dtype=torch.float64)
    rows[1] = -1.0
    return {"old": old, "log_prob": log_prob, "mask": mask, "row_advantages": rows}


def plugin_loss(name, data, mode, config, rows=slice(None)):
    log_prob = data["log_prob"][rows].clone().requires_grad_(True)
    mask = data["mask"][rows]
    advantages = data["row_advantages"][rows] * mask  # (b, T), as verl gives them
    torch.manual_seed(0)  # Clip-Cov draws with the global generator, as verl's
    loss, metrics = core_algos.get_policy_loss_fn(name)(
        old_log_prob=data["old"][rows],
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=mode,
        config=config,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, metrics


def reference_loss(method, data, mode, config):
    """grpo_lab's own functions on the whole batch, verl's mode translated."""
    log_prob = data["log_prob"].clone().requires_grad_(True)
    mask = data["mask"]
    cap = (
        None
        if method not in CAPPED_METHODS | TRUNCATED_METHODS
        or math.isinf(config.clip_ratio_c)
        else config.clip_ratio_c
    )
    per_token, _ = compute_policy_gradient_loss(
        data["row_advantages"],
        log_prob,
        method,
        data["old"],
        config.clip_ratio_low,
        mask,
        cliprange_high=config.clip_ratio_high,
        ratio_cap=cap,
        sapo_temperature_pos=config.tau_pos,
        sapo_temperature_neg=config.tau_neg,
    )
    normalization, constant = {
        "token-mean": ("token", None),
        "seq-mean-token-mean": ("sequence", None),
        "seq-mean-token-sum": ("constant", B),
        "seq-mean-token-sum-norm": ("constant", B * 5),
        "token-sum": ("constant", 1),
    }[mode]
    loss = aggregate_loss_across_microbatch(
        per_token, mask.double(), normalization, constant
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad


def record(key: str, value_delta: float, grad_delta: float) -> None:
    PARITY[key] = (value_delta, grad_delta)


def delta(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module", autouse=True)
def parity_notes():
    yield
    if not PARITY:
        return
    lines = [
        "grpo_lab inside verl 0.9.1: max |delta| in float64 (value, gradient wrt log pi)",
        f"{'comparison':<64} {'value':>10} {'grad':>10}",
    ]
    lines += [f"{k:<64} {v:10.2e} {g:10.2e}" for k, (v, g) in sorted(PARITY.items())]
    if NOTES:
        Path(NOTES).write_text("\n".join(lines) + "\n")


def test_verl_loaded_the_plugin_from_its_entry_point():
    assert LOADED_BY_VERL
    for method in OBJECTIVES:
        assert f"grpo_lab_{method}" in core_algos.POLICY_LOSS_REGISTRY
    assert "grpo_lab_maxrl" in core_algos.ADV_ESTIMATOR_REGISTRY


def test_registration_is_idempotent():
    import importlib

    import grpo_lab.integrations.verl.algorithms as plugin

    before = dict(core_algos.ADV_ESTIMATOR_REGISTRY)
    plugin.register()
    importlib.reload(plugin)  # new function objects: verl would refuse a re-register
    assert before == core_algos.ADV_ESTIMATOR_REGISTRY


MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)


# Clip-Cov and KL-Cov select tokens within each micro-batch, as verl's do: their
# loss is not the full batch's (tests/verl/test_verl_new_objectives.py splits
# both sides alike).
@pytest.mark.parametrize(
    "method", tuple(m for m in OBJECTIVES if m not in EVERY_ROW_METHODS)
)
@pytest.mark.parametrize("mode", MODES)
def test_loss_matches_grpo_lab_with_global_counts(method, mode):
    """Two micro-batches on each of two ranks, weighted by verl's global counts,
    add up (after the data-parallel average) to grpo_lab's full-batch loss."""
    data = batch()
    clip = CLIP.get(method, 0.2)
    config = actor_config(
        clip_ratio_low=clip, clip_ratio_high=clip * 1.4, loss_scale_factor=5
    )
    expected, expected_grad = reference_loss(method, data, mode, config)
    info = {
        "dp_size": 2,
        "batch_num_tokens": int(data["mask"].sum()),
        "global_batch_size": B,
        "loss_scale_factor": 5,
    }
    config.global_batch_info.update(info)
    total, grad = (
        torch.zeros((), dtype=torch.float64),
        torch.zeros(B, T, dtype=torch.float64),
    )
    for start in range(0, B, 2):  # ranks 0, 1 hold rows 0-3, 4-7; micro-batches of 2
        rows = slice(start, start + 2)
        loss, micro_grad, metrics = plugin_loss(
            f"grpo_lab_{method}", data, mode, config, rows
        )
        total += loss / 2  # the data-parallel all-reduce averages the ranks
        grad[rows] = micro_grad / 2
    assert "actor/ppo_kl" in metrics
    record(
        f"grpo_lab_{method} vs grpo_lab, {mode}, dp 2",
        delta(total, expected),
        delta(grad, expected_grad),
    )
    assert torch.allclose(total, expected, rtol=1e-12, atol=1e-12)
    assert torch.allclose(grad, expected_grad, rtol=1e-12, atol=1e-12)


BUILT_INS = (
    ("grpo", "vanilla", "token-mean", {}),
    ("grpo", "vanilla", "seq-mean-token-mean", {}),
    (
        "gspo",
        "gspo",
        "seq-mean-token-mean",
        {"clip_ratio_c": math.inf, "clip_ratio_low": 0.05, "clip_ratio_high": 0.07},
    ),
    ("sapo", "sapo", "seq-mean-token-mean", {"tau_pos": 1.3, "tau_neg": 1.6}),
    ("cispo", "cispo", "token-mean", {}),
    (
        "gmpo",
        "geo_mean",
        "seq-mean-token-mean",
        {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4},
    ),
)


@pytest.mark.parametrize(("method", "built_in", "mode", "changes"), BUILT_INS)
def test_loss_matches_verl_built_in(method, built_in, mode, changes):
    data = batch(seed=1)
    config = actor_config(**changes)
    ours, our_grad, _ = plugin_loss(f"grpo_lab_{method}", data, mode, config)
    theirs, their_grad, _ = plugin_loss(built_in, data, mode, config)
    record(
        f"grpo_lab_{method} vs verl {built_in}, {mode}",
        delta(ours, theirs),
        delta(our_grad, their_grad),
    )
    # verl's sequence mode divides by length + 1e-8 (grpo_lab: max(length, 1)).
    assert torch.allclose(ours, theirs, rtol=1e-7, atol=1e-10)
    assert torch.allclose(our_grad, their_grad, rtol=1e-7, atol=1e-10)


def test_sequence_objectives_refuse_token_varying_advantages():
    data = batch()
    log_prob = data["log_prob"].clone().requires_grad_(True)
    advantages = torch.randn(B, T, dtype=torch.float64) * data["mask"]
    with pytest.raises(ValueError, match="constant over each response"):
        core_algos.get_policy_loss_fn("grpo_lab_gspo")(
            data["old"],
            log_prob,
            advantages,
            data["mask"],
            "token-mean",
            actor_config(),
        )


def rewards_and_index(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 2, (12,), generator=generator).double()
    scores[:4] = torch.tensor([1.0, 0.0, 0.0, 0.0])
    uids = ["a", "b", "c"]
    order = torch.randperm(12, generator=generator)
    index = [uids[i // 4] for i in order.tolist()]  # verl shuffles the rows
    mask = torch.arange(5)[None, :] < torch.randint(1, 6, (12, 1), generator=generator)
    token_rewards = torch.zeros(12, 5, dtype=torch.float64)
    lengths = mask.sum(dim=1)
    token_rewards[torch.arange(12), lengths - 1] = scores[order]
    return token_rewards, mask.double(), index, scores, order


def test_every_estimator_matches_grpo_lab():
    import grpo_lab.integrations.verl.algorithms as plugin

    token_rewards, mask, index, scores, order = rewards_and_index()
    for name, (baseline, normalizer) in plugin.estimator_pairs().items():
        estimator = core_algos.get_adv_estimator_fn(name)
        advantages, returns = estimator(
            token_level_rewards=token_rewards,
            response_mask=mask,
            index=index,
            config=AlgoConfig(),
        )
        lengths = mask.sum(dim=1)[order.argsort()]  # in grpo_lab's row order
        expected, _ = compute_group_normalized_rewards(
            scores, 4, baseline, 1e-6, normalizer,
            response_lengths=lengths if normalizer == "token_whiten" else None,
        )  # fmt: skip
        expected = expected[order].unsqueeze(-1) * mask
        record(f"{name} vs grpo_lab advantages", delta(advantages, expected), 0.0)
        assert torch.allclose(advantages, expected, rtol=1e-12, atol=1e-12)
        assert torch.equal(advantages, returns)


@pytest.mark.parametrize(
    ("name", "built_in", "keywords", "tolerance"),
    [
        ("grpo_lab_mean_std", "grpo", {}, 1e-10),
        ("grpo_lab_mean_none", "grpo", {"norm_adv_by_std_in_grpo": False}, 1e-10),
        ("grpo_lab_leave_one_out_none", "rloo", {}, 1e-10),
        # verl's vectorized group statistics are float32.
        ("grpo_lab_mean_std", "grpo_vectorized", {}, 1e-6),
        ("grpo_lab_leave_one_out_none", "rloo_vectorized", {}, 1e-6),
    ],
)
def test_estimator_matches_verl_built_in(name, built_in, keywords, tolerance):
    token_rewards, mask, index, _, _ = rewards_and_index(seed=2)
    ours, _ = core_algos.get_adv_estimator_fn(name)(
        token_level_rewards=token_rewards,
        response_mask=mask,
        index=index,
        config=AlgoConfig(),
    )
    theirs, _ = core_algos.get_adv_estimator_fn(built_in)(
        token_level_rewards=token_rewards.clone(),
        response_mask=mask,
        index=index,
        config=AlgoConfig(),
        **keywords,
    )
    record(
        f"{name} vs verl {built_in} {keywords or ''}".strip(), delta(ours, theirs), 0.0
    )
    assert torch.allclose(ours, theirs, rtol=tolerance, atol=tolerance)


# --- the exported launch -----------------------------------------------------------


def gpu_config(**changes) -> TrainConfig:
    values = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "task": "reverse",
        "task_options": {"n_digits": 5},
        "steps": 3,
        "eval_size": 8,
        "sft_max_steps": 0,
        "importance_reweighting_method": "gmpo",
        "cliprange": 0.4,
        "cliprange_high": 0.5,
        "advantage_normalizer": "mean",
        "loss_normalization": "token",
        "kl_coef": 0.01,
        "train_batch_size": 128,
        "gradient_accumulation_steps": 16,
        **changes,
    }
    return TrainConfig.for_profile("gpu", **values)


def compose_exported(folder: Path):
    lines = (folder / "overrides.txt").read_text().splitlines()
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=lines)


def test_exported_folder_composes_and_validates_in_verl(tmp_path):
    from verl.utils.config import validate_config

    from grpo_lab.integrations.verl.algorithms import objective_options
    from grpo_lab.integrations.verl.launch import write_launch_folder

    files = write_launch_folder(gpu_config(), tmp_path)
    assert {p.name for p in files} >= {"overrides.txt", "run.sh", "README.md"}
    script = (tmp_path / "run.sh").read_text()
    assert "python -m verl.trainer.main_ppo" in script
    assert "VERL_USE_EXTERNAL_MODULES" in script
    cfg = compose_exported(tmp_path)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    algorithm = omega_conf_to_dataclass(cfg.algorithm)
    validate_config(cfg, use_reference_policy=True, use_critic=False)
    assert actor.policy_loss.loss_mode == "grpo_lab_gmpo"
    assert algorithm.adv_estimator == "grpo_lab_maxrl"
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.4, 0.5)
    assert actor.clip_ratio_c == math.inf and actor.loss_agg_mode == "token-mean"
    assert actor.ppo_mini_batch_size == 16 and cfg.actor_rollout_ref.rollout.n == 8
    assert actor.ppo_epochs == 1 and actor.use_kl_loss and actor.kl_loss_coef == 0.01
    assert actor.ppo_micro_batch_size_per_gpu == 8 and cfg.data.train_batch_size == 32
    template = cfg.actor_rollout_ref.model.custom_chat_template
    assert template == "{% for message in messages %}{{ message.content }}{% endfor %}"
    # The composed losses read the exported clip range through verl's own classes.
    options = objective_options("gmpo", actor)
    assert (options.cliprange, options.upper_cliprange) == (0.4, 0.5)
    # The reward file scores through the task.
    namespace: dict = {"__file__": str(tmp_path / "data" / "reward.py")}
    exec((tmp_path / "data" / "reward.py").read_text(), namespace)
    first = (tmp_path / "data" / "train.jsonl").read_text().splitlines()[0]
    truth = json.loads(first)["reward_model"]["ground_truth"]
    assert namespace["compute_score"]("grpo_lab/reverse", truth, truth) == 1.0


def test_exported_gdpo_composes_and_reads_the_reward_parts(tmp_path):
    from grpo_lab.integrations.verl.launch import write_launch_folder

    config = gpu_config(
        reward_aggregation="normalize_then_sum_tokens", advantage_normalizer="std"
    )
    write_launch_folder(config, tmp_path)
    algorithm = omega_conf_to_dataclass(compose_exported(tmp_path).algorithm)
    assert algorithm.adv_estimator == "gdpo" and algorithm.norm_adv_by_std_in_grpo
    assert list(algorithm.gdpo_reward_keys) == ["format_reward", "answer_reward"]


def test_constant_normalization_exports_loss_scale_factor(tmp_path):
    from grpo_lab.integrations.verl.launch import write_launch_folder

    config = gpu_config(
        loss_normalization="constant", normalization_constant=128 * 1024
    )
    write_launch_folder(config, tmp_path)
    actor = omega_conf_to_dataclass(compose_exported(tmp_path).actor_rollout_ref.actor)
    assert (
        actor.loss_agg_mode == "seq-mean-token-sum-norm"
        and actor.loss_scale_factor == 1024
    )
    with pytest.raises(ValueError, match="normalization_constant"):
        write_launch_folder(
            gpu_config(loss_normalization="constant", normalization_constant=1000),
            tmp_path,
        )


@pytest.mark.parametrize(
    ("name", "changes"),
    [
        ("advantage_eps", {"advantage_eps": 1e-4}),
        ("nan_rewards", {"nan_rewards": "ignore"}),
        ("kl_importance_weighting", {"kl_importance_weighting": True}),
        ("top_entropy_quantile", {"top_entropy_quantile": 0.2}),
        ("sft_max_steps", {"sft_max_steps": 5}),
        ("device", {"device": "cpu", "backend": "hf"}),
        ("model", {"model": "tiny"}),
    ],
)
def test_settings_verl_cannot_carry_are_refused(tmp_path, name, changes):
    from grpo_lab.integrations.verl.launch import write_launch_folder

    with pytest.raises(ValueError, match=f"^{name} "):
        write_launch_folder(gpu_config(**changes), tmp_path)
    assert not (tmp_path / "overrides.txt").exists()


def test_every_train_config_field_is_mapped_or_explained():
    from grpo_lab.integrations.verl.launch import (
        EXPORTED_SETTINGS,
        NOT_TRAINING_SETTINGS,
    )

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not set(EXPORTED_SETTINGS) & set(NOT_TRAINING_SETTINGS)
    # A field in neither is refused unless default (tests/test_unrowed.py).
    assert set(EXPORTED_SETTINGS) | set(NOT_TRAINING_SETTINGS) <= names
    assert all(reason.strip() for reason in NOT_TRAINING_SETTINGS.values())


# --- one GPU to many nodes --------------------------------------------------------


def rollout_replicas(cfg) -> int:
    """How many vLLM replicas verl 0.9.1 starts: world size // rollout world
    size, as verl.workers.rollout.llm_server.LLMServerManager counts them."""
    rollout = cfg.actor_rollout_ref.rollout
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    size = (
        rollout.tensor_model_parallel_size
        * rollout.data_parallel_size
        * rollout.pipeline_model_parallel_size
    )
    return world // size


def test_one_gpu_export_starts_a_rollout_engine_where_verls_default_would_not(
    tmp_path,
):
    from grpo_lab.integrations.verl.launch import write_launch_folder

    write_launch_folder(gpu_config(), tmp_path)
    cfg = compose_exported(tmp_path)
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == 1
    assert (cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes) == (1, 1)
    assert rollout_replicas(cfg) == 1
    lines = (tmp_path / "overrides.txt").read_text().splitlines()
    without = [line for line in lines if "tensor_model_parallel_size" not in line]
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        default = compose(config_name="ppo_trainer", overrides=without)
    assert default.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    assert rollout_replicas(default) == 0  # verl's default: no engine on one GPU


def test_eight_gpus_on_two_nodes_compose_and_validate(tmp_path):
    from verl.utils.config import validate_config

    from grpo_lab.integrations.verl.launch import write_launch_folder

    write_launch_folder(gpu_config(), tmp_path, gpus=8, nodes=2)
    cfg = compose_exported(tmp_path)
    validate_config(cfg, use_reference_policy=True, use_critic=False)
    assert (cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes) == (8, 2)
    assert rollout_replicas(cfg) == 16
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    # 128 responses a step over 16 GPUs: 8 per GPU, in micro-batches of 8.
    responses = actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
    assert responses % 16 == 0
    assert (responses // 16) % actor.ppo_micro_batch_size_per_gpu == 0
    script = (tmp_path / "ray_cluster.sh").read_text()
    assert "ray start --head --port=6379 --num-gpus=8" in script
    assert 'ray start --address="$HEAD_ADDRESS:6379" --num-gpus=8' in script
    assert 'RAY_ADDRESS="${RAY_ADDRESS:-auto}"' in (tmp_path / "run.sh").read_text()


def test_the_defaults_the_readme_compares_against_are_verls(tmp_path):
    from grpo_lab.integrations.verl.launch import VERL_DEFAULTS

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        default = compose(config_name="ppo_trainer")
    for key, value in VERL_DEFAULTS.items():
        node = default
        for part in key.split("."):
            node = node[part]
        assert node == value, key


def test_run_sh_makes_the_relative_paths_absolute_where_it_runs(tmp_path):
    import subprocess

    from grpo_lab.integrations.verl.launch import write_launch_folder

    write_launch_folder(gpu_config(), tmp_path / "made")
    moved = tmp_path / "moved"
    (tmp_path / "made").rename(moved)  # the folder copied to a cluster
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    (stub / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(
        [str(moved / "run.sh")], capture_output=True, text=True, env=env, check=True
    ).stdout.splitlines()
    assert f"data.train_files={moved}/data/train.jsonl" in out
    assert f"reward.custom_reward_function.path={moved}/data/reward.py" in out
    assert f"trainer.default_local_dir={moved}/checkpoints" in out


# --- verl rows and their conditions --------------------------------------------


def test_gspo_sets_loss_agg_mode_explicitly_and_verl_follows_it(tmp_path):
    from grpo_lab.integrations.verl.launch import write_launch_folder

    for normalization, mode in (
        ("token", "token-mean"),
        ("sequence", "seq-mean-token-mean"),
    ):
        config = gpu_config(
            importance_reweighting_method="gspo",
            cliprange=0.05,
            cliprange_high=None,
            loss_normalization=normalization,
        )
        folder = tmp_path / normalization
        write_launch_folder(config, folder)
        assert (
            f"actor_rollout_ref.actor.loss_agg_mode={mode}"
            in (folder / "overrides.txt").read_text().splitlines()
        )
        actor = omega_conf_to_dataclass(
            compose_exported(folder).actor_rollout_ref.actor
        )
        assert actor.loss_agg_mode == mode
        # verl 0.9.1's gspo aggregates by the mode it is given, as grpo_lab's does.
        data = batch(seed=3)
        changes = {"clip_ratio_c": math.inf, "clip_ratio_low": 0.05}
        ours, our_grad, _ = plugin_loss(
            "grpo_lab_gspo", data, mode, actor_config(**changes)
        )
        theirs, their_grad, _ = plugin_loss("gspo", data, mode, actor_config(**changes))
        assert torch.allclose(ours, theirs, rtol=1e-7, atol=1e-10), mode
        assert torch.allclose(our_grad, their_grad, rtol=1e-7, atol=1e-10), mode
    other = plugin_loss("gspo", data, "token-mean", actor_config(**changes))[0]
    assert not torch.allclose(other, theirs)  # the mode changes verl's gspo


def weighted_loss(name, data, mode, config, weights):
    log_prob = data["log_prob"].clone().requires_grad_(True)
    loss, _ = core_algos.get_policy_loss_fn(name)(
        old_log_prob=data["old"], log_prob=log_prob,
        advantages=data["row_advantages"] * data["mask"], response_mask=data["mask"],
        loss_agg_mode=mode, config=config, rollout_is_weights=weights,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad


@pytest.mark.parametrize(
    ("case", "name", "built_in", "mode", "changes", "weights"),
    [
        # verl's gspo has no dual clip: grpo_lab's gspo with verl's default 3.0 caps.
        ("gspo, clip_ratio_c 3.0", "grpo_lab_gspo", "gspo", "seq-mean-token-mean",
         {"clip_ratio_c": 3.0, "clip_ratio_low": 0.05, "clip_ratio_high": 0.07},
         None),
        # Token-level IS weights: verl weighs each token's GSPO-token term,
        # grpo_lab scales the sequence's loss by the weights' mean.
        ("gspo, token-level IS weights", "grpo_lab_gspo", "gspo",
         "seq-mean-token-mean",
         {"clip_ratio_c": math.inf, "clip_ratio_low": 0.05, "clip_ratio_high": 0.07},
         "token"),
        # verl's sapo always aggregates by seq-mean-token-mean.
        ("sapo, token-mean", "grpo_lab_sapo", "sapo", "token-mean",
         {"tau_pos": 1.3, "tau_neg": 1.6}, None),
        # verl's geo_mean takes its micro-batch's row mean whatever the mode.
        ("geo_mean, token-mean", "grpo_lab_gmpo", "geo_mean", "token-mean",
         {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}, None),
    ],
)  # fmt: skip
def test_verl_built_ins_differ_outside_their_conditions(
    case, name, built_in, mode, changes, weights
):
    data = batch(seed=1)
    data["log_prob"][0] = data["old"][0] + 2.0  # a (sequence) ratio of e^2 > 3
    data["row_advantages"][0] = -1.0
    config = actor_config(**changes)
    if weights == "token":
        generator = torch.Generator().manual_seed(5)
        weights = 0.5 + torch.rand(B, T, generator=generator, dtype=torch.float64)
    ours, our_grad = weighted_loss(name, data, mode, config, weights)
    theirs, their_grad = weighted_loss(built_in, data, mode, config, weights)
    record(f"differs: {case}", delta(ours, theirs), delta(our_grad, their_grad))
    assert delta(our_grad, their_grad) > 1e-6, case


def test_geo_mean_ignores_the_global_batch_counts():
    data = batch(seed=1)
    config = actor_config(clip_ratio_low=0.4, clip_ratio_high=0.4)
    config.global_batch_info.update(
        {
            "dp_size": 2,
            "global_batch_size": B,
            "batch_num_tokens": int(data["mask"].sum()),
        }
    )
    rows = slice(0, 2)  # one of four micro-batches (two ranks x two)
    ours, _, _ = plugin_loss("grpo_lab_gmpo", data, "seq-mean-token-mean", config, rows)
    theirs, _, _ = plugin_loss("geo_mean", data, "seq-mean-token-mean", config, rows)
    # grpo_lab: the rows' share of the global batch (2 / 8) x dp 2; verl: the
    # micro-batch's own mean.
    assert torch.allclose(ours, theirs * 2 / B * 2, rtol=1e-7, atol=1e-12)
    record("differs: geo_mean with global counts (ratio)", delta(ours, theirs), 0.0)


def test_kl_estimators_match_verls_and_k3_differs_where_verl_clamps_it():
    from grpo_lab.kl import compute_kl_penalty

    log_prob = torch.tensor([[-2.0, -14.0]], dtype=torch.float64)
    reference = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)  # log r 0.5, 13
    for ours_name, verl_name in (("k1", "kl"), ("k2", "mse")):
        ours = compute_kl_penalty(log_prob, reference, ours_name)
        theirs = core_algos.kl_penalty(log_prob, reference, verl_name)
        assert torch.allclose(ours, theirs, rtol=1e-12, atol=0), ours_name
    ours = compute_kl_penalty(log_prob, reference, "k3")
    theirs = core_algos.kl_penalty(log_prob, reference, "low_var_kl")
    assert torch.allclose(ours[0, 0], theirs[0, 0], rtol=1e-12)  # below the clamp
    assert theirs[0, 1] == 10.0 and ours[0, 1] > 10.0  # e^13 - 14 against 10
    record("differs: k3 above 10 (low_var_kl clamps)", delta(ours, theirs), 0.0)


def test_verls_optimizer_decays_every_parameter():
    from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    optimizer = build_optimizer(
        model.parameters(), FSDPOptimizerConfig(lr=1e-3, weight_decay=0.1)
    )
    decayed = [p for g in optimizer.param_groups if g["weight_decay"] == 0.1
               for p in g["params"]]  # fmt: skip
    assert len(decayed) == len(list(model.parameters())) == 4  # biases, norm too


# --- the translation table's claims, read from the table itself -------------------------

TABLE = Path(__file__).resolve().parents[2] / "docs" / "translation_table.md"
# Each objective row of the table (its first cell), the grpo_lab objective and
# the verl built-in it is measured against, and the settings the row states.
TABLE_ROWS = {
    '`importance_reweighting_method="grpo"`, `cliprange`': ("grpo", "vanilla", {}),
    "`cliprange_high`": ("grpo", "vanilla", {"clip_ratio_high": 0.28}),
    "`ratio_cap`": ("grpo", "vanilla", {"clip_ratio_c": 3.0}),
    '`importance_reweighting_method="gspo"`': (
        "gspo",
        "gspo",
        {"clip_ratio_c": math.inf, "clip_ratio_low": 0.05, "clip_ratio_high": 0.07},
    ),
    '`importance_reweighting_method="cispo"`, `cliprange`, `cliprange_high`': (
        "cispo",
        "cispo",
        {},
    ),
    '`importance_reweighting_method="sapo"`, `sapo_temperature_pos`, '
    "`sapo_temperature_neg`": ("sapo", "sapo", {"tau_pos": 1.3, "tau_neg": 1.6}),
    '`importance_reweighting_method="gmpo"`, `cliprange`, `cliprange_high` '
    "(on log w)": (
        "gmpo",
        "geo_mean",
        {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4},
    ),
    '`importance_reweighting_method="dppo_tv"`, `cliprange`, `cliprange_high`, '
    "`ratio_cap`": (
        "dppo_tv",
        "dppo_tv",
        {"clip_ratio_low": 0.1, "clip_ratio_high": 0.15},
    ),
    '`importance_reweighting_method="dppo_kl"`, `cliprange`, `cliprange_high`, '
    "`ratio_cap`": (
        "dppo_kl",
        "dppo_kl",
        {"clip_ratio_low": 0.05, "clip_ratio_high": 0.08},
    ),
    '`importance_reweighting_method="clip_cov"`, `covariance_fraction`, '
    "`clip_cov_low`, `clip_cov_high`": (
        "clip_cov",
        "clip_cov",
        {"policy_loss": {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.02}},
    ),
    '`importance_reweighting_method="kl_cov"`, `covariance_fraction`, `kl_cov_coef`': (
        "kl_cov",
        "kl_cov",
        {"policy_loss": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.5}},
    ),
}
MODE_LIST = r"((?:`[a-z-]+`(?:, | and )?)+)"
ONE_MICRO_BATCH = " on one micro-batch of one rank"


def table_claims() -> dict[str, dict[str, list[str]]]:
    """{first cell: {"exact": modes, "exact_one": modes, "differs": modes}} of
    the objective rows: what each row says of verl, mode by mode."""
    import re

    claims = {}
    for line in TABLE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if cells[0] not in TABLE_ROWS:
            continue
        agreement = cells[-1]
        found = {"exact": [], "exact_one": [], "differs": []}
        for match in re.finditer(r"verl: exact in " + MODE_LIST, agreement):
            one = agreement[match.end() :].startswith(ONE_MICRO_BATCH)
            found["exact_one" if one else "exact"] += re.findall(
                r"`([a-z-]+)`", match.group(1)
            )
        for match in re.finditer(r"differs in " + MODE_LIST, agreement):
            found["differs"] += re.findall(r"`([a-z-]+)`", match.group(1))
        claims[cells[0]] = found
    return claims


def split_loss(name, data, mode, config, weights=None):
    """verl's loss over 2 ranks x 2 micro-batches with the global counts, the
    ranks averaged as the data-parallel all-reduce does."""
    config.global_batch_info.update(
        {
            "dp_size": 2,
            "batch_num_tokens": int(data["mask"].sum()),
            "global_batch_size": B,
            "loss_scale_factor": 5,
        }
    )
    total = torch.zeros((), dtype=torch.float64)
    grad = torch.zeros(B, T, dtype=torch.float64)
    for start in range(0, B, 2):
        rows = slice(start, start + 2)
        log_prob = data["log_prob"][rows].clone().requires_grad_(True)
        mask = data["mask"][rows]
        extra = {} if weights is None else {"rollout_is_weights": weights[rows]}
        torch.manual_seed(start)  # each micro-batch's Clip-Cov draw, both sides
        loss, _ = core_algos.get_policy_loss_fn(name)(
            old_log_prob=data["old"][rows], log_prob=log_prob,
            advantages=data["row_advantages"][rows] * mask, response_mask=mask,
            loss_agg_mode=mode, config=config, **extra,
        )  # fmt: skip
        (micro_grad,) = torch.autograd.grad(loss, log_prob)
        total += loss.detach() / 2
        grad[rows] = micro_grad / 2
    return total, grad


def test_the_table_names_a_verl_claim_for_every_mode_of_every_objective_row():
    claims = table_claims()
    assert set(claims) == set(TABLE_ROWS)
    for row, found in claims.items():
        named = found["exact"] + found["exact_one"] + found["differs"]
        assert set(found["exact"]) | set(found["differs"]) == set(MODES) or (
            found["exact_one"] and set(found["differs"]) == set(MODES)
        ), row
        assert set(named) <= set(MODES), row


@pytest.mark.parametrize("row", tuple(TABLE_ROWS))
def test_each_objective_row_holds_in_the_modes_it_names(row):
    method, built_in, changes = TABLE_ROWS[row]
    found = table_claims()[row]
    data = batch(seed=1)
    if method.startswith("dppo"):  # DPPO reads probabilities: each stays below 1
        data["log_prob"] = data["log_prob"].clamp(max=-1e-3)
    for mode in found["exact"]:
        config = actor_config(loss_scale_factor=5, **changes)
        ours, our_grad = split_loss(f"grpo_lab_{method}", data, mode, config)
        theirs, their_grad = split_loss(built_in, data, mode, config)
        record(f"table: {row[:30]} vs {built_in}, {mode}, 2x2", delta(ours, theirs),
               delta(our_grad, their_grad))  # fmt: skip
        assert torch.allclose(ours, theirs, rtol=1e-7, atol=1e-10), (row, mode)
        assert torch.allclose(our_grad, their_grad, rtol=1e-7, atol=1e-10), (row, mode)
    for mode in found["exact_one"]:
        config = actor_config(loss_scale_factor=5, **changes)
        ours, our_grad, _ = plugin_loss(f"grpo_lab_{method}", data, mode, config)
        theirs, their_grad, _ = plugin_loss(built_in, data, mode, config)
        assert torch.allclose(ours, theirs, rtol=1e-7, atol=1e-10), (row, mode)
        assert torch.allclose(our_grad, their_grad, rtol=1e-7, atol=1e-10), (row, mode)
    for mode in found["differs"]:
        config = actor_config(loss_scale_factor=5, **changes)
        ours, our_grad = split_loss(f"grpo_lab_{method}", data, mode, config)
        theirs, their_grad = split_loss(built_in, data, mode, config)
        assert delta(our_grad, their_grad) > 1e-6, (row, mode)


def test_gmpo_averages_rollout_weights_arithmetically_where_verl_does_geometrically():
    """The table's GMPO rollout-weight line: verl's geo_mean scales a response's
    term by exp(mean_t log w_t), grpo_lab by the mean of its tokens' w_t."""
    data = batch(seed=1)
    generator = torch.Generator().manual_seed(5)
    weights = 0.5 + torch.rand(B, T, generator=generator, dtype=torch.float64)
    config = actor_config(clip_ratio_low=0.4, clip_ratio_high=0.4)
    mode = "seq-mean-token-mean"
    ours, _ = weighted_loss("grpo_lab_gmpo", data, mode, config, weights)
    theirs, _ = weighted_loss("geo_mean", data, mode, config, weights)
    assert abs(ours - theirs).item() > 1e-3  # 1.2e-2 for this batch
    # Each response's weights replaced by their geometric mean: the two agree.
    mask = data["mask"].double()
    geometric = torch.exp((weights.log() * mask).sum(1) / mask.sum(1))  # (B,)
    flat = geometric[:, None].expand(B, T).clone()
    ours, our_grad = weighted_loss("grpo_lab_gmpo", data, mode, config, flat)
    theirs, their_grad = weighted_loss("geo_mean", data, mode, config, weights)
    assert torch.allclose(ours, theirs, rtol=1e-7, atol=1e-10)
    assert torch.allclose(our_grad, their_grad, rtol=1e-7, atol=1e-10)
    assert "geometrically" in TABLE.read_text() and "arithmetic mean" in (
        TABLE.read_text()
    )
