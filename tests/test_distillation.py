"""On-policy distillation (grpo_lab.distillation) against TRL's DistillationTrainer loss.

TRL 1.16's loss (``trl/trainer/distillation_trainer.py``, ``_chunked_divergence_loss``)
is a divergence of the full next-token distributions: beta = 1 the reverse KL
KL(pi || pi_T), beta = 0 the forward KL(pi_T || pi). grpo_lab's settings score
the one sampled token y ~ pi. The two coincide in expectation over that token:
summing each setting's per-token loss over every vocabulary entry y, weighted
by pi(y) (detached), gives a number whose value and gradient can be compared
with TRL's, exactly. TRL's kernel projects in float32, so the tolerance is
float32's; grpo_lab's side runs in float64.

Where they coincide (see the module docstring of grpo_lab.distillation):
E[k1] = E[k3] = TRL beta 1 (values); grad E[k2 loss] = grad E[k1 reward] =
TRL beta 1; grad E[k3 loss] = TRL beta 0; forward_kl_topk over the whole
vocabulary = TRL beta 0 (value and gradient, no sampling). TRL's beta 0.5 (a
generalized JSD) has no grpo_lab setting.
"""

from __future__ import annotations

import math

import pytest
import torch

import grpo_lab.distillation as distillation
from grpo_lab.distillation import (
    check_distillation_settings,
    distillation_token_loss,
    forward_kl_topk,
)
from grpo_lab.losses import ObjectiveOptions

trl_trainer = pytest.importorskip("trl.trainer.distillation_trainer")

B, K, V = 2, 3, 7  # rows, completion positions, vocabulary
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # TRL projects in float32


