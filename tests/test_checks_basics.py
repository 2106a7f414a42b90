"""Exercise checks of notebooks 00-05: each accepts the reference, rejects
plausible wrong answers with ExerciseFailed, and reports a stub as not attempted."""

from __future__ import annotations

import pytest
import torch

from grpo_lab.advantages import compute_group_normalized_rewards
from grpo_lab.logprobs import compute_entropy
from grpo_lab.losses import compute_policy_gradient_loss
from grpo_lab.masks import pad_prompt_and_response_ids
from grpo_lab.rewards import exact_match_reward
from grpo_lab.teaching.checks import ExerciseFailed
from grpo_lab.teaching.checks.advantages import check_group_normalized_advantages
from grpo_lab.teaching.checks.gspo import check_sequence_ratio, reference_sequence_ratio
from grpo_lab.teaching.checks.logprobs import (
    check_response_log_probs,
    check_token_entropy,
    reference_token_log_probs,
)
from grpo_lab.teaching.checks.losses import check_clipped_loss
from grpo_lab.teaching.checks.masks import check_response_mask
from grpo_lab.teaching.checks.setup import check_greedy_continuation


def stub(*args, **kwargs):
    raise NotImplementedError()


def assert_accepts(check, student_fn, capsys, *args):
    assert check(student_fn, *args) is True
    assert "correct" in capsys.readouterr().out


def assert_rejects(check, student_fn, *args):
    with pytest.raises(ExerciseFailed, match="For "):
        check(student_fn, *args)


def assert_not_attempted(check, capsys, *args):
    assert check(stub, *args) is False
    assert "not attempted yet" in capsys.readouterr().out


# --- 00: a prompt's greedy continuation ---------------------------------------


def continuation_reference(model, tokenizer, prompt, max_new_tokens):
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    start = ids.shape[1]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_id = model(ids).logits[:, -1].argmax(dim=-1, keepdim=True)  # (1, 1)
            if next_id.item() == tokenizer.eos_token_id:
                break
            ids = torch.cat([ids, next_id], dim=1)
    return tokenizer.decode(ids[0, start:])


def continuation_with_eos(model, tokenizer, prompt, max_new_tokens):
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    start = ids.shape[1]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_id = model(ids).logits[:, -1].argmax(dim=-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=1)
            if next_id.item() == tokenizer.eos_token_id:
                break
    return tokenizer.decode(ids[0, start:])


def test_continuation_check(capsys):
    assert_accepts(check_greedy_continuation, continuation_reference, capsys)
    with pytest.raises(ExerciseFailed, match="<eos> ends the response"):
        check_greedy_continuation(continuation_with_eos)
    assert_not_attempted(check_greedy_continuation, capsys)


def test_the_scripted_model_reads_the_whole_prefix_through_a_cache():
    """generate, with its key-value cache, sees the scripted answer: the hook
    rebuilds the prefix from what the cache holds."""
    from grpo_lab.teaching.checks.setup import _models, reference_continuation

    name, model, tokenizer, prompt, max_new_tokens, _ = _models()[1]
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    generated = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    text = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
    assert text == reference_continuation(model, tokenizer, prompt, max_new_tokens)
    assert text == "19", name


# --- 01: response mask and shift ---------------------------------------------


def mask_reference(prompt_ids, response_ids, pad_token_id):
    sequences = [p + r for p, r in zip(prompt_ids, response_ids)]
    masks = [[0] * len(p) + [1] * len(r) for p, r in zip(prompt_ids, response_ids)]
    longest = max(len(s) for s in sequences)
    tokens = torch.tensor([s + [pad_token_id] * (longest - len(s)) for s in sequences])
    full_mask = torch.tensor([m + [0] * (longest - len(m)) for m in masks])
    return {
        "input_ids": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "response_mask": full_mask[:, 1:],
    }


def mask_without_shift(prompt_ids, response_ids, pad_token_id):
    # The mask over input_ids instead of labels: one position too late.
    batch = mask_reference(prompt_ids, response_ids, pad_token_id)
    full = [[0] * len(p) + [1] * len(r) for p, r in zip(prompt_ids, response_ids)]
    longest = max(len(m) for m in full)
    mask = torch.tensor([m + [0] * (longest - len(m)) for m in full])
    return {**batch, "response_mask": mask[:, :-1]}


