"""``gnnpar plan gcn | gpt | machines``: rank grid shapes and print the best ones.

::

    gnnpar plan gcn --dataset ogbn-products --gpus 64 --machine perlmutter --top 5
    gnnpar plan gcn --nodes 100000 --edges 2000000 --features 128 --classes 10 --gpus 8
    gnnpar plan gpt --params 20B --gpus 1024 --machine perlmutter --plot plan.png
    gnnpar plan gpt --layers 2 --hidden 64 --heads 8 --seq 32 --batch 16 --gpus 8 \\
        --machine cpu --bandwidth bw.json
    gnnpar plan machines

Bad input is one line on stderr and exit code 2 (:class:`~gnnpar.plan.PlanError`).
"""

from __future__ import annotations

import argparse
from typing import Any

from gnnpar.atomic import write_json
from gnnpar.plan.machines import Machine, builtin_machines, get_machine
from gnnpar.plan.plot import plot_candidates
from gnnpar.plan.problems import (
    GCNProblem,
    GPTProblem,
    PlanError,
    format_count,
    gcn_datasets,
    gpt_sizes,
    parse_count,
)
from gnnpar.plan.rank import Candidate, rank_gcn, rank_gpt_stages, shape_label

__all__ = ["add_plan_commands", "format_candidates", "plot_candidates"]


def _machine(args: argparse.Namespace) -> Machine:
    return get_machine(args.machine, args.bandwidth or None)


def _gcn_problem(args: argparse.Namespace) -> GCNProblem:
    common = {
        "hidden": args.hidden,
        "layers": args.layers,
        "model": args.model,
        "element_size": args.element_size,
    }
    if args.dataset:
        if args.nodes is not None or args.edges is not None:
            raise PlanError("give either --dataset or --nodes/--edges, not both")
        presets = gcn_datasets()
        if args.dataset in presets:
            d = presets[args.dataset]
            return GCNProblem.from_edges(
                d["nodes"],
                d["edges"],
                features=d["features"],
                classes=d["classes"],
                name=args.dataset,
                **common,
            )
        from gnnpar.data import load

        try:
            graph = load(args.dataset, root=args.root)
        except (KeyError, FileNotFoundError) as err:
            known = ", ".join(presets)
            raise PlanError(
                f"unknown dataset {args.dataset!r} ({err}); sizes are built in for {known}, "
                "or give --nodes, --edges, --features and --classes"
            ) from None
        return GCNProblem(
            nodes=graph.num_nodes,
            nnz=graph.num_edges + graph.num_nodes,
            features=graph.feat.shape[1],
            classes=graph.num_classes,
            name=args.dataset,
            **common,
        )
    missing = [
        f"--{k}" for k in ("nodes", "edges", "features", "classes") if getattr(args, k) is None
    ]
    if missing:
        raise PlanError(f"give --dataset NAME, or {', '.join(missing)}")
    return GCNProblem.from_edges(
        parse_count(args.nodes),
        parse_count(args.edges),
        features=args.features,
        classes=args.classes,
        name="graph",
        **common,
    )


