"""grpo_lab.integrations.unrowed: a field with no row in an engine's table.

A made-up setting (a ``TrainConfig`` subclass with one more field, declared as
the real ones are) has no row in TRL's table nor verl's: both exports refuse it
away from its default, naming it and its value, and carry the run unchanged at
its default or when the setting has no effect.
"""

from __future__ import annotations

import dataclasses

import pytest

from grpo_lab.errors import UserError
from grpo_lab.integrations import unrowed
from grpo_lab.integrations.trl import translation as grpo_trl
from grpo_lab.integrations.verl import settings as verl_settings
from grpo_lab.training.config import TrainConfig
from grpo_lab.training.config.fields import setting

NEW = "made_up_loss_knob"
WithNewSetting = dataclasses.make_dataclass(
    "WithNewSetting",
    [(NEW, float, setting(0.5, "advantages and loss", "A setting with no rows."))],
    bases=(TrainConfig,),
)


def new_config(**changes) -> TrainConfig:
    """The gpu profile as verl can export it, on the subclass, with ``changes``."""
    base = TrainConfig.for_profile(
        "gpu", model="Qwen/Qwen2.5-0.5B-Instruct", sft_max_steps=0
    )
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
    return WithNewSetting(**{**values, **changes})


def test_the_made_up_field_has_no_row_in_either_table():
    names = [field.name for field in dataclasses.fields(WithNewSetting)]
    assert unrowed.unrowed_fields(WithNewSetting, [[]]) == names  # in field order
    assert names[-1] == NEW
    trl_tables = (
        grpo_trl.TRANSLATIONS,
        grpo_trl.LAUNCH_SETTINGS,
        grpo_trl.NOT_TRAINING_SETTINGS,
    )
    verl_tables = (verl_settings.EXPORTS, verl_settings.NOT_TRAINING_SETTINGS)
    for tables in (trl_tables, verl_tables):
        rowless = unrowed.unrowed_fields(TrainConfig, tables)
        assert unrowed.unrowed_fields(WithNewSetting, tables) == [*rowless, NEW]


def test_trl_refuses_it_away_from_its_default_naming_it():
    with pytest.raises(UserError) as refused:
        grpo_trl.to_trl_config(new_config(**{NEW: 0.7}))
    message = str(refused.value)
    assert message.startswith(f"{NEW} 0.7: TRL's GRPOTrainer has no counterpart")
    assert "set it to its default 0.5 or train with grpo_lab" in message


def test_trl_carries_it_at_its_default_unchanged():
    config = new_config()
    plain = TrainConfig.for_profile(
        "gpu", model="Qwen/Qwen2.5-0.5B-Instruct", sft_max_steps=0
    )
    assert grpo_trl.to_trl_config(config) == grpo_trl.to_trl_config(plain)


def test_verl_refuses_it_away_from_its_default_naming_it():
    with pytest.raises(ValueError, match=f"^{NEW} must be its default 0.5 ") as no:
        verl_settings.launch_overrides(new_config(**{NEW: 0.7}))
    assert "verl has no counterpart" in str(no.value)
    assert str(no.value).endswith("got 0.7")


def test_verl_carries_it_at_its_default_unchanged():
    plain = TrainConfig.for_profile(
        "gpu", model="Qwen/Qwen2.5-0.5B-Instruct", sft_max_steps=0
    )
    overrides = verl_settings.launch_overrides(new_config())
    assert overrides == verl_settings.launch_overrides(plain)


def test_an_inert_value_is_carried_by_both(monkeypatch):
    config = new_config(**{NEW: 0.7})
    with pytest.raises(UserError):
        grpo_trl.to_trl_config(config)
    note = {NEW: "read only by something this config turns off"}
    monkeypatch.setattr(unrowed, "inert_settings", lambda c: note)
    assert grpo_trl.to_trl_config(config) == grpo_trl.to_trl_config(new_config())
    assert verl_settings.launch_overrides(config) == verl_settings.launch_overrides(
        new_config()
    )


def test_the_tables_list_it_as_refused_unless_default():
    table = grpo_trl.translation_table(config_class=WithNewSetting)
    assert table.splitlines()[-1] == f"| `{NEW}` | — | refused unless default |"
    assert table.startswith(grpo_trl.translation_table() + "\n")
    exported = verl_settings.exported_fields(config_class=WithNewSetting)
    assert exported[NEW] == "refused unless default"
    assert {n: exported[n] for n in exported if n != NEW} == (
        verl_settings.exported_fields()
    )


def test_a_default_from_a_factory_is_its_value():
    built = TrainConfig()  # every field at its default
    for name in ("task_options", "kl_coef", "cliprange_high", "report_to"):
        assert unrowed.field_default(TrainConfig, name) == getattr(built, name)
    assert isinstance(unrowed.field_default(TrainConfig, "task_options"), dict)
