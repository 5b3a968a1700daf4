"""``gnnpar plan NAME | machines``: rank grid shapes and print the best ones.

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
    gnnpar plan sage --dataset cora --gpus 4
    gnnpar plan machines

Every registered workload whose train spec has a planner
(:attr:`gnnpar.train.spec.TrainSpec.planner`, a :class:`gnnpar.plan.command.PlanCommand`) is
a subcommand named as in ``gnnpar train``, taking the trainer's options it names with the
trainer's defaults. Bad input is one line on stderr and exit code 2
(:class:`~gnnpar.plan.PlanError`).
"""

from __future__ import annotations

import argparse
from typing import Any

from gnnpar.plan.machines import builtin_machines

__all__ = ["add_plan_commands"]


def _cmd_machines(args: argparse.Namespace) -> int:
    for m in builtin_machines().values():
        host = "" if m.host_memory_gb is None else f" ({m.host_memory_gb:g} GB host a node)"
        print(
            f"{m.name:<11} {m.description}\n"
            f"{'':<11} {m.devices_per_node} per node, {m.memory_gb:g} GB{host}, intra "
            f"{m.intra.gbps:g} GB/s, inter {m.inter.gbps:g} GB/s, GEMM {m.gemm_tflops:g} "
            f"TFLOP/s, SpMM {m.spmm_gflops:g} GFLOP/s\n{'':<11} assumptions: {m.assumptions}"
        )
    return 0


def add_plan_commands(subparsers: Any) -> None:
    """Register ``gnnpar plan NAME`` for every workload with a planner, and ``machines``."""
    from gnnpar.train.config import add_flags
    from gnnpar.train.spec import specs

    plan = subparsers.add_parser("plan", help="rank grid shapes with the planner's models")
    kinds = plan.add_subparsers(dest="workload", required=True)
    for name, spec in specs().items():
        planner = spec.planner
        if planner is None:
            continue
        sub = kinds.add_parser(name, help=planner.help, description=planner.description)
        add_flags(sub, spec.config, planner.options)
        if planner.add_arguments is not None:
            planner.add_arguments(sub)
        sub.set_defaults(func=planner.run)
    m = kinds.add_parser("machines", help="list the built-in machines and their assumptions")
    m.set_defaults(func=_cmd_machines)
