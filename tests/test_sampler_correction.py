"""Importance-sampling correction against the sampler's log-probs (TIS / MIS)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from grpo_lab.sampler_correction import (
    CORRECTION_MODES,
    check_sampler_correction,
    correction_weights,
    sampler_correction_weights,
    sampler_log_prob_gap,
    sampler_weights_and_metrics,
)

# Two responses: 3 and 2 response tokens; the last columns are padding.
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
# Token ratios rho = pi_trainer / pi_sampler on the response tokens.
RATIOS = torch.tensor(
    [[2.0, 0.5, 4.0, 1.0], [1.5, 0.25, 1.0, 1.0]], dtype=torch.float64
)
SAMPLER = torch.full((2, 4), -2.0, dtype=torch.float64)
TRAINER = SAMPLER + RATIOS.log()  # log-probs <= 0: the largest is -2 + ln 4


def weights_of(mode, trainer=TRAINER, sampler=SAMPLER, mask=MASK, **bounds):
    return sampler_correction_weights(trainer, sampler, mask, mode=mode, **bounds)


# mode, bounds -> expected weights and diagnostics, by hand:
#   sequence ratios: 2 * 0.5 * 4 = 4 and 1.5 * 0.25 = 0.375.
CLOSED_FORMS = {
    # min(rho, 3): only the 4 is cut.
    "token_truncate": (
        {"cap": 3.0},
        [[2.0, 0.5, 3.0, 0.0], [1.5, 0.25, 0.0, 0.0]],
        # ratio min / mean / max over 5 tokens: 0.25, 7.25 / 5, 3
        {"is_ratio_min": 0.25, "is_ratio_mean": 1.45, "is_ratio_max": 3.0},
        (1 / 5, 1 / 2),
    ),
    # rho outside [0.3, 3] -> 0: the 4 and the 0.25.
    "token_mask": (
        {"low": 0.3, "high": 3.0},
        [[2.0, 0.5, 0.0, 0.0], [1.5, 0.0, 0.0, 0.0]],
        {"is_ratio_min": 0.0, "is_ratio_mean": 0.8, "is_ratio_max": 2.0},
        (2 / 5, 2 / 2),
    ),
    # min(4, 3) = 3 on row 0; 0.375 on row 1. Statistics over the 2 responses.
    "sequence_truncate": (
        {"cap": 3.0},
        [[3.0, 3.0, 3.0, 0.0], [0.375, 0.375, 0.0, 0.0]],
        {"is_ratio_min": 0.375, "is_ratio_mean": 1.6875, "is_ratio_max": 3.0},
        (3 / 5, 1 / 2),
    ),
    # 4 is outside [0.3, 3]: row 0 masked out; 0.375 kept.
    "sequence_mask": (
        {"low": 0.3, "high": 3.0},
        [[0.0, 0.0, 0.0, 0.0], [0.375, 0.375, 0.0, 0.0]],
        {"is_ratio_min": 0.0, "is_ratio_mean": 0.1875, "is_ratio_max": 0.375},
        (3 / 5, 1 / 2),
    ),
}


@pytest.mark.parametrize("mode", list(CLOSED_FORMS))
def test_closed_forms(mode):
    bounds, expected, ratio_stats, (token_fraction, sequence_fraction) = CLOSED_FORMS[
        mode
    ]
    weights, metrics = weights_of(mode, **bounds)
    torch.testing.assert_close(
        weights, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12
    )
    for key, value in ratio_stats.items():
        assert metrics[key] == pytest.approx(value, abs=1e-12), key
    assert metrics["is_token_corrected_fraction"] == pytest.approx(token_fraction)
    assert metrics["is_sequence_corrected_fraction"] == pytest.approx(sequence_fraction)


def test_gap_metrics_by_hand():
    # |log rho| on the 5 response tokens: log 2, log 2, log 4, log 1.5, log 4.
    gaps = [math.log(2), math.log(2), math.log(4), math.log(1.5), math.log(4)]
    for mode in CORRECTION_MODES:
        _, metrics = weights_of(mode)
        assert metrics["sampler_log_prob_diff_mean"] == pytest.approx(sum(gaps) / 5)
        assert metrics["sampler_log_prob_diff_max"] == pytest.approx(math.log(4))


def test_none_is_the_mask_and_reports_only_the_gap():
    weights, metrics = weights_of("none")
    torch.testing.assert_close(weights, MASK.double(), rtol=0, atol=0)
    assert set(metrics) == {"sampler_log_prob_diff_mean", "sampler_log_prob_diff_max"}


def test_bounds_are_kept_inclusive():
    # rho exactly at the cap is not corrected; exactly at low / high is kept.
    ratios = torch.tensor([[1.0, 0.5, 0.25]], dtype=torch.float64)  # exp(log) exact
    trainer, sampler, mask = ratios.log(), torch.zeros(1, 3).double(), torch.ones(1, 3)
    weights, metrics = weights_of(
        "token_mask", trainer, sampler, mask, low=0.25, high=1
    )
    torch.testing.assert_close(weights, ratios, rtol=0, atol=0)
    assert metrics["is_token_corrected_fraction"] == 0.0
    _, metrics = weights_of("token_truncate", trainer, sampler, mask, cap=1.0)
    assert metrics["is_token_corrected_fraction"] == 0.0


def test_sequence_ratio_is_the_product_not_the_geometric_mean():
    # Two tokens of ratio 2: product 4 (> cap 3), geometric mean 2 (< cap).
    trainer = torch.zeros(1, 2, dtype=torch.float64)
    sampler = torch.full((1, 2), -math.log(2), dtype=torch.float64)
    weights, _ = weights_of("sequence_truncate", trainer, sampler, torch.ones(1, 2))
    torch.testing.assert_close(weights, torch.full((1, 2), 3.0, dtype=torch.float64))


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_weights_are_detached(mode):
    trainer = TRAINER.clone().requires_grad_()
    sampler = SAMPLER.clone().requires_grad_()
    weights, _ = weights_of(mode, trainer, sampler, low=0.3)
    assert not weights.requires_grad
    # Nothing flows back through w into either log-prob.
    (weights.sum() + (trainer * 0).sum()).backward()
    assert torch.equal(trainer.grad, torch.zeros_like(trainer))
    assert sampler.grad is None


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_masked_positions_are_ignored_whatever_they_hold(mode):
    junk_trainer, junk_sampler = TRAINER.clone(), SAMPLER.clone()
    junk_trainer[0, 3], junk_sampler[0, 3] = float("nan"), float("inf")
    junk_trainer[1, 2], junk_sampler[1, 2] = float("-inf"), 50.0
    junk_trainer[1, 3], junk_sampler[1, 3] = 80.0, float("nan")
    clean = weights_of(mode, low=0.3)
    junk = weights_of(mode, junk_trainer, junk_sampler, low=0.3)
    torch.testing.assert_close(junk[0], clean[0], rtol=0, atol=0)
    assert junk[1] == clean[1]


def test_a_nan_sampler_log_prob_counts_as_ratio_one_in_the_train_step():
    # As TRL: a token the sampler did not score gets rho = 1 (no correction), in
    # the core the train step calls; the door a direct caller meets refuses it.
    sampler = SAMPLER.clone()
    sampler[0, 2] = float("nan")
    weights, metrics = sampler_weights_and_metrics(
        TRAINER, sampler, MASK, "token_truncate", 3.0, 0.0, 3.0
    )
    assert weights[0, 2] == 1.0
    assert metrics["sampler_log_prob_diff_max"] == pytest.approx(math.log(4))
    weights, _ = sampler_weights_and_metrics(
        TRAINER, sampler, MASK, "sequence_truncate", 3.0, 0.0, 3.0
    )
    assert weights[0, 0] == pytest.approx(1.0)  # 2 * 0.5 * 1
    with pytest.raises(
        ValueError,
        match=r"^sampler_log_probs must be log-probabilities \(<= 0, not NaN\) "
        r"inside the response mask, got nan at 1 of 5 positions$",
    ):
        weights_of("token_truncate", sampler=sampler)


def test_the_door_refuses_a_mask_or_log_probs_it_would_misread():
    """A 0.5 mask would read as 1; a positive or +inf log-prob is no
    probability (its ratio would be clipped into a weight); a meta tensor holds
    no values. Masked-out positions may hold anything."""
    with pytest.raises(
        ValueError, match=r"^response_mask must hold only 0 and 1 .*got 0\.5$"
    ):
        weights_of("token_truncate", mask=MASK * 0.5)
    for value in (0.5, math.inf):
        trainer = TRAINER.clone()
        trainer[1, 0] = value
        with pytest.raises(
            ValueError, match=rf"^trainer_log_probs .*got {value!r} at 1"
        ):
            weights_of("token_truncate", trainer=trainer)
        trainer[1, 3] = trainer[1, 0]  # padding: ignored
        trainer[1, 0] = TRAINER[1, 0]
        assert weights_of("token_truncate", trainer=trainer)[0][1, 3] == 0
    with pytest.raises(ValueError, match=r"^trainer_log_probs must hold values"):
        weights_of("none", trainer=TRAINER.to("meta"))
    assert weights_of("none", mask=MASK.bool())[0].sum() == 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_are_computed_in_float32(dtype):
    # A log-ratio of 1e-3 vanishes in half precision but not in float32.
    trainer = torch.full((1, 2), -2.0, dtype=dtype)
    sampler = torch.full((1, 2), -2.0, dtype=dtype)
    trainer_exact = trainer.float() + 1e-3
    weights, _ = weights_of("token_truncate", trainer_exact, sampler, torch.ones(1, 2))
    assert weights.dtype == torch.float32
    assert weights[0, 0].item() == pytest.approx(math.exp(1e-3), rel=1e-6)
    half_weights, _ = weights_of("token_mask", trainer, sampler, torch.ones(1, 2))
    assert half_weights.dtype == torch.float32


def test_empty_mask_gives_zero_weights_and_zero_metrics():
    weights, metrics = weights_of("token_mask", mask=torch.zeros(2, 4))
    assert torch.equal(weights, torch.zeros(2, 4, dtype=torch.float64))
    assert all(value == 0.0 for value in metrics.values())
    assert sampler_log_prob_gap(TRAINER, SAMPLER, torch.zeros(2, 4)) == {
        "sampler_log_prob_diff_mean": 0.0,
        "sampler_log_prob_diff_max": 0.0,
    }


def test_correction_weights_match_the_public_function():
    for mode in CORRECTION_MODES:
        weights, corrected = correction_weights(
            TRAINER, SAMPLER, MASK, mode=mode, low=0.3
        )
        assert torch.equal(weights, weights_of(mode, low=0.3)[0])
        assert not corrected[~MASK.bool()].any()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("clip", 3.0, 0.0, 3.0), "sampler_correction must be one of"),
        (("token_truncate", 0.0, 0.0, 3.0), "sampler_correction_cap"),
        (("token_truncate", -1.0, 0.0, 3.0), "sampler_correction_cap"),
        (("token_truncate", float("nan"), 0.0, 3.0), "sampler_correction_cap"),
        (("token_truncate", True, 0.0, 3.0), "sampler_correction_cap"),
        (("token_mask", 3.0, -0.1, 3.0), "sampler_correction_low"),
        (("token_mask", 3.0, float("nan"), 3.0), "sampler_correction_low"),
        (("token_mask", 3.0, float("inf"), 3.0), "sampler_correction_low"),
        (("token_mask", 3.0, 0.0, float("nan")), "sampler_correction_high"),
        (("token_mask", 3.0, 0.0, 0.0), "sampler_correction_high"),
        (("token_mask", 3.0, 2.0, 0.5), "sampler_correction_low must be below"),
        (("token_mask", 3.0, 2.0, 2.0), "sampler_correction_low must be below"),
        (("none", 3.0, 2.0, 0.5), "sampler_correction_low must be below"),
    ],
)
def test_bad_settings_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        check_sampler_correction(*arguments)
    with pytest.raises(ValueError, match=message):
        mode, cap, low, high = arguments
        sampler_correction_weights(
            TRAINER, SAMPLER, MASK, mode=mode, cap=cap, low=low, high=high
        )


def test_good_settings_pass():
    check_sampler_correction("token_truncate", math.inf, 0.0, math.inf)
    check_sampler_correction("sequence_mask", 3.0, 0.5, 2.0)


@pytest.mark.parametrize(
    ("trainer", "sampler", "mask", "name"),
    [
        (TRAINER[:, :3], SAMPLER, MASK, "trainer_log_probs"),
        (TRAINER, SAMPLER[:1], MASK, "sampler_log_probs"),
        (TRAINER, SAMPLER, MASK[0], "response_mask"),
        (TRAINER, [[0.0]], MASK, "sampler_log_probs"),
    ],
)
def test_bad_shapes_are_refused(trainer, sampler, mask, name):
    with pytest.raises(ValueError, match=name):
        weights_of("token_truncate", trainer, sampler, mask)


# --- Parity with TRL 1.16 -------------------------------------------------------


TRL_PROMPTS = ["12>", "34>"]
TRL_GROUP_SIZE = 2
TRL_COMPLETIONS = ["21$", "2", "1x2$", "4344"]  # "$": <eos>
TRL_BOUNDS = {"clip_max": 1.6, "clip_min": 0.7}  # mask modes: [0.7, 1.6]


def trl_inputs(mode: str, sampler_noise: float = 0.4) -> dict:
    """TRL's own ``_generate_and_score_completions`` on fixed completions whose
    "vLLM" log-probs are the policy's plus noise; returns its inputs dict.

    GRPOTrainer is built without vLLM (nothing to import or download), with
    ``vllm_importance_sampling_correction=True``; ``use_vllm`` is switched on
    afterwards so the method takes its vLLM branch, where the IS ratio is
    computed. The completions come from a ``rollout_func`` that returns the
    sampler log-probs, the scorer is the naive float64 log_softmax, and the
    ratio itself is TRL's code, not a copy.
    """
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from grpo_lab.models import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    completion_ids = [encode(tokenizer, c) for c in TRL_COMPLETIONS]
    prompt_ids = {p: tokenizer.encode(p, add_special_tokens=False) for p in TRL_PROMPTS}
    policy_log_probs = _naive_completion_log_probs(
        tokenizer,
        [prompt_ids[p] for p in TRL_PROMPTS for _ in range(2)],
        completion_ids,
    )
    generator = torch.Generator().manual_seed(0)
    sampler = [
        (
            row
            + sampler_noise
            * torch.randn(row.shape, generator=generator, dtype=row.dtype)
        ).tolist()
        for row in policy_log_probs
    ]

    def rollout(prompts, trainer):
        return {
            "prompt_ids": [prompt_ids[p] for p in prompts],
            "completion_ids": completion_ids,
            "logprobs": sampler,
        }

    args = GRPOConfig(
        output_dir="unused",
        use_cpu=True,
        per_device_train_batch_size=len(TRL_COMPLETIONS),
        num_generations=TRL_GROUP_SIZE,
        max_completion_length=6,
        report_to=[],
        save_strategy="no",
        bf16=False,
        loss_type="grpo",
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=TRL_BOUNDS["clip_max"],
        vllm_importance_sampling_clip_min=(
            TRL_BOUNDS["clip_min"] if mode.endswith("_mask") else None
        ),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=_tiny_model(tokenizer),
            reward_funcs=lambda prompts, completions, **kw: [1.0, 0.0, 0.5, 0.0],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": TRL_PROMPTS}),
            processing_class=tokenizer,
            rollout_func=rollout,
        )
        trainer.model.train()  # TRL logs under "train"
        trainer.use_vllm = True
        trainer._last_loaded_step = trainer.state.global_step  # no weight sync
        trainer._get_per_token_logps_and_entropies = _naive_trl_scorer
        prompts = [{"prompt": p} for p in TRL_PROMPTS for _ in range(TRL_GROUP_SIZE)]
        inputs = trainer._generate_and_score_completions(prompts)
    inputs["trainer"] = trainer
    return inputs


def encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text.replace("$", ""), add_special_tokens=False)
    return ids + [tokenizer.eos_token_id] * text.count("$")


def _tiny_model(tokenizer):
    from grpo_lab.models import build_tiny_qwen2

    sizes = {"hidden_size": 16, "num_layers": 1, "intermediate_size": 32}
    return build_tiny_qwen2(tokenizer, seed=0, **sizes).double()


def _naive_completion_log_probs(tokenizer, prompt_ids, completion_ids):
    """log pi of each completion token under a fresh tiny model (float64)."""
    model = _tiny_model(tokenizer)
    rows = []
    with torch.no_grad():
        for prompt, completion in zip(prompt_ids, completion_ids):
            ids = torch.tensor([prompt + completion])
            log_softmax = torch.log_softmax(model(input_ids=ids).logits, dim=-1)
            positions = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
            rows.append(log_softmax[0, positions, ids[0, len(prompt) :]])
    return rows


def _naive_trl_scorer(model, input_ids, attention_mask, logits_to_keep, **kwargs):
    """TRL's scorer in float64: log_softmax of the completion tokens' logits."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    log_softmax = torch.log_softmax(logits[:, -logits_to_keep - 1 : -1], dim=-1)
    labels = input_ids[:, -logits_to_keep:]  # (B, C)
    log_probs = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, C)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)  # (B, C)
    return log_probs, entropy, None


