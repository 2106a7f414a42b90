"""Hide by reach: while an exercise's answer runs, nothing the student can reach
computes it.

For every exercise of the notebooks, every function of the course's modules
and of the check modules (what a student reaches by import, however the
notebook's own imports name it) that takes the answer's arguments is called
in the answer's place, and must not pass the check. Routes that need an
adapter (a library's ``generate``, a check module's helper called with its
arguments turned around) are listed by hand, and refused too. The grader hides
what the same table lists (``PACKAGE_COUNTERPARTS``); the routes below also run
through `grpo-lab grade` in tests/test_checks_both_paths.py.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import io
import types
from pathlib import Path

import nbformat
import pytest
import torch

from grpo_lab.instructor.rubric import find_exercises
from grpo_lab.teaching.checks import PACKAGE_COUNTERPARTS

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
# What a student reaches by import: the course's modules and the checks'.
REACHABLE_MODULES = (
    "grpo_lab.advantages",
    "grpo_lab.aggregation",
    "grpo_lab.kl",
    "grpo_lab.logprobs",
    "grpo_lab.lora",
    "grpo_lab.losses",
    "grpo_lab.masks",
    "grpo_lab.prefix_sharing",
    "grpo_lab.rewards",  # 08-robust_reward
    "grpo_lab.rollouts.multiturn",
    "grpo_lab.sampler_correction",
    "grpo_lab.train_step",
    "grpo_lab.tasks.hackable",  # 08-robust_reward
    "grpo_lab.training.loop",
    "grpo_lab.training.staleness",
    "grpo_lab.teaching.explorer",
    "grpo_lab.teaching.checks.advantages",
    "grpo_lab.teaching.checks.aggregation",
    "grpo_lab.teaching.checks.asynchronous",
    "grpo_lab.teaching.checks.family",
    "grpo_lab.teaching.checks.gspo",
    "grpo_lab.teaching.checks.logprobs",
    "grpo_lab.teaching.checks.loop",
    "grpo_lab.teaching.checks.lora",
    "grpo_lab.teaching.checks.losses",
    "grpo_lab.teaching.checks.masks",
    "grpo_lab.teaching.checks.mismatch",
    "grpo_lab.teaching.checks.rewards",  # 08-robust_reward
    "grpo_lab.teaching.checks.scaling",
    "grpo_lab.teaching.checks.setup",
    "grpo_lab.teaching.checks.train_step",
    "grpo_lab.teaching.checks.turns",
)
# Cases too slow to run once per candidate, by check: 09's fresh process. The
# enumeration runs without them: a check with fewer cases accepts more, so a
# candidate it still refuses is refused by the whole check too.
SLOW_CASES = {
    "check_cache_key": "grpo_lab.teaching.checks.loop._check_key_is_stable_across_processes"
}
# Functions that act on a model in place and return nothing an exercise asks
# for; with integers in the model's place merge_adapter_into runs for minutes.
NOT_ANSWERS = {
    "grpo_lab.lora.merge_adapter_into",
    "grpo_lab.lora.add_adapters",
    # Given two strings (08-robust_reward's arguments) it asks the Hub for a model
    # of that name, retrying for a minute without a network.
    "grpo_lab.models.load_pretrained",
}


def _exercises() -> list[tuple[str, str, str, int]]:
    """(notebook, check name, function name, positional arguments it takes)."""
    found = []
    for path in sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        for exercise in find_exercises(notebook, path.name):
            source = notebook.cells[exercise.check_index].source
            tree = ast.parse(source.split("### BEGIN HIDDEN TESTS")[0])
            calls = [
                n.func.id
                for n in ast.walk(tree)
                if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and n.func.id in PACKAGE_COUNTERPARTS
            ]
            function = exercise.exercise_id.split("-", 1)[1]
            definition = next(
                n
                for n in ast.walk(
                    ast.parse(notebook.cells[exercise.solution_index].source)
                )
                if isinstance(n, ast.FunctionDef) and n.name == function
            )
            arguments = len(definition.args.args) - len(definition.args.defaults)
            found.append((path.name[:2], calls[0], function, arguments))
    return found


EXERCISES = _exercises()


def _check(check_name: str):
    for module in REACHABLE_MODULES:
        if module.startswith("grpo_lab.teaching.checks."):
            found = getattr(importlib.import_module(module), check_name, None)
            if found is not None:
                return found
    raise AssertionError(f"no check module defines {check_name}")


def _candidates(arguments: int) -> list[tuple[str, types.FunctionType]]:
    """Every reachable function that accepts ``arguments`` positional values."""
    found = {}
    for name in REACHABLE_MODULES:
        module = importlib.import_module(name)
        for attribute, value in vars(module).items():
            if not isinstance(value, types.FunctionType) or not (
                value.__module__.startswith("grpo_lab")
            ):
                continue
            if value.__module__ == "grpo_lab.teaching.checks.framework":
                continue
            if attribute.startswith("check_"):
                continue  # a check is not an answer
            if f"{value.__module__}.{value.__qualname__}" in NOT_ANSWERS:
                continue
            try:
                inspect.signature(value).bind(*range(arguments))
            except TypeError:
                continue
            found[id(value)] = (f"{value.__module__}.{value.__qualname__}", value)
    return sorted(found.values(), key=lambda pair: pair[0])


def _passes(check_name: str, answer) -> bool:
    """Whether the check, as a check cell calls it, passes ``answer``."""
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            return _check(check_name)(answer) is True
        except Exception:
            return False


@pytest.mark.slow
@pytest.mark.parametrize(
    ("notebook", "check_name", "function", "arguments"),
    EXERCISES,
    ids=[f"{e[0]}-{e[2]}" for e in EXERCISES],
)
def test_no_reachable_function_answers_the_exercise(
    notebook, check_name, function, arguments, monkeypatch
):
    if check_name in SLOW_CASES:
        module, name = SLOW_CASES[check_name].rsplit(".", 1)
        monkeypatch.setattr(importlib.import_module(module), name, lambda *a: None)
    answering = []
    for path, candidate in _candidates(arguments):

        def in_its_place(*args, _candidate=candidate, **kwargs):
            return _candidate(*args, **kwargs)

        if _passes(check_name, in_its_place):
            answering.append(path)
    assert not answering, f"{notebook}-{function}: {answering} answer it"


def test_the_enumeration_finds_what_answers_when_nothing_is_hidden(monkeypatch):
    """The test above can fail: with the hiding off, the package's own
    functions answer their exercises."""
    from grpo_lab.teaching.checks import framework

    monkeypatch.setattr(framework, "hide_while_running", lambda fn, name: fn)
    from grpo_lab.masks import pad_prompt_and_response_ids

    def in_its_place(*args, **kwargs):
        return pad_prompt_and_response_ids(*args, **kwargs)

    assert _passes("check_response_mask", in_its_place)


# --- routes that need an adapter -------------------------------------------------


def _by_generate(model, tokenizer, prompt, max_new_tokens):
    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    generated = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)


def _by_sampling_loop(model, tokenizer, prompt, max_new_tokens):
    # The package's own token-by-token sampler, greedy at temperature 0.
    from grpo_lab.rollouts.base import SamplingSettings
    from grpo_lab.rollouts.mismatch import MismatchRolloutBackend

    sampling = SamplingSettings(temperature=0.0, max_new_tokens=max_new_tokens)
    rollouts = MismatchRolloutBackend(model, tokenizer).generate([prompt], 1, sampling)
    ids = rollouts.response_token_ids[0]
    return tokenizer.decode(ids, skip_special_tokens=True)


def _by_written(prompt_ids, segments):
    from grpo_lab.rollouts.multiturn import MODEL
    from grpo_lab.teaching.checks.turns import _written

    return _written(prompt_ids, segments, (MODEL,))[:, 1:]


def _by_slips(x, weight, lora_A, lora_B, alpha, rank):
    from grpo_lab.teaching.checks.lora import _slips

    # alpha and rank swapped: the "upside down" slip is then the answer.
    return next(
        value
        for message, value in _slips(x, weight, lora_A, lora_B, rank, alpha).items()
        if "upside down" in message
    )


def _by_grpo_clip_loss(policy, old, reference, advantages, mask, low, high, beta):
    from grpo_lab.losses import ObjectiveOptions, grpo_clip_loss

    options = ObjectiveOptions(cliprange=low, cliprange_high=high)
    surrogate = grpo_clip_loss(
        advantages.unsqueeze(-1), policy, old, mask.bool(), options
    )[0]
    ratio = torch.exp(policy - old)
    log_r = reference - policy
    per_token = surrogate + beta * ratio * (log_r.exp() - log_r - 1)
    return (per_token * mask).sum() / mask.sum()


def _by_reference_slices(rollout_batch_size, train_batch_size, group_size):
    from grpo_lab.teaching.checks.loop import _reference_slices

    if train_batch_size % group_size:
        raise ValueError("group_size must divide train_batch_size")
    return _reference_slices(rollout_batch_size, train_batch_size)


def _by_within_bound(policy, sampler, advantages, mask, versions, trainer, bound, cap):
    from grpo_lab.train_step import UpdateSettings, microbatch_loss
    from grpo_lab.training.staleness import within_bound

    kept = within_bound(versions, trainer, bound)
    rows = kept.repeat_interleave(policy.shape[0] // versions.shape[0])
    settings = UpdateSettings(
        importance_reweighting_method="grpo",
        cliprange=0.2,
        sampler_correction="token_truncate",
        sampler_correction_cap=cap,
    )
    microbatch = {
        "response_mask": mask[rows],
        "advantages": advantages[rows],
        "old_log_probs": policy[rows].detach(),
        "sampler_log_probs": sampler[rows],
    }
    loss = microbatch_loss(policy[rows], policy[rows], microbatch, settings)[0]
    return kept, loss


def _by_exact_match(response, ground_truth):
    from grpo_lab.rewards import exact_match_reward

    return exact_match_reward(response, ground_truth)["reward"]


def _by_task_reward(response, ground_truth):
    from grpo_lab.tasks import get_task

    task = get_task("hackable_addition", reward="strict")
    return task.reward_fn(response, ground_truth)["reward"]


def _by_config_cache_key(config):
    from types import SimpleNamespace

    from grpo_lab.teaching.explorer import config_cache_key

    return config_cache_key(SimpleNamespace(to_dict=lambda: config))


def _by_rollout_rewards(responses, ground_truths, group_size, advantage_eps):
    from grpo_lab.advantages import compute_group_normalized_rewards
    from grpo_lab.rewards import exact_match_reward

    truths = [truth for truth in ground_truths for _ in range(group_size)]
    rewards = [exact_match_reward(r, t)["reward"] for r, t in zip(responses, truths)]
    return compute_group_normalized_rewards(
        torch.tensor(rewards), group_size, "mean", advantage_eps, "std"
    )[0]


def _by_fixed_logits(logits, response_mask):
    from grpo_lab.logprobs import get_response_log_probs
    from grpo_lab.teaching.checks.logprobs import _FixedLogits

    labels = torch.zeros(response_mask.shape, dtype=torch.long)
    entropy = get_response_log_probs(
        _FixedLogits(logits.float()),
        labels,
        labels,
        return_token_entropy=True,
        entropy_gradient=True,
        logits_chunk_size=0,
    )["token_entropy"]  # (B, T)
    return entropy[response_mask.bool()].mean()


ROUTES = {
    "staleness.within_bound": ("check_admitted_loss", _by_within_bound),
    "rewards.exact_match_reward": ("check_robust_reward", _by_exact_match),
    "hackable_addition's strict reward": ("check_robust_reward", _by_task_reward),
    "generate": ("check_greedy_continuation", _by_generate),
    "mismatch.MismatchRolloutBackend": ("check_greedy_continuation", _by_sampling_loop),
    "explorer.config_cache_key": ("check_cache_key", _by_config_cache_key),
    "advantages.compute_group_normalized_rewards": (
        "check_group_normalized_advantages",
        _by_rollout_rewards,
    ),
    "logprobs.get_response_log_probs": ("check_token_entropy", _by_fixed_logits),
    "turns._written": ("check_multi_turn_mask", _by_written),
    "lora._slips": ("check_lora_linear", _by_slips),
    "losses.grpo_clip_loss": ("check_dapo_kl_loss", _by_grpo_clip_loss),
    "loop._reference_slices": ("check_train_batch_slices", _by_reference_slices),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_route_that_needs_an_adapter_is_hidden(route, monkeypatch):
    check_name, answer = ROUTES[route]
    if check_name in SLOW_CASES:
        module, name = SLOW_CASES[check_name].rsplit(".", 1)
        monkeypatch.setattr(importlib.import_module(module), name, lambda *a: None)
    assert not _passes(check_name, answer), route
    # ... and it is a real route: with the hiding off, it passes.
    from grpo_lab.teaching.checks import framework

    monkeypatch.setattr(framework, "hide_while_running", lambda fn, name: fn)
    assert _passes(check_name, answer), route


def test_the_reach_module_loads_alone_in_a_fresh_process():
    # A check's fresh process (09's cache key) loads reach.py from its file and
    # hides by place: nothing of the package or of torch comes with it.
    import subprocess
    import sys

    from grpo_lab.teaching.checks import reach

    script = (
        "import sys, importlib.util; "
        "spec = importlib.util.spec_from_file_location('r', sys.argv[1]); "
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        "module.hide_in_this_process(['grpo_lab.teaching.explorer:config_cache_key']); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpo_lab', 'torch')))"
    )
    command = [sys.executable, "-c", script, reach.__file__]
    printed = subprocess.run(command, capture_output=True, text=True, check=True)
    assert printed.stdout.strip() == "[]"
