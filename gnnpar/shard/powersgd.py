"""PowerSGD gradient compression on stage 0's buckets: torch's own communication hook.

``shard(model, grid, 0, powersgd_rank=r)`` hands each gradient bucket's all-reduce over the
data axis to ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.powerSGD_hook`` —
the hook DDP users register, unchanged: it compresses each matrix gradient M (n × m) to
rank-r factors P = M·Q and Q = Mᵀ·P (each all-reduced, P orthogonalised between), keeps the
compression error and adds it to the next step's gradient (error feedback), reuses the last
step's Q (warm start), all-reduces vectors and matrices that would not compress more than 2×
as they are, and runs a plain all-reduce for the first ``start_iter`` steps. The hook reads a
bucket through four methods (``buffer``, ``gradients``, ``index``, ``is_last``), which
:class:`_HookBucket` answers for one of our buckets; its result is the mean over the data
ranks, so the bucket is first multiplied by data / the runtime's divisor.

Bytes: the hook all-reduces through ``torch.distributed`` itself, so :mod:`gnnpar.comm`
counts them from the hook's own tally (``PowerSGDState.total_numel_after_compression``,
which it advances by (n + m)·r for a compressed matrix and by its size for one sent whole),
at the ring's all-reduce cost; in the first ``start_iter`` steps, the whole bucket.

Only stage 0: PowerSGD's factors are all-reduced, so every rank ends with the whole
approximate gradient, which a reduce-scatter's shards (stages 1–3) have no use for.
"""

from __future__ import annotations

import torch

from gnnpar import comm
from gnnpar.grid import ProcessGrid
from gnnpar.shard.flat import Slot

__all__ = ["PowerSGD"]


class _HookBucket:
    """What ``powerSGD_hook`` reads of a bucket (it is duck-typed on these four methods)."""

    def __init__(self, index: int, last: bool, buffer: torch.Tensor, grads: list[torch.Tensor]):
        self._index, self._last, self._buffer, self._grads = index, last, buffer, grads

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


class PowerSGD:
    """The PowerSGD state of one data group and the all-reduce of a bucket through it."""

    def __init__(self, grid: ProcessGrid, rank: int, start_iter: int = 2, seed: int = 0):
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        self.grid = grid
        self.start_iter = start_iter
        self.state = PowerSGDState(
            grid.group("data"),
            matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iter,
            random_seed=seed,
            compression_stats_logging_frequency=1 << 62,  # no log lines
        )

    def shape_of(self, slot: Slot) -> tuple[int, ...]:
        """The shape the hook sees of ``slot``'s gradient: a tensor-parallel matrix stores its
        local block flattened, so the block's (rows, columns) — where z does not cut it
        further (z = 1); else, and for every other parameter, its own shape."""
        layout = slot.layout
        if layout is not None and layout.kind == "matrix" and layout.depth == 1:
            r, c, _ = layout.coords(self.grid)
            return layout.block_shape(r, c)
        return tuple(slot.shape)

    def all_reduce(
        self, index: int, last: bool, buffer: torch.Tensor, grads: list[torch.Tensor]
    ) -> comm.Handle:
        """The compressed mean of ``buffer`` (``grads`` its per-parameter views) over the data
        axis, written into ``buffer``; a handle whose result is ``buffer`` (already done)."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

        state, p = self.state, self.grid.size("data")
        plain = state.iter < self.start_iter
        before = state.total_numel_after_compression
        future = powerSGD_hook(state, _HookBucket(index, last, buffer, grads))
        sent = buffer.numel() if plain else state.total_numel_after_compression - before
        full = sent * buffer.element_size()
        comm.account(self.grid, "data", "all_reduce", comm.ring_bytes("all_reduce", full, p))
        what = f"PowerSGD all-reduce of bucket {index} over grid axis 'data'"
        # Waited for here, before the next bucket's hook starts: the hook issues its later
        # all-reduces from the callbacks of the earlier ones (gloo's thread), so two buckets
        # in flight would issue them in an order that differs between ranks.
        try:
            out = future.wait()
        except RuntimeError as e:
            raise comm.CommError(f"{what} failed: {e}") from e
        if out.data_ptr() != buffer.data_ptr():
            buffer.copy_(out)
        return comm.Handle(None, lambda: buffer, what)
