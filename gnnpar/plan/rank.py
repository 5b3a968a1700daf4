"""Rank grid shapes: every factorisation of the world into (data, x, y, z), and for GPT
into (pipe, data, x, y, z) (:mod:`gnnpar.plan.pipeline`), costed with the communication,
compute and memory models, those that fit in memory first, fastest first.

Predicted step time = compute (:mod:`gnnpar.plan.compute`) + communication
(:mod:`gnnpar.plan.comm_model`), with no overlap between them. Full-graph training has no
batch to split, so its shapes all have data = 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gnnpar.grid import AXES, factorizations
from gnnpar.plan.comm_model import (
    Collective,
    Infeasible,
    bytes_by_axis,
    comm_seconds,
    gcn_collectives,
    gpt_collectives,
    gpt_layout,
    intra_node_axes,
    meta_gpt,
)
from gnnpar.plan.compute import gcn_compute_seconds, gpt_compute_seconds
from gnnpar.plan.machines import Machine
from gnnpar.plan.memory import USABLE_FRACTION, device_bytes, gcn_memory, gpt_memory
from gnnpar.plan.pipeline import PipelinePlan, p2p_collectives, pipeline_plan
from gnnpar.plan.pipeline import stage_problem as pipeline_stage
from gnnpar.plan.problems import GCNProblem, GPTProblem, PlanError

__all__ = [
    "Candidate",
    "choose_fullgraph_grid",
    "choose_gpt_plan",
    "fullgraph_epoch_bytes",
    "largest_gpt",
    "rank_gcn",
    "rank_gpt",
    "rank_gpt_stages",
    "shape_label",
]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One grid shape with its predictions (rank 0, the busiest rank).

    ``fits`` is False when the shape cannot run the problem or needs more memory than the
    machine has; ``reason`` then says why. Times are seconds per step (epoch for GCN).
    """

    shape: Mapping[str, int]
    fits: bool
    reason: str = ""
    step_seconds: float = float("inf")
    compute: Mapping[str, float] = dataclasses.field(default_factory=dict)
    comm: Mapping[str, float] = dataclasses.field(default_factory=dict)
    bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    memory: Mapping[str, float] = dataclasses.field(default_factory=dict)
    intra_node: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    collectives: tuple[Collective, ...] = ()
    stage: int | None = None  # the ZeRO stage (GPT candidates)
    pipeline: PipelinePlan | None = None  # GPT candidates with a pipe axis

    @property
    def compute_seconds(self) -> float:
        """Compute seconds per step."""
        return sum(self.compute.values())

    @property
    def comm_seconds(self) -> float:
        """Communication seconds per step."""
        return sum(self.comm.values())

    @property
    def total_bytes(self) -> int:
        """Bytes this rank sends per step, over all axes."""
        return sum(self.bytes.values())

    @property
    def memory_bytes(self) -> float:
        """Device memory this rank needs (offloaded parts are not)."""
        return device_bytes(self.memory)

    def as_dict(self) -> dict:
        """JSON-ready summary (without the collective list)."""
        return {
            "shape": dict(self.shape),
            "fits": self.fits,
            "reason": self.reason,
            "step_seconds": self.step_seconds if self.fits else None,
            "compute_seconds": dict(self.compute),
            "comm_seconds": dict(self.comm),
            "bytes": dict(self.bytes),
            "memory_bytes": dict(self.memory),
            "intra_node": dict(self.intra_node),
            "stage": self.stage,
            "pipeline": self.pipeline.as_dict() if self.pipeline is not None else None,
        }


def shape_label(shape: Mapping[str, int]) -> str:
    """``"d1 x2 y2 z2"`` (``"p4 d1 x2 y2 z2"`` with a pipe axis, ``"d1 c4 x2 y1 z1"`` with a
    context axis)."""
    axes = ("data", *(("context",) if shape.get("context", 1) > 1 else ()), *AXES[:3])
    label = " ".join(f"{'d' if a == 'data' else a[0]}{shape.get(a, 1)}" for a in axes)
    return f"p{shape['pipe']} {label}" if shape.get("pipe", 1) > 1 else label


def _shapes(world: int, data: bool) -> list[dict[str, int]]:
    if world < 1:
        raise PlanError(f"the number of GPUs must be positive, got {world}")
    out = []
    for d, x, y, z in factorizations(world):
        if d != 1 and not data:
            continue
        out.append({"data": d, "x": x, "y": y, "z": z})
    return out


