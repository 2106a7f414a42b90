"""grpo_lab.integrations.trl: the TrainConfig -> GRPOConfig table, TRL training
from it, and first-step parity with grpo_lab through the table.

The parity cases build a TrainConfig, translate it with ``to_trl_config`` and
hand TRL exactly those loss settings; TRL computes its loss and gradients on
fixed completions (tests/test_trl_parity.py's harness, in float64) and
grpo_lab computes its own from ``config.update_settings()``. Run with ``-s`` to
print each configuration's largest |difference| (loss and gradients).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from test_trl_parity import (
    GROUP_SIZE,
    MAX_COMPLETION_LENGTH,
    PROMPTS,
    REWARDS,
    make_trainer,
    max_deltas,
    run_grpo_lab,
    run_trl,
)
from trl import GRPOConfig, GRPOTrainer

from grpo_lab import cli
from grpo_lab.advantages import compute_group_normalized_rewards
from grpo_lab.errors import UserError
from grpo_lab.integrations import trl as grpo_trl
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


def test_every_field_is_translated_launched_or_not_a_training_setting():
    groups = (
        grpo_trl.TRANSLATIONS,
        grpo_trl.LAUNCH_SETTINGS,
        grpo_trl.NOT_TRAINING_SETTINGS,
    )
    for config_field in dataclasses.fields(TrainConfig):
        homes = [group for group in groups if config_field.name in group]
        assert len(homes) == 1, f"{config_field.name} is in {len(homes)} groups"
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set().union(*groups) == names  # no row names a field that is gone
    for group in (grpo_trl.LAUNCH_SETTINGS, grpo_trl.NOT_TRAINING_SETTINGS):
        assert all(reason for reason in group.values())


def test_every_trl_name_in_the_table_is_a_grpo_config_field():
    trl_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    named = {n for t in grpo_trl.TRANSLATIONS.values() for n in t.trl_names}
    assert named <= trl_fields, named - trl_fields
    table = grpo_trl.translation_table()
    assert table.count("\n") == len(grpo_trl.TRANSLATIONS) + 1
    assert "| `group_size` | `num_generations` |" in table


def test_the_readme_shows_the_table_as_the_code_has_it():
    readme = Path(__file__).resolve().parents[1] / "README.md"
    section = readme.read_text(encoding="utf-8").split("## When you outgrow one GPU")[1]
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
        ({"backend": "hf"}, "task 'gsm8k'"),  # no stop strings in TRL's generate
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
    ],
)  # fmt: skip
def test_a_setting_trl_lacks_is_refused_by_name(overrides, message):
    with pytest.raises(UserError, match=message) as error:
        grpo_trl.to_trl_config(gpu_config(**overrides))
    assert "cannot run on TRL's GRPOTrainer" in str(error.value)


def test_an_inert_setting_is_not_refused():
    # kl_estimator does nothing without a KL penalty.
    arguments = grpo_trl.to_trl_config(gpu_config(kl_estimator="k1"))
    assert arguments["beta"] == 0.0


def test_grpo_lab_trainer_is_used_only_for_what_trl_lacks():
    exact = gpu_config(advantage_eps=1e-4, nan_rewards="ignore")
    assert grpo_trl.grpo_lab_trainer_reasons(exact) == []
    assert grpo_trl.trainer_class_for(exact) is GRPOTrainer
    lacking = gpu_config(baseline="leave_one_out", lr_warmup_steps=3)
    reasons = grpo_trl.grpo_lab_trainer_reasons(lacking)
    assert "baseline 'leave_one_out'" in reasons and "lr_warmup_steps 3" in reasons
    trainer_class = grpo_trl.trainer_class_for(lacking)
    assert issubclass(trainer_class, GRPOTrainer)
    assert trainer_class is grpo_trl.GrpoLabTrainer


# --- data and reward ----------------------------------------------------------------


def test_task_dataset_and_reward_function_follow_the_task():
    task = get_task("reverse", n_digits=3)
    dataset = grpo_trl.task_dataset(task, "train", 5, seed=0)
    assert dataset.column_names == ["prompt", "ground_truth"] and len(dataset) == 5
    example = task.train(5, 0)[0]
    assert (dataset[0]["prompt"], dataset[0]["ground_truth"]) == (
        example.prompt,
        example.ground_truth,
    )
    chat = grpo_trl.task_dataset(task, "eval", 2, seed=0, chat_template=True)
    assert chat[0]["prompt"] == [{"role": "user", "content": task.eval(2, 0)[0].prompt}]
    reward = grpo_trl.trl_reward_function(task)
    truth = example.ground_truth
    completions = [truth, "nope", [{"role": "assistant", "content": truth}]]
    assert reward(["p"] * 3, completions, ground_truth=[truth] * 3) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="split must be"):
        grpo_trl.task_dataset(task, "test", 2, seed=0)


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
    trainer_class = grpo_trl.trainer_class_for(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trainer_class(
            model=str(tiny_model_dir),
            reward_funcs=grpo_trl.trl_reward_function(task),
            args=GRPOConfig(output_dir=str(tmp_path), **arguments),
            train_dataset=grpo_trl.task_dataset(task, "train", 16, config.seed),
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


# --- first-step parity through the translation ---------------------------------------

# The GRPOConfig arguments that decide the first step's loss and gradients.
LOSS_ARGUMENTS = (
    "loss_type",
    "importance_sampling_level",
    "epsilon",
    "epsilon_high",
    "delta",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "beta",
    "use_bias_correction_kl",
    "entropy_coef",
    "top_entropy_quantile",
    "temperature",
    "scale_rewards",
)
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


def translated_trainer(tokenizer, tmp_path, config: TrainConfig, rewards=REWARDS):
    """The harness's GRPOTrainer with ``config``'s translated loss settings; the
    class trainer_class_for(config) picks. Returns it and TRL's beta."""
    arguments = grpo_trl.to_trl_config(config)
    assert arguments["max_completion_length"] == MAX_COMPLETION_LENGTH
    fields = {k: arguments[k] for k in LOSS_ARGUMENTS if k in arguments}
    beta = fields.pop("beta")
    trainer = make_trainer(tokenizer, tmp_path, rewards, **fields)
    trainer_class = grpo_trl.trainer_class_for(config)
    if trainer_class is not GRPOTrainer:
        # The harness builds a GRPOTrainer; GrpoLabTrainer adds two attributes
        # in its __init__ and nothing else, so they are set here.
        trainer.__class__ = trainer_class
        trainer.train_config = config
        trainer._rewards_per_func = None
    return trainer, beta


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
    trainer, beta = translated_trainer(tokenizer, tmp_path, config)
    assert (type(trainer) is GRPOTrainer) == (not name.startswith("GrpoLabTrainer"))
    trl_run = run_trl(trainer, beta=beta)
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
    trainer, beta = translated_trainer(tokenizer, tmp_path, config)
    assert trainer.args.num_iterations == 1
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: randn(*a, **k) * 0)
    trl_run = run_trl(trainer, beta=beta)
    monkeypatch.undo()
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
        mine, beta = translated_trainer(tokenizer, tmp_path, config)
        plain = make_trainer(
            tokenizer,
            tmp_path,
            REWARDS,
            **{k: v for k, v in vars(mine.args).items() if k == "loss_type"},
        )
        ours, theirs = run_trl(mine, beta=beta), run_trl(plain)
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
    trainer, _ = translated_trainer(tokenizer, tmp_path, config, rewards=rewards)
    with pytest.raises(RuntimeError, match="nan_rewards is 'propagate'"):
        run_trl(trainer)


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


