"""Multi-turn rollouts: the policy writes, calls a tool, reads its reply, writes on.

One episode, for one prompt (``|`` marks where the author changes)::

    37*58= | <calc>37*58</calc> | <out> | 2146 | </out> | 2146<eos>
    prompt | model (trained)    | separator, tool, sep. | model (trained)

The policy samples until it closes a tool call (the tool's ``call_close`` is a
stop string) or ends its turn; the environment runs the tool on the text
between the call tags and appends ``output_open + reply + output_close``;
sampling resumes from the whole context, up to ``max_turns`` model turns and a
budget of ``sampling.max_new_tokens`` response tokens (model and environment
tokens together), each model turn at most ``max_turn_tokens`` long (a turn
that reaches it without a call ends the episode). A call in the last allowed
turn is not run.

Every piece of a response is a :class:`Segment` that records who wrote it. The
response mask covers the model's own tokens only:

    response_mask[b, t] = 1  iff labels[b, t] was sampled by the policy

so a tool's output and the separators around it get no gradient and no weight
in any loss normalization, and the sampler's log-probs are kept for model
tokens only (one per masked-in token, as ``Rollouts.sampler_log_probs``
requires). With no tool call the rollout, its ids, log-probs and mask are
exactly the single-turn ones.

The wrapped backend resumes from token ids (``continue_ids``): the hf backend
on CPU re-encodes the whole context each turn (no key/value cache is carried
across turns; the first turn shares each prompt's prefill), the vllm backend
sends each turn's context as token ids and its prefix cache reuses the earlier
turns. Taught in ``notebooks/14_tools_and_turns.ipynb``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from grpo_lab.masks import pad_prompt_and_response_ids
from grpo_lab.rollouts.base import (
    Rollouts,
    SamplingSettings,
    check_generate_arguments,
    load_current_weights,
)
from grpo_lab.rollouts.hf import HFRolloutBackend
from grpo_lab.rollouts.tools import CalculatorTool

if TYPE_CHECKING:  # vllm.py imports vLLM only when a backend is built
    from grpo_lab.rollouts.vllm import VLLMRolloutBackend

MODEL, TOOL, SEPARATOR = "model", "tool", "separator"
ROLES = (MODEL, TOOL, SEPARATOR)
# Why an episode ended: the model stopped without a call, its last allowed turn
# ended in a call, or the token budget (of the episode or of a turn) ran out.
END_REASONS = ("answered", "turn_limit", "budget")
MAX_TURNS_LIMIT = 16


@dataclass(frozen=True)
class Segment:
    """A run of response tokens written by one author (``role``)."""

    # "model" (sampled by the policy), "tool" (the tool's reply) or "separator"
    # (the tags the environment writes around it).
    role: str
    token_ids: tuple[int, ...]
    text: str


@dataclass
class MultiTurnRollouts(Rollouts):
    """Rollouts whose responses interleave model turns and tool replies.

    ``response_token_ids[k]`` is the concatenation of ``segments[k]``'s ids;
    ``sampler_log_probs[k]`` holds one value per model token, in order.
    """

    segments: list[list[Segment]] = field(default_factory=list)
    # One of END_REASONS per response.
    end_reasons: list[str] = field(default_factory=list)
    # Model turns and tool calls of each response, and calls answered "error".
    turns: list[int] = field(default_factory=list)
    tool_calls: list[int] = field(default_factory=list)
    tool_errors: list[int] = field(default_factory=list)
    # tools/... metrics of the batch (logged with the step's train metrics).
    sampling_metrics: dict[str, float] = field(default_factory=dict)


def check_max_turns(max_turns: int, name: str = "max_turns") -> None:
    """An int in [1, MAX_TURNS_LIMIT]: model turns per episode."""
    if (
        isinstance(max_turns, bool)
        or not isinstance(max_turns, int)
        or not 1 <= max_turns <= MAX_TURNS_LIMIT
    ):
        raise ValueError(
            f"{name} must be an int in [1, {MAX_TURNS_LIMIT}] (model turns per "
            f"episode), got {max_turns!r}"
        )


def segment_model_flags(segments: list[Segment]) -> list[int]:
    """1 for each token the model wrote, 0 for tool and separator tokens."""
    return [int(s.role == MODEL) for s in segments for _ in s.token_ids]


def pad_prompt_and_segment_ids(
    prompt_ids: list[list[int]],
    segments: list[list[Segment]],
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """:func:`grpo_lab.masks.pad_prompt_and_response_ids` with a model-only mask.

    The response of row b is its segments' ids in order. Then, with
    written[b, i] = 1 when token i of the padded sequence was sampled by the
    model, response_mask[b, t] = written[b, t + 1]: the mask follows the
    labels, so the first token after a tool reply is trained and the last
    separator token before it is not. Returns ``input_ids``, ``labels`` and
    ``response_mask``, each (B, T - 1); with model segments only, exactly the
    single-turn tensors.
    """
    _check_segments(segments, len(prompt_ids))
    response_ids = [[t for s in row for t in s.token_ids] for row in segments]
    batch = pad_prompt_and_response_ids(prompt_ids, response_ids, pad_token_id)
    width = batch["labels"].shape[1] + 1
    written = [
        [0] * len(prompt) + segment_model_flags(row)
        for prompt, row in zip(prompt_ids, segments)
    ]
    padded = [flags + [0] * (width - len(flags)) for flags in written]
    model_mask = torch.tensor(padded, dtype=torch.long)[:, 1:]  # (B, T-1)
    batch["response_mask"] = batch["response_mask"] * model_mask  # (B, T-1)
    return batch


def _check_segments(segments: list[list[Segment]], rows: int) -> None:
    if not isinstance(segments, (list, tuple)) or len(segments) != rows:
        raise ValueError(
            f"segments must be a list with one list of Segment per prompt ({rows}), "
            f"got {type(segments).__name__} of length "
            f"{len(segments) if isinstance(segments, (list, tuple)) else 'n/a'}"
        )
    for index, row in enumerate(segments):
        for segment in row:
            if not isinstance(segment, Segment) or segment.role not in ROLES:
                raise ValueError(
                    f"segments[{index}] must hold Segment objects with a role in "
                    f"{ROLES}, got {segment!r}"
                )


def multi_turn_token_batch(
    rollouts: MultiTurnRollouts, pad_token_id: int
) -> dict[str, torch.Tensor]:
    """input_ids, labels, response_mask (B·G, T) of multi-turn rollouts."""
    return pad_prompt_and_segment_ids(
        rollouts.prompt_token_ids, rollouts.segments, pad_token_id
    )


@dataclass
class _Episode:
    """One response being built, turn by turn."""

    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    model_log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    # None while the episode waits for its next model turn.
    end_reason: str | None = None

    @property
    def length(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    def response_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]


class MultiTurnRolloutBackend:
    """Wraps the hf backend: a tool call ends a turn, the tool's reply is
    appended, and sampling resumes (see the module docstring).

    ``generate`` returns :class:`MultiTurnRollouts`; ``sync`` and ``refresh``
    pass through to the wrapped backend.
    """

    def __init__(
        self,
        backend: HFRolloutBackend | VLLMRolloutBackend,
        tool: CalculatorTool,
        max_turns: int = 2,
        max_turn_tokens: int | None = None,
    ) -> None:
        if not callable(getattr(backend, "continue_ids", None)):
            raise ValueError(
                "backend must resume from token ids (continue_ids: the hf or vllm "
                "rollout backend), "
                f"got {type(backend).__name__}"
            )
        check_max_turns(max_turns)
        if max_turn_tokens is not None and (
            isinstance(max_turn_tokens, bool)
            or not isinstance(max_turn_tokens, int)
            or max_turn_tokens < 1
        ):
            raise ValueError(
                "max_turn_tokens must be None or a positive int, "
                f"got {max_turn_tokens!r}"
            )
        self.backend = backend
        self.tool = tool
        self.max_turns = max_turns
        self.max_turn_tokens = max_turn_tokens
        self.tokenizer = backend.tokenizer
        self._eos_ids = {backend.tokenizer.eos_token_id}

    def generate(
        self, prompts: list[str], group_size: int, sampling: SamplingSettings
    ) -> MultiTurnRollouts:
        """B prompts -> B·G episodes, prompt-major, as ``generate`` of any backend."""
        check_generate_arguments(prompts, group_size, sampling)
        budget = sampling.max_new_tokens
        first = self.backend.generate(
            prompts, group_size, self._turn_sampling(sampling, 1, budget)
        )  # with no call, exactly the single-turn rollout
        episodes = [_Episode(prompt_ids=list(ids)) for ids in first.prompt_token_ids]
        for episode, ids, values, text in zip(
            episodes, first.response_token_ids, first.sampler_log_probs, first.responses
        ):
            self._take_model_turn(episode, ids, values, text, 1, budget)
        for turn in range(2, self.max_turns + 1):
            waiting = [e for e in episodes if e.end_reason is None]
            if not waiting:
                break
            self._resume(waiting, sampling, turn, budget)
        return self._rollouts(first.prompts, episodes)

    def sync(self, policy: torch.nn.Module) -> None:
        """Sync the wrapped backend."""
        self.backend.sync(policy)

    def refresh(self, policy: torch.nn.Module) -> None:
        """Load the policy's weights into the wrapped backend now."""
        load_current_weights(self.backend, policy)

    def _turn_sampling(
        self, sampling: SamplingSettings, turn: int, max_new_tokens: int
    ) -> SamplingSettings:
        """Turn 1 is sampled as a single-turn rollout (plus the call's stop
        string); later turns get their own seed and the budget left. No turn
        is longer than ``max_turn_tokens``."""
        if self.max_turn_tokens is not None:
            max_new_tokens = min(max_new_tokens, self.max_turn_tokens)
        stops = sampling.stop_strings
        if turn < self.max_turns and self.tool.call_close not in stops:
            stops = (*stops, self.tool.call_close)
        seed = sampling.seed
        if seed is not None and turn > 1:
            seed = random.Random(f"{seed}/turn/{turn}").randrange(2**31)
        return dataclasses.replace(
            sampling, stop_strings=stops, seed=seed, max_new_tokens=max_new_tokens
        )

    def _resume(
        self,
        waiting: list[_Episode],
        sampling: SamplingSettings,
        turn: int,
        budget: int,
    ) -> None:
        """One more model turn for every waiting episode, each within its budget."""
        room = max(budget - e.length for e in waiting)
        contexts = [e.prompt_ids + e.response_ids() for e in waiting]
        ids, values, texts = self.backend.continue_ids(
            contexts, self._turn_sampling(sampling, turn, room)
        )
        for episode, row, row_values, text in zip(waiting, ids, values, texts):
            left = budget - episode.length
            if len(row) > left:  # a longer turn than this episode has room for
                row, row_values = row[:left], row_values[:left]
                text = self.tokenizer.decode(row, skip_special_tokens=True)
            self._take_model_turn(episode, row, row_values, text, turn, budget)

    def _take_model_turn(
        self,
        episode: _Episode,
        ids: list[int],
        values: list[float],
        text: str,
        turn: int,
        budget: int,
    ) -> None:
        """Append the model's turn; run its tool call, or end the episode."""
        episode.segments.append(Segment(MODEL, tuple(ids), text))
        episode.model_log_probs += values
        episode.turns += 1
        arguments = self.tool.call_arguments(text)
        if arguments is None:
            cut = episode.length >= budget or len(ids) == self.max_turn_tokens
            ended = bool(ids) and ids[-1] in self._eos_ids
            episode.end_reason = "budget" if cut and not ended else "answered"
            return
        if turn == self.max_turns:
            episode.end_reason = "turn_limit"
            return
        reply = self.tool.run(arguments)
        replies = self._reply_segments(reply.text)
        if episode.length + sum(len(s.token_ids) for s in replies) >= budget:
            episode.end_reason = "budget"  # no room left for the model to answer
            return
        episode.segments += replies
        episode.tool_calls += 1
        episode.tool_errors += int(reply.error)

    def _reply_segments(self, reply_text: str) -> list[Segment]:
        return reply_segments(self.tokenizer, self.tool, reply_text)

    def _rollouts(
        self, prompts: list[str], episodes: list[_Episode]
    ) -> MultiTurnRollouts:
        return _as_rollouts(prompts, episodes)


