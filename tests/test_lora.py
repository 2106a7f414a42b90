"""LoRA adapters (grpo_lab/lora.py): exact at initialisation, the chain
rule in float64, adapters-only training, the base model as KL reference,
rollouts, checkpoints, merging, float16 loss scaling and the memory estimate."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import threading
import time

import pytest
import torch
from test_checkpoint import (
    comparable,
    run_cli,
)
from transformers import AutoModelForCausalLM

from grpo_lab import lora
from grpo_lab.cli import main as cli
from grpo_lab.logprobs import get_response_log_probs
from grpo_lab.masks import pad_prompt_and_response_ids
from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2, load_tokenizer
from grpo_lab.rollouts.base import SamplingSettings
from grpo_lab.rollouts.hf import HFRolloutBackend
from grpo_lab.rollouts.vllm import policy_weights_for_vllm
from grpo_lab.train_step import policy_gradient_update
from grpo_lab.training import config as config_module
from grpo_lab.training import loop
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.metrics import read_metrics, step_records

SIZES = {
    "tiny_hidden_size": 32,
    "tiny_num_layers": 1,
    "tiny_intermediate_size": 64,
}


def tiny_config(tmp_path, **overrides) -> TrainConfig:
    settings = {
        "run_dir": str(tmp_path / "run"),
        **SIZES,
        "task_options": {"n_digits": 3},
        "max_new_tokens": 5,
        "rollout_batch_size": 16,
        "group_size": 4,
        "train_batch_size": 16,
        "steps": 2,
        "eval_every": 1,
        "eval_size": 8,
        "checkpoint_every": 1,
        "sft_max_steps": 0,
        "lora_rank": 4,
    }
    return TrainConfig.for_profile("cpu", **{**settings, **overrides})


def fixed_batch(tokenizer) -> dict[str, torch.Tensor]:
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ["12>", "345>"]]
    responses = [tokenizer.encode(r, add_special_tokens=False) for r in ["21", "543"]]
    return pad_prompt_and_response_ids(
        [prompts[0], prompts[0], prompts[1], prompts[1]],
        [responses[0], responses[1], responses[1], responses[0]],
        tokenizer.pad_token_id,
    )


ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5])


def randomize_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """Give every B a random value (B starts at 0, which hides A's gradient) and
    every trained norm copy a gain away from its frozen original."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if ".lora_B." in name:
                parameter.copy_(0.3 * noise.to(parameter.dtype))
            elif ".modules_to_save." in name:
                parameter.mul_(1 + 0.3 * noise.to(parameter.dtype))


def load_merged(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load base-named weights; only the tied output head may be absent."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []


class LowerCaseFirst:
    """The reverse task's prompts, reward 1 when a response starts with a
    lower-case letter: a random tiny model's groups have signal at once."""

    def __init__(self, task):
        self.task = task
        self.stop_strings = task.stop_strings
        self.max_new_tokens = task.max_new_tokens

    def train(self, n, seed):
        return self.task.train(n, seed)

    def reward_fn(self, response, ground_truth):
        value = float(response[:1].islower())
        return {"reward": value, "format_reward": value, "answer_reward": value}


def lora_names(model: torch.nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters() if ".lora_" in name}


def norm_copy_names(model: torch.nn.Module) -> set[str]:
    return {n for n, _ in model.named_parameters() if ".modules_to_save." in n}


def optimized_names(policy) -> set[str]:
    by_id = {id(p): n for n, p in policy.model.named_parameters()}
    return {by_id[id(p)] for g in policy.optimizer.param_groups for p in g["params"]}


# --- settings ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lora_rank", -1, r"^lora_rank must be an int >= 0"),
        ("lora_rank", 2.0, r"^lora_rank must be an int >= 0"),
        ("lora_alpha", 0.0, r"^lora_alpha must be a finite number > 0, got 0.0"),
        ("lora_alpha", float("nan"), r"^lora_alpha must be a finite number > 0"),
        ("lora_dropout", 1.0, r"^lora_dropout must be a number in \[0, 1\), got 1.0"),
        ("lora_target_modules", "all linear", r"^lora_target_modules must be"),
        ("lora_target_modules", [], r"^lora_target_modules must be"),
        ("lora_target_modules", ["q_proj", ""], r"^lora_target_modules must be"),
        ("lora_lr", 0.0, r"^lora_lr must be a finite number in \(0.0, inf\)"),
        ("lora_train_norms", "yes", r"^lora_train_norms must be True or False"),
        ("lora_train_norms", 1, r"^lora_train_norms must be True or False, got 1"),
    ],
)
def test_bad_lora_settings_are_refused_when_the_config_is_built(field, value, message):
    with pytest.raises(ValueError, match=message) as from_config:
        TrainConfig.for_profile("cpu", **{"lora_rank": 4, field: value})
    if field != "lora_lr":  # the validator a direct caller meets says the same
        arguments = {"rank": 4, "alpha": 32.0, "dropout": 0.0}
        arguments["target_modules"] = "all-linear"
        arguments[field.removeprefix("lora_")] = value
        with pytest.raises(ValueError) as from_validator:
            lora.check_lora_settings(**arguments)
        assert str(from_validator.value) == str(from_config.value)


def test_target_modules_take_a_list_or_comma_separated_names():
    config = TrainConfig.for_profile(
        "cpu", lora_rank=2, lora_target_modules="q_proj,v_proj"
    )
    assert config.lora_settings().target_modules == ("q_proj", "v_proj")
    assert TrainConfig.for_profile("cpu").lora_settings() is None


