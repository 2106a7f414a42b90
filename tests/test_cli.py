"""The grpo-lab command line: flags, config files, resume, one-line errors, plot."""

from __future__ import annotations

import contextlib
import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from test_run_dir import held_by_another_process  # one lock-holding child

from grpo_lab.cli import main as cli
from grpo_lab.errors import UserError
from grpo_lab.training import loop
from grpo_lab.training import run_dir as run_dirs
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.metrics import append_metrics

# A run that finishes in about a second: no warm-up, a 1-layer model, 16 rollouts.
TINY = [
    "--profile", "cpu", "--tiny-hidden-size", "32", "--tiny-num-layers", "1",
    "--tiny-intermediate-size", "64", "--task-options", '{"n_digits": 3}',
    "--max-new-tokens", "5", "--steps", "1", "--rollout-batch-size", "16",
    "--group-size", "4", "--train-batch-size", "16", "--eval-size", "4",
    "--eval-every", "1", "--sft-max-steps", "0", "--checkpoint-every", "1",
    "--no-progress",
]  # fmt: skip
NEW = ["--run-dir", "{tmp}/new"]


def on_jsonl(name: str) -> list[str]:
    """A tiny gsm8k run on the JSONL file ``{tmp}/name``."""
    options = json.dumps({"path": "{tmp}/" + name})
    return [*TINY, "--task", "gsm8k", "--task-options", options, *NEW]


def parse(argv):
    return cli.build_parser().parse_args(argv)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 2-step run (checkpoints at steps 1 and 2), copied by each test."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    config = cli.train_config(parse(["train", *TINY, "--steps", "2"]))
    config = TrainConfig.from_dict({**config.to_dict(), "run_dir": str(run_dir)})
    loop.train(config, progress=False)
    run_dirs.release_run_dir(run_dir)
    return run_dir


def copy_run(run_dir: Path, to: Path) -> Path:
    shutil.copytree(run_dir, to)
    return to


# --- flags, config files, resume ------------------------------------------------------


def test_train_flags_build_the_config():
    config = cli.train_config(parse(["train", "--profile", "cpu", "--lr", "3e-4"]))
    assert config == TrainConfig.for_profile("cpu", lr=3e-4)


def test_help_lists_the_config_file_and_debug_flags(capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(["train", "--help"])
    help_text = capsys.readouterr().out
    assert raised.value.code == 0
    assert "--config FILE" in help_text and "--debug" in help_text
    assert "--resume RUN_DIR" in help_text


def test_a_yaml_config_file_with_flags_on_top(tmp_path):
    path = tmp_path / "run.yaml"
    # YAML reads 3e-4 (no dot) as a string; the float field takes it as a float.
    path.write_text(
        "profile: cpu\nlr: 3e-4\nsteps: 7\nmax_grad_norm: null\n"
        "task_options:\n  n_digits: 4\n"
    )
    config = cli.train_config(parse(["train", "--config", str(path), "--steps", "9"]))
    assert config == TrainConfig.for_profile(
        "cpu", lr=3e-4, steps=9, max_grad_norm=None, task_options={"n_digits": 4}
    )


def test_a_json_config_file_names_the_profile_unless_the_flag_does(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"profile": "gpu", "steps": 5, "lr": 1e-5}))
    from_file = cli.train_config(parse(["train", "--config", str(path)]))
    assert from_file == TrainConfig.for_profile("gpu", steps=5, lr=1e-5)
    flagged = cli.train_config(
        parse(["train", "--config", str(path), "--profile", "cpu", "--lr", "2e-4"])
    )
    assert flagged == TrainConfig.for_profile("cpu", steps=5, lr=2e-4)


def test_a_config_file_trains(tmp_path, capsys):
    settings = cli.train_config(parse(["train", *TINY])).to_dict()
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({k: v for k, v in settings.items() if k != "resume"}))
    run_dir = tmp_path / "run"
    argv = ["train", "--config", str(path), "--run-dir", str(run_dir), "--steps", "2"]
    assert cli.main([*argv, "--no-progress"]) == 0
    assert json.loads((run_dir / "config.json").read_text())["steps"] == 2
    assert "run written to" in capsys.readouterr().out