def _as_rollouts(prompts: list[str], episodes: list[_Episode]) -> MultiTurnRollouts:
    rollouts = MultiTurnRollouts(
        prompts=prompts,
        responses=["".join(s.text for s in e.segments) for e in episodes],
        prompt_token_ids=[e.prompt_ids for e in episodes],
        response_token_ids=[e.response_ids() for e in episodes],
        sampler_log_probs=[e.model_log_probs for e in episodes],
        segments=[e.segments for e in episodes],
        end_reasons=[e.end_reason for e in episodes],
        turns=[e.turns for e in episodes],
        tool_calls=[e.tool_calls for e in episodes],
        tool_errors=[e.tool_errors for e in episodes],
    )
    rollouts.sampling_metrics = tool_metrics(rollouts)
    return rollouts


def reply_segments(
    tokenizer: PreTrainedTokenizerBase, tool: CalculatorTool, reply_text: str
) -> list[Segment]:
    """output_open, the reply, output_close: each encoded on its own."""
    pieces = (
        (SEPARATOR, tool.output_open),
        (TOOL, reply_text),
        (SEPARATOR, tool.output_close),
    )
    return [
        Segment(role, tuple(tokenizer.encode(text, add_special_tokens=False)), text)
        for role, text in pieces
    ]


def replayed_rollouts(
    tokenizer: PreTrainedTokenizerBase,
    tool: CalculatorTool,
    prompts: list[str],
    model_turns: list[list[list[int]]],
    log_prob: float = 0.0,
) -> MultiTurnRollouts:
    """Fixed episodes: the given model turns, with the tool run between them.

    ``model_turns[k]`` holds the token ids of each model turn of episode k
    (prompt ``prompts[k]``); after every turn but the last that ends in a
    call, the tool's reply is appended as the rollout appends it. Every model
    token gets sampler log-prob ``log_prob``. A fixed multi-turn batch for
    parity tests and figures; the end reason is "answered" when the last turn
    ends in EOS, else "budget".
    """
    if len(model_turns) != len(prompts):
        raise ValueError(
            f"model_turns must hold one list of turns per prompt ({len(prompts)}), "
            f"got {len(model_turns)}"
        )
    episodes = []
    for prompt, turns in zip(prompts, model_turns):
        episode = _Episode(
            prompt_ids=tokenizer.encode(prompt, add_special_tokens=False)
        )
        for index, ids in enumerate(turns):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            episode.segments.append(Segment(MODEL, tuple(ids), text))
            episode.model_log_probs += [log_prob] * len(ids)
            episode.turns += 1
            arguments = tool.call_arguments(text)
            if arguments is not None and index < len(turns) - 1:
                reply = tool.run(arguments)
                episode.segments += reply_segments(tokenizer, tool, reply.text)
                episode.tool_calls += 1
                episode.tool_errors += int(reply.error)
        last = turns[-1] if turns else []
        ended = bool(last) and last[-1] == tokenizer.eos_token_id
        episode.end_reason = "answered" if ended else "budget"
        episodes.append(episode)
    return _as_rollouts(prompts, episodes)


