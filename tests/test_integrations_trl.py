"""grpo_lab.integrations.trl.translation: the TrainConfig -> GRPOConfig table, TRL training
from it, and first-step parity with grpo_lab through the table.

The parity cases build a TrainConfig, translate it with ``to_trl_config`` and
hand TRL exactly those loss settings; TRL computes its loss and gradients on
fixed completions (tests/test_trl_parity.py's harness, in float64) and
grpo_lab computes its own from ``config.update_settings()``. Run with ``-s`` to
print each configuration's largest |difference| (loss and gradients).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from test_trl_parity import (
    COMPLETIONS,
    FORMAT_REWARDS,
    GROUP_SIZE,
    MAX_COMPLETION_LENGTH,
    PROMPTS,
    REWARDS,
    ROW_PROMPTS,
    encode,
    fresh_model,
    make_trainer,
    max_deltas,
    off_policy,
    run_grpo_lab,
    run_trl,
)
from trl import GRPOConfig, GRPOTrainer

from grpo_lab.advantages import (
    compute_group_normalized_rewards,
    compute_multi_reward_advantages,
)
from grpo_lab.cli import main as cli
from grpo_lab.errors import UserError
from grpo_lab.integrations.cluster import Cluster
from grpo_lab.integrations.trl import launch as grpo_trl_launch
from grpo_lab.integrations.trl import parity as grpo_trl_parity
from grpo_lab.integrations.trl import trainer as grpo_trl_trainer
from grpo_lab.integrations.trl import translation as grpo_trl
from grpo_lab.integrations.trl.names import from_trl_values
from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2, load_tokenizer
from grpo_lab.tasks import get_task
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.loop import learning_rate_at

TOLERANCE = 1e-12  # float64, the same formula on both sides
PARITY_REPORT: dict[str, dict[str, float]] = {}


def test_the_module_names_the_trl_version_it_is_tested_against():
    import trl

    assert grpo_trl.TESTED_TRL_VERSION == "1.16.0" == trl.__version__


# --- the table --------------------------------------------------------------------


def test_every_field_is_translated_launched_not_training_or_default_only():
    groups = (
        grpo_trl.TRANSLATIONS,
        grpo_trl.LAUNCH_SETTINGS,
        grpo_trl.NOT_TRAINING_SETTINGS,
    )
    default_only = []
    for config_field in dataclasses.fields(TrainConfig):
        homes = [group for group in groups if config_field.name in group]
        assert len(homes) <= 1, f"{config_field.name} is in {len(homes)} groups"
        if not homes:
            default_only.append(config_field.name)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set().union(*groups) <= names  # no row names a field that is gone
    table = grpo_trl.translation_table()
    listed = [line for line in table.splitlines() if "refused unless default" in line]
    assert listed == [f"| `{n}` | — | refused unless default |" for n in default_only]
    for group in (grpo_trl.LAUNCH_SETTINGS, grpo_trl.NOT_TRAINING_SETTINGS):
        assert all(reason for reason in group.values())


def test_every_trl_name_in_the_table_is_a_grpo_config_field():
    trl_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    named = {n for t in grpo_trl.TRANSLATIONS.values() for n in t.trl_names}
    assert named <= trl_fields, named - trl_fields
    table = grpo_trl.translation_table()
    default_only = table.count("| — | refused unless default |")
    assert table.count("\n") == len(grpo_trl.TRANSLATIONS) + default_only + 1
    assert "| `group_size` | `num_generations` |" in table


def test_the_scaling_out_page_shows_the_table_as_the_code_has_it():
    page = Path(__file__).resolve().parents[1] / "docs" / "scaling_out.md"
    section = page.read_text(encoding="utf-8")
    assert grpo_trl.translation_table() in section
    assert "grpo-lab export trl --profile gpu" in section
    assert "grpo-lab export verl" in section


def gpu_config(**overrides) -> TrainConfig:
    return TrainConfig.for_profile("gpu", **overrides)


def test_the_gpu_profile_maps_to_grpo_config_arguments_that_load():
    config = gpu_config()
    arguments = grpo_trl.to_trl_config(config)
    assert arguments["num_generations"] == 8
    assert arguments["generation_batch_size"] == 256
    assert arguments["per_device_train_batch_size"] == 2  # 128 rows / 64 steps
    assert arguments["gradient_accumulation_steps"] == 64
    assert arguments["max_steps"] == 400  # 200 rollout batches x 2 optimizer steps
    assert arguments["loss_type"] == "grpo" and arguments["epsilon"] == 0.2
    assert arguments["use_vllm"] and arguments["vllm_mode"] == "colocate"
    assert arguments["max_completion_length"] == 1024
    assert arguments["bf16"] and not arguments["fp16"]
    assert arguments["scale_rewards"] == "group"
    assert arguments["generation_kwargs"] == {
        "stop": ["</answer>"],  # GSM8K's r1-zero answer ends sampling
        "include_stop_str_in_output": True,
    }
    on_cpu = {"use_vllm": False, "bf16": False, "use_cpu": True}  # no GPU here
    loaded = GRPOConfig(output_dir="unused", **{**arguments, **on_cpu})
    assert loaded.steps_per_generation == 128  # 256 / 2 rows per micro-step
    json.dumps(arguments)  # frozen as grpo_config.json
    # Eight processes: the microbatch stays, the accumulation shrinks 8-fold.
    eight = grpo_trl.to_trl_config(config, num_processes=8)
    assert eight["per_device_train_batch_size"] == 2
    assert eight["gradient_accumulation_steps"] == 8  # 2 x 8 x 8 = 128
    odd = gpu_config(
        rollout_batch_size=192, train_batch_size=96, gradient_accumulation_steps=3
    )
    three = grpo_trl.data_parallel_batch(odd, 3)  # 32 rows split over 3 x 1
    assert three == {
        "per_device_train_batch_size": 32,
        "gradient_accumulation_steps": 1,
    }
    four = grpo_trl.data_parallel_batch(odd, 4)  # 3 steps do not split: rows do
    assert four == {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 3}
    with pytest.raises(UserError, match="train_batch_size 96"):
        grpo_trl.data_parallel_batch(odd, 5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"importance_reweighting_method": "gmpo"}, "importance_reweighting_method"),
        ({"importance_reweighting_method": "noclip"}, "importance_reweighting_method"),
        ({"kl_coef": 0.1, "kl_estimator": "k1"}, "kl_estimator 'k1'"),
        ({"entropy_coef": 0.01}, "entropy_coef 0.01"),
        ({"sft_max_steps": 5}, "sft_max_steps 5"),
        ({"backend": "hf", "rollout_max_batch_size": 8, "task": "reverse"},
         "rollout_max_batch_size 8"),
        ({"group_size": 1, "baseline": "none", "advantage_normalizer": "none"},
         "group_size 1"),
        (
            {"importance_reweighting_method": "cispo", "cliprange": 0.2},
            "cliprange 0.2",
        ),
        (
            {"importance_reweighting_method": "sapo", "loss_normalization": "token"},
            "loss_normalization 'token'",
        ),
        ({"importance_reweighting_method": "dppo_tv"}, "importance_reweighting_method 'dppo_tv'"),
        ({"importance_reweighting_method": "dppo_kl"}, "importance_reweighting_method 'dppo_kl'"),
        ({"importance_reweighting_method": "clip_cov"}, "importance_reweighting_method 'clip_cov'"),
        ({"importance_reweighting_method": "kl_cov", "cliprange": None},
         "importance_reweighting_method 'kl_cov'"),
        ({"importance_reweighting_method": "luspo", "kl_coef": 0.1}, "kl_coef 0.1"),
        ({"importance_reweighting_method": "vespo", "cliprange": None},
         "loss_normalization 'sequence'"),
        ({"importance_reweighting_method": "vespo", "cliprange": None,
          "loss_normalization": "token", "sampler_correction": "token_truncate"},
         "sampler_correction 'token_truncate'"),
        ({"advantage_normalizer": "token_whiten"}, "advantage_normalizer 'token_whiten'"),
        ({"reward_aggregation": "normalize_then_sum_tokens"},
         "reward_aggregation 'normalize_then_sum_tokens'"),
    ],
)  # fmt: skip
def test_a_setting_trl_lacks_is_refused_by_name(overrides, message):
    with pytest.raises(UserError, match=message) as error:
        grpo_trl.to_trl_config(gpu_config(**overrides))
    assert "cannot run on TRL's GRPOTrainer" in str(error.value)


def test_the_2026_members_become_trls_loss_types():
    luspo = grpo_trl.to_trl_config(
        gpu_config(importance_reweighting_method="luspo", cliprange=3e-4, ratio_cap=2.0)
    )
    assert (luspo["loss_type"], luspo["importance_sampling_level"]) == (
        "luspo",
        "sequence",
    )
    assert (luspo["epsilon"], luspo["delta"]) == (3e-4, 2.0)
    vespo = grpo_trl.to_trl_config(
        gpu_config(
            importance_reweighting_method="vespo",
            cliprange=None,
            loss_normalization="token",
            vespo_k_pos=1.5,
            off_policy_mask_threshold=0.5,
        )
    )
    assert (vespo["loss_type"], vespo["importance_sampling_level"]) == (
        "vespo",
        "token",
    )
    assert (vespo["vespo_k_pos"], vespo["vespo_lambda_neg"]) == (1.5, 2.0)
    assert vespo["off_policy_mask_threshold"] == 0.5
    assert grpo_trl.to_trl_config(gpu_config())["off_policy_mask_threshold"] is None
    # And back: TRL's names read as grpo_lab's, in either order.
    for values in (
        {"loss_type": "luspo", "importance_sampling_level": "sequence"},
        {"importance_sampling_level": "sequence", "loss_type": "luspo"},
    ):
        fields = from_trl_values({**values, "num_iterations": 2, "epsilon": 0.2})
        assert fields["importance_reweighting_method"] == "luspo", values


def test_an_inert_setting_is_not_refused():
    # kl_estimator does nothing without a KL penalty.
    arguments = grpo_trl.to_trl_config(gpu_config(kl_estimator="k1"))
    assert arguments["beta"] == 0.0


def test_grpo_lab_trainer_is_used_only_for_what_trl_lacks():
    exact = gpu_config(advantage_eps=1e-4, nan_rewards="ignore")
    assert grpo_trl.grpo_lab_trainer_reasons(exact) == []
    assert grpo_trl_trainer.trainer_class_for(exact) is GRPOTrainer
    lacking = gpu_config(baseline="leave_one_out", lr_warmup_steps=3)
    reasons = grpo_trl.grpo_lab_trainer_reasons(lacking)
    assert "baseline 'leave_one_out'" in reasons and "lr_warmup_steps 3" in reasons
    trainer_class = grpo_trl_trainer.trainer_class_for(lacking)
    assert issubclass(trainer_class, GRPOTrainer)
    assert trainer_class is grpo_trl_trainer.GrpoLabTrainer


def test_reward_parts_reach_trl_as_one_reward_function_each(tokenizer, tmp_path):
    config = gpu_config(reward_aggregation="normalize_then_sum")
    assert grpo_trl.to_trl_config(config)["multi_objective_aggregation"] == (
        "normalize_then_sum"
    )
    assert "multi_objective_aggregation" not in grpo_trl.to_trl_config(gpu_config())
    task = get_task("reverse", n_digits=3)
    functions = grpo_trl_trainer.trl_reward_functions(task, config)
    names = [f.__name__ for f in functions]
    assert names == ["reverse_format_reward", "reverse_answer_reward"]
    assert [f(["p"], ["999"], ground_truth=["123"]) for f in functions] == [
        [1.0],
        [0.0],
    ]
    # GrpoLabTrainer (nan_rewards propagate) hands TRL's per-function rewards
    # to grpo_lab's own aggregation, with grpo_lab's epsilon.
    parts = {"reward_aggregation": "normalize_then_sum", "nan_rewards": "propagate"}
    run = TrainConfig.for_profile("cpu", **{**HARNESS, **parts, "advantage_eps": 1e-6})
    trainer = grpo_trl_parity.fixed_completions_trainer(
        {"num_generations": GROUP_SIZE, "max_completion_length": MAX_COMPLETION_LENGTH},
        fresh_model(tokenizer), tokenizer, ROW_PROMPTS,
        [encode(tokenizer, c) for c in COMPLETIONS], REWARDS, tmp_path,
        trainer_class=grpo_trl_trainer.GrpoLabTrainer, train_config=run,
        extra_rewards=(FORMAT_REWARDS,),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = trainer._generate_and_score_completions(
            [{"prompt": p} for p in PROMPTS for _ in range(GROUP_SIZE)]
        )
    ours, _ = compute_multi_reward_advantages(
        torch.tensor([REWARDS, FORMAT_REWARDS]).T, GROUP_SIZE, "mean",
        run.advantage_eps, "std", reward_aggregation="normalize_then_sum",
    )  # fmt: skip
    assert torch.equal(inputs["advantages"], ours)


# --- data and reward ----------------------------------------------------------------


def test_task_dataset_and_reward_function_follow_the_task():
    task = get_task("reverse", n_digits=3)
    dataset = grpo_trl_trainer.task_dataset(task, "train", 5, seed=0)
    assert dataset.column_names == ["prompt", "ground_truth"] and len(dataset) == 5
    example = task.train(5, 0)[0]
    assert (dataset[0]["prompt"], dataset[0]["ground_truth"]) == (
        example.prompt,
        example.ground_truth,
    )
    chat = grpo_trl_trainer.task_dataset(task, "eval", 2, seed=0, chat_template=True)
    assert chat[0]["prompt"] == [{"role": "user", "content": task.eval(2, 0)[0].prompt}]
    reward = grpo_trl_trainer.trl_reward_function(task)
    truth = example.ground_truth
    completions = [truth, "nope", [{"role": "assistant", "content": truth}]]
    assert reward(["p"] * 3, completions, ground_truth=[truth] * 3) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="split must be"):
        grpo_trl_trainer.task_dataset(task, "test", 2, seed=0)


# --- a real GRPOTrainer trains from the translation ----------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2 and its character tokenizer, saved as a local model folder."""
    folder = tmp_path_factory.mktemp("tiny_model")
    tokenizer = build_char_tokenizer()
    model = build_tiny_qwen2(
        tokenizer, hidden_size=16, num_layers=1, intermediate_size=32, seed=0
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_grpo_trainer_built_from_the_translation_trains_two_steps(
    tiny_model_dir, tmp_path
):
    # An entropy bonus (token normalization) gives the untrained model a
    # gradient even when every reward is 0; the warm-up needs GrpoLabTrainer.
    config = TrainConfig.for_profile(
        "smoke",
        task_options={"n_digits": 3},
        rollout_batch_size=8,
        train_batch_size=8,
        group_size=4,
        sft_max_steps=0,
        eval_every=0,
        loss_normalization="token",
        entropy_coef=0.01,
        lr_warmup_steps=2,
    )
    arguments = grpo_trl.to_trl_config(config)
    assert arguments["use_cpu"] and arguments["max_steps"] == 2
    task = get_task(config.task, **config.task_options)
    trainer_class = grpo_trl_trainer.trainer_class_for(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_class(
            model=str(tiny_model_dir),
            reward_funcs=grpo_trl_trainer.trl_reward_function(task),
            args=GRPOConfig(output_dir=str(tmp_path), **arguments),
            train_dataset=grpo_trl_trainer.task_dataset(task, "train", 16, config.seed),
            processing_class=load_tokenizer(str(tiny_model_dir)),
            train_config=config,
        )
        before = [p.detach().clone() for p in trainer.model.parameters()]
        result = trainer.train()
    assert result.global_step == 2 and math.isfinite(result.training_loss)
    changed = [
        (b - p.detach()).abs().max() > 0
        for b, p in zip(before, trainer.model.parameters())
    ]
    assert any(changed)
    scheduler = trainer.lr_scheduler
    rates = [config.lr * scheduler.lr_lambdas[0](step) for step in range(3)]
    assert rates == [learning_rate_at(config, s) for s in (1, 2, 3)]


def test_hf_rollouts_stop_at_strings_once_generate_has_the_tokenizer(
    tiny_model_dir, tmp_path
):
    """small-gpu samples with transformers: the task's stop strings become
    generation_kwargs' stop_strings. TRL's own generation path then fails for
    want of a tokenizer, and stops at the strings once it is handed one."""
    small_gpu = grpo_trl.to_trl_config(TrainConfig.for_profile("small-gpu"))
    assert small_gpu["generation_kwargs"] == {"stop_strings": ["</answer>"]}
    assert not small_gpu["use_vllm"]
    config = TrainConfig.for_profile(
        "smoke", task_options={"n_digits": 3}, sft_max_steps=0, eval_every=0
    )
    tokenizer = load_tokenizer(str(tiny_model_dir))
    # Every printable one-character token: each completion stops after one.
    stops = [t for t in map(tokenizer.decode, range(len(tokenizer))) if len(t) == 1]
    arguments = grpo_trl.to_trl_config(config)
    assert arguments["max_completion_length"] >= 4 and len(stops) > 10
    arguments["generation_kwargs"] = {"stop_strings": stops}
    task = get_task(config.task, **config.task_options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=grpo_trl_trainer.trl_reward_function(task),
            args=GRPOConfig(output_dir=str(tmp_path), **arguments),
            train_dataset=grpo_trl_trainer.task_dataset(task, "train", 8, 0),
            processing_class=tokenizer,
        )
    prompt_ids = [tokenizer.encode("123>", add_special_tokens=False)] * 4
    with pytest.raises(ValueError, match="could not locate a tokenizer"):
        trainer._generate_single_turn(prompt_ids, None, {}, 4)
    grpo_trl_trainer.hand_generate_the_tokenizer(trainer)
    torch.manual_seed(0)
    completions, _ = trainer._generate_single_turn(prompt_ids, None, {}, 4)
    assert [len(ids) for ids in completions] == [1, 1, 1, 1]
    trainer.args.generation_kwargs = None  # without stop strings: no wrapper
    generate = trainer.model.generate
    grpo_trl_trainer.hand_generate_the_tokenizer(trainer)
    assert trainer.model.generate is generate


# --- first-step parity through the translation ---------------------------------------

# The harness's batch: 3 prompts x 4 completions, one optimizer step over all 12.
HARNESS = {
    "task_options": {"n_digits": 3},
    "rollout_batch_size": len(PROMPTS) * GROUP_SIZE,
    "train_batch_size": len(PROMPTS) * GROUP_SIZE,
    "group_size": GROUP_SIZE,
    "epochs_per_rollout_batch": 2,  # off-policy, so the ratio is not 1
    "max_new_tokens": MAX_COMPLETION_LENGTH,
    "sft_max_steps": 0,
    "share_prompt_prefix": False,
    "advantage_eps": 1e-4,
    "nan_rewards": "ignore",
    "importance_reweighting_method": "grpo",
    "cliprange": 0.2,
}
ROWS_TIMES_LENGTH = len(PROMPTS) * GROUP_SIZE * MAX_COMPLETION_LENGTH
PARITY_CASES = {
    # mapped onto GRPOTrainer itself
    "grpo, sequence (loss_type=grpo)": {},
    "grpo, token (loss_type=dapo)": {"loss_normalization": "token"},
    "grpo, constant = rows x length (loss_type=dr_grpo)": {
        "loss_normalization": "constant",
        "normalization_constant": ROWS_TIMES_LENGTH,
    },
    "cliprange_high=0.28, token (epsilon_high)": {
        "loss_normalization": "token",
        "cliprange_high": 0.28,
    },
    "ratio_cap=1.5 (delta)": {"ratio_cap": 1.5},
    "cispo, cliprange=1, cliprange_high=0.3 (epsilon_high=1.3)": {
        "importance_reweighting_method": "cispo",
        "loss_normalization": "token",
        "cliprange": 1.0,
        "cliprange_high": 0.3,
    },
    "sapo, temperatures 1.0 / 1.5": {
        "importance_reweighting_method": "sapo",
        "sapo_temperature_pos": 1.0,
        "sapo_temperature_neg": 1.5,
    },
    "gspo, cliprange=0.05 (importance_sampling_level=sequence)": {
        "importance_reweighting_method": "gspo",
        "cliprange": 0.05,
    },
    "kl_coef=0.1, k3, token (beta)": {"loss_normalization": "token", "kl_coef": 0.1},
    "kl_coef=0.1, kl_importance_weighting (use_bias_correction_kl)": {
        "kl_coef": 0.1,
        "kl_importance_weighting": True,
    },
    "gspo, kl_coef=0.1, kl_importance_weighting": {
        "importance_reweighting_method": "gspo",
        "kl_coef": 0.1,
        "kl_importance_weighting": True,
    },
    "top_entropy_quantile=0.3": {"top_entropy_quantile": 0.3},
    "temperature=0.7, token": {"loss_normalization": "token", "temperature": 0.7},
    "entropy_coef=0.05, token": {"loss_normalization": "token", "entropy_coef": 0.05},
    "advantage_normalizer=batch_std (scale_rewards=batch)": {
        "advantage_normalizer": "batch_std"
    },
    "advantage_normalizer=none (scale_rewards=none)": {"advantage_normalizer": "none"},
    # through GrpoLabTrainer
    "GrpoLabTrainer: constant, normalization_constant=50": {
        "loss_normalization": "constant",
        "normalization_constant": 50,
    },
    "GrpoLabTrainer: baseline=leave_one_out": {"baseline": "leave_one_out"},
    "GrpoLabTrainer: baseline=none": {"baseline": "none"},
    "GrpoLabTrainer: advantage_normalizer=mean (MaxRL)": {
        "advantage_normalizer": "mean"
    },
    "GrpoLabTrainer: advantage_eps=1e-6, nan_rewards=propagate (defaults)": {
        "advantage_eps": 1e-6,
        "nan_rewards": "propagate",
    },
}


def translated_run(tokenizer, tmp_path, config: TrainConfig, rewards=REWARDS):
    """TRL's first step of ``config``'s translated loss settings on the harness
    (grpo_trl_parity.trl_first_step_loss, on the class trainer_class_for picks)."""
    arguments = grpo_trl.to_trl_config(config)
    assert arguments["max_completion_length"] == MAX_COMPLETION_LENGTH
    return grpo_trl_parity.trl_first_step_loss(
        config,
        fresh_model(tokenizer),
        tokenizer,
        ROW_PROMPTS,
        [encode(tokenizer, c) for c in COMPLETIONS],
        rewards,
        tmp_path,
        **off_policy(),
    )


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def advantage_difference(trl_run, config: TrainConfig) -> float:
    """max |TRL's advantages - grpo_lab's| for the harness's rewards."""
    ours, _ = compute_group_normalized_rewards(
        torch.tensor(REWARDS),
        config.group_size,
        config.baseline,
        config.advantage_eps,
        config.advantage_normalizer,
        nan_rewards=config.nan_rewards,
    )
    return (trl_run.inputs["advantages"] - ours.double()).abs().max().item()


@pytest.mark.parametrize("name", list(PARITY_CASES))
def test_first_step_loss_and_gradients_match_grpo_lab(tokenizer, tmp_path, name):
    config = TrainConfig.for_profile("cpu", **{**HARNESS, **PARITY_CASES[name]})
    trl_run = translated_run(tokenizer, tmp_path, config)
    plain = type(trl_run.trainer) is GRPOTrainer
    assert plain == (not name.startswith("GrpoLabTrainer"))
    advantage_delta = advantage_difference(trl_run, config)
    # The loss on TRL's advantages: they agree with grpo_lab's to float32
    # rounding (TRL's nanstd), and through GrpoLabTrainer they are grpo_lab's.
    deltas = max_deltas(
        trl_run, run_grpo_lab(tokenizer, trl_run, config.update_settings())
    )
    PARITY_REPORT[name] = {"advantages": advantage_delta, **deltas}
    print(f"\n{name}: " + ", ".join(f"{k} {v:.1e}" for k, v in deltas.items()))
    # TRL's nanstd and torch.std round differently in float32.
    assert advantage_delta <= 1e-6, advantage_delta
    # Relative to the gradients' size (raw rewards of baseline none reach 2).
    scale = max(g.abs().max().item() for g in trl_run.parameter_gradients)
    for key, value in deltas.items():
        assert value <= TOLERANCE * max(1.0, scale), (name, key, value)
    assert trl_run.log_prob_gradients.abs().max() > 0  # something was compared


@pytest.mark.parametrize("normalization", ["sequence", "token"])
def test_on_policy_reinforce_matches_trl_with_a_ratio_of_one(
    tokenizer, tmp_path, monkeypatch, normalization
):
    # importance_reweighting_method none (the default) is on-policy: TRL's old
    # log-probs are then the policy's own, detached, so its ratio is 1 with the
    # gradient of log pi. The harness's perturbation is set to 0 for that.
    overrides = {
        "epochs_per_rollout_batch": 1,
        "importance_reweighting_method": "none",
        "cliprange": None,
        "loss_normalization": normalization,
    }
    config = TrainConfig.for_profile("cpu", **{**HARNESS, **overrides})
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: randn(*a, **k) * 0)
    trl_run = translated_run(tokenizer, tmp_path, config)
    monkeypatch.undo()
    assert trl_run.trainer.args.num_iterations == 1
    deltas = max_deltas(
        trl_run, run_grpo_lab(tokenizer, trl_run, config.update_settings())
    )
    # The loss values are different surrogates of one gradient: TRL's is
    # -A * ratio (ratio 1), grpo_lab's REINFORCE loss -A * log pi.
    gradients = {k: v for k, v in deltas.items() if "loss" not in k or "/" in k}
    name = f"none (on-policy REINFORCE), {normalization}; gradients only"
    advantages = advantage_difference(trl_run, config)
    PARITY_REPORT[name] = {"advantages": advantages, "loss": math.nan, **gradients}
    assert max(gradients.values()) <= TOLERANCE, deltas
    assert deltas["loss"] > 1e-6  # the surrogates' values do differ
    assert trl_run.log_prob_gradients.abs().max() > 0


def test_the_subclass_changes_what_trl_would_compute(tokenizer, tmp_path):
    # The same harness without GrpoLabTrainer gives other advantages (and loss):
    # each subclass case is a real difference, not a relabelling.
    for name, overrides in PARITY_CASES.items():
        if not name.startswith("GrpoLabTrainer"):
            continue
        config = TrainConfig.for_profile("cpu", **{**HARNESS, **overrides})
        ours = translated_run(tokenizer, tmp_path, config)
        plain = make_trainer(
            tokenizer, tmp_path, REWARDS, loss_type=ours.trainer.args.loss_type
        )
        theirs = run_trl(plain)
        difference = max(
            (ours.inputs["advantages"] - theirs.inputs["advantages"]).abs().max(),
            (sum(ours.losses) - sum(theirs.losses)).abs(),
        )
        assert difference > 1e-6, name


def test_a_nan_reward_with_propagate_is_refused(tokenizer, tmp_path):
    config = TrainConfig.for_profile(
        "cpu", **{**HARNESS, "advantage_eps": 1e-6, "nan_rewards": "propagate"}
    )
    rewards = [None, *REWARDS[1:]]
    with pytest.raises(RuntimeError, match="nan_rewards is 'propagate'"):
        translated_run(tokenizer, tmp_path, config, rewards=rewards)


@pytest.fixture(scope="module", autouse=True)
def print_the_parity_table():
    """After the module: every parity case's largest |difference| (with -s)."""
    yield
    if PARITY_REPORT:
        print(
            "\n| configuration | advantages | loss | d loss / d log-prob | "
            "parameter gradients |"
        )
        print("|---|---|---|---|---|")
        for name, deltas in PARITY_REPORT.items():
            print(
                f"| {name} | {deltas['advantages']:.1e} | {deltas['loss']:.1e} "
                f"| {deltas['d_loss/d_log_prob']:.1e} "
                f"| {deltas['parameter_gradients']:.1e} |"
            )


# --- grpo-lab export trl -----------------------------------------------------------

# The gpu profile at the toy task's size, so that a CPU dry run is quick.
SMALL_GPU_RUN = [
    "--profile", "gpu", "--task", "reverse", "--task-options", '{"n_digits": 3}',
    "--rollout-batch-size", "8", "--train-batch-size", "4", "--group-size", "4",
    "--gradient-accumulation-steps", "2", "--max-new-tokens", "6",
    "--eval-size", "8",
]  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("export") / "trl_run"
    assert cli.main(["export", "trl", *SMALL_GPU_RUN, "--out", str(out_dir)]) == 0
    return out_dir


ONE_GPU_CONFIGS = (
    "single_gpu",
    "deepspeed_zero1",
    "deepspeed_zero2",
    "deepspeed_zero3",
    "fsdp",
)


def test_the_exported_folder_holds_loadable_configs(exported):
    names = {p.relative_to(exported).as_posix() for p in exported.rglob("*")}
    expected = {
        "train.py",
        "launch.sh",
        "README.md",
        "grpo_config.json",
        "train_config.json",
        *(f"accelerate/{name}.yaml" for name in ONE_GPU_CONFIGS),
    }
    assert expected <= names and "accelerate/multi_gpu.yaml" not in names
    arguments = json.loads((exported / "grpo_config.json").read_text())
    config = TrainConfig.from_dict(
        json.loads((exported / "train_config.json").read_text())
    )
    assert arguments == grpo_trl.to_trl_config(config)
    assert config.profile == "gpu" and config.rollout_batch_size == 8
    on_cpu = {"use_vllm": False, "bf16": False, "use_cpu": True}  # no GPU here
    loaded = GRPOConfig(output_dir=str(exported / "output"), **{**arguments, **on_cpu})
    assert loaded.num_generations == 4 and loaded.max_completion_length == 6
    assert loaded.steps_per_generation == 4  # 8 rollouts / microbatches of 2
    kinds = {}
    for name in ONE_GPU_CONFIGS:
        values = yaml.safe_load((exported / "accelerate" / f"{name}.yaml").read_text())
        kinds[name] = values["distributed_type"]
        assert values["mixed_precision"] == "bf16"  # the gpu profile autocasts
        assert (values["num_processes"], values["num_machines"]) == (1, 1)
    assert kinds == {
        "single_gpu": "NO",
        "deepspeed_zero1": "DEEPSPEED",
        "deepspeed_zero2": "DEEPSPEED",
        "deepspeed_zero3": "DEEPSPEED",
        "fsdp": "FSDP",
    }
    for stage in (1, 2, 3):
        values = yaml.safe_load(
            (exported / f"accelerate/deepspeed_zero{stage}.yaml").read_text()
        )
        assert values["deepspeed_config"]["zero_stage"] == stage
    readme = (exported / "README.md").read_text()
    for name in ONE_GPU_CONFIGS:
        command = f"accelerate launch --config_file accelerate/{name}.yaml train.py"
        assert command in readme


@pytest.mark.slow
def test_the_exported_train_script_runs_one_step_on_the_cpu(
    exported, tiny_model_dir, tmp_path
):
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = str(Path(grpo_trl.__file__).resolve().parents[2])
    environment["PYTHONPATH"] = os.pathsep.join(
        [root, *filter(None, [environment.get("PYTHONPATH")])]
    )
    output = tmp_path / "output"
    command = [
        sys.executable, str(exported / "train.py"), "--model", str(tiny_model_dir),
        "--max-steps", "1", "--use-cpu", "--output-dir", str(output),
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, env=environment, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = json.loads((output / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["global_step"] == 1
    assert (output / "final_model" / "config.json").exists()


def test_export_verl_needs_no_verl_installed(tmp_path, capsys):
    """This environment has no verl: the launch folder is written all the same."""
    from grpo_lab.integrations.verl import algorithms as grpo_verl

    assert grpo_verl.core_algos is None  # verl's registries are not importable
    out = tmp_path / "verl_run"
    flags = ["--profile", "gpu", "--task", "reverse", "--eval-size", "64"]
    flags += ["--model", "Qwen/Qwen2.5-Math-1.5B", "--out", str(out)]
    assert cli.main(["export", "verl", *flags]) == 0
    overrides = (out / "overrides.txt").read_text().splitlines()
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=grpo_lab_grpo" in overrides
    assert "algorithm.adv_estimator=grpo_lab_mean_std" in overrides
    assert "python -m verl.trainer.main_ppo" in (out / "run.sh").read_text()


def test_export_verl_refuses_a_setting_by_name(tmp_path, capsys):
    flags = ["--profile", "gpu", "--task", "reverse", "--eval-size", "64"]
    flags += ["--model", "m", "--dynamic-sampling", "--out", str(tmp_path / "v")]
    code = cli.main(["export", "verl", *flags])
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1
    assert error.startswith("grpo-lab export: dynamic_sampling must be False")
    assert not (tmp_path / "v").exists() or not any((tmp_path / "v").iterdir())


def test_export_of_the_tiny_model_saves_it_beside_train_py(tmp_path):
    config = TrainConfig.for_profile("smoke", sft_max_steps=0)
    written = grpo_trl_launch.write_launch_folder(config, tmp_path)
    assert tmp_path / "tiny_model" in written
    assert load_tokenizer(str(tmp_path / "tiny_model")).encode("12>")


# --- one GPU to many nodes -------------------------------------------------------


def export_trl(tmp_path, *flags: str) -> Path:
    out = tmp_path / "trl_run"
    assert cli.main(["export", "trl", *SMALL_GPU_RUN, *flags, "--out", str(out)]) == 0
    return out


def accelerate_files(folder: Path) -> dict[str, dict]:
    return {
        path.stem: yaml.safe_load(path.read_text())
        for path in sorted((folder / "accelerate").glob("*.yaml"))
    }


def with_world_size(monkeypatch, processes: int) -> None:
    """GRPOConfig validates against this process count (accelerate's world size)."""
    monkeypatch.setattr(
        GRPOConfig, "world_size", property(lambda self: processes), raising=False
    )


def test_export_for_eight_gpus_writes_every_config_with_eight_processes(
    tmp_path, monkeypatch
):
    flags = ["--rollout-batch-size", "16", "--train-batch-size", "8"]
    out = export_trl(tmp_path, "--gpus", "8", *flags)
    files = accelerate_files(out)
    assert set(files) == {
        "multi_gpu",
        "deepspeed_zero1",
        "deepspeed_zero2",
        "deepspeed_zero3",
        "fsdp",
    }
    for name, values in files.items():
        assert values["num_processes"] == 8 and values["num_machines"] == 1, name
    arguments = json.loads((out / "grpo_config.json").read_text())
    config = TrainConfig.from_dict(json.loads((out / "train_config.json").read_text()))
    # 8 rows a step over 8 processes: 1 row each, no accumulation.
    assert arguments["per_device_train_batch_size"] == 1
    assert arguments["gradient_accumulation_steps"] == 1
    with_world_size(monkeypatch, 8)
    on_cpu = {"use_vllm": False, "bf16": False, "use_cpu": True}
    loaded = GRPOConfig(output_dir=str(tmp_path / "o"), **{**arguments, **on_cpu})
    global_batch = loaded.per_device_train_batch_size * 8 * 1
    assert global_batch == config.train_batch_size
    assert loaded.steps_per_generation == 2  # two optimizer steps per rollout batch
    assert config.rollout_batch_size // config.train_batch_size == 2


def test_the_batch_rule_is_trls_own(monkeypatch, tmp_path):
    """trl_batch_problem agrees with GRPOConfig's own validation on a grid."""
    outcomes = []
    grid = itertools.product([1, 2, 3, 4, 8], [1, 2, 3], [8, 12, 24], [False, True])
    for processes, per_device, generation_batch, evaluates in grid:
        arguments = {
            "per_device_train_batch_size": per_device,
            "generation_batch_size": generation_batch,
            "num_generations": 4,
            "eval_strategy": "steps" if evaluates else "no",
            "eval_steps": 1,
            "per_device_eval_batch_size": 2,
        }
        with_world_size(monkeypatch, processes)
        try:
            GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **arguments)
            trl_refuses = False
        except ValueError:
            trl_refuses = True
        ours = grpo_trl.trl_batch_problem(arguments, processes)
        assert (ours is not None) == trl_refuses, (arguments, processes, ours)
        outcomes.append(trl_refuses)
    assert any(outcomes) and not all(outcomes)  # both kinds of case were seen


def test_a_batch_that_does_not_split_names_the_counts_that_work(tmp_path, capsys):
    out = tmp_path / "v"
    code = cli.main(["export", "trl", *SMALL_GPU_RUN, "--gpus", "3", "--out", str(out)])
    error = capsys.readouterr().err
    assert code == 2
    assert "train_batch_size 4" in error and "over 3 processes" in error
    assert "it splits over 1, 2, 4 processes" in error
    assert not out.exists() or not any(out.iterdir())


def test_two_nodes_write_machine_ranks_and_a_rendezvous(tmp_path):
    out = export_trl(tmp_path, "--gpus", "2", "--nodes", "2")
    for name, values in accelerate_files(out).items():
        assert (values["num_processes"], values["num_machines"]) == (4, 2), name
        assert values["main_process_port"] == 29500
    script = (out / "launch.sh").read_text()
    assert "--machine_rank" in script and "--main_process_ip" in script
    assert "--main_process_port" in script
    readme = (out / "README.md").read_text()
    assert "MACHINE_RANK=1 MAIN_PROCESS_IP=ADDRESS_OF_MACHINE_0" in readme
    arguments = json.loads((out / "grpo_config.json").read_text())
    assert arguments["per_device_train_batch_size"] == 1  # 4 rows over 4 processes
    assert arguments["gradient_accumulation_steps"] == 1


def test_vllm_server_mode_writes_a_server_command_and_the_gpu_split(tmp_path):
    # 5 GPUs on one machine: GPU 4 serves, GPUs 0-3 train (4 processes).
    out = export_trl(tmp_path, "--gpus", "5", "--vllm-mode", "server")
    arguments = json.loads((out / "grpo_config.json").read_text())
    assert arguments["vllm_mode"] == "server" and arguments["use_vllm"]
    assert "vllm_gpu_memory_utilization" not in arguments
    serve = (out / "vllm_serve.sh").read_text()
    assert "trl vllm-serve --model" in serve
    assert 'CUDA_VISIBLE_DEVICES="${VLLM_GPUS:-4}"' in serve
    launch = (out / "launch.sh").read_text()
    assert 'CUDA_VISIBLE_DEVICES="${TRAIN_GPUS:-0,1,2,3}"' in launch
    assert {v["num_processes"] for v in accelerate_files(out).values()} == {4}
    # Two machines: the server is a third machine with all its GPUs.
    two = export_trl(tmp_path / "two", "--gpus", "2", "--nodes", "2", "--vllm-mode",
                     "server")  # fmt: skip
    assert "--data-parallel-size 2" in (two / "vllm_serve.sh").read_text()
    assert {v["num_processes"] for v in accelerate_files(two).values()} == {4}


def test_a_cpu_profile_export_for_gpus_leaves_use_cpu_out(tmp_path, monkeypatch):
    """The folder is for its GPUs: accelerate places the processes, not use_cpu."""
    flags = ["--profile", "cpu", "--sft-max-steps", "0", "--gpus", "8", "--nodes", "2"]
    out = tmp_path / "trl_run"
    assert cli.main(["export", "trl", *flags, "--out", str(out)]) == 0
    arguments = json.loads((out / "grpo_config.json").read_text())
    config = TrainConfig.from_dict(json.loads((out / "train_config.json").read_text()))
    assert config.device == "cpu" and grpo_trl.to_trl_config(config)["use_cpu"]
    assert "use_cpu" not in arguments
    with_world_size(monkeypatch, 16)
    loaded = GRPOConfig(output_dir=str(tmp_path / "o"), **arguments)
    assert loaded.use_cpu is False
    readme = (out / "README.md").read_text()
    assert "`use_cpu` is not exported" in readme and "train.py --use-cpu" in readme
    gpu = export_trl(tmp_path / "gpu", "--gpus", "2")  # a GPU config keeps its value
    assert json.loads((gpu / "grpo_config.json").read_text())["use_cpu"] is False


def test_the_server_readme_names_trls_ports_and_who_reaches_them(tmp_path):
    from trl.generation.vllm_client import VLLMClient
    from trl.scripts.vllm_serve import ScriptArguments

    client = inspect.signature(VLLMClient.__init__).parameters
    assert client["server_port"].default == grpo_trl_launch.VLLM_SERVER_PORT
    assert client["group_port"].default == grpo_trl_launch.VLLM_GROUP_PORT
    serve = {f.name: f.default for f in dataclasses.fields(ScriptArguments)}
    assert serve["port"] == grpo_trl_launch.VLLM_SERVER_PORT
    trl_defaults = grpo_trl_launch.field_defaults(GRPOConfig)
    assert trl_defaults["vllm_server_port"] == grpo_trl_launch.VLLM_SERVER_PORT
    assert trl_defaults["vllm_group_port"] == grpo_trl_launch.VLLM_GROUP_PORT
    two = export_trl(tmp_path, "--gpus", "2", "--nodes", "2", "--vllm-mode", "server")
    arguments = json.loads((two / "grpo_config.json").read_text())
    assert (arguments["vllm_server_port"], arguments["vllm_group_port"]) == (
        8000,
        51216,
    )
    readme = " ".join((two / "README.md").read_text().split())
    assert "reach VLLM_SERVER_HOST on port 8000" in readme
    assert "must reach machine 0 on port 51216" in readme
    assert "reach machine 0 on port 29500" in readme


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--vllm-mode", "server", "--backend", "hf", "--task", "reverse"],
         "needs backend 'vllm'"),
        (["--vllm-mode", "server"], "needs --gpus 2 or more"),
        (["--gpus", "0"], "--gpus must be a positive int"),
        (["--nodes", "0"], "--nodes must be a positive int"),
    ],
)  # fmt: skip
def test_a_launch_that_cannot_work_is_refused(tmp_path, capsys, flags, message):
    out = tmp_path / "v"
    code = cli.main(["export", "trl", *SMALL_GPU_RUN, *flags, "--out", str(out)])
    assert code == 2 and message in capsys.readouterr().err


