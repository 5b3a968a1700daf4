"""Compiled sampling kernels (numba), an optional accelerated form of the tensor ones.

:func:`sample_rows`, :meth:`Relabeler.relabel <gnnpar.sampling.neighbor.Relabeler>` and
:func:`~gnnpar.sampling.vertex.induced_block` (whole node sets) have a
pure-torch implementation that always works; when numba is installed (``pip install
'gnnpar[fast]'``) these loops compute **the same results bit for bit**, one row or one id at a
time instead of a few dozen whole-tensor passes: the same hash of ``(key, node key, draw)``
(:mod:`gnnpar.sampling.rng`), the same Floyd rounds, the same order of edges and of first
appearances. Tests hold the two against each other.

numba compiles a kernel on its first call in a process (seconds, the first time on a machine)
or loads it from its on-disk cache (``cache=True``: a ``__pycache__`` folder beside this
package, or ``NUMBA_CACHE_DIR``). :func:`warm_up` makes that happen on a tiny graph, so that a
training task pays for it while it sets up rather than inside its first epoch's time.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gnnpar.errors import UserError

__all__ = ["KERNELS", "WarmUp", "available", "induced", "relabel", "sample_rows", "warm_up"]

#: The kernels: neighbour sampling uses ``sample_rows`` and ``relabel`` (as do the blocks of
#: layer-wise evaluation), the subgraph samplers ``induced``.
KERNELS = ("sample_rows", "relabel", "induced")


def available() -> bool:
    """Whether numba can be imported (the kernels compile on first use)."""
    return importlib.util.find_spec("numba") is not None


def _kernels() -> Any:
    """The compiled kernels, built once per process (numba caches the compiled code)."""
    from gnnpar.sampling import _numba_kernels

    return _numba_kernels


def sample_rows(
    indptr: torch.Tensor,
    rows: torch.Tensor,
    fanout: int,
    replace: bool,
    key: int | torch.Tensor,
    row_keys: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`gnnpar.sampling.neighbor.sample_rows` for ``fanout >= 1`` (``key``: one
    key, or one per row)."""
    keys = key.numpy() if isinstance(key, torch.Tensor) else np.array([key], dtype=np.int64)
    counts, pos = _kernels().sample_rows(
        indptr.numpy(), rows.numpy(), row_keys.numpy(), keys, int(fanout), bool(replace)
    )
    return torch.from_numpy(counts), torch.from_numpy(pos)


def relabel(
    scratch: torch.Tensor, tag: int, ids: torch.Tensor, num_dst: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """First-appearance relabelling with ``scratch`` entries stamped by ``tag``: returns
    ``(src_nodes, local, duplicate)`` where ``duplicate`` is the first repeated id among the
    first ``num_dst`` ids, or -1."""
    src, local, dup = _kernels().relabel(scratch.numpy(), np.int64(tag), ids.numpy(), num_dst)
    return torch.from_numpy(src), torch.from_numpy(local), int(dup)


def induced(
    indptr: torch.Tensor, indices: torch.Tensor, nodes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indptr, local, edge_ids)`` of the subgraph induced by the sorted ids ``nodes``, as
    :func:`~gnnpar.sampling.vertex.induced_block` builds it for the whole set."""
    out, local, eids = _kernels().induced(indptr.numpy(), indices.numpy(), nodes.numpy())
    return torch.from_numpy(out), torch.from_numpy(local), torch.from_numpy(eids)


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """What :func:`warm_up` did: the seconds it took, and how many kernels numba compiled
    (none in its on-disk cache yet) and loaded from that cache."""

    seconds: float
    compiled: int
    loaded: int


def warm_up(kernels: Sequence[str] = KERNELS) -> WarmUp | None:
    """Compile ``kernels`` (names from :data:`KERNELS`), or load them from numba's cache, for
    the argument types the samplers pass (int64 CSR arrays and ids; the calls below go
    through the same wrappers as theirs), by running each on a tiny graph. None without
    numba. A kernel this process has compiled already costs nothing and counts in neither
    ``compiled`` nor ``loaded``."""
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        raise UserError(f"unknown sampling kernel {unknown[0]!r}; kernels are {KERNELS}")
    if not available():
        return None
    start = time.perf_counter()
    dispatchers = [getattr(_kernels(), name) for name in kernels]
    before = [_cache_counts(d) for d in dispatchers]
    # three nodes: 0 -> 1, 2; 1 -> 0; 2 -> nothing
    indptr = torch.tensor([0, 2, 3, 3], dtype=torch.int64)
    indices = torch.tensor([1, 2, 0], dtype=torch.int64)
    rows = torch.arange(3, dtype=torch.int64)
    if "sample_rows" in kernels:
        for replace in (False, True):  # fan-out 1 < degree 2: Floyd's rounds run too
            sample_rows(indptr, rows, 1, replace, 5, rows)
    if "relabel" in kernels:
        scratch = torch.full((3,), torch.iinfo(torch.int64).max, dtype=torch.int64)
        relabel(scratch, 1 << 32, torch.tensor([0, 1, 1], dtype=torch.int64), 1)
    if "induced" in kernels:
        induced(indptr, indices, torch.tensor([0, 1], dtype=torch.int64))
    after = [_cache_counts(d) for d in dispatchers]
    return WarmUp(
        seconds=time.perf_counter() - start,
        compiled=sum(a[0] - b[0] for a, b in zip(after, before, strict=True)),
        loaded=sum(a[1] - b[1] for a, b in zip(after, before, strict=True)),
    )


def _cache_counts(dispatcher: Any) -> tuple[int, int]:
    """A numba dispatcher's compilations so far that its on-disk cache missed and hit."""
    stats = getattr(dispatcher, "stats", None)
    if stats is None:
        return 0, 0
    return sum(stats.cache_misses.values()), sum(stats.cache_hits.values())
