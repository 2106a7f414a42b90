"""LoRA adapters on the policy, through ``peft``: train a low-rank update only.

Each targeted linear layer ``y = W x`` becomes

    y = W x + (alpha / r) * B (A dropout(x))

with A (r, in) drawn at random and B (out, r) zero, so at initialisation the
adapted model computes exactly what the base model does (an added 0.0), and
only A and B are trained: r * (in + out) numbers per layer instead of
in * out (Hu et al., arXiv:2106.09685). The base weights stay frozen, so a KL
penalty's reference is the same model with the adapters switched off: no
second copy of the weights (as TRL does).

The loop hands the core the transformers model itself, with peft's LoRA
layers injected in place (``PeftModel.base_model.model``): the chunked head,
prefix sharing and ``generate`` see an ordinary causal LM. The ``PeftModel``
wrapper is kept beside it for what only it does: ``save_pretrained`` of the
adapter and switching the adapters off.

``lora_train_norms`` also trains a copy of each RMSNorm gain (peft's
``modules_to_save``): 2 L + 1 vectors of the hidden size. The originals stay
frozen, so the reference (adapters off) is still the base model. A tiny model
needs them: its frozen gains and small tied head cap what low-rank updates can
reach.

``lora_rank = 0`` (the default) is full fine-tuning, untouched. Taught in
``notebooks/13_lora_for_rl.ipynb``; :func:`lora_linear` is the adapter forward
written out, the oracle of peft's layer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# peft's name for "every nn.Linear except the output head".
ALL_LINEAR = "all-linear"
# peft's modules_to_save names (suffixes) of a Qwen2 / Llama decoder's RMSNorm
# modules: two per layer and the final one.
NORM_MODULES = ("input_layernorm", "post_attention_layernorm", "model.norm")
# Bytes per adapter parameter while training with AdamW in float32: the weight,
# its gradient and two moments.
ADAPTER_TRAINING_BYTES = 16
# The settings that shape or train adapters: each needs lora_rank > 0.
ADAPTER_OPTIONS = (
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_lr",
    "lora_train_norms",
)
# The linear layers of one Qwen2 (and Llama) decoder layer, under their parents.
QWEN2_LINEAR_NAMES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@dataclass(frozen=True)
class LoraSettings:
    """One run's adapter shape: rank r, alpha (scale alpha / r), dropout, targets."""

    # Rank r of each update B A (0: no adapters, full fine-tuning).
    rank: int
    # The update is scaled by alpha / rank.
    alpha: float
    # Dropout on the adapter's input (0: none, exact and deterministic).
    dropout: float
    # Module names (suffixes) to adapt, or "all-linear".
    target_modules: str | tuple[str, ...]
    # Also train a copy of every RMSNorm gain (NORM_MODULES), the base's frozen.
    train_norms: bool = False

    @property
    def scale(self) -> float:
        """alpha / r, the factor on B A x."""
        return self.alpha / self.rank


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    alpha: float,
    rank: int,
) -> torch.Tensor:
    """The adapted linear layer without dropout: x W^T + (alpha / r) x A^T B^T.

    x (..., in), weight W (out, in), lora_A (r, in), lora_B (out, r) ->
    (..., out). The same operations in the same order as peft's LoRA
    ``Linear.forward`` (base output, then B(A(x)) times the scale), so the two
    agree bit for bit. It never forms the (out, in) update B A: two thin
    matmuls cost r (in + out) multiply-adds per row instead of in * out.
    """
    base = torch.nn.functional.linear(x, weight)  # (..., out)
    down = torch.nn.functional.linear(x, lora_A)  # (..., r)
    return base + torch.nn.functional.linear(down, lora_B) * (alpha / rank)