def demonstration_segments(
    tokenizer: PreTrainedTokenizerBase, tool: CalculatorTool, demonstration: str
) -> list[Segment]:
    """A written tool-using demonstration, split by author, then EOS.

    ``"<calc>1+2</calc><out>3</out>3"`` -> model ``<calc>1+2</calc>``,
    separator ``<out>``, tool ``3``, separator ``</out>``, model ``3<eos>``:
    the text between each ``output_open`` and its ``output_close`` is the
    tool's. The supervised warm-up trains on the model's segments only, as
    GRPO does (:func:`pad_prompt_and_segment_ids`).
    """
    pieces: list[tuple[str, str]] = []
    rest = demonstration
    while tool.output_open in rest:
        before, _, after = rest.partition(tool.output_open)
        reply, closed, rest = after.partition(tool.output_close)
        pieces += [(MODEL, before), (SEPARATOR, tool.output_open), (TOOL, reply)]
        if not closed:
            raise ValueError(
                f"demonstration must close each {tool.output_open!r} with "
                f"{tool.output_close!r}, got {demonstration!r}"
            )
        pieces.append((SEPARATOR, tool.output_close))
    pieces.append((MODEL, rest))
    segments = [
        Segment(role, tuple(tokenizer.encode(text, add_special_tokens=False)), text)
        for role, text in pieces
        if text
    ]
    return [*segments, Segment(MODEL, (tokenizer.eos_token_id,), "")]


