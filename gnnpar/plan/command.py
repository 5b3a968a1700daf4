"""``gnnpar plan NAME``, the parts every workload's planner shares: the :class:`PlanCommand` a
workload registers in its train spec (:attr:`gnnpar.train.spec.TrainSpec.planner`), the
machine options, and the ranked table (with ``--plot`` and ``--json``) of the candidates a
workload's cost model returns. The command line (:mod:`gnnpar.cli.plan`) adds one
subcommand per registered planner, with the trainer's own flags for the options it names.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from gnnpar.atomic import write_json
from gnnpar.plan.inputs import PlanError
from gnnpar.plan.machines import Machine, get_machine
from gnnpar.plan.memory import OFF_DEVICE
from gnnpar.plan.plot import plot_candidates
from gnnpar.plan.rank import Candidate, shape_label

__all__ = [
    "PlanCommand",
    "add_machine_options",
    "format_candidates",
    "machine_from",
    "report",
]


@dataclasses.dataclass(frozen=True)
class PlanCommand:
    """A workload's ``gnnpar plan NAME``: its one-line ``help`` and ``description``, the
    trainer's config fields it takes as flags (``options``, spelled and defaulted as
    ``gnnpar train NAME`` spells them: the same flags describe the same run, so both pick the
    same grid), its own flags (``add_arguments``), and ``run(args)``, which prints and
    returns the exit code (PlanError for bad input)."""

    help: str
    description: str
    options: tuple[str, ...]
    run: Callable[[argparse.Namespace], int]
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None


def machine_from(args: argparse.Namespace) -> Machine:
    machine = get_machine(args.machine, args.bandwidth or None)
    if getattr(args, "memory_gb", None) is not None:  # a stated per-rank memory
        if args.memory_gb <= 0:
            raise PlanError(f"--memory-gb must be positive, got {args.memory_gb}")
        machine = dataclasses.replace(machine, memory_gb=args.memory_gb)
    return machine


def add_machine_options(p: argparse.ArgumentParser, default_machine: str) -> None:
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


def format_candidates(cands: list[Candidate], top: int, tiers: bool | None = None) -> str:
    """A plain-text table of the ``top`` best shapes (and how many do not fit): device memory,
    the offloaded parts (``host GB``, ``file GB``) where any candidate has them, and with
    ``tiers`` an ``offload`` column of each shape's tier (None: where the shown shapes'
    tiers differ)."""
    axes = [
        a
        for a in ("x", "y", "z", "xy", "xz", "yz", "expert", "context", "data", "tensor", "pipe")
        if any(c.bytes.get(a) for c in cands)
    ]
    head = ["rank", "shape (data x y z)", "step ms", "compute", "comm", *axes, "memory GB"]
    offs = [k for k in OFF_DEVICE if any(c.memory.get(k) for c in cands)]
    head += [f"{k} GB" for k in offs]
    fitting = [c for c in cands if c.fits]
    if tiers is None:
        tiers = len({c.offload for c in fitting[:top]}) > 1
    if tiers:
        head.append("offload")
    stages = len({c.stage for c in cands}) > 1
    if stages:
        head.insert(2, "ZeRO")
    piped = any(c.pipeline is not None for c in cands[:top] if c.fits)
    if piped:
        head[1] = "shape (pipe data x y z)"
        head.insert(2, "schedule m·v bubble")
    rows = []
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
                *[f"{c.memory.get(k, 0.0) / 1e9:,.2f}" for k in offs],
                *([c.offload or "-"] if tiers else []),
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


def report(
    cands: list[Candidate], args: argparse.Namespace, title: str, tiers: bool | None = None
) -> int:
    """Print ``title`` and the table of the ``args.top`` best candidates (``tiers``: their
    offload tiers, :func:`format_candidates`), and write ``--plot`` and ``--json``."""
    print(title)
    print(format_candidates(cands, args.top, tiers))
    if args.plot:
        plot_candidates(cands, args.plot, title, top=args.top)
        print(f"wrote {args.plot}")
    if args.json:
        doc = {"title": title, "candidates": [c.as_dict() for c in cands]}
        write_json(args.json, doc, indent=1)  # whole or not at all
        print(f"wrote {args.json}")
    return 0
