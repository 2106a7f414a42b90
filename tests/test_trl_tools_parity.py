"""The exported TRL rollout_func against grpo_lab's multi-turn rollout, in float64.

A fixed batch of calculator episodes (model turns replayed through the tool:
calls answered, a wrong answer, an answer without a call, a failed call, a
turn cut before EOS) goes to TRL 1.16's ``GRPOTrainer`` through the rollout_func
that ``grpo-lab export trl`` writes (``grpo_lab.integrations.trl.tools``), with
the exported reward function. TRL's own ``_generate_and_score_completions`` and
``_compute_loss`` compute its masks, rewards, advantages and loss; grpo_lab's
side is its loop's batch (``rollout_token_batch``), the task's reward, group
normalization and ``policy_gradient_update``. TRL's scorer is the naive float64
one, as in tests/test_trl_parity.py.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from grpo_lab.advantages import compute_group_normalized_rewards
from grpo_lab.integrations.trl.parity import _naive_scorer
from grpo_lab.integrations.trl.tools import (
    make_rollout_func,
    rollout_func_output,
    tool_trainer_keywords,
    trainer_episode_sampler,
)
from grpo_lab.integrations.trl.trainer import trl_reward_function
from grpo_lab.logprobs import get_response_log_probs
from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.rollouts.multiturn import replayed_rollouts
from grpo_lab.tasks import get_task
from grpo_lab.teaching.gradient_recorder import GradientRecorder
from grpo_lab.train_step import UpdateSettings, policy_gradient_update
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.loop import rollout_token_batch

PROMPTS = ["12*34=", "56*78=", "23*45="]  # one length: no left padding in TRL
GROUP_SIZE = 4
ROW_PROMPTS = [p for p in PROMPTS for _ in range(GROUP_SIZE)]
# Model turns of each episode ("$" is EOS); the tool answers every call but
# the last turn's. Rewards vary within each group.
TURNS = [
    ["<calc>12*34</calc>", "408$"],  # right, with the tool
    ["<calc>12*34</calc>", "418$"],  # the reply copied wrong
    ["408$"],  # right, without a call
    ["<calc>12*3</calc>", "36$"],  # a wrong call, its reply copied
    ["<calc>56*78</calc>", "4368$"],
    ["<calc>56*78</calc>", "43"],  # cut before EOS
    ["<calc>56**78</calc>", "1$"],  # the tool answers "error"
    ["4368$"],
    ["<calc>23*45</calc>", "1035$"],
    ["<calc>23*45</calc>", "1035$"],
    ["1000$"],
    ["<calc>23*45</calc>", "<calc>1035</calc>", "1035$"],  # two calls
]
SIZES = {"hidden_size": 16, "num_layers": 1, "intermediate_size": 32}
TOLERANCE = 1e-12
LOSS_TYPES = {
    # TRL loss_type -> grpo_lab's (docs/translation_table.md)
    "grpo": {"importance_reweighting_method": "grpo", "loss_normalization": "sequence"},
    "dapo": {"importance_reweighting_method": "grpo", "loss_normalization": "token"},
}


def encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text.replace("$", ""), add_special_tokens=False)
    return ids + [tokenizer.eos_token_id] * text.count("$")


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def task():
    return get_task("calculator", max_turns=3)


@pytest.fixture(scope="module")
def episodes(tokenizer, task):
    """The fixed batch, as grpo_lab's multi-turn rollout writes it."""
    turns = [[encode(tokenizer, t) for t in row] for row in TURNS]
    return replayed_rollouts(tokenizer, task.tool, ROW_PROMPTS, turns, log_prob=-0.7)


def fresh_model(tokenizer):
    return build_tiny_qwen2(tokenizer, seed=0, **SIZES).double()


def truths() -> dict[str, str]:
    """Each prompt's product, as the task's examples hold it."""
    answers = {}
    for prompt in PROMPTS:
        a, b = prompt.rstrip("=").split("*")
        answers[prompt] = str(int(a) * int(b))
    return answers


