"""GSM8K and MATH with the r1-zero prompt, from local JSONL files or the hub.

Published formats, one JSON object per line:
  GSM8K: {"question": ..., "answer": "... #### 42"}  (answer after "####", commas
         stripped; "<<48/2=24>>" calculator notes are dropped from demonstrations)
  MATH:  {"problem": ..., "solution": "... \\boxed{...}", "level": ..., "type": ...}
         (answer = content of the last \\boxed{...}, or the record's "answer" field
         when present, as in MATH-500; a numeric "answer" becomes a string)

Splits, in order of precedence:
  * ``train_path`` / ``eval_path``: separate files (GSM8K ships train.jsonl and
    test.jsonl; MATH ships train and test). A split whose file is missing raises.
  * ``path``: one file, split by a fixed hash of the question
    (``grpo_lab.tasks.splits.is_eval_prompt`` with ``eval_fraction``).
  * none of them: the hub's train and test splits through ``datasets``
    (imported lazily; install the ``data`` extra).
Files are checked when the task is built and read on the first ``train`` or
``eval`` call, so building a task (e.g. to read ``max_new_tokens``) is cheap.
``train(n, seed)`` walks seeded shuffles of the train split (repeating only after
every example was used); ``eval(n, seed)`` returns n distinct eval examples.
Graded by ``grpo_lab.rewards.r1_zero_reward``: ground truths from files go through
the same size caps and sandboxed math-verify worker as model answers. Rewards are
taught in ``notebooks/03_rewards_and_advantages.ipynb``.
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import ClassVar

from grpo_lab.rewards import last_boxed_content, r1_zero_reward
from grpo_lab.tasks.base import Example
from grpo_lab.tasks.splits import (
    check_count_and_seed,
    check_eval_fraction,
    is_eval_prompt,
    sample_distinct_examples,
)

R1_ZERO_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the "
    "Assistant solves it. The Assistant first thinks about the reasoning process in "
    "the mind and then provides the User with the answer. The reasoning process is "
    "enclosed within <think> </think> and answer is enclosed within <answer> "
    "</answer> tags, respectively, i.e., <think> reasoning process here </think> "
    "<answer> answer here </answer>.\nUser: {question}\nAssistant: <think>"
)
R1_ZERO_STOP_STRINGS = ("</answer>",)
GSM8K_HUB = ("openai/gsm8k", "main")
MATH_HUB_NAME = "EleutherAI/hendrycks_math"
MATH_HUB_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
_CALCULATOR_NOTE = re.compile(r"<<[^<>]*>>")


def r1_zero_prompt(question: str) -> str:
    """The r1-zero prompt around ``question``; the response continues "<think>"."""
    return R1_ZERO_PROMPT.format(question=question.strip())


def r1_zero_demonstration(reasoning: str, answer: str) -> str:
    """A well-formed response: " {reasoning} </think> <answer> {answer} </answer>"."""
    return f" {reasoning.strip()} </think> <answer> {answer} </answer>"


def extract_gsm8k_answer(answer_text: str) -> str:
    """The final answer of a GSM8K record: after the last "####", commas removed."""
    if "####" not in answer_text:
        raise ValueError(f"answer must contain '####', got {answer_text[-80:]!r}")
    return answer_text.rsplit("####", 1)[1].strip().replace(",", "")


def extract_math_answer(solution: str) -> str | None:
    """The final answer of a MATH solution: the last \\boxed{...}, or None."""
    content = last_boxed_content(solution)
    return None if content is None else content.strip()


def gsm8k_example(record: dict) -> Example:
    """One GSM8K record as an r1-zero example with a demonstration."""
    question, answer_text = _required(record, ("question", "answer"))
    answer = extract_gsm8k_answer(answer_text)
    reasoning = _CALCULATOR_NOTE.sub("", answer_text.rsplit("####", 1)[0])
    return Example(
        prompt=r1_zero_prompt(question),
        ground_truth=answer,
        demonstration=r1_zero_demonstration(reasoning, answer),
    )


def math_example(record: dict) -> Example:
    """One MATH record as an r1-zero example with a demonstration."""
    problem, solution = _required(record, ("problem", "solution"))
    answer = math_record_answer(record) or extract_math_answer(solution)
    if answer is None:
        raise ValueError(
            f"solution must contain \\boxed{{...}}, got {solution[-80:]!r}"
        )
    return Example(
        prompt=r1_zero_prompt(problem),
        ground_truth=answer,
        demonstration=r1_zero_demonstration(solution, answer),
    )


def math_record_answer(record: dict) -> str | None:
    """A MATH record's "answer" field as a string; None when absent or "".

    Numbers become strings: an int as written (4 -> "4"), a float in plain
    decimal notation (0.5 -> "0.5", 4.0 -> "4", 1e-05 -> "0.00001"). ValueError
    for a boolean, a NaN or infinite float, or any other type.
    """
    value = record.get("answer")
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"answer must be a string or a number, got {value!r}")
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        raise ValueError(f"answer must be a finite number, got {value!r}")
    if value.is_integer():
        return str(int(value))
    return format(Decimal(repr(value)), "f")


def _required(record: dict, keys: tuple[str, ...]) -> list[str]:
    """The string values of ``keys`` in ``record``; ValueError naming a missing one."""
    if not isinstance(record, dict):
        raise ValueError(f"record must be a JSON object, got {type(record).__name__}")
    missing = [key for key in keys if not isinstance(record.get(key), str)]
    if missing:
        raise ValueError(
            f"record must have string fields {list(keys)}, missing {missing}"
        )
    return [record[key] for key in keys]


def load_jsonl(path: str | Path) -> list[dict]:
    """The JSON objects of a JSONL file (blank lines skipped).

    ValueError naming the path when it is missing, or the line that is not JSON.
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"path must name an existing JSONL file, got {str(path)!r}")
    records = []
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                records.append(_json_line(line, file, number))
    return records


