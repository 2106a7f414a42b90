"""DPPO-TV, DPPO-KL, Clip-Cov and KL-Cov against verl 0.9.1's own losses.

verl's ``compute_policy_loss_dppo_tv``, ``_dppo_kl``, ``_clip_cov`` and
``_kl_cov`` (``verl/trainer/ppo/core_algos.py``) compute one side; grpo_lab's
records compute the other, through the plugin verl loaded (``grpo_lab_<name>``)
and through the core function directly. float64, values and gradients by each
token's log-prob, in every ``loss_agg_mode`` over 2 ranks x 2 micro-batches with
verl's global counts. Clip-Cov draws its tokens with torch's global generator,
as verl does: each micro-batch is seeded the same on both sides. Each parity
check is then run on perturbed copies of the implementation (mutants), and
must fail on every one.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

try:
    import verl
except ImportError:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("verl is not installed (make .venv-verl)", allow_module_level=True)

from test_integrations_verl import split_loss
from verl.trainer.ppo import core_algos
from verl.workers.config import FSDPActorConfig
from verl.workers.config.actor import PolicyLossConfig

from grpo_lab import losses
from grpo_lab.aggregation import aggregate_loss_across_microbatch
from grpo_lab.losses import compute_policy_gradient_loss

B, T, G = 8, 7, 4
MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)
# Each member: verl's built-in, its actor settings, and grpo_lab's options.
MEMBERS = {
    "dppo_tv": (
        {"clip_ratio_low": 0.1, "clip_ratio_high": 0.15, "clip_ratio_c": 3.0},
        {"cliprange": 0.1, "cliprange_high": 0.15, "ratio_cap": 3.0},
    ),
    "dppo_kl": (
        {"clip_ratio_low": 0.05, "clip_ratio_high": 0.08, "clip_ratio_c": 3.0},
        {"cliprange": 0.05, "cliprange_high": 0.08, "ratio_cap": 3.0},
    ),
    "clip_cov": (
        {
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28,
            "policy_loss": {"clip_cov_ratio": 0.3, "clip_cov_lb": 0.02},
        },
        {
            "cliprange": 0.2,
            "cliprange_high": 0.28,
            "covariance_fraction": 0.3,
            "clip_cov_low": 0.02,
        },
    ),
    "kl_cov": (
        {"policy_loss": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.5}},
        {"covariance_fraction": 0.2, "kl_cov_coef": 0.5},
    ),
}
REPORT: dict[str, tuple[float, float]] = {}  # run with -s to print them


def actor_config(method: str) -> FSDPActorConfig:
    changes = dict(MEMBERS[method][0])
    policy_loss = PolicyLossConfig(loss_mode=method, **changes.pop("policy_loss", {}))
    values = {
        "strategy": "fsdp",
        "rollout_n": G,
        "ppo_micro_batch_size_per_gpu": 2,
        "clip_ratio": 0.2,
        "loss_scale_factor": 5,
        "policy_loss": policy_loss,
        **changes,
    }
    return FSDPActorConfig(**values)


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Probabilities spread over (0.05, 0.95) and moved by N(0, 0.6) in log
    space: DPPO's trust regions bind on some tokens and not on others."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6, 2, 7, 4])
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    old = torch.log(
        0.05 + 0.9 * torch.rand(B, T, generator=generator, dtype=torch.float64)
    )
    log_prob = old + torch.randn(B, T, generator=generator, dtype=torch.float64) * 0.6
    log_prob = log_prob.clamp(max=-1e-3)  # a probability stays below 1
    # A < 0 on row 1, and its first token's ratio e^2 above DPPO's cap of 3.
    old[1, 0], log_prob[1, 0] = math.log(0.05), math.log(0.05) + 2.0
    rows = torch.randn(B, 1, generator=generator, dtype=torch.float64)
    rows[1] = -1.0
    return {"old": old, "log_prob": log_prob, "mask": mask, "rows": rows}


def verl_split(name: str, data, mode: str, config) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's loss (``name`` from its registry) over 2 ranks x 2 micro-batches,
    each micro-batch seeded alike on both sides, ranks averaged: the table's
    ``split_loss`` on this batch's (B, 1) advantages."""
    return split_loss(name, {**data, "row_advantages": data["rows"]}, mode, config)


def grpo_lab_micro_batch(method: str, data, rows: slice, seed: int):
    """grpo_lab's core function on one micro-batch, (b, 1) advantages, with the
    token-mean of that micro-batch: loss, gradient, diagnostics."""
    log_prob = data["log_prob"][rows].clone().requires_grad_(True)
    mask = data["mask"][rows]
    torch.manual_seed(seed)
    per_token, diagnostics = compute_policy_gradient_loss(
        data["rows"][rows], log_prob, method, data["old"][rows],
        response_mask=mask, **MEMBERS[method][1],
    )  # fmt: skip
    loss = aggregate_loss_across_microbatch(per_token, mask.double(), "token")
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, diagnostics


