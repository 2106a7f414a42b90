"""Train-step and rollout throughput of a randomly initialised Qwen2.5 shape.

Model: Qwen2Config(hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate
8960, vocabulary 151,936, tied embeddings), bfloat16 weights and AdamW states
(no float32 master copy), random weights: throughput does not depend on them.

--shape Qwen2.5-0.5B is Qwen2.5-0.5B-Instruct's published config (hidden 896,
24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151,936, tied), the
small-gpu profile's model, randomly initialised (the GPU machine has no
weights). With --autocast float16 the weights stay float32 (master weights),
the forward runs under float16 autocast and a dynamic loss scale
(torch.amp.GradScaler) guards the backward, as the loop does on a T4;
--method lora trains rank --lora-rank adapters on every linear layer
(grpo_lab.lora, the loop's own); --gradient-checkpointing as the
profile; --memory-cap-gib caps this process's CUDA memory with
torch.cuda.set_per_process_memory_fraction (a 16 GB T4 shows 15 GiB), so a
case that would not fit a T4 fails with an out-of-memory error here too.

Train step: grpo_lab.train_step.policy_gradient_update on a batch of B
sequences of T tokens (prompt then response, response = the last
T - prompt_len tokens), on-policy loss, max_grad_norm 1, once with the model's
own forward (logits_chunk_size 0) and once with the chunked output head.
  tokens/s = B * T / seconds per step
  MFU      = 6 * N * B * T / seconds / peak FLOP/s,
             N = every parameter once (the tied head counts once: its matmul
             runs), attention-score FLOPs and the chunked head's recomputation
             not counted; peak = 989e12 FLOP/s, the dense bf16 figure
             NVIDIA gives for H100/H200 SXM.
Rollouts: model.generate(do_sample=True, temperature 1, top_k 0, top_p 1) on
random prompt ids, min_new_tokens = max_new_tokens so every row generates the
same count; tokens/s = rows * new tokens / seconds.

    PYTHONPATH=. python benchmarks/gpu_throughput.py            # on a GPU
    .venv/bin/python benchmarks/gpu_throughput.py --quick        # CPU, tiny shape
"""

from __future__ import annotations

import contextlib
import statistics
import sys

import harness
import torch

from grpo_lab.train_step import policy_gradient_update

PEAK_FLOPS = 989e12
SHAPES = {  # Qwen2Config fields
    "Qwen2.5-1.5B": {"hidden_size": 1536, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2,
                     "intermediate_size": 8960, "vocab_size": 151936},
    "Qwen2.5-0.5B": {"hidden_size": 896, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2,
                     "intermediate_size": 4864, "vocab_size": 151936},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000},
}  # fmt: skip
FLAGS = {
    "shape": harness.Flag("Qwen2.5-1.5B", tuple(SHAPES)), "device": "cuda",
    "dtype": harness.Flag("bfloat16", ("bfloat16", "float32")), "batch_size": 16,
    "microbatch_size": 8, "seq_len": 1024, "prompt_len": 256, "chunk_size": 1024,
    "warmup_steps": 2, "steps": 5, "rollout_batch": 64, "rollout_prompt_len": 128,
    "new_tokens": 256,
    "method": harness.Flag("full", ("full", "lora"), "full fine-tuning or LoRA"),
    "lora_rank": 1, "lora_alpha": 32.0,
    "autocast": harness.Flag("none", ("none", "float16", "bfloat16")),
    "gradient_checkpointing": False,
    "memory_cap_gib": harness.Flag(0.0, help="CUDA memory cap in GiB (0: none)"),
}  # fmt: skip
QUICK = {
    "shape": "tiny", "device": "cpu", "dtype": "float32", "batch_size": 4,
    "microbatch_size": 2, "seq_len": 32, "prompt_len": 8, "chunk_size": 8,
    "warmup_steps": 1, "steps": 1, "rollout_batch": 2, "rollout_prompt_len": 4,
    "new_tokens": 4,
}  # fmt: skip