TRL_TO_OURS = {
    "token_truncate": {"cap": TRL_BOUNDS["clip_max"]},
    "sequence_truncate": {"cap": TRL_BOUNDS["clip_max"]},
    "token_mask": {"low": TRL_BOUNDS["clip_min"], "high": TRL_BOUNDS["clip_max"]},
    "sequence_mask": {"low": TRL_BOUNDS["clip_min"], "high": TRL_BOUNDS["clip_max"]},
}


@pytest.fixture(scope="module", params=list(TRL_TO_OURS))
def trl_case(request):
    return request.param, trl_inputs(request.param)


def test_weights_match_trl(trl_case):
    mode, inputs = trl_case
    mask = inputs["completion_mask"]  # (B, C)
    trl_ratio = inputs["importance_sampling_ratio"]  # (B, C) or (B, 1)
    assert trl_ratio.dtype == torch.float64
    weights, metrics = sampler_correction_weights(
        inputs["old_per_token_logps"],
        inputs["sampling_per_token_logps"],
        mask,
        mode=mode,
        **TRL_TO_OURS[mode],
    )
    expected = (trl_ratio * mask).expand_as(weights)  # (B, C)
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-12)
    # The bounds bind on these inputs (a test where nothing is corrected
    # would prove little) and not everything is cut either.
    assert metrics["is_sequence_corrected_fraction"] > 0
    assert 0 < metrics["is_token_corrected_fraction"] < 1
    # TRL's own logged ratio statistics and log-prob gap.
    logged = inputs["trainer"]._metrics["train"]
    for ours, theirs in (
        ("is_ratio_min", "sampling/importance_sampling_ratio/min"),
        ("is_ratio_mean", "sampling/importance_sampling_ratio/mean"),
        ("is_ratio_max", "sampling/importance_sampling_ratio/max"),
        ("sampler_log_prob_diff_mean", "sampling/sampling_logp_difference/mean"),
        ("sampler_log_prob_diff_max", "sampling/sampling_logp_difference/max"),
    ):
        assert metrics[ours] == pytest.approx(logged[theirs][-1], abs=1e-12), ours


