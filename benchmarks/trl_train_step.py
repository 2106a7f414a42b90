"""One GRPO optimizer step on a prepared batch: grpo_lab against TRL's GRPOTrainer.

Both sides start from the same weights and see the same token ids and the same
advantages; generation and rewards are outside the timed region on both sides.
Time per step: the sides alternate in one process (median of --steps after a
warm-up step). Peak memory: each side in a fresh process, one step after a
warm-up step. Agreement: the loss and gradients of one step from the same
weights, read before the update. ``report`` states the method in full (the
sides, the settings matched, which grpo_lab settings define the same loss as
which TRL loss_type); it goes into the result file and RESULTS.md.

    .venv/bin/python benchmarks/trl_train_step.py
    .venv/bin/python benchmarks/trl_train_step.py --quick

The sharing table measures when grpo_lab's shared-prompt path pays on this
machine: the same step as is and with ``share_prompt_prefix=True``, alternating,
on batches of --sharing-rows rows cut into groups of G responses to prompts of
P tokens (--sharing-cases "GxP"), with the positions (B - U) * c that sharing
saves and what ``share_prompt_prefix="auto"`` picks
(grpo_lab.prefix_sharing.worth_sharing).
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
import warnings

import harness
import torch

from grpo_lab.advantages import compute_group_normalized_rewards
from grpo_lab.logprobs import get_response_log_probs
from grpo_lab.masks import pad_prompt_and_response_ids
from grpo_lab.models import build_char_tokenizer
from grpo_lab.prefix_sharing import (
    AUTO_MIN_SAVED_POSITIONS,
    prompt_only_columns,
    saved_positions,
    worth_sharing,
)
from grpo_lab.teaching.gradient_recorder import GradientRecorder
from grpo_lab.train_step import policy_gradient_update

MODEL_SHAPES = {
    # The CPU toy-task model: character vocabulary.
    "tiny": {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": None},
    # A small model with a realistic vocabulary, where the output head matters.
    "small": {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 2, "intermediate_size": 1408, "vocab_size": 32000},
}  # fmt: skip
FLAGS = {
    "model": harness.Flag(["tiny", "small"], tuple(MODEL_SHAPES)), "prompts": 4,
    "group_size": 4, "prompt_len": 32, "max_completion_len": 128, "steps": 5,
    "device": "cpu", "sharing_model": harness.Flag("tiny", tuple(MODEL_SHAPES)),
    "sharing_rows": 16, "sharing_steps": 15,
    "sharing_cases": ["2x8", "4x8", "8x16", "2x32", "4x32", "8x32", "4x64", "4x96"],
}  # fmt: skip
QUICK = {"model": ["tiny"], "prompts": 2, "group_size": 2, "prompt_len": 8,
         "max_completion_len": 16, "steps": 2, "sharing_rows": 4,
         "sharing_steps": 2, "sharing_cases": ["2x8", "4x2"]}  # fmt: skip
LEARNING_RATE, MAX_GRAD_NORM, CLIPRANGE = 1e-5, 1.0, 0.2
SIDES = ("ours", "ours_shared", "trl")  # shared: share_prompt_prefix=True
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
SHARING_COLUMNS = [
    ("model", "model"), ("group_size", "G"), ("prompt_len", "P"), ("batch_size", "B"),
    ("sequence_len", "T"), ("prefix_len", "c"), ("saved_positions", "saved positions"),
    ("plain_seconds", "plain s/step"), ("shared_seconds", "shared s/step"),
    ("shared_over_plain", "shared / plain time"), ("auto", "auto picks"),
    ("auto_over_best", "auto / faster time"),
]  # fmt: skip
NOTES = """Reading: the ratio columns compare the two on the same batch in one
process. Both run the same model forward and backward; what differs is the
scoring around it. TRL 1.16 scores with its own chunked head
(`add_fused_lm_head`); off Triton devices it scores every position, prompt
included, and computes the entropy at each. grpo_lab scores the (B, T)
response positions it needs with the lean default path, which keeps no
(B, T, V) log-softmax table. Both sides' times include the AdamW step.

