"""Wall time and steps to a held-out accuracy: grpo_lab's train() against TRL.

Task: the CPU toy task (reverse 5 digits, the "cpu" profile of TrainConfig).

1. Warm start, once, shared by both sides and every seed: the tiny Qwen2 of the
   cpu profile (weights from --warm-seed) after grpo_lab's supervised warm-up
   (a random model never samples a correct answer); saved with save_pretrained.
Then per seed (the seed drives the prompt draws and the samplers):
2. grpo_lab: grpo_lab.training.train on the cpu profile from that checkpoint
   (sft_max_steps 0).
3. TRL: GRPOTrainer from the same checkpoint with matched settings: 32 prompts
   x group 8 = 256 responses per step, one optimizer step per rollout batch
   (on-policy), AdamW with the profile's learning rate and warm-up steps,
   betas (0.9, 0.999), no weight decay, max_grad_norm 1, beta 0 (no KL),
   loss_type "grpo" (per-response mean, then mean over responses), group-std
   advantages, temperature 1, top_p 1, no top-k, at most 7 new tokens,
   float32, same reward function. (TRL's optimizer is its default fused AdamW,
   grpo_lab's the loop's torch.optim.AdamW.)

Both are evaluated by the same function (grpo_lab.training.loop.evaluate: one
sampled response at temperature 1, and greedy decoding, on the same held-out
prompts) every --eval-every steps. Time to accuracy = training wall time
(rollouts + reward + update; evaluation excluded on both sides) up to the first
evaluation whose --accuracy ("sampled" by default, the distribution being
trained) reaches --target. Both sides run every step (--max-steps), so their
time per step is also compared over identical step ranges. Differences that
remain: the prompts are drawn from the same generator but in a different order
(grpo_lab draws 32 fresh prompts per step, TRL shuffles a dataset of the same
size), the random streams of the samplers differ, and TRL's advantage is
(r - mean) / (std + 1e-4) with the unbiased std.

    .venv/bin/python benchmarks/time_to_accuracy.py
    .venv/bin/python benchmarks/time_to_accuracy.py --quick
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import harness
import torch
from cpu_profile import curve_line, evaluation, first_reaching
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl_train_step import grpo_config, grpo_trainer

from grpo_lab.rollouts import make_backend
from grpo_lab.tasks import get_task
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.loop import (
    Policy,
    build_policy,
    evaluate,
    save_final_model,
    train,
    warm_up_settings,
)
from grpo_lab.training.sft import warm_up

FLAGS = {
    "seeds": [0, 1, 2],
    "warm_seed": 0,
    "target": 0.9,
    "accuracy": harness.Flag(
        "sampled", ("sampled", "greedy"), "which held-out accuracy must reach --target"
    ),
    "max_steps": 400,
    "eval_every": 20,
    "stop_at_target": harness.Flag(
        False, help="stop TRL at the target (default: both sides run every step)"
    ),
    "config_overrides": harness.Flag({}, help="TrainConfig fields to set, as JSON"),
}
QUICK = {
    "seeds": [0],
    "max_steps": 2,
    "eval_every": 1,
    "config_overrides": {
        "rollout_batch_size": 8, "train_batch_size": 8, "group_size": 4,
        "eval_size": 4, "sft_max_steps": 2, "sft_eval_every": 1,
        "sft_eval_size": 4, "sft_batch_size": 4,
    },
}  # fmt: skip


def base_config(arguments, seed: int, run_dir: str) -> TrainConfig:
    """The cpu profile at this run's steps and evaluation interval."""
    return TrainConfig.for_profile(
        "cpu",
        seed=seed,
        steps=arguments.max_steps,
        eval_every=arguments.eval_every,
        checkpoint_every=0,
        run_dir=run_dir,
        **arguments.config_overrides,
    )


