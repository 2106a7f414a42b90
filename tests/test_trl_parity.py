"""grpo_lab against TRL 1.16's GRPOTrainer loss, in float64, option by option.

TRL's own code computes every number on its side: ``_generate_and_score_completions``
turns fixed completions (a ``rollout_func``; nothing is generated or downloaded)
and fixed rewards into advantages and masks, and ``_compute_loss`` computes the
loss, which is backpropagated into a tiny float64 Qwen2. Only its scorer is
replaced, by the naive float64 form (log_softmax of logits / T), because TRL's
fused head keeps float32 statistics; one test checks that fused head itself
against grpo_lab's scorer. grpo_lab's side is its own ``policy_gradient_update``
(parameter gradients) and ``microbatch_loss`` (the gradient by each token's
log-prob), configured as ``docs/translation_table.md`` says. Where the two
definitions differ, the test asserts that they differ and says why.

Run with ``-s`` to print each configuration's largest |difference|.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from pathlib import Path

import pytest
import torch
from trl import GRPOConfig

from grpo_lab import losses
from grpo_lab.advantages import (
    compute_group_normalized_rewards,
    compute_multi_reward_advantages,
)
from grpo_lab.integrations.trl.parity import (
    TrlFirstStep,
    fixed_completions_trainer,
    trl_first_step,
)
from grpo_lab.logprobs import get_response_log_probs
from grpo_lab.masks import pad_prompt_and_response_ids
from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.teaching.gradient_recorder import GradientRecorder
from grpo_lab.train_step import UpdateSettings, microbatch_loss, policy_gradient_update

PROMPTS = ["12>", "34>", "56>"]  # one length: no left padding on TRL's side
GROUP_SIZE = 4
ROW_PROMPTS = [p for p in PROMPTS for _ in range(GROUP_SIZE)]
# Completion token strings (one character per token; "$" stands for <eos>).
COMPLETIONS = [
    "21$",
    "2",
    "1x2$",
    "12",
    "43$",
    "4",
    "3344",
    "43",
    "65$",
    "6",
    "5",
    "65",
]
# Group 3 is all equal: zero advantages, yet a KL or entropy term moves it.
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 0.25, 0.0, 2.0, 1.0, 1.0, 1.0, 1.0]
MAX_COMPLETION_LENGTH = 6
SIZES = {"hidden_size": 16, "num_layers": 1, "intermediate_size": 32}
TOLERANCE = 1e-12  # float64, the same formula on both sides
REPORT: dict[str, float] = {}


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text.replace("$", ""), add_special_tokens=False)
    return ids + [tokenizer.eos_token_id] * text.count("$")


def fresh_model(tokenizer):
    return build_tiny_qwen2(tokenizer, seed=0, **SIZES).double()


def make_trainer(tokenizer, tmp_path, rewards, **config_fields):
    """A GRPOTrainer on fixed completions and rewards, as TRL builds it."""
    return fixed_completions_trainer(
        {
            "num_generations": GROUP_SIZE,
            "max_completion_length": MAX_COMPLETION_LENGTH,
            **config_fields,
        },
        fresh_model(tokenizer),
        tokenizer,
        ROW_PROMPTS,
        [encode(tokenizer, c) for c in COMPLETIONS],
        rewards,
        tmp_path,
    )


def perturbed(seed: int, scale: float, flip: bool = False):
    """current + scale x N(0, 1) noise (seeded; flipped over rows if asked)."""

    def log_probs(current, mask):
        generator = torch.Generator().manual_seed(seed)
        noise = torch.randn(current.shape, generator=generator, dtype=torch.float64)
        return current + scale * (noise.flip(0) if flip else noise)

    return log_probs


def run_trl(trainer, perturb_seed: int = 0, beta: float = 0.0) -> TrlFirstStep:
    """Advantages by TRL, old/reference log-probs set off the current policy,
    then TRL's loss on each accumulation microbatch, backpropagated."""
    return trl_first_step(trainer, ROW_PROMPTS, **off_policy(perturb_seed), beta=beta)


def off_policy(seed: int = 0) -> dict:
    """The old (current + 0.3 noise) and reference (current - 0.2 noise
    flipped) log-probs of trl_first_step."""
    return {
        "old_log_probs": perturbed(seed, 0.3),
        "reference_log_probs": perturbed(seed, -0.2, flip=True),
    }


def to_grpo_lab_layout(values: torch.Tensor, completion_mask, response_mask):
    """(B, C) completion-aligned values -> (B, T) in grpo_lab's padded layout."""
    out = torch.zeros(response_mask.shape, dtype=values.dtype)
    out[response_mask.bool()] = values[completion_mask.bool()]
    return out