def test_corrected_loss_and_gradients_match_trl(trl_case):
    """TRL's ``_compute_loss`` (loss_type grpo, the IS ratio on its inputs)
    against ``policy_gradient_update`` with the same old and sampler log-probs:
    the loss value and every parameter gradient, in float64."""
    from grpo_lab.masks import pad_prompt_and_response_ids
    from grpo_lab.teaching.gradient_recorder import GradientRecorder
    from grpo_lab.train_step import policy_gradient_update

    mode, inputs = trl_case
    trainer = inputs["trainer"]
    trainer.model.zero_grad(set_to_none=True)
    trainer.current_gradient_accumulation_steps = 1
    trainer.beta = 0.0
    trl_loss = trainer._compute_loss(trainer.model, inputs)
    trl_loss.backward()
    trl_gradients = [p.grad.clone() for p in trainer.model.parameters()]

    tokenizer = trainer.processing_class
    batch = pad_prompt_and_response_ids(
        [p.tolist() for p in inputs["prompt_ids"]],
        [encode(tokenizer, c) for c in TRL_COMPLETIONS],
        tokenizer.pad_token_id,
    )
    mask = batch["response_mask"]

    def ours(name):  # (B, C) completion-aligned -> (B, T) grpo_lab layout
        out = torch.zeros(mask.shape, dtype=torch.float64)
        values = inputs[name][inputs["completion_mask"].bool()]
        out[mask.bool()] = values.double()  # float32 sampler values exactly
        return out

    def update(**correction):
        model = _tiny_model(tokenizer)
        recorder = GradientRecorder(model.parameters())
        loss, metadata = policy_gradient_update(
            model,
            recorder,
            1,
            None,
            batch,
            inputs["advantages"].double(),
            "grpo",
            ours("old_per_token_logps"),
            0.2,
            "sequence",
            sampler_log_probs=ours("sampling_per_token_logps"),
            **correction,
        )
        return loss, recorder.gradients, metadata

    loss, gradients, metadata = update(
        sampler_correction=mode,
        **{f"sampler_correction_{k}": v for k, v in TRL_TO_OURS[mode].items()},
    )
    assert abs(loss.item() - trl_loss.item()) < 1e-12
    for theirs, mine in zip(trl_gradients, gradients):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)
    assert metadata["is_token_corrected_fraction"] > 0
    # Without the correction the gradient differs: the weights bind.
    _, plain, plain_metadata = update()
    assert max((a - b).abs().max().item() for a, b in zip(plain, gradients)) > 1e-6
    assert "is_ratio_mean" not in plain_metadata
    assert plain_metadata["sampler_log_prob_diff_max"] == pytest.approx(
        metadata["sampler_log_prob_diff_max"]
    )