def _evaluate(
    shape: dict[str, int],
    machine: Machine,
    collectives: Callable[[], list[Collective]],
    compute: Callable[[], dict[str, float]],
    memory: Callable[[], dict[str, float]],
) -> Candidate:
    world = math.prod(shape.get(a, 1) for a in AXES)
    try:
        colls = collectives()
        mem = memory()
        comp = compute()
    except Infeasible as err:
        return Candidate(shape, False, str(err))
    comm = comm_seconds(colls, shape, machine)
    intra = intra_node_axes(shape, machine.ranks_per_node(world))
    fits, reason = True, ""
    usable = USABLE_FRACTION * machine.memory_gb * 1e9
    if device_bytes(mem) > usable:
        fits = False
        reason = f"needs {device_bytes(mem) / 1e9:.1f} GB of {machine.memory_gb:g} GB"
    return Candidate(
        shape=shape,
        fits=fits,
        reason=reason,
        step_seconds=sum(comp.values()) + sum(comm.values()),
        compute=comp,
        comm=comm,
        bytes=bytes_by_axis(colls),
        memory=mem,
        intra_node={a: intra[a] for a in (*AXES, "tensor")},
        collectives=tuple(colls),
    )


def _order(cands: Iterable[Candidate]) -> list[Candidate]:
    def key(c: Candidate):
        s = c.shape
        return (
            not c.fits,
            c.step_seconds,
            c.total_bytes,
            c.stage or 0,
            s.get("pipe", 1),
            -s["data"],
            -s["x"],
            -s["y"],
        )

    return sorted(cands, key=key)


def rank_gcn(problem: GCNProblem, world: int, machine: Machine) -> list[Candidate]:
    """Every x·y·z shape of ``world`` ranks (data = 1) for a full-graph run, best first."""
    return _order(
        _evaluate(
            s,
            machine,
            lambda s=s: gcn_collectives(problem, s),
            lambda s=s: gcn_compute_seconds(problem, s, machine),
            lambda s=s: gcn_memory(problem, s),
        )
        for s in _shapes(world, data=False)
    )


