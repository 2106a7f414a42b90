"""``sync`` after real optimizer steps: vLLM then samples from the trained
policy, for a tied head (every grpo_lab tiny model) and an untied one.

vLLM's CPU build repacks its linear weights after loading, so a sync must go
through the worker's reload; a tied head keeps a packed copy of its own, which
only a reload that is sent ``lm_head.weight`` refreshes.
"""

from __future__ import annotations

import pytest
import torch
from vllm_engines import backend_for, tiny_policy

from grpo_lab.models import build_char_tokenizer
from grpo_lab.rollouts.base import SamplingSettings
from grpo_lab.rollouts.vllm import log_prob_gap

TOLERANCE = 1e-5
PROMPTS = ["12345=", "90817="]
SAMPLING = SamplingSettings(temperature=1.0, max_new_tokens=8, seed=21)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module", params=["tied", "untied"])
def engine(request, tokenizer, tmp_path_factory):
    policy = tiny_policy(tokenizer, tied=request.param == "tied", seed=3)
    folder = tmp_path_factory.mktemp(request.param)
    return backend_for(policy, tokenizer, folder), policy


def optimizer_step(policy, optimizer, rollouts):
    """One AdamW step raising the log-likelihood of ``rollouts``' responses."""
    ids = [
        p + r for p, r in zip(rollouts.prompt_token_ids, rollouts.response_token_ids)
    ]
    width = max(map(len, ids))
    batch = torch.tensor([row + [0] * (width - len(row)) for row in ids])  # (B, L)
    logits = policy(batch).logits[:, :-1].float()  # (B, L-1, V)
    log_probs = torch.log_softmax(logits, -1).gather(-1, batch[:, 1:, None])
    loss = -log_probs.mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_sync_after_1_and_10_optimizer_steps_keeps_vllm_on_policy(engine):
    backend, policy = engine
    assert (
        log_prob_gap(policy, backend.generate(PROMPTS, 4, SAMPLING), 1.0)[
            "rollout/logprob_abs_diff_max"
        ]
        < TOLERANCE
    )  # the engine loaded the saved weights
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    batch = backend.generate(PROMPTS, 4, SAMPLING)  # the data of every step
    for step in range(1, 11):
        optimizer_step(policy, optimizer, batch)
        if step in (1, 10):
            stale = log_prob_gap(policy, backend.generate(PROMPTS, 4, SAMPLING), 1.0)
            # the step moved the policy away from what vLLM holds
            assert stale["rollout/logprob_abs_diff_mean"] > 1e-2, step
        backend.sync(policy)
        if step in (1, 10):
            synced = log_prob_gap(policy, backend.generate(PROMPTS, 4, SAMPLING), 1.0)
            assert synced["rollout/logprob_abs_diff_max"] < TOLERANCE, (step, synced)


def test_the_head_vllm_samples_with_is_the_policys(engine, tokenizer):
    # After a change to the head alone (the embedding, when tied), greedy
    # samples follow the policy's new argmax: a stale head would not.
    backend, policy = engine
    head = policy.get_output_embeddings().weight
    with torch.no_grad():
        target = tokenizer.convert_tokens_to_ids("7")
        head[target] += 50.0 * head.norm(dim=1).max() / head[target].norm()
    backend.sync(policy)
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=4)
    rollouts = backend.generate(PROMPTS, 1, greedy)
    expected = policy_greedy(policy, rollouts.prompt_token_ids, 4)
    assert rollouts.response_token_ids == expected
    assert log_prob_gap(policy, rollouts, 1.0)["rollout/logprob_abs_diff_max"] < 1e-4


def policy_greedy(policy, prompt_ids, steps):
    result = []
    with torch.no_grad():
        for prompt in prompt_ids:
            ids = list(prompt)
            for _ in range(steps):
                ids.append(int(policy(torch.tensor([ids])).logits[0, -1].argmax()))
            result.append(ids[len(prompt) :])
    return result
