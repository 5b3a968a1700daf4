"""Ranking grid shapes, for any workload: every factorisation of the world into
(data, x, y, z) (:func:`grid_shapes`), each costed by a workload's communication, compute and
memory models into a :class:`Candidate` (:func:`evaluate`), those that fit in memory first,
fastest first (:func:`best_first`). The full-graph GNN ranks with
:func:`gnnpar.models.fullgraph.planning.rank_gcn`, the GPT (with pipe and context axes and
ZeRO stages) with :func:`gnnpar.models.gpt.planning.rank_gpt`.

Predicted step time = compute (:mod:`gnnpar.plan.compute`) + communication
(:mod:`gnnpar.plan.comm_model`), with no overlap between them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping

from gnnpar.grid import AXES, factorizations
from gnnpar.plan.comm_model import (
    Collective,
    Infeasible,
    bytes_by_axis,
    comm_seconds,
    intra_node_axes,
)
from gnnpar.plan.inputs import PlanError
from gnnpar.plan.machines import Machine
from gnnpar.plan.memory import USABLE_FRACTION, device_bytes

__all__ = [
    "Candidate",
    "PipelinePlan",
    "best_first",
    "best_shape",
    "evaluate",
    "grid_shapes",
    "largest_fitting",
    "shape_label",
]


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """How a candidate pipelines: its schedule, micro-batches, chunks per rank, bubble and
    peak in-flight chunk passes."""

    pipe: int
    schedule: str
    micro_batches: int
    virtual: int
    bubble: float
    in_flight: int

    def as_dict(self) -> dict:  # noqa: D102
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One grid shape with its predictions (rank 0, the busiest rank).

    ``fits`` is False when the shape cannot run the problem or needs more memory than the
    machine has; ``reason`` then says why. Times are seconds per step (epoch for GCN).
    ``offload`` (GPT candidates) is the offload tier its ``memory`` has: ``"none"``,
    ``"host"`` or ``"file"`` — the problem's, or with ``offload="auto"`` the smallest that
    fits (:mod:`gnnpar.models.gpt.planning`); None where the workload has no tiers.
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
    offload: str | None = None  # the offload tier (GPT candidates)

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
            "offload": self.offload,
        }


def shape_label(shape: Mapping[str, int]) -> str:
    """``"d1 x2 y2 z2"`` (``"p4 d1 x2 y2 z2"`` with a pipe axis, ``"d1 c4 x2 y1 z1"`` with a
    context axis, ``"d2 e2 x2 y1 z1"`` with an expert axis)."""
    optional = tuple(a for a in ("context", "expert") if shape.get(a, 1) > 1)
    axes = ("data", *optional, *AXES[:3])
    label = " ".join(f"{'d' if a == 'data' else a[0]}{shape.get(a, 1)}" for a in axes)
    return f"p{shape['pipe']} {label}" if shape.get("pipe", 1) > 1 else label


def grid_shapes(world: int, data: bool) -> list[dict[str, int]]:
    """Every (data, x, y, z) factorisation of ``world`` ranks (with ``data`` False, those
    with data = 1)."""
    if world < 1:
        raise PlanError(f"the number of GPUs must be positive, got {world}")
    out = []
    for d, x, y, z in factorizations(world):
        if d != 1 and not data:
            continue
        out.append({"data": d, "x": x, "y": y, "z": z})
    return out


def evaluate(
    shape: dict[str, int],
    machine: Machine,
    collectives: Callable[[], list[Collective]],
    compute: Callable[[], dict[str, float]],
    memory: Callable[[], dict[str, float]],
) -> Candidate:
    """The :class:`Candidate` of ``shape``: a workload's ``collectives``, ``compute`` seconds
    and ``memory`` parts (each a callable, so a shape that cannot run, :class:`Infeasible`,
    is one that does not fit, with the reason), priced on ``machine``."""
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


def best_first(cands: Iterable[Candidate]) -> list[Candidate]:
    """Candidates that fit first, fastest first; ties go to fewer bytes, the lower ZeRO
    stage, fewer pipeline stages, then more data, x and y ranks."""

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


def best_shape(cands: list[Candidate], what: str) -> dict[str, int]:
    """The shape of the first of ``cands`` (ranked), PlanError naming a few reasons when none
    fits (``what``: the thing being planned, for the message)."""
    if not cands or not cands[0].fits:
        reasons = sorted({c.reason for c in cands})[:3]
        raise PlanError(f"no grid shape can run this {what}: {'; '.join(reasons)}")
    return dict(cands[0].shape)


def largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
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