def labels_not_shifted(prompt_ids, response_ids, pad_token_id):
    batch = mask_reference(prompt_ids, response_ids, pad_token_id)
    return {**batch, "labels": batch["input_ids"]}


def mask_from_padding(prompt_ids, response_ids, pad_token_id):
    batch = mask_reference(prompt_ids, response_ids, pad_token_id)
    return {**batch, "response_mask": (batch["labels"] != pad_token_id).long()}


def test_mask_check(capsys):
    assert_accepts(check_response_mask, mask_reference, capsys)
    assert torch.equal(
        mask_reference([[5, 6]], [[7, 1]], 0)["response_mask"],
        pad_prompt_and_response_ids([[5, 6]], [[7, 1]], 0)["response_mask"],
    )
    for wrong in (mask_without_shift, labels_not_shifted, mask_from_padding):
        assert_rejects(check_response_mask, wrong)
    assert_not_attempted(check_response_mask, capsys)


def test_mask_check_rejects_a_missing_key():
    def no_mask(prompt_ids, response_ids, pad_token_id):
        batch = mask_reference(prompt_ids, response_ids, pad_token_id)
        return {"input_ids": batch["input_ids"], "labels": batch["labels"]}

    with pytest.raises(ExerciseFailed, match="response_mask"):
        check_response_mask(no_mask)


# --- 02: log-probs and entropy -----------------------------------------------


def log_probs_reference(logits, labels):
    gathered = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return gathered - torch.logsumexp(logits, dim=-1)


def response_reference(logits, labels, mask):
    token = log_probs_reference(logits.float(), labels)  # (B, T)
    return (token * mask).sum(dim=-1)  # (B,)


def response_by_take_and_where(logits, labels, mask):
    # Written another way: take_along_dim, the normalizer subtracted per position,
    # torch.where over the response, an einsum-free masked sum.
    wide = logits.to(torch.float32)
    picked = torch.take_along_dim(wide, labels[..., None], dim=-1)[..., 0]  # (B, T)
    normalizer = wide.logsumexp(-1)  # (B, T)
    return torch.where(mask.bool(), picked - normalizer, torch.zeros(())).sum(1)


def response_with_log_softmax(logits, labels, mask):
    # Right values, but a (B, T, V) log_softmax output is kept for backward.
    token = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    return (token * mask).sum(-1)


def response_via_exp(logits, labels, mask):
    # log(softmax) by hand, without the max shift: overflows for logits ~1000.
    wide = logits.float()
    probabilities = wide.exp() / wide.exp().sum(-1, keepdim=True)
    token = probabilities.log().gather(-1, labels[..., None])[..., 0]
    return (token * mask).sum(-1)


def response_in_bfloat16(logits, labels, mask):
    # No upcast: the logsumexp is taken in the logits' own dtype.
    return (log_probs_reference(logits, labels) * mask).sum(-1).float()


def response_mean(logits, labels, mask):
    return response_reference(logits, labels, mask) / mask.sum(-1)


def response_unmasked(logits, labels, mask):
    return response_reference(logits, labels, torch.ones_like(mask))


def response_shifted_again(logits, labels, mask):
    # Shifts the labels once more, as if they were the input ids.
    return response_reference(logits, labels.roll(-1, dims=1), mask)


def response_half_gradient(logits, labels, mask):
    value = response_reference(logits, labels, mask)
    return 0.5 * value + 0.5 * value.detach()


def test_response_log_prob_check_accepts_two_ways_of_writing_it(capsys):
    assert_accepts(check_response_log_probs, response_reference, capsys)
    assert_accepts(check_response_log_probs, response_by_take_and_where, capsys)
    assert_not_attempted(check_response_log_probs, capsys)


