"""Compiled sampling kernels (numba), an optional accelerated form of the tensor ones.

:func:`sample_rows`, :meth:`Relabeler.relabel <gnnpar.sampling.neighbor.Relabeler>` and
:func:`~gnnpar.sampling.vertex.induced_block` (whole node sets) have a
pure-torch implementation that always works; when numba is installed (``pip install
'gnnpar[fast]'``) these loops compute **the same results bit for bit**, one row or one id at a
time instead of a few dozen whole-tensor passes: the same hash of ``(key, node key, draw)``
(:mod:`gnnpar.sampling.rng`), the same Floyd rounds, the same order of edges and of first
appearances. Tests hold the two against each other.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import torch

__all__ = ["available", "induced", "relabel", "sample_rows"]


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
