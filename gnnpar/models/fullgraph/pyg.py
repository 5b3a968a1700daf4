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

What it supports is :data:`~gnnpar.models.pyg.model.SUPPORTED` (and any module of the
user's own whose children are supported); anything else is refused before a rank launches by
:func:`~gnnpar.models.pyg.model.check_model`, naming the class, where it sits and the list.
Dropout masks are drawn by each rank from torch's generator, so a parallel run's masks are
not a serial run's (evaluation and dropout-free training equal serial to rounding).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from gnnpar import comm
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid
from gnnpar.models.fullgraph.parallelize import ShardedGNN
from gnnpar.models.fullgraph.schedule import Step, step
from gnnpar.models.fullgraph.share import NODE_AXIS, GraphShare
from gnnpar.models.pyg.model import check_model, gradient_parameters, install_forwards, seeded
from gnnpar.sparse.source import ShardSource


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
        if self.compute_dtype not in (self.dtype, torch.bfloat16):
            raise UserError(
                f"a PyG model computes in its parameters' dtype or bfloat16, not "
                f"{self.compute_dtype}"
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
        self.inputs = None  # learnt featureless rows (learn_featureless)
        self._grad_steps = [
            s
            for p in gradient_parameters(model)
            for s in step(
                "backward",
                NODE_AXIS,
                "all_reduce",
                grid.size(NODE_AXIS),
                p.numel(),
                "parameter gradient",
                p.element_size(),
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
        """This rank's rows of ``model(x, edge_index)``. ``dropout_seed`` (training): the
        model's own dropout draws from torch's generator seeded with it and this rank (a
        step's masks are the same after a resume on the same grid; another grid draws
        others)."""
        self.share.start_recording()
        with contextlib.ExitStack() as stack:
            if dropout_seed is not None and self.training:
                seed = dropout_seed * 1009 + self.grid.global_rank
                stack.enter_context(seeded(seed, self.device))
            if self.compute_dtype != self.dtype:
                # bf16: the masters stay in their dtype; autocast runs the products in
                # bfloat16, the share sends and multiplies what it gathers in bfloat16
                stack.enter_context(torch.autocast(self.device.type, dtype=self.compute_dtype))
            if self.inputs is not None:  # this rank's featureless rows: the learnt ones
                x = self.inputs(x)
            if self.share.typed:  # model(x, edge_index, edge_type): the share holds both
                return self.module(x, self.share, self.share)
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
        """Every tensor of the user's state dict, replicated (written by rank 0), and the
        learnt featureless rows beside it, each rank's own."""
        from gnnpar.checkpoint.state import module_layout
        from gnnpar.models.fullgraph.embedding import with_inputs

        return with_inputs(module_layout(self.module, self.grid), self.inputs, self.grid)

    def shard_numel(self) -> dict[str, int]:
        """Elements this rank holds: adjacency nonzeros, input features, parameters."""
        return {
            "adjacency_nnz": sum(op.nnz for op in self.share.relation_operators())
            if self.share.typed
            else self.share.operator("attention").nnz,
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
    par.share.prepare(install_forwards(model, par.share))
    if grid.size(NODE_AXIS) > 1:
        hook = _sum_gradient(grid)
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(hook)
    return par
