"""Apply 3D (Plexus) parallelism from outside to a plain full-graph GCN / GraphSAGE / GAT /
GIN / R-GCN model (GAT and GIN: :mod:`gnnpar.models.fullgraph.gat`).

>>> par = parallelize_fullgraph(model, grid, source)
>>> x = par.input_features()          # this rank's shard of the input features
>>> logits = par(x, dropout_seed=epoch)
>>> loss = par.loss(logits, "train_mask")

Each rank holds only its blocks of Â, of the features, of the activations and of the
weights; the plain model's parameters are read once to cut the weight shards.

A layer multiplies the sparse operators of its kind (:func:`operator_blocks`): GCN Â,
GraphSAGE (Â, identity), R-GCN (Â_1, …, Â_R, identity), one per relation of a typed graph
(:mod:`gnnpar.models.fullgraph.relations`); their aggregates are concatenated and multiplied
by the stacked weight, so every grid algorithm and its schedule take R-GCN as a layer of
R + 1 operators.

**Mixed precision** (``compute_dtype=torch.bfloat16``, the ``mixed_precision = "bf16"`` of
the ``gcn`` task): the parameters (masters) stay in ``dtype`` (float32) and are what the
optimizer steps; each forward casts them to the compute dtype, so Â, the features, the
activations, both products and every collective's payload (H and W all-gathers, the
all-reduces of Â·H and of the output, the weight-gradient reduce-scatter or all-reduce and
the input-gradient reductions) are bfloat16, and the cast's backward lands the gradients in
the masters' dtype. The loss and accuracy are computed in float32 from the bfloat16 logits
(:mod:`gnnpar.models.fullgraph.loss`). float16 is refused: the local SpMM has no float16 kernel and
the full-graph task no loss scaling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from gnnpar import comm
from gnnpar.comm import chunk_sizes
from gnnpar.errors import UserError
from gnnpar.graph import is_multilabel
from gnnpar.grid import ProcessGrid
from gnnpar.models.fullgraph.embedding import InputEmbedding, with_inputs
from gnnpar.models.fullgraph.layout import Layout3D, layout3d
from gnnpar.models.fullgraph.loss import (
    gather_masked,
    sharded_accuracy,
    sharded_argmax,
    sharded_bce_with_logits,
    sharded_cross_entropy,
)
from gnnpar.models.fullgraph.plexus import layer_schedule, plexus_layer
from gnnpar.models.fullgraph.schedule import Step, bytes_by_phase
from gnnpar.nn.dropout import index_dropout
from gnnpar.recompute import recompute
from gnnpar.sparse.csr import CSRBlock
from gnnpar.sparse.kernels import LocalSpMM
from gnnpar.sparse.source import ShardSource

if TYPE_CHECKING:
    from gnnpar.models.fullgraph.model import FullGraphGNN


def _weight_piece(stacked: torch.Tensor, lay: Layout3D, num_blocks: int) -> torch.Tensor:
    """This rank's flat piece of the stacked weight blocks (num_blocks·in × out)."""
    d_in = stacked.shape[0] // num_blocks
    blocks = [
        stacked[k * d_in + lay.fin[0] : k * d_in + lay.fin[1], lay.fout[0] : lay.fout[1]]
        for k in range(num_blocks)
    ]
    flat = torch.cat(blocks, dim=0).reshape(-1)
    return flat[lay.w_part[0] : lay.w_part[1]].clone()


COMPUTE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def operator_blocks(
    source: ShardSource, kind: str, parity: int, rows: tuple[int, int], cols: tuple[int, int]
) -> list[CSRBlock]:
    """Block ``rows × cols`` (of the order pair ``parity``) of every sparse operator a layer
    of ``kind`` multiplies, in the order its stacked weight stacks their weights: Â (gcn),
    (Â, root) (sage), (Â_1, …, Â_R, root) (rgcn: each relation's operator, read with the
    source's ``relation_adjacency``). The root is the permutation between the two orders
    (the identity in node ids)."""
    if kind == "rgcn":
        out = [
            source.relation_adjacency(r, parity, rows, cols)  # type: ignore[attr-defined]
            for r in range(num_relations_of(source))
        ]
    else:
        out = [source.adjacency(parity, rows, cols)]
    if kind in ("sage", "rgcn"):
        out.append(source.root(parity, rows, cols))
    return out