def grpo_lab_batch(tokenizer):
    prompt_ids = [
        tokenizer.encode(p, add_special_tokens=False)
        for p in PROMPTS
        for _ in range(GROUP_SIZE)
    ]
    response_ids = [encode(tokenizer, c) for c in COMPLETIONS]
    return pad_prompt_and_response_ids(prompt_ids, response_ids, tokenizer.pad_token_id)


def run_grpo_lab(tokenizer, trl_run: TrlFirstStep, settings: UpdateSettings, steps=1):
    """The same loss by grpo_lab: parameter gradients of policy_gradient_update,
    and the gradient by each log-prob of microbatch_loss on the whole batch
    (with the sampler's log-probs when TRL's batch holds them)."""
    batch = grpo_lab_batch(tokenizer)
    inputs = trl_run.inputs
    mask = batch["response_mask"]
    old = to_grpo_lab_layout(
        inputs["old_per_token_logps"], inputs["completion_mask"], mask
    )
    reference = to_grpo_lab_layout(
        inputs["ref_per_token_logps"], inputs["completion_mask"], mask
    )
    sampler = inputs.get("sampling_per_token_logps")
    if sampler is not None:
        sampler = to_grpo_lab_layout(sampler, inputs["completion_mask"], mask)
    model = fresh_model(tokenizer)
    recorder = GradientRecorder(model.parameters())
    update_keywords = dataclasses.asdict(settings)
    loss, metadata = policy_gradient_update(
        model,
        recorder,
        steps,
        None,
        batch,
        inputs["advantages"],
        old_log_probs=old if settings.importance_reweighting_method != "none" else None,
        reference_log_probs=reference if settings.kl_coef > 0 else None,
        sampler_log_probs=sampler,
        **update_keywords,
    )
    # The gradient by log pi of the whole batch's loss (one microbatch).
    scoring_model = fresh_model(tokenizer)
    with torch.no_grad():
        logits = scoring_model(batch["input_ids"]).logits / settings.temperature
        log_softmax = torch.log_softmax(logits, dim=-1)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)  # (B, T)
    log_probs = log_softmax.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    log_probs = log_probs.clone().requires_grad_()
    microbatch = {
        "response_mask": mask,
        "advantages": inputs["advantages"],
        "old_log_probs": old,
        "reference_log_probs": reference,
    }
    if settings.importance_reweighting_method == "none":
        microbatch.pop("old_log_probs")
    if sampler is not None:
        microbatch["sampler_log_probs"] = sampler
    whole_loss, _ = microbatch_loss(log_probs, entropy, microbatch, settings)
    whole_loss.backward()
    gradient = log_probs.grad[mask.bool()]  # in TRL's row-major completion order
    return loss, whole_loss.detach(), gradient, recorder.gradients, metadata


def max_deltas(trl_run: TrlFirstStep, ours) -> dict[str, float]:
    loss, whole_loss, gradient, parameter_gradients, _ = ours
    trl_loss = sum(trl_run.losses)
    trl_gradient = trl_run.log_prob_gradients[trl_run.inputs["completion_mask"].bool()]
    return {
        "loss": (loss.double() - trl_loss).abs().item(),
        "whole_batch_loss": (whole_loss - trl_loss).abs().item(),
        "d_loss/d_log_prob": (gradient - trl_gradient).abs().max().item(),
        "parameter_gradients": max(
            (a - b).abs().max().item()
            for a, b in zip(parameter_gradients, trl_run.parameter_gradients)
        ),
    }


def assert_parity(name: str, deltas: dict[str, float], tolerance=TOLERANCE):
    REPORT[name] = max(deltas.values())
    print(f"\n{name}: max |delta| {REPORT[name]:.2e}  {deltas}")
    for key, value in deltas.items():
        assert value <= tolerance, (name, key, value)


# loss_type and TRL fields -> grpo_lab UpdateSettings fields (docs/translation_table.md)
LOSS_TYPES = {
    "grpo": {"importance_reweighting_method": "grpo", "loss_normalization": "sequence"},
    # bnpo on one microbatch: the token mean of that batch.
    "bnpo": {"importance_reweighting_method": "grpo", "loss_normalization": "token"},
    "dr_grpo": {
        "importance_reweighting_method": "grpo",
        "loss_normalization": "constant",
        "normalization_constant": len(COMPLETIONS) * MAX_COMPLETION_LENGTH,
    },
    "dapo": {"importance_reweighting_method": "grpo", "loss_normalization": "token"},
}