def tool_metrics(rollouts: MultiTurnRollouts) -> dict[str, float]:
    """``tools/`` means over the episodes of a batch.

    turns_mean, calls_mean, errors_mean (calls answered "error"),
    model_token_fraction (model tokens / all response tokens),
    turn_limit_fraction and budget_fraction (episodes ended by each limit).
    """
    count = len(rollouts.segments)
    model_tokens = sum(sum(segment_model_flags(row)) for row in rollouts.segments)
    all_tokens = sum(len(ids) for ids in rollouts.response_token_ids)
    return {
        "tools/turns_mean": sum(rollouts.turns) / count,
        "tools/calls_mean": sum(rollouts.tool_calls) / count,
        "tools/errors_mean": sum(rollouts.tool_errors) / count,
        "tools/model_token_fraction": model_tokens / max(all_tokens, 1),
        "tools/turn_limit_fraction": rollouts.end_reasons.count("turn_limit") / count,
        "tools/budget_fraction": rollouts.end_reasons.count("budget") / count,
    }


def trained_tool_token_metrics(
    rollouts: Rollouts, response_mask: torch.Tensor
) -> dict[str, float]:
    """How much of what the tools wrote the update is about to train on.

    With written[b, t] = 1 where the label at t was sampled by the model (the
    flags of :func:`pad_prompt_and_segment_ids`), over the response positions
    of the batch that is trained::

        tools/trained_tool_token_fraction = sum(mask * (1 - written))
                                            / sum over rows of tool + separator tokens

    0 when the mask is the model-only one; 1 when every tool and separator
    token is trained (the classic bug: the single-turn mask over a multi-turn
    response). Empty for single-turn rollouts, and when no tool replied.
    """
    if not isinstance(rollouts, MultiTurnRollouts):
        return {}
    tool_tokens = sum(
        len(row_ids) - sum(segment_model_flags(row))
        for row_ids, row in zip(rollouts.response_token_ids, rollouts.segments)
    )
    if tool_tokens == 0:
        return {}
    width = response_mask.shape[1] + 1
    written = [
        [1] * len(prompt) + segment_model_flags(row)
        for prompt, row in zip(rollouts.prompt_token_ids, rollouts.segments)
    ]  # prompt positions count as written: only response positions are checked
    padded = [flags + [1] * (width - len(flags)) for flags in written]
    not_model = 1 - torch.tensor(padded, dtype=torch.long)[:, 1:]  # (B, T-1)
    trained = (response_mask.detach().cpu().long() != 0).long() * not_model
    return {"tools/trained_tool_token_fraction": trained.sum().item() / tool_tokens}
