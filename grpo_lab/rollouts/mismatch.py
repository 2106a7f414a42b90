"""A rollout backend that samples from a controlled perturbation of the policy.

A fast inference engine never samples from exactly the distribution the trainer
scores: lower precision, a truncated nucleus, a different temperature, weights
that arrive late. This backend makes each of those happen on purpose, on any
device, and reports the perturbed sampler's own log-probs, so the gap

    d_t = log pi_trainer(y_t) - log pi_sampler(y_t)

and the importance-sampling correction built on it can be watched on a laptop.
One perturbation per backend:

    none:         the policy itself (d = 0 up to float noise)
    bf16:         logits rounded to bfloat16 before the softmax (8 significant
                  bits: a relative spacing of 2^-8 = 0.0039)
    fp16:         logits rounded to float16 before the softmax (11 significant
                  bits: 2^-11 = 0.00049, 8x finer than bfloat16, the precision
                  of "defeating the training-inference mismatch via FP16",
                  arXiv:2510.26788; its range, up to 65504, holds any logit)
    top_p:        nucleus sampling with mass ``scale``; the trainer scores the
                  full distribution
    temperature:  softmax(logits / scale) at sampling only; the trainer scores
                  at the run's temperature
    stale:        a frozen copy of the weights, refreshed on every k-th ``sync``
                  call only (k = ``sync_every``)
    noise:        z + scale * eps, eps ~ N(0, 1) drawn afresh for every token
                  (seeded with the sampling seed)

The sampling loop is a plain one (prompt prefill, then one token at a time with
the key/value cache); it follows the sampling settings' temperature and top-p
except where the perturbation replaces them. Greedy requests (temperature 0)
take the argmax of the perturbed logits. Evaluation through this backend sees
the perturbed sampler too. Taught in ``notebooks/`` on rollouts.
"""

from __future__ import annotations

import copy
import math

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo_lab.rollouts.base import Rollouts, SamplingSettings, check_generate_arguments
from grpo_lab.rollouts.hf import (
    HFRolloutBackend,
    _cut_after_eos,
    _device_of,
    _eos_token_ids,
    _left_pad,
)

PERTURBATIONS = ("none", "bf16", "fp16", "top_p", "temperature", "stale", "noise")
# The dtype each rounding perturbation rounds the logits to.
ROUNDING_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The scale each perturbation uses when none is given; the others take none.
DEFAULT_SCALES = {"top_p": 0.9, "temperature": 0.7, "noise": 0.5}


def check_mismatch_settings(
    mismatch: str,
    scale: float | None,
    sync_every: int,
    *,
    backend: str = "mismatch",
) -> None:
    """The one check of a perturbation, its scale and its sync period.

    ``scale``: top_p's nucleus mass in (0, 1]; temperature's sampling
    temperature > 0; noise's standard deviation >= 0; None picks
    ``DEFAULT_SCALES``; the other perturbations take no scale. ``sync_every``:
    a positive int, other than 1 only for ``stale``. A perturbation needs
    ``backend`` "mismatch" (the run's backend, for ``TrainConfig``).
    """
    if mismatch not in PERTURBATIONS:
        raise ValueError(f"mismatch must be one of {PERTURBATIONS}, got {mismatch!r}")
    if mismatch != "none" and backend != "mismatch":
        raise ValueError(
            f"mismatch {mismatch!r} needs backend 'mismatch', got backend {backend!r}"
        )
    if scale is not None:
        _check_scale(mismatch, scale)
    if (
        isinstance(sync_every, bool)
        or not isinstance(sync_every, int)
        or sync_every < 1
    ):
        raise ValueError(
            f"mismatch_sync_every must be a positive int, got {sync_every!r}"
        )
    if sync_every != 1 and mismatch != "stale":
        raise ValueError(
            f"mismatch_sync_every applies to mismatch 'stale' only and must be 1 "
            f"for mismatch {mismatch!r}, got {sync_every!r}"
        )


def _check_scale(mismatch: str, scale: float) -> None:
    if mismatch not in DEFAULT_SCALES:
        raise ValueError(
            f"mismatch_scale must be None for mismatch {mismatch!r} (only "
            f"{tuple(DEFAULT_SCALES)} take a scale), got {scale!r}"
        )
    number = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    if not number or not math.isfinite(scale):
        raise ValueError(f"mismatch_scale must be a finite number, got {scale!r}")
    if mismatch == "top_p" and not 0 < scale <= 1:
        raise ValueError(
            f"mismatch_scale for mismatch 'top_p' is the nucleus mass and must be "
            f"in (0, 1], got {scale!r}"
        )
    if mismatch == "temperature" and not scale > 0:
        raise ValueError(
            f"mismatch_scale for mismatch 'temperature' is the sampling "
            f"temperature and must be > 0, got {scale!r}"
        )
    if mismatch == "noise" and not scale >= 0:
        raise ValueError(
            f"mismatch_scale for mismatch 'noise' is the noise's standard "
            f"deviation and must be >= 0, got {scale!r}"
        )


