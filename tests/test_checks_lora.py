"""The LoRA-forward check of notebook 13: it accepts two different correct
answers, names each usual slip (the alpha / r scale forgotten, A and B swapped,
...), refuses the package's own function and reports a stub as not attempted;
and the package's adapter forward is what peft's layer computes."""

from __future__ import annotations

import re

import pytest
import torch

from grpo_lab import lora
from grpo_lab.teaching.checks import ExerciseFailed
from grpo_lab.teaching.checks.lora import check_lora_linear


def two_matmuls(x, weight, lora_A, lora_B, alpha, rank):
    return x @ weight.T + (alpha / rank) * ((x @ lora_A.T) @ lora_B.T)


def merged_weight(x, weight, lora_A, lora_B, alpha, rank):
    # W' = W + (alpha / r) B A, then one matmul: the merge, as a forward.
    return torch.einsum("...i,oi->...o", x, weight + alpha / rank * lora_B @ lora_A)


def scale_forgotten(x, weight, lora_A, lora_B, alpha, rank):
    return x @ weight.T + x @ lora_A.T @ lora_B.T


def scale_alpha(x, weight, lora_A, lora_B, alpha, rank):
    return x @ weight.T + alpha * (x @ lora_A.T @ lora_B.T)


def swapped(x, weight, lora_A, lora_B, alpha, rank):
    return x @ weight.T + (alpha / rank) * (x @ lora_B @ lora_A)


def no_base(x, weight, lora_A, lora_B, alpha, rank):
    return (alpha / rank) * (x @ lora_A.T @ lora_B.T)


def detached(x, weight, lora_A, lora_B, alpha, rank):
    return two_matmuls(x, weight, lora_A.detach(), lora_B.detach(), alpha, rank)


def stub(x, weight, lora_A, lora_B, alpha, rank):
    raise NotImplementedError()


@pytest.mark.parametrize("answer", [two_matmuls, merged_weight])
def test_two_different_correct_answers_pass(answer, capsys):
    assert check_lora_linear(answer) is True
    assert "correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("answer", "hint"),
    [
        (scale_forgotten, "the alpha / r scale is missing"),
        (scale_alpha, "the scale is alpha, not alpha / r"),
        (swapped, "A and B are swapped"),
        (no_base, "the frozen base output (x through W) is missing"),
    ],
)
def test_each_usual_slip_is_refused_and_named(answer, hint):
    with pytest.raises(ExerciseFailed, match=re.escape("hint: " + hint)) as failure:
        check_lora_linear(answer)
    assert failure.value.cases_passed < failure.value.cases_run == 3


def test_an_answer_without_gradients_to_the_adapters_is_refused():
    with pytest.raises(ExerciseFailed, match="carries no gradient to lora_B"):
        check_lora_linear(detached)


def test_the_package_function_is_refused_and_a_stub_is_not_attempted(capsys):
    with pytest.raises(ExerciseFailed, match="write it yourself"):
        check_lora_linear(lora.lora_linear)
    assert check_lora_linear(stub) is False
    assert "not attempted yet" in capsys.readouterr().out


def test_lora_linear_is_what_a_peft_layer_computes_bit_for_bit():
    import peft

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5, bias=False))
    settings = lora.LoraSettings(rank=2, alpha=5.0, dropout=0.0, target_modules="0")
    config = peft.LoraConfig(r=2, lora_alpha=5.0, target_modules=["0"])
    assert lora.peft_lora_config(settings).lora_alpha == config.lora_alpha
    adapted = peft.get_peft_model(model, config)
    layer = adapted.base_model.model[0]
    torch.nn.init.normal_(layer.lora_B["default"].weight)  # B = 0 would hide it
    x = torch.randn(3, 4, 6)  # (..., in)
    expected = layer(x)  # (..., out)
    received = lora.lora_linear(
        x,
        layer.base_layer.weight,
        layer.lora_A["default"].weight,
        layer.lora_B["default"].weight,
        alpha=5.0,
        rank=2,
    )
    assert torch.equal(received, expected)
    assert not torch.equal(received, layer.base_layer(x))