def test_float16_autocast_needs_float32_master_weights():
    with pytest.raises(ValueError, match=r"^dtype must be 'float32' with autocast"):
        TrainConfig.for_profile("cpu", dtype="float16", autocast_dtype="float16")


def test_lora_settings_without_adapters_are_refused():
    """Without a rank an adapter setting does nothing: one validator refuses any
    that differs from its default (a flag, a config file's key, a keyword);
    at its default it changes nothing, so a full dump of the fields passes."""
    with pytest.raises(ValueError, match=r"^lora_alpha needs lora_rank > 0") as built:
        TrainConfig(lora_alpha=8.0, lora_lr=1e-3)
    assert str(built.value).endswith("got lora_alpha 8.0 with lora_rank 0")
    with pytest.raises(ValueError) as direct:
        lora.check_adapter_options_need_rank(0, {"lora_alpha": 8.0})
    assert str(direct.value) == str(built.value)
    with pytest.raises(ValueError, match=r"^lora_train_norms needs lora_rank > 0"):
        TrainConfig.for_profile("cpu", lora_train_norms=False)
    assert TrainConfig.for_profile("cpu", lora_train_norms=True).lora_settings() is None
    assert TrainConfig.for_profile("cpu", lora_rank=2, lora_lr=1e-3).lora_lr == 1e-3
    assert TrainConfig.from_dict(TrainConfig().to_dict()).lora_rank == 0
    assert config_module.inert_settings(TrainConfig()) == {}


def test_lora_rank_0_drops_the_profile_s_adapter_settings():
    config = TrainConfig.for_profile("small-gpu", lora_rank=0, device="cpu")
    assert (config.lora_lr, config.lora_train_norms) == (2e-3, True)  # the defaults
    with pytest.raises(ValueError, match=r"^lora_lr needs lora_rank > 0"):
        TrainConfig.for_profile("small-gpu", lora_rank=0, lora_lr=5e-5)


def test_adapter_targets_and_rank_fit_the_model():
    """The tiny model's layers are known when the config is built; any model's
    when its adapters are added, before peft allocates them."""
    with pytest.raises(ValueError, match=r"got 'qproj', which matches none") as built:
        TrainConfig(lora_rank=4, lora_target_modules="q_proj,qproj")
    assert "q_proj" in str(built.value)  # the names it could have meant
    # hidden 128, 4 heads, 2 key/value heads: k_proj and v_proj are 128 -> 64
    assert TrainConfig(lora_rank=64).lora_rank == 64
    with pytest.raises(ValueError, match=r"^lora_rank must be at most 64, .*got 65$"):
        TrainConfig(lora_rank=65)
    assert TrainConfig(lora_rank=128, lora_target_modules="q_proj").lora_rank == 128
    model = build_tiny_qwen2(build_char_tokenizer(), hidden_size=16, num_layers=1)
    settings = lora.LoraSettings(
        rank=9, alpha=8.0, dropout=0.0, target_modules="all-linear"
    )
    with pytest.raises(ValueError, match=r"^lora_rank must be at most 8, .*got 9$"):
        lora.add_adapters(model, settings, seed=0)  # v_proj: 16 -> 8
    assert not any("lora" in name for name, _ in model.named_modules())
    # GPT-2's linear layers are transformers' Conv1D (weight (in, out)): read too.
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50))
    layers = lora.model_linear_layers(gpt2)
    assert layers["transformer.h.0.attn.c_attn"] == (16, 48)
    assert "lm_head" not in layers
    lora.check_adapter_fit(4, ("c_attn",), layers)


# --- the policy: what trains, and exactness at initialisation ------------------------


def test_full_fine_tuning_is_untouched_and_lora_trains_only_the_adapters(tmp_path):
    full = loop.build_policy(tiny_config(tmp_path, lora_rank=0))
    assert full.adapters is None and lora_names(full.model) == set()
    full_parameters = {id(p) for g in full.optimizer.param_groups for p in g["params"]}
    assert full_parameters == {id(p) for p in full.model.parameters()}
    assert full.optimizer.param_groups[0]["lr"] == 3e-4

    adapted = loop.build_policy(tiny_config(tmp_path, lora_rank=4))
    norm_copies = {
        f"{prefix}.modules_to_save.default.weight"
        for prefix in ("model.layers.0.input_layernorm", "model.norm",
                       "model.layers.0.post_attention_layernorm")
    }  # fmt: skip
    assert norm_copy_names(adapted.model) == norm_copies
    assert optimized_names(adapted) == lora_names(adapted.model) | norm_copies
    assert lora.trainable_parameter_count(adapted.model) == (
        4 * ((32 + 32) * 2 + (32 + 16) * 2 + (32 + 64) * 2 + (64 + 32)) + 3 * 32
    )
    assert adapted.optimizer.param_groups[0]["lr"] == 2e-3  # lora_lr
    adapted = loop.build_policy(
        tiny_config(tmp_path, lora_rank=4, lora_train_norms=False)
    )
    assert norm_copy_names(adapted.model) == set()
    assert optimized_names(adapted) == lora_names(adapted.model)
    # r (in + out) per linear layer: one Qwen2 layer of hidden 32, MLP 64.
    shapes = lora.qwen2_linear_shapes(32, 64, 1, 4, 2)
    assert lora.trainable_parameter_count(adapted.model) == lora.lora_parameter_count(
        shapes, 4
    )
    assert lora.trainable_parameter_count(adapted.model) == 4 * (
        (32 + 32) * 2 + (32 + 16) * 2 + (32 + 64) * 2 + (64 + 32)
    )


