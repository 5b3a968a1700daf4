"""The planner: communication, compute and memory models that choose the grid shape.

Public surface::

    from gnnpar.plan import GCNProblem, GPTProblem, get_machine, rank_gcn, rank_gpt
    machine = get_machine("a100x4")                       # or "cpu", a bandwidth table, ...
    problem = GCNProblem.from_edges(2_449_029, 61_859_140, features=100, classes=47)
    best = rank_gcn(problem, world=64, machine=machine)[0]
    best.shape, best.step_seconds, best.bytes, best.comm, best.memory

    choose_fullgraph_grid(world, num_nodes, dims)         # what `gnnpar train gcn` uses
    choose_gpt_plan(GPTProblem(GPTConfig(...)), world, machine)  # (shape, ZeRO stage):
                                                          # what `gnnpar train gpt` runs

Modules, one job each: :mod:`~gnnpar.plan.problems` (what is planned),
:mod:`~gnnpar.plan.machines` (machine descriptions and the measured bandwidth table),
:mod:`~gnnpar.plan.comm_model` (collectives per step, placement, seconds),
:mod:`~gnnpar.plan.compute` (GEMM / SpMM time), :mod:`~gnnpar.plan.memory` (bytes per
device), :mod:`~gnnpar.plan.rank` (enumerate and rank shapes), :mod:`~gnnpar.cli.plan`
(``gnnpar plan``), :mod:`~gnnpar.plan.plot` (its ``--plot`` figure).
"""

from gnnpar.plan.comm_model import (
    Collective,
    bytes_by_axis,
    comm_seconds,
    gcn_collectives,
    gpt_collectives,
    intra_node_axes,
)
from gnnpar.plan.machines import (
    Link,
    Machine,
    builtin_machines,
    get_machine,
    load_bandwidth_table,
    local_machine,
)
from gnnpar.plan.problems import GCNProblem, GPTProblem, PlanError
from gnnpar.plan.rank import (
    Candidate,
    choose_fullgraph_grid,
    choose_gpt_plan,
    fullgraph_epoch_bytes,
    rank_gcn,
    rank_gpt,
)

__all__ = [
    "Candidate",
    "Collective",
    "GCNProblem",
    "GPTProblem",
    "Link",
    "Machine",
    "PlanError",
    "builtin_machines",
    "bytes_by_axis",
    "choose_fullgraph_grid",
    "choose_gpt_plan",
    "comm_seconds",
    "fullgraph_epoch_bytes",
    "gcn_collectives",
    "get_machine",
    "gpt_collectives",
    "intra_node_axes",
    "load_bandwidth_table",
    "local_machine",
    "rank_gcn",
    "rank_gpt",
]
