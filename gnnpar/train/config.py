"""Typed run configuration: dataclasses filled from defaults, then a TOML file, then flags.

Every task (``gcn``, ``sage``, ``gpt``) has one flat dataclass. :func:`add_flags` turns its
fields into command-line flags (``--hidden 16``, ``--no-permute``); :func:`resolve` merges
defaults ← ``--config FILE`` ← flags and checks every key and type, so a typo or a wrong type
is one clear error naming the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration that cannot be used (unknown key, wrong type, bad value)."""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of an annotation such as ``int``, ``str | None``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported config annotation {tp}")
        return args[0], True
    return tp, False


def _coerce(key: str, value: Any, tp: Any) -> Any:
    base, optional = _base_type(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"config key '{key}' must be a {base.__name__}, got nothing")
    if base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif base is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported config type {base}")
    raise ConfigError(
        f"config key '{key}' must be a {base.__name__}, got {type(value).__name__} {value!r}"
    )


def from_mapping(cls: type, values: dict[str, Any], where: str = "config") -> Any:
    """An instance of ``cls`` from ``values``; unknown keys and wrong types are errors."""
    types_ = _field_types(cls)
    unknown = sorted(set(values) - set(types_))
    if unknown:
        raise ConfigError(
            f"unknown key '{unknown[0]}' in {where}; known keys: {', '.join(sorted(types_))}"
        )
    out = {k: _coerce(k, v, types_[k]) for k, v in values.items()}
    obj = cls(**out)
    check = getattr(obj, "check", None)
    if check is not None:
        check()
    return obj


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file into a flat dict (a single top-level table named like the task, e.g.
    ``[gcn]``, is also accepted)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    tables = [k for k, v in data.items() if isinstance(v, dict)]
    if len(tables) == 1 and len(data) == 1:
        data = data[tables[0]]
    return data


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of ``cls`` (default ``None``: unset flags do not override)."""
    for f in dataclasses.fields(cls):
        base, _ = _base_type(_field_types(cls)[f.name])
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if base is bool:
            parser.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{help_text} (default: {default})",
            )
        else:
            parser.add_argument(
                flag,
                dest=f.name,
                type=base,
                default=None,
                metavar=base.__name__.upper(),
                help=f"{help_text} (default: {default})",
            )


def resolve(cls: type, args: argparse.Namespace, config_file: str | None) -> Any:
    """Defaults ← TOML file ← flags, as an instance of ``cls``."""
    values: dict[str, Any] = {}
    if config_file:
        values.update(load_toml(config_file))
        # validate the file on its own first, so its errors name the file
        from_mapping(cls, dict(values), where=f"config file {config_file}")
    for f in dataclasses.fields(cls):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return from_mapping(cls, values)


def to_toml(obj: Any) -> str:
    """The configuration as TOML text (what ``--print-config`` shows)."""
    lines = []
    for k, v in dataclasses.asdict(obj).items():
        if v is None:
            lines.append(f"# {k} = (unset)")
        elif isinstance(v, bool):
            lines.append(f"{k} = {'true' if v else 'false'}")
        elif isinstance(v, str):
            lines.append(f'{k} = "{v}"')
        else:
            lines.append(f"{k} = {v}")
    return "\n".join(lines) + "\n"