# --- In the update ----------------------------------------------------------------


def update_batch():
    from grpo_lab.masks import pad_prompt_and_response_ids
    from grpo_lab.models import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ["1>", "22>"]]
    responses = [encode(tokenizer, c) for c in ["21$", "3"]]
    batch = pad_prompt_and_response_ids(prompts, responses, tokenizer.pad_token_id)
    return tokenizer, batch


def current_log_probs(model, batch):
    logits = model(input_ids=batch["input_ids"]).logits  # (B, T, V)
    log_softmax = torch.log_softmax(logits, dim=-1)
    return log_softmax.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)


def run_update(model, batch, advantages, **keywords):
    from grpo_lab.teaching.gradient_recorder import GradientRecorder
    from grpo_lab.train_step import policy_gradient_update

    recorder = GradientRecorder(model.parameters())
    loss, metadata = policy_gradient_update(
        model, recorder, 1, None, batch, advantages, **keywords
    )
    return loss, recorder.gradient, metadata


def test_update_gradient_is_the_weighted_closed_form():
    # On-policy REINFORCE ("none"), sequence normalization:
    #   loss = (1/B) sum_i (1/|o_i|) sum_t -A_i * w_t * log pi_t,
    # w_t = min(pi_t / pi_sampler_t, cap) with pi_trainer = the current policy.
    tokenizer, batch = update_batch()
    mask = batch["response_mask"].double()
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)
    model = _tiny_model(tokenizer)
    with torch.no_grad():
        current = current_log_probs(model, batch)  # (B, T)
    # Hand-picked token ratios on the response tokens: 2, 0.5, 4 | 1.5.
    ratios = torch.ones(mask.shape, dtype=torch.float64)
    ratios[mask.bool()] = torch.tensor([2.0, 0.5, 4.0, 1.5], dtype=torch.float64)
    sampler = current - ratios.log()
    expected_weights = torch.clamp(ratios, max=3.0) * mask  # (B, T)

    oracle = _tiny_model(tokenizer)
    log_probs = current_log_probs(oracle, batch)
    per_token = -advantages[:, None] * expected_weights * log_probs  # (B, T)
    loss = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
    loss.backward()
    oracle_gradient = torch.cat([p.grad.flatten() for p in oracle.parameters()])

    corrected_loss, gradient, metadata = run_update(
        model,
        batch,
        advantages,
        sampler_log_probs=sampler,
        sampler_correction="token_truncate",
        sampler_correction_cap=3.0,
    )
    torch.testing.assert_close(gradient, oracle_gradient, rtol=1e-10, atol=1e-12)
    assert corrected_loss.item() == pytest.approx(loss.item(), rel=1e-10)
    assert metadata["is_token_corrected_fraction"] == pytest.approx(1 / 4)
    assert metadata["is_ratio_max"] == pytest.approx(3.0)
    # The correction changed the gradient.
    _, plain_gradient, _ = run_update(_tiny_model(tokenizer), batch, advantages)
    assert (plain_gradient - gradient).abs().max() > 1e-6


