"""Dataset options, ``KEY=VALUE`` pairs: parsed as each dataset's builder takes them and
checked before anything loads. Every command that names a dataset reads its options here
(``gnnpar train``, ``gnnpar data``, ``gnnpar-partition``, the example scripts)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gnnpar.data.catalogue import catalogue, get_entry
from gnnpar.data.structure import STRUCTURE_DEFAULTS, split_structure
from gnnpar.errors import UserError

__all__ = [
    "DATASET_OPTIONS_HELP",
    "add_dataset_options",
    "check_dataset",
    "parse_options",
    "split_options",
]

DATASET_OPTIONS_HELP = "dataset options as k=v,k=v (e.g. normalize_features=true)"

_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})


def _parse_bool(key: str, text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise UserError(f"option {key}: expected true or false, got {text!r}")


def _guess(text: str) -> Any:
    """A value of unknown type: int, then float, then boolean, else the string itself."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def split_options(text: str | None) -> list[str]:
    """``"k=v,k=v"`` (the one spelling of dataset options, ``--dataset-options``) as its
    ``k=v`` items; ``None`` or blank is none."""
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def add_dataset_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--dataset-options k=v,k=v``: how every command and example takes a dataset's
    options (the trainer's ``dataset_options``); read it back with :func:`split_options`."""
    parser.add_argument(
        "--dataset-options", default=None, metavar="K=V,K=V", help=DATASET_OPTIONS_HELP
    )


def parse_options(pairs: Sequence[str], defaults: Mapping[str, Any] | None = None) -> dict:
    """Turn ``["num_nodes=5000", "seed=1"]`` into keyword arguments.

    Values take the type of the default of the same key when there is one (``bool`` accepts
    true/false/yes/no/1/0); otherwise ints, floats and booleans are recognised. Dashes in keys
    become underscores.
    """
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise UserError(f"expected KEY=VALUE, got {pair!r}")
        if not key.isidentifier():  # also keeps every message that names the key one line
            raise UserError(f"option names are letters, digits and _, got {key!r}")
        default = None if defaults is None else defaults.get(key)
        if isinstance(default, bool):
            options[key] = _parse_bool(key, text)  # its own error names the key
            continue
        try:
            if isinstance(default, int):
                value: Any = int(text)
            elif isinstance(default, float):
                value = float(text)
            elif isinstance(default, str):
                value = text
            else:
                value = _guess(text)
        except ValueError:
            kind = type(default).__name__
            raise UserError(f"option {key}: expected {kind}, got {text!r}") from None
        options[key] = value
    return options


def _defaults_for(name: str) -> Mapping[str, Any]:
    """The option defaults of ``name``: its builder's and the structure options."""
    entry = get_entry(name)
    return {**({} if entry is None else entry.defaults), **STRUCTURE_DEFAULTS}


def check_dataset(name: str, pairs: Sequence[str]) -> dict[str, Any]:
    """Parse a dataset's ``KEY=VALUE`` options as its builder takes them (a catalogue name:
    known keys, the defaults' types; every dataset takes the structure options of
    :mod:`gnnpar.data.structure`) and check that a name outside the catalogue is a folder;
    a :class:`ValueError` of one line otherwise. Returns the options."""
    options = parse_options(pairs, _defaults_for(name))
    if "root" in options:
        raise UserError("give the data root as the root option (--root DIR), not as root=")
    own, _ = split_structure(options)
    entry = get_entry(name)
    if entry is not None:
        entry.resolve_kwargs(own)
    elif not Path(name).exists():
        names = ", ".join(e.name for e in catalogue())
        raise UserError(
            f"unknown dataset {name!r}: not a catalogue name ({names}) and no such folder"
        )
    return options
