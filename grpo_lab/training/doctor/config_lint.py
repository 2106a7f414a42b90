"""config-lint: settings each valid on its own that are known to hurt together.

Read from the run's config.json (grpo_lab's field names,
``grpo_lab/training/config/fields.py``); a config that cannot be read skips it.
"""

from __future__ import annotations

from grpo_lab.training.doctor.findings import (
    Finding,
    Run,
    config_number,
    config_text,
)

# GSPO's ratio is a geometric mean over a response, within about 1e-3 of 1 on
# policy: its paper clips at 3e-4 / 4e-4; a token-level range such as 0.2 then
# never clips anything.
GSPO_CLIPRANGE_MAX = 0.01


def lint_cispo_without_high_clip(run: Run) -> str | None:
    """CISPO with ``cliprange_high`` None clips its weight at 1 + cliprange.

    CISPO keeps every token's gradient and only bounds the detached weight;
    MiniMax-M1 (arXiv:2506.13585) tunes the upper bound alone, and
    NovaSky-AI/SkyRL#553 moved CISPO's defaults from (0.2, 0.2) to (0, 5)
    after ScaleRL's ablation; thinking-machines-lab/tinker-cookbook#763
    recommends the one-sided clip with a high bound of about 4.
    """
    if config_text(run, "importance_reweighting_method") != "cispo":
        return None
    if run.config.get("cliprange_high") is not None:
        return None
    clip = config_number(run, "cliprange")
    bound = f"1 + {clip:g}" if clip is not None else "1 + cliprange"
    return (
        f"importance_reweighting_method 'cispo' with cliprange_high None caps "
        f"each token's weight at {bound}: set cliprange_high (about 4: weights "
        "up to 5, as ScaleRL) and keep cliprange near 1 (lower bound ~0)"
    )


def lint_gspo_token_mean(run: Run) -> str | None:
    """GSPO with the token-mean loss weighs its one-ratio-per-response terms
    by length.

    GSPO's objective averages over responses (sequence mean); alibaba/ROLL#165
    found pg_loss far off with another aggregation and the fix was
    'seq-mean-token-mean'; huggingface/trl#3823 reports the same length
    weighting of GSPO's sequence-level terms.
    """
    if config_text(run, "importance_reweighting_method") != "gspo":
        return None
    if config_text(run, "loss_normalization", "sequence") != "token":
        return None
    return (
        "importance_reweighting_method 'gspo' with loss_normalization 'token' "
        "weighs each response's one ratio by its length: use 'sequence', the "
        "mean GSPO is defined with"
    )


def lint_gspo_wide_clip(run: Run) -> str | None:
    """GSPO with a token-sized clip range never clips (see GSPO_CLIPRANGE_MAX)."""
    if config_text(run, "importance_reweighting_method") != "gspo":
        return None
    clip = config_number(run, "cliprange")
    if clip is None or clip < GSPO_CLIPRANGE_MAX:
        return None
    return (
        f"importance_reweighting_method 'gspo' with cliprange {clip:g}: its "
        "sequence ratio stays within ~1e-3 of 1, so the clip never acts; the "
        "GSPO paper uses 3e-4 (and 4e-4 high)"
    )


LINTS = (lint_cispo_without_high_clip, lint_gspo_token_mean, lint_gspo_wide_clip)


def rule_config_lint(run: Run) -> Finding | str | None:
    """Every lint of :data:`LINTS` that the run's config trips, as one warning."""
    if run.config is None:
        return "no readable grpo_lab config.json"
    problems = [problem for lint in LINTS if (problem := lint(run))]
    if not problems:
        return None
    return Finding(
        "config-lint",
        "warning",
        "config.json",
        [],
        "; ".join(problems),
        "these settings are each valid, and together they change what the "
        "objective does",
        "change the settings named above (the reasons cite the papers' values)",
    )