def test_mode_none_is_bit_identical_to_no_sampler_log_probs():
    tokenizer, batch = update_batch()
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)
    sampler = torch.full(batch["labels"].shape, -0.7, dtype=torch.float64)
    old = sampler + 0.1
    for keywords in ({}, {"importance_reweighting_method": "grpo", "cliprange": 0.2}):
        if keywords:
            keywords["old_log_probs"] = old
        loss, gradient, metadata = run_update(
            _tiny_model(tokenizer), batch, advantages, **keywords
        )
        with_loss, with_gradient, with_metadata = run_update(
            _tiny_model(tokenizer),
            batch,
            advantages,
            sampler_log_probs=sampler,
            sampler_correction="none",
            **keywords,
        )
        assert torch.equal(loss, with_loss)
        assert torch.equal(gradient, with_gradient)
        extra = set(with_metadata) - set(metadata)
        assert extra == {"sampler_log_prob_diff_mean", "sampler_log_prob_diff_max"}
        for key, value in metadata.items():
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(with_metadata[key])
            )
    # Off-policy, the gap is measured against old_log_probs: |(-0.6) - (-0.7)|.
    assert with_metadata["sampler_log_prob_diff_max"] == pytest.approx(0.1)


def test_correction_without_sampler_log_probs_is_refused():
    tokenizer, batch = update_batch()
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"sampler_correction.*returned no sampler"):
        run_update(
            _tiny_model(tokenizer), batch, advantages, sampler_correction="token_mask"
        )
    with pytest.raises(ValueError, match="sampler_log_probs must have the shape"):
        run_update(
            _tiny_model(tokenizer),
            batch,
            advantages,
            sampler_log_probs=torch.zeros(2, 1),
            sampler_correction="token_mask",
        )


