"""The Hub: a run's model card, the push, and its one-line errors, all offline.

``HfApi.create_repo``, ``create_branch`` and ``upload_folder`` are replaced by
functions that record their arguments and copy the folder into a local
"remote"; the token lookup is replaced too. Nothing leaves the machine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import huggingface_hub
import pytest
import torch
import yaml
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError
from transformers import AutoModelForCausalLM

from grpo_lab.cli import main as cli
from grpo_lab.integrations import hub
from grpo_lab.models import load_tokenizer
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.loop import train
from grpo_lab.training.metrics import read_metrics

REPO = "someone/grpo-reverse-tiny"
MODEL_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished smoke run (2 warm-up steps, GRPO steps 0-2), copied by each test."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(TrainConfig.for_profile("smoke", run_dir=str(run_dir)), progress=False)
    return run_dir


@pytest.fixture
def run_dir(finished_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


@pytest.fixture
def remote(monkeypatch, tmp_path) -> dict[str, Any]:
    """The Hub, stubbed at HfApi: records each call, copies uploads to a folder."""
    state: dict[str, Any] = {"root": tmp_path / "remote", "calls": []}

    def create_repo(self, repo_id, **kwargs):
        state["calls"].append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def create_branch(self, repo_id, **kwargs):
        state["calls"].append(("create_branch", repo_id, kwargs))

    def upload_folder(self, **kwargs):
        state["calls"].append(("upload_folder", kwargs["repo_id"], kwargs))
        branch = kwargs.get("revision") or "main"
        target = state["root"] / kwargs["repo_id"] / branch
        shutil.copytree(kwargs["folder_path"], target, dirs_exist_ok=True)

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_branch", create_branch)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test_token")
    return state


def front_matter(card: str) -> dict[str, Any]:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def one_line_error(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    return captured.err


# --- the card ---------------------------------------------------------------------


def test_the_front_matter_names_the_base_model_and_dataset_when_known():
    gsm8k = {"model": "Qwen/Qwen2.5-Math-1.5B", "task": "gsm8k", "task_options": {}}
    assert hub.card_metadata(gsm8k) == {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["grpo", "grpo-lab"],
        "base_model": "Qwen/Qwen2.5-Math-1.5B",
        "datasets": ["openai/gsm8k"],
    }
    local = {**gsm8k, "task_options": {"train_path": "train.jsonl"}, "task": "math"}
    assert "datasets" not in hub.card_metadata(local)
    math = {**gsm8k, "task": "math"}
    assert hub.card_metadata(math)["datasets"] == ["EleutherAI/hendrycks_math"]
    tiny = hub.card_metadata({"model": "tiny", "task": "reverse"})
    assert "base_model" not in tiny and "datasets" not in tiny


def test_a_local_model_folder_is_not_named_as_a_base_model(tmp_path):
    metadata = hub.card_metadata({"model": str(tmp_path), "task": "reverse"})
    assert "base_model" not in metadata


def test_the_card_reports_accuracy_before_and_after_and_the_settings():
    config = TrainConfig(steps=3).to_dict()
    history = [
        {"sft/step": 1, "sft/loss": 2.0},
        {"step": 0, "eval/accuracy_greedy": 0.125, "eval/accuracy_sampled": 0.0625},
        {"step": 1, "train/reward_mean": 0.25, "time/step_seconds": 0.5},
        {
            "step": 3,
            "train/reward_mean": 0.5,
            "eval/accuracy_greedy": 0.875,
            "eval/accuracy_sampled": 0.8125,
        },
    ]
    card = hub.model_card(config, history, REPO)
    assert front_matter(card)["tags"] == ["grpo", "grpo-lab"]
    assert "# grpo-reverse-tiny\n" in card
    assert "| decoding | before (step 0) | after (step 3) |" in card
    assert "| greedy | 0.125 | 0.875 |" in card
    assert "| sampled | 0.0625 | 0.8125 |" in card
    assert "![Mean reward per GRPO step](reward_curve.png)" in card
    assert "## Metrics at the last step (3)" in card
    assert "| `train/reward_mean` | 0.5 |" in card
    assert "| `lr` | `0.0003` |" in card
    assert '| `task_options` | `{"n_digits": 5}` |' in card
    assert "| `run_dir` |" not in card and "time/step_seconds" not in card
    assert f'tokenizer = AutoTokenizer.from_pretrained("{REPO}")' in card
    without_eval = hub.model_card(config, history[2:3], REPO, curve_file=None)
    assert "Not measured in this run" in without_eval
    assert "reward_curve.png" not in without_eval


# --- the push ---------------------------------------------------------------------


def test_push_uploads_the_final_model_with_its_card_and_curve(run_dir, remote, capsys):
    assert cli.main(["push", str(run_dir), REPO, "--private"]) == 0
    assert f"to https://huggingface.co/{REPO}" in capsys.readouterr().out
    (create, repo, options), (upload, _, sent) = remote["calls"]
    assert (create, repo, options) == (
        "create_repo",
        REPO,
        {"private": True, "exist_ok": True},
    )
    assert upload == "upload_folder" and Path(sent["folder_path"]) == (
        run_dir / "final_model"
    )
    assert sent["revision"] is None and sent["commit_message"] == "grpo-lab: run"

    pushed = remote["root"] / REPO / "main"
    names = {path.name for path in pushed.iterdir()}
    assert names == MODEL_FILES | {"README.md", "reward_curve.png"}
    assert (pushed / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = (pushed / "README.md").read_text(encoding="utf-8")
    metadata = front_matter(card)
    assert metadata["library_name"] == "transformers"
    assert {"grpo", "grpo-lab"} <= set(metadata["tags"])
    history = read_metrics(run_dir)
    last = history[-1]
    greedy = f"{history[2]['eval/accuracy_greedy']:.4g}"
    assert f"| greedy | {greedy} | {last['eval/accuracy_greedy']:.4g} |" in card
    assert "| decoding | before (step 0) | after (step 2) |" in card
    assert f"| `train/response_length` | {last['train/response_length']:.4g} |" in card

    # The card's snippet, run on the pushed folder: the run's model, and the
    # ids of grpo_lab's loader.
    snippet = card.split("```python\n", 1)[1].split("```", 1)[0]
    loaded: dict[str, Any] = {}
    exec(snippet.replace(REPO, str(pushed)), loaded)
    local = AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    text = "Reverse 12345: 54321<eos>"
    ids = load_tokenizer(str(pushed))(text, return_tensors="pt").input_ids
    assert torch.equal(loaded["tokenizer"](text, return_tensors="pt").input_ids, ids)
    with torch.no_grad():
        assert torch.equal(loaded["model"](ids).logits, local(ids).logits)  # (1, T, V)


def test_a_revision_is_created_as_a_branch_and_pushed_to(run_dir, remote):
    assert cli.main(["push", str(run_dir), REPO, "--revision", "step-2"]) == 0
    names = [call[0] for call in remote["calls"]]
    assert names == ["create_repo", "create_branch", "upload_folder"]
    assert remote["calls"][0][2]["private"] is None  # the namespace's default
    assert remote["calls"][1][2] == {"branch": "step-2", "exist_ok": True}
    assert remote["calls"][2][2]["revision"] == "step-2"
    assert (remote["root"] / REPO / "step-2" / "README.md").exists()


def test_no_token_is_one_line_and_sends_nothing(run_dir, remote, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    message = one_line_error(capsys, ["push", str(run_dir), REPO])
    assert message == (
        "grpo-lab push: no Hugging Face token found (run hf auth login, or set "
        "HF_TOKEN to a token with write access)\n"
    )
    assert remote["calls"] == []


@pytest.mark.parametrize(
    "failure",
    [
        HfHubHTTPError(
            "403 Forbidden: you do not have write access to this repository",
            response=httpx.Response(
                403, request=httpx.Request("POST", "https://huggingface.co/api")
            ),
        ),
        httpx.ConnectError("[Errno -3] Temporary failure in name resolution"),
    ],
    ids=["refused", "offline"],
)
def test_a_failed_upload_is_one_line_saying_how_to_retry(
    run_dir, remote, monkeypatch, capsys, failure
):
    def upload_folder(self, **kwargs):
        raise failure

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    message = one_line_error(capsys, ["push", str(run_dir), REPO])
    assert message.startswith(
        f"grpo-lab push: pushing {run_dir}/final_model to {REPO} failed: "
    )
    assert str(failure).split()[0] in message
    assert message.endswith(f"then retry with grpo-lab push {run_dir} {REPO})\n")


def test_an_unfinished_run_or_a_bad_name_is_refused_before_any_call(
    run_dir, remote, capsys
):
    shutil.rmtree(run_dir / "final_model")
    message = one_line_error(capsys, ["push", str(run_dir), REPO])
    assert "final_model does not exist: the run has not finished" in message
    message = one_line_error(capsys, ["push", str(run_dir.parent), "not a name"])
    assert "final_model does not exist" in message
    (run_dir / "final_model").mkdir()
    message = one_line_error(capsys, ["push", str(run_dir), "two words/x"])
    assert "repo id 'two words/x' is not a valid Hub name" in message
    assert remote["calls"] == []


# --- pushing at the end of training -------------------------------------------------


SMOKE = ["train", "--profile", "smoke", "--no-progress"]


def test_train_push_to_hub_pushes_when_the_run_ends(tmp_path, remote, capsys):
    run_dir = tmp_path / "pushed"
    argv = [*SMOKE, "--run-dir", str(run_dir), "--push-to-hub", REPO]
    assert cli.main(argv) == 0
    assert f"pushed to https://huggingface.co/{REPO}" in capsys.readouterr().out
    assert [call[0] for call in remote["calls"]] == ["create_repo", "upload_folder"]
    pushed = remote["root"] / REPO / "main"
    assert {path.name for path in pushed.iterdir()} >= MODEL_FILES | {"README.md"}
    assert json.loads((run_dir / "config.json").read_text())["profile"] == "smoke"


def test_train_push_to_hub_without_a_token_stops_before_training(
    tmp_path, remote, monkeypatch, capsys
):
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    run_dir = tmp_path / "never"
    argv = [*SMOKE, "--run-dir", str(run_dir), "--push-to-hub", REPO]
    message = one_line_error(capsys, argv)
    assert message.startswith("grpo-lab train: no Hugging Face token found")
    assert not run_dir.exists()
