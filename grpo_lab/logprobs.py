"""Per-token log-probabilities and entropy, without a (B, T, V) log-softmax.

A policy-gradient loss needs one number per token: log p(label | prefix). The naive
way builds the whole (B, T, V) table and keeps one column::

    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None])

With B = 8, T = 512 and V = 152k that table is 2.5 GB in float32, and autograd
keeps it (plus its backward's temporaries). This module computes the same numbers
from log p(label) = z_label - logsumexp(z), a few rows at a time, with a hand-written
backward. Taught in ``notebooks/02_logprobs_and_entropy.ipynb``.
"""

from __future__ import annotations

import contextlib
import math
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.autograd.function import once_differentiable

from grpo_lab.prefix_sharing import (
    PrefixSplit,
    can_share_prefix,
    check_shared_prefix_length,
    check_token_batch,
    forward_with_shared_prefix,
    join_prefix_and_tail,
    split_at_prefix,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Architectures whose logits are exactly lm_head(model.model(...).last_hidden_state),
# so logits_chunk_size > 0 may call the decoder and the head itself. Checked in
# transformers 5.17, models/{olmo2,qwen2,qwen3,llama}/modeling_*.py: each
# *ForCausalLM.forward runs hidden_states = self.model(...).last_hidden_state (the
# final RMSNorm is inside self.model), then logits = self.lm_head(hidden_states[:,
# slice_indices, :]) where logits_to_keep=0 keeps every position, and returns those
# logits untouched: no logit_scale, no final_logit_softcapping, no division. Gemma2,
# for one, divides, applies tanh and multiplies after lm_head, so it is not listed.
CHUNKED_HEAD_MODEL_TYPES = frozenset({"olmo2", "qwen2", "qwen3", "llama"})

# Token ids an input embedding accepts.
_INPUT_ID_DTYPES = (torch.int64, torch.int32)

# Float32 scratch space per chunk of rows: bounds every temporary to this size.
_WORKSPACE_BYTES = 16 * 1024 * 1024


def _probability_dtype(dtype: torch.dtype) -> torch.dtype:
    # bfloat16 keeps 8 bits of mantissa: a log-ratio of 3e-4 (GSPO's clip range)
    # rounds away, and a sum over 152k probabilities loses digits. Use float32.
    return torch.float32 if dtype in {torch.float16, torch.bfloat16} else dtype


def _probability_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """z / T in float32 (a copy only for half precision or T != 1)."""
    logits = logits.to(_probability_dtype(logits.dtype))
    return logits if temperature == 1.0 else logits / temperature


def _row_chunks(num_rows: int, vocab_size: int) -> list[slice]:
    """Row ranges whose float32 (rows, V) scratch fits in _WORKSPACE_BYTES."""
    rows = max(1, _WORKSPACE_BYTES // max(1, 4 * vocab_size))
    return [slice(start, start + rows) for start in range(0, num_rows, rows)]


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) over the last dim: (..., V) -> (...).

    H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v, since
    log p_v = z_v - logsumexp(z). Naive form: -(softmax(z) * log_softmax(z)).sum(-1).
    Half-precision logits are upcast to float32 first. A masked token (z = -inf,
    p = 0) adds 0, not 0 * -inf = nan. Uniform over 4 tokens gives ln 4; a
    one-hot-like distribution gives about 0.
    """
    _check_entropy_logits(logits)
    logits = _probability_logits(logits, 1.0)
    log_normalizer = torch.logsumexp(logits, dim=-1)
    expected_logit = _expected_logit(torch.softmax(logits, dim=-1), logits)
    return log_normalizer - expected_logit


def _check_entropy_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"logits must be a floating-point tensor, got {type(logits).__name__}"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if logits.ndim < 1:
        raise ValueError(
            "logits must have a vocabulary dimension (shape (..., V)), got a scalar"
        )
    if logits.shape[-1] == 0:
        raise ValueError(
            "logits must have at least one vocabulary entry (shape (..., V), "
            f"V >= 1), got shape {tuple(logits.shape)}"
        )


def _expected_logit(probabilities: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """sum_v p_v z_v over the last dim, where a p_v = 0 term counts as 0."""
    finite_logits = logits.masked_fill(probabilities == 0, 0.0)  # 0 * -inf is nan
    return (probabilities * finite_logits).sum(dim=-1)


def _selected_logits_and_log_normalizer(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """z_label / T and logsumexp(z / T) per position, a chunk of rows at a time."""
    logit_rows = logits.reshape(-1, logits.shape[-1])  # (B*T, V)
    label_rows = labels.reshape(-1, 1)  # (B*T, 1)
    dtype = _probability_dtype(logits.dtype)
    selected = logits.new_empty(label_rows.shape[0], dtype=dtype)  # (B*T,)
    log_normalizer = torch.empty_like(selected)  # (B*T,)
    for rows in _row_chunks(*logit_rows.shape):
        scaled = _probability_logits(logit_rows[rows], temperature)  # (c, V)
        log_normalizer[rows] = torch.logsumexp(scaled, dim=-1)
        selected[rows] = scaled.gather(1, label_rows[rows]).squeeze(1)
    return selected.view(labels.shape), log_normalizer.view(labels.shape)


def _log_prob_gradient(
    logits: torch.Tensor,
    labels: torch.Tensor,
    log_normalizer: torch.Tensor,
    grad_log_probs: torch.Tensor,
    temperature: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """d/dz of sum g * log p(label): g * (onehot(label) - softmax(z / T)) / T.

    Why: log p(label) = z_label / T - log sum_v exp(z_v / T), so its derivative
    by z_v is ([v == label] - p_v) / T. softmax(z / T) is recomputed in float32 as
    exp(z / T - logsumexp) from the saved log-normalizer, a chunk of rows at a
    time, and written into one (B, T, V) buffer in the logits' dtype. The float32
    operations are those autograd runs for gather - logsumexp (-g * p, then + g
    at the label), so the gradient is the same, bit for bit on CPU. ``out`` may
    be ``logits`` itself, when nothing else reads them: each row chunk is read
    before it is overwritten.
    """
    logit_rows = logits.reshape(-1, logits.shape[-1])  # (B*T, V)
    label_rows = labels.reshape(-1, 1)  # (B*T, 1)
    normalizer_rows = log_normalizer.reshape(-1, 1)  # (B*T, 1)
    grad_rows = grad_log_probs.reshape(-1, 1)  # (B*T, 1)
    if out is None:  # contiguous, whatever the logits' strides
        out = logits.new_empty(logits.shape)  # (B, T, V), logits' dtype
    grad_logit_rows = out.view(logit_rows.shape)  # (B*T, V)
    for rows in _row_chunks(*logit_rows.shape):
        scaled = _probability_logits(logit_rows[rows], temperature)  # (c, V)
        probabilities = (scaled - normalizer_rows[rows]).exp_()  # (c, V)
        grad_chunk = probabilities.mul_(-grad_rows[rows])  # -g * p
        grad_chunk.scatter_add_(1, label_rows[rows], grad_rows[rows])  # + g at label
        if temperature != 1.0:
            grad_chunk.div_(temperature)
        grad_logit_rows[rows] = grad_chunk
    return out


def _log_prob_and_entropy_gradient(
    logits: torch.Tensor,
    labels: torch.Tensor,
    log_normalizer: torch.Tensor,
    entropy: torch.Tensor,
    grad_log_probs: torch.Tensor,
    grad_entropy: torch.Tensor,
    temperature: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """d/dz of sum (g * log p(label) + h * H), a chunk of rows at a time.

    With s = z / T and p = softmax(s): d log p(label) / d s_v = [v == label] - p_v
    and d H / d s_v = -p_v (log p_v + H), so the logits' gradient is
    (g [v == label] - p_v (g + h (log p_v + H))) / T. A p_v = 0 term (a -inf
    logit) contributes 0. Written into one (B, T, V) buffer like
    :func:`_log_prob_gradient`; ``out`` may be ``logits`` themselves.
    """
    logit_rows = logits.reshape(-1, logits.shape[-1])  # (B*T, V)
    label_rows = labels.reshape(-1, 1)  # (B*T, 1)
    normalizer_rows = log_normalizer.reshape(-1, 1)  # (B*T, 1)
    entropy_rows = entropy.reshape(-1, 1).to(normalizer_rows.dtype)  # (B*T, 1)
    grad_rows = grad_log_probs.reshape(-1, 1)  # (B*T, 1)
    entropy_grad_rows = grad_entropy.reshape(-1, 1)  # (B*T, 1)
    if out is None:
        out = logits.new_empty(logits.shape)  # (B, T, V), logits' dtype
    grad_logit_rows = out.view(logit_rows.shape)  # (B*T, V)
    for rows in _row_chunks(*logit_rows.shape):
        scaled = _probability_logits(logit_rows[rows], temperature)  # (c, V)
        log_p = scaled - normalizer_rows[rows]  # (c, V)
        probabilities = log_p.exp()  # (c, V)
        centered = (log_p + entropy_rows[rows]).masked_fill_(probabilities == 0, 0)
        weight = centered.mul_(entropy_grad_rows[rows]).add_(grad_rows[rows])
        grad_chunk = weight.mul_(probabilities).neg_()  # -p (g + h (log p + H))
        grad_chunk.scatter_add_(1, label_rows[rows], grad_rows[rows])  # + g at label
        if temperature != 1.0:
            grad_chunk.div_(temperature)
        grad_logit_rows[rows] = grad_chunk
    return out


class _SelectedLogProb(torch.autograd.Function):
    """log p(label) = z_label / T - logsumexp(z / T), with a lean chunked backward.

    Autograd on the composite form keeps a float32 copy of half-precision logits
    and, in backward, builds several (B, T, V) temporaries (one for logsumexp's,
    one for gather's gradient). Here forward saves the logits it was given (no
    copy), the labels and the (B, T) log-normalizer; backward writes the gradient
    chunk by chunk into one buffer. It never writes into the saved logits: the
    caller may still hold them. Outputs (log_probs, log_normalizer); the second
    carries no gradient.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature):
        selected, log_normalizer = _selected_logits_and_log_normalizer(
            logits, labels, temperature
        )
        ctx.save_for_backward(logits, labels, log_normalizer)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(log_normalizer)
        return selected - log_normalizer, log_normalizer

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs, _grad_log_normalizer):
        logits, labels, log_normalizer = ctx.saved_tensors
        grad_logits = _log_prob_gradient(
            logits, labels, log_normalizer, grad_log_probs, ctx.temperature
        )
        return grad_logits, None, None