Where the definitions coincide and where they differ:

- TRL `loss_type="grpo"` is `mean_i( sum_t -min(r A_i, clip(r) A_i) / |o_i| )`;
  with one iteration per batch its old log-probs are the detached current ones,
  so `r = 1` and the value is `-mean(A)`. grpo_lab's `"grpo"` reweighting with
  `old_log_probs` = the current log-probs and `loss_normalization="sequence"` is
  the same expression: same value, same gradient.
- TRL `loss_type="dr_grpo"` divides the masked token sum by
  `B * max_completion_length`; grpo_lab's `"constant"` normalization divides by
  `normalization_constant`, so they coincide for
  `normalization_constant = B * max_completion_length`.
- grpo_lab's on-policy default `"none"` uses `-A * log p` (REINFORCE form): its
  value differs from TRL's (`-A * 1`), its gradient `-A * grad log p` is the same.
- TRL's default `loss_type="dapo"` (divide by the number of tokens in the
  accumulated generation batch) is grpo_lab's `loss_normalization="token"`:
  each microbatch's token mean is weighted by its share of the batch's
  response tokens, so the sum is the batch's token mean however the tokens
  split across microbatches (tests/test_trl_parity.py checks it under uneven
  accumulation).
- Advantages: TRL's `scale_rewards="group"` divides by the unbiased group
  standard deviation plus 1e-4; grpo_lab's `"std"` normalizer uses its own
  epsilon. Here both sides receive the same precomputed advantages."""


def build_model(shape_name: str, tokenizer, device: torch.device):
    shape = MODEL_SHAPES[shape_name]
    model = harness.random_qwen2(
        0,
        **{**shape, "vocab_size": shape["vocab_size"] or len(tokenizer)},
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    return model.to(device).train()


def build_batch(
    settings: dict, model, tokenizer, device
) -> tuple[dict, dict, torch.Tensor]:
    """Both sides' inputs: prompts of one length, responses of varied lengths."""
    generator = torch.Generator().manual_seed(settings["seed"])
    group_size, vocab_size = settings["group_size"], model.config.vocab_size

    def random_ids(count: int) -> list[int]:  # ids 0 and 1 are <pad> and <eos>
        return torch.randint(2, vocab_size, (count,), generator=generator).tolist()

    prompts = [random_ids(settings["prompt_len"]) for _ in range(settings["prompts"])]
    prompt_ids = [ids for ids in prompts for _ in range(group_size)]
    longest = settings["max_completion_len"]
    lengths = torch.randint(
        longest // 4, longest, (len(prompt_ids),), generator=generator
    )
    response_ids = [
        [*random_ids(n - 1), tokenizer.eos_token_id] for n in lengths.tolist()
    ]
    raw_rewards = torch.rand(len(prompt_ids), generator=generator).round()  # (B,)
    raw_rewards[::group_size] = 1.0  # no all-zero group
    raw_rewards[1::group_size] = 0.0
    advantages = compute_group_normalized_rewards(raw_rewards, group_size)[0].float()
    ours = pad_prompt_and_response_ids(prompt_ids, response_ids, tokenizer.pad_token_id)
    trl_inputs = _trl_inputs(ours, settings["prompt_len"], advantages)
    ours, trl_inputs = (
        {k: v.to(device) for k, v in b.items()} for b in (ours, trl_inputs)
    )
    return ours, trl_inputs, advantages.to(device)


def _trl_inputs(ours: dict, prompt_len: int, advantages: torch.Tensor) -> dict:
    """What GRPOTrainer._generate_and_score_completions returns (no vLLM), cut
    from the same ids: every prompt is ``prompt_len`` tokens long."""
    ids = torch.cat([ours["input_ids"][:, :1], ours["labels"]], dim=1)  # (B, P + C)
    completion_mask = ours["response_mask"][:, prompt_len - 1 :]  # (B, C)
    return {
        "prompt_ids": ids[:, :prompt_len],  # (B, P)
        "prompt_mask": torch.ones_like(ids[:, :prompt_len]),  # (B, P)
        "completion_ids": ids[:, prompt_len:],  # (B, C)
        "completion_mask": completion_mask,
        "advantages": advantages,  # (B,)
        "num_items_in_batch": completion_mask.sum(),
    }


