"""Context parallelism: each sequence split over the grid's ``context`` axis, attention as a ring.

**Layout.** With C context ranks a sequence of T tokens is cut into 2C chunks of L = T/(2C)
tokens, and rank r holds chunks r and 2C−1−r (one early, one late), in that order. Under a
causal mask a late chunk attends to many keys and an early one to few, so every rank does the
same work (:func:`chunk_ids`, :func:`positions`, :func:`split_sequence`).

**Ring attention.** Each rank keeps its queries; the key/value blocks travel around the ring
(rank r sends to r+1 and receives from r−1, point to point through :mod:`gnnpar.comm`, so the
bytes count on the context axis). At step s rank r holds the block of rank r−s and attends its
two query chunks to the block's two key chunks: a key chunk before the query chunk in full, the
same chunk with the causal mask, a later one not at all. The partial results are merged with
the online softmax (each partial output comes with its rows' log-sum-exp, i.e. running max and
sum; merging rescales both sides to the new log-sum-exp), so no rank ever holds a T×T score
matrix or another rank's whole sequence at once; each chunk pair's scores are computed a slice
of sequences·heads at a time, at most ``TILE_BYTES`` of them.

**Backward** (a custom autograd function) recomputes each block's probabilities from the saved
log-sum-exp, as FlashAttention does: the key/value blocks go around the ring again, each with
the gradient of its keys and values accumulated by the ranks it has visited, and after C hops
the gradients arrive home. Per rank and attention layer, with K the bytes of its local keys:
forward (C−1)·2K, backward (C−1)·2K for the keys and values plus C·2K for their gradients
(:func:`ring_bytes`).

:func:`context_parallel` applies it to our GPT from the outside (each
:class:`~gnnpar.models.gpt.model.CausalSelfAttention`, plain or tensor-parallel, gets a ring);
the model is then called with each rank's tokens and their global ``pos``.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from gnnpar import comm
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid

__all__ = [
    "RingAttention",
    "chunk_ids",
    "context_parallel",
    "plain_attention",
    "positions",
    "ring_bytes",
    "simulate_ring_attention",
    "split_sequence",
]

AXIS = "context"


def chunk_ids(c: int, r: int) -> tuple[int, int]:
    """The two chunks (of 2C) that context rank ``r`` of ``c`` holds: one early, one late."""
    if not 0 <= r < c:
        raise ValueError(f"context rank {r} is outside an axis of size {c}")
    return r, 2 * c - 1 - r


def _chunk_len(t: int, c: int) -> int:
    if t % (2 * c):
        raise UserError(
            f"a sequence of {t} tokens does not cut into 2·context = {2 * c} equal chunks"
        )
    return t // (2 * c)


def positions(t: int, c: int, r: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (0..t−1) of the tokens context rank ``r`` of ``c`` holds, in its order."""
    n = _chunk_len(t, c)
    return torch.cat([torch.arange(i * n, (i + 1) * n, device=device) for i in chunk_ids(c, r)])


def split_sequence(x: torch.Tensor, c: int, r: int, dim: int = 1) -> torch.Tensor:
    """Context rank ``r``'s part of ``x``, whose dimension ``dim`` is the whole sequence."""
    n = _chunk_len(x.shape[dim], c)
    a, b = chunk_ids(c, r)
    return torch.cat([x.narrow(dim, a * n, n), x.narrow(dim, b * n, n)], dim=dim)


