"""`partition()`: one entry point for every method, and the `Partition` it returns."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gnnpar.errors import UserError
from partitioners.csr import CSR, as_csr
from partitioners.metis import BALANCE_NAMES, metis_owner
from partitioners.simple import (
    hash_owner,
    random_owner,
    random_owner_by_class,
    range_owner,
    range_owner_by_class,
)
from partitioners.streaming import streaming_owner
from partitioners.typed import (
    TOLERANCE,
    EdgeChunks,
    TypedInput,
    class_balance,
    csr_edges,
    node_classes,
    rebalance,
    type_columns,
    typed_input,
)

__all__ = ["METHODS", "Partition", "check_num_parts", "partition", "supported_balance"]

METHODS = ("random", "range", "hash", "metis", "ldg", "fennel")
_STREAM_OPTIONS = ("order", "passes", "slack", "gamma", "alpha", "chunk_edges")
_BALANCES = {"metis": BALANCE_NAMES, "range": ("nodes", "edges", "types")}
_OPTIONS = {
    "metis": ("node_weight", "edge_weight", "ufactor", "niter", "ncuts", "recursive"),
    "ldg": _STREAM_OPTIONS,
    "fennel": _STREAM_OPTIONS,
}


def _is_reader(graph: Any) -> bool:
    from gnnpar.data.chunked import GraphReader

    return isinstance(graph, GraphReader)


def _folder_input(folder: str | Path, method: str) -> Any:
    """A graph folder as partitioner input: for LDG/Fennel a
    :class:`~gnnpar.data.chunked.GraphReader`, whose edges are read from disk in chunks
    (only ``indptr`` in memory); for the other methods the graph itself (memory-mapped;
    METIS copies it into memory)."""
    from gnnpar.data.chunked import GraphReader

    if method in ("ldg", "fennel"):
        return GraphReader(folder, verify="size")
    from gnnpar.data.storage import load_graph

    return load_graph(folder, verify="size")


@dataclass
class Partition:
    """An assignment of every node to one of ``num_parts`` parts.

    Attributes:
        owner: int64 array, ``owner[v]`` is the part of node ``v`` (original ids).
        num_parts: K.
        method, seed, balance: how it was made.
        info: what the method knows about its result (e.g. METIS's ``edge_cut`` objective,
            a streaming method's capacity) plus ``time_s``, the wall time of the method.
    """

    owner: np.ndarray
    num_parts: int
    method: str = "custom"
    seed: int = 0
    balance: tuple[str, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return int(self.owner.shape[0])

    def sizes(self) -> np.ndarray:
        """Number of nodes in every part."""
        return np.bincount(self.owner, minlength=self.num_parts)

    def nodes(self, k: int) -> np.ndarray:
        """Ids of the nodes of part ``k``, increasing."""
        return np.flatnonzero(self.owner == k)

    def validate(self) -> None:
        """Raise ValueError unless every node has exactly one part in ``[0, K)`` and no
        part is empty (when there are at least K nodes)."""
        owner, k, n = self.owner, self.num_parts, self.num_nodes
        if owner.ndim != 1 or not np.issubdtype(owner.dtype, np.integer):
            raise ValueError(f"owner must be a 1-D integer array, got {owner.dtype} {owner.shape}")
        if n and (int(owner.min()) < 0 or int(owner.max()) >= k):
            bad = int(owner.min()) if int(owner.min()) < 0 else int(owner.max())
            raise ValueError(f"owner holds part {bad}, outside [0, {k})")
        empty = np.flatnonzero(self.sizes() == 0)
        if n >= k and empty.size:
            raise UserError(f"{empty.size} of {k} parts are empty (first: part {int(empty[0])})")


def supported_balance(method: str) -> tuple[str, ...]:
    """The balance names ``method`` can honour."""
    return _BALANCES.get(method, ("nodes", "types"))


def check_num_parts(num_parts: Any, num_nodes: int) -> int:
    """``num_parts`` as an int, or ValueError if it is not in ``[1, num_nodes]``."""
    if isinstance(num_parts, bool) or not isinstance(num_parts, (int, np.integer)):
        raise UserError(f"num_parts must be an integer, got {num_parts!r}")
    k = int(num_parts)
    if k < 1:
        raise UserError(f"num_parts must be >= 1, got {k}")
    if k > num_nodes:
        raise UserError(
            f"cannot split {num_nodes} nodes into {k} parts: num_parts must be <= num_nodes"
        )
    return k


def _fill_empty(owner: np.ndarray, num_parts: int) -> int:
    """Give every empty part one node taken from the largest part; returns how many moved.

    Only a safety net: the balanced methods never leave a part empty when n >= K, but a hash
    or a cut-driven method can on tiny or disconnected graphs.
    """
    sizes = np.bincount(owner, minlength=num_parts)
    moved = 0
    for k in np.flatnonzero(sizes == 0):
        donor = int(np.argmax(sizes))
        v = int(np.flatnonzero(owner == donor)[-1])
        owner[v] = k
        sizes[donor] -= 1
        sizes[k] += 1
        moved += 1
    return moved


def _normalise_balance(balance: str | Sequence[str] | None, typed: bool) -> tuple[str, ...]:
    """The balance names asked for: ``"types"`` by default for a typed graph, else
    ``"nodes"``."""
    default = ("types",) if typed else ("nodes",)
    if balance is None:
        return default
    items = (balance,) if isinstance(balance, str) else tuple(balance)
    unknown = [b for b in items if b not in BALANCE_NAMES]
    if unknown:
        raise UserError(f"unknown balance {unknown}; choose from {BALANCE_NAMES}")
    if "types" in items and not typed:
        raise UserError(
            "balance 'types' needs a typed graph (gnnpar.graph.typed: graph.types); this one "
            "has no node types"
        )
    return items or default


def _train_mask(graph: Any, csr: CSR) -> np.ndarray | None:
    """The training mask of the input (a reader's is read from disk), or None."""
    if _is_reader(graph):
        if "train_mask" not in graph.ndata_keys():
            return None
        return graph.ndata("train_mask", slice(None)).astype(bool)
    return csr.train_mask()


def _balance_types(
    owner: np.ndarray,
    k: int,
    typed: TypedInput,
    train: np.ndarray | None,
    edges: EdgeChunks,
    tolerance: float,
) -> dict[str, Any]:
    """:func:`~partitioners.typed.rebalance` ``owner`` in place; what to record of it."""
    classes, names, train_class = node_classes(typed, train)
    moved = rebalance(owner, k, classes, train_class, typed.target_index, edges, tolerance)
    counts = class_balance(owner, k, typed.node_type, typed.num_types)
    spread = {
        f"type:{name}": _max_over_mean(row)
        for name, row in zip(typed.node_types, counts, strict=True)
    }
    if train_class is not None:
        target = typed.node_types[typed.target_index]
        train_counts = np.bincount(owner[classes == train_class], minlength=k)
        spread[f"train:{target}"] = _max_over_mean(train_counts)
    return {"tolerance": tolerance, "classes": names, "moved": moved, "max_over_mean": spread}


def _max_over_mean(counts: np.ndarray) -> float:
    mean = float(np.mean(counts)) if counts.size else 0.0
    return float(np.max(counts)) / mean if mean > 0 else 1.0


def partition(
    graph: Any,
    num_parts: int,
    method: str = "metis",
    seed: int = 0,
    balance: str | Sequence[str] | None = None,
    progress: bool = False,
    type_tolerance: float = TOLERANCE,
    **options: Any,
) -> Partition:
    """Assign every node of ``graph`` to one of ``num_parts`` parts.

    Args:
        graph: a ``gnnpar.graph.Graph``, scipy sparse matrix, ``(indptr, indices)`` tuple or
            :class:`~partitioners.csr.CSR` (rows are destinations).
        num_parts: K, between 1 and the number of nodes.
        method: ``"random"`` (balanced random), ``"range"`` (contiguous id blocks),
            ``"hash"``, ``"metis"`` (edge-cut METIS), ``"ldg"`` or ``"fennel"`` (one-pass
            streaming).
        seed: every method is deterministic for a given seed.
        balance: what to keep balanced, any of ``"nodes"`` (default), ``"train"`` (training
            nodes, from ``ndata['train_mask']``) and ``"edges"`` (in-edges). METIS honours all
            three as constraints (DGL's ``balance_ntypes`` / ``balance_edges``); ``range``
            honours ``"edges"`` by cutting at equal edge counts; the others balance nodes
            only and refuse the other names. ``"types"`` (a typed graph only, and its
            default; every method) balances every node type and the target type's training
            nodes (:mod:`partitioners.typed`): METIS as constraints, ``random`` and
            ``range`` by dealing out or cutting each type on its own, and after any method
            a rebalancing that moves the fewest nodes, reported in ``info["types"]``
            (``moved``, and ``max_over_mean`` of every type and of the training nodes).
        progress: show a progress bar for the long-running methods.
        type_tolerance: with ``"types"``, the most nodes of a type (or training nodes) a
            part may hold is ``ceil(type_tolerance * mean)``.
        **options: passed to the method: for ``metis`` ``node_weight``, ``edge_weight``,
            ``ufactor``, ``niter``, ``ncuts``, ``recursive``
            (:func:`~partitioners.metis.metis_owner`); for ``ldg``/``fennel`` ``order``,
            ``passes``, ``slack``, ``gamma``, ``alpha``
            (:func:`~partitioners.streaming.streaming_owner`).

    Returns:
        A validated :class:`Partition`.

    Raises:
        ValueError: for an unknown method or balance, or ``num_parts`` outside
            ``[1, num_nodes]``.
    """
    if method not in METHODS:
        raise UserError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    if isinstance(graph, (str, Path)):
        graph = _folder_input(graph, method)
    if _is_reader(graph):  # a graph folder for LDG/Fennel: edges read from disk in chunks
        csr = CSR(graph.indptr, np.zeros(0, dtype=np.int64), graph.num_nodes, name=graph.name)
        read = graph.indices
    else:
        csr = as_csr(graph, check=True)  # METIS would crash on ids out of range
        read = None
    # a typed graph is partitioned through its homogeneous view (the CSR above)
    typed = typed_input(graph)
    n = csr.num_nodes
    k = check_num_parts(num_parts, n)
    bal = _normalise_balance(balance, typed is not None)
    supported = supported_balance(method)
    if any(b not in supported for b in bal):
        raise UserError(
            f"method {method!r} can balance only {', '.join(supported)}, not {', '.join(bal)} "
            "(METIS balances nodes, training nodes and edges)"
        )
    unknown = sorted(set(options) - set(_OPTIONS.get(method, ())))
    if unknown:
        allowed = ", ".join(_OPTIONS.get(method, ())) or "none"
        raise UserError(f"method {method!r} does not take {unknown} (options: {allowed})")
    if isinstance(type_tolerance, bool) or not (
        isinstance(type_tolerance, (int, float)) and type_tolerance >= 1.0
    ):
        raise UserError(f"type_tolerance must be a number >= 1.0, got {type_tolerance!r}")
    by_type = "types" in bal and typed is not None
    train = _train_mask(graph, csr) if by_type else None
    start = time.perf_counter()
    info: dict[str, Any] = {}
    if method == "random" and by_type:
        owner = random_owner_by_class(node_classes(typed, train)[0], k, seed)
    elif method == "random":
        owner = random_owner(n, k, seed)
    elif method == "range" and by_type:
        owner = range_owner_by_class(typed.node_type, k, csr.indptr, by_edges="edges" in bal)
    elif method == "range":
        owner = range_owner(n, k, csr.indptr, by_edges="edges" in bal)
    elif method == "hash":
        owner = hash_owner(n, k, seed)
    elif method == "metis":
        weights = type_columns(typed, train) if by_type else None
        owner, info = metis_owner(csr, k, seed=seed, balance=bal, type_weights=weights, **options)
    else:
        owner, info = streaming_owner(
            csr.indptr,
            csr.indices,
            n,
            k,
            method=method,
            seed=seed,
            progress=progress,
            read=read,
            **options,
        )
    moved = _fill_empty(owner, k) if n >= k else 0
    if moved:
        info["refilled_empty_parts"] = moved
    if by_type:
        chunk = int(options.get("chunk_edges", 1 << 22))
        edges = csr_edges(csr.indptr, csr.indices, read, chunk)  # a reader's: from disk
        info["types"] = _balance_types(owner, k, typed, train, edges, type_tolerance)
    info["time_s"] = time.perf_counter() - start
    result = Partition(owner, k, method, int(seed), bal, info)
    result.validate()
    return result
