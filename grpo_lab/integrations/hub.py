"""A run on the Hugging Face Hub: its model card, and pushing its final model.

``push_run(run_dir, repo_id)`` (``grpo-lab push RUN_DIR REPO_ID``) writes a
model card into ``RUN_DIR/final_model/README.md`` and the reward curve beside
it (``reward_curve.png``), then creates the repository (``exist_ok``) and
uploads that folder with ``HfApi.upload_folder``. The folder is what
``save_pretrained`` wrote, so ``AutoModelForCausalLM.from_pretrained(repo_id)``
and ``AutoTokenizer.from_pretrained(repo_id)`` load it; the tiny model's
character tokenizer is saved in a form ``AutoTokenizer`` opens with the ids it
trained with (``grpo_lab.models.load_tokenizer`` opens it as that class, which
also names a character outside its alphabet).

The card is read from the run folder alone: ``config.json`` gives its front
matter (``library_name: transformers``, tags ``grpo`` and ``grpo-lab``, the base
model when it was a Hub model, the dataset when the task read one from the
Hub) and its settings table; ``metrics.jsonl`` gives the held-out accuracy
before and after GRPO, the last step's metrics and the reward curve.

A missing token, a bad repository name or a failed upload is a
:class:`HubError` (a :class:`~grpo_lab.errors.UserError`): the command line
prints it as one line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from grpo_lab.errors import UserError
from grpo_lab.tasks.math_data import GSM8K_HUB, MATH_HUB_NAME
from grpo_lab.teaching.curves import curve
from grpo_lab.training import run_dir as run_dirs
from grpo_lab.training.config import INERT_SETTINGS_KEY
from grpo_lab.training.loop import FINAL_MODEL_DIR
from grpo_lab.training.metrics import read_metrics

CARD_FILE = "README.md"
CURVE_FILE = "reward_curve.png"
TAGS = ("grpo", "grpo-lab")
# Hub datasets a task reads when task_options name no local file.
TASK_DATASETS = {"gsm8k": GSM8K_HUB[0], "math": MATH_HUB_NAME}
_LOCAL_DATA_OPTIONS = ("path", "train_path", "eval_path")
# Config fields that describe this machine and its tools, not the run.
_LOCAL_FIELDS = ("run_dir", "resume", "report_to", INERT_SETTINGS_KEY)
HUB_URL = "https://huggingface.co"


class HubError(UserError):
    """A push that cannot happen: no token, a bad name, a failed upload."""


# --- the model card -------------------------------------------------------------


def card_metadata(config: Mapping[str, Any]) -> dict[str, Any]:
    """The card's YAML front matter, from a run's config.json."""
    metadata: dict[str, Any] = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": list(TAGS),
    }
    model = config.get("model")
    if isinstance(model, str) and model != "tiny" and not Path(model).exists():
        metadata["base_model"] = model
    dataset = TASK_DATASETS.get(config.get("task"))
    options = config.get("task_options") or {}
    if dataset and not any(options.get(name) for name in _LOCAL_DATA_OPTIONS):
        metadata["datasets"] = [dataset]
    if config.get("lora_rank", 0) > 0:  # final_model holds a peft adapter
        metadata["library_name"] = "peft"
        metadata["tags"] += ["lora"]
    return metadata


def model_card(
    config: Mapping[str, Any],
    history: Sequence[Mapping[str, Any]],
    repo_id: str,
    curve_file: str | None = CURVE_FILE,
) -> str:
    """README.md: front matter, held-out accuracy before -> after, the reward
    curve (``curve_file``, None to leave it out), the last step's metrics, the
    settings and how to load the model."""
    from huggingface_hub import ModelCardData

    front_matter = ModelCardData(**card_metadata(config)).to_yaml()
    sections = [
        f"---\n{front_matter}\n---",
        _introduction(config, repo_id),
        _accuracy_section(history),
    ]
    if curve_file is not None:
        sections.append(f"## Reward\n\n![Mean reward per GRPO step]({curve_file})")
    sections += [
        _final_metrics_section(history),
        _config_section(config),
        _usage_section(config, repo_id),
    ]
    return "\n\n".join(section for section in sections if section) + "\n"


def _introduction(config: Mapping[str, Any], repo_id: str) -> str:
    model = config.get("model")
    start = (
        "a tiny character-level Qwen2 model built from scratch"
        if model == "tiny"
        else f"`{model}`"
    )
    return (
        f"# {repo_id.split('/')[-1]}\n\n"
        f"Trained with GRPO (Group Relative Policy Optimization) by grpo-lab on "
        f"the `{config.get('task')}` task, starting from {start}, for "
        f"{config.get('steps')} steps."
    )


def _accuracy_section(history: Sequence[Mapping[str, Any]]) -> str:
    evaluations = [r for r in history if "step" in r and "eval/accuracy_greedy" in r]
    if not evaluations:
        return "## Held-out accuracy\n\nNot measured in this run (eval_every 0)."
    first, last = evaluations[0], evaluations[-1]
    rows = [
        f"| {label} | {_number(first.get(key))} | {_number(last.get(key))} |"
        for label, key in (
            ("greedy", "eval/accuracy_greedy"),
            ("sampled", "eval/accuracy_sampled"),
        )
    ]
    return "\n".join(
        [
            "## Held-out accuracy",
            "",
            f"| decoding | before (step {first['step']}) | after (step "
            f"{last['step']}) |",
            "| --- | --- | --- |",
            *rows,
        ]
    )


def _final_metrics_section(history: Sequence[Mapping[str, Any]]) -> str:
    steps = [r for r in history if "step" in r]
    if not steps:
        return ""
    last = steps[-1]
    rows = [
        f"| `{key}` | {_number(value)} |"
        for key, value in last.items()
        if key != "step" and not key.startswith("time/")
    ]
    return "\n".join(
        [
            f"## Metrics at the last step ({last['step']})",
            "",
            "| metric | value |",
            "| --- | --- |",
            *rows,
        ]
    )


def _config_section(config: Mapping[str, Any]) -> str:
    rows = [
        f"| `{name}` | {_cell(value)} |"
        for name, value in config.items()
        if name not in _LOCAL_FIELDS
    ]
    return "\n".join(
        ["## Training settings", "", "| setting | value |", "| --- | --- |", *rows]
    )


def _usage_section(config: Mapping[str, Any], repo_id: str) -> str:
    """How to load it: AutoModelForCausalLM and AutoTokenizer (the tiny model's
    character tokenizer gives the same ids through both tokenizer loaders)."""
    imports = "from transformers import AutoModelForCausalLM, AutoTokenizer"
    tokenizer = f'AutoTokenizer.from_pretrained("{repo_id}")'
    if config.get("model") == "tiny":
        tokenizer += (
            "\n# the same ids as grpo_lab.models.load_tokenizer, which also names "
            "any character\n# outside the tiny model's alphabet"
        )
    if config.get("lora_rank", 0) > 0:
        return _adapter_usage_section(config, repo_id, imports, tokenizer)
    return (
        f"## Use\n\n```python\n{imports}\n\n"
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")\n'
        f"tokenizer = {tokenizer}\n```"
    )


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else _cell(value)
    return f"{value:.4g}"


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return f"`{text}`".replace("|", "\\|")


def save_reward_curve(
    history: Sequence[Mapping[str, Any]], path: str | os.PathLike
) -> Path | None:
    """Mean reward per GRPO step as a PNG at ``path``; None when none was logged."""
    steps, rewards = curve(history, "train/reward_mean")
    if not steps:
        return None
    figure = Figure(figsize=(6, 3.5))
    axis = figure.subplots()
    axis.plot(steps, rewards, marker="." if len(steps) < 40 else None)
    axis.set(xlabel="GRPO step", ylabel="mean reward", title="reward")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return Path(path)


def write_model_card(run_dir: str | os.PathLike, repo_id: str) -> Path:
    """Write README.md (and reward_curve.png) into ``RUN_DIR/final_model``."""
    folder = final_model_dir(run_dir)
    history = read_metrics(run_dir)
    drawn = save_reward_curve(history, folder / CURVE_FILE)
    card = model_card(
        _saved_config(run_dir), history, repo_id, CURVE_FILE if drawn else None
    )
    path = folder / CARD_FILE
    path.write_text(card, encoding="utf-8")
    return path


# --- pushing --------------------------------------------------------------------


def _adapter_usage_section(
    config: Mapping[str, Any], repo_id: str, imports: str, tokenizer: str
) -> str:
    """A LoRA adapter: opened with peft on its base model (a tiny run's base is
    the run folder's base_model/, after its warm-up)."""
    base = config.get("model")
    if base == "tiny" or config.get("sft_max_steps", 0) > 0:
        base = "RUN_DIR/base_model"
    return (
        f"## Use\n\nA LoRA adapter (rank {config['lora_rank']}, alpha "
        f"{config.get('lora_alpha')}) for `{base}`; `grpo-lab merge RUN_DIR --out "
        f"DIR` writes it merged into a plain model.\n\n```python\n{imports}\n"
        f"from peft import PeftModel\n\n"
        f'base = AutoModelForCausalLM.from_pretrained("{base}")\n'
        f'model = PeftModel.from_pretrained(base, "{repo_id}")\n'
        f"tokenizer = {tokenizer}\n```"
    )


def final_model_dir(run_dir: str | os.PathLike) -> Path:
    """``RUN_DIR/final_model``; HubError when the run has not written it."""
    folder = Path(run_dir) / FINAL_MODEL_DIR
    if not folder.is_dir():
        raise HubError(
            f"{folder} does not exist: the run has not finished",
            f"finish it with grpo-lab train --resume {run_dir}, then push",
        )
    return folder


def check_repo_id(repo_id: str) -> None:
    """HubError unless ``repo_id`` is a valid Hub name ("name" or "user/name")."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise HubError(
            f"repo id {repo_id!r} is not a valid Hub name: {_one_line(error)}",
            "use user/name with letters, digits, '-', '_' and '.'",
        ) from error


def hub_token() -> str:
    """The Hugging Face token (``HF_TOKEN`` or ``hf auth login``); HubError if none."""
    import huggingface_hub

    token = huggingface_hub.get_token()
    if not token:
        raise HubError(
            "no Hugging Face token found",
            "run hf auth login, or set HF_TOKEN to a token with write access",
        )
    return token


def push_run(
    run_dir: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
) -> str:
    """Write the card, create ``repo_id`` (exist_ok) and upload final_model/.

    ``revision`` names a branch, created when missing. Returns the repository's
    URL. Raises :class:`HubError` before anything is sent when the folder, the
    name or the token is missing, and when the Hub refuses or cannot be reached.
    """
    from huggingface_hub import HfApi

    folder = final_model_dir(run_dir)
    check_repo_id(repo_id)
    api = HfApi(token=hub_token())
    write_model_card(run_dir, repo_id)
    try:
        # private=None keeps the namespace's default visibility for a new repo.
        url = api.create_repo(repo_id, private=private or None, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            revision=revision,
            commit_message=f"grpo-lab: {Path(run_dir).resolve().name}",
        )
    except _hub_errors() as error:
        raise HubError(
            f"pushing {folder} to {repo_id} failed: {_one_line(error)}",
            f"check the token's write access and the connection, then retry with "
            f"grpo-lab push {run_dir} {repo_id}",
        ) from error
    return str(url) if url else f"{HUB_URL}/{repo_id}"


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What the Hub client raises when a request fails (HTTP, network, refusal)."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    return (HfHubHTTPError, httpx.HTTPError, OSError, ValueError)


def _saved_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    try:
        return run_dirs.read_saved_config(run_dir)
    except UserError as error:
        raise HubError(error.problem, error.fix) from error


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