def test_at_initialisation_log_probs_and_loss_equal_the_base_model_bit_for_bit(
    tmp_path,
):
    full = loop.build_policy(tiny_config(tmp_path, lora_rank=0))
    adapted = loop.build_policy(tiny_config(tmp_path, lora_rank=8))
    batch = fixed_batch(full.tokenizer)
    base_scores = get_response_log_probs(
        full.model, batch["input_ids"], batch["labels"], return_token_entropy=True
    )
    lora_scores = get_response_log_probs(
        adapted.model, batch["input_ids"], batch["labels"], return_token_entropy=True
    )
    for key in ("log_probs", "token_entropy"):
        assert torch.equal(base_scores[key], lora_scores[key]), key
    base_loss, _ = policy_gradient_update(
        full.model, full.optimizer, 2, 1.0, batch, ADVANTAGES
    )
    lora_loss, _ = policy_gradient_update(
        adapted.model, adapted.optimizer, 2, 1.0, batch, ADVANTAGES
    )
    assert base_loss.item() != 0 and torch.equal(base_loss, lora_loss)


def test_an_update_moves_the_adapters_and_leaves_the_base_weights(tmp_path):
    policy = loop.build_policy(tiny_config(tmp_path))
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    policy_gradient_update(
        policy.model,
        policy.optimizer,
        1,
        1.0,
        fixed_batch(policy.tokenizer),
        ADVANTAGES,
    )
    for name, parameter in policy.model.named_parameters():
        moved = not torch.equal(parameter, before[name])
        trained = ".lora_B." in name or ".modules_to_save." in name
        assert moved == trained, name  # A's gradient is 0 while B = 0


def test_adapter_gradients_are_the_chain_rule_of_the_full_weight_gradient():
    """float64: with W' = W + s B A, dL/dB = s dL/dW' A^T and dL/dA = s B^T dL/dW'."""
    tokenizer = build_char_tokenizer()
    settings = lora.LoraSettings(
        rank=3, alpha=6.0, dropout=0.0, target_modules="all-linear"
    )
    base = build_tiny_qwen2(
        tokenizer, hidden_size=32, num_layers=1, intermediate_size=64
    )
    adapted = lora.inner_model(lora.add_adapters(base.double(), settings, seed=0))
    randomize_adapters(adapted)
    merged = build_tiny_qwen2(
        tokenizer, hidden_size=32, num_layers=1, intermediate_size=64
    )
    merged = merged.double()
    load_merged(merged, dict(lora.merged_named_parameters(adapted)))
    batch = fixed_batch(tokenizer)

    def loss_of(model):
        scores = get_response_log_probs(model, batch["input_ids"], batch["labels"])
        weights = ADVANTAGES.double()[:, None] * batch["response_mask"]
        return -(scores["log_probs"] * weights).sum()

    loss_of(adapted).backward()
    loss_of(merged).backward()
    merged_weights = dict(merged.named_parameters())
    checked = 0
    for name, module in adapted.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        a = module.lora_A["default"].weight  # (r, in)
        b = module.lora_B["default"].weight  # (out, r)
        full_gradient = merged_weights[f"{name}.weight"].grad  # (out, in)
        scale = settings.scale
        assert scale == module.scaling["default"] == 2.0
        torch.testing.assert_close(
            b.grad, scale * full_gradient @ a.T, rtol=0, atol=1e-12
        )
        torch.testing.assert_close(
            a.grad, scale * b.T @ full_gradient, rtol=0, atol=1e-12
        )
        assert b.grad.abs().max() > 1e-6 and a.grad.abs().max() > 1e-6
        checked += 1
    assert checked == 7  # q, k, v, o, gate, up, down


def test_the_kl_reference_is_the_base_model_with_adapters_off(tmp_path, monkeypatch):
    config = tiny_config(tmp_path, kl_coef=0.1)
    policy = loop.build_policy(config)
    base = loop.build_policy(tiny_config(tmp_path, lora_rank=0))
    randomize_adapters(policy.model)
    monkeypatch.setattr(loop, "frozen_copy", lambda model: pytest.fail("a copy"))
    batch = fixed_batch(policy.tokenizer)
    reference = loop.score_reference_log_probs(config, policy, batch)
    expected = loop.score_old_log_probs(config, base.model, batch)
    adapted = loop.score_old_log_probs(config, policy.model, batch)
    assert torch.equal(reference, expected)
    assert not torch.equal(adapted, expected)  # the adapters are back on after
    assert policy.reference_model is None


def test_with_trained_norms_the_reference_keeps_the_base_gains(tmp_path):
    """Only the norm copies moved: the policy differs from the base, and the
    reference (adapters off) is still the base bit for bit."""
    config = tiny_config(tmp_path, kl_coef=0.1)
    policy = loop.build_policy(config)
    base = loop.build_policy(tiny_config(tmp_path, lora_rank=0))
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if ".modules_to_save." in name:
                parameter.mul_(1.5)
    batch = fixed_batch(policy.tokenizer)
    expected = loop.score_old_log_probs(config, base.model, batch)
    assert not torch.equal(
        loop.score_old_log_probs(config, policy.model, batch), expected
    )
    assert torch.equal(loop.score_reference_log_probs(config, policy, batch), expected)
    base_weights = dict(base.model.named_parameters())
    with lora.adapters_disabled(policy.adapters):  # merged weights: the base's
        weights = dict(lora.merged_named_parameters(policy.model))
    assert set(weights) == set(base_weights)
    assert all(torch.equal(weights[n], p) for n, p in base_weights.items())
    merged = dict(lora.merged_named_parameters(policy.model))  # adapters on
    assert torch.equal(
        merged["model.norm.weight"], 1.5 * base_weights["model.norm.weight"]
    )
    state = lora.base_state_dict(policy.model)
    assert all(torch.equal(state[n], p) for n, p in base_weights.items())


