"""Rollouts with vLLM on a GPU, and the weight sync that keeps vLLM on-policy.

vLLM serves its own copy of the weights, so after every optimizer step ``sync``
copies the policy's parameters into it; until then vLLM samples from the old
policy. ``log_prob_gap`` checks the copy: vLLM reports the log-probability of
each token it sampled, and right after a sync the policy must give the same
numbers, up to bfloat16 and kernel noise.

vLLM is imported only when a backend is built, so this module imports without
it. Everything that does not need vLLM (sampling arguments, conversion of its
outputs, weight names, the health check) is a plain function tested on CPU.
Taught in ``notebooks/`` on rollouts and the training loop.

Written against vLLM 0.31.0 (the ``vllm`` extra), V1 engine:

- ``LLM.apply_model(fn)`` runs ``fn(model)`` on the worker's ``nn.Module``
  (``vllm/entrypoints/llm.py``; ``WorkerBase.apply_model`` is
  ``fn(self.get_model())``). With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the engine
  core, and with one GPU the ``UniProcExecutor``, live in this process and
  ``collective_rpc`` calls the worker directly without serializing
  (``vllm/v1/executor/uniproc_executor.py``; ``vllm/v1/engine/llm_engine.py``
  sets ``self.model_executor`` only in that mode). So the weights cross by
  reference, one tensor at a time. TRL's colocate mode does the same through
  ``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights``
  (``trl/generation/vllm_generation.py``); the older V0 path
  ``...driver_worker.model_runner.model`` is the same object.
- The model's ``load_weights`` takes Hugging Face checkpoint names and fuses
  q/k/v and gate/up itself; Qwen2 skips ``lm_head.`` when the embeddings are tied
  (``vllm/model_executor/models/qwen2.py``). Plain bfloat16 weights need no
  post-processing; quantized models would need vLLM's layerwise reload
  (``vllm/model_executor/model_loader/reload``), which this backend does not use.
- ``logprobs_mode="processed_logprobs"`` makes the reported log-probs those of
  softmax(logits / T) after top-p, the distribution actually sampled
  (``vllm/v1/sample/ops/topk_topp_sampler.py``); the default ``raw_logprobs``
  ignores the temperature. TRL sets the same mode.
- ``SamplingParams``: ``top_k=0`` (or -1) disables top-k; ``n`` must be 1 for
  greedy sampling (temperature < 1e-5); with a seed, the n samples of a request
  use seeds seed, seed + 1, ... (``vllm/v1/engine/parallel_sampling.py``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from grpo_lab.logprobs import check_temperature, get_response_log_probs
from grpo_lab.lora import merged_named_parameters
from grpo_lab.masks import pad_prompt_and_response_ids
from grpo_lab.rollouts.base import Rollouts, SamplingSettings, check_generate_arguments

# Sources checked (vllm-project/vllm unless named; commit prefixes):
#   vllm/entrypoints/llm.py @10fdb8f0 (apply_model, collective_rpc,
#     reset_prefix_cache, generate with a list of SamplingParams)
#   vllm/v1/executor/uniproc_executor.py @0b940c49 (in-process collective_rpc)
#   vllm/v1/engine/llm_engine.py (model_executor only when not multiprocess)
#   vllm/v1/worker/worker_base.py (apply_model = fn(self.get_model()))
#   vllm/model_executor/models/qwen2.py @013a2792 (lm_head skipped when tied)
#   vllm/distributed/weight_transfer/ipc_engine.py @406784bd (the multi-process
#     alternative: CUDA IPC handles, then the same model.load_weights)
#   vllm/v1/sample/ops/topk_topp_sampler.py (processed_logprobs after top-p)
#   vllm/v1/engine/parallel_sampling.py (child seed = seed + index)
#   vllm/sampling_params.py (top_k 0 disables; n == 1 for greedy)
#   huggingface/trl trl/generation/vllm_generation.py @02bf6bcd (colocate mode)
# Pinned: vllm==0.31.0. Watch log_prob_gap after the first sync of a new setup:
# a large gap means the weights did not arrive.

# vLLM samples greedily below this temperature (its _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5
VLLM_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
INSTALL_HINT = "install the vllm extra: pip install -e '.[vllm]'"


class VLLMRolloutBackend:
    """``generate(prompts, group_size, sampling) -> Rollouts`` served by vLLM.

    vLLM loads ``model_name_or_path`` (weights and tokenizer) once; ``sync(policy)``
    must follow every optimizer step. The engine runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set here) so that ``sync`` can hand
    tensors over without copying them through a pipe. Needs a CUDA GPU and the
    ``vllm`` extra; both are checked first, with a clear error.

    ``gpu_memory_utilization`` is vLLM's share of the GPU (weights + KV cache);
    the rest is left to the policy and optimizer training on the same GPU.
    ``enforce_eager`` skips CUDA-graph capture: slower sampling, faster start.
    """

    def __init__(
        self,
        model_name_or_path: str,
        *,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        seed: int = 0,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
    ) -> None:
        _check_engine_arguments(dtype, gpu_memory_utilization, max_model_len, seed)
        vllm = import_vllm()
        require_cuda()
        # Read when the engine is built: keep the engine core in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.llm = vllm.LLM(
            model=model_name_or_path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager,
            tensor_parallel_size=1,
            logprobs_mode="processed_logprobs",
        )
        _require_in_process_engine(self.llm)
        self.sampling_params_class = vllm.SamplingParams
        self.tokenizer = self.llm.get_tokenizer()
        self.dtype = VLLM_DTYPES[dtype]

    def generate(
        self, prompts: list[str], group_size: int, sampling: SamplingSettings
    ) -> Rollouts:
        """B prompts -> B·G responses, prompt-major, with vLLM's own log-probs.

        Prompts are tokenized without special tokens (as the HF backend and
        ``tokenize_prompt_and_output`` do) and sent as token ids, so training
        scores exactly the ids vLLM saw. temperature 0 is greedy: one sample per
        prompt, repeated G times.
        """
        check_generate_arguments(prompts, group_size, sampling)
        prompt_ids = [
            self.tokenizer.encode(prompt, add_special_tokens=False)
            for prompt in prompts
        ]
        params = [
            self.sampling_params_class(
                **vllm_sampling_kwargs(sampling, group_size, prompt_index)
            )
            for prompt_index in range(len(prompts))
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False
        )
        return request_outputs_to_rollouts(
            prompts, outputs, group_size, greedy=is_greedy(sampling)
        )

    def continue_ids(
        self, context_ids: list[list[int]], sampling: SamplingSettings
    ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """One continuation per context given as token ids: the multi-turn
        rollout's next turn (:mod:`grpo_lab.rollouts.multiturn`).

        Each context (prompt, earlier turns, tool replies) is sent as token ids,
        one request per context with n=1 and seed ``sampling.seed + index``, so
        vLLM generates each turn from exactly the ids the episode holds; its
        prefix cache reuses the earlier turns' keys and values. Returns the
        sampled ids (a final EOS kept; cut after a stop string by vLLM), vLLM's
        log-prob of each, and their text.
        """
        if not context_ids:
            raise ValueError("context_ids must not be empty, got []")
        params = [
            self.sampling_params_class(**vllm_sampling_kwargs(sampling, 1, index))
            for index in range(len(context_ids))
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(ids)} for ids in context_ids],
            params,
            use_tqdm=False,
        )
        return request_outputs_to_continuations(outputs, len(context_ids))

    def sync(self, policy: torch.nn.Module) -> None:
        """Copy the policy's current weights into vLLM, then drop its prefix cache.

        Parameters stream one at a time, cast to vLLM's dtype (no copy when the
        policy already is); vLLM copies each into its own, fused, tensors. Cached
        prompt KV was computed with the old weights, hence the reset.
        """
        weights = policy_weights_for_vllm(policy, self.dtype)
        with torch.no_grad():
            self.llm.apply_model(lambda model: model.load_weights(weights))
        self.llm.reset_prefix_cache()


def import_vllm() -> Any:
    """The ``vllm`` module, or an ImportError that says how to install it."""
    try:
        return importlib.import_module("vllm")
    except ImportError as error:
        raise ImportError(
            f"The vLLM rollout backend needs vLLM: {INSTALL_HINT} "
            f"(import failed: {error})"
        ) from error


def require_cuda() -> None:
    """Raise a RuntimeError unless torch sees a CUDA GPU (vLLM needs one)."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "The vLLM rollout backend needs a CUDA GPU and torch sees none "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); "
            "use the hf backend on this machine"
        )