def test_update_settings_refuse_bad_bounds():
    from grpo_lab.train_step import UpdateSettings

    with pytest.raises(ValueError, match=r"^sampler_correction_low"):
        UpdateSettings(sampler_correction_low=2.0, sampler_correction_high=1.0)
    with pytest.raises(ValueError, match=r"^sampler_correction_cap"):
        UpdateSettings(sampler_correction_cap=0.0)
    with pytest.raises(ValueError, match=r"^sampler_correction must"):
        UpdateSettings(sampler_correction="tis")


# --- In the loop ------------------------------------------------------------------


@pytest.fixture
def loop_rollouts(even_digit_task):
    """``loop_rollouts(tmp_path, with_sampler=True, **overrides)``: a tiny
    policy, hf rollouts of the even-first-digit task, and sampler log-probs."""

    def build(tmp_path, with_sampler=True, **overrides):
        """A tiny policy, hf rollouts, and (by hand) sampler log-probs: the policy's
        own log-probs of the sampled tokens plus noise, one row per response.

        ``with_sampler=False`` drops the backend's own sampler log-probs, as a
        backend that reports none would."""
        from grpo_lab.logprobs import get_response_log_probs
        from grpo_lab.tasks import get_task
        from grpo_lab.training import loop
        from grpo_lab.training.config import TrainConfig

        config = TrainConfig.for_profile(
            "cpu",
            **{
                "run_dir": str(tmp_path / "run"),
                "tiny_hidden_size": 32,
                "tiny_num_layers": 1,
                "tiny_intermediate_size": 64,
                "task_options": {"n_digits": 3},
                "max_new_tokens": 5,
                "rollout_batch_size": 32,
                "group_size": 4,
                "train_batch_size": 32,
                "sft_max_steps": 0,
                **overrides,
            },
        )
        policy = loop.build_policy(config)
        task = even_digit_task()
        examples = get_task("reverse", n_digits=3).train(8, seed=0)
        rollouts = policy.backend.generate(
            [e.prompt for e in examples],
            4,
            loop.sampling_settings(config, task, seed=1),
        )
        if with_sampler:
            batch = loop.rollout_token_batch(rollouts, policy.tokenizer)
            with torch.no_grad():
                scored = get_response_log_probs(
                    policy.model, batch["input_ids"], batch["labels"]
                )["log_probs"]  # (B, T)
            generator = torch.Generator().manual_seed(0)
            noisy = scored + 0.3 * torch.randn(scored.shape, generator=generator)
            mask = batch["response_mask"].bool()
            rollouts.sampler_log_probs = [
                row[m].tolist() for row, m in zip(noisy, mask)
            ]
        else:  # a backend that reports no sampler log-probs (hf reports its own)
            rollouts.sampler_log_probs = None
        return config, task, policy, rollouts, examples

    return build


