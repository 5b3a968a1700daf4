"""Collective matmuls: an all-gather followed by a matmul, and a matmul followed by a
reduce-scatter, along the sequence over one grid axis, either as one collective and the
products (``decompose=False``) or decomposed into point-to-point steps that overlap the
products (``decompose=True``, the "looped collective matmul" of Wang et al., ASPLOS 2023).

Both are what a sequence-parallel :class:`~gnnpar.tensor.Linear` runs
(:mod:`gnnpar.tensor.sequence`): the column layer gathers its input's sequence before its
matmul (and reduce-scatters the input gradient in backward); the row layer reduce-scatters its
output's sequence after its matmul (and gathers the output gradient in backward).

**Chunk-wise products.** ``mm`` is applied to each rank's chunk of the sequence separately
in both forms, and the results concatenated: a BLAS product over a subset of the rows is not,
in general, bit-equal to those rows of the product over all of them (the library picks its
kernel by the row count; measured with MKL in float64), so computing chunk by chunk in both
forms is what makes ``decompose`` change no bit. The cost is ``p`` products instead of one
and a concatenation.

**The decomposed schedule** over ``p`` ranks, rank ``r``: step ``k = 1 … p−1`` exchanges
with the ranks ``k`` ahead and ``k`` behind (one send and one receive posted together,
:func:`gnnpar.comm.exchange`), all steps in flight at once.

- *gather → matmul*: every step sends this rank's chunk to rank ``r+k`` and receives rank
  ``r−k``'s; the product of this rank's own chunk runs while they travel, then each received
  chunk's product as it arrives.
- *matmul → reduce-scatter*: step ``k`` computes the partial product for rank ``r+k``'s
  chunk and sends it, so it travels while the next one is computed; this rank's own partial
  is computed last. The partials that arrive are summed **in group order** (rank 0's, then
  rank 1's, …), the order of the shared-memory transport's reduce-scatter
  (:mod:`gnnpar.shm`), so on the host the two forms agree bit for bit. Against gloo's own
  algorithm (collectives under ``GNNPAR_SHM_MIN_BYTES``) or NCCL's, the sums over more than
  two ranks are taken in another order and differ in the last bits.

A neighbour ring that passes accumulators would sum chunk ``j`` starting from rank ``j+1``,
an order that depends on ``j``; steps ``k`` apart keep one order for every chunk and move
exactly the ring's bytes. Each message is padded to the largest chunk, as
:mod:`gnnpar.comm` pads uneven collectives, so both forms move (and count, on the same axis)
``(p−1)·max_chunk`` rows per rank: the ring's ``(p−1)/p·V`` when the sequence divides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from gnnpar import comm
from gnnpar.chunking import chunk_offsets
from gnnpar.grid import ProcessGrid

__all__ = ["Pending", "gather_matmul", "matmul_scatter"]

Product = Callable[[torch.Tensor], torch.Tensor]


class Pending:
    """A reduce-scatter in flight; ``wait()`` returns this rank's chunk of the sum."""

    def __init__(self, finish: Callable[[], torch.Tensor]):
        self._finish = finish
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """Wait for the transfers and return the result (idempotent)."""
        if self._result is None:
            self._result = self._finish()
            self._finish = None  # drop what the closure holds
        return self._result


def _pad(t: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """``t`` contiguous, with zeros appended along ``dim`` up to ``rows``."""
    t = t.contiguous()
    short = rows - t.shape[dim]
    if short == 0:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, short]
    return F.pad(t, pad)


def _chunks(t: torch.Tensor, dim: int, sizes: Sequence[int]) -> list[torch.Tensor]:
    return [t.narrow(dim, o, s) for o, s in zip(chunk_offsets(sizes), sizes, strict=True)]


def gather_matmul(
    x: torch.Tensor,
    mm: Product,
    grid: ProcessGrid,
    axis: str,
    dim: int,
    sizes: Sequence[int],
    decompose: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, x_full)``: ``x_full`` is every rank's ``x`` concatenated along ``dim`` in group
    order (rank ``j`` holding ``sizes[j]`` of it) and ``y`` the concatenation of ``mm`` of
    each rank's chunk (see the module docstring)."""
    dim = dim % x.dim()
    p, me = grid.size(axis), grid.rank(axis)
    if p == 1:
        return mm(x.contiguous()), x
    if not decompose:
        full = comm.all_gather(x, grid, axis, dim=dim, sizes=sizes)
        prods = [mm(c.contiguous()) for c in _chunks(full, dim, sizes)]
        return torch.cat(prods, dim), full
    send = _pad(x, dim, max(sizes))
    handles = {}
    for k in range(1, p):  # all in flight at once: each pair of ranks exchanges one message
        src = (me - k) % p
        handles[src] = comm.exchange(send, grid, axis, dst=(me + k) % p, src=src)
    chunks: list[torch.Tensor | None] = [None] * p
    prods: list[torch.Tensor | None] = [None] * p
    chunks[me] = x
    prods[me] = mm(x.contiguous())  # while the others' chunks travel
    for k in range(1, p):
        src = (me - k) % p
        got = handles[src].wait().narrow(dim, 0, sizes[src])
        chunks[src] = got
        prods[src] = mm(got.contiguous())
    return torch.cat(prods, dim), torch.cat(chunks, dim)


def matmul_scatter(
    x: torch.Tensor,
    mm: Product,
    grid: ProcessGrid,
    axis: str,
    dim: int,
    sizes: Sequence[int],
    decompose: bool,
) -> Pending:
    """This rank's chunk along ``dim`` (``sizes[rank]`` of it) of the sum over the ``axis``
    group of ``mm`` applied chunk by chunk to ``x``; the returned :class:`Pending`'s
    ``wait()`` gives it. Without ``decompose`` the products are taken first and one blocking
    reduce-scatter sums them; with it, the transfers overlap the products and, decomposed,
    ``wait()`` sums what arrived (work placed between the call and ``wait()`` overlaps the
    last transfers)."""
    dim = dim % x.dim()
    p, me = grid.size(axis), grid.rank(axis)
    parts = _chunks(x, dim, sizes)
    if p == 1:
        out = mm(parts[0].contiguous())
        return Pending(lambda: out)
    if not decompose:
        full = torch.cat([mm(c.contiguous()) for c in parts], dim)
        # blocking: on the host it takes the shared-memory transport, which sums in group order;
        # contiguous as the decomposed result is, so that what follows (a norm's weight
        # gradient, summed over the tokens in memory order) sums in the same order too
        out = comm.reduce_scatter(full, grid, axis, dim=dim, sizes=sizes).contiguous()
        return Pending(lambda: out)
    rows = max(sizes)
    handles = []
    for k in range(1, p):
        dst, src = (me + k) % p, (me - k) % p
        part = _pad(mm(parts[dst].contiguous()), dim, rows)  # travels while the next is computed
        handles.append((src, comm.exchange(part, grid, axis, dst=dst, src=src)))
    own = mm(parts[me].contiguous())

    def finish() -> torch.Tensor:
        got = dict.fromkeys(range(p))
        got[me] = own
        for src, h in handles:
            got[src] = h.wait().narrow(dim, 0, sizes[me])
        out = own if me == 0 else torch.empty_like(own).copy_(got[0])  # own: a fresh product
        for j in range(1, p):  # group order: the shared-memory transport's order
            out.add_(got[j])
        return out

    return Pending(finish)