def ring_bytes(local_kv_bytes: int, c: int) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per attention layer, where
    ``local_kv_bytes`` is the size of its keys (= of its values)."""
    if c <= 1:
        return 0, 0
    return 2 * (c - 1) * local_kv_bytes, (2 * (c - 1) + 2 * c) * local_kv_bytes


# ------------------------------------------------------------------------------ the ring
class _Ring:
    """Point-to-point passing along the context axis: send to rank r+1, receive from r−1."""

    def __init__(self, grid: ProcessGrid, axis: str = AXIS):
        self.grid, self.axis = grid, axis
        self.size, self.rank = grid.size(axis), grid.rank(axis)

    def shift(self, tensors: Sequence[torch.Tensor], tag: int) -> list[torch.Tensor]:
        """Send ``tensors`` on and return what the previous rank sent."""
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        sends = [
            comm.send(t, self.grid, self.axis, nxt, tag + i) for i, t in enumerate(tensors)
        ]
        got = [
            comm.recv(t.shape, t.dtype, self.grid, self.axis, prev, tag + i)
            for i, t in enumerate(tensors)
        ]
        for h in sends:
            h.wait()
        return got


class _ThreadRing:
    """The same passing between threads of one process (:func:`simulate_ring_attention`)."""

    def __init__(self, boxes: list[queue.Queue], rank: int):
        self.boxes, self.size, self.rank = boxes, len(boxes), rank

    def shift(self, tensors: Sequence[torch.Tensor], tag: int) -> list[torch.Tensor]:
        self.boxes[(self.rank + 1) % self.size].put([t.clone() for t in tensors])
        return self.boxes[self.rank].get(timeout=60)


# ---------------------------------------------------------------------------- the blocks
#: Bytes of one score tile (chunk × chunk scores of some sequences and heads): the pairs are
#: computed a slice of sequences·heads at a time, so the transient scores stay this small.
TILE_BYTES = 8 << 20


def _pairs(c: int, r: int, src: int) -> Iterator[tuple[int, int, bool]]:
    """(query chunk, key chunk, causal) of the local pairs that attend at all, when rank
    ``r`` holds the key/value block of rank ``src``."""
    for i, qi in enumerate(chunk_ids(c, r)):
        for j, kj in enumerate(chunk_ids(c, src)):
            if kj <= qi:
                yield i, j, kj == qi


def _tiles(n: int, chunk: int, itemsize: int) -> list[slice]:
    """Slices of the ``n`` sequences·heads whose chunk × chunk scores fit in TILE_BYTES."""
    per = max(1, TILE_BYTES // max(1, chunk * chunk * itemsize))
    return [slice(a, min(a + per, n)) for a in range(0, n, per)]


def _half(t: torch.Tensor, i: int) -> torch.Tensor:
    """Chunk ``i`` (0: the early one, 1: the late one) of a rank's tokens (dimension 1)."""
    n = t.shape[1] // 2
    return t[:, i * n : (i + 1) * n]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``(..., T, d)`` as ``(sequences·heads, T, d)``."""
    return t.reshape(-1, *t.shape[-2:])


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        n = s.shape[-1]
        mask = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _forward(q, k, v, ring, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's attention output and its rows' log-sum-exp (both of its query chunks)."""
    c, r = ring.size, ring.rank
    shape = q.shape
    q, k, v = _flat(q), _flat(k), _flat(v)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    tiles = _tiles(q.shape[0], q.shape[1] // 2, q.element_size())
    for step in range(c):
        for i, j, causal in _pairs(c, r, src=(r - step) % c):
            for t in tiles:
                s = _scores(_half(q, i)[t], _half(k, j)[t], scale, causal)
                part = torch.logsumexp(s, dim=-1)
                o = torch.matmul(torch.exp(s - part.unsqueeze(-1)), _half(v, j)[t])
                # online softmax: rescale both partial outputs to the merged log-sum-exp
                old = _half(lse, i)[t]
                new = torch.logaddexp(old, part)
                _half(out, i)[t] = _half(out, i)[t] * torch.exp(old - new).unsqueeze(
                    -1
                ) + o * torch.exp(part - new).unsqueeze(-1)
                _half(lse, i)[t] = new
        if step < c - 1:
            k, v = ring.shift([k, v], tag=4 * step)
    return out.reshape(shape), lse.reshape(shape[:-1])


def _backward(q, k, v, out, lse, grad, ring, scale: float):
    """Gradients of q, k, v (this rank's) from the gradient of its output."""
    c, r = ring.size, ring.rank
    shape = q.shape
    q, k, v, grad = _flat(q), _flat(k), _flat(v), _flat(grad)
    lse = lse.reshape(q.shape[:-1])
    delta = (grad * _flat(out)).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    tiles = _tiles(q.shape[0], q.shape[1] // 2, q.element_size())
    for step in range(c):
        for i, j, causal in _pairs(c, r, src=(r - step) % c):
            for t in tiles:
                qi, gi, kj, vj = _half(q, i)[t], _half(grad, i)[t], _half(k, j)[t], _half(v, j)[t]
                p = torch.exp(_scores(qi, kj, scale, causal) - _half(lse, i)[t].unsqueeze(-1))
                _half(dv, j)[t] += torch.matmul(p.transpose(-2, -1), gi)
                ds = p * (torch.matmul(gi, vj.transpose(-2, -1)) - _half(delta, i)[t].unsqueeze(-1))
                _half(dq, i)[t] += torch.matmul(ds, kj) * scale
                _half(dk, j)[t] += torch.matmul(ds.transpose(-2, -1), qi) * scale
        # the block's gradients travel with it; after the last step one more hop takes them home
        if step < c - 1:
            k, v, dk, dv = ring.shift([k, v, dk, dv], tag=4 * step)
        elif c > 1:
            dk, dv = ring.shift([dk, dv], tag=4 * step + 2)
    return dq.reshape(shape), dk.reshape(shape), dv.reshape(shape)


class _RingAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, scale):  # noqa: D102
        out, lse = _forward(q, k, v, ring, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, out, lse, grad.contiguous(), ctx.ring, ctx.scale)
        return dq, dk, dv, None, None


class RingAttention:
    """Causal attention of ``(B, H, T_local, head_dim)`` queries, keys and values whose
    sequence is split over ``grid``'s context axis (this rank's two chunks, see the module
    docstring); what :func:`context_parallel` gives each attention block."""

    def __init__(self, grid: ProcessGrid, axis: str = AXIS):
        self.grid, self.axis = grid, axis

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention output, this rank's part of the sequence."""
        ring = _Ring(self.grid, self.axis)
        return _RingAttentionFn.apply(q, k, v, ring, 1.0 / math.sqrt(q.shape[-1]))


def simulate_ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: int, grad: torch.Tensor | None = None
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Ring attention of whole ``(B, H, T, head_dim)`` tensors on ``c`` simulated context
    ranks (threads of this process, each with its two chunks, passing blocks through queues):
    the output (whole sequence, in order) and, given the output's gradient ``grad``, the
    gradients of q, k and v. What the ranks of a real context axis compute, without one."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    boxes: list[queue.Queue] = [queue.Queue() for _ in range(c)]
    results: list = [None] * c
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            ring = _ThreadRing(boxes, r)
            mine = [split_sequence(t, c, r, dim=-2) for t in (q, k, v)]
            out, lse = _forward(*mine, ring, scale)
            grads = None
            if grad is not None:
                g = split_sequence(grad, c, r, dim=-2)
                grads = _backward(*mine, out, lse, g, ring, scale)
            results[r] = (out, grads)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    t = q.shape[-2]
    order = torch.cat([positions(t, c, r) for r in range(c)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(t)

    def whole(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts, dim=-2).index_select(-2, inverse.to(parts[0].device))

    out = whole([res[0] for res in results])
    if grad is None:
        return out, None
    return out, tuple(whole([res[1][i] for res in results]) for i in range(3))


# ---------------------------------------------------------------------- applying it
def context_parallel(model: nn.Module, grid: ProcessGrid) -> nn.Module:
    """Give every attention module of ``model`` whose class declares ``ring_attention``
    (our GPT's :class:`~gnnpar.models.gpt.model.CausalSelfAttention`; before or after
    :func:`~gnnpar.tensor.parallelize`) ring attention over ``grid``'s context axis, in
    place; call the model with this rank's tokens (:func:`split_sequence`) and their
    ``pos`` (:func:`positions`). Attention dropout is not supported (a ``ValueError``).
    A grid without a context axis leaves the model as it is."""
    if grid.size(AXIS) == 1:
        return model
    ring = RingAttention(grid)
    found = False
    for name, m in model.named_modules():
        if getattr(type(m), "ring_attention", False):
            if m.dropout > 0:
                raise UserError(f"{name}: ring attention has no attention dropout (dropout=0)")
            m.attention = ring
            found = True
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no CausalSelfAttention for context parallelism"
        )
    return model


@contextlib.contextmanager
def plain_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``model``'s attention is plain again: each rank attends over whole
    sequences it holds (generation, which feeds sequences of any length)."""
    saved = [(m, m.attention) for m in model.modules() if getattr(type(m), "ring_attention", False)]
    for m, _ in saved:
        m.attention = None
    try:
        yield model
    finally:
        for m, ring in saved:
            m.attention = ring