def verl_micro_batch(method: str, data, rows: slice, seed: int):
    log_prob = data["log_prob"][rows].clone().requires_grad_(True)
    mask = data["mask"][rows]
    torch.manual_seed(seed)
    loss, _ = core_algos.get_policy_loss_fn(method)(
        old_log_prob=data["old"][rows], log_prob=log_prob,
        advantages=data["rows"][rows] * mask, response_mask=mask,
        loss_agg_mode="token-mean", config=actor_config(method),
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad


def core_deltas(method: str) -> tuple[float, float]:
    """Largest |value| and |gradient| differences between grpo_lab's core
    function and verl's built-in, over the four micro-batches of two seeds."""
    value, gradient = 0.0, 0.0
    for seed in (0, 1):
        data = batch(seed)
        for start in range(0, B, 2):
            rows = slice(start, start + 2)
            ours, our_grad, _ = grpo_lab_micro_batch(method, data, rows, 7 + start)
            theirs, their_grad = verl_micro_batch(method, data, rows, 7 + start)
            value = max(value, (ours - theirs).abs().item())
            gradient = max(gradient, (our_grad - their_grad).abs().max().item())
    return value, gradient


@pytest.mark.parametrize("method", tuple(MEMBERS))
@pytest.mark.parametrize("mode", MODES)
def test_plugin_matches_verl_built_in_in_every_mode(method, mode):
    data = batch()
    ours, our_grad = verl_split(f"grpo_lab_{method}", data, mode, actor_config(method))
    theirs, their_grad = verl_split(method, data, mode, actor_config(method))
    value, gradient = (ours - theirs).abs().item(), (our_grad - their_grad).abs().max()
    REPORT[f"{method}, {mode}"] = (value, gradient.item())
    print(f"\n{method} vs verl, {mode}, 2x2: |delta| {value:.1e}, grad {gradient:.1e}")
    assert their_grad.abs().max() > 0  # something to compare
    if mode == "seq-mean-token-mean":
        # verl divides each response by its length + 1e-8, grpo_lab by the length.
        assert torch.allclose(ours, theirs, rtol=1e-7, atol=1e-10)
        assert torch.allclose(our_grad, their_grad, rtol=1e-7, atol=1e-10)
    else:
        assert value <= 1e-12 and gradient <= 1e-12, (value, gradient)


@pytest.mark.parametrize("method", tuple(MEMBERS))
def test_core_function_matches_verl_and_the_member_binds(method):
    value, gradient = core_deltas(method)
    REPORT[f"{method}, core function, token-mean per micro-batch"] = (value, gradient)
    print(
        f"\n{method}, core function vs verl: |delta| {value:.1e}, grad {gradient:.1e}"
    )
    assert value <= 1e-12 and gradient <= 1e-12, (value, gradient)
    # The member's own rule acts on these inputs: tokens dropped, truncated or
    # selected, so the parity above is not that of plain REINFORCE.
    _, _, diagnostics = grpo_lab_micro_batch(method, batch(), slice(0, 8), 0)
    key = "clip_fraction" if method.startswith("dppo") else "covariance_selected_mean"
    assert 0 < diagnostics[key] < 1, diagnostics


def test_clip_cov_draws_with_the_global_generator_as_verl_does():
    # Two seeds draw different tokens (so the seeding above is what matches).
    data = batch()
    first = grpo_lab_micro_batch("clip_cov", data, slice(0, 8), 0)[1]
    second = grpo_lab_micro_batch("clip_cov", data, slice(0, 8), 3)[1]
    assert not torch.equal(first, second)


def test_the_export_reads_verls_covariance_fields():
    from grpo_lab.integrations.verl.algorithms import objective_options

    options = objective_options("clip_cov", actor_config("clip_cov"))
    assert (options.covariance_fraction, options.clip_cov_low) == (0.3, 0.02)
    options = objective_options("kl_cov", actor_config("kl_cov"))
    assert (options.covariance_fraction, options.kl_cov_coef) == (0.2, 0.5)
    assert objective_options("dppo_tv", actor_config("dppo_tv")).ratio_cap == 3.0


# --- mutants: each perturbed implementation fails the parity check ---------------


def _negated(loss):
    def mutant(*args):
        per_token, diagnostics = loss(*args)
        return -per_token, diagnostics

    return mutant


def _with_options(loss, **changes):
    def mutant(advantages, log_probs, old, mask, options):
        fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
        changed = object.__new__(type(options))
        for name, value in {**fields, **changes}.items():
            object.__setattr__(changed, name, value)  # unchecked, as a bug would be
        return loss(advantages, log_probs, old, mask, changed)

    return mutant


def _swapped_sides(loss):
    def mutant(advantages, log_probs, old, mask, options):
        swap = {
            "cliprange": options.upper_cliprange,
            "cliprange_high": options.cliprange,
        }
        return _with_options(loss, **swap)(advantages, log_probs, old, mask, options)

    return mutant


def _first_candidates(loss):
    def mutant(*args):
        draw = torch.randperm
        torch.randperm = lambda n, *rest, **keywords: torch.arange(n)  # no shuffle
        try:
            return loss(*args)
        finally:
            torch.randperm = draw

    return mutant


MUTANTS = {
    "dppo_tv": {
        "wrong sign": lambda loss: _negated(loss),
        "threshold sides swapped": _swapped_sides,
        "weight not truncated": lambda loss: _with_options(loss, ratio_cap=None),
        "ratio clip instead of TV": lambda loss: _with_options(
            losses.grpo_clip_loss, ratio_cap=None
        ),
    },
    "dppo_kl": {
        "wrong sign": lambda loss: _negated(loss),
        "threshold sides swapped": _swapped_sides,
        "TV instead of binary KL": lambda loss: losses.dppo_tv_loss,
    },
    "clip_cov": {
        "wrong sign": lambda loss: _negated(loss),
        "the first candidates, not a draw": _first_candidates,
        "band's lower side open": lambda loss: _with_options(
            loss, clip_cov_low=-math.inf
        ),
        "one token, not the fraction": lambda loss: _with_options(
            loss, covariance_fraction=1e-9
        ),
    },
    "kl_cov": {
        "wrong sign": lambda loss: _negated(loss),
        "no penalty": lambda loss: losses.noclip_loss,
        "every token penalized": lambda loss: _with_options(
            loss, covariance_fraction=1.0
        ),
        "penalty sign flipped": lambda loss: _with_options(loss, kl_cov_coef=-0.5),
    },
}


@pytest.mark.parametrize(
    ("method", "mutant"),
    [(method, name) for method, named in MUTANTS.items() for name in named],
)
def test_each_mutant_fails_the_parity_check(monkeypatch, method, mutant):
    record = losses.OBJECTIVE_RECORDS[method]
    perturbed = dataclasses.replace(record, loss=MUTANTS[method][mutant](record.loss))
    monkeypatch.setitem(losses.OBJECTIVE_RECORDS, method, perturbed)
    value, gradient = core_deltas(method)
    assert max(value, gradient) > 1e-6, (method, mutant, value, gradient)


# --- the export --------------------------------------------------------------------


def gpu_config(**changes):
    from grpo_lab.training.config import TrainConfig

    values = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "task": "reverse",
        "task_options": {"n_digits": 5},
        "steps": 3,
        "eval_size": 8,
        "sft_max_steps": 0,
        "train_batch_size": 128,
        "gradient_accumulation_steps": 16,
        **changes,
    }
    return TrainConfig.for_profile("gpu", **values)