def _block_keys(layer: nn.Module) -> list[tuple[str, int | None]]:
    """The plain parameter of each stored weight block of ``layer`` (see
    :meth:`ShardedGNN.plain_keys`)."""
    if hasattr(layer, "block_keys"):
        return layer.block_keys()
    if hasattr(layer, "operator_keys"):
        return [(k, None) for k in layer.operator_keys()]
    return [("weight", None)]


def _weight_blocks(layer: nn.Module) -> torch.Tensor:
    """``layer``'s stored weight blocks stacked (the stacked weight but for R-GCN bases)."""
    return layer.weight_blocks() if hasattr(layer, "weight_blocks") else layer.stacked_weight()


def num_relations_of(source: ShardSource) -> int:
    """Relations whose operators ``source`` holds (0: an untyped source)."""
    return int(getattr(source, "num_relations", 0) or 0)


class ShardedGNN(nn.Module):
    """What every parallel full-graph model shares: data access, loss and accuracy over
    its logits block, and the two precisions. Subclasses set ``logits_rows``,
    ``logits_cols``, ``row_axis`` and ``class_axis`` (None where classes are not split).

    ``dtype`` (default: the model's) is the dtype of the parameters (the masters the
    optimizer updates) and of checkpoints; ``compute_dtype`` (default: ``dtype``) that of
    Â, the features, activations, products and collectives (see the module docstring)."""

    input_block: tuple[tuple[int, int], tuple[int, int]]
    logits_rows: tuple[int, int]
    logits_cols: tuple[int, int]
    row_axis: str
    class_axis: str | None
    #: ``"none"`` or ``"full"`` (:mod:`gnnpar.recompute`): what :meth:`forward` keeps.
    activation_checkpointing = "none"

    def __init__(
        self,
        model: FullGraphGNN,
        grid: ProcessGrid,
        source: ShardSource,
        dtype: torch.dtype | None,
        compute_dtype: torch.dtype | None = None,
        data_parallel: bool = False,
    ) -> None:
        super().__init__()
        if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
            raise UserError(
                f"compute_dtype {compute_dtype} is not supported for full-graph training "
                "(the local SpMM has kernels for float32, float64 and bfloat16)"
            )
        if grid.data != 1 and not data_parallel:
            raise UserError(
                f"full-graph training has no batch to split over data={grid.data}; "
                "use a grid with data=1"
            )
        dims = model.dims
        if dims[0] != source.feat_dim:
            raise UserError(
                f"model expects {dims[0]} input features, the graph has {source.feat_dim}"
            )
        self.grid = grid
        self.kind = model.kind
        self.dropout = model.dropout
        self.num_nodes = source.num_nodes
        self.num_layers = len(model.layers)
        self.dims = dims
        self.source = source
        self.dtype = dtype or next(model.parameters()).dtype
        self.compute_dtype = compute_dtype or self.dtype
        # Shards are read on the host (memory-mapped files) and live on the grid's device.
        self.device = grid.device
        self._gather_buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        # the plain model's parameter of each stored weight block, per layer (checkpoints)
        self._block_keys = [_block_keys(layer) for layer in model.layers]
        #: Learnt input rows of a typed graph's featureless nodes (:meth:`learn_featureless`).
        self.inputs: InputEmbedding | None = None
        # R-GCN bases: the relations (R) and bases (B) of each layer's coefficients, or None
        self._bases = [
            tuple(layer.comp.shape) if getattr(layer, "comp", None) is not None else None
            for layer in model.layers
        ]

    def schedule(self, input_grad: bool = False) -> list[Step]:
        """The collectives of one forward and one backward pass on this rank (each layer's
        own description; ``input_grad``: the input features' gradient is wanted too, as it
        is with learnt featureless rows)."""
        raise NotImplementedError

    def learn_featureless(self, seed: int) -> None:
        """Learn an input row per featureless node of the typed graph, held as the input
        block is (:class:`~gnnpar.models.fullgraph.embedding.InputEmbedding`; before the
        optimizer is built)."""
        rows, cols = self.input_block
        self.inputs = InputEmbedding(self.source, rows, cols, seed, self.dtype, self.device)

    def gather_buffer(
        self, sizes: Sequence[int], width: int, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """The buffer an all-gather of H's rows (``sizes``: each rank's, ``width`` features
        each) lands in, kept across layers and epochs: one per width, replaced when the
        graph's size changes. A gathered H is as large as the graph's features, and a fresh
        one each time costs its page faults on the host (half a 2-rank all-gather's time at
        R-MAT 16). Its consumer, the SpMM, keeps nothing of it, so the next gather may
        overwrite it. None with one rank or where the ranks' rows differ in number (the
        gather then compacts a copy).

        The 1D layer gathers at every layer and uses it. The 3D layer gathers only its first
        layer's input and does not: kept through backward, the buffer raised rank 0's peak
        at R-MAT 18 by 7% on 1×1×2 and 11% on 2×1×2 to save about 3% of the z=2 epoch."""
        if len(sizes) < 2 or len(set(sizes)) > 1:
            return None
        shape = (sum(sizes), width)
        buf = self._gather_buffers.get((width, dtype))
        if buf is None or tuple(buf.shape) != shape:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            self._gather_buffers[(width, dtype)] = buf
        return buf

    def expected_bytes(self, input_grad: bool = False) -> dict[str, dict[str, float]]:
        """Per-rank bytes by axis of one forward and one backward pass, from
        :meth:`schedule` (elements of the compute dtype; unrounded). With full activation
        checkpointing backward also runs every forward collective again (the recompute)."""
        out = bytes_by_phase(self.schedule(input_grad), self.compute_dtype.itemsize)
        if self.activation_checkpointing == "full":
            for axis, nbytes in out["forward"].items():
                out["backward"][axis] = out["backward"].get(axis, 0.0) + nbytes
        return out

    def forward(self, x: torch.Tensor, dropout_seed: int | None = None) -> torch.Tensor:
        """This rank's block of the logits (rows :attr:`logits_rows`, classes
        :attr:`logits_cols`); ``dropout_seed`` seeds the dropout masks (None: no dropout).
        With :attr:`activation_checkpointing` ``"full"`` each layer keeps only its input
        for backward and runs again there, collectives included."""
        h = x if self.inputs is None else self.inputs(x)
        full = self.activation_checkpointing == "full"
        for i in range(self.num_layers):
            seed = None if dropout_seed is None else dropout_seed * 1009 + i
            h = recompute(self.layer, i, h, seed, enabled=full)
        return h

    def layer(self, i: int, h: torch.Tensor, seed: int | None) -> torch.Tensor:
        """Layer ``i`` on this rank's blocks: the input's dropout (seeded by ``seed``), the
        sparse and dense products, the bias and the activation (not after the last)."""
        raise NotImplementedError

    def in_compute_dtype(self, param: torch.Tensor) -> torch.Tensor:
        """``param`` (a master) cast to the compute dtype for this pass (itself when they
        agree); differentiable, so its gradient lands on the master in the master's dtype."""
        return param if param.dtype == self.compute_dtype else param.to(self.compute_dtype)

    def input_features(self) -> torch.Tensor:
        """This rank's block of the input features (order 0), on the grid's device, in the
        compute dtype."""
        rows, cols = self.input_block
        return self.source.features(rows, cols).to(device=self.device, dtype=self.compute_dtype)

    def full_weights(self, grads: bool = False) -> list[dict[str, torch.Tensor]]:
        """Every layer's full stacked weight and bias (or gradients); collective."""
        return self.params.full(grads)

    @property
    def output_order(self) -> int:
        """Node order of the logits rows (0: P₂, 1: P)."""
        return self.num_layers % 2

    def node_data(self, name: str) -> torch.Tensor:
        """Labels or a mask for the logits rows of this rank, on the grid's device."""
        return self.source.node_data(name, self.output_order, self.logits_rows).to(self.device)

    def loss(self, logits: torch.Tensor, mask_name: str = "train_mask") -> torch.Tensor:
        """Masked cross-entropy over the sharded logits, or for a multi-label (N x C) label
        binary cross-entropy with logits over every task (the same scalar on every rank)."""
        labels, mask = self.node_data("label"), self.node_data(mask_name)
        axes = (self.grid, self.class_axis, self.row_axis)
        if is_multilabel(labels):
            tasks = self.dims[-1]
            return sharded_bce_with_logits(logits, labels, mask, *axes, tasks, self.logits_cols[0])
        return sharded_cross_entropy(logits, labels, mask, *axes, self.logits_cols[0])

    def gather_masked(
        self, logits: torch.Tensor, mask_name: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The masked rows' full logits and labels, on every rank (for a score such as
        ROC-AUC that needs them all; collective)."""
        return gather_masked(
            logits,
            self.node_data("label"),
            self.node_data(mask_name),
            self.grid,
            self.class_axis,
            self.row_axis,
        )

    # ------------------------------------------------------------------------ checkpoints
    def plain_keys(self, layer: int) -> tuple[list[tuple[str, int | None]], str | None]:
        """State-dict keys of ``layer`` in the plain model: the parameter of each stored weight
        block, in the order they are stacked, as ``(key, None)`` (a whole in × out parameter)
        or ``(key, b)`` (slice b of the stacked ``bases``), and the bias (None without one)."""
        blocks = self._block_keys[layer]
        bias = f"layers.{layer}.bias" if self.has_bias else None
        return [(f"layers.{layer}.{k}", b) for k, b in blocks], bias

    def block_boxes(
        self, layer: int, fin: tuple[int, int], fout: tuple[int, int]
    ) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        """The checkpoint boxes of ``layer``'s stored blocks' rows ``fin`` × columns ``fout``,
        in stacking order."""
        keys, _ = self.plain_keys(layer)
        size = (fin[1] - fin[0], fout[1] - fout[0])
        return [
            ("model/" + k, (fin[0], fout[0]), size)
            if b is None
            else ("model/" + k, (b, fin[0], fout[0]), (1, *size))
            for k, b in keys
        ]

    def weight_piece(self, layer: int):
        """(parameter, chunks, split axes) of ``layer``'s stacked weight on this rank. Here:
        replicated, the whole stack (1D and 2D keep full weights)."""
        from gnnpar.checkpoint.chunks import concat

        whole = ((0, self.dims[layer]), (0, self.dims[layer + 1]))
        return self.params.weights[layer], concat(self.block_boxes(layer, *whole)), ()

    def comp_piece(self, layer: int):
        """(parameter, chunks, split axes) of ``layer``'s basis coefficients (R × B, whole on
        every rank)."""
        from gnnpar.checkpoint.chunks import concat

        box = ("model/" + f"layers.{layer}.comp", (0, 0), self._bases[layer])
        return self.comps[str(layer)], concat([box]), ()

    def bias_piece(self, layer: int):
        """(parameter, chunks, split axes) of ``layer``'s bias on this rank (replicated)."""
        from gnnpar.checkpoint.chunks import concat

        _, key = self.plain_keys(layer)
        n = self.dims[layer + 1]
        return self.params.biases[layer], concat([("model/" + key, (0,), (n,))]), ()

    def checkpoint_layout(self):
        """This rank's :class:`~gnnpar.checkpoint.state.ModelLayout` against the plain
        :class:`~gnnpar.models.fullgraph.model.FullGraphGNN`'s state dict."""
        from gnnpar.checkpoint.state import MODEL, ModelLayout, Piece, TensorSpec, writes

        pieces, tensors, params, keys = [], {}, {}, []
        for i in range(self.num_layers):
            blocks, bias = self.plain_keys(i)
            shape = (self.dims[i], self.dims[i + 1])
            bases = self._bases[i]
            for key, b in blocks:
                if b is None:
                    keys.append(key)
                    tensors[MODEL + key] = TensorSpec.of(shape, self.dtype)
                elif b == 0:  # the stacked bases, then their coefficients (state-dict order)
                    comp = f"layers.{i}.comp"
                    keys += [key, comp]
                    tensors[MODEL + key] = TensorSpec.of((bases[1], *shape), self.dtype)
                    tensors[MODEL + comp] = TensorSpec.of(bases, self.dtype)
            parts = [(f"weight.{i}", *self.weight_piece(i))]
            if bases is not None:
                parts.append((f"comp.{i}", *self.comp_piece(i)))
            if bias is not None:
                keys.append(bias)
                tensors[MODEL + bias] = TensorSpec.of((self.dims[i + 1],), self.dtype)
                parts.append((f"bias.{i}", *self.bias_piece(i)))
            for name, param, chunks, split in parts:
                write = writes(self.grid, split)
                pieces.append(Piece(name, param.detach(), chunks, write))
                params[id(param)] = (chunks, write)
        return with_inputs(ModelLayout(pieces, tensors, keys, {}, params), self.inputs, self.grid)

    def predictions(self, logits: torch.Tensor) -> torch.Tensor:
        """Every node's prediction in original node order, on every rank (collective): its
        class (arg-max of the logits, ties to the lowest class id) as int64, or for a
        multi-label (N x C) label each task's probability (sigmoid of the logits) as
        float32, N x C."""
        ids = self.source.node_ids(self.output_order, self.logits_rows).to(self.device).long()
        if is_multilabel(self.node_data("label")):
            rows = logits.detach().float()
            if self.class_axis is not None:
                widths = comm.gather_sizes(rows.shape[1], self.grid, self.class_axis)
                rows = comm.all_gather(rows.contiguous(), self.grid, self.class_axis, dim=1,
                                       sizes=widths)  # fmt: skip
            pred = torch.sigmoid(rows)
            out = torch.full((self.num_nodes, pred.shape[1]), -1.0, device=self.device)
        else:
            pred = sharded_argmax(logits, self.grid, self.class_axis, self.logits_cols[0])
            pred = pred.long()
            out = torch.full((self.num_nodes,), -1, dtype=torch.int64, device=self.device)
        out[ids] = pred[: ids.numel()]
        # ranks that hold the same rows agree; every node's row is held by some rank
        return comm.all_reduce(out, self.grid, "world", op="max")

    def accuracy(self, logits: torch.Tensor, mask_name: str) -> float:
        """Accuracy over the masked rows of the whole graph."""
        return sharded_accuracy(
            logits,
            self.node_data("label"),
            self.node_data(mask_name),
            self.grid,
            self.class_axis,
            self.row_axis,
            self.logits_cols[0],
        )


