"""One GRPO optimizer step on a prepared batch: grpo_lab against TRL's GRPOTrainer.

Both sides start from the same weights and see the same token ids and the same
advantages; generation and rewards are outside the timed region on both sides.

  grpo_lab  policy_gradient_update(model, AdamW, 1, max_grad_norm, batch, advantages)
            (on-policy: importance_reweighting_method="none"); timed twice:
            as is, and with share_prompt_prefix=True (each of the batch's
            prompts runs once for its group; the training loop's setting)
  TRL       GRPOTrainer.training_step(model, inputs) with generation bypassed
            (its _prepare_inputs returns the prepared batch), then
            clip_grad_norm_, optimizer.step, optimizer.zero_grad: what the
            Trainer's inner loop does per step. TRL 1.16 scores with its fused,
            chunked output head (no (B, T, V) logits).

Settings matched: group size, epsilon 0.2, beta 0 (no KL, no reference model),
one iteration per batch (so TRL's old log-probs are the detached current ones),
no gradient accumulation, max_grad_norm 1, float32, torch.optim.AdamW(fused=True)
on both sides (TRL's default optim, "adamw_torch_fused").

Agreement (one step from the same weights, gradients read before the update):
  TRL loss_type="grpo"    vs grpo_lab importance_reweighting_method="grpo" with
                          old_log_probs = the current log-probs, cliprange 0.2,
                          loss_normalization="sequence": both are
                          mean_i( sum_t -A_i * ratio_it / |o_i| ) with ratio = 1.
  TRL loss_type="dr_grpo" vs loss_normalization="constant" with
                          normalization_constant = B * max_completion_length.
  grpo_lab's on-policy "none" loss, -A * log p, has a different value but the
  same gradient; its gradient is compared too.

Time per step: steps alternate between the sides in one process (median of
--steps). Peak memory: each side in a fresh process, one step after a warm-up
step, peak above the memory held after setup.

    .venv/bin/python benchmarks/trl_train_step.py
    .venv/bin/python benchmarks/trl_train_step.py --smoke
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
import warnings
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

from grpo_lab.advantages import compute_group_normalized_rewards
from grpo_lab.logprobs import get_response_log_probs
from grpo_lab.masks import pad_prompt_and_response_ids
from grpo_lab.models import build_char_tokenizer
from grpo_lab.train_step import policy_gradient_update

MODEL_SHAPES = {
    # The CPU toy-task model: character vocabulary.
    "tiny": {"hidden_size": 128, "num_layers": 2, "heads": 4, "kv_heads": 2,
             "intermediate_size": 256, "vocab_size": None},
    # A small model with a realistic vocabulary, where the output head matters.
    "small": {"hidden_size": 512, "num_layers": 4, "heads": 8, "kv_heads": 2,
              "intermediate_size": 1408, "vocab_size": 32000},
}  # fmt: skip
LEARNING_RATE = 1e-5
# grpo_lab as is, grpo_lab with share_prompt_prefix=True, and TRL.
OUR_SIDES = ("ours", "ours_shared")
SIDES = (*OUR_SIDES, "trl")
MAX_GRAD_NORM = 1.0
CLIPRANGE = 0.2


def build_model(shape_name: str, tokenizer, device: torch.device):
    shape = MODEL_SHAPES[shape_name]
    config = Qwen2Config(
        vocab_size=shape["vocab_size"] or len(tokenizer),
        hidden_size=shape["hidden_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        intermediate_size=shape["intermediate_size"],
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device).train()


def build_batch(settings: dict, vocab_size: int, pad_token_id: int, eos_token_id: int):
    """Prompts of one length (no prompt padding), responses of varied lengths."""
    generator = torch.Generator().manual_seed(settings["seed"])
    batch_size = settings["prompts"] * settings["group_size"]
    low = 2  # ids 0 and 1 are <pad> and <eos>
    prompt_ids = [
        torch.randint(
            low, vocab_size, (settings["prompt_len"],), generator=generator
        ).tolist()
        for _ in range(settings["prompts"])
    ]
    prompt_ids = [ids for ids in prompt_ids for _ in range(settings["group_size"])]
    lengths = torch.randint(
        settings["max_completion_len"] // 4,
        settings["max_completion_len"],
        (batch_size,),
        generator=generator,
    ).tolist()
    response_ids = [
        [
            *torch.randint(
                low, vocab_size, (length - 1,), generator=generator
            ).tolist(),
            eos_token_id,
        ]
        for length in lengths
    ]
    raw_rewards = torch.rand(batch_size, generator=generator).round()  # (B,)
    raw_rewards[:: settings["group_size"]] = 1.0  # no all-zero group
    raw_rewards[1 :: settings["group_size"]] = 0.0
    advantages, _ = compute_group_normalized_rewards(
        raw_rewards, settings["group_size"]
    )
    ours = pad_prompt_and_response_ids(prompt_ids, response_ids, pad_token_id)
    trl_inputs = _trl_inputs(prompt_ids, response_ids, advantages, pad_token_id)
    return ours, trl_inputs, advantages.float()


def _trl_inputs(prompt_ids, response_ids, advantages, pad_token_id) -> dict:
    """The dict GRPOTrainer._generate_and_score_completions returns (no vLLM)."""
    width = max(len(ids) for ids in response_ids)
    completion_ids = torch.full((len(response_ids), width), pad_token_id)  # (B, C)
    completion_mask = torch.zeros((len(response_ids), width), dtype=torch.long)
    for row, ids in enumerate(response_ids):
        completion_ids[row, : len(ids)] = torch.tensor(ids)
        completion_mask[row, : len(ids)] = 1
    prompt = torch.tensor(prompt_ids)  # (B, P)
    return {
        "prompt_ids": prompt,
        "prompt_mask": torch.ones_like(prompt),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages.float(),
        "num_items_in_batch": completion_mask.sum(),
    }


def build_trainer(model, tokenizer, settings: dict, loss_type: str, out_dir: str):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    batch_size = settings["prompts"] * settings["group_size"]
    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=batch_size,
        num_generations=settings["group_size"],
        max_completion_length=settings["max_completion_len"],
        loss_type=loss_type,
        beta=0.0,
        epsilon=CLIPRANGE,
        num_iterations=1,
        gradient_accumulation_steps=1,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM,
        bf16=False,
        use_cpu=settings["device"] == "cpu",
        report_to="none",
        logging_steps=1_000_000,
        save_strategy="no",
        disable_dropout=True,
    )
    dataset = Dataset.from_list([{"prompt": "0"}] * batch_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop
    # Generation is not part of the step being compared: hand the batch through.
    trainer._prepare_inputs = lambda inputs: inputs
    return trainer


def trl_step(trainer, inputs) -> None:
    model = trainer.model
    trainer.training_step(model, inputs, None)
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def ours_step(model, optimizer, batch, advantages, share_prompt_prefix) -> None:
    policy_gradient_update(
        model,
        optimizer,
        1,
        MAX_GRAD_NORM,
        batch,
        advantages,
        share_prompt_prefix=share_prompt_prefix,
    )


class GradientRecorder(torch.optim.Optimizer):
    """An optimizer whose step() keeps a copy of the gradients and changes nothing."""

    def __init__(self, params):
        super().__init__(params, {})
        self.gradients: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.gradients = [
            p.grad.detach().clone()
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
        ]


def agreement(settings: dict, tokenizer, device) -> list[dict]:
    """Loss values and gradients of one step from the same weights, both sides."""
    rows = []
    for loss_type, normalization in (("grpo", "sequence"), ("dr_grpo", "constant")):
        model = build_model(settings["model"], tokenizer, device)
        ours, trl_inputs, advantages = _batch_on(settings, model, tokenizer, device)
        batch_size = advantages.shape[0]
        constant = batch_size * settings["max_completion_len"]
        with tempfile.TemporaryDirectory() as out_dir:
            trainer = build_trainer(
                copy.deepcopy(model), tokenizer, settings, loss_type, out_dir
            )
            trl_loss = trainer.compute_loss(trainer.model, trl_inputs)
            trl_loss.backward()
            trl_gradients = [p.grad for p in trainer.model.parameters()]
        with torch.no_grad():
            old_log_probs = get_response_log_probs(
                model, ours["input_ids"], ours["labels"]
            )["log_probs"]  # (B, T)
        for method in ("grpo", "none"):
            recorder = GradientRecorder(model.parameters())
            our_loss, _ = policy_gradient_update(
                model,
                recorder,
                1,
                None,
                ours,
                advantages,
                importance_reweighting_method=method,
                old_log_probs=old_log_probs if method == "grpo" else None,
                cliprange=CLIPRANGE if method == "grpo" else None,
                loss_normalization=normalization,
                normalization_constant=constant
                if normalization == "constant"
                else None,
            )
            gradient_diff = max(
                float((a - b).abs().max())
                for a, b in zip(recorder.gradients, trl_gradients)
            )
            gradient_scale = max(float(b.abs().max()) for b in trl_gradients)
            rows.append(
                {
                    "trl_loss_type": loss_type,
                    "ours": f"{method}, {normalization}"
                    + (
                        f" (constant {constant})" if normalization == "constant" else ""
                    ),
                    "trl_loss": float(trl_loss.detach()),
                    "our_loss": float(our_loss),
                    "loss_abs_diff": abs(float(trl_loss.detach()) - float(our_loss)),
                    "max_abs_grad_diff": gradient_diff,
                    "max_abs_grad": gradient_scale,
                }
            )
    return rows


def _batch_on(settings, model, tokenizer, device):
    ours, trl_inputs, advantages = build_batch(
        settings,
        model.config.vocab_size,
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
    )
    ours = {key: value.to(device) for key, value in ours.items()}
    trl_inputs = {key: value.to(device) for key, value in trl_inputs.items()}
    return ours, trl_inputs, advantages.to(device)


def _setup_side(side: str, settings: dict, tokenizer, device, out_dir: str):
    model = build_model(settings["model"], tokenizer, device)
    ours, trl_inputs, advantages = _batch_on(settings, model, tokenizer, device)
    if side in OUR_SIDES:
        # TRL's default optim is "adamw_torch_fused": the same kernel on both sides.
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=LEARNING_RATE, weight_decay=0.0, fused=True
        )
        share = side == "ours_shared"
        return lambda: ours_step(model, optimizer, ours, advantages, share)
    trainer = build_trainer(model, tokenizer, settings, "grpo", out_dir)
    return lambda: trl_step(trainer, trl_inputs)


def timing(settings: dict, tokenizer, device) -> dict:
    """Median seconds per step, the two sides alternating in one process."""
    with tempfile.TemporaryDirectory() as out_dir:
        steps = {
            side: _setup_side(side, settings, tokenizer, device, out_dir)
            for side in SIDES
        }
        seconds = {side: [] for side in steps}
        for step_index in range(settings["steps"] + 1):
            for side, step in steps.items():
                synchronize(device)
                start = time.perf_counter()
                step()
                synchronize(device)
                if step_index > 0:  # the first step of each side is a warm-up
                    seconds[side].append(time.perf_counter() - start)
    return {side: statistics.median(values) for side, values in seconds.items()}


def peak_memory_worker(side: str, settings: dict) -> dict:
    """In a fresh process: peak memory of one step after a warm-up step."""
    device = torch.device(settings["device"])
    tokenizer = build_char_tokenizer()
    with tempfile.TemporaryDirectory() as out_dir:
        step = _setup_side(side, settings, tokenizer, device, out_dir)
        step()
        synchronize(device)
        with PeakMemory(device) as peak:
            step()
    return {"side": side, "peak_bytes": peak.peak_bytes}


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), nargs="+",
                        default=["tiny", "small"])  # fmt: skip
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-completion-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT_DIR / "trl_train_step.json"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few steps")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.smoke:
        arguments.model = ["tiny"]
        arguments.prompts, arguments.group_size = 2, 2
        arguments.prompt_len, arguments.max_completion_len = 8, 16
        arguments.steps = 2
    return arguments


def settings_for(arguments, model_name: str) -> dict:
    return {
        "model": model_name,
        "prompts": arguments.prompts,
        "group_size": arguments.group_size,
        "prompt_len": arguments.prompt_len,
        "max_completion_len": arguments.max_completion_len,
        "steps": arguments.steps,
        "seed": arguments.seed,
        "device": arguments.device,
    }


def run_model(arguments, model_name: str) -> tuple[dict, list[dict]]:
    settings = settings_for(arguments, model_name)
    device = torch.device(arguments.device)
    tokenizer = build_char_tokenizer()
    agreement_rows = [
        {"model": model_name, **row} for row in agreement(settings, tokenizer, device)
    ]
    seconds = timing(settings, tokenizer, device)
    script = str(Path(__file__).resolve())
    peaks = {
        side: run_worker(
            [script, "--worker", json.dumps({"side": side, "settings": settings})]
        )["peak_bytes"]
        for side in SIDES
    }
    model = build_model(model_name, tokenizer, torch.device("cpu"))
    ours, _, _ = build_batch(
        settings, model.config.vocab_size, tokenizer.pad_token_id, 1
    )
    row = {
        "model": model_name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": model.config.vocab_size,
        "batch_size": settings["prompts"] * settings["group_size"],
        "sequence_len": int(ours["input_ids"].shape[1]),
        "response_tokens": int(ours["response_mask"].sum()),
        "ours_seconds": seconds["ours"],
        "trl_seconds": seconds["trl"],
        "trl_time_over_ours": seconds["trl"] / seconds["ours"],
        "shared_seconds": seconds["ours_shared"],
        "trl_time_over_shared": seconds["trl"] / seconds["ours_shared"],
        "ours_peak_mib": peaks["ours"] / 2**20,
        "shared_peak_mib": peaks["ours_shared"] / 2**20,
        "trl_peak_mib": peaks["trl"] / 2**20,
        "trl_peak_over_ours": peaks["trl"] / max(1, peaks["ours"]),
    }
    return row, agreement_rows


TIMING_COLUMNS = [
    ("model", "model"), ("parameters", "params"), ("vocab_size", "vocab"),
    ("batch_size", "B"), ("sequence_len", "T"), ("ours_seconds", "grpo_lab s/step"),
    ("trl_seconds", "TRL s/step"), ("trl_time_over_ours", "TRL / grpo_lab time"),
    ("shared_seconds", "shared-prompt s/step"),
    ("trl_time_over_shared", "TRL / shared-prompt time"),
    ("ours_peak_mib", "grpo_lab peak MiB"),
    ("shared_peak_mib", "shared-prompt peak MiB"), ("trl_peak_mib", "TRL peak MiB"),
    ("trl_peak_over_ours", "TRL / grpo_lab peak"),
]  # fmt: skip
AGREEMENT_COLUMNS = [
    ("model", "model"), ("trl_loss_type", "TRL loss_type"), ("ours", "grpo_lab"),
    ("trl_loss", "TRL loss"), ("our_loss", "grpo_lab loss"),
    ("loss_abs_diff", "|Δ loss|"), ("max_abs_grad_diff", "max |Δ grad|"),
    ("max_abs_grad", "max |grad|"),
]  # fmt: skip


def main(argv=None) -> None:
    arguments = parse_arguments(argv)
    if arguments.worker:
        spec = json.loads(arguments.worker)
        print(json.dumps(peak_memory_worker(spec["side"], spec["settings"])))
        return
    timing_rows, agreement_rows = [], []
    for model_name in arguments.model:
        row, rows = run_model(arguments, model_name)
        timing_rows.append(row)
        agreement_rows.extend(rows)
        print(format_table([row], TIMING_COLUMNS), flush=True)
    payload = {
        "benchmark": "trl_train_step",
        "command": command_line(__file__, argv),
        "machine": machine_info(),
        "settings": {
            key: value
            for key, value in vars(arguments).items()
            if key not in {"worker", "out"}
        },
        "timing": timing_rows,
        "agreement": agreement_rows,
    }
    write_json(arguments.out, payload)
    print(format_table(timing_rows, TIMING_COLUMNS))
    print(format_table(agreement_rows, AGREEMENT_COLUMNS))
    print(f"wrote {arguments.out}")


if __name__ == "__main__":
    sys.exit(main())
