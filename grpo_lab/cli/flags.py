"""The ``grpo-lab train`` and ``export`` flags, without importing torch.

Every flag is a ``TrainConfig`` field, but the ``grpo_lab/training/config``
package imports torch and the whole core (their registries give the choices), which
takes seconds, and longer on a loaded machine: too long for ``--help``. So the
flags are kept here as data, ``cli_flags.json`` (each field's section, help,
choices, type and every profile's value), written by
``python -m grpo_lab.cli.flags`` from ``TrainConfig`` itself. The table records
the SHA-256 of the config package it was written from; when a file has changed
since, the flags are read from ``TrainConfig`` directly (slower, never stale),
and ``tests/test_cli_help.py`` fails until the table is written again.

A flag's text is converted by the config's one value parser
(:func:`grpo_lab.training.config.field_value`, which reads config files too),
imported when a flag is given, not for ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import typing
from pathlib import Path
from typing import Any

TABLE_PATH = Path(__file__).with_name("flags.json")
CONFIG_PACKAGE = Path(__file__).parents[1] / "training" / "config"
# The flag whose default is chosen by the machine, not by a profile.
PROFILE_FIELD = "profile"


def config_digest() -> str:
    """SHA-256 of the training/config package, the files the flags are written
    from (each module's name and bytes, in name order)."""
    digest = hashlib.sha256()
    for path in sorted(CONFIG_PACKAGE.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def flag_table() -> dict[str, Any]:
    """The flags as data, from TrainConfig (imports torch and the core)."""
    from grpo_lab.training import config as config_module
    from grpo_lab.training.run_dir import RESUMABLE_FIELDS

    hints = typing.get_type_hints(config_module.TrainConfig)
    profiles = {
        name: config_module.TrainConfig.for_profile(name).to_dict()
        for name in config_module.PROFILES
    }
    fields = []
    for config_field in dataclasses.fields(config_module.TrainConfig):
        kind = hints[config_field.name]
        fields.append(
            {
                "name": config_field.name,
                "section": config_field.metadata["section"],
                "help": config_field.metadata["help"],
                "choices": list(config_field.metadata["choices"]) or None,
                "boolean": kind is bool,
                "type": _type_name(kind),
                "profiles": {
                    p: values[config_field.name] for p, values in profiles.items()
                },
            }
        )
    return {
        "config_sha256": config_digest(),
        "sections": list(config_module.SECTIONS),
        "resumable_fields": list(RESUMABLE_FIELDS),
        "fields": fields,
    }


def _type_name(kind: Any) -> str:
    """The metavar-style name of a field's type: int, float, str, ..."""
    if typing.get_origin(kind) is dict:
        return "json"
    arguments = [a for a in typing.get_args(kind) if a is not type(None)]
    base = arguments[0] if arguments else kind
    return getattr(base, "__name__", "value")


def stored_table() -> dict[str, Any] | None:
    """The written table when it matches today's config package, else None."""
    try:
        table = json.loads(TABLE_PATH.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return table if table.get("config_sha256") == config_digest() else None


def current_table() -> dict[str, Any]:
    """The stored table when it is current, else one built from TrainConfig."""
    return stored_table() or flag_table()


def write_table(path: Path = TABLE_PATH) -> Path:
    """Write :func:`flag_table` to ``path`` (``python -m grpo_lab.cli.flags``)."""
    text = json.dumps(flag_table(), indent=1, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")
    return path


def field_names(table: dict[str, Any]) -> tuple[str, ...]:
    return tuple(field["name"] for field in table["fields"])


def add_config_flags(
    parser: argparse.ArgumentParser,
    table: dict[str, Any],
    exclude: tuple[str, ...] = (),
) -> None:
    """One ``--flag`` per TrainConfig field (underscores become dashes), grouped
    by section, with the field's help text, its choices and every profile's value.

    Every flag defaults to "not given", so the chosen profile's defaults apply
    unless a flag overrides them. ``--task-options`` takes JSON; an optional
    value is cleared with ``none``.
    """
    groups = {name: parser.add_argument_group(name) for name in table["sections"]}
    for field in table["fields"]:
        if field["name"] in exclude:
            continue
        options: dict[str, Any] = {
            "dest": field["name"],
            "default": argparse.SUPPRESS,
            "help": (field["help"] + " " + profile_values(field)).replace("%", "%%"),
        }
        if field["boolean"]:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = FieldValue(field["name"], field["type"])
        if field["choices"]:
            options["choices"] = field["choices"]
            options["metavar"] = (
                "{" + ",".join(str(c).lower() for c in field["choices"]) + "}"
            )
        elif not field["boolean"]:
            options["metavar"] = field["name"].upper()
        flag = "--" + field["name"].replace("_", "-")
        groups[field["section"]].add_argument(flag, **options)


def profile_values(field: dict[str, Any]) -> str:
    """``(default: 0.0003; gpu: 1e-06)``: the cpu value, then each profile's
    value where it differs."""
    if field["name"] == PROFILE_FIELD:
        return "(default: chosen by the machine, or $GRPO_LAB_PROFILE)"
    values = field["profiles"]
    cpu = values["cpu"]
    others = [f"{p}: {_shown(v)}" for p, v in values.items() if p != "cpu" and v != cpu]
    if not others:
        return f"(default: {_shown(cpu)})"
    return f"(default: {_shown(cpu)}; {', '.join(others)})"


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


class FieldValue:
    """argparse ``type=``: a flag's text to the field's value, by the config's
    parser (imported on first use, so ``--help`` never loads torch)."""

    def __init__(self, name: str, type_name: str):
        self.name = name
        self.__name__ = type_name  # argparse names it in "invalid int value"

    def __call__(self, text: str) -> Any:
        from grpo_lab.training.config import field_value

        return field_value(self.name, text, from_text=True)

    def __repr__(self) -> str:
        return self.__name__


if __name__ == "__main__":
    print(f"wrote {write_table()}")