class Parallel3DGNN(ShardedGNN):
    """A full-graph GNN whose Â, H and W are sharded over the x × y × z grid."""

    #: Each layer reduces its weight and bias gradients over x, y and z itself: a data-axis
    #: reduction (:func:`gnnpar.shard.shard`) only averages them over data.
    tensor_grads_complete = True

    def __init__(
        self,
        model: FullGraphGNN,
        grid: ProcessGrid,
        source: ShardSource,
        overlap_chunks: int = 1,
        dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype | None = None,
        data_parallel: bool = False,
    ):
        super().__init__(model, grid, source, dtype, compute_dtype, data_parallel)
        if overlap_chunks < 1:
            raise UserError(f"overlap_chunks must be at least 1, got {overlap_chunks}")
        dtype = self.dtype
        dims = self.dims
        self.overlap_chunks = overlap_chunks
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        #: R-GCN basis coefficients by layer index (R × B, whole on every rank)
        self.comps = nn.ParameterDict()
        self._num_ops = [layer.num_ops for layer in model.layers]
        self._num_blocks = [len(keys) for keys in self._block_keys]
        for i, layer in enumerate(model.layers):
            # the weight and bias pieces depend on the widths only, not on the graph
            nb = self._num_blocks[i]
            lay = layout3d(grid, i, source.num_nodes, dims[i], dims[i + 1], nb)
            with torch.no_grad():
                stacked = _weight_blocks(layer).detach().to(dtype)
                piece = _weight_piece(stacked, lay, nb).to(self.device)
                self.weights.append(nn.Parameter(piece))
                if self._bases[i] is not None:
                    comp = layer.comp.detach().to(device=self.device, dtype=dtype, copy=True)
                    self.comps[str(i)] = nn.Parameter(comp)
                if layer.bias is not None:
                    b = layer.bias.detach().to(dtype)[lay.fout[0] : lay.fout[1]]
                    self.biases.append(nn.Parameter(b.to(self.device, copy=True)))
        self.has_bias = len(self.biases) == len(model.layers)
        self.set_source(source)

    def set_source(self, source: ShardSource) -> None:
        """Read this rank's blocks of Â (and of the root operator), its node ids and data
        from ``source``: the graph the next passes run on, of any number of nodes. The
        weights stay; a mini-batch sampler (ScaleGNN's vertex sampling,
        :mod:`gnnpar.sampling.vertex`) calls it with every step's subgraph."""
        if source.feat_dim != self.dims[0]:
            raise UserError(
                f"model expects {self.dims[0]} input features, the graph has {source.feat_dim}"
            )
        dims, n = self.dims, source.num_nodes
        self.source, self.num_nodes = source, n
        self.layouts: list[Layout3D] = []
        self.ops: list[list[list[tuple[int, int, LocalSpMM]]]] = []
        self._row_ids: list[torch.Tensor] = []
        for i, num_ops in enumerate(self._num_ops):
            lay = layout3d(self.grid, i, n, dims[i], dims[i + 1], num_ops=self._num_blocks[i])
            parity = i % 2
            blocks = operator_blocks(source, self.kind, parity, lay.rows, lay.cols)
            if len(blocks) != num_ops:
                raise UserError(
                    f"layer {i} stacks {num_ops} operators' weights, the source gives "
                    f"{len(blocks)} operators"
                )
            ops = [
                LocalSpMM(b.to(dtype=self.compute_dtype, device=self.device)).row_chunks(
                    self.overlap_chunks
                )
                for b in blocks
            ]
            in_rows = lay.h_sub if i == 0 else lay.cols
            self._row_ids.append(source.node_ids(parity, in_rows).to(self.device))
            self.layouts.append(lay)
            self.ops.append(ops)
        last = self.layouts[-1]
        self.input_block = (self.layouts[0].h_sub, self.layouts[0].fin)
        self.logits_rows, self.logits_cols = last.rows, last.fout
        self.row_axis, self.class_axis = last.depth, last.outer

    # ------------------------------------------------------------------------------ data
    @property
    def output_layout(self) -> Layout3D:
        """Layout of the last layer: its rows and class columns are the logits block."""
        return self.layouts[-1]

    # --------------------------------------------------------------------------- compute
    def layer(self, i: int, h: torch.Tensor, seed: int | None) -> torch.Tensor:  # noqa: D102
        lay = self.layouts[i]
        h = index_dropout(h, self.dropout, seed, self._row_ids[i], lay.fin[0], self.training)
        w = self.in_compute_dtype(self.weights[i])
        comp = self.comps[str(i)] if str(i) in self.comps else None
        comp = None if comp is None else self.in_compute_dtype(comp)
        h = plexus_layer(h, w, self.ops[i], self.grid, lay, input_split=i == 0, comp=comp)
        if self.has_bias:
            h = h + comm.copy_to(self.in_compute_dtype(self.biases[i]), self.grid, lay.depth)
        return torch.relu(h) if i < self.num_layers - 1 else h

    # ----------------------------------------------------------------------- checkpoints
    def weight_piece(self, layer: int):
        """(parameter, chunks, split axes): the weight block (input features ``fin`` × output
        features ``fout`` of every operator, stacked) flattened, this rank's range ``w_part``
        of it; split over all three axes."""
        from gnnpar.checkpoint.chunks import concat

        lay = self.layouts[layer]
        chunks = concat(self.block_boxes(layer, lay.fin, lay.fout), *lay.w_part)
        return self.weights[layer], chunks, ("x", "y", "z")

    def bias_piece(self, layer: int):
        """(parameter, chunks, split axes): output features ``fout``, split over the outer
        axis and replicated over the others."""
        from gnnpar.checkpoint.chunks import concat

        lay = self.layouts[layer]
        _, key = self.plain_keys(layer)
        n = lay.fout[1] - lay.fout[0]
        return self.biases[layer], concat([("model/" + key, (lay.fout[0],), (n,))]), (lay.outer,)

    # ------------------------------------------------------------------------ accounting
    def schedule(self, input_grad: bool = False) -> list[Step]:
        """The collectives of one forward and one backward pass, layer by layer (see
        :func:`~gnnpar.models.fullgraph.plexus.layer_schedule`); ``input_grad``: the input features'
        gradient is wanted too."""
        out: list[Step] = []
        for i, lay in enumerate(self.layouts):
            num_ops = len(self.ops[i])
            grad_in = input_grad or i > 0 or self.inputs is not None
            bases = 0 if self._bases[i] is None else self._bases[i][1]
            out += layer_schedule(
                self.grid,
                lay,
                num_ops,
                i == 0,
                grad_in,
                self.has_bias,
                self.overlap_chunks,
                bases,
            )
        return out

    def shard_numel(self) -> dict[str, int]:
        """Elements this rank holds: adjacency nonzeros, input features, weights."""
        return {
            "adjacency_nnz": sum(c[2].nnz for ops in self.ops for op in ops for c in op),
            "features": int(self.input_features().numel()),
            "weights": sum(int(w.numel()) for w in self.weights)
            + sum(int(c.numel()) for c in self.comps.values()),
        }

    # ----------------------------------------------------------------------- state dicts
    def full_weights(self, grads: bool = False) -> list[dict[str, torch.Tensor]]:
        """Every layer's full stacked weight blocks and bias (or their gradients), assembled
        from all ranks (collective over the tensor axis); with bases the blocks are
        [V_1; …; V_B; W_root] and ``"comp"`` the coefficients."""
        out = []
        members = self.grid.ranks("tensor")
        for i, lay in enumerate(self.layouts):
            w = self.weights[i]
            piece = (w.grad if grads else w.data).detach().reshape(-1)
            sizes = comm.gather_sizes(piece.numel(), self.grid, "tensor")
            flat = comm.all_gather(piece, self.grid, "tensor", sizes=sizes)
            num_ops = self._num_blocks[i]
            d_in, d_out = self.dims[i], self.dims[i + 1]
            full = torch.zeros(num_ops * d_in, d_out, dtype=self.dtype, device=self.device)
            blocks: dict[tuple, torch.Tensor] = {}
            offset = 0
            for r, size in zip(members, sizes, strict=True):
                lr = layout3d(
                    self.grid, i, self.num_nodes, d_in, d_out, num_ops, self.grid.coords(r)
                )
                key = (lr.fin, lr.fout)
                buf = blocks.setdefault(
                    key, torch.zeros(sum(lr.w_sizes), dtype=self.dtype, device=self.device)
                )
                buf[lr.w_part[0] : lr.w_part[1]] = flat[offset : offset + size]
                offset += size
            for (fin, fout), buf in blocks.items():
                blk = buf.view(num_ops * (fin[1] - fin[0]), fout[1] - fout[0])
                for k in range(num_ops):
                    rows = blk[k * (fin[1] - fin[0]) : (k + 1) * (fin[1] - fin[0])]
                    full[k * d_in + fin[0] : k * d_in + fin[1], fout[0] : fout[1]] = rows
            entry = {"weight": full}
            if str(i) in self.comps:
                comp = self.comps[str(i)]
                entry["comp"] = (comp.grad if grads else comp.data).detach().clone()
            if self.has_bias:
                b = self.biases[i]
                bias_piece = (b.grad if grads else b.data).detach()
                sizes = chunk_sizes(d_out, self.grid.size(lay.outer))
                gathered = comm.all_gather(bias_piece, self.grid, lay.outer, sizes=sizes)
                entry["bias"] = gathered
            out.append(entry)
        return out