VESPO_SHAPE = {
    "vespo_k_pos": 1.5,
    "vespo_lambda_pos": 2.5,
    "vespo_k_neg": 2.0,
    "vespo_lambda_neg": 1.25,
}
CASES = {
    # name: (GRPOConfig fields, grpo_lab settings, TRL beta)
    "loss_type=grpo": ({"loss_type": "grpo"}, LOSS_TYPES["grpo"], 0.0),
    "loss_type=bnpo": ({"loss_type": "bnpo"}, LOSS_TYPES["bnpo"], 0.0),
    "loss_type=dr_grpo": ({"loss_type": "dr_grpo"}, LOSS_TYPES["dr_grpo"], 0.0),
    "loss_type=dapo": ({"loss_type": "dapo"}, LOSS_TYPES["dapo"], 0.0),
    "epsilon_high=0.28 (dapo)": (
        {"loss_type": "dapo", "epsilon_high": 0.28},
        {**LOSS_TYPES["dapo"], "cliprange_high": 0.28},
        0.0,
    ),
    "delta=1.5 (grpo)": (
        {"loss_type": "grpo", "delta": 1.5},
        {**LOSS_TYPES["grpo"], "ratio_cap": 1.5},
        0.0,
    ),
    # TRL's cispo epsilon_high is an absolute cap and there is no lower clip:
    # ours clips to [1 - eps_low, 1 + eps_high], so eps_low = 1 (a bound of 0
    # never binds) and eps_high = cap - 1.
    "loss_type=cispo (epsilon_high=1.3)": (
        {"loss_type": "cispo", "epsilon_high": 1.3},
        {
            "importance_reweighting_method": "cispo",
            "loss_normalization": "token",
            "cliprange": 1.0,
            "cliprange_high": 0.3,
        },
        0.0,
    ),
    # SAPO's temperatures are ones float32 holds exactly: TRL builds them with
    # torch.where on Python floats, a float32 tensor (1.05 would differ ~1e-8).
    "loss_type=sapo": (
        {"loss_type": "sapo", "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.5},
        {
            "importance_reweighting_method": "sapo",
            "loss_normalization": "sequence",
            "sapo_temperature_pos": 1.0,
            "sapo_temperature_neg": 1.5,
        },
        0.0,
    ),
    "importance_sampling_level=sequence (GSPO)": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.05},
        {
            "importance_reweighting_method": "gspo",
            "loss_normalization": "sequence",
            "cliprange": 0.05,
        },
        0.0,
    ),
    # LUSPO in its paper's setup: GSPO's sequence ratio, each response's loss
    # summed over its tokens, the mean over responses.
    "loss_type=luspo (sequence level)": (
        {
            "loss_type": "luspo",
            "importance_sampling_level": "sequence",
            "epsilon": 0.05,
        },
        {
            "importance_reweighting_method": "luspo",
            "loss_normalization": "sequence",
            "cliprange": 0.05,
        },
        0.0,
    ),
    "loss_type=luspo, delta=1.1": (
        {
            "loss_type": "luspo",
            "importance_sampling_level": "sequence",
            "epsilon": 0.05,
            "delta": 1.1,
        },
        {
            "importance_reweighting_method": "luspo",
            "loss_normalization": "sequence",
            "cliprange": 0.05,
            "ratio_cap": 1.1,
        },
        0.0,
    ),
    "loss_type=vespo": (
        {"loss_type": "vespo"},
        {"importance_reweighting_method": "vespo", "loss_normalization": "token"},
        0.0,
    ),
    # VESPO's k and lambda are ones float32 holds exactly: TRL builds them with
    # torch.where on Python floats, a float32 tensor.
    "loss_type=vespo, own shape, beta=0.1": (
        {"loss_type": "vespo", **VESPO_SHAPE, "use_bias_correction_kl": True},
        {
            "importance_reweighting_method": "vespo",
            "loss_normalization": "token",
            **VESPO_SHAPE,
            "kl_coef": 0.1,
            "kl_importance_weighting": True,
        },
        0.1,
    ),
    "off_policy_mask_threshold=0.05 (grpo)": (
        {"loss_type": "grpo", "off_policy_mask_threshold": 0.05},
        {**LOSS_TYPES["grpo"], "off_policy_mask_threshold": 0.05},
        0.0,
    ),
    "off_policy_mask_threshold=0.05 (vespo)": (
        {"loss_type": "vespo", "off_policy_mask_threshold": 0.05},
        {
            "importance_reweighting_method": "vespo",
            "loss_normalization": "token",
            "off_policy_mask_threshold": 0.05,
        },
        0.0,
    ),
    "beta=0.1, k3, use_bias_correction_kl=False": (
        {"loss_type": "dapo", "use_bias_correction_kl": False},
        {**LOSS_TYPES["dapo"], "kl_coef": 0.1, "kl_estimator": "k3"},
        0.1,
    ),
    "beta=0.1, k3, use_bias_correction_kl=True": (
        {"loss_type": "grpo", "use_bias_correction_kl": True},
        {
            **LOSS_TYPES["grpo"],
            "kl_coef": 0.1,
            "kl_estimator": "k3",
            "kl_importance_weighting": True,
        },
        0.1,
    ),
    "beta=0.1, use_bias_correction_kl=True, GSPO": (
        {
            "loss_type": "grpo",
            "importance_sampling_level": "sequence",
            "use_bias_correction_kl": True,
        },
        {
            "importance_reweighting_method": "gspo",
            "loss_normalization": "sequence",
            "kl_coef": 0.1,
            "kl_importance_weighting": True,
        },
        0.1,
    ),
    "top_entropy_quantile=0.3": (
        {"loss_type": "grpo", "top_entropy_quantile": 0.3},
        {**LOSS_TYPES["grpo"], "top_entropy_quantile": 0.3},
        0.0,
    ),
    "temperature=0.7": (
        {"loss_type": "dapo", "temperature": 0.7},
        {**LOSS_TYPES["dapo"], "temperature": 0.7},
        0.0,
    ),
    "entropy_coef=0.05 (dapo)": (
        {"loss_type": "dapo", "entropy_coef": 0.05},
        {**LOSS_TYPES["dapo"], "entropy_coef": 0.05},
        0.0,
    ),
}


