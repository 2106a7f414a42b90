"""The doctor's rules for on-policy distillation: a teacher off its distribution,
and a KL that falls while the task reward stays flat.

Both read the distillation diagnostics the update logs
(:func:`grpo_lab.distillation.distillation_token_loss`): the token means of the
sampled tokens' log-probs under the teacher and the student, and of the
per-token KL d_t. A run without a teacher logs none of them, and both rules
skip it.
"""

from __future__ import annotations

from grpo_lab.training.doctor.findings import (
    Finding,
    Run,
    mean,
    reward_is_flat,
    series,
    values,
)
from grpo_lab.training.doctor.findings import evidence as _evidence
from grpo_lab.training.doctor.findings import persistent as _persistent

# The mean of log pi_T - log pi over the student's own tokens is minus the
# reverse KL, so the teacher is always somewhat below the student. Two nats per
# token means the teacher gives the student's tokens under e^-2 (about 14%) of
# the student's probability, geometric mean: it is scoring text it would not
# write itself (another task, split or prompt format) ...
TEACHER_GAP = 2.0
# ... and the gap is stuck when the last third of the run keeps more than half
# of the first third's: distillation is not closing it.
GAP_KEPT = 0.5
# The KL "falls" when the last third's mean is at most half the first third's.
KL_FALL = 0.5
# A trend needs a few points.
MIN_TREND_STEPS = 4

TEACHER_KEY = "loss/teacher_log_prob_mean"
STUDENT_KEY = "loss/student_log_prob_mean"
KL_KEY = "loss/distillation_kl_mean"


def _thirds(numbers: list[float]) -> tuple[float, float]:
    third = max(1, len(numbers) // 3)
    return mean(numbers[:third]), mean(numbers[-third:])


def rule_teacher_off_distribution(run: Run) -> Finding | str | None:
    """The teacher's log-probs on the student's tokens far below the student's,
    and staying there."""
    teacher = dict(series(run, TEACHER_KEY))
    student = dict(series(run, STUDENT_KEY))
    gaps = [
        (step, student[step] - teacher[step]) for step in teacher if step in student
    ]
    if not gaps:
        return f"no {TEACHER_KEY} and {STUDENT_KEY} logged (no teacher)"
    far = _persistent(gaps, TEACHER_GAP)
    first, last = _thirds(values(gaps))
    if not far or last < GAP_KEPT * first:
        return None
    return Finding(
        "teacher-off-distribution",
        "warning",
        f"{STUDENT_KEY} - {TEACHER_KEY}",
        _evidence(far),
        f"{len(far)} of {len(gaps)} steps had the teacher at least "
        f"{TEACHER_GAP:g} nats per token below the student on the student's own "
        f"tokens (first third {first:.3g}, last third {last:.3g})",
        "the teacher scores states it never visits: it was trained on another "
        "task, split or prompt format, so its per-token signal is noise on the "
        "student's samples",
        "check that the teacher solves this task in this prompt format (its own "
        "eval accuracy); warm the student up on the teacher's format; keep the "
        "task reward beside the teacher (distillation_task_reward)",
    )


def rule_kl_falls_reward_flat(run: Run) -> Finding | str | None:
    """The distillation KL falls while the task reward stays flat: the student
    copies the teacher's surface, not its skill."""
    points = series(run, KL_KEY)
    if not points:
        return f"no {KL_KEY} logged (no teacher)"
    if len(points) < MIN_TREND_STEPS:
        return f"fewer than {MIN_TREND_STEPS} steps logged {KL_KEY}"
    first, last = _thirds(values(points))
    if not (first > 0 and last <= KL_FALL * first):
        return None
    if not reward_is_flat(run, min_steps=MIN_TREND_STEPS):
        return None
    return Finding(
        "kl-falls-reward-flat",
        "warning",
        KL_KEY,
        _evidence(points),
        f"the distillation KL fell from {first:.3g} to {last:.3g} (first and last "
        "third of the run) while the task reward stayed flat",
        "the student matches the teacher where matching is cheap (format, "
        "style, common tokens) and not on the tokens that decide the answer; or "
        "the teacher itself does not solve the task",
        "measure the teacher's own accuracy; add the task reward "
        "(distillation_task_reward) so the answer's tokens carry the reward's "
        "signal too",
    )