IS_KEYS = [
    "rollout/is_ratio_min",
    "rollout/is_ratio_mean",
    "rollout/is_ratio_max",
    "rollout/is_token_corrected_fraction",
    "rollout/is_sequence_corrected_fraction",
]
GAP_METRICS = [
    "rollout/sampler_log_prob_diff_mean",
    "rollout/sampler_log_prob_diff_max",
]


@pytest.mark.parametrize(
    "schedule",
    [{}, {"train_batch_size": 16, "importance_reweighting_method": "grpo"}],
    ids=["on-policy", "off-policy"],
)
def test_grpo_update_logs_the_correction_under_rollout(
    tmp_path, schedule, loop_rollouts
):
    from grpo_lab.training import loop

    if schedule:
        schedule = {**schedule, "cliprange": 0.2}
    config, task, policy, rollouts, examples = loop_rollouts(
        tmp_path,
        sampler_correction="token_mask",
        sampler_correction_low=0.8,
        sampler_correction_high=1.25,
        **schedule,
    )
    record = loop.grpo_update(config, task, policy, rollouts, examples)
    assert record["train/optimizer_steps"] >= 1
    for key in IS_KEYS + GAP_METRICS:
        assert key in record, key
    # noise 0.3 on each log-prob: some tokens fall outside [0.8, 1.25], not all.
    assert 0 < record["rollout/is_token_corrected_fraction"] < 1
    assert record["rollout/is_ratio_min"] == 0.0  # a masked token
    assert record["rollout/is_ratio_max"] <= 1.25
    assert 0.1 < record["rollout/sampler_log_prob_diff_mean"] < 0.5
    assert not any("is_" in key or "sampler" in key for key in record if "loss/" in key)