def trl_trainer(tokenizer, task, episodes, tmp_path, loss_type: str):
    """GRPOTrainer with the exported rollout_func (its sampler replaced by the
    fixed batch) and the exported reward function."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    exported_reward = trl_reward_function(task)
    answers = truths()

    def reward(prompts, completions, **columns):
        texts = [p["prompt"] if isinstance(p, dict) else p for p in prompts]
        return exported_reward(
            prompts, completions, ground_truth=[answers[t] for t in texts]
        )

    args = GRPOConfig(
        output_dir=str(tmp_path),
        num_generations=GROUP_SIZE,
        max_completion_length=max(len(ids) for ids in episodes.response_token_ids),
        per_device_train_batch_size=len(ROW_PROMPTS),
        gradient_accumulation_steps=1,
        loss_type=loss_type,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        bf16=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=fresh_model(tokenizer),
            reward_funcs=reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            processing_class=tokenizer,
            rollout_func=make_rollout_func(lambda texts, trainer: episodes),
        )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def trl_step(trainer):
    """TRL's batch for ROW_PROMPTS and its loss, backpropagated."""
    captured: list[torch.Tensor] = []
    trainer._get_per_token_logps_and_entropies = _naive_scorer(trainer, captured)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = trainer._generate_and_score_completions(
            [{"prompt": p} for p in ROW_PROMPTS]
        )
    inputs["advantages"] = inputs["advantages"].double()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    gradients = [
        torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for p in trainer.model.parameters()
    ]
    return inputs, loss.detach(), gradients


def trl_loss_mask_in_our_layout(inputs, batch) -> torch.Tensor:
    """TRL's completion_mask * tool_mask, (B, C), moved onto grpo_lab's labels:
    completion token j of a row is label P - 1 + j (prompt length P)."""
    mask = (inputs["completion_mask"] * inputs["tool_mask"]).long()  # (B, C)
    start = len(ROW_PROMPTS[0]) - 1
    out = torch.zeros_like(batch["response_mask"])
    width = min(mask.shape[1], out.shape[1] - start)
    out[:, start : start + width] = mask[:, :width]
    return out


def grpo_lab_step(tokenizer, task, episodes, loss_type: str):
    """The loop's batch, the task's rewards, GRPO advantages, one update."""
    batch = rollout_token_batch(episodes, tokenizer)
    answers = truths()
    rewards = [
        task.reward_fn(response, answers[prompt])["reward"]
        for response, prompt in zip(episodes.responses, ROW_PROMPTS)
    ]
    advantages, _ = compute_group_normalized_rewards(
        torch.tensor(rewards), GROUP_SIZE, "mean", 1e-4, "std"
    )  # TRL's fixed epsilon
    model = fresh_model(tokenizer)
    with torch.no_grad():  # on-policy: the old policy is the current one, as TRL's
        old = get_response_log_probs(model, batch["input_ids"], batch["labels"])
    recorder = GradientRecorder(model.parameters())
    settings = UpdateSettings(cliprange=0.2, **LOSS_TYPES[loss_type])
    loss, _ = policy_gradient_update(
        model,
        recorder,
        1,
        None,
        batch,
        advantages.double(),
        old_log_probs=old["log_probs"],
        **dataclasses.asdict(settings),
    )
    return batch, rewards, advantages, loss, recorder.gradients


def test_the_fixed_batch_has_what_the_parity_needs(episodes, task):
    assert sum(episodes.tool_calls) == 10 and sum(episodes.tool_errors) == 1
    assert "<out>error</out>" in episodes.responses[6]
    assert episodes.end_reasons[5] == "budget"
    assert episodes.tool_calls[11] == 2


