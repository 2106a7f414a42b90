"""``grpo-lab``: train a run, plot its curves, write student notebooks.

    grpo-lab train [--profile cpu|gpu] [--lr 3e-4 ...]   # flags = TrainConfig fields
    grpo-lab train --resume RUN_DIR [--steps 80]          # continue a run exactly
    grpo-lab plot RUN_DIR                                 # RUN_DIR/curves.png
    grpo-lab student-notebooks OUT_DIR [--source notebooks]
    grpo-lab notebooks DIR [--force]                      # copy the course notebooks

Every ``train`` flag is generated from a ``TrainConfig`` field, so the command
line and ``TrainConfig.for_profile(profile, **overrides)`` are the same thing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from grpo_lab.training.config import (
    TrainConfig,
    add_config_arguments,
    config_from_arguments,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``grpo-lab`` argument parser with its four commands."""
    parser = argparse.ArgumentParser(
        prog="grpo-lab", description="Group Relative Policy Optimization, hands on."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser(
        "train",
        help="run GRPO (cpu profile: a tiny model learns to reverse digits)",
        description="Run GRPO. Flags override the profile's defaults.",
    )
    train_parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        dest="resume_dir",
        default=None,
        help="continue RUN_DIR from its latest checkpoint, with its config.json "
        "(other flags override it, e.g. --steps to train longer)",
    )
    train_parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar"
    )
    add_config_arguments(train_parser, exclude=("resume",))
    plot_parser = commands.add_parser(
        "plot", help="draw RUN_DIR/metrics.jsonl into RUN_DIR/curves.png"
    )
    plot_parser.add_argument("run_dir", metavar="RUN_DIR")
    notebooks_parser = commands.add_parser(
        "student-notebooks",
        help="write copies of the notebooks with exercise solutions removed",
    )
    notebooks_parser.add_argument("out_dir", metavar="OUT_DIR")
    notebooks_parser.add_argument(
        "--source",
        default=None,
        help="folder of solution notebooks (default: ./notebooks if it exists, "
        "else the notebooks shipped with the package)",
    )
    copy_parser = commands.add_parser(
        "notebooks", help="copy the course notebooks (with solutions) into DIR"
    )
    copy_parser.add_argument("out_dir", metavar="DIR")
    copy_parser.add_argument(
        "--force", action="store_true", help="overwrite notebooks already in DIR"
    )
    return parser


def train_config(arguments: argparse.Namespace) -> TrainConfig:
    """The config to train with: profile + flags, or a saved run + flags."""
    if arguments.resume_dir is None:
        return config_from_arguments(arguments)
    config_file = Path(arguments.resume_dir) / "config.json"
    if not config_file.exists():
        raise SystemExit(f"grpo-lab: --resume: {config_file} does not exist")
    saved = json.loads(config_file.read_text(encoding="utf-8"))
    flags = {
        key: value
        for key, value in vars(arguments).items()
        if key in saved and key not in ("resume", "run_dir")
    }
    return TrainConfig.from_dict(
        {**saved, **flags, "resume": True, "run_dir": arguments.resume_dir}
    )


def run_train(arguments: argparse.Namespace) -> int:
    """``grpo-lab train``: train, then print where the run went."""
    from grpo_lab.training.loop import train

    try:
        config = train_config(arguments)
    except ValueError as error:
        raise SystemExit(f"grpo-lab train: {error}") from error
    try:
        result = train(config, progress=not arguments.no_progress)
    except KeyboardInterrupt:
        print(
            "\ninterrupted; continue with: grpo-lab train --resume "
            f"{config.run_dir or 'RUN_DIR'}",
            file=sys.stderr,
        )
        return 130
    _print_summary(result.run_dir, result.history)
    return 0


def _print_summary(run_dir: Path, history: list[dict]) -> None:
    evaluations = [r for r in history if "eval/accuracy_greedy" in r]
    if evaluations:
        first, last = evaluations[0], evaluations[-1]
        print(
            "held-out accuracy greedy "
            f"{first['eval/accuracy_greedy']:.3f} -> {last['eval/accuracy_greedy']:.3f}"
            f", sampled {first['eval/accuracy_sampled']:.3f} -> "
            f"{last['eval/accuracy_sampled']:.3f} (steps {first['step']} -> "
            f"{last['step']})"
        )
    print(f"run written to {run_dir}")


def run_plot(arguments: argparse.Namespace) -> int:
    """``grpo-lab plot RUN_DIR``: save RUN_DIR/curves.png."""
    from grpo_lab.teaching.curves import save_run_curves

    try:
        path = save_run_curves(arguments.run_dir)
    except ValueError as error:
        raise SystemExit(f"grpo-lab plot: {error}") from error
    print(f"curves written to {path}")
    return 0


def run_student_notebooks(arguments: argparse.Namespace) -> int:
    """``grpo-lab student-notebooks OUT_DIR``: strip solutions into OUT_DIR."""
    from grpo_lab.teaching.shipped_notebooks import shipped_notebooks_dir

    try:
        from grpo_lab.teaching.student import write_student_notebooks
    except ModuleNotFoundError as error:
        if error.name != "nbformat":
            raise
        raise SystemExit(
            "grpo-lab student-notebooks: needs nbformat, which is not installed; "
            "pip install nbformat (the lab and dev extras include it)"
        ) from error
    if arguments.source is not None:
        source = Path(arguments.source)
    elif Path("notebooks").is_dir():
        source = Path("notebooks")
    else:
        try:
            source = shipped_notebooks_dir()
        except FileNotFoundError as error:
            raise SystemExit(f"grpo-lab student-notebooks: {error}") from error
    if not source.is_dir():
        raise SystemExit(f"grpo-lab student-notebooks: {source} is not a folder")
    written = write_student_notebooks(source, arguments.out_dir)
    print(f"{len(written)} student notebooks written to {arguments.out_dir}")
    return 0


def run_notebooks(arguments: argparse.Namespace) -> int:
    """``grpo-lab notebooks DIR``: copy the shipped notebooks into DIR."""
    from grpo_lab.teaching.shipped_notebooks import copy_notebooks

    try:
        copied = copy_notebooks(arguments.out_dir, overwrite=arguments.force)
    except (FileNotFoundError, FileExistsError) as error:
        raise SystemExit(f"grpo-lab notebooks: {error}") from error
    print(f"{len(copied)} notebooks copied to {arguments.out_dir}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``grpo-lab`` console script."""
    arguments = build_parser().parse_args(argv)
    commands = {
        "train": run_train,
        "plot": run_plot,
        "student-notebooks": run_student_notebooks,
        "notebooks": run_notebooks,
    }
    return commands[arguments.command](arguments)


if __name__ == "__main__":
    sys.exit(main())
