"""Relabel nodes so every part owns a contiguous id range, and cut out one part's local CSR."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LocalPart", "Relabelling", "local_part", "relabel"]


@dataclass
class Relabelling:
    """New ids: part 0's nodes first (in original id order), then part 1's, ...

    Attributes:
        order: ``order[new] = old`` (int64, n).
        node_map: ``node_map[old] = new`` (int64, n).
        offsets: ``K + 1`` offsets; part ``k`` owns new ids ``[offsets[k], offsets[k+1])``.
    """

    order: np.ndarray
    node_map: np.ndarray
    offsets: np.ndarray


def relabel(owner: np.ndarray, num_parts: int) -> Relabelling:
    """The relabelling of a partition (a stable sort of nodes by owner)."""
    order = np.argsort(owner, kind="stable").astype(np.int64, copy=False)
    node_map = np.empty_like(order)
    node_map[order] = np.arange(order.shape[0], dtype=np.int64)
    offsets = np.zeros(num_parts + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=num_parts), out=offsets[1:])
    return Relabelling(order, node_map, offsets)


@dataclass
class LocalPart:
    """One part's topology in local ids.

    Local ids ``0 .. num_owned-1`` are the owned nodes (new ids ``start + i``); after them come
    the halo nodes in increasing new id. Row ``i < num_owned`` lists every in-neighbour of
    owned node ``i`` (with halo 1) or only the owned ones (halo 0); halo rows are empty.
    """

    indptr: np.ndarray
    indices: np.ndarray
    edge_ids: np.ndarray
    local_to_global: np.ndarray
    num_owned: int

    @property
    def num_halo(self) -> int:
        return int(self.local_to_global.shape[0]) - self.num_owned


def local_part(
    indptr: np.ndarray, indices: np.ndarray, rl: Relabelling, k: int, halo: int
) -> LocalPart:
    """Local CSR of part ``k`` with ``halo`` (0 or 1) hops of halo nodes.

    ``edge_ids`` are the positions of the local edges in the input CSR, so edge data can be
    sliced with them.
    """
    start, stop = int(rl.offsets[k]), int(rl.offsets[k + 1])
    rows = rl.order[start:stop]
    begin = indptr[rows]
    deg = indptr[rows + 1] - begin
    ptr = np.zeros(rows.shape[0] + 1, dtype=np.int64)
    np.cumsum(deg, out=ptr[1:])
    total = int(ptr[-1])
    # Position in the input CSR of the t-th gathered entry.
    pos = np.repeat(begin - ptr[:-1], deg) + np.arange(total, dtype=np.int64)
    src = rl.node_map[indices[pos]]
    inside = (src >= start) & (src < stop)
    if halo == 0:
        kept = np.zeros(total + 1, dtype=np.int64)
        np.cumsum(inside, out=kept[1:])
        ptr = kept[ptr]
        pos, src = pos[inside], src[inside]
        local = src - start
        halo_ids = np.zeros(0, dtype=np.int64)
    else:
        halo_ids = np.unique(src[~inside])
        local = np.where(inside, src - start, 0)
        outside = ~inside
        local[outside] = (stop - start) + np.searchsorted(halo_ids, src[outside])
        # Halo rows are empty: repeat the last offset once per halo node.
        ptr = np.concatenate([ptr, np.full(halo_ids.shape[0], ptr[-1], dtype=np.int64)])
    local_to_global = np.concatenate([np.arange(start, stop, dtype=np.int64), halo_ids])
    return LocalPart(ptr, local.astype(np.int64, copy=False), pos, local_to_global, stop - start)
