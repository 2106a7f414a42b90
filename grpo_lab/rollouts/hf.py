"""Rollouts with Hugging Face ``generate``: exact policy samples, on any device.

Sampling follows softmax(logits / T) restricted to the top-p nucleus and nothing
else: no top-k, no repetition penalty, none of the generation defaults a hub
checkpoint ships. The token ids are returned exactly as sampled, so training
scores the very tokens that were drawn (no decode/re-encode round trip).
Each sampled token also comes with the log-prob the sampler gave it, read off
the scores ``generate`` sampled from (after temperature and top-p), so no
second forward pass is needed.
Taught in ``notebooks/`` on rollouts and the training loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from grpo_lab.prefix_sharing import distinct_rows
from grpo_lab.rollouts.base import Rollouts, SamplingSettings, check_generate_arguments


class HFRolloutBackend:
    """``generate(prompts, group_size, sampling) -> Rollouts`` with ``model.generate``.

    The backend samples from the live policy module, so ``sync`` has nothing to do.
    ``max_batch_size`` bounds how many sequences are generated at once (None: all);
    it also bounds the processed scores kept until the sampler's log-probs are
    read off them (rows x new tokens x vocabulary float32 values).
    ``share_prompt_prefix`` runs each distinct prompt once (all but its last
    token) and hands ``generate`` a copy of that key/value cache per response,
    instead of running the prompt G times: the same samples, with less work.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_batch_size: int | None = None,
        share_prompt_prefix: bool = True,
    ) -> None:
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError(
                "tokenizer must define pad_token_id and eos_token_id, got "
                f"{tokenizer.pad_token_id!r} and {tokenizer.eos_token_id!r}"
            )
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(
                f"max_batch_size must be None or positive, got {max_batch_size!r}"
            )
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.share_prompt_prefix = share_prompt_prefix

    def generate(
        self, prompts: list[str], group_size: int, sampling: SamplingSettings
    ) -> Rollouts:
        """B prompts -> B·G responses, prompt-major (``prompts[i]`` repeated G times).

        temperature 0 is greedy decoding (evaluation); otherwise tokens are drawn
        from softmax(logits / temperature) within the top-p nucleus. With
        ``sampling.seed`` set, the draw is reproducible and the global torch
        generator is left as it was (the RNG is forked, then seeded).
        """
        check_generate_arguments(prompts, group_size, sampling)
        repeated_prompts = [prompt for prompt in prompts for _ in range(group_size)]
        encoded = [
            self.tokenizer.encode(prompt, add_special_tokens=False)
            for prompt in prompts
        ]  # once per prompt; each response gets its own copy of the ids
        prompt_ids = [list(ids) for ids in encoded for _ in range(group_size)]
        chunk = self.max_batch_size or len(prompt_ids)
        response_ids: list[list[int]] = []
        log_probs: list[list[float]] = []
        with _seeded_rng(sampling.seed, _device_of(self.model)):
            for start in range(0, len(prompt_ids), chunk):
                ids, values = self._generate_chunk(
                    prompt_ids[start : start + chunk], sampling
                )
                response_ids += ids
                log_probs += values
        responses = []
        for index, ids in enumerate(response_ids):
            ids, text = self._cut_at_stop_string(ids, sampling.stop_strings)
            response_ids[index] = ids
            log_probs[index] = log_probs[index][: len(ids)]
            responses.append(text)
        return Rollouts(
            prompts=repeated_prompts,
            responses=responses,
            prompt_token_ids=prompt_ids,
            response_token_ids=response_ids,
            sampler_log_probs=log_probs,
        )

    def continue_ids(
        self, context_ids: list[list[int]], sampling: SamplingSettings
    ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """One continuation per context given as token ids (no re-tokenization).

        What ``generate`` does for each response, from ids: the sampled ids (cut
        after EOS or the first stop string), the sampler's log-prob of each, and
        their text. Used by the multi-turn rollout to resume after a tool reply
        (:mod:`grpo_lab.rollouts.multiturn`).
        """
        if not context_ids:
            raise ValueError("context_ids must not be empty, got []")
        chunk = self.max_batch_size or len(context_ids)
        response_ids: list[list[int]] = []
        log_probs: list[list[float]] = []
        with _seeded_rng(sampling.seed, _device_of(self.model)):
            for start in range(0, len(context_ids), chunk):
                ids, values = self._generate_chunk(
                    [list(row) for row in context_ids[start : start + chunk]],
                    sampling,
                )
                response_ids += ids
                log_probs += values
        texts = []
        for index, ids in enumerate(response_ids):
            ids, text = self._cut_at_stop_string(ids, sampling.stop_strings)
            response_ids[index] = ids
            log_probs[index] = log_probs[index][: len(ids)]
            texts.append(text)
        return response_ids, log_probs, texts

    def sync(self, policy: torch.nn.Module) -> None:
        """Nothing to load: generation reads the policy's live weights."""

    def _generate_chunk(
        self, prompt_ids: list[list[int]], sampling: SamplingSettings
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Sampled ids (cut after EOS) and the sampler's log-prob of each."""
        device = _device_of(self.model)
        input_ids, attention_mask = _left_pad(prompt_ids, self.tokenizer.pad_token_id)
        was_training = self.model.training
        self.model.eval()
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        try:
            with torch.no_grad(), _exact_generation_config(self.model, self.tokenizer):
                prefilled = (
                    _prefill_distinct_prompts(self.model, input_ids, attention_mask)
                    if self.share_prompt_prefix
                    else {}
                )
                output = self.model.generate(
                    input_ids=input_ids,  # (b, P)
                    attention_mask=attention_mask,  # (b, P)
                    generation_config=_generation_config(self.model, sampling),
                    # Stop strings are matched on text: generate needs the tokenizer.
                    tokenizer=self.tokenizer,
                    **prefilled,
                )
        finally:
            self.model.train(was_training)
        generated = output.sequences[:, input_ids.shape[1] :]  # (b, N)
        log_probs = sampled_token_log_probs(output.scores, generated)  # (b, N)
        eos_ids = _eos_token_ids(self.model, self.tokenizer)
        ids = [_cut_after_eos(row, eos_ids) for row in generated.tolist()]
        values = [row[: len(kept)] for row, kept in zip(log_probs.tolist(), ids)]
        return ids, values

    def _cut_at_stop_string(
        self, ids: list[int], stop_strings: tuple[str, ...]
    ) -> tuple[list[int], str]:
        """Keep tokens up to the one completing the first stop string; decode.

        The text is cut right after the stop string; the ids keep the whole
        final token (a token may carry characters past the stop string).
        """
        text = self._decode(ids)
        positions = [text.find(stop) for stop in stop_strings if stop in text]
        if not positions:
            return ids, text
        # The shortest prefix whose text contains a stop string (binary search:
        # containment only grows as tokens are added).
        low, high = 1, len(ids)
        while low < high:
            middle = (low + high) // 2
            if any(stop in self._decode(ids[:middle]) for stop in stop_strings):
                high = middle
            else:
                low = middle + 1
        kept_text = self._decode(ids[:low])
        ends = [
            kept_text.find(stop) + len(stop)
            for stop in stop_strings
            if stop in kept_text
        ]
        return ids[:low], kept_text[: min(ends)]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def sampled_token_log_probs(
    scores: tuple[torch.Tensor, ...], tokens: torch.Tensor
) -> torch.Tensor:
    """log softmax(scores_t)[y_t] for each step t: the sampler's own log-probs.

    ``scores`` are ``generate``'s processed scores, one (b, V) tensor per step:
    logits / temperature with tokens outside the top-p nucleus at -inf, so the
    result is the log-prob inside the renormalised nucleus, the distribution
    the token was drawn from. Greedy scores are the raw logits (log-probs at
    temperature 1). Positions after EOS hold padding; callers cut them.
    """
    if len(scores) != tokens.shape[1]:
        raise ValueError(
            f"scores must have one entry per generated token ({tokens.shape[1]}), "
            f"got {len(scores)}"
        )
    columns = [
        torch.log_softmax(step.float(), dim=-1).gather(1, tokens[:, t, None])
        for t, step in enumerate(scores)
    ]  # N x (b, 1)
    if not columns:
        return tokens.new_zeros(tokens.shape, dtype=torch.float32)
    return torch.cat(columns, dim=1).cpu()  # (b, N)


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@contextlib.contextmanager
def _seeded_rng(seed: int | None, device: torch.device) -> Iterator[None]:
    """Seed torch inside a fork of its RNG state, or use the global RNG (None)."""
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _left_pad(
    prompt_ids: list[list[int]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad so every prompt ends at the same column (generation appends there)."""
    width = max(len(ids) for ids in prompt_ids)
    padded = [[pad_token_id] * (width - len(ids)) + ids for ids in prompt_ids]
    mask = [[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids]
    return torch.tensor(padded), torch.tensor(mask)  # (b, P), (b, P)


def _prefill_distinct_prompts(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> dict[str, object]:
    """``past_key_values`` for ``generate``: each distinct prompt prefilled once.

    The cache covers every column but the last, so ``generate`` still runs the
    last prompt token per row and samples from its logits. Rows that repeat a
    prompt (left padding included) share its prefill, copied row by row.
    Positions follow ``generate``'s own rule for left padding: cumsum(mask) - 1,
    and 0 on padding. Returns {} when no prompt repeats or prompts are 1 token.
    """
    width = input_ids.shape[1]
    if width < 2:
        return {}
    keys = torch.cat([input_ids[:, :-1], attention_mask[:, :-1]], dim=1)
    distinct, row_to_prompt = distinct_rows(keys)  # (U, 2(P-1)), (b,)
    if distinct.shape[0] == input_ids.shape[0]:
        return {}
    prefix_ids, prefix_mask = distinct.split(width - 1, dim=1)  # (U, P-1) each
    positions = (prefix_mask.cumsum(-1) - 1).masked_fill(prefix_mask == 0, 0)
    cache = model(
        input_ids=prefix_ids,
        attention_mask=prefix_mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,  # the prefill's logits are not needed
    ).past_key_values
    cache.batch_select_indices(row_to_prompt)
    return {"past_key_values": cache}


def _eos_token_ids(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> list[int]:
    """The tokenizer's EOS plus any end token the model's generation config names."""
    configured = getattr(model.generation_config, "eos_token_id", None)
    if configured is None:
        configured = []
    elif isinstance(configured, int):
        configured = [configured]
    return list(dict.fromkeys([tokenizer.eos_token_id, *configured]))


@contextlib.contextmanager
def _exact_generation_config(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
) -> Iterator[None]:
    """Hide the model's own generation defaults (top_k, repetition penalty, ...).

    ``generate`` fills every unset field from ``model.generation_config``; a hub
    checkpoint may set sampling tweaks there that would bend the distribution.
    Only the end and pad tokens are kept while generating.
    """
    original = model.generation_config
    model.generation_config = GenerationConfig(
        eos_token_id=_eos_token_ids(model, tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=original.bos_token_id,
    )
    try:
        yield
    finally:
        model.generation_config = original


def _generation_config(
    model: PreTrainedModel, sampling: SamplingSettings
) -> GenerationConfig:
    """Every logits processor neutral except temperature and top-p.

    transformers' global default is top_k=50, so top_k=0 is passed explicitly.
    """
    neutral = {
        "max_new_tokens": sampling.max_new_tokens,
        "stop_strings": list(sampling.stop_strings) or None,
        "min_p": None,
        "typical_p": 1.0,
        "epsilon_cutoff": 0.0,
        "eta_cutoff": 0.0,
        "repetition_penalty": 1.0,
        "no_repeat_ngram_size": 0,
        "min_length": 0,
        "min_new_tokens": None,
        "renormalize_logits": False,
        "num_beams": 1,
        "use_cache": True,
        # The processed scores give the sampler's log-probs; ids are unchanged.
        "output_scores": True,
        "return_dict_in_generate": True,
        "eos_token_id": model.generation_config.eos_token_id,
        "pad_token_id": model.generation_config.pad_token_id,
    }
    if sampling.temperature == 0:
        return GenerationConfig(do_sample=False, **neutral)
    return GenerationConfig(
        do_sample=True,
        top_k=0,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        **neutral,
    )


def _cut_after_eos(generated: list[int], eos_ids: list[int]) -> list[int]:
    """Keep tokens up to and including the first EOS; drop the padding after it.

    A row without EOS either ran to ``max_new_tokens`` (kept whole) or stopped on
    a stop string and was padded afterwards (cut later by the stop-string rule).
    """
    for position, token in enumerate(generated):
        if token in eos_ids:
            return generated[: position + 1]
    return generated