def logits_and_mask(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(B, K, V, generator=generator, dtype=torch.float64) * 1.5
    teacher = torch.randn(B, K, V, generator=generator, dtype=torch.float64) * 1.5
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # (B, K): the last position padded
    return student, teacher, mask


def trl_divergence(student, teacher, mask, beta):
    """TRL's DistillationTrainer loss and its gradient in the student logits: the
    hidden states are the logits themselves and each head is the identity."""
    identity = torch.eye(V, dtype=torch.float64)
    hidden = student.clone().requires_grad_(True)
    loss, _, _ = trl_trainer._chunked_divergence_loss(
        hidden, teacher, identity, identity, mask, beta
    )
    (grad,) = torch.autograd.grad(loss, hidden)
    return loss.detach().double(), grad.double()


def expected_setting(student, teacher, mask, distillation_form, estimator):
    """E_{y ~ pi}[per-token loss] and E_{y ~ pi}[d_y], token-mean over the mask,
    and the gradient of the first in the student logits."""
    logits = student.clone().requires_grad_(True)
    log_pi = torch.log_softmax(logits, dim=-1).reshape(B * K, V)  # every y a token
    log_teacher = torch.log_softmax(teacher, dim=-1).reshape(B * K, V)
    every_token = torch.ones(B * K, V, dtype=torch.bool)
    per_token, _ = distillation_token_loss(
        log_pi, log_teacher, every_token, ObjectiveOptions(),
        distillation=distillation_form, estimator=estimator,
    )  # fmt: skip
    weights = log_pi.detach().exp()  # pi(y), the sampling distribution
    positions = mask.reshape(-1).double()
    loss = ((weights * per_token).sum(-1) * positions).sum() / positions.sum()
    divergence = distillation.reverse_kl_per_token(log_pi, log_teacher, estimator)
    value = ((weights * divergence).sum(-1) * positions).sum() / positions.sum()
    (grad,) = torch.autograd.grad(loss, logits)
    return value.detach(), grad


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_sampled_reverse_kl_averages_to_trls_reverse_kl(estimator):
    student, teacher, mask = logits_and_mask()
    theirs, _ = trl_divergence(student, teacher, mask, beta=1.0)
    form = "reward" if estimator == "k1" else "loss"
    value, _ = expected_setting(student, teacher, mask, form, estimator)
    assert torch.allclose(value, theirs, **TOLERANCE)


@pytest.mark.parametrize(
    ("form", "estimator", "beta"),
    [("loss", "k2", 1.0), ("reward", "k1", 1.0)],
)
def test_reverse_kl_gradients_match_trl_beta_one(form, estimator, beta):
    """k2 as a loss and k1 as a reward follow grad KL(pi || pi_T)."""
    student, teacher, mask = logits_and_mask(seed=1)
    _, their_grad = trl_divergence(student, teacher, mask, beta)
    _, grad = expected_setting(student, teacher, mask, form, estimator)
    assert torch.allclose(grad, their_grad, **TOLERANCE)


def test_k3_as_a_reward_is_not_the_reverse_kl_gradient():
    """E[k3 grad log pi] - E[k1 grad log pi] = sum_y pi_T(y) grad log pi(y) != 0:
    k3's value is unbiased, its score-function gradient is not."""
    student, teacher, mask = logits_and_mask(seed=1)
    _, their_grad = trl_divergence(student, teacher, mask, beta=1.0)
    _, grad = expected_setting(student, teacher, mask, "reward", "k3")
    assert not torch.allclose(grad, their_grad, **TOLERANCE)


def test_k3_as_a_loss_follows_trls_forward_kl_beta_zero():
    student, teacher, mask = logits_and_mask(seed=2)
    _, their_grad = trl_divergence(student, teacher, mask, beta=0.0)
    _, grad = expected_setting(student, teacher, mask, "loss", "k3")
    assert torch.allclose(grad, their_grad, **TOLERANCE)
    _, reverse_grad = trl_divergence(student, teacher, mask, beta=1.0)
    assert not torch.allclose(grad, reverse_grad, **TOLERANCE)


def test_forward_kl_on_the_whole_vocabulary_is_trls_beta_zero():
    student, teacher, mask = logits_and_mask(seed=3)
    theirs, their_grad = trl_divergence(student, teacher, mask, beta=0.0)
    logits = student.clone().requires_grad_(True)
    log_teacher = torch.log_softmax(teacher, dim=-1)
    top = log_teacher.topk(V, dim=-1)  # k = V: every token
    student_top = torch.log_softmax(logits, dim=-1).gather(-1, top.indices)
    per_position = forward_kl_topk(student_top, top.values)  # (B, K)
    ours = (per_position * mask).sum() / mask.sum()
    (grad,) = torch.autograd.grad(ours, logits)
    assert torch.allclose(ours.detach(), theirs, **TOLERANCE)
    assert torch.allclose(grad, their_grad, **TOLERANCE)


def test_trls_jsd_at_one_half_is_none_of_the_settings():
    """beta 0.5 lies strictly between the two KLs here; no setting gives it."""
    student, teacher, mask = logits_and_mask(seed=4)
    jsd, _ = trl_divergence(student, teacher, mask, beta=0.5)
    forward, _ = trl_divergence(student, teacher, mask, beta=0.0)
    reverse, _ = trl_divergence(student, teacher, mask, beta=1.0)
    assert 0 < jsd < min(forward, reverse)
    for estimator in ("k1", "k2", "k3"):
        value, _ = expected_setting(student, teacher, mask, "reward", estimator)
        assert not torch.allclose(value, jsd, **TOLERANCE)


# --- mutants: each breaks the comparison it should ---------------------------


def test_mutant_wrong_sign_is_caught(monkeypatch):
    """d_t with its sign flipped (a reward of +KL) climbs away from the teacher."""
    student, teacher, mask = logits_and_mask(seed=1)
    _, their_grad = trl_divergence(student, teacher, mask, beta=1.0)
    original = distillation.reverse_kl_per_token
    monkeypatch.setattr(
        distillation,
        "reverse_kl_per_token",
        lambda s, t, e: -original(s, t, e),
    )
    _, grad = expected_setting(student, teacher, mask, "reward", "k1")
    assert not torch.allclose(grad, their_grad, **TOLERANCE)
    assert torch.allclose(grad, -their_grad, **TOLERANCE)


def test_mutant_wrong_estimator_is_caught(monkeypatch):
    """k3 computed where k2 was asked for: the loss then follows the forward KL."""
    student, teacher, mask = logits_and_mask(seed=1)
    _, their_grad = trl_divergence(student, teacher, mask, beta=1.0)
    original = distillation.reverse_kl_per_token
    monkeypatch.setattr(
        distillation, "reverse_kl_per_token", lambda s, t, e: original(s, t, "k3")
    )
    _, grad = expected_setting(student, teacher, mask, "loss", "k2")
    assert not torch.allclose(grad, their_grad, **TOLERANCE)


def test_mutant_forward_reverse_swap_is_caught(monkeypatch):
    """Student and teacher swapped in d_t: the value is KL(pi_T || pi) by k1."""
    student, teacher, mask = logits_and_mask(seed=5)
    theirs, their_grad = trl_divergence(student, teacher, mask, beta=1.0)
    original = distillation.reverse_kl_per_token
    monkeypatch.setattr(
        distillation, "reverse_kl_per_token", lambda s, t, e: original(t, s, e)
    )
    value, grad = expected_setting(student, teacher, mask, "reward", "k1")
    assert not torch.allclose(value, theirs, **TOLERANCE)
    assert not torch.allclose(grad, their_grad, **TOLERANCE)


# --- settings -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (("distil", "k3", 1.0, False), "distillation must be one of"),
        (("loss", "k4", 1.0, False), "distillation_estimator must be one of"),
        (("loss", "k3", 0.0, False), "distillation_coef must be a finite number > 0"),
        (("loss", "k3", float("nan"), False), "distillation_coef"),
        (("loss", "k3", 1.0, 1), "distillation_task_reward must be True or False"),
        (("loss", "k1", 1.0, False), "distillation_estimator 'k1' cannot be"),
        (("reward", "k1", 1.0, False, "gspo"), "importance_reweighting_method 'gspo'"),
    ],
)
def test_bad_settings_are_refused_by_name(arguments, named):
    with pytest.raises(ValueError, match=named):
        check_distillation_settings(*arguments)


