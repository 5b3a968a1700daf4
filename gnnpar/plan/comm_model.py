"""Communication of one training step, collective by collective, and its time: the parts
every workload's cost model shares.

A workload lists what one step sends as :class:`Collective` s (the full-graph GNN's in
:func:`gnnpar.models.fullgraph.cost.gcn_collectives`, the GPT's in
:func:`gnnpar.models.gpt.cost.gpt_collectives`), each carrying the per-rank ring bytes exactly
as :mod:`gnnpar.comm` records them (pieces padded to the largest, rounded once per call,
:func:`collective`), so the sums equal measured traffic byte for byte.

Placement (:func:`intra_node_axes`): ranks are numbered x fastest, then y, z, context, data,
pipe; a node holds ``ranks_per_node`` consecutive ranks; a group is intra-node when every
group along that axis lies inside one node (for a single axis: stride × size divides
ranks_per_node). :func:`comm_seconds` prices each collective with the machine's α–β model for
its placement.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping

from gnnpar.comm import ring_bytes
from gnnpar.grid import AXES, COMBINED_AXES, GridShape, axes_of, rank_at
from gnnpar.plan.inputs import PlanError
from gnnpar.plan.machines import Machine

__all__ = [
    "Collective",
    "Infeasible",
    "bytes_by_axis",
    "bytes_by_axis_kind",
    "collective",
    "comm_seconds",
    "grid_shape",
    "intra_node_axes",
]


class Infeasible(PlanError):
    """The grid shape cannot run this problem (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective (repeated ``count`` times) as this rank sees it: ``nbytes`` are the
    ring bytes of one call, rounded as :mod:`gnnpar.comm` records them."""

    axis: str
    kind: str
    group: int
    nbytes: int
    what: str
    count: int = 1

    @property
    def total(self) -> int:
        """Bytes of all ``count`` calls."""
        return self.nbytes * self.count


def collective(
    axis: str, kind: str, p: int, full_bytes: float, what: str, count: int = 1
) -> list[Collective]:
    """[Collective] for a buffer of ``full_bytes`` over ``p`` ranks, or [] when p == 1."""
    if p <= 1:
        return []
    return [Collective(axis, kind, p, round(ring_bytes(kind, full_bytes, p)), what, count)]


def bytes_by_axis(collectives: Iterable[Collective]) -> dict[str, int]:
    """Total bytes per axis (what ``Traffic.by_axis()`` measures)."""
    out: dict[str, int] = {}
    for c in collectives:
        out[c.axis] = out.get(c.axis, 0) + c.total
    return out


def bytes_by_axis_kind(collectives: Iterable[Collective]) -> dict[str, dict[str, int]]:
    """``{axis: {kind: bytes}}`` (what ``Traffic.as_dict()`` measures)."""
    out: dict[str, dict[str, int]] = {}
    for c in collectives:
        d = out.setdefault(c.axis, {})
        d[c.kind] = d.get(c.kind, 0) + c.total
    return out


def intra_node_axes(shape: Mapping[str, int], ranks_per_node: int) -> dict[str, bool]:
    """For every axis name (single and combined): whether all its groups sit inside one
    node, for ranks numbered x fastest and nodes of ``ranks_per_node`` consecutive ranks."""
    full = {a: int(shape.get(a, 1)) for a in AXES}
    stride, s = {}, 1
    for a in AXES:
        stride[a] = s
        s *= full[a]
    out = {}
    for name in (*AXES, *COMBINED_AXES):
        axes = axes_of(name)
        inside = [a for a in axes if full[a] > 1]
        if not inside:
            out[name] = True
            continue
        others = [a for a in AXES if a not in axes]
        # members lie between base and base + span; a node is a range of ranks, so the
        # group is inside one node when its first and last member are
        span = sum((full[a] - 1) * stride[a] for a in inside)
        ok = True
        for combo in itertools.product(*(range(full[a]) for a in others)):
            base = sum(i * stride[a] for a, i in zip(others, combo, strict=True))
            if base // ranks_per_node != (base + span) // ranks_per_node:
                ok = False
                break
        out[name] = ok
    return out


def comm_seconds(
    collectives: Iterable[Collective],
    shape: Mapping[str, int],
    machine: Machine,
) -> dict[str, float]:
    """Seconds per axis of ``collectives`` on ``machine`` (no overlap with compute)."""
    world = 1
    for a in AXES:
        world *= int(shape.get(a, 1))
    intra = intra_node_axes(shape, machine.ranks_per_node(world))
    out: dict[str, float] = {}
    for c in collectives:
        t = machine.collective_seconds(c.kind, c.group, c.nbytes, intra[c.axis]) * c.count
        out[c.axis] = out.get(c.axis, 0.0) + t
    return out


def grid_shape(shape: Mapping[str, int], coords: Mapping[str, int] | None = None) -> GridShape:
    """The :class:`GridShape` of ``shape`` seen from the rank at ``coords`` (default 0)."""
    g = GridShape(**{a: int(shape.get(a, 1)) for a in AXES})
    if coords is None:
        return g
    return dataclasses.replace(g, global_rank=rank_at(g.sizes(), coords))
