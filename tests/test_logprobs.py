"""Tests for grpo_lab.logprobs: values, gradients, memory, chunked heads, errors.

The oracle everywhere is the naive form log_softmax(logits.float() / T).gather.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    LlamaConfig,
    Olmo2Config,
    Qwen2Config,
    Qwen3Config,
)

import grpo_lab.logprobs as logprobs_module
from grpo_lab.logprobs import (
    CHUNKED_HEAD_MODEL_TYPES,
    compute_entropy,
    get_response_log_probs,
)
from grpo_lab.models import build_char_tokenizer

# ---------------------------------------------------------------- helpers


class FixedLogits(torch.nn.Module):
    """A stand-in model whose forward returns the given logits, whatever the input."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.logits)


def at_least_float32(logits):
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def naive_log_probs(logits, labels, temperature=1.0):
    """The oracle: full float32 log_softmax, then one column per position."""
    log_probs_all = torch.log_softmax(at_least_float32(logits) / temperature, -1)
    return log_probs_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)


def naive_entropy(logits, temperature=1.0):
    log_probs_all = torch.log_softmax(at_least_float32(logits) / temperature, -1)
    return -(log_probs_all.exp() * log_probs_all).sum(-1)  # (B, T)


def composite_log_probs(logits, labels, temperature=1.0):
    """The former default path: z_label - logsumexp(z) by plain autograd."""
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    selected = scaled.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return selected - torch.logsumexp(scaled, dim=-1)


def score_fixed(logits, labels, **options):
    """The package's default path on given logits."""
    return get_response_log_probs(FixedLogits(logits), labels, labels, **options)


def random_case(shape, dtype, seed=0):
    """Logits with spread ~3 (not near-uniform) and labels that hit 0 and V - 1."""
    generator = torch.Generator().manual_seed(seed)
    batch_size, seq_len, vocab_size = shape
    logits = 3 * torch.randn(shape, generator=generator)  # (B, T, V)
    labels = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    labels[0, 0] = 0
    labels[-1, -1] = vocab_size - 1
    return logits.to(dtype), labels


def logits_grad(score, logits, labels, weights):
    leaf = logits.detach().clone().requires_grad_()
    (score(leaf, labels) * weights).sum().backward()
    return leaf.grad


def small_workspace(monkeypatch, bytes_=4096):
    """Force many row chunks (a few rows each) on small test tensors."""
    monkeypatch.setattr(logprobs_module, "_WORKSPACE_BYTES", bytes_)


TOLERANCE = {  # gradients, compared after rounding to the logits' dtype
    torch.float64: {"rtol": 1e-7, "atol": 1e-7},
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 2e-3, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-4},
}
SHAPES = [(1, 1, 2), (2, 5, 7), (3, 17, 50), (2, 9, 1000)]


# ---------------------------------------------------------------- default path


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_default_path_matches_naive_values_and_gradients(
    monkeypatch, dtype, shape, temperature
):
    small_workspace(monkeypatch)
    logits, labels = random_case(shape, dtype)
    weights = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))

    scored = score_fixed(
        logits, labels, return_token_entropy=True, temperature=temperature
    )
    expected_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert scored["log_probs"].dtype == expected_dtype
    torch.testing.assert_close(
        scored["log_probs"], naive_log_probs(logits, labels, temperature)
    )
    torch.testing.assert_close(
        scored["token_entropy"], naive_entropy(logits, temperature)
    )

    def package(z, y):
        return score_fixed(z, y, temperature=temperature)["log_probs"]

    grad = logits_grad(package, logits, labels, weights)
    expected = logits_grad(
        lambda z, y: naive_log_probs(z, y, temperature), logits, labels, weights
    )
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.float(), expected.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_default_path_is_bit_identical_to_gather_minus_logsumexp(
    monkeypatch, dtype, temperature
):
    # Same float32 operations, one row at a time: the train step's numbers do not
    # move when the backward is hand-written (on CPU, several chunks of rows).
    small_workspace(monkeypatch, bytes_=40_000)  # 10 rows of V = 1000 per chunk
    logits, labels = random_case((2, 9, 1000), dtype)
    weights = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))

    def package(z, y):
        return score_fixed(z, y, temperature=temperature)["log_probs"]

    assert torch.equal(
        package(logits, labels), composite_log_probs(logits, labels, temperature)
    )
    grad = logits_grad(package, logits, labels, weights)
    expected = logits_grad(
        lambda z, y: composite_log_probs(z, y, temperature), logits, labels, weights
    )
    assert torch.equal(grad, expected)