def test_the_readme_says_what_the_export_changed_from_trls_defaults(exported):
    readme = (exported / "README.md").read_text()
    assert "vllm_importance_sampling_correction=False" in readme
    assert "| `vllm_importance_sampling_correction` | `True` | `False` |" in readme
    assert "| `use_bias_correction_kl` | `True` | `False` |" in readme
    assert "| `loss_type` | `'dapo'` | `'grpo'` |" in readme
    assert 'pip install "PATH/TO/grpo-lab[bench,vllm]"' in readme
    assert "pip install verl" not in readme and "grpo-lab==" not in readme
    changes = grpo_trl_launch.engine_default_changes({"loss_type": "dapo"})
    assert changes == []  # TRL's own default is not a change


def absolute_paths_in(folder: Path, *roots: Path) -> list[str]:
    """Files under ``folder`` whose bytes hold one of ``roots`` (this machine's)."""
    places = (*roots, Path(tempfile.gettempdir()), Path.home())
    needles = {str(place).encode() for place in places}
    found = []
    for path in folder.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path}: {n!r}" for n in needles if n in data]
    return found


def test_no_exported_file_holds_an_absolute_path(tmp_path, tiny_model_dir):
    # The tiny model (its weights are written), a task read from local files,
    # a run folder and several machines: every file is scanned, bytes and all.
    data = Path(__file__).parent / "data"
    options = json.dumps(
        {"train_path": str(data / "gsm8k_train.jsonl"),
         "eval_path": str(data / "gsm8k_test.jsonl")}
    )  # fmt: skip
    repo = Path(__file__).resolve().parents[1]
    common = ["--task", "gsm8k", "--task-options", options, "--eval-size", "4",
              "--run-dir", str(tmp_path / "run"), "--gpus", "2", "--nodes", "2"]  # fmt: skip
    trl_out, verl_out = tmp_path / "trl", tmp_path / "verl"
    trl_flags = ["--profile", "smoke", "--sft-max-steps", "0", "--backend", "vllm",
                 "--device", "cuda"]  # fmt: skip
    assert cli.main(["export", "trl", *trl_flags, *common, "--out", str(trl_out)]) == 0
    verl_flags = ["--profile", "gpu", "--model", "Qwen/Qwen2.5-0.5B-Instruct"]
    assert (
        cli.main(["export", "verl", *verl_flags, *common, "--out", str(verl_out)]) == 0
    )
    for folder in (trl_out, verl_out):
        assert (folder / "task_files").is_dir()
        assert absolute_paths_in(folder, tmp_path, repo, Path(sys.prefix)) == []
    config = json.loads((trl_out / "train_config.json").read_text())
    assert config["run_dir"] is None
    assert (
        config["task_options"]["train_path"]
        == "task_files/train_path_gsm8k_train.jsonl"
    )


