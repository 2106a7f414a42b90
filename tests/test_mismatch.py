"""The mismatch backend: each perturbation opens the gap it should, and IS closes it."""

from __future__ import annotations

import pytest
import torch

from grpo_lab.logprobs import get_response_log_probs
from grpo_lab.masks import pad_prompt_and_response_ids
from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.rollouts import HFRolloutBackend, build_backend, make_backend
from grpo_lab.rollouts.base import SamplingSettings
from grpo_lab.rollouts.mismatch import (
    PERTURBATIONS,
    MismatchRolloutBackend,
    check_mismatch_settings,
    nucleus_mask,
    sampler_scores,
)
from grpo_lab.sampler_correction import sampler_correction_weights
from grpo_lab.training.config import TrainConfig

PROMPTS = ["12345>", "7>", "98>"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture()
def model(tokenizer):
    """Peaked distributions (sharper embeddings) so that perturbations show."""
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=2, seed=3)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)
    return model


def sample(backend, seed=1, temperature=1.0, **options):
    settings = SamplingSettings(temperature, max_new_tokens=10, seed=seed, **options)
    return backend.generate(PROMPTS, 6, settings)


def trainer_and_sampler(model, rollouts, temperature=1.0):
    """Flat (N,) trainer and sampler log-probs of every response token."""
    batch = pad_prompt_and_response_ids(
        rollouts.prompt_token_ids, rollouts.response_token_ids, pad_token_id=0
    )
    with torch.no_grad():
        scored = get_response_log_probs(
            model, batch["input_ids"], batch["labels"], temperature=temperature
        )["log_probs"]  # (B, T)
    for ids, values in zip(rollouts.response_token_ids, rollouts.sampler_log_probs):
        assert len(ids) == len(values)
    sampler = torch.tensor([v for row in rollouts.sampler_log_probs for v in row])
    return scored[batch["response_mask"].bool()], sampler  # (N,), (N,)


def mean_gap(model, rollouts, temperature=1.0):
    trainer, sampler = trainer_and_sampler(model, rollouts, temperature)
    return (trainer - sampler).abs().mean().item()


@pytest.mark.parametrize(
    ("mismatch", "scale"),
    [("none", None), ("noise", 0.0), ("temperature", 1.0), ("top_p", 1.0)],
)
def test_no_perturbation_samples_the_policy_itself(model, tokenizer, mismatch, scale):
    backend = MismatchRolloutBackend(model, tokenizer, mismatch, scale)
    # Cached one-token steps against one full forward: float noise only.
    assert mean_gap(model, sample(backend)) < 1e-5


def test_bf16_gap_is_small_and_nonzero(model, tokenizer):
    backend = MismatchRolloutBackend(model, tokenizer, "bf16")
    # bfloat16 keeps 8 significant bits: logits of size ~5 move by up to ~1e-2.
    assert 1e-5 < mean_gap(model, sample(backend)) < 0.05


def test_fp16_gap_is_nonzero_and_several_times_smaller_than_bf16s(model, tokenizer):
    # float16 keeps 11 significant bits to bfloat16's 8: round to nearest moves a
    # logit in [4, 8) by at most half a spacing, 2^-9 against 2^-6.
    logits = 4 + torch.arange(4096.0)[None] * 2.0**-10  # (1, V): [4, 8), exact
    plain = SamplingSettings(max_new_tokens=4)
    error = {
        name: (sampler_scores(logits, name, None, plain) - logits).abs().max().item()
        for name in ("bf16", "fp16")
    }
    assert error == {"bf16": 2.0**-6, "fp16": 2.0**-9}
    fp16_gap = mean_gap(model, sample(MismatchRolloutBackend(model, tokenizer, "fp16")))
    bf16_gap = mean_gap(model, sample(MismatchRolloutBackend(model, tokenizer, "bf16")))
    assert 1e-6 < fp16_gap < bf16_gap / 3


def test_top_p_sampler_log_probs_are_never_below_the_trainers(model, tokenizer):
    backend = MismatchRolloutBackend(model, tokenizer, "top_p", 0.7)
    trainer, sampler = trainer_and_sampler(model, sample(backend))
    # Inside the nucleus p / mass(nucleus) >= p, and mass >= 0.7.
    assert bool((sampler >= trainer - 1e-6).all())
    assert bool((sampler - trainer <= -torch.log(torch.tensor(0.7)) + 1e-5).all())
    assert (sampler - trainer).max() > 1e-2


def test_temperature_gap_grows_with_distance_of_one_over_tau_from_one(model, tokenizer):
    # |1/tau - 1| = 0.05, 0.25, 0.67.
    gaps = [
        mean_gap(
            model, sample(MismatchRolloutBackend(model, tokenizer, "temperature", tau))
        )
        for tau in (1.05, 0.8, 0.6)
    ]
    assert 0 < gaps[0] < gaps[1] < gaps[2], gaps


