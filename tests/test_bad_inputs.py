"""Bad input to the public core functions: a clear ValueError or a correct result.

Each case feeds one wrong thing (shape, dtype, type, an empty batch, a length
mismatch, NaN/inf where it must not matter) to one public function and sorts
the outcome into one of five classes:

    clear error    a ValueError that names the argument and says "got ..."
    obscure error  any other exception, or a ValueError that names something else
    silent wrong   a finite result where an error (or another result) was due
    silent NaN     a NaN/inf result where an error (or a finite result) was due
    correct        the result the case expects (masked entries ignored, ...)

A case with an ``argument`` must end as a clear error naming it; a case with an
``expected`` check must end correct. The names in ``OPEN_CASES`` are cases the
function under them does not handle yet: strict xfails, so that handling one
fails the run until its name leaves the set.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial

import pytest
import torch

from grpo_lab.advantages import (
    compute_group_normalized_rewards,
    compute_rollout_rewards,
)
from grpo_lab.aggregation import aggregate_loss_across_microbatch, microbatch_loss_scale
from grpo_lab.integrations.trl.translation import to_trl_config
from grpo_lab.integrations.verl.algorithms import aggregate_like_verl
from grpo_lab.kl import check_kl_settings, compute_kl_penalty
from grpo_lab.logprobs import (
    compute_entropy,
    get_response_log_probs,
)
from grpo_lab.losses import compute_policy_gradient_loss, high_entropy_mask
from grpo_lab.masks import (
    masked_mean,
    masked_normalize,
    pad_prompt_and_response_ids,
    tokenize_prompt_and_output,
)
from grpo_lab.models import (
    build_bpe_tokenizer,
    build_char_tokenizer,
    build_tiny_qwen2,
    tokenizer_training_corpus,
)
from grpo_lab.prefix_sharing import prompt_only_columns, split_at_prefix
from grpo_lab.rewards import grade_math_answer
from grpo_lab.rollouts.base import Rollouts
from grpo_lab.rollouts.tools import CalculatorTool
from grpo_lab.sampler_correction import (
    correction_weights,
    sampler_correction_weights,
    sampler_log_prob_gap,
    sampler_weights,
)
from grpo_lab.train_step import grpo_train_step, policy_gradient_update
from grpo_lab.training.dynamic_sampling import (
    collect_groups_with_signal,
    groups_with_signal,
    replay_reward_fn,
)
from grpo_lab.training.evaluation import (
    correct_counts,
    held_out_scores,
    pass_at_k,
    pass_at_k_curve,
)
from grpo_lab.training.overlong import (
    check_overlong_settings,
    is_truncated,
    mask_truncated,
    shape_reward_results,
    soft_overlong_punishment,
    truncated_rows,
    truncation_metrics,
)

CLEAR, OBSCURE = "clear error", "obscure error"
SILENT_WRONG, SILENT_NAN, CORRECT = "silent wrong", "silent NaN", "correct"
CLASSES = (CLEAR, OBSCURE, SILENT_WRONG, SILENT_NAN, CORRECT)
TINY_SIZES = {
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}
VOCAB = 98  # the default character tokenizer: <pad>, <eos> and 96 characters


@dataclass(frozen=True)
class Case:
    """One bad input to one function, and what must come of it."""

    # The public function under test.
    function: str
    # What is wrong with the input.
    bad_input: str
    # Calls the function on the bad input.
    call: Callable[[], object]
    # A clear error must name this argument (None: a result is expected).
    argument: str | None = None
    # Whether a returned result is right (only when ``argument`` is None).
    expected: Callable[[object], bool] | None = None

    @property
    def name(self) -> str:
        return f"{self.function}: {self.bad_input}"


def is_clear(message: str, argument: str) -> bool:
    """The message names ``argument`` (as a whole word) and what it got."""
    names_it = re.search(rf"(?<![\w.]){re.escape(argument)}(?!\w)", message)
    return bool(names_it) and "got" in message


def has_non_finite(result: object) -> bool:
    if isinstance(result, torch.Tensor):
        return result.is_floating_point() and not bool(torch.isfinite(result).all())
    if isinstance(result, float):
        return not math.isfinite(result)
    if isinstance(result, dict):
        return any(has_non_finite(value) for value in result.values())
    if isinstance(result, (tuple, list)):
        return any(has_non_finite(value) for value in result)
    return False


def classify(case: Case) -> tuple[str, str]:
    """(class, detail): the class of the outcome, and the error or result seen."""
    try:
        result = case.call()
    except ValueError as error:
        clear = case.argument is not None and is_clear(str(error), case.argument)
        return (CLEAR if clear else OBSCURE), f"ValueError: {error}"
    except Exception as error:
        return OBSCURE, f"{type(error).__name__}: {error}"
    detail = repr(result)[:300]
    if case.expected is not None and case.expected(result):
        return CORRECT, detail
    return (SILENT_NAN if has_non_finite(result) else SILENT_WRONG), detail


def audit_table(cases: list[Case]) -> dict[str, Counter]:
    """{function: Counter of outcome classes}: where bad input lands."""
    table: dict[str, Counter] = {}
    for case in cases:
        table.setdefault(case.function, Counter())[classify(case)[0]] += 1
    return table


# ------------------------------------------------------------------ inputs


@cache
def tokenizer():
    return build_char_tokenizer()


def tiny_model():
    return build_tiny_qwen2(tokenizer(), seed=0, **TINY_SIZES)


@cache
def shared_model():
    """One model for the cases that only score (nothing changes its weights)."""
    return tiny_model()


def ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


IDS = ids([2, 3, 4, 5], [6, 7, 8, 9])  # (2, 4) valid token ids
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 0, 1], [0, 0, 1]])
# Masked in: 1, 3, 6. Mean 10 / 3; row means [2, 6]; sum / 2 = 5;
# column sums / 2 = [0.5, 0, 4.5].
LOG_PROBS = torch.tensor([[-1.0, -2.0, -3.0], [-1.5, -0.5, -2.5]])
ADVANTAGES = torch.tensor([1.0, -1.0])
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0])
REWARD_ADVANTAGES = [0.7071, -0.7071, -0.7071, 0.7071]  # +-0.5 / sample std 0.7071


def with_masked(value: float, tensor: torch.Tensor = VALUES) -> torch.Tensor:
    """``tensor`` with ``value`` in every masked-out position of MASK."""
    return tensor.masked_fill(MASK == 0, value)


def equals(expected) -> Callable[[object], bool]:
    expected = torch.as_tensor(expected, dtype=torch.float32)

    def check(result: object) -> bool:
        return isinstance(result, torch.Tensor) and torch.allclose(
            result.float(), expected, atol=1e-4, equal_nan=True
        )

    return check


def tokenize(prompt, output, tokenizer_=None):
    return tokenize_prompt_and_output(
        prompt, output, tokenizer() if tokenizer_ is None else tokenizer_
    )


def pad(prompt_ids, response_ids, pad_token_id=0):
    return pad_prompt_and_response_ids(prompt_ids, response_ids, pad_token_id)


def log_probs(input_ids, labels, **options):
    return get_response_log_probs(shared_model(), input_ids, labels, **options)


def scores(input_ids, labels, **options):
    return get_response_log_probs(shared_model(), input_ids, labels, **options)


def same_scores_as_int64(result: object) -> bool:
    expected = get_response_log_probs(shared_model(), IDS, IDS)["log_probs"]
    return torch.equal(result["log_probs"], expected)


def exact_match(response: str, truth: str) -> dict[str, float]:
    correct = float(response == truth)
    return {"reward": correct, "format_reward": 1.0, "answer_reward": correct}


def nan_reward(response: str, truth: str) -> dict[str, float]:
    return {"reward": math.nan, "format_reward": 1.0, "answer_reward": 0.0}


def str_reward(response: str, truth: str) -> dict[str, object]:
    return {"reward": "1", "format_reward": 1.0, "answer_reward": 1.0}


def normalize(raw_rewards=REWARDS, group_size=2, **options):
    return compute_group_normalized_rewards(raw_rewards, group_size, **options)


def pg_loss(**overrides):
    """The GRPO clip loss on LOG_PROBS; ``overrides`` replace inputs."""
    inputs = {
        "raw_rewards_or_advantages": ADVANTAGES,
        "policy_log_probs": LOG_PROBS,
        "importance_reweighting_method": "grpo",
        "old_log_probs": LOG_PROBS,
        "cliprange": 0.2,
        "response_mask": MASK,
    }
    return compute_policy_gradient_loss(**{**inputs, **overrides})


def finite_where_masked_in(result: object) -> bool:
    per_token_loss, diagnostics = result
    finite = torch.isfinite(per_token_loss[MASK.bool()]).all()
    return bool(finite) and not has_non_finite(diagnostics)


def aggregate(loss=VALUES, mask=MASK, *args):
    return aggregate_loss_across_microbatch(loss, mask, *args)


def policy_batch() -> dict[str, torch.Tensor]:
    return tokenize(["ab", "ab"], ["c", "cd"])  # (2, 3) each


def update(**overrides):
    """policy_gradient_update on a fresh tiny model; ``overrides`` replace inputs."""
    model = tiny_model()
    inputs = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "gradient_accumulation_steps": 1,
        "max_grad_norm": 1.0,
        "batch": policy_batch(),
        "advantages": ADVANTAGES,
    }
    return policy_gradient_update(**{**inputs, **overrides})


def train_step(**overrides):
    """grpo_train_step on a fresh tiny model; ``overrides`` replace inputs."""
    model = tiny_model()
    inputs = {
        "model": model,
        "tokenizer": tokenizer(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "gradient_accumulation_steps": 1,
        "max_grad_norm": 1.0,
        "reward_fn": exact_match,
        "repeated_prompts": ["ab", "ab"],
        "rollout_responses": ["c", "d"],
        "repeated_ground_truths": ["c", "c"],
        "group_size": 2,
    }
    return grpo_train_step(**{**inputs, **overrides})


def stepped_with_finite_loss(result: object) -> bool:
    loss, metadata = result
    return bool(torch.isfinite(loss)) and metadata["optimizer_step"] == 1.0


def float_input_ids_batch() -> dict[str, torch.Tensor]:
    batch = policy_batch()
    return {**batch, "input_ids": batch["input_ids"].float()}


# ------------------------------------------------------------------ the cases


def text_cases() -> list[Case]:
    f = "tokenize_prompt_and_output"
    return [
        Case(f, "prompt is a str", partial(tokenize, "ab", "cd"), "prompt"),
        Case(f, "output is a str", partial(tokenize, ["a", "b"], "cd"), "output"),
        Case(f, "prompt is None", partial(tokenize, None, ["a"]), "prompt"),
        Case(f, "empty lists", partial(tokenize, [], []), "prompt"),
        Case(f, "lengths differ", partial(tokenize, ["a", "b"], ["c"]), "prompt"),
        Case(f, "an int prompt", partial(tokenize, [1], ["a"]), "prompt"),
        Case(f, "a None output", partial(tokenize, ["a"], [None]), "output"),
        Case(f, "empty texts", partial(tokenize, ["", ""], ["", ""]), "prompt"),
        Case(
            f, "unknown char, prompt", partial(tokenize, ["h\u00e9"], ["a"]), "prompt"
        ),
        Case(f, "unknown char, output", partial(tokenize, ["a"], ["\u00e9"]), "output"),
        Case(f, "tokenizer is an int", partial(tokenize, ["a"], ["b"], 0), "tokenizer"),
    ]


def id_list_cases() -> list[Case]:
    f = "pad_prompt_and_response_ids"
    rows = torch.tensor([[2, 3], [4, 5]])
    return [
        Case(f, "flat list of ints", partial(pad, [2, 3], [4, 5]), "prompt_ids"),
        Case(f, "response_ids flat", partial(pad, [[2], [3]], [4, 5]), "response_ids"),
        Case(f, "a (B, T) tensor", partial(pad, rows, rows), "prompt_ids"),
        Case(f, "1-D tensor rows", partial(pad, list(rows), list(rows)), "prompt_ids"),
        Case(f, "str rows", partial(pad, ["ab"], ["cd"]), "prompt_ids"),
        Case(f, "a float id", partial(pad, [[2.5, 3]], [[4]]), "prompt_ids"),
        Case(f, "a str id", partial(pad, [[2]], [["x"]]), "response_ids"),
        Case(f, "a None id", partial(pad, [[2, None]], [[3]]), "prompt_ids"),
        Case(f, "lengths differ", partial(pad, [[1]], [[2], [3]]), "prompt_ids"),
        Case(f, "empty lists", partial(pad, [], []), "prompt_ids"),
        Case(f, "one token in all", partial(pad, [[1]], [[]]), "prompt_ids"),
        Case(
            f,
            "pad_token_id None, padding needed",
            partial(pad, [[1, 2], [3]], [[4], [5]], None),
            "pad_token_id",
        ),
        Case(
            f,
            "pad_token_id a float",
            partial(pad, [[1, 2], [3]], [[4], [5]], 0.5),
            "pad_token_id",
        ),
        Case(
            f,
            "pad_token_id a str",
            partial(pad, [[1, 2], [3]], [[4], [5]], "0"),
            "pad_token_id",
        ),
        Case(
            f,
            "tuple rows",
            lambda: pad([(2,), (4,)], [(3,), ()])["labels"],
            expected=equals([[3], [0]]),
        ),
        Case(
            f,
            "tuple prompts, list responses",
            lambda: pad([(2, 3), (4,)], [[], [5]])["labels"],
            expected=equals([[3], [5]]),
        ),
    ]


def non_finite_masked_cases() -> list[Case]:
    cases = []
    for label, value in (("inf", math.inf), ("-inf", -math.inf), ("NaN", math.nan)):
        tensor = with_masked(value)
        cases += [
            Case(
                "masked_mean",
                f"{label} where masked out",
                partial(masked_mean, tensor, MASK),
                expected=equals(10 / 3),
            ),
            Case(
                "masked_mean",
                f"{label} where masked out, bool mask, dim=1",
                partial(masked_mean, tensor, MASK.bool(), dim=1),
                expected=equals([2.0, 6.0]),
            ),
            Case(
                "masked_normalize",
                f"{label} where masked out",
                partial(masked_normalize, tensor, MASK, 2.0),
                expected=equals(5.0),
            ),
            Case(
                "masked_normalize",
                f"{label} where masked out, float mask, dim=0",
                partial(masked_normalize, tensor, MASK.float(), 2.0, dim=0),
                expected=equals([0.5, 0.0, 4.5]),
            ),
        ]
    return cases


def reduction_cases() -> list[Case]:
    f, g = "masked_mean", "masked_normalize"
    return [
        Case(
            f,
            "bool mask",
            partial(masked_mean, VALUES, MASK.bool()),
            None,
            equals(10 / 3),
        ),
        Case(
            f,
            "float mask",
            partial(masked_mean, VALUES, MASK.float()),
            None,
            equals(10 / 3),
        ),
        Case(
            f,
            "int values",
            partial(masked_mean, VALUES.long(), MASK),
            None,
            equals(10 / 3),
        ),
        Case(
            f,
            "empty batch (NaN, as documented)",
            partial(masked_mean, torch.zeros(0, 3), torch.zeros(0, 3)),
            expected=equals(math.nan),
        ),
        Case(
            f, "mask shape differs", partial(masked_mean, VALUES, MASK[:, :2]), "mask"
        ),
        Case(f, "mask (B, 1)", partial(masked_mean, VALUES, MASK[:, :1]), "mask"),
        Case(f, "tensor a list", partial(masked_mean, VALUES.tolist(), MASK), "tensor"),
        Case(f, "mask a list", partial(masked_mean, VALUES, MASK.tolist()), "mask"),
        Case(f, "mask None", partial(masked_mean, VALUES, None), "mask"),
        Case(f, "dim out of range", partial(masked_mean, VALUES, MASK, dim=2), "dim"),
        Case(f, "dim a float", partial(masked_mean, VALUES, MASK, dim=1.0), "dim"),
        Case(f, "dim a str", partial(masked_mean, VALUES, MASK, dim="1"), "dim"),
        Case(
            g,
            "bool mask",
            partial(masked_normalize, VALUES, MASK.bool(), 2),
            None,
            equals(5.0),
        ),
        Case(
            g,
            "mask shape differs",
            partial(masked_normalize, VALUES, MASK.T, 2.0),
            "mask",
        ),
        Case(
            g,
            "tensor a list",
            partial(masked_normalize, VALUES.tolist(), MASK, 2.0),
            "tensor",
        ),
        Case(
            g,
            "dim out of range",
            partial(masked_normalize, VALUES, MASK, 2.0, dim=-3),
            "dim",
        ),
    ] + [
        Case(
            g,
            f"normalize_constant {value!r}",
            partial(masked_normalize, VALUES, MASK, value),
            "normalize_constant",
        )
        for value in (0, math.nan, math.inf, None, "2", True)
    ]


def entropy_cases() -> list[Case]:
    f = "compute_entropy"
    return [
        Case(f, "a scalar", partial(compute_entropy, torch.tensor(1.0)), "logits"),
        Case(
            f, "int logits", partial(compute_entropy, torch.ones(2, 3).long()), "logits"
        ),
        Case(
            f,
            "bool logits",
            partial(compute_entropy, torch.ones(2, 3).bool()),
            "logits",
        ),
        Case(f, "a list", partial(compute_entropy, [[0.0, 0.0]]), "logits"),
        Case(
            f, "empty vocabulary", partial(compute_entropy, torch.zeros(2, 0)), "logits"
        ),
        Case(
            f,
            "empty batch",
            partial(compute_entropy, torch.zeros(0, 4)),
            expected=lambda result: result.shape == (0,),
        ),
        Case(
            f,
            "-inf logits (masked tokens)",
            partial(compute_entropy, torch.tensor([0.0, 0.0, -math.inf])),
            expected=equals(math.log(2)),
        ),
    ]


def scoring_cases() -> list[Case]:
    negative = ids([2, -1, 4, 5], [6, 7, 8, 9])
    too_large = ids([2, 3, 4, VOCAB], [6, 7, 8, 9])
    cases = []
    for f, score in (
        ("get_response_log_probs", log_probs),
        ("get_response_log_probs (keyword extras)", scores),
    ):
        cases += [
            Case(f, "negative input id", partial(score, negative, IDS), "input_ids"),
            Case(
                f, "input id = vocab size", partial(score, too_large, IDS), "input_ids"
            ),
            Case(f, "float input ids", partial(score, IDS.float(), IDS), "input_ids"),
            Case(f, "bool input ids", partial(score, IDS.bool(), IDS), "input_ids"),
            Case(f, "input ids a list", partial(score, IDS.tolist(), IDS), "input_ids"),
            Case(f, "1-D ids and labels", partial(score, IDS[0], IDS[0]), "input_ids"),
            Case(
                f,
                "3-D ids and labels",
                partial(score, IDS[None], IDS[None]),
                "input_ids",
            ),
            Case(f, "empty batch", partial(score, IDS[:0], IDS[:0]), "input_ids"),
            Case(
                f, "no positions", partial(score, IDS[:, :0], IDS[:, :0]), "input_ids"
            ),
            Case(f, "labels a list", partial(score, IDS, IDS.tolist()), "labels"),
            Case(f, "labels shape differs", partial(score, IDS, IDS[:, :3]), "labels"),
            Case(f, "int32 labels", partial(score, IDS, IDS.int()), "labels"),
            Case(f, "float labels", partial(score, IDS, IDS.float()), "labels"),
            Case(f, "label -100", partial(score, IDS, IDS.clamp(max=-100)), "labels"),
            Case(f, "label = vocab size", partial(score, IDS, too_large), "labels"),
            Case(
                f,
                "int32 input ids",
                partial(score, IDS.int(), IDS),
                None,
                same_scores_as_int64,
            ),
        ]
    f = "get_response_log_probs"
    shared_negative = ids([-2, 3, 4, 5], [-2, 3, 8, 9])
    return [
        *cases,
        Case(
            f,
            "model a str",
            partial(get_response_log_probs, "qwen2", IDS, IDS),
            "model",
        ),
        Case(
            f,
            "negative input id, chunked head",
            partial(scores, negative, IDS, logits_chunk_size=2),
            "input_ids",
        ),
        Case(
            f,
            "negative input id, shared prefix",
            partial(scores, shared_negative, IDS, shared_prefix_length=1),
            "input_ids",
        ),
        Case(
            f, "temperature 0", partial(scores, IDS, IDS, temperature=0), "temperature"
        ),
        Case(
            f,
            "logits_chunk_size -1",
            partial(scores, IDS, IDS, logits_chunk_size=-1),
            "logits_chunk_size",
        ),
        Case(
            f,
            "shared_prefix_length = T",
            partial(scores, IDS, IDS, shared_prefix_length=4),
            "shared_prefix_length",
        ),
    ]


def prefix_cases() -> list[Case]:
    f, g = "prompt_only_columns", "split_at_prefix"
    return [
        Case(
            f,
            "1-D mask",
            partial(prompt_only_columns, torch.tensor([0, 1])),
            "response_mask",
        ),
        Case(
            f,
            "no columns",
            partial(prompt_only_columns, torch.zeros(2, 0)),
            "response_mask",
        ),
        Case(f, "a list", partial(prompt_only_columns, [[0, 1]]), "response_mask"),
        Case(
            f,
            "bool mask",
            partial(prompt_only_columns, torch.tensor([[False, True]])),
            expected=lambda result: result == 1,
        ),
        Case(
            f,
            "float mask",
            partial(prompt_only_columns, torch.tensor([[0.0, 0.0, 1.0]])),
            expected=lambda result: result == 2,
        ),
        Case(
            g,
            "labels shape differs",
            partial(split_at_prefix, IDS, IDS[:, :3], 2),
            "labels",
        ),
        Case(g, "1-D ids", partial(split_at_prefix, IDS[0], IDS[0], 1), "input_ids"),
    ]


def tokenizer_cases() -> list[Case]:
    f, g = "build_char_tokenizer", "build_bpe_tokenizer"
    return [
        Case(
            f,
            "encode an unknown character",
            lambda: build_char_tokenizer("abc").encode("abz"),
            "text",
        ),
        Case(
            f,
            "call on a batch with an unknown character",
            lambda: build_char_tokenizer("abc")(["ab", "\u00e9"]),
            "text",
        ),
        Case(f, "characters an int", partial(build_char_tokenizer, 123), "characters"),
        Case(
            f,
            "characters a list",
            partial(build_char_tokenizer, ["ab", "c"]),
            "characters",
        ),
        Case(
            g,
            "vocab_size a str",
            partial(build_bpe_tokenizer, vocab_size="512"),
            "vocab_size",
        ),
        Case(
            g,
            "vocab_size a float",
            partial(build_bpe_tokenizer, vocab_size=300.5),
            "vocab_size",
        ),
        Case(
            "tokenizer_training_corpus",
            "num_lines a float",
            partial(tokenizer_training_corpus, num_lines=2.5),
            "num_lines",
        ),
    ]


def advantage_cases() -> list[Case]:
    f, g = "compute_group_normalized_rewards", "compute_rollout_rewards"
    nan_rewards = torch.tensor([1.0, math.nan, 0.0, 1.0])
    return [
        # NaN is the reward of a response that could not be scored: by default it
        # makes its own group's advantages NaN (and the step stops before the
        # optimizer), never another group's; nan_rewards="ignore" drops it.
        Case(
            f,
            "a NaN reward",
            lambda: normalize(nan_rewards)[0],
            None,
            lambda result: bool(
                torch.isnan(result[:2]).all() and torch.isfinite(result[2:]).all()
            ),
        ),
        Case(
            f,
            "a NaN reward, ignored",
            lambda: normalize(nan_rewards, nan_rewards="ignore")[0],
            None,
            equals([0.0, 0.0, -0.7071, 0.7071]),
        ),
        Case(f, "rewards a list", partial(normalize, [1.0, 0.0]), "raw_rewards"),
        Case(
            f,
            "int rewards",
            lambda: normalize(REWARDS.long())[0],
            None,
            equals(REWARD_ADVANTAGES),
        ),
        Case(
            f,
            "bool rewards",
            lambda: normalize(REWARDS.bool())[0],
            None,
            equals(REWARD_ADVANTAGES),
        ),
        Case(f, "empty rewards", partial(normalize, REWARDS[:0]), "raw_rewards"),
        Case(
            f,
            "group_size 1, std normalizer",
            partial(normalize, group_size=1),
            "group_size",
        ),
        Case(f, "group_size a float", partial(normalize, group_size=2.0), "group_size"),
        Case(f, "group_size a bool", partial(normalize, group_size=True), "group_size"),
        Case(
            f,
            "group_size 3 for 4 rewards",
            partial(normalize, group_size=3),
            "group_size",
        ),
        Case(
            f,
            "advantage_eps < 0",
            partial(normalize, advantage_eps=-1.0),
            "advantage_eps",
        ),
        Case(
            f,
            "advantage_eps NaN",
            partial(normalize, advantage_eps=math.nan),
            "advantage_eps",
        ),
        Case(f, "baseline typo", partial(normalize, baseline="Mean"), "baseline"),
        Case(
            g,
            "responses a str",
            partial(compute_rollout_rewards, exact_match, "ab", ["a", "b"]),
            "rollout_responses",
        ),
        Case(
            g,
            "a NaN reward",
            # passed through at its index for nan_rewards to handle (see above)
            lambda: compute_rollout_rewards(nan_reward, ["a", "b"], ["a", "b"])[0],
            None,
            lambda result: bool(torch.isnan(result).all()) and result.shape == (2,),
        ),
        Case(
            g,
            "a str reward",
            partial(compute_rollout_rewards, str_reward, ["a"], ["a"]),
            "reward_fn",
        ),
        Case(
            g,
            "reward_fn None",
            partial(compute_rollout_rewards, None, ["a"], ["a"]),
            "reward_fn",
        ),
        Case(
            g,
            "empty lists",
            partial(compute_rollout_rewards, exact_match, [], []),
            "rollout_responses",
        ),
    ]


def loss_cases() -> list[Case]:
    f, g = "compute_policy_gradient_loss", "aggregate_loss_across_microbatch"
    return [
        Case(
            f,
            "-inf old log-probs where masked out",
            partial(pg_loss, old_log_probs=with_masked(-math.inf, LOG_PROBS)),
            expected=finite_where_masked_in,
        ),
        Case(f, "cliprange NaN", partial(pg_loss, cliprange=math.nan), "cliprange"),
        Case(
            f,
            "policy_log_probs a list",
            partial(pg_loss, policy_log_probs=LOG_PROBS.tolist()),
            "policy_log_probs",
        ),
        Case(
            f,
            "advantages a list",
            partial(pg_loss, raw_rewards_or_advantages=[1.0, -1.0]),
            "raw_rewards_or_advantages",
        ),
        Case(
            f,
            "method typo",
            partial(pg_loss, importance_reweighting_method="GRPO"),
            "importance_reweighting_method",
        ),
        Case(
            g,
            "inf where masked out",
            partial(aggregate, with_masked(math.inf)),
            expected=equals(4.0),  # row means [2, 6]
        ),
        Case(
            g,
            "NaN where masked out, constant",
            partial(aggregate, with_masked(math.nan), MASK, "constant", 2),
            expected=equals(5.0),
        ),
        Case(
            g,
            "normalization_constant NaN",
            partial(aggregate, VALUES, MASK, "constant", math.nan),
            "normalization_constant",
        ),
        Case(
            g,
            "normalization_constant inf",
            partial(aggregate, VALUES, MASK, "constant", math.inf),
            "normalization_constant",
        ),
        Case(
            g,
            "empty batch",
            partial(aggregate, torch.zeros(0, 3), torch.zeros(0, 3)),
            "per_token_policy_gradient_loss",
        ),
        Case(g, "mask a list", partial(aggregate, VALUES, MASK.tolist()), "mask"),
        Case(
            g, "bool mask", partial(aggregate, VALUES, MASK.bool()), None, equals(4.0)
        ),
    ]


def train_step_cases() -> list[Case]:
    f, g = "grpo_train_step", "policy_gradient_update"
    nan_where_masked_out = torch.zeros(2, 3)
    nan_where_masked_out[0, 2] = math.nan  # row 0 is "ab" + "c": its label 3 is pad
    return [
        Case(
            f,
            "prompts a str",
            partial(train_step, repeated_prompts="ab"),
            "repeated_prompts",
        ),
        Case(
            f, "group_size a float", partial(train_step, group_size=2.0), "group_size"
        ),
        Case(
            f,
            "gradient_accumulation_steps a float",
            partial(train_step, gradient_accumulation_steps=1.5),
            "gradient_accumulation_steps",
        ),
        Case(
            f,
            "max_grad_norm < 0",
            partial(train_step, max_grad_norm=-1.0),
            "max_grad_norm",
        ),
        Case(
            f,
            "max_grad_norm NaN",
            partial(train_step, max_grad_norm=math.nan),
            "max_grad_norm",
        ),
        Case(
            g,
            "float input ids",
            lambda: update(batch=float_input_ids_batch()),
            "input_ids",
        ),
        Case(
            g,
            "NaN old log-probs where masked out",
            partial(
                update,
                importance_reweighting_method="grpo",
                cliprange=0.2,
                old_log_probs=nan_where_masked_out,
            ),
            expected=stepped_with_finite_loss,
        ),
        Case(
            g,
            "advantages a list",
            partial(update, advantages=[1.0, -1.0]),
            "advantages",
        ),
        Case(
            g, "batch missing keys", partial(update, batch={"input_ids": IDS}), "batch"
        ),
    ]


# ------------------------------------------------------------------ the newer API


def kl(policy=LOG_PROBS, reference=LOG_PROBS, estimator="k3"):
    return compute_kl_penalty(policy, reference, estimator)


def kl_cases() -> list[Case]:
    f, g = "compute_kl_penalty", "check_kl_settings"
    return (
        [
            Case(f, "estimator typo", partial(kl, estimator="K3"), "estimator"),
            Case(f, "estimator None", partial(kl, estimator=None), "estimator"),
            Case(
                f,
                "reference shape differs",
                partial(kl, reference=LOG_PROBS[:, :2]),
                "reference_log_probs",
            ),
            Case(
                f,
                "policy a list",
                partial(kl, policy=LOG_PROBS.tolist()),
                "policy_log_probs",
            ),
            Case(
                f, "reference None", partial(kl, reference=None), "reference_log_probs"
            ),
            Case(
                f,
                "int log-probs",
                partial(kl, policy=LOG_PROBS.long()),
                "policy_log_probs",
            ),
            Case(f, "equal policies", kl, expected=equals(torch.zeros(2, 3))),
            Case(
                f,
                "bfloat16 inputs: float32 result",
                lambda: kl(LOG_PROBS.bfloat16(), LOG_PROBS.bfloat16(), "k1").dtype,
                expected=lambda dtype: dtype == torch.float32,
            ),
            # exp(-1) - (-1) - 1 = e^-1 for log r = -1 (policy -1, reference -2)
            Case(
                f,
                "k3 by hand",
                lambda: kl(torch.tensor([[-1.0]]), torch.tensor([[-2.0]])),
                expected=equals([[math.exp(-1)]]),
            ),
        ]
        + [
            Case(
                g,
                f"kl_coef {value!r}",
                partial(check_kl_settings, value, "k3"),
                "kl_coef",
            )
            for value in (-0.1, math.nan, math.inf, "0.1", True, None)
        ]
        + [
            Case(
                g,
                "kl_estimator typo",
                partial(check_kl_settings, 0.1, "k4"),
                "kl_estimator",
            ),
        ]
    )


SAMPLER = LOG_PROBS - 0.1  # (2, 3): rho = e^0.1 on every token


def weights(mode="token_truncate", trainer=LOG_PROBS, sampler=SAMPLER, **options):
    return sampler_correction_weights(trainer, sampler, MASK, mode=mode, **options)


def sampler_cases() -> list[Case]:
    f, g = "sampler_correction_weights", "correction_weights"
    nan_sampler = SAMPLER.clone()
    nan_sampler[0, 0] = math.nan  # a response token the sampler did not score
    return [
        Case(f, "mode typo", partial(weights, "TIS"), "mode"),
        Case(f, "cap 0", partial(weights, cap=0.0), "cap"),
        Case(f, "cap NaN", partial(weights, cap=math.nan), "cap"),
        Case(f, "cap a str", partial(weights, cap="3"), "cap"),
        Case(f, "low < 0", partial(weights, "token_mask", low=-1.0), "low"),
        Case(f, "high 0", partial(weights, "token_mask", high=0.0), "high"),
        Case(f, "low = high", partial(weights, "token_mask", low=2.0, high=2.0), "low"),
        Case(
            f,
            "trainer a list",
            partial(weights, trainer=LOG_PROBS.tolist()),
            "trainer_log_probs",
        ),
        Case(
            f,
            "sampler shape differs",
            partial(weights, sampler=SAMPLER[:, :2]),
            "sampler_log_probs",
        ),
        Case(
            f,
            "mask 1-D",
            lambda: sampler_correction_weights(
                LOG_PROBS, SAMPLER, MASK[0], mode="token_mask"
            ),
            "response_mask",
        ),
        Case(
            f,
            "NaN sampler log-prob on a response token",
            partial(weights, sampler=nan_sampler, cap=1.0),
            "sampler_log_probs",
        ),
        Case(
            "sampler_weights",
            "NaN sampler log-prob on a response token: rho 1 there (TRL)",
            lambda: sampler_weights(
                LOG_PROBS, nan_sampler, MASK, "token_truncate", 1.0, 0.0, 3.0
            )[0],
            expected=equals(MASK.float()),
        ),
        Case(
            f,
            "-inf sampler log-prob where masked out",
            lambda: weights(sampler=with_masked(-math.inf, SAMPLER), cap=1.0)[0],
            expected=equals(MASK.float()),
        ),
        Case(
            f,
            "rho above the mask's high: weight 0",
            lambda: weights("token_mask", high=1.05)[0],
            expected=equals(torch.zeros(2, 3)),
        ),
        Case(
            g,
            "mode typo",
            lambda: correction_weights(LOG_PROBS, SAMPLER, MASK, mode="mask"),
            "mode",
        ),
        Case(
            "sampler_log_prob_gap",
            "every sampler log-prob NaN: nothing to measure",
            lambda: sampler_log_prob_gap(LOG_PROBS, torch.full((2, 3), math.nan), MASK),
            expected=lambda result: (
                result
                == {"sampler_log_prob_diff_mean": 0.0, "sampler_log_prob_diff_max": 0.0}
            ),
        ),
    ]


ENTROPY = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # masked in: 1, 3, 6


def objective_cases() -> list[Case]:
    f, g, h = (
        "compute_policy_gradient_loss",
        "high_entropy_mask",
        "microbatch_loss_scale",
    )
    nan_entropy = ENTROPY.clone()
    nan_entropy[0, 0] = math.nan
    only_last = torch.tensor([[False, False, False], [False, False, True]])
    return [
        Case(
            f,
            "gspo without a response mask",
            partial(pg_loss, importance_reweighting_method="gspo", response_mask=None),
            "response_mask",
        ),
        Case(
            f,
            "cliprange_high < 0",
            partial(pg_loss, cliprange_high=-0.1),
            "cliprange_high",
        ),
        Case(
            f, "ratio_cap below the clip", partial(pg_loss, ratio_cap=1.1), "ratio_cap"
        ),
        Case(
            f,
            "sapo temperature 0",
            partial(
                pg_loss, importance_reweighting_method="sapo", sapo_temperature_pos=0.0
            ),
            "sapo_temperature_pos",
        ),
        Case(
            f,
            "gmpo without cliprange",
            partial(pg_loss, importance_reweighting_method="gmpo", cliprange=None),
            "cliprange",
        ),
        Case(
            f,
            "cispo old log-probs a list",
            partial(
                pg_loss,
                importance_reweighting_method="cispo",
                old_log_probs=LOG_PROBS.tolist(),
            ),
            "old_log_probs",
        ),
        Case(
            f,
            "gspo old log-probs shape differs",
            partial(
                pg_loss,
                importance_reweighting_method="gspo",
                old_log_probs=LOG_PROBS[:, :2],
            ),
            "old_log_probs",
        ),
        Case(
            f,
            "gmpo -inf old log-probs where masked out",
            partial(
                pg_loss,
                importance_reweighting_method="gmpo",
                old_log_probs=with_masked(-math.inf, LOG_PROBS),
            ),
            expected=finite_where_masked_in,
        ),
        # NaN entropy: never kept, and left out of the threshold (its rule):
        # the finite masked-in entropies are 3 and 6, the median 4.5 keeps 6.
        Case(
            g,
            "one NaN entropy, quantile 0.5",
            partial(high_entropy_mask, nan_entropy, MASK, 0.5),
            expected=lambda result: torch.equal(result, only_last),
        ),
        Case(
            g,
            "every entropy NaN: no token",
            partial(high_entropy_mask, torch.full((2, 3), math.nan), MASK, 0.5),
            expected=lambda result: not result.any(),
        ),
        Case(
            g,
            "NaN entropy where masked out",
            partial(high_entropy_mask, with_masked(math.nan, ENTROPY), MASK, 0.5),
            expected=lambda result: torch.equal(
                result, torch.tensor([[False, False, True], [False, False, True]])
            ),
        ),
        Case(
            g, "quantile 0", partial(high_entropy_mask, ENTROPY, MASK, 0.0), "quantile"
        ),
        Case(
            g,
            "quantile 1.5",
            partial(high_entropy_mask, ENTROPY, MASK, 1.5),
            "quantile",
        ),
        Case(
            g,
            "quantile NaN",
            partial(high_entropy_mask, ENTROPY, MASK, math.nan),
            "quantile",
        ),
        Case(
            g,
            "entropy shape differs",
            partial(high_entropy_mask, ENTROPY[:, :2], MASK, 0.5),
            "token_entropy",
        ),
        Case(
            g,
            "entropy a list",
            partial(high_entropy_mask, ENTROPY.tolist(), MASK, 0.5),
            "token_entropy",
        ),
        Case(
            h,
            "batch_rows 0",
            partial(microbatch_loss_scale, "sequence", 2, 0),
            "batch_rows",
        ),
        Case(
            h,
            "microbatch_rows above batch_rows",
            partial(microbatch_loss_scale, "sequence", 8, 4),
            "microbatch_rows",
        ),
        Case(
            h,
            "microbatch_rows -1",
            partial(microbatch_loss_scale, "sequence", -1, 4),
            "microbatch_rows",
        ),
        # 4 of 4 rows: weight 4 / 4
        Case(
            h,
            "every row: weight 1",
            partial(microbatch_loss_scale, "sequence", 4, 4),
            expected=lambda result: result == 1.0,
        ),
        Case(
            h,
            "normalization typo",
            partial(microbatch_loss_scale, "tokens", 2, 4),
            "loss_normalization",
        ),
        Case(
            h,
            "batch_tokens < 0",
            partial(
                microbatch_loss_scale,
                "token",
                2,
                4,
                microbatch_tokens=0,
                batch_tokens=-1,
            ),
            "batch_tokens",
        ),
        Case(
            h,
            "batch_tokens below the microbatch's",
            partial(
                microbatch_loss_scale,
                "token",
                2,
                4,
                microbatch_tokens=5,
                batch_tokens=3,
            ),
            "batch_tokens",
        ),
        Case(
            h,
            "microbatch_tokens None",
            partial(microbatch_loss_scale, "token", 2, 4, batch_tokens=3),
            "microbatch_tokens",
        ),
        Case(
            h,
            "no token in the batch: scale 0",
            partial(
                microbatch_loss_scale,
                "token",
                2,
                4,
                microbatch_tokens=0,
                batch_tokens=0,
            ),
            expected=lambda result: result == 0.0,
        ),
    ]


def verl(info=None, mode="token-mean", loss=VALUES, mask=MASK):
    return aggregate_like_verl(loss, mask, mode, info)


def verl_cases() -> list[Case]:
    f = "aggregate_like_verl"
    counts = {"global_batch_size": 4, "batch_num_tokens": 6}
    cases = [
        Case(
            f,
            f"dp_size {value!r}",
            partial(verl, {**counts, "dp_size": value}),
            "dp_size",
        )
        for value in (0, -1, "2", 1.5, True)
    ]
    return [
        *cases,
        Case(
            f,
            "batch_num_tokens 0",
            partial(verl, {"global_batch_size": 4, "batch_num_tokens": 0}),
            "batch_num_tokens",
        ),
        Case(
            f,
            "global_batch_size 0",
            partial(
                verl,
                {"global_batch_size": 0, "batch_num_tokens": 6},
                "seq-mean-token-mean",
            ),
            "global_batch_size",
        ),
        Case(
            f,
            "batch_num_tokens below the micro-batch's 3",
            partial(verl, {"global_batch_size": 4, "batch_num_tokens": 2}),
            "batch_num_tokens",
        ),
        Case(
            f,
            "dp_size 2 without global counts",
            partial(verl, {"dp_size": 2}),
            "global_batch_info",
        ),
        Case(f, "mode typo", partial(verl, counts, "token_mean"), "loss_agg_mode"),
        Case(
            f,
            "loss_scale_factor 0",
            partial(
                verl, {**counts, "loss_scale_factor": 0}, "seq-mean-token-sum-norm"
            ),
            "loss_scale_factor",
        ),
        Case(
            f,
            "mask shape differs",
            partial(verl, counts, mask=MASK[:, :2]),
            "response_mask",
        ),
        Case(
            f,
            "loss a list",
            partial(verl, counts, loss=VALUES.tolist()),
            "per_token_loss",
        ),
        # token mean 10 / 3 x n / N = 3 / 6 x D = 2
        Case(
            f,
            "dp_size 2, global counts",
            partial(verl, {**counts, "dp_size": 2}),
            expected=equals(10 / 3),
        ),
        Case(f, "no global counts: this micro-batch's", verl, expected=equals(10 / 3)),
    ]


def rollouts_of(rewards: list[float], group_size: int = 2) -> tuple[Rollouts, list]:
    responses = [str(index) for index in range(len(rewards))]
    rollouts = Rollouts(
        prompts=["p"] * len(rewards),
        responses=responses,
        prompt_token_ids=None,
        response_token_ids=None,
    )
    return rollouts, [f"example {i}" for i in range(len(rewards) // group_size)]


def collect(rewards=(1.0, 0.0), max_rounds=2, grade=None, examples=None):
    def sample(round_):
        rollouts, found = rollouts_of(list(rewards))
        return rollouts, found if examples is None else examples

    def graded(rollouts, found):
        return [{"reward": r} for r in rewards]

    return collect_groups_with_signal(sample, grade or graded, 2, max_rounds)


def dynamic_sampling_cases() -> list[Case]:
    f, g = "groups_with_signal", "collect_groups_with_signal"
    nan_rewards = torch.tensor([1.0, math.nan, 1.0, 0.0, 0.0, 1.0])
    return [
        Case(
            f, "rewards a list", partial(groups_with_signal, [1.0, 0.0], 2), "rewards"
        ),
        Case(f, "group_size 0", partial(groups_with_signal, REWARDS, 0), "group_size"),
        Case(
            f, "group_size 2.0", partial(groups_with_signal, REWARDS, 2.0), "group_size"
        ),
        Case(
            f,
            "group_size True",
            partial(groups_with_signal, REWARDS, True),
            "group_size",
        ),
        Case(
            f,
            "group_size 3 for 4",
            partial(groups_with_signal, REWARDS, 3),
            "group_size",
        ),
        Case(
            f,
            "rewards 2-D",
            partial(groups_with_signal, REWARDS.reshape(2, 2), 2),
            "rewards",
        ),
        # group 0: finite rewards 1, 1 (no signal); group 1: 0, 0, 1
        Case(
            f,
            "NaN rewards are left out",
            partial(groups_with_signal, nan_rewards, 3),
            expected=lambda result: result.tolist() == [1],
        ),
        Case(g, "max_rounds 0", partial(collect, max_rounds=0), "max_rounds"),
        Case(g, "max_rounds 1.0", partial(collect, max_rounds=1.0), "max_rounds"),
        Case(g, "sample returns no example", partial(collect, examples=[]), "sample"),
        Case(
            g,
            "grade returns too few dicts",
            partial(collect, grade=lambda rollouts, found: [{"reward": 1.0}]),
            "grade",
        ),
        Case(
            g,
            "grade returns dicts without a reward",
            partial(collect, grade=lambda rollouts, found: [{"score": 1}] * 2),
            "grade",
        ),
        Case(
            g,
            "one group with signal",
            lambda: (
                collect().sampling_metrics["rollout/kept_group_fraction"]
                if False
                else collect()[0].sampling_metrics["rollout/kept_group_fraction"]
            ),
            expected=lambda result: result == 1.0,
        ),
        Case(
            "replay_reward_fn",
            "one call too many",
            lambda: [
                replay(r, "t")
                for replay in [replay_reward_fn([{"r": 1}], ["a"])]
                for r in "aa"
            ],
            "response",
        ),
    ]


def overlong_cases() -> list[Case]:
    f, g, h = "soft_overlong_punishment", "shape_reward_results", "mask_truncated"
    lengths = torch.tensor([3, 5, 7, 9])
    result = {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}
    flags = torch.tensor([False, True])
    return (
        [
            Case(
                f,
                "buffer 0",
                partial(soft_overlong_punishment, lengths, 8, 0),
                "buffer",
            ),
            Case(
                f,
                "buffer 2.5",
                partial(soft_overlong_punishment, lengths, 8, 2.5),
                "buffer",
            ),
            Case(
                f,
                "buffer above max_length",
                partial(soft_overlong_punishment, lengths, 8, 9),
                "buffer",
            ),
            Case(
                f,
                "max_length 0",
                partial(soft_overlong_punishment, lengths, 0, 1),
                "max_length",
            ),
            Case(
                f,
                "lengths a list",
                partial(soft_overlong_punishment, [3, 5], 8, 4),
                "lengths",
            ),
            Case(
                f,
                "lengths 2-D",
                partial(soft_overlong_punishment, lengths.reshape(2, 2), 8, 4),
                "lengths",
            ),
            # start 8 - 4 = 4: 3 -> 0, 5 -> -1/4, 7 -> -3/4, 9 (> 8) -> -1
            Case(
                f,
                "by hand",
                partial(soft_overlong_punishment, lengths, 8, 4),
                expected=equals([0.0, -0.25, -0.75, -1.0]),
            ),
        ]
        + [
            Case(
                g,
                f"penalty {value!r}",
                partial(
                    shape_reward_results,
                    [result],
                    [7],
                    max_length=8,
                    buffer=4,
                    penalty=value,
                ),
                "penalty",
            )
            for value in (-1.0, math.nan, math.inf, "1")
        ]
        + [
            Case(
                g,
                "fewer lengths than results",
                partial(
                    shape_reward_results,
                    [result, result],
                    [7],
                    max_length=8,
                    buffer=4,
                    penalty=1.0,
                ),
                "lengths",
            ),
            # 7 tokens: -3/4 x 0.5 = -0.375
            Case(
                g,
                "penalty 0.5 by hand",
                lambda: shape_reward_results(
                    [result], [7], max_length=8, buffer=4, penalty=0.5
                )[0]["reward"],
                expected=lambda reward: reward == 0.625,
            ),
            Case(
                h,
                "truncated float",
                partial(mask_truncated, MASK, flags.float()),
                "truncated",
            ),
            Case(
                h,
                "truncated a list",
                partial(mask_truncated, MASK, [False, True]),
                "truncated",
            ),
            Case(
                h,
                "truncated shape differs",
                partial(mask_truncated, MASK, torch.tensor([True])),
                "truncated",
            ),
            Case(
                "truncation_metrics",
                "truncated int",
                partial(truncation_metrics, [1, 2], torch.tensor([0, 1])),
                "truncated",
            ),
            Case(
                "truncation_metrics",
                "lengths and flags differ",
                partial(truncation_metrics, [1, 2, 3], flags),
                "truncated",
            ),
            Case(
                "truncation_metrics",
                "no response",
                partial(truncation_metrics, [], torch.zeros(0, dtype=torch.bool)),
                "truncated",
            ),
            Case(
                "truncated_rows",
                "lengths differ",
                partial(
                    truncated_rows,
                    ["a", "b"],
                    None,
                    [1],
                    eos_token_ids=[1],
                    stop_strings=[],
                    max_new_tokens=2,
                ),
                "lengths",
            ),
        ]
        + [
            Case(
                "check_overlong_settings",
                bad_input,
                partial(check_overlong_settings, *arguments),
                argument,
            )
            for bad_input, arguments, argument in (
                ("negative penalty", (False, 4, -0.5, 8), "overlong_penalty"),
                ("buffer 0", (False, 0, 1.0, 8), "overlong_buffer"),
                ("buffer above max_new_tokens", (False, 9, 1.0, 8), "overlong_buffer"),
                (
                    "mask flag a str",
                    ("yes", None, 1.0, 8),
                    "mask_truncated_completions",
                ),
            )
        ]
    )


def far_below(n: int, c: int, k: int) -> float:
    """pass@k from the sum of the k log-factors log(1 - c / (n - j))."""
    return -math.expm1(math.fsum(math.log1p(-c / (n - j)) for j in range(k)))


def evaluation_cases() -> list[Case]:
    f, g = "pass_at_k", "pass_at_k_curve"
    n, c, k = 10**9, 10**5, 10**4  # both counts past the exact product: closed form
    none_correct = 1.0
    for j in range(k):  # the k-factor product, exact to ~1e-12
        none_correct *= 1.0 - c / (n - j)
    return [
        Case(f, "n True", partial(pass_at_k, True, 0, 1), "n"),
        Case(f, "c above n", partial(pass_at_k, 4, 5, 1), "c"),
        Case(f, "k 0", partial(pass_at_k, 4, 1, 0), "k"),
        Case(f, "k a float", partial(pass_at_k, 4, 1, 2.0), "k"),
        Case(
            f,
            "n = 10**9, c = 10**5, k = 10**4 (no loop over n)",
            partial(pass_at_k, n, c, k),
            expected=lambda result: abs(result - (1 - none_correct)) < 1e-9,
        ),
        Case(
            f,
            "n = 10**18",
            partial(pass_at_k, 10**18, 10**12, 10**4),
            expected=lambda result: (
                abs(result - far_below(10**18, 10**12, 10**4)) < 1e-10
            ),
        ),
        Case(g, "n = 10**9", partial(pass_at_k_curve, [1], 10**9), "n"),
        Case(g, "a count above n", partial(pass_at_k_curve, [5], 4), "correct_counts"),
        Case(
            g, "a negative count", partial(pass_at_k_curve, [-1], 4), "correct_counts"
        ),
        Case(g, "a str count", partial(pass_at_k_curve, ["1"], 4), "correct_counts"),
        Case(g, "no prompt", partial(pass_at_k_curve, [], 4), "correct_counts"),
        # pass@k of [0, 1, 4] correct of 4: (0 + k/4 + 1) / 3
        Case(
            g,
            "by hand",
            partial(pass_at_k_curve, [0, 1, 4], 4),
            expected=lambda curve: (
                curve == pytest.approx([(0 + k / 4 + 1) / 3 for k in range(1, 5)])
            ),
        ),
        Case(
            "held_out_scores",
            "no example",
            partial(held_out_scores, None, None, [], None),
            "examples",
        ),
        Case(
            "correct_counts",
            "no example",
            partial(correct_counts, None, None, [], 4, None),
            "examples",
        ),
        Case(
            "correct_counts",
            "n 0",
            partial(correct_counts, None, None, ["example"], 0, None),
            "n",
        ),
    ]


def door_cases() -> list[Case]:
    """Values a door reads once: log-probs, masks, lengths, counts, types."""
    positive = LOG_PROBS.abs()  # (2, 3): log-probs above 0
    nan_policy = LOG_PROBS.clone()
    nan_policy[1, 2] = math.nan
    inf_reference = LOG_PROBS.clone()
    inf_reference[0, 0] = math.inf
    inf_trainer = LOG_PROBS.clone()
    inf_trainer[0, 0] = math.inf  # a response token: rho = inf before the cap
    f, g = "compute_kl_penalty", "sampler_correction_weights"
    tool = CalculatorTool()
    return [
        Case(
            f,
            "positive policy log-probs",
            partial(kl, policy=positive),
            "policy_log_probs",
        ),
        Case(
            f, "NaN policy log-prob", partial(kl, policy=nan_policy), "policy_log_probs"
        ),
        Case(
            f,
            "+inf reference log-prob",
            partial(kl, reference=inf_reference),
            "reference_log_probs",
        ),
        # log r = -1 - (-201) = 200: exp(200) is past float32's largest (e^88.7)
        Case(
            f,
            "k3 at log-ratio 200 in float32",
            lambda: kl(torch.tensor([[-201.0]]), torch.tensor([[-1.0]])),
            "reference_log_probs",
        ),
        # float64 holds it: exp(200) - 200 - 1
        Case(
            f,
            "k3 at log-ratio 200 in float64: finite",
            lambda: kl(
                torch.tensor([[-201.0]]).double(), torch.tensor([[-1.0]]).double()
            ),
            expected=lambda result: bool(
                torch.isclose(
                    result, torch.tensor([[math.exp(200) - 201]], dtype=torch.float64)
                )
            ),
        ),
        Case(
            f,
            "meta-device tensors",
            partial(kl, policy=LOG_PROBS.to("meta"), reference=LOG_PROBS.to("meta")),
            "policy_log_probs",
        ),
        Case(g, "mask of 0.5", partial(weights_with_mask, MASK * 0.5), "response_mask"),
        Case(
            g,
            "+inf trainer log-prob on a response token",
            partial(weights, trainer=inf_trainer),
            "trainer_log_probs",
        ),
        Case(
            g,
            "meta-device trainer log-probs",
            partial(weights, trainer=LOG_PROBS.to("meta")),
            "trainer_log_probs",
        ),
        Case(
            "replay_reward_fn",
            "no results for one response",
            partial(replay_reward_fn, [], ["a"]),
            "responses",
        ),
        Case(
            "collect_groups_with_signal",
            "group_size 0",
            partial(collect_groups_with_signal, None, None, 0, 3),
            "group_size",
        ),
        Case(
            "soft_overlong_punishment",
            "a negative length",
            partial(soft_overlong_punishment, torch.tensor([-5, 3]), 10, 4),
            "lengths",
        ),
        Case(
            "soft_overlong_punishment",
            "a NaN length",
            partial(soft_overlong_punishment, torch.tensor([math.nan, 3.0]), 10, 4),
            "lengths",
        ),
        Case(
            "is_truncated",
            "max_new_tokens 0",
            partial(
                is_truncated,
                [1, 2],
                "ab",
                2,
                eos_token_ids=[0],
                stop_strings=[],
                max_new_tokens=0,
            ),
            "max_new_tokens",
        ),
        Case(
            "to_trl_config",
            "a dict, not a TrainConfig",
            partial(to_trl_config, {"lr": 1e-3}),
            "config",
        ),
        Case(
            "CalculatorTool.call_arguments",
            "None",
            partial(tool.call_arguments, None),
            "segment_text",
        ),
        # The tool reads ASCII digits only: other scripts' digits are no numbers.
        Case(
            "CalculatorTool.run",
            "Arabic-Indic digits",
            lambda: tool.run("\u0663+\u0664"),
            expected=lambda reply: reply.error,
        ),
        Case(
            "CalculatorTool.run",
            "mathematical-bold digits",
            lambda: tool.run("\U0001d7d1+\U0001d7d2"),
            expected=lambda reply: reply.error,
        ),
        Case(
            "CalculatorTool.run",
            "ASCII digits",
            lambda: tool.run("3+4"),
            expected=lambda reply: (reply.text, reply.error) == ("7", False),
        ),
        # A ground truth that hedges accepts neither side alone (rule 5, no worker).
        Case(
            "grade_math_answer",
            "ground truth 4 \\approx 5 against 4",
            lambda: grade_math_answer("4", "4 \\approx 5", grader=NO_GRADER),
            expected=lambda grade: not grade.equal,
        ),
    ]


def weights_with_mask(mask: torch.Tensor):
    return sampler_correction_weights(LOG_PROBS, SAMPLER, mask, mode="token_truncate")


class _NoGrader:
    """A MathGrader stand-in that fails the test if a verdict reaches it."""

    def grade(self, answer: str, ground_truth: str):
        raise AssertionError(f"the worker was asked: {answer!r} vs {ground_truth!r}")


NO_GRADER = _NoGrader()


OWN_CASES = (
    text_cases()
    + id_list_cases()
    + non_finite_masked_cases()
    + reduction_cases()
    + entropy_cases()
    + scoring_cases()
    + prefix_cases()
    + tokenizer_cases()
)
OTHER_CASES = advantage_cases() + loss_cases() + train_step_cases()
NEWER_CASES = (
    kl_cases()
    + sampler_cases()
    + objective_cases()
    + verl_cases()
    + dynamic_sampling_cases()
    + overlong_cases()
    + evaluation_cases()
    + door_cases()
)
CASES = OWN_CASES + OTHER_CASES + NEWER_CASES
# Cases the functions under them do not handle yet; the expected outcome is the
# one the case states (a clear error naming ``argument``, or ``expected``).
OPEN_CASES = frozenset({})


def test_case_names_are_unique_and_open_cases_exist():
    names = Counter(case.name for case in CASES)
    assert [name for name, count in names.items() if count > 1] == []
    assert set(names) >= OPEN_CASES


def test_the_classifier_tells_the_classes_apart():
    def refuse(message: str):
        raise ValueError(message)

    examples = {
        CLEAR: Case("f", "a", partial(refuse, "mask must be 2-D, got 1-D"), "mask"),
        OBSCURE: Case(
            "f", "b", partial(refuse, "response_mask must be 2-D, got 1"), "mask"
        ),
        SILENT_NAN: Case("f", "c", lambda: {"x": torch.tensor([0.0, math.inf])}, "x"),
        SILENT_WRONG: Case("f", "d", lambda: torch.tensor(0.0), None, equals(1.0)),
        CORRECT: Case("f", "e", lambda: torch.tensor(1.0), None, equals(1.0)),
    }
    assert {name: classify(case)[0] for name, case in examples.items()} == {
        name: name for name in examples
    }
    assert classify(Case("f", "g", partial(len, 3), "x"))[0] == OBSCURE  # TypeError


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            case,
            id=case.name,
            marks=pytest.mark.xfail(strict=True, reason="not handled yet")
            if case.name in OPEN_CASES
            else (),
        )
        for case in CASES
    ],
)
def test_bad_input_gets_a_clear_error_or_a_correct_result(case):
    outcome, detail = classify(case)
    assert outcome == (CLEAR if case.argument is not None else CORRECT), detail


def print_audit_table(cases: list[Case] = CASES) -> None:
    """One row of outcome counts per function: ``python tests/test_bad_inputs.py``."""
    print("| function | " + " | ".join(CLASSES) + " |")
    print("|---" * (len(CLASSES) + 1) + "|")
    for function, counts in audit_table(cases).items():
        print(f"| {function} | " + " | ".join(str(counts[c]) for c in CLASSES) + " |")


if __name__ == "__main__":
    print_audit_table()


# ------------------------------------------------------------------ the CLI

# A run that finishes in about a second: no warm-up, a 1-layer model, 16 rollouts.
TINY_RUN = [
    "--profile", "cpu", "--tiny-hidden-size", "32", "--tiny-num-layers", "1",
    "--tiny-intermediate-size", "64", "--task-options", '{"n_digits": 3}',
    "--max-new-tokens", "5", "--steps", "1", "--rollout-batch-size", "16",
    "--group-size", "4", "--train-batch-size", "16", "--eval-size", "4",
    "--eval-every", "0", "--sft-max-steps", "0", "--checkpoint-every", "0",
    "--no-progress",
]  # fmt: skip


def reward_once(value: float, index: int = 5):
    """ReverseTask.reward_fn, returning ``value`` as the reward of call ``index``."""
    from grpo_lab.tasks.toy import ReverseTask

    original = ReverseTask.reward_fn
    calls = Counter()

    def reward_fn(self, response, ground_truth):
        scores = original(self, response, ground_truth)
        calls["n"] += 1
        return {**scores, "reward": value} if calls["n"] == index + 1 else scores

    return reward_fn


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_reward_stops_train_with_one_line_and_exit_2(
    value, tmp_path, monkeypatch, capsys
):
    from grpo_lab.cli import main as cli
    from grpo_lab.tasks.toy import ReverseTask

    monkeypatch.setattr(ReverseTask, "reward_fn", reward_once(value))
    code = cli.main(["train", *TINY_RUN, "--run-dir", str(tmp_path / "run")])
    error = capsys.readouterr().err
    assert code == 2
    lines = error.strip().splitlines()
    assert len(lines) == 1, error
    line = lines[0]
    assert line.startswith("grpo-lab train: task 'reverse'")
    assert "ReverseTask.reward_fn" in line or "reward_fn" in line
    assert f"returned reward {value!r} for sample 5 of the rollout batch" in line
    assert "prompt '" in line and "response '" in line
    if math.isnan(value):
        assert "nan_rewards: ignore" in line and "--nan-rewards ignore" in line
    else:
        assert "must be finite" in line


def test_a_nan_reward_is_ignored_when_the_config_says_so(tmp_path, monkeypatch):
    from grpo_lab.cli import main as cli
    from grpo_lab.tasks.toy import ReverseTask
    from grpo_lab.training.metrics import read_metrics

    monkeypatch.setattr(ReverseTask, "reward_fn", reward_once(math.nan))
    run_dir = tmp_path / "run"
    argv = ["train", *TINY_RUN, "--nan-rewards", "ignore", "--run-dir", str(run_dir)]
    assert cli.main(argv) == 0
    assert read_metrics(run_dir)[-1]["step"] == 1


# ------------------------------------------------------------------ the config

# Settings refused as the config is built: (overrides, the field named, its value).
CONFIG_CASES = [
    ({"lora_lr": 1e-3}, "lora_lr", "0.001"),
    ({"lora_alpha": 8.0}, "lora_alpha", "8.0"),
    ({"lora_train_norms": False}, "lora_train_norms", "False"),
    ({"lora_dropout": 0.1}, "lora_dropout", "0.1"),
    ({"lora_rank": 4, "lora_target_modules": "no_such_proj"}, "lora_target_modules",
     "'no_such_proj'"),
    ({"lora_rank": 1_000_000_000}, "lora_rank", "1000000000"),
    ({"steps": 1_000_000_000}, "steps", "1000000000"),
    ({"seed": 10**23}, "seed", str(10**23)),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "name", "value"), CONFIG_CASES)
def test_a_setting_that_cannot_work_is_refused_when_the_config_is_built(
    overrides, name, value
):
    from grpo_lab.training.config import TrainConfig

    with pytest.raises(ValueError) as refused:
        TrainConfig.for_profile("cpu", **overrides)
    message = str(refused.value)
    assert is_clear(message, name), message
    assert f"got {value}" in message or f"got {name} {value}" in message, message


def test_eval_every_0_is_no_evaluation_at_all():
    """Documented: 0 evaluates never, not even after the last step."""
    from grpo_lab.training.config import TrainConfig, field_help
    from grpo_lab.training.loop import _evaluation_due

    config = TrainConfig.for_profile("smoke", eval_every=0)
    assert not any(_evaluation_due(config, step) for step in range(1, config.steps + 1))
    assert "not even after the last step" in field_help("eval_every")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "sets no field: it is empty"),
        (b"# only a comment\n", "sets no field: it is empty"),
        ("steps: 3\n".encode("utf-16"), "must be UTF-8 text, got byte 0xff"),
    ],
    ids=["empty", "comments only", "UTF-16"],
)
def test_a_config_file_that_sets_nothing_or_is_not_utf8_is_named(
    content, problem, tmp_path, capsys
):
    from grpo_lab.cli import main as cli

    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    assert cli.main(["train", "--config", str(path)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"grpo-lab train: config file {path} {problem}"), error
    assert not (tmp_path / "runs").exists()


def test_the_gpu_profile_on_a_cpu_machine_fails_before_the_hub(
    tmp_path, monkeypatch, capsys
):
    """The device is checked before the task and the model, which may reach for
    the Hub (GSM8K and Qwen2.5 in the gpu profile)."""
    from grpo_lab import tasks
    from grpo_lab.cli import main as cli

    def no_hub(*args, **kwargs):
        raise AssertionError("the task was built before the device was checked")

    monkeypatch.setattr(tasks, "get_task", no_hub)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "gpu.yaml"
    path.write_text("profile: gpu\n")
    assert cli.main(["train", "--config", str(path)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("grpo-lab train: device 'cuda' is not available"), error