def test_the_warm_up_trains_the_base_norms_and_the_copies_start_from_them(tmp_path):
    """Inside training_base_weights the frozen originals train (the full model
    warms up); after it the trained copies hold the warmed-up gains and only the
    adapters and copies require grad again."""
    policy = loop.build_policy(tiny_config(tmp_path))
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    with lora.training_base_weights(policy.adapters):
        warming = {n for n, p in policy.model.named_parameters() if p.requires_grad}
        assert warming.isdisjoint(trainable)
        assert "model.norm.original_module.weight" in warming
        with torch.no_grad():
            for name, parameter in policy.model.named_parameters():
                if name in warming:
                    parameter.add_(0.25)
    assert trainable == {
        n for n, p in policy.model.named_parameters() if p.requires_grad
    }
    state = policy.model.state_dict()
    for name in norm_copy_names(policy.model):
        original = name.replace(".modules_to_save.default.", ".original_module.")
        assert torch.equal(state[name], state[original]), name
        assert torch.all(state[name] == 1.25)  # RMSNorm gains start at 1


def update_with_sgd(config: TrainConfig, rollouts_seed: int = 0):
    """One grpo_update of a LoRA policy with random B, by plain SGD (lr 1): the
    adapters afterwards are (before - gradient), easy to compare across options."""
    policy = loop.build_policy(config)
    randomize_adapters(policy.model)
    policy.optimizer = torch.optim.SGD(lora.trainable_parameters(policy.model), lr=1.0)
    task = LowerCaseFirst(loop.build_task(config, policy.tokenizer))
    torch.manual_seed(rollouts_seed)
    rollouts, examples = loop.sample_rollout_batch(config, task, policy, 1)
    record = loop.grpo_update(config, task, policy, rollouts, examples)
    adapters = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    return record, adapters


@pytest.mark.parametrize(
    "option",
    [
        {"logits_chunk_size": 3},
        {"share_prompt_prefix": False},
        {"gradient_checkpointing": True},
        {"kl_coef": 0.05, "entropy_coef": 0.01},
    ],
    ids=["chunked head", "no prefix sharing", "gradient checkpointing", "kl"],
)
def test_lora_gives_the_same_update_through_each_memory_option(tmp_path, option):
    plain_record, plain = update_with_sgd(tiny_config(tmp_path))
    record, adapters = update_with_sgd(tiny_config(tmp_path, **option))
    assert record["train/optimizer_steps"] == 1
    moved = 0
    for name, value in plain.items():
        trained = ".lora_" in name or ".modules_to_save." in name
        if "kl_coef" in option and trained:
            moved += not torch.allclose(value, adapters[name], atol=1e-7)
            continue
        torch.testing.assert_close(adapters[name], value, rtol=1e-5, atol=1e-6)
    if "kl_coef" in option:
        assert moved > 0  # the penalty and the bonus change the update
    else:
        assert record["loss/loss"] == pytest.approx(plain_record["loss/loss"], rel=1e-5)


def test_off_policy_epochs_train_the_adapters(tmp_path):
    config = tiny_config(
        tmp_path,
        epochs_per_rollout_batch=2,
        train_batch_size=8,
        importance_reweighting_method="grpo",
        cliprange=0.2,
    )
    record, _ = update_with_sgd(config)
    assert record["train/optimizer_steps"] == 4


# --- rollouts -------------------------------------------------------------------------


def merged_copy(policy) -> torch.nn.Module:
    """A plain model holding the policy's merged weights."""
    merged = build_tiny_qwen2(
        policy.tokenizer, hidden_size=32, num_layers=1, intermediate_size=64
    )
    load_merged(merged, dict(lora.merged_named_parameters(policy.model)))
    return merged


def test_rollouts_sample_the_adapted_policy(tmp_path):
    policy = loop.build_policy(tiny_config(tmp_path))
    randomize_adapters(policy.model)
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=6, seed=3)
    prompts = ["12>", "345>"]
    sampled = policy.backend.generate(prompts, 4, sampling)
    reference = HFRolloutBackend(merged_copy(policy), policy.tokenizer)
    expected = reference.generate(prompts, 4, sampling)
    assert sampled.response_token_ids == expected.response_token_ids
    base = loop.build_policy(tiny_config(tmp_path, lora_rank=0))
    assert base.backend.generate(prompts, 4, sampling).responses != sampled.responses


def test_vllm_receives_merged_weights_under_the_base_names(tmp_path):
    policy = loop.build_policy(tiny_config(tmp_path))
    randomize_adapters(policy.model)
    weights = dict(policy_weights_for_vllm(policy.model, torch.float32))
    assert not any(".lora_" in n or "base_layer" in n for n in weights)
    base = build_tiny_qwen2(
        policy.tokenizer, hidden_size=32, num_layers=1, intermediate_size=64
    )
    assert set(weights) == {n for n, _ in base.named_parameters()}
    base.load_state_dict(weights, strict=False)  # lm_head is tied
    batch = fixed_batch(policy.tokenizer)
    torch.testing.assert_close(
        base(batch["input_ids"]).logits, policy.model(batch["input_ids"]).logits
    )


# --- checkpoints, the saved adapter, merging ------------------------------------------