def test_resume_loads_the_saved_config_and_applies_allowed_flags(tmp_path):
    saved = TrainConfig.for_profile("cpu", lr=3e-4, steps=10, run_dir="elsewhere")
    (tmp_path / "config.json").write_text(saved.to_json())
    config = cli.train_config(
        parse(["train", "--resume", str(tmp_path), "--steps", "20"])
    )
    assert config.lr == 3e-4 and config.steps == 20
    assert config.resume and config.run_dir == str(tmp_path)
    with pytest.raises(UserError, match=r"lr 0\.0003 -> 0\.001"):
        cli.train_config(parse(["train", "--resume", str(tmp_path), "--lr", "1e-3"]))
    with pytest.raises(UserError, match="does not exist"):
        cli.train_config(parse(["train", "--resume", str(tmp_path / "missing")]))


def test_a_resume_with_allowed_flags_is_recorded(finished_run, tmp_path, capsys):
    run_dir = copy_run(finished_run, tmp_path / "run")
    argv = ["train", "--resume", str(run_dir), "--steps", "3", "--eval-every", "2"]
    assert cli.main([*argv, "--no-progress"]) == 0
    (record,) = run_dirs.read_resumes(run_dir)
    assert record["changes"] == {
        "steps": {"from": 2, "to": 3},
        "eval_every": {"from": 1, "to": 2},
    }
    saved = json.loads((run_dir / "config.json").read_text())
    assert (saved["steps"], saved["eval_every"], saved["lr"]) == (3, 2, 3e-4)
    assert "steps 0 -> 3" in capsys.readouterr().out


# --- errors: one line for the user's, a traceback for bugs ----------------------------

