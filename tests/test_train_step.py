"""Tests for grpo_lab.train_step on a tiny Qwen2: gradients, guards, diagnostics.

The oracle is a naive full-batch computation: log_softmax(logits / T), the loss
formula written out, every row scored, one backward.
"""

from __future__ import annotations

import pytest
import torch

from grpo_lab.advantages import (
    compute_group_normalized_rewards,
    compute_rollout_rewards,
)
from grpo_lab.masks import pad_prompt_and_response_ids, tokenize_prompt_and_output
from grpo_lab.teaching.gradient_recorder import GradientRecorder
from grpo_lab.train_step import (
    UpdateSettings,
    grpo_train_step,
    policy_gradient_update,
)

PROMPTS = ["12+3=", "12+3=", "7+8=", "7+8=", "40+2=", "40+2=", "9+9=", "9+9="]
RESPONSES = ["15", "51", "15", "1", "42", "42x", "18", "99"]
TRUTHS = ["15", "15", "15", "15", "42", "42", "18", "18"]
# Some rows have zero advantage, so they are skipped; the rest are not.
ADVANTAGES = torch.tensor([1.0, -1.0, 0.0, 0.0, 0.5, -0.5, 0.0, 2.0])
CLIPRANGES = {"none": None, "noclip": None, "grpo": 0.2, "gspo": 0.05}


def exact_match(response: str, truth: str) -> dict[str, float]:
    correct = float(response == truth)
    return {"reward": correct, "format_reward": 1.0, "answer_reward": correct}


def naive_log_probs(model, batch, temperature=1.0):
    logits = model(batch["input_ids"]).logits.float() / temperature  # (B, T, V)
    log_probs = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    return log_probs.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)  # (B, T)


def naive_loss(
    model,
    batch,
    advantages,
    method,
    old_log_probs,
    normalization,
    constant=None,
    temperature=1.0,
):
    """Every row scored, the formula written out, one scalar."""
    log_probs = naive_log_probs(model, batch, temperature)  # (B, T)
    mask = batch["response_mask"].float()  # (B, T)
    lengths = mask.sum(dim=1).clamp_min(1)  # (B,)
    advantage = advantages[:, None]  # (B, 1)
    if method == "none":
        per_token = -advantage * log_probs
    else:
        log_ratio = log_probs - old_log_probs  # (B, T)
        if method == "gspo":
            log_ratio = ((log_ratio * mask).sum(dim=1) / lengths)[:, None]  # (B, 1)
        ratio = log_ratio.exp()
        per_token = -advantage * ratio
        if method in ("grpo", "gspo"):
            eps = CLIPRANGES[method]
            clipped = -advantage * ratio.clamp(1 - eps, 1 + eps)
            per_token = torch.maximum(per_token, clipped)  # -min(objectives)
        per_token = per_token.expand_as(log_probs)
    if normalization == "sequence":
        return ((per_token * mask).sum(dim=1) / lengths).mean()
    return (per_token * mask).sum() / constant


def naive_gradients(model, *args, **kwargs):
    loss = naive_loss(model, *args, **kwargs)
    parameters = list(model.parameters())
    gradients = torch.autograd.grad(loss, parameters, allow_unused=True)
    return [
        torch.zeros_like(p) if g is None else g for p, g in zip(parameters, gradients)
    ]


def assert_gradients_close(actual, expected, atol=1e-6):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=atol, rtol=1e-4)


@pytest.fixture
def batch(char_tokenizer):
    return tokenize_prompt_and_output(PROMPTS, RESPONSES, char_tokenizer)