@pytest.mark.slow
def test_a_run_saves_an_adapter_peft_opens_and_merge_reproduces_its_logits(
    tmp_path, monkeypatch
):
    import huggingface_hub
    from peft import AutoPeftModelForCausalLM, PeftModel

    # An entropy bonus: every step has a gradient, so the norm copies move.
    config = tiny_config(
        tmp_path, sft_max_steps=2, sft_eval_every=1, sft_eval_size=4, entropy_coef=0.01
    )
    run_dir = loop.train(config, progress=False).run_dir
    final = run_dir / loop.FINAL_MODEL_DIR
    assert (final / "adapter_config.json").exists()
    assert not (final / "model.safetensors").exists()
    checkpoint_folder = run_dir / "checkpoints" / "step_000002"
    assert (checkpoint_folder / "adapter_model.safetensors").exists()
    base_dir = run_dir / loop.BASE_MODEL_DIR

    def opened(adapter_folder):
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        return PeftModel.from_pretrained(base, adapter_folder).eval()

    # The run's own policy, restored from its last checkpoint payload.
    policy = loop.build_policy(config)
    payload = torch.load(run_dir / "checkpoints" / "step_000002.pt", weights_only=True)
    policy.model.load_state_dict(payload["model"])
    policy.model.eval()
    for name in norm_copy_names(policy.model):  # trained: not the base's gains
        original = name.replace(".modules_to_save.default.", ".original_module.")
        assert not torch.equal(payload["model"][name], payload["model"][original])
    ids = fixed_batch(policy.tokenizer)["input_ids"]
    expected = policy.model(ids).logits
    for folder in (final, checkpoint_folder):
        with torch.no_grad():
            assert torch.equal(opened(folder)(input_ids=ids).logits, expected)
    # The adapter folder alone opens, its base named in it (a local folder stands
    # in for the Hub, which is offline), and it carries grpo_lab's card.
    adapter_config = json.loads((final / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(base_dir.resolve())
    card = (final / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: peft" in card
    assert f"# {run_dir.name}\n" in card and "[More Information Needed]" not in card
    alone = tmp_path / "elsewhere" / "adapter"
    shutil.copytree(final, alone)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with torch.no_grad():
        logits = AutoPeftModelForCausalLM.from_pretrained(alone).eval()(ids).logits
    assert torch.equal(logits, expected)
    merged_dir = tmp_path / "merged"
    assert cli.main(["merge", str(run_dir), "--out", str(merged_dir)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)
    reloaded = load_tokenizer(str(merged_dir))
    text = "12 + 34 = 46\n<answer>46</answer>"
    ids = policy.tokenizer.encode(text)
    assert reloaded.encode(text) == ids
    assert reloaded.decode(ids) == policy.tokenizer.decode(ids)


@pytest.mark.slow
def test_the_first_step_loss_equals_full_fine_tuning_after_the_same_warm_up(tmp_path):
    """lora_rank 8 vs 0: the warm-up trains the full model either way, the
    adapters start at B = 0, so the step-0 evaluation and step 1's loss are the
    same numbers bit for bit."""
    # An entropy bonus scores every response: a loss even if no group has signal.
    overrides = {
        "steps": 1,
        "entropy_coef": 0.01,
        "sft_max_steps": 6,
        "sft_eval_every": 6,
        "sft_eval_size": 4,
    }
    full = loop.train(
        tiny_config(tmp_path / "full", lora_rank=0, **overrides), progress=False
    )
    adapted = loop.train(
        tiny_config(tmp_path / "lora", lora_rank=8, **overrides), progress=False
    )
    full_steps, lora_steps = step_records(full.history), step_records(adapted.history)
    assert full_steps[0] == lora_steps[0]  # step 0: the same evaluation
    assert full_steps[1]["loss/loss"] != 0
    assert full_steps[1]["loss/loss"] == lora_steps[1]["loss/loss"]
    assert full_steps[1]["train/reward_mean"] == lora_steps[1]["train/reward_mean"]


# The smallest run that warms up, checkpoints every step and evaluates: 4 steps.
LORA_KILL_FLAGS = [
    "--profile", "cpu",
    "--tiny-hidden-size", "16",
    "--tiny-num-layers", "1",
    "--tiny-intermediate-size", "32",
    "--task-options", '{"n_digits": 3}',
    "--rollout-batch-size", "16",
    "--group-size", "4",
    "--train-batch-size", "16",
    "--max-new-tokens", "5",
    "--eval-every", "2",
    "--eval-size", "8",
    "--checkpoint-every", "1",
    "--sft-max-steps", "2",
    "--sft-eval-every", "2",
    "--sft-eval-size", "4",
    "--sft-batch-size", "8",
    "--entropy-coef", "0.01",  # a gradient even in a step without signal
    "--lora-rank", "4",
    "--no-progress",
]  # fmt: skip


def adapter_tensors(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run_dir / "final_model" / "adapter_model.safetensors")


def kill_once_written(process: subprocess.Popen, path) -> threading.Thread:
    """A thread that SIGKILLs ``process`` as soon as ``path`` exists."""

    def watch() -> None:
        deadline = time.monotonic() + 300
        while not path.exists() and process.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_a_lora_run_killed_with_sigkill_resumes_to_the_same_metrics(tmp_path):
    """A real SIGKILL of a `grpo-lab train` process after step 2's checkpoint,
    then a resume to step 4. The uninterrupted reference and the resume run in
    this process (one thread, as the tiny model's runs always use), the
    reference while the other is being killed. Metrics and the final adapter
    (A, B and the trained norm copies) equal bit for bit."""
    killed = tmp_path / "killed"
    process = run_cli(
        [*LORA_KILL_FLAGS, "--steps", "400", "--run-dir", str(killed)], tmp_path
    )
    watcher = kill_once_written(process, killed / "checkpoints" / "step_000002.pt")
    reference = tmp_path / "reference"
    flags = [*LORA_KILL_FLAGS, "--steps", "4", "--run-dir", str(reference)]
    assert cli.main(["train", *flags]) == 0
    watcher.join()
    output, _ = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, output
    lines_at_kill = len(read_metrics(killed))
    resume = ["train", "--resume", str(killed), "--steps", "4", "--no-progress"]
    assert cli.main(resume) == 0
    assert json.loads((reference / "config.json").read_text())["lora_rank"] == 4
    assert 1 <= lines_at_kill < len(read_metrics(killed))
    assert len(step_records(read_metrics(killed))) == 5  # steps 0..4
    assert comparable(killed) == comparable(reference)
    expected, resumed = adapter_tensors(reference), adapter_tensors(killed)
    assert expected.keys() == resumed.keys()
    assert any("layernorm" in name for name in expected)
    assert all(torch.equal(expected[n], resumed[n]) for n in expected)
    assert any(".lora_B." in n and expected[n].abs().max() > 0 for n in expected)


# --- float16: a dynamic loss scale -------------------------------------------------------


def test_an_overflowing_loss_scale_skips_the_step_and_says_so(tmp_path):
    policy = loop.build_policy(tiny_config(tmp_path))
    randomize_adapters(policy.model)
    batch = fixed_batch(policy.tokenizer)
    before = [p.detach().clone() for p in policy.model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # x 2^127 x 1000: inf
    _, metadata = policy_gradient_update(
        policy.model,
        policy.optimizer,
        1,
        1.0,
        batch,
        1000 * ADVANTAGES,
        grad_scaler=scaler,
    )
    assert metadata["optimizer_step"] == 0.0 and metadata["loss_scale_skipped"] == 1.0
    assert torch.isfinite(metadata["loss"])  # the loss is fine: only the scale was not
    assert metadata["loss_scale"] == 2.0**126  # halved for the next step
    assert all(torch.equal(p, b) for p, b in zip(policy.model.parameters(), before))
    assert all(p.grad is None for p in policy.model.parameters())


def test_a_scaled_float16_step_equals_the_unscaled_step(tmp_path):
    batch = fixed_batch(build_char_tokenizer())
    results = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**10)):
        policy = loop.build_policy(tiny_config(tmp_path))
        randomize_adapters(policy.model)
        policy.optimizer = torch.optim.SGD(
            lora.trainable_parameters(policy.model), lr=1.0
        )
        with torch.autocast("cpu", dtype=torch.float16):
            _, metadata = policy_gradient_update(
                policy.model, policy.optimizer, 1, None, batch, ADVANTAGES,
                grad_scaler=scaler,
            )  # fmt: skip
        results.append(
            (metadata, [p.detach().clone() for p in policy.model.parameters()])
        )
    (plain, plain_weights), (scaled, scaled_weights) = results
    assert scaled["optimizer_step"] == 1.0 and scaled["loss_scale_skipped"] == 0.0
    assert all(p.dtype == torch.float32 for p in scaled_weights)  # master weights
    for a, b in zip(plain_weights, scaled_weights):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=5e-4)
    assert "loss_scale_skipped" not in plain


def test_a_non_finite_loss_is_still_refused_under_a_loss_scale(tmp_path):
    policy = loop.build_policy(tiny_config(tmp_path))
    advantages = torch.tensor([float("nan"), 1.0, 0.0, 0.0])
    with pytest.raises(RuntimeError, match="Non-finite GRPO loss"):
        policy_gradient_update(
            policy.model, policy.optimizer, 1, 1.0, fixed_batch(policy.tokenizer),
            advantages, grad_scaler=torch.amp.GradScaler("cpu"),
        )  # fmt: skip


def test_float16_runs_build_a_grad_scaler_and_checkpoint_its_scale(tmp_path):
    config = tiny_config(tmp_path, autocast_dtype="float16")
    policy = loop.build_policy(config)
    assert isinstance(policy.grad_scaler, torch.amp.GradScaler)
    assert loop.build_policy(tiny_config(tmp_path)).grad_scaler is None
    policy.grad_scaler.scale(torch.ones(()))  # the scale is made lazily
    policy.grad_scaler.update(new_scale=1024.0)
    path = loop.save_checkpoint(config, tmp_path / "run", policy, 1)
    fresh = loop.build_policy(config)
    payload = torch.load(path, weights_only=True)
    from grpo_lab.training import checkpoint

    checkpoint.restore_checkpoint(
        payload, path, fresh.model, fresh.optimizer, grad_scaler=fresh.grad_scaler
    )
    assert fresh.grad_scaler.get_scale() == 1024.0


# --- the small-gpu profile's memory estimate ------------------------------------------


def test_the_small_gpu_estimate_counts_the_real_lora_parameters():
    """The estimate's adapter count is the count peft gives Qwen2.5-0.5B's
    architecture (built on the meta device, nothing downloaded)."""
    from peft import get_peft_model
    from transformers import Qwen2Config

    config = TrainConfig.for_profile("small-gpu")
    sizes = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
             "num_attention_heads": 14, "num_key_value_heads": 2}  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            Qwen2Config(vocab_size=151936, tie_word_embeddings=True, **sizes)
        )
        adapted = get_peft_model(model, lora.peft_lora_config(config.lora_settings()))
    counted = lora.trainable_parameter_count(adapted)
    assert config_module.lora_parameter_count_of(config) == counted
    estimate = config_module.training_memory_bytes(
        config, config_module.KNOWN_PARAMETER_COUNTS[config.model]
    )
    base = config_module.KNOWN_PARAMETER_COUNTS[config.model] * 4  # frozen float32
    assert estimate == pytest.approx(
        (base + counted * lora.ADAPTER_TRAINING_BYTES)
        + config_module.activation_bytes(config)
    )
    assert estimate < 15 * 2**30  # a T4 under the 15 GiB cap


