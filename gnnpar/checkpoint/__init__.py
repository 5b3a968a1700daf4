"""The one checkpoint format of gnnpar, for every workload and every parallelism.

A checkpoint is a folder per step whose manifest records, for every full tensor of the plain
model and of the optimizer state, which part of it each rank file holds (the *global
layout*). So any checkpoint loads onto any grid, process count and ZeRO stage — each rank
reading only the stored parts that overlap its own — and consolidates offline into one plain
state dict. Files are checked against their sizes and checksums before use, and read with
``torch.load(weights_only=True)``: nothing but tensors is ever unpickled. See
``docs/checkpoints.md`` for the format, field by field.

::

    from gnnpar import checkpoint
    checkpoint.save("runs/x/checkpoints", step, grid, model, optimizer, extra={...})
    found = checkpoint.load("runs/x/checkpoints", grid, model, optimizer)   # None if empty
    state = checkpoint.consolidate("runs/x/checkpoints")                    # plain state dict
"""

from gnnpar.checkpoint.consolidate import consolidate, consolidate_inputs, describe, open_checkpoint
from gnnpar.checkpoint.protocol import CheckpointError, complete_steps
from gnnpar.checkpoint.store import LoadResult, load, save
from gnnpar.verified import FormatError

__all__ = [
    "CheckpointError",
    "FormatError",
    "LoadResult",
    "complete_steps",
    "consolidate",
    "consolidate_inputs",
    "describe",
    "load",
    "open_checkpoint",
    "save",
]
