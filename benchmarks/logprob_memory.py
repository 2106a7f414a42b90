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
    .venv/bin/python benchmarks/logprob_memory.py --quick    # seconds; tiny sizes
"""

from __future__ import annotations

import sys
import tempfile
from itertools import product
from pathlib import Path

import harness
import torch

from grpo_lab.logprobs import get_response_log_probs

FLAGS = {
    "vocab_sizes": [32000, 151936],
    "seq_lens": [512, 2048],
    "chunk_sizes": [64, 128, 256, 512],
    "batch_size": 1,
    "heads": harness.Flag(
        ["frozen"], ("frozen", "trainable"),
        "frozen (the default; --quick: both): the head weight takes no gradient, "
        "the logits' own cost; trainable: every weight trains",
    ),
    "hidden_size": 1536,
    "device": "cpu",
    "dtype": harness.Flag("float32", ("float32", "bfloat16")),
    "in_process": harness.Flag(
        False, help="every case in this process (right for CUDA, whose peak resets)"
    ),
}  # fmt: skip
QUICK = {
    "vocab_sizes": [512], "seq_lens": [64], "chunk_sizes": [16, 64],
    "hidden_size": 64, "heads": ["frozen", "trainable"],
}  # fmt: skip
COLUMNS = [
    ("head", "head"), ("vocab_size", "vocab"), ("seq_len", "seq"),
    ("method", "method"), ("peak_mib", "peak MiB"),
    ("memory_reduction_vs_naive", "naive peak / peak"), ("seconds", "fwd+bwd s"),
    ("time_vs_naive", "time / naive"), ("max_abs_diff_log_probs", "max |Δ log p|"),
    ("max_abs_diff_token_entropy", "max |Δ H|"),
    ("max_abs_diff_head_grad", "max |Δ grad head|"),
    ("max_abs_diff_decoder_grad", "max |Δ grad layer|"),
]  # fmt: skip
FROZEN_NOTES = """Reading the log-prob tables:

- naive keeps the (B, T, V) logits, their log-softmax and, in backward, the
  gradients of both; the default path (chunk 0) still materializes the model's
  (B, T, V) logits and their gradient, but no log-softmax table; the chunked
  path holds one (B, c, V) chunk at a time and recomputes it in backward, so
  its time includes a second head forward per chunk.
- What no method removes sets a floor under every peak: the decoder layer's
  activations, the (B, T, H) hidden states and their gradient, and allocator
  slack (resident memory counts it)."""
TRAINABLE_NOTES = """Reading the trainable-head tables:

- Every method ends backward holding the head's (V, H) weight gradient, and
  with tied embeddings the embedding's backward builds a second dense (V, H)
  gradient that is added into it: 0.87 GiB each at V = 151,936, H = 1536 in
  float32, whatever B and T are. Naive's (B, T, V) tables grow with B * T, so
  the chunked path's ratio grows with the batch.