# Mistakes a user makes: each must print one line "grpo-lab train: ..." and exit
# 2, with no traceback and without starting a run.
# {tmp}: the test's folder; {run}: a finished run; {corrupt}: that run with every
# checkpoint overwritten; {bare}: that run without checkpoints; {locked}: that run,
# locked by another process ({pid}); {full}: torch.save fails as on a full disk.
EXPORT = ["export", "trl", "--profile", "gpu", "--out", "{tmp}/export"]
BAD_INVOCATIONS = {
    "unknown task": ([*TINY, "--task", "nosuch", *NEW], "task must be one of"),
    "unknown task option": (
        [*TINY, "--task-options", '{"n_digit": 3}', *NEW],
        "unknown option(s) ['n_digit']",
    ),
    "bad task option": (
        [*TINY, "--task-options", '{"n_digits": 0}', *NEW],
        "n_digits must be an int in [3, 6], got 0",
    ),
    "missing dataset file": (
        on_jsonl("missing.jsonl"),
        "path must name an existing JSONL file, got '{tmp}/missing.jsonl'",
    ),
    "bad JSONL": (
        on_jsonl("bad.jsonl"),
        "{tmp}/bad.jsonl:2 is not valid JSON",
    ),
    "JSONL record without its answer": (
        on_jsonl("no_answer.jsonl"),
        "missing ['answer']",
    ),
    "eval_size beyond the eval split": (
        [*TINY, "--eval-size", "100000", *NEW],
        "n must be at most the eval split size",
    ),
    "group_size not dividing": (
        [*TINY, "--group-size", "3", *NEW],
        "group_size must divide rollout_batch_size (16), got 3",
    ),
    "negative lr": (
        [*TINY, "--lr", "-1", *NEW],
        "lr must be a finite number in (0.0, inf), got -1.0",
    ),
    "off-policy without importance weights": (
        [*TINY, "--train-batch-size", "8", *NEW],
        "importance_reweighting_method must be",
    ),
    "run dir holding a run": ([*TINY, "--run-dir", "{run}"], "already holds a run"),
    "run dir that is a file": (
        [*TINY, "--run-dir", "{tmp}/a_file"],
        "run_dir '{tmp}/a_file' cannot be created: File exists",
    ),
    "run dir under a file": (
        [*TINY, "--run-dir", "{tmp}/a_file/run"],
        "cannot be created: Not a directory",
    ),
    "missing relative model path": (
        [*TINY, "--model", "./no/such/model", *NEW],
        "model path './no/such/model' does not exist",
    ),
    "missing absolute model path": (
        [*TINY, "--model", "{tmp}/no_model", *NEW],
        "model path '{tmp}/no_model' does not exist",
    ),
    "unavailable device": (
        [*TINY, "--device", "cuda:99", *NEW],
        "device 'cuda:99' is not available",
    ),
    "unknown device": (
        [*TINY, "--device", "gpu", *NEW],
        "device must be a torch device such as 'cpu' or 'cuda:0', got 'gpu'",
    ),
    "resume of a missing folder": (
        ["--resume", "{tmp}/missing"],
        "{tmp}/missing/config.json does not exist",
    ),
    "resume of a folder without config.json": (
        ["--resume", "{tmp}/empty"],
        "{tmp}/empty/config.json does not exist",
    ),
    "resume with another lr": (
        ["--resume", "{run}", "--lr", "1e-3"],
        "lr 0.0003 -> 0.001",
    ),
    "resume with another task": (
        ["--resume", "{run}", "--task", "addition", "--task-options", "{}"],
        "task 'reverse' -> 'addition'",
    ),
    "resume with another group size and seed": (
        ["--resume", "{run}", "--group-size", "8", "--seed", "3"],
        "seed 0 -> 3, group_size 4 -> 8",
    ),
    "resume into another run dir": (
        ["--resume", "{run}", "--run-dir", "{tmp}/other"],
        "--run-dir {tmp}/other differs from --resume {run}",
    ),
    "resume with every checkpoint corrupt": (
        ["--resume", "{corrupt}"],
        "no checkpoint in {corrupt}/checkpoints loads",
    ),
    "resume with metrics but no checkpoint": (
        ["--resume", "{bare}"],
        "has 3 metric lines but no checkpoint",
    ),
    "resume of a run another process writes": (
        ["--resume", "{locked}"],
        "is in use by process {pid}",
    ),
    "missing config file": (
        ["--config", "{tmp}/missing.yaml", *NEW],
        "config file {tmp}/missing.yaml cannot be read: No such file",
    ),
    "config file with an unknown key": (
        ["--config", "{tmp}/unknown_key.yaml", *NEW],
        "has an unknown key 'group-size' (did you mean 'group_size'?",
    ),
    "config file that is not a mapping": (
        ["--config", "{tmp}/list.yaml", *NEW],
        "must map field names to values, got list",
    ),
    "config file that is not JSON": (
        ["--config", "{tmp}/broken.json", *NEW],
        "is not valid JSON",
    ),
    "config file value of the wrong type": (
        ["--config", "{tmp}/bad_type.yaml", *NEW],
        "lr in config file {tmp}/bad_type.yaml must be float, got 'fast'",
    ),
    "config file with --resume": (
        ["--resume", "{run}", "--config", "{tmp}/bad_type.yaml"],
        "--config cannot be combined with --resume",
    ),
    "full disk at a checkpoint": (
        [*TINY, "--run-dir", "{full}"],
        "could not write checkpoint {full}/checkpoints/step_000001.pt: RuntimeError: "
        "[enforce fail at inline_container.cc",
    ),
    # grpo-lab export (argv starts with "export"): a setting TRL lacks, the cpu
    # profile's supervised warm-up, a folder that already holds files.
    "export of an objective TRL lacks": (
        [*EXPORT, "--importance-reweighting-method", "gmpo"],
        "importance_reweighting_method 'gmpo' cannot run on TRL's GRPOTrainer",
    ),
    "export of a warm-up": (
        ["export", "trl", "--profile", "cpu", "--out", "{tmp}/export"],
        "sft_max_steps 400 cannot run on TRL's GRPOTrainer",
    ),
    "export into a folder holding files": (
        [*EXPORT[:-1], "{run}"],
        "is not an empty folder",
    ),
}


