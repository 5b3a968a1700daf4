"""``gnnpar plan gcn | gpt | machines``: rank grid shapes and print the best ones.

::

    gnnpar plan gcn --gpus 4 --machine cpu     # what `gnnpar train gcn --nprocs 4` runs
    gnnpar plan gcn --dataset ogbn-products --hidden 128 --layers 3 --gpus 64 \\
        --machine perlmutter --top 5
    gnnpar plan gcn --nodes 100000 --edges 2000000 --features 128 --classes 10 --gpus 8
    gnnpar plan gpt --params 20B --block-size 2048 --batch-size 1024 --mixed-precision bf16 \\
        --gpus 1024 --machine perlmutter --plot plan.png
    gnnpar plan gpt --n-layer 2 --n-embd 64 --n-head 8 --gpus 8 --machine cpu \\
        --bandwidth bw.json
    gnnpar plan gpt --params 1.3B --grid context=4 --gpus 8 --memory-gb 40 --longest-sequence
    gnnpar plan gpt --n-embd 1024 --n-head 16 --offload host --gpus 8 --memory-gb 16 --largest
    gnnpar plan machines

The model and run options are the trainer's (``gnnpar train gcn|gpt``), with its defaults.

Bad input is one line on stderr and exit code 2 (:class:`~gnnpar.plan.PlanError`).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from gnnpar.atomic import write_json
from gnnpar.data.sizes import gcn_datasets
from gnnpar.fmt import count, format_count
from gnnpar.plan.machines import Machine, builtin_machines, get_machine
from gnnpar.plan.plot import plot_candidates
from gnnpar.plan.problems import (
    GCNProblem,
    GPTProblem,
    PlanError,
    gpt_sizes,
    parse_count,
)
from gnnpar.plan.rank import (
    Candidate,
    largest_gpt,
    longest_sequence,
    rank_gcn,
    rank_gpt_stages,
    shape_label,
)

__all__ = ["add_plan_commands", "format_candidates", "plot_candidates"]


def _machine(args: argparse.Namespace) -> Machine:
    machine = get_machine(args.machine, args.bandwidth or None)
    if getattr(args, "memory_gb", None) is not None:  # a stated per-rank memory
        if args.memory_gb <= 0:
            raise PlanError(f"--memory-gb must be positive, got {args.memory_gb}")
        machine = dataclasses.replace(machine, memory_gb=args.memory_gb)
    return machine


# The trainer's options that ``gnnpar plan`` takes, spelled and defaulted as the trainer's:
# the same flags describe the same run, so both pick the same grid.
GCN_OPTIONS = ("dataset", "root", "dataset_options", "model", "hidden", "heads", "out_heads",
               "layers", "dtype", "mixed_precision", "activation_checkpointing")  # fmt: skip
GPT_OPTIONS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "tie_weights",
               "batch_size", "dtype", "mixed_precision", "grad_clip", "grad_accum", "schedule",
               "virtual_stages", "activation_checkpointing", "offload")  # fmt: skip
SAGE_OPTIONS = ("dataset", "root", "dataset_options", "model", "sampler", "partitions", "fanouts",
                "batch_size", "hidden", "layers", "feature_cache", "prefetch", "zero_stage",
                "dtype", "mixed_precision")  # fmt: skip


def _task_config(cls: type, args: argparse.Namespace) -> Any:
    """The trainer's config of the run the flags describe (defaults, then the flags)."""
    from gnnpar.train.config import ConfigError, resolve

    try:
        return resolve(cls, args, None)
    except ConfigError as err:
        raise PlanError(str(err)) from None