def memory_fraction(cap_gib: float, total_bytes: int) -> float:
    """The share of a GPU's memory that is ``cap_gib`` GiB (at most all of it)."""
    if not cap_gib > 0:
        raise ValueError(f"memory_cap_gib must be > 0, got {cap_gib!r}")
    return min(1.0, cap_gib * 2**30 / total_bytes)


def cap_memory(arguments, device: torch.device) -> float | None:
    """Cap this process's CUDA memory at --memory-cap-gib; the fraction set."""
    if not arguments.memory_cap_gib or device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = memory_fraction(arguments.memory_cap_gib, total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def build_model(arguments, device: torch.device):
    """The random model in --dtype; under --method lora, adapters in place."""
    with device:  # initialised where it runs
        model = harness.random_qwen2(
            arguments.seed,
            **SHAPES[arguments.shape],
            max_position_embeddings=32768,
            rope_theta=1_000_000.0,
        )
    model = model.to(device=device, dtype=getattr(torch, arguments.dtype))
    if arguments.gradient_checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        model.config.use_cache = False
    if arguments.method == "lora":
        from grpo_lab import lora

        settings = lora.LoraSettings(
            arguments.lora_rank, arguments.lora_alpha, 0.0, lora.ALL_LINEAR
        )
        model = lora.inner_model(lora.add_adapters(model, settings, arguments.seed))
    return model


def train_method(arguments) -> str:
    """ "full fine-tuning" or "LoRA r=<rank>"."""
    if arguments.method == "full":
        return "full fine-tuning"
    return f"LoRA r={arguments.lora_rank}"


def autocast(arguments, device: torch.device):
    """torch.autocast to --autocast, or nothing."""
    if arguments.autocast == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, arguments.autocast))


def random_batch(arguments, vocab_size: int, device) -> tuple[dict, torch.Tensor]:
    """B sequences of T random ids; the response is the last T - prompt_len."""
    generator = torch.Generator().manual_seed(arguments.seed)
    shape = (arguments.batch_size, arguments.seq_len + 1)
    ids = torch.randint(2, vocab_size, shape, generator=generator)  # (B, T + 1)
    response_mask = torch.zeros_like(ids[:, 1:])  # (B, T)
    response_mask[:, arguments.prompt_len - 1 :] = 1
    batch = {
        "input_ids": ids[:, :-1],
        "labels": ids[:, 1:],
        "response_mask": response_mask,
    }
    advantages = torch.randn(arguments.batch_size, generator=generator)  # (B,)
    return {k: v.to(device) for k, v in batch.items()}, advantages.to(device)


def train_step_throughput(model, arguments, device, chunk_size: int) -> dict:
    """Median seconds of policy_gradient_update after the warm-up steps."""
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6, weight_decay=0.0)
    # float16 gradients underflow: a dynamic loss scale, as the loop uses.
    scaler = (
        torch.amp.GradScaler(device.type) if arguments.autocast == "float16" else None
    )
    batch, advantages = random_batch(arguments, model.config.vocab_size, device)
    accumulation = arguments.batch_size // arguments.microbatch_size
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step():
        with autocast(arguments, device):
            return policy_gradient_update(
                model, optimizer, accumulation, 1.0, batch, advantages,
                logits_chunk_size=chunk_size, grad_scaler=scaler,
            )  # fmt: skip

    seconds = [
        harness.timed(device, step)[1]
        for _ in range(arguments.warmup_steps + arguments.steps)
    ][arguments.warmup_steps :]
    optimizer.state.clear()  # free the AdamW moments before the rollouts
    step_seconds = statistics.median(seconds)
    tokens = arguments.batch_size * arguments.seq_len
    parameters = sum(p.numel() for p in model.parameters())
    cuda = device.type == "cuda"
    return {
        "method": train_method(arguments),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "loss_scale": scaler.get_scale() if scaler is not None else None,
        "logits_chunk_size": chunk_size,
        "batch_size": arguments.batch_size,
        "microbatch_size": arguments.microbatch_size,
        "seq_len": arguments.seq_len,
        "seconds_per_step": step_seconds,
        "tokens_per_second": tokens / step_seconds,
        "mfu": 6 * parameters * tokens / step_seconds / PEAK_FLOPS,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if cuda
        else None,
        "parameters": parameters,
    }