def test_the_optional_memory_rule_is_told_not_graded(capsys):
    # log_softmax keeps a (B, T, V) tensor for backward: the optional section's
    # point, so the answer passes with a note.
    assert check_response_log_probs(response_with_log_softmax) is True
    assert "note (the optional memory section)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (response_via_exp, "For logits around 1000"),
        (response_in_bfloat16, "logsumexp is taken in bfloat16"),
        (response_mean, "the mean over the response's tokens"),
        (response_unmasked, "response_mask is not applied"),
        (response_shifted_again, "For random logits"),
        (response_half_gradient, "gradient w.r.t. logits"),
    ],
    ids=["exp", "bfloat16", "mean", "unmasked", "shifted", "half_grad"],
)
def test_response_log_prob_check_names_the_mistakes(wrong, message):
    with pytest.raises(ExerciseFailed, match=message) as failure:
        check_response_log_probs(wrong)
    assert failure.value.cases_run == 4


def test_a_bfloat16_result_is_refused_by_its_dtype():
    def half(logits, labels, mask):
        return (log_probs_reference(logits, labels) * mask).sum(-1)

    with pytest.raises(ExerciseFailed, match=r"must be float32, got torch\.bfloat16"):
        check_response_log_probs(half)


def test_reference_log_probs_match_log_softmax():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[0, 6, 3], [1, 1, 2]])
    naive = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(reference_token_log_probs(logits, labels), naive, atol=1e-6)


def entropy_reference(logits, response_mask):
    logits = logits.float()
    probabilities = torch.softmax(logits, -1)
    entropy = torch.logsumexp(logits, -1) - (probabilities * logits).sum(-1)
    return (entropy * response_mask).sum() / response_mask.sum()


def entropy_naive_log(logits, response_mask):
    probabilities = torch.softmax(logits.float(), -1)
    entropy = -(probabilities * probabilities.log()).sum(-1)  # 0 * log 0 = nan
    return (entropy * response_mask).sum() / response_mask.sum()


def entropy_per_response(logits, response_mask):
    probabilities = torch.softmax(logits.float(), -1)
    entropy = -(probabilities * torch.log_softmax(logits.float(), -1)).sum(-1)
    return ((entropy * response_mask).sum(-1) / response_mask.sum(-1)).mean()


def test_entropy_check(capsys):
    assert_accepts(check_token_entropy, entropy_reference, capsys)
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    package = compute_entropy(logits)[mask.bool()].mean()
    assert torch.allclose(entropy_reference(logits, mask), package)
    with pytest.raises(ExerciseFailed, match="the result is NaN"):
        check_token_entropy(entropy_naive_log)
    with pytest.raises(ExerciseFailed, match="each response's mean"):
        check_token_entropy(entropy_per_response)
    assert_not_attempted(check_token_entropy, capsys)


# --- 03: group-normalized advantages -----------------------------------------


def advantages_reference(responses, ground_truths, group_size, advantage_eps):
    truths = [truth for truth in ground_truths for _ in range(group_size)]
    rewards = [exact_match_reward(r, t)["reward"] for r, t in zip(responses, truths)]
    grouped = torch.tensor(rewards).reshape(-1, group_size)  # (groups, G)
    centered = grouped - grouped.mean(1, keepdim=True)
    return (centered / (grouped.std(1, keepdim=True) + advantage_eps)).flatten()


def advantages_interleaved(responses, ground_truths, group_size, advantage_eps):
    # Reads the batch as prompt 0, prompt 1, ..., prompt 0, ...: not group by group.
    count = len(ground_truths)
    truths = [ground_truths[i % count] for i in range(len(responses))]
    rewards = [exact_match_reward(r, t)["reward"] for r, t in zip(responses, truths)]
    grouped = torch.tensor(rewards).reshape(-1, group_size)
    centered = grouped - grouped.mean(1, keepdim=True)
    return (centered / (grouped.std(1, keepdim=True) + advantage_eps)).flatten()


def test_advantage_check(capsys):
    assert_accepts(check_group_normalized_advantages, advantages_reference, capsys)
    responses, truths = ["1", "0", "0", "1", "1", "1"], ["1", "1"]
    package, _ = compute_group_normalized_rewards(
        torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), 3, "mean", 1e-6, "std"
    )
    assert torch.allclose(advantages_reference(responses, truths, 3, 1e-6), package)
    with pytest.raises(ExerciseFailed, match="group by group"):
        check_group_normalized_advantages(advantages_interleaved)
    assert_not_attempted(check_group_normalized_advantages, capsys)


