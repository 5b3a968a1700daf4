"""What one rank holds of a model and its optimizer, described against the full tensors.

:func:`model_layout` turns any model gnnpar trains into a :class:`ModelLayout`: the rank's
local tensors (*pieces*), where each lies in the full tensors of the plain model
(:class:`~gnnpar.checkpoint.chunks.Chunk` s), and whether this rank is the one that writes it
(replicated values are written once). Parallel wrappers describe themselves — a
:class:`~gnnpar.shard.ShardedModel`, a full-graph model from
:func:`~gnnpar.models.fullgraph.parallelize_fullgraph` — through a ``checkpoint_layout()`` method; a
plain or tensor-parallel module (:func:`gnnpar.tensor.parallelize`) is described by
:func:`gnnpar.tensor.state.checkpoint_layout`. The optimizer's per-element state follows its
parameter's chunks (:func:`optimizer_pieces`).

Full tensors are named ``model/<plain state-dict key>`` and ``optim/<state>/<key>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from gnnpar.checkpoint.chunks import Chunk, concat
from gnnpar.grid import ProcessGrid

__all__ = [
    "ModelLayout",
    "Piece",
    "TensorSpec",
    "model_layout",
    "optimizer_pieces",
    "replicated_piece",
    "writes",
]

MODEL = "model/"
OPTIM = "optim/"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A full tensor's shape and dtype (as saved)."""

    shape: tuple[int, ...]
    dtype: str

    def to_json(self) -> dict[str, Any]:  # noqa: D102
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def of(cls, shape: Iterable[int], dtype: torch.dtype) -> TensorSpec:
        """The spec of a tensor of ``shape`` and ``dtype``."""
        return cls(tuple(int(s) for s in shape), str(dtype).removeprefix("torch."))


@dataclasses.dataclass
class Piece:
    """A local tensor (read and written flat) and where its elements live."""

    name: str
    tensor: torch.Tensor
    chunks: list[Chunk]
    write: bool = True


@dataclasses.dataclass
class ModelLayout:
    """A rank's model state against the plain model's full tensors.

    ``tensors``: every full tensor by global name (``model/<key>``), canonical keys only;
    ``keys``: the plain state dict's keys in order; ``aliases``: tied keys → their canonical
    key; ``params``: ``id(optimizer parameter)`` → (its chunks, whether this rank writes its
    optimizer state)."""

    pieces: list[Piece]
    tensors: dict[str, TensorSpec]
    keys: list[str]
    aliases: dict[str, str]
    params: dict[int, tuple[list[Chunk], bool]]
    after_load: Any = None  # called once every piece holds its loaded values (collective)


def writes(grid: ProcessGrid, split_axes: Iterable[str]) -> bool:
    """Whether this rank writes a piece split over ``split_axes`` and replicated over the
    others: only the rank at coordinate 0 of every replicated axis does."""
    # every pipeline stage holds tensors of its own: a stage's pieces are split over pipe
    split = {*split_axes, "pipe"}
    return all(v == 0 for a, v in grid.coords().items() if a not in split)


def replicated_piece(name: str, key: str, tensor: torch.Tensor, write: bool) -> Piece:
    """A piece holding the whole tensor ``key``."""
    box = (MODEL + key, (0,) * tensor.dim(), tuple(tensor.shape))
    return Piece(name, tensor, concat([box]), write)


def model_layout(model: Any, grid: ProcessGrid) -> ModelLayout:
    """The :class:`ModelLayout` of ``model`` on this rank: its own ``checkpoint_layout()``
    if it has one, else that of a plain or tensor-parallel module."""
    describe = getattr(model, "checkpoint_layout", None)
    if describe is not None:
        return describe()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"cannot checkpoint a {type(model).__name__}: give an nn.Module, a ShardedModel or "
            "a parallel full-graph model"
        )
    from gnnpar.tensor.state import checkpoint_layout

    return checkpoint_layout(model, grid)


def _per_element(key: str, value: Any, param: torch.Tensor) -> bool:
    """Whether optimizer state ``value`` holds one number per parameter element."""
    if not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return False
    return param.dim() > 0 or key != "step"


def optimizer_pieces(
    optimizer: torch.optim.Optimizer, layout: ModelLayout
) -> tuple[list[Piece], dict[str, TensorSpec], list[dict[str, Any]]]:
    """The optimizer's state as pieces (per-element state follows its parameter's chunks;
    other tensor state, such as Adam's ``step``, is kept per full tensor), the full tensors
    they belong to, and the parameter groups' hyper-parameters (JSON-ready)."""
    pieces: list[Piece] = []
    tensors: dict[str, TensorSpec] = {}
    groups: list[dict[str, Any]] = []
    for gi, group in enumerate(optimizer.param_groups):
        groups.append(_hyper(group))
        for pi, p in enumerate(group["params"]):
            if id(p) not in layout.params:
                raise ValueError(
                    "the optimizer holds a parameter the model does not (build the optimizer "
                    "from the parallel model's parameters)"
                )
            chunks, write = layout.params[id(p)]
            for name, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue  # non-tensor state is rebuilt by the optimizer
                label = f"{OPTIM}{name}/g{gi}.p{pi}"
                if _per_element(name, value, p):
                    moved = [
                        dataclasses.replace(c, key=f"{OPTIM}{name}/{c.key[len(MODEL):]}")
                        for c in chunks
                    ]
                    pieces.append(Piece(label, value, moved, write))
                    for c in chunks:
                        spec = layout.tensors[c.key]
                        tensors[f"{OPTIM}{name}/{c.key[len(MODEL):]}"] = TensorSpec(
                            spec.shape, str(value.dtype).removeprefix("torch.")
                        )
                else:
                    for key in dict.fromkeys(c.key[len(MODEL):] for c in chunks):
                        full = f"{OPTIM}{name}/{key}"
                        tensors[full] = TensorSpec.of(value.shape, value.dtype)
                        box = concat([(full, (0,) * value.dim(), tuple(value.shape))])
                        pieces.append(Piece(f"{label}:{key}", value, box, write))
    return pieces, tensors, groups


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, tuple):
            v = list(v)
        out[k] = v
    return out
