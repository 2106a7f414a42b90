"""The course's commands of ``grpo-lab``: student copies, grading, the
instructor's kit.

    grpo-lab student-notebooks OUT_DIR [--source notebooks]
    grpo-lab notebooks DIR [--force]                      # the student copies
    grpo-lab grade SUBMISSIONS_DIR --out grades.csv [-j N]
    grpo-lab instructor kit KIT [--source CHECKOUT]      # solutions, key, answers

Like every command, each imports what it needs when it runs, so that
``grpo-lab --help`` answers at once.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from grpo_lab.errors import UserError


def add_course_commands(commands: Any, common: argparse.ArgumentParser) -> None:
    """The course's subcommands, in the order ``grpo-lab --help`` lists them."""
    _add_student_notebooks_command(commands, common)
    _add_notebooks_command(commands, common)
    _add_grade_command(commands, common)
    _add_instructor_command(commands, common)


def _add_student_notebooks_command(
    commands: Any, common: argparse.ArgumentParser
) -> None:
    """``grpo-lab student-notebooks`` and its arguments."""
    notebooks_parser = commands.add_parser(
        "student-notebooks",
        parents=[common],
        help="write copies of the notebooks with exercise solutions removed",
    )
    notebooks_parser.add_argument("out_dir", metavar="OUT_DIR")
    notebooks_parser.add_argument(
        "--source",
        default=None,
        help="folder of solution notebooks (default: ./notebooks if it exists, "
        "else the notebooks shipped with the package)",
    )


def _add_notebooks_command(commands: Any, common: argparse.ArgumentParser) -> None:
    """``grpo-lab notebooks`` and its arguments."""
    copy_parser = commands.add_parser(
        "notebooks",
        parents=[common],
        help="write the student copies of the course notebooks into DIR",
    )
    copy_parser.add_argument("out_dir", metavar="DIR")
    copy_parser.add_argument(
        "--force", action="store_true", help="overwrite notebooks already in DIR"
    )


def _add_grade_command(commands: Any, common: argparse.ArgumentParser) -> None:
    """``grpo-lab grade`` and its arguments."""
    grade_parser = commands.add_parser(
        "grade",
        parents=[common],
        help="grade submitted notebooks (one folder per student) against the "
        "course's checks",
    )
    grade_parser.add_argument("submissions_dir", metavar="SUBMISSIONS_DIR")
    grade_parser.add_argument("--out", required=True, help="the CSV file to write")
    grade_parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds one exercise may take (default: 60)",
    )
    grade_parser.add_argument(
        "--notebooks",
        default=None,
        help="folder of the course notebooks whose checks grade (default: a "
        "checkout's notebooks/; from an installed wheel, KIT/notebooks)",
    )
    grade_parser.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=1,
        help="notebooks graded at a time, each in its own kernel (default: 1)",
    )
    grade_parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar"
    )


def _add_instructor_command(commands: Any, common: argparse.ArgumentParser) -> None:
    """``grpo-lab instructor`` and its arguments."""
    instructor_parser = commands.add_parser(
        "instructor",
        parents=[common],
        help="write the instructor's kit (solved notebooks, solutions key, model "
        "answers) from a checkout of the course",
    )
    instructor_parser.add_argument("action", choices=("kit",))
    instructor_parser.add_argument("out_dir", metavar="KIT")
    instructor_parser.add_argument(
        "--source",
        default=None,
        metavar="CHECKOUT",
        help="the course's checkout (default: the one grpo_lab is imported from)",
    )
    instructor_parser.add_argument(
        "--force", action="store_true", help="overwrite a kit already in KIT"
    )


def run_student_notebooks(arguments: argparse.Namespace) -> int:
    """``grpo-lab student-notebooks OUT_DIR``: strip solutions into OUT_DIR."""
    from grpo_lab.instructor.shipped_notebooks import shipped_notebooks_dir

    try:
        from grpo_lab.instructor.student import write_student_notebooks
    except ModuleNotFoundError as error:
        if error.name != "nbformat":
            raise
        raise UserError(
            "student-notebooks needs nbformat, which is not installed",
            "pip install nbformat; the lab and dev extras include it",
        ) from error
    if arguments.source is not None:
        source = Path(arguments.source)
    elif Path("notebooks").is_dir():
        source = Path("notebooks")
    else:
        try:
            source = shipped_notebooks_dir()
        except FileNotFoundError as error:
            raise UserError(str(error), "give --source the notebooks") from error
    if not source.is_dir():
        raise UserError(f"{source} is not a folder", "give --source the notebooks")
    written = write_student_notebooks(source, arguments.out_dir)
    print(f"{len(written)} student notebooks written to {arguments.out_dir}")
    return 0


def run_notebooks(arguments: argparse.Namespace) -> int:
    """``grpo-lab notebooks DIR``: write the student copies into DIR."""
    from grpo_lab.instructor.shipped_notebooks import copy_notebooks

    try:
        copied = copy_notebooks(arguments.out_dir, overwrite=arguments.force)
    except (FileNotFoundError, FileExistsError) as error:
        raise UserError(
            str(error), "pass --force to overwrite, or another DIR"
        ) from error
    print(f"{len(copied)} notebooks copied to {arguments.out_dir}")
    return 0


def run_grade(arguments: argparse.Namespace) -> int:
    """``grpo-lab grade SUBMISSIONS_DIR --out grades.csv``: one row per exercise."""
    try:
        from grpo_lab.instructor import grading
    except ModuleNotFoundError as error:
        raise UserError(
            f"grade needs {error.name}, which is not installed",
            "pip install nbformat nbclient ipykernel; the dev extra includes them",
        ) from error
    try:
        grades = grading.grade_submissions(
            arguments.submissions_dir,
            notebooks_dir=arguments.notebooks,
            timeout=arguments.timeout,
            jobs=arguments.jobs,
            progress=not arguments.no_progress,
        )
    except (ValueError, FileNotFoundError) as error:
        raise UserError(
            str(error), "see grpo-lab grade --help for the folder layout"
        ) from error
    grading.write_grades_csv(grades, arguments.out)
    counts = {o: sum(g.outcome == o for g in grades) for o in grading.OUTCOMES}
    summary = ", ".join(f"{n} {o}" for o, n in counts.items())
    print(f"{len(grades)} grades ({summary}) written to {arguments.out}")
    return 0


def run_instructor(arguments: argparse.Namespace) -> int:
    """``grpo-lab instructor kit KIT``: solved notebooks, key and answers."""
    from grpo_lab.instructor.instructor_kit import write_kit

    try:
        written = write_kit(arguments.out_dir, arguments.source, arguments.force)
    except (ValueError, FileExistsError) as error:
        raise UserError(str(error), "see grpo-lab instructor --help") from error
    print(f"instructor's kit ({len(written)} files) written to {arguments.out_dir}")
    return 0


COURSE_COMMANDS = {
    "student-notebooks": run_student_notebooks,
    "notebooks": run_notebooks,
    "grade": run_grade,
    "instructor": run_instructor,
}
