"""Peak memory and time of per-token log-probs (+ entropy) forward and backward.

Three ways to score the labels of one batch under a one-layer Qwen2 whose output
head has the realistic shape (hidden 1536, vocabulary 32,000 or 151,936):

  naive    model(input_ids).logits -> log_softmax -> gather; entropy from the same
           (B, T, V) log-probabilities (no grad, a diagnostic)
  default  grpo_lab.logprobs.get_response_log_probs(..., logits_chunk_size=0)
  chunk=N  get_response_log_probs(..., logits_chunk_size=N): the decoder runs once,
           the output head N positions at a time, each chunk recomputed in backward

Backward runs through sum(weights * log_probs) with fixed random weights, as a
policy-gradient loss does (entropy is a diagnostic and carries no gradient).
Every trainable parameter's .grad is allocated before measuring, so the peak is
what scoring adds on top of a model that already holds its gradients. Two
settings of the tied head/embedding weight (--heads):
  frozen     it takes no gradient: the peak is the cost of the logits alone
             (the head's activation memory, what the chunked path targets)
  trainable  it trains too: the (V, H) weight-gradient temporaries of the head
             and the embedding (0.87 GiB each at V = 151,936 in float32) count,
             and they are the same for every method

On CPU every case runs in a fresh process and its peak is the resident-set
high-water mark above the resident size after setup; on CUDA it is
torch.cuda.max_memory_allocated above memory_allocated after setup. Ratios are
against naive at the same (vocabulary, sequence length), measured in one run.

    .venv/bin/python benchmarks/logprob_memory.py            # the CPU table
    .venv/bin/python benchmarks/logprob_memory.py --smoke    # seconds; tiny sizes
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_utils import (
    DEFAULT_OUT_DIR,
    PeakMemory,
    command_line,
    format_table,
    machine_info,
    run_worker,
    synchronize,
    write_json,
)
from transformers import AutoModelForCausalLM, Qwen2Config

from grpo_lab.logprobs import get_response_log_probs

HIDDEN_SIZE = 1536


def build_model(
    vocab_size: int, hidden_size: int, device: torch.device, dtype: torch.dtype
):
    """A one-layer Qwen2 with a Qwen2.5-1.5B-shaped head (tied embeddings)."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=1,
        num_attention_heads=max(1, hidden_size // 128),
        num_key_value_heads=max(1, hidden_size // 768),
        intermediate_size=hidden_size * 2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)
    return model.train()


def naive_log_probs(model, input_ids, labels) -> dict[str, torch.Tensor]:
    """log_softmax over the full (B, T, V) logits, then gather."""
    logits = model(input_ids).logits.float()  # (B, T, V)
    log_probs_all = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    log_probs = log_probs_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)
    with torch.no_grad():
        entropy = -(log_probs_all.exp() * log_probs_all).sum(-1)  # (B, T)
    return {"log_probs": log_probs, "token_entropy": entropy}


def score(method: str, model, input_ids, labels) -> dict[str, torch.Tensor]:
    if method == "naive":
        return naive_log_probs(model, input_ids, labels)
    chunk = 0 if method == "default" else int(method.removeprefix("chunk="))
    return get_response_log_probs(
        model, input_ids, labels, return_token_entropy=True, logits_chunk_size=chunk
    )


def forward_backward(method, model, input_ids, labels, loss_weights):
    scored = score(method, model, input_ids, labels)
    loss = (scored["log_probs"].float() * loss_weights).sum()
    loss.backward()
    return scored