def _gcn_problem(args: argparse.Namespace) -> GCNProblem:
    from gnnpar.models.fullgraph.task import FullGraphConfig
    from gnnpar.train.precision import compute_dtype

    sizes_given = args.nodes is not None or args.edges is not None
    if sizes_given and args.dataset is not None:
        raise PlanError("give either --dataset or --nodes/--edges, not both")
    cfg = _task_config(FullGraphConfig, args)
    common = {
        "hidden": cfg.hidden,
        "layers": cfg.layers,
        "model": cfg.model,
        "element_size": compute_dtype(cfg).itemsize,
        "heads": cfg.heads,
        "out_heads": cfg.out_heads,
        "activation_checkpointing": cfg.activation_checkpointing,
    }
    if not sizes_given:
        presets = gcn_datasets()
        if cfg.dataset in presets and not cfg.dataset_options:
            d = presets[cfg.dataset]
            return GCNProblem.from_edges(
                d["nodes"],
                d["edges"],
                features=d["features"],
                classes=d["classes"],
                name=cfg.dataset,
                **common,
            )
        from gnnpar.train.loop import load_dataset

        try:
            graph = load_dataset(cfg)
        except (KeyError, FileNotFoundError, ValueError) as err:
            known = ", ".join(presets)
            raise PlanError(
                f"cannot load dataset {cfg.dataset!r} ({err}); sizes are built in for {known}, "
                "or give --nodes, --edges, --features and --classes"
            ) from None
        return GCNProblem(
            nodes=graph.num_nodes,
            nnz=graph.num_edges + graph.num_nodes,
            features=graph.feat.shape[1],
            classes=graph.num_classes,
            name=cfg.dataset,
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
    from gnnpar.models.gpt.task import GPTTaskConfig, plan_problem

    if args.params:
        wanted = parse_count(args.params)
        presets = gpt_sizes()
        match = [k for k in presets if abs(parse_count(k) - wanted) <= 0.1 * wanted]
        if not match:
            raise PlanError(
                f"no GPT shape of about {args.params} parameters is built in "
                f"({', '.join(presets)}); give --n-layer, --n-embd and --n-head"
            )
        preset = presets[match[0]]
        for key, name in (("layers", "n_layer"), ("hidden", "n_embd"), ("heads", "n_head")):
            if getattr(args, name) is None:  # a flag given beside --params wins
                setattr(args, name, preset[key])
    cfg = _task_config(GPTTaskConfig, args)
    problem = plan_problem(cfg)
    return dataclasses.replace(problem, stage=args.stage or 0, name=args.params or "gpt")


def _cell(c: Candidate, axis: str) -> str:
    b = c.bytes.get(axis, 0)
    if not b:
        return "-"
    where = "" if c.intra_node.get(axis, True) else "*"
    return f"{b / 1e6:,.1f}MB/{c.comm.get(axis, 0.0) * 1e3:,.1f}ms{where}"


def _pipeline_cell(c: Candidate) -> str:
    pl = c.pipeline
    if pl is None:
        return "-"
    return f"{pl.schedule} {pl.micro_batches}·{pl.virtual} {pl.bubble:.1%}"


def format_candidates(cands: list[Candidate], top: int) -> str:
    """A plain-text table of the ``top`` best shapes (and how many do not fit)."""
    axes = [
        a
        for a in ("x", "y", "z", "context", "data", "tensor", "pipe")
        if any(c.bytes.get(a) for c in cands)
    ]
    head = ["rank", "shape (data x y z)", "step ms", "compute", "comm", *axes, "memory GB"]
    off = next((k for c in cands for k in ("host", "file") if c.memory.get(k)), None)
    if off:
        head.append(f"{off} GB")
    stages = len({c.stage for c in cands}) > 1
    if stages:
        head.insert(2, "ZeRO")
    piped = any(c.pipeline is not None for c in cands[:top] if c.fits)
    if piped:
        head[1] = "shape (pipe data x y z)"
        head.insert(2, "schedule m·v bubble")
    rows = []
    fitting = [c for c in cands if c.fits]
    for i, c in enumerate(fitting[:top], 1):
        rows.append(
            [
                str(i),
                shape_label(c.shape),
                *([_pipeline_cell(c)] if piped else []),
                *([str(c.stage)] if stages else []),
                f"{c.step_seconds * 1e3:,.2f}",
                f"{c.compute_seconds * 1e3:,.2f}",
                f"{c.comm_seconds * 1e3:,.2f}",
                *[_cell(c, a) for a in axes],
                f"{c.memory_bytes / 1e9:,.2f}",
                *([f"{c.memory.get(off, 0.0) / 1e9:,.2f}"] if off else []),
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
        f"widths {problem.dims}; {count(args.gpus, 'rank')} on {machine.name} "
        f"({machine.ranks_per_node(args.gpus)} per node)"
    )
    return _report(cands, args, title)


def _grid_shape(args: argparse.Namespace) -> dict[str, int]:
    """The axes ``--grid`` fixes (none without it)."""
    from gnnpar.grid import GridError, parse_grid_spec

    if not args.grid:
        return {}
    try:
        return parse_grid_spec(args.grid)
    except GridError as err:
        raise PlanError(str(err)) from None


def _cmd_gpt(args: argparse.Namespace) -> int:
    problem = _gpt_problem(args)
    machine = _machine(args)
    low = 1 if problem.offload != "none" else 0
    if args.stage is not None and args.stage < low:
        raise PlanError(f"--offload {problem.offload} needs --stage 1, 2 or 3, not 0")
    stages = tuple(range(low, 4)) if args.stage is None else (args.stage,)
    shape = _grid_shape(args)
    if args.longest_sequence:
        seq, best = longest_sequence(problem, args.gpus, machine, stages, shape)
        where = f"{count(args.gpus, 'rank')} of {machine.memory_gb:g} GB"
        if best is None:
            print(f"no sequence length fits {where}")
            return 0
        print(
            f"longest sequence: {seq:,} tokens on {where} (shape {shape_label(best.shape)}, "
            f"ZeRO stage {best.stage}, {best.memory_bytes / 1e9:,.2f} GB per rank, "
            f"batch {problem.batch})"
        )
        return 0
    if args.largest:
        problem, cands = largest_gpt(problem, args.gpus, machine, stages, shape or None)
    else:
        cands = rank_gpt_stages(problem, args.gpus, machine, stages, shape.get("context", 1))
    fixed = {a: v for a, v in shape.items() if a != "context"}
    cands = [c for c in cands if all(c.shape.get(a, 1) == v for a, v in fixed.items())]
    which = f"ZeRO stage {low}-3" if args.stage is None else f"ZeRO stage {args.stage}"
    if problem.offload != "none":
        which += f", offload {problem.offload}"
    title = (
        f"GPT {format_count(problem.num_params)} ({problem.layers} layers, "
        f"hidden {problem.hidden}, {problem.heads} heads), "
        f"batch {problem.batch} x {problem.seq} tokens, {which}; "
        f"{count(args.gpus, 'rank')} on {machine.name} "
        f"({machine.ranks_per_node(args.gpus)} per node, {machine.memory_gb:g} GB each)"
    )
    if args.largest:
        title = f"largest that fits: {title}"
    return _report(cands, args, title)


def _data_sizes(gpus: int) -> list[int]:
    """1, 2, 4, ... below ``gpus``, then ``gpus``."""
    out, d = [], 1
    while d < gpus:
        out.append(d)
        d *= 2
    return [*out, gpus]


def _cmd_sage(args: argparse.Namespace) -> int:
    from gnnpar.models.minibatch.task import MiniBatchConfig, check_partitions, plan_problem
    from gnnpar.plan.memory import estimated_part, minibatch_memory
    from gnnpar.train.config import ConfigError
    from gnnpar.train.loop import load_dataset

    cfg = _task_config(MiniBatchConfig, args)
    if cfg.partitions is None and args.gpus is None:
        raise PlanError("give --gpus (data ranks), or --partitions FOLDER (one rank a part)")
    try:
        problem = plan_problem(cfg, load_dataset(cfg))
    except ConfigError as err:
        raise PlanError(str(err)) from None
    rows = []
    if cfg.partitions is not None:
        meta = check_partitions(cfg)  # cut from this dataset, or one line naming both
        d = int(meta["num_parts"])
        if args.gpus is not None and args.gpus != d:
            raise PlanError(f"--gpus {args.gpus}, but {cfg.partitions} holds {d} parts")
        for k, rec in enumerate(meta["parts"]):
            memory = minibatch_memory(problem, d, rec)
            rows.append({"data": d, "rank": k, "part": rec, "memory": memory})
    else:
        for d in _data_sizes(args.gpus):
            part = estimated_part(problem, d) if d > 1 else None
            memory = minibatch_memory(problem, d)
            rows.append({"data": d, "rank": None, "part": part, "memory": memory})
    title = (
        f"sage on {problem.name}: {problem.nodes:,} nodes, {problem.edges:,} edges, "
        f"{problem.features} features; batch {problem.batch_size}, fan-outs "
        f"{','.join(map(str, problem.fanouts))}, hidden {problem.hidden}, ZeRO stage "
        f"{problem.stage}: peak memory per data rank (minibatch_memory"
        + (f", the parts of {cfg.partitions})" if cfg.partitions else ", parts estimated)")
    )
    print(title)
    print(format_minibatch_rows(rows))
    if args.json:
        write_json(args.json, {"title": title, "rows": rows}, indent=1)
        print(f"wrote {args.json}")
    return 0


def format_minibatch_rows(rows: list[dict[str, Any]]) -> str:
    """The table of ``gnnpar plan sage``: per data rank its part and peak memory, with the
    three largest parts of the model."""
    mib = 1 << 20
    lines = [f"{'data':>4} {'rank':>4} {'owned':>11} {'halo':>11} {'local edges':>13} "
             f"{'MiB':>9}  largest parts (MiB)"]  # fmt: skip
    for r in rows:
        part, mem = r["part"], r["memory"]
        owned, halo, edges = (
            ("all", "0", "all")
            if part is None
            else (f"{part['num_owned']:,.0f}", f"{part['num_halo']:,.0f}",
                  f"{part['num_local_edges']:,.0f}")  # fmt: skip
        )
        top = sorted(mem.items(), key=lambda kv: -kv[1])[:3]
        largest = ", ".join(f"{k} {v / mib:,.0f}" for k, v in top)
        rank = "each" if r["rank"] is None else str(r["rank"])
        lines.append(f"{r['data']:>4} {rank:>4} {owned:>11} {halo:>11} {edges:>13} "
                     f"{sum(mem.values()) / mib:>9,.0f}  {largest}")  # fmt: skip
    return "\n".join(lines)


def _cmd_machines(args: argparse.Namespace) -> int:
    for m in builtin_machines().values():
        print(
            f"{m.name:<11} {m.description}\n"
            f"{'':<11} {m.devices_per_node} per node, {m.memory_gb:g} GB, intra "
            f"{m.intra.gbps:g} GB/s, inter {m.inter.gbps:g} GB/s, GEMM {m.gemm_tflops:g} "
            f"TFLOP/s, SpMM {m.spmm_gflops:g} GFLOP/s\n{'':<11} assumptions: {m.assumptions}"
        )
    return 0


def _common(p: argparse.ArgumentParser, default_machine: str) -> None:
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
        help="measured bandwidth table (gnnpar info --check --json); repeatable",
    )
    p.add_argument("--top", type=int, default=5, help="shapes to print")
    p.add_argument("--plot", default=None, help="PNG of predicted step time over shapes")
    p.add_argument("--json", default=None, help="write every shape's predictions as JSON")


def add_plan_commands(subparsers: Any) -> None:
    """Register ``gnnpar plan gcn | gpt | sage | machines``."""
    plan = subparsers.add_parser("plan", help="rank grid shapes with the planner's models")
    kinds = plan.add_subparsers(dest="workload", required=True)

    from gnnpar.models.fullgraph.task import FullGraphConfig
    from gnnpar.models.gpt.task import GPTTaskConfig
    from gnnpar.models.minibatch.task import MiniBatchConfig
    from gnnpar.train.config import add_flags

    g = kinds.add_parser(
        "gcn",
        help="full-graph GCN / GraphSAGE on an x*y*z grid",
        description="Rank x*y*z shapes for `gnnpar train gcn` with the same options (and the "
        "same defaults), or for a graph of given sizes.",
    )
    add_flags(g, FullGraphConfig, GCN_OPTIONS)
    sizes = g.add_argument_group("a graph by its sizes (instead of --dataset)")
    sizes.add_argument("--nodes", default=None, help="nodes (e.g. 2.4M)")
    sizes.add_argument("--edges", default=None, help="undirected edges (nnz = 2E + N)")
    sizes.add_argument("--features", type=int, default=None, help="input features")
    sizes.add_argument("--classes", type=int, default=None, help="output classes")
    _common(g, "a100x4")
    g.set_defaults(func=_cmd_gcn)

    t = kinds.add_parser(
        "gpt",
        help="GPT with pipeline x data x 3D tensor parallelism",
        description="Rank (pipe, data, x, y, z) shapes and ZeRO stages for `gnnpar train gpt` "
        "with the same options (and the same defaults), or for a built-in size (--params); "
        "pipelines run --schedule with --grad-accum micro-batches.",
    )
    t.add_argument(
        "--params",
        default=None,
        help=f"a built-in size: {', '.join(gpt_sizes())} (sets n_layer, n_embd, n_head)",
    )
    add_flags(t, GPTTaskConfig, GPT_OPTIONS)
    t.add_argument(
        "--grid",
        default=None,
        help="fix these axes (the trainer's --grid, e.g. context=4 or x=2,data=2)",
    )
    t.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="memory per rank in GB (default: the machine's)",
    )
    t.add_argument(
        "--longest-sequence",
        action="store_true",
        help="print the longest block size that fits the memory per rank instead",
    )
    t.add_argument(
        "--stage",
        type=int,
        default=None,
        choices=(0, 1, 2, 3),
        help="data-axis sharding (ZeRO) stage; default: rank every stage",
    )
    t.add_argument(
        "--largest",
        action="store_true",
        help="find the most layers (at the given width, heads, sequence and batch) that fit "
        "the per-rank memory on --gpus ranks, and rank its shapes",
    )
    _common(t, "a100x4")
    t.set_defaults(func=_cmd_gpt)

    sg = kinds.add_parser(
        "sage",
        help="mini-batch GraphSAGE: peak memory per data rank",
        description="Peak memory per data rank of `gnnpar train sage` (the neighbour "
        "sampler's GraphSAGE) with the same options (and the same defaults), by the "
        "planner's mini-batch memory model: for 1, 2, 4, ... up to --gpus ranks on parts "
        "estimated from the graph's degrees, or for each part of --partitions FOLDER.",
    )
    add_flags(sg, MiniBatchConfig, SAGE_OPTIONS)
    sg.add_argument("--gpus", type=int, default=None, help="data ranks to plan for")
    sg.add_argument("--json", default=None, help="write every row's parts as JSON")
    sg.set_defaults(func=_cmd_sage)

    m = kinds.add_parser("machines", help="list the built-in machines and their assumptions")
    m.set_defaults(func=_cmd_machines)
