"""verl's export rows: each row's note says what its converter writes.

No verl needed: the converters are plain functions of a ``TrainConfig``. A note
names verl keys the short way (``actor.clip_ratio`` for
``actor_rollout_ref.actor.clip_ratio``); these tests hold every note to the keys
its converter writes, to its "refused unless" value and to its "(X: Y)" cases.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import math
import re

import pytest

from grpo_lab.integrations.verl.settings import EXPORTS, Target
from grpo_lab.training.config import TrainConfig

# A dotted verl key in a note; not a file name such as data/reward.py, and not a
# factor ("x rollout.n": a key another row writes, named to explain a product).
NOTE_KEY = re.compile(r"(?<![\w/.])(?<!x )[a-z_]+(?:\.[a-z_0-9]+)+")
FILE_SUFFIXES = (".py", ".jsonl", ".txt")
FACTOR = re.compile(r"(?<= x )[a-z_]+(?:\.[a-z_0-9]+)+")
REFUSAL = re.compile(r"^refused unless (\S+)")
# "key (X: Y)": with the field at X, the converter writes Y under key.
CASE = re.compile(r"([a-z_]+(?:\.[a-z_0-9]+)+) \((None|0): ([^,)]+)[,)]")
# A value each refusing row must refuse (and that TrainConfig itself accepts).
REFUSED_VALUES = {
    "advantage_eps": 1e-4,
    "nan_rewards": "ignore",
    "kl_importance_weighting": True,
    "top_entropy_quantile": 0.2,
    "sft_max_steps": 5,
    "mismatch": "logit_noise",
    "sampler_correction": "token_truncate",
    "dynamic_sampling": True,
    "max_staleness": 1,
    "mask_truncated_completions": True,
    "overlong_buffer": 16,
    "lora_dropout": 0.05,
    "lora_train_norms": True,
}


def gpu_config(**changes) -> TrainConfig:
    values = {
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "task": "reverse",
        "task_options": {"n_digits": 5},
        "sft_max_steps": 0,
        "importance_reweighting_method": "grpo",
        "cliprange": 0.2,
        "cliprange_high": 0.28,
        "kl_coef": 0.01,
        "train_batch_size": 128,
        "gradient_accumulation_steps": 16,
        **changes,
    }
    return TrainConfig.for_profile("gpu", **values)


@pytest.fixture(scope="module")
def configs() -> list[TrainConfig]:
    """Configs that between them make every row write something."""
    return [
        gpu_config(),
        gpu_config(
            lora_rank=8,
            lora_alpha=16,
            lora_lr=1e-5,
            lora_dropout=0.0,
            lora_train_norms=False,
        ),
        gpu_config(loss_normalization="constant", normalization_constant=256),
        gpu_config(chat_template=False),
        gpu_config(  # on-policy distillation beside the task reward
            teacher="Qwen/Qwen2.5-1.5B-Instruct",
            distillation="reward",
            distillation_estimator="k1",
            distillation_task_reward=True,
            distillation_coef=0.5,
            ratio_cap=3.0,
        ),
        gpu_config(reward_aggregation="normalize_then_sum_tokens"),
    ]


def with_field(config: TrainConfig, name: str, value: object) -> TrainConfig:
    """A copy of ``config`` with one field changed, not re-checked (a value
    TrainConfig would refuse reaches the converter as it is)."""
    changed = copy.copy(config)
    setattr(changed, name, value)
    return changed


def written(name: str, configs: list[TrainConfig]) -> dict[str, object]:
    """Every override row ``name`` writes for any of ``configs`` it accepts."""
    overrides: dict[str, object] = {}
    for config in configs:
        try:
            overrides.update(EXPORTS[name].convert(config, Target()))
        except ValueError:
            continue
    return overrides


def named_by(note_key: str, key: str) -> bool:
    return key == note_key or key.endswith("." + note_key)


def is_named(name: str, key: str, value: object) -> bool:
    """Whether row ``name``'s note names ``key`` or, for a file, its value."""
    note = EXPORTS[name].note
    if isinstance(value, str) and "/" in value and value in note:
        return True  # data/train.jsonl, data/reward.py: the note names the file
    return any(named_by(note_key, key) for note_key in note_keys(name))


def keys_in(note: str) -> list[str]:
    return [key for key in NOTE_KEY.findall(note) if not key.endswith(FILE_SUFFIXES)]


def note_keys(name: str) -> list[str]:
    return keys_in(EXPORTS[name].note)


def test_the_key_pattern_reads_short_and_full_keys_but_not_files():
    note = "data.seed, actor.optim.betas[1], data/reward.py (None: inf) x rollout.n"
    assert keys_in("the data files and reward.py") == []
    assert keys_in(note) == ["data.seed", "actor.optim.betas"]
    assert FACTOR.findall(note) == ["rollout.n"]
    assert named_by("actor.clip_ratio", "actor_rollout_ref.actor.clip_ratio")
    assert not named_by("actor.clip_ratio", "actor_rollout_ref.actor.clip_ratio_c")


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_a_note_names_only_keys_its_converter_writes(name, configs):
    keys = written(name, configs)
    for note_key in note_keys(name):
        assert any(named_by(note_key, key) for key in keys), (
            f"{name}'s note names {note_key}, which its converter never writes "
            f"(it writes {sorted(keys)})"
        )
    if keys and not REFUSAL.match(EXPORTS[name].note):
        named = [key for key, value in keys.items() if is_named(name, key, value)]
        assert named, f"{name}'s note names none of the keys it writes: {sorted(keys)}"