def test_export_verl_of_the_gpu_profile_works_offline_from_local_files(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setitem(sys.modules, "datasets", None)  # any hub read would fail
    data = Path(__file__).parent / "data"
    options = json.dumps(
        {"train_path": str(data / "gsm8k_train.jsonl"),
         "eval_path": str(data / "gsm8k_test.jsonl")}
    )  # fmt: skip
    out = tmp_path / "verl"
    flags = ["--profile", "gpu", "--task-options", options, "--eval-size", "4"]
    assert cli.main(["export", "verl", *flags, "--out", str(out)]) == 0
    rows = [
        json.loads(line) for line in (out / "data/train.jsonl").read_text().splitlines()
    ]
    questions = {json.loads(line)["question"] for line in
                 (data / "gsm8k_train.jsonl").read_text().splitlines()}  # fmt: skip
    assert len(rows) == 200 * 32  # steps x prompts per step, from 6 local questions
    assert all(any(q in r["prompt"][0]["content"] for q in questions) for r in rows)
    namespace: dict = {"__file__": str(out / "data" / "reward.py")}
    exec((out / "data" / "reward.py").read_text(), namespace)  # builds the task there
    truth = rows[0]["reward_model"]["ground_truth"]
    answer = f" x </think> <answer> {truth} </answer>"
    assert namespace["compute_score"]("grpo_lab/gsm8k", answer, truth) == 1.0


def test_export_verl_for_one_gpu_fits_its_rollout_on_it():
    from grpo_lab.integrations.verl import launch as verl_launch

    config = TrainConfig.for_profile("gpu", task="reverse", eval_size=8)
    overrides = verl_launch.launch_overrides(config)
    assert overrides["actor_rollout_ref.rollout.tensor_model_parallel_size"] == 1
    assert overrides["trainer.n_gpus_per_node"] == 1
    assert overrides["trainer.nnodes"] == 1
    many = verl_launch.launch_overrides(config, cluster=Cluster(8, 2))
    assert (many["trainer.n_gpus_per_node"], many["trainer.nnodes"]) == (8, 2)
    # 128 responses a step over 16 GPUs: 8 each, in micro-batches of 2 (the
    # config's 64 accumulation steps of 2 rows).
    assert many["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == 2
    with pytest.raises(ValueError, match="splits over 1, 2, 4, 8, 16, 32, 64"):
        verl_launch.launch_overrides(config, cluster=Cluster(3, 1))


def test_report_to_in_any_case_reaches_both_engines_lower_case(tmp_path):
    from grpo_lab.integrations.verl import launch as verl_launch

    config = TrainConfig.for_profile("gpu", task="reverse", report_to="TensorBoard")
    assert grpo_trl.to_trl_config(config)["report_to"] == ["tensorboard"]
    logger = verl_launch.launch_overrides(config)["trainer.logger"]
    assert logger == ["console", "tensorboard"]
    both = TrainConfig.for_profile("gpu", task="reverse", report_to="none")
    assert grpo_trl.to_trl_config(both)["report_to"] == "none"
    assert verl_launch.launch_overrides(both)["trainer.logger"] == ["console"]
    out = tmp_path / "v"
    flags = ["--profile", "gpu", "--task", "reverse", "--eval-size", "8"]
    assert cli.main(["export", "verl", *flags, "--report-to", "TensorBoard",
                     "--out", str(out)]) == 0  # fmt: skip
    assert "trainer.logger=[console,tensorboard]" in (out / "overrides.txt").read_text()


# --- rows made true ------------------------------------------------------------------


def test_mask_truncated_completions_is_refused_where_trl_disagrees():
    # tests/test_trl_parity.py shows the disagreement: TRL masks 3 of 4
    # completions cut at "</answer>", grpo_lab none.
    with pytest.raises(UserError, match="mask_truncated_completions True") as error:
        grpo_trl.to_trl_config(gpu_config(mask_truncated_completions=True))
    assert "</answer>" in str(error.value)
    plain = gpu_config(task="reverse", mask_truncated_completions=True)
    assert grpo_trl.to_trl_config(plain)["mask_truncated_completions"] is True


def test_weight_decay_reaches_every_parameter_as_in_grpo_lab(tokenizer, tmp_path):
    config = TrainConfig.for_profile("cpu", **{**HARNESS, "weight_decay": 0.1})
    assert "weight_decay 0.1 on every parameter" in grpo_trl.grpo_lab_trainer_reasons(
        config
    )
    groups = {}
    for name, trainer_class in (
        ("trl", GRPOTrainer),
        ("grpo_lab", grpo_trl_trainer.GrpoLabTrainer),
    ):
        keywords = {} if trainer_class is GRPOTrainer else {"train_config": config}
        trainer = grpo_trl_parity.fixed_completions_trainer(
            {"num_generations": GROUP_SIZE, "max_completion_length": 6,
             "weight_decay": 0.1},
            fresh_model(tokenizer), tokenizer, ROW_PROMPTS,
            [encode(tokenizer, c) for c in COMPLETIONS], REWARDS, tmp_path,
            trainer_class=trainer_class, **keywords,
        )  # fmt: skip
        optimizer = trainer.create_optimizer()
        groups[name] = {
            decay: sum(len(g["params"]) for g in optimizer.param_groups
                       if g["weight_decay"] == decay)
            for decay in (0.0, 0.1)
        }  # fmt: skip
    total = len(list(fresh_model(tokenizer).parameters()))
    # HF's Trainer leaves biases and norm weights undecayed; grpo_lab decays all.
    assert groups["trl"][0.0] > 0 and groups["trl"][0.1] < total
    assert groups["grpo_lab"] == {0.0: 0, 0.1: total}
    print(f"\nundecayed tensors: HF's Trainer {groups['trl'][0.0]} of {total}, "
          "GrpoLabTrainer 0")  # fmt: skip


# --- export trl RUN_DIR ----------------------------------------------------------


@pytest.fixture(scope="module")
def warmed_up_run(tmp_path_factory) -> Path:
    """A smoke-profile run: a 2-step warm-up, then 2 GRPO steps (step 0 kept)."""
    run_dir = tmp_path_factory.mktemp("run") / "run"
    flags = ["--profile", "smoke", "--max-new-tokens", "6", "--checkpoint-every", "5"]
    assert cli.main(["train", *flags, "--run-dir", str(run_dir)]) == 0
    return run_dir


@pytest.mark.slow
def test_export_from_a_run_folder_starts_from_its_warm_up(
    warmed_up_run, tmp_path, tokenizer, monkeypatch
):
    import test_trl_parity

    out = tmp_path / "trl"
    assert cli.main(["export", "trl", str(warmed_up_run), "--out", str(out)]) == 0
    config = TrainConfig.from_dict(json.loads((out / "train_config.json").read_text()))
    assert (config.model, config.sft_max_steps, config.run_dir) == ("model", 0, None)
    assert absolute_paths_in(out, tmp_path, warmed_up_run) == []
    warm = (warmed_up_run / "checkpoints" / "step_000000").resolve()
    exported = grpo_trl_load_model(out / "model")
    started = grpo_trl_load_model(warm)
    fresh = build_tiny_qwen2(tokenizer, seed=0, hidden_size=16, num_layers=2,
                             intermediate_size=64)  # fmt: skip
    for ours, theirs in zip(exported.parameters(), started.parameters()):
        assert torch.equal(ours, theirs)  # the warmed-up weights, unchanged
    assert not all(
        torch.equal(a, b) for a, b in zip(exported.parameters(), fresh.parameters())
    )
    # Its first step on TRL against grpo_lab's, on the harness's completions
    # with the exported model (on-policy REINFORCE: the gradients agree).
    model_copy = lambda _tokenizer: grpo_trl_load_model(out / "model").double()  # noqa: E731
    monkeypatch.setattr(test_trl_parity, "fresh_model", model_copy)
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: randn(*a, **k) * 0)
    # share_prompt_prefix off, as in the harness (with it on, the parameter
    # gradients differ by 3e-8 of their size in float64).
    batch = {"rollout_batch_size": 12, "train_batch_size": 12}
    batch["share_prompt_prefix"] = False
    harness_config = dataclasses.replace(config, **batch)
    trl_run = grpo_trl_parity.trl_first_step_loss(
        harness_config, model_copy(None), tokenizer, ROW_PROMPTS,
        [encode(tokenizer, c) for c in COMPLETIONS], REWARDS, tmp_path, **off_policy(),
    )  # fmt: skip
    monkeypatch.undo()
    monkeypatch.setattr(test_trl_parity, "fresh_model", model_copy)
    deltas = max_deltas(
        trl_run, run_grpo_lab(tokenizer, trl_run, harness_config.update_settings())
    )
    gradients = {k: v for k, v in deltas.items() if "loss" not in k or "/" in k}
    scale = max(g.abs().max().item() for g in trl_run.parameter_gradients)
    print(f"\nexported run's first step: {gradients}, gradient scale {scale:.2e}")
    assert max(gradients.values()) <= TOLERANCE * max(1.0, scale), deltas
    assert trl_run.log_prob_gradients.abs().max() > 0


def grpo_trl_load_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder))