- The chunked path sums the head's weight gradient chunk by chunk into one
  buffer (a hand-written checkpoint); `torch.utils.checkpoint` around the head
  would allocate a fresh (V, H) gradient per chunk and add it to `.grad`."""


def build_model(spec: dict):
    """A one-layer Qwen2 with a Qwen2.5-1.5B-shaped head (tied embeddings)."""
    hidden_size = spec["hidden_size"]
    model = harness.random_qwen2(
        spec["seed"],
        vocab_size=spec["vocab_size"],
        hidden_size=hidden_size,
        num_hidden_layers=1,
        num_attention_heads=max(1, hidden_size // 128),
        num_key_value_heads=max(1, hidden_size // 768),
        intermediate_size=hidden_size * 2,
        max_position_embeddings=4096,
    )
    return model.to(device=spec["device"], dtype=getattr(torch, spec["dtype"])).train()


def naive_log_probs(model, input_ids, labels) -> dict[str, torch.Tensor]:
    """log_softmax over the full (B, T, V) logits, then gather."""
    logits = model(input_ids).logits.float()  # (B, T, V)
    log_probs_all = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    log_probs = log_probs_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)
    with torch.no_grad():
        entropy = -(log_probs_all.exp() * log_probs_all).sum(-1)  # (B, T)
    return {"log_probs": log_probs, "token_entropy": entropy}


def forward_backward(method: str, model, input_ids, labels, loss_weights) -> dict:
    """Score the labels one way, then backward through sum(weights * log p)."""
    if method == "naive":
        scored = naive_log_probs(model, input_ids, labels)
    else:
        chunk = 0 if method == "default" else int(method.removeprefix("chunk="))
        scored = get_response_log_probs(
            model, input_ids, labels, return_token_entropy=True, logits_chunk_size=chunk
        )
    (scored["log_probs"].float() * loss_weights).sum().backward()
    return scored


def run_case(spec: dict) -> dict:
    """One (head, vocabulary, length, method) case; saves what is compared.

    head "frozen": the tied head/embedding weight takes no gradient, so the peak
    is what scoring the logits costs; "trainable": every weight trains, so the
    (V, H) weight-gradient temporaries count too.
    """
    device = torch.device(spec["device"])
    model = build_model(spec)
    if spec["head"] == "frozen":
        model.get_output_embeddings().weight.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for parameter in trainable:
        parameter.grad = torch.zeros_like(parameter)
    generator = torch.Generator().manual_seed(spec["seed"] + 1)
    shape = (spec["batch_size"], spec["seq_len"])
    input_ids = torch.randint(0, spec["vocab_size"], shape, generator=generator)
    labels = torch.randint(0, spec["vocab_size"], shape, generator=generator)
    loss_weights = torch.randn(shape, generator=generator)
    input_ids, labels = input_ids.to(device), labels.to(device)  # (B, T)
    loss_weights = loss_weights.to(device)  # (B, T)
    method = spec["method"]
    # Warm up kernels on a short prefix: it cannot raise the measured peak.
    prefix = (input_ids[:, :8], labels[:, :8], loss_weights[:, :8])
    forward_backward(method, model, *prefix)
    for parameter in trainable:
        parameter.grad.zero_()
    with harness.PeakMemory(device) as peak:
        scored, seconds = harness.timed(
            device, forward_backward, method, model, input_ids, labels, loss_weights
        )
    _save_digest(Path(spec["digest_path"]), model, scored, labels, spec["seed"] + 2)
    row = {k: v for k, v in spec.items() if k not in {"digest_path", "threads"}}
    return {
        **row,
        "peak_bytes": peak.peak_bytes,
        "seconds": seconds,
        "logits_bytes": spec["batch_size"] * spec["seq_len"] * spec["vocab_size"] * 4,
    }


def _save_digest(path: Path, model, scored, labels, seed: int) -> None:
    # Rows of the head/embedding gradient (64 label rows, 64 fixed random rows)
    # and one decoder weight's gradient cover the output head and the path back
    # into the decoder, without writing a (V, H) tensor per case.
    head_weight = model.get_output_embeddings().weight
    head_grad = (
        head_weight.grad if head_weight.grad is not None else head_weight.detach()
    )  # (V, H): the weight itself when frozen (then it must be unchanged)
    generator = torch.Generator().manual_seed(seed)
    random_rows = torch.randint(0, head_grad.shape[0], (64,), generator=generator)
    rows = torch.cat([labels.flatten()[:64].cpu(), random_rows])
    decoder_grad = model.model.layers[0].self_attn.o_proj.weight.grad
    torch.save(
        {
            "log_probs": scored["log_probs"].detach().float().cpu(),
            "token_entropy": scored["token_entropy"].detach().float().cpu(),
            "head_grad": head_grad[rows.to(head_grad.device)].float().cpu(),
            "decoder_grad": decoder_grad.float().cpu(),
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


def verdicts(rows: list[dict]) -> str:
    """The two targets, checked at the largest vocabulary in the table."""
    largest = max(row["vocab_size"] for row in rows)
    lines = [f"Targets at vocabulary {largest}:", ""]
    for head, seq_len in sorted({(row["head"], row["seq_len"]) for row in rows}):
        key = (head, largest, seq_len)
        case = [r for r in rows if (r["head"], r["vocab_size"], r["seq_len"]) == key]
        chunked = [r for r in case if r["method"].startswith("chunk=")]
        default = [r for r in case if r["method"] == "default"]
        if not (chunked and default):  # a case still running
            continue
        best, worst = max(chunked, key=_reduction), min(chunked, key=_reduction)
        meeting = [r["method"] for r in chunked if _reduction(r) >= 4]
        chunk_verdict = f"met by {', '.join(meeting)}" if meeting else "not met"
        default_reduction = _reduction(default[0])
        lines.append(
            f"- {head} head, T={seq_len}: chunked head {_reduction(worst):.2f}× "
            f"({worst['method']}) to {_reduction(best):.2f}× ({best['method']}) "
            f"lower peak than naive (target ≥ 4×: {chunk_verdict}); default path "
            f"{default_reduction:.2f}× (target > 1×: "
            f"{'met' if default_reduction > 1 else 'not met'})."
        )
    return "\n".join(lines)


def _reduction(row: dict) -> float:
    """naive peak / peak; a peak of 0 bytes (nothing measurable) reads as inf."""
    ratio = row.get("memory_reduction_vs_naive")
    return float("inf") if ratio is None else ratio


def memory_measure(arguments) -> str:
    if harness.device_label(arguments.device) == "GPU":
        return "torch.cuda.max_memory_allocated - memory_allocated after setup"
    where = "fresh process per case"
    if arguments.in_process:
        where = "every case in one process"
    reset = "high-water mark reset through /proc/self/clear_refs"
    return f"{where}: VmHWM - VmRSS after setup ({reset})"


def report(arguments, rows: list[dict]) -> dict:
    device = harness.device_label(arguments.device)
    title = "Log-prob memory and time"
    if arguments.heads == ["trainable"]:
        title += f", trainable head, batch {arguments.batch_size}"
    elif arguments.batch_size != 1:
        title += f", batch {arguments.batch_size}"
    notes = [
        text
        for head, text in (("frozen", FROZEN_NOTES), ("trainable", TRAINABLE_NOTES))
        if head in arguments.heads and device == "CPU"
    ]
    return {
        "title": f"{title} ({device})",
        "description": (
            f"Batch {arguments.batch_size}, hidden {arguments.hidden_size}, dtype "
            f"{arguments.dtype}, one-layer Qwen2 with tied embeddings; backward "
            f"through sum(w * log p). Peak: {memory_measure(arguments)}. Head "
            "`frozen`: the tied head/embedding weight takes no gradient, so the "
            "peak is the logits' own cost; `trainable`: it trains, and its (V, H) "
            "weight-gradient temporaries (the same for every method) count too.\n"
            "`naive peak / peak` above 1 means less memory than naive; "
            "`time / naive` below 1 means faster. Differences are against naive."
        ),
        "tables": [harness.table(COLUMNS, rows, notes=verdicts(rows) if rows else "")],
        "notes": "\n\n".join(notes),
    }


def cases(arguments) -> list[dict]:
    """Every case's spec, naive first at each (head, vocabulary, length)."""
    methods = ["naive", "default", *[f"chunk={c}" for c in arguments.chunk_sizes]]
    grid = product(arguments.heads, arguments.vocab_sizes, arguments.seq_lens)
    shared = ("batch_size", "hidden_size", "device", "dtype", "seed")
    return [
        {"method": method, "head": head, "vocab_size": vocab_size, "seq_len": seq_len,
         **{key: getattr(arguments, key) for key in shared}}
        for head, vocab_size, seq_len in grid
        for method in methods
    ]  # fmt: skip


def measure(arguments, save: harness.Save) -> dict:
    """Every case, each in a fresh process unless --in-process; saved after each."""
    rows, threads = [], torch.get_num_threads()
    with tempfile.TemporaryDirectory() as digest_dir:
        for spec in cases(arguments):
            case = f"{digest_dir}/{spec['head']}_{spec['vocab_size']}_{spec['seq_len']}"
            spec["digest_path"] = f"{case}_{spec['method']}.pt"
            if arguments.in_process:
                row = run_case(spec)
            else:
                row = harness.run_worker(__file__, {**spec, "threads": threads})
            rows.append(
                {**row, **compare_digests(f"{case}_naive.pt", spec["digest_path"])}
            )
            add_ratios(rows)
            save(report(arguments, rows))
            print(
                f"{spec['method']:>10} {spec['head']} V={spec['vocab_size']} "
                f"T={spec['seq_len']}: {row['peak_bytes'] / 2**20:9.1f} MiB "
                f"{row['seconds']:7.2f} s",
                flush=True,
            )
    return report(arguments, rows)


def worker(spec: dict) -> dict:
    torch.set_num_threads(spec["threads"])
    return run_case(spec)


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
