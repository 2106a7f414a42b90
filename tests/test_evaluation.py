"""Held-out scores: accuracy, format rate and length of one response per prompt."""

from __future__ import annotations

from grpo_lab.rollouts.base import Rollouts, SamplingSettings
from grpo_lab.tasks import get_task
from grpo_lab.training.evaluation import held_out_scores


class FirstCorrectBackend:
    """Answers the first ``correct`` prompts right and the rest with "x"."""

    def __init__(self, correct: int, with_ids: bool):
        self.correct, self.with_ids = correct, with_ids

    def generate(self, prompts, group_size, sampling):
        answers = [
            prompt[:-1][::-1] if index < self.correct else "x"
            for index, prompt in enumerate(prompts)
        ]
        ids = [list(range(len(a) + 1)) for a in answers] if self.with_ids else None
        return Rollouts(
            prompts=list(prompts),
            responses=answers,
            prompt_token_ids=[[0]] * len(prompts) if self.with_ids else None,
            response_token_ids=ids,
        )

    def sync(self, policy):
        pass


def test_scores_are_means_over_the_held_out_prompts():
    task = get_task("reverse", n_digits=3)
    examples = task.eval(4, seed=0)
    scores = held_out_scores(
        FirstCorrectBackend(3, with_ids=True), task, examples, SamplingSettings()
    )
    # 3 of 4 answers right; "x" is still well formed for the reverse task only
    # if it is digits, so format is the reverse task's own judgement.
    assert scores.accuracy == 0.75
    expected_format = (
        sum(
            task.reward_fn(r, e.ground_truth)["format_reward"]
            for r, e in zip(
                ["".join(reversed(e.prompt[:-1])) for e in examples[:3]] + ["x"],
                examples,
            )
        )
        / 4
    )
    assert scores.format_rate == expected_format
    # Token lengths: answers of 3 digits + EOS three times, "x" + EOS once.
    assert scores.response_length == (4 + 4 + 4 + 2) / 4


def test_lengths_fall_back_to_characters_without_token_ids():
    task = get_task("reverse", n_digits=3)
    scores = held_out_scores(
        FirstCorrectBackend(0, with_ids=False),
        task,
        task.eval(2, seed=1),
        SamplingSettings(),
    )
    assert (scores.accuracy, scores.response_length) == (0.0, 1.0)
