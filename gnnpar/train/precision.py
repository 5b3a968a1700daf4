"""The one precision option of every task, ``mixed_precision = none | bf16 | fp16``, with the
master precision (``dtype``) and the gradient-reduction precision (``reduce_dtype``), turned
into a :class:`gnnpar.shard.MixedPrecision` policy; and the dynamic loss scaling that fp16
needs (bf16 has float32's exponent range and needs none).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gnnpar.shard.clip import scale_grads_

__all__ = ["LossScaler", "compute_dtype", "full_precision", "master_dtype", "shard_policy"]

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def full_precision(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least float32 (losses of low-precision logits are computed in fp32;
    float64 stays float64)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def master_dtype(cfg: Any) -> torch.dtype:
    """The dtype of the master weights and the optimizer state (``cfg.dtype``)."""
    return _DTYPES[cfg.dtype]


def compute_dtype(cfg: Any) -> torch.dtype:
    """The dtype of parameters, activations and compute in forward and backward."""
    return master_dtype(cfg) if cfg.mixed_precision == "none" else _DTYPES[cfg.mixed_precision]


def shard_policy(cfg: Any):
    """The :class:`~gnnpar.shard.MixedPrecision` policy of ``cfg`` (None: everything in the
    master dtype). With mixed precision, gradients are reduced in fp32 unless
    ``reduce_dtype`` says otherwise."""
    from gnnpar.shard import MixedPrecision

    reduce = getattr(cfg, "reduce_dtype", None)
    if cfg.mixed_precision == "none" and reduce is None:
        return None
    if cfg.mixed_precision == "none":
        return MixedPrecision(reduce_dtype=_DTYPES[reduce], master_dtype=master_dtype(cfg))
    return MixedPrecision(
        param_dtype=compute_dtype(cfg),
        reduce_dtype=_DTYPES[reduce or "fp32"],
        master_dtype=master_dtype(cfg),
    )


class LossScaler:
    """Dynamic loss scaling for fp16 (a no-op otherwise): the loss is multiplied by
    ``scale`` before backward and the gradients divided by it before the step; a step whose
    gradients hold an inf or NaN is skipped and the scale halved, and after ``interval``
    good steps in a row the scale doubles. Every rank decides the same (the gradient norm
    is global)."""

    def __init__(self, enabled: bool, init: float = 2.0**16, interval: int = 2000):
        self.enabled = enabled
        self.scale = init if enabled else 1.0
        self.interval = interval
        self.good = 0
        self.skipped = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on."""
        return loss * self.scale if self.enabled else loss

    def unscale(self, params) -> None:
        """Divide the gradients of ``params`` by the scale (one foreach multiply by its
        inverse: the scale is a power of two, so the same bits as dividing)."""
        if self.enabled:
            scale_grads_(params, torch.tensor(1.0 / self.scale, dtype=torch.float64))

    def update(self, grad_norm: float) -> bool:
        """Record the step's gradient norm; return whether the optimizer may step."""
        if not self.enabled:
            return True
        if not math.isfinite(grad_norm):
            self.scale /= 2.0
            self.good = 0
            self.skipped += 1
            return False
        self.good += 1
        if self.good >= self.interval:
            self.scale *= 2.0
            self.good = 0
        return True

    def state(self) -> dict[str, float]:
        """JSON-ready state (checkpointed with the trainer's)."""
        return {"scale": self.scale, "good": self.good, "skipped": self.skipped}

    def load(self, state: dict[str, float]) -> None:
        """Restore :meth:`state`."""
        if state:
            self.scale = float(state["scale"])
            self.good, self.skipped = int(state["good"]), int(state["skipped"])
