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

State: the hook's step count, its generator (which draws a new bucket's first Q) and per
bucket the error feedback and the warm start's P and Q are this rank's own
(:meth:`PowerSGD.state_tensors`); checkpoints and snapshots keep them beside the rank's
generator, so a resume on the grid that saved them continues the compression exactly.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from gnnpar import comm
from gnnpar.errors import UserError
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


#: The state's tensors that are not per bucket (:meth:`PowerSGD.state_tensors`).
_SCALARS = ("iter", "rng_key", "rng_pos", "rng_gauss")


def _tables(state) -> list[tuple[str, dict]]:
    """The hook's per-bucket tables, by the names :meth:`PowerSGD.state_tensors` gives them."""
    return [("error", state.error_dict), ("p", state.p_memory_dict), ("q", state.q_memory_dict)]


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

    def state_tensors(self, buckets: list[list[tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """This rank's compression state as named tensors: ``iter``, the generator's
        (``rng_key``, ``rng_pos``, ``rng_gauss``: numpy's MT19937 state), per bucket i
        ``error.i`` (the error feedback), ``p.i`` and ``q.i`` (the warm start; the hook
        draws a bucket's Q afresh where it has no P), and ``layout``: the rank r and
        ``buckets`` (each bucket's gradient shapes, as the hook sees them), for which they
        were made."""
        state = self.state
        _, key, pos, has_gauss, gauss = state.rng.get_state()
        out = {
            "iter": torch.tensor([state.iter], dtype=torch.int64),
            "rng_key": torch.from_numpy(key.astype(np.int64)),
            "rng_pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
            "rng_gauss": torch.tensor([gauss], dtype=torch.float64),
            "layout": self._layout(buckets),
        }
        for kind, table in _tables(state):
            out.update({f"{kind}.{i}": t for i, t in table.items()})
        return out

    def load_state_tensors(
        self, tensors: dict[str, torch.Tensor], buckets: list[list[tuple[int, ...]]]
    ) -> bool:
        """Continue from :meth:`state_tensors` of this rank; False (nothing loaded) where
        they were made for another rank r or other ``buckets``; UserError naming the first
        key that is missing or not of that form."""
        state = self.state
        for key in (*_SCALARS, "layout"):
            if key not in tensors:
                raise UserError(f"PowerSGD state: no {key!r}")
        if not torch.equal(tensors["layout"], self._layout(buckets)):
            return False
        rng_key, rng_pos = tensors["rng_key"], tensors["rng_pos"]
        if rng_key.shape != (624,) or rng_pos.shape != (2,) or tensors["iter"].numel() != 1:
            raise UserError("PowerSGD state: 'iter', 'rng_key' or 'rng_pos' has another shape")
        tables = dict(_tables(state))
        loaded: dict[str, dict[int, torch.Tensor]] = {kind: {} for kind in tables}
        for name, t in tensors.items():
            kind, _, index = name.partition(".")
            if kind in loaded and index.isdigit():
                loaded[kind][int(index)] = t.to(self.grid.device, copy=True)
            elif name not in (*_SCALARS, "layout"):
                raise UserError(f"PowerSGD state: unknown key {name!r}")
        state.iter = int(tensors["iter"].item())
        state.rng.set_state(
            (
                "MT19937",
                rng_key.numpy().astype(np.uint32),
                int(rng_pos[0]),
                int(rng_pos[1]),
                float(tensors["rng_gauss"].item()),
            )
        )
        for kind, table in tables.items():
            table.clear()
            table.update(loaded[kind])
        return True

    def _layout(self, buckets: list[list[tuple[int, ...]]]) -> torch.Tensor:
        """What the state was made for, as bytes: the rank r and the buckets' shapes."""
        r = self.state.matrix_approximation_rank
        text = json.dumps({"rank": r, "buckets": [[list(s) for s in b] for b in buckets]})
        return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)

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
