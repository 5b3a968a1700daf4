"""numba loops behind :mod:`gnnpar.sampling.compiled` (imported only when numba is).

Arithmetic is unsigned 64-bit, which wraps exactly like the int64 tensor code of
:mod:`gnnpar.sampling.rng` (whose right shifts are masked to act as logical shifts).
"""

from __future__ import annotations

import numba
import numpy as np

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_STEP = np.uint64(0x632BE59BD9B4E019)
_LOW32 = np.uint64(0xFFFFFFFF)
_S33 = np.uint64(33)
_S32 = np.uint64(32)


@numba.njit(cache=True, inline="always")
def _mix(x):
    x ^= x >> _S33
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    return x ^ (x >> _S33)


@numba.njit(cache=True)
def _draws(base, count, out):
    """The ``count`` 32-bit draws of one id (``rng.random_bits``'s column)."""
    for h in range((count + 1) // 2):
        v = _mix(base + np.uint64(h + 1) * _STEP)
        out[2 * h] = v & _LOW32
        if 2 * h + 1 < count:
            out[2 * h + 1] = v >> _S32


@numba.njit(cache=True, nogil=True)
def sample_rows(indptr, rows, row_keys, keys, k, replace):
    m = rows.shape[0]
    counts = np.empty(m, dtype=np.int64)
    total = 0
    for r in range(m):
        deg = indptr[rows[r] + 1] - indptr[rows[r]]
        if replace:
            counts[r] = k if deg > 0 else 0
        else:
            counts[r] = min(deg, k)
        total += counts[r]
    out = np.empty(total, dtype=np.int64)
    bits = np.empty(k, dtype=np.uint64)
    picks = np.empty(k, dtype=np.int64)
    o = 0
    for r in range(m):
        start = indptr[rows[r]]
        deg = indptr[rows[r] + 1] - start
        c = counts[r]
        if c == 0:
            continue
        if not replace and deg <= k:
            for i in range(deg):
                out[o + i] = start + i
            o += deg
            continue
        key = keys[0] if keys.shape[0] == 1 else keys[r]
        base = _mix(np.uint64(row_keys[r]) * _GOLDEN + np.uint64(key))
        _draws(base, k, bits)
        if replace:
            for i in range(k):
                out[o + i] = start + np.int64((bits[i] * np.uint64(deg)) >> _S32)
            o += k
            continue
        for i in range(k):  # Floyd: t uniform in [0, j], j itself if t is taken
            j = deg - k + i
            t = np.int64((bits[i] * np.uint64(j + 1)) >> _S32)
            for q in range(i):
                if picks[q] == t:
                    t = j
                    break
            picks[i] = t
            out[o + i] = start + t
        o += k
    return counts, out


@numba.njit(cache=True, nogil=True)
def relabel(scratch, tag, ids, num_dst):
    n = ids.shape[0]
    local = np.empty(n - num_dst, dtype=np.int64)
    src = np.empty(n, dtype=np.int64)
    high = tag >> 32
    count = 0
    dup = -1
    for p in range(n):
        v = ids[p]
        e = scratch[v]
        if (e >> 32) == high:
            lid = e & 0xFFFFFFFF
            if p < num_dst and dup < 0:
                dup = v
        else:
            lid = count
            scratch[v] = tag | count
            src[count] = v
            count += 1
        if p >= num_dst:
            local[p - num_dst] = lid
    return src[:count].copy(), local, dup


@numba.njit(cache=True, nogil=True)
def induced(indptr, indices, nodes):
    """The subgraph induced by the sorted ids ``nodes``: ``(indptr, local, edge_ids)`` of
    its CSR, rows and kept edges in the graph's order (``vertex.induced_block``'s square
    case)."""
    b = nodes.shape[0]
    top = nodes[b - 1] + 1 if b else 0
    where = np.full(top, -1, np.int64)
    total = 0
    for i in range(b):
        v = nodes[i]
        where[v] = i
        total += indptr[v + 1] - indptr[v]
    local = np.empty(total, np.int64)
    eids = np.empty(total, np.int64)
    out = np.zeros(b + 1, np.int64)
    m = 0
    for i in range(b):
        v = nodes[i]
        for e in range(indptr[v], indptr[v + 1]):
            u = indices[e]
            if u < top:
                j = where[u]
                if j >= 0:
                    local[m] = j
                    eids[m] = e
                    m += 1
        out[i + 1] = m
    return out, local[:m].copy(), eids[:m].copy()
