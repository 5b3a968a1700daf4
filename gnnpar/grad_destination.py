"""Where a parameter's next gradient may be written in place: the offer a data-parallel
gradient bucket (:mod:`gnnpar.shard.buckets`) attaches to a parameter, and the one function
a layer calls to read it (the tensor-parallel ``Linear`` computes ``dW`` there, ``out=``).
It lives below both, so neither imports the other."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["clear", "grad_destination", "offer"]

#: The attribute a bucketed parameter carries while the hooks are on: a callable returning
#: where its next gradient may be written.
_ATTRIBUTE = "_gnnpar_grad_destination"


def offer(param: torch.Tensor, where: Callable[[], torch.Tensor | None]) -> None:
    """Let layers write ``param``'s next gradient where ``where()`` says (None: nowhere)."""
    setattr(param, _ATTRIBUTE, where)


def clear(param: torch.Tensor) -> None:
    """Withdraw :func:`offer` (no-op without one)."""
    if hasattr(param, _ATTRIBUTE):
        delattr(param, _ATTRIBUTE)


def grad_destination(param: torch.Tensor) -> torch.Tensor | None:
    """Where ``param``'s next gradient may be computed in place, or None: a view of its
    bucket's buffer in ``param``'s shape, when the bucket keeps the gradients as views of it
    (stages 0-1 without a cast), this backward reduces (not under ``no_sync``) and ``param``
    has no gradient yet. A layer whose backward makes a parameter's whole gradient in one
    product writes it there (``out=``): autograd then keeps that view as the gradient, and
    the bucket's copy of it is saved."""
    fn = getattr(param, _ATTRIBUTE, None)
    return None if fn is None else fn()
