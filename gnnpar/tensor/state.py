"""Parameters of a tensor-parallel model: full ↔ sharded state dicts and checkpoint layouts.
(The data-axis gradient reduction and the gradient norm of a tensor-parallel model are
:mod:`gnnpar.shard`'s: ``shard(model, grid, stage=0)`` and ``ShardedModel.clip_grad_norm_``.)"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from gnnpar import comm
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid
from gnnpar.tensor.layers import ShardedModule
from gnnpar.tensor.layout import ShardLayout

__all__ = [
    "full_state_dict",
    "gather_full",
    "load_full_state_dict",
    "local_numel",
    "sharded_parameters",
]


def sharded_parameters(model: nn.Module) -> dict[str, tuple[ShardedModule, str, ShardLayout]]:
    """Every state-dict key of ``model`` that names a sharded parameter → (module, local
    parameter name, layout). Tied parameters appear under each of their names; a weight a
    module only borrows (a pipeline stage's tied head, not among its parameters) is left out."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, ShardedModule):
            for pname, layout in module.layouts().items():
                if pname not in module._parameters:
                    continue
                out[f"{prefix}.{pname}" if prefix else pname] = (module, pname, layout)
    return out


def _unique_params(model: nn.Module) -> Iterator[nn.Parameter]:
    seen = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield p


def gather_full(piece: torch.Tensor, layout: ShardLayout, grid: ProcessGrid) -> torch.Tensor:
    """The full tensor from every rank's ``piece`` (a parameter or its gradient), on every rank
    (collective over the tensor axes)."""
    layout.check_grid(grid)
    r, c, _ = layout.coords(grid)
    if layout.kind == "matrix":
        flat = comm.all_gather(piece.detach().contiguous(), grid, "z")
        blk = layout.unflatten(flat, r, c)
        blk = comm.all_gather(blk, grid, layout.col_axis, dim=1, sizes=layout.col_sizes())
    else:
        blk = piece.detach()
    blk = comm.all_gather(blk, grid, layout.row_axis, dim=0, sizes=layout.row_sizes())
    return blk.index_select(0, layout.row_order().to(blk.device)) if layout.fused > 1 else blk


def full_state_dict(model: nn.Module, grid: ProcessGrid) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded parameter gathered to its full tensor, in the
    format of the module it replaced, so it loads into the plain model. Collective: every rank
    calls it and gets the same result (data-axis replicas hold the same pieces)."""
    sharded = sharded_parameters(model)
    cache: dict[int, torch.Tensor] = {}
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if key in sharded:
            module, pname, layout = sharded[key]
            if id(value) not in cache:
                full = gather_full(value, layout, grid)
                cache[id(value)] = module.to_full_format(pname, full)
            out[key] = cache[id(value)]
        else:
            out[key] = value.detach().clone()
    return out


def _full_shape(src: Any) -> tuple[int, ...]:
    """Shape of a full tensor or of a lazy one (a safetensors slice has ``get_shape``)."""
    shape = src.shape if hasattr(src, "shape") else src.get_shape()
    return tuple(int(n) for n in shape)


def _read_all(src: Any) -> torch.Tensor:
    if isinstance(src, torch.Tensor):
        return src
    return src[tuple(slice(0, n) for n in _full_shape(src))]


def load_full_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], grid: ProcessGrid, strict: bool = True
) -> None:
    """Load a full (plain-model) state dict into a parallel ``model``: each rank keeps its
    pieces. No communication.

    A value may be a tensor or anything that reads a box of the full tensor by indexing with
    slices (a memory-mapped tensor from ``torch.load(..., mmap=True)``, a safetensors
    ``get_slice``): sharded parameters read only this rank's boxes, straight into the pieces,
    so a pretrained model loads slice by slice. Keys and shapes are checked before anything is
    written (with ``strict``, missing or unexpected keys raise ValueError)."""
    mine = model.state_dict(keep_vars=True)
    if strict:
        missing = sorted(set(mine) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(mine))
        if missing or unexpected:
            raise UserError(
                f"state dict does not match the model: missing keys {missing}, unexpected "
                f"keys {unexpected}"
            )
    sharded = sharded_parameters(model)
    plan = []
    for key, target in mine.items():
        if key not in state_dict:
            continue
        src = state_dict[key]
        got = _full_shape(src)
        if key in sharded:
            module, pname, layout = sharded[key]
            transposed = module.stored_transposed(pname)
            want = tuple(reversed(layout.shape)) if transposed else layout.shape
            if got != want:
                raise UserError(f"{key}: full tensor has shape {got}, the layer expects {want}")
            plan.append((target, src, layout, transposed))
            continue
        if got != tuple(target.shape):
            raise UserError(f"{key}: got shape {got}, the model holds {tuple(target.shape)}")
        plan.append((target, src, None, False))
    with torch.no_grad():
        for target, src, layout, transposed in plan:
            if layout is None:
                target.copy_(_read_all(src))
                continue
            r, c, d = layout.coords(grid)
            layout.read_piece(src.__getitem__, target.data, r, c, d, transposed)


def local_numel(model: nn.Module) -> int:
    """Parameters stored on this rank (tied ones once, padding included)."""
    return sum(p.numel() for p in _unique_params(model))
