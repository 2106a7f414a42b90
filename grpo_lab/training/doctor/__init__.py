"""The run doctor: read a finished (or running) run's metrics and name its problems.

``diagnose(path)`` reads a grpo_lab run folder (``metrics.jsonl`` and
``config.json``), a TRL ``GRPOTrainer`` output (``trainer_state.json``, its
``log_history`` mapped onto this package's metric names: :data:`TRL_KEYS`) or a
verl metric log (the console's ``step:N - key:value`` lines or the file
logger's JSONL: :data:`VERL_KEYS`), and applies each rule of :data:`RULES` to
the per-step series. A finding names its rule, a severity (``error``: the run
cannot learn as it is; ``warning``: it may learn, badly; ``info``: it looks
wrong and is not), the evidence (the steps and values that tripped it), a
one-line likely cause and what to try. A rule whose metrics the run did not log
is skipped, and the report says so.

Damaged files are read line by line: each line that cannot be used is named,
with its line number, under ``unreadable``, and the rest is diagnosed.
``grpo-lab doctor RUN_DIR`` prints the report (``--json`` for tools) and exits 1
when a finding is an error.
"""

from __future__ import annotations

from pathlib import Path

from grpo_lab.training.doctor import (
    asynchrony,
    config_lint,
    distillation,
    dynamics,
    rules,
    turns,
)
from grpo_lab.training.doctor.findings import (
    SEVERITIES,
    Diagnosis,
    Finding,
    Rule,
    Run,
    reward_change,
    reward_is_flat,
    series,
)
from grpo_lab.training.doctor.reading import (
    CONFIG_FILE,
    TRL_KEYS,
    TRL_STATE_FILE,
    VERL_KEYS,
    load_run,
    trl_record,
)

__all__ = [
    "CONFIG_FILE",
    "RULES",
    "SEVERITIES",
    "TRL_KEYS",
    "TRL_STATE_FILE",
    "VERL_KEYS",
    "Diagnosis",
    "Finding",
    "Run",
    "diagnose",
    "format_report",
    "load_run",
    "reward_change",
    "reward_is_flat",
    "series",
    "trl_record",
]

RULES: dict[str, Rule] = {
    "responses-truncated": rules.rule_responses_truncated,
    "no-signal": rules.rule_no_signal,
    "ratio-not-one-on-policy": rules.rule_ratio_on_policy,
    "sampler-gap-jump": rules.rule_sampler_gap_jump,
    "entropy-collapse": rules.rule_entropy_collapse,
    "entropy-explosion": rules.rule_entropy_explosion,
    "clip-fraction-high": rules.rule_clip_fraction_high,
    "reward-flat-loss-moves": rules.rule_reward_flat_loss_moves,
    "reward-flat-with-signal": dynamics.rule_reward_flat_with_signal,
    "non-finite": rules.rule_non_finite,
    "learning-rate-out-of-range": rules.rule_learning_rate,
    "gradient-norm-out-of-range": rules.rule_gradient_norm,
    "loss-near-zero": dynamics.rule_loss_near_zero,
    "kl-spike": dynamics.rule_kl_spike,
    "group-sanity": dynamics.rule_group_sanity,
    "late-reward-collapse": dynamics.rule_late_reward_collapse,
    "length-runaway": dynamics.rule_length_runaway,
    "length-collapse": dynamics.rule_length_collapse,
    "steps-out-of-order": dynamics.rule_steps_out_of_order,
    "tool-output-trained": turns.rule_tool_output_trained,
    "turn-budget-truncates": turns.rule_turn_budget_truncates,
    "staleness-at-bound": asynchrony.rule_staleness_at_bound,
    "many-dropped-groups": asynchrony.rule_many_dropped_groups,
    "dropped-groups-long": asynchrony.rule_dropped_groups_long,
    "correction-mostly-clipped": asynchrony.rule_correction_mostly_clipped,
    "config-lint": config_lint.rule_config_lint,
    "teacher-off-distribution": distillation.rule_teacher_off_distribution,
    "kl-falls-reward-flat": distillation.rule_kl_falls_reward_flat,
}


def diagnose(path: str | Path | Run) -> Diagnosis:
    """Every rule applied to the run at ``path`` (see :func:`load_run`)."""
    run = path if isinstance(path, Run) else load_run(path)
    diagnosis = Diagnosis(
        str(run.source), run.kind, len(run.history), unreadable=list(run.unreadable)
    )
    for name, rule in RULES.items():
        try:
            outcome = rule(run)
        except Exception as error:  # a rule's bug must not hide the other rules
            outcome = f"the rule failed on this run ({type(error).__name__}: {error})"
        if isinstance(outcome, Finding):
            diagnosis.findings.append(outcome)
        elif isinstance(outcome, str):
            diagnosis.skipped[name] = outcome
    diagnosis.findings.sort(key=lambda f: SEVERITIES.index(f.severity))
    return diagnosis


def format_report(diagnosis: Diagnosis) -> str:
    """The diagnosis as plain text: one block per finding, then skipped rules
    and unreadable lines."""
    count = len(diagnosis.findings)
    lines = [
        f"{diagnosis.source} ({diagnosis.kind}, {diagnosis.steps} steps): "
        + (f"{count} finding(s)" if count else "no findings")
    ]
    for finding in diagnosis.findings:
        lines += ["", f"[{finding.severity}] {finding.rule}: {finding.summary}"]
        if finding.evidence:
            lines.append(f"  evidence ({finding.metric}): {_evidence(finding)}")
        lines += [f"  likely cause: {finding.cause}", f"  try: {finding.advice}"]
    if diagnosis.skipped:
        lines += ["", "not checked:"]
        lines += [f"  {name}: {why}" for name, why in diagnosis.skipped.items()]
    if diagnosis.unreadable:
        lines += ["", f"unreadable ({len(diagnosis.unreadable)}, left out):"]
        lines += [f"  {where}" for where in diagnosis.unreadable]
    return "\n".join(lines)


def _evidence(finding: Finding) -> str:
    return ", ".join(
        f"step {step}: {'non-finite' if value is None else f'{value:.4g}'}"
        for step, value in finding.evidence
    )
