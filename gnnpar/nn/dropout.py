"""Dropout whose mask depends only on (seed, global row id, global column id) (features), or
on (seed, edge, head) (attention: :func:`edge_dropout`).

Every grid shape — and the serial model — then draws the same mask for the same element,
so loss curves of different grids agree for one seed. Each row id and each column id is
hashed once (SplitMix64's finaliser, int64 arithmetic; logical right shifts are emulated with
masks because torch shifts signed integers arithmetically) to 32 random bits; an element's
number is the top bits of ``(row_key XOR col_key) * odd constant`` in int32 — three cheap
operations per element, which matters because the input layer's features are wide.
"""

from __future__ import annotations

import torch

from gnnpar.errors import UserError

_M1 = -49064778989728563  # 0xff51afd7ed558ccd as a signed 64-bit integer
_M2 = -4265267296055464877  # 0xc4ceb9fe1a85ec53
_GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15
_LOW31 = (1 << 31) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _M1
    x = x ^ ((x >> 33) & _LOW31)
    x = x * _M2
    return x ^ ((x >> 33) & _LOW31)


_M32 = -1640531535  # 0x9e3779b1 as a signed 32-bit integer (odd)
_BITS = 24


def _keys(ids: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
    """32 well-mixed bits per id, as int32."""
    x = _mix(ids.to(torch.int64) * _GOLDEN + salt)
    return ((x >> 32) & 0xFFFFFFFF).to(torch.int32)  # wraps into the int32 range


def hash_int32(seed: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """A uniform int32 for every (row, col) pair of the two id vectors (outer product), a
    pure function of ``seed`` and the ids; its high bits are the well-mixed ones."""
    base = _mix(torch.tensor(seed, dtype=torch.int64) * _GOLDEN + 1)
    r = _keys(rows, base)
    c = _keys(cols, _mix(base + 7))
    return (r[:, None] ^ c[None, :]) * _M32


def hash_uniform(seed: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Uniform numbers in [0, 1) on a 2^-24 lattice (the top 24 bits of
    :func:`hash_int32`)."""
    top = (hash_int32(seed, rows, cols) >> (32 - _BITS)) + (1 << (_BITS - 1))  # signed shift
    return top.to(torch.float64) / float(1 << _BITS)


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
        raise UserError(f"dropout probability must be in [0, 1), got {p}")
    cols = torch.arange(col_start, col_start + h.shape[1], device=row_ids.device)
    # x >= p·2^32 − 2^31 keeps a fraction 1 − p of uniform int32 values; only the
    # (well-mixed) high bits decide, as in hash_uniform.
    threshold = round(p * (1 << _BITS)) * (1 << (32 - _BITS)) - (1 << 31)
    keep = hash_int32(seed, row_ids, cols) >= threshold
    return torch.where(keep.to(h.device), h, 0.0).mul_(1.0 / (1.0 - p))


def edge_dropout(
    att: torch.Tensor,
    p: float,
    seed: int | None,
    dst_ids: torch.Tensor,
    src_ids: torch.Tensor,
    training: bool = True,
) -> torch.Tensor:
    """Dropout on attention values ``att`` (E × K: edge e from global node ``src_ids[e]`` to
    ``dst_ids[e]``, head k) whose mask is a function of (seed, dst, src, head) alone, so every
    grid draws the same mask for the same edge (the serial model included)."""
    if not training or p == 0.0 or seed is None:
        return att
    if not 0.0 <= p < 1.0:
        raise UserError(f"attention dropout probability must be in [0, 1), got {p}")
    base = _mix(torch.tensor(seed, dtype=torch.int64) * _GOLDEN + 3)  # not feature dropout's
    dev = dst_ids.device
    edge = _keys(dst_ids, base) ^ _keys(src_ids, _mix(base + 7))
    head = _keys(torch.arange(att.shape[1], device=dev), _mix(base + 13))
    threshold = round(p * (1 << _BITS)) * (1 << (32 - _BITS)) - (1 << 31)
    keep = ((edge[:, None] ^ head[None, :]) * _M32) >= threshold
    return torch.where(keep.to(att.device), att, 0.0) * (1.0 / (1.0 - p))
