"""Bring your own GNN: a plain PyG model trained full-graph on any x × y × z grid.

>>> par = parallelize_pyg(model, grid, source)     # model: built from torch_geometric.nn
>>> logits = par(par.input_features())             # this rank's rows of model(x, edge_index)
>>> par.loss(logits, "train_mask").backward()      # gradients summed over the grid

**The choice of shape.** Like :func:`gnnpar.tensor.parallelize` (and FSDP2), it works *in
place* on the user's modules: each supported convolution and norm gets a parallel
``forward`` (its parameters untouched, so ``model.state_dict()`` keeps the user's keys and a
consolidated checkpoint loads into the original class with ``strict=True``), and each
parameter a hook that sums its gradient over the grid. It *returns* a
:class:`ParallelPyG`, the full-graph models' common face (:class:`ShardedGNN`: input
features, loss, accuracy, predictions, checkpoint layout, bytes), whose ``module`` is the
model itself. The model's own ``forward`` runs unchanged, called with this rank's node rows
where it takes ``x`` and the graph share (:class:`~.share.GraphShare`) where it takes
``edge_index``; anything it does row by row between convolutions (residuals, ``torch.cat``,
``JumpingKnowledge``, activations, dropout, ``log_softmax``) is correct as written.

What it supports is :data:`SUPPORTED` (and any module of the user's own whose children are
supported); anything else is refused before a rank launches by :func:`check_model`, naming
the class, where it sits and the list. Dropout masks are drawn by each rank from torch's
generator, so a parallel run's masks are not a serial run's (evaluation and dropout-free
training equal serial to rounding).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch_geometric.nn as pyg
from torch import nn

from gnnpar import comm
from gnnpar.comm import ring_bytes
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid
from gnnpar.models.fullgraph.parallelize import ShardedGNN
from gnnpar.models.fullgraph.pyg_layers import FORWARDS, graph_layer_norm, operators_of, refusal
from gnnpar.models.fullgraph.schedule import Step, step
from gnnpar.models.fullgraph.share import NODE_AXIS, GraphShare
from gnnpar.sparse.source import ShardSource

#: Modules that run as they are on a rank's node rows (no communication).
ROW_WISE: tuple[type, ...] = (
    nn.Linear, pyg.Linear, nn.LayerNorm, nn.Dropout, nn.Identity, nn.Sequential,
    nn.ModuleList, nn.ModuleDict, pyg.BatchNorm, pyg.JumpingKnowledge, pyg.MLP,
    nn.ReLU, nn.ELU, nn.GELU, nn.LeakyReLU, nn.PReLU, nn.SiLU, nn.Tanh, nn.Sigmoid,
    nn.Softplus, nn.LogSoftmax, nn.Softmax,
)  # fmt: skip

#: What :func:`parallelize_pyg` takes, by name (for the refusal of anything else).
SUPPORTED = (
    "GCNConv", "SAGEConv (mean, max)", "GATConv", "GATv2Conv", "GINConv", "SGConv", "APPNP",
    "GCN2Conv", "Linear", "BatchNorm / BatchNorm1d", "LayerNorm (graph, node)", "MLP",
    "JumpingKnowledge (cat, max, lstm)", "Dropout", "activations", "Sequential / ModuleList",
)  # fmt: skip


def _own_class(module: nn.Module) -> bool:
    """A class of the user's (not torch's nor PyG's): a container whose forward is theirs."""
    root = type(module).__module__.split(".")[0]
    return root not in ("torch", "torch_geometric")


def _allowed_inside(parent: nn.Module | None, module: nn.Module) -> bool:
    """The LSTM and attention of ``JumpingKnowledge(mode="lstm")`` work per node."""
    return isinstance(parent, pyg.JumpingKnowledge) and isinstance(module, (nn.LSTM, nn.Linear))


def check_model(model: nn.Module) -> None:
    """Every module of ``model`` is supported (:data:`SUPPORTED`, or a class of the user's
    own), with options that can run: otherwise one UserError naming the class, where it
    sits in the model and what is supported."""
    if not isinstance(model, nn.Module):
        raise UserError(f"the model must be a torch.nn.Module, got {type(model).__name__}")
    _check_tree(model, "", None)


