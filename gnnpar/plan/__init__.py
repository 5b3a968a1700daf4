"""The planner's generic parts: machines, collectives and their seconds, the compute roofline,
the shared memory terms, and ranking shapes into candidates. Each workload's cost and memory
model lives with the workload and builds on these:

    from gnnpar.plan import get_machine
    from gnnpar.models.fullgraph.cost import GCNProblem
    from gnnpar.models.fullgraph.planning import rank_gcn
    machine = get_machine("a100x4")                       # or "cpu", a bandwidth table, ...
    problem = GCNProblem.from_edges(2_449_029, 61_859_140, features=100, classes=47)
    best = rank_gcn(problem, world=64, machine=machine)[0]
    best.shape, best.step_seconds, best.bytes, best.comm, best.memory

:func:`gnnpar.models.fullgraph.planning.choose_fullgraph_grid` is what ``gnnpar train gcn``
runs, :func:`gnnpar.models.gpt.planning.choose_gpt_plan` (shape and ZeRO stage) what
``gnnpar train gpt`` runs, :func:`gnnpar.models.minibatch.cost.minibatch_memory` what
``gnnpar plan sage`` prints.

Modules, one job each: :mod:`~gnnpar.plan.inputs` (checked input, :class:`PlanError`),
:mod:`~gnnpar.plan.machines` (machine descriptions and the measured bandwidth table),
:mod:`~gnnpar.plan.comm_model` (collectives, placement, seconds),
:mod:`~gnnpar.plan.compute` (the roofline), :mod:`~gnnpar.plan.memory` (ZeRO state and
other shared bytes), :mod:`~gnnpar.plan.rank` (enumerate and rank shapes),
:mod:`~gnnpar.plan.command` (what a workload's ``gnnpar plan NAME`` shares),
:mod:`~gnnpar.plan.plot` (its ``--plot`` figure).
"""

from gnnpar.plan.comm_model import (
    Collective,
    Infeasible,
    bytes_by_axis,
    bytes_by_axis_kind,
    comm_seconds,
    intra_node_axes,
)
from gnnpar.plan.inputs import PlanError, parse_count
from gnnpar.plan.machines import (
    Link,
    Machine,
    builtin_machines,
    get_machine,
    load_bandwidth_table,
    local_machine,
)
from gnnpar.plan.rank import Candidate, PipelinePlan, shape_label

__all__ = [
    "Candidate",
    "Collective",
    "Infeasible",
    "Link",
    "Machine",
    "PipelinePlan",
    "PlanError",
    "builtin_machines",
    "bytes_by_axis",
    "bytes_by_axis_kind",
    "comm_seconds",
    "get_machine",
    "intra_node_axes",
    "load_bandwidth_table",
    "local_machine",
    "parse_count",
    "shape_label",
]
