"""Held-out scores: accuracy, format rate and length of one response per prompt."""

from __future__ import annotations

import itertools
import math

import pytest

from grpo_lab.rollouts.base import Rollouts, SamplingSettings
from grpo_lab.tasks import get_task
from grpo_lab.training.evaluation import (
    correct_counts,
    held_out_scores,
    pass_at_k,
    pass_at_k_curve,
)


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


# ---------------------------------------------------------------- pass@k


@pytest.mark.parametrize(("n", "c"), [(10, 0), (10, 3), (7, 7), (1, 1), (20, 13)])
def test_pass_at_1_is_the_fraction_correct(n: int, c: int) -> None:
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


@pytest.mark.parametrize(("n", "c"), [(10, 0), (10, 1), (10, 9), (5, 5)])
def test_pass_at_n_is_whether_any_sample_is_correct(n: int, c: int) -> None:
    assert pass_at_k(n, c, n) == (1.0 if c > 0 else 0.0)


@pytest.mark.parametrize(("n", "c", "k"), [(10, 3, 2), (8, 2, 5), (30, 4, 10)])
def test_pass_at_k_matches_the_binomial_closed_form(n: int, c: int, k: int) -> None:
    expected = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12)


def test_pass_at_k_by_hand() -> None:
    # n = 4, c = 1, k = 2: the pair misses the one correct sample in C(3,2) = 3 of
    # C(4,2) = 6 pairs, so pass@2 = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n = 4, c = 2, k = 3: any 3 of 4 include a correct one
    assert pass_at_k(4, 2, 3) == 1.0


@pytest.mark.parametrize(
    ("n", "c", "k", "name"),
    [
        (0, 0, 1, "n must"),
        (4, 5, 1, "c must"),
        (4, 1, 0, "k must"),
        (4, 1, 5, "k must"),
        (4.0, 1, 1, "n must"),
        (4, True, 1, "c must"),
    ],
)
def test_pass_at_k_rejects_bad_counts(n, c, k, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        pass_at_k(n, c, k)


def test_pass_at_k_curve_rises_from_the_mean_to_the_solved_share() -> None:
    curve = pass_at_k_curve([0, 1, 4], n=4)
    assert curve[0] == pytest.approx((0 + 1 + 4) / 12)  # pass@1: mean accuracy
    assert curve[-1] == pytest.approx(2 / 3)  # two of three prompts solved once
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(curve))
    with pytest.raises(ValueError, match="correct_counts"):
        pass_at_k_curve([], n=4)


def test_correct_counts_counts_each_prompt_s_group(alternating_backend) -> None:
    task = get_task("reverse", n_digits=3)
    examples = task.eval(3, seed=0)
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=5)
    assert correct_counts(alternating_backend(), task, examples, 5, sampling) == [3] * 3
