"""``grpo-lab train --config FILE``: a YAML or JSON file of TrainConfig fields.

Read strictly (:func:`read_config_file`): a key given twice, a YAML 1.1
surprise (``0x10``, ``yes``), an unknown key or a value of the wrong type is a
``UserError`` naming the file and the line or key. Each value is converted by
the parser that also reads the flags (:func:`grpo_lab.training.config.field_value`).
Imported only when a file is given, like the config itself.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any

from grpo_lab.cli.flags import current_table, field_names
from grpo_lab.errors import UserError

# The flags as data (cli.py reads them from here too): a file's keys are theirs.
FLAG_TABLE = current_table()
FIELD_NAMES = field_names(FLAG_TABLE)
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
USAGE_HINT = "see grpo-lab train --help"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def read_config_file(path: str | Path, *, from_trl: bool = False) -> dict[str, Any]:
    """The TrainConfig fields of a YAML or JSON file, each checked against its type.

    Parsed strictly: a key given twice is refused (YAML and JSON would keep the
    last); so is a plain YAML scalar that YAML 1.1 (PyYAML) reads differently
    from YAML 1.2 and JSON: hexadecimal, octal, binary, sexagesimal or
    underscored numbers (``0x10``, ``010``, ``1_000``, ``1:30``) and
    ``yes``/``no``/``on``/``off`` booleans (quote them for a string; write
    ``16`` or ``true``). Unknown keys are refused with the nearest field's name
    and, for a TRL ``GRPOConfig`` name, its grpo_lab name from the TRL table;
    ``resume`` is refused (use ``--resume``). A float field also takes a string
    in decimal or scientific notation (YAML 1.1 reads ``3e-4`` as a string).
    ``from_trl``: the keys are TRL names, translated through that table. A
    file that is not UTF-8 (UTF-16 from some Windows editors) or that sets
    nothing (empty, or comments only) is refused, naming the file.
    """
    path = Path(path)
    if path.suffix.lower() not in CONFIG_SUFFIXES:
        raise UserError(
            f"config file {path} must end in {', '.join(CONFIG_SUFFIXES)}",
            "rename it, or write it as YAML or JSON",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise UserError(
            f"config file {path} cannot be read: {error.strerror or error}",
            "check the path given to --config",
        ) from error
    except UnicodeDecodeError as error:
        raise UserError(
            f"config file {path} must be UTF-8 text, got byte "
            f"0x{error.object[error.start]:02x} at offset {error.start}"
            + (
                " (a UTF-16 byte-order mark)" if error.object[:2] in _UTF16_BOMS else ""
            ),
            "save it as UTF-8",
        ) from error
    values = _parse_config_text(text, path)
    if values is None:
        raise UserError(
            f"config file {path} sets no field: it is empty or only comments",
            "write one 'name: value' line per setting, or leave out --config",
        )
    if not isinstance(values, dict):
        raise UserError(
            f"config file {path} must map field names to values, got "
            f"{type(values).__name__}",
            "write one 'name: value' line per setting",
        )
    if from_trl:
        values = _translated_from_trl(values, path)
    for key in values:
        _check_config_key(key, path)
    return {key: _config_value(key, value, path) for key, value in values.items()}


def _translated_from_trl(values: dict[str, Any], path: Path) -> dict[str, Any]:
    from grpo_lab.integrations.trl.names import from_trl_values

    try:
        return from_trl_values(values)
    except UserError as error:
        raise UserError(f"config file {path}: {error.problem}", error.fix) from error


# Plain YAML scalars that read the same in YAML 1.1 (PyYAML) and YAML 1.2 / JSON
# (floats: grpo_lab.training.config.command_line.FLOAT_TEXT).
_YAML12_INT = re.compile(r"[-+]?(0|[1-9][0-9]*)")
_YAML12_BOOL = re.compile(r"true|True|TRUE|false|False|FALSE")


class _AmbiguousYaml(Exception):
    """A key given twice, or a scalar YAML 1.1 reads as something else."""

    def __init__(self, line: int, problem: str) -> None:
        self.line, self.problem = line, problem
        super().__init__(problem)


def _strict_yaml_loader() -> type:
    """PyYAML's SafeLoader, refusing duplicate keys and YAML 1.1 surprises."""
    import yaml

    from grpo_lab.training.config.command_line import FLOAT_TEXT

    class StrictLoader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
        loader.flatten_mapping(node)
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _AmbiguousYaml(
                    line, f"key {key!r} is given twice (lines {seen[key]} and {line})"
                )
            seen[key] = line
        return loader.construct_mapping(node, deep=True)

    def strict(tag: str, pattern: re.Pattern, fix: str) -> None:
        construct = yaml.SafeLoader.yaml_constructors[f"tag:yaml.org,2002:{tag}"]

        def constructor(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
            value = construct(loader, node)
            if not pattern.fullmatch(node.value):
                raise _AmbiguousYaml(
                    node.start_mark.line + 1,
                    f"{node.value!r} is read by YAML 1.1 as the {tag} {value!r}, a "
                    "YAML 1.1 surprise (numbers are read in decimal only, booleans "
                    f"as true or false only); {fix}",
                )
            return value

        StrictLoader.add_constructor(f"tag:yaml.org,2002:{tag}", constructor)

    StrictLoader.add_constructor("tag:yaml.org,2002:map", mapping)
    strict("int", _YAML12_INT, "write the number in decimal, or quote a string")
    strict("float", FLOAT_TEXT, "write the number in decimal, or quote a string")
    strict("bool", _YAML12_BOOL, "write true or false, or quote a string")
    return StrictLoader


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (json keeps the last)."""
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _AmbiguousYaml(0, f"key {key!r} is given twice")
        seen[key] = value
    return seen


def _parse_config_text(text: str, path: Path) -> Any:
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text, object_pairs_hook=_unique_keys)
        except _AmbiguousYaml as error:
            raise UserError(
                f"config file {path}: {error.problem}", "keep one of them"
            ) from error
        except json.JSONDecodeError as error:
            raise UserError(
                f"config file {path} is not valid JSON: {error}", "fix that line"
            ) from error
    try:
        import yaml
    except ImportError as error:
        raise UserError(
            f"reading {path} needs PyYAML",
            "pip install pyyaml, or write the config as JSON",
        ) from error
    try:
        values = yaml.load(text, Loader=_strict_yaml_loader())
    except _AmbiguousYaml as error:
        raise UserError(
            f"config file {path} line {error.line}: {error.problem}", USAGE_HINT
        ) from error
    except yaml.YAMLError as error:
        problem = " ".join(str(error).split())
        raise UserError(
            f"config file {path} is not valid YAML: {problem}", "fix that line"
        ) from error
    return values


def _check_config_key(key: Any, path: Path) -> None:
    if key == "resume":
        raise UserError(
            f"config file {path} sets resume",
            "continue a run with grpo-lab train --resume RUN_DIR instead",
        )
    if key in FIELD_NAMES:
        return
    raise UserError(
        f"config file {path} has an unknown key {key!r}",
        f"{_unknown_name_hint(str(key))}the keys are TrainConfig fields; {USAGE_HINT}",
    )


def _unknown_name_hint(name: str) -> str:
    """ "TRL's `x` is grpo_lab's `y` (...); " for a TRL name, else "did you mean
    'nearest'? " (difflib), else ""."""
    name = name.replace("-", "_")
    if name not in FIELD_NAMES:
        from grpo_lab.integrations.trl.names import trl_name_hint

        trl = trl_name_hint(name)
        if trl is not None:
            return f"{trl}; or read a TRL-style file with --from-trl; "
    close = difflib.get_close_matches(name, FIELD_NAMES, n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def _config_value(name: str, value: Any, path: Path) -> Any:
    """``value`` when it fits the field's type (:func:`field_value`, the parser
    that also reads the flags)."""
    from grpo_lab.training.config import field_value

    try:
        return field_value(name, value, where=f" in config file {path}")
    except ValueError as error:
        raise UserError(str(error), USAGE_HINT) from error