def test_non_contiguous_logits_are_scored_correctly():
    base, labels = random_case((5, 2, 11), torch.float32)
    logits = base.transpose(0, 1)  # (2, 5, 11), not contiguous
    labels = labels.transpose(0, 1).contiguous()  # (2, 5)
    torch.testing.assert_close(
        score_fixed(logits, labels)["log_probs"], naive_log_probs(logits, labels)
    )


def test_backward_leaves_the_callers_logits_untouched():
    logits, labels = random_case((2, 4, 13), torch.float32)
    logits.requires_grad_()
    before = logits.detach().clone()
    score_fixed(logits, labels)["log_probs"].sum().backward()
    assert torch.equal(logits.detach(), before)
    assert logits.grad is not None and logits.grad.abs().sum() > 0


@settings(max_examples=30, deadline=None)
@given(
    batch_size=st.integers(1, 3),
    seq_len=st.integers(1, 6),
    vocab_size=st.integers(2, 40),
    temperature=st.floats(0.25, 4.0),
    seed=st.integers(0, 1000),
)
def test_probabilities_of_all_labels_sum_to_one(
    batch_size, seq_len, vocab_size, temperature, seed
):
    # Scoring every vocabulary entry as the label must give a distribution.
    logits, _ = random_case((batch_size, seq_len, vocab_size), torch.float32, seed)
    columns = [
        score_fixed(
            logits,
            torch.full((batch_size, seq_len), label),
            temperature=temperature,
        )["log_probs"]
        for label in range(vocab_size)
    ]
    log_probs = torch.stack(columns, dim=-1)  # (B, T, V)
    assert (log_probs <= 1e-6).all()
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(batch_size, seq_len))


# ---------------------------------------------------------------- memory


def saved_for_backward_bytes(score, logits, labels) -> int:
    """Bytes of distinct storages autograd keeps for backward, summed."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        score(logits, labels)
    return sum(storages.values())


def peak_allocated_bytes(run) -> int:
    """CPU allocator high-water mark above the start, from the profiler's trace."""
    profiler = pytest.importorskip("torch.profiler")
    event_types = pytest.importorskip("torch._C._profiler")
    with profiler.profile(
        activities=[profiler.ProfilerActivity.CPU], profile_memory=True
    ) as trace:
        run()
    pending = list(trace.profiler.kineto_results.experimental_event_tree())
    allocations = []
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == event_types._EventType.Allocation:
            fields = event.extra_fields
            allocations.append(
                (event.start_time_ns, fields.alloc_size, fields.total_allocated)
            )
    allocations.sort()
    baseline = allocations[0][2] - allocations[0][1]
    return max(total for _, _, total in allocations) - baseline


METHODS = {
    "naive": naive_log_probs,
    "composite": composite_log_probs,
    "package": lambda z, y: score_fixed(z, y)["log_probs"],
}


def head_case(dtype):
    # Logits come from an output head inside the measured region, as in a model,
    # so the naive path may free them once log_softmax has run.
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 64, 16, generator=generator).to(dtype)  # (B, T, H)
    head = torch.randn(4096, 16, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, 4096, (2, 64), generator=generator)  # (B, T)
    return hidden, head, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_for_backward_is_no_larger_than_naive(dtype):
    hidden, head, labels = head_case(dtype)

    def saved(method):
        def score(hidden_, labels_):
            return METHODS[method](hidden_ @ head.T, labels_)

        return saved_for_backward_bytes(score, hidden, labels)

    naive, package = saved("naive"), saved("package")
    # Each keeps one (B, T, V) tensor: naive its float32 log_softmax output, the
    # package the logits as given (half the bytes in bfloat16), plus its (B, T)
    # float32 log-normalizer (2 * 64 * 4 = 512 bytes). The rest is shared.
    float32_table_bytes = 2 * 64 * 4096 * 4
    logits_bytes = 2 * 64 * 4096 * hidden.element_size()
    assert package <= naive - float32_table_bytes + logits_bytes + 2 * 64 * 4
    assert package > logits_bytes  # the hook did see the saved logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_enabled", [True, False])
def test_peak_memory_is_below_naive_and_composite(monkeypatch, dtype, grad_enabled):
    small_workspace(monkeypatch, bytes_=64 * 1024)  # 4 rows per chunk
    hidden, head, labels = head_case(dtype)
    weights = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))

    def peak(method):
        def run():
            with torch.set_grad_enabled(grad_enabled):
                log_probs = METHODS[method](hidden @ head.T, labels)
                if grad_enabled:
                    (log_probs * weights).sum().backward()

        run()  # warm-up: one-time allocations are not part of the comparison
        head.grad = None
        measured = peak_allocated_bytes(run)
        head.grad = None
        return measured

    naive, composite, package = peak("naive"), peak("composite"), peak("package")
    assert package < naive and package < composite
    # The package holds the logits (and, in backward, their gradient) plus a few
    # chunks of scratch: less than half a float32 (B, T, V) table on top.
    logits_bytes = 2 * 64 * 4096 * hidden.element_size()
    float32_table_bytes = 2 * 64 * 4096 * 4
    held = (2 if grad_enabled else 1) * logits_bytes
    assert package < held + float32_table_bytes / 2


