"""Typed (heterogeneous) graphs in partitions: node types of an input, per-type balance.

A typed graph (:mod:`gnnpar.graph.typed`) is partitioned through its **homogeneous view**:
every method assigns the view's nodes as for any graph (none of them needs an edge
transform, which a typed graph refuses). What the types add:

- **balance** ``"types"`` (DistDGL's ``balance_ntypes`` over node types, plus the training
  nodes): every node type's nodes, and the target type's training nodes
  (``ndata["train_mask"]``), spread evenly over the parts. It is the default for a typed
  graph. METIS gets one vertex-weight constraint per node type plus one for the training
  nodes (:func:`type_columns`); ``random`` deals every class of node (each type, the target
  type split into training and other nodes) out on its own and ``range`` cuts every type's
  id range into K blocks; then, after any method, :func:`rebalance` moves the fewest nodes
  (those with the fewest neighbours in their part and the most in the part they go to)
  until every class's count per part is at most ``ceil(tolerance * mean)``, ``tolerance =
  1.05``.
- **typed parts**: the writer stores each part's ``types/edge_type.npy`` and the schema in
  the manifest's meta (:mod:`partitioners.format`).

:func:`typed_input` finds the types of whatever the partitioners accept: a
``gnnpar.graph.Graph`` with :attr:`~gnnpar.graph.Graph.types`, a graph folder (its
manifest's ``types`` table and ``types/*.npy``) or a
:class:`~gnnpar.data.chunked.GraphReader` of either; None for an untyped input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gnnpar.errors import UserError
from partitioners.csr import to_numpy

__all__ = [
    "TOLERANCE",
    "TypedInput",
    "EdgeChunks",
    "class_caps",
    "csr_edges",
    "node_classes",
    "rebalance",
    "type_columns",
    "typed_input",
]

#: Allowed imbalance of every node type (and the training nodes): at most
#: ``ceil(TOLERANCE * mean)`` of them in any part.
TOLERANCE = 1.05


@dataclass
class TypedInput:
    """The types of a partitioner input.

    Attributes:
        meta: the schema, :meth:`GraphTypes.meta() <gnnpar.graph.typed.GraphTypes.meta>`
            (``node_types``, ``offsets``, ``relations``, ``feat_dims``, ``target``).
        node_type: ``(num_nodes,)`` int64 type index of every node of the input.
        node_ids: ``(num_nodes,)`` int64 original id (in the types' id space) of every node
            of a relabelled typed graph (a permutation, a subgraph), or None where node
            ``v`` is original id ``v``.
        edge_type: the relation index of the edges at CSR positions (an array or a slice).
    """

    meta: dict[str, Any]
    node_type: np.ndarray
    node_ids: np.ndarray | None
    edge_type: Callable[[Any], np.ndarray]

    @property
    def node_types(self) -> list[str]:
        """The node type names, in id order."""
        return list(self.meta["node_types"])

    @property
    def relation_names(self) -> list[str]:
        """``src___rel___dst`` of every relation, in relation-index order."""
        return ["___".join(r) for r in self.meta["relations"]]

    @property
    def num_types(self) -> int:
        """Number of node types."""
        return len(self.meta["node_types"])

    @property
    def num_relations(self) -> int:
        """Number of relations."""
        return len(self.meta["relations"])

    @property
    def target_index(self) -> int | None:
        """Index of the target node type, or None."""
        target = self.meta.get("target")
        return None if target is None else self.node_types.index(target)


def node_type_of(offsets: Any, original: np.ndarray) -> np.ndarray:
    """Type index of each node given by its original id (the numpy twin, torch being
    optional here, of :meth:`gnnpar.graph.typed.TypeSchema.node_type_of`)."""
    bounds = np.asarray(list(offsets)[1:-1], dtype=np.int64)
    return np.searchsorted(bounds, original, side="right").astype(np.int64)


def _from_types(types: Any, num_nodes: int) -> TypedInput:
    ids = None if types.node_ids is None else to_numpy(types.node_ids).astype(np.int64)
    original = np.arange(num_nodes, dtype=np.int64) if ids is None else ids
    edge_type = to_numpy(types.edge_type).astype(np.int64, copy=False)
    return TypedInput(
        types.meta(), node_type_of(types.offsets, original), ids, edge_type.__getitem__
    )


def _from_folder(folder: str | Path, verify: str) -> TypedInput | None:
    from gnnpar.data.storage import read_manifest_of
    from gnnpar.verified import load_npy

    manifest = read_manifest_of(folder)
    meta = manifest.meta.get("types")
    if meta is None:
        return None
    if not isinstance(meta, dict) or "offsets" not in meta:
        raise UserError(f"{manifest.folder}: meta field 'types' is malformed")
    n, m = int(manifest.meta["num_nodes"]), int(manifest.meta["num_edges"])
    edge_type = load_npy(manifest, "types/edge_type.npy", verify, True, "int64", (m,))
    ids = None
    if "types/node_ids.npy" in manifest.files:
        ids = np.array(load_npy(manifest, "types/node_ids.npy", verify, True, "int64", (n,)))
    original = np.arange(n, dtype=np.int64) if ids is None else ids
    return TypedInput(
        dict(meta), node_type_of(meta["offsets"], original), ids, edge_type.__getitem__
    )


def typed_input(graph: Any, verify: str = "size") -> TypedInput | None:
    """The types of a partitioner input (see the module docstring), or None.

    ``verify`` is how a graph folder's type arrays are checked against its manifest
    (``"checksum"``, ``"size"`` or ``"none"``)."""
    if isinstance(graph, (str, Path)):
        return _from_folder(graph, verify)
    from gnnpar.data.chunked import GraphReader

    if isinstance(graph, GraphReader):
        # a reader wraps a Graph in memory or a graph folder (it exposes neither publicly)
        inner = getattr(graph, "_graph", None)
        if inner is not None:
            return typed_input(inner, verify)
        folder = getattr(graph, "_folder", None)
        return None if folder is None else _from_folder(folder, "none")  # checked when opened
    types = getattr(graph, "types", None)
    if types is None:
        return None
    return _from_types(types, int(graph.num_nodes))


# ---------------------------------------------------------------------- classes and caps


def node_classes(
    typed: TypedInput, train: np.ndarray | None
) -> tuple[np.ndarray, list[str], int | None]:
    """``(node_class, names, train_class)``: every node's balance class.

    Class ``t < T`` is node type ``t``, except that the target type's training nodes form
    class ``T`` (``train_class``; None without training nodes). The classes are disjoint,
    so one node moving changes one class's counts."""
    cls = typed.node_type.copy()
    names = [f"type:{t}" for t in typed.node_types]
    target = typed.target_index
    if train is None or target is None or not train.any():
        return cls, names, None
    cls[train & (cls == target)] = typed.num_types
    return cls, [*names, f"train:{typed.node_types[target]}"], typed.num_types


def class_caps(counts: np.ndarray, num_parts: int, tolerance: float = TOLERANCE) -> np.ndarray:
    """The most nodes of a class a part may hold: ``ceil(tolerance * count / num_parts)``."""
    # a tiny epsilon keeps an exact product (1.05 * 40 = 42.00000000000001) from rounding up
    return np.ceil(tolerance * np.asarray(counts, dtype=np.float64) / num_parts - 1e-9).astype(
        np.int64
    )


def type_columns(typed: TypedInput, train: np.ndarray | None) -> tuple[list[np.ndarray], list[str]]:
    """METIS vertex-weight columns for balance ``"types"``: one 0/1 column per node type,
    and one for the target type's training nodes (when there are any)."""
    cols = [(typed.node_type == t).astype(np.int64) for t in range(typed.num_types)]
    names = [f"type:{t}" for t in typed.node_types]
    target = typed.target_index
    if train is not None and target is not None and train.any():
        cols.append((train & (typed.node_type == target)).astype(np.int64))
        names.append(f"train:{typed.node_types[target]}")
    return cols, names


# ---------------------------------------------------------------------- rebalancing


#: Edges in chunks: a function returning a fresh iterator of ``(destinations, sources)``.
EdgeChunks = Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]