def test_the_rollout_func_output_is_what_trl_requires(episodes, tokenizer):
    output = rollout_func_output(episodes)
    assert set(output) == {"prompt_ids", "completion_ids", "logprobs", "env_mask"}
    for ids, mask, values in zip(
        output["completion_ids"], output["env_mask"], output["logprobs"]
    ):
        assert len(ids) == len(mask) == len(values)
        assert all(v == 0.0 for v, m in zip(values, mask) if not m)
        assert all(v == -0.7 for v, m in zip(values, mask) if m)
    # row 0: "<calc>12*34</calc>" (18) by the model, "<out>408</out>" (14) not
    assert output["env_mask"][0] == [1] * 18 + [0] * 14 + [1] * 4
    assert tokenizer.decode(output["completion_ids"][0], skip_special_tokens=True) == (
        "<calc>12*34</calc><out>408</out>408"
    )


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_trl_on_the_exported_rollout_func_matches_grpo_lab(
    tokenizer, task, episodes, tmp_path, loss_type
):
    trainer = trl_trainer(tokenizer, task, episodes, tmp_path, loss_type)
    inputs, trl_loss, trl_gradients = trl_step(trainer)
    batch, rewards, advantages, loss, gradients = grpo_lab_step(
        tokenizer, task, episodes, loss_type
    )
    # masks: TRL trains exactly the tokens grpo_lab trains, tool output in neither
    assert torch.equal(
        trl_loss_mask_in_our_layout(inputs, batch), batch["response_mask"]
    )
    trained = inputs["completion_mask"] * inputs["tool_mask"]  # (B, C)
    assert trained.sum() < inputs["completion_mask"].sum()  # tool tokens left out
    # rewards and advantages
    assert rewards == [1, 0, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1]
    assert (inputs["advantages"] - advantages.double()).abs().max() <= 1e-6
    # loss and every parameter's gradient
    assert abs(trl_loss.item() - loss.item()) <= TOLERANCE
    delta = max((a - b).abs().max().item() for a, b in zip(gradients, trl_gradients))
    assert delta <= TOLERANCE
    assert max(g.abs().max().item() for g in gradients) > 0  # something to compare


def test_training_tool_output_would_not_match(tokenizer, task, episodes, tmp_path):
    """The check can fail: TRL without env_mask trains the tool's tokens."""
    trainer = trl_trainer(tokenizer, task, episodes, tmp_path, "dapo")
    output = rollout_func_output(episodes)
    output.pop("env_mask")
    trainer.rollout_func = lambda prompts, trainer: dict(output)
    inputs, trl_loss, _ = trl_step(trainer)
    _, _, _, loss, _ = grpo_lab_step(tokenizer, task, episodes, "dapo")
    assert "tool_mask" not in inputs
    assert abs(trl_loss.item() - loss.item()) > 1e-6


def test_the_launch_folder_passes_the_rollout_func_for_a_tool_task():
    calculator = TrainConfig.for_profile("cpu", task="calculator", sft_max_steps=0)
    assert set(tool_trainer_keywords(calculator)) == {"rollout_func"}
    assert tool_trainer_keywords(TrainConfig.for_profile("cpu")) == {}
    json.dumps(calculator.to_dict())  # the folder's train_config.json round-trips


def test_the_exported_sampler_runs_episodes_on_the_trainer_s_model(
    tokenizer, task, episodes, tmp_path
):
    """What train.py passes: episodes sampled on trainer.model with TRL's
    temperature and completion length, one per (repeated) prompt."""
    trainer = trl_trainer(tokenizer, task, episodes, tmp_path, "dapo")
    sample = trainer_episode_sampler(task, seed=3)
    trainer.rollout_func = make_rollout_func(sample)
    output = trainer.rollout_func([{"prompt": p} for p in ROW_PROMPTS], trainer)
    assert len(output["completion_ids"]) == len(ROW_PROMPTS)
    budget = trainer.args.max_completion_length
    for ids, mask in zip(output["completion_ids"], output["env_mask"]):
        assert 0 < len(ids) <= budget and len(mask) == len(ids)
    again = trainer.rollout_func([{"prompt": p} for p in ROW_PROMPTS], trainer)
    assert again["completion_ids"] == output["completion_ids"]  # seeded by step