def test_k1_is_a_reward_not_a_loss_because_its_gradient_ignores_the_teacher():
    """grad k1 = grad log pi: the same for two different teachers."""
    student, teacher, _ = logits_and_mask()
    grads = []
    for other in (teacher, -teacher):
        log_pi = torch.log_softmax(student, -1).requires_grad_(True)
        loss = distillation.reverse_kl_per_token(
            log_pi, torch.log_softmax(other, -1), "k1"
        ).sum()
        grads.append(torch.autograd.grad(loss, log_pi)[0])
    assert torch.equal(grads[0], grads[1])


def test_reward_form_with_grpo_clips_the_token_advantage():
    """Off-policy, a token whose ratio left [1 - eps, 1 + eps] on the side its
    advantage pushes loses its gradient; hand-checked on one row of two tokens.

    log pi = log pi_old + (0.5, 0), teacher = student - (1, -1) at those tokens:
    k1 = (1, -1), advantages (-1, 1). Token 0: ratio e^0.5 = 1.65 > 1.2 but its
    advantage is negative, so min() keeps the unclipped -A w: gradient w = 1.65.
    Token 1: ratio 1, gradient -A w = -1.
    """
    old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    log_pi = (old + torch.tensor([[0.5, 0.0]], dtype=torch.float64)).requires_grad_()
    teacher = log_pi.detach() - torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    options = ObjectiveOptions(importance_reweighting_method="grpo", cliprange=0.2)
    per_token, diagnostics = distillation_token_loss(
        log_pi, teacher, torch.ones(1, 2, dtype=torch.bool), options,
        distillation="reward", estimator="k1", old_log_probs=old,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(per_token.sum(), log_pi)
    expected = torch.tensor([[math.exp(0.5), -1.0]], dtype=torch.float64)
    assert torch.allclose(grad, expected)
    assert diagnostics["distillation_kl_mean"] == pytest.approx(0.0)