def run_case(
    method: str,
    vocab_size: int,
    seq_len: int,
    batch_size: int,
    hidden_size: int,
    device: torch.device,
    dtype: torch.dtype,
    head: str,
    digest_path: Path | None,
) -> dict:
    """One (method, vocabulary, length) case; saves values and gradients to compare.

    head "frozen": the tied head/embedding weight takes no gradient, so the peak
    is what scoring the logits costs; "trainable": every weight trains, so the
    (V, H) weight-gradient temporaries count too.
    """
    model = build_model(vocab_size, hidden_size, device, dtype)
    if head == "frozen":
        model.get_output_embeddings().weight.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for parameter in trainable:
        parameter.grad = torch.zeros_like(parameter)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    labels = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    loss_weights = torch.randn(batch_size, seq_len, generator=generator)
    input_ids, labels = input_ids.to(device), labels.to(device)  # (B, T)
    loss_weights = loss_weights.to(device)  # (B, T)
    # Warm up kernels on a short prefix: it cannot raise the measured peak.
    forward_backward(
        method, model, input_ids[:, :8], labels[:, :8], loss_weights[:, :8]
    )
    for parameter in trainable:
        parameter.grad.zero_()
    synchronize(device)
    with PeakMemory(device) as peak:
        start = time.perf_counter()
        scored = forward_backward(method, model, input_ids, labels, loss_weights)
        synchronize(device)
        seconds = time.perf_counter() - start
    if digest_path is not None:
        _save_digest(digest_path, model, scored, labels)
    return {
        "method": method,
        "head": head,
        "vocab_size": vocab_size,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "hidden_size": hidden_size,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device.type,
        "peak_bytes": peak.peak_bytes,
        "seconds": seconds,
        "logits_bytes": batch_size * seq_len * vocab_size * 4,
    }


def _save_digest(path: Path, model, scored, labels) -> None:
    # Rows of the head/embedding gradient (64 label rows, 64 fixed random rows)
    # and one decoder weight's gradient cover the output head and the path back
    # into the decoder, without writing a (V, H) tensor per case.
    head_weight = model.get_output_embeddings().weight
    head_grad = (
        head_weight.grad if head_weight.grad is not None else head_weight.detach()
    )  # (V, H): the weight itself when frozen (then it must be unchanged)
    generator = torch.Generator().manual_seed(2)
    rows = torch.cat(
        [
            labels.flatten()[:64].cpu(),
            torch.randint(0, head_grad.shape[0], (64,), generator=generator),
        ]
    )
    torch.save(
        {
            "log_probs": scored["log_probs"].detach().float().cpu(),
            "token_entropy": scored["token_entropy"].detach().float().cpu(),
            "head_grad": head_grad[rows.to(head_grad.device)].float().cpu(),
            "decoder_grad": model.model.layers[0]
            .self_attn.o_proj.weight.grad.float()
            .cpu(),
        },
        path,
    )


def compare_digests(reference_path: Path, candidate_path: Path) -> dict:
    """Max absolute difference of each saved tensor against naive's."""
    reference = torch.load(reference_path)
    candidate = torch.load(candidate_path)
    return {
        f"max_abs_diff_{key}": float((reference[key] - candidate[key]).abs().max())
        for key in reference
    }


def add_ratios(rows: list[dict]) -> None:
    """peak and time as ratios naive / method, at the same vocabulary and length."""
    naive = {
        (row["head"], row["vocab_size"], row["seq_len"]): row
        for row in rows
        if row["method"] == "naive"
    }
    for row in rows:
        reference = naive.get((row["head"], row["vocab_size"], row["seq_len"]))
        if reference is None:
            continue
        row["memory_reduction_vs_naive"] = (
            reference["peak_bytes"] / row["peak_bytes"] if row["peak_bytes"] else None
        )
        row["time_vs_naive"] = row["seconds"] / reference["seconds"]
        row["peak_mib"] = row["peak_bytes"] / 2**20


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument(
        "--chunk-sizes", type=int, nargs="+", default=[64, 128, 256, 512]
    )
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument(
        "--heads",
        nargs="+",
        choices=["frozen", "trainable"],
        default=None,
        help="frozen (the default; --smoke: both): the head weight takes no "
        "gradient, the logits' own cost; trainable: every weight trains",
    )
    parser.add_argument("--hidden-size", type=int, default=HIDDEN_SIZE)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT_DIR / "logprob_memory.json"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run every case in this process (right for CUDA, whose peak resets)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes that exercise every path"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.smoke:
        arguments.vocab_sizes = [512]
        arguments.seq_lens = [64]
        arguments.chunk_sizes = [16, 64]
        arguments.hidden_size = 64
        arguments.heads = arguments.heads or ["frozen", "trainable"]
    arguments.heads = arguments.heads or ["frozen"]
    return arguments


def methods(chunk_sizes: list[int]) -> list[str]:
    return ["naive", "default", *[f"chunk={size}" for size in chunk_sizes]]


