"""Train-step and rollout throughput of a randomly initialised Qwen2.5-1.5B shape.

Model: Qwen2Config(hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate
8960, vocabulary 151,936, tied embeddings), bfloat16 weights and AdamW states
(no float32 master copy), random weights: throughput does not depend on them.

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
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000},
}  # fmt: skip
FLAGS = {
    "shape": harness.Flag("Qwen2.5-1.5B", tuple(SHAPES)), "device": "cuda",
    "dtype": harness.Flag("bfloat16", ("bfloat16", "float32")), "batch_size": 16,
    "microbatch_size": 8, "seq_len": 1024, "prompt_len": 256, "chunk_size": 1024,
    "warmup_steps": 2, "steps": 5, "rollout_batch": 64, "rollout_prompt_len": 128,
    "new_tokens": 256,
}  # fmt: skip
QUICK = {
    "shape": "tiny", "device": "cpu", "dtype": "float32", "batch_size": 4,
    "microbatch_size": 2, "seq_len": 32, "prompt_len": 8, "chunk_size": 8,
    "warmup_steps": 1, "steps": 1, "rollout_batch": 2, "rollout_prompt_len": 4,
    "new_tokens": 4,
}  # fmt: skip


def build_model(arguments, device: torch.device):
    with device:  # initialised where it runs
        model = harness.random_qwen2(
            arguments.seed,
            **SHAPES[arguments.shape],
            max_position_embeddings=32768,
            rope_theta=1_000_000.0,
        )
    return model.to(device=device, dtype=getattr(torch, arguments.dtype))


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
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    batch, advantages = random_batch(arguments, model.config.vocab_size, device)
    accumulation = arguments.batch_size // arguments.microbatch_size
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = [
        harness.timed(
            device, policy_gradient_update, model, optimizer, accumulation, 1.0,
            batch, advantages, logits_chunk_size=chunk_size,
        )[1]
        for _ in range(arguments.warmup_steps + arguments.steps)
    ][arguments.warmup_steps :]  # fmt: skip
    del optimizer
    step_seconds = statistics.median(seconds)
    tokens = arguments.batch_size * arguments.seq_len
    parameters = sum(p.numel() for p in model.parameters())
    cuda = device.type == "cuda"
    return {
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
    generator = torch.Generator().manual_seed(arguments.seed + 1)
    shape = (arguments.rollout_batch, arguments.rollout_prompt_len)
    prompts = torch.randint(2, model.config.vocab_size, shape, generator=generator)
    prompts = prompts.to(device)  # (B, P)
    settings = {
        "do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
        "pad_token_id": 0, "attention_mask": torch.ones_like(prompts),
    }  # fmt: skip
    model.generate(prompts, **settings, max_new_tokens=4, min_new_tokens=4)  # warm-up
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
    return {
        "title": "Train-step and rollout throughput, "
        f"{arguments.shape} shape ({harness.device_label(arguments.device)})",
        "description": (
            f"Random weights, {arguments.dtype}, shape {SHAPES[arguments.shape]}. "
            f"MFU = 6·N·tokens / time / {PEAK_FLOPS:.3g} FLOP/s (dense bf16 peak "
            "of H100/H200 SXM); attention-score FLOPs and the chunked head's "
            "recomputation are not counted."
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
    model = build_model(arguments, device)
    train_rows = []
    for chunk_size in (0, arguments.chunk_size):
        train_rows.append(train_step_throughput(model, arguments, device, chunk_size))
        save(report(arguments, train_rows, []))
    for parameter in model.parameters():
        parameter.grad = None
    return report(arguments, train_rows, [rollout_throughput(model, arguments, device)])


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