def _check_tree(module: nn.Module, path: str, parent: nn.Module | None) -> None:
    where = f"'{path}'" if path else "the model itself"
    if isinstance(module, pyg.MessagePassing) and type(module) not in FORWARDS:
        raise UserError(
            f"{type(module).__name__} at {where} is a message-passing layer gnnpar has no "
            f"parallel form of; supported: {', '.join(SUPPORTED)}"
        )
    known = isinstance(module, (*FORWARDS, *ROW_WISE, pyg.LayerNorm))
    if not known and not _own_class(module) and not _allowed_inside(parent, module):
        raise UserError(
            f"{type(module).__name__} at {where} is not supported by parallelize_pyg; "
            f"supported: {', '.join(SUPPORTED)}"
        )
    why = refusal(module)
    if why is not None:
        raise UserError(f"{why}: not supported by parallelize_pyg (at {where})")
    if isinstance(module, pyg.MessagePassing):
        # a convolution's own parts run inside its parallel forward; GINConv's MLP is the user's
        children = [("nn", module.nn)] if isinstance(module, pyg.GINConv) else []
    else:
        children = list(module.named_children())
    for name, child in children:
        _check_tree(child, f"{path}.{name}" if path else name, module)


def _sum_gradient(grid: ProcessGrid) -> Callable[[torch.Tensor], None]:
    """A post-accumulate hook summing a replicated parameter's gradient over the grid."""

    def hook(param: torch.Tensor) -> None:
        param.grad = comm.all_reduce(param.grad.contiguous(), grid, NODE_AXIS)

    return hook


class ParallelPyG(ShardedGNN):
    """A PyG model on this rank's share of the graph (see the module docstring)."""

    #: The parameters' gradients are complete after backward (summed by their hooks).
    tensor_grads_complete = True

    def __init__(
        self,
        model: nn.Module,
        grid: ProcessGrid,
        source: ShardSource,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        nn.Module.__init__(self)
        if grid.data != 1 or grid.size("pipe") != 1 or grid.size("context") != 1:
            raise UserError(
                f"a PyG model trains full-graph on x × y × z; this grid is {grid.describe()}"
            )
        first = next(iter(model.parameters()), None)
        self.dtype = first.dtype if first is not None else torch.float32
        self.compute_dtype = compute_dtype or self.dtype
        if self.compute_dtype != self.dtype:
            raise UserError(
                "a PyG model runs in its parameters' dtype; mixed precision is not supported "
                "for user models"
            )
        self.grid, self.source, self.device = grid, source, grid.device
        self.kind, self.dropout = "pyg", 0.0
        self.num_nodes = source.num_nodes
        self.share = GraphShare(grid, source, self.compute_dtype, self.device)
        self.module = model.to(self.device)
        self.dims = [source.feat_dim, source.num_classes]
        self.num_layers = 1
        rows = self.share.rows
        self.input_block = (rows, (0, source.feat_dim))
        self.logits_rows, self.logits_cols = rows, (0, source.num_classes)
        self.row_axis, self.class_axis = NODE_AXIS, None
        self._gather_buffers = {}
        self._grad_steps = [
            s
            for p in model.parameters()
            if p.requires_grad
            for s in step(
                "backward",
                NODE_AXIS,
                "all_reduce",
                grid.size(NODE_AXIS),
                p.numel(),
                "parameter gradient",
            )  # fmt: skip
        ]

    @property
    def output_order(self) -> int:
        """The one node order of the share."""
        return 0

    @property
    def activation_checkpointing(self) -> str:  # type: ignore[override]
        """``"full"``: each convolution keeps only its inputs and runs again in backward."""
        return "full" if self.share.checkpointing else "none"

    @activation_checkpointing.setter
    def activation_checkpointing(self, mode: str) -> None:
        if mode not in ("none", "full"):
            raise UserError(f"activation_checkpointing of a PyG model: none or full, not {mode!r}")
        self.share.checkpointing = mode == "full"

    def forward(self, x: torch.Tensor, dropout_seed: int | None = None) -> torch.Tensor:
        """This rank's rows of ``model(x, edge_index)``. ``dropout_seed`` is not used: the
        model's own dropout draws from torch's generator."""
        self.share.start_recording()
        return self.module(x, self.share)

    def schedule(self, input_grad: bool = False) -> list[Step]:
        """The collectives of the last forward (as each op recorded them) and of its
        backward, with the parameters' gradient sums."""
        return [*self.share.steps, *self._grad_steps]

    def expected_bytes(self, input_grad: bool = False) -> dict[str, dict[str, float]]:
        """Per-rank bytes by axis of the last forward and its backward (a recomputed
        convolution's forward steps are recorded again when it reruns)."""
        from gnnpar.models.fullgraph.schedule import bytes_by_phase

        return bytes_by_phase(self.schedule(), self.compute_dtype.itemsize)

    def checkpoint_layout(self):
        """Every tensor of the user's state dict, replicated (written by rank 0)."""
        from gnnpar.checkpoint.state import module_layout

        return module_layout(self.module, self.grid)

    def shard_numel(self) -> dict[str, int]:
        """Elements this rank holds: adjacency nonzeros, input features, parameters."""
        return {
            "adjacency_nnz": self.share.operator("attention").nnz,
            "features": int(self.input_features().numel()),
            "weights": sum(p.numel() for p in self.module.parameters()),
        }


def parallelize_pyg(
    model: nn.Module,
    grid: ProcessGrid,
    source: ShardSource,
    compute_dtype: torch.dtype | None = None,
) -> ParallelPyG:
    """Put the plain PyG ``model`` on ``grid`` in place, reading this rank's blocks from
    ``source`` (its shards cut with norm ``"raw"`` and one node order: permutation
    ``symmetric`` or ``none``), and return its :class:`ParallelPyG`. Refuses an unsupported
    module first (:func:`check_model`). Every rank must build the same model (same seed)."""
    check_model(model)
    par = ParallelPyG(model, grid, source, compute_dtype)
    kinds: list[str] = []
    for module in model.modules():
        forward = FORWARDS.get(type(module))
        if isinstance(module, pyg.LayerNorm) and module.mode == "graph":
            forward = graph_layer_norm
        if forward is None:
            continue
        kinds += [k for k in operators_of(module) if k not in kinds]
        module._gnnpar_share = par.share
        module.forward = forward.__get__(module)
    par.share.prepare(kinds)
    if grid.size(NODE_AXIS) > 1:
        hook = _sum_gradient(grid)
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)
    return par


