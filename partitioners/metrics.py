"""How good a partition is: edge cut, balance, replication, communication, time and memory.

Definitions (K parts, edges are the stored CSR entries ``j -> i``):

- **edge cut**: edges whose endpoints have different owners; ``edge_cut_fraction`` divides
  by all edges. For a symmetric graph every undirected edge is stored, and counted, twice;
  the fraction is the same either way.
- **balance** of a quantity: max over parts / mean over parts (1.0 is perfect), for nodes,
  edges (in-edges of the owned nodes: the aggregation work) and training nodes.
- **halo** of part ``k``: the nodes outside ``k`` with an edge into ``k`` (1-hop halo).
  ``replication_factor`` = (owned + halo nodes over all parts) / n; ``halo_fraction`` =
  halo nodes / local nodes over all parts; ``max_halo_fraction`` the largest per part.
- **comm_bytes**: feature bytes a 1-hop aggregation moves: every part fetches the feature row
  of each of its halo nodes once (total halo nodes x bytes per row); ``max_comm_bytes`` is
  the largest part's share (the one everybody waits for).
- **time_s** and **peak_bytes**: measured by :func:`measure` around the partitioning.

For a typed graph (:mod:`gnnpar.graph.typed`) two more:

- **relation_cut**: per relation (``src___rel___dst``), its ``edges``, the ``cut`` ones
  (endpoints in different parts) and their ``fraction`` of the relation's edges.
- **type_balance**: per node type ``type:<name>``, the max over mean of its nodes per part;
  and ``train:<target>``, that of the target type's training nodes (``train_balance``
  too, since only target nodes train).
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gnnpar.errors import UserError
from partitioners.assignment import Partition
from partitioners.csr import as_csr, to_numpy

__all__ = [
    "Measurement",
    "Quality",
    "balance",
    "edge_cut",
    "format_table",
    "halo_counts",
    "measure",
    "quality",
    "relation_cut",
    "type_balance",
]


def edge_cut(indptr: np.ndarray, indices: np.ndarray, owner: np.ndarray) -> tuple[int, float]:
    """``(count, fraction)`` of stored edges whose endpoints lie in different parts."""
    total = int(indices.shape[0])
    if total == 0:
        return 0, 0.0
    cut = int(np.count_nonzero(np.repeat(owner, np.diff(indptr)) != owner[indices]))
    return cut, cut / total


def balance(values: np.ndarray) -> float:
    """Max over mean of per-part totals (1.0 for an all-zero quantity)."""
    values = np.asarray(values, dtype=np.float64)
    mean = float(values.mean()) if values.size else 0.0
    return float(values.max()) / mean if mean > 0 else 1.0


def halo_counts(
    indptr: np.ndarray, indices: np.ndarray, owner: np.ndarray, num_parts: int
) -> np.ndarray:
    """Number of 1-hop halo nodes of every part (distinct outside sources of its in-edges)."""
    n = owner.shape[0]
    if indices.shape[0] == 0:
        return np.zeros(num_parts, dtype=np.int64)
    dst_part = np.repeat(owner, np.diff(indptr))
    cross = dst_part != owner[indices]
    keys = np.unique(dst_part[cross] * n + indices[cross])
    return np.bincount(keys // n, minlength=num_parts).astype(np.int64)


def relation_cut(
    indptr: np.ndarray,
    indices: np.ndarray,
    owner: np.ndarray,
    edge_type: np.ndarray,
    num_relations: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``(cut, total)``, each ``(num_relations,)``: the edges of every relation whose
    endpoints lie in different parts, and all its edges (``edge_type`` aligned with
    ``indices``)."""
    edge_type = np.asarray(edge_type, dtype=np.int64)
    total = np.bincount(edge_type, minlength=num_relations)
    if indices.shape[0] == 0:
        return np.zeros(num_relations, dtype=np.int64), total
    cross = np.repeat(owner, np.diff(indptr)) != owner[indices]
    return np.bincount(edge_type[cross], minlength=num_relations), total


def type_balance(
    owner: np.ndarray, node_type: np.ndarray, num_types: int, num_parts: int
) -> np.ndarray:
    """``(num_types,)`` max over mean of every node type's nodes per part."""
    keys = np.asarray(node_type, dtype=np.int64) * num_parts + owner
    counts = np.bincount(keys, minlength=num_types * num_parts).reshape(num_types, num_parts)
    return np.array([balance(row) for row in counts])


