"""Activation checkpointing: what a layer keeps for backward is recomputed instead.

``activation_checkpointing`` takes one of :data:`MODES`:

- ``"none"``: every activation that backward needs is kept from forward.
- ``"full"``: only a block's input is kept; backward runs the block's forward again (all of
  it: its collectives too, accounted by :func:`gnnpar.comm.record` like the first time) and
  takes what it needs from that run. The memory of a transformer block drops from every
  intermediate tensor to its input; the compute grows by one forward.
- ``"selective"`` (transformer blocks): only the attention core (``softmax(QKᵀ)·V`` with its
  scores, softmax and attention dropout, whose memory grows with the square of the sequence)
  is recomputed, as Megatron-LM's selective recomputation (Korthikanti et al., 2022). The
  outputs of the linear layers, the layer norms and the GELU stay kept: each is what the next
  linear layer saves for its weight gradient, so recomputing one would run that layer and its
  collectives again. Nothing is communicated twice.

Both use PyTorch's non-reentrant :func:`torch.utils.checkpoint.checkpoint`: the recompute
runs inside backward with the random-number state of the forward (the same dropout masks) and
its module hooks fire again, which is how a ZeRO-3 unit is gathered again for it
(:mod:`gnnpar.shard.zero3`). Code that must behave differently inside backward (no forward
prefetching there) asks :func:`in_backward`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from gnnpar.errors import UserError

__all__ = ["MODES", "check_mode", "in_backward", "recompute"]

MODES = ("none", "full", "selective")


def check_mode(mode: str, allowed: tuple[str, ...] = MODES) -> str:
    """``mode`` if it is one of ``allowed``, else a ``ValueError`` naming them."""
    if mode not in allowed:
        raise UserError(
            f"activation_checkpointing must be one of {', '.join(allowed)}, got {mode!r}"
        )
    return mode


def recompute(fn: Callable[..., Any], *args: Any, enabled: bool = True) -> Any:
    """``fn(*args)``, whose saved tensors are dropped after forward and recomputed by calling
    ``fn(*args)`` again in backward (when ``enabled`` and gradients are being recorded)."""
    if not enabled or not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)


def in_backward() -> bool:
    """Whether autograd's backward pass is running on this thread (a recompute runs there)."""
    return torch._C._current_graph_task_id() != -1