def grpo_config(out_dir, use_cpu: bool, **settings):
    """TRL's GRPOConfig as both comparisons set it: one iteration per batch, no
    KL (beta 0), no gradient accumulation, float32, no logging or saving."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out_dir), gradient_accumulation_steps=1, num_iterations=1,
        beta=0.0, bf16=False, use_cpu=use_cpu, report_to="none",
        logging_steps=1_000_000, save_strategy="no", disable_dropout=True, **settings,
    )  # fmt: skip


def grpo_trainer(model, tokenizer, config, rows: list[dict], reward, callbacks=()):
    """TRL's GRPOTrainer on a dataset of ``rows``, its warnings silenced."""
    from datasets import Dataset
    from trl import GRPOTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=list(callbacks),
        )


def build_trainer(model, tokenizer, settings: dict, loss_type: str, out_dir: str):
    batch_size = settings["prompts"] * settings["group_size"]
    config = grpo_config(
        out_dir, settings["device"] == "cpu", per_device_train_batch_size=batch_size,
        num_generations=settings["group_size"], loss_type=loss_type,
        max_completion_length=settings["max_completion_len"], epsilon=CLIPRANGE,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=MAX_GRAD_NORM,
    )  # fmt: skip
    dataset = [{"prompt": "0"}] * batch_size
    trainer = grpo_trainer(
        model,
        tokenizer,
        config,
        dataset,
        lambda completions, **_: [0.0] * len(completions),
    )
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train's loop
    # Generation is not part of the step being compared: hand the batch through.
    trainer._prepare_inputs = lambda inputs: inputs
    return trainer


def trl_step(trainer, inputs) -> None:
    """What the Trainer's inner loop does per step, after generation."""
    trainer.training_step(trainer.model, inputs, None)
    torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), MAX_GRAD_NORM)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def flat_gradient(model) -> torch.Tensor:
    """Every parameter's .grad (zeros where none), flattened: (N,)."""
    grads = [
        p.grad if p.grad is not None else torch.zeros_like(p)
        for p in model.parameters()
    ]
    return torch.cat([grad.flatten() for grad in grads])


def agreement(settings: dict, tokenizer, device) -> list[dict]:
    """Loss values and gradients of one step from the same weights, both sides."""
    rows = []
    for loss_type, normalization in (("grpo", "sequence"), ("dr_grpo", "constant")):
        model = build_model(settings["model"], tokenizer, device)
        ours, trl_inputs, advantages = build_batch(settings, model, tokenizer, device)
        constant = advantages.shape[0] * settings["max_completion_len"]
        with tempfile.TemporaryDirectory() as out_dir:
            trainer = build_trainer(
                copy.deepcopy(model), tokenizer, settings, loss_type, out_dir
            )
            loss = trainer.compute_loss(trainer.model, trl_inputs)
            loss.backward()
            trl_loss, trl_gradient = float(loss.detach()), flat_gradient(trainer.model)
        with torch.no_grad():
            old_log_probs = get_response_log_probs(
                model, ours["input_ids"], ours["labels"]
            )["log_probs"]  # (B, T)
        label = normalization
        if normalization == "constant":
            label += f" (constant {constant})"
        for method in ("grpo", "none"):
            recorder = GradientRecorder(model.parameters())
            clipped = method == "grpo"  # old log-probs = the current ones: ratio 1
            our_loss, _ = policy_gradient_update(
                model,
                recorder,
                1,
                None,
                ours,
                advantages,
                importance_reweighting_method=method,
                old_log_probs=old_log_probs if clipped else None,
                cliprange=CLIPRANGE if clipped else None,
                loss_normalization=normalization,
                normalization_constant=constant
                if normalization == "constant"
                else None,
            )
            rows.append(
                {
                    "trl_loss_type": loss_type,
                    "ours": f"{method}, {label}",
                    "trl_loss": trl_loss,
                    "our_loss": float(our_loss),
                    "loss_abs_diff": abs(trl_loss - float(our_loss)),
                    "max_abs_grad_diff": float(
                        (recorder.gradient - trl_gradient).abs().max()
                    ),
                    "max_abs_grad": float(trl_gradient.abs().max()),
                }
            )
    return rows


