"""The command line's bridge: TrainConfig fields as flags, and flag text as values."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any

from grpo_lab.training.config.fields import SECTIONS
from grpo_lab.training.config.memory import chosen_profile
from grpo_lab.training.config.train_config import TrainConfig


def add_config_arguments(
    parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()
) -> None:
    """One ``--flag`` per TrainConfig field (underscores become dashes), grouped
    by section, with the field's help text and its choices.

    Every flag defaults to "not given", so the chosen profile's defaults apply
    unless a flag overrides them. ``--task-options`` takes JSON; an optional
    value is cleared with ``none``.
    """
    hints = typing.get_type_hints(TrainConfig)
    groups = {name: parser.add_argument_group(name) for name in SECTIONS}
    for config_field in dataclasses.fields(TrainConfig):
        if config_field.name in exclude:
            continue
        kind = hints[config_field.name]
        options: dict[str, Any] = {
            "dest": config_field.name,
            "default": argparse.SUPPRESS,
            "help": config_field.metadata["help"].replace("%", "%%"),
        }
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["type"] = flag_value(config_field.name)
        choices = config_field.metadata["choices"]
        if choices:
            options["choices"] = choices
            options["metavar"] = "{" + ",".join(str(c).lower() for c in choices) + "}"
        elif kind is not bool:
            options["metavar"] = config_field.name.upper()
        flag = "--" + config_field.name.replace("_", "-")
        groups[config_field.metadata["section"]].add_argument(flag, **options)


def config_from_arguments(arguments: argparse.Namespace) -> TrainConfig:
    """The config a parsed command line asks for (profile defaults + flags)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {key: value for key, value in vars(arguments).items() if key in names}
    profile = given.pop("profile", None) or chosen_profile()
    return TrainConfig.for_profile(profile, **given)


def flag_value(name: str) -> Callable[[str], Any]:
    """argparse ``type=`` for field ``name``: :func:`field_value` of the text."""

    def parse(text: str) -> Any:
        return field_value(name, text, from_text=True)

    kind = _type_options(typing.get_type_hints(TrainConfig)[name])[0]
    parse.__name__ = getattr(kind, "__name__", "value")  # "invalid int value"
    return parse


# A float as YAML 1.2 and JSON spell it (YAML 1.1 reads "3e-4" as a string).
FLOAT_TEXT = re.compile(
    r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?"
    r"|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)"
)


def field_value(
    name: str, value: Any, *, from_text: bool = False, where: str = ""
) -> Any:
    """The value of field ``name`` given on the command line or in a config file.

    The one parser of both doors, read from the field's type hint:

    - a flag's text (``from_text``): ``none`` clears a field of several types
      (``int | None``, ``str | list[str]``), a dict
      field reads a JSON object, any other is converted by the field's type
      (``int("16")``); a bad text raises what argparse reports ("invalid int
      value");
    - a config file's value, already typed by YAML or JSON: it must fit the
      field's type (a bool is no number), except that a float field also takes
      a string in decimal or scientific notation; ``ValueError`` otherwise,
      naming the field (``where`` says where it was given).
    """
    options = _type_options(typing.get_type_hints(TrainConfig)[name])
    if from_text:
        return _value_from_text(options, value)
    return _value_from_file(name, options, value, where)


def _value_from_text(options: tuple[Any, ...], text: str) -> Any:
    if typing.get_origin(options[0]) is dict:
        return _json_object(text)
    if len(options) > 1 and text.lower() == "none":
        return None
    if bool in options and text.lower() in ("true", "false"):
        return text.lower() == "true"  # bool("false") would be True
    base = next(option for option in options if option not in (type(None), bool))
    return base(text)


def _value_from_file(
    name: str, options: tuple[Any, ...], value: Any, where: str
) -> Any:
    if value is None and type(None) in options:
        return None
    for option in options:
        base = typing.get_origin(option) or option
        if base is float and isinstance(value, str) and FLOAT_TEXT.fullmatch(value):
            with contextlib.suppress(ValueError):
                return float(value)
        if _fits(value, base):
            return value
    names = " or ".join(
        getattr(typing.get_origin(o) or o, "__name__", str(o)) for o in options
    )
    raise ValueError(f"{name}{where} must be {names}, got {value!r}")


def _type_options(kind: Any) -> tuple[Any, ...]:
    """The types a field's hint allows: ``int | None`` -> ``(int, NoneType)``."""
    union = typing.get_origin(kind) in (typing.Union, types.UnionType)
    return typing.get_args(kind) if union else (kind,)


def _fits(value: Any, base: Any) -> bool:
    if base is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(base, type) and isinstance(value, base)


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value
