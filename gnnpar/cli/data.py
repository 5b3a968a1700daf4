"""``gnnpar data list | prepare | import | info | split-edges``: the dataset sub-commands of the
``gnnpar`` CLI."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gnnpar.cli.top import USER_ERRORS
from gnnpar.data.catalogue import (
    build,
    catalogue,
    default_root,
    get_entry,
    load,
    source_record,
    stored_folder,
)
from gnnpar.data.options import add_dataset_options, check_dataset, parse_options, split_options
from gnnpar.data.storage import FORMAT, is_graph_folder, save_graph
from gnnpar.data.structure import STRUCTURE_DEFAULTS, apply_structure, split_structure
from gnnpar.errors import UserError
from gnnpar.graph import Graph
from gnnpar.graph.typed import GraphTypes, relation_name
from gnnpar.verified import check_output

__all__ = ["add_data_commands", "describe"]


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
    if graph.is_multilabel:
        rows.append(("classes", f"{graph.num_classes} binary tasks (multi-label, 0/1 per task)"))
    else:
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
    if graph.edge_split is not None:
        rec = graph.edge_split.record()
        sizes = " / ".join(f"{k} {v:,}" for k, v in rec["edges"].items())
        rows.append(
            (
                "edge split",
                f"{sizes} edges; negatives {rec['protocol']}, metric {rec['metric']}; "
                f"cut from {rec['source'] or 'an unrecorded graph'} (digest {rec['digest']})",
            )
        )
    others = sorted(set(graph.ndata) - {"feat", "label", "train_mask", "val_mask", "test_mask"})
    if others:
        rows.append(("other data", ", ".join(others)))
    return rows + ([] if graph.types is None else _typed_rows(graph.types))


def _typed_rows(types: GraphTypes) -> list[tuple[str, str]]:
    """A typed graph's rows: its node types (counts, feature widths), target, relations."""
    kinds = [
        f"{t} {types.num_nodes_of(t):,}" + (f" ({d:,} features)" if d else "")
        for t, d in zip(types.node_types, types.feat_dims, strict=True)
    ]
    rows = [("node types", ", ".join(kinds)), ("target", types.target or "none")]
    counts = types.relation_counts()
    for i, (rel, count) in enumerate(zip(types.relations, counts, strict=True)):
        rows.append(("relations" if i == 0 else "", f"{relation_name(rel)} {count:,}"))
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
    options = check_dataset(args.name, split_options(args.dataset_options))
    # a folder given by path is the input; a catalogue dataset's files under the root are
    # kept safe by check_output's rule that --overwrite replaces only a graph folder's files
    inputs = [args.name] if Path(args.name).exists() else []
    check_output(args.out, FORMAT, args.overwrite, inputs)
    start = time.perf_counter()
    if args.memory_limit is not None:
        return _prepare_to_disk(args, options, start)
    graph = build(args.name, args.root, **options)
    out = save_graph(
        graph,
        args.out,
        overwrite=args.overwrite,
        source=source_record(args.name, options),
        inputs=inputs,
    )
    print(
        f"wrote {out}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges "
        f"({time.perf_counter() - start:.1f} s)"
    )
    return 0


