"""Tests for the rollout backends' records (grpo_lab.rollouts.BACKEND_RECORDS):
a backend is one record and its class, and every other part of grpo_lab reads
its facts from the record."""

from __future__ import annotations

import dataclasses

import pytest

from grpo_lab.errors import UserError
from grpo_lab.integrations.cluster import Cluster
from grpo_lab.integrations.trl.translation import to_trl_config
from grpo_lab.integrations.verl.settings import EXPORTS, Target
from grpo_lab.rollouts import BACKEND_RECORDS, BackendRecord, HFRolloutBackend
from grpo_lab.training import loop
from grpo_lab.training.config import TrainConfig, inert_settings


class CountingBackend(HFRolloutBackend):
    """A stand-in backend: the policy's own ``generate``, counting its calls."""

    calls = 0

    def generate(self, *arguments, **keywords):
        CountingBackend.calls += 1
        return super().generate(*arguments, **keywords)


@pytest.fixture
def counting_backend(monkeypatch):
    record = BackendRecord(
        make=lambda model, tokenizer, path=None, **options: CountingBackend(
            model, tokenizer, **options
        ),
        options=lambda config: {"max_batch_size": config.rollout_max_batch_size},
        fields=("rollout_max_batch_size",),
        trl="a stand-in backend has no TRL counterpart",
        verl="a stand-in backend has no verl counterpart",
    )
    monkeypatch.setitem(BACKEND_RECORDS, "counting", record)
    CountingBackend.calls = 0
    return record


def test_a_new_backend_is_one_record_and_its_class(counting_backend, tmp_path):
    config = TrainConfig.for_profile(
        "smoke", backend="counting", steps=2, eval_every=0, run_dir=str(tmp_path)
    )
    loop.train(config, progress=False)
    assert CountingBackend.calls >= config.steps  # every rollout batch is its
    with pytest.raises(UserError, match=r"backend.*counting.*no TRL counterpart"):
        to_trl_config(config)
    with pytest.raises(ValueError, match=r"backend must be hf or vllm.*counting"):
        EXPORTS["backend"].convert(config, Target(Cluster(), 512))


def test_an_unknown_backend_is_refused_with_the_records_names():
    with pytest.raises(ValueError, match=r"backend must be one of \('hf', 'vllm', "):
        TrainConfig.for_profile("smoke", backend="sglang")


def test_a_field_only_another_backend_reads_is_inert():
    config = TrainConfig.for_profile("smoke", backend="hf")
    assert "vllm_gpu_memory_utilization" not in inert_settings(config)
    changed = dataclasses.replace(config, vllm_gpu_memory_utilization=0.5)
    assert inert_settings(changed)["vllm_gpu_memory_utilization"] == (
        "only the vllm backend reads it"
    )


def test_a_sampler_correction_needs_a_backend_whose_record_reports_log_probs(
    monkeypatch,
):
    quiet = dataclasses.replace(BACKEND_RECORDS["hf"], sampler_log_probs=False)
    monkeypatch.setitem(BACKEND_RECORDS, "hf", quiet)
    with pytest.raises(ValueError, match=r"needs the sampler's log-probs"):
        TrainConfig.for_profile("smoke", sampler_correction="token_truncate")


def test_an_objective_without_a_trl_row_is_refused_by_export_trl(monkeypatch):
    """TRL's objectives are an allow-list: a record added to the family without
    a TRL row is refused by name, never exported as another loss."""
    from grpo_lab.losses import OBJECTIVE_RECORDS

    probe = dataclasses.replace(OBJECTIVE_RECORDS["grpo"])
    monkeypatch.setitem(OBJECTIVE_RECORDS, "probe", probe)
    config = TrainConfig.for_profile(
        "smoke",
        importance_reweighting_method="probe",
        cliprange=0.2,
        epochs_per_rollout_batch=2,
    )
    with pytest.raises(UserError, match=r"importance_reweighting_method.*probe"):
        to_trl_config(config)
