"""A typed block's nodes grouped by type and its edges grouped by relation, built once per
block and shared by the typed layers (:mod:`gnnpar.models.hetero`).

- :class:`TypeGroups`: the block's source nodes grouped by node type (stable, so each
  type's destinations come first in its group: the destinations are the first sources).
  A node's *rank* is its place in its type's group; :meth:`TypeGroups.split` gives the rows
  of each type, :meth:`TypeGroups.merge` puts per-type rows back in block order (the
  per-type linears of :class:`~gnnpar.models.hetero.input.TypedInput` and of HGT).
- :class:`TypedBlock`: the groups and, per relation ``src type -> dst type``, its edges as a
  :class:`RelationCSR` whose rows are the destinations of the destination type and whose
  columns are the sources of the source type, both by rank (the compact operand of one
  mean aggregation per relation, :class:`~gnnpar.models.hetero.rgcn.RGCNConv`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from gnnpar.errors import UserError
from gnnpar.graph.typed import TypeSchema
from gnnpar.sampling.block import aggregation_operator

__all__ = ["RelationCSR", "TypeGroups", "TypedBlock", "block_node_types"]


def block_node_types(block: Any, schema: TypeSchema) -> torch.Tensor:
    """The node type of every source node of ``block``: from its original id
    (``block.keys``) by the ``schema``; one UserError when the block records other types
    (its keys are then not original ids)."""
    keys, offsets = block.keys, schema.offsets
    got = schema.node_type_of(keys)
    given = block.node_type
    if given is not None and not torch.equal(given.to(got.device), got):
        raise UserError(
            "the block's node types disagree with the types of its keys: its keys (src_keys, "
            "else src_nodes) must be the nodes' original ids"
        )
    if keys.numel() and (int(keys.min()) < 0 or int(keys.max()) >= offsets[-1]):
        raise UserError(f"the block's keys must be original ids in [0, {offsets[-1]})")
    return got


@dataclasses.dataclass(frozen=True)
class TypeGroups:
    """A block's source nodes grouped by type.

    Attributes:
        node_type: ``(num_src,)`` type index of every source node.
        num_dst: number of destinations (the first sources).
        order: ``(num_src,)`` source ids grouped by type, each group in block order.
        ptr: ``num_types + 1`` offsets of the groups in ``order``.
        dst_counts: destinations of each type (the head of its group).
        rank: ``(num_src,)`` place of every source in its type's group.
        dst_order: ``(num_dst,)`` the destinations grouped by type (each group the head of
            its type's group in ``order``).
    """

    node_type: torch.Tensor
    num_dst: int
    order: torch.Tensor
    ptr: tuple[int, ...]
    dst_counts: tuple[int, ...]
    rank: torch.Tensor
    dst_order: torch.Tensor

    @classmethod
    def build(cls, node_type: torch.Tensor, num_dst: int, num_types: int) -> TypeGroups:
        """The groups of sources of types ``node_type`` (the first ``num_dst`` being the
        destinations) among ``num_types`` types."""
        if node_type.dim() != 1 or node_type.dtype != torch.int64:
            raise UserError(f"node types must be a 1-D int64 tensor, got {node_type.dtype}")
        if node_type.numel() and (int(node_type.min()) < 0 or int(node_type.max()) >= num_types):
            raise UserError(f"node types must lie in [0, {num_types})")
        order = torch.argsort(node_type, stable=True)
        counts = torch.bincount(node_type, minlength=num_types)
        ptr = torch.zeros(num_types + 1, dtype=torch.int64, device=node_type.device)
        torch.cumsum(counts, 0, out=ptr[1:])
        rank = torch.empty_like(order)
        sorted_types = node_type.index_select(0, order)
        rank[order] = torch.arange(order.numel(), device=order.device) - ptr[sorted_types]
        dst = torch.bincount(node_type[:num_dst], minlength=num_types).tolist()
        starts = ptr.tolist()
        dst_order = torch.cat(
            [order[starts[t] : starts[t] + dst[t]] for t in range(num_types)]
        ) if num_types else order[:0]  # fmt: skip
        return cls(node_type, num_dst, order, tuple(starts), tuple(dst), rank, dst_order)

    @property
    def num_types(self) -> int:
        """Number of node types."""
        return len(self.dst_counts)

    def count(self, t: int) -> int:
        """Number of sources of type ``t``."""
        return self.ptr[t + 1] - self.ptr[t]

    @property
    def counts(self) -> list[int]:
        """Number of sources of every type (the sizes of the groups, in type order)."""
        return [self.count(t) for t in range(self.num_types)]

    def sources(self, t: int) -> torch.Tensor:
        """The sources of type ``t``, by rank."""
        return self.order[self.ptr[t] : self.ptr[t + 1]]

    def destinations(self, t: int) -> torch.Tensor:
        """The destinations of type ``t``, by rank."""
        return self.order[self.ptr[t] : self.ptr[t] + self.dst_counts[t]]

    def split(self, h: torch.Tensor, dst: bool = False) -> list[torch.Tensor]:
        """The rows of ``h`` (one per source, or per destination with ``dst``) of each type,
        by rank: one gather in type order, then views (backward scatters once, not once
        per type)."""
        if dst:
            return list(h.index_select(0, self.dst_order).split(list(self.dst_counts)))
        return list(h.index_select(0, self.order).split(self.counts))

    def merge(self, parts: Sequence[torch.Tensor], dst: bool = False) -> torch.Tensor:
        """Per-type rows (``parts[t]``: type ``t``'s sources, or destinations with ``dst``,
        by rank) in block order: the inverse of :meth:`split`."""
        sizes = self.dst_counts if dst else self.counts
        starts = torch.tensor([0, *sizes[:-1]], device=self.rank.device).cumsum(0)
        n = self.num_dst if dst else self.rank.numel()
        where = starts[self.node_type[:n]] + self.rank[:n]
        return torch.cat(list(parts)).index_select(0, where)


@dataclasses.dataclass(frozen=True)
class RelationCSR:
    """One relation's edges of a block: rows are the block's destinations of the relation's
    destination type, columns its sources of the source type (both by rank in their type's
    group). Has what :func:`~gnnpar.models.minibatch.model.block_mean` reads."""

    indptr: torch.Tensor
    indices: torch.Tensor
    num_src: int
    num_dst: int
    _operators: dict[tuple[str, torch.dtype], Any] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def num_edges(self) -> int:
        """Number of edges of the relation."""
        return int(self.indices.numel())

    def operator(self, kind: str, dtype: torch.dtype) -> Any:
        """The relation's edges as a sparse operator for the aggregation ``kind``, built on
        first use and kept (as :meth:`gnnpar.sampling.Block.operator`)."""
        shape = (self.num_dst, self.num_src)
        return aggregation_operator(self._operators, self.indptr, self.indices, shape, kind, dtype)

    def in_degrees(self) -> torch.Tensor:
        """In-degree of every row in this relation."""
        return self.indptr[1:] - self.indptr[:-1]


@dataclasses.dataclass(frozen=True)
class TypedBlock:
    """A block's :class:`TypeGroups` and its edges per relation.

    Attributes:
        block: the block.
        groups: its source nodes by type.
        ends: ``(src type, dst type)`` of every relation (``(-1, -1)`` for one that has no
            edge in the block and was not given).
        relations: one :class:`RelationCSR` per relation (None where it has no edge).
    """

    block: Any
    groups: TypeGroups
    ends: tuple[tuple[int, int], ...]
    relations: tuple[RelationCSR | None, ...]

    @classmethod
    def build(
        cls,
        block: Any,
        num_types: int,
        num_relations: int,
        ends: Sequence[tuple[int, int]] | None = None,
        node_type: torch.Tensor | None = None,
    ) -> TypedBlock:
        """Group ``block``'s nodes and edges. ``ends``: each relation's (source type,
        destination type), checked against the edges (default: read off the edges);
        ``node_type``: the sources' types (default: ``block.node_type``)."""
        node_type = block.node_type if node_type is None else node_type
        if node_type is None or block.edge_type is None:
            raise UserError(
                "a typed layer needs a typed block (edge_type and node_type): sample a typed graph"
            )
        if node_type.shape != (block.num_src,):
            raise UserError(
                f"the block has {block.num_src} sources but {node_type.numel()} node types"
            )
        etype = block.edge_type
        if etype.shape != (block.num_edges,) or etype.dtype != torch.int64:
            raise UserError(f"edge types must be int64 of shape ({block.num_edges},)")
        if etype.numel() and (int(etype.min()) < 0 or int(etype.max()) >= num_relations):
            raise UserError(f"the block's edge types must lie in [0, {num_relations})")
        if ends is not None and len(ends) != num_relations:
            raise UserError(f"ends must give {num_relations} (src, dst) type pairs")
        groups = TypeGroups.build(node_type, block.num_dst, num_types)
        order = torch.argsort(etype, stable=True)  # by relation, in CSR order within one
        counts = torch.bincount(etype, minlength=num_relations).tolist()
        src = block.indices.index_select(0, order)
        dst = block.dst_index().index_select(0, order)
        src_t, dst_t = node_type.index_select(0, src), node_type.index_select(0, dst)
        starts = [0, *itertools.accumulate(counts)]
        if ends is None:
            firsts = [starts[r] for r in range(num_relations) if counts[r]]
            found = iter(torch.stack([src_t[firsts], dst_t[firsts]], 1).tolist())
            ends = [tuple(next(found)) if counts[r] else (-1, -1) for r in range(num_relations)]
        ends = tuple((int(s), int(d)) for s, d in ends)
        want = torch.tensor(ends, dtype=torch.int64, device=etype.device).reshape(-1, 2)
        rel = etype.index_select(0, order)
        bad = (src_t != want[rel, 0]) | (dst_t != want[rel, 1])
        if bool(bad.any()):
            r = int(rel[torch.nonzero(bad)[0, 0]])
            raise UserError(
                f"the block's edges of relation {r} do not all go from node type {ends[r][0]} "
                f"to node type {ends[r][1]}"
            )
        rank = groups.rank
        relations: list[RelationCSR | None] = []
        for r in range(num_relations):
            if not counts[r]:
                relations.append(None)
                continue
            s, d = ends[r]
            lo, hi = starts[r], starts[r + 1]
            rows = rank.index_select(0, dst[lo:hi])
            indptr = torch.zeros(groups.dst_counts[d] + 1, dtype=torch.int64, device=rows.device)
            torch.cumsum(torch.bincount(rows, minlength=groups.dst_counts[d]), 0, out=indptr[1:])
            cols = rank.index_select(0, src[lo:hi])
            relations.append(RelationCSR(indptr, cols, groups.count(s), groups.dst_counts[d]))
        return cls(block, groups, ends, tuple(relations))

    @property
    def num_relations(self) -> int:
        """Number of relations."""
        return len(self.relations)

    def prepare_operators(self, kind: str, dtype: torch.dtype) -> None:
        """Build every relation's aggregation operator and its transpose now (what R-GCN's
        mean per relation multiplies by, forward and backward): in a loader's prefetch
        thread, beside the previous batch's step."""
        for rel in self.relations:
            if rel is not None:
                rel.operator(kind, dtype).T  # noqa: B018 - built and kept
