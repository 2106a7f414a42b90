"""A run's model card: the README.md of ``RUN_DIR/final_model``.

A run writes it when it saves final_model/ (in place of the blank card peft
writes beside an adapter), and ``grpo-lab push`` writes it again naming the
repository and adding the reward curve (:mod:`grpo_lab.integrations.hub`). The
card is read from the run folder alone: ``config.json`` gives its front matter
(``library_name: transformers``, or ``peft`` for an adapter; tags ``grpo`` and
``grpo-lab``; the base model when it was a Hub model; the dataset when the task
read one from the Hub) and its settings table; ``metrics.jsonl`` gives the
held-out accuracy before and after GRPO and the last step's metrics.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grpo_lab.tasks.math_data import GSM8K_HUB, MATH_HUB_NAME
from grpo_lab.training.config import INERT_SETTINGS_KEY

CARD_FILE = "README.md"
CURVE_FILE = "reward_curve.png"
TAGS = ("grpo", "grpo-lab")
# Hub datasets a task reads when task_options name no local file.
TASK_DATASETS = {"gsm8k": GSM8K_HUB[0], "math": MATH_HUB_NAME}
_LOCAL_DATA_OPTIONS = ("path", "train_path", "eval_path")
# Config fields that describe this machine and its tools, not the run.
_LOCAL_FIELDS = ("run_dir", "resume", "report_to", INERT_SETTINGS_KEY)


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
    *,
    title: str | None = None,
) -> str:
    """README.md: front matter, held-out accuracy before -> after, the reward
    curve (``curve_file``, None to leave it out), the last step's metrics, the
    settings and how to load the model from ``repo_id`` (a Hub name or a
    folder). ``title`` heads the card (default: the last part of ``repo_id``)."""
    from huggingface_hub import ModelCardData

    front_matter = ModelCardData(**card_metadata(config)).to_yaml()
    sections = [
        f"---\n{front_matter}\n---",
        _introduction(config, title or repo_id.split("/")[-1]),
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


def _introduction(config: Mapping[str, Any], title: str) -> str:
    model = config.get("model")
    start = (
        "a tiny character-level Qwen2 model built from scratch"
        if model == "tiny"
        else f"`{model}`"
    )
    return (
        f"# {title}\n\n"
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
