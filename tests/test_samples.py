"""sample_rows grades each sampled response; samples_markdown lays models side by side."""

from __future__ import annotations

import pytest

from grpo_lab.tasks import get_task
from grpo_lab.teaching.samples import SampleRow, sample_rows, samples_markdown


def test_sample_rows_grades_each_response_of_each_prompt(
    alternating_backend,
) -> None:
    task = get_task("reverse", n_digits=5)
    examples = task.eval(2, seed=0)
    backend = alternating_backend(wrong="9|9")
    rows = sample_rows(backend, task, examples, samples_per_prompt=3, seed=4)
    assert [row.prompt for row in rows] == [e.prompt for e in examples]
    assert rows[0].responses[0] == examples[0].ground_truth
    assert rows[1].responses == (
        examples[1].ground_truth,
        "9|9",
        examples[1].ground_truth,
    )
    assert rows[1].rewards == (1.0, 0.0, 1.0)
    assert backend.sampling.max_new_tokens == task.max_new_tokens
    assert backend.sampling.seed == 4


def test_sample_rows_refuses_bad_sizes(alternating_backend) -> None:
    task = get_task("reverse", n_digits=5)
    with pytest.raises(ValueError, match="samples_per_prompt"):
        sample_rows(
            alternating_backend(wrong="9|9"),
            task,
            task.eval(1, 0),
            samples_per_prompt=0,
        )
    with pytest.raises(ValueError, match="examples"):
        sample_rows(alternating_backend(wrong="9|9"), task, [])


def test_samples_markdown_puts_models_in_columns_and_escapes_cells() -> None:
    start = [SampleRow("12=", "21", ("9|9", ""), (0.0, 0.0))]
    end = [SampleRow("12=", "21", ("21", "21"), (1.0, 1.0))]
    table = samples_markdown({"start": start, "end": end}).splitlines()
    assert table[0] == "| prompt | answer | start | end |"
    assert table[1] == "|---|---|---|---|"
    assert table[2] == "| `12=` | `21` | `9\\|9` (0), ∅ (0) | `21` (1), `21` (1) |"
    with pytest.raises(ValueError, match="rows_by_model"):
        samples_markdown(
            {"start": start, "other": [SampleRow("3=", "3", ("3",), (1.0,))]}
        )
    with pytest.raises(ValueError, match="rows_by_model"):
        samples_markdown({})
