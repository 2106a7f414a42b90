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
    .venv/bin/python benchmarks/gpu_throughput.py --smoke        # CPU, tiny shape
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_utils import (
    DEFAULT_OUT_DIR,
    command_line,
    format_table,
    machine_info,
    synchronize,
    write_json,
)
from transformers import AutoModelForCausalLM, Qwen2Config

from grpo_lab.train_step import policy_gradient_update

PEAK_FLOPS = 989e12
QWEN25_1P5B = {
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
}
SMOKE_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 1000,
}


def build_model(shape: dict, device: torch.device, dtype: torch.dtype):
    config = Qwen2Config(
        **shape,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
    )
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(device)


def random_batch(batch_size, seq_len, prompt_len, vocab_size, device):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab_size, (batch_size, seq_len + 1), generator=generator)
    response_mask = torch.zeros(batch_size, seq_len, dtype=torch.long)  # (B, T)
    response_mask[:, prompt_len - 1 :] = 1
    batch = {
        "input_ids": ids[:, :-1],  # (B, T)
        "labels": ids[:, 1:],  # (B, T)
        "response_mask": response_mask,
    }
    advantages = torch.randn(batch_size, generator=generator)  # (B,)
    return {k: v.to(device) for k, v in batch.items()}, advantages.to(device)


def train_step_throughput(model, arguments, device, chunk_size: int) -> dict:
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    batch, advantages = random_batch(
        arguments.batch_size,
        arguments.seq_len,
        arguments.prompt_len,
        model.config.vocab_size,
        device,
    )
    accumulation = arguments.batch_size // arguments.microbatch_size
    seconds = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(arguments.warmup_steps + arguments.steps):
        synchronize(device)
        start = time.perf_counter()
        policy_gradient_update(
            model,
            optimizer,
            accumulation,
            1.0,
            batch,
            advantages,
            logits_chunk_size=chunk_size,
        )
        synchronize(device)
        if step >= arguments.warmup_steps:
            seconds.append(time.perf_counter() - start)
    del optimizer
    step_seconds = statistics.median(seconds)
    tokens = arguments.batch_size * arguments.seq_len
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "logits_chunk_size": chunk_size,
        "batch_size": arguments.batch_size,
        "microbatch_size": arguments.microbatch_size,
        "seq_len": arguments.seq_len,
        "seconds_per_step": step_seconds,
        "tokens_per_second": tokens / step_seconds,
        "mfu": 6 * parameters * tokens / step_seconds / PEAK_FLOPS,
        "peak_memory_gib": (
            torch.cuda.max_memory_allocated(device) / 2**30
            if device.type == "cuda"
            else None
        ),
        "parameters": parameters,
    }


@torch.no_grad()
def rollout_throughput(model, arguments, device) -> dict:
    model.eval()
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(
        2,
        model.config.vocab_size,
        (arguments.rollout_batch, arguments.rollout_prompt_len),
        generator=generator,
    ).to(device)  # (B, P)
    settings = {
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "max_new_tokens": arguments.new_tokens,
        "min_new_tokens": arguments.new_tokens,
        "pad_token_id": 0,
        "attention_mask": torch.ones_like(prompts),
    }
    model.generate(prompts, **{**settings, "max_new_tokens": 4, "min_new_tokens": 4})
    synchronize(device)
    start = time.perf_counter()
    output = model.generate(prompts, **settings)
    synchronize(device)
    seconds = time.perf_counter() - start
    new_tokens = (output.shape[1] - prompts.shape[1]) * prompts.shape[0]
    return {
        "rollout_batch": arguments.rollout_batch,
        "prompt_len": arguments.rollout_prompt_len,
        "new_tokens_per_row": arguments.new_tokens,
        "seconds": seconds,
        "tokens_per_second": new_tokens / seconds,
    }


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--microbatch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rollout-batch", type=int, default=64)
    parser.add_argument("--rollout-prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT_DIR / "gpu_throughput.json"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shape, runs on CPU")
    arguments = parser.parse_args(argv)
    arguments.shape = dict(QWEN25_1P5B)
    arguments.dtype = "bfloat16"
    if arguments.smoke:
        arguments.shape = dict(SMOKE_SHAPE)
        arguments.device, arguments.dtype = "cpu", "float32"
        arguments.batch_size, arguments.microbatch_size = 4, 2
        arguments.seq_len, arguments.prompt_len, arguments.chunk_size = 32, 8, 8
        arguments.warmup_steps, arguments.steps = 1, 1
        arguments.rollout_batch, arguments.rollout_prompt_len = 2, 4
        arguments.new_tokens = 4
    return arguments


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


def main(argv=None) -> None:
    arguments = parse_arguments(argv)
    device = torch.device(arguments.device)
    model = build_model(arguments.shape, device, getattr(torch, arguments.dtype))
    train_rows = []
    for chunk_size in (0, arguments.chunk_size):
        train_rows.append(train_step_throughput(model, arguments, device, chunk_size))
        print(format_table(train_rows[-1:], TRAIN_COLUMNS), flush=True)
    for parameter in model.parameters():
        parameter.grad = None
    rollout = rollout_throughput(model, arguments, device)
    payload = {
        "benchmark": "gpu_throughput",
        "command": command_line(__file__, argv),
        "machine": machine_info(),
        "peak_flops": PEAK_FLOPS,
        "settings": {k: v for k, v in vars(arguments).items() if k != "out"},
        "train_step": train_rows,
        "rollout": [rollout],
    }
    write_json(arguments.out, payload)
    print(format_table(train_rows, TRAIN_COLUMNS))
    print(format_table([rollout], ROLLOUT_COLUMNS))
    print(f"wrote {arguments.out}")


if __name__ == "__main__":
    sys.exit(main())