def _setup_side(side: str, settings: dict, tokenizer, device, out_dir: str):
    """One side's step as a function of no arguments, ready to time."""
    model = build_model(settings["model"], tokenizer, device)
    ours, trl_inputs, advantages = build_batch(settings, model, tokenizer, device)
    if side == "trl":
        trainer = build_trainer(model, tokenizer, settings, "grpo", out_dir)
        return lambda: trl_step(trainer, trl_inputs)
    # TRL's default optim is "adamw_torch_fused": the same kernel on both sides.
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LEARNING_RATE, weight_decay=0.0, fused=True
    )
    share = side == "ours_shared"
    return lambda: policy_gradient_update(
        model, optimizer, 1, MAX_GRAD_NORM, ours, advantages, share_prompt_prefix=share
    )


def timing(settings: dict, tokenizer, device) -> dict:
    """Median seconds per step, the sides alternating in one process."""
    with tempfile.TemporaryDirectory() as out_dir:
        steps = {
            side: _setup_side(side, settings, tokenizer, device, out_dir)
            for side in SIDES
        }
        seconds = {side: [] for side in steps}
        for _ in range(settings["steps"] + 1):
            for side, step in steps.items():
                seconds[side].append(harness.timed(device, step)[1])
    # The first step of each side is a warm-up.
    return {side: statistics.median(values[1:]) for side, values in seconds.items()}


def sharing_case(settings: dict, case: str, tokenizer, device) -> dict:
    """One "GxP" case of the sharing table: plain and shared steps alternating."""
    group_size, prompt_len = (int(part) for part in case.split("x"))
    rows = settings["sharing_rows"]
    if group_size < 2 or rows % group_size:
        raise ValueError(
            f"--sharing-cases {case!r}: G must be >= 2 and divide --sharing-rows {rows}"
        )
    case_settings = {
        **settings, "model": settings["sharing_model"], "group_size": group_size,
        "prompts": rows // group_size, "prompt_len": prompt_len,
    }  # fmt: skip
    model = build_model(case_settings["model"], tokenizer, device)
    ours, _, advantages = build_batch(case_settings, model, tokenizer, device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LEARNING_RATE, weight_decay=0.0, fused=True
    )
    seconds = {False: [], True: []}
    for _ in range(settings["sharing_steps"] + 1):
        for share in seconds:
            _, spent = harness.timed(
                device, policy_gradient_update, model, optimizer, 1, MAX_GRAD_NORM,
                ours, advantages, share_prompt_prefix=share,
            )  # fmt: skip
            seconds[share].append(spent)
    plain, shared = (statistics.median(seconds[s][1:]) for s in (False, True))
    ids, labels = ours["input_ids"], ours["labels"]  # (B, T)
    prefix_len = prompt_only_columns(ours["response_mask"])
    auto = worth_sharing(ids, labels, prefix_len)
    return {
        "model": case_settings["model"], "group_size": group_size,
        "prompt_len": prompt_len, "batch_size": rows,
        "sequence_len": int(ids.shape[1]), "prefix_len": prefix_len,
        "saved_positions": saved_positions(ids, labels, prefix_len),
        "plain_seconds": plain, "shared_seconds": shared,
        "shared_over_plain": shared / plain, "auto": "shared" if auto else "plain",
        "auto_over_best": (shared if auto else plain) / min(plain, shared),
    }  # fmt: skip


def sharing(arguments) -> list[dict]:
    """The sharing table's rows, one per --sharing-cases entry."""
    settings = {k: getattr(arguments, k) for k in (*FLAGS, "seed")}
    device, tokenizer = torch.device(arguments.device), build_char_tokenizer()
    return [
        sharing_case(settings, case, tokenizer, device)
        for case in arguments.sharing_cases
    ]


