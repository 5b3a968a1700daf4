"""``gnnpar-partition``: partition a dataset, inspect a partition folder, compare methods.

::

    gnnpar-partition DATASET --parts K --out DIR [--overwrite] [--method metis] [--halo 1]
                     [--balance-train] [--balance-edges] [--no-balance-types] [--seed S]
                     [--root ROOT] [--dataset-options K=V,K=V] [--memory-limit SIZE]
    gnnpar-partition inspect DIR [--verify checksum|size]
    gnnpar-partition compare DATASET --parts K [--methods random,metis,...] [--plot FILE.png]
                     [--json FILE]

``DATASET`` is anything ``gnnpar.data.load`` accepts: a catalogue name (``sbm``, ``rmat``,
``citeseer``, ...) or a dataset folder; ``--dataset-options scale=16,seed=1`` passes options
to it, spelled as for ``gnnpar train``. With ``--memory-limit SIZE`` (e.g. ``3GB``) and a
graph folder, the edges are streamed from disk in chunks that fit the limit (LDG and Fennel
partition that way; the writer always does), and the quality table, which needs the whole
graph, is left out. A typed graph (:mod:`gnnpar.graph.typed`) is balanced per node type
and target training nodes by default (balance ``types``, :mod:`partitioners.typed`;
``--no-balance-types`` balances nodes only), and its quality report adds the edge cut of
every relation and the balance of every node type. A user error (a bad value, a missing or
damaged file: a :class:`~gnnpar.errors.UserError` or an OSError) prints one line and exits
with status 2; a bug shows its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from gnnpar.errors import UserError
from gnnpar.verified import check_output
from partitioners.assignment import METHODS, Partition, partition, supported_balance
from partitioners.format import (
    FORMAT,
    PartitionBalanceWarning,
    load_manifest,
    load_meta,
    load_part,
)
from partitioners.metrics import Quality, format_table, human_bytes, measure, quality
from partitioners.writer import write

__all__ = ["main"]

PROG = "gnnpar-partition"


class CliError(UserError):
    """An error to report as one line (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its error on one line, and where to look: no usage block
    before it (``--help`` shows that); a typed newline is shown escaped. (gnnpar's parser
    does the same; this package keeps its own.)"""

    def error(self, message: str) -> NoReturn:  # noqa: D102
        message = message.replace("\n", "\\n")
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _load_dataset(args: argparse.Namespace) -> Any:
    """The graph ``args.dataset`` names, with ``--root`` and ``--dataset-options``."""
    try:
        from gnnpar.data import load
        from gnnpar.data.options import check_dataset, split_options
    except ImportError as err:  # the dataset layer lives in gnnpar
        raise CliError(f"loading datasets needs the gnnpar package: {err}") from err
    options = check_dataset(args.dataset, split_options(args.dataset_options))
    return load(args.dataset, root=args.root, **options)


def _inputs(args: argparse.Namespace) -> list[Path]:
    """What the partition is made from, to keep ``--out`` apart from: the dataset folder,
    or for a catalogue name its prepared copy and files under the data root."""
    if Path(args.dataset).exists():
        return [Path(args.dataset)]
    from gnnpar.data.catalogue import default_root

    return [(default_root() if args.root is None else Path(args.root)) / args.dataset]


def _partition_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Partition a graph dataset and write one folder per partitioning "
        f"(other commands: '{PROG} inspect DIR', '{PROG} compare DATASET --parts K').",
    )
    p.add_argument("dataset", help="catalogue name (sbm, rmat, citeseer, ...) or folder")
    p.add_argument("--parts", "-k", type=int, required=True, metavar="K", help="number of parts")
    p.add_argument(
        "--method",
        "-m",
        default="metis",
        choices=METHODS,
        metavar="METHOD",  # the choices, once: in the help
        help=f"partitioner: {', '.join(METHODS)} (default: metis)",
    )
    p.add_argument("--out", required=True, help="output folder (refused if it exists)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    p.add_argument("--halo", type=int, default=1, choices=(0, 1), help="halo hops (default: 1)")
    _balance_flags(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the method (default: 0)")
    p.add_argument(
        "--memory-limit",
        default=None,
        metavar="SIZE",
        help="stream the edges of a graph folder from disk in chunks under SIZE bytes "
        "(e.g. 3GB, 512MiB); LDG/Fennel partition streamed, METIS loads the graph (default: "
        "the whole graph in memory)",
    )
    _common(p)
    return p


def _balance_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--balance-train",
        action="store_true",
        help="balance training nodes instead of all nodes (default: all nodes; a typed "
        "graph's type balance includes its training nodes)",
    )
    p.add_argument(
        "--balance-edges", action="store_true", help="also balance in-edges (default: off)"
    )
    p.add_argument(
        "--no-balance-types",
        action="store_true",
        help="for a typed graph, balance the node count only instead of every node type and "
        "the target type's training nodes (default: balance the types)",
    )


def _common(p: argparse.ArgumentParser) -> None:
    from gnnpar.data.options import add_dataset_options

    p.add_argument("--root", default=None, help="dataset root (default: $GNNPAR_DATA, ./datasets)")
    add_dataset_options(p)
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _balance(args: argparse.Namespace, typed: bool = False) -> list[str]:
    """The balance names the flags ask for; ``typed``: the graph has node types."""
    out = ["nodes"]
    if typed and not getattr(args, "no_balance_types", False):
        out = ["types"]  # it holds the training nodes: --balance-train adds nothing
    elif getattr(args, "balance_train", False):
        out = ["train"]
    if getattr(args, "balance_edges", False):
        out.append("edges")
    return out


def _is_typed(graph: Any) -> bool:
    return getattr(graph, "types", None) is not None


def _typed_rows(q: Quality) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A typed graph's per-relation cut and per-type balance rows (empty when untyped)."""
    relations = [
        {"relation": name, "edges": r["edges"], "cut": r["cut"], "cut %": 100 * r["fraction"]}
        for name, r in (q.relation_cut or {}).items()
    ]
    types = [{"nodes": name, "balance (max/mean)": b} for name, b in (q.type_balance or {}).items()]
    return relations, types


def _print_typed(relations: list[dict[str, Any]], types: list[dict[str, Any]]) -> None:
    if relations:
        print()
        print(format_table(relations))
    if types:
        print()
        print(format_table(types))


def _meta_typed_rows(meta: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """:func:`_typed_rows` from a typed partition folder's meta (the per-part counts the
    writer records); empty for an untyped folder or one without the counts."""
    types, parts = meta.get("types"), meta["parts"]
    if not types or any("num_by_type" not in p for p in parts):
        return [], []
    from partitioners.metrics import balance

    names = ["___".join(r) for r in types["relations"]]
    edges = [sum(p["in_edges_by_relation"][i] for p in parts) for i in range(len(names))]
    cut = [sum(p["cut_by_relation"][i] for p in parts) for i in range(len(names))]
    relations = [
        {"relation": n, "edges": m, "cut": c, "cut %": 100 * c / m if m else 0.0}
        for n, m, c in zip(names, edges, cut, strict=True)
    ]
    rows = [
        {"nodes": f"type:{t}", "balance (max/mean)": balance([p["num_by_type"][i] for p in parts])}
        for i, t in enumerate(types["node_types"])
    ]
    train = [p.get("num_train") for p in parts]
    if types.get("target") and None not in train:  # only target nodes train
        rows.append({"nodes": f"train:{types['target']}", "balance (max/mean)": balance(train)})
    return relations, rows


def _summary_rows(q: Quality) -> list[dict[str, Any]]:
    rows = [
        ("edge cut", f"{q.edge_cut} ({q.edge_cut_fraction:.2%} of {q.num_edges})"),
        ("node balance (max/mean)", f"{q.node_balance:.3f}"),
        ("edge balance (max/mean)", f"{q.edge_balance:.3f}"),
        ("train balance (max/mean)", "-" if q.train_balance is None else f"{q.train_balance:.3f}"),
        ("replication factor", f"{q.replication_factor:.3f}"),
        ("halo fraction (all / max part)", f"{q.halo_fraction:.3f} / {q.max_halo_fraction:.3f}"),
        (
            "1-hop feature traffic (all / max part)",
            f"{human_bytes(q.comm_bytes)} / {human_bytes(q.max_comm_bytes)}",
        ),
        ("partition time", "-" if q.time_s is None else f"{q.time_s:.2f} s"),
        ("peak memory", human_bytes(q.peak_bytes)),
    ]
    return [{"metric": a, "value": b} for a, b in rows]


def _cmd_partition(argv: Sequence[str]) -> int:
    args = _partition_parser().parse_args(argv)
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise CliError(f"output folder {out} already exists: add --overwrite, or another --out")
    check_output(out, FORMAT, args.overwrite, _inputs(args))
    show = not args.no_progress
    if args.memory_limit is not None:
        return _partition_streamed(args, out, show)
    from tqdm.auto import tqdm

    with tqdm(
        total=4, desc="load", disable=not show, bar_format="{desc:<28} {n}/{total} [{elapsed}]"
    ) as stages:
        graph = _load_dataset(args)
        stages.update()
        stages.set_description(f"partition ({args.method}, K={args.parts})")
        with measure() as m:
            part = partition(
                graph,
                args.parts,
                method=args.method,
                seed=args.seed,
                balance=_balance(args, _is_typed(graph)),
                progress=show,
            )
        stages.update()
        stages.set_description("quality")
        q = quality(graph, part, time_s=m.time_s, peak_bytes=m.peak_bytes)
        stages.update()
        stages.set_description(f"write {out}")
        with warnings.catch_warnings():  # printed below as one line
            warnings.simplefilter("ignore", PartitionBalanceWarning)
            write(graph, part, out, halo=args.halo, progress=show, overwrite=args.overwrite)
        stages.update()
    print(
        f"{graph.name}: {q.num_nodes} nodes, {q.num_edges} edges -> {part.num_parts} parts "
        f"with {part.method} (seed {part.seed}), halo {args.halo}, written to {out}"
    )
    print(format_table(_summary_rows(q)))
    _print_typed(*_typed_rows(q))
    print()
    meta = load_meta(out)
    print(format_table(_part_rows(meta)))
    _warn(meta, out)
    return 0


def _partition_streamed(args: argparse.Namespace, out: Path, show: bool) -> int:
    """``--memory-limit``: partition and write a graph folder without loading its edges."""
    from gnnpar.data.chunked import GraphReader, chunk_edges_for
    from gnnpar.data.storage import is_graph_folder
    from gnnpar.fmt import parse_bytes

    limit = parse_bytes(args.memory_limit)
    if not is_graph_folder(args.dataset) or args.dataset_options:
        raise CliError(
            f"--memory-limit streams a graph folder; {args.dataset!r} is not one (write it "
            "first with 'gnnpar data prepare NAME --out DIR --memory-limit SIZE')"
        )
    reader = GraphReader(args.dataset, verify="size")
    # the checks a loaded graph gets (Graph.validate), streamed under the same limit
    reader.validate(chunk_edges_for(limit, 24 * reader.num_nodes, "checking the graph"))
    options: dict[str, Any] = {}
    if args.method in ("ldg", "fennel"):
        # the assignment, the stream order and indptr: 24 bytes a node
        options["chunk_edges"] = chunk_edges_for(limit, 24 * reader.num_nodes, args.method)
    source: Any = reader if args.method in ("ldg", "fennel") else args.dataset
    from partitioners.typed import typed_input

    typed = typed_input(reader) is not None
    with measure() as m:
        part = partition(
            source,
            args.parts,
            method=args.method,
            seed=args.seed,
            balance=_balance(args, typed),
            progress=show,
            **options,
        )
    with warnings.catch_warnings():  # printed below as one line
        warnings.simplefilter("ignore", PartitionBalanceWarning)
        write(
            args.dataset,
            part,
            out,
            halo=args.halo,
            progress=show,
            overwrite=args.overwrite,
            memory_limit=limit,
        )
    print(
        f"{reader.name}: {reader.num_nodes} nodes, {reader.num_edges} edges -> "
        f"{part.num_parts} parts with {part.method} (seed {part.seed}), halo {args.halo}, "
        f"written to {out} (streamed under {args.memory_limit}; partition "
        f"{m.time_s:.2f} s, peak {human_bytes(m.peak_bytes)})"
    )
    meta = load_meta(out)
    _print_typed(*_meta_typed_rows(meta))
    print()
    print(format_table(_part_rows(meta)))
    _warn(meta, out)
    return 0


def _part_rows(meta: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for k, (info, (start, stop)) in enumerate(zip(meta["parts"], meta["node_ranges"], strict=True)):
        rows.append(
            {
                "part": k,
                "ids": f"[{start}, {stop})",
                "owned": info["num_owned"],
                "halo": info["num_halo"],
                "local edges": info["num_local_edges"],
                "train": "-" if info.get("num_train") is None else info["num_train"],
            }
        )
    return rows


def _inspect_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{PROG} inspect", description="Show and check a partition folder.")
    p.add_argument("dir", metavar="DIR", help="a partition folder (written by gnnpar-partition)")
    p.add_argument(
        "--verify",
        default="checksum",
        choices=("checksum", "size"),
        help="check every file's checksum or only its size (default: checksum)",
    )
    p.add_argument("--no-verify", action="store_true", help="same as --verify size")
    # accepted as the other commands do, and hidden: inspect draws no progress bars
    p.add_argument("--no-progress", action="store_true", help=argparse.SUPPRESS)
    return p


def _cmd_inspect(argv: Sequence[str]) -> int:
    args = _inspect_parser().parse_args(argv)
    level = "size" if args.no_verify else args.verify
    manifest = load_manifest(args.dir)
    meta = manifest.meta
    source = meta.get("source") or {}
    print(
        f"{args.dir}: {meta['graph_name']!r}, {meta['num_nodes']} nodes, {meta['num_edges']} "
        f"edges, {meta['num_parts']} parts by {meta['method']} (seed {meta['seed']}, balance "
        f"{', '.join(meta.get('balance', [])) or '-'}), halo {meta['halo_hops']}, "
        f"{manifest.schema} v{manifest.version}, cut from graph "
        f"{source.get('fingerprint') or 'unknown'}"
    )
    if meta.get("ndata"):
        print(
            "node data: "
            + ", ".join(f"{k} {v['dtype']} {tuple(v['shape'])}" for k, v in meta["ndata"].items())
        )
    if meta.get("types"):
        types = meta["types"]
        print(
            f"typed: {len(types['node_types'])} node types "
            f"({', '.join(types['node_types'])}; target {types.get('target') or '-'}), "
            f"{len(types['relations'])} relations"
        )
    print(format_table(_part_rows(meta)))
    _print_typed(*_meta_typed_rows(meta))
    for k in range(meta["num_parts"]):
        load_part(args.dir, k, verify=level)
    manifest.verify("node_map.npy", level)
    check = "sizes" if level == "size" else "sizes and xxh3_64 checksums"
    print(f"all {meta['num_parts']} parts load; {len(manifest.files)} files match their {check}")
    _warn(meta, args.dir)
    return 0


def _warn(meta: dict[str, Any], folder: str | Path) -> None:
    """Print the partition's balance warning, if any, as one line."""
    from partitioners.format import idle_parts_message

    message = idle_parts_message(meta, folder)
    if message:
        print(f"{PROG}: warning: {message}", file=sys.stderr)


def _compare_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{PROG} compare", description="Run several partitioners and print one table.")
    p.add_argument("dataset", help="catalogue name (sbm, rmat, citeseer, ...) or folder")
    p.add_argument("--parts", "-k", type=int, required=True, metavar="K", help="number of parts")
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated, from {', '.join(METHODS)} (default: all)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of every method (default: 0)")
    _balance_flags(p)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="also draw the table")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    _common(p)
    return p


def _cmd_compare(argv: Sequence[str]) -> int:
    args = _compare_parser().parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise CliError(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    graph = _load_dataset(args)
    rows = []
    from tqdm.auto import tqdm

    typed = _is_typed(graph)
    for method in tqdm(methods, desc="methods", disable=args.no_progress, leave=False):
        with measure() as m:
            # Ask each method only for the balance it can honour (METIS: all of them).
            asked = _balance(args, typed)
            wanted = [b for b in asked if b in supported_balance(method)] or ["nodes"]
            part: Partition = partition(
                graph, args.parts, method=method, seed=args.seed, balance=wanted
            )
        rows.append(quality(graph, part, time_s=m.time_s, peak_bytes=m.peak_bytes).as_dict())
    print(
        f"{graph.name}: {rows[0]['num_nodes']} nodes, {rows[0]['num_edges']} edges, "
        f"K={args.parts}, seed {args.seed}"
    )
    print(format_table(_compare_rows(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.plot:
        _plot(rows, args.plot, f"{graph.name}, K={args.parts}")
        print(f"plot written to {args.plot}")
    return 0


def _compare_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        row = {
            "method": r["method"],
            "cut %": 100 * r["edge_cut_fraction"],
            "nodes bal": r["node_balance"],
            "edges bal": r["edge_balance"],
            "train bal": r["train_balance"],
        }
        if r.get("type_balance"):  # a typed graph: its worst node type
            row["worst type bal"] = max(r["type_balance"].values())
        row.update(
            {
                "replication": r["replication_factor"],
                "halo %": 100 * r["halo_fraction"],
                "time s": r["time_s"],
                "peak MiB": None if r["peak_bytes"] is None else r["peak_bytes"] / 2**20,
            }
        )
        out.append(row)
    return out


def _plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    try:
        from partitioners.plots import write_compare_plot

        write_compare_plot(rows, path, title)
    except ImportError as err:
        raise CliError("--plot needs matplotlib: pip install 'gnnpar[bench]'") from err


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"inspect": _cmd_inspect, "compare": _cmd_compare}
    try:
        if argv and argv[0] in commands:
            return commands[argv[0]](argv[1:])
        return _cmd_partition(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2)
        return int(exit_.code or 0) if isinstance(exit_.code, int) else 2
    except (UserError, OSError) as err:  # what the user gave (gnnpar.errors), the OS's refusal
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2  # anything else is a bug: its traceback, status 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
