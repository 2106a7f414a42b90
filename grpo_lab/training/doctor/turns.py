"""The doctor's rules on multi-turn runs: tool output trained, episodes cut by
the turn budget.

Both read the ``tools/`` metrics a grpo_lab run logs for a tool-using task
(:mod:`grpo_lab.rollouts.multiturn`); a run without them (a single-turn task,
a TRL or verl log) skips both.
"""

from __future__ import annotations

from grpo_lab.training.doctor.findings import (
    Finding,
    Run,
    evidence,
    persistent,
    reward_is_flat,
    series,
)

# Any tool or separator token in the loss is the bug: the policy is pushed to
# predict what the tool wrote, which it cannot control (its gradient teaches
# the model to hallucinate tool replies), and the loss's normalizers count
# tokens nobody sampled. A correct mask gives exactly 0, so the floor is 0.
TRAINED_TOOL_TOKEN_FLOOR = 0.0
# Episodes ended by the turn limit or the token budget rather than by an
# answer: above half of them, most rewards grade an episode the budget cut, so
# the reward says more about max_turns and max_new_tokens than about the policy.
TURN_BUDGET_FRACTION = 0.5
CUT_KEYS = ("tools/turn_limit_fraction", "tools/budget_fraction")


def rule_tool_output_trained(run: Run) -> Finding | str | None:
    """Tool-output tokens carry weight in the loss: the response mask is the
    single-turn one (prompt vs response) over a multi-turn response.

    Loss masks for tool results are what multi-turn trainers had to add
    (huggingface/trl#4974: mask tool results in the loss, attend to them;
    PrimeIntellect-ai/prime-rl#978: by default train on assistant messages only).
    """
    points = series(run, "tools/trained_tool_token_fraction")
    if not points:
        return "no tools/trained_tool_token_fraction logged (not a tool-using run)"
    trained = [
        (step, value) for step, value in points if value > TRAINED_TOOL_TOKEN_FLOOR
    ]
    if not trained:
        return None
    return Finding(
        "tool-output-trained",
        "error",
        "tools/trained_tool_token_fraction",
        evidence(trained),
        f"{len(trained)} of {len(points)} steps trained on tokens the tool or the "
        f"environment wrote (up to {max(v for _, v in trained):.0%} of them)",
        "the response mask covers the whole response, tool replies and the tags "
        "around them included, instead of the model's own tokens only",
        "build the batch with grpo_lab.rollouts.multiturn.pad_prompt_and_segment_ids "
        "(or TRL's env_mask, verl's response_mask of the agent loop) so that only "
        "model-sampled tokens are 1",
    )


def rule_turn_budget_truncates(run: Run) -> Finding | str | None:
    """Most episodes end at the turn limit or the token budget, not in an answer.

    A budget too tight for the task's call-reply-answer loop
    (verl-project/verl#6404: one turn spends the trajectory's budget and leaves
    nothing for the tool rounds; NovaSky-AI/SkyRL#406: the generation length is
    the trajectory's, not a turn's).
    """
    cut = _cut_fraction_series(run)
    if not cut:
        return f"no {' or '.join(CUT_KEYS)} logged (not a tool-using run)"
    high = persistent(cut, TURN_BUDGET_FRACTION)
    if not high:
        return None
    flat = reward_is_flat(run)
    return Finding(
        "turn-budget-truncates",
        "error" if flat else "warning",
        "tools/turn_limit_fraction + tools/budget_fraction",
        evidence(high),
        f"{len(high)} of {len(cut)} steps ended more than "
        f"{TURN_BUDGET_FRACTION:.0%} of episodes at the turn limit or the token "
        "budget" + (", with the reward flat" if flat else ""),
        "max_turns is too small for the calls the policy makes (a call in the last "
        "allowed turn is never answered), or max_new_tokens / max_turn_tokens cut "
        "the episode before its answer",
        "raise the task's max_turns (task_options) or max_new_tokens; a call_cost "
        "discourages needless calls",
    )


def _cut_fraction_series(run: Run) -> list[tuple[int, float]]:
    """turn_limit_fraction + budget_fraction per step (either may be missing)."""
    totals: dict[int, float] = {}
    for key in CUT_KEYS:
        for step, value in series(run, key):
            totals[step] = totals.get(step, 0.0) + value
    return sorted(totals.items())