def is_greedy(sampling: SamplingSettings) -> bool:
    """True when vLLM decodes greedily: temperature below 1e-5."""
    return sampling.temperature < GREEDY_TEMPERATURE


def vllm_sampling_kwargs(
    sampling: SamplingSettings, group_size: int, prompt_index: int = 0
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one prompt's group.

    Temperature and top-p only: top_k=0 disables top-k, so samples follow
    softmax(logits / T) within the nucleus. logprobs=0 returns the log-prob of
    each sampled token. Greedy requests ask for n=1 (vLLM refuses more). With a
    seed, prompt i's samples use seeds seed + i·G + j, j < G: distinct across
    the whole batch, so identical prompts still get independent samples.
    """
    greedy = is_greedy(sampling)
    seed = None
    if sampling.seed is not None and not greedy:
        seed = sampling.seed + prompt_index * group_size
    return {
        "n": 1 if greedy else group_size,
        "temperature": 0.0 if greedy else sampling.temperature,
        "top_p": 1.0 if greedy else sampling.top_p,
        "top_k": 0,
        "max_tokens": sampling.max_new_tokens,
        "stop": list(sampling.stop_strings),
        "include_stop_str_in_output": True,
        "seed": seed,
        "logprobs": 0,
    }


def request_outputs_to_rollouts(
    prompts: Sequence[str],
    request_outputs: Sequence[Any],
    group_size: int,
    *,
    greedy: bool = False,
) -> Rollouts:
    """vLLM ``RequestOutput``s (one per prompt) -> prompt-major ``Rollouts``.

    Each output's ``outputs`` holds G ``CompletionOutput``s (one when ``greedy``,
    repeated G times). Token ids are kept exactly as sampled, a final EOS
    included; the text ends right after a stop string (vLLM's
    ``include_stop_str_in_output``). ``sampler_log_probs[k][t]`` is vLLM's
    log-prob of ``response_token_ids[k][t]``; None when vLLM returned none.
    """
    if len(request_outputs) != len(prompts):
        raise ValueError(
            f"request_outputs must have one entry per prompt ({len(prompts)}), "
            f"got {len(request_outputs)}"
        )
    rollouts = Rollouts([], [], [], [], [])
    for prompt, request_output in zip(prompts, request_outputs):
        for completion in _group_completions(request_output, group_size, greedy):
            rollouts.prompts.append(prompt)
            rollouts.responses.append(completion.text)
            rollouts.prompt_token_ids.append(list(request_output.prompt_token_ids))
            rollouts.response_token_ids.append(list(completion.token_ids))
            rollouts.sampler_log_probs.append(sampled_token_log_probs(completion))
    return _without_missing_log_probs(rollouts)


def request_outputs_to_continuations(
    request_outputs: Sequence[Any], count: int
) -> tuple[list[list[int]], list[list[float]], list[str]]:
    """vLLM outputs of ``count`` one-sample requests -> (ids, log-probs, texts).

    The multi-turn rollout keeps one sampler log-prob per model token, so a
    completion without log-probs is refused.
    """
    if len(request_outputs) != count:
        raise ValueError(
            f"request_outputs must have one entry per context ({count}), "
            f"got {len(request_outputs)}"
        )
    ids, log_probs, texts = [], [], []
    for request_output in request_outputs:
        (completion,) = _group_completions(request_output, 1, greedy=True)
        values = sampled_token_log_probs(completion)
        if values is None:
            raise ValueError(
                "each continuation must carry vLLM's logprobs (SamplingParams "
                "logprobs=0), got None"
            )
        ids.append(list(completion.token_ids))
        log_probs.append(values)
        texts.append(completion.text)
    return ids, log_probs, texts


def _group_completions(request_output: Any, group_size: int, greedy: bool) -> list[Any]:
    completions = sorted(request_output.outputs, key=lambda output: output.index)
    expected = 1 if greedy else group_size
    if len(completions) != expected:
        raise ValueError(
            f"each request output must hold {expected} completion(s) "
            f"(group_size={group_size}, greedy={greedy}), got {len(completions)}"
        )
    return completions * (group_size if greedy else 1)


def sampled_token_log_probs(completion: Any) -> list[float] | None:
    """The log-prob vLLM reported for each sampled token, or None if absent.

    ``completion.logprobs`` has one mapping per sampled token, from token id to
    a ``Logprob`` whose ``.logprob`` is the value; with ``logprobs=0`` the
    mapping holds just the sampled token.
    """
    if completion.logprobs is None:
        return None
    token_ids = list(completion.token_ids)
    if len(completion.logprobs) != len(token_ids):
        raise ValueError(
            f"completion.logprobs must have one entry per sampled token "
            f"({len(token_ids)}), got {len(completion.logprobs)}"
        )
    return [
        _log_prob_of(position, token_id)
        for position, token_id in zip(completion.logprobs, token_ids)
    ]


def _log_prob_of(position: Mapping[int, Any], token_id: int) -> float:
    if token_id not in position:
        raise ValueError(
            f"completion.logprobs must include the sampled token {token_id}, "
            f"got token ids {sorted(position)}"
        )
    return float(position[token_id].logprob)


def _without_missing_log_probs(rollouts: Rollouts) -> Rollouts:
    missing = [values is None for values in rollouts.sampler_log_probs]
    if all(missing):
        rollouts.sampler_log_probs = None
    elif any(missing):
        raise ValueError(
            "every completion must carry logprobs or none must, got "
            f"{sum(missing)} of {len(missing)} without"
        )
    return rollouts


def vllm_weight_name(name: str) -> str:
    """A policy parameter name in the checkpoint form vLLM's loader expects.

    Hugging Face names already are that form (``model.layers.0.mlp.up_proj.weight``);
    only the ``_orig_mod.`` segment added by ``torch.compile`` is removed.
    """
    return name.replace("_orig_mod.", "")


def policy_weights_for_vllm(
    policy: torch.nn.Module, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, detached tensor in ``dtype``), one at a time.

    ``named_parameters`` lists a tied embedding once (``model.embed_tokens``);
    an ``lm_head.`` entry is skipped when the config ties the embeddings, as
    vLLM's Qwen2 loader does. ``.to(dtype)`` returns the parameter itself when
    it already has ``dtype``: no extra copy of the model is made. A policy
    with LoRA layers sends merged weights, W + (alpha / r) B A, under the base
    model's names (:func:`grpo_lab.lora.merged_named_parameters`): vLLM
    samples the adapted policy, and the sampler log-prob gap shows the sync.
    """
    config = getattr(policy, "config", None)
    skip_lm_head = bool(getattr(config, "tie_word_embeddings", False))
    for name, parameter in merged_named_parameters(policy):
        name = vllm_weight_name(name)
        if skip_lm_head and name.startswith("lm_head."):
            continue
        yield name, parameter.detach().to(dtype)


