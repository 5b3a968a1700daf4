"""One-pass streaming partitioners: LDG and Fennel.

Nodes arrive one at a time (in id order, or a seeded random order) and are placed at once,
looking only at the owners of their already-placed neighbours and at the part sizes. Memory
is the assignment itself plus O(K): the CSR is only read, row by row, so it can be a
memory-mapped file much larger than RAM. That is their use: graphs where METIS, which
holds several copies of the adjacency, runs out of memory.

- **LDG** (Stanton & Kliot, KDD 2012): put ``v`` in the part maximising
  ``|N(v) ∩ P_k| * (1 - |P_k| / C)``, ``C`` the capacity.
- **Fennel** (Tsourakakis et al., WSDM 2014): maximise
  ``|N(v) ∩ P_k| - alpha * gamma * |P_k| ** (gamma - 1)`` with ``gamma = 1.5`` and
  ``alpha = sqrt(K) * m / n ** 1.5``, under a hard cap ``C = slack * n / K``.

Ties go to the smaller part. ``N(v)`` is the CSR row of ``v``: its in-neighbours (all
neighbours for a symmetric graph).

The edges are read from ``indices`` (an array, a memory map) or through ``read`` (positions
to source ids, e.g. :meth:`gnnpar.data.chunked.GraphReader.indices` of a graph folder on
disk), in chunks of at most ``chunk_edges`` edges covering consecutive nodes of the stream:
memory is ``indptr``, the assignment and the stream order (24 bytes a node) plus one chunk
(about 16 bytes an edge), whatever the graph's size; the result does not depend on the
chunk size. ``passes > 1`` restreams (Nishimura & Ugander, KDD 2013):
later passes see every neighbour's previous owner, which lowers the cut at the same memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gnnpar.errors import UserError

__all__ = ["STREAM_METHODS", "streaming_owner"]

STREAM_METHODS = ("ldg", "fennel")
_PROGRESS_EVERY = 8192


def streaming_owner(
    indptr: np.ndarray,
    indices: np.ndarray | None,
    num_nodes: int,
    num_parts: int,
    method: str = "fennel",
    seed: int = 0,
    order: str = "natural",
    passes: int = 1,
    slack: float = 1.1,
    gamma: float = 1.5,
    alpha: float | None = None,
    progress: bool = False,
    read: Callable[[np.ndarray], np.ndarray] | None = None,
    chunk_edges: int = 1 << 22,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Stream the nodes once (or ``passes`` times) and return ``(owner, info)``.

    Args:
        indptr, indices: the CSR (numpy arrays or memory maps); only read. ``indices`` may
            be None when ``read`` is given.
        read: returns the source ids of the edges at the given positions (default:
            ``indices[positions]``).
        chunk_edges: edges read at a time.
        order: ``"natural"`` (id order: the order a file is read in; the default) or
            ``"random"`` (a seeded permutation).
        passes: number of streaming passes (1 = classic one-pass streaming).
        slack: capacity per part is ``ceil(slack * n / K)`` (at least ``ceil(n / K)``).
        gamma, alpha: Fennel's parameters (``alpha`` defaults to the paper's value).
    """
    if method not in STREAM_METHODS:
        raise UserError(f"unknown streaming method {method!r}; choose from {STREAM_METHODS}")
    if order not in ("random", "natural"):
        raise UserError(f"order must be 'random' or 'natural', got {order!r}")
    if passes < 1:
        raise UserError(f"passes must be >= 1, got {passes}")
    if slack < 1.0:
        raise UserError(f"slack must be >= 1.0, got {slack}")
    if chunk_edges < 1:
        raise UserError(f"chunk_edges must be >= 1, got {chunk_edges}")
    if read is None:
        if indices is None:
            raise ValueError("streaming_owner needs indices or read")
        read = indices.__getitem__
    n, k = num_nodes, num_parts
    capacity = max(int(np.ceil(slack * n / k)), -(-n // k))
    edges = int(indptr[-1]) if n else 0
    if alpha is None:
        alpha = np.sqrt(k) * max(edges, 1) / max(n, 1) ** 1.5
    # Unplaced nodes point at an extra bucket k, so bincount needs no filtering.
    owner = np.full(n, k, dtype=np.int64)
    sizes = np.zeros(k + 1, dtype=np.int64)
    stream = (
        np.random.default_rng(seed).permutation(n)
        if order == "random"
        else np.arange(n, dtype=np.int64)
    )

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n * passes, desc=method, unit="node", leave=False)
    try:
        for _ in range(passes):
            _one_pass(
                indptr,
                read,
                chunk_edges,
                owner,
                sizes,
                stream,
                k,
                capacity,
                method,
                alpha,
                gamma,
                bar,
            )
    finally:
        if bar is not None:
            bar.close()
    info = {"capacity": capacity, "passes": passes, "order": order}
    if method == "fennel":
        info.update(alpha=float(alpha), gamma=gamma)
    return owner, info


def _neighbour_chunks(
    indptr: np.ndarray,
    read: Callable[[np.ndarray], np.ndarray],
    stream: np.ndarray,
    chunk_edges: int,
):
    """The stream in chunks: ``(nodes, ptr, sources)`` with the in-neighbours of
    ``nodes[t]`` at ``sources[ptr[t]:ptr[t + 1]]``; a node with more in-edges than a chunk
    comes alone, as ``(nodes, None, pieces)`` with its neighbours in a list of pieces."""
    from gnnpar.data.chunked import gather, row_groups

    deg = indptr[stream + 1] - indptr[stream]
    for a, b in row_groups(deg, chunk_edges):
        nodes = stream[a:b]
        if b == a + 1 and deg[a] > chunk_edges:
            start = int(indptr[nodes[0]])
            pieces = (  # read lazily, one piece at a time
                read(np.arange(start + lo, start + min(lo + chunk_edges, int(deg[a]))))
                for lo in range(0, int(deg[a]), chunk_edges)
            )
            yield nodes, None, pieces
            continue
        rows, offset = gather(deg, a, b)
        ptr = np.zeros(b - a + 1, dtype=np.int64)
        np.cumsum(deg[a:b], out=ptr[1:])
        yield nodes, ptr, read(indptr[stream[rows]] + offset)


def _one_pass(
    indptr: np.ndarray,
    read: Callable[[np.ndarray], np.ndarray],
    chunk_edges: int,
    owner: np.ndarray,
    sizes: np.ndarray,
    stream: np.ndarray,
    k: int,
    capacity: int,
    method: str,
    alpha: float,
    gamma: float,
    bar: Any,
) -> None:
    n = owner.shape[0]
    fennel = method == "fennel"
    part_sizes = sizes[:k]  # a view: updates show through
    # Fennel's size penalty per part, kept up to date one entry at a time.
    penalty = alpha * gamma * part_sizes.astype(np.float64) ** (gamma - 1.0)
    full = part_sizes >= capacity
    bincount, argmax = np.bincount, np.argmax
    step = 0
    for nodes, ptr, sources in _neighbour_chunks(indptr, read, stream, chunk_edges):
        for t in range(nodes.shape[0]):
            v = int(nodes[t])
            old = int(owner[v])
            if old < k:  # restreaming: take v out of its part first
                sizes[old] -= 1
                full[old] = False
                if fennel:
                    penalty[old] = alpha * gamma * float(sizes[old]) ** (gamma - 1.0)
                owner[v] = k
            if ptr is None:  # a node with more in-edges than a chunk, read in pieces
                counts = sum(bincount(owner[piece], minlength=k + 1)[:k] for piece in sources)
            elif ptr[t + 1] > ptr[t]:
                counts = bincount(owner[sources[ptr[t] : ptr[t + 1]]], minlength=k + 1)[:k]
            else:
                counts = None
            if fennel:
                score = -penalty if counts is None else counts - penalty
            elif counts is None:
                score = -part_sizes.astype(np.float64)
            else:
                # LDG; the tiny size term breaks ties (including all-zero rows) towards small
                # parts.
                score = counts * (1.0 - part_sizes / capacity) - part_sizes * (1e-9 / capacity)
            if full.any():
                score = np.where(full, -np.inf, score)
            best = int(argmax(score))
            owner[v] = best
            sizes[best] += 1
            if sizes[best] >= capacity:
                full[best] = True
            if fennel:
                penalty[best] = alpha * gamma * float(sizes[best]) ** (gamma - 1.0)
            step += 1
            if bar is not None and step % _PROGRESS_EVERY == 0:
                bar.update(_PROGRESS_EVERY)
    if bar is not None:
        bar.update(n % _PROGRESS_EVERY)
