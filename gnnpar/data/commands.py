"""``gnnpar data list | prepare | info``: the dataset sub-commands of the ``gnnpar`` CLI."""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from gnnpar.data.catalogue import build, catalogue, default_root, get_entry, load, source_record
from gnnpar.data.storage import is_graph_folder, save_graph
from gnnpar.graph import Graph

__all__ = ["add_data_commands", "parse_options", "describe", "check_dataset", "root_and_options"]

_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})


def _parse_bool(key: str, text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(f"option {key}: expected true or false, got {text!r}")


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
            raise ValueError(f"expected KEY=VALUE, got {pair!r}")
        default = None if defaults is None else defaults.get(key)
        try:
            if isinstance(default, bool):
                value: Any = _parse_bool(key, text)
            elif isinstance(default, int):
                value = int(text)
            elif isinstance(default, float):
                value = float(text)
            elif isinstance(default, str):
                value = text
            else:
                value = _guess(text)
        except ValueError as err:
            if "option" in str(err):
                raise
            kind = type(default).__name__
            raise ValueError(f"option {key}: expected {kind}, got {text!r}") from None
        options[key] = value
    return options


def _defaults_for(name: str) -> Mapping[str, Any] | None:
    entry = get_entry(name)
    return None if entry is None else entry.defaults


def root_and_options(
    name: str, pairs: Sequence[str], root: str | None
) -> tuple[str | None, dict[str, Any]]:
    """The data root and the dataset's options from ``KEY=VALUE`` pairs, where ``root=DIR``
    may stand for ``--root DIR`` (the form error messages suggest); both at once must agree."""
    options = parse_options(pairs, _defaults_for(name))
    if "root" not in options:
        return root, options
    given = str(options.pop("root"))
    if root is not None and Path(root) != Path(given):
        raise ValueError(f"--root {root} and root={given} name different data roots")
    return given, options


def check_dataset(name: str, pairs: Sequence[str]) -> dict[str, Any]:
    """Parse a dataset's ``KEY=VALUE`` options as its builder takes them (a catalogue name:
    known keys, the defaults' types) and check that a name outside the catalogue is a folder;
    a :class:`ValueError` of one line otherwise. Returns the options."""
    options = parse_options(pairs, _defaults_for(name))
    if "root" in options:
        raise ValueError("give the data root as the root option (--root DIR), not as root=")
    entry = get_entry(name)
    if entry is not None:
        entry.resolve_kwargs(options)
    elif not Path(name).exists():
        names = ", ".join(e.name for e in catalogue())
        raise ValueError(
            f"unknown dataset {name!r}: not a catalogue name ({names}) and no such folder"
        )
    return options


def describe(graph: Graph) -> list[tuple[str, str]]:
    """``(field, value)`` rows summarising a graph, as printed by ``gnnpar data info``."""
    deg = graph.in_degrees()
    rows = [
        ("name", graph.name),
        ("nodes", f"{graph.num_nodes:,}"),
        (
            "edges",
            f"{graph.num_edges:,} stored (symmetric: {_yes(graph.is_symmetric())}, "
            f"self loops: {_yes(graph.has_self_loops())}, "
            f"weighted: {_yes(graph.edge_weight is not None)})",
        ),
    ]
    feat = graph.feat
    if feat is None:
        rows.append(("features", "none"))
    else:
        dim = feat.shape[1] if feat.dim() > 1 else 1
        rows.append(("features", f"{dim:,} ({str(feat.dtype).replace('torch.', '')})"))
    rows.append(("classes", str(graph.num_classes) if graph.label is not None else "no labels"))
    split = [
        f"{part} {int(mask.sum()):,}"
        for part, mask in (
            ("train", graph.train_mask),
            ("val", graph.val_mask),
            ("test", graph.test_mask),
        )
        if mask is not None
    ]
    rows.append(("split", " / ".join(split) if split else "none"))
    if graph.num_nodes:
        d = deg.to(torch.float64)
        rows.append(
            (
                "in-degree",
                f"min {int(deg.min())}, mean {float(d.mean()):.2f}, "
                f"median {float(d.median()):.0f}, max {int(deg.max())}; "
                f"isolated nodes: {int(((deg == 0) & (graph.out_degrees() == 0)).sum()):,}",
            )
        )
    others = sorted(set(graph.ndata) - {"feat", "label", "train_mask", "val_mask", "test_mask"})
    if others:
        rows.append(("other data", ", ".join(others)))
    return rows


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _cmd_list(args: argparse.Namespace) -> int:
    root = default_root() if args.root is None else Path(args.root)
    for entry in catalogue():
        prepared = root / entry.name
        mark = f"  [prepared: {prepared}]" if is_graph_folder(prepared) else ""
        print(f"{entry.name:<10} {entry.description}{mark}")
        options = " ".join(f"{k}={v}" for k, v in entry.defaults.items())
        print(f"{'':<10} options: {options or 'none'}")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    root, options = root_and_options(args.name, args.options, args.root)
    start = time.perf_counter()
    graph = build(args.name, root, **options)
    out = save_graph(
        graph, args.out, overwrite=args.overwrite, source=source_record(args.name, options)
    )
    print(
        f"wrote {out}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges "
        f"({time.perf_counter() - start:.1f} s)"
    )
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    root, options = root_and_options(args.target, args.options, args.root)
    graph = load(args.target, root, **options)
    for field, value in describe(graph):
        print(f"{field:<11} {value}")
    return 0


def _guarded(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Report expected failures (bad input, missing files) as one line and exit code 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (ValueError, TypeError, OSError, ImportError, pickle.UnpicklingError) as err:
            print(f"gnnpar data {args.data_command}: error: {err}", file=sys.stderr)
            return 2

    return run


class _IntermixedParser(argparse.ArgumentParser):
    """Lets ``KEY=VALUE`` positionals follow options (``prepare sbm --out d seed=1``), which
    plain ``parse_args`` rejects once the first positional has been matched."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if getattr(self, "_intermixing", False):
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def add_data_commands(subparsers: Any) -> None:
    """Register ``data`` (with ``list``, ``prepare``, ``info``) on an argparse sub-parsers
    object. Each command sets ``func``: ``func(args) -> exit code``."""
    data = subparsers.add_parser(
        "data",
        help="list, prepare and inspect datasets",
        description="List the dataset catalogue, prepare datasets in gnnpar's on-disk format, "
        "and summarise a dataset. The data root defaults to ./datasets ($GNNPAR_DATA).",
    )

    def usage(args: argparse.Namespace) -> int:
        data.print_usage(sys.stderr)
        print("gnnpar data: error: choose a command: list, prepare or info", file=sys.stderr)
        return 2

    data.set_defaults(func=usage, data_command=None)
    sub = data.add_subparsers(
        dest="data_command", metavar="{list,prepare,info}", parser_class=_IntermixedParser
    )

    p = sub.add_parser("list", help="the dataset catalogue and its options")
    p.add_argument("--root", default=None, help="data root (default: $GNNPAR_DATA or datasets)")
    p.set_defaults(func=_guarded(_cmd_list))

    p = sub.add_parser(
        "prepare",
        help="build a dataset and save it in gnnpar's format",
        description="Build NAME (a catalogue name or a Planetoid/OGB/gnnpar folder) with the "
        "given KEY=VALUE options and save it atomically to --out.",
    )
    p.add_argument("name", help="catalogue name (see 'gnnpar data list') or a folder")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--root", default=None, help="where file-based datasets are looked up")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    p.add_argument("options", nargs="*", metavar="KEY=VALUE", help="dataset options")
    p.set_defaults(func=_guarded(_cmd_prepare))

    p = sub.add_parser(
        "info",
        help="nodes, edges, features, classes, split and degrees of a dataset",
    )
    p.add_argument("target", metavar="PATH_OR_NAME", help="a folder or a catalogue name")
    p.add_argument("--root", default=None, help="data root (default: $GNNPAR_DATA or datasets)")
    p.add_argument("options", nargs="*", metavar="KEY=VALUE", help="dataset options")
    p.set_defaults(func=_guarded(_cmd_info))