# --- 04: clipped loss ---------------------------------------------------------


def clipped_reference(advantages, policy_log_probs, old_log_probs, cliprange):
    a, ratio, clipped = _ratio_and_bounds(
        advantages, policy_log_probs, old_log_probs, cliprange
    )
    return -torch.minimum(a * ratio, a * clipped)


def _ratio_and_bounds(advantages, policy_log_probs, old_log_probs, cliprange):
    ratio = torch.exp(policy_log_probs - old_log_probs)
    clipped = ratio.clamp(1 - cliprange, 1 + cliprange)
    return advantages.unsqueeze(-1), ratio, clipped


def clipped_with_max(advantages, policy_log_probs, old_log_probs, cliprange):
    a, ratio, clipped = _ratio_and_bounds(
        advantages, policy_log_probs, old_log_probs, cliprange
    )
    return -torch.maximum(a * ratio, a * clipped)


def clipped_log_ratio(advantages, policy_log_probs, old_log_probs, cliprange):
    log_ratio = (policy_log_probs - old_log_probs).clamp(-cliprange, cliprange)
    a = advantages.unsqueeze(-1)
    return -torch.minimum(
        a * (policy_log_probs - old_log_probs).exp(), a * log_ratio.exp()
    )


def clipped_without_sign(advantages, policy_log_probs, old_log_probs, cliprange):
    a, ratio, clipped = _ratio_and_bounds(
        advantages, policy_log_probs, old_log_probs, cliprange
    )
    return torch.minimum(a * ratio, a * clipped)


def clipped_detached_ratio(advantages, policy_log_probs, old_log_probs, cliprange):
    return clipped_reference(
        advantages, policy_log_probs, old_log_probs, cliprange
    ).detach()


def clipped_only_clipped_term(advantages, policy_log_probs, old_log_probs, cliprange):
    a, _, clipped = _ratio_and_bounds(
        advantages, policy_log_probs, old_log_probs, cliprange
    )
    return -a * clipped


def test_clipped_loss_check(capsys):
    assert_accepts(check_clipped_loss, clipped_reference, capsys)
    advantages, old = torch.tensor([1.0, -1.0]), torch.full((2, 3), -1.0)
    policy = old + torch.tensor([[0.5, 0.0, -0.5]] * 2)
    package, _ = compute_policy_gradient_loss(advantages, policy, "grpo", old, 0.2)
    assert torch.allclose(clipped_reference(advantages, policy, old, 0.2), package)
    for wrong in (
        clipped_with_max,
        clipped_log_ratio,
        clipped_without_sign,
        clipped_detached_ratio,
        clipped_only_clipped_term,
    ):
        assert_rejects(check_clipped_loss, wrong)
    assert_not_attempted(check_clipped_loss, capsys)


# --- 05: GSPO sequence ratio --------------------------------------------------


def ratio_geometric(policy_log_probs, old_log_probs, response_mask):
    log_ratio = (policy_log_probs - old_log_probs) * response_mask
    return torch.exp(log_ratio.sum(1) / response_mask.sum(1))


def ratio_arithmetic(policy_log_probs, old_log_probs, response_mask):
    ratio = torch.exp(policy_log_probs - old_log_probs) * response_mask
    return ratio.sum(1) / response_mask.sum(1)


def ratio_product(policy_log_probs, old_log_probs, response_mask):
    return torch.exp(((policy_log_probs - old_log_probs) * response_mask).sum(1))


def ratio_ignores_mask(policy_log_probs, old_log_probs, response_mask):
    return torch.exp((policy_log_probs - old_log_probs).mean(1))


def test_sequence_ratio_check(capsys):
    assert_accepts(check_sequence_ratio, ratio_geometric, capsys)
    for wrong in (
        ratio_arithmetic,
        ratio_product,
        ratio_ignores_mask,
        lambda p, o, m: ratio_geometric(p.detach(), o, m),  # detached ratio
    ):
        assert_rejects(check_sequence_ratio, wrong)
    assert_not_attempted(check_sequence_ratio, capsys)