def worker(spec: dict) -> dict:
    """In a fresh process: peak memory of one step after a warm-up step."""
    settings = spec["settings"]
    device = torch.device(settings["device"])
    with tempfile.TemporaryDirectory() as out_dir:
        step = _setup_side(
            spec["side"], settings, build_char_tokenizer(), device, out_dir
        )
        step()
        with harness.PeakMemory(device) as peak:
            step()
    return peak.peak_bytes


def run_model(arguments, model_name: str) -> tuple[dict, list[dict]]:
    # What one model's run depends on (sent to the peak-memory workers).
    settings = {**vars(arguments), "model": model_name}
    settings = {k: settings[k] for k in (*FLAGS, "seed")}
    device = torch.device(arguments.device)
    tokenizer = build_char_tokenizer()
    agreement_rows = [
        {"model": model_name, **row} for row in agreement(settings, tokenizer, device)
    ]
    seconds = timing(settings, tokenizer, device)
    peaks = {  # bytes
        side: harness.run_worker(__file__, {"side": side, "settings": settings})
        for side in SIDES
    }
    model = build_model(model_name, tokenizer, torch.device("cpu"))
    ours, _, _ = build_batch(settings, model, tokenizer, torch.device("cpu"))
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


def report(
    arguments,
    timing_rows: list[dict],
    agreement_rows: list[dict],
    sharing_rows: list[dict] = (),
) -> dict:
    return {
        "title": "One GRPO step against TRL GRPOTrainer "
        f"({harness.device_label(arguments.device)})",
        "description": (
            "Same weights, token ids and advantages on both sides; generation and "
            "rewards outside the timed region. grpo_lab: `policy_gradient_update` "
            '(on-policy), as is and with `share_prompt_prefix=True` ("shared-prompt" '
            "columns: each of the batch's prompts runs once for its group, as in the "
            "training loop). TRL: `GRPOTrainer.training_step` on the prepared batch "
            "(its `_prepare_inputs` bypassed) + `clip_grad_norm_` + `optimizer.step`. "
            f"Group size {arguments.group_size}, epsilon 0.2, beta 0, one iteration, "
            "no gradient accumulation, max_grad_norm 1, fused AdamW on both sides "
            "(TRL's default), float32. Seconds: median over "
            f"{arguments.steps} alternating steps after a warm-up; peak: fresh "
            "process per side, one step after a warm-up step."
        ),
        "tables": [
            harness.table(TIMING_COLUMNS, timing_rows),
            harness.table(
                AGREEMENT_COLUMNS,
                agreement_rows,
                title="Loss and gradient agreement, one step from the same weights "
                "(gradients read before the update):",
            ),
            harness.table(
                SHARING_COLUMNS,
                list(sharing_rows),
                title="When the shared-prompt path pays: grpo_lab's step as is and "
                f"with `share_prompt_prefix=True`, {arguments.sharing_rows} rows in "
                "groups of G responses (of 1/4 to 1 times "
                f"{arguments.max_completion_len} tokens) to prompts of P tokens, "
                f"median of {arguments.sharing_steps} alternating steps after a "
                "warm-up; saved positions: (B - U) c, of B T; auto: "
                '`share_prompt_prefix="auto"`, which shares when at least '
                f"{AUTO_MIN_SAVED_POSITIONS} positions are saved:",
            ),
        ],
        "notes": NOTES,
    }


def measure(arguments, save: harness.Save) -> dict:
    timing_rows, agreement_rows = [], []
    for model_name in arguments.model:
        row, rows = run_model(arguments, model_name)
        timing_rows.append(row)
        agreement_rows.extend(rows)
        save(report(arguments, timing_rows, agreement_rows))
        print(f"{model_name}: TRL / grpo_lab time {row['trl_time_over_ours']:.2f}")
    sharing_rows = sharing(arguments)
    return report(arguments, timing_rows, agreement_rows, sharing_rows)


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