@dataclass
class Quality:
    """Quality of one partition (see the module docstring for the definitions)."""

    method: str
    num_parts: int
    num_nodes: int
    num_edges: int
    edge_cut: int
    edge_cut_fraction: float
    node_balance: float
    edge_balance: float
    train_balance: float | None
    replication_factor: float
    halo_fraction: float
    max_halo_fraction: float
    comm_bytes: int
    max_comm_bytes: int
    time_s: float | None = None
    peak_bytes: int | None = None
    relation_cut: dict[str, dict[str, Any]] | None = None
    type_balance: dict[str, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _row_bytes(feat: Any) -> int:
    if feat is None:
        return 0
    shape = tuple(getattr(feat, "shape", ()))
    itemsize = getattr(feat, "itemsize", None) or to_numpy(feat).itemsize
    return int(np.prod(shape[1:], dtype=np.int64)) * int(itemsize)


def quality(
    graph: Any,
    part: Partition,
    feature_bytes: int | None = None,
    time_s: float | None = None,
    peak_bytes: int | None = None,
) -> Quality:
    """Every metric of ``part`` on ``graph``.

    ``feature_bytes`` is the size of one node's feature row; by default it is taken from
    ``ndata['feat']`` (0 when there are no features). A typed graph also gets its
    per-relation edge cut and per-type balance (the module docstring).
    """
    csr = as_csr(graph)
    owner, k = part.owner, part.num_parts
    if owner.shape[0] != csr.num_nodes:
        raise UserError(f"partition covers {owner.shape[0]} nodes, graph has {csr.num_nodes}")
    cut, frac = edge_cut(csr.indptr, csr.indices, owner)
    sizes = np.bincount(owner, minlength=k)
    edges = np.bincount(owner, weights=np.diff(csr.indptr), minlength=k)
    mask = csr.train_mask()
    train = None if mask is None else balance(np.bincount(owner[mask], minlength=k))
    halo = halo_counts(csr.indptr, csr.indices, owner, k)
    local = sizes + halo
    n = max(csr.num_nodes, 1)
    row = _row_bytes(csr.ndata.get("feat")) if feature_bytes is None else int(feature_bytes)
    return Quality(
        method=part.method,
        num_parts=k,
        num_nodes=csr.num_nodes,
        num_edges=csr.num_edges,
        edge_cut=cut,
        edge_cut_fraction=frac,
        node_balance=balance(sizes),
        edge_balance=balance(edges),
        train_balance=train,
        replication_factor=float(local.sum()) / n,
        halo_fraction=float(halo.sum()) / max(float(local.sum()), 1.0),
        max_halo_fraction=float((halo / np.maximum(local, 1)).max()) if k else 0.0,
        comm_bytes=int(halo.sum()) * row,
        max_comm_bytes=int(halo.max()) * row if k else 0,
        time_s=time_s if time_s is not None else part.info.get("time_s"),
        peak_bytes=peak_bytes,
        **_typed_quality(graph, csr, owner, k, mask),
    )


def _typed_quality(
    graph: Any, csr: Any, owner: np.ndarray, k: int, mask: np.ndarray | None
) -> dict[str, Any]:
    """``relation_cut`` and ``type_balance`` of a typed graph; nothing for an untyped one."""
    from partitioners.typed import typed_input

    typed = typed_input(graph)
    if typed is None:
        return {}
    cut, total = relation_cut(
        csr.indptr, csr.indices, owner, typed.edge_type(slice(None)), typed.num_relations
    )
    relations = {
        name: {"edges": int(m), "cut": int(c), "fraction": float(c) / int(m) if m else 0.0}
        for name, c, m in zip(typed.relation_names, cut, total, strict=True)
    }
    spread = type_balance(owner, typed.node_type, typed.num_types, k)
    types = {f"type:{t}": float(b) for t, b in zip(typed.node_types, spread, strict=True)}
    target = typed.target_index
    if mask is not None and target is not None and mask.any():
        train = mask & (typed.node_type == target)
        types[f"train:{typed.node_types[target]}"] = balance(np.bincount(owner[train], minlength=k))
    return {"relation_cut": relations, "type_balance": types}


# ---------------------------------------------------------------------- time and memory


@dataclass
class Measurement:
    """Filled in by :func:`measure` when its block ends."""

    time_s: float = 0.0
    peak_bytes: int = 0
    source: str = ""


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@contextmanager
def measure() -> Iterator[Measurement]:
    """Wall time and peak extra memory of the block it wraps.

    On Linux, peak memory is the process's resident-set high-water mark during the block
    minus its resident set at the start (``source == "rss"``), so memory allocated by C
    libraries (METIS, DGL) counts. Elsewhere it falls back to ``tracemalloc``, which sees
    only Python and numpy allocations (``source == "tracemalloc"``). Peak RSS is a
    process-wide quantity: measure one thing at a time, ideally in a fresh process.
    """
    m = Measurement()
    use_rss = _reset_peak_rss() and _status_kib("VmHWM") is not None
    start_rss = _status_kib("VmRSS") if use_rss else None
    started_trace = False
    if not use_rss and not tracemalloc.is_tracing():
        tracemalloc.start()
        started_trace = True
    if not use_rss:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
    t0 = time.perf_counter()
    try:
        yield m
    finally:
        m.time_s = time.perf_counter() - t0
        if use_rss:
            peak = _status_kib("VmHWM") or 0
            m.peak_bytes = max(0, peak - (start_rss or 0)) * 1024
            m.source = "rss"
        else:
            _, peak = tracemalloc.get_traced_memory()
            m.peak_bytes = max(0, peak - base)
            m.source = "tracemalloc"
            if started_trace:
                tracemalloc.stop()


# ---------------------------------------------------------------------- tables


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def format_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A plain-text table (first column left-aligned, the rest right-aligned)."""
    if not rows:
        return ""
    columns = columns or list(rows[0])
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]

    def line(values: list[str]) -> str:
        first = values[0].ljust(widths[0])
        rest = [v.rjust(w) for v, w in zip(values[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest])

    out = [line(columns), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def human_bytes(n: float | None) -> str:
    """``1536 -> '1.5 KiB'``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