def test_noise_gap_grows_with_scale(model, tokenizer):
    gaps = [
        mean_gap(model, sample(MismatchRolloutBackend(model, tokenizer, "noise", s)))
        for s in (0.1, 0.5, 1.0)
    ]
    assert 0 < gaps[0] < gaps[1] < gaps[2], gaps


def take_a_step(model):
    """Stand-in for an optimizer step: every weight moves a little."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.1)


def test_stale_weights_refresh_on_every_kth_sync_only(model, tokenizer):
    backend = MismatchRolloutBackend(model, tokenizer, "stale", sync_every=3)
    assert mean_gap(model, sample(backend)) < 1e-5  # the copy starts in sync
    gaps = []
    for _ in range(3):
        take_a_step(model)
        backend.sync(model)
        gaps.append(mean_gap(model, sample(backend)))
    # Syncs 1 and 2 keep the old weights; sync 3 loads the policy's.
    assert gaps[0] > 1e-2 and gaps[1] > gaps[0], gaps
    assert gaps[2] < 1e-5, gaps
    assert not any(p.requires_grad for p in backend.frozen.parameters())


def test_refresh_loads_the_weights_at_once_without_counting_a_sync(model, tokenizer):
    backend = MismatchRolloutBackend(model, tokenizer, "stale", sync_every=3)
    take_a_step(model)
    assert mean_gap(model, sample(backend)) > 1e-2
    backend.refresh(model)
    assert mean_gap(model, sample(backend)) < 1e-5
    assert backend.sync_calls == 0


def test_other_perturbations_sample_the_live_weights(model, tokenizer):
    backend = MismatchRolloutBackend(model, tokenizer, "none")
    take_a_step(model)
    assert mean_gap(model, sample(backend)) < 1e-5


def test_seeded_samples_repeat_and_differ_across_seeds(model, tokenizer):
    backend = MismatchRolloutBackend(model, tokenizer, "noise", 0.5)
    first, again, other = sample(backend, 4), sample(backend, 4), sample(backend, 5)
    assert first.response_token_ids == again.response_token_ids
    assert first.sampler_log_probs == again.sampler_log_probs
    assert first.response_token_ids != other.response_token_ids
    assert first.prompts == [p for p in PROMPTS for _ in range(6)]


def test_max_batch_size_bounds_the_rows_sampled_at_once(model, tokenizer):
    rows = []
    handle = model.model.embed_tokens.register_forward_hook(
        lambda module, args, output: rows.append(args[0].shape[0])
    )
    try:
        chunked = MismatchRolloutBackend(model, tokenizer, max_batch_size=5)
        rollouts = sample(chunked)
    finally:
        handle.remove()
    # 18 responses in chunks of 5, 5, 5 and 3.
    assert max(rows) == 5 and 3 in rows
    assert len(rollouts.response_token_ids) == 18
    assert mean_gap(model, rollouts) < 1e-5
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=6)
    whole = MismatchRolloutBackend(model, tokenizer, "bf16").generate(
        PROMPTS, 3, greedy
    )
    parts = MismatchRolloutBackend(model, tokenizer, "bf16", max_batch_size=2)
    assert parts.generate(PROMPTS, 3, greedy).response_token_ids == (
        whole.response_token_ids
    )
    with pytest.raises(ValueError, match="max_batch_size"):
        MismatchRolloutBackend(model, tokenizer, max_batch_size=0)


def test_greedy_without_perturbation_matches_hf_generate(model, tokenizer):
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=8)
    ours = MismatchRolloutBackend(model, tokenizer).generate(PROMPTS, 2, greedy)
    theirs = HFRolloutBackend(model, tokenizer).generate(PROMPTS, 2, greedy)
    assert ours.response_token_ids == theirs.response_token_ids
    assert ours.responses == theirs.responses


def test_eos_and_stop_strings_end_responses(tokenizer):
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0)
    backend = MismatchRolloutBackend(model, tokenizer, "noise", 0.3)
    rollouts = backend.generate(
        ["12345>"], 32, SamplingSettings(max_new_tokens=30, stop_strings=("a",), seed=0)
    )
    assert any(text.endswith("a") for text in rollouts.responses)
    for ids, values, text in zip(
        rollouts.response_token_ids, rollouts.sampler_log_probs, rollouts.responses
    ):
        assert len(ids) == len(values)
        assert tokenizer.eos_token_id not in ids[:-1]
        assert text.count("a") <= 1
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_nucleus_mask_keeps_the_smallest_top_set_reaching_top_p():
    # p = (0.5, 0.3, 0.15, 0.05): top_p 0.7 keeps 0.5 + 0.3; 0.8 keeps 2 as well
    # (mass before the third token is 0.8, not below 0.8); 0.81 keeps 3.
    scores = torch.tensor([[0.5, 0.05, 0.3, 0.15]]).log()
    assert nucleus_mask(scores, 0.7).tolist() == [[True, False, True, False]]
    assert nucleus_mask(scores, 0.8 - 1e-6).tolist() == [[True, False, True, False]]
    assert nucleus_mask(scores, 0.81).tolist() == [[True, False, True, True]]
    assert nucleus_mask(scores, 0.1).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("drift", None, 1), "mismatch must be one of"),
        (("top_p", 0.0, 1), "mismatch_scale for mismatch 'top_p'"),
        (("temperature", -1.0, 1), "must be > 0"),
        (("noise", float("nan"), 1), "mismatch_scale must be a finite number"),
        (("stale", 0.5, 2), "mismatch_scale must be None for mismatch 'stale'"),
        (("stale", None, 0), "mismatch_sync_every must be a positive int"),
        (("bf16", None, 2), "applies to mismatch 'stale' only"),
    ],
)
def test_bad_settings_are_refused_on_construction(model, tokenizer, arguments, message):
    with pytest.raises(ValueError, match=message):
        MismatchRolloutBackend(model, tokenizer, *arguments)
    with pytest.raises(ValueError, match=message):
        check_mismatch_settings(*arguments)
    with pytest.raises(ValueError, match="needs backend 'mismatch'"):
        check_mismatch_settings("bf16", None, 1, backend="hf")


def test_train_config_builds_the_backend_and_defaults_stay_hf(model, tokenizer):
    config = TrainConfig(
        backend="mismatch", mismatch="stale", mismatch_sync_every=4, device="cpu"
    )
    backend = build_backend(config, model, tokenizer)
    assert isinstance(backend, MismatchRolloutBackend)
    assert (backend.mismatch, backend.sync_every) == ("stale", 4)
    assert isinstance(build_backend(TrainConfig(), model, tokenizer), HFRolloutBackend)
    noise = make_backend("mismatch", model, tokenizer, mismatch="noise")
    assert noise.scale == 0.5
    assert set(PERTURBATIONS) >= {
        "bf16",
        "fp16",
        "top_p",
        "temperature",
        "stale",
        "noise",
    }


# --------------------------- a categorical policy with a closed-form gradient

ACTIONS = 6
LOGITS = torch.tensor([1.5, 0.5, 0.0, -0.5, -1.0, 0.8])
ADVANTAGES = torch.tensor([1.0, -0.5, 2.0, 0.0, 3.0, -1.0])


def exact_gradient() -> torch.Tensor:
    """d/dtheta_k sum_a pi_a A_a = pi_k (A_k - sum_a pi_a A_a)."""
    policy = torch.softmax(LOGITS.double(), dim=0)
    return policy * (ADVANTAGES.double() - (policy * ADVANTAGES.double()).sum())


def estimated_gradient(mismatch, scale, correction, draws, seed) -> torch.Tensor:
    """Mean of w A(a) grad log pi(a) over ``draws`` actions from the sampler."""
    generator = torch.Generator().manual_seed(seed)
    logits = LOGITS.double().expand(draws, ACTIONS)  # (n, K)
    settings = SamplingSettings()
    scores = sampler_scores(logits, mismatch, scale, settings, generator)  # (n, K)
    sampler_log_probs = torch.log_softmax(scores.double(), dim=-1)  # (n, K)
    actions = torch.multinomial(sampler_log_probs.exp(), 1, generator=generator)
    theta = LOGITS.double().clone().requires_grad_(True)
    trainer = torch.log_softmax(theta, dim=0)[actions]  # (n, 1)
    weights, _ = sampler_correction_weights(
        trainer.detach(),
        sampler_log_probs.gather(1, actions),  # (n, 1)
        torch.ones_like(trainer),
        mode=correction,
        cap=1e6,
    )  # (n, 1)
    loss = (weights * ADVANTAGES.double()[actions] * trainer).mean()
    (gradient,) = torch.autograd.grad(loss, theta)
    return gradient


@pytest.mark.parametrize(("mismatch", "scale"), [("temperature", 0.6), ("noise", 1.5)])
def test_token_truncate_with_a_large_cap_removes_the_bias(mismatch, scale):
    exact = exact_gradient()
    draws = 200_000

    def bias(estimate):
        return ((estimate - exact).norm() / exact.norm()).item()

    floor = bias(estimated_gradient("none", None, "none", draws, 0))
    floor = max(floor, bias(estimated_gradient("none", None, "none", draws, 1)))
    uncorrected = bias(estimated_gradient(mismatch, scale, "none", draws, 2))
    corrected = bias(estimated_gradient(mismatch, scale, "token_truncate", draws, 3))
    # The perturbed sampler's mean gradient is off by far more than sampling
    # noise; reweighting by pi / pi_sampler brings it back to the noise level.
    assert uncorrected > 10 * floor, (uncorrected, floor)
    assert corrected < uncorrected / 5, (corrected, uncorrected)
    assert corrected < 4 * floor, (corrected, floor)