def _json_line(line: str, file: Path, number: int) -> dict:
    """One parsed JSONL line; ValueError with the file and line number otherwise."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}:{number} is not valid JSON: {error}") from error


def load_hub_records(dataset_name: str, config_name: str | None, split: str) -> list:
    """Records of a hub dataset split through ``datasets`` (imported lazily)."""
    try:
        import datasets
    except ImportError as error:
        raise ImportError(
            "loading from the Hugging Face hub needs the `datasets` package "
            "(pip install 'grpo-lab[data]'); or pass path= a local JSONL file"
        ) from error
    try:
        dataset = datasets.load_dataset(dataset_name, config_name, split=split)
    except Exception as error:
        raise RuntimeError(
            f"could not load {dataset_name!r} ({config_name}, {split}) from the hub; "
            f"offline? pass path= a local JSONL file instead: {error}"
        ) from error
    return [dict(record) for record in dataset]


def _examples(records: list, to_example: Callable[[dict], Example]) -> list[Example]:
    """Convert records, naming the record index on failure."""
    examples = []
    for index, record in enumerate(records):
        try:
            examples.append(to_example(record))
        except ValueError as error:
            raise ValueError(f"record {index}: {error}") from error
    return examples


@dataclass(frozen=True)
class _R1ZeroTask:
    """Shared fields and sampling of the r1-zero math tasks."""

    # One JSONL file, split into train and eval by a fixed hash of the question.
    path: str | None = None
    # Train split's own JSONL file (train_path/eval_path take precedence over path).
    train_path: str | None = None
    # Eval split's own JSONL file (e.g. GSM8K's test.jsonl).
    eval_path: str | None = None
    # Share of `path` held out for evaluation (unused with separate files).
    eval_fraction: float = 0.1
    # Longest response, in tokens.
    max_new_tokens: int = 1024

    stop_strings: ClassVar[tuple[str, ...]] = R1_ZERO_STOP_STRINGS

    def __post_init__(self) -> None:
        check_eval_fraction(self.eval_fraction)
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens must be a positive int, got {self.max_new_tokens!r}"
            )
        for option in ("path", "train_path", "eval_path"):
            value = getattr(self, option)
            if value is not None and not Path(value).is_file():
                raise ValueError(
                    f"{option} must name an existing JSONL file, got {value!r}"
                )

    @functools.cached_property
    def splits(self) -> dict[str, list[Example] | None]:
        """Examples of each split ({"train", "eval"}), loaded on first use."""
        if self.train_path is not None or self.eval_path is not None:
            return {
                "train": self._load_file(self.train_path),
                "eval": self._load_file(self.eval_path),
            }
        if self.path is not None:
            examples = self._load_file(self.path)
            is_eval = [is_eval_prompt(e.prompt, self.eval_fraction) for e in examples]
            return {
                "train": [e for e, held in zip(examples, is_eval) if not held],
                "eval": [e for e, held in zip(examples, is_eval) if held],
            }
        return self._load_hub()

    def _load_file(self, path: str | None) -> list[Example] | None:
        return None if path is None else _examples(load_jsonl(path), self.to_example)

    def _split(self, split: str) -> list[Example]:
        examples = self.splits[split]
        if examples is None:
            raise ValueError(
                f"{split}_path was not given, so the {split} split is empty"
            )
        return examples

    def train(self, n: int, seed: int) -> list[Example]:
        """``n`` examples from seeded shuffles of the train split, epoch after epoch."""
        check_count_and_seed(n, seed)
        pool = self._split("train")
        if not pool and n:
            raise ValueError(f"the train split of {self.name} is empty, got n={n}")
        rng, examples = random.Random(seed), []
        while len(examples) < n:
            examples.extend(rng.sample(pool, len(pool)))
        return examples[:n]

    def eval(self, n: int, seed: int) -> list[Example]:
        """``n`` distinct eval examples in a seeded order."""
        return sample_distinct_examples(self._split("eval"), n, seed, "eval")

    def reward_fn(self, response: str, ground_truth: str) -> dict[str, float]:
        """See ``grpo_lab.rewards.r1_zero_reward``."""
        return r1_zero_reward(response, ground_truth)


@dataclass(frozen=True)
class GSM8KTask(_R1ZeroTask):
    """Grade-school math word problems (GSM8K) with the r1-zero prompt."""

    name: ClassVar[str] = "gsm8k"

    def to_example(self, record: dict) -> Example:
        return gsm8k_example(record)

    def _load_hub(self) -> dict[str, list[Example]]:
        return {
            split: _examples(load_hub_records(*GSM8K_HUB, hub_split), gsm8k_example)
            for split, hub_split in (("train", "train"), ("eval", "test"))
        }


@dataclass(frozen=True)
class MathTask(_R1ZeroTask):
    """Competition mathematics (MATH) with the r1-zero prompt."""

    name: ClassVar[str] = "math"

    def to_example(self, record: dict) -> Example:
        return math_example(record)

    def _load_hub(self) -> dict[str, list[Example]]:
        return {
            split: [
                example
                for subject in MATH_HUB_SUBJECTS
                for example in _examples(
                    load_hub_records(MATH_HUB_NAME, subject, hub_split), math_example
                )
            ]
            for split, hub_split in (("train", "train"), ("eval", "test"))
        }