def test_reference_sequence_ratio_by_hand():
    # Token ratios 2 and 0.5 on the response: sqrt(2 * 0.5) = 1; 4 and 1: 2.
    old = torch.zeros(2, 3)
    policy = torch.tensor([[9.0, 2.0, 0.5], [9.0, 4.0, 1.0]]).log()
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    ratio = reference_sequence_ratio(policy, old, mask)
    assert torch.allclose(ratio, torch.tensor([1.0, 2.0]), atol=1e-6)


def test_a_student_exception_other_than_stub_propagates():
    def broken(*args):
        raise TypeError("typo in the student's code")

    with pytest.raises(TypeError, match="typo"):
        check_sequence_ratio(broken)


def test_the_package_function_is_refused_with_its_name():
    with pytest.raises(ExerciseFailed) as failure:
        check_response_mask(pad_prompt_and_response_ids)
    assert str(failure.value).startswith(
        "write it yourself: this check compares against "
        "grpo_lab.masks.pad_prompt_and_response_ids"
    )

    def aliased(prompt_ids, response_ids, pad_token_id):
        return build(prompt_ids, response_ids, pad_token_id)

    build = pad_prompt_and_response_ids  # a closure under another name
    with pytest.raises(ExerciseFailed, match="not available while this exercise"):
        check_response_mask(aliased)


def test_a_helper_beside_the_answer_that_calls_the_package_is_refused():
    with pytest.raises(ExerciseFailed, match="compute_entropy is not available"):
        check_token_entropy(entropy_via_helper)


def _helper_calling_the_package(logits):
    return compute_entropy(logits)


def entropy_via_helper(logits, response_mask):
    return _helper_calling_the_package(logits)[response_mask.bool()].mean()


# --- every check: how many of its cases passed ------------------------------------


def test_a_passing_check_reports_every_case_passed(capsys):
    assert check_group_normalized_advantages(advantages_reference) is True
    assert "correct ✔ (4 of 4 cases passed)" in capsys.readouterr().out


def test_a_failing_check_counts_the_cases_it_passed():
    # Wrong only on groups of two: the last of the four cases.
    def wrong_for_pairs(responses, ground_truths, group_size, advantage_eps):
        if group_size == 2:
            return torch.zeros(len(responses))
        return advantages_reference(responses, ground_truths, group_size, advantage_eps)

    with pytest.raises(ExerciseFailed, match="group_size=2") as failure:
        check_group_normalized_advantages(wrong_for_pairs)
    assert (failure.value.cases_passed, failure.value.cases_run) == (3, 4)
    assert str(failure.value).endswith("3 of 4 cases passed")


def test_a_half_done_answer_fails_rather_than_reading_not_attempted():
    def half_done(responses, ground_truths, group_size, advantage_eps):
        if group_size == 4:
            return advantages_reference(
                responses, ground_truths, group_size, advantage_eps
            )
        raise NotImplementedError  # the other group sizes: still the stub

    with pytest.raises(ExerciseFailed, match="still raises NotImplementedError"):
        check_group_normalized_advantages(half_done)


def test_a_student_exception_keeps_its_type_and_gets_the_count():
    def breaks_on_pairs(responses, ground_truths, group_size, advantage_eps):
        if group_size == 2:
            raise IndexError("off by one")
        return advantages_reference(responses, ground_truths, group_size, advantage_eps)

    with pytest.raises(IndexError, match="off by one") as failure:
        check_group_normalized_advantages(breaks_on_pairs)
    assert failure.value.__notes__ == ["3 of 4 cases passed"]
    assert failure.value.cases_passed == 3


def test_the_public_signature_hides_the_case_count():
    import inspect

    from grpo_lab.teaching.checks.framework import exercise_check

    @exercise_check("a check with arguments of its own")
    def check_token_entropy(student_fn, cases, model, tokenizer):
        pass

    assert list(inspect.signature(check_token_entropy).parameters) == [
        "student_fn",
        "model",
        "tokenizer",
    ]
    assert list(inspect.signature(check_greedy_continuation).parameters) == [
        "student_fn"
    ]
