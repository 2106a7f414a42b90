"""What a model actually writes: a few prompts, their sampled responses and rewards.

Curves give averages; a table of samples shows what the averages hide (the
digits a reward-hacking policy dumps, the reversal that is right but for one
swapped pair). :func:`sample_rows` samples ``samples_per_prompt`` responses per
example from a rollout backend and grades each with the task's reward;
:func:`samples_markdown` lays out the rows of several models (a run's start,
middle and end) side by side, one column per model. Taught in
``notebooks/08_training_loop.ipynb``.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_lab.rollouts.base import RolloutBackend, SamplingSettings
from grpo_lab.tasks.base import Example, Task


@dataclass(frozen=True)
class SampleRow:
    """One prompt, its expected answer, and the sampled responses with rewards."""

    prompt: str
    ground_truth: str
    responses: tuple[str, ...]
    rewards: tuple[float, ...]


def sample_rows(
    backend: RolloutBackend,
    task: Task,
    examples: list[Example],
    *,
    samples_per_prompt: int = 3,
    temperature: float = 1.0,
    seed: int = 0,
) -> list[SampleRow]:
    """Sample ``samples_per_prompt`` responses per example and grade each one.

    reward of a response = task.reward_fn(response, ground_truth)["reward"],
    sampled at ``temperature`` with at most ``task.max_new_tokens`` tokens.
    """
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt!r}")
    if not examples:
        raise ValueError("examples must hold at least one example, got []")
    sampling = SamplingSettings(
        temperature=temperature,
        max_new_tokens=task.max_new_tokens,
        stop_strings=tuple(task.stop_strings),
        seed=seed,
    )
    prompts = [example.prompt for example in examples]
    responses = backend.generate(prompts, samples_per_prompt, sampling).responses
    rows = []
    for index, example in enumerate(examples):
        group = responses[index * samples_per_prompt : (index + 1) * samples_per_prompt]
        rewards = [task.reward_fn(r, example.ground_truth)["reward"] for r in group]
        rows.append(
            SampleRow(
                example.prompt, example.ground_truth, tuple(group), tuple(rewards)
            )
        )
    return rows


def samples_markdown(rows_by_model: dict[str, list[SampleRow]]) -> str:
    """A markdown table: one line per prompt, one column per model.

    Each cell lists that model's responses as ``response`` (reward); all models
    must have sampled the same prompts in the same order.
    """
    if not rows_by_model:
        raise ValueError("rows_by_model must name at least one model, got {}")
    columns = list(rows_by_model.values())
    prompts = [row.prompt for row in columns[0]]
    for label, rows in rows_by_model.items():
        if [row.prompt for row in rows] != prompts:
            raise ValueError(
                f"rows_by_model[{label!r}] must sample the prompts {prompts}, "
                f"got {[row.prompt for row in rows]}"
            )
    header = "| prompt | answer | " + " | ".join(rows_by_model) + " |"
    rule = "|---" * (2 + len(rows_by_model)) + "|"
    lines = [header, rule]
    for index, prompt in enumerate(prompts):
        cells = [_code(prompt), _code(columns[0][index].ground_truth)]
        cells += [_responses_cell(rows[index]) for rows in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _responses_cell(row: SampleRow) -> str:
    """``response`` (reward) for each response of a row, separated by commas."""
    return ", ".join(
        f"{_code(response)} ({reward:g})"
        for response, reward in zip(row.responses, row.rewards, strict=True)
    )


def _code(text: str) -> str:
    """Text as inline code that a table cell can hold (empty shows as ∅)."""
    if not text:
        return "∅"
    cleaned = text.replace("\n", "⏎").replace("|", "\\|").replace("`", "'")
    return f"`{cleaned}`"