# ---------------------------------------------------------------- no grad


@pytest.mark.parametrize("chunk_size", [0, 3])
def test_no_grad_scoring_builds_no_graph(chunk_size):
    model = tiny_causal_lm(Qwen2Config, tie_word_embeddings=True)
    input_ids, labels = token_batch(model)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with (
        torch.no_grad(),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
    ):
        old = get_response_log_probs(
            model, input_ids, labels, True, logits_chunk_size=chunk_size
        )
    assert saved == []
    assert old["log_probs"].grad_fn is None and not old["log_probs"].requires_grad
    with_grad = get_response_log_probs(
        model, input_ids, labels, True, logits_chunk_size=chunk_size
    )
    assert with_grad["log_probs"].requires_grad
    torch.testing.assert_close(old["log_probs"], with_grad["log_probs"].detach())
    torch.testing.assert_close(old["token_entropy"], with_grad["token_entropy"])


# ---------------------------------------------------------------- chunked head


CONFIGS = {
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "llama": LlamaConfig,
    "olmo2": Olmo2Config,
}


def tiny_causal_lm(config_class, tie_word_embeddings, seed=0, **extra):
    """One decoder layer, hidden 32; output head scaled so logits spread ~3."""
    tokenizer = build_char_tokenizer()
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        **extra,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30)
    return model


def token_batch(model, batch_size=2, seq_len=7):
    vocab_size = model.config.vocab_size
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    labels = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    labels[0, 0], labels[-1, -1] = 0, vocab_size - 1
    return input_ids, labels


