"""REINFORCE++, the optimal token baseline and GDPO against verl 0.9.1's own code.

Each grpo_lab function is compared in float64 with the estimator verl registers
under its name (``verl/trainer/ppo/core_algos.py``), on a batch whose rows
verl sees shuffled (groups by uid, as verl's trainer hands them) and whose
responses have different lengths. Each test also runs a wrong variant (a
mutant) and asserts that the same comparison catches it. The estimators run
under ``torch.no_grad`` in verl: they have values, not gradients.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    import verl  # noqa: F401  (loads the entry points of "verl.plugins")
except ImportError:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("verl is not installed (make .venv-verl)", allow_module_level=True)

from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos

from grpo_lab.advantages import (
    compute_group_normalized_rewards,
    compute_multi_reward_advantages,
    optimal_token_baseline_advantages,
)

B, T, G = 12, 6, 4
TABLE = Path(__file__).resolve().parents[2] / "docs" / "translation_table.md"


def table_claim(estimator: str) -> str:
    """The agreement cell of the translation table's row naming verl's
    ``adv_estimator="<estimator>"``: what the tests below must hold."""
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) == 4 and f'`adv_estimator="{estimator}"`' in cells[2]:
            return cells[3]
    raise AssertionError(f"the translation table has no row for {estimator}")


def rollout_batch(seed: int = 0) -> dict:
    """Rows in grpo_lab's order (groups of G consecutive), and the order verl
    sees them in (``order``: verl's row r is grpo_lab's row order[r])."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=generator)
    lengths[:G] = torch.tensor([2, 6, 3, 3])  # one strictly longest response
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()  # (B, T)
    rewards = torch.randn(B, generator=generator, dtype=torch.float64)
    components = torch.randint(0, 3, (B, 2), generator=generator).double() / 2
    probabilities = 0.05 + 0.9 * torch.rand(
        B, T, generator=generator, dtype=torch.float64
    )
    others = torch.rand(B, T, generator=generator, dtype=torch.float64)
    order = torch.randperm(B, generator=generator)
    return {
        "lengths": lengths,
        "mask": mask,
        "rewards": rewards,
        "components": components,  # (B, 2), values 0, 0.5, 1: exact in float32
        "old_log_probs": probabilities.log(),
        "sum_pi_squared": probabilities**2 + others * (1 - probabilities) ** 2,
        "is_weights": 0.5 + torch.rand(B, T, generator=generator, dtype=torch.float64),
        "order": order,
        "index": np.array([f"uid{int(i) // G}" for i in order]),
    }


def at_last_token(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) outcome rewards placed on each response's last token, (B, T)."""
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(mask.shape[0]), mask.sum(1).long() - 1] = values
    return token_rewards


def verl_estimator(name: str, data: dict, values: torch.Tensor | None = None, **extra):
    order = data["order"]
    mask = data["mask"][order]
    rewards = data["rewards"] if values is None else values
    return core_algos.get_adv_estimator_fn(name)(
        token_level_rewards=at_last_token(rewards[order], mask),
        response_mask=mask,
        index=data["index"],
        **extra,
    )


def grouped(name: str, baseline: str, data: dict, **changes) -> torch.Tensor:
    """grpo_lab's (B,) advantages broadcast over verl's rows, (B, T)."""
    lengths = changes.pop("lengths", data["lengths"])
    values, _ = compute_group_normalized_rewards(
        data["rewards"], G, baseline, 0.0, name, response_lengths=lengths
    )
    order = data["order"]
    return values[order, None] * data["mask"][order]


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# --- REINFORCE++ ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("verl_name", "baseline"),
    [("reinforce_plus_plus", "none"), ("reinforce_plus_plus_baseline", "mean")],
)
def test_reinforce_plus_plus_is_token_whitening_exactly(verl_name, baseline):
    assert "verl: exact in float64" in table_claim(verl_name)
    data = rollout_batch()
    extra = {"config": AlgoConfig(gamma=1.0)}
    theirs, _ = verl_estimator(verl_name, data, **extra)
    ours = grouped("token_whiten", baseline, data)
    assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-12), gap(ours, theirs)
    # Mutants: whitening over responses instead of tokens (each response one
    # token), the other baseline, and batch_std's scale without the shift.
    ones = torch.ones(B, dtype=torch.long)
    assert gap(grouped("token_whiten", baseline, data, lengths=ones), theirs) > 1e-2
    other = "mean" if baseline == "none" else "none"
    assert gap(grouped("token_whiten", other, data), theirs) > 1e-2
    assert gap(grouped("batch_std", baseline, data, lengths=None), theirs) > 1e-2


def test_reinforce_plus_plus_with_a_discount_is_not_grpo_labs():
    # grpo_lab's advantages are one number per response: verl's gamma 1.
    data = rollout_batch(seed=1)
    theirs, _ = verl_estimator(
        "reinforce_plus_plus", data, config=AlgoConfig(gamma=0.9)
    )
    assert gap(grouped("token_whiten", "none", data), theirs) > 1e-2


# --- the optimal token baseline -----------------------------------------------------