def check_lora_settings(
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: str | list[str] | tuple[str, ...],
    *,
    train_norms: bool = False,
) -> None:
    """Refuse a LoRA shape that cannot train, naming the setting.

    rank: an int >= 0 (0: full fine-tuning); alpha: a finite number > 0;
    dropout: in [0, 1); target_modules: "all-linear" or a non-empty list of
    module names; train_norms: True or False.
    """
    if not isinstance(train_norms, bool):
        raise ValueError(f"lora_train_norms must be True or False, got {train_norms!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(
            f"lora_rank must be an int >= 0 (0: full fine-tuning), got {rank!r}"
        )
    if not _finite_number(alpha) or alpha <= 0:
        raise ValueError(f"lora_alpha must be a finite number > 0, got {alpha!r}")
    if not _finite_number(dropout) or not 0 <= dropout < 1:
        raise ValueError(f"lora_dropout must be a number in [0, 1), got {dropout!r}")
    target_names(target_modules)


def check_adapter_options_need_rank(rank: int, given: dict[str, object]) -> None:
    """Refuse an adapter setting (``ADAPTER_OPTIONS``) given without adapters.

    ``given``: the adapter settings a caller set, name -> value. With
    ``rank`` 0 (full fine-tuning) none of them has any effect, so the first
    is refused, naming it and its value.
    """
    if rank != 0 or isinstance(rank, bool) or not given:
        return
    name, value = next(iter(given.items()))
    raise ValueError(
        f"{name} needs lora_rank > 0 (adapters): lora_rank 0 is full fine-tuning, "
        f"where {name} has no effect; set lora_rank, or leave {name} out; "
        f"got {name} {value!r} with lora_rank 0"
    )


def check_adapter_fit(
    rank: int,
    target_modules: str | tuple[str, ...],
    linear_layers: dict[str, tuple[int, int]],
) -> None:
    """Every target names a linear layer, and the rank fits the smallest one.

    ``linear_layers``: the (in, out) of each linear layer but the output
    head, by qualified name. A target matches a layer whose name is it or ends
    in "." + it (peft's rule). The update B A of a layer has rank at most
    min(in, out), so a larger ``rank`` adds parameters and no capacity.
    """
    if target_modules == ALL_LINEAR:
        chosen = dict(linear_layers)
    else:
        chosen = {}
        for target in target_modules:
            matched = {
                name: shape
                for name, shape in linear_layers.items()
                if name == target or name.endswith("." + target)
            }
            if not matched:
                known = sorted({name.rsplit(".", 1)[-1] for name in linear_layers})
                raise ValueError(
                    f"lora_target_modules must name linear layers of the model "
                    f"({', '.join(known)}), got {target!r}, which matches none"
                )
            chosen.update(matched)
    if not chosen:
        raise ValueError(
            f"lora_target_modules must match a linear layer, got {target_modules!r}"
        )
    largest = min(min(shape) for shape in chosen.values())
    if rank > largest:
        raise ValueError(
            f"lora_rank must be at most {largest}, the smallest min(in, out) of the "
            "adapted layers (an update B A has no higher rank), "
            f"got {rank!r}"
        )


def qwen2_linear_layers(
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
) -> dict[str, tuple[int, int]]:
    """(in, out) of every linear layer of a Qwen2 decoder by qualified name."""
    shapes = qwen2_linear_shapes(
        hidden_size, intermediate_size, 1, num_heads, num_kv_heads
    )
    return {
        f"model.layers.{layer}.{name}": shape
        for layer in range(num_layers)
        for name, shape in zip(QWEN2_LINEAR_NAMES, shapes, strict=True)
    }