def log_prob_gap(
    policy: torch.nn.Module,
    rollouts: Rollouts,
    temperature: float,
    *,
    pad_token_id: int = 0,
    logits_chunk_size: int | None = None,
) -> dict[str, float]:
    """How far the sampler's log-probs are from the policy's, on the sampled tokens.

    d_t = log pi_policy(y_t) - log pi_sampler(y_t), with log pi_policy from
    softmax(logits / temperature) (``get_response_log_probs``). Returns, over all
    response tokens: mean |d|, max |d|, mean d, and mean exp(d), the importance
    ratio a trainer would apply. Right after ``sync`` the gap should be small
    (bfloat16 noise, ~1e-2); a large gap means the weights did not arrive.

    Exact only for top_p = 1 (vLLM renormalizes inside the nucleus). For greedy
    rollouts vLLM reports log softmax(logits): pass temperature 1.0. The policy
    is scored in eval mode, then restored.
    """
    prompt_ids, response_ids, sampler_log_probs = _checked_rollout_ids(rollouts)
    check_temperature(temperature)
    batch = pad_prompt_and_response_ids(prompt_ids, response_ids, pad_token_id)
    policy_log_probs = _score_without_grad(
        policy, batch, temperature, logits_chunk_size
    )  # (B, T-1)
    response_mask = batch["response_mask"].to(policy_log_probs.device).bool()
    sampler = torch.tensor(
        [value for row in sampler_log_probs for value in row],
        dtype=policy_log_probs.dtype,
        device=policy_log_probs.device,
    )  # (N,) response tokens, row-major like response_mask
    gap = policy_log_probs[response_mask] - sampler  # (N,)
    return {
        "rollout/logprob_abs_diff_mean": gap.abs().mean().item(),
        "rollout/logprob_abs_diff_max": gap.abs().max().item(),
        "rollout/logprob_diff_mean": gap.mean().item(),
        "rollout/prob_ratio_mean": gap.exp().mean().item(),
    }


