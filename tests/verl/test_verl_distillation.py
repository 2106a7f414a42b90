"""On-policy distillation against verl 0.9.1's own distillation losses, float64.

verl's ``distillation_ppo_loss`` (``verl/trainer/distillation/losses.py``) is
called as its actor calls it: the student's log-probs in verl's unpadded
layout, the teacher's in the batch, the global batch counts beside them. It is
compared, value and gradient, with grpo_lab's own microbatch loss
(:func:`grpo_lab.train_step.microbatch_loss`) under the translated settings:

    verl                                   grpo_lab
    use_policy_gradient=False, loss_mode   distillation="loss", estimator
    use_policy_gradient=True,  loss_mode   distillation="reward", grpo clip
    use_task_rewards, distillation_loss_coef   distillation_task_reward, coef
    loss_agg_mode token-mean / seq-mean-token-mean   token / sequence

verl's clamps (``loss_max_clamp``, ``log_prob_min_clamp``) are off in the
comparison: grpo_lab has none. ``forward_kl_topk`` is compared with verl's
FSDP top-k function on nested tensors, as verl's logits processor calls it
(in float32, as verl computes it).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
import verl
import verl.utils

# verl.utils.dataset's __init__ imports its dataset readers (datasets, PIL),
# which this environment leaves out (requirements/verl.txt); the loss code
# needs only its dataset_utils module, so the package is registered without
# running that __init__.
_spec = importlib.util.find_spec("verl.utils.dataset")
_package = types.ModuleType("verl.utils.dataset")
_package.__path__ = list(_spec.submodule_search_locations)
sys.modules.setdefault("verl.utils.dataset", _package)

from tensordict import TensorDict  # noqa: E402
from verl.trainer.distillation import losses as verl_losses  # noqa: E402
from verl.trainer.distillation.fsdp import losses as verl_fsdp  # noqa: E402
from verl.workers.config import (  # noqa: E402
    DistillationConfig,
    DistillationLossConfig,
    FSDPActorConfig,
)

import grpo_lab.distillation as distillation  # noqa: E402
from grpo_lab.distillation import forward_kl_topk  # noqa: E402
from grpo_lab.train_step import UpdateSettings, microbatch_loss  # noqa: E402

B, P, T = 4, 2, 5  # responses, prompt tokens, response tokens
CLIP_LOW, CLIP_HIGH, CAP = 0.2, 0.28, 3.0
MODES = {"token-mean": "token", "seq-mean-token-mean": "sequence"}


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 2, 4, 1])
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    old = -torch.rand(B, T, generator=generator, dtype=torch.float64) * 2
    log_prob = old + torch.randn(B, T, generator=generator, dtype=torch.float64) * 0.4
    teacher = old + torch.randn(B, T, generator=generator, dtype=torch.float64)
    advantages = torch.randn(B, generator=generator, dtype=torch.float64)
    return {
        "lengths": lengths,
        "mask": mask,
        "old": old,
        "log_prob": log_prob,
        "teacher": teacher,
        "advantages": advantages,
    }


def unpadded(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B, T, ...) response values in verl's unpadded layout (total tokens, ...):
    each sequence is P prompt tokens then its response, and a model's output at
    position i scores token i + 1 (verl's no_padding_2_padding shifts by one)."""
    pieces = []
    for row, length in enumerate(lengths.tolist()):
        tail = values.shape[2:]
        pieces += [
            torch.zeros((P - 1, *tail), dtype=values.dtype),
            values[row, :length],
            torch.zeros((1, *tail), dtype=values.dtype),
        ]
    return torch.cat(pieces)