def warm_start(config: TrainConfig, folder: Path) -> float:
    """grpo_lab's supervised warm-up from the seed's model; returns its seconds."""
    task = get_task(config.task, **config.task_options)
    policy = build_policy(config)
    started = time.perf_counter()
    warm_up(
        policy.model,
        policy.tokenizer,
        policy.backend,
        task,
        warm_up_settings(config, task),
        log=lambda record: None,
    )
    seconds = time.perf_counter() - started
    save_final_model(policy, folder)
    return seconds


def run_ours(config: TrainConfig, warm_folder: Path, arguments) -> dict:
    """grpo_lab's train() from the warm start; evaluations from its history."""
    config = dataclasses.replace(config, model=str(warm_folder), sft_max_steps=0)
    elapsed, evaluations = 0.0, []
    for record in train(config, progress=False).history:
        if "step" in record:
            elapsed += record.get("time/step_seconds", 0.0)
            if "eval/accuracy_greedy" in record:
                evaluations.append(evaluation(record, seconds=elapsed))
    return summarize("grpo_lab", evaluations, arguments)


class HeldOutAccuracy(TrainerCallback):
    """grpo_lab's evaluate() in TRL's loop every k steps (may stop at the target)."""

    def __init__(self, config, task, tokenizer, arguments):
        self.config, self.task, self.tokenizer = config, task, tokenizer
        self.arguments = arguments
        self.eval_examples = task.eval(config.eval_size, seed=config.seed)
        self.evaluations: list[dict] = []
        self.started = self.excluded = 0.0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.started = time.perf_counter()
        self.held_out(0, model)  # the accuracy training starts from

    def on_step_end(self, args, state, control, model=None, **kwargs):
        reached = self.held_out(state.global_step, model)
        if reached and self.arguments.stop_at_target:
            control.should_training_stop = True

    def held_out(self, step: int, model) -> bool:
        """Evaluate when due (time excluded); True when the target is reached."""
        if step % self.config.eval_every and step != self.config.steps:
            return False
        now = time.perf_counter()
        training_seconds = now - self.started - self.excluded
        policy = Policy(
            model, self.tokenizer, None, make_backend("hf", model, self.tokenizer)
        )
        was_training = model.training
        record = evaluate(self.config, self.task, policy, self.eval_examples, step)
        model.train(was_training)
        self.excluded += time.perf_counter() - now
        self.evaluations.append(
            evaluation({"step": step, **record}, seconds=training_seconds)
        )
        accuracy = record[f"eval/accuracy_{self.arguments.accuracy}"]
        return accuracy >= self.arguments.target


def run_trl(config: TrainConfig, warm_folder: Path, arguments) -> dict:
    """TRL's GRPOTrainer from the warm start, evaluated by HeldOutAccuracy."""
    task = get_task(config.task, **config.task_options)
    tokenizer = AutoTokenizer.from_pretrained(warm_folder)
    model = AutoModelForCausalLM.from_pretrained(warm_folder, dtype=torch.float32)
    examples = task.train(config.prompts_per_step * config.steps, config.seed)
    rows = [{"prompt": e.prompt, "ground_truth": e.ground_truth} for e in examples]

    def reward(prompts, completions, ground_truth, **kwargs):
        return [
            task.reward_fn(c, t)["reward"] for c, t in zip(completions, ground_truth)
        ]

    callback = HeldOutAccuracy(config, task, tokenizer, arguments)
    trl_settings = trl_config(config, f"{config.run_dir}-trl")
    trainer = grpo_trainer(model, tokenizer, trl_settings, rows, reward, [callback])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return summarize("TRL", callback.evaluations, arguments)


