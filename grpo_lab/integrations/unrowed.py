"""The fields an engine's table has no row for: refused unless they change nothing.

TRL's :data:`~grpo_lab.integrations.trl.translation.TRANSLATIONS` and verl's
:data:`~grpo_lab.integrations.verl.settings.EXPORTS` hold one row per field
they carry, refuse or know to be harmless. A field with no row (a new setting,
say, that only grpo_lab's own loss reads) needs none to be safe: an export
refuses it, naming it, unless its value is the field's default or the setting
has no effect in the config (:func:`~grpo_lab.training.config.inert_settings`).
The tables' renderings list such a field as :data:`DEFAULT_ONLY_NOTE`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from grpo_lab.training.config import inert_settings

DEFAULT_ONLY_NOTE = "refused unless default"


def field_defaults(config_class: type) -> dict[str, Any]:
    """Each dataclass field's default (its factory's value, if any); fields
    without one are left out."""
    values = {}
    for found in dataclasses.fields(config_class):
        if found.default is not dataclasses.MISSING:
            values[found.name] = found.default
        elif found.default_factory is not dataclasses.MISSING:
            values[found.name] = found.default_factory()
    return values


def field_default(config_class: type, name: str) -> Any:
    """The dataclass default of field ``name`` (its factory's value, if any)."""
    return field_defaults(config_class)[name]


def unrowed_fields(config_class: type, tables: Iterable[Iterable[str]]) -> list[str]:
    """The fields of ``config_class`` that no table names, in field order."""
    named = set().union(*(set(table) for table in tables))
    return [f.name for f in dataclasses.fields(config_class) if f.name not in named]


def check_unrowed(
    config: Any,
    tables: Iterable[Iterable[str]],
    refusal: Callable[[str, Any, Any], Exception],
) -> None:
    """Raise ``refusal(name, value, default)`` for the first field no table names
    whose value is not its default and that has an effect in ``config``."""
    inert = inert_settings(config)
    for name in unrowed_fields(type(config), tables):
        value, default = getattr(config, name), field_default(type(config), name)
        if name not in inert and value != default:
            raise refusal(name, value, default)
