"""The package against the reference design (``shared/seed/grpo.py``), bit for bit.

Every public function of the reference design is called with the same inputs
through both implementations, with every new option at its default: values,
diagnostics and parameter gradients must be *equal* (``torch.equal``), not
close. The reference file sits beside the repository (``../shared/seed``); CI
lays it there, so a missing file fails under CI instead of skipping.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

import grpo_lab
from grpo_lab.models import build_char_tokenizer, build_tiny_olmo2, build_tiny_qwen2
from grpo_lab.teaching.gradient_recorder import GradientRecorder

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "seed" / "grpo.py"
SIZES = {"hidden_size": 32, "num_layers": 1, "intermediate_size": 64}
METHODS = {"none": None, "noclip": None, "grpo": 0.2, "gspo": 0.05}


def _load_reference():
    if not REFERENCE.exists():
        if os.environ.get("CI"):
            pytest.fail(f"the reference design is missing at {REFERENCE}")
        pytest.skip(f"no reference design at {REFERENCE}")
    spec = importlib.util.spec_from_file_location("reference_grpo", REFERENCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference():
    return _load_reference()


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def assert_same(actual, expected) -> None:
    """Equal values, dtypes and shapes; tensors compared with torch.equal."""
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected)
        for key in expected:
            assert_same(actual[key], expected[key])
        return
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        assert torch.equal(actual, expected), (actual, expected)
        return
    if isinstance(expected, float) and expected != expected:  # NaN
        assert actual != actual
        return
    assert actual == expected


def rollout_texts():
    prompts = ["12>", "12>", "12>", "12>", "345>", "345>", "345>", "345>"]
    responses = ["21", "2", "21", "12", "543", "543", "5", "5433"]
    truths = ["21"] * 4 + ["543"] * 4
    return prompts, responses, truths


def exact_match(response: str, truth: str) -> dict[str, float]:
    correct = float(response == truth)
    return {"reward": correct, "format_reward": 1.0, "answer_reward": correct}


def test_tokenization_is_identical(reference, tokenizer):
    prompts, responses, _ = rollout_texts()
    assert_same(
        grpo_lab.tokenize_prompt_and_output(prompts, responses, tokenizer),
        reference.tokenize_prompt_and_output(prompts, responses, tokenizer),
    )


@pytest.mark.parametrize("chunk_size", [0, 3])
def test_log_probs_entropy_and_their_gradients_are_identical(
    reference, tokenizer, chunk_size
):
    # The reference chunks only OLMo2's head, so both paths use OLMo2 here.
    batch = grpo_lab.tokenize_prompt_and_output(*rollout_texts()[:2], tokenizer)
    results = []
    for implementation in (grpo_lab, reference):
        model = build_tiny_olmo2(tokenizer, seed=0, **SIZES)
        scored = implementation.get_response_log_probs(
            model, batch["input_ids"], batch["labels"], True, chunk_size
        )
        scored["log_probs"].sum().backward()
        gradients = [p.grad.clone() for p in model.parameters()]
        results.append((scored, gradients))
    (ours, our_gradients), (theirs, their_gradients) = results
    assert_same(ours["log_probs"].detach(), theirs["log_probs"].detach())
    assert_same(ours["token_entropy"], theirs["token_entropy"])
    for a, b in zip(our_gradients, their_gradients):
        if chunk_size == 0:
            assert_same(a, b)
        else:
            # The chunked head sums its weight gradient in one buffer by hand,
            # where the reference lets autograd add one per chunk: the same sum
            # in another order, equal up to float32 rounding.
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("baseline", "normalizer"),
    [("mean", "std"), ("mean", "none"), ("none", "none"), ("mean", "mean")],
)
def test_rewards_and_advantages_are_identical(reference, baseline, normalizer):
    _, responses, truths = rollout_texts()
    ours = grpo_lab.compute_rollout_rewards(exact_match, responses, truths)
    theirs = reference.compute_rollout_rewards(exact_match, responses, truths)
    assert_same(ours[0], theirs[0]) or assert_same(ours[1], theirs[1])
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.25, 0.0, 0.0, 2.0])
    assert_same(
        dict(zip("am", grpo_lab.compute_group_normalized_rewards(
            rewards, 4, baseline, 1e-6, normalizer
        ))),
        dict(zip("am", reference.compute_group_normalized_rewards(
            rewards, 4, baseline, 1e-6, normalizer
        ))),
    )  # fmt: skip


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_losses_and_aggregation_are_identical(reference, method, dtype):
    generator = torch.Generator().manual_seed(0)
    policy = (torch.randn(4, 6, generator=generator) * 0.1 - 1.0).to(dtype)
    old = policy.float() + torch.randn(4, 6, generator=generator) * 0.05
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0] * 6, [1, 0] * 3])
    advantages = torch.tensor([1.0, -0.5, 0.3, -2.0])
    results = []
    for implementation in (grpo_lab, reference):
        log_probs = policy.float().clone().requires_grad_(True)
        per_token, metadata = implementation.compute_policy_gradient_loss(
            advantages, log_probs.to(dtype), method, old, METHODS[method], mask
        )
        for normalization, constant in (("sequence", None), ("constant", 7)):
            loss = implementation.aggregate_loss_across_microbatch(
                per_token, mask, normalization, constant
            )
            (gradient,) = torch.autograd.grad(loss, log_probs, retain_graph=True)
            results.append((loss.detach(), gradient))
        results.append((per_token.detach(), metadata))
    half = len(results) // 2
    for ours, theirs in zip(results[:half], results[half:]):
        assert_same(ours[0], theirs[0])
        assert_same(ours[1], theirs[1])


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize(
    ("normalization", "constant", "accumulation"),
    [("sequence", None, 1), ("sequence", None, 3), ("constant", 10, 2)],
)
def test_train_steps_are_identical(
    reference, tokenizer, method, normalization, constant, accumulation
):
    prompts, responses, truths = rollout_texts()
    batch = grpo_lab.tokenize_prompt_and_output(prompts, responses, tokenizer)
    old = torch.randn(batch["labels"].shape, generator=torch.Generator().manual_seed(1))
    old = old * 0.1 - 2.0  # (B, T)
    results = []
    for implementation in (grpo_lab, reference):
        model = build_tiny_qwen2(tokenizer, seed=0, **SIZES)
        recorder = GradientRecorder(model.parameters())
        loss, metadata = implementation.grpo_train_step(
            model,
            tokenizer,
            recorder,
            accumulation,
            1.0,
            exact_match,
            prompts,
            responses,
            truths,
            4,
            importance_reweighting_method=method,
            old_log_probs=None if method == "none" else old,
            cliprange=METHODS[method],
            loss_normalization=normalization,
            normalization_constant=constant,
        )
        results.append((loss, metadata, recorder.gradients))
    (our_loss, ours, our_gradients), (their_loss, theirs, their_gradients) = results
    assert_same(our_loss, their_loss)
    assert_same(ours, theirs)
    assert ours["optimizer_step"] == 1.0
    for a, b in zip(our_gradients, their_gradients):
        assert_same(a, b)


def test_a_step_with_no_signal_reports_the_reference_zeros(reference, tokenizer):
    prompts, _, truths = rollout_texts()
    solved = ["21"] * 4 + ["543"] * 4  # every group all correct: advantages 0
    results = []
    for implementation in (grpo_lab, reference):
        model = build_tiny_qwen2(tokenizer, seed=0, **SIZES)
        recorder = GradientRecorder(model.parameters())
        results.append(
            implementation.grpo_train_step(
                model, tokenizer, recorder, 1, 1.0, exact_match, prompts, solved,
                truths, 4, importance_reweighting_method="grpo",
                old_log_probs=torch.zeros(8, 6), cliprange=0.2,
            )
        )  # fmt: skip
        assert recorder.steps == 0
    assert_same(results[0][0], results[1][0])
    assert_same(results[0][1], results[1][1])
