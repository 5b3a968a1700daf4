"""Stages 0–2: gradients reduced in buckets from backward hooks, overlapping backward.

The trainable parameters are cut into buckets of about ``bucket_bytes``, in reverse order of
registration (the order in which backward produces their gradients) and never across a
unit boundary. A hook on every parameter (``register_post_accumulate_grad_hook``) copies its
gradient into its bucket; when a bucket is full it is launched as an asynchronous collective
over the data axis while backward goes on with the layers below. Buckets are launched strictly
in order (a full bucket waits for the ones before it), so every rank issues the same
collectives in the same order. At the end of backward (an autograd callback) the remaining
buckets are launched (parameters that got no gradient count as zero), every collective is
waited for, and the results are written where the optimizer reads them.

- **stage 0**: all-reduce; the parameters' ``.grad`` are views of the bucket buffers, so
  the result lands where any optimizer on the model's parameters reads it (DDP's
  ``gradient_as_bucket_view``).
- **stage 1**: reduce-scatter into this rank's master chunk of the bucket; the full gradient
  buffers stay allocated (ZeRO-1 keeps full gradients and shards the optimizer state).
- **stage 2**: reduce-scatter as stage 1, but each bucket's buffer exists only between its
  first gradient and the end of its reduce-scatter, and the parameters' ``.grad`` are freed as
  soon as they are copied (ZeRO-2).

After an optimizer step on the master pieces, stages 1–2 all-gather every bucket's chunks back
into the model's parameters (:meth:`GradBuckets.gather_params`).

Gradients are averaged over the data axis — and over z for the parameters that a
tensor-parallel model replicates over z (their gradients differ per z rank) — so
each rank's loss should be the mean over its part of the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gnnpar import comm, grad_destination
from gnnpar.grid import ProcessGrid
from gnnpar.shard.flat import FlatGroup, Slot

__all__ = ["Bucket", "GradBuckets", "build_buckets"]

#: Bucket reductions allowed in flight during backward.
MAX_INFLIGHT_BUCKETS = 2


def _queue_callback(fn) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class Bucket:
    """Some trainable parameters whose gradients travel in one collective."""

    def __init__(
        self,
        index: int,
        group: FlatGroup,
        stage: int,
        reduce_dtype: torch.dtype,
        param_dtype: torch.dtype,
    ):
        self.index = index
        self.group = group
        self.stage = stage
        self.reduce_dtype = reduce_dtype
        self.slot_of = {id(s.param): s for s in group.slots}
        self.ready: set[int] = set()
        self.buffer: torch.Tensor | None = None
        self.handle: comm.Handle | None = None
        self.launched = False
        # Gradients are views of the bucket buffer when no cast separates them (stages 0-1).
        self.grad_views = stage in (0, 1) and param_dtype == reduce_dtype

    def _buffer(self) -> torch.Tensor:
        if self.buffer is None:
            n = self.group.padded if self.stage > 0 else self.group.numel
            self.buffer = torch.zeros(n, dtype=self.reduce_dtype, device=self.group.device)
        return self.buffer

    def take(self, param: nn.Parameter) -> None:
        """Move ``param.grad`` into the bucket buffer."""
        slot = self.slot_of[id(param)]
        buf = self._buffer()
        view = buf[slot.offset : slot.offset + slot.numel].view(slot.shape)
        grad = param.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
        elif grad is None:
            view.zero_()
        if self.grad_views:
            param.grad = view
        else:
            param.grad = None
        self.ready.add(id(param))

    def destination(self, param: nn.Parameter) -> torch.Tensor | None:
        """A view of the buffer in ``param``'s shape for its next gradient, or None when
        the gradients are not views of the buffer or the reduction has started."""
        if not self.grad_views or self.launched:
            return None
        slot = self.slot_of[id(param)]
        return self._buffer()[slot.offset : slot.offset + slot.numel].view(slot.shape)

    @property
    def full(self) -> bool:
        """Every parameter of the bucket has delivered its gradient."""
        return len(self.ready) == len(self.group.slots)

    def launch(
        self, scale: float, order: str = "ring", powersgd: Any = None, last: bool = False
    ) -> None:
        """Start the asynchronous reduction over the group's data axis (missing gradients
        count as zero), its sum in ``order`` (:data:`gnnpar.comm.ORDERS`); at stage 0 with
        ``powersgd`` (:class:`gnnpar.shard.powersgd.PowerSGD`), through its hook (``last``:
        the step's last bucket)."""
        grid = self.group.grid
        buf = self._buffer()
        for s in self.group.slots:
            if id(s.param) not in self.ready:
                buf[s.offset : s.offset + s.numel].zero_()
                if self.grad_views:
                    s.param.grad = buf[s.offset : s.offset + s.numel].view(s.shape)
        g = self.group
        if g.z_start < g.numel and grid.size("z") > 1:
            comm.all_reduce(buf[g.z_start : g.numel], grid, "z")
        if self.stage == 0 and powersgd is not None and grid.size("data") > 1:
            # the hook returns the mean over data: scale so that it is the sum over scale
            if scale != grid.size("data"):
                buf.mul_(grid.size("data") / scale)
            views = [buf[s.offset : s.offset + s.numel].view(powersgd.shape_of(s)) for s in g.slots]
            self.handle = powersgd.all_reduce(self.index, last, buf, views)
            self.launched = True
            return
        if scale != 1:
            buf.div_(scale)
        if self.stage == 0:
            self.handle = comm.all_reduce(buf, grid, "data", async_op=True, order=order)
        else:
            self.handle = comm.reduce_scatter(buf, grid, "data", async_op=True, order=order)
        self.launched = True

    def finish(self) -> None:
        """Wait for the reduction and hand the result to the optimizer's parameters."""
        if self.handle is None:
            return
        out = self.handle.wait()
        self.handle = None
        g = self.group
        if self.stage == 0:
            if g.pieces:  # mixed precision: separate master copies hold the gradient now
                g.set_grad(out)
                self.buffer.zero_()
            elif not self.grad_views:
                for s in g.slots:
                    piece = out[s.offset : s.offset + s.numel].view(s.shape).to(s.param.dtype)
                    s.param.grad = piece
        else:
            g.set_grad(out, owned=out.data_ptr() != self.buffer.data_ptr())
            if self.stage == 2:
                self.buffer = None
            else:
                self.buffer.zero_()
        self.ready.clear()
        self.launched = False


class GradBuckets:
    """The bucketed gradient reduction of stages 0–2 (see the module docstring)."""

    def __init__(
        self,
        grid: ProcessGrid,
        stage: int,
        buckets: list[Bucket],
        scale: float,
        order: str = "ring",
        powersgd=None,
        release: Callable[[torch.Tensor], None] | None = None,
    ):
        self.grid = grid
        #: gives back a master chunk's resident file pages once gathered (the file tier)
        self.release = release
        self.stage = stage
        self.buckets = buckets
        self.scale = scale
        self.reduce_order = order  # of the data axis's sum (gnnpar.comm.ORDERS)
        self.powersgd = powersgd  # stage 0's compression (gnnpar.shard.powersgd), or None
        self.divisor = scale  # the average's; scale drops the data size when the loss has it
        self.sync = True
        self._next = 0
        self._done = 0
        self._in_backward = False
        self._hooks = []
        self._bucket_of: dict[int, Bucket] = {}
        for b in buckets:
            for s in b.group.slots:
                self._bucket_of[id(s.param)] = b
                self._hooks.append(s.param.register_post_accumulate_grad_hook(self._on_grad))
                grad_destination.offer(s.param, functools.partial(self._destination, s.param))
        self._gathered_versions = [b.group.version for b in buckets]

    # --------------------------------------------------------------------------- backward
    def _destination(self, param: nn.Parameter) -> torch.Tensor | None:
        if not self.sync or param.grad is not None:
            return None  # no_sync accumulates in .grad; a second contribution adds to it
        return self._bucket_of[id(param)].destination(param)

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.sync:
            return  # no_sync: the gradient stays in param.grad and accumulates there
        if not self._in_backward:
            self._in_backward = True
            _queue_callback(self._end_of_backward)
        bucket = self._bucket_of[id(param)]
        bucket.take(param)
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            self._launch(self.buckets[self._next])
            self._next += 1
        # Bound the reductions in flight at stages 1-2, where each holds a bucket-sized
        # transient until it finishes (measured: unbounded, stage 1's backward peak on 4 ranks
        # grows by 164 MB for 71M parameters); stage 0 all-reduces its persistent buffers in
        # place, and waiting here would only stall backward behind the network.
        while self.stage > 0 and self._next - self._done > MAX_INFLIGHT_BUCKETS:
            self.buckets[self._done].finish()
            self._done += 1

    def _launch(self, bucket: Bucket) -> None:
        last = bucket is self.buckets[-1]
        bucket.launch(self.scale, self.reduce_order, self.powersgd, last)

    def _end_of_backward(self) -> None:
        try:
            for b in self.buckets[self._next :]:
                self._launch(b)
            for b in self.buckets[self._done :]:
                b.finish()
        finally:
            self._next = 0
            self._done = 0
            self._in_backward = False

    # ------------------------------------------------------------------------ parameters
    def stale(self) -> bool:
        """Whether an optimizer has changed some master chunk since the last gather."""
        return any(
            b.group.version != v for b, v in zip(self.buckets, self._gathered_versions, strict=True)
        )

    @torch.no_grad()
    def gather_params(self) -> None:
        """Bring the model's parameters up to date with the master chunks: all-gather each
        bucket's chunks (stages 1–2) or copy the masters (stage 0 with mixed precision).

        At most ``MAX_INFLIGHT_BUCKETS + 1`` gathers are in flight: each returns a full
        bucket, so launching all at once would hold a second copy of every parameter."""
        pending: list[tuple[Bucket, comm.Handle]] = []

        def land(b: Bucket, handle: comm.Handle) -> None:
            full = handle.wait()
            for s, view in zip(b.group.slots, b.group.views(full), strict=False):
                s.param.copy_(view)
            if self.release is not None:
                self.release(b.group.master)

        for b in self.buckets:
            g = b.group
            if not g.pieces and self.stage == 0:
                continue
            dtype = g.slots[0].param.dtype
            send = g.send(dtype)
            if self.stage == 0:
                pending.append((b, comm.Handle(None, lambda s=send: s, "local")))
            else:
                pending.append((b, comm.all_gather(send, g.grid, "data", async_op=True)))
            if len(pending) > MAX_INFLIGHT_BUCKETS:
                land(*pending.pop(0))
        for b, handle in pending:
            land(b, handle)
        self._gathered_versions = [b.group.version for b in self.buckets]

    def remove_hooks(self) -> None:
        """Detach the backward hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for b in self.buckets:
            for s in b.group.slots:
                grad_destination.clear(s.param)


def build_buckets(
    slots: list[Slot],
    unit_of: dict[int, int],
    view_of: Callable[[Slot], ProcessGrid],
    stage: int,
    bucket_bytes: int,
    master_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    param_dtype: torch.dtype,
    alloc=None,
) -> list[Bucket]:
    """Trainable ``slots`` cut into buckets (reverse registration order; a new bucket at each
    unit boundary and after ``bucket_bytes``); each bucket is sharded and reduced over the
    data axis of ``view_of(slot)`` (the same for every slot of a unit). ``master_dtype`` None
    (stage 0 without mixed precision) creates no master copies: the model's parameters are the
    optimizer's.
    ``param_dtype`` is the dtype the model's parameters have during training; ``alloc`` places
    the master chunks (an offload tier's)."""
    chosen: list[list[Slot]] = []
    size, unit = 0, None
    for s in reversed(slots):
        nbytes = s.numel * torch.empty((), dtype=reduce_dtype).element_size()
        u = unit_of.get(id(s.param))
        if not chosen or u != unit or (size + nbytes > bucket_bytes and size > 0):
            chosen.append([])
            size = 0
        chosen[-1].append(s)
        size += nbytes
        unit = u
    out = []
    for i, group_slots in enumerate(chosen):
        values = [s.param.detach() for s in group_slots]
        grid = view_of(group_slots[0])
        world = grid.size("data") if stage > 0 else 1
        rank = grid.rank("data") if stage > 0 else 0
        group = FlatGroup(group_slots, world, rank, master_dtype, grid.device, values, True, alloc)
        group.grid = grid
        out.append(Bucket(i, group, stage, reduce_dtype, param_dtype))
    return out
