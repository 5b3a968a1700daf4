"""Running a pipeline schedule on one pipe rank: its chunks, its messages, its micro-batches.

:class:`Pipeline` executes this rank's program from :func:`gnnpar.pipeline.schedule.program`
op by op: a forward on a chunk takes the micro-batch's input (the data on the first virtual
stage, else the activation received from the previous one), a backward takes the gradient
received from the next one (or the loss on the last); activations and their gradients travel
with :func:`gnnpar.comm.send` / :func:`gnnpar.comm.recv` over the ``pipe`` axis, so they are
counted per axis like every collective. Sends do not block; every send is waited for before
the step returns.

Gradients accumulate over the micro-batches; the data-parallel reduction runs once per chunk,
in the backward of its last micro-batch (``no_sync`` around every other backward).

A tied embedding (:class:`TiedWeight`) lives on the first virtual stage; the last one gets its
values from the first rank at the start of each step and sends back the gradient its head
accumulated, which the first rank adds to its own in its last backward, before the
data-parallel reduction, so both uses count as in one model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gnnpar import comm
from gnnpar.grid import ProcessGrid
from gnnpar.pipeline.schedule import Op, ScheduleError, peak_bound, program, verify

__all__ = ["Pipeline", "StepResult", "TiedWeight"]


@dataclasses.dataclass
class StepResult:
    """What one pipelined step gives back on this rank."""

    #: Sum of the reported losses of the micro-batches (the last pipe rank; 0 elsewhere).
    loss: float
    #: Most chunk passes whose activations this rank held at once (measured).
    peak_in_flight: int
    #: Seconds this rank spent waiting for messages.
    wait_seconds: float


class TiedWeight:
    """A weight shared by the first virtual stage (the token embedding) and the last (the
    head), when they run on different pipe ranks.

    First rank: :meth:`watch` is called with the weight as the embedding uses it in each
    forward; the first such forward of a step sends it to the last rank, and a hook adds the
    gradient received from the last rank into the gradient of its last backward. Last rank:
    :attr:`leaf` is the received copy (the head's weight for the step), whose gradient
    accumulates over the micro-batches.
    """

    def __init__(self, grid: ProcessGrid, shape: Sequence[int], dtype: torch.dtype):
        self.grid = grid
        self.shape = tuple(shape)
        self.dtype = dtype
        self.leaf: torch.Tensor | None = None
        self._extra: torch.Tensor | None = None
        self._send_tag: int | None = None
        self._sends: list[comm.Handle] = []
        self._hooked: list[torch.Tensor] = []
        self._hooks: list[Any] = []

    # ------------------------------------------------------------------- first rank
    def watch(self, weight: torch.Tensor) -> None:
        """The embedding's weight in a forward on the first rank: send it if the step's send
        is due, and hook its gradient (once per tensor)."""
        if self._send_tag is not None:
            peer = self.grid.size("pipe") - 1
            # a copy: the send runs in the background, and a sharded (ZeRO-3) embedding
            # frees its gathered weight after the forward, while the send may still read it
            value = weight.detach().to(self.dtype, copy=True)
            self._sends.append(comm.send(value, self.grid, "pipe", peer, self._send_tag))
            self._send_tag = None
        if weight.requires_grad and not any(t is weight for t in self._hooked):
            self._hooked.append(weight)
            self._hooks.append(weight.register_hook(self._add_extra))

    def _add_extra(self, grad: torch.Tensor) -> torch.Tensor:
        if self._extra is None:
            return grad
        extra, self._extra = self._extra, None
        return grad + extra.to(grad.dtype)

    # ------------------------------------------------------------------- the runtime
    def due_send(self, tag: int) -> None:
        """The weight goes out with the next forward that calls :meth:`watch`."""
        self._send_tag = tag

    def receive(self, value: torch.Tensor, train: bool) -> None:
        """Last rank: the step's copy of the weight."""
        self.leaf = value.requires_grad_(train)

    def grad(self) -> torch.Tensor:
        """Last rank: the gradient the head accumulated this step (zeros if none)."""
        if self.leaf is None or self.leaf.grad is None:
            return torch.zeros(self.shape, dtype=self.dtype, device=self.grid.device)
        return self.leaf.grad

    def add_to_last_backward(self, grad: torch.Tensor) -> None:
        """First rank: add ``grad`` to the weight's gradient in the next backward."""
        self._extra = grad

    def end_step(self) -> None:
        """Wait for the sends and drop the step's hooks and copies."""
        if self._send_tag is not None:
            raise ScheduleError("the tied weight was due to be sent, but no forward used it")
        for h in self._sends:
            h.wait()
        for h in self._hooks:
            h.remove()
        self._sends, self._hooks, self._hooked = [], [], []
        self._extra = None
        self.leaf = None


class Pipeline:
    """This pipe rank's part of a pipelined model: ``chunks[c]`` is virtual stage
    ``c·p + r``. ``schedule``, ``micro_batches`` and ``virtual`` as in
    :func:`gnnpar.pipeline.schedule.program` (verified free of deadlock here, once)."""

    def __init__(
        self,
        grid: ProcessGrid,
        chunks: Sequence[Callable[[torch.Tensor], torch.Tensor]],
        schedule: str,
        micro_batches: int,
        virtual: int = 1,
        tie: TiedWeight | None = None,
    ):
        self.grid = grid
        self.p = grid.size("pipe")
        self.rank = grid.rank("pipe")
        self.chunks = list(chunks)
        if len(self.chunks) != virtual:
            raise ValueError(f"{len(self.chunks)} chunks for {virtual} virtual stages")
        self.schedule, self.m, self.v = schedule, micro_batches, virtual
        self.tie = tie if self.p > 1 else None
        tied = self.tie is not None
        programs = program(schedule, self.p, micro_batches, virtual, tied=tied)
        #: The simulated peak of every rank (the program is checked before it runs).
        self.simulated_peaks = verify(programs)
        self.ops = programs[self.rank]
        self.bound = peak_bound(schedule, self.p, micro_batches, virtual, self.rank)
        self.stages = self.p * virtual

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first virtual stage (the input)."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last virtual stage (the output and loss)."""
        return self.rank == self.p - 1

    def _stage(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    def train_step(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[Any],
        loss_fn: Callable[[torch.Tensor, Any], tuple[torch.Tensor, float]],
        act_shape: Callable[[int], Sequence[int]],
        act_dtype: torch.dtype,
        no_sync: Callable[[int], contextlib.AbstractContextManager] | None = None,
    ) -> StepResult:
        """Forward and backward of the ``m`` micro-batches. ``inputs[i]`` feeds the first
        virtual stage (only read there), ``targets[i]`` the loss on the last, where
        ``loss_fn(output, target)`` gives the loss to differentiate and the value to report.
        ``act_shape(i)`` is the shape of micro-batch ``i``'s activations between stages.
        ``no_sync(c)`` is the context that defers chunk ``c``'s gradient reduction."""
        return self._run(self.ops, inputs, targets, loss_fn, act_shape, act_dtype, no_sync)

    @torch.no_grad()
    def forward(
        self,
        inputs: Sequence[torch.Tensor],
        act_shape: Callable[[int], Sequence[int]],
        act_dtype: torch.dtype,
    ) -> list[torch.Tensor]:
        """The outputs of the last virtual stage for every micro-batch (on the last pipe
        rank; an empty list elsewhere), forward only; any number of micro-batches."""
        n = len(inputs)
        programs = program(self.schedule, self.p, n, self.v, tied=self.tie is not None,
                           forward_only=True)  # fmt: skip
        verify(programs)
        outputs: list[torch.Tensor] = []

        def keep(out: torch.Tensor, target: Any) -> tuple[torch.Tensor, float]:
            outputs.append(out)
            return out, 0.0

        self._run(programs[self.rank], inputs, [None] * n, keep, act_shape, act_dtype, None,
                  train=False)  # fmt: skip
        return outputs

    def _run(
        self,
        ops: list[Op],
        inputs: Sequence[torch.Tensor],
        targets: Sequence[Any],
        loss_fn: Callable[[torch.Tensor, Any], tuple[torch.Tensor, float]],
        act_shape: Callable[[int], Sequence[int]],
        act_dtype: torch.dtype,
        no_sync: Callable[[int], contextlib.AbstractContextManager] | None,
        train: bool = True,
    ) -> StepResult:
        if train and len(inputs) != self.m:
            raise ValueError(f"{len(inputs)} micro-batches for a pipeline of {self.m}")
        last_b = {op.chunk: i for i, op in enumerate(ops) if op.kind == "B"}
        received: dict[tuple[str, int, int], torch.Tensor] = {}
        held: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        sends: list[comm.Handle] = []
        total, peak, waited = 0.0, 0, 0.0
        for i, op in enumerate(ops):
            if op.kind == "recv":
                t0 = time.perf_counter()
                if op.what in ("weight", "tie"):
                    value = comm.recv(self.tie.shape, self.tie.dtype, self.grid, "pipe", op.peer,
                                      op.tag)  # fmt: skip
                    if op.what == "weight":
                        self.tie.receive(value, train)
                    else:
                        self.tie.add_to_last_backward(value)
                else:
                    shape = act_shape(op.mb)
                    value = comm.recv(shape, act_dtype, self.grid, "pipe", op.peer, op.tag)
                    received[(op.what, op.mb, op.chunk)] = value
                waited += time.perf_counter() - t0
            elif op.kind == "send":
                if op.what == "weight":
                    self.tie.due_send(op.tag)
                    continue
                if op.what == "tie":
                    value = self.tie.grad()
                elif op.what == "act":
                    kept = held[(op.mb, op.chunk)] if train else held.pop((op.mb, op.chunk))
                    value = kept[1].detach().to(act_dtype)
                else:
                    value = held.pop((op.mb, op.chunk))[0].grad.to(act_dtype)
                sends.append(comm.send(value, self.grid, "pipe", op.peer, op.tag))
            elif op.kind == "F":
                s = self._stage(op.chunk)
                if s == 0:
                    x = inputs[op.mb]
                else:
                    x = received.pop(("act", op.mb, op.chunk)).requires_grad_(train)
                    # the input's gradient leaves in act_dtype whatever the chunk computes in
                out = self.chunks[op.chunk](x)
                if s == self.stages - 1:
                    loss, value = loss_fn(out, targets[op.mb])
                    total += float(value)
                    out = loss
                if train or s < self.stages - 1:  # kept for backward, or to be sent
                    held[(op.mb, op.chunk)] = (x if s > 0 and train else None, out)
                    peak = max(peak, len(held))
            else:  # "B"
                s = self._stage(op.chunk)
                x, out = held[(op.mb, op.chunk)]
                quiet = no_sync is not None and i != last_b[op.chunk]
                with no_sync(op.chunk) if quiet else contextlib.nullcontext():
                    if s == self.stages - 1:
                        out.backward()
                    else:
                        out.backward(received.pop(("grad", op.mb, op.chunk)).to(out.dtype))
                if s == 0:
                    del held[(op.mb, op.chunk)]
                else:  # the input's gradient leaves with the next op
                    held[(op.mb, op.chunk)] = (x, None)
            # sends that finished free their buffers now, not at the end of the step
            sends = [h for h in sends if not h.is_completed()]
        for h in sends:
            h.wait()
        if self.tie is not None:
            self.tie.end_step()
        return StepResult(total, peak, waited)