def bad_invocation_places(tmp_path: Path, finished_run: Path) -> dict[str, str]:
    """The files and folders the bad invocations name, made in ``tmp_path``."""
    (tmp_path / "bad.jsonl").write_text('{"question": "1+1", "answer": "#### 2"}\n{x\n')
    (tmp_path / "no_answer.jsonl").write_text('{"question": "1+1"}\n' * 3)
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "unknown_key.yaml").write_text("profile: cpu\ngroup-size: 4\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "bad_type.yaml").write_text("profile: cpu\nlr: fast\n")
    run = copy_run(finished_run, tmp_path / "run")
    corrupt = copy_run(finished_run, tmp_path / "corrupt")
    for path in (corrupt / "checkpoints").glob("*.pt"):
        path.write_bytes(b"corrupt")
    bare = copy_run(finished_run, tmp_path / "bare")
    shutil.rmtree(bare / "checkpoints")
    locked = copy_run(finished_run, tmp_path / "locked")
    places = {"tmp": tmp_path, "run": run, "corrupt": corrupt, "bare": bare}
    places |= {"locked": locked, "full": tmp_path / "full"}
    return {name: str(path) for name, path in places.items()}


def fill(text: str, places: dict[str, str]) -> str:
    for name, value in places.items():
        text = text.replace("{" + name + "}", value)
    return text


def test_there_are_at_least_twenty_bad_invocations():
    assert len(BAD_INVOCATIONS) >= 20


def full_disk_save(payload, handle):
    raise RuntimeError(
        "[enforce fail at inline_container.cc:626] . unexpected pos 4160 vs 4054"
    )


@pytest.mark.parametrize("name", BAD_INVOCATIONS)
def test_a_bad_invocation_prints_one_line_and_exits_2(
    name, finished_run, tmp_path, monkeypatch, capsys
):
    argv, expected = BAD_INVOCATIONS[name]
    places = bad_invocation_places(tmp_path, finished_run)
    with contextlib.ExitStack() as stack:
        if "{locked}" in argv:
            holder = stack.enter_context(held_by_another_process(places["locked"]))
            places["pid"] = str(holder)
        if "{full}" in argv:
            monkeypatch.setattr(torch, "save", full_disk_save)
        command = argv if argv[0] == "export" else ["train", *argv]
        code = cli.main([fill(a, places) for a in command])
    error = capsys.readouterr().err
    lines = [line for line in error.splitlines() if ": warning: " not in line]
    assert code == 2 and "Traceback" not in error
    assert len(lines) == 1 and lines[0].startswith(f"grpo-lab {command[0]}: "), error
    assert fill(expected, places) in lines[0]
    assert lines[0].endswith(")")  # "... (how to fix it)"


def test_every_corrupt_checkpoint_is_warned_about_on_its_own_line(
    finished_run, tmp_path, capsys
):
    places = bad_invocation_places(tmp_path, finished_run)
    assert cli.main(["train", "--resume", places["corrupt"]]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("grpo-lab train: warning: checkpoint ")
    assert "step_000002.pt does not load" in lines[0]
    assert "trying step_000001.pt" in lines[0]
    assert "step_000001.pt does not load" in lines[1] and len(lines) == 3


def test_debug_raises_the_user_error_with_its_cause(tmp_path):
    with pytest.raises(UserError, match="task must be one of") as raised:
        cli.main(["train", *TINY, "--task", "nosuch", "--debug"])
    assert isinstance(raised.value.__cause__, ValueError)
    with pytest.raises(run_dirs.RunDirError, match="cannot be created"):
        (tmp_path / "a_file").write_text("x")
        cli.main(["train", *TINY, "--run-dir", str(tmp_path / "a_file"), "--debug"])


def test_a_bug_keeps_its_traceback(tmp_path, monkeypatch):
    def broken_train(config, progress=True):
        raise ValueError("a bug inside training")

    monkeypatch.setattr(loop, "train", broken_train)
    with pytest.raises(ValueError, match="a bug inside training"):
        cli.main(["train", *TINY, "--run-dir", str(tmp_path / "run")])


def test_an_interrupted_run_says_how_to_go_on(tmp_path, monkeypatch, capsys):
    def interrupted(config, progress=True):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "train", interrupted)
    assert cli.main(["train", *TINY, "--run-dir", str(tmp_path / "run")]) == 130
    assert "no checkpoint was written yet" in capsys.readouterr().err


def test_unknown_flags_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as raised:
        cli.main(["train", "--no-such-flag"])
    assert raised.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


# --- the other commands -----------------------------------------------------------------


def test_train_runs_and_reports(tmp_path, capsys):
    code = cli.main(["train", *TINY, "--run-dir", str(tmp_path / "run")])
    assert code == 0
    output = capsys.readouterr().out
    assert "held-out accuracy greedy" in output and "run written to" in output
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["steps"] == 1 and saved["run_dir"] == str(tmp_path / "run")
    assert not run_dirs.holds_run_dir(tmp_path / "run")


def test_plot_writes_curves(tmp_path, capsys):
    append_metrics(tmp_path, {"step": 1, "train/reward_mean": 0.5})
    assert cli.main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").exists()
    assert cli.main(["plot", str(tmp_path / "empty")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("grpo-lab plot: ") and "no metrics" in error


def test_notebooks_calls_the_folder_update(tmp_path, monkeypatch, capsys):
    # The module the command imports (another test may have imported it anew).
    student = importlib.import_module("grpo_lab.instructor.student")

    calls = []
    update = student.StudentFolderUpdate(added=[tmp_path / "out" / "00_a.ipynb"])
    monkeypatch.setattr(
        student,
        "update_student_folder",
        lambda source, out: calls.append((source, out)) or update,
    )
    source = str(tmp_path / "notebooks")
    assert cli.main(["notebooks", str(tmp_path / "out"), "--source", source]) == 0
    assert calls == [(source, str(tmp_path / "out"))]
    out = capsys.readouterr().out
    assert out.startswith("added 00_a.ipynb\n") and "1 notebooks added" in out
    monkeypatch.undo()
    missing = str(tmp_path / "missing")
    assert cli.main(["notebooks", "out", "--source", missing]) == 2
    error = capsys.readouterr().err
    assert "source_dir must be a directory" in error and error.count("\n") == 1


def test_export_shows_its_stages_on_a_terminal(tmp_path, capsys, monkeypatch):
    argv = ["export", "trl", "--profile", "smoke", "--sft-max-steps", "0", "--out"]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli.main([*argv, str(tmp_path / "shown")]) == 0
    bar = capsys.readouterr().err
    assert "export trl" in bar and "2/2" in bar and "writing the launch folder" in bar
    assert cli.main([*argv, str(tmp_path / "quiet"), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_a_model_folder_is_copied_with_a_byte_bar(tmp_path, capsys):
    from grpo_lab.integrations.cluster import copy_folder

    source = tmp_path / "weights"
    (source / "sub").mkdir(parents=True)
    (source / "model.safetensors").write_bytes(b"\0" * 3000)
    (source / "sub" / "config.json").write_text("{}")
    copy_folder(source, tmp_path / "copy", progress=True)
    assert (tmp_path / "copy" / "model.safetensors").read_bytes() == b"\0" * 3000
    assert (tmp_path / "copy" / "sub" / "config.json").read_text() == "{}"
    bar = capsys.readouterr().err
    assert "copying weights" in bar and "3.00k/3.00k" in bar


@pytest.mark.parametrize(
    ("argv", "setting"),
    [
        (["--lora-lr", "1e-3"], "lora_lr"),
        (["--lora-alpha", "8"], "lora_alpha"),
        (["--no-lora-train-norms"], "lora_train_norms"),
        (
            ["--lora-rank", "4", "--lora-target-modules", "no_such_proj"],
            "lora_target_modules",
        ),
        (["--lora-rank", "1000000000"], "lora_rank"),
    ],
)
def test_lora_flags_that_cannot_act_are_one_line_and_exit_2(
    argv, setting, tmp_path, capsys
):
    assert cli.main(["train", *argv, "--run-dir", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"grpo-lab train: {setting} ") and "got" in error, error
    assert len(error.splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_config_file_s_lora_lr_without_a_rank_is_refused(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("lora_lr: 1.0e-4\n")
    assert cli.main(["train", "--config", str(path)]) == 2
    assert "lora_lr needs lora_rank > 0" in capsys.readouterr().err