def test_export_from_a_folder_that_is_no_run_is_refused(tmp_path, capsys):
    code = cli.main(["export", "trl", str(tmp_path), "--out", str(tmp_path / "o")])
    assert code == 2 and "RUN_DIR must be a folder grpo-lab train wrote" in (
        capsys.readouterr().err
    )


def test_to_trl_config_names_a_dict_given_for_a_config():
    with pytest.raises(ValueError, match=r"^config must be a TrainConfig .*got dict$"):
        grpo_trl.to_trl_config({"lr": 1e-3})


ASYNC_REASONS = ("async_admission 'pace'", "weight_sync_every")


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({}, []),
        ({"async_admission": "pace"}, ["async_admission 'pace'"]),
        ({"weight_sync_every": 3}, ["weight_sync_every"]),
        ({"async_admission": "pace", "weight_sync_every": 2}, list(ASYNC_REASONS)),
    ],
)
def test_an_asynchronous_run_is_refused_naming_what_trl_async_lacks(overrides, named):
    config = TrainConfig.for_profile("cpu", max_staleness=2, **overrides)
    with pytest.raises(UserError, match="max_staleness 2") as error:
        grpo_trl.to_trl_config(config)
    message = str(error.value)
    assert "trl.experimental.async_grpo" in message
    assert "the loss: TRL's async loss clips pi / pi_sampler" in message  # always
    for reason in ASYNC_REASONS:  # a setting TRL could hold is not blamed
        assert (reason in message) == (reason in named), reason