def _prepare_to_disk(args: argparse.Namespace, options: dict, start: float) -> int:
    """``prepare --memory-limit``: a generator that writes to disk in chunks (R-MAT)."""
    from gnnpar.data.rmat import rmat_to_disk
    from gnnpar.data.storage import read_meta
    from gnnpar.data.structure import split_structure
    from gnnpar.fmt import parse_bytes

    entry = get_entry(args.name)
    own, structure = split_structure(options)
    if entry is None or entry.name != "rmat" or structure:
        raise UserError(
            f"--memory-limit generates rmat to disk in chunks; {args.name!r}"
            + (" with structure options" if structure else "")
            + " is built in memory (leave out --memory-limit)"
        )
    # a graph of its own (drawn in batches): the source says so, so that it is never taken
    # for the in-memory generator's graph of the same options
    source = {**source_record(args.name, options), "generator": "rmat_to_disk"}
    out = rmat_to_disk(
        args.out,
        **entry.resolve_kwargs(own),
        memory_limit=parse_bytes(args.memory_limit),
        overwrite=args.overwrite,
        source=source,
    )
    meta = read_meta(out)
    print(
        f"wrote {out}: {meta['num_nodes']:,} nodes, {meta['num_edges']:,} edges, streamed "
        f"under {args.memory_limit} ({time.perf_counter() - start:.1f} s)"
    )
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    from gnnpar.data.imports import file_kind, import_source, read_graph_file

    options = parse_options(split_options(args.dataset_options), STRUCTURE_DEFAULTS)
    own, structure = split_structure(options)
    if own:
        raise UserError(
            f"unknown option(s) {', '.join(own)} for an imported file; known: "
            f"{', '.join(STRUCTURE_DEFAULTS)}"
        )
    check_output(args.out, FORMAT, args.overwrite, [args.file])
    start = time.perf_counter()
    kind = file_kind(args.file, args.kind)
    graph = apply_structure(read_graph_file(args.file, kind, args.name, args.target), structure)
    source = import_source(args.file, kind, structure)
    out = save_graph(graph, args.out, overwrite=args.overwrite, source=source, inputs=[args.file])
    print(
        f"wrote {out}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges from {kind} file "
        f"{args.file} ({time.perf_counter() - start:.1f} s)"
    )
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    options = check_dataset(args.target, split_options(args.dataset_options))
    graph = load(args.target, args.root, **options)
    for field, value in describe(graph):
        print(f"{field:<11} {value}")
    return 0


def _cmd_split_edges(args: argparse.Namespace) -> int:
    from gnnpar.graph.edge_split import check_metric, split_edges

    options = check_dataset(args.dataset, split_options(args.dataset_options))
    if args.metric is not None:
        check_metric(args.metric, "--metric")
    # never write over what is read: the folder given, or the prepared copy a name loads
    if Path(args.dataset).exists():
        inputs: list[str | Path] = [args.dataset]
    else:
        stored = stored_folder(args.dataset, args.root, **options)
        inputs = [stored] if stored is not None else []
    check_output(args.out, FORMAT, args.overwrite, inputs)
    start = time.perf_counter()
    graph = load(args.dataset, args.root, **options)
    if graph.edge_split is not None:
        raise UserError(
            f"{args.dataset} already has an edge split (train it with --split stored, or "
            "split the graph it was cut from)"
        )
    message = split_edges(
        graph,
        val=args.val,
        test=args.test,
        seed=args.seed,
        time=args.by_time,
        negatives=args.negatives,
        num_negatives=args.num_negatives,
        metric=args.metric,
    )
    split = message.edge_split
    # the split's options in the source too, so the folder is never taken for a prepared
    # copy of the whole dataset (gnnpar.data.catalogue.load)
    source = {**source_record(args.dataset, options), "split_edges": split.how}
    out = save_graph(message, args.out, overwrite=args.overwrite, source=source, inputs=inputs)
    sizes = " / ".join(f"{k} {int(getattr(split, k).shape[1]):,}" for k in ("train", "val", "test"))
    print(
        f"wrote {out}: edges {sizes} ({split.how['method']} split), negatives "
        f"{split.protocol}, metric {split.metric} ({time.perf_counter() - start:.1f} s)"
    )
    return 0


