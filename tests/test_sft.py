"""SFT warm-up: demonstration batches, a loss that falls, stopping on accuracy."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.rollouts.base import Rollouts, SamplingSettings
from grpo_lab.tasks import get_task
from grpo_lab.tasks.base import Example
from grpo_lab.training.sft import (
    WarmUpSettings,
    WarmUpWarning,
    demonstration_batch,
    sft_step,
    warm_up,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


class AnswerBackend:
    """Answers correctly for the first ``correct`` prompts of each call."""

    def __init__(self, task, correct: int):
        self.task, self.correct, self.calls = task, correct, 0

    def generate(self, prompts, group_size, sampling):
        self.calls += 1
        answers = [
            prompt[:-1][::-1] if index < self.correct else "x"
            for index, prompt in enumerate(prompts)
        ]
        return Rollouts(prompts=list(prompts), responses=answers)

    def sync(self, policy):
        pass


def test_demonstration_batch_trains_on_the_answer_and_eos(tokenizer):
    batch = demonstration_batch([Example("12>", "21", "21")], tokenizer)
    # ids: "1" "2" ">" | "2" "1" <eos>; inputs drop the last id, labels the first.
    ids = [*tokenizer.encode("12>21"), tokenizer.eos_token_id]
    assert batch["input_ids"].tolist() == [ids[:-1]]
    assert batch["labels"].tolist() == [ids[1:]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1, 1]]


def test_examples_without_demonstrations_are_refused(tokenizer):
    with pytest.raises(ValueError, match="demonstration"):
        demonstration_batch([Example("12>", "21")], tokenizer)


def test_sft_steps_lower_the_loss_and_change_the_weights(tokenizer):
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    examples = get_task("reverse", n_digits=3).train(8, seed=0)
    batch = demonstration_batch(examples, tokenizer)
    losses = [sft_step(model, optimizer, batch) for _ in range(15)]
    # A random model starts near log(98) = 4.6 nats; memorising 8 answers is easy.
    assert losses[0] > 3.5 and losses[-1] < 0.5 * losses[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def settings(task, max_steps, target, eval_every=2):
    return WarmUpSettings(
        max_steps=max_steps,
        batch_size=4,
        lr=1e-3,
        eval_every=eval_every,
        target_accuracy=target,
        held_out=task.eval(4, seed=0),
        sampling=SamplingSettings(max_new_tokens=5, seed=0),
        train_seed=0,
    )


def test_warm_up_stops_at_the_first_check_that_reaches_the_target(tokenizer):
    task = get_task("reverse", n_digits=3)
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0)
    logged = []
    records = warm_up(
        model, tokenizer, AnswerBackend(task, 2), task, settings(task, 10, 0.5),
        log=logged.append,
    )  # fmt: skip
    # Accuracy is 2/4 = 0.5 at the first check (step 2): stop there.
    assert [r["sft/step"] for r in records] == [1, 2]
    assert records[1]["sft/accuracy_sampled"] == 0.5
    assert "sft/accuracy_sampled" not in records[0]
    assert logged == records


def test_warm_up_runs_to_the_step_cap_below_the_target(tokenizer):
    task = get_task("reverse", n_digits=3)
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0)
    backend = AnswerBackend(task, 1)
    with pytest.warns(WarmUpWarning, match=r"sft_max_steps \(5\) .* 0\.250, below"):
        records = warm_up(
            model, tokenizer, backend, task, settings(task, 5, 0.5), log=lambda r: None
        )
    assert [r["sft/step"] for r in records] == [1, 2, 3, 4, 5]
    assert backend.calls == 3  # checks at steps 2, 4 and the last step 5


def test_a_warm_up_that_reaches_its_target_at_the_cap_does_not_warn(tokenizer):
    task = get_task("reverse", n_digits=3)
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", WarmUpWarning)
        records = warm_up(
            model, tokenizer, AnswerBackend(task, 2), task, settings(task, 2, 0.5),
            log=lambda r: None,
        )  # fmt: skip
    assert records[-1]["sft/accuracy_sampled"] == 0.5


def test_a_greedy_check_is_logged_as_greedy_accuracy(tokenizer):
    task = get_task("reverse", n_digits=3)
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0)
    greedy = dataclasses.replace(
        settings(task, 2, 0.5), sampling=SamplingSettings(temperature=0.0)
    )
    records = warm_up(
        model, tokenizer, AnswerBackend(task, 4), task, greedy, log=lambda r: None
    )
    assert records[-1]["sft/accuracy_greedy"] == 1.0
    assert "sft/accuracy_sampled" not in records[-1]


def test_every_warm_up_check_samples_the_current_weights(tokenizer):
    """A backend that keeps its own copy (vLLM, the stale simulator) gets the
    warm-up's weights before each check, not the step-0 weights."""
    from grpo_lab.rollouts.mismatch import MismatchRolloutBackend

    task = get_task("reverse", n_digits=3)
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0)
    backend = MismatchRolloutBackend(model, tokenizer, "stale", sync_every=1000)
    with pytest.warns(WarmUpWarning):  # a target of 1.1 runs to the cap
        warm_up(
            model, tokenizer, backend, task, settings(task, 2, 1.1), log=lambda r: None
        )
    for copy, live in zip(backend.frozen.parameters(), model.parameters()):
        assert torch.equal(copy, live)  # step 2's check loaded step 2's weights
    assert backend.sync_calls == 0  # refreshes are not RL steps' syncs
