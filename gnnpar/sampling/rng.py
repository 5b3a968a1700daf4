"""Counter-based random numbers: a pure function of ``(key, id, counter)``.

Every random choice of the samplers is a hash of the batch key, the node's id and a counter,
never a draw from a stateful generator. That is what makes a sample reproducible from its
seed, independent of batch composition, thread timing and process count, and lets a
partition owner draw exactly the neighbours a single process would draw for the same node.

The hash is SplitMix64's finaliser in int64 arithmetic (torch shifts signed integers
arithmetically, so logical right shifts are emulated with masks). One 64-bit hash gives two
32-bit numbers.
"""

from __future__ import annotations

import torch

__all__ = ["derive_key", "random_bits", "random_unit", "uniform_below"]

_M1 = -49064778989728563  # 0xff51afd7ed558ccd as signed int64
_M2 = -4265267296055464877  # 0xc4ceb9fe1a85ec53
_GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15
_STEP = 0x632BE59BD9B4E019  # another odd constant, for counters
_LOW31 = (1 << 31) - 1
_LOW32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix_int(x: int) -> int:
    """SplitMix64's finaliser on a Python int (unsigned 64-bit arithmetic)."""
    x &= _MASK64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _MASK64
    return x ^ (x >> 33)


def derive_key(*parts: int) -> int:
    """A 64-bit key (as a signed int) from integers such as ``(seed, epoch, batch)``.

    Different tuples give unrelated keys; the same tuple always gives the same key.
    """
    h = 0x243F6A8885A308D3  # pi's fraction bits: a fixed start
    for p in parts:
        h = _mix_int(h ^ _mix_int(int(p) + 0x9E3779B97F4A7C15))
    return _signed(h)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (in place on ``x``, which it returns)."""
    x ^= (x >> 33) & _LOW31
    x *= _M1
    x ^= (x >> 33) & _LOW31
    x *= _M2
    x ^= (x >> 33) & _LOW31
    return x


def random_bits(key: int | torch.Tensor, ids: torch.Tensor, count: int) -> torch.Tensor:
    """``(count, len(ids))`` int64 numbers uniform in ``[0, 2**32)``.

    Entry ``(j, i)`` depends only on ``(key, ids[i], j)``: row ``j`` is the ``j``-th draw of
    every id (rows are contiguous, which is how the samplers consume them). ``key`` is one
    key, or one per id.
    """
    ids = ids.to(torch.int64)
    m = ids.numel()
    if count == 0 or m == 0:
        return torch.zeros((count, m), dtype=torch.int64, device=ids.device)
    base = _mix(ids * _GOLDEN + key)
    half = (count + 1) // 2
    steps = torch.arange(1, half + 1, dtype=torch.int64, device=ids.device) * _STEP
    h = _mix(base[None, :] + steps[:, None])
    out = torch.empty((2 * half, m), dtype=torch.int64, device=ids.device)
    out[0::2] = h & _LOW32
    out[1::2] = (h >> 32) & _LOW32
    return out[:count]


def uniform_below(bits: torch.Tensor, bound: torch.Tensor | int) -> torch.Tensor:
    """Map 32-bit uniform ``bits`` to integers uniform in ``[0, bound)`` (Lemire's
    multiply-shift; the bias is below ``bound / 2**32``). ``bound`` must be < 2**31."""
    return (bits * bound) >> 32


def random_unit(key: int | torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in ``[0, 1)`` per id (53 random bits from two draws); entry ``i``
    depends only on ``(key, ids[i])``."""
    bits = random_bits(key, ids, 2)
    return ((bits[0] << 21) | (bits[1] >> 11)).to(torch.float64) * 2.0**-53
