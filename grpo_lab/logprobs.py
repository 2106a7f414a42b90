"""Per-token log-probabilities and entropy, without a (B, T, V) log-softmax.

Taught in ``notebooks/02_logprobs_and_entropy.ipynb``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

# Architectures whose logits are exactly ``lm_head(final_hidden_state)``: no logit
# scaling or soft-capping after the head, so the chunked path may bypass forward().
CHUNKED_HEAD_MODEL_TYPES = frozenset({"olmo2", "qwen2", "qwen3", "llama"})

_ENTROPY_WORKSPACE_BYTES = 16 * 1024 * 1024


def _probability_dtype_logits(logits: torch.Tensor) -> torch.Tensor:
    # bfloat16 cannot represent GSPO's 1 +/- 3e-4 clip bounds: compute in float32.
    if logits.dtype in {torch.float16, torch.bfloat16}:
        return logits.float()
    return logits


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy H = logsumexp(z) - sum_v softmax(z)_v z_v over the last dim.

    (..., V) -> (...). Naive form: -(softmax(z) * log_softmax(z)).sum(-1).
    """
    if logits.ndim < 1:
        raise ValueError("logits must have a vocabulary dimension, got a scalar")
    logits = _probability_dtype_logits(logits)
    log_normalizer = torch.logsumexp(logits, dim=-1)
    expected_logit = (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    return log_normalizer - expected_logit


def _chunked_token_entropy(
    logits: torch.Tensor, log_normalizer: torch.Tensor
) -> torch.Tensor:
    """No-grad entropy over bounded sequence chunks. (B, T, V) -> (B, T)."""
    bytes_per_position = logits.shape[0] * logits.shape[-1] * logits.element_size()
    chunk = max(1, _ENTROPY_WORKSPACE_BYTES // max(1, bytes_per_position))
    with torch.no_grad():
        logits = logits.detach()
        log_normalizer = log_normalizer.detach()
        entropy = torch.empty_like(log_normalizer)  # (B, T)
        for start in range(0, logits.shape[1], chunk):
            chunk_logits = logits[:, start : start + chunk, :]
            probabilities = torch.softmax(chunk_logits, dim=-1)
            expected_logit = probabilities.mul_(chunk_logits).sum(dim=-1)
            entropy[:, start : start + chunk] = (
                log_normalizer[:, start : start + chunk] - expected_logit
            )
    return entropy


def _response_log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, return_token_entropy: bool
) -> dict[str, torch.Tensor]:
    """log p(label) = z_label - logsumexp(z). (B, T, V), (B, T) -> (B, T)."""
    logits = _probability_dtype_logits(logits)
    log_normalizer = torch.logsumexp(logits, dim=-1)  # (B, T)
    selected = logits.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)  # (B, T)
    result = {"log_probs": selected - log_normalizer}
    if return_token_entropy:
        result["token_entropy"] = _chunked_token_entropy(logits, log_normalizer)
    return result


def get_response_log_probs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
    logits_chunk_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Score ``labels`` under ``model``: log p(labels[b, t] | input_ids[b, :t+1]).

    ``logits_chunk_size``: ``None`` reads ``model.config.grpo_logits_chunk_size``
    (default 0); 0 runs the model's own forward; a positive size runs the decoder
    once and the output head on that many positions at a time, each chunk
    checkpointed so its (B, chunk, V) logits are recomputed in backward instead
    of kept. Naive equivalent: ``log_softmax(model(input_ids).logits).gather``.
    """
    return score_response_tokens(
        model,
        input_ids,
        labels,
        return_token_entropy=return_token_entropy,
        logits_chunk_size=logits_chunk_size,
    )


def score_response_tokens(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    return_token_entropy: bool = False,
    logits_chunk_size: int | None = None,
    temperature: float = 1.0,
) -> dict[str, torch.Tensor]:
    """:func:`get_response_log_probs` under the sampling distribution softmax(z / T).

    Rollouts sampled at temperature T come from softmax(logits / T), so ratios and
    old log-probs must be scored from logits / T too (as TRL does). T = 1 is
    exactly :func:`get_response_log_probs`.
    """
    if logits_chunk_size is None:
        logits_chunk_size = getattr(
            getattr(model, "config", None), "grpo_logits_chunk_size", 0
        )
    if (
        not isinstance(logits_chunk_size, int)
        or isinstance(logits_chunk_size, bool)
        or logits_chunk_size < 0
    ):
        raise ValueError(
            "logits_chunk_size must be a nonnegative integer, "
            f"got {logits_chunk_size!r}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    if logits_chunk_size == 0:
        logits = _scaled(model(input_ids).logits, temperature)  # (B, T, V)
        return _response_log_probs_from_logits(logits, labels, return_token_entropy)
    decoder, output_head = _decoder_and_head(model)
    hidden_states = decoder(input_ids=input_ids, use_cache=False).last_hidden_state

    def scaled_head(hidden):
        return _scaled(output_head(hidden), temperature)

    return _score_hidden_in_chunks(
        scaled_head, hidden_states, labels, logits_chunk_size, return_token_entropy
    )


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature == 1.0:
        return logits
    return _probability_dtype_logits(logits) / temperature


def _decoder_and_head(
    model: torch.nn.Module,
) -> tuple[torch.nn.Module, torch.nn.Module]:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    decoder = getattr(model, "model", None)
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if (
        model_type not in CHUNKED_HEAD_MODEL_TYPES
        or not isinstance(decoder, torch.nn.Module)
        or not isinstance(head, torch.nn.Module)
    ):
        raise ValueError(
            "Chunked log probabilities require a model whose logits are exactly "
            f"lm_head(hidden) ({', '.join(sorted(CHUNKED_HEAD_MODEL_TYPES))}) with "
            f"model.model and an output head; got model_type={model_type!r}"
        )
    return decoder, head


def _score_hidden_in_chunks(
    output_head: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    return_token_entropy: bool,
) -> dict[str, torch.Tensor]:
    def score_chunk(hidden_chunk, label_chunk):
        return _response_log_probs_from_logits(
            output_head(hidden_chunk), label_chunk, return_token_entropy
        )

    chunks = []
    for start in range(0, hidden_states.shape[1], chunk_size):
        hidden_chunk = hidden_states[:, start : start + chunk_size, :]  # (B, c, H)
        label_chunk = labels[:, start : start + chunk_size]  # (B, c)
        if torch.is_grad_enabled():
            chunks.append(
                checkpoint(score_chunk, hidden_chunk, label_chunk, use_reentrant=False)
            )
        else:
            chunks.append(score_chunk(hidden_chunk, label_chunk))
    return {key: torch.cat([c[key] for c in chunks], dim=1) for key in chunks[0]}