def composed_actor(folder):
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    lines = (folder / "overrides.txt").read_text().splitlines()
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=lines)
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"importance_reweighting_method": "clip_cov", "covariance_fraction": 0.01,
             "clip_cov_low": 0.5, "clip_cov_high": 4.0},
            {"covariance_fraction": 0.01, "clip_cov_low": 0.5, "clip_cov_high": 4.0},
        ),
        (
            {"importance_reweighting_method": "kl_cov", "cliprange": None,
             "covariance_fraction": 0.002, "kl_cov_coef": 1.0},
            {"covariance_fraction": 0.002, "kl_cov_coef": 1.0},
        ),
        (
            {"importance_reweighting_method": "dppo_tv", "cliprange": 0.1,
             "ratio_cap": 3.0},
            {"cliprange": 0.1, "ratio_cap": 3.0},
        ),
        ({"importance_reweighting_method": "luspo", "cliprange": 3e-4}, {"cliprange": 3e-4}),
        ({"importance_reweighting_method": "vespo", "cliprange": None}, {"vespo_k_pos": 2.0}),
    ],
)  # fmt: skip
def test_the_export_writes_each_member_as_verl_reads_it(tmp_path, changes, expected):
    from grpo_lab.integrations.verl.algorithms import objective_options
    from grpo_lab.integrations.verl.launch import write_launch_folder

    method = changes["importance_reweighting_method"]
    write_launch_folder(gpu_config(**changes), tmp_path)
    actor = composed_actor(tmp_path)
    assert actor.policy_loss.loss_mode == f"grpo_lab_{method}"
    options = objective_options(method, actor)  # what the loss reads in verl
    for name, value in expected.items():
        assert getattr(options, name) == value, name


@pytest.mark.parametrize(
    ("name", "changes"),
    [
        ("vespo_k_pos", {"importance_reweighting_method": "vespo", "cliprange": None,
                         "vespo_k_pos": 1.5}),
        ("off_policy_mask_threshold", {"importance_reweighting_method": "grpo",
                                       "cliprange": 0.2, "off_policy_mask_threshold": 0.5}),
    ],
)  # fmt: skip
def test_what_verl_cannot_carry_is_refused_by_name(tmp_path, name, changes):
    from grpo_lab.integrations.verl.launch import write_launch_folder

    with pytest.raises(ValueError, match=f"^{name} "):
        write_launch_folder(gpu_config(**changes), tmp_path)
