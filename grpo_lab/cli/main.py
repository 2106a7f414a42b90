"""``grpo-lab``: train a run, plot its curves, push it to the Hub, write notebooks.

    grpo-lab train [--profile cpu|gpu] [--lr 3e-4 ...]   # flags = TrainConfig fields
    grpo-lab train --config run.yaml [--lr 3e-4 ...]      # a file, flags on top
    grpo-lab train --resume RUN_DIR [--steps 80]          # continue a run exactly
    grpo-lab plot RUN_DIR                                 # RUN_DIR/curves.png
    grpo-lab push RUN_DIR REPO_ID [--private]             # model + card to the Hub
    grpo-lab merge RUN_DIR --out DIR                      # a LoRA run, merged
    grpo-lab notebooks DIR [--source FOLDER]             # the student copies
    grpo-lab doctor RUN_DIR [--json]                      # name a run's problems
    grpo-lab export trl|verl --profile gpu --out DIR      # a launch folder for TRL/verl
    grpo-lab export trl --gpus 8 --nodes 2 [--vllm-mode server] --out DIR
    grpo-lab grade SUBMISSIONS_DIR --out grades.csv      # grade submitted notebooks
    grpo-lab instructor kit KIT [--source CHECKOUT]      # solutions, key, answers

Every ``train`` flag is generated from a ``TrainConfig`` field, so the command
line and ``TrainConfig.for_profile(profile, **overrides)`` are the same thing.
A config file (YAML or JSON) maps the same field names to values; flags
override it, and the profile it names (or ``--profile``) supplies the rest.

A problem the user can fix (a setting, a path, a data file, the run folder's
state, a full disk) prints one line, ``grpo-lab train: <what> (<how to fix>)``,
and exits with status 2; ``--debug`` shows its traceback as well. Any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import functools
import importlib
import importlib.util
import json
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_lab.cli import flags as cli_flags
from grpo_lab.cli.config_file import (
    FIELD_NAMES,
    FLAG_TABLE,
    USAGE_HINT,
    read_config_file,
)
from grpo_lab.cli.course import COURSE_COMMANDS, add_course_commands
from grpo_lab.errors import UserError

# Torch, the core and training are imported inside the commands that use them,
# so that ``grpo-lab --help`` and ``grpo-lab CMD --help`` answer at once; the
# flags come from cli_flags' table (TrainConfig's fields, written as data).
if TYPE_CHECKING:
    from grpo_lab.training.config import TrainConfig

RESUMABLE_FLAGS = ", ".join(
    "--" + name.replace("_", "-") for name in FLAG_TABLE["resumable_fields"]
)
PROFILE_HELP = (
    "Each setting's help ends with its default, the cpu profile's value, and "
    "each other profile's value where it differs; --profile (else "
    "$GRPO_LAB_PROFILE, else the machine) chooses which apply."
)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with ``(default: X)`` on every flag that has a default
    and does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, argparse.SUPPRESS):
            return text
        if action.option_strings:
            return f"{text} (default: %(default)s)"
        return text


def add_config_arguments(
    parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()
) -> None:
    """One ``--flag`` per TrainConfig field (:func:`cli_flags.add_config_flags`)."""
    cli_flags.add_config_flags(parser, FLAG_TABLE, exclude=exclude)


def build_parser() -> argparse.ArgumentParser:
    """The ``grpo-lab`` argument parser with its commands."""
    parser = argparse.ArgumentParser(
        prog="grpo-lab",
        description="Group Relative Policy Optimization, hands on.",
        formatter_class=HelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error that is otherwise printed as one line",
    )
    commands = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=functools.partial(  # every command's help shows defaults
            argparse.ArgumentParser, formatter_class=HelpFormatter
        ),
    )
    _add_train_command(commands, common)
    _add_plot_command(commands, common)
    _add_push_command(commands, common)
    _add_merge_command(commands, common)
    _add_doctor_command(commands, common)
    _add_export_command(commands, common)
    add_course_commands(commands, common)
    return parser


def _add_train_command(commands: Any, common: argparse.ArgumentParser) -> None:
    """``grpo-lab train`` and its arguments."""
    train_parser = commands.add_parser(
        "train",
        parents=[common],
        help="run GRPO (cpu profile: a tiny model learns to reverse digits)",
        description="Run GRPO. Flags override the config file, which overrides "
        "the profile's defaults. " + PROFILE_HELP,
    )
    train_parser.add_argument(
        "--config",
        metavar="FILE",
        dest="config_file",
        default=None,
        help="a YAML or JSON file of TrainConfig fields (e.g. 'lr: 3.0e-4'); "
        "flags override its values, its profile (or --profile) supplies the rest",
    )
    _add_from_trl_flag(train_parser)
    train_parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        dest="resume_dir",
        default=None,
        help="continue RUN_DIR from its latest checkpoint with its config.json; "
        f"only {RESUMABLE_FLAGS} may change",
    )
    train_parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar"
    )
    train_parser.add_argument(
        "--push-to-hub",
        metavar="REPO_ID",
        default=None,
        help="when the run ends, push its final model and a model card to this "
        "Hugging Face Hub repository (as grpo-lab push does)",
    )
    add_config_arguments(train_parser, exclude=("resume",))


def _add_plot_command(commands: Any, common: argparse.ArgumentParser) -> None:
    """``grpo-lab plot`` and its arguments."""
    plot_parser = commands.add_parser(
        "plot",
        parents=[common],
        help="draw RUN_DIR/metrics.jsonl into RUN_DIR/curves.png",
    )
    plot_parser.add_argument("run_dir", metavar="RUN_DIR")


def _add_push_command(commands: Any, common: argparse.ArgumentParser) -> None:
    """``grpo-lab push`` and its arguments."""
    push_parser = commands.add_parser(
        "push",
        parents=[common],
        help="upload RUN_DIR/final_model with a model card to the Hugging Face Hub",
        description="Write a model card into RUN_DIR/final_model, create REPO_ID "
        "if needed and upload the folder (token: HF_TOKEN or hf auth login).",
    )
    push_parser.add_argument("run_dir", metavar="RUN_DIR")
    push_parser.add_argument("repo_id", metavar="REPO_ID", help="user/name on the Hub")
    push_parser.add_argument(
        "--private", action="store_true", help="create the repository as private"
    )
    push_parser.add_argument(
        "--revision",
        default=None,
        help="the branch to push to (created when missing; default: main)",
    )


def _add_merge_command(commands: Any, common: argparse.ArgumentParser) -> None:
    """``grpo-lab merge`` and its arguments."""
    merge_parser = commands.add_parser(
        "merge",
        parents=[common],
        help="write a LoRA run's adapter merged into its base model (W + alpha/r BA)",
        description="Open RUN_DIR's adapter (final_model, or --adapter DIR such "
        "as a checkpoint folder) on the run's base model, merge it and save a "
        "plain transformers model and tokenizer to --out.",
    )
    merge_parser.add_argument("run_dir", metavar="RUN_DIR")
    merge_parser.add_argument(
        "--out", metavar="DIR", dest="out_dir", required=True, help="a new folder"
    )
    merge_parser.add_argument(
        "--adapter",
        metavar="DIR",
        default=None,
        help="the adapter folder (default: RUN_DIR/final_model)",
    )


def _add_doctor_command(commands: Any, common: argparse.ArgumentParser) -> None:
    """``grpo-lab doctor`` and its arguments."""
    doctor_parser = commands.add_parser(
        "doctor",
        parents=[common],
        help="name a run's problems (truncation, no signal, entropy, lr, ...)",
        description="Read RUN_DIR/metrics.jsonl (grpo-lab train), a TRL "
        "trainer_state.json (its folder, a checkpoint-* folder or the file) or "
        "a verl metric log (console output or the file logger's JSONL) and "
        "print each problem found: its rule, evidence, likely cause and a fix. "
        "Exits 1 when a finding is an error, 2 when RUN_DIR cannot be read.",
    )
    doctor_parser.add_argument("run_dir", metavar="RUN_DIR")
    doctor_parser.add_argument(
        "--json", action="store_true", help="print the findings as JSON"
    )


def _add_export_command(commands: Any, common: argparse.ArgumentParser) -> None:
    """``grpo-lab export`` and its arguments."""
    export_parser = commands.add_parser(
        "export",
        parents=[common],
        help="write a launch folder that trains this config on TRL or verl",
        description="Translate a config (profile + file + flags, as for train) "
        "into a launch folder for TRL's GRPOTrainer or verl; a setting the other "
        "library cannot run is refused by name. " + PROFILE_HELP,
    )
    export_parser.add_argument("target", choices=("trl", "verl"))
    export_parser.add_argument(
        "source_run",
        nargs="?",
        metavar="RUN_DIR",
        default=None,
        help="a run folder: export its config, starting from its warm-up's "
        "checkpoint (instead of profile, --config and flags)",
    )
    export_parser.add_argument(
        "--out", metavar="DIR", dest="out_dir", required=True, help="a new folder"
    )
    export_parser.add_argument(
        "--config",
        metavar="FILE",
        dest="config_file",
        default=None,
        help="a YAML or JSON file of TrainConfig fields; flags override it",
    )
    export_parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        metavar="N",
        help="GPUs per machine (default: 1); N x M processes in all",
    )
    export_parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        metavar="M",
        help="machines (default: 1): accelerate's machine ranks, verl's Ray cluster",
    )
    export_parser.add_argument(
        "--vllm-mode",
        choices=("colocate", "server"),
        default="colocate",
        help="trl only: vLLM beside each process, or TRL's `trl vllm-serve` server",
    )
    export_parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar"
    )
    _add_from_trl_flag(export_parser)
    export_parser.set_defaults(resume_dir=None)
    add_config_arguments(export_parser, exclude=("resume",))


def _add_from_trl_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--from-trl",
        action="store_true",
        help="read --config's keys as TRL GRPOConfig names (learning_rate, "
        "num_generations, max_steps, beta, epsilon, ...) and translate them "
        "through the TRL translation table",
    )


# --- the config to train with -------------------------------------------------------


def train_config(arguments: argparse.Namespace) -> TrainConfig:
    """The config to train with: profile + file + flags, or a saved run + flags.

    Raises :class:`UserError` for any problem with the settings.
    """
    try:
        if arguments.resume_dir is not None:
            return resumed_config(arguments)
        values = {}
        if arguments.config_file is not None:
            from_trl = getattr(arguments, "from_trl", False)
            values = read_config_file(arguments.config_file, from_trl=from_trl)
        merged = {**values, **_flags(arguments)}  # flags win over the file
        from grpo_lab.training.config import config_from_arguments

        return config_from_arguments(argparse.Namespace(**merged))
    except UserError:
        raise
    except ValueError as error:
        raise UserError(str(error), USAGE_HINT) from error


def resumed_config(arguments: argparse.Namespace) -> TrainConfig:
    """RUN_DIR/config.json with the given flags, checked as a resume of that run."""
    from grpo_lab.training import run_dir as run_dirs
    from grpo_lab.training.config import TrainConfig

    run_dir = Path(arguments.resume_dir)
    if arguments.config_file is not None:
        raise UserError(
            "--config cannot be combined with --resume",
            "a resumed run keeps RUN_DIR/config.json; give the settings that may "
            f"change ({RESUMABLE_FLAGS}) as flags",
        )
    flags = _flags(arguments)
    if "run_dir" in flags and Path(flags["run_dir"]).resolve() != run_dir.resolve():
        raise UserError(
            f"--run-dir {flags['run_dir']} differs from --resume {run_dir}",
            "a resumed run stays in its folder; drop --run-dir",
        )
    saved = run_dirs.read_saved_config(run_dir)
    config = TrainConfig.from_dict(
        {**saved, **flags, "resume": True, "run_dir": str(run_dir)}
    )
    run_dirs.check_resume_config(saved, config, run_dir / run_dirs.CONFIG_FILE)
    return config


def _flags(arguments: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig fields given on the command line (no others are set)."""
    return {k: v for k, v in vars(arguments).items() if k in FIELD_NAMES}