def resolved_scale(mismatch: str, scale: float | None) -> float | None:
    """``scale``, or the perturbation's default when it is None."""
    return DEFAULT_SCALES.get(mismatch) if scale is None else float(scale)


def nucleus_mask(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """True on the smallest set of top tokens whose probability reaches top_p.

    Tokens are sorted by probability; a token is kept when the mass strictly
    before it is below top_p (so the most likely token is always kept).
    """
    probabilities = torch.softmax(scores, dim=-1)  # (b, V)
    sorted_probabilities, order = probabilities.sort(dim=-1, descending=True)
    mass_before = sorted_probabilities.cumsum(dim=-1) - sorted_probabilities
    keep_sorted = mass_before < top_p  # (b, V)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # (b, V)


def sampler_scores(
    logits: torch.Tensor,
    mismatch: str,
    scale: float | None,
    sampling: SamplingSettings,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The perturbed sampler's scores: log_softmax of them is log pi_sampler.

    z = logits (float32); bf16: z = bfloat16(z); fp16: z = float16(z); noise:
    z + scale * eps; then z / T with T = scale for ``temperature``, else
    sampling.temperature (greedy, T = 0: z unscaled); then tokens outside the
    nucleus (mass scale for ``top_p``, else sampling.top_p) set to -inf.
    Shapes (b, V) -> (b, V).
    """
    scale = resolved_scale(mismatch, scale)
    scores = logits.float()  # (b, V)
    if mismatch in ROUNDING_DTYPES:
        scores = scores.to(ROUNDING_DTYPES[mismatch]).float()
    if mismatch == "noise" and scale > 0:
        noise = torch.randn(
            scores.shape, generator=generator, device=scores.device
        )  # (b, V)
        scores = scores + scale * noise
    if sampling.temperature == 0:
        return scores
    temperature = scale if mismatch == "temperature" else sampling.temperature
    scores = scores / temperature
    top_p = scale if mismatch == "top_p" else sampling.top_p
    if top_p < 1:
        scores = scores.masked_fill(~nucleus_mask(scores, top_p), float("-inf"))
    return scores


class MismatchRolloutBackend:
    """``generate(prompts, group_size, sampling) -> Rollouts`` from a perturbed policy.

    ``mismatch`` picks the perturbation (``PERTURBATIONS``), ``scale`` its size
    (None: ``DEFAULT_SCALES``), ``sync_every`` the period of ``stale``. The
    returned ``sampler_log_probs`` are log softmax of :func:`sampler_scores` at
    each sampled token, one per response token (a sampled EOS included).
    ``max_batch_size`` bounds how many sequences are sampled at once (None: all).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        mismatch: str = "none",
        scale: float | None = None,
        sync_every: int = 1,
        max_batch_size: int | None = None,
    ) -> None:
        check_mismatch_settings(mismatch, scale, sync_every)
        # Checks the tokenizer and max_batch_size; cuts at stop strings.
        self.text = HFRolloutBackend(model, tokenizer, max_batch_size)
        self.max_batch_size = max_batch_size
        self.model = model
        self.tokenizer = tokenizer
        self.mismatch = mismatch
        self.scale = resolved_scale(mismatch, scale)
        self.sync_every = sync_every
        self.sync_calls = 0
        self.frozen = self._frozen_copy(model) if mismatch == "stale" else None

    def generate(
        self, prompts: list[str], group_size: int, sampling: SamplingSettings
    ) -> Rollouts:
        """B prompts -> B·G responses, prompt-major, with the sampler's log-probs.

        With ``sampling.seed`` set, samples (and noise) come from a generator
        seeded with it; otherwise from one seeded by the global torch RNG.
        """
        check_generate_arguments(prompts, group_size, sampling)
        encoded = [
            self.tokenizer.encode(prompt, add_special_tokens=False)
            for prompt in prompts
        ]
        prompt_ids = [list(ids) for ids in encoded for _ in range(group_size)]
        generator = self._generator(sampling.seed)
        chunk = self.max_batch_size or len(prompt_ids)
        ids, log_probs = [], []
        for start in range(0, len(prompt_ids), chunk):
            chunk_ids, chunk_log_probs = self._sample(
                prompt_ids[start : start + chunk], sampling, generator
            )
            ids += chunk_ids
            log_probs += chunk_log_probs
        rollouts = Rollouts(
            prompts=[prompt for prompt in prompts for _ in range(group_size)],
            responses=[],
            prompt_token_ids=prompt_ids,
            response_token_ids=[],
            sampler_log_probs=[],
        )
        for row, values in zip(ids, log_probs):
            row, text = self.text._cut_at_stop_string(row, sampling.stop_strings)
            rollouts.response_token_ids.append(row)
            rollouts.sampler_log_probs.append(values[: len(row)])
            rollouts.responses.append(text)
        return rollouts

    def sync(self, policy: torch.nn.Module) -> None:
        """stale: copy the policy's weights in on every ``sync_every``-th call.

        Other perturbations sample from the live policy: nothing to load.
        """
        self.sync_calls += 1
        if self.frozen is not None and self.sync_calls % self.sync_every == 0:
            self.frozen.load_state_dict(policy.state_dict())

    def refresh(self, policy: torch.nn.Module) -> None:
        """Load the policy's weights now, without counting a sync (stale only)."""
        if self.frozen is not None:
            self.frozen.load_state_dict(policy.state_dict())

    def sampling_model(self) -> torch.nn.Module:
        """The module tokens are drawn from: the frozen copy for stale."""
        return self.model if self.frozen is None else self.frozen

    @staticmethod
    def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
        frozen = copy.deepcopy(model)
        frozen.requires_grad_(False)
        return frozen.eval()

    def _generator(self, seed: int | None) -> torch.Generator:
        device = _device_of(self.model)
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        return torch.Generator(device=device).manual_seed(seed)

    def _sample(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingSettings,
        generator: torch.Generator,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """The sampling loop: prefill, then one token per step, cache reused."""
        model = self.sampling_model()
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                tokens, log_probs = self._sample_tokens(
                    model, prompt_ids, sampling, generator
                )
        finally:
            model.train(was_training)
        eos_ids = _eos_token_ids(self.model, self.tokenizer)
        ids = [_cut_after_eos(row, eos_ids) for row in tokens.tolist()]
        values = [row[: len(kept)] for row, kept in zip(log_probs.tolist(), ids)]
        return ids, values

    def _sample_tokens(
        self,
        model: torch.nn.Module,
        prompt_ids: list[list[int]],
        sampling: SamplingSettings,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = _device_of(model)
        input_ids, attention_mask = _left_pad(prompt_ids, self.tokenizer.pad_token_id)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        eos = torch.tensor(_eos_token_ids(self.model, self.tokenizer), device=device)
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)
        tokens, log_probs, cache = [], [], None
        step_ids = input_ids  # (b, P) first, then (b, 1)
        for _ in range(sampling.max_new_tokens):
            positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)  # (b, P+t)
            output = model(
                input_ids=step_ids,
                attention_mask=attention_mask,
                position_ids=positions[:, -step_ids.shape[1] :],
                past_key_values=cache,
                use_cache=True,
            )
            cache = output.past_key_values
            scores = sampler_scores(
                output.logits[:, -1], self.mismatch, self.scale, sampling, generator
            )  # (b, V)
            token, log_prob = _draw(scores, sampling.temperature == 0, generator)
            token = token.masked_fill(finished, self.tokenizer.pad_token_id)  # (b,)
            tokens.append(token)
            log_probs.append(log_prob)
            finished = finished | torch.isin(token, eos)
            if bool(finished.all()):
                break
            step_ids = token[:, None]  # (b, 1)
            attention_mask = torch.cat(
                [attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)],
                dim=1,
            )
        return torch.stack(tokens, 1).cpu(), torch.stack(log_probs, 1).cpu()


def _draw(
    scores: torch.Tensor, greedy: bool, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row (argmax when greedy) and log softmax(scores) there."""
    log_softmax = torch.log_softmax(scores, dim=-1)  # (b, V)
    if greedy:
        token = scores.argmax(dim=-1)  # (b,)
    else:
        token = torch.multinomial(log_softmax.exp(), 1, generator=generator).squeeze(
            1
        )  # (b,)
    return token, log_softmax.gather(1, token[:, None]).squeeze(1)  # (b,), (b,)