ALGORITHMS = ("3d", "2d", "1d")


def check_relations(model: FullGraphGNN, source: ShardSource, algorithm: str = "3d") -> None:
    """An R-GCN reads a source of as many relations as it has: one UserError otherwise.
    Bases (``num_bases``) run on the 3D algorithm (:mod:`~gnnpar.models.fullgraph.plexus`);
    the 1D and 2D baselines keep the stacked weight whole and refuse them.
    (:func:`check_norm` refuses a per-relation source to the other kinds.)"""
    if model.kind != "rgcn":
        return
    have, layer = num_relations_of(source), model.layers[0]
    if layer.num_bases is not None and algorithm != "3d":
        raise UserError(
            f"num_bases: R-GCN bases run on the 3d algorithm, not {algorithm!r} (its layers "
            "keep the stacked weight [W_1; …; W_R; W_root] whole)"
        )
    if have != layer.num_relations:
        where = getattr(source, "norm_where", "the source")
        raise UserError(
            f"the rgcn model has {layer.num_relations} relations, {where} holds operators of "
            f"{have}: prepare the shards of the typed graph with norm='mean-per-relation'"
        )


def check_norm(kind: str, source: ShardSource) -> None:
    """A model of ``kind`` reads the adjacency :func:`~gnnpar.models.fullgraph.model.norm_of`
    names; a source recording another is refused in one line naming where it is recorded
    (e.g. a shard folder of GCN-normalised values, which have lost the edge weights GAT and
    GIN read, or an untyped folder for an R-GCN)."""
    from gnnpar.models.fullgraph.model import norm_of

    norm, want = getattr(source, "norm", None), norm_of(kind)
    if norm is not None and norm != want:
        raise UserError(
            f"{source.norm_where} is {norm!r}, but a {kind} model reads the {want!r} "
            f"adjacency: prepare the shards with norm={want!r}"
        )


