"""Do two revisions train the same run? Same metrics and byte-identical weights.

    .venv/bin/python benchmarks/same_run.py --revisions main HEAD --steps 3
    .venv/bin/python benchmarks/same_run.py --revisions main WORKTREE
    .venv/bin/python benchmarks/same_run.py --run-dirs runs/a runs/b

With ``--revisions`` each revision is exported (``git archive``; ``WORKTREE``:
the checkout as it is, uncommitted edits included) into a temporary folder, and
``grpo-lab train --profile cpu --seed 0`` runs from there with that copy of
``grpo_lab`` first on the path, plus any ``--steps`` / ``--sft-max-steps`` and
extra flags after ``--``. Then (and with ``--run-dirs``, on two finished runs):

- every line of ``metrics.jsonl`` must hold the same keys and values, ignoring
  the keys that start with ``--ignore-prefix`` (``time/``: wall-clock timings);
- every weights file of the runs (``*.safetensors``, ``*.bin``) must be byte
  for byte the same, and every checkpoint ``*.pt`` must hold the same objects,
  tensors exactly equal, except the entries named by ``--pt-ignore`` (default:
  ``rng``, the process's random states, which differ between two runs of one
  revision too, and ``config.run_dir``, each run's own folder). A ``.pt``
  archive's bytes carry a per-save id, so its contents are compared.

Prints each difference and exits 1 if there is any, 0 if the runs agree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def export_revision(revision: str, folder: Path) -> None:
    """The tree of ``revision`` (or the working tree, ``WORKTREE``) in ``folder``."""
    folder.mkdir(parents=True)
    if revision == "WORKTREE":
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO_ROOT, capture_output=True, check=True,
        ).stdout.decode()  # fmt: skip
        for name in filter(None, listed.split("\0")):
            source = REPO_ROOT / name
            if source.is_file():
                target = folder / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(source.read_bytes())
        return
    archive = folder.with_suffix(".tar")
    subprocess.run(
        ["git", "archive", "--format=tar", "-o", str(archive), revision],
        cwd=REPO_ROOT, check=True,
    )  # fmt: skip
    with tarfile.open(archive) as tar:
        tar.extractall(folder, filter="data")
    archive.unlink()


def train(source: Path, run_dir: Path, flags: list[str]) -> None:
    """One cpu-profile run, seed 0, of the ``grpo_lab`` in ``source``."""
    command = [
        sys.executable, "-m", "grpo_lab.cli", "train", "--profile", "cpu",
        "--seed", "0", "--run-dir", str(run_dir), "--no-progress", *flags,
    ]  # fmt: skip
    environment = {**os.environ, "PYTHONPATH": str(source)}
    print("==", " ".join(command), f"(from {source.name})", flush=True)
    subprocess.run(command, cwd=source, env=environment, check=True)


def metric_lines(run_dir: Path, ignore: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [
        {key: value for key, value in record.items() if not key.startswith(ignore)}
        for record in records
    ]


def metric_differences(first: Path, second: Path, ignore: str) -> list[str]:
    ours, theirs = metric_lines(first, ignore), metric_lines(second, ignore)
    differences = []
    if len(ours) != len(theirs):
        differences.append(f"metrics.jsonl: {len(ours)} lines against {len(theirs)}")
    for number, (a, b) in enumerate(zip(ours, theirs), start=1):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                where = "first" if key in a else "second"
                differences.append(f"line {number}: {key} only in the {where} run")
            elif json.dumps(a[key]) != json.dumps(b[key]):
                differences.append(f"line {number}: {key} {a[key]!r} != {b[key]!r}")
    return differences


def weight_files(run_dir: Path) -> dict[str, Path]:
    return {
        str(path.relative_to(run_dir)): path
        for path in sorted(run_dir.rglob("*"))
        if path.is_file() and path.name.endswith((*WEIGHT_SUFFIXES, ".pt"))
    }


def same_pt_contents(first: Path, second: Path, ignore: list[str]) -> bool:
    """Whether two torch.save files hold equal objects (tensors exactly equal),
    leaving out the dotted entries ``ignore`` (``rng``, ``config.run_dir``)."""
    import torch

    def without_ignored(payload: dict) -> dict:
        payload = dict(payload)
        for dotted in ignore:
            *parents, last = dotted.split(".")
            holder = payload
            for name in parents:
                holder[name] = dict(holder.get(name, {}))
                holder = holder[name]
            holder.pop(last, None)
        return payload

    def same(a: object, b: object) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(a, b)
            )
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(map(same, a, b))
        return type(a) is type(b) and a == b

    load = {"map_location": "cpu", "weights_only": False}
    return same(
        without_ignored(torch.load(first, **load)),
        without_ignored(torch.load(second, **load)),
    )


def weight_differences(
    first: Path, second: Path, pt_ignore: list[str]
) -> tuple[list[str], int]:
    ours, theirs = weight_files(first), weight_files(second)
    differences = [
        f"{name}: only in the {'first' if name in ours else 'second'} run"
        for name in sorted(set(ours) ^ set(theirs))
    ]
    compared = 0
    for name in sorted(set(ours) & set(theirs)):
        compared += 1
        if name.endswith(".pt"):
            if not same_pt_contents(ours[name], theirs[name], pt_ignore):
                differences.append(f"{name}: different contents")
        elif ours[name].read_bytes() != theirs[name].read_bytes():
            differences.append(f"{name}: different bytes")
    return differences, compared


def compare(first: Path, second: Path, ignore: str, pt_ignore: list[str]) -> int:
    differences = metric_differences(first, second, ignore)
    lines = len(metric_lines(first, ignore))
    weight_report, compared = weight_differences(first, second, pt_ignore)
    differences += weight_report
    for line in differences:
        print("DIFFERENT", line)
    print(
        f"{lines} metric lines (keys starting {ignore!r} ignored), {compared} "
        f"weight/checkpoint files compared ({pt_ignore} left out of the .pt): "
        + ("the runs agree" if not differences else f"{len(differences)} differences")
    )
    return 1 if differences or compared == 0 else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--revisions", nargs=2, metavar=("FIRST", "SECOND"))
    which.add_argument("--run-dirs", nargs=2, type=Path, metavar=("FIRST", "SECOND"))
    parser.add_argument("--steps", type=int, help="--steps of each run")
    parser.add_argument("--sft-max-steps", type=int, help="--sft-max-steps of each")
    parser.add_argument("--ignore-prefix", default="time/")
    parser.add_argument("--pt-ignore", nargs="*", default=["rng", "config.run_dir"])
    parser.add_argument("--keep", type=Path, help="keep the runs in this folder")
    parser.add_argument("extra", nargs="*", help="more train flags, after --")
    arguments = parser.parse_args(argv)
    if arguments.run_dirs:
        return compare(
            *arguments.run_dirs, arguments.ignore_prefix, arguments.pt_ignore
        )
    flags = list(arguments.extra)
    if arguments.steps is not None:
        flags += ["--steps", str(arguments.steps)]
    if arguments.sft_max_steps is not None:
        flags += ["--sft-max-steps", str(arguments.sft_max_steps)]
    with tempfile.TemporaryDirectory() as scratch:
        root = arguments.keep or Path(scratch)
        runs = []
        for index, revision in enumerate(arguments.revisions):
            source = root / f"source_{index}"
            export_revision(revision, source)
            runs.append(root / f"run_{index}")
            train(source, runs[-1], flags)
        return compare(*runs, arguments.ignore_prefix, arguments.pt_ignore)


if __name__ == "__main__":
    sys.exit(main())
