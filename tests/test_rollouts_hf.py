"""HF rollouts: exact token ids, exact sampling distribution, seeds, stop strings."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from grpo_lab.logprobs import get_response_log_probs
from grpo_lab.masks import pad_prompt_and_response_ids
from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2
from grpo_lab.rollouts import HFRolloutBackend, make_backend
from grpo_lab.rollouts.base import SamplingSettings


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=0)


def first_token_distribution(model, prompt_ids, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0, -1]  # (V,)
    return torch.softmax(logits / temperature, dim=-1)  # (V,)


def trainer_log_probs(model, rollouts, temperature):
    """The trainer's log-probs of every response token, flat, row-major."""
    batch = pad_prompt_and_response_ids(
        rollouts.prompt_token_ids, rollouts.response_token_ids, pad_token_id=0
    )
    with torch.no_grad():
        scored = get_response_log_probs(
            model, batch["input_ids"], batch["labels"], temperature=temperature
        )["log_probs"]  # (B, T)
    return scored[batch["response_mask"].bool()]  # (N,)


def flat_sampler_log_probs(rollouts):
    for ids, values in zip(rollouts.response_token_ids, rollouts.sampler_log_probs):
        assert len(values) == len(ids)  # one per kept token, EOS included
    return torch.tensor([v for row in rollouts.sampler_log_probs for v in row])


@pytest.fixture(scope="module")
def sharp_model(tokenizer):
    """Peaked next-token distributions, and an EOS that gets sampled sometimes."""
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=2, seed=3)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(4.0)
        prompt = torch.tensor([tokenizer.encode("12345>7>")])
        hidden = model(prompt, output_hidden_states=True).hidden_states[-1][0]
        direction = hidden.mean(0)  # (H,)
        # An untied head whose EOS row gives a typical state a logit of ~1.5.
        head = model.model.embed_tokens.weight.clone()  # (V, H)
        head[tokenizer.eos_token_id] = 1.5 * direction / direction.norm() ** 2
        model.lm_head.weight = torch.nn.Parameter(head)
    return model


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_log_probs_equal_the_trainers_at_the_sampling_temperature(
    sharp_model, tokenizer, temperature
):
    rollouts = HFRolloutBackend(sharp_model, tokenizer).generate(
        ["12345>", "7>", ">"], 4, SamplingSettings(temperature, 1.0, 10, seed=5)
    )
    assert any(tokenizer.eos_token_id in ids for ids in rollouts.response_token_ids)
    sampler = flat_sampler_log_probs(rollouts)  # (N,)
    torch.testing.assert_close(
        sampler,
        trainer_log_probs(sharp_model, rollouts, temperature),
        atol=1e-5,
        rtol=0,
    )
    if temperature != 1.0:
        # Scored at temperature 1 instead, the numbers differ: the scores used
        # really are the tempered ones.
        at_one = trainer_log_probs(sharp_model, rollouts, 1.0)
        assert (sampler - at_one).abs().max() > 1e-2


def test_top_p_sampler_log_probs_are_the_renormalised_nucleus(sharp_model, tokenizer):
    top_p = 0.6
    rollouts = HFRolloutBackend(sharp_model, tokenizer).generate(
        ["12345>", "7>"], 8, SamplingSettings(1.0, top_p, 8, seed=2)
    )
    sampler = flat_sampler_log_probs(rollouts)  # (N,)
    full = trainer_log_probs(sharp_model, rollouts, 1.0)  # (N,)
    # Inside the nucleus, p_sampler = p / mass(nucleus) >= p, and mass >= top_p.
    assert bool((sampler >= full - 1e-6).all())
    assert bool((sampler - full <= -torch.log(torch.tensor(top_p)) + 1e-5).all())
    assert (sampler - full).max() > 1e-2


def test_stop_string_cut_keeps_one_log_prob_per_kept_token(model, tokenizer):
    rollouts = HFRolloutBackend(model, tokenizer).generate(
        ["12345>"], 32, SamplingSettings(max_new_tokens=30, stop_strings=("a",), seed=0)
    )
    assert any(text.endswith("a") for text in rollouts.responses)
    torch.testing.assert_close(
        flat_sampler_log_probs(rollouts),
        trainer_log_probs(model, rollouts, 1.0),
        atol=1e-5,
        rtol=0,
    )


