"""Dynamic sampling: keep the groups whose rewards differ, sample more, give up bounded."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from grpo_lab.rollouts.base import Rollouts
from grpo_lab.tasks import get_task
from grpo_lab.tasks.base import Example
from grpo_lab.training import loop
from grpo_lab.training.config import TrainConfig, inert_settings
from grpo_lab.training.dynamic_sampling import (
    DynamicSamplingWarning,
    GradedRollouts,
    check_dynamic_sampling_settings,
    collect_groups_with_signal,
    groups_with_signal,
    replay_reward_fn,
)
from grpo_lab.training.metrics import step_records

NAN = math.nan


# --- the filter ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rewards", "group_size", "kept"),
    [
        ([0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0], 4, [0, 3]),
        ([1, 1, 1, 1], 4, []),
        ([0.5, 0.25], 2, [0]),
        ([NAN, 1, 1, 1, NAN, 0, 1, 1], 4, [1]),  # NaN left out of the comparison
        ([NAN, NAN, 2, 2], 2, []),
        ([3, 3, 3], 1, []),  # a group of one never has signal
    ],
)
def test_groups_with_signal_closed_cases(rewards, group_size, kept):
    found = groups_with_signal(torch.tensor(rewards, dtype=torch.float32), group_size)
    assert found.tolist() == kept


def test_groups_with_signal_refuses_a_ragged_batch():
    with pytest.raises(ValueError, match=r"group_size \(4\) dividing"):
        groups_with_signal(torch.zeros(6), 4)
    with pytest.raises(ValueError, match=r"got shape \(2, 2\)"):
        groups_with_signal(torch.zeros(2, 2), 2)


# --- the collecting loop ----------------------------------------------------------------


def rollouts_of(round_: int, texts: list[str], group_size: int) -> Rollouts:
    prompts = [f"p{round_}-{i // group_size}" for i in range(len(texts))]
    ids = [[round_, i] for i in range(len(texts))]
    return Rollouts(prompts, texts, ids, [[7]] * len(texts))


class RoundScript:
    """sample(round) plays prescribed responses; grade counts every call."""

    def __init__(self, rounds: list[list[str]], group_size: int) -> None:
        self.rounds, self.group_size, self.graded = rounds, group_size, []

    def sample(self, round_):
        texts = self.rounds[round_]
        examples = [
            Example(f"p{round_}-{g}", "1") for g in range(len(texts) // self.group_size)
        ]
        return rollouts_of(round_, texts, self.group_size), examples

    def grade(self, rollouts, examples):
        self.graded += rollouts.responses
        return [
            {"reward": float(text == "1"), "format_reward": 1.0, "answer_reward": 0.0}
            for text in rollouts.responses
        ]


def test_collect_keeps_sampling_until_the_batch_has_signal():
    # 2 prompts x 2 per round: round 0 all equal, round 1 one group, round 2 two.
    script = RoundScript(
        [["0", "0", "1", "1"], ["1", "1", "0", "1"], ["0", "1", "1", "0"]], 2
    )
    graded, examples = collect_groups_with_signal(script.sample, script.grade, 2, 5)
    assert isinstance(graded, GradedRollouts)
    assert [e.prompt for e in examples] == ["p1-1", "p2-0"]
    assert graded.responses == ["0", "1", "0", "1"]
    assert graded.prompts == ["p1-1", "p1-1", "p2-0", "p2-0"]
    assert graded.prompt_token_ids == [[1, 2], [1, 3], [2, 0], [2, 1]]
    assert [r["reward"] for r in graded.reward_results] == [0.0, 1.0, 0.0, 1.0]
    assert graded.sampling_metrics == {
        "rollout/dynamic_sampling_rounds": 3.0,
        "rollout/kept_group_fraction": 3 / 6,
        "rollout/dynamic_sampling_gave_up": 0.0,
    }
    assert len(script.graded) == 12  # each sampled response graded once


def test_the_first_round_with_signal_is_the_only_round():
    script = RoundScript([["0", "1", "1", "0"]], 2)
    graded, examples = collect_groups_with_signal(script.sample, script.grade, 2, 3)
    assert [e.prompt for e in examples] == ["p0-0", "p0-1"]
    assert graded.sampling_metrics["rollout/dynamic_sampling_rounds"] == 1.0
    assert graded.sampling_metrics["rollout/kept_group_fraction"] == 1.0


def test_giving_up_pads_with_equal_reward_groups_and_warns_once():
    script = RoundScript([["0", "0", "1", "0"], ["1", "1", "0", "0"]] * 2, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        graded, examples = collect_groups_with_signal(script.sample, script.grade, 2, 2)
        collect_groups_with_signal(script.sample, script.grade, 2, 2)
    # The one group with signal first, then the first equal-reward group drawn.
    assert [e.prompt for e in examples] == ["p0-1", "p0-0"]
    assert graded.responses == ["1", "0", "0", "0"]
    assert graded.sampling_metrics["rollout/dynamic_sampling_gave_up"] == 1.0
    assert graded.sampling_metrics["rollout/kept_group_fraction"] == 1 / 4
    messages = [w for w in caught if issubclass(w.category, DynamicSamplingWarning)]
    assert len(messages) == 1
    assert "dynamic_sampling_max_rounds (2)" in str(messages[0].message)


def test_replay_hands_back_the_grades_in_order():
    results = [{"reward": 1.0}, {"reward": 0.0}]
    replay = replay_reward_fn(results, ["a", "b"])
    assert replay("a", "t") is results[0] and replay("b", "t") is results[1]
    with pytest.raises(ValueError, match="must be the graded one 'a'"):
        replay_reward_fn(results, ["a", "b"])("b", "t")


# --- in the loop ------------------------------------------------------------------------


class ScriptedBackend:
    """Answers "0" to every prompt for the first rounds, then mixes "0"/"2"."""

    def __init__(self, tokenizer, equal_rounds: int) -> None:
        self.tokenizer, self.equal_rounds, self.calls = tokenizer, equal_rounds, 0

    def generate(self, prompts, group_size, sampling):
        self.calls += 1
        cycle = "0" if self.calls <= self.equal_rounds else "02"
        texts = [cycle[j % len(cycle)] for _ in prompts for j in range(group_size)]
        encode = lambda t: self.tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
        return Rollouts(
            prompts=[p for p in prompts for _ in range(group_size)],
            responses=texts,
            prompt_token_ids=[encode(p) for p in prompts for _ in range(group_size)],
            response_token_ids=[
                [*encode(t), self.tokenizer.eos_token_id] for t in texts
            ],
        )

    def sync(self, policy):
        pass


class EvenAnswer:
    name = "even"
    stop_strings = ()
    max_new_tokens = 3

    def __init__(self):
        self.task, self.graded = get_task("reverse", n_digits=3), 0

    def train(self, n, seed):
        return self.task.train(n, seed)

    def reward_fn(self, response, ground_truth):
        self.graded += 1
        value = float(response == "2")
        return {"reward": value, "format_reward": 1.0, "answer_reward": value}


def smoke(tmp_path, **overrides) -> TrainConfig:
    return TrainConfig.for_profile("smoke", run_dir=str(tmp_path / "r"), **overrides)


def test_sample_rollout_batch_collects_rounds_and_grpo_update_grades_nothing(
    tmp_path,
):
    config = smoke(tmp_path, dynamic_sampling=True, dynamic_sampling_max_rounds=4)
    policy = loop.build_policy(config)
    policy.backend = ScriptedBackend(policy.tokenizer, equal_rounds=2)
    task = EvenAnswer()
    rollouts, examples = loop.sample_rollout_batch(config, task, policy, step=1)
    assert policy.backend.calls == 3 and task.graded == 3 * 16
    # Round 2's prompts come from a seed of their own, not the step's.
    assert [e.prompt for e in examples] == [
        e.prompt for e in task.train(4, loop.derived_seed(config, "prompts/round2", 1))
    ]
    record = loop.grpo_update(config, task, policy, rollouts, examples)
    assert task.graded == 3 * 16  # not graded a second time
    assert record["rollout/dynamic_sampling_rounds"] == 3.0
    assert record["rollout/kept_group_fraction"] == 4 / 12
    assert record["train/equal_reward_group_fraction"] == 0.0
    assert record["train/optimizer_steps"] == 1.0


def test_without_dynamic_sampling_the_batch_is_round_0(tmp_path):
    config = smoke(tmp_path)
    policy = loop.build_policy(config)
    task = get_task("reverse", n_digits=5)
    rollouts, examples = loop.sample_rollout_batch(config, task, policy, step=3)
    assert type(rollouts) is Rollouts
    assert examples == task.train(4, loop.derived_seed(config, "prompts", 3))
    again, _ = loop.sample_round(config, task, policy, 3, 0)
    assert again.response_token_ids == rollouts.response_token_ids


def test_a_two_step_smoke_run_with_dynamic_sampling(tmp_path):
    # The smoke model gets nothing right: every round is all zeros, so each step
    # gives up after 2 rounds and trains on equal-reward groups (no optimizer step).
    config = smoke(tmp_path, dynamic_sampling=True, dynamic_sampling_max_rounds=2)
    with pytest.warns(DynamicSamplingWarning, match="dynamic_sampling_max_rounds"):
        history = loop.train(config, progress=False).history
    trained = [r for r in step_records(history) if r["step"] > 0]
    assert [r["rollout/dynamic_sampling_rounds"] for r in trained] == [2.0, 2.0]
    assert [r["rollout/dynamic_sampling_gave_up"] for r in trained] == [1.0, 1.0]
    assert all(r["rollout/kept_group_fraction"] == 0.0 for r in trained)
    assert all(r["train/optimizer_steps"] == 0.0 for r in trained)


# --- settings ----------------------------------------------------------------------


def test_check_dynamic_sampling_settings():
    check_dynamic_sampling_settings(True, 1, "leave_one_out")
    check_dynamic_sampling_settings(False, 3, "none")  # off: any baseline
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds must be a"):
        check_dynamic_sampling_settings(True, 0)
    with pytest.raises(ValueError, match="dynamic_sampling needs a group baseline"):
        check_dynamic_sampling_settings(True, 2, "none")
    with pytest.raises(ValueError, match="dynamic_sampling must be True or False"):
        check_dynamic_sampling_settings("yes", 2)


def test_the_round_bound_and_the_penalty_are_inert_when_their_option_is_off():
    notes = inert_settings(
        TrainConfig.for_profile(
            "cpu", dynamic_sampling_max_rounds=3, overlong_penalty=0.5
        )
    )
    assert notes["dynamic_sampling_max_rounds"] == "dynamic_sampling is off"
    assert notes["overlong_penalty"].startswith("overlong_buffer is None")
    on = TrainConfig.for_profile(
        "cpu", dynamic_sampling=True, dynamic_sampling_max_rounds=3, overlong_buffer=2
    )
    assert inert_settings(on) == {}


def test_replay_and_collect_refuse_what_they_would_misread():
    with pytest.raises(
        ValueError, match=r"^responses must have one entry per result \(0\), got 1$"
    ):
        replay_reward_fn([], ["a"])  # before any call: not at the first reward
    with pytest.raises(ValueError, match=r"^group_size must be a positive int, got 0$"):
        collect_groups_with_signal(None, None, 0, 3)  # before sampling anything
