"""The exported verl tool config against grpo_lab's multi-turn rollout (verl 0.9.1).

A fixed batch of calculator episodes (grpo_lab's ``replayed_rollouts``: model
turns with the tool run between them) is run through what ``grpo-lab export
verl`` writes for a tool-using task: verl's own ``initialize_tools_from_config``
builds the tool from ``tool_config.yaml``, verl's ``ToolParser`` registry gives
the exported call parser, and each call goes through the tool's verl lifecycle
(create, execute, release). The replies, the agent loop's response mask
(1 on generated tokens, 0 on appended ones), verl's GRPO outcome advantages and
verl's vanilla policy loss on that mask are compared with grpo_lab's replies,
mask, advantages and loss. The overrides compose and validate in verl's Hydra
config.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    import verl
except ImportError:
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("verl is not installed (make .venv-verl)", allow_module_level=True)

from hydra import compose, initialize_config_dir
from pydantic import BaseModel
from verl.tools.tool_registry import initialize_tools_from_config
from verl.trainer.ppo import core_algos
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import FSDPActorConfig

from grpo_lab.advantages import compute_group_normalized_rewards
from grpo_lab.aggregation import aggregate_loss_across_microbatch
from grpo_lab.integrations.verl.tools import (
    PARSER_NAME,
    TOOL_CONFIG_FILE,
    calculator_calls,
    verl_response_mask,
)
from grpo_lab.losses import compute_policy_gradient_loss
from grpo_lab.models import build_char_tokenizer
from grpo_lab.rollouts.multiturn import replayed_rollouts
from grpo_lab.tasks import get_task
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.loop import rollout_token_batch


class FunctionCall(BaseModel):
    """verl's agent_loop.tool_parser.FunctionCall (0.9.1), whose module needs
    the agent loop's full install: the fields the loop reads."""

    name: str
    arguments: str


PROMPTS = ["12*34=", "56*78="]
GROUP_SIZE = 4
ROW_PROMPTS = [p for p in PROMPTS for _ in range(GROUP_SIZE)]
TURNS = [  # "$" is EOS
    ["<calc>12*34</calc>", "408$"],
    ["<calc>12*34</calc>", "418$"],
    ["408$"],
    ["<calc>12*3</calc>", "36$"],
    ["<calc>56*78</calc>", "4368$"],
    ["<calc>56**78</calc>", "1$"],  # the tool answers "error"
    ["4368$"],
    ["<calc>56*78</calc>", "43"],  # cut before EOS
]


def encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text.replace("$", ""), add_special_tokens=False)
    return ids + [tokenizer.eos_token_id] * text.count("$")


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def task():
    return get_task("calculator")


@pytest.fixture(scope="module")
def episodes(tokenizer, task):
    turns = [[encode(tokenizer, t) for t in row] for row in TURNS]
    return replayed_rollouts(tokenizer, task.tool, ROW_PROMPTS, turns)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from grpo_lab.integrations.verl.launch import write_launch_folder

    out = tmp_path_factory.mktemp("verl_calculator")
    config = TrainConfig.for_profile("gpu", task="calculator", eval_size=16, steps=2)
    write_launch_folder(config, out)
    return out


def run(coroutine):
    return asyncio.new_event_loop().run_until_complete(coroutine)


async def verl_replies(tool, tokenizer, episodes) -> list[list[str]]:
    """Each model turn's calls (the exported parser's rule), each call through
    the tool's verl lifecycle as the agent loop runs it: the replies."""
    replies = []
    for row in episodes.segments:
        model_turns = [s for s in row if s.role == "model"]
        texts = []
        for segment in model_turns[:-1]:  # the last turn's call is never run
            text = tokenizer.decode(list(segment.token_ids), skip_special_tokens=True)
            for call in calculator_calls(text):
                call = FunctionCall(**call)
                assert call.name == tool.name
                instance_id, _ = await tool.create(create_kwargs={})
                response, reward, metrics = await tool.execute(
                    instance_id, json.loads(call.arguments), agent_data=None
                )
                await tool.release(instance_id)
                assert reward == 0.0 and isinstance(metrics["error"], bool)
                texts.append(response.text)
        replies.append(texts)
    return replies