def test_a_factor_a_note_names_is_written_by_its_own_row(configs):
    factors = {k for row in EXPORTS.values() for k in FACTOR.findall(row.note)}
    assert factors == {"rollout.n"}  # rollout_batch_size's and train_batch_size's
    for factor in factors:
        writers = [
            n for n in EXPORTS if any(named_by(factor, k) for k in written(n, configs))
        ]
        assert writers == ["group_size"], factor


def test_every_refusing_row_has_a_value_to_refuse():
    refusing = {name for name, row in EXPORTS.items() if REFUSAL.match(row.note)}
    assert refusing == set(REFUSED_VALUES) | {"device"}


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_a_refusing_row_refuses_what_its_note_says(name, configs):
    config = configs[1] if name.startswith("lora_") else configs[0]  # adapters on
    allowed = ast.literal_eval(REFUSAL.match(EXPORTS[name].note).group(1))
    assert getattr(config, name) == allowed, (name, allowed)  # what the rows pass
    EXPORTS[name].convert(config, Target())
    bad = with_field(config, name, REFUSED_VALUES[name])
    with pytest.raises(ValueError, match=f"^{name} must be"):
        EXPORTS[name].convert(bad, Target())


def test_the_device_row_refuses_a_cpu_run(configs):
    EXPORTS["device"].convert(configs[0], Target())
    with pytest.raises(ValueError, match=r"^device must be a CUDA device"):
        EXPORTS["device"].convert(with_field(configs[0], "device", "cpu"), Target())


def test_a_notes_cases_are_what_its_converter_writes(configs):
    config = configs[0]
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    checked = []
    for name, row in EXPORTS.items():
        for note_key, case, value in CASE.findall(row.note):
            if value == "inf":
                expected = math.inf
            elif re.fullmatch(r"-?\d+", value):
                expected = int(value)
            elif value in fields:
                expected = getattr(config, value)
            else:
                continue  # a case in words ("the task's"): not a value to compare
            overrides = row.convert(with_field(config, name, eval(case)), Target())
            (key,) = [key for key in overrides if named_by(note_key, key)]
            assert overrides[key] == expected, (name, note_key, case, value)
            checked.append(name)
    assert sorted(checked) == [
        "autocast_dtype",
        "checkpoint_every",
        "eval_every",
        "max_grad_norm",
        "ratio_cap",
    ]


def test_every_field_is_exported_not_training_or_default_only():
    from grpo_lab.integrations.verl.settings import (
        NOT_TRAINING_SETTINGS,
        exported_fields,
    )

    names = [field.name for field in dataclasses.fields(TrainConfig)]
    assert not set(EXPORTS) & set(NOT_TRAINING_SETTINGS)
    assert set(EXPORTS) | set(NOT_TRAINING_SETTINGS) <= set(names)  # none gone
    rowless = [n for n in names if n not in EXPORTS and n not in NOT_TRAINING_SETTINGS]
    listed = exported_fields()
    assert sorted(listed) == sorted(names)
    assert [n for n in names if listed[n] == "refused unless default"] == rowless


# --- REINFORCE++ and the reward's parts ---------------------------------------------


def test_reward_parts_and_token_whitening_export_as_verl_runs_them(tmp_path):
    from grpo_lab.integrations.verl.launch import write_launch_folder
    from grpo_lab.integrations.verl.settings import launch_overrides

    gdpo = launch_overrides(gpu_config(reward_aggregation="normalize_then_sum_tokens"))
    assert gdpo["algorithm.adv_estimator"] == "gdpo"
    assert gdpo["++algorithm.gdpo_reward_keys"] == ["format_reward", "answer_reward"]
    assert gdpo["algorithm.norm_adv_by_std_in_grpo"] is True
    plain = launch_overrides(gpu_config(advantage_normalizer="token_whiten"))
    assert plain["algorithm.adv_estimator"] == "grpo_lab_mean_token_whiten"
    for aggregation, expected in (
        ("reward", 1.0),
        ("sum_then_normalize", 2.0),
        ("normalize_then_sum_tokens", None),
    ):
        folder = tmp_path / aggregation
        write_launch_folder(gpu_config(reward_aggregation=aggregation), folder)
        namespace: dict = {"__file__": str(folder / "data" / "reward.py")}
        exec((folder / "data" / "reward.py").read_text(), namespace)
        score = namespace["compute_score"]("grpo_lab/reverse", "12345", "12345")
        if expected is None:  # verl's gdpo reads the parts by key
            assert score == {"score": 1.0, "format_reward": 1.0, "answer_reward": 1.0}
        else:
            assert score == expected


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"reward_aggregation": "normalize_then_sum"}, "reward_aggregation must be"),
        (
            {"reward_aggregation": "normalize_then_sum_tokens", "baseline": "none"},
            "advantage_normalizer must be 'std' or 'none' with baseline 'mean'",
        ),
    ],
)
def test_reward_parts_verl_cannot_run_are_refused_by_name(changes, message):
    from grpo_lab.integrations.verl.settings import launch_overrides

    with pytest.raises(ValueError, match=message):
        launch_overrides(gpu_config(**changes))


def test_an_asynchronous_run_is_refused_naming_verls_asynchronous_trainers():
    config = TrainConfig.for_profile("cpu", max_staleness=1, async_admission="pace")
    with pytest.raises(ValueError, match="max_staleness must be 0") as error:
        EXPORTS["max_staleness"].convert(config, Target())
    message = str(error.value)
    for name in (
        "one_step_off_policy",
        "algorithm.rollout_correction.bypass_mode",
        "fully_async_policy",
        "async_training.staleness_threshold",
        "async_training.trigger_parameter_sync_step",
        "partial_rollout",
    ):
        assert name in message
