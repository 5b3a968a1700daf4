"""Plain CSR arrays: the one input type every partitioner works on.

Partitioners take many graph types (a ``gnnpar.graph.Graph``, a scipy sparse matrix, a pair of
``indptr``/``indices`` arrays) and turn them into :class:`CSR`: numpy views of the topology,
zero-copy where the input allows it, plus node data. The convention is the project's: row
``i`` lists the *in*-neighbours of node ``i`` (``A[i, j] != 0`` iff there is an edge
``j -> i``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gnnpar.arrays import to_numpy
from gnnpar.errors import UserError

__all__ = ["CSR", "as_csr", "csr_rows", "has_self_loops", "symmetrize", "to_numpy"]


def _index_array(x: Any, what: str) -> np.ndarray:
    a = to_numpy(x)
    if a.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{what} must have an integer dtype, got {a.dtype}")
    return a.astype(np.int64, copy=False)


@dataclass
class CSR:
    """A graph as CSR arrays (rows are destinations) plus node data.

    Attributes:
        indptr: ``num_nodes + 1`` int64 row offsets.
        indices: int64 source node of every edge, row by row.
        num_nodes: number of nodes.
        edge_weight: optional weight per edge, aligned with ``indices``.
        ndata: node data (numpy or torch arrays with one row per node).
        name: a label for messages and metadata.
    """

    indptr: np.ndarray
    indices: np.ndarray
    num_nodes: int
    edge_weight: np.ndarray | None = None
    ndata: dict[str, Any] = field(default_factory=dict)
    name: str = "graph"

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    def in_degrees(self) -> np.ndarray:
        return np.diff(self.indptr)

    def train_mask(self) -> np.ndarray | None:
        """``ndata['train_mask']`` as a numpy bool array, or None."""
        mask = self.ndata.get("train_mask")
        return None if mask is None else to_numpy(mask).astype(bool, copy=False)

    def check(self) -> None:
        """Raise ValueError naming the first structural problem found."""
        n = self.num_nodes
        if self.indptr.shape[0] != n + 1:
            raise ValueError(f"indptr has length {self.indptr.shape[0]}, expected {n + 1}")
        if n >= 0 and self.indptr.shape[0] and int(self.indptr[0]) != 0:
            raise ValueError(f"indptr[0] must be 0, got {int(self.indptr[0])}")
        if int(self.indptr[-1]) != self.num_edges:
            raise ValueError(
                f"indptr[-1] ({int(self.indptr[-1])}) must equal len(indices) ({self.num_edges})"
            )
        if n and np.any(np.diff(self.indptr) < 0):
            raise ValueError("indptr must be non-decreasing")
        if self.num_edges:
            lo, hi = int(self.indices.min()), int(self.indices.max())
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                raise ValueError(f"indices contain node id {bad}, outside [0, {n})")
        if self.edge_weight is not None and self.edge_weight.shape[0] != self.num_edges:
            raise ValueError(
                f"edge_weight has {self.edge_weight.shape[0]} entries but there are "
                f"{self.num_edges} edges"
            )
        for key, value in self.ndata.items():
            rows = value.shape[0] if getattr(value, "ndim", 0) else None
            if rows != n:
                raise ValueError(f"ndata[{key!r}] has {rows} rows but the graph has {n} nodes")


def as_csr(graph: Any, check: bool = False) -> CSR:
    """Turn ``graph`` into :class:`CSR` without copying the topology where possible.

    Accepted: :class:`CSR`; any object with ``indptr``, ``indices`` and ``num_nodes``
    attributes (``gnnpar.graph.Graph``; ``edge_weight``, ``ndata`` and ``name`` are used when
    present); a square scipy sparse matrix (``A[i, j]`` = edge ``j -> i``); a tuple
    ``(indptr, indices)`` or ``(indptr, indices, num_nodes)``.
    """
    if isinstance(graph, CSR):
        out = graph
    elif hasattr(graph, "indptr") and hasattr(graph, "indices") and hasattr(graph, "num_nodes"):
        if hasattr(graph, "tocsr") and hasattr(graph, "shape"):  # scipy has these too
            out = _from_scipy(graph)
        else:
            weight = getattr(graph, "edge_weight", None)
            ndata = getattr(graph, "ndata", None) or {}
            out = CSR(
                _index_array(graph.indptr, "indptr"),
                _index_array(graph.indices, "indices"),
                int(graph.num_nodes),
                None if weight is None else to_numpy(weight),
                dict(ndata) if isinstance(ndata, Mapping) else {},
                str(getattr(graph, "name", "graph")),
            )
    elif hasattr(graph, "tocsr") and hasattr(graph, "shape"):
        out = _from_scipy(graph)
    elif isinstance(graph, tuple) and len(graph) in (2, 3):
        indptr = _index_array(graph[0], "indptr")
        n = int(graph[2]) if len(graph) == 3 else indptr.shape[0] - 1
        out = CSR(indptr, _index_array(graph[1], "indices"), n)
    else:
        raise TypeError(
            "expected a gnnpar Graph, a scipy sparse matrix or a tuple (indptr, indices), got "
            f"{type(graph).__name__}"
        )
    if check:
        out.check()
    return out


def _from_scipy(mat: Any) -> CSR:
    if mat.shape[0] != mat.shape[1]:
        raise UserError(f"adjacency must be square, got shape {mat.shape}")
    csr = mat.tocsr()
    data = np.asarray(csr.data)
    weight = None if data.size == 0 or np.all(data == 1) else data
    return CSR(
        csr.indptr.astype(np.int64, copy=False),
        csr.indices.astype(np.int64, copy=False),
        int(csr.shape[0]),
        weight,
    )


def csr_rows(indptr: np.ndarray) -> np.ndarray:
    """The row (destination) of every stored entry, in CSR order."""
    n = indptr.shape[0] - 1
    return np.repeat(np.arange(n, dtype=np.int64), np.diff(indptr))


def has_self_loops(indptr: np.ndarray, indices: np.ndarray) -> bool:
    """Whether any row stores its own id (checked in chunks of rows, stopping early)."""
    n = indptr.shape[0] - 1
    step = 1 << 16
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        rows = np.repeat(np.arange(lo, hi, dtype=np.int64), np.diff(indptr[lo : hi + 1]))
        if np.any(rows == indices[int(indptr[lo]) : int(indptr[hi])]):
            return True
    return False


def symmetrize(
    indptr: np.ndarray,
    indices: np.ndarray,
    num_nodes: int,
    edge_weight: np.ndarray | None = None,
    index_dtype: type = np.int64,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The undirected simple graph of a CSR: ``A + A^T`` without self loops or duplicates.

    Returns ``(indptr, indices, weight)`` with sorted rows. ``weight`` is None when
    ``edge_weight`` is None; otherwise the weight of ``{u, v}`` is the sum of the weights of
    every stored ``u -> v`` and ``v -> u`` entry (what METIS should see as the cost of cutting
    that pair).
    """
    import scipy.sparse as sp

    # int32 ones count multiplicities without the overflow an int8 could hit.
    data = np.ones(indices.shape[0], dtype=np.int32) if edge_weight is None else edge_weight
    mat = sp.csr_matrix((data, indices, indptr), shape=(num_nodes, num_nodes))
    both = (mat + mat.T).tocsr()  # sums u->v and v->u (and duplicates)
    del mat, data
    both.sum_duplicates()
    out_ptr = both.indptr.astype(np.int64, copy=False)
    out_idx = both.indices.astype(index_dtype, copy=False)
    out_w = np.asarray(both.data)
    del both
    if has_self_loops(indptr, indices):
        keep = csr_rows(out_ptr) != out_idx
        kept = np.zeros(out_idx.shape[0] + 1, dtype=np.int64)
        np.cumsum(keep, out=kept[1:])
        out_ptr, out_idx, out_w = kept[out_ptr], out_idx[keep], out_w[keep]
    out_indptr = out_ptr.astype(index_dtype, copy=False)
    out_indices = out_idx
    weight = None if edge_weight is None else out_w
    return out_indptr, out_indices, weight