def test_returns_prompt_major_groups_with_exact_ids(model, tokenizer):
    backend = HFRolloutBackend(model, tokenizer)
    prompts = ["12345>", "7>"]
    rollouts = backend.generate(prompts, 3, SamplingSettings(max_new_tokens=8, seed=1))
    assert rollouts.prompts == ["12345>"] * 3 + ["7>"] * 3
    assert rollouts.prompt_token_ids[0] == tokenizer.encode("12345>")
    assert rollouts.prompt_token_ids[3] == tokenizer.encode("7>")  # no left pads
    for ids, text in zip(rollouts.response_token_ids, rollouts.responses):
        assert 1 <= len(ids) <= 8
        eos_positions = [i for i, t in enumerate(ids) if t == tokenizer.eos_token_id]
        # EOS, when sampled, is the last token kept; nothing follows it.
        assert eos_positions in ([], [len(ids) - 1])
        if not eos_positions:
            assert len(ids) == 8
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_seeded_sampling_repeats_and_leaves_global_rng_alone(model, tokenizer):
    backend = HFRolloutBackend(model, tokenizer)
    sampling = SamplingSettings(max_new_tokens=6, seed=123)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = backend.generate(["12>", "345>"], 4, sampling)
    assert torch.equal(torch.get_rng_state(), before)
    second = backend.generate(["12>", "345>"], 4, sampling)
    other = backend.generate(
        ["12>", "345>"], 4, SamplingSettings(max_new_tokens=6, seed=124)
    )
    assert first.response_token_ids == second.response_token_ids
    assert first.response_token_ids != other.response_token_ids


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_first_token_frequencies_match_softmax_of_logits_over_temperature(
    tokenizer, temperature
):
    # A sharper model than the fixture so that temperature changes the target.
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=3)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(5.0)  # entropy ~4.2 nats, top-1 ~0.13
    # Hub checkpoints ship sampling tweaks; the backend must ignore them.
    model.generation_config.top_k = 5
    model.generation_config.repetition_penalty = 3.0
    prompt = "12345>"
    prompt_ids = tokenizer.encode(prompt)
    probabilities = first_token_distribution(model, prompt_ids, temperature)
    sample_count = 6000
    rollouts = HFRolloutBackend(model, tokenizer).generate(
        [prompt], sample_count, SamplingSettings(temperature, max_new_tokens=1, seed=7)
    )
    first_tokens = torch.tensor([ids[0] for ids in rollouts.response_token_ids])
    counts = torch.bincount(first_tokens, minlength=len(tokenizer)).double()
    expected = probabilities.double() * sample_count
    # Pearson chi-square over cells with enough expected mass; the rest pooled.
    large = expected >= 5
    observed = torch.cat([counts[large], counts[~large].sum().unsqueeze(0)])
    target = torch.cat([expected[large], expected[~large].sum().unsqueeze(0)])
    chi_square = ((observed - target) ** 2 / target.clamp_min(1e-9)).sum().item()
    degrees = observed.numel() - 1
    # mean = degrees, sd = sqrt(2 * degrees); a top-k or a penalty adds thousands.
    assert chi_square < degrees + 6 * (2 * degrees) ** 0.5, (chi_square, degrees)
    total_variation = 0.5 * (counts / sample_count - probabilities.double()).abs().sum()
    # Sampling noise alone gives about sum_v sqrt(2 p_v / (pi n)) / 2 ~ 0.05 here;
    # a top-50 cut would add the 0.23 mass beyond the top 50 tokens.
    assert total_variation < 0.1
    # Tokens outside the top 50 (and the configured top 5) are sampled too.
    outside_top_50 = probabilities.argsort(descending=True)[50:]
    assert counts[outside_top_50].sum() > 0
    assert counts[probabilities.argsort(descending=True)[5:]].sum() > 0.1 * sample_count


def test_top_p_keeps_only_the_nucleus(tokenizer):
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1, seed=3)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(5.0)
    prompt_ids = tokenizer.encode("12345>")
    probabilities = first_token_distribution(model, prompt_ids, 1.0)
    sorted_probabilities, order = probabilities.sort(descending=True)
    # The nucleus: smallest prefix of the sorted tokens with mass >= top_p.
    nucleus_size = int((sorted_probabilities.cumsum(0) < 0.5).sum()) + 1
    rollouts = HFRolloutBackend(model, tokenizer).generate(
        ["12345>"], 2000, SamplingSettings(top_p=0.5, max_new_tokens=1, seed=1)
    )
    sampled = {ids[0] for ids in rollouts.response_token_ids}
    assert sampled <= set(order[:nucleus_size].tolist())
    assert len(sampled) >= min(2, nucleus_size)


def test_greedy_is_argmax_and_padding_does_not_change_it(model, tokenizer):
    backend = HFRolloutBackend(model, tokenizer)
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=5)
    batched = backend.generate(["9>", "12345>"], 2, greedy)
    assert batched.response_token_ids[0] == batched.response_token_ids[1]
    for prompt, ids in [
        ("9>", batched.response_token_ids[0]),
        ("12345>", batched.response_token_ids[2]),
    ]:
        # A naive argmax loop, one token at a time, no padding, no cache.
        tokens = tokenizer.encode(prompt)
        expected = []
        with torch.no_grad():
            for _ in range(5):
                next_id = int(model(torch.tensor([tokens])).logits[0, -1].argmax())
                expected.append(next_id)
                tokens.append(next_id)
                if next_id == tokenizer.eos_token_id:
                    break
        assert ids == expected