def settings_for(fields: dict) -> UpdateSettings:
    return UpdateSettings(**{"cliprange": 0.2, **fields})


# What each case's option is compared against, to show that it changes the
# result on these inputs (an option that never binds would prove nothing).
WITHOUT_THE_OPTION = {
    "loss_type=bnpo": LOSS_TYPES["grpo"],
    "loss_type=dr_grpo": LOSS_TYPES["grpo"],
    "epsilon_high=0.28 (dapo)": LOSS_TYPES["dapo"],
    "delta=1.5 (grpo)": LOSS_TYPES["grpo"],
    "loss_type=cispo (epsilon_high=1.3)": LOSS_TYPES["dapo"],
    "loss_type=sapo": LOSS_TYPES["grpo"],
    "importance_sampling_level=sequence (GSPO)": {
        **LOSS_TYPES["grpo"],
        "cliprange": 0.05,
    },
    "beta=0.1, k3, use_bias_correction_kl=True": {
        **LOSS_TYPES["grpo"],
        "kl_coef": 0.1,
    },
    "beta=0.1, k3, use_bias_correction_kl=False": LOSS_TYPES["dapo"],
    "beta=0.1, use_bias_correction_kl=True, GSPO": {
        "importance_reweighting_method": "gspo",
        "loss_normalization": "sequence",
        "kl_coef": 0.1,
    },
    "top_entropy_quantile=0.3": LOSS_TYPES["grpo"],
    "loss_type=luspo (sequence level)": {
        "importance_reweighting_method": "gspo",
        "loss_normalization": "sequence",
        "cliprange": 0.05,
    },
    "loss_type=luspo, delta=1.1": {
        "importance_reweighting_method": "luspo",
        "loss_normalization": "sequence",
        "cliprange": 0.05,
    },
    "loss_type=vespo": LOSS_TYPES["dapo"],
    "loss_type=vespo, own shape, beta=0.1": {
        "importance_reweighting_method": "vespo",
        "loss_normalization": "token",
        "kl_coef": 0.1,
        "kl_importance_weighting": True,
    },
    "off_policy_mask_threshold=0.05 (grpo)": LOSS_TYPES["grpo"],
    "off_policy_mask_threshold=0.05 (vespo)": {
        "importance_reweighting_method": "vespo",
        "loss_normalization": "token",
    },
    "temperature=0.7": LOSS_TYPES["dapo"],
    "entropy_coef=0.05 (dapo)": LOSS_TYPES["dapo"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradients_match_trl(tokenizer, tmp_path, name):
    trl_fields, our_fields, beta = CASES[name]
    trainer = make_trainer(tokenizer, tmp_path, REWARDS, **trl_fields)
    trl_run = run_trl(trainer, beta=beta)
    ours = run_grpo_lab(tokenizer, trl_run, settings_for(our_fields))
    assert_parity(name, max_deltas(trl_run, ours))
    assert trl_run.log_prob_gradients.abs().max() > 0  # something to compare
    if name in WITHOUT_THE_OPTION:
        plain = run_grpo_lab(tokenizer, trl_run, settings_for(WITHOUT_THE_OPTION[name]))
        assert max_deltas(trl_run, plain)["parameter_gradients"] > 1e-6, name


# --- mutants: a perturbed implementation fails the parity check -------------------


def _negated(loss):
    def mutant(*args):
        per_token, diagnostics = loss(*args)
        return -per_token, diagnostics

    return mutant


def _divided_by_length(loss):
    def mutant(advantages, log_probs, old, mask, options):
        per_token, diagnostics = loss(advantages, log_probs, old, mask, options)
        lengths = mask.sum(dim=1, keepdim=True).clamp_min(1)
        return per_token / lengths**2, diagnostics  # GSPO / L, not GSPO x L

    return mutant


def _vespo_sides_swapped(loss):
    def mutant(advantages, log_probs, old, mask, options):
        return loss(-advantages, log_probs, old, mask, options)[0] * -1, {}

    return mutant


def _vespo_geometric_mean(loss):
    # GSPO's mean log ratio in place of VESPO's sum.
    def mutant(advantages, log_probs, old, mask, options):
        lengths = mask.sum(dim=1, keepdim=True).clamp_min(1)
        shrunk = old + (log_probs - old) / lengths
        phi, _ = losses.vespo_weights(advantages, shrunk - old, mask, options)
        return -phi * advantages * log_probs, {}

    return mutant


def _mask_mutant(kind: str):
    def mutant(advantages, log_probs, old, mask, threshold):
        kl = (old - log_probs.detach()) * mask
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
        mean = kl.sum(dim=1, keepdim=True) / lengths
        if kind == "advantage side flipped":
            return (advantages <= 0) | (mean <= threshold)
        if kind == "threshold side flipped":
            return (advantages >= 0) | (mean >= threshold)
        batch_mean = kl.sum() / mask.sum()  # one mean for the batch
        return (advantages >= 0) | (batch_mean <= threshold)

    return mutant


RECORD_MUTANTS = {
    "loss_type=luspo (sequence level)": (
        "luspo",
        {"wrong sign": _negated, "divided by the length": _divided_by_length},
    ),
    "loss_type=vespo, own shape, beta=0.1": (
        "vespo",
        {
            "wrong sign": _negated,
            "k and lambda of the other sign": _vespo_sides_swapped,
            "mean log ratio, not the sum": _vespo_geometric_mean,
        },
    ),
}
MASK_MUTANTS = (
    "advantage side flipped",
    "threshold side flipped",
    "the batch's mean, not each response's",
)


@pytest.fixture(scope="module")
def trl_runs(tokenizer, tmp_path_factory):
    """TRL's first step of each case that mutants are run against, once."""
    cache: dict[str, TrlFirstStep] = {}

    def run(name: str) -> TrlFirstStep:
        if name not in cache:
            trl_fields, _, beta = CASES[name]
            folder = tmp_path_factory.mktemp("mutant")
            trainer = make_trainer(tokenizer, folder, REWARDS, **trl_fields)
            cache[name] = run_trl(trainer, beta=beta)
        return cache[name]

    return run


@pytest.mark.parametrize(
    ("case", "mutant"),
    [(case, name) for case, (_, named) in RECORD_MUTANTS.items() for name in named]
    + [("off_policy_mask_threshold=0.05 (grpo)", name) for name in MASK_MUTANTS],
)
def test_each_mutant_fails_the_trl_parity_check(
    tokenizer, trl_runs, monkeypatch, case, mutant
):
    trl_run = trl_runs(case)
    if case in RECORD_MUTANTS:
        method, named = RECORD_MUTANTS[case]
        record = losses.OBJECTIVE_RECORDS[method]
        perturbed = dataclasses.replace(record, loss=named[mutant](record.loss))
        monkeypatch.setitem(losses.OBJECTIVE_RECORDS, method, perturbed)
    else:
        monkeypatch.setattr(losses, "off_policy_sequence_mask", _mask_mutant(mutant))
    ours = run_grpo_lab(tokenizer, trl_run, settings_for(CASES[case][1]))
    deltas = max_deltas(trl_run, ours)
    assert deltas["parameter_gradients"] > 1e-6, (case, mutant, deltas)


def test_off_policy_mask_measures_against_the_samplers_log_probs_as_trl_does(
    tokenizer, tmp_path
):
    # With sampler log-probs (vLLM's), TRL's mask measures KL(sampler || pi),
    # both drifts at once; grpo_lab's mask reads the same log-probs.
    fields = {"loss_type": "grpo", "off_policy_mask_threshold": 0.05}
    trainer = make_trainer(tokenizer, tmp_path, REWARDS, **fields)
    trl_run = trl_first_step(
        trainer, ROW_PROMPTS, **off_policy(0), sampler_log_probs=perturbed(3, 0.4)
    )
    settings = settings_for({**LOSS_TYPES["grpo"], "off_policy_mask_threshold": 0.05})
    assert_parity("off_policy_mask_threshold=0.05, sampler log-probs",
                  max_deltas(trl_run, run_grpo_lab(tokenizer, trl_run, settings)))  # fmt: skip
    # Against pi_old instead, other responses would be dropped.
    trl_run.inputs.pop("sampling_per_token_logps")
    ours = run_grpo_lab(tokenizer, trl_run, settings)
    assert max_deltas(trl_run, ours)["parameter_gradients"] > 1e-6


def test_dapo_under_uneven_accumulation_matches_and_bnpo_does_not(tokenizer, tmp_path):
    # Two microbatches of 6 responses with 14 and 13 tokens. DAPO divides every
    # microbatch by the whole batch's token count, as grpo_lab's token
    # normalization does; TRL's bnpo divides each microbatch by its own count
    # and averages the two, which is not the batch's token mean.
    for loss_type, tolerance in (("dapo", TOLERANCE), ("bnpo", None)):
        trainer = make_trainer(
            tokenizer,
            tmp_path,
            REWARDS,
            loss_type=loss_type,
            gradient_accumulation_steps=2,
        )
        trl_run = run_trl(trainer)
        ours = run_grpo_lab(tokenizer, trl_run, settings_for(LOSS_TYPES["dapo"]), 2)
        deltas = max_deltas(trl_run, ours)
        if tolerance is not None:
            assert_parity("loss_type=dapo, 2 uneven microbatches", deltas)
        else:
            assert deltas["loss"] > 1e-4, deltas  # bnpo: per-microbatch means


def test_grpo_entropy_bonus_is_normalized_differently(tokenizer, tmp_path):
    # TRL subtracts coef * (token mean of entropy) whatever the loss type;
    # grpo_lab adds -coef * H_t to each token's loss before the loss's own
    # normalization (as verl does). With loss_type grpo (per-response means)
    # the two differ; with token normalization (dapo) they agree (above).
    trainer = make_trainer(
        tokenizer, tmp_path, REWARDS, loss_type="grpo", entropy_coef=0.5
    )
    trl_run = run_trl(trainer)
    ours = run_grpo_lab(
        tokenizer, trl_run, settings_for({**LOSS_TYPES["grpo"], "entropy_coef": 0.5})
    )
    assert max_deltas(trl_run, ours)["parameter_gradients"] > 1e-6


@pytest.mark.parametrize(
    ("scale_rewards", "normalizer"),
    [("group", "std"), ("batch", "batch_std"), ("none", "none")],
)
@pytest.mark.parametrize("with_none", [False, True])
def test_advantages_match_trl(
    tokenizer, tmp_path, scale_rewards, normalizer, with_none
):
    rewards = list(REWARDS)
    if with_none:
        # An unscorable response (None in TRL, NaN here) in groups 1 and 2; group
        # 2 keeps one scored reward only, so its std is undefined: advantage 0.
        rewards[1] = None
        rewards[4] = rewards[5] = rewards[6] = None
    trainer = make_trainer(tokenizer, tmp_path, rewards, scale_rewards=scale_rewards)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = trainer._generate_and_score_completions(
            [{"prompt": p} for p in PROMPTS for _ in range(GROUP_SIZE)]
        )
    raw = torch.tensor([math.nan if r is None else r for r in rewards])
    ours, _ = compute_group_normalized_rewards(
        raw,
        GROUP_SIZE,
        "mean",
        1e-4,  # TRL's fixed epsilon
        normalizer,
        nan_rewards="ignore" if with_none else "propagate",
    )
    delta = (ours - inputs["advantages"]).abs().max().item()
    name = f"scale_rewards={scale_rewards}" + (", None rewards" if with_none else "")
    REPORT[name] = delta
    print(f"\n{name}: max |delta| {delta:.2e}")
    # float32 rewards on both sides; TRL's nanstd and torch.std round differently.
    assert delta <= 1e-6, (ours, inputs["advantages"])
    assert (inputs["advantages"] != 0).any()


# A second reward function (a format part) beside REWARDS, on another scale.
FORMAT_REWARDS = [0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("weights", [None, [1.0, 0.5]])
def test_multi_reward_aggregation_matches_trl(
    tokenizer, tmp_path, aggregation, weights
):
    fields = {"multi_objective_aggregation": aggregation, "reward_weights": weights}
    trainer = fixed_completions_trainer(
        {"num_generations": GROUP_SIZE, "max_completion_length": MAX_COMPLETION_LENGTH,
         **fields},
        fresh_model(tokenizer), tokenizer, ROW_PROMPTS,
        [encode(tokenizer, c) for c in COMPLETIONS], REWARDS, tmp_path,
        extra_rewards=(FORMAT_REWARDS,),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = trainer._generate_and_score_completions(
            [{"prompt": p} for p in PROMPTS for _ in range(GROUP_SIZE)]
        )
    components = torch.tensor([REWARDS, FORMAT_REWARDS]).T  # (B, 2), float32 as TRL
    deltas = {}
    for name in AGGREGATIONS:  # the other aggregation is the mutant
        ours, _ = compute_multi_reward_advantages(
            components, GROUP_SIZE, "mean", 1e-4, "std",  # TRL's fixed epsilon
            reward_aggregation=name, reward_weights=weights,
        )  # fmt: skip
        deltas[name] = (ours - inputs["advantages"]).abs().max().item()
    REPORT[f"multi_objective_aggregation={aggregation}, weights={weights}"] = deltas[
        aggregation
    ]
    assert deltas[aggregation] <= 1e-6, deltas  # float32 on both sides
    assert min(deltas.values()) < 1e-2 < max(deltas.values()), deltas


def test_trl_fused_scorer_matches_grpo_lab_scoring(tokenizer, tmp_path):
    # TRL's real scorer (its chunked, fused output head with float32 running
    # statistics) at temperature 0.7 against grpo_lab's get_response_log_probs.
    trainer = make_trainer(tokenizer, tmp_path, REWARDS, temperature=0.7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = trainer._generate_and_score_completions(
            [{"prompt": p} for p in PROMPTS for _ in range(GROUP_SIZE)]
        )
        log_probs, entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            inputs["completion_ids"].shape[1],
            compute_entropy=True,
        )
    batch = grpo_lab_batch(tokenizer)
    ours = get_response_log_probs(
        fresh_model(tokenizer), batch["input_ids"], batch["labels"], True, 0,
        temperature=0.7,
    )  # fmt: skip
    mask, completion_mask = (
        batch["response_mask"].bool(),
        inputs["completion_mask"].bool(),
    )
    deltas = {
        "log_probs": (ours["log_probs"][mask] - log_probs[completion_mask]).abs().max(),
        "entropy": (ours["token_entropy"][mask] - entropy[completion_mask]).abs().max(),
    }
    deltas = {key: value.item() for key, value in deltas.items()}
    REPORT["TRL fused scorer, temperature=0.7"] = max(deltas.values())
    print(f"\nTRL fused scorer, temperature=0.7: {deltas}")
    assert max(deltas.values()) < 1e-5  # float32 statistics inside TRL's kernel


# --- docs/translation_table.md is kept true --------------------------------------

TABLE = Path(__file__).resolve().parents[1] / "docs" / "translation_table.md"
ASSIGNMENT = re.compile(r'^(?P<name>[a-z_][a-z0-9_]*)(?:=(?P<value>"[^"]*"|[^"]\S*))?$')


def table_names(column: int) -> list[tuple[str, str | None]]:
    """(name, quoted value or None) of every `backticked` token in a column."""
    names = []
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 4 or set(cells[0]) <= {"-"}:
            continue
        if cells[0] == "grpo_lab":  # a header row
            continue
        for token in re.findall(r"`([^`]+)`", cells[column]):
            match = ASSIGNMENT.match(token)
            assert match, f"unparsable table entry {token!r}"
            value = match["value"]
            quoted = value.strip('"') if value and value.startswith('"') else None
            names.append((match["name"], quoted))
    return names


def test_every_grpo_lab_name_in_the_translation_table_exists():
    from grpo_lab import advantages, aggregation, kl, losses
    from grpo_lab.training.config import TrainConfig

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    named = table_names(0)
    assert len(named) > 20
    for name, value in named:
        assert name in fields, f"{name} is not a TrainConfig field"
        if value is not None:
            assert value in fields[name].metadata["choices"], (name, value)
    values = {value for _, value in named}
    registries = (
        losses.REWEIGHTING_METHODS,
        aggregation.LOSS_NORMALIZATIONS,
        advantages.BASELINES,
        advantages.ADVANTAGE_NORMALIZERS,
        kl.KL_ESTIMATORS,
    )
    for registry in registries:
        assert set(registry) <= values, set(registry) - values


def test_every_trl_field_in_the_translation_table_exists():
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    named = table_names(1)
    assert len(named) > 15
    for name, value in named:
        assert name in fields, f"{name} is not a GRPOConfig field"
        if value is not None:  # a value that field's help text documents
            help_text = fields[name].metadata["help"]
            assert re.search(rf"\b{re.escape(value)}\b", help_text), (name, value)


def test_every_test_the_table_names_exists():
    """The "Tests behind each row" section names only tests that are there."""
    text = TABLE.read_text(encoding="utf-8")
    section = text.split("## Tests behind each row", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(?:[\w/.]+::)?(test_\w+)`", section))
    assert len(named) > 20
    tests = Path(__file__).resolve().parent
    defined = {
        name
        for path in tests.rglob("test_*.py")
        for name in re.findall(r"^def (test_\w+)", path.read_text(), re.MULTILINE)
    }
    assert named <= defined, sorted(named - defined)


# --- where TRL and grpo_lab differ, measured ---------------------------------------


def test_entropy_bonus_under_accumulation_differs_by_a_measured_amount(
    tokenizer, tmp_path
):
    # Two microbatches of 14 and 13 tokens. TRL subtracts coef x (each
    # microbatch's own token mean of the entropy) / 2; grpo_lab's token
    # normalization takes the whole batch's token mean. The policy term agrees
    # (test_dapo_under_uneven_accumulation_matches_and_bnpo_does_not), so the
    # whole difference is the bonus's.
    fields = {"loss_type": "dapo", "entropy_coef": 0.05}
    trainer = make_trainer(
        tokenizer, tmp_path, REWARDS, gradient_accumulation_steps=2, **fields
    )
    trl_run = run_trl(trainer)
    ours = run_grpo_lab(
        tokenizer,
        trl_run,
        settings_for({**LOSS_TYPES["dapo"], "entropy_coef": 0.05}),
        2,
    )
    deltas = max_deltas(trl_run, ours)
    scale = max(g.abs().max().item() for g in trl_run.parameter_gradients)
    relative = deltas["parameter_gradients"] / scale
    REPORT["entropy_coef=0.05, dapo, 2 uneven microbatches (relative)"] = relative
    print(
        f"\nentropy bonus under accumulation: relative gradient difference {relative:.1e}"
    )
    assert relative > 1e-7  # differs: the translation table says so
    assert relative < 1e-2  # and only by the bonus's share


class _Gather:
    """accelerate's pad_across_processes and gather for processes whose other
    ranks hold ``others`` (an empty tensor: one process)."""

    def __init__(self, others: torch.Tensor):
        self.others = others

    def pad_across_processes(self, tensor, dim=0, pad_index=0):
        return tensor

    def gather(self, tensor):
        return torch.cat([tensor, self.others.to(tensor.dtype)])


def test_top_entropy_quantile_spans_every_process_in_trl(tokenizer):
    from types import SimpleNamespace

    from trl import GRPOTrainer

    from grpo_lab.losses import high_entropy_mask

    generator = torch.Generator().manual_seed(0)
    entropy = torch.rand(4, 5, generator=generator)  # (B, T) this process's
    mask = torch.arange(5)[None, :] < torch.tensor([[5], [3], [4], [2]])  # (B, T)
    others = 0.5 + torch.rand(14, generator=generator)  # a second process's tokens
    ours = high_entropy_mask(entropy, mask, 0.3)  # (B, T)
    one = GRPOTrainer.get_high_entropy_mask(
        SimpleNamespace(accelerator=_Gather(torch.empty(0))), entropy, mask, 0.7
    )
    two = GRPOTrainer.get_high_entropy_mask(
        SimpleNamespace(accelerator=_Gather(others)), entropy, mask, 0.7
    )
    assert torch.equal(one, ours)  # one process: the same tokens
    changed = int((two != ours).sum())
    REPORT["top_entropy_quantile=0.3, 2 processes: tokens chosen differently"] = changed
    print(f"\ntop_entropy_quantile over 2 processes: {changed} of 14 tokens differ")
    assert changed > 0


def test_mask_truncated_completions_disagrees_at_a_stop_string(tmp_path):
    from grpo_lab.models import DEFAULT_CHARACTERS
    from grpo_lab.training.overlong import truncated_rows

    tokenizer = build_char_tokenizer(DEFAULT_CHARACTERS + "</answer>")
    model = build_tiny_qwen2(tokenizer, seed=0, **SIZES).double()
    # Three answers stop at "</answer>" (no EOS, as vLLM's stop leaves them),
    # one ends in EOS; none ran out of its 20 tokens.
    texts = ["<answer>1</answer>", "<answer>2</answer>", "<answer>3</answer>", "12"]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    ids[3] = [*ids[3], tokenizer.eos_token_id]
    trainer = fixed_completions_trainer(
        {"num_generations": 4, "max_completion_length": 20,
         "mask_truncated_completions": True},
        model, tokenizer, ["12>"] * 4, ids, [1.0, 0.0, 1.0, 0.0], tmp_path,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = trainer._generate_and_score_completions([{"prompt": "12>"}] * 4)
    trl_masked = (inputs["completion_mask"].sum(dim=1) == 0).tolist()
    ours = truncated_rows(
        texts, ids, [len(i) for i in ids], eos_token_ids=[tokenizer.eos_token_id],
        stop_strings=("</answer>",), max_new_tokens=20,
    )  # fmt: skip
    assert trl_masked == [True, True, True, False]  # 3 of 4 masked by TRL
    assert ours.tolist() == [False, False, False, False]  # 0 by grpo_lab
