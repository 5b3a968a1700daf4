"""What one rank holds of a model and its optimizer, described against the full tensors.

:func:`model_layout` turns any model gnnpar trains into a :class:`ModelLayout`: the rank's
local tensors (*pieces*), where each lies in the full tensors of the plain model
(:class:`~gnnpar.checkpoint.chunks.Chunk` s), and whether this rank is the one that writes it
(replicated values are written once). Parallel wrappers describe themselves — a
:class:`~gnnpar.shard.ShardedModel`, a full-graph model from
:func:`~gnnpar.models.fullgraph.parallelize_fullgraph` — through a ``checkpoint_layout()`` method; a
plain or tensor-parallel module (:func:`gnnpar.tensor.parallelize`) by :func:`module_layout`,
its sharded layers each saying how their parameters are stored (:class:`ShardedParameters`,
which the layers of :mod:`gnnpar.tensor` implement). The optimizer's per-element state follows its
parameter's chunks (:func:`optimizer_pieces`).

Full tensors are named ``model/<plain state-dict key>`` and ``optim/<state>/<key>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

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
    #: called once the pieces were read for a save or a snapshot (the file offload tier
    #: gives back the pages that reading them made resident)
    after_read: Any = None
    #: full tensors (``model/<key>``) the run keeps beyond the plain state dict, restored on
    #: resume and left out of :func:`~gnnpar.checkpoint.consolidate` (a full-graph model's
    #: learnt input rows of featureless nodes: :mod:`gnnpar.models.fullgraph.embedding`)
    inputs: list[str] = dataclasses.field(default_factory=list)


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


@runtime_checkable
class ShardedParameters(Protocol):
    """A module that stores some of its parameters sharded (the tensor-parallel layers of
    :mod:`gnnpar.tensor`) says how each is saved: :meth:`stored_piece`."""

    def stored_piece(
        self, name: str, key: str, value: torch.Tensor, grid: ProcessGrid
    ) -> tuple[tuple[int, ...], Piece] | None:
        """The full tensor's shape and this rank's :class:`Piece` of its parameter ``name``,
        saved under the plain state-dict ``key``; None when ``name`` is not sharded."""


def model_layout(model: Any, grid: ProcessGrid) -> ModelLayout:
    """The :class:`ModelLayout` of ``model`` on this rank: its own ``checkpoint_layout()``
    if it has one, else that of a plain module whose layers may shard their parameters
    (:func:`module_layout`)."""
    describe = getattr(model, "checkpoint_layout", None)
    if describe is not None:
        return describe()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"cannot checkpoint a {type(model).__name__}: give an nn.Module, a ShardedModel or "
            "a parallel full-graph model"
        )
    return module_layout(model, grid)


def _sharding_modules(model: torch.nn.Module) -> dict[str, tuple[ShardedParameters, str]]:
    """Every state-dict key of a parameter whose module may shard it → (module, local
    name). Tied parameters appear under each of their names; a weight a module only borrows
    (a pipeline stage's tied head, not among its parameters) is left out."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, ShardedParameters):
            for name in module._parameters:
                out[f"{prefix}.{name}" if prefix else name] = (module, name)
    return out


def module_layout(model: torch.nn.Module, grid: ProcessGrid) -> ModelLayout:
    """The layout of a plain or tensor-parallel ``model`` on this rank: each parameter a
    :class:`ShardedParameters` layer shards as its piece says, everything else replicated;
    data-axis replicas write nothing (the model is the same on each)."""
    sharding = _sharding_modules(model)
    pieces, tensors, aliases, params = [], {}, {}, {}
    canonical: dict[int, str] = {}
    keys = []
    for key, value in model.state_dict(keep_vars=True).items():
        keys.append(key)
        if id(value) in canonical:
            aliases[key] = canonical[id(value)]
            continue
        canonical[id(value)] = key
        stored = None
        if key in sharding:
            module, name = sharding[key]
            stored = module.stored_piece(name, key, value.detach(), grid)
        if stored is None:
            shape = tuple(value.shape)
            piece = replicated_piece(key, key, value.detach(), writes(grid, ()))
        else:
            shape, piece = stored
        tensors[MODEL + key] = TensorSpec.of(shape, value.dtype)
        pieces.append(piece)
        if isinstance(value, torch.nn.Parameter):
            params[id(value)] = (piece.chunks, piece.write)
    return ModelLayout(pieces, tensors, keys, aliases, params)


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
                    dtype = str(value.dtype).removeprefix("torch.")
                    moved = []
                    for c in chunks:  # the parameter's boxes, under the state's name
                        key = f"{OPTIM}{name}/{c.key[len(MODEL) :]}"
                        moved.append(Chunk(key, c.offsets, c.sizes, c.at, c.transposed))
                        tensors[key] = TensorSpec(layout.tensors[c.key].shape, dtype)
                    pieces.append(Piece(label, value, moved, write))
                else:
                    for key in dict.fromkeys(c.key[len(MODEL) :] for c in chunks):
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