def old_log_probs_for(model, batch, temperature=1.0):
    """The current policy's log-probs, perturbed so ratios leave the clip range."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        log_probs = naive_log_probs(model, batch, temperature)  # (B, T)
    return log_probs + 0.3 * torch.randn(log_probs.shape, generator=generator)


def run_update(
    model, batch, method, normalization, steps, advantages=ADVANTAGES, **keywords
):
    old = old_log_probs_for(model, batch) if method != "none" else None
    optimizer = GradientRecorder(model.parameters(), lr=1.0)
    loss, metadata = policy_gradient_update(
        model,
        optimizer,
        steps,
        None,
        batch,
        advantages,
        method,
        old,
        CLIPRANGES[method],
        normalization,
        7 if normalization == "constant" else None,
        **keywords,
    )
    return loss, metadata, optimizer


CASES = [
    ("none", "sequence"),
    ("noclip", "constant"),
    ("grpo", "sequence"),
    ("gspo", "constant"),
]


@pytest.mark.parametrize(("method", "normalization"), CASES)
def test_microbatches_give_the_full_batch_gradient(
    make_tiny_qwen2, batch, method, normalization
):
    reference = make_tiny_qwen2()
    old = old_log_probs_for(reference, batch) if method != "none" else None
    expected = naive_gradients(
        reference, batch, ADVANTAGES, method, old, normalization, constant=7
    )
    for steps in (1, 2, 4):
        _, metadata, optimizer = run_update(
            make_tiny_qwen2(), batch, method, normalization, steps
        )
        assert optimizer.steps == 1
        assert_gradients_close(optimizer.gradients, expected)
        assert metadata["active_response_count"] == 5.0  # zero rows skipped
        assert metadata["optimizer_step"] == 1.0


@pytest.mark.parametrize(("method", "normalization"), CASES)
def test_diagnostics_do_not_depend_on_the_microbatch_split(
    make_tiny_qwen2, batch, method, normalization
):
    results = [
        run_update(make_tiny_qwen2(), batch, method, normalization, steps)[:2]
        for steps in (1, 2, 4)
    ]
    single_loss, single = results[0]
    assert set(single) >= {"loss", "gradient_norm", "token_entropy"}
    for loss, metadata in results[1:]:
        torch.testing.assert_close(loss, single_loss, atol=1e-6, rtol=1e-5)
        assert set(metadata) == set(single)
        for key, value in single.items():
            torch.testing.assert_close(
                torch.as_tensor(metadata[key]).double(),
                torch.as_tensor(value).double(),
                atol=1e-6,
                rtol=1e-5,
                msg=key,
            )


def test_diagnostics_equal_the_naive_values(make_tiny_qwen2, batch):
    model = make_tiny_qwen2()
    old = old_log_probs_for(model, batch)
    active = ADVANTAGES != 0
    with torch.no_grad():
        log_probs = naive_log_probs(model, batch)[active]  # (b, T)
        logits = model(batch["input_ids"][active]).logits  # (b, T, V)
        mask = batch["response_mask"][active].bool()  # (b, T)
        entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)  # (b, T)
        ratio = (log_probs - old[active]).exp()  # (b, T)
        advantage = ADVANTAGES[active][:, None]  # (b, 1)
        clipped = ((advantage > 0) & (ratio > 1.2)) | ((advantage < 0) & (ratio < 0.8))
        naive_loss_value = naive_loss(model, batch, ADVANTAGES, "grpo", old, "sequence")
    loss, metadata, _ = run_update(model, batch, "grpo", "sequence", 4)
    assert metadata["response_token_count"].item() == mask.sum().item()
    assert metadata["clip_count"].item() == (clipped & mask).sum().item()
    assert metadata["clip_count"].item() > 0  # the case exercises clipping
    torch.testing.assert_close(metadata["token_entropy"], entropy[mask].mean())
    torch.testing.assert_close(metadata["importance_ratio_mean"], ratio[mask].mean())
    torch.testing.assert_close(loss, naive_loss_value)


def test_skipped_rows_still_count_in_the_sequence_divisor(make_tiny_qwen2, batch):
    # Scoring only the 5 active rows but dividing by all 8 rows is the full-batch
    # mean; dividing by 5 would make the gradient 8/5 times too large.
    model = make_tiny_qwen2()
    active = ADVANTAGES != 0
    active_batch = {key: value[active] for key, value in batch.items()}
    only_active = naive_gradients(
        model, active_batch, ADVANTAGES[active], "none", None, "sequence"
    )
    _, _, optimizer = run_update(make_tiny_qwen2(), batch, "none", "sequence", 2)
    assert_gradients_close(optimizer.gradients, [g * 5 / 8 for g in only_active])


def test_temperature_scores_logits_divided_by_temperature(make_tiny_qwen2, batch):
    model = make_tiny_qwen2()
    old = old_log_probs_for(model, batch, temperature=2.0)
    expected = naive_gradients(
        model, batch, ADVANTAGES, "grpo", old, "sequence", temperature=2.0
    )
    gradients = {}
    for temperature in (1.0, 2.0):
        model = make_tiny_qwen2()
        optimizer = GradientRecorder(model.parameters(), lr=1.0)
        policy_gradient_update(
            model,
            optimizer,
            2,
            None,
            batch,
            ADVANTAGES,
            "grpo",
            old,
            0.2,
            temperature=temperature,
        )
        gradients[temperature] = optimizer.gradients
    assert_gradients_close(gradients[2.0], expected)
    assert not torch.allclose(gradients[1.0][0], gradients[2.0][0], atol=1e-4)


def test_logits_chunk_size_gives_the_same_gradients(make_tiny_qwen2, batch):
    gradients = []
    for chunk_size in (0, 3):
        _, _, optimizer = run_update(
            make_tiny_qwen2(),
            batch,
            "gspo",
            "sequence",
            2,
            logits_chunk_size=chunk_size,
        )
        gradients.append(optimizer.gradients)
    assert_gradients_close(gradients[1], gradients[0])


@pytest.mark.parametrize(("method", "normalization"), CASES)
def test_sharing_prompt_prefixes_gives_the_same_gradients(
    make_tiny_qwen2, batch, method, normalization, monkeypatch
):
    import grpo_lab.train_step as train_step_module

    prefix_lengths = []
    prefix_to_share = train_step_module.prefix_to_share

    def recording_prefix_to_share(mask, share, *ids_and_labels):
        prefix_lengths.append(prefix_to_share(mask, share, *ids_and_labels))
        return prefix_lengths[-1]

    monkeypatch.setattr(train_step_module, "prefix_to_share", recording_prefix_to_share)
    gradients, metadata = [], []
    for share in (False, True):
        _, step_metadata, optimizer = run_update(
            make_tiny_qwen2(),
            batch,
            method,
            normalization,
            2,
            share_prompt_prefix=share,
        )
        gradients.append(optimizer.gradients)
        metadata.append(step_metadata)
    # Active rows 0, 1, 4, 5 | 7 in microbatches of 4: "12+3=" and "40+2=" leave
    # 4 prompt-only columns, "9+9=" alone 3 (one row: nothing to share); the
    # unshared update asks for 0 on both microbatches.
    assert prefix_lengths == [0, 0, 4, 3]
    assert_gradients_close(gradients[1], gradients[0], atol=1e-5)
    for key, value in metadata[0].items():
        torch.testing.assert_close(
            torch.as_tensor(metadata[1][key]), torch.as_tensor(value)
        )


def test_max_grad_norm_clips_and_reports_the_norm_before_clipping(
    make_tiny_qwen2, batch
):
    model = make_tiny_qwen2()
    expected = naive_gradients(model, batch, ADVANTAGES, "none", None, "sequence")
    expected_norm = torch.stack([g.norm() for g in expected]).norm()
    optimizer = GradientRecorder(model.parameters(), lr=1.0)
    _, metadata = policy_gradient_update(model, optimizer, 2, 1e-3, batch, ADVANTAGES)
    torch.testing.assert_close(
        metadata["gradient_norm"], expected_norm, rtol=1e-4, atol=0
    )
    clipped_norm = torch.stack([g.norm() for g in optimizer.gradients]).norm()
    assert clipped_norm.item() == pytest.approx(1e-3, rel=1e-3)


def test_a_real_step_changes_the_parameters(tiny_qwen2, batch):
    before = [p.detach().clone() for p in tiny_qwen2.parameters()]
    optimizer = GradientRecorder(tiny_qwen2.parameters(), lr=0.1)
    loss, metadata = policy_gradient_update(
        tiny_qwen2, optimizer, 2, 1.0, batch, ADVANTAGES
    )
    assert optimizer.steps == 1 and metadata["optimizer_step"] == 1.0
    assert torch.isfinite(loss)
    changed = [
        not torch.equal(old, new.detach())
        for old, new in zip(before, tiny_qwen2.parameters())
    ]
    with_gradient = [g.abs().sum().item() > 0 for g in optimizer.gradients]
    assert changed == with_gradient
    assert sum(changed) >= len(changed) - 1  # every weight takes part
    assert all(p.grad is None for p in tiny_qwen2.parameters())  # zeroed after


def test_all_zero_advantages_do_not_step(tiny_qwen2, batch):
    before = [p.detach().clone() for p in tiny_qwen2.parameters()]
    optimizer = GradientRecorder(tiny_qwen2.parameters(), lr=1.0)
    loss, metadata = policy_gradient_update(
        tiny_qwen2,
        optimizer,
        2,
        1.0,
        batch,
        torch.zeros(8),
        "grpo",
        torch.zeros(batch["labels"].shape),
        0.2,
    )
    assert optimizer.steps == 0
    assert loss.item() == 0.0
    # Nothing was scored: only what is true of a skipped step is reported (a
    # zero entropy or clip fraction would read as a measurement).
    assert metadata == {"optimizer_step": 0.0, "active_response_count": 0.0}
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_qwen2.parameters()))


class UnusableTokenizer:
    pad_token_id = 0

    def encode(self, *args, **kwargs):
        raise AssertionError("nothing should be tokenized")


def test_grpo_train_step_with_no_signal_neither_tokenizes_nor_steps(tiny_qwen2):
    optimizer = GradientRecorder(tiny_qwen2.parameters(), lr=1.0)
    # Every response in each group gets the same reward: all advantages are 0.
    loss, metadata = grpo_train_step(
        tiny_qwen2,
        UnusableTokenizer(),
        optimizer,
        2,
        1.0,
        exact_match,
        ["1+1=", "1+1="],
        ["2", "2"],
        ["2", "2"],
        2,
    )
    assert optimizer.steps == 0
    assert loss.item() == 0.0 and metadata["optimizer_step"] == 0.0
    assert metadata["reward_mean"] == 1.0


def assert_parameters_unchanged(model, before):
    for old, new in zip(before, model.parameters()):
        assert torch.equal(old, new.detach()) or (
            torch.isnan(old).any() and torch.equal(old.nan_to_num(), new.nan_to_num())
        )


@pytest.mark.parametrize(
    ("method", "old_value", "message"),
    [
        ("noclip", -float("inf"), "Non-finite GRPO loss"),
        # Clipping hides the overflowing ratio in the loss; the ratio mean shows it.
        ("grpo", -1e4, "Non-finite importance_ratio_mean"),
    ],
)
def test_non_finite_ratios_raise_before_the_step(
    tiny_qwen2, batch, method, old_value, message
):
    before = [p.detach().clone() for p in tiny_qwen2.parameters()]
    optimizer = GradientRecorder(tiny_qwen2.parameters(), lr=1.0)
    old = torch.full(batch["labels"].shape, old_value)
    with pytest.raises(RuntimeError, match=message):
        policy_gradient_update(
            tiny_qwen2, optimizer, 2, 1.0, batch, ADVANTAGES.abs(), method, old, 0.2
        )
    assert optimizer.steps == 0
    assert_parameters_unchanged(tiny_qwen2, before)


def test_a_poisoned_parameter_raises_before_the_step(tiny_qwen2, batch):
    with torch.no_grad():
        tiny_qwen2.model.norm.weight[0] = float("nan")
    before = [p.detach().clone() for p in tiny_qwen2.parameters()]
    optimizer = GradientRecorder(tiny_qwen2.parameters(), lr=1.0)
    with pytest.raises(RuntimeError, match="Non-finite GRPO loss"):
        policy_gradient_update(tiny_qwen2, optimizer, 2, 1.0, batch, ADVANTAGES)
    assert optimizer.steps == 0
    assert_parameters_unchanged(tiny_qwen2, before)


def test_token_id_path_matches_the_text_path(make_tiny_qwen2, char_tokenizer):
    # The character tokenizer round-trips, so the sampled ids are the text's ids.
    model = make_tiny_qwen2()
    text_optimizer = GradientRecorder(model.parameters(), lr=1.0)
    text_loss, text_metadata = grpo_train_step(
        model,
        char_tokenizer,
        text_optimizer,
        2,
        1.0,
        exact_match,
        PROMPTS,
        RESPONSES,
        TRUTHS,
        2,
    )
    model = make_tiny_qwen2()
    id_optimizer = GradientRecorder(model.parameters(), lr=1.0)
    rewards, _ = compute_rollout_rewards(exact_match, RESPONSES, TRUTHS)
    advantages, _ = compute_group_normalized_rewards(rewards, 2)
    batch = pad_prompt_and_response_ids(
        [char_tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS],
        [char_tokenizer.encode(r, add_special_tokens=False) for r in RESPONSES],
        char_tokenizer.pad_token_id,
    )
    id_loss, id_metadata = policy_gradient_update(
        model, id_optimizer, 2, 1.0, batch, advantages
    )
    assert torch.equal(text_loss, id_loss)
    assert_gradients_close(id_optimizer.gradients, text_optimizer.gradients, atol=0)
    for key, value in id_metadata.items():
        assert torch.equal(torch.as_tensor(text_metadata[key]), torch.as_tensor(value))
    assert {"reward_mean", "advantage_mean", "advantage_std"} <= set(text_metadata)


def test_policy_gradient_update_errors(tiny_qwen2, batch):
    optimizer = GradientRecorder(tiny_qwen2.parameters(), lr=1.0)
    old = torch.zeros(batch["labels"].shape)

    def update(**overrides):
        arguments = {
            "model": tiny_qwen2,
            "optimizer": optimizer,
            "gradient_accumulation_steps": 2,
            "max_grad_norm": 1.0,
            "batch": batch,
            "advantages": ADVANTAGES,
            "importance_reweighting_method": "grpo",
            "old_log_probs": old,
            "cliprange": 0.2,
        } | overrides
        return policy_gradient_update(**arguments)

    short = {key: value[:, :-1] for key, value in batch.items()}
    cases = [
        (
            {"batch": {"input_ids": batch["input_ids"]}},
            r"batch must hold \('input_ids', 'labels', 'response_mask'\).*missing \['labels', 'response_mask'\]",
        ),
        (
            {"batch": batch | {"response_mask": batch["response_mask"][:, 1:]}},
            r"batch\['response_mask'\] must be 2-D with the shape of batch\['labels'\] \(8, \d+\), got \(8, \d+\)",
        ),
        (
            {"advantages": ADVANTAGES[:, None]},
            r"advantages must have shape \(8,\), one per batch row, got \(8, 1\)",
        ),
        (
            {"advantages": ADVANTAGES[:4]},
            r"advantages must have shape \(8,\).*got \(4,\)",
        ),
        ({"batch": short}, r"old_log_probs must have the shape of batch\['labels'\]"),
        (
            {"old_log_probs": None},
            r"old_log_probs must be a tensor for 'grpo' reweighting, got None",
        ),
        (
            {"gradient_accumulation_steps": 9},
            r"gradient_accumulation_steps must be between 1 and the batch size 8, got 9",
        ),
        (
            {"gradient_accumulation_steps": 0},
            r"gradient_accumulation_steps must be between 1 and the batch size 8, got 0",
        ),
        (
            {"importance_reweighting_method": "ppo"},
            r"importance_reweighting_method must be one of .*got 'ppo'",
        ),
        ({"cliprange": None}, r"cliprange must be positive for 'grpo', got None"),
        (
            {"loss_normalization": "tokens"},
            r"loss_normalization must be one of \('sequence', 'constant', 'token'\), "
            r"got 'tokens'",
        ),
        (
            {"loss_normalization": "constant"},
            r"normalization_constant must be positive for constant normalization, got None",
        ),
        (
            {"temperature": 0.0},
            r"temperature must be a finite number > 0, got 0.0",
        ),
        (
            {"temperature": float("nan")},
            r"temperature must be a finite number > 0, got nan",
        ),
        (
            {"max_grad_norm": -1.0},
            r"max_grad_norm must be None \(no clipping\) or a finite number > 0, "
            r"got -1.0",
        ),
        ({"max_grad_norm": 0.0}, r"max_grad_norm must be None .*got 0.0"),
        ({"max_grad_norm": float("inf")}, r"max_grad_norm must be None .*got inf"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            update(**overrides)
    for chunk_size in (-1, 1.5):
        with pytest.raises(ValueError, match=rf"logits_chunk_size .*got {chunk_size}"):
            update(logits_chunk_size=chunk_size)
    assert optimizer.steps == 0


def test_grpo_train_step_whitens_over_the_tokens_it_trains_on(
    make_tiny_qwen2, char_tokenizer
):
    # token_whiten (REINFORCE++) needs each response's token count: the step
    # tokenizes first and weighs each response by its response_mask.
    model = make_tiny_qwen2()
    text_optimizer = GradientRecorder(model.parameters(), lr=1.0)
    text_loss, _ = grpo_train_step(
        model, char_tokenizer, text_optimizer, 2, 1.0, exact_match,
        PROMPTS, RESPONSES, TRUTHS, 2, "none", 1e-6, "token_whiten",
    )  # fmt: skip
    batch = tokenize_prompt_and_output(PROMPTS, RESPONSES, char_tokenizer)
    rewards, _ = compute_rollout_rewards(exact_match, RESPONSES, TRUTHS)
    lengths = batch["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 1  # the weights differ from a plain mean
    advantages, _ = compute_group_normalized_rewards(
        rewards, 2, "none", 1e-6, "token_whiten", response_lengths=lengths
    )
    model = make_tiny_qwen2()
    optimizer = GradientRecorder(model.parameters(), lr=1.0)
    loss, _ = policy_gradient_update(model, optimizer, 2, 1.0, batch, advantages)
    assert torch.equal(text_loss, loss)
    assert_gradients_close(optimizer.gradients, text_optimizer.gradients, atol=0)


def test_grpo_train_step_errors(tiny_qwen2, char_tokenizer):
    optimizer = GradientRecorder(tiny_qwen2.parameters(), lr=1.0)

    def step(**overrides):
        arguments = {
            "model": tiny_qwen2,
            "tokenizer": char_tokenizer,
            "optimizer": optimizer,
            "gradient_accumulation_steps": 1,
            "max_grad_norm": 1.0,
            "reward_fn": exact_match,
            "repeated_prompts": ["1+1=", "1+1="],
            "rollout_responses": ["2", "3"],
            "repeated_ground_truths": ["2", "2"],
            "group_size": 2,
        } | overrides
        return grpo_train_step(**arguments)

    cases = [
        (
            {
                "rollout_responses": [],
                "repeated_prompts": [],
                "repeated_ground_truths": [],
            },
            r"rollout_responses must hold at least one response, got 0",
        ),
        ({"repeated_prompts": ["1+1="]}, r"must have the same length, got 1, 2 and 2"),
        (
            {"group_size": 3},
            r"group_size must be positive and divide the batch size 2, got 3",
        ),
        (
            {"group_size": 0},
            r"group_size must be positive and divide the batch size 2, got 0",
        ),
        (
            {"gradient_accumulation_steps": 3},
            r"gradient_accumulation_steps must be between 1 and the batch size 2, got 3",
        ),
        (
            {"importance_reweighting_method": "grpo", "cliprange": 0.2},
            r"old_log_probs must be a tensor for 'grpo' reweighting, got None",
        ),
        (
            {
                "importance_reweighting_method": "gspo",
                "old_log_probs": torch.zeros(2, 5),
                "cliprange": -1.0,
            },
            r"cliprange must be positive for 'gspo', got -1.0",
        ),
        (
            {"loss_normalization": "constant", "normalization_constant": 0},
            r"normalization_constant must be positive for constant normalization, got 0",
        ),
        (
            {"baseline": "median"},
            r"baseline must be one of \('mean', 'none', 'leave_one_out'\), got 'median'",
        ),
        (
            {"advantage_normalizer": "max"},
            r"advantage_normalizer must be one of .*got 'max'",
        ),
        (
            {
                "importance_reweighting_method": "noclip",
                "old_log_probs": torch.zeros(2, 9),
            },
            r"old_log_probs must have the shape of batch\['labels'\] \(2, 4\), got \(2, 9\)",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            step(**overrides)
    assert optimizer.steps == 0


# --- the GRPO family in the update: token mean, KL, entropy bonus, 80/20 --------


def naive_entropy(model, batch, temperature=1.0):
    logits = model(batch["input_ids"]).logits.float() / temperature  # (B, T, V)
    log_softmax = torch.log_softmax(logits, dim=-1)
    return -(log_softmax.exp() * log_softmax).sum(-1)  # (B, T), with gradient


def naive_family_gradients(model, batch, advantages, old, extra):
    """The full batch's loss, written out: objective * entropy mask + kl_coef *
    w * k3 - entropy_coef * H per token, then the token mean or the sequence
    mean. Every row takes part (a KL or entropy term moves zero-advantage rows)."""
    log_probs = naive_log_probs(model, batch)  # (B, T)
    mask = batch["response_mask"].float()  # (B, T)
    ratio = (log_probs - old).exp()  # (B, T)
    advantage = advantages[:, None]  # (B, 1)
    per_token = torch.maximum(-advantage * ratio, -advantage * ratio.clamp(0.8, 1.2))
    entropy = naive_entropy(model, batch)  # (B, T)
    if "top_entropy_quantile" in extra:
        threshold = torch.quantile(
            entropy.detach()[mask.bool()], 1 - extra["top_entropy_quantile"]
        )
        per_token = per_token * (entropy.detach() >= threshold)
    if "reference" in extra:
        log_r = extra["reference"] - log_probs  # (B, T)
        k3 = log_r.exp() - log_r - 1
        if extra.get("kl_importance_weighting"):
            k3 = k3 * ratio
        per_token = per_token + extra["kl_coef"] * k3
    per_token = per_token - extra.get("entropy_coef", 0.0) * entropy
    if extra["normalization"] == "token":
        loss = (per_token * mask).sum() / mask.sum()
    else:
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).mean()
    gradients = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return [
        torch.zeros_like(p) if g is None else g
        for p, g in zip(model.parameters(), gradients)
    ]


def family_update(model, batch, old, steps, chunk=0, **keywords):
    optimizer = GradientRecorder(model.parameters(), lr=1.0)
    loss, metadata = policy_gradient_update(
        model, optimizer, steps, None, batch, ADVANTAGES, "grpo", old, 0.2,
        logits_chunk_size=chunk, **keywords,
    )  # fmt: skip
    return loss, metadata, optimizer


def test_token_normalization_is_the_batch_token_mean_for_uneven_microbatches(
    make_tiny_qwen2, batch
):
    # 3 accumulation steps split 8 rows 3 + 3 + 2, with different token counts;
    # each microbatch's token mean is weighted by its share of the batch's
    # tokens, skipped zero-advantage rows included (they count in N).
    reference = make_tiny_qwen2()
    old = old_log_probs_for(reference, batch)
    expected = naive_family_gradients(
        reference, batch, ADVANTAGES, old, {"normalization": "token"}
    )
    for steps in (1, 3, 4):
        _, metadata, optimizer = family_update(
            make_tiny_qwen2(), batch, old, steps, loss_normalization="token"
        )
        assert_gradients_close(optimizer.gradients, expected)
        assert metadata["active_response_count"] == 5.0  # zero rows still skipped


@pytest.mark.parametrize("weighted", [False, True])
def test_kl_penalty_matches_the_naive_loss_and_moves_zero_advantage_rows(
    make_tiny_qwen2, batch, weighted
):
    reference_model = make_tiny_qwen2()
    old = old_log_probs_for(reference_model, batch)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        current = naive_log_probs(reference_model, batch)
    reference = current - 0.2 * torch.randn(current.shape, generator=generator)
    extra = {
        "normalization": "sequence",
        "reference": reference,
        "kl_coef": 0.1,
        "kl_importance_weighting": weighted,
    }
    expected = naive_family_gradients(reference_model, batch, ADVANTAGES, old, extra)
    for steps in (1, 4):
        _, metadata, optimizer = family_update(
            make_tiny_qwen2(), batch, old, steps,
            reference_log_probs=reference, kl_coef=0.1, kl_estimator="k3",
            kl_importance_weighting=weighted,
        )  # fmt: skip
        assert_gradients_close(optimizer.gradients, expected)
        assert metadata["active_response_count"] == 8.0  # every row has a KL term
    mask = batch["response_mask"].bool()
    log_r = reference - current
    k3 = log_r.exp() - log_r - 1
    torch.testing.assert_close(metadata["kl_mean"], k3[mask].mean())


@pytest.mark.parametrize("chunk", [0, 3])
def test_entropy_bonus_gradient_matches_autograd_of_the_naive_entropy(
    make_tiny_qwen2, batch, chunk
):
    model = make_tiny_qwen2()
    old = old_log_probs_for(model, batch)
    extra = {"normalization": "sequence", "entropy_coef": 0.3}
    expected = naive_family_gradients(model, batch, ADVANTAGES, old, extra)
    _, _, optimizer = family_update(
        make_tiny_qwen2(), batch, old, 2, chunk, entropy_coef=0.3
    )
    assert_gradients_close(optimizer.gradients, expected)
    _, _, without = family_update(make_tiny_qwen2(), batch, old, 2, chunk)
    assert not torch.allclose(without.gradients[0], optimizer.gradients[0], atol=1e-6)


def test_top_entropy_quantile_keeps_the_policy_gradient_of_high_entropy_tokens(
    make_tiny_qwen2, batch
):
    # One microbatch: the quantile is over every response token of the batch,
    # zero-advantage rows included (as TRL takes it over its forward batch).
    model = make_tiny_qwen2()
    old = old_log_probs_for(model, batch)
    extra = {"normalization": "sequence", "top_entropy_quantile": 0.4}
    expected = naive_family_gradients(model, batch, ADVANTAGES, old, extra)
    _, metadata, optimizer = family_update(
        make_tiny_qwen2(), batch, old, 1, top_entropy_quantile=0.4
    )
    assert_gradients_close(optimizer.gradients, expected)
    assert 0.3 < metadata["entropy_mask_mean"].item() < 0.5
    assert metadata["active_response_count"] == 8.0


def test_family_options_reach_the_update_from_grpo_train_step(
    tiny_qwen2, char_tokenizer
):
    optimizer = GradientRecorder(tiny_qwen2.parameters(), lr=1.0)
    old = torch.zeros(2, 4)
    # Both responses score the same: zero advantages, but the KL term still
    # moves the policy, so the step happens.
    _, metadata = grpo_train_step(
        tiny_qwen2, char_tokenizer, optimizer, 1, 1.0, exact_match,
        ["1+1=", "1+1="], ["2", "2"], ["2", "2"], 2,
        importance_reweighting_method="grpo", old_log_probs=old, cliprange=0.2,
        cliprange_high=0.28, reference_log_probs=torch.full((2, 4), -1.0),
        kl_coef=0.5,
    )  # fmt: skip
    assert optimizer.steps == 1 and metadata["kl_mean"] > 0
    assert {"clip_low_fraction", "clip_high_fraction"} <= set(metadata)
    with pytest.raises(ValueError, match=r"unknown update option\(s\) \['clip_high'\]"):
        grpo_train_step(
            tiny_qwen2, char_tokenizer, optimizer, 1, 1.0, exact_match,
            ["1+1="] * 2, ["2", "3"], ["2"] * 2, 2, clip_high=0.3,
        )  # fmt: skip


def test_family_update_errors(tiny_qwen2, batch):
    optimizer = GradientRecorder(tiny_qwen2.parameters(), lr=1.0)
    old = torch.zeros(batch["labels"].shape)

    def update(**overrides):
        return policy_gradient_update(
            tiny_qwen2, optimizer, 2, 1.0, batch, ADVANTAGES, "grpo", old, 0.2,
            **overrides,
        )  # fmt: skip

    cases = [
        ({"kl_coef": 0.1}, r"reference_log_probs must be a tensor when kl_coef > 0 \(0.1\), got None"),
        ({"kl_coef": 0.1, "reference_log_probs": torch.zeros(8, 2)}, r"reference_log_probs must have the shape of batch\['labels'\]"),
        ({"kl_coef": -0.1}, r"kl_coef must be a finite number >= 0"),
        ({"kl_estimator": "k4"}, r"kl_estimator must be one of \('k1', 'k2', 'k3'\), got 'k4'"),
        ({"cliprange_high": -0.1}, r"cliprange_high must be None .*got -0.1"),
        ({"ratio_cap": 1.0}, r"ratio_cap must be None .*above the upper clip bound 1.2"),
        ({"entropy_coef": -1.0}, r"entropy_coef must be a finite number >= 0"),
        ({"top_entropy_quantile": 0.0}, r"top_entropy_quantile must be a number in \(0, 1\]"),
        ({"top_entropy_quantile": 1.5}, r"top_entropy_quantile must be a number in \(0, 1\]"),
        ({"sapo_temperature_pos": 0.0}, r"sapo_temperature_pos must be a finite number > 0"),
    ]  # fmt: skip
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            update(**overrides)
    assert optimizer.steps == 0


@pytest.mark.parametrize(
    "method", ["none", "noclip", "grpo", "gspo", "cispo", "sapo", "gmpo"]
)
@pytest.mark.parametrize("extra", [{}, {"cliprange_high": 0.28}], ids=("plain", "high"))
def test_a_step_with_no_signal_logs_the_keys_of_a_step_with_signal(
    method, extra, make_tiny_qwen2, char_tokenizer
):
    # Group 1 all right (no signal), group 2 split; then both groups all right.
    prompts, truths = ["1+1="] * 4, ["2"] * 4
    keys = []
    for responses in (["2", "3", "2", "2"], ["2", "2", "2", "2"]):
        model = make_tiny_qwen2(seed=0)
        _, metadata = grpo_train_step(
            model, char_tokenizer, GradientRecorder(model.parameters()), 2, 1.0,
            exact_match, prompts, responses, truths, 2,
            importance_reweighting_method=method,
            old_log_probs=None if method == "none" else torch.zeros(4, 4),
            cliprange=None if method in ("none", "noclip", "sapo") else 0.2,
            **({} if method in ("none", "noclip", "sapo") else extra),
        )  # fmt: skip
        keys.append(set(metadata))
    assert keys[0] == keys[1]


def test_the_update_reads_settings_built_once(monkeypatch, tiny_qwen2, batch):
    from grpo_lab import losses as objectives
    from grpo_lab.train_step import UpdateSettings

    settings = UpdateSettings(
        importance_reweighting_method="grpo", cliprange=0.2, cliprange_high=0.28
    )
    calls = []
    checker = objectives.check_objective_settings
    monkeypatch.setattr(
        objectives, "check_objective_settings", lambda *a, **k: calls.append(a)
    )
    old = torch.zeros(batch["labels"].shape)
    optimizer = GradientRecorder(tiny_qwen2.parameters(), lr=1.0)
    policy_gradient_update(
        tiny_qwen2, optimizer, 4, 1.0, batch, ADVANTAGES, old_log_probs=old,
        settings=settings,
    )  # fmt: skip
    assert optimizer.steps == 1 and calls == []  # four microbatches, no re-check
    monkeypatch.setattr(objectives, "check_objective_settings", checker)
    with pytest.raises(ValueError, match=r"not both: got settings and \['kl_coef'\]"):
        policy_gradient_update(
            tiny_qwen2, optimizer, 1, 1.0, batch, ADVANTAGES, old_log_probs=old,
            settings=settings, kl_coef=0.1,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"settings must be an UpdateSettings"):
        policy_gradient_update(
            tiny_qwen2, optimizer, 1, 1.0, batch, ADVANTAGES, settings={"a": 1}
        )


def test_the_microbatches_do_not_recheck_the_per_token_settings(
    count_checks, tiny_qwen2, batch
):
    from grpo_lab.kl import compute_kl_penalty
    from grpo_lab.losses import high_entropy_mask
    from grpo_lab.prefix_sharing import shared_prefix_length
    from grpo_lab.sampler_correction import correction_weights
    from grpo_lab.train_step import UpdateSettings

    settings = UpdateSettings(
        kl_coef=0.1, kl_estimator="k2", top_entropy_quantile=0.5,
        sampler_correction="token_truncate", share_prompt_prefix=True,
    )  # fmt: skip
    counts = count_checks()
    zeros = torch.zeros(batch["labels"].shape)  # (B, T)
    optimizer = GradientRecorder(tiny_qwen2.parameters(), lr=1.0)
    _, metadata = policy_gradient_update(
        tiny_qwen2, optimizer, 4, 1.0, batch, ADVANTAGES, reference_log_probs=zeros,
        sampler_log_probs=zeros, settings=settings,
    )  # fmt: skip
    assert optimizer.steps == 1 and "kl_mean" in metadata  # every setting was used
    assert "entropy_mask_mean" in metadata and "is_ratio_mean" in metadata
    assert counts == dict.fromkeys(counts, 0)  # four microbatches, no re-check
    # Direct callers still pass each door, and a bad setting is still refused.
    mask = batch["response_mask"]
    compute_kl_penalty(zeros, zeros, "k2")
    high_entropy_mask(zeros, mask, 0.5)
    correction_weights(zeros, zeros, mask, mode="token_truncate")
    shared_prefix_length(mask, True)
    assert counts == dict.fromkeys(counts, 1)
    refused = [
        (compute_kl_penalty, (zeros, zeros, "k4"), {}, "kl_estimator"),
        (high_entropy_mask, (zeros, mask, 1.5), {}, "top_entropy_quantile"),
        (correction_weights, (zeros, zeros, mask), {"mode": "x"}, "sampler_correction"),
        (shared_prefix_length, (mask, "yes"), {}, "share_prompt_prefix"),
    ]
    for function, args, kwargs, setting in refused:
        with pytest.raises(ValueError, match=f"{setting} must be"):
            function(*args, **kwargs)


def test_covariance_objectives_score_every_row_of_the_microbatch():
    # Clip-Cov and KL-Cov rank a token against every token of its microbatch,
    # zero-advantage rows included, and KL-Cov's penalty moves those rows too.
    for method, cliprange in (("clip_cov", 0.2), ("kl_cov", None), ("grpo", 0.2)):
        settings = UpdateSettings(
            importance_reweighting_method=method, cliprange=cliprange
        )
        covariance = method != "grpo"
        assert settings.scores_every_row is covariance, method
        assert settings.every_row_has_gradient is covariance, method
