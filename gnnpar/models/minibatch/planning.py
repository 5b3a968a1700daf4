"""``gnnpar plan sage`` (:data:`PLANNER`): the peak memory of each data rank of a mini-batch
run, by :func:`gnnpar.models.minibatch.cost.minibatch_memory`, for 1, 2, 4, ... ranks on
parts estimated from the graph's degrees, or for each part of a partition folder."""

from __future__ import annotations

import argparse
from typing import Any

from gnnpar.atomic import write_json
from gnnpar.models.minibatch.cost import estimated_part, minibatch_memory
from gnnpar.plan.command import PlanCommand
from gnnpar.plan.inputs import PlanError
from gnnpar.train.config import ConfigError, resolve
from gnnpar.train.loop import load_dataset

__all__ = ["PLANNER", "format_minibatch_rows"]


SAGE_OPTIONS = ("dataset", "root", "dataset_options", "model", "sampler", "partitions", "fanouts",
                "batch_size", "hidden", "layers", "feature_cache", "prefetch", "zero_stage",
                "dtype", "mixed_precision", "bases")  # fmt: skip


def _data_sizes(gpus: int) -> list[int]:
    """1, 2, 4, ... below ``gpus``, then ``gpus``."""
    out, d = [], 1
    while d < gpus:
        out.append(d)
        d *= 2
    return [*out, gpus]


def _cmd_sage(args: argparse.Namespace) -> int:
    from gnnpar.models.minibatch.task import MiniBatchConfig, check_partitions, plan_problem

    cfg = resolve(MiniBatchConfig, args, None)
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
    model = "sage" if problem.typed is None else f"rgcn ({problem.typed.num_relations} relations)"
    title = (
        f"{model} on {problem.name}: {problem.nodes:,} nodes, {problem.edges:,} edges, "
        f"{problem.features} features; batch {problem.batch_size}, fan-outs "
        f"{cfg.fanouts if problem.typed else ','.join(map(str, problem.fanouts))}, hidden "
        f"{problem.hidden}, ZeRO stage "
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


def _sage_arguments(sg: argparse.ArgumentParser) -> None:
    sg.add_argument("--gpus", type=int, default=None, help="data ranks to plan for")
    sg.add_argument("--json", default=None, help="write every row's parts as JSON")


#: ``gnnpar plan sage``.
PLANNER = PlanCommand(
    help="mini-batch GraphSAGE (R-GCN on a typed graph): peak memory per data rank",
    description="Peak memory per data rank of `gnnpar train sage` (the neighbour "
    "sampler's GraphSAGE, or R-GCN with --model rgcn on a typed graph) with the same "
    "options (and the same defaults), by the "
    "planner's mini-batch memory model: for 1, 2, 4, ... up to --gpus ranks on parts "
    "estimated from the graph's degrees, or for each part of --partitions FOLDER.",
    options=SAGE_OPTIONS,
    run=_cmd_sage,
    add_arguments=_sage_arguments,
)
