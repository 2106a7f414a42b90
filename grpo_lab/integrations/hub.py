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

The card (:mod:`grpo_lab.training.model_card`, which a run also writes when it
saves final_model/) is read from the run folder alone; the push names the
repository in it and adds the reward curve.

A missing token, a bad repository name or a failed upload is a
:class:`HubError` (a :class:`~grpo_lab.errors.UserError`): the command line
prints it as one line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from grpo_lab.errors import UserError
from grpo_lab.teaching.curves import curve
from grpo_lab.training import run_dir as run_dirs
from grpo_lab.training.loop import FINAL_MODEL_DIR
from grpo_lab.training.metrics import read_metrics
from grpo_lab.training.model_card import CARD_FILE, CURVE_FILE, model_card

HUB_URL = "https://huggingface.co"


class HubError(UserError):
    """A push that cannot happen: no token, a bad name, a failed upload."""


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