def scores_and_parameter_grads(model, score, input_ids, labels):
    """(log_probs, token_entropy, {name: grad}) after backward of a weighted sum."""
    model.zero_grad(set_to_none=True)
    log_probs, entropy = score(model, input_ids, labels)
    weights = torch.linspace(-1, 1, labels.numel()).view(labels.shape)  # (B, T)
    (log_probs * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return log_probs.detach(), entropy, grads


def package_score(chunk_size, temperature, shared_prefix_length=0):
    def score(model, input_ids, labels):
        scored = get_response_log_probs(
            model,
            input_ids,
            labels,
            return_token_entropy=True,
            logits_chunk_size=chunk_size,
            temperature=temperature,
            shared_prefix_length=shared_prefix_length,
        )
        return scored["log_probs"], scored["token_entropy"]

    return score


def naive_model_score(temperature):
    def score(model, input_ids, labels):
        logits = model(input_ids).logits  # (B, T, V)
        entropy = naive_entropy(logits.detach(), temperature)
        return naive_log_probs(logits, labels, temperature), entropy

    return score


def assert_scores_equal(actual, expected):
    log_probs, entropy, grads = actual
    torch.testing.assert_close(log_probs, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, expected[1], rtol=1e-5, atol=1e-5)
    assert grads.keys() == expected[2].keys()
    for name, grad in grads.items():
        # One thread sums a weight gradient's terms in another order than several:
        # single elements near 0 then differ by up to ~2e-5 (seen on a Qwen3 head).
        torch.testing.assert_close(grad, expected[2][name], rtol=1e-4, atol=5e-5)


def test_allowlist_is_exactly_the_checked_architectures():
    assert set(CONFIGS) == CHUNKED_HEAD_MODEL_TYPES


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
@pytest.mark.parametrize("tie_word_embeddings", [True, False])
def test_chunked_head_equals_model_forward(model_type, tie_word_embeddings):
    model = tiny_causal_lm(CONFIGS[model_type], tie_word_embeddings)
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    assert (head.weight is embeddings.weight) == tie_word_embeddings
    input_ids, labels = token_batch(model)  # T = 7
    full = scores_and_parameter_grads(model, package_score(0, 1.0), input_ids, labels)
    naive = scores_and_parameter_grads(model, naive_model_score(1.0), input_ids, labels)
    assert_scores_equal(full, naive)
    for chunk_size in (1, 3, 7, 10):  # 3 leaves a short last chunk; 10 > T
        chunked = scores_and_parameter_grads(
            model, package_score(chunk_size, 1.0), input_ids, labels
        )
        assert_scores_equal(chunked, full)


@pytest.mark.parametrize("chunk_size", [0, 2, 4])
@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_temperature_scores_softmax_of_logits_over_temperature(chunk_size, temperature):
    model = tiny_causal_lm(Qwen3Config, tie_word_embeddings=False)
    input_ids, labels = token_batch(model, seq_len=6)
    actual = scores_and_parameter_grads(
        model, package_score(chunk_size, temperature), input_ids, labels
    )
    expected = scores_and_parameter_grads(
        model, naive_model_score(temperature), input_ids, labels
    )
    assert_scores_equal(actual, expected)
    at_one = scores_and_parameter_grads(
        model, package_score(chunk_size, 1.0), input_ids, labels
    )
    assert not torch.allclose(actual[0], at_one[0])


@pytest.mark.parametrize("chunk_size", [0, 3])
def test_temperature_one_is_bit_identical_to_get_response_log_probs(chunk_size):
    model = tiny_causal_lm(Olmo2Config, tie_word_embeddings=False)
    input_ids, labels = token_batch(model)
    options = {"return_token_entropy": True, "logits_chunk_size": chunk_size}
    scored = get_response_log_probs(
        model, input_ids, labels, temperature=1.0, **options
    )
    plain = get_response_log_probs(model, input_ids, labels, **options)
    assert torch.equal(scored["log_probs"], plain["log_probs"])
    assert torch.equal(scored["token_entropy"], plain["token_entropy"])


def test_chunk_size_none_reads_the_model_config():
    model = tiny_causal_lm(LlamaConfig, tie_word_embeddings=True)
    input_ids, labels = token_batch(model)
    model.config.grpo_logits_chunk_size = 2
    from_config = get_response_log_probs(model, input_ids, labels)
    torch.testing.assert_close(
        from_config["log_probs"],
        get_response_log_probs(model, input_ids, labels, logits_chunk_size=0)[
            "log_probs"
        ],
    )
    model.config.grpo_logits_chunk_size = -2
    with pytest.raises(ValueError, match=r"logits_chunk_size .*got -2"):
        get_response_log_probs(model, input_ids, labels)


# ---------------------------------------------------------------- shared prefix


def grouped_token_batch(model, prompts=3, group_size=4, prompt_len=5, seq_len=9):
    """G rows per prompt: equal first ``prompt_len`` ids (and labels), then random."""
    input_ids, labels = token_batch(model, prompts * group_size, seq_len)
    prompt_ids = torch.randint(2, 50, (prompts, prompt_len + 1)).repeat_interleave(
        group_size, dim=0
    )  # (B, P + 1)
    input_ids[:, :prompt_len] = prompt_ids[:, :prompt_len]
    labels[:, :prompt_len] = prompt_ids[:, 1:]  # labels = the next prompt token
    return input_ids, labels


def assert_scores_close_to_scale(actual, expected, relative=1e-5):
    """Equal up to float32 rounding of sums taken in another order: each error
    within ``relative`` times the largest magnitude of that tensor."""
    for got, want in zip(actual[:2], expected[:2]):
        assert (got - want).abs().max() <= relative * want.abs().max()
    for name, grad in actual[2].items():
        want = expected[2][name]
        assert (grad - want).abs().max() <= relative * want.abs().max(), name


@pytest.mark.parametrize("model_type", ["qwen2", "olmo2", "llama"])
@pytest.mark.parametrize("chunk_size", [0, 3])
@pytest.mark.parametrize("prefix_length", [1, 4, 5, 8])
def test_shared_prefix_equals_scoring_every_row_whole(
    model_type, chunk_size, prefix_length
):
    # prefix_length 8 runs past the shared prompt: rows then differ, nothing merges
    # beyond what is equal, and the values must still match.
    model = tiny_causal_lm(CONFIGS[model_type], tie_word_embeddings=True)
    input_ids, labels = grouped_token_batch(model)
    whole = scores_and_parameter_grads(
        model, package_score(chunk_size, 0.8), input_ids, labels
    )
    shared = scores_and_parameter_grads(
        model, package_score(chunk_size, 0.8, prefix_length), input_ids, labels
    )
    assert_scores_close_to_scale(shared, whole)


def test_shared_prefix_runs_each_prompt_once(monkeypatch):
    model = tiny_causal_lm(Qwen2Config, tie_word_embeddings=False)
    input_ids, labels = grouped_token_batch(model)  # 12 rows x 9, 3 prompts x 5
    shapes = []
    model.model.embed_tokens.register_forward_hook(
        lambda module, args, output: shapes.append(tuple(args[0].shape))
    )
    get_response_log_probs(model, input_ids, labels, shared_prefix_length=5)
    assert shapes == [(3, 5), (12, 4)]  # 15 + 48 positions instead of 108


def test_rows_with_different_prefix_labels_are_not_merged():
    model = tiny_causal_lm(Qwen2Config, tie_word_embeddings=False)
    input_ids, labels = grouped_token_batch(model)
    labels[1, 2] = (labels[0, 2] + 1) % model.config.vocab_size  # row 1 differs
    whole = get_response_log_probs(model, input_ids, labels)["log_probs"]
    shared = get_response_log_probs(model, input_ids, labels, shared_prefix_length=5)
    torch.testing.assert_close(shared["log_probs"], whole, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(shared["log_probs"][1], shared["log_probs"][0])


def test_shared_prefix_falls_back_under_gradient_checkpointing():
    # transformers drops the key/value cache while checkpointing in training mode.
    model = tiny_causal_lm(Qwen2Config, tie_word_embeddings=False)
    model.gradient_checkpointing_enable()
    model.train()
    input_ids, labels = grouped_token_batch(model)
    whole = scores_and_parameter_grads(model, package_score(0, 1.0), input_ids, labels)
    shared = scores_and_parameter_grads(
        model, package_score(0, 1.0, 5), input_ids, labels
    )
    assert_scores_close_to_scale(shared, whole)


@pytest.mark.parametrize("prefix_length", [-1, 9, True, 2.0, "3"])
def test_bad_shared_prefix_length_is_rejected(prefix_length):
    model = tiny_causal_lm(Qwen2Config, tie_word_embeddings=False)
    input_ids, labels = grouped_token_batch(model)  # T = 9
    with pytest.raises(ValueError) as error:
        get_response_log_probs(
            model, input_ids, labels, shared_prefix_length=prefix_length
        )
    assert "shared_prefix_length must be an int in [0, 8]" in str(error.value)
    assert f"got {prefix_length!r}" in str(error.value)


# ---------------------------------------------------------------- unsupported


def unsupported_models():
    gemma2 = tiny_causal_lm(Gemma2Config, tie_word_embeddings=True)
    assert gemma2.config.final_logit_softcapping is not None
    gpt2 = AutoModelForCausalLM.from_config(
        GPT2Config(
            vocab_size=98,
            n_embd=32,
            n_layer=1,
            n_head=4,
            n_positions=64,
            bos_token_id=1,
            eos_token_id=1,
        )
    )
    plain = torch.nn.Sequential(torch.nn.Embedding(98, 8), torch.nn.Linear(8, 98))
    return {"'gemma2'": gemma2, "'gpt2'": gpt2, "None": plain}  # by model_type repr


def test_unsupported_architectures_get_a_clear_error_for_chunking():
    input_ids = torch.tensor([[2, 3, 4]])
    for model_type, model in unsupported_models().items():
        with pytest.raises(ValueError) as error:
            get_response_log_probs(model, input_ids, input_ids, logits_chunk_size=2)
        message = str(error.value)
        assert "logits_chunk_size > 0 needs" in message and "'qwen2'" in message
        assert f"{type(model).__name__} with model_type={model_type}" in message


def test_soft_capped_model_still_scores_on_the_default_path():
    # Gemma2 caps its logits after the head: chunk size 0 uses its own forward.
    model = unsupported_models()["'gemma2'"]
    input_ids, labels = token_batch(model)
    scored = get_response_log_probs(model, input_ids, labels, logits_chunk_size=0)
    expected = naive_log_probs(model(input_ids).logits, labels)
    torch.testing.assert_close(scored["log_probs"], expected)


# ---------------------------------------------------------------- compute_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compute_entropy_hand_computed(dtype):
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # uniform over 4: H = ln 4 = 1.3863
            [100.0, 0.0, 0.0, 0.0],  # p ~ (1, e^-100, ...): H ~ 3 * 100 e^-100 ~ 0
            [0.0, math.log(3), -math.inf, -math.inf],  # p = (1/4, 3/4, 0, 0)
        ]
    ).to(dtype)
    # Third row: H = -(1/4 ln 1/4 + 3/4 ln 3/4) = ln 4 - (3/4) ln 3 = 0.5623.
    # bfloat16 stores ln 3 as 1.1016 (not 1.0986): p = (0.2494, 0.7506), H = 0.5617.
    third = 0.5623 if dtype == torch.float32 else 0.5617
    expected = torch.tensor([math.log(4), 0.0, third])
    entropy = compute_entropy(logits)
    assert entropy.dtype == torch.float32
    torch.testing.assert_close(entropy, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5,), (2, 3, 7), (4, 1000)])