# Mixed lengths (left padding), a 1-token prompt, and repeats within a group.
SHARING_PROMPTS = ["12345>", "7>", ">", "98>"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prompt_prefill_samples_exactly_what_plain_generate_does(
    tokenizer, temperature
):
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=2, seed=4)
    # An untied random head, so that greedy outputs depend on the prompt, and
    # sharp attention, so that they depend on positions too.
    generator = torch.Generator().manual_seed(0)
    head_shape = model.lm_head.weight.shape
    model.lm_head.weight = torch.nn.Parameter(
        torch.randn(head_shape, generator=generator)
    )
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    sampling = SamplingSettings(temperature=temperature, max_new_tokens=6, seed=3)
    shared, plain = (
        HFRolloutBackend(model, tokenizer, share_prompt_prefix=share).generate(
            SHARING_PROMPTS, 5, sampling
        )
        for share in (True, False)
    )
    assert shared.response_token_ids == plain.response_token_ids
    assert shared.responses == plain.responses
    distinct_responses = len(set(map(tuple, shared.response_token_ids)))
    assert distinct_responses >= (3 if temperature == 0 else 10)


def input_shapes_of_generate(model, tokenizer, group_size):
    """The (rows, positions) of every forward that generating one token runs."""
    shapes = []
    handle = model.model.embed_tokens.register_forward_hook(
        lambda module, args, output: shapes.append(tuple(args[0].shape))
    )
    try:
        HFRolloutBackend(model, tokenizer).generate(
            SHARING_PROMPTS, group_size, SamplingSettings(max_new_tokens=1, seed=0)
        )
    finally:
        handle.remove()
    return shapes


def test_shared_prompt_prefill_runs_each_prompt_once(model, tokenizer):
    # 4 distinct prompts prefilled on 5 of their 6 padded columns, then every
    # one of the 20 rows runs its last prompt token only.
    assert input_shapes_of_generate(model, tokenizer, 5) == [(4, 5), (20, 1)]


def test_prompts_that_never_repeat_are_not_prefilled_twice(model, tokenizer):
    # Plain generate: one prefill of the whole batch.
    assert input_shapes_of_generate(model, tokenizer, 1) == [(4, 6)]


def test_stop_string_cuts_text_and_ids(tokenizer):
    backend = HFRolloutBackend(
        build_tiny_qwen2(tokenizer, hidden_size=32, num_layers=1), tokenizer
    )
    ids = tokenizer.encode("ab</answer>cd")
    kept_ids, text = backend._cut_at_stop_string(ids, ("</answer>",))
    # "ab</answer>" is 11 characters, one token each.
    assert kept_ids == ids[:11]
    assert text == "ab</answer>"
    assert backend._cut_at_stop_string(ids, ("zz",)) == (ids, "ab</answer>cd")


def test_generation_stops_at_stop_string(model, tokenizer):
    backend = HFRolloutBackend(model, tokenizer)
    stop = "a"
    rollouts = backend.generate(
        ["12345>"],
        64,
        SamplingSettings(max_new_tokens=40, stop_strings=(stop,), seed=0),
    )
    stopped = [text for text in rollouts.responses if stop in text]
    assert stopped, "the sampler never produced the stop string; pick another"
    for ids, text in zip(rollouts.response_token_ids, rollouts.responses):
        if stop in text:
            assert text.endswith(stop) and text.count(stop) == 1
            assert tokenizer.decode(ids, skip_special_tokens=True) == text
            assert tokenizer.pad_token_id not in ids


def test_training_mode_is_restored(model, tokenizer):
    model.train()
    HFRolloutBackend(model, tokenizer).generate(
        ["1>"], 1, SamplingSettings(max_new_tokens=2, seed=0)
    )
    assert model.training
    model.eval()


@pytest.mark.parametrize(
    ("prompts", "group_size", "sampling", "message"),
    [
        ([], 2, SamplingSettings(), "prompts"),
        (["1>"], 0, SamplingSettings(), "group_size"),
        (["1>"], 2, SamplingSettings(temperature=-1.0), "temperature"),
        (["1>"], 2, SamplingSettings(top_p=0.0), "top_p"),
        (["1>"], 2, SamplingSettings(max_new_tokens=0), "max_new_tokens"),
    ],
)
def test_bad_arguments_raise(model, tokenizer, prompts, group_size, sampling, message):
    with pytest.raises(ValueError, match=message):
        HFRolloutBackend(model, tokenizer).generate(prompts, group_size, sampling)


def test_make_backend(model, tokenizer):
    assert isinstance(make_backend("hf", model, tokenizer), HFRolloutBackend)
    with pytest.raises(ValueError, match="name must be one of"):
        make_backend("vllmm", model, tokenizer)
    with pytest.raises(ValueError, match="model_name_or_path"):
        make_backend("vllm", model, tokenizer)
    if importlib.util.find_spec("vllm") is None:  # the main environment
        with pytest.raises(ImportError, match="needs vLLM"):
            make_backend("vllm", model, tokenizer, model_name_or_path="some/model")
