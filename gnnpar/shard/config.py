"""Typed options of :func:`gnnpar.shard.shard`: the mixed-precision policy and FCDP."""

from __future__ import annotations

import dataclasses

import torch

from gnnpar.errors import UserError

__all__ = ["FCDP", "OFFLOAD_MODES", "STAGES", "MixedPrecision"]

#: The sharding stages: 0 = bucketed all-reduce (DDP), 1 = optimizer state sharded (ZeRO-1),
#: 2 = + gradients (ZeRO-2), 3 = + parameters (ZeRO-3 / FSDP).
STAGES = (0, 1, 2, 3)
CACHE_MODES = ("slice", "full")
#: Where the optimizer's masters, state and step live (:mod:`gnnpar.shard.offload`): on the
#: device, in host memory (ZeRO-Offload), or in memory-mapped files (ZeRO-Infinity style).
OFFLOAD_MODES = ("none", "host", "file")


def _check_dtype(name: str, value: object, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise UserError(f"MixedPrecision.{name} must be a floating torch.dtype, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Mixed-precision policy.

    Attributes:
        param_dtype: dtype of the parameters used in forward and backward (gathered in this
            dtype, so it is also the all-gather's); ``None`` keeps the master dtype.
        reduce_dtype: dtype of the gradient reduction (all-reduce or reduce-scatter);
            ``None`` uses ``param_dtype``.
        master_dtype: dtype of the master weights that the optimizer updates (and of its
            state), one per rank's shard.
        output_dtype: cast the model's floating outputs to this dtype (``None``: leave them).
        cast_forward_inputs: cast the model's floating inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    master_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        _check_dtype("param_dtype", self.param_dtype)
        _check_dtype("reduce_dtype", self.reduce_dtype)
        _check_dtype("master_dtype", self.master_dtype, optional=False)
        _check_dtype("output_dtype", self.output_dtype)

    def compute(self) -> torch.dtype:
        """The dtype of forward and backward."""
        return self.param_dtype or self.master_dtype

    def reduce(self) -> torch.dtype:
        """The dtype of the gradient reduction."""
        return self.reduce_dtype or self.compute()


@dataclasses.dataclass(frozen=True)
class FCDP:
    """Fully-cached data parallelism on top of stage 3.

    After a unit's forward its gathered parameters stay cached; in backward the unit is
    rebuilt from the cache instead of a second all-gather over the whole data axis.

    Attributes:
        cache: ``"slice"`` — each rank keeps its node-local slice (1/k of the unit for k data
            ranks per node) and backward rebuilds the unit with an all-gather inside the node;
            ``"full"`` — each rank keeps the whole unit and backward needs no communication.
            Frozen parameters (``requires_grad=False`` when :func:`~gnnpar.shard.shard` is
            called) are always cached whole, once, and never communicated again.
        device_budget_bytes: bytes of cache that may stay in device memory; entries beyond
            it go to host memory (pinned when the device is a GPU). On a CPU-only run both
            are the same memory; the placement is still reported.
        pin_memory: pin host cache buffers (only matters with CUDA).
    """

    cache: str = "slice"
    device_budget_bytes: int = 0
    pin_memory: bool = True

    def __post_init__(self) -> None:
        if self.cache not in CACHE_MODES:
            raise UserError(f"FCDP.cache must be one of {CACHE_MODES}, got {self.cache!r}")
        if not isinstance(self.device_budget_bytes, int) or self.device_budget_bytes < 0:
            raise UserError(
                "FCDP.device_budget_bytes must be a non-negative integer, got "
                f"{self.device_budget_bytes!r}"
            )