def test_compute_entropy_matches_naive(dtype, shape):
    logits = (4 * torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(
        dtype
    )
    probabilities = torch.softmax(logits.float(), dim=-1)
    naive = -(probabilities * probabilities.log()).sum(-1)
    torch.testing.assert_close(compute_entropy(logits), naive, rtol=1e-5, atol=1e-5)


def test_masked_tokens_give_finite_entropy_log_probs_and_gradients():
    # A -inf logit (a masked token) has p = 0 and must add 0 to the entropy.
    logits, labels = random_case((2, 3, 6), torch.float32)
    logits[..., 4:] = -math.inf
    labels = labels % 4  # (B, T), only unmasked tokens
    logits.requires_grad_()
    scored = score_fixed(logits, labels, return_token_entropy=True)
    entropy = compute_entropy(logits)
    (scored["log_probs"].sum() + entropy.sum()).backward()
    unmasked = logits.detach()[..., :4]
    torch.testing.assert_close(scored["token_entropy"], naive_entropy(unmasked))
    torch.testing.assert_close(entropy.detach(), naive_entropy(unmasked))
    torch.testing.assert_close(scored["log_probs"], naive_log_probs(unmasked, labels))
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[..., 4:] == 0).all()


def test_compute_entropy_rejects_a_scalar():
    with pytest.raises(ValueError, match=r"logits .*\(\.\.\., V\).*scalar"):
        compute_entropy(torch.tensor(1.0))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("chunk_size", [-1, True, 2.0, "4"])