def aggregation_bytes_per_width(n: int, x: int, yz: int, element_size: int = 4) -> float:
    """Per-rank bytes of one aggregation ``Â·H`` per feature of H on an ``x`` × ``yz`` split
    of ``n`` nodes, forward and backward (:meth:`~.share.GraphShare.propagate`): the y·z
    all-gather of the block's columns and the x reduce-scatter of its rows, each paired with
    its adjoint."""
    cols, rows = -(-n // x), -(-n // yz)
    gather = ring_bytes("all_gather", yz * -(-cols // yz) * element_size, yz)
    scatter = ring_bytes("reduce_scatter", x * -(-rows // x) * element_size, x)
    return 2 * (gather + scatter)


def choose_share_grid(world: int, num_nodes: int = 1 << 20) -> dict[str, int]:
    """The x × y·z split of ``world`` ranks whose aggregation moves the fewest bytes
    (:func:`aggregation_bytes_per_width`; ties: the smaller x), the y·z ranks on y."""
    best = min(
        (aggregation_bytes_per_width(num_nodes, x, world // x), x)
        for x in range(1, world + 1)
        if world % x == 0
    )
    x = best[1]
    return {"x": x, "y": world // x, "z": 1}


# --------------------------------------------------------------------------- factories
def load_factory(target: str) -> Callable[..., nn.Module]:
    """The function ``module:factory`` names (``module`` importable, or a ``.py`` file),
    one UserError otherwise."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"model {target!r}: give module:factory (e.g. mymodels:appnp)")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise UserError(f"model {target!r}: no file {path}")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"model {target!r}: cannot import {module_name} ({err})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"model {target!r}: {module_name} has no function {attr!r}")
    return factory


def build_user_model(
    target: str, in_channels: int, out_channels: int, options: dict[str, Any]
) -> nn.Module:
    """``factory(in_channels=..., out_channels=..., **options)`` of ``target``, checked
    (:func:`check_model`); one UserError naming the target if the call fails."""
    factory = load_factory(target)
    try:
        model = factory(in_channels=in_channels, out_channels=out_channels, **options)
    except TypeError as err:
        raise UserError(f"model {target!r}: {err}") from None
    check_model(model)
    return model