def parallelize_fullgraph(
    model: FullGraphGNN,
    grid: ProcessGrid,
    source: ShardSource,
    algorithm: str = "3d",
    overlap_chunks: int = 1,
    dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
    data_parallel: bool = False,
) -> ShardedGNN:
    """Shard ``model`` over ``grid`` reading graph blocks from ``source``: ``"3d"`` (Plexus,
    the default), or CAGNET's ``"2d"`` (SUMMA over x × y) and ``"1d"`` (rows over all ranks)
    baselines. Parameters are kept in ``dtype`` (default: the model's), forward and backward
    run in ``compute_dtype`` (default: ``dtype``; ``torch.bfloat16`` for mixed precision).

    ``data_parallel`` (3D only): the grid may have a data axis, each data group training on a
    graph of its own (a sampled subgraph, :meth:`Parallel3DGNN.set_source`); the gradients
    are then averaged over data by :func:`gnnpar.shard.shard`. A full graph has no batch to
    split over data, so it is refused by default."""
    check_norm(model.kind, source)
    check_relations(model, source, algorithm)
    if data_parallel and (algorithm != "3d" or model.kind not in ("gcn", "sage")):
        raise UserError(
            f"data_parallel takes the 3d algorithm and a gcn or sage model, not "
            f"{algorithm!r} with {model.kind!r}"
        )
    if model.kind in ("gat", "gin"):
        from gnnpar.models.fullgraph.gat import parallel_gemm_first

        if algorithm not in ALGORITHMS:
            raise UserError(f"unknown full-graph algorithm {algorithm!r}; use one of {ALGORITHMS}")
        cls = parallel_gemm_first(model, algorithm)
        return cls(model, grid, source, dtype=dtype, compute_dtype=compute_dtype)
    if algorithm == "3d":
        return Parallel3DGNN(
            model, grid, source, overlap_chunks, dtype, compute_dtype, data_parallel
        )
    from gnnpar.models.fullgraph.cagnet import Parallel1DGNN, Parallel2DGNN

    if algorithm == "2d":
        return Parallel2DGNN(model, grid, source, dtype, compute_dtype)
    if algorithm == "1d":
        return Parallel1DGNN(model, grid, source, dtype=dtype, compute_dtype=compute_dtype)
    raise UserError(f"unknown full-graph algorithm {algorithm!r}; use one of {ALGORITHMS}")