# --- what can be checked before training starts -------------------------------------


def check_can_train(config: TrainConfig) -> None:
    """The task, its data, the model path, the device and the backend, or UserError.

    These fail inside ``train`` only after the run folder is written; checked
    here, a mistake costs one line and leaves no folder behind. The machine's
    own checks (device, backend) come first: they cost nothing, while the task
    and the model may reach for the Hub.
    """
    _check_device(config)
    _check_backend(config)
    _check_task(config)
    _check_model(config)


def _check_task(config: TrainConfig) -> None:
    from grpo_lab.tasks import get_task

    try:
        task = get_task(config.task, **config.task_options)
        task.eval(config.eval_size, seed=config.seed)
        task.train(config.prompts_per_step, seed=config.seed)
    except (ValueError, TypeError, OSError, ImportError, RuntimeError) as error:
        raise UserError(
            f"task {config.task!r} with options {config.task_options}: {error}",
            "check --task, --task-options and the dataset files they name",
        ) from error


def _check_model(config: TrainConfig) -> None:
    from grpo_lab.models import check_model_path

    if config.model == "tiny":
        return
    try:
        check_model_path(config.model)
    except FileNotFoundError as error:
        raise UserError(
            str(error), "give --model an existing model folder or a hub name"
        ) from error


def _check_device(config: TrainConfig) -> None:
    from grpo_lab.training.parsers import DEVICE_HINT, check_device_available

    try:
        check_device_available(config.device)
    except ValueError as error:
        raise UserError(str(error), DEVICE_HINT) from error