def model_linear_layers(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """(in, out) of every linear layer of ``model`` but its output head: each
    ``nn.Linear``, and each transformers ``Conv1D`` (GPT-2's linear layer,
    weight (in, out)), the layers peft can adapt."""
    head = (
        model.get_output_embeddings()
        if hasattr(model, "get_output_embeddings")
        else None
    )
    layers = {}
    for name, module in model.named_modules():
        if module is head:
            continue
        if isinstance(module, torch.nn.Linear):
            layers[name] = (module.in_features, module.out_features)
        elif type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
            layers[name] = tuple(module.weight.shape)  # (in, out)
    return layers


def target_names(
    target_modules: str | list[str] | tuple[str, ...],
) -> str | tuple[str, ...]:
    """ "all-linear", or the module names of a list or a comma-separated string."""
    if target_modules == ALL_LINEAR:
        return ALL_LINEAR
    names: list = []
    if isinstance(target_modules, str):
        names = [name.strip() for name in target_modules.split(",")]
    elif isinstance(target_modules, (list, tuple)):
        names = list(target_modules)
    if not names or not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise ValueError(
            f"lora_target_modules must be {ALL_LINEAR!r} or a non-empty list of "
            "module names such as ['q_proj', 'v_proj'] (or 'q_proj,v_proj'), "
            f"got {target_modules!r}"
        )
    return tuple(names)


def _finite_number(value: object) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value)


def peft_lora_config(settings: LoraSettings):
    """The ``peft.LoraConfig`` of ``settings`` (the one TRL's peft_config gets)."""
    import peft

    targets = settings.target_modules
    return peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets if isinstance(targets, str) else list(targets),
        modules_to_save=list(NORM_MODULES) if settings.train_norms else None,
        task_type="CAUSAL_LM",
    )