def trl_config(config: TrainConfig, out_dir: str):
    """TRL's GRPOConfig matched to the cpu profile (see the module docstring)."""
    return grpo_config(
        out_dir, True, seed=config.seed, max_steps=config.steps,
        per_device_train_batch_size=config.rollout_batch_size,
        num_generations=config.group_size, steps_per_generation=1,
        learning_rate=config.lr, lr_scheduler_type="constant_with_warmup",
        warmup_steps=getattr(config, "lr_warmup_steps", 0),
        weight_decay=config.weight_decay, adam_beta1=0.9,
        adam_beta2=config.adam_beta2, max_grad_norm=config.max_grad_norm,
        loss_type="grpo", scale_rewards="group", temperature=config.temperature,
        top_p=config.top_p, top_k=0, max_completion_length=config.max_new_tokens,
        dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip


def summarize(framework: str, evaluations: list[dict], arguments) -> dict:
    """A run's first evaluation at the target, and its last evaluation."""
    reached = first_reaching(evaluations, arguments.accuracy, arguments.target) or {}
    last = evaluations[-1] if evaluations else {}
    per_step = last["seconds"] / last["step"] if last.get("step") else None
    return {
        "framework": framework,
        "reached": bool(reached),
        "steps_to_target": reached.get("step"),
        "seconds_to_target": reached.get("seconds"),
        "seconds_per_step": per_step,
        "last_step": last.get("step"),
        "last_accuracy_greedy": last.get("accuracy_greedy"),
        "last_accuracy_sampled": last.get("accuracy_sampled"),
        "evaluations": evaluations,
    }


def add_common_step_pace(runs: list[dict]) -> None:
    """s/step of each run of a seed over the same first N steps.

    Later steps cost grpo_lab less (more groups are all correct, and such groups
    are skipped), so paces are compared over identical step ranges: all the
    steps both runs took (N = the last evaluated step they share), and the steps
    until both had reached the target (N = the later of their target steps).
    """
    for seed in {run["seed"] for run in runs}:
        same_seed = [run for run in runs if run["seed"] == seed]
        shared = set.intersection(
            *({e["step"] for e in run["evaluations"] if e["step"]} for run in same_seed)
        )
        if not shared:
            continue
        both_reached = [run["steps_to_target"] for run in same_seed]
        to_target = max(both_reached) if all(both_reached) else None
        for run in same_seed:
            run["common_steps"] = max(shared)
            run["seconds_per_common_step"] = _pace(run, max(shared))
            if to_target in shared:
                run["target_steps"] = to_target
                run["seconds_per_step_to_target"] = _pace(run, to_target)


def _pace(run: dict, steps: int) -> float:
    seconds = next(e["seconds"] for e in run["evaluations"] if e["step"] == steps)
    return seconds / steps


MEANS = (  # averaged over seeds; all but the first also as TRL / grpo_lab
    "steps_to_target",
    "seconds_to_target",
    "seconds_per_common_step",
    "seconds_per_step_to_target",
)


def summary_rows(runs: list[dict]) -> list[dict]:
    """Per framework: seeds, seeds at target, means; TRL's over grpo_lab's."""
    rows = []
    for framework in ("grpo_lab", "TRL"):
        mine = [r for r in runs if r["framework"] == framework]
        means = {f"mean_{key}": _mean([r.get(key) for r in mine]) for key in MEANS}
        reached = sum(r["reached"] for r in mine)
        rows.append(
            {"framework": framework, "seeds": len(mine), "reached": reached, **means}
        )
    ours, theirs = rows
    for key in MEANS[1:]:
        if ours[f"mean_{key}"] and theirs[f"mean_{key}"]:
            theirs[f"trl_over_ours_{key}"] = theirs[f"mean_{key}"] / ours[f"mean_{key}"]
    return rows


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


COLUMNS = [
    ("framework", "framework"), ("seed", "seed"), ("reached", "reached target"),
    ("steps_to_target", "steps"), ("seconds_to_target", "seconds"),
    ("common_steps", "shared steps"),
    ("seconds_per_common_step", "s/step, shared steps"),
    ("target_steps", "steps until both at target"),
    ("seconds_per_step_to_target", "s/step, until both at target"),
    ("last_step", "last eval step"),
    ("last_accuracy_greedy", "last greedy acc."),
    ("last_accuracy_sampled", "last sampled acc."), ("warm_up_seconds", "warm-up s"),
]  # fmt: skip
SUMMARY_COLUMNS = [
    ("framework", "framework"), ("seeds", "seeds"), ("reached", "reached"),
    ("mean_steps_to_target", "mean steps"),
    ("mean_seconds_to_target", "mean seconds"),
    ("trl_over_ours_seconds_to_target", "TRL / grpo_lab seconds"),
    ("mean_seconds_per_common_step", "mean s/step, shared steps"),
    ("trl_over_ours_seconds_per_common_step", "TRL / grpo_lab s/step, shared steps"),
    ("mean_seconds_per_step_to_target", "mean s/step, until both at target"),
    ("trl_over_ours_seconds_per_step_to_target",
     "TRL / grpo_lab s/step, until both at target"),
]  # fmt: skip


NOTES = """Notes:

- Both sides start from the same warmed-up weights; the warm-up (grpo_lab's
  supervised warm-up, until a quarter of sampled held-out answers are right) is
  shared and not counted.
- Seconds per step include sampling, rewards and the update on both sides.
  TRL's generation goes through its own `generate` call and bookkeeping;
  grpo_lab's through `grpo_lab.rollouts.hf`.
- grpo_lab runs each prompt once for its group of 8, both when sampling (one
  prefill per distinct prompt, its key/value cache copied to the 8 rows) and
  in the update (`share_prompt_prefix`, the cpu profile's default); TRL runs
  every prompt 8 times. With 6-token prompts and responses of 5 digits plus
  EOS, a group's update runs 5 + 8 × 7 = 61 positions instead of 8 × 12 = 96.
- Both sides run every step. Later steps cost grpo_lab less (more groups are
  all correct, and it does not score groups whose rewards are all equal), so
  time per step is given over two identical step ranges: all steps ("shared
  steps"), and the steps until both runs had reached the target."""


def curves(runs: list[dict]) -> str:
    return "\n".join(
        [
            "Held-out accuracy by step (step: sampled / greedy accuracy; seconds "
            "exclude evaluation):",
            "",
            *(
                curve_line(
                    f"{run['framework']}, seed {run['seed']}", run["evaluations"]
                )
                for run in runs
            ),
        ]
    )


def report(arguments, runs: list[dict]) -> dict:
    config, seeds = base_config(arguments, 0, "run"), arguments.seeds
    return {
        "title": "Time to accuracy against TRL GRPOTrainer (CPU toy task), "
        f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}",
        "description": (
            f"Target: {arguments.accuracy} held-out accuracy (temperature "
            f"{'1' if arguments.accuracy == 'sampled' else '0'}) ≥ "
            f"{arguments.target} on {config.eval_size} prompts, checked every "
            f"{arguments.eval_every} steps, at most {arguments.max_steps} steps; "
            "seconds exclude evaluation and the shared warm-up. Both sides and "
            "every seed start from the same warmed-up weights."
        ),
        "tables": [
            harness.table(COLUMNS, runs),
            harness.table(SUMMARY_COLUMNS, summary_rows(runs), notes=curves(runs)),
        ],
        "notes": NOTES,
        "config": config.to_dict(),
    }


def measure(arguments, save: harness.Save) -> dict:
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        warm_folder = Path(scratch) / "warm"
        warm_config = base_config(arguments, arguments.warm_seed, f"{scratch}/warm-run")
        warm_seconds = warm_start(warm_config, warm_folder)
        for seed in arguments.seeds:
            config = base_config(arguments, seed, f"{scratch}/seed-{seed}")
            for side in (run_ours, run_trl):
                run = side(config, warm_folder, arguments)
                runs.append({**run, "seed": seed, "warm_up_seconds": warm_seconds})
                add_common_step_pace(runs)
                save(report(arguments, runs))
                print(f"{run['framework']}, seed {seed}: {run['last_step']} steps")
    return report(arguments, runs)


def main(argv=None) -> dict | None:
    return harness.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