def worker_main(spec_text: str) -> None:
    spec = json.loads(spec_text)
    torch.set_num_threads(spec.pop("threads"))
    spec["device"] = torch.device(spec["device"])
    spec["dtype"] = getattr(torch, spec["dtype"])
    digest = spec.pop("digest_path")
    result = run_case(**spec, digest_path=Path(digest))
    print(json.dumps(result))


def run_all(arguments: argparse.Namespace, digest_dir: Path, save=None) -> list[dict]:
    """Every case; ``save(rows)`` after each, so a stopped run keeps its rows."""
    rows = []
    cases = [
        (head, vocab_size, seq_len)
        for head in arguments.heads
        for vocab_size in arguments.vocab_sizes
        for seq_len in arguments.seq_lens
    ]
    for head, vocab_size, seq_len in cases:
        for method in methods(arguments.chunk_sizes):
            digest_path = digest_dir / f"{head}_{vocab_size}_{seq_len}_{method}.pt"
            spec = {
                "method": method,
                "head": head,
                "vocab_size": vocab_size,
                "seq_len": seq_len,
                "batch_size": arguments.batch_size,
                "hidden_size": arguments.hidden_size,
                "device": arguments.device,
                "dtype": arguments.dtype,
            }
            row = _run_one(arguments, spec, digest_path)
            naive_path = digest_dir / f"{head}_{vocab_size}_{seq_len}_naive.pt"
            row.update(compare_digests(naive_path, digest_path))
            rows.append(row)
            add_ratios(rows)
            if save is not None:
                save(rows)
            print(
                f"{method:>10} {head} V={vocab_size} T={seq_len}: "
                f"{row['peak_bytes'] / 2**20:9.1f} MiB {row['seconds']:7.2f} s",
                flush=True,
            )
    add_ratios(rows)
    return rows


def _run_one(arguments, spec, digest_path) -> dict:
    if arguments.in_process:
        return run_case(
            **{
                **spec,
                "device": torch.device(spec["device"]),
                "dtype": getattr(torch, spec["dtype"]),
            },
            digest_path=digest_path,
        )
    worker_spec = {
        **spec,
        "threads": torch.get_num_threads(),
        "digest_path": str(digest_path),
    }
    script = str(Path(__file__).resolve())
    return run_worker([script, "--worker", json.dumps(worker_spec)])


COLUMNS = [
    ("head", "head"),
    ("vocab_size", "vocab"),
    ("seq_len", "seq"),
    ("method", "method"),
    ("peak_mib", "peak MiB"),
    ("memory_reduction_vs_naive", "naive peak / peak"),
    ("seconds", "fwd+bwd s"),
    ("time_vs_naive", "time / naive"),
    ("max_abs_diff_log_probs", "max |Δ log p|"),
    ("max_abs_diff_token_entropy", "max |Δ H|"),
    ("max_abs_diff_head_grad", "max |Δ grad head|"),
    ("max_abs_diff_decoder_grad", "max |Δ grad layer|"),
]


def main(argv=None) -> None:
    arguments = parse_arguments(argv)
    if arguments.worker:
        worker_main(arguments.worker)
        return
    machine = machine_info()  # the load when the benchmark starts

    def save(rows: list[dict]) -> None:
        write_json(arguments.out, results_payload(arguments, argv, machine, rows))

    with tempfile.TemporaryDirectory() as digest_dir:
        rows = run_all(arguments, Path(digest_dir), save)
    save(rows)
    print(format_table(rows, COLUMNS))
    print(f"wrote {arguments.out}")


def results_payload(arguments, argv, machine: dict, rows: list[dict]) -> dict:
    return {
        "benchmark": "logprob_memory",
        "command": command_line(__file__, argv),
        "machine": machine,
        "settings": {
            key: value
            for key, value in vars(arguments).items()
            if key not in {"worker", "out"}
        },
        "memory_measure": (
            "torch.cuda.max_memory_allocated - memory_allocated after setup"
            if arguments.device.startswith("cuda")
            else "fresh process per case: VmHWM - VmRSS after setup "
            "(high-water mark reset through /proc/self/clear_refs)"
        ),
        "rows": rows,
    }


if __name__ == "__main__":
    sys.exit(main())
