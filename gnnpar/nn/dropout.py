"""Dropout whose mask depends only on (seed, global row id, global column id).

Every grid shape — and the serial model — then draws the same mask for the same element,
so loss curves of different grids agree for one seed. The mask comes from a counter-based
hash (SplitMix64's finaliser) in int64 arithmetic; logical right shifts are emulated with
masks because torch shifts signed integers arithmetically.
"""

from __future__ import annotations

import torch

_M1 = -49064778989728563  # 0xff51afd7ed558ccd as a signed 64-bit integer
_M2 = -4265267296055464877  # 0xc4ceb9fe1a85ec53
_GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15
_LOW31 = (1 << 31) - 1
_LOW53 = (1 << 53) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _M1
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _M2
    return x ^ ((x >> 33) & _LOW31)


def hash_uniform(seed: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in [0, 1) for every (row, col) pair of the two id vectors (outer
    product), a pure function of ``seed`` and the ids."""
    base = _mix(torch.tensor(seed, dtype=torch.int64) * _GOLDEN + 1)
    r = _mix(rows.to(torch.int64) + base)
    x = _mix(r[:, None] * _GOLDEN + cols.to(torch.int64)[None, :])
    return (x & _LOW53).to(torch.float64) / float(1 << 53)


def index_dropout(
    h: torch.Tensor,
    p: float,
    seed: int | None,
    row_ids: torch.Tensor,
    col_start: int = 0,
    training: bool = True,
) -> torch.Tensor:
    """Dropout on ``h`` whose rows have global ids ``row_ids`` and whose columns are the
    global features ``col_start .. col_start + h.shape[1]``."""
    if not training or p == 0.0 or seed is None:
        return h
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    cols = torch.arange(col_start, col_start + h.shape[1], device=row_ids.device)
    keep = hash_uniform(seed, row_ids, cols) >= p
    return h * keep.to(h.dtype).to(h.device) / (1.0 - p)