@torch.no_grad()
def rollout_throughput(model, arguments, device) -> dict:
    """Sampled generation, every row forced to the same number of new tokens."""
    model.eval()
    model.config.use_cache = True  # off for gradient checkpointing
    generator = torch.Generator().manual_seed(arguments.seed + 1)
    shape = (arguments.rollout_batch, arguments.rollout_prompt_len)
    prompts = torch.randint(2, model.config.vocab_size, shape, generator=generator)
    prompts = prompts.to(device)  # (B, P)
    settings = {
        "do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
        "pad_token_id": 0, "attention_mask": torch.ones_like(prompts),
    }  # fmt: skip
    with autocast(arguments, device):  # the sampler in the policy's dtype
        model.generate(prompts, **settings, max_new_tokens=4, min_new_tokens=4)
        new = arguments.new_tokens
        output, seconds = harness.timed(
            device,
            model.generate,
            prompts,
            **settings,
            max_new_tokens=new,
            min_new_tokens=new,
        )
    return {
        "rollout_batch": arguments.rollout_batch,
        "prompt_len": arguments.rollout_prompt_len,
        "new_tokens_per_row": new,
        "seconds": seconds,
        "tokens_per_second": (output.shape[1] - prompts.shape[1])
        * prompts.shape[0]
        / seconds,
    }


TRAIN_COLUMNS = [
    ("method", "method"), ("trainable_parameters", "trainable"),
    ("logits_chunk_size", "chunk"), ("batch_size", "B"), ("microbatch_size", "micro B"),
    ("seq_len", "T"), ("seconds_per_step", "s/step"), ("tokens_per_second", "tokens/s"),
    ("mfu", "MFU"), ("peak_memory_gib", "peak GiB"),
]  # fmt: skip
ROLLOUT_COLUMNS = [
    ("rollout_batch", "rows"), ("prompt_len", "prompt"),
    ("new_tokens_per_row", "new tokens/row"), ("seconds", "s"),
    ("tokens_per_second", "new tokens/s"),
]  # fmt: skip


def report(arguments, train_rows: list[dict], rollouts: list[dict]) -> dict:
    lora_label = "" if arguments.method == "full" else f", {train_method(arguments)}"
    return {
        "title": "Train-step and rollout throughput, "
        f"{arguments.shape} shape{lora_label} "
        f"({harness.device_label(arguments.device)})",
        "description": (
            f"Random weights, {arguments.dtype}, autocast {arguments.autocast}, "
            f"gradient checkpointing {arguments.gradient_checkpointing}, memory cap "
            f"{arguments.memory_cap_gib or 'none'} GiB, shape "
            f"{SHAPES[arguments.shape]}. "
            f"MFU = 6·N·tokens / time / {PEAK_FLOPS:.3g} FLOP/s (dense bf16 peak "
            "of H100/H200 SXM); attention-score FLOPs and the chunked head's "
            "recomputation are not counted, and under LoRA 6·N still counts the "
            "frozen weights' gradients, which are never computed (about 4·N)."
        ),
        "tables": [
            harness.table(TRAIN_COLUMNS, train_rows),
            harness.table(
                ROLLOUT_COLUMNS,
                rollouts,
                title="HF `generate` rollouts (sampling, temperature 1, no top-k):",
            ),
        ],
        "notes": "",
        "peak_flops": PEAK_FLOPS,
    }


def measure(arguments, save: harness.Save) -> dict:
    device = torch.device(arguments.device)
    fraction = cap_memory(arguments, device)  # before anything is allocated
    model = build_model(arguments, device)
    train_rows = []
    for chunk_size in (0, arguments.chunk_size):
        train_rows.append(train_step_throughput(model, arguments, device, chunk_size))
        save(report(arguments, train_rows, []))
    for parameter in model.parameters():
        parameter.grad = None
    result = report(
        arguments, train_rows, [rollout_throughput(model, arguments, device)]
    )
    return {**result, "memory_fraction": fraction}


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