def _check_backend(config: TrainConfig) -> None:
    if config.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UserError(
            "backend 'vllm' needs the vllm package",
            "pip install 'grpo-lab[vllm]' on a CUDA machine (or vLLM's CPU build: "
            "make .venv-vllm/.grpo-lab-installed), or use --backend hf",
        )


# --- commands -------------------------------------------------------------------------


def run_train(arguments: argparse.Namespace) -> int:
    """``grpo-lab train``: train, then print where the run went."""
    from grpo_lab.training import checkpoint as checkpoints
    from grpo_lab.training import run_dir as run_dirs
    from grpo_lab.training.config.profiles import sampler_note
    from grpo_lab.training.loop import train

    config = train_config(arguments)
    check_can_train(config)
    note = sampler_note(config.profile, config.backend)
    if note is not None:
        print(note, file=sys.stderr)
    if arguments.push_to_hub is not None:  # before training, not after it
        from grpo_lab.integrations.hub import check_repo_id, hub_token

        check_repo_id(arguments.push_to_hub)
        hub_token()
    if config.run_dir is None:  # named here, so that an interruption can name it
        config = dataclasses.replace(
            config, run_dir=str(run_dirs.new_run_dir(config.task))
        )
    try:
        result = train(config, progress=not arguments.no_progress)
    except KeyboardInterrupt:
        if checkpoints.list_checkpoints(config.run_dir):
            advice = f"continue with: grpo-lab train --resume {config.run_dir}"
        else:
            advice = f"no checkpoint was written yet; {config.run_dir} can be deleted"
        print(f"\ninterrupted; {advice}", file=sys.stderr)
        return 130
    except (OSError, ImportError) as error:
        raise UserError(_one_line(error), _os_error_fix(error)) from error
    finally:
        run_dirs.release_run_dir(config.run_dir)
    _print_summary(result.run_dir, result.history)
    if arguments.push_to_hub is not None:
        from grpo_lab.integrations.hub import push_run

        print(f"pushed to {push_run(result.run_dir, arguments.push_to_hub)}")
    return 0