def _gpt_problem(args: argparse.Namespace) -> GPTProblem:
    sizes: dict[str, int] = {}
    if args.params:
        wanted = parse_count(args.params)
        presets = gpt_sizes()
        match = [k for k in presets if abs(parse_count(k) - wanted) <= 0.1 * wanted]
        if not match:
            raise PlanError(
                f"no GPT shape of about {args.params} parameters is built in "
                f"({', '.join(presets)}); give --layers, --hidden and --heads"
            )
        sizes = dict(presets[match[0]])
    for key in ("layers", "hidden", "heads"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    if "layers" not in sizes or "hidden" not in sizes:
        raise PlanError("give --params SIZE (e.g. 20B), or --layers and --hidden")
    if "heads" not in sizes:
        sizes["heads"] = max(1, sizes["hidden"] // 128)
    return GPTProblem.sized(
        **sizes,
        seq=args.seq,
        batch=args.batch,
        vocab=args.vocab,
        element_size=args.element_size,
        stage=args.stage or 0,
        name=args.params or "gpt",
    )


def _cell(c: Candidate, axis: str) -> str:
    b = c.bytes.get(axis, 0)
    if not b:
        return "-"
    where = "" if c.intra_node.get(axis, True) else "*"
    return f"{b / 1e6:,.1f}MB/{c.comm.get(axis, 0.0) * 1e3:,.1f}ms{where}"


def format_candidates(cands: list[Candidate], top: int) -> str:
    """A plain-text table of the ``top`` best shapes (and how many do not fit)."""
    axes = [a for a in ("x", "y", "z", "data", "tensor") if any(c.bytes.get(a) for c in cands)]
    head = ["rank", "shape (data x y z)", "step ms", "compute", "comm", *axes, "memory GB"]
    stages = len({c.stage for c in cands}) > 1
    if stages:
        head.insert(2, "ZeRO")
    rows = []
    fitting = [c for c in cands if c.fits]
    for i, c in enumerate(fitting[:top], 1):
        rows.append(
            [
                str(i),
                shape_label(c.shape),
                *([str(c.stage)] if stages else []),
                f"{c.step_seconds * 1e3:,.2f}",
                f"{c.compute_seconds * 1e3:,.2f}",
                f"{c.comm_seconds * 1e3:,.2f}",
                *[_cell(c, a) for a in axes],
                f"{c.memory_bytes / 1e9:,.2f}",
            ]
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in [head, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    rest = [c for c in cands if not c.fits]
    lines.append(
        f"per axis: bytes this rank sends per step / predicted seconds; * = inter-node group. "
        f"{len(fitting)} shapes fit"
        + (
            f", {len(rest)} do not (e.g. {shape_label(rest[0].shape)}: {rest[0].reason})"
            if rest
            else ""
        )
    )
    return "\n".join(lines)


def _report(cands: list[Candidate], args: argparse.Namespace, title: str) -> int:
    print(title)
    print(format_candidates(cands, args.top))
    if args.plot:
        plot_candidates(cands, args.plot, title, top=args.top)
        print(f"wrote {args.plot}")
    if args.json:
        doc = {"title": title, "candidates": [c.as_dict() for c in cands]}
        write_json(args.json, doc, indent=1)  # whole or not at all
        print(f"wrote {args.json}")
    return 0


def _cmd_gcn(args: argparse.Namespace) -> int:
    problem = _gcn_problem(args)
    machine = _machine(args)
    cands = rank_gcn(problem, args.gpus, machine)
    title = (
        f"{problem.model} on {problem.name}: {problem.nodes:,} nodes, {problem.nnz:,} nonzeros, "
        f"widths {problem.dims}; {args.gpus} ranks on {machine.name} "
        f"({machine.ranks_per_node(args.gpus)} per node)"
    )
    return _report(cands, args, title)


def _cmd_gpt(args: argparse.Namespace) -> int:
    problem = _gpt_problem(args)
    machine = _machine(args)
    stages = (0, 1, 2, 3) if args.stage is None else (args.stage,)
    cands = rank_gpt_stages(problem, args.gpus, machine, stages)
    which = "ZeRO stage 0-3" if args.stage is None else f"ZeRO stage {args.stage}"
    title = (
        f"GPT {format_count(problem.num_params)} ({problem.layers} layers, "
        f"hidden {problem.hidden}, {problem.heads} heads), "
        f"batch {problem.batch} x {problem.seq} tokens, {which}; "
        f"{args.gpus} ranks on {machine.name} ({machine.ranks_per_node(args.gpus)} per node)"
    )
    return _report(cands, args, title)


def _cmd_machines(args: argparse.Namespace) -> int:
    for m in builtin_machines().values():
        print(
            f"{m.name:<11} {m.description}\n"
            f"{'':<11} {m.devices_per_node} per node, {m.memory_gb:g} GB, intra "
            f"{m.intra.gbps:g} GB/s, inter {m.inter.gbps:g} GB/s, GEMM {m.gemm_tflops:g} "
            f"TFLOP/s, SpMM {m.spmm_gflops:g} GFLOP/s\n{'':<11} assumptions: {m.assumptions}"
        )
    return 0


def _common(p: argparse.ArgumentParser, default_machine: str, element_size: int) -> None:
    p.add_argument("--gpus", type=int, required=True, help="ranks (GPUs) to plan for")
    p.add_argument(
        "--machine",
        default=default_machine,
        help=f"built-in machine (gnnpar plan machines) or a bandwidth table; "
        f"default {default_machine}",
    )
    p.add_argument(
        "--bandwidth",
        action="append",
        default=[],
        help="measured bandwidth table (gnnpar info --check --out); repeatable",
    )
    p.add_argument("--element-size", type=int, default=element_size, help="bytes per element")
    p.add_argument("--top", type=int, default=5, help="shapes to print")
    p.add_argument("--plot", default=None, help="PNG of predicted step time over shapes")
    p.add_argument("--json", default=None, help="write every shape's predictions as JSON")


def add_plan_commands(subparsers: Any) -> None:
    """Register ``gnnpar plan gcn | gpt | machines``."""
    plan = subparsers.add_parser("plan", help="rank grid shapes with the planner's models")
    kinds = plan.add_subparsers(dest="workload", required=True)

    g = kinds.add_parser("gcn", help="full-graph GCN / GraphSAGE on an x*y*z grid")
    g.add_argument(
        "--dataset", default=None, help=f"{', '.join(gcn_datasets())} or a catalogue dataset"
    )
    g.add_argument("--root", default=None, help="dataset root for catalogue datasets")
    g.add_argument("--nodes", default=None, help="nodes (e.g. 2.4M)")
    g.add_argument("--edges", default=None, help="undirected edges (nnz = 2E + N)")
    g.add_argument("--features", type=int, default=None, help="input features")
    g.add_argument("--classes", type=int, default=None, help="output classes")
    g.add_argument("--hidden", type=int, default=128, help="hidden width (default 128)")
    g.add_argument("--layers", type=int, default=3, help="layers (default 3)")
    g.add_argument("--model", default="gcn", choices=("gcn", "sage"))
    _common(g, "a100x4", 4)
    g.set_defaults(func=_cmd_gcn)

    t = kinds.add_parser("gpt", help="GPT with data x 3D tensor parallelism")
    t.add_argument("--params", default=None, help=f"model size: {', '.join(gpt_sizes())}")
    t.add_argument("--layers", type=int, default=None)
    t.add_argument("--hidden", type=int, default=None)
    t.add_argument("--heads", type=int, default=None, help="default hidden/128")
    t.add_argument("--seq", type=int, default=2048, help="tokens per sequence (2048)")
    t.add_argument("--batch", type=int, default=1024, help="sequences per step, global (1024)")
    t.add_argument("--vocab", type=int, default=50304)
    t.add_argument(
        "--stage",
        type=int,
        default=None,
        choices=(0, 1, 2, 3),
        help="data-axis sharding (ZeRO) stage; default: rank every stage",
    )
    _common(t, "a100x4", 2)
    t.set_defaults(func=_cmd_gpt)

    m = kinds.add_parser("machines", help="list the built-in machines and their assumptions")
    m.set_defaults(func=_cmd_machines)