class _SelectedLogProbAndEntropy(torch.autograd.Function):
    """log p(label) and the entropy H of softmax(z / T), both with gradients.

    The memory-lean form of autograd on log_softmax(z / T).gather(label) and
    -(softmax * log_softmax).sum(-1): forward keeps the logits, labels and two
    (B, T) tensors (log-normalizer, entropy); backward writes both gradients in
    one pass over row chunks (:func:`_log_prob_and_entropy_gradient`).
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature):
        selected, log_normalizer = _selected_logits_and_log_normalizer(
            logits, labels, temperature
        )
        entropy = _chunked_token_entropy(logits, log_normalizer, temperature)
        ctx.save_for_backward(logits, labels, log_normalizer, entropy)
        ctx.temperature = temperature
        return selected - log_normalizer, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, labels, log_normalizer, entropy = ctx.saved_tensors
        grad_logits = _log_prob_and_entropy_gradient(
            logits,
            labels,
            log_normalizer,
            entropy,
            grad_log_probs,
            grad_entropy,
            ctx.temperature,
        )
        return grad_logits, None, None


def _chunked_token_entropy(
    logits: torch.Tensor, log_normalizer: torch.Tensor, temperature: float
) -> torch.Tensor:
    """No-grad entropy of softmax(z / T), a chunk of rows at a time. -> (B, T).

    H = logsumexp(z / T) - sum_v p_v z_v / T (see :func:`compute_entropy`). It is
    a reported diagnostic, so it keeps no graph.
    """
    with torch.no_grad():
        logit_rows = logits.detach().reshape(-1, logits.shape[-1])  # (B*T, V)
        normalizer_rows = log_normalizer.detach().reshape(-1)  # (B*T,)
        entropy = torch.empty_like(normalizer_rows)  # (B*T,)
        for rows in _row_chunks(*logit_rows.shape):
            scaled = _probability_logits(logit_rows[rows], temperature)  # (c, V)
            probabilities = torch.softmax(scaled, dim=-1)  # (c, V)
            expected_logit = _expected_logit(probabilities, scaled)  # (c,)
            entropy[rows] = normalizer_rows[rows] - expected_logit
    return entropy.view(log_normalizer.shape)


def _response_log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool,
    temperature: float = 1.0,
    entropy_gradient: bool = False,
) -> dict[str, torch.Tensor]:
    """log p(label) under softmax(z / T). (B, T, V), (B, T) -> (B, T) float32+."""
    _check_logits_match_labels(logits, labels)
    if entropy_gradient:
        log_probs, entropy = _SelectedLogProbAndEntropy.apply(
            logits, labels, temperature
        )
        return {"log_probs": log_probs, "token_entropy": entropy}  # (B, T) each
    log_probs, log_normalizer = _SelectedLogProb.apply(logits, labels, temperature)
    result = {"log_probs": log_probs}  # (B, T)
    if return_token_entropy:
        result["token_entropy"] = _chunked_token_entropy(
            logits, log_normalizer, temperature
        )
    return result


def get_response_log_probs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
    logits_chunk_size: int | None = None,
    *,
    temperature: float = 1.0,
    shared_prefix_length: int = 0,
    entropy_gradient: bool = False,
) -> dict[str, torch.Tensor]:
    """Score ``labels`` under ``model``: log p(labels[b, t] | input_ids[b, :t+1]).

    log p(label) = z_label - logsumexp(z), with z the logits at that position
    divided by ``temperature``. Naive equivalent (the test oracle)::

        logits = model(input_ids).logits.float() / temperature  # (B, T, V)
        torch.log_softmax(logits, dim=-1).gather(-1, labels[..., None]).squeeze(-1)

    Returns ``{"log_probs": (B, T)}`` and, with ``return_token_entropy``,
    ``"token_entropy": (B, T)`` (no gradient), the entropy of softmax(z / T).
    Half-precision logits are upcast to float32 a few rows at a time, never as a
    whole (B, T, V) copy: bfloat16 keeps 7 stored mantissa bits and cannot
    resolve a ratio of 1 +/- 3e-4 (GSPO's clip range). Autograd keeps only the
    logits and a (B, T) log-normalizer; backward writes the logits' gradient
    chunk by chunk into one buffer.

    ``logits_chunk_size``: 0 runs the model's own forward. A positive size (for
    the model types in ``CHUNKED_HEAD_MODEL_TYPES``) runs the decoder once and
    the output head on that many positions at a time; each chunk's (B, chunk, V)
    logits are dropped after forward and recomputed in backward (checkpointing
    by hand, which also sums the head's weight gradient into one buffer).
    ``None`` reads ``model.config.grpo_logits_chunk_size`` (default 0), the
    reference design's way of setting it on the model.

    Keyword-only extras (their defaults are the reference design's scorer):

    - ``temperature`` T: rollouts sampled at T come from softmax(logits / T), so
      ratios and old log-probs must be scored from logits / T too (as TRL does).
    - ``shared_prefix_length`` c > 0: rows whose first c input ids and labels are
      equal (the G responses of one prompt) run those c positions once, and only
      their remaining T - c positions per row (:mod:`grpo_lab.prefix_sharing`).
      The same values, with less work; 0 runs every row whole.
    - ``entropy_gradient``: the entropy (``return_token_entropy`` must be True)
      carries its gradient, for an entropy bonus. Naive equivalent: autograd
      on -(softmax(z / T) * log_softmax(z / T)).sum(-1); here backward adds
      h * -p (log p + H) / T to the logits' gradient in the same chunked pass,
      keeping only a (B, T) entropy more.

    Taught in ``notebooks/02_logprobs_and_entropy.ipynb``.
    """
    _check_model(model)
    chunk_size = _resolved_chunk_size(model, logits_chunk_size)
    check_temperature(temperature)
    if entropy_gradient and not return_token_entropy:
        raise ValueError(
            "return_token_entropy must be True when entropy_gradient is True, got False"
        )
    scoring = _Scoring(return_token_entropy, temperature, entropy_gradient)
    _check_labels_match_input_ids(input_ids, labels)
    _check_input_id_range(input_ids, _input_vocabulary_size(model))
    check_shared_prefix_length(shared_prefix_length, input_ids.shape[1])
    if shared_prefix_length and can_share_prefix(model):
        split = split_at_prefix(input_ids, labels, shared_prefix_length)
        if split.distinct_count < input_ids.shape[0]:
            return _score_with_shared_prefix(model, split, chunk_size, scoring)
    if chunk_size == 0:
        logits = model(input_ids).logits  # (B, T, V)
        return _response_log_probs_from_logits(logits, labels, *scoring)
    decoder, output_head = _decoder_and_head(model)
    hidden_states = decoder(input_ids=input_ids, use_cache=False).last_hidden_state
    _check_label_range(labels, output_head.weight.shape[0])
    return _score_hidden_in_chunks(
        output_head, hidden_states, labels, chunk_size, *scoring
    )


class _Scoring(typing.NamedTuple):
    # Also return the entropy per position.
    return_token_entropy: bool
    # Score softmax(z / temperature).
    temperature: float
    # The entropy carries its gradient.
    entropy_gradient: bool


def _score_with_shared_prefix(
    model: PreTrainedModel,
    split: PrefixSplit,
    chunk_size: int,
    scoring: _Scoring,
) -> dict[str, torch.Tensor]:
    """Score each distinct prefix once and every row's tail; join to (B, T)."""
    if chunk_size == 0:
        module = model

        def score(output, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return _response_log_probs_from_logits(
                output.logits, labels, *scoring
            )  # (b, t, V) -> (b, t)

    else:
        module, output_head = _decoder_and_head(model)

        def score(output, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            _check_label_range(labels, output_head.weight.shape[0])
            return _score_hidden_in_chunks(
                output_head,
                output.last_hidden_state,  # (b, t, H)
                labels,
                chunk_size,
                *scoring,
            )

    prefix_output, tail_output = forward_with_shared_prefix(module, split)
    prefix_scores = score(prefix_output, split.prefix_labels)  # (U, c) each
    tail_scores = score(tail_output, split.tail_labels)  # (B, T - c) each
    return {
        key: join_prefix_and_tail(split, prefix_scores[key], tail_scores[key])
        for key in prefix_scores
    }  # (B, T) each


def _resolved_chunk_size(model: torch.nn.Module, logits_chunk_size) -> int:
    if logits_chunk_size is None:
        config = getattr(model, "config", None)
        logits_chunk_size = getattr(config, "grpo_logits_chunk_size", 0)
    check_logits_chunk_size(logits_chunk_size)
    return logits_chunk_size


def check_logits_chunk_size(logits_chunk_size: object) -> None:
    """The one check of an output-head chunk size: an int >= 0."""
    if (
        not isinstance(logits_chunk_size, int)
        or isinstance(logits_chunk_size, bool)
        or logits_chunk_size < 0
    ):
        raise ValueError(
            "logits_chunk_size must be a nonnegative int (0: the model's forward; "
            f"N > 0: N positions per output-head chunk), got {logits_chunk_size!r}"
        )


def check_temperature(
    temperature: object, *, name: str = "temperature", allow_greedy: bool = False
) -> None:
    """The one check of a temperature: a finite number > 0.

    Scoring divides logits by it, so 0 is refused; a sampler may allow 0
    (``allow_greedy``), which means greedy decoding.
    """
    number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
    if number and math.isfinite(temperature) and temperature == 0 and allow_greedy:
        return
    if not number or not math.isfinite(temperature) or temperature <= 0:
        expected = (
            "a finite number >= 0 (0: greedy)"
            if allow_greedy
            else ("a finite number > 0")
        )
        raise ValueError(f"{name} must be {expected}, got {temperature!r}")


def _check_model(model) -> None:
    if not callable(model):
        raise ValueError(
            "model must be a causal LM (a torch.nn.Module returning .logits), "
            f"got {type(model).__name__}"
        )


def _check_labels_match_input_ids(
    input_ids: torch.Tensor, labels: torch.Tensor
) -> None:
    check_token_batch(input_ids, labels)
    if 0 in input_ids.shape:
        raise ValueError(
            "input_ids must hold at least one row and one position, got shape "
            f"{tuple(input_ids.shape)}"
        )
    if input_ids.dtype not in _INPUT_ID_DTYPES:
        raise ValueError(
            f"input_ids must be torch.int64 (or torch.int32) token ids, "
            f"got {input_ids.dtype}"
        )
    if labels.dtype != torch.long:
        raise ValueError(f"labels must be torch.int64 token ids, got {labels.dtype}")


def _input_vocabulary_size(model: torch.nn.Module) -> int | None:
    """Rows of the model's input embedding; None when the model has none."""
    get_embeddings = getattr(model, "get_input_embeddings", None)
    if not callable(get_embeddings):
        return None
    try:
        embedding = get_embeddings()
    except (NotImplementedError, AttributeError):
        return None
    size = getattr(embedding, "num_embeddings", None)
    return size if isinstance(size, int) else None


def _check_input_id_range(input_ids: torch.Tensor, vocab_size: int | None) -> None:
    """Ids in [0, vocab_size): one min/max pass over the (B, T) ids."""
    low, high = torch.stack(torch.aminmax(input_ids)).tolist()
    upper = math.inf if vocab_size is None else vocab_size
    if low >= 0 and high < upper:
        return
    outside = (input_ids < 0) | (input_ids >= upper)  # (B, T)
    row, position = outside.nonzero()[0].tolist()
    raise ValueError(
        f"input_ids must be token ids in [0, {vocab_size or 'V'}) (the rows of "
        f"the model's input embedding), got {input_ids[row, position].item()} at "
        f"input_ids[{row}, {position}]"
    )


def _check_logits_match_labels(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits must have shape {(*labels.shape, 'V')} to match labels, "
            f"got {tuple(logits.shape)}"
        )
    _check_label_range(labels, logits.shape[-1])


def _check_label_range(labels: torch.Tensor, vocab_size: int) -> None:
    if ((labels < 0) | (labels >= vocab_size)).any():
        raise ValueError(
            f"labels must be token ids in [0, {vocab_size}), got values in "
            f"[{labels.min().item()}, {labels.max().item()}]"
        )


def _decoder_and_head(
    model: torch.nn.Module,
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """model.model and the output head, for a type in CHUNKED_HEAD_MODEL_TYPES."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    decoder = getattr(model, "model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if (
        model_type not in CHUNKED_HEAD_MODEL_TYPES
        or not isinstance(decoder, torch.nn.Module)
        or not isinstance(head, torch.nn.Linear)
    ):
        raise ValueError(
            "logits_chunk_size > 0 needs a causal LM whose logits are exactly "
            "lm_head(model.model(...)): model_type in "
            f"{sorted(CHUNKED_HEAD_MODEL_TYPES)} with .model and an nn.Linear "
            "output head; "
            f"got {type(model).__name__} with model_type={model_type!r}. "
            "Use logits_chunk_size=0."
        )
    return decoder, head


def _score_hidden_in_chunks(
    output_head: torch.nn.Linear,
    hidden_states: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    return_token_entropy: bool,
    temperature: float,
    entropy_gradient: bool = False,
) -> dict[str, torch.Tensor]:
    """Head + scoring, ``chunk_size`` positions at a time: (B, T, H) -> (B, T)."""
    device_type = hidden_states.device.type
    compute_dtype = (
        torch.get_autocast_dtype(device_type)
        if torch.is_autocast_enabled(device_type)
        else None
    )
    log_probs, entropy = _ChunkedHeadLogProb.apply(
        hidden_states,
        output_head.weight,
        output_head.bias,
        labels,
        _HeadSettings(
            chunk_size,
            temperature,
            return_token_entropy,
            compute_dtype,
            entropy_gradient,
        ),
    )
    result = {"log_probs": log_probs}  # (B, T)
    if return_token_entropy:
        result["token_entropy"] = entropy  # (B, T)
    return result


@dataclass(frozen=True)
class _HeadSettings:
    # Positions per chunk: the largest logits ever held are (B, chunk_size, V).
    chunk_size: int
    # Score softmax(z / temperature).
    temperature: float
    # Also return the (no-grad) entropy per position.
    with_entropy: bool
    # The matmul dtype autocast chose at forward time (None: the inputs' own).
    compute_dtype: torch.dtype | None
    # The entropy carries its gradient (an entropy bonus).
    entropy_gradient: bool = False


class _ChunkedHeadLogProb(torch.autograd.Function):
    """log p(label) under softmax(lm_head(h) / T), never holding (B, T, V) logits.

    Activation checkpointing by hand. Forward runs the head on ``chunk_size``
    positions at a time and keeps only the hidden states, the labels and a (B, T)
    log-normalizer. Backward recomputes each chunk's logits, turns them into the
    logits' gradient g * (onehot - p) / T (:func:`_log_prob_gradient`), and
    accumulates the head's weight gradient into a single (V, H) buffer, where
    ``torch.utils.checkpoint`` around ``lm_head`` would allocate a fresh (V, H)
    gradient per chunk and add it to ``.grad``. Outputs (log_probs, entropy);
    the entropy is a diagnostic without gradient (zeros unless requested).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, settings):
        dtype = _probability_dtype(settings.compute_dtype or weight.dtype)
        log_probs = hidden.new_empty(labels.shape, dtype=dtype)  # (B, T)
        log_normalizer = torch.empty_like(log_probs)  # (B, T)
        entropy = torch.zeros_like(log_probs)  # (B, T)
        with _head_matmuls(hidden, weight, bias, settings) as head:
            for positions in _position_chunks(labels.shape[1], settings.chunk_size):
                logits = head(hidden[:, positions])  # (B, c, V)
                selected, normalizer = _selected_logits_and_log_normalizer(
                    logits, labels[:, positions], settings.temperature
                )  # (B, c), (B, c)
                log_probs[:, positions] = selected - normalizer
                log_normalizer[:, positions] = normalizer
                if settings.with_entropy:
                    entropy[:, positions] = _chunked_token_entropy(
                        logits, normalizer, settings.temperature
                    )
        ctx.save_for_backward(hidden, weight, bias, labels, log_normalizer, entropy)
        ctx.settings = settings
        if not settings.entropy_gradient:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, bias, labels, log_normalizer, entropy = ctx.saved_tensors
        settings = ctx.settings
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None  # (B, T, H)
        grad_weight = torch.zeros_like(weight) if needs_weight else None  # (V, H)
        grad_bias = torch.zeros_like(bias) if needs_bias else None  # (V,)
        with _head_matmuls(hidden, weight, bias, settings) as head:
            for positions in _position_chunks(labels.shape[1], settings.chunk_size):
                hidden_chunk = hidden[:, positions]  # (B, c, H)
                logits = head(hidden_chunk)  # (B, c, V), recomputed
                grad_logits = _chunk_logit_gradient(
                    logits,
                    positions,
                    labels,
                    log_normalizer,
                    entropy,
                    grad_log_probs,
                    grad_entropy,
                    settings,
                )  # (B, c, V)
                del logits
                if grad_hidden is not None:
                    grad_hidden[:, positions] = head.input_gradient(grad_logits)
                if grad_weight is not None:
                    head.accumulate_weight_gradient(
                        grad_weight, grad_logits, hidden_chunk
                    )
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(dim=(0, 1)).to(grad_bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None


def _chunk_logit_gradient(
    logits: torch.Tensor,
    positions: slice,
    labels: torch.Tensor,
    log_normalizer: torch.Tensor,
    entropy: torch.Tensor,
    grad_log_probs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    settings: _HeadSettings,
) -> torch.Tensor:
    """The recomputed chunk's logit gradient, written over those logits."""
    if settings.entropy_gradient and grad_entropy is not None:
        return _log_prob_and_entropy_gradient(
            logits,
            labels[:, positions],
            log_normalizer[:, positions],
            entropy[:, positions],
            grad_log_probs[:, positions],
            grad_entropy[:, positions],
            settings.temperature,
            out=logits,  # the recomputed logits are ours to overwrite
        )
    return _log_prob_gradient(
        logits,
        labels[:, positions],
        log_normalizer[:, positions],
        grad_log_probs[:, positions],
        settings.temperature,
        out=logits,
    )


def _position_chunks(seq_len: int, chunk_size: int) -> list[slice]:
    return [slice(start, start + chunk_size) for start in range(0, seq_len, chunk_size)]


class _HeadMatmuls:
    """z = h W^T + b and its two gradients, in the dtype autocast chose."""

    def __init__(self, weight, bias, compute_dtype):
        self.dtype = compute_dtype or weight.dtype
        self.weight = weight.to(self.dtype)  # (V, H), a copy only under autocast
        self.bias = None if bias is None else bias.to(self.dtype)

    def __call__(self, hidden_chunk: torch.Tensor) -> torch.Tensor:
        # (B, c, H) -> (B, c, V)
        return torch.nn.functional.linear(
            hidden_chunk.to(self.dtype), self.weight, self.bias
        )

    def input_gradient(self, grad_logits: torch.Tensor) -> torch.Tensor:
        # dL/dh = dL/dz W: (B, c, V) -> (B, c, H)
        return grad_logits.to(self.dtype) @ self.weight

    def accumulate_weight_gradient(
        self, grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden_chunk
    ) -> None:
        # dL/dW += (dL/dz)^T h over the chunk's B * c positions: (V, H)
        grad_rows = grad_logits.to(self.dtype).reshape(-1, grad_logits.shape[-1])
        hidden_rows = hidden_chunk.to(self.dtype).reshape(-1, hidden_chunk.shape[-1])
        if grad_weight.dtype == self.dtype:
            grad_weight.addmm_(grad_rows.T, hidden_rows)
        else:
            grad_weight += (grad_rows.T @ hidden_rows).to(grad_weight.dtype)


@contextlib.contextmanager
def _head_matmuls(hidden, weight, bias, settings: _HeadSettings):
    """The head's matmuls with autocast off (its dtype was fixed at forward)."""
    with torch.autocast(hidden.device.type, enabled=False):
        yield _HeadMatmuls(weight, bias, settings.compute_dtype)


def check_log_prob_values(
    log_probs: object, name: str, mask: torch.Tensor | None = None
) -> None:
    """A tensor of log-probs a door can read: on a real device, and each value
    (where ``mask`` is 1, or everywhere) <= 0 and not NaN (-inf: probability 0).

    A floating-point tensor's other properties (shape, dtype) are left to the
    caller's own checks; anything else passes through to them.
    """
    if not isinstance(log_probs, torch.Tensor) or not log_probs.is_floating_point():
        return
    if log_probs.device.type == "meta":
        raise ValueError(
            f"{name} must hold values (a cpu or cuda tensor), got a tensor on the "
            "meta device"
        )
    values = log_probs.detach()
    if mask is not None:
        values = values[mask.bool()]  # (N,): the positions that count
    bad = torch.isnan(values) | (values > 0)  # (N,)
    if bool(bad.any()):
        first = values[bad][0].item()
        where = " inside the response mask" if mask is not None else ""
        raise ValueError(
            f"{name} must be log-probabilities (<= 0, not NaN){where}, got {first!r} "
            f"at {int(bad.sum())} of {bad.numel()} positions"
        )
