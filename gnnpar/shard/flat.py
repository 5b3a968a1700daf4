"""Flat groups: several parameters laid end to end in one buffer and cut into equal shards.

A :class:`FlatGroup` is the unit of communication of the sharded stages: a gradient bucket
(stages 1–2) or the trainable or frozen parameters of one unit (stage 3). Its ``numel``
elements are padded with zeros to a multiple of the data-axis size ``p`` and cut into ``p``
chunks of ``chunk = padded / p`` elements; rank ``r`` owns elements ``[r·chunk, (r+1)·chunk)``.
A parameter may straddle two chunks: each rank's part of it is a *piece*, a 1-D
``nn.Parameter`` that is a view of the rank's master chunk, so an optimizer stepping the
pieces writes straight into the chunk that the next all-gather sends. Pieces of no elements
are not created, so a rank only gives its optimizer what it owns.

Within a group, parameters whose gradient must also be summed over z (biases, norms and
plain parameters of a tensor-parallel model, which the tensor layers leave unreduced over z)
are placed last, so that their gradients form one contiguous tail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["FlatGroup", "ParamSlice", "Slot"]


@dataclasses.dataclass(eq=False)
class Slot:
    """One parameter of the model, wherever it appears.

    ``name`` is its first state-dict key; ``refs`` every ``(module, attribute)`` that holds it
    (tied parameters have several); ``shape`` the shape of the tensor this rank holds before
    data-axis sharding (for a tensor-parallel layer, its piece); ``z_reduce`` whether its
    gradient is summed over z; ``offset`` its start within its flat group.
    """

    name: str
    refs: list[tuple[nn.Module, str]]
    shape: torch.Size
    dtype: torch.dtype
    trainable: bool
    z_reduce: bool = False
    offset: int = 0
    param: nn.Parameter | None = None  # the original parameter object
    aliases: list[str] = dataclasses.field(default_factory=list)  # every state-dict key
    layout: Any = None  # the tensor-parallel ShardLayout, if a ShardedModule holds it
    owner: nn.Module | None = None  # that ShardedModule
    owner_attr: str = ""
    #: Held by this rank's expert coordinate only (a mixture of experts' experts): reduced
    #: and sharded over the ranks with the same experts, not over the expert axis.
    expert: bool = False

    @property
    def numel(self) -> int:
        """Elements of the parameter."""
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclasses.dataclass(eq=False)
class ParamSlice:
    """This rank's part of a parameter: elements ``[start, stop)`` of the flattened parameter,
    at ``chunk_offset`` in this rank's chunk."""

    slot: Slot
    start: int
    stop: int
    chunk_offset: int
    param: nn.Parameter

    @property
    def numel(self) -> int:
        """Elements of the piece."""
        return self.stop - self.start