def test_the_exported_tool_answers_as_grpo_lab_s(folder, tokenizer, episodes):
    (tool,) = initialize_tools_from_config(str(folder / TOOL_CONFIG_FILE))
    assert type(tool).__name__ == "CalculatorVerlTool" and tool.name == "calculator"
    ours = [[s.text for s in row if s.role == "tool"] for row in episodes.segments]
    assert run(verl_replies(tool, tokenizer, episodes)) == ours
    assert ours[5] == ["error"] and ours[2] == []


def test_the_overrides_compose_into_verl_s_multi_turn_config(folder):
    from verl.utils.config import validate_config

    lines = (folder / "overrides.txt").read_text().splitlines()
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=lines)
    validate_config(cfg, use_reference_policy=False, use_critic=False)
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    assert multi_turn.enable and multi_turn.format == PARSER_NAME
    assert multi_turn.tool_config_path == TOOL_CONFIG_FILE
    assert (multi_turn.max_assistant_turns, multi_turn.max_user_turns) == (2, 1)
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "tool_agent"
    omega_conf_to_dataclass(multi_turn)  # verl's MultiTurnConfig accepts it


def verl_layout(episodes):
    """The agent loop's response_mask of each episode, right-padded: (B, R)."""
    masks = verl_response_mask(episodes)
    width = max(len(m) for m in masks)
    return torch.tensor([m + [0] * (width - len(m)) for m in masks])


def test_mask_advantages_and_loss_match_verl(tokenizer, task, episodes):
    ours = rollout_token_batch(episodes, tokenizer)["response_mask"]  # (B, T - 1)
    mask = verl_layout(episodes)  # (B, R)
    start = len(ROW_PROMPTS[0]) - 1  # response token j is label start + j
    assert torch.equal(ours[:, start : start + mask.shape[1]], mask)
    assert ours[:, :start].sum() == 0 and ours[:, start + mask.shape[1] :].sum() == 0
    # verl's GRPO outcome advantage: the score at the last response token
    answers = {"12*34=": "408", "56*78=": "4368"}
    scores = [
        task.reward_fn(r, answers[p])["reward"]
        for r, p in zip(episodes.responses, ROW_PROMPTS)
    ]
    token_rewards = torch.zeros(mask.shape, dtype=torch.float64)
    lengths = [len(m) for m in verl_response_mask(episodes)]
    for row, length in enumerate(lengths):
        token_rewards[row, length - 1] = scores[row]
    index = np.array(ROW_PROMPTS, dtype=object)
    verl_advantages, _ = core_algos.compute_grpo_outcome_advantage(
        token_rewards, mask, index, epsilon=1e-6
    )
    advantages, _ = compute_group_normalized_rewards(
        torch.tensor(scores, dtype=torch.float64), GROUP_SIZE, "mean", 1e-6, "std"
    )
    assert torch.allclose(verl_advantages, advantages[:, None] * mask, atol=1e-12)
    # verl's vanilla (PPO-clip) loss on that mask, token-mean, against grpo_lab's
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(mask.shape, generator=generator, dtype=torch.float64)
    log_prob = (
        old + 0.3 * torch.randn(mask.shape, generator=generator)
    ).requires_grad_()
    config = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=GROUP_SIZE,
        ppo_micro_batch_size_per_gpu=2,
        clip_ratio=0.2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
    )
    verl_loss, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=verl_advantages,
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=config,
    )
    (verl_grad,) = torch.autograd.grad(verl_loss, log_prob)
    ours_log_prob = log_prob.detach().clone().requires_grad_()
    per_token, _ = compute_policy_gradient_loss(
        advantages[:, None], ours_log_prob, "grpo", old, 0.2, mask
    )
    loss = aggregate_loss_across_microbatch(per_token, mask.double(), "token", None)
    (grad,) = torch.autograd.grad(loss, ours_log_prob)
    assert abs(loss.item() - verl_loss.item()) <= 1e-12
    assert (grad - verl_grad).abs().max() <= 1e-12
    assert (grad[mask == 0] == 0).all() and grad.abs().max() > 0