def verl_loss(data, mode, **loss_settings):
    """verl's distillation_ppo_loss and its gradient in the student log-probs."""
    loss_config = DistillationLossConfig(
        **{
            "loss_max_clamp": None,
            "log_prob_min_clamp": None,
            "clip_ratio": CLIP_LOW,
            "clip_ratio_low": CLIP_LOW,
            "clip_ratio_high": CLIP_HIGH,
            **loss_settings,
        }
    )
    config = FSDPActorConfig(
        strategy="fsdp",
        rollout_n=2,
        ppo_micro_batch_size_per_gpu=B,
        clip_ratio=CLIP_LOW,
        clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH,
        clip_ratio_c=CAP,
        loss_agg_mode=mode,
    )
    log_prob = data["log_prob"].clone().requires_grad_(True)
    mask = data["mask"]
    attention = torch.cat([torch.ones(B, P, dtype=torch.long), mask.long()], dim=1)
    tensors = TensorDict(
        {
            "prompts": torch.ones(B, P, dtype=torch.long),
            "responses": torch.ones(B, T, dtype=torch.long),
            "attention_mask": attention,
            "response_mask": mask,
            "old_log_probs": data["old"],
            "advantages": data["advantages"][:, None] * mask,  # (B, T), as verl's
            "teacher_logprobs": unpadded(data["teacher"][..., None], data["lengths"]),
            "dp_size": 1,
            "batch_num_tokens": int(mask.sum()),
            "global_batch_size": B,
        },
        batch_size=[],
    )
    model_output = {"log_probs": unpadded(log_prob, data["lengths"])}
    loss, metrics = verl_losses.distillation_ppo_loss(
        config,
        DistillationConfig(distillation_loss=loss_config),
        model_output=model_output,
        data=tensors,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, metrics


def grpo_lab_loss(data, mode, **settings):
    """grpo_lab's microbatch loss (the update's own composition) and gradient."""
    update = UpdateSettings(
        importance_reweighting_method="grpo",
        cliprange=CLIP_LOW,
        cliprange_high=CLIP_HIGH,
        ratio_cap=CAP,
        loss_normalization=MODES[mode],
        **settings,
    )
    log_prob = data["log_prob"].clone().requires_grad_(True)
    microbatch = {
        "response_mask": data["mask"],
        "advantages": data["advantages"],
        "old_log_probs": data["old"],
        "teacher_log_probs": data["teacher"],
    }
    loss, diagnostics = microbatch_loss(
        log_prob, torch.zeros_like(log_prob), microbatch, update
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss.detach(), grad, diagnostics


def assert_same(ours, theirs):
    (value, grad), (their_value, their_grad) = ours[:2], theirs[:2]
    assert torch.allclose(value, their_value, rtol=1e-10, atol=1e-12)
    assert torch.allclose(grad, their_grad, rtol=1e-10, atol=1e-12)


CASES = [
    # (grpo_lab settings, verl settings)
    (
        {"distillation": "loss", "distillation_estimator": "k2"},
        {"loss_mode": "k2", "use_policy_gradient": False, "use_task_rewards": False},
    ),
    (
        {"distillation": "loss", "distillation_estimator": "k3"},
        {"loss_mode": "k3", "use_policy_gradient": False, "use_task_rewards": False},
    ),
    (
        {"distillation": "reward", "distillation_estimator": "k1"},
        {"loss_mode": "k1", "use_policy_gradient": True, "use_task_rewards": False},
    ),
    (
        {"distillation": "reward", "distillation_estimator": "k2"},
        {"loss_mode": "k2", "use_policy_gradient": True, "use_task_rewards": False},
    ),
    (
        {"distillation": "reward", "distillation_estimator": "k3"},
        {"loss_mode": "k3", "use_policy_gradient": True, "use_task_rewards": False},
    ),
    (  # GRPO + OPD: the task objective and 0.3 x the distillation reward
        {
            "distillation": "reward",
            "distillation_estimator": "k1",
            "distillation_task_reward": True,
            "distillation_coef": 0.3,
        },
        {
            "loss_mode": "k1",
            "use_policy_gradient": True,
            "use_task_rewards": True,
            "distillation_loss_coef": 0.3,
        },
    ),
    (  # GRPO + OPD with the KL as a direct loss
        {
            "distillation": "loss",
            "distillation_estimator": "k3",
            "distillation_task_reward": True,
            "distillation_coef": 2.0,
        },
        {
            "loss_mode": "k3",
            "use_policy_gradient": False,
            "use_task_rewards": True,
            "distillation_loss_coef": 2.0,
        },
    ),
]


@pytest.mark.parametrize("mode", tuple(MODES))
@pytest.mark.parametrize(("ours", "theirs"), CASES)
def test_distillation_matches_verl(ours, theirs, mode):
    data = batch()
    assert_same(grpo_lab_loss(data, mode, **ours), verl_loss(data, mode, **theirs))


def test_both_refuse_k1_as_a_direct_loss():
    with pytest.raises(ValueError, match="k1"):
        DistillationLossConfig(loss_mode="k1", use_policy_gradient=False)
    with pytest.raises(ValueError, match="distillation_estimator 'k1' cannot be"):
        UpdateSettings(distillation="loss", distillation_estimator="k1")


def test_verl_clamps_where_grpo_lab_does_not():
    """verl's default loss_max_clamp (10) changes a token whose k2 is above 10."""
    data = batch()
    data["teacher"][0, 0] = data["log_prob"][0, 0] - 5.0  # k2 = 12.5
    ours = grpo_lab_loss(
        data, "token-mean", distillation="loss", distillation_estimator="k2"
    )
    unclamped = verl_loss(
        data, "token-mean", loss_mode="k2", use_policy_gradient=False,
        use_task_rewards=False,
    )  # fmt: skip
    assert_same(ours, unclamped)
    clamped = verl_loss(
        data, "token-mean", loss_mode="k2", use_policy_gradient=False,
        use_task_rewards=False, loss_max_clamp=10.0,
    )  # fmt: skip
    with pytest.raises(AssertionError):
        assert_same(ours, clamped)


def verl_forward_kl_topk(student_logits, teacher_top_log_probs, teacher_top_ids):
    """verl's FSDP forward_kl_topk, on nested tensors as its logits processor
    hands them (one sequence), clamps off."""
    config = DistillationConfig(
        distillation_loss=DistillationLossConfig(
            loss_mode="forward_kl_topk",
            topk=teacher_top_ids.shape[-1],
            use_policy_gradient=False,
            log_prob_min_clamp=None,
            loss_max_clamp=None,
        )
    )
    nested = torch.nested.nested_tensor_from_jagged
    outputs = verl_fsdp.compute_forward_kl_topk(
        student_logits=student_logits[None],
        teacher_topk_log_probs=nested(
            teacher_top_log_probs, offsets=torch.tensor([0, len(student_logits)])
        ),
        teacher_topk_ids=nested(
            teacher_top_ids, offsets=torch.tensor([0, len(student_logits)])
        ),
        config=config,
        data_format="thd",
    )
    return outputs["distillation_losses"][0].clamp_min(0.0)  # verl's registry clamps


@pytest.mark.parametrize("top_k", [1, 3, 9])
def test_forward_kl_topk_matches_verl(top_k):
    generator = torch.Generator().manual_seed(top_k)
    positions, vocabulary = 6, 9
    student = torch.randn(
        positions, vocabulary, generator=generator, dtype=torch.float64
    )
    teacher = torch.randn(
        positions, vocabulary, generator=generator, dtype=torch.float64
    )
    top = torch.log_softmax(teacher, -1).topk(top_k, dim=-1)
    logits = student.clone().requires_grad_(True)
    theirs = verl_forward_kl_topk(logits, top.values, top.indices)
    (their_grad,) = torch.autograd.grad(theirs.sum(), logits)
    logits = student.clone().requires_grad_(True)
    ours = forward_kl_topk(
        torch.log_softmax(logits, -1).gather(-1, top.indices), top.values
    )
    (grad,) = torch.autograd.grad(ours.sum(), logits)
    # verl's kl_divergence computes in float32 (log_p.float()): float32's tolerance.
    assert torch.allclose(ours.detach(), theirs.detach().double(), rtol=1e-6, atol=1e-7)
    assert torch.allclose(grad, their_grad, rtol=1e-6, atol=1e-7)


# --- mutants: each breaks the comparison with verl ----------------------------


MUTANTS = {
    "wrong sign": lambda original: lambda s, t, e: -original(s, t, e),
    "wrong estimator": lambda original: lambda s, t, e: original(s, t, "k3"),
    "forward/reverse swap": lambda original: lambda s, t, e: original(t, s, e),
}


@pytest.mark.parametrize("mutant", tuple(MUTANTS))
def test_mutants_are_caught(monkeypatch, mutant):
    """A wrong sign, a wrong estimator and a forward/reverse swap of d_t each
    move grpo_lab's loss away from verl's (k1 as a reward, token-mean)."""
    data = batch(seed=3)
    ours, theirs = CASES[2]
    expected = verl_loss(data, "token-mean", **theirs)
    assert_same(grpo_lab_loss(data, "token-mean", **ours), expected)
    original = distillation.reverse_kl_per_token
    monkeypatch.setattr(distillation, "reverse_kl_per_token", MUTANTS[mutant](original))
    with pytest.raises(AssertionError):
        assert_same(grpo_lab_loss(data, "token-mean", **ours), expected)


# --- the export: an OPD run as verl's distillation settings ---------------------------


def opd_config(**changes):
    from grpo_lab.training.config import TrainConfig

    values = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "teacher": "Qwen/Qwen2.5-1.5B-Instruct",
        "distillation": "reward",
        "distillation_estimator": "k1",
        "task": "reverse",
        "task_options": {"n_digits": 5},
        "steps": 3,
        "eval_size": 8,
        "sft_max_steps": 0,
        "train_batch_size": 128,
        "gradient_accumulation_steps": 16,
        "ratio_cap": 3.0,  # the gpu profile is off-policy: verl's fixed dual clip
        **changes,
    }
    return TrainConfig.for_profile("gpu", **values)


def exported_distillation(tmp_path, config):
    """The folder's overrides composed by verl's Hydra config, and its
    distillation section built (and so checked) by verl's own dataclasses."""
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from grpo_lab.integrations.verl.launch import write_launch_folder

    write_launch_folder(config, tmp_path)
    lines = (tmp_path / "overrides.txt").read_text().splitlines()
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        composed = compose(config_name="ppo_trainer", overrides=lines)
    validate_config(composed, use_reference_policy=False, use_critic=False)
    return omega_conf_to_dataclass(composed.distillation)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {},
            {"loss_mode": "k1", "use_policy_gradient": True, "use_task_rewards": False},
        ),
        (
            {"distillation": "loss", "distillation_estimator": "k3"},
            {"loss_mode": "k3", "use_policy_gradient": False},
        ),
        (
            {"distillation_task_reward": True, "distillation_coef": 0.3},
            {"use_task_rewards": True, "distillation_loss_coef": 0.3},
        ),
    ],
)
def test_an_opd_run_exports_verls_distillation_settings(tmp_path, changes, expected):
    distilled = exported_distillation(tmp_path, opd_config(**changes))
    assert distilled.enabled
    loss = distilled.distillation_loss
    for name, value in expected.items():
        assert getattr(loss, name) == value, name
    assert loss.loss_max_clamp is None and loss.log_prob_min_clamp is None
    (teacher,) = distilled.teacher_models.values()
    assert teacher.model_path == "Qwen/Qwen2.5-1.5B-Instruct"
    assert teacher.num_replicas == 1  # one GPU of its own, tensor parallel 1


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"distillation_coef": 0.5}, "distillation_coef must be 1.0"),
        (
            {"ratio_cap": None},
            "ratio_cap must be 3.0",
        ),
    ],
)
def test_what_verl_cannot_express_is_refused_by_name(tmp_path, changes, named):
    from grpo_lab.integrations.verl.launch import write_launch_folder

    with pytest.raises(ValueError, match=named):
        write_launch_folder(opd_config(**changes), tmp_path)


def test_a_local_teacher_is_copied_into_the_folder(tmp_path):
    """A run folder's final_model goes to teacher/, named relative to the
    folder in overrides.txt and made absolute by run.sh."""
    from grpo_lab.integrations.verl.launch import write_launch_folder
    from grpo_lab.models import build_char_tokenizer, build_tiny_qwen2

    tokenizer = build_char_tokenizer()
    for folder in (tmp_path / "student", tmp_path / "run" / "final_model"):
        model = build_tiny_qwen2(tokenizer, hidden_size=16, num_layers=1, seed=0)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    config = opd_config(model=str(tmp_path / "student"), teacher=str(tmp_path / "run"))
    out = tmp_path / "launch"
    write_launch_folder(config, out)
    assert (out / "teacher" / "config.json").exists()
    lines = (out / "overrides.txt").read_text().splitlines()
    assert "distillation.teacher_models.teacher_model.model_path=teacher" in lines
    script = (out / "run.sh").read_text()
    assert '"distillation.teacher_models.teacher_model.model_path=$HERE/teacher"' in (
        script
    )
    assert str(tmp_path) not in (out / "overrides.txt").read_text()