def rank_gpt(
    problem: GPTProblem, world: int, machine: Machine, context: int = 1
) -> list[Candidate]:
    """Every data·x·y·z shape of ``world`` ranks for a GPT step, and with ``problem.schedule``
    every pipe·data·x·y·z shape with pipe > 1 (pipelines of that schedule), best first; with
    ``context`` > 1, the shapes with that context axis (sequences split over it; no pipe)."""
    model = meta_gpt(problem)
    out = []
    if context < 1 or world % context:
        raise PlanError(f"context={context} does not divide {world} ranks")
    pipes = [1]
    if problem.schedule and context == 1:
        pipes += [p for p in range(2, min(world, problem.layers) + 1) if world % p == 0]
    for pipe in pipes:
        for s in _shapes(world // pipe // context, data=True):
            shape = {**s, "pipe": pipe} if pipe > 1 else s
            if context > 1:
                shape = {**shape, "context": context}
            out.append(_gpt_candidate(problem, shape, machine, model))
    return _order(out)


def _gpt_candidate(
    problem: GPTProblem, shape: dict[str, int], machine: Machine, model: Any
) -> Candidate:
    """One GPT candidate; with a pipe axis, its busiest stage (:mod:`gnnpar.plan.pipeline`)."""
    pipe = shape.get("pipe", 1)
    rest = {a: v for a, v in shape.items() if a != "pipe"}
    plan = None
    try:
        stage_problem = problem
        if pipe > 1:
            plan = pipeline_plan(problem, pipe)
            stage_problem = pipeline_stage(problem, pipe)
        layout = gpt_layout(stage_problem, rest, model)
        p2p = p2p_collectives(problem, shape, plan) if plan is not None else []
    except Infeasible as err:
        return Candidate(shape, False, str(err), stage=problem.stage, pipeline=plan)

    def compute() -> dict[str, float]:
        out = gpt_compute_seconds(stage_problem, rest, machine, layout)
        if plan is not None:
            # the stage's ranks share the devices with every other stage's
            world = math.prod(shape.values())
            slower = machine.compute_share(world // pipe) / machine.compute_share(world)
            out = {k: v * slower for k, v in out.items()}
            # and it waits for the others this part of the step
            out["bubble"] = sum(out.values()) * plan.bubble / (1.0 - plan.bubble)
        return out

    def memory() -> dict[str, float]:
        out = gpt_memory(stage_problem, rest, layout)
        if plan is not None:  # the chunk passes in flight, of the m·v of a step
            out["activations"] *= plan.in_flight / (plan.micro_batches * plan.virtual)
        return out

    c = _evaluate(
        shape,
        machine,
        lambda: gpt_collectives(stage_problem, rest, layout=layout) + p2p,
        compute,
        memory,
    )
    return dataclasses.replace(c, stage=problem.stage, pipeline=plan)


def _best(cands: list[Candidate], what: str) -> dict[str, int]:
    if not cands or not cands[0].fits:
        reasons = sorted({c.reason for c in cands})[:3]
        raise PlanError(f"no grid shape can run this {what}: {'; '.join(reasons)}")
    return dict(cands[0].shape)


def fullgraph_epoch_bytes(
    shape: dict[str, int],
    num_nodes: int,
    dims: list[int],
    num_ops: int = 1,
    element_size: int = 4,
    bias: bool = True,
    model: str | None = None,
    heads: tuple[int, int] = (8, 1),
) -> dict[str, float]:
    """Bytes per axis that rank 0 moves in one forward + backward pass of a 3D full-graph
    model with feature widths ``dims`` (biases included, the loss's few scalars not);
    ``model`` (default: gcn, or sage for 2 operators) and GAT's (hidden, output) ``heads``."""
    problem = GCNProblem.from_widths(
        num_nodes,
        1,
        list(dims),
        model=model or ("sage" if num_ops == 2 else "gcn"),
        element_size=element_size,
        bias=bias,
        heads=heads[0],
        out_heads=heads[1],
    )
    colls = gcn_collectives(problem, {"data": 1, **shape}, loss=False)
    out = {"x": 0.0, "y": 0.0, "z": 0.0}
    for axis, b in bytes_by_axis(colls).items():
        out[axis] += float(b)
    return out


def choose_fullgraph_grid(
    world: int,
    num_nodes: int,
    dims: list[int],
    num_ops: int = 1,
    *,
    nnz: int | None = None,
    machine: Machine | None = None,
    element_size: int = 4,
    algorithm: str = "3d",
    model: str | None = None,
    heads: tuple[int, int] = (8, 1),
    activation_checkpointing: str = "none",
) -> dict[str, int]:
    """The grid shape for a full-graph run of ``algorithm`` on ``world`` ranks.

    3D, with a ``machine`` (and the adjacency's ``nnz``): the fastest predicted x·y·z shape
    that fits (:func:`rank_gcn`; what ``gnnpar plan gcn`` ranks first). Without: the shape
    with the fewest bytes per epoch; ties go to the shape whose busiest axis moves least, then
    to x before y before z. 2D (SUMMA): the squarest x·y; 1D: x = ``world``. ``model``
    (default: gcn, or sage for 2 operators) and GAT's (hidden, output) ``heads`` pick the
    layers' schedules and memory, ``activation_checkpointing`` (none or full) the memory,
    compute and bytes of the recompute.
    """
    model = model or ("sage" if num_ops == 2 else "gcn")
    if algorithm == "2d":
        x = int(world**0.5)
        while world % x:
            x -= 1
        return {"x": x, "y": world // x}
    if algorithm == "1d":
        return {"x": world}
    if algorithm != "3d":
        raise PlanError(f"unknown full-graph algorithm {algorithm!r}: 3d, 2d or 1d")
    if machine is not None:
        problem = GCNProblem.from_widths(
            num_nodes,
            nnz or num_nodes,
            list(dims),
            model=model,
            element_size=element_size,
            heads=heads[0],
            out_heads=heads[1],
            activation_checkpointing=activation_checkpointing,
        )
        best = _best(rank_gcn(problem, world, machine), "graph")
        return {a: best[a] for a in ("x", "y", "z")}
    chosen = None
    for s in _shapes(world, data=False):
        shape = {a: s[a] for a in ("x", "y", "z")}
        b = fullgraph_epoch_bytes(shape, num_nodes, dims, num_ops, model=model, heads=heads)
        key = (sum(b.values()), max(b.values()), -shape["x"], -shape["y"])
        if chosen is None or key < chosen[0]:
            chosen = (key, shape)
    return chosen[1]


def rank_gpt_stages(
    problem: GPTProblem,
    world: int,
    machine: Machine,
    stages: Iterable[int] = (0, 1, 2, 3),
    context: int = 1,
) -> list[Candidate]:
    """Every (shape, ZeRO stage) for a GPT step, best first: :func:`rank_gpt` for each stage,
    merged (at equal predicted time the lower stage first). With ``problem.offload`` stage 0
    (nothing sharded to offload) is left out."""
    if problem.offload != "none":
        stages = [s for s in stages if s >= 1]
    cands = [
        c
        for stage in stages
        for c in rank_gpt(dataclasses.replace(problem, stage=stage), world, machine, context)
    ]
    return _order(cands)


def _of_shape(cands: list[Candidate], shape: Mapping[str, int] | None) -> list[Candidate]:
    """The candidates of grid ``shape`` (all of them for None)."""
    if shape is None:
        return cands
    want = {a: shape.get(a, 1) for a in ("pipe", "data", *AXES[:3])}
    return [c for c in cands if {a: c.shape.get(a, 1) for a in want} == want]


def longest_sequence(
    problem: GPTProblem,
    world: int,
    machine: Machine,
    stages: Iterable[int] = (0, 1, 2, 3),
    shape: Mapping[str, int] | None = None,
) -> tuple[int, Candidate | None]:
    """The longest sequence (a multiple of 2·context, at most ``1 << 24``) for which some
    shape (``shape``'s when given: its context axis and the axes it names) and stage fit
    ``machine``'s memory, with the best such candidate; (0, None) when none does. Memory grows
    with the sequence, so a bisection over multiples of 2·context finds it."""
    stages = tuple(stages)
    context = (shape or {}).get("context", 1)
    want = {a: v for a, v in (shape or {}).items() if a != "context"}

    def best(seq: int) -> Candidate | None:
        p = dataclasses.replace(problem, model=dataclasses.replace(problem.model, block_size=seq))
        for c in rank_gpt_stages(p, world, machine, stages, context):
            if c.fits and all(c.shape.get(a, 1) == v for a, v in want.items()):
                return c
        return None

    unit = 2 * context
    units = _largest_fitting(lambda n: best(n * unit) is not None, (1 << 24) // unit)
    return units * unit, best(units * unit) if units else None


def _largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
    """The largest n in 1..``limit`` with ``fits(n)``, 0 when ``fits(1)`` is false, for a
    ``fits`` that holds up to some n and not beyond (memory grows with n): doubling until
    it does not fit, then a bisection."""
    lo, hi = 0, 1
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # lo fits (or is 0), hi does not (or is past the limit)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def choose_gpt_plan(
    problem: GPTProblem,
    world: int,
    machine: Machine,
    shape: Mapping[str, int] | None = None,
    stage: int | None = None,
) -> tuple[dict[str, int], int]:
    """The (shape, ZeRO stage) predicted fastest for ``problem`` among those that fit:
    ``shape`` or ``stage`` fix one of them (what ``gnnpar train gpt`` runs when it is given
    no grid or no stage, and ``gnnpar plan gpt`` recommends)."""
    stages = (0, 1, 2, 3) if stage is None else (stage,)
    context = 1 if shape is None else shape.get("context", 1)
    cands = _of_shape(rank_gpt_stages(problem, world, machine, stages, context), shape)
    fitting = [c for c in cands if c.fits]
    if not fitting:
        reasons = sorted({c.reason for c in cands})[:3]
        raise PlanError(f"no grid shape and stage can run this model: {'; '.join(reasons)}")
    return dict(fitting[0].shape), fitting[0].stage


def largest_gpt(
    problem: GPTProblem,
    world: int,
    machine: Machine,
    stages: Iterable[int] = (0, 1, 2, 3),
    shape: Mapping[str, int] | None = None,
    limit: int = 4096,
) -> tuple[GPTProblem, list[Candidate]]:
    """The deepest GPT of ``problem``'s width, heads, sequence and batch (its ``n_layer``
    grown, at most ``limit``) for which some shape (``shape``: that one) and stage fits
    ``machine``'s per-device memory on ``world`` ranks, and its ranking. Memory grows with
    the layers, so a doubling search and a bisection find it; PlanError when even one layer
    does not fit."""
    stages = tuple(stages)
    context = (shape or {}).get("context", 1)

    def ranked(layers: int) -> list[Candidate]:
        sized = dataclasses.replace(
            problem, model=dataclasses.replace(problem.model, n_layer=layers)
        )
        return _of_shape(rank_gpt_stages(sized, world, machine, stages, context), shape)

    def fits(layers: int) -> bool:
        return any(c.fits for c in ranked(layers))

    layers = _largest_fitting(fits, limit)
    if not layers:
        reasons = sorted({c.reason for c in ranked(1)})[:3]
        raise PlanError(f"not even a 1-layer GPT of this width fits: {'; '.join(reasons)}")
    best = dataclasses.replace(problem, model=dataclasses.replace(problem.model, n_layer=layers))
    return best, _of_shape(rank_gpt_stages(best, world, machine, stages, context), shape)