def token_baseline(data: dict, **options):
    """grpo_lab's optimal token baseline, in verl's row order."""
    weights = options.pop("rollout_is_weights", None)
    advantages, returns = optimal_token_baseline_advantages(
        data["rewards"], data["mask"], G, data["old_log_probs"],
        data["sum_pi_squared"], rollout_is_weights=weights, **options,
    )  # fmt: skip
    order = data["order"]
    return advantages[order], returns[order]


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("handle_zero_tail", [True, False])
def test_optimal_token_baseline_matches_verl(with_weights, handle_zero_tail):
    assert table_claim("optimal_token_baseline").startswith("verl: exact in float64")
    data = rollout_batch(seed=2)
    order = data["order"]
    weights = data["is_weights"] if with_weights else None
    theirs, their_returns = verl_estimator(
        "optimal_token_baseline", data,
        old_log_probs=data["old_log_probs"][order],
        sum_pi_squared=data["sum_pi_squared"][order],
        rollout_is_weights=None if weights is None else weights[order],
        handle_zero_tail=handle_zero_tail,
    )  # fmt: skip
    ours, our_returns = token_baseline(
        data, rollout_is_weights=weights, handle_zero_tail=handle_zero_tail
    )
    assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-12), gap(ours, theirs)
    assert torch.allclose(our_returns, their_returns, rtol=1e-12, atol=1e-12)
    # Mutants: the other tail rule; no importance weights where verl has them
    # (or the reverse); the group mean reward as every token's baseline.
    flipped, _ = token_baseline(
        data, rollout_is_weights=weights, handle_zero_tail=not handle_zero_tail
    )
    assert gap(flipped, theirs) > 1e-2
    swapped = data["is_weights"] if weights is None else None
    assert gap(token_baseline(data, rollout_is_weights=swapped,
                              handle_zero_tail=handle_zero_tail)[0], theirs) > 1e-3  # fmt: skip
    mean_baseline = grouped("none", "mean", data, lengths=None)
    assert gap(mean_baseline, theirs) > 1e-2


# --- GDPO ----------------------------------------------------------------------------


def verl_gdpo(data: dict, weights: list[float] | None):
    """verl's gdpo with two reward components, read as its trainer hands them."""
    order, prompt = data["order"], 3
    mask = data["mask"][order]
    components = data["components"][order].numpy()
    config = AlgoConfig(
        adv_estimator="gdpo",
        gdpo_reward_keys=["format_reward", "answer_reward"],
        gdpo_reward_weights=weights,
    )
    batch = {
        "prompts": torch.zeros(B, prompt, dtype=torch.long),
        "attention_mask": torch.cat([torch.ones(B, prompt), mask], dim=1).long(),
    }
    theirs, _ = core_algos.get_adv_estimator_fn("gdpo")(
        token_level_rewards=torch.zeros_like(mask),
        response_mask=mask,
        index=data["index"],
        config=config,
        non_tensor_batch={
            "format_reward": components[:, 0],
            "answer_reward": components[:, 1],
        },
        batch=batch,
    )
    return theirs


def multi(data: dict, aggregation: str, weights=None, dtype=torch.float64, **kw):
    lengths = data["lengths"] if aggregation.endswith("tokens") else None
    values, _ = compute_multi_reward_advantages(
        data["components"].to(dtype), G, "mean", 1e-6, kw.pop("normalizer", "std"),
        reward_aggregation=aggregation, reward_weights=weights,
        response_lengths=lengths,
    )  # fmt: skip
    order = data["order"]
    return values.double()[order, None] * data["mask"][order]


@pytest.mark.parametrize("weights", [None, [1.0, 0.5]])
def test_gdpo_with_two_components_matches_verl(weights):
    # verl reads the components into float32 (np.asarray(..., np.float32)) and
    # computes in float32: grpo_lab in float32 agrees to float32 rounding.
    claim = table_claim("gdpo")
    stated = float(re.search(r"equal to float32 rounding \(≤ ([0-9.e-]+);", claim)[1])
    data = rollout_batch(seed=3)
    theirs = verl_gdpo(data, weights)
    ours = multi(data, "normalize_then_sum_tokens", weights)
    in_float32 = multi(data, "normalize_then_sum_tokens", weights, torch.float32)
    assert gap(ours, theirs) <= stated and gap(in_float32, theirs) <= stated
    # Mutants: TRL's whitening over responses, summing before normalizing, and
    # equal weights where verl weighs (or the reverse).
    assert gap(multi(data, "normalize_then_sum", weights), theirs) > 1e-2
    assert gap(multi(data, "sum_then_normalize", weights), theirs) > 1e-2
    other = [1.0, 0.5] if weights is None else None
    assert gap(multi(data, "normalize_then_sum_tokens", other), theirs) > 1e-2


def test_gdpo_of_one_component_matches_verl_in_float64():
    # Without reward keys verl's gdpo normalizes token_level_rewards alone, in
    # the rewards' own dtype: exact in float64.
    assert "exact in float64 with one part" in table_claim("gdpo")
    data = rollout_batch(seed=4)
    order = data["order"]
    mask = data["mask"][order]
    for norm_by_std, normalizer in ((True, "std"), (False, "none")):
        theirs, _ = core_algos.get_adv_estimator_fn("gdpo")(
            token_level_rewards=at_last_token(data["rewards"][order], mask),
            response_mask=mask,
            index=data["index"],
            norm_adv_by_std_in_grpo=norm_by_std,
        )
        ours, _ = compute_multi_reward_advantages(
            data["rewards"][:, None], G, "mean", 1e-6, normalizer,
            reward_aggregation="normalize_then_sum_tokens",
            response_lengths=data["lengths"],
        )  # fmt: skip
        ours = ours[order, None] * mask
        assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-12), gap(ours, theirs)
        assert gap(grouped("std", "mean", data, lengths=None), theirs) > 1e-2