def test_bad_chunk_size_is_rejected(chunk_size):
    logits, labels = random_case((1, 3, 5), torch.float32)
    with pytest.raises(ValueError) as error:
        score_fixed(logits, labels, logits_chunk_size=chunk_size)
    assert "logits_chunk_size must be a nonnegative int" in str(error.value)
    assert f"got {chunk_size!r}" in str(error.value)


@pytest.mark.parametrize("temperature", [0, -1.0, math.nan, math.inf, True, "1"])
def test_bad_temperature_is_rejected(temperature):
    logits, labels = random_case((1, 3, 5), torch.float32)
    with pytest.raises(ValueError) as error:
        score_fixed(logits, labels, temperature=temperature)
    assert "temperature must be a finite number > 0" in str(error.value)
    assert f"got {temperature!r}" in str(error.value)


def test_labels_must_match_input_ids():
    logits, labels = random_case((2, 3, 5), torch.float32)
    model = FixedLogits(logits)
    with pytest.raises(
        ValueError, match=r"labels .*shape of input_ids \(2, 3\).*\(2, 4\)"
    ):
        get_response_log_probs(model, labels, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must be torch.int64.*torch.int32"):
        get_response_log_probs(model, labels, labels.int())


@pytest.mark.parametrize("bad_label", [-100, 5])
def test_labels_must_be_vocabulary_ids(bad_label):
    logits, labels = random_case((2, 3, 5), torch.float32)
    labels[1, 2] = bad_label
    input_ids = torch.zeros_like(labels)  # (B, T)
    with pytest.raises(ValueError, match=r"labels must be token ids in \[0, 5\)"):
        get_response_log_probs(FixedLogits(logits), input_ids, labels)


def refuse_to_run(model):
    """Make ``model``'s forward fail loudly: a check must stop the call first."""

    def forward(*args, **kwargs):
        raise AssertionError("the model ran on input that should have been refused")

    model.forward = forward
    model.model.forward = forward
    return model


@pytest.mark.parametrize(
    "options",
    [{}, {"logits_chunk_size": 3}, {"shared_prefix_length": 2}],
    ids=["model forward", "chunked head", "shared prefix"],
)
@pytest.mark.parametrize(
    ("position", "bad_id"), [((0, 0), -1), ((1, 4), 98), ((1, 6), 10**6)]
)
def test_input_ids_must_be_rows_of_the_input_embedding(options, position, bad_id):
    model = refuse_to_run(tiny_causal_lm(Qwen2Config, tie_word_embeddings=False))
    input_ids, labels = token_batch(model)  # (2, 7), vocabulary 98
    input_ids[position] = bad_id
    with pytest.raises(ValueError) as error:
        get_response_log_probs(model, input_ids, labels, **options)
    assert str(error.value) == (
        "input_ids must be token ids in [0, 98) (the rows of the model's input "
        f"embedding), got {bad_id} at input_ids[{position[0]}, {position[1]}]"
    )


def test_input_id_range_is_that_of_the_embedding_not_the_tokenizer():
    model = tiny_causal_lm(Qwen2Config, tie_word_embeddings=False)
    model.resize_token_embeddings(128)  # rows 98..127 exist, no token uses them
    input_ids, labels = token_batch(model)
    input_ids[0, 0] = 127
    scored = get_response_log_probs(model, input_ids, labels)["log_probs"]
    assert torch.isfinite(scored).all()
    input_ids[0, 0] = 128
    with pytest.raises(ValueError, match=r"in \[0, 128\) .*got 128 at input_ids"):
        get_response_log_probs(model, input_ids, labels)


def test_input_ids_need_an_integer_dtype():
    model = refuse_to_run(tiny_causal_lm(Qwen2Config, tie_word_embeddings=False))
    input_ids, labels = token_batch(model)
    for dtype in (torch.float32, torch.bool, torch.int16):
        with pytest.raises(
            ValueError,
            match=rf"input_ids must be torch.int64 \(or torch.int32\) .*got {dtype}",
        ):
            get_response_log_probs(model, input_ids.to(dtype), labels)


def test_int32_input_ids_score_like_int64():
    model = tiny_causal_lm(Qwen2Config, tie_word_embeddings=False)
    input_ids, labels = token_batch(model)
    expected = get_response_log_probs(model, input_ids, labels)["log_probs"]
    scored = get_response_log_probs(model, input_ids.int(), labels)["log_probs"]
    assert torch.equal(scored, expected)


def test_token_batches_must_be_nonempty_2d_tensors():
    model = refuse_to_run(tiny_causal_lm(Qwen2Config, tie_word_embeddings=False))
    input_ids, labels = token_batch(model)
    cases = {
        "input_ids must be a \\(B, T\\) tensor of token ids, got list": (
            input_ids.tolist(),
            labels,
        ),
        "input_ids must be a \\(B, T\\) tensor .*got shape \\(7,\\)": (
            input_ids[0],
            labels[0],
        ),
        "labels must have the shape of input_ids \\(2, 7\\), got list": (
            input_ids,
            labels.tolist(),
        ),
        "at least one row and one position, got shape \\(0, 7\\)": (
            input_ids[:0],
            labels[:0],
        ),
        "at least one row and one position, got shape \\(2, 0\\)": (
            input_ids[:, :0],
            labels[:, :0],
        ),
    }
    for message, (bad_ids, bad_labels) in cases.items():
        with pytest.raises(ValueError, match=message):
            get_response_log_probs(model, bad_ids, bad_labels)
    with pytest.raises(ValueError, match=r"model must be a causal LM .*got str"):
        get_response_log_probs("Qwen/Qwen2.5-0.5B", input_ids, labels)


@pytest.mark.parametrize(
    ("logits", "message"),
    [
        (torch.zeros(2, 3, dtype=torch.long), "floating-point tensor, got torch.int64"),
        ([[0.0, 1.0]], "floating-point tensor, got list"),
        (torch.zeros(2, 0), "at least one vocabulary entry .*got shape \\(2, 0\\)"),
    ],
)
def test_compute_entropy_rejects_what_has_no_distribution(logits, message):
    with pytest.raises(ValueError, match=rf"logits must .*{message}"):
        compute_entropy(logits)


def test_logits_must_match_labels():
    logits, labels = random_case((2, 4, 5), torch.float32)
    with pytest.raises(ValueError, match=r"logits must have shape \(2, 3, 'V'\)"):
        get_response_log_probs(FixedLogits(logits), labels[:, :3], labels[:, :3])


# ------------------------------------------------- chunked head: autocast, memory


def test_chunked_head_under_autocast_matches_the_model_forward():
    # Under bfloat16 autocast the head's matmul runs in bfloat16 in both paths;
    # the chunked path fixes that dtype at forward and reuses it in backward.
    # Values agree; gradients are as close to float32 as the model's own.
    model = tiny_causal_lm(Qwen2Config, tie_word_embeddings=True)
    input_ids, labels = token_batch(model)
    exact = scores_and_parameter_grads(model, package_score(0, 1.0), input_ids, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = scores_and_parameter_grads(
            model, package_score(0, 1.0), input_ids, labels
        )
        chunked = scores_and_parameter_grads(
            model, package_score(3, 1.0), input_ids, labels
        )
    assert chunked[0].dtype == torch.float32
    torch.testing.assert_close(chunked[0], full[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(chunked[1], full[1], rtol=0, atol=1e-6)
    for name, grad in chunked[2].items():
        assert grad.dtype == torch.float32
        chunked_error = (grad - exact[2][name]).abs().max()
        full_error = (full[2][name] - exact[2][name]).abs().max()
        assert chunked_error <= 2 * full_error + 1e-6, name


def linear_head_case(head_requires_grad):
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 64, 256, generator=generator).requires_grad_()  # (B,T,H)
    head = torch.nn.Linear(256, 4096, bias=False)  # V = 4096
    head.weight.requires_grad_(head_requires_grad)
    labels = torch.randint(0, 4096, (2, 64), generator=generator)  # (B, T)
    return hidden, head, labels


def chunked_head_backward(hidden, head, labels, chunk_size=8):
    scored = logprobs_module._score_hidden_in_chunks(
        head, hidden, labels, chunk_size, return_token_entropy=True, temperature=1.0
    )
    scored["log_probs"].sum().backward()


def test_chunked_head_allocates_its_weight_gradient_once():
    # A (V, H) weight gradient per chunk, added to .grad (what checkpointing the
    # head does), would peak at two (V, H) tensors or more; one buffer is one.
    hidden, head, labels = linear_head_case(head_requires_grad=True)
    chunked_head_backward(hidden, head, labels)  # warm-up
    head.weight.grad, hidden.grad = None, None
    peak = peak_allocated_bytes(lambda: chunked_head_backward(hidden, head, labels))
    weight_gradient_bytes = head.weight.numel() * 4  # 4 MiB
    chunk_logits_bytes = 2 * 8 * 4096 * 4  # 256 KiB
    assert weight_gradient_bytes <= peak
    assert peak < weight_gradient_bytes + 8 * chunk_logits_bytes


def test_chunked_head_matches_naive_for_a_frozen_head():
    hidden, head, labels = linear_head_case(head_requires_grad=False)
    chunked_head_backward(hidden, head, labels)
    assert head.weight.grad is None
    chunked_grad, hidden.grad = hidden.grad, None
    naive_log_probs(head(hidden), labels).sum().backward()
    torch.testing.assert_close(chunked_grad, hidden.grad, rtol=1e-5, atol=1e-6)


def test_chunked_head_trains_the_head_alone_when_hidden_states_are_frozen():
    hidden, head, labels = linear_head_case(head_requires_grad=True)
    hidden = hidden.detach()  # a frozen decoder: only the head takes a gradient
    chunked_head_backward(hidden, head, labels)
    chunked_grad, head.weight.grad = head.weight.grad, None
    naive_log_probs(head(hidden), labels).sum().backward()
    torch.testing.assert_close(chunked_grad, head.weight.grad, rtol=1e-5, atol=1e-5)


# ------------------------------------------------- entropy with its gradient


def entropy_bonus_grads(model, score, input_ids, labels):
    """Parameter gradients of sum(w * log p) + sum(v * H): both flow back."""
    model.zero_grad(set_to_none=True)
    log_probs, entropy = score(model, input_ids, labels)
    weights = torch.linspace(-1, 1, labels.numel()).view(labels.shape)  # (B, T)
    (log_probs * weights + entropy * weights.flip(0)).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("chunk_size", [0, 3])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_differentiable_entropy_matches_autograd_of_the_naive_form(
    chunk_size, temperature
):
    model = tiny_causal_lm(Qwen2Config, tie_word_embeddings=False).double()
    input_ids, labels = token_batch(model)

    def package(model, input_ids, labels):
        scored = get_response_log_probs(
            model, input_ids, labels, True, chunk_size,
            temperature=temperature, entropy_gradient=True,
        )  # fmt: skip
        return scored["log_probs"], scored["token_entropy"]

    def naive(model, input_ids, labels):
        logits = model(input_ids).logits  # (B, T, V)
        return (
            naive_log_probs(logits, labels, temperature),
            naive_entropy(logits, temperature),
        )

    actual = entropy_bonus_grads(model, package, input_ids, labels)
    expected = entropy_bonus_grads(model, naive, input_ids, labels)
    for name, grad in actual.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-9, atol=1e-10)
    without = scores_and_parameter_grads(
        model, package_score(chunk_size, temperature), input_ids, labels
    )[2]
    assert any(not torch.allclose(without[n], actual[n]) for n in actual)


def test_differentiable_entropy_of_masked_logits_is_finite():
    logits = torch.tensor([[[0.0, -math.inf, 1.0]]], requires_grad=True)
    labels = torch.tensor([[2]])
    scored = get_response_log_probs(
        FixedLogits(logits), labels, labels, True, entropy_gradient=True
    )
    scored["token_entropy"].sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0, 1] == 0
    with pytest.raises(ValueError, match="return_token_entropy must be True"):
        get_response_log_probs(
            FixedLogits(logits), labels, labels, entropy_gradient=True
        )
