"""Partitioners that ignore the edges: ``random``, ``range`` and ``hash``.

They cost O(n) time and memory and are the baselines every other method is held against.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "hash_owner",
    "random_owner",
    "random_owner_by_class",
    "range_owner",
    "range_owner_by_class",
    "splitmix64",
]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_RANDOM_SALT = 0x52414E44  # "RAND": random_owner's stream, apart from the splits' streams


def splitmix64(x: np.ndarray, seed: int = 0) -> np.ndarray:
    """The splitmix64 finaliser of ``x + seed``: a fast, well-mixed 64-bit hash of ids."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + np.uint64(seed % 2**64) * _GOLDEN + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def random_owner(num_nodes: int, num_parts: int, seed: int = 0) -> np.ndarray:
    """A uniformly random *balanced* assignment: part sizes differ by at most one.

    A random permutation dealt into equal contiguous chunks, so no part is empty when
    ``num_nodes >= num_parts`` (DGL's ``random`` draws each owner independently instead).

    The permutation comes from a stream of its own (``seed`` salted): the dataset splits
    draw ``default_rng(seed).permutation(num_nodes)`` too, and sharing that stream put
    every training node of a split made with the same seed into the first parts.
    """
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_RANDOM_SALT,)))
    owner = np.empty(num_nodes, dtype=np.int64)
    owner[rng.permutation(num_nodes)] = (
        np.arange(num_nodes, dtype=np.int64) * num_parts // max(num_nodes, 1)
    )
    return owner


def range_owner(
    num_nodes: int, num_parts: int, indptr: np.ndarray | None = None, by_edges: bool = False
) -> np.ndarray:
    """Contiguous blocks of node ids.

    By default the blocks hold equal node counts (sizes differ by at most one). With
    ``by_edges`` (and ``indptr``), cut points are placed so every block holds about the
    same number of in-edges, while each block keeps at least one node.
    """
    if not by_edges or indptr is None or num_nodes == 0 or int(indptr[-1]) == 0:
        return np.arange(num_nodes, dtype=np.int64) * num_parts // max(num_nodes, 1)
    total = int(indptr[-1])
    targets = (np.arange(1, num_parts, dtype=np.float64) * total / num_parts).astype(np.int64)
    # Block i starts at the first node with at least targets[i-1] edges before it.
    cuts = np.searchsorted(indptr, targets, side="left")
    # Every block keeps a node: cut i must lie in [i, n - K + i] and cuts strictly increase,
    # i.e. cuts - i is non-decreasing inside [0, n - K].
    steps = np.arange(1, num_parts, dtype=np.int64)
    shifted = np.clip(cuts - steps, 0, num_nodes - num_parts)
    cuts = steps + np.maximum.accumulate(shifted)
    owner = np.zeros(num_nodes, dtype=np.int64)
    owner[cuts] = 1
    return np.cumsum(owner)


def random_owner_by_class(classes: np.ndarray, num_parts: int, seed: int = 0) -> np.ndarray:
    """:func:`random_owner` class by class: every class's nodes, in a random order, dealt
    to the parts in turn, each class starting where the previous one stopped. Each class's
    counts per part, and the part sizes, differ by at most one (a typed graph's node types
    and training nodes, :func:`partitioners.typed.node_classes`)."""
    n = classes.shape[0]
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_RANDOM_SALT,)))
    order = np.argsort(classes, kind="stable")
    bounds = np.searchsorted(classes[order], np.arange(int(classes.max()) + 2 if n else 1))
    owner = np.empty(n, dtype=np.int64)
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        nodes = order[lo:hi][rng.permutation(int(hi - lo))]
        owner[nodes] = (lo + np.arange(hi - lo, dtype=np.int64)) % num_parts
    return owner


def range_owner_by_class(
    classes: np.ndarray, num_parts: int, indptr: np.ndarray | None = None, by_edges: bool = False
) -> np.ndarray:
    """:func:`range_owner` class by class: every class's nodes (in id order) cut into
    ``num_parts`` contiguous blocks (of equal in-edge counts with ``by_edges``). For a typed
    graph numbered type after type, part ``k`` holds the ``k``-th block of every type."""
    n = classes.shape[0]
    owner = np.empty(n, dtype=np.int64)
    deg = None if indptr is None else np.diff(indptr)
    for c in np.unique(classes):
        nodes = np.flatnonzero(classes == c)
        ptr = None
        if by_edges and deg is not None and nodes.shape[0] >= num_parts:
            ptr = np.zeros(nodes.shape[0] + 1, dtype=np.int64)
            np.cumsum(deg[nodes], out=ptr[1:])
        owner[nodes] = range_owner(nodes.shape[0], num_parts, ptr, by_edges=ptr is not None)
    return owner


def hash_owner(num_nodes: int, num_parts: int, seed: int = 0) -> np.ndarray:
    """``owner[v] = hash(v, seed) mod num_parts``: stateless, so any process can compute any
    node's owner without the assignment array."""
    ids = np.arange(num_nodes, dtype=np.uint64)
    return (splitmix64(ids, seed) % np.uint64(num_parts)).astype(np.int64)