# --- the first step against TRL's GRPOTrainer with the same peft_config ------------------


def set_adapters(named_parameters, seed: int = 5) -> None:
    """A and B from one seeded generator, in name order (B nonzero: A trains)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in named_parameters:
            if ".lora_" in name:
                noise = torch.randn(parameter.shape, generator=generator)
                parameter.copy_(0.2 * noise.to(parameter.dtype))


@pytest.mark.slow
def test_the_first_lora_step_equals_trls_with_the_same_peft_config(tmp_path):
    """float64, loss_type grpo off-policy: TRL wraps the model with peft itself
    (adapters and the trained norm copies, modules_to_save); both sides then get
    the same adapter values, and the loss and every trainable gradient agree."""
    from test_trl_parity import (
        COMPLETIONS,
        GROUP_SIZE,
        MAX_COMPLETION_LENGTH,
        REWARDS,
        ROW_PROMPTS,
        SIZES,
        encode,
        grpo_lab_batch,
        off_policy,
        to_grpo_lab_layout,
    )

    from grpo_lab.integrations.trl.parity import (
        fixed_completions_trainer,
        trl_first_step,
    )
    from grpo_lab.integrations.trl.trainer import peft_config_for
    from grpo_lab.teaching.gradient_recorder import GradientRecorder

    tokenizer = build_char_tokenizer()
    config = TrainConfig.for_profile("cpu", lora_rank=2, lora_alpha=8.0)

    def fresh():
        return build_tiny_qwen2(tokenizer, seed=0, **SIZES).double()

    trainer = fixed_completions_trainer(
        {"num_generations": GROUP_SIZE, "max_completion_length": MAX_COMPLETION_LENGTH,
         "loss_type": "grpo"},
        fresh(), tokenizer, ROW_PROMPTS, [encode(tokenizer, c) for c in COMPLETIONS],
        REWARDS, tmp_path, peft_config=peft_config_for(config),
    )  # fmt: skip
    trl_names = [n for n, _ in trainer.model.named_parameters()]
    assert any(".lora_A." in n for n in trl_names)
    set_adapters(trainer.model.named_parameters())
    trl_run = trl_first_step(trainer, ROW_PROMPTS, **off_policy(0))

    adapted = lora.inner_model(lora.add_adapters(fresh(), config.lora_settings(), 0))
    set_adapters(adapted.named_parameters())
    batch = grpo_lab_batch(tokenizer)
    inputs, mask = trl_run.inputs, batch["response_mask"]
    old = to_grpo_lab_layout(
        inputs["old_per_token_logps"], inputs["completion_mask"], mask
    )
    recorder = GradientRecorder(lora.trainable_parameters(adapted))
    loss, _ = policy_gradient_update(
        adapted, recorder, 1, None, batch, inputs["advantages"],
        importance_reweighting_method="grpo", old_log_probs=old, cliprange=0.2,
    )  # fmt: skip
    trained = [n for n in trl_names if ".lora_" in n or ".modules_to_save." in n]
    trl_gradients = [
        g for n, g in zip(trl_names, trl_run.parameter_gradients) if n in trained
    ]
    assert len(trained) == len(recorder.gradients) == 17  # 7 x (A, B), 3 norms
    assert all(p.dtype == torch.float64 for p in lora.trainable_parameters(adapted))
    assert abs(loss.double() - sum(trl_run.losses)).item() <= 1e-12
    for ours, theirs in zip(recorder.gradients, trl_gradients, strict=True):
        assert theirs.abs().max() > 1e-8  # every adapter gets a gradient
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def test_an_adapter_names_the_model_it_applies_to(tmp_path):
    run_dir = tmp_path / "run"
    base = str((run_dir / loop.BASE_MODEL_DIR).resolve())
    tiny = TrainConfig.for_profile("cpu", lora_rank=8, sft_max_steps=0)
    assert loop.adapter_base(tiny, run_dir) == base
    hub_name = dataclasses.replace(tiny, model="Qwen/Qwen2.5-0.5B-Instruct")
    assert loop.adapter_base(hub_name, run_dir) == "Qwen/Qwen2.5-0.5B-Instruct"
    warmed = dataclasses.replace(hub_name, sft_max_steps=5)
    assert loop.adapter_base(warmed, run_dir) == base
    local = dataclasses.replace(tiny, model=str(tmp_path))
    assert loop.adapter_base(local, run_dir) == str(tmp_path.resolve())


def test_the_model_card_of_a_lora_run_says_it_is_an_adapter():
    from grpo_lab.training.model_card import card_metadata, model_card

    config = TrainConfig.for_profile("cpu", lora_rank=8).to_dict()
    assert card_metadata(config)["library_name"] == "peft"
    assert "lora" in card_metadata(config)["tags"]
    card = model_card(config, [], "me/run", curve_file=None)
    assert 'PeftModel.from_pretrained(base, "me/run")' in card
    assert "RUN_DIR/base_model" in card and "grpo-lab merge" in card
    full = TrainConfig.for_profile("cpu").to_dict()
    assert card_metadata(full)["library_name"] == "transformers"
    assert "PeftModel" not in model_card(full, [], "me/run", curve_file=None)


def test_export_maps_lora_to_trl_peft_config_and_verl_settings():
    from grpo_lab.integrations.trl import trainer as grpo_trl
    from grpo_lab.integrations.trl.translation import to_trl_config
    from grpo_lab.integrations.verl import launch as verl

    config = TrainConfig.for_profile(
        "cpu", lora_rank=8, lora_target_modules="q_proj", sft_max_steps=0
    )
    peft_config = grpo_trl.peft_config_for(config)
    assert (peft_config.r, peft_config.lora_alpha) == (8, 32.0)
    assert peft_config.target_modules == {"q_proj"}
    norms = ["input_layernorm", "post_attention_layernorm", "model.norm"]
    assert peft_config.modules_to_save == norms
    plain = dataclasses.replace(config, lora_train_norms=False)
    assert grpo_trl.peft_config_for(plain).modules_to_save is None
    with pytest.raises(ValueError, match=r"^lora_train_norms must be False .* verl"):
        verl.lora_overrides(config)
    config = plain  # verl's own LoRA settings
    assert grpo_trl.peft_config_for(TrainConfig.for_profile("cpu")) is None
    assert to_trl_config(config)["learning_rate"] == config.lora_lr
    full = TrainConfig.for_profile("cpu", sft_max_steps=0)
    assert to_trl_config(full)["learning_rate"] == full.lr
    assert verl.lora_overrides(config) == {
        "actor_rollout_ref.model.lora_rank": 8,
        "actor_rollout_ref.model.lora_alpha": 32.0,
        "actor_rollout_ref.model.target_modules": ["q_proj"],
        "actor_rollout_ref.actor.optim.lr": 2e-3,
    }
    assert verl.lora_overrides(full) == {}
    with pytest.raises(ValueError, match=r"^lora_dropout must be 0"):
        verl.lora_overrides(dataclasses.replace(config, lora_dropout=0.1))
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert {n for n in fields if n.startswith("lora_")} <= set(verl.exported_fields())


# --- the small-gpu cases of benchmarks/gpu.sh (they run on a GPU only) -----------------


def benchmark_module(name: str):
    import importlib
    import sys
    from pathlib import Path

    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    return importlib.import_module(name)


def test_gpu_sh_runs_small_gpu_full_and_lora_under_a_15_gib_cap_with_valid_flags():
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    gpu_throughput = benchmark_module("gpu_throughput")
    harness = benchmark_module("harness")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.sh"
    listed = subprocess.run(
        ["bash", str(script), "--dry-run"],
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    # NAME TIMEOUT PYTHON SCRIPT FLAGS...
    cases = {line.split()[0]: shlex.split(line)[4:] for line in listed}
    assert {"gpu_throughput_small_gpu_full", "gpu_throughput_small_gpu_lora"} <= set(
        cases
    )
    hidden, mlp, layers, heads, kv_heads, vocabulary = (
        config_module.KNOWN_ARCHITECTURES["Qwen/Qwen2.5-0.5B-Instruct"]
    )
    profile = TrainConfig.for_profile("small-gpu")
    for method in ("full", "lora"):
        arguments = harness.arguments_of(
            gpu_throughput, cases[f"gpu_throughput_small_gpu_{method}"]
        )
        assert (arguments.method, arguments.device) == (method, "cuda")
        assert arguments.memory_cap_gib == 15 and arguments.gradient_checkpointing
        assert (arguments.dtype, arguments.autocast) == ("float32", "float16")
        assert arguments.lora_rank == profile.lora_rank
        assert arguments.lora_alpha == profile.lora_alpha
        assert arguments.chunk_size == profile.logits_chunk_size
        microbatch = profile.train_batch_size // profile.gradient_accumulation_steps
        assert arguments.microbatch_size == microbatch
        assert arguments.new_tokens == profile.max_new_tokens
        assert arguments.rollout_batch == profile.rollout_batch_size
        assert gpu_throughput.SHAPES[arguments.shape] == {
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "intermediate_size": mlp,
            "vocab_size": vocabulary,
        }


def test_the_memory_cap_is_the_share_of_the_gpu_that_15_gib_is():
    gpu_throughput = benchmark_module("gpu_throughput")
    assert gpu_throughput.memory_fraction(15, 60 * 2**30) == 0.25
    assert gpu_throughput.memory_fraction(15, 15 * 2**30) == 1.0
    assert gpu_throughput.memory_fraction(15, 14 * 2**30) == 1.0  # at most all
    with pytest.raises(ValueError, match="memory_cap_gib must be > 0"):
        gpu_throughput.memory_fraction(0, 60 * 2**30)


def test_the_small_gpu_step_runs_lora_under_float16_autocast_on_cpu(tmp_path):
    """The GPU case's code path at tiny sizes: adapters only, a loss scale."""
    gpu_throughput = benchmark_module("gpu_throughput")
    out = tmp_path / "small_gpu_lora.json"
    flags = ["--quick", "--method", "lora", "--autocast", "float16"]
    result = gpu_throughput.main(
        [*flags, "--gradient-checkpointing", "--out", str(out)]
    )
    train, rollouts = result["tables"]
    shape = gpu_throughput.SHAPES["tiny"]
    shapes = lora.qwen2_linear_shapes(
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["num_hidden_layers"],
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
    )
    for row in train["rows"]:
        assert row["method"] == "LoRA r=1"
        assert row["trainable_parameters"] == lora.lora_parameter_count(shapes, 1)
        # GradScaler's dynamic scale: 2^16, halved at each overflowing step.
        assert row["loss_scale"] in [2.0**k for k in range(17)]
    assert rollouts["rows"][0]["tokens_per_second"] > 0
    assert result["memory_fraction"] is None  # no cap on a CPU