def csr_edges(
    indptr: np.ndarray,
    indices: np.ndarray | None = None,
    read: Callable[[Any], np.ndarray] | None = None,
    chunk_edges: int = 1 << 22,
) -> EdgeChunks:
    """The edges of a CSR as :data:`EdgeChunks` of at most ``chunk_edges`` edges; the
    sources come from ``indices`` or, for a graph on disk, ``read`` (positions to sources,
    e.g. :meth:`gnnpar.data.chunked.GraphReader.indices`)."""
    total = int(indptr[-1]) if indptr.shape[0] else 0
    take = read if read is not None else indices.__getitem__  # type: ignore[union-attr]

    def chunks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for lo in range(0, total, chunk_edges):
            hi = min(lo + chunk_edges, total)
            dst = np.searchsorted(indptr, np.arange(lo, hi, dtype=np.int64), side="right") - 1
            yield dst.astype(np.int64, copy=False), np.asarray(take(slice(lo, hi)), np.int64)

    return chunks


def _neighbour_parts(
    cand: np.ndarray, owner: np.ndarray, num_parts: int, edges: EdgeChunks
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(candidate position, part, count)``: how many neighbours (in- and out-) each
    candidate has in each part, as unique sparse triples, one pass over the edges."""
    n = owner.shape[0]
    pos_of = np.full(n, -1, dtype=np.int64)
    pos_of[cand] = np.arange(cand.shape[0], dtype=np.int64)
    keys = []
    for dst, src in edges():
        into = pos_of[dst]  # the edge's destination is a candidate: its source's part counts
        outof = pos_of[src]  # its source is a candidate: its destination's part counts
        a, b = into >= 0, outof >= 0
        keys.append(into[a] * num_parts + owner[src[a]])
        keys.append(outof[b] * num_parts + owner[dst[b]])
    if not keys:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    unique, counts = np.unique(np.concatenate(keys), return_counts=True)
    return unique // num_parts, unique % num_parts, counts.astype(np.int64)


def _spread(
    owner: np.ndarray,
    num_parts: int,
    members: np.ndarray,
    movable: np.ndarray,
    cap: int,
    room_cap: np.ndarray | None,
    edges: EdgeChunks | None,
) -> int:
    """Move ``movable`` nodes out of the parts holding more than ``cap`` ``members`` into
    parts below it (and, where ``room_cap`` is given, with room under it too); returns how
    many moved. Each over-full part sends exactly its surplus (or what fits), choosing the
    nodes that lose the fewest internal neighbours and gain the most in a receiving part;
    each goes to its best receiver with room, the rest are dealt to the others."""
    k = num_parts
    counts = np.bincount(owner[members], minlength=k)
    surplus = np.maximum(counts - cap, 0)
    room = np.maximum(cap - counts, 0)
    if room_cap is not None:
        room = np.minimum(room, np.maximum(room_cap, 0))
    total = min(int(surplus.sum()), int(room.sum()))
    if total == 0:
        return 0
    cand = np.flatnonzero(movable & (surplus[owner] > 0))
    internal = np.zeros(cand.shape[0], dtype=np.int64)
    best = np.full(cand.shape[0], -1, dtype=np.int64)
    best_count = np.zeros(cand.shape[0], dtype=np.int64)
    if edges is not None and cand.size:
        who, part, num = _neighbour_parts(cand, owner, k, edges)
        own = part == owner[cand[who]]
        internal[who[own]] = num[own]
        ok = ~own & (room[part] > 0)
        w, p, c = who[ok], part[ok], num[ok]
        if w.size:  # per candidate the receiver with the most neighbours (ties: lowest id)
            order = np.lexsort((p, -c, w))
            w, p, c = w[order], p[order], c[order]
            first = np.ones(w.shape[0], dtype=bool)
            first[1:] = w[1:] != w[:-1]
            best[w[first]] = p[first]
            best_count[w[first]] = c[first]
    gain = best_count - internal
    src = owner[cand]
    # per over-full part, its surplus of candidates, the best gains first (ties: lowest id)
    order = np.lexsort((cand, -gain, src))
    cand, gain, src, best = cand[order], gain[order], src[order], best[order]
    starts = np.searchsorted(src, np.arange(k), side="left")
    rank = np.arange(cand.shape[0]) - starts[src]
    pick = rank < surplus[src]
    cand, gain, best = cand[pick], gain[pick], best[pick]
    # at most the room there is: the best gains overall
    if cand.shape[0] > total:
        keep = np.sort(np.lexsort((cand, -gain))[:total])
        cand, gain, best = cand[keep], gain[keep], best[keep]
    dest = np.full(cand.shape[0], -1, dtype=np.int64)
    # each to its best receiver while that has room, the best gains first
    wants = np.flatnonzero(best >= 0)
    order = wants[np.lexsort((cand[wants], -gain[wants], best[wants]))]
    b = best[order]
    starts = np.searchsorted(b, np.arange(k), side="left")
    ok = np.arange(order.shape[0]) - starts[b] < room[b]
    dest[order[ok]] = b[ok]
    room = room - np.bincount(b[ok], minlength=k)
    # the rest dealt to the receivers' remaining room, emptiest receivers first
    rest = np.flatnonzero(dest < 0)
    if rest.size:
        by_room = np.argsort(-room, kind="stable")
        slots = np.repeat(by_room, room[by_room])
        # interleave: one slot from each receiver in turn, so the rest spread out
        turn = np.concatenate([np.arange(r) for r in room[by_room]]) if slots.size else slots
        slots = slots[np.argsort(turn, kind="stable")]
        dest[rest] = slots[: rest.shape[0]]
    owner[cand] = dest
    return int(cand.shape[0])


def rebalance(
    owner: np.ndarray,
    num_parts: int,
    node_class: np.ndarray,
    train_class: int | None = None,
    target_type: int | None = None,
    edges: EdgeChunks | None = None,
    tolerance: float = TOLERANCE,
) -> int:
    """Move the fewest nodes so that every class holds at most ``ceil(tolerance * mean)``
    nodes in any part; changes ``owner`` in place and returns how many nodes moved.

    ``node_class`` is :func:`node_classes`' (disjoint classes); the training class
    ``train_class`` is part of the node type ``target_type``, whose cap covers both. The
    training nodes are spread first (into parts with room for the target type, where
    possible), then every type, moving only nodes outside the training class, so no class
    is unbalanced again. With ``edges`` (:func:`csr_edges`; one pass over them for every
    class that must move nodes) the nodes that move are those with the fewest neighbours
    in their part and the most in the part they go to; without, the lowest ids.

    Every class ends within its cap: a part over its type's cap but within its training
    cap always holds a non-training node of the type to move, and the parts under a cap
    have room for every surplus.
    """
    k = num_parts
    if k <= 1 or owner.size == 0:
        return 0
    num_classes = int(node_class.max()) + 1
    counts = np.bincount(node_class, minlength=num_classes)
    moved = 0
    is_train = None
    if train_class is not None and target_type is not None:
        is_train = node_class == train_class
        members = is_train
        target = is_train | (node_class == target_type)
        target_cap = int(class_caps([int(target.sum())], k, tolerance)[0])
        cap = int(class_caps([counts[train_class]], k, tolerance)[0])
        # first into parts with room for the target type too, then anywhere under the cap
        room = target_cap - np.bincount(owner[target], minlength=k)
        moved += _spread(owner, k, members, members, cap, room, edges)
        moved += _spread(owner, k, members, members, cap, None, edges)
    for c in range(num_classes):
        if c == train_class:
            continue
        members = node_class == c
        movable = members
        if c == target_type and is_train is not None:
            members = members | is_train  # the type's cap counts its training nodes too
        total = int(members.sum())
        if total == 0:
            continue
        cap = int(class_caps([total], k, tolerance)[0])
        moved += _spread(owner, k, members, movable, cap, None, edges)
    return moved


def class_balance(
    owner: np.ndarray, num_parts: int, node_class: np.ndarray, num_classes: int
) -> np.ndarray:
    """``(num_classes, num_parts)`` node counts of every class in every part."""
    keys = node_class.astype(np.int64) * num_parts + owner
    return np.bincount(keys, minlength=num_classes * num_parts).reshape(num_classes, num_parts)