class FlatGroup:
    """Parameters laid end to end, padded to a multiple of ``world`` and cut into ``world``
    equal chunks; this rank (index ``rank``) owns one chunk as a master buffer of
    ``master_dtype`` whose pieces are the parameters an optimizer steps.

    ``values`` (the current value of every slot, in slot order) initialises the master chunk.
    With ``master_dtype`` None the group is a layout only (no master chunk, no pieces).
    ``alloc(numel, dtype)`` gives a zeroed master chunk somewhere other than ``device`` (an
    offload tier, :mod:`gnnpar.shard.offload`).
    """

    def __init__(
        self,
        slots: list[Slot],
        world: int,
        rank: int,
        master_dtype: torch.dtype | None,
        device: torch.device,
        values: list[torch.Tensor],
        trainable: bool,
        alloc: Callable[[int, torch.dtype], torch.Tensor] | None = None,
    ):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"bad shard rank {rank} of {world}")
        # z-reduced parameters last: their gradients then form one contiguous tail.
        order = sorted(range(len(slots)), key=lambda i: slots[i].z_reduce)
        self.slots = [slots[i] for i in order]
        values = [values[i] for i in order]
        offset = 0
        for s in self.slots:
            s.offset = offset
            offset += s.numel
        self.numel = offset
        self.world, self.rank = world, rank
        self.chunk = -(-self.numel // world) if self.numel else 0
        self.padded = self.chunk * world
        self.lo, self.hi = rank * self.chunk, (rank + 1) * self.chunk
        self.z_start = next((s.offset for s in self.slots if s.z_reduce), self.numel)
        self.trainable = trainable
        self.device = device
        #: The grid view whose data axis this group is sharded over (set by its maker).
        self.grid: Any = None
        self.pieces: list[ParamSlice] = []
        if master_dtype is None:
            self.master = torch.zeros(0, device=device)
            return
        if alloc is None:
            self.master = torch.zeros(self.chunk, dtype=master_dtype, device=device)
        else:
            self.master = alloc(self.chunk, master_dtype)
        with torch.no_grad():
            for s, v in zip(self.slots, values, strict=True):
                a, b = max(self.lo, s.offset), min(self.hi, s.offset + s.numel)
                if a >= b:
                    continue
                flat = v.detach().reshape(-1)
                part = flat[a - s.offset : b - s.offset]
                self.master[a - self.lo : b - self.lo].copy_(part)
                param = nn.Parameter(self.master[a - self.lo : b - self.lo], trainable)
                self.pieces.append(ParamSlice(s, a - s.offset, b - s.offset, a - self.lo, param))

    def add_empty_piece(self) -> None:
        """Give this rank an empty piece of the first parameter (for a rank that owns no
        element of the model at all: an optimizer refuses an empty parameter list)."""
        if self.slots:
            param = nn.Parameter(self.master[:0], self.trainable)
            self.pieces.append(ParamSlice(self.slots[0], 0, 0, 0, param))

    # ------------------------------------------------------------------------ layout
    def slot_range(self, slot: Slot) -> tuple[int, int]:
        """``[start, stop)`` of ``slot`` in the flat buffer."""
        return slot.offset, slot.offset + slot.numel

    def views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Each slot's tensor (in its shape) as a view of the full flat buffer ``full``."""
        sizes = [s.numel for s in self.slots]
        tail = full.numel() - self.numel
        parts = full.split([*sizes, tail]) if tail else full.split(sizes)
        return [p.view(s.shape) for p, s in zip(parts, self.slots, strict=False)]

    def flatten(self, tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The padded flat buffer (``padded`` elements) of one tensor per slot."""
        out = torch.zeros(self.padded, dtype=dtype, device=self.device)
        for s, t in zip(self.slots, tensors, strict=True):
            out[s.offset : s.offset + s.numel].copy_(t.reshape(-1))
        return out

    def send(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The master chunk as the parameter all-gather sends it: on the group's device, in
        ``dtype`` (default the master's); the chunk itself when nothing changes."""
        return self.master.to(self.device, dtype or self.master.dtype)

    @property
    def version(self) -> int:
        """Version counter of the master chunk (changes whenever an optimizer writes it)."""
        return self.master._version

    # ------------------------------------------------------------------------- grads
    def set_grad(self, shard_grad: torch.Tensor, owned: bool = False) -> None:
        """Add this rank's reduced gradient chunk to the pieces' gradients (assigning views of
        one buffer where the optimizer has set them to ``None``). ``owned``: nobody else uses
        ``shard_grad``, so it may become that buffer."""
        # to the master's memory: the host with an offload tier, else a no-op
        g = shard_grad.to(self.master.device, self.master.dtype)
        if all(p.param.grad is None for p in self.pieces):
            # The pieces' gradients are views of one buffer, which lives as long as they do
            # (an optimizer's zero_grad frees it).
            buf = g if owned or g.data_ptr() != shard_grad.data_ptr() else g.clone()
            for p in self.pieces:
                p.param.grad = buf[p.chunk_offset : p.chunk_offset + p.numel]
            return
        for p in self.pieces:
            part = g[p.chunk_offset : p.chunk_offset + p.numel]
            if p.param.grad is None:
                p.param.grad = part.clone()
            else:
                p.param.grad.add_(part)

    def nbytes(self) -> int:
        """Bytes of the master chunk."""
        return self.master.numel() * self.master.element_size()