def test_grpo_update_without_a_correction_logs_only_the_gap(tmp_path, loop_rollouts):
    from grpo_lab.training import loop

    config, task, policy, rollouts, examples = loop_rollouts(tmp_path)
    record = loop.grpo_update(config, task, policy, rollouts, examples)
    assert set(GAP_METRICS) <= set(record)
    assert not set(IS_KEYS) & set(record)
    # No sampler log-probs: exactly today's keys, none of these.
    config, task, policy, rollouts, examples = loop_rollouts(
        tmp_path, with_sampler=False
    )
    plain = loop.grpo_update(config, task, policy, rollouts, examples)
    assert set(plain) == set(record) - set(GAP_METRICS)


def test_a_correction_with_a_backend_that_returned_none_is_refused(
    tmp_path, loop_rollouts
):
    from grpo_lab.training import loop

    config, task, policy, rollouts, examples = loop_rollouts(
        tmp_path, with_sampler=False, sampler_correction="token_truncate"
    )
    with pytest.raises(ValueError, match="returned no sampler log-probs"):
        loop.grpo_update(config, task, policy, rollouts, examples)


def test_sampler_rows_must_match_the_response_tokens():
    from grpo_lab.rollouts.base import Rollouts
    from grpo_lab.training import loop

    rollouts = Rollouts(["1>"], ["2"], [[3, 83]], [[4, 1]], [[-0.5, None]])
    mask = torch.tensor([[0, 1, 1]])
    padded = loop.sampler_log_prob_batch(rollouts, mask)
    assert padded[0, 0] == 0 and padded[0, 1] == -0.5 and padded[0, 2].isnan()
    rollouts.sampler_log_probs = [[-0.5]]
    with pytest.raises(ValueError, match="one value per response token"):
        loop.sampler_log_prob_batch(rollouts, mask)


def test_a_bad_bound_names_the_function_that_was_called():
    trainer = SAMPLER + RATIOS.log()  # (B, T)
    with pytest.raises(ValueError, match=r"sampler_correction_weights's cap"):
        sampler_correction_weights(trainer, SAMPLER, MASK, mode="token_truncate", cap=0)
    with pytest.raises(ValueError, match=r"\(correction_weights's cap"):
        correction_weights(trainer, SAMPLER, MASK, mode="token_truncate", cap=0.0)