def test_the_exported_folder_holds_loadable_configs(exported):
    names = {p.relative_to(exported).as_posix() for p in exported.rglob("*")}
    expected = {
        "train.py",
        "README.md",
        "grpo_config.json",
        "train_config.json",
        "accelerate/single_gpu.yaml",
        "accelerate/multi_gpu.yaml",
        "accelerate/deepspeed_zero3.yaml",
    }
    assert expected <= names
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
    for name in ("single_gpu", "multi_gpu", "deepspeed_zero3"):
        values = yaml.safe_load((exported / "accelerate" / f"{name}.yaml").read_text())
        kinds[name] = values["distributed_type"]
        assert values["mixed_precision"] == "bf16"  # the gpu profile autocasts
    assert kinds == {
        "single_gpu": "NO",
        "multi_gpu": "MULTI_GPU",
        "deepspeed_zero3": "DEEPSPEED",
    }
    zero3 = yaml.safe_load((exported / "accelerate/deepspeed_zero3.yaml").read_text())
    assert zero3["deepspeed_config"]["zero_stage"] == 3
    readme = (exported / "README.md").read_text()
    for name in ("single_gpu", "multi_gpu", "deepspeed_zero3"):
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


def test_export_verl_without_its_module_is_a_one_line_error(
    tmp_path, monkeypatch, capsys
):
    original = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "grpo_lab.integrations.verl" else original(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    code = cli.main(["export", "verl", "--profile", "gpu", "--out", str(tmp_path)])
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1
    assert error.startswith("grpo-lab export: grpo_lab.integrations.verl is not")


def test_export_of_the_tiny_model_saves_it_beside_train_py(tmp_path):
    config = TrainConfig.for_profile("smoke", sft_max_steps=0)
    written = grpo_trl.write_launch_folder(config, tmp_path)
    assert tmp_path / "tiny_model" in written
    assert load_tokenizer(str(tmp_path / "tiny_model")).encode("12>")
