"""vLLM's real engine (CPU build) behind VLLMRolloutBackend: what it samples,
the log-probs it reports, seeds, stop strings, multi-turn continuations, the
prompt ids it sees, and the process state it leaves behind.

One engine for the module: a tied tiny Qwen2 in float32 with grpo_lab's BPE
tokenizer (several characters per token, split differently by vLLM's own
AutoTokenizer than by the policy's tokenizer object).
"""

from __future__ import annotations

import random

import pytest
import torch
from vllm_engines import backend_for, tiny_policy

from grpo_lab.models import build_bpe_tokenizer
from grpo_lab.rollouts.base import SamplingSettings
from grpo_lab.rollouts.vllm import log_prob_gap

# float32 on both sides: the engine's log-probs equal the policy's up to
# kernel rounding (about 1e-6 here).
TOLERANCE = 1e-5
PROMPTS = ["Reverse 12345:", "the answer is"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_bpe_tokenizer()


@pytest.fixture(scope="module")
def engine(tokenizer, tmp_path_factory):
    """(backend, policy, what the engine start changed in this process)."""
    policy = tiny_policy(tokenizer)
    torch.manual_seed(1234)
    random.seed(1234)
    before = (torch.get_num_threads(), torch.random.get_rng_state(), random.getstate())
    backend = backend_for(policy, tokenizer, tmp_path_factory.mktemp("bpe"))
    after = (torch.get_num_threads(), torch.random.get_rng_state(), random.getstate())
    return backend, policy, before, after


def test_prompt_ids_are_the_policy_tokenizers(engine, tokenizer):
    backend, _, _, _ = engine
    rollouts = backend.generate(PROMPTS, 2, SamplingSettings(max_new_tokens=4, seed=0))
    policy_ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    assert rollouts.prompt_token_ids == [policy_ids[0]] * 2 + [policy_ids[1]] * 2
    # vLLM's own tokenizer splits the same text otherwise: the test means something.
    engine_tokenizer = backend.llm.get_tokenizer()
    engine_ids = engine_tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    assert engine_ids != policy_ids[0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_reports_the_log_probs_it_sampled_from(engine, temperature):
    backend, policy, _, _ = engine
    sampling = SamplingSettings(temperature=temperature, max_new_tokens=12, seed=5)
    rollouts = backend.generate(PROMPTS, 4, sampling)
    assert rollouts.prompts == [PROMPTS[0]] * 4 + [PROMPTS[1]] * 4
    assert len(rollouts.responses) == 8
    assert all(1 <= len(ids) <= 12 for ids in rollouts.response_token_ids)
    assert [len(v) for v in rollouts.sampler_log_probs] == [
        len(ids) for ids in rollouts.response_token_ids
    ]
    # processed log-probs: those of softmax(logits / T), scored by the policy
    gap = log_prob_gap(policy, rollouts, temperature)
    assert gap["rollout/logprob_abs_diff_max"] < TOLERANCE
    # ... and not those of softmax(logits) when T != 1
    if temperature != 1.0:
        raw = log_prob_gap(policy, rollouts, 1.0)
        assert raw["rollout/logprob_abs_diff_mean"] > 1e-2


def test_seeds_repeat_samples_and_differ_across_seeds(engine):
    backend, _, _, _ = engine

    def sample(seed):
        sampling = SamplingSettings(max_new_tokens=10, seed=seed)
        return backend.generate(PROMPTS, 3, sampling).response_token_ids

    first, again, other = sample(11), sample(11), sample(12)
    assert first == again
    assert first != other
    # the G samples of one prompt are distinct streams
    assert len({tuple(ids) for ids in first[:3]}) > 1


def test_a_stop_string_ends_the_response_and_is_kept(engine, tokenizer):
    backend, _, _, _ = engine
    free = backend.generate(PROMPTS, 4, SamplingSettings(max_new_tokens=24, seed=3))
    # a stop string that the unconstrained samples do contain: their first char
    stop = next(text[1] for text in free.responses if len(text) > 2)
    sampling = SamplingSettings(max_new_tokens=24, seed=3, stop_strings=(stop,))
    stopped = backend.generate(PROMPTS, 4, sampling)
    assert any(text.endswith(stop) for text in stopped.responses)
    for text, ids in zip(stopped.responses, stopped.response_token_ids):
        if stop in text:
            assert text.index(stop) == len(text) - len(stop)
            # the last sampled token completes the stop string
            assert stop in tokenizer.decode(ids)
            assert stop not in tokenizer.decode(ids[:-1])


def test_continue_ids_extends_each_context(engine, tokenizer):
    backend, policy, _, _ = engine
    contexts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    sampling = SamplingSettings(max_new_tokens=6, seed=9)
    ids, log_probs, texts = backend.continue_ids(contexts, sampling)
    assert len(ids) == len(log_probs) == len(texts) == 2
    assert [len(v) for v in log_probs] == [len(i) for i in ids]
    assert backend.continue_ids(contexts, sampling)[0] == ids  # seeded
    from grpo_lab.rollouts.base import Rollouts

    rollouts = Rollouts(PROMPTS, texts, contexts, ids, log_probs)
    assert log_prob_gap(policy, rollouts, 1.0)["rollout/logprob_abs_diff_max"] < (
        TOLERANCE
    )


def test_starting_the_engine_keeps_threads_and_random_state(engine):
    _, _, before, after = engine
    assert after[0] == before[0]
    assert torch.equal(after[1], before[1])
    assert after[2] == before[2]
    # torch.set_num_threads works again (the CPU worker had replaced it)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