def _guarded(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Report expected failures (bad input, missing files) as one line and exit code 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except USER_ERRORS as err:  # a bug goes on to gnnpar's own report (its traceback)
            print(f"gnnpar data {args.data_command}: error: {err}", file=sys.stderr)
            return 2

    return run


def add_data_commands(subparsers: Any) -> None:
    """Register ``data`` (``list``, ``prepare``, ``import``, ``info``, ``split-edges``) on an
    argparse sub-parsers object. Each command sets ``func``: ``func(args) -> exit code``."""
    data = subparsers.add_parser(
        "data",
        help="list, prepare, import and inspect datasets",
        description="List the dataset catalogue, prepare datasets in gnnpar's on-disk format, "
        "import a graph saved by PyG, DGL, scipy or as an edge list, and summarise a dataset. "
        "The data root defaults to ./datasets ($GNNPAR_DATA).",
    )

    def usage(args: argparse.Namespace) -> int:
        # one line, as argparse's errors (gnnpar.cli._Parser)
        print(
            "gnnpar data: error: choose a command: list, prepare, import or info (see gnnpar "
            "data --help)",
            file=sys.stderr,
        )
        return 2

    data.set_defaults(func=usage, data_command=None)
    sub = data.add_subparsers(dest="data_command", metavar="{list,prepare,import,info,split-edges}")

    p = sub.add_parser("list", help="the dataset catalogue and its options")
    p.add_argument("--root", default=None, help="data root (default: $GNNPAR_DATA or datasets)")
    p.set_defaults(func=_guarded(_cmd_list))

    p = sub.add_parser(
        "prepare",
        help="build a dataset and save it in gnnpar's format",
        description="Build NAME (a catalogue name or a Planetoid/OGB/gnnpar folder) with the "
        "given --dataset-options and save it atomically to --out.",
    )
    p.add_argument("name", help="catalogue name (see 'gnnpar data list') or a folder")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--root", default=None, help="where file-based datasets are looked up")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    p.add_argument(
        "--memory-limit",
        default=None,
        metavar="SIZE",
        help="generate rmat straight to disk in chunks under SIZE bytes (e.g. 3GB): a graph "
        "larger than memory, drawn in batches",
    )
    add_dataset_options(p)
    p.set_defaults(func=_guarded(_cmd_prepare))

    p = sub.add_parser(
        "import",
        help="turn a PyG, DGL, scipy .npz or edge-list file into a gnnpar graph folder",
        description="Read FILE without running anything in it (a PyG Data or HeteroData saved with "
        "torch.save: .pt/.pth; dgl.save_graphs: .bin; scipy.sparse.save_npz: .npz; an edge "
        "list 'src dst [weight]' per line: .txt/.edges/.el/.tsv/.edgelist) and save it "
        "atomically to --out, recording the file's size and checksum.",
    )
    p.add_argument("file", help="the file to import")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument(
        "--kind",
        choices=("pyg", "dgl", "npz", "edges"),
        default=None,
        help="what the file is (default: from its suffix)",
    )
    p.add_argument("--name", default=None, help="the graph's name (default: the file's stem)")
    p.add_argument(
        "--target",
        default=None,
        help="a typed graph's node type whose labels and masks to keep (needed when several "
        "types have them; docs/typed.md)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    p.add_argument(
        "--dataset-options",
        default=None,
        metavar="K=V,K=V",
        help="structure options: to_undirected=true (add reverse edges), "
        "self_loops=keep|add|remove",
    )
    p.set_defaults(func=_guarded(_cmd_import))

    p = sub.add_parser(
        "info",
        help="nodes, edges, features, classes, split and degrees of a dataset",
    )
    p.add_argument("target", metavar="PATH_OR_NAME", help="a folder or a catalogue name")
    p.add_argument("--root", default=None, help="data root (default: $GNNPAR_DATA or datasets)")
    add_dataset_options(p)
    p.set_defaults(func=_guarded(_cmd_info))

    p = sub.add_parser(
        "split-edges",
        help="cut a link-prediction edge split and save it with its message-passing graph",
        description="Load DATASET, cut train / validation / test edges (random, or the latest "
        "by a node attribute) with their evaluation negatives, and save the message-passing "
        "graph (the training edges) with the split atomically to --out; train on it with "
        "'gnnpar train link --dataset OUT --split stored'.",
    )
    p.add_argument("dataset", metavar="DATASET", help="a catalogue name or a folder")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--root", default=None, help="data root (default: $GNNPAR_DATA or datasets)")
    add_dataset_options(p)
    p.add_argument("--val", type=float, default=0.05, help="validation fraction of the edges")
    p.add_argument("--test", type=float, default=0.1, help="test fraction of the edges")
    p.add_argument("--seed", type=int, default=0, help="seed of the cut and the negatives")
    p.add_argument(
        "--by-time",
        default=None,
        metavar="ATTR",
        help="order edges by this node attribute (an edge's time: the later endpoint's); "
        "the latest test, the next validate (default: a random split)",
    )
    p.add_argument(
        "--negatives",
        choices=("pairs", "per-source"),
        default="pairs",
        help="evaluation negatives: random non-edge pairs shared by all positives, or "
        "corrupted destinations per positive",
    )
    p.add_argument(
        "--num-negatives", type=int, default=1, help="negatives per positive (default: 1)"
    )
    p.add_argument(
        "--metric",
        default=None,
        metavar="mrr|rocauc|hits@K",
        help="the score models are selected by (default: rocauc for pairs, mrr per source)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    p.set_defaults(func=_guarded(_cmd_split_edges))