def add_adapters(
    model: torch.nn.Module, settings: LoraSettings, seed: int
) -> torch.nn.Module:
    """Inject LoRA layers into ``model`` in place; return the ``PeftModel``.

    A is drawn from a generator seeded by ``seed`` (the global RNG is left as it
    was, so the rest of the run draws what a full fine-tuning run draws), B is
    zero. Every base weight is frozen; only A and B require grad, and with
    ``train_norms`` the copies of the RMSNorm gains (equal to the base's).
    """
    import peft

    check_adapter_fit(
        settings.rank, settings.target_modules, model_linear_layers(model)
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        adapted = peft.get_peft_model(model, peft_lora_config(settings))
    if settings.train_norms and not dict(_norm_copies(adapted)):
        raise ValueError(
            f"lora_train_norms found none of the modules {NORM_MODULES} in "
            f"{type(model).__name__}; set lora_train_norms false for this model"
        )
    if getattr(model, "is_gradient_checkpointing", False):
        model.enable_input_require_grads()  # frozen embeddings: keep a grad path
    return adapted


def inner_model(adapted: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a ``PeftModel`` (LoRA layers in place)."""
    return adapted.base_model.model


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that require grad: the adapters, or every weight without."""
    return [p for p in model.parameters() if p.requires_grad]


def trainable_parameter_count(model: torch.nn.Module) -> int:
    """Numbers the optimizer updates."""
    return sum(p.numel() for p in trainable_parameters(model))


def lora_parameter_count(linear_shapes: list[tuple[int, int]], rank: int) -> int:
    """r * (in + out) summed over the adapted layers' (in, out) shapes."""
    return sum(rank * (fan_in + fan_out) for fan_in, fan_out in linear_shapes)


def qwen2_linear_shapes(
    hidden_size: int,
    intermediate_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
) -> list[tuple[int, int]]:
    """(in, out) of every linear layer of a Qwen2 decoder but the output head."""
    kv_size = hidden_size // num_heads * num_kv_heads
    per_layer = [
        (hidden_size, hidden_size),  # q_proj
        (hidden_size, kv_size),  # k_proj
        (hidden_size, kv_size),  # v_proj
        (hidden_size, hidden_size),  # o_proj
        (hidden_size, intermediate_size),  # gate_proj
        (hidden_size, intermediate_size),  # up_proj
        (intermediate_size, hidden_size),  # down_proj
    ]
    return per_layer * num_layers


@contextlib.contextmanager
def adapters_disabled(adapted: torch.nn.Module | None) -> Iterator[None]:
    """Inside: the base model (adapters off). ``None`` (no adapters): nothing."""
    if adapted is None:
        yield
        return
    with adapted.disable_adapter():
        yield


@contextlib.contextmanager
def training_base_weights(adapted: torch.nn.Module | None) -> Iterator[None]:
    """Inside: adapters off and the base weights trainable (the supervised
    warm-up trains the base model exactly as a full fine-tuning run would);
    afterwards the base is frozen again, and trained norm copies restart from
    the warmed-up gains (:func:`copy_base_norms`). ``None``: nothing changes."""
    if adapted is None:
        yield
        return
    adapter_flags = {p: p.requires_grad for p in adapted.parameters()}
    with adapted.disable_adapter():
        for parameter, trains in adapter_flags.items():
            parameter.requires_grad_(not trains)
        try:
            yield
        finally:
            for parameter, trains in adapter_flags.items():
                parameter.requires_grad_(trains)
    copy_base_norms(adapted)


def _norm_copies(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, peft ``ModulesToSaveWrapper``): each module trained as a copy."""
    from peft.utils.other import ModulesToSaveWrapper

    for name, module in model.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            yield name, module


def copy_base_norms(model: torch.nn.Module) -> None:
    """Set each trained copy (``modules_to_save``) to its frozen original, in
    place (the optimizer keeps the same tensors): the warm-up trained the
    originals, and the adapted policy must start as the warmed-up base."""
    with torch.no_grad():
        for _, wrapper in _norm_copies(model):
            for copy in wrapper.modules_to_save.values():
                for name, tensor in wrapper.original_module.state_dict().items():
                    copy.get_parameter(name).copy_(tensor)


def _base_name(name: str, copies: dict[str, torch.nn.Module]) -> str | None:
    """The base model's name of parameter ``name`` of an adapted model, or None
    when the forward does not use it now: a wrapped module's frozen original
    while its trained copy is active, or the copy while adapters are off."""
    for prefix, wrapper in copies.items():
        if not name.startswith(prefix + "."):
            continue
        rest = name.removeprefix(prefix + ".")
        active = wrapper.active_adapters and not wrapper.disable_adapters
        used = f"modules_to_save.{wrapper.active_adapters[0]}." if active else None
        used = used or "original_module."
        return f"{prefix}.{rest.removeprefix(used)}" if rest.startswith(used) else None
    return name.replace(".base_layer.", ".")


def _lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def merged_named_parameters(
    model: torch.nn.Module,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(base name, weight) of ``model`` with each adapter merged: W + (alpha/r) B A.

    ``model`` is the transformers model with LoRA layers in place; names come
    out as the base model spells them (``...q_proj.weight``, no ``base_layer``,
    no adapter tensors), so a loader of the base checkpoint (vLLM, a fresh
    model's ``load_state_dict``) takes them. A norm trained as a copy comes
    out as the copy (the original while the adapters are off). Nothing is
    modified; one merged tensor exists at a time.
    """
    deltas = {
        f"{name}.base_layer.weight": module
        for name, module in _lora_layers(model)
        if not module.disable_adapters
    }
    copies = dict(_norm_copies(model))
    for name, parameter in model.named_parameters():
        base_name = _base_name(name, copies)
        if ".lora_" in name or base_name is None:
            continue
        weight = parameter.detach()
        module = deltas.get(name)
        if module is not None:
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters)
            weight = weight + delta.to(weight.dtype)  # (out, in)
        yield base_name, weight


def base_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base weights of an adapted model, under the base model's names
    (a norm trained as a copy: its frozen original)."""
    return {
        name.replace(".base_layer.", ".").replace(".original_module.", "."): tensor
        for name, tensor in model.state_dict().items()
        if ".lora_" not in name and ".modules_to_save." not in name
    }


def merge_adapter_into(base: torch.nn.Module, adapter_dir, out_dir) -> None:
    """Open ``adapter_dir`` on ``base`` (``PeftModel.from_pretrained``), merge
    W + (alpha/r) B A into each weight (``merge_and_unload``) and
    ``save_pretrained`` the plain model to ``out_dir``. ``base`` is consumed."""
    import peft

    adapted = peft.PeftModel.from_pretrained(base, str(adapter_dir))
    adapted.merge_and_unload().save_pretrained(str(out_dir))
