"""Neighbour sampling on typed graphs (:mod:`gnnpar.graph.typed`): fan-outs per relation.

DGL's rule: a fan-out ``k`` on a typed graph draws up to ``k`` in-neighbours of a node **per
relation** (a paper gets ``k`` citing papers and ``k`` authors), and a layer may give each
relation its own fan-out. :class:`~gnnpar.sampling.NeighborSampler` does this for a typed
graph (``per_relation=False`` draws ``k`` over all relations together, as on the homogeneous
view).

How: the edges of every (destination, relation) pair form one *virtual row* ``v * R + r`` of
a CSR over the graph's edges grouped by relation inside each row (:class:`RelationRows`; a
graph built by :func:`~gnnpar.graph.typed.typed_graph` is grouped already, a relabelled one is
regrouped once). Drawing from the virtual rows is the homogeneous draw
(:func:`~gnnpar.sampling.neighbor.sample_rows`, same kernels, same counter-based keys with the
node key ``key * R + r``), so the neighbours of a node do not depend on the batch, the
process count or the partition. The picks are merged back row by row, each row's relations in
order, as positions of the graph's CSR: every later step (exclusion of link-prediction
targets, relabelling, edge weights) is the homogeneous sampler's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gnnpar.errors import UserError
from gnnpar.graph.typed import GraphTypes, TypeSchema, relation_name

__all__ = ["RelationRows", "parse_relation_fanouts"]


def _fanout(value: Any, where: str) -> int:
    try:
        f = int(value)
    except (TypeError, ValueError):
        raise UserError(f"{where}: fan-out {value!r} is not an integer") from None
    if f < 0 and f != -1 or isinstance(value, bool):
        raise UserError(f"{where}: fan-out {value!r}: use 0 or more neighbours, or -1 for all")
    return f


def _layer(value: Any, types: GraphTypes, where: str) -> list[int]:
    """One layer's fan-out for every relation, from an int or a mapping (``"*"``: the rest)."""
    if isinstance(value, str):
        value = dict(item.split(":", 1) for item in value.split("/")) if ":" in value else value
    if not isinstance(value, Mapping):
        return [_fanout(value, where)] * types.num_relations
    rest = value.get("*")
    out: list[int | None] = [None] * types.num_relations
    for rel, f in value.items():
        if rel != "*":
            out[types.relation_index(rel)] = _fanout(f, f"{where}, relation {rel}")
    missing = [relation_name(types.relations[i]) for i, f in enumerate(out) if f is None]
    if missing and rest is None:
        raise UserError(f"{where} gives no fan-out for {missing[0]} (add '*' for the rest)")
    return [f if f is not None else _fanout(rest, where) for f in out]


def parse_relation_fanouts(fanouts: Sequence[Any] | str, types: GraphTypes) -> list[list[int]]:
    """Each layer's fan-out per relation (hop order, like every fan-out list here).

    A layer is an int (every relation), or a mapping relation → fan-out where a relation is
    named as :meth:`GraphTypes.relation_index` accepts and ``"*"`` covers the others. As a
    string, layers are comma-separated and a layer's mapping reads ``cites:5/*:10``
    (``"cites:5/*:10,10"``: 5 citing papers and 10 of every other relation, then 10 of
    each).
    """
    layers = [p.strip() for p in fanouts.split(",")] if isinstance(fanouts, str) else fanouts
    if not layers or any(p == "" for p in layers):
        raise UserError(f"fan-outs {fanouts!r}: give one per layer, e.g. '10,10'")
    return [_layer(v, types, f"fan-out {i}") for i, v in enumerate(layers)]


class RelationRows:
    """The edges of a typed CSR grouped into one virtual row per (node, relation), and each
    layer's fan-out per relation: what a sampler draws a typed hop with.

    Attributes:
        layers: per layer, each relation's fan-out (:func:`parse_relation_fanouts`).
        fanouts: one fan-out per layer, the layer's largest.
        indptr: ``(num_nodes * R + 1,)`` offsets of the virtual rows.
        order: CSR position of each grouped edge, or None when the graph's own order is
            grouped already (positions are then the graph's).
    """

    def __init__(
        self,
        indptr: torch.Tensor,
        edge_type: torch.Tensor,
        types: TypeSchema,
        fanouts: Sequence[Any] | str,
    ):
        self.layers = parse_relation_fanouts(fanouts, types)
        self.fanouts = [max(layer, default=0) for layer in self.layers]
        n, r = indptr.numel() - 1, types.num_relations
        self.num_relations = r
        rows = torch.repeat_interleave(
            torch.arange(n, dtype=torch.int64, device=indptr.device),
            indptr[1:] - indptr[:-1],
            output_size=edge_type.numel(),
        )
        virtual = rows * r + edge_type
        grouped = bool((virtual[1:] >= virtual[:-1]).all()) if virtual.numel() else True
        self.order: torch.Tensor | None = None
        if not grouped:
            virtual, self.order = torch.sort(virtual, stable=True)
        self.indptr = torch.zeros(n * r + 1, dtype=torch.int64, device=indptr.device)
        torch.cumsum(torch.bincount(virtual, minlength=n * r), 0, out=self.indptr[1:])

    def draw(
        self,
        frontier: torch.Tensor,
        hop: int,
        sample: Any,
        row_keys: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(counts, positions)`` of every frontier row: up to hop ``hop``'s fan-out of each
        relation, a row's relations in order. ``sample(indptr, rows, fanout, row_keys)`` is
        the homogeneous row sampler."""
        fanouts = self.layers[hop]
        r, m = self.num_relations, frontier.numel()
        counts = torch.zeros(m, dtype=torch.int64, device=frontier.device)
        picks, owners = [], []
        for rel, fanout in enumerate(fanouts):
            if fanout == 0:
                continue
            c, pos = sample(self.indptr, frontier * r + rel, fanout, row_keys * r + rel)
            counts += c
            picks.append(pos)
            owners.append(torch.repeat_interleave(
                torch.arange(m, device=frontier.device), c, output_size=pos.numel()
            ))  # fmt: skip
        if not picks:
            return counts, torch.zeros(0, dtype=torch.int64, device=frontier.device)
        pos, owner = torch.cat(picks), torch.cat(owners)
        if len(picks) > 1:  # row by row, the relations of a row in order (a stable sort)
            pos = pos.index_select(0, torch.sort(owner, stable=True).indices)
        return counts, pos if self.order is None else self.order.index_select(0, pos)


def typed_fields(
    types: GraphTypes, positions: torch.Tensor, src: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The typed fields of a block (:class:`~gnnpar.sampling.Block`): ``(edge_type,
    node_type)``, each edge's relation (edges given by CSR ``positions``) and each source's
    node type (sources by node id)."""
    edge_type = types.edge_type.index_select(0, positions)
    return edge_type, types.node_type_of(types.original_ids(src))