def _os_error_fix(error: BaseException) -> str:
    """How to fix an OSError raised while training (or a missing package)."""
    code = getattr(error, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "free space on that disk, then resume with grpo-lab train --resume"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "choose a folder you can write to as --run-dir"
    if isinstance(error, ImportError):
        return "install the package it names"
    return "check the path, file or connection it names; --debug shows where"


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


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
        raise UserError(str(error), "plot a folder grpo-lab train wrote") from error
    print(f"curves written to {path}")
    return 0


def run_push(arguments: argparse.Namespace) -> int:
    """``grpo-lab push RUN_DIR REPO_ID``: the final model and its card to the Hub."""
    from grpo_lab.integrations.hub import push_run

    url = push_run(
        arguments.run_dir,
        arguments.repo_id,
        private=arguments.private,
        revision=arguments.revision,
    )
    print(f"pushed the final model of {arguments.run_dir} to {url}")
    return 0


def run_merge(arguments: argparse.Namespace) -> int:
    """``grpo-lab merge RUN_DIR --out DIR``: the adapted model as a plain one."""
    from grpo_lab import lora
    from grpo_lab.models import load_pretrained, load_tokenizer
    from grpo_lab.training.config import TrainConfig
    from grpo_lab.training.loop import BASE_MODEL_DIR, FINAL_MODEL_DIR, tiny_model

    run_dir = Path(arguments.run_dir)
    adapter = Path(arguments.adapter or run_dir / FINAL_MODEL_DIR)
    out_dir = Path(arguments.out_dir)
    if not (adapter / "adapter_config.json").is_file():
        raise UserError(
            f"{adapter} holds no LoRA adapter (adapter_config.json)",
            "merge a run trained with --lora-rank > 0, or name its adapter with "
            "--adapter",
        )
    if out_dir.exists():
        raise UserError(f"{out_dir} already exists", "give --out a new folder")
    config = TrainConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    if (run_dir / BASE_MODEL_DIR).is_dir():  # the warmed-up base
        base, _ = load_pretrained(str(run_dir / BASE_MODEL_DIR), dtype=config.dtype)
    elif config.model == "tiny":
        base, _ = tiny_model(config)
    else:
        base, _ = load_pretrained(config.model, dtype=config.dtype)
    lora.merge_adapter_into(base, adapter, out_dir)
    load_tokenizer(str(adapter)).save_pretrained(out_dir)
    print(f"merged model written to {out_dir}")
    return 0


def run_doctor(arguments: argparse.Namespace) -> int:
    """``grpo-lab doctor RUN_DIR``: print the run's problems (``--json``: as JSON);
    exit 1 when a finding is an error."""
    from grpo_lab.training.doctor import diagnose, format_report

    try:
        diagnosis = diagnose(arguments.run_dir)
    except ValueError as error:
        raise UserError(
            _one_line(error), "give the folder or log grpo-lab train, TRL or verl wrote"
        ) from error
    if arguments.json:
        print(json.dumps(diagnosis.to_dict(), indent=2, allow_nan=False))
    else:
        print(format_report(diagnosis))
    return 1 if diagnosis.has_errors else 0


def run_export(arguments: argparse.Namespace) -> int:
    """Write the launch folder of ``grpo-lab export trl|verl [RUN_DIR]``, with a
    bar over its two stages (on a terminal, unless --no-progress)."""
    from tqdm.auto import tqdm

    from grpo_lab.training.checkpoint import quiet_transformers

    with tqdm(
        total=2,
        desc=f"export {arguments.target}",
        unit="stage",
        disable=True if arguments.no_progress else None,
    ) as stages:
        stages.set_postfix_str("reading the settings")
        config = _export_config(arguments)
        stages.update()
        stages.set_postfix_str("writing the launch folder")
        with quiet_transformers():  # the stages bar stands for its shard bar
            written = _write_export(arguments, config)
        stages.update()
    out_dir = Path(arguments.out_dir)
    print(f"wrote {len(written)} files to {out_dir}; see {out_dir / 'README.md'}")
    return 0


def _export_config(arguments: argparse.Namespace):
    """The config ``grpo-lab export`` translates: flags, or a run's warm-up."""
    if arguments.source_run is None:
        config = train_config(arguments)
    else:
        from grpo_lab.integrations.cluster import warmed_up_config

        try:
            config = warmed_up_config(arguments.source_run)
        except ValueError as error:
            raise UserError(
                str(error), "give the folder grpo-lab train wrote"
            ) from error
    return config


def _write_export(arguments: argparse.Namespace, config) -> list:
    """The launch folder written by the target's ``write_launch_folder``."""
    out_dir = Path(arguments.out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} is not an empty folder", "give --out a new folder")
    module = f"grpo_lab.integrations.{arguments.target}.launch"
    # The verl folder is written without verl; TRL's needs trl's GRPOConfig.
    if arguments.target == "trl" and importlib.util.find_spec("trl") is None:
        raise UserError("trl is not installed", "pip install trl==1.16.0")
    writer = importlib.import_module(module).write_launch_folder
    cluster = {"gpus": arguments.gpus, "nodes": arguments.nodes}
    if arguments.target == "trl":
        cluster["vllm_mode"] = arguments.vllm_mode
    elif arguments.vllm_mode != "colocate":
        raise UserError(
            "--vllm-mode is TRL's choice; verl runs its own vLLM engines",
            "leave --vllm-mode out for verl",
        )
    try:
        written = writer(config, out_dir, **cluster)
    except ValueError as error:
        raise UserError(str(error), "see grpo-lab export --help") from error
    except (RuntimeError, OSError) as error:  # the task's data could not be read
        raise UserError(
            _one_line(error), "pass the task's data as a local file"
        ) from error
    return written


COMMANDS = {
    "train": run_train,
    "plot": run_plot,
    "push": run_push,
    "merge": run_merge,
    "doctor": run_doctor,
    "export": run_export,
    **COURSE_COMMANDS,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``grpo-lab`` console script.

    A :class:`UserError` prints ``grpo-lab COMMAND: <what> (<how to fix>)`` and
    returns 2 (with ``--debug`` it is raised, traceback and all).
    """
    parser = build_parser()
    arguments, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(
            f"unrecognized arguments: {' '.join(unknown)}{_flag_hints(unknown)}"
        )
    prefix = f"grpo-lab {arguments.command}"
    try:
        with _warnings_as_lines(prefix):
            return COMMANDS[arguments.command](arguments)
    except UserError as error:
        if arguments.debug:
            raise
        print(f"{prefix}: {_one_line(error)}", file=sys.stderr)
        return 2


def _flag_hints(unknown: list[str]) -> str:
    """ "; TRL's `learning_rate` is grpo_lab's `lr` (...)" for each unknown
    ``--flag`` that is a TRL GRPOConfig name; "" when none is."""
    hints = []
    for token in unknown:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            if name not in FIELD_NAMES:
                from grpo_lab.integrations.trl.names import trl_name_hint

                hint = trl_name_hint(name)
                if hint is not None:
                    flag = "--" + hint.split("grpo_lab's `")[1].split("`")[0]
                    hints.append(f"{hint}: use {flag.replace('_', '-')}")
    return "".join(f"; {hint}" for hint in hints)


@contextlib.contextmanager
def _warnings_as_lines(prefix: str) -> Iterator[None]:
    """Print the package's checkpoint warnings as ``PREFIX: warning: ...`` lines."""
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        # Only a loaded checkpoint module can have warned of a checkpoint.
        checkpoints = sys.modules.get("grpo_lab.training.checkpoint")
        if checkpoints and issubclass(category, checkpoints.CheckpointWarning):
            print(f"{prefix}: warning: {message}", file=sys.stderr)
        else:
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = original


if __name__ == "__main__":
    sys.exit(main())
