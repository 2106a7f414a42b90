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
time per step is also compared over identical step ranges. Differences that remain: the prompts are drawn from the same
generator but in a different order (grpo_lab draws 32 fresh prompts per step,
TRL shuffles a dataset of the same size), the random streams of the samplers
differ, and TRL's advantage is (r - mean) / (std + 1e-4) with the unbiased std.

    .venv/bin/python benchmarks/time_to_accuracy.py
    .venv/bin/python benchmarks/time_to_accuracy.py --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from bench_utils import (
    DEFAULT_OUT_DIR,
    command_line,
    format_table,
    machine_info,
    write_json,
)

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

SMOKE_OVERRIDES = {
    "rollout_batch_size": 8,
    "train_batch_size": 8,
    "group_size": 4,
    "eval_size": 4,
    "sft_max_steps": 2,
    "sft_eval_every": 1,
    "sft_eval_size": 4,
    "sft_batch_size": 4,
}


def base_config(arguments, seed: int, run_dir: Path) -> TrainConfig:
    overrides = SMOKE_OVERRIDES if arguments.smoke else {}
    return TrainConfig.for_profile(
        "cpu",
        seed=seed,
        steps=arguments.max_steps,
        eval_every=arguments.eval_every,
        checkpoint_every=0,
        run_dir=str(run_dir),
        **overrides,
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


def run_ours(config: TrainConfig, warm_folder: Path, target: float, measure: str):
    config = dataclasses.replace(config, model=str(warm_folder), sft_max_steps=0)
    result = train(config, progress=False)
    elapsed, evaluations = 0.0, []
    for record in result.history:
        if "step" not in record:
            continue
        elapsed += record.get("time/step_seconds", 0.0)
        if "eval/accuracy_greedy" in record:
            evaluations.append(
                {
                    "step": record["step"],
                    "seconds": elapsed,
                    "accuracy_greedy": record["eval/accuracy_greedy"],
                    "accuracy_sampled": record["eval/accuracy_sampled"],
                }
            )
    return summarize("grpo_lab", evaluations, target, measure)


class HeldOutAccuracy:
    """A TRL callback: grpo_lab's evaluate() every k steps (may stop at the target)."""

    def __init__(self, config, task, tokenizer, target, measure, stop_at_target):
        self.config, self.task, self.tokenizer = config, task, tokenizer
        self.target, self.measure = target, measure
        self.stop_at_target = stop_at_target
        self.eval_examples = task.eval(config.eval_size, seed=config.seed)
        self.evaluations: list[dict] = []
        self.started = 0.0
        self.excluded = 0.0

    def callback(self):
        from transformers import TrainerCallback

        outer = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                outer.started = time.perf_counter()
                outer.evaluate(0, model)  # the accuracy training starts from

            def on_step_end(self, args, state, control, model=None, **kwargs):
                reached = outer.evaluate(state.global_step, model)
                if reached and outer.stop_at_target:
                    control.should_training_stop = True

        return _Callback()

    def evaluate(self, step: int, model) -> bool:
        if step % self.config.eval_every and step != self.config.steps:
            return False
        now = time.perf_counter()
        training_seconds = now - self.started - self.excluded
        backend = make_backend("hf", model, self.tokenizer)
        policy = Policy(model, self.tokenizer, None, backend)
        was_training = model.training
        record = evaluate(self.config, self.task, policy, self.eval_examples, step)
        model.train(was_training)
        self.excluded += time.perf_counter() - now
        self.evaluations.append(
            {
                "step": step,
                "seconds": training_seconds,
                "accuracy_greedy": record["eval/accuracy_greedy"],
                "accuracy_sampled": record["eval/accuracy_sampled"],
            }
        )
        return record[f"eval/accuracy_{self.measure}"] >= self.target


def run_trl(
    config: TrainConfig,
    warm_folder: Path,
    target: float,
    measure: str,
    out_dir: Path,
    stop_at_target: bool,
):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    task = get_task(config.task, **config.task_options)
    tokenizer = AutoTokenizer.from_pretrained(warm_folder)
    model = AutoModelForCausalLM.from_pretrained(warm_folder, dtype=torch.float32)
    examples = task.train(config.prompts_per_step * config.steps, config.seed)
    dataset = Dataset.from_list(
        [{"prompt": e.prompt, "ground_truth": e.ground_truth} for e in examples]
    )

    def reward(prompts, completions, ground_truth, **kwargs):
        return [
            task.reward_fn(completion, truth)["reward"]
            for completion, truth in zip(completions, ground_truth)
        ]

    accuracy = HeldOutAccuracy(config, task, tokenizer, target, measure, stop_at_target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=trl_config(config, out_dir),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[accuracy.callback()],
        )
        trainer.train()
    return summarize("TRL", accuracy.evaluations, target, measure)


def trl_config(config: TrainConfig, out_dir: Path):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out_dir),
        seed=config.seed,
        max_steps=config.steps,
        per_device_train_batch_size=config.rollout_batch_size,
        num_generations=config.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        learning_rate=config.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=getattr(config, "lr_warmup_steps", 0),
        weight_decay=config.weight_decay,
        adam_beta1=0.9,
        adam_beta2=config.adam_beta2,
        max_grad_norm=config.max_grad_norm,
        beta=0.0,
        loss_type="grpo",
        scale_rewards="group",
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=0,
        max_completion_length=config.max_new_tokens,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1_000_000,
        disable_dropout=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def summarize(
    framework: str, evaluations: list[dict], target: float, measure: str
) -> dict:
    key = f"accuracy_{measure}"
    reached = next((e for e in evaluations if e[key] >= target), None)
    last = evaluations[-1] if evaluations else {}
    return {
        "framework": framework,
        "reached": reached is not None,
        "steps_to_target": reached["step"] if reached else None,
        "seconds_to_target": reached["seconds"] if reached else None,
        "seconds_per_step": (
            last["seconds"] / last["step"] if last.get("step") else None
        ),
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
        common = max(shared)
        both_reached = [run["steps_to_target"] for run in same_seed]
        to_target = max(both_reached) if all(both_reached) else None
        for run in same_seed:
            run["common_steps"] = common
            run["seconds_per_common_step"] = _pace(run, common)
            if to_target in shared:
                run["target_steps"] = to_target
                run["seconds_per_step_to_target"] = _pace(run, to_target)


def _pace(run: dict, steps: int) -> float:
    seconds = next(e["seconds"] for e in run["evaluations"] if e["step"] == steps)
    return seconds / steps


def summary_rows(runs: list[dict]) -> list[dict]:
    rows = []
    for framework in ("grpo_lab", "TRL"):
        mine = [r for r in runs if r["framework"] == framework]
        reached = [r for r in mine if r["reached"]]
        rows.append(
            {
                "framework": framework,
                "seeds": len(mine),
                "reached": len(reached),
                "mean_steps_to_target": _mean([r["steps_to_target"] for r in reached]),
                "mean_seconds_to_target": _mean(
                    [r["seconds_to_target"] for r in reached]
                ),
                "mean_seconds_per_common_step": _mean(
                    [r.get("seconds_per_common_step") for r in mine]
                ),
                "mean_seconds_per_step_to_target": _mean(
                    [r.get("seconds_per_step_to_target") for r in mine]
                ),
            }
        )
    ours, theirs = rows
    for key in (
        "mean_seconds_to_target",
        "mean_seconds_per_common_step",
        "mean_seconds_per_step_to_target",
    ):
        if ours[key] and theirs[key]:
            theirs[key.replace("mean_", "trl_over_ours_")] = theirs[key] / ours[key]
    return rows


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--warm-seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument(
        "--accuracy", choices=("sampled", "greedy"), default="sampled",
        help="which held-out accuracy must reach --target",
    )  # fmt: skip
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument(
        "--stop-at-target", action="store_true",
        help="stop TRL at the target (default: both sides run every step)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT_DIR / "time_to_accuracy.json"
    )
    parser.add_argument("--smoke", action="store_true", help="a few tiny steps")
    arguments = parser.parse_args(argv)
    if arguments.smoke:
        arguments.seeds, arguments.max_steps, arguments.eval_every = [0], 2, 1
    return arguments


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


def main(argv=None) -> None:
    arguments = parse_arguments(argv)
    machine = machine_info()  # the load when the benchmark starts
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        warm_folder = scratch / "warm"
        warm_seconds = warm_start(
            base_config(arguments, arguments.warm_seed, scratch / "warm-run"),
            warm_folder,
        )
        for seed in arguments.seeds:
            config = base_config(arguments, seed, scratch / f"ours-{seed}")
            for framework in ("grpo_lab", "TRL"):
                if framework == "grpo_lab":
                    run = run_ours(
                        config, warm_folder, arguments.target, arguments.accuracy
                    )
                else:
                    run = run_trl(
                        config,
                        warm_folder,
                        arguments.target,
                        arguments.accuracy,
                        scratch / f"trl-{seed}",
                        arguments.stop_at_target,
                    )
                runs.append({**run, "seed": seed, "warm_up_seconds": warm_seconds})
                add_common_step_pace(runs)
                print(format_table(runs[-1:], COLUMNS), flush=True)
                # Written after every run: an interrupted benchmark keeps its results.
                write_json(
                    arguments.out, results_payload(arguments, argv, machine, runs)
                )
    payload = results_payload(arguments, argv, machine, runs)
    print(format_table(runs, COLUMNS))
    print(format_table(payload["summary"], SUMMARY_COLUMNS))
    print(f"wrote {arguments.out}")


def results_payload(arguments, argv, machine: dict, runs: list[dict]) -> dict:
    return {
        "benchmark": "time_to_accuracy",
        "command": command_line(__file__, argv),
        "machine": machine,
        "settings": {k: v for k, v in vars(arguments).items() if k != "out"},
        "config": base_config(arguments, 0, Path("run")).to_dict(),
        "description": (
            f"Target: {arguments.accuracy} held-out accuracy (temperature "
            f"{'1' if arguments.accuracy == 'sampled' else '0'}) ≥ "
            f"{arguments.target} on "
            f"{base_config(arguments, 0, Path('run')).eval_size} prompts, checked "
            f"every {arguments.eval_every} steps, at most {arguments.max_steps} "
            "steps; seconds exclude evaluation and the shared warm-up. "
            "Both sides and every seed start from the same warmed-up weights."
        ),
        "runs": runs,
        "summary": summary_rows(runs),
    }


if __name__ == "__main__":
    sys.exit(main())