def _checked_rollout_ids(
    rollouts: Rollouts,
) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    for field in ("prompt_token_ids", "response_token_ids", "sampler_log_probs"):
        if getattr(rollouts, field) is None:
            raise ValueError(f"rollouts.{field} must be set, got None")
    prompt_ids = rollouts.prompt_token_ids
    response_ids = rollouts.response_token_ids
    sampler_log_probs = rollouts.sampler_log_probs
    if not len(prompt_ids) == len(response_ids) == len(sampler_log_probs):
        raise ValueError(
            "rollouts.prompt_token_ids, response_token_ids and sampler_log_probs "
            f"must have the same length, got {len(prompt_ids)}, "
            f"{len(response_ids)} and {len(sampler_log_probs)}"
        )
    for index, (ids, values) in enumerate(zip(response_ids, sampler_log_probs)):
        if len(ids) != len(values):
            raise ValueError(
                f"rollouts.sampler_log_probs[{index}] must have one value per "
                f"response token ({len(ids)}), got {len(values)}"
            )
    if not any(response_ids):
        raise ValueError("rollouts must contain at least one response token, got 0")
    return prompt_ids, response_ids, sampler_log_probs


def _score_without_grad(
    policy: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    temperature: float,
    logits_chunk_size: int | None,
) -> torch.Tensor:
    device = next(policy.parameters()).device
    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad():
            scores = get_response_log_probs(
                policy,
                batch["input_ids"].to(device),  # (B, T-1)
                batch["labels"].to(device),  # (B, T-1)
                temperature=temperature,
                logits_chunk_size=logits_chunk_size,
            )
    finally:
        policy.train(was_training)
    return scores["log_probs"].float()  # (B, T-1)


def _check_engine_arguments(
    dtype: str,
    gpu_memory_utilization: float,
    max_model_len: int | None,
    seed: int,
) -> None:
    if dtype not in VLLM_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(VLLM_DTYPES)}, got {dtype!r}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}"
        )
    if max_model_len is not None and (
        isinstance(max_model_len, bool)
        or not isinstance(max_model_len, int)
        or max_model_len < 1
    ):
        raise ValueError(
            f"max_model_len must be None or a positive int, got {max_model_len!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")


def _require_in_process_engine(llm: Any) -> None:
    """``sync`` passes tensors by reference: the engine must live in-process."""
    if getattr(llm.llm_engine, "model_executor", None) is None:
        raise RuntimeError(
            "vLLM started its engine in a separate process, so weights cannot be "
            "synced by reference; set VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM "
            "is first used in this Python process"
        )
