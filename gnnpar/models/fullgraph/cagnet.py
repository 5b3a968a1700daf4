"""CAGNET's 1D and 2D full-graph algorithms: the baselines the 3D layer must beat.

**1D** (P ranks of one axis, default ``"tensor"``): rank i holds rows i of Â (all columns) and
rows i of H (all features); the weights are replicated.
Per layer: all-gather H (backward: reduce-scatter of its gradient), local SpMM and GEMM,
all-reduce of the weight gradient.

**2D** (SUMMA on an R × C grid, rows over ``x``, columns over ``y``; z must be 1): rank (i, j)
holds block (i, j) of Â and of H (rows i, features j). Per layer: H's column block j is
all-gathered over x; the row i of Â is streamed block by block, each broadcast over y from
its owner (stage j′ multiplies Â(i, j′) by rows j′ of H); the aggregate is all-gathered over y
and multiplied by column block j of the replicated W. Backward streams Â again and
reduce-scatters the gradients.

A layer of several sparse operators (GraphSAGE's Â and root, R-GCN's Â_1 … Â_R and root:
:func:`~gnnpar.models.fullgraph.parallelize.operator_blocks`) multiplies each, concatenates
the aggregates along the features and multiplies by the stacked weight; 2D streams every
operator's block.

Both compose gnnpar's differentiable collectives, so their backward passes are the adjoints
of their forward passes by construction. Each layer's collectives are described once, by
:func:`rows1d_schedule` and :func:`summa_schedule`, from which the models' byte accounting
comes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from gnnpar import comm
from gnnpar.comm import chunk_sizes
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid
from gnnpar.models.fullgraph.layout import chunk
from gnnpar.models.fullgraph.parallelize import ShardedGNN, operator_blocks
from gnnpar.models.fullgraph.schedule import Step, step
from gnnpar.nn.dropout import index_dropout
from gnnpar.sparse.csr import CSRBlock
from gnnpar.sparse.kernels import LocalSpMM, spmm
from gnnpar.sparse.source import ShardSource

if TYPE_CHECKING:
    from gnnpar.models.fullgraph.model import FullGraphGNN


class _ReplicatedParams(nn.Module):
    """Full weights and biases of the plain model, replicated on every rank."""

    def full(self, grads: bool = False) -> list[dict[str, torch.Tensor]]:
        """Each layer's stacked weight and bias (or their gradients)."""
        out = []
        for i, w in enumerate(self.weights):
            entry = {"weight": (w.grad if grads else w).detach()}
            if len(self.biases) == len(self.weights):
                b = self.biases[i]
                entry["bias"] = (b.grad if grads else b).detach()
            out.append(entry)
        return out

    def __init__(self, model: FullGraphGNN, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(layer.stacked_weight().detach().to(device, dtype, copy=True))
            for layer in model.layers
        )
        self.biases = nn.ParameterList(
            nn.Parameter(layer.bias.detach().to(device, dtype, copy=True))
            for layer in model.layers
            if layer.bias is not None
        )


class Parallel1DGNN(ShardedGNN):
    """CAGNET 1D: row blocks of Â and H over one axis, weights replicated."""

    def __init__(
        self,
        model: FullGraphGNN,
        grid: ProcessGrid,
        source: ShardSource,
        axis: str = "tensor",
        dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype | None = None,
    ):
        super().__init__(model, grid, source, dtype, compute_dtype)
        n, p = self.num_nodes, grid.size(axis)
        self.axis = axis
        self.row_sizes = chunk_sizes(n, p)
        self.rows = chunk(n, p, grid.rank(axis))
        self.ops = [
            [
                LocalSpMM(b.to(dtype=self.compute_dtype, device=self.device))
                for b in operator_blocks(source, self.kind, i % 2, self.rows, (0, n))
            ]
            for i in range(self.num_layers)
        ]
        self.params = _ReplicatedParams(model, self.dtype, self.device)
        self.has_bias = len(self.params.biases) == self.num_layers
        self._row_ids = [
            source.node_ids(i % 2, self.rows).to(self.device) for i in range(self.num_layers)
        ]
        self.input_block = (self.rows, (0, self.dims[0]))
        self.logits_rows, self.logits_cols = self.rows, (0, self.dims[-1])
        self.row_axis, self.class_axis = axis, None

    def layer(self, i: int, h: torch.Tensor, seed: int | None) -> torch.Tensor:
        """Layer ``i`` on this rank's rows (all features)."""
        h = index_dropout(h, self.dropout, seed, self._row_ids[i], 0, self.training)
        out = self.gather_buffer(self.row_sizes, h.shape[1], h.dtype)
        full = comm.gather_from(h, self.grid, self.axis, sizes=self.row_sizes, out=out)
        # the SpMMs are done with ``full`` before any other layer gathers into the buffer
        aggs = [spmm(op, full) for op in self.ops[i]]
        agg = aggs[0] if len(aggs) == 1 else torch.cat(aggs, dim=1)
        w = comm.copy_to(self.in_compute_dtype(self.params.weights[i]), self.grid, self.axis)
        if self.has_bias:
            b = self.in_compute_dtype(self.params.biases[i])
            h = torch.addmm(comm.copy_to(b, self.grid, self.axis), agg, w)
        else:
            h = agg @ w
        # in place: the product's backward keeps its inputs, not its result
        return h.relu_() if i < self.num_layers - 1 else h

    def schedule(self, input_grad: bool = False) -> list[Step]:
        """The collectives of one forward and one backward pass, layer by layer (see
        :func:`rows1d_schedule`)."""
        out: list[Step] = []
        for i in range(self.num_layers):
            d_in, d_out = self.dims[i], self.dims[i + 1]
            num_ops = len(self.ops[i])
            grad_in = input_grad or i > 0 or self.inputs is not None  # learnt rows: dX too
            out += rows1d_schedule(
                self.axis, self.row_sizes, d_in, d_out, num_ops, grad_in, self.has_bias, i
            )
        return out


class _SummaSpMM(torch.autograd.Function):
    """Â(i, :) @ H(:, j) with the row of Â streamed over the column axis block by block."""

    @staticmethod
    def forward(ctx, h_col, model, layer):  # noqa: D102
        ctx.model, ctx.layer = model, layer
        out = None
        for j2, cols in enumerate(model.col_ranges):
            ops = model.stage_ops(layer, j2)
            part = torch.cat([op.mm(h_col[cols[0] : cols[1]]) for op in ops], dim=1)
            out = part if out is None else out + part
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        model, layer = ctx.model, ctx.layer
        width = grad.shape[1] // model.num_ops
        pieces = []
        for j2 in range(len(model.col_ranges)):
            ops = model.stage_ops(layer, j2)
            g = None
            for k, op in enumerate(ops):
                part = op.T.mm(grad[:, k * width : (k + 1) * width].contiguous())
                g = part if g is None else g + part
            pieces.append(g)
        return torch.cat(pieces, dim=0), None, None


class Parallel2DGNN(ShardedGNN):
    """CAGNET 2D (SUMMA): Â and H in R × C blocks over (x, y); weights replicated."""

    def __init__(
        self,
        model: FullGraphGNN,
        grid: ProcessGrid,
        source: ShardSource,
        dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype | None = None,
    ):
        super().__init__(model, grid, source, dtype, compute_dtype)
        if grid.z != 1:
            raise UserError(f"the 2D algorithm runs on x × y grids; this grid has z={grid.z}")
        n = self.num_nodes
        r, c = grid.size("x"), grid.size("y")
        i, j = grid.rank("x"), grid.rank("y")
        self.num_ops = model.layers[0].num_ops
        self.row_sizes = chunk_sizes(n, r)
        self.rows = chunk(n, r, i)
        self.col_ranges = [chunk(n, c, k) for k in range(c)]
        self.own_blocks = [
            [
                b.to(dtype=self.compute_dtype, device=self.device)
                for b in operator_blocks(
                    source, self.kind, layer % 2, self.rows, self.col_ranges[j]
                )
            ]
            for layer in range(self.num_layers)
        ]
        # Every stage's nnz is exchanged once, so each broadcast knows its sizes.
        self.stage_nnz = [
            [comm.gather_sizes(b.nnz, grid, "y") for b in blocks] for blocks in self.own_blocks
        ]
        self.index_dtype = torch.int32 if n < 2**31 else torch.int64
        self.fin = [chunk(d, c, j) for d in self.dims]
        self.fin_sizes = [chunk_sizes(d, c) for d in self.dims]
        self.params = _ReplicatedParams(model, self.dtype, self.device)
        self.has_bias = len(self.params.biases) == self.num_layers
        self._row_ids = [
            source.node_ids(layer % 2, self.rows).to(self.device)
            for layer in range(self.num_layers)
        ]
        self.input_block = (self.rows, self.fin[0])
        self.logits_rows, self.logits_cols = self.rows, self.fin[-1]
        self.row_axis, self.class_axis = "x", "y"

    def stage_ops(self, layer: int, stage: int) -> list[LocalSpMM]:
        """Block Â(i, stage) of ``layer``: broadcast over y from the rank that owns it."""
        rows = self.rows[1] - self.rows[0]
        cols = self.col_ranges[stage]
        mine = self.grid.rank("y") == stage
        out = []
        for k, own in enumerate(self.own_blocks[layer]):
            nnz = self.stage_nnz[layer][k][stage]
            if mine:
                indptr, idx, vals = own.indptr, own.indices.to(self.index_dtype), own.values
            else:
                indptr = torch.empty(rows + 1, dtype=torch.int64, device=self.device)
                idx = torch.empty(nnz, dtype=self.index_dtype, device=self.device)
                vals = torch.empty(nnz, dtype=self.compute_dtype, device=self.device)
            for t in (indptr, idx, vals):
                comm.broadcast(t, self.grid, "y", src=stage)
            block = CSRBlock(indptr, idx.long(), vals, (rows, cols[1] - cols[0]))
            out.append(LocalSpMM(block, autotune=False))
        return out

    def layer(self, i: int, h: torch.Tensor, seed: int | None) -> torch.Tensor:
        """Layer ``i`` on this rank's block (rows i, features j)."""
        grid = self.grid
        h = index_dropout(h, self.dropout, seed, self._row_ids[i], self.fin[i][0], self.training)
        h_col = comm.gather_from(h, grid, "x", sizes=self.row_sizes)
        agg = _SummaSpMM.apply(h_col, self, i)  # rows i × (ops · features j)
        width = self.fin[i][1] - self.fin[i][0]
        parts = [agg[:, k * width : (k + 1) * width] for k in range(self.num_ops)]
        full = torch.cat(
            [comm.gather_from(p, grid, "y", dim=1, sizes=self.fin_sizes[i]) for p in parts],
            dim=1,
        )
        w = self.in_compute_dtype(self.params.weights[i])
        w = comm.split_to(comm.copy_to(w, grid, "x"), grid, "y", dim=1)
        h = full @ w
        if self.has_bias:
            b = self.in_compute_dtype(self.params.biases[i])
            b = comm.split_to(comm.copy_to(b, grid, "x"), grid, "y")
            h = h + b
        return torch.relu(h) if i < self.num_layers - 1 else h

    def schedule(self, input_grad: bool = False) -> list[Step]:
        """The collectives of one forward and one backward pass, layer by layer (see
        :func:`summa_schedule`)."""
        ies = torch.tensor([], dtype=self.index_dtype).element_size()
        out: list[Step] = []
        for i in range(self.num_layers):
            out += summa_schedule(
                (self.grid.size("x"), self.grid.size("y")),
                self.row_sizes,
                self.rows[1] - self.rows[0],
                self.fin_sizes[i],
                self.fin[i][1] - self.fin[i][0],
                self.dims[i + 1],
                self.stage_nnz[i],
                input_grad or i > 0 or self.inputs is not None,  # learnt rows: dX too
                self.has_bias,
                ies,
                i,
            )
        return out


def rows1d_schedule(
    axis: str,
    row_sizes: list[int],
    d_in: int,
    d_out: int,
    num_ops: int,
    input_grad: bool,
    bias: bool,
    layer: int = 0,
) -> list[Step]:
    """The collectives of one forward and backward of a 1D layer over ``axis`` (rows split
    into ``row_sizes``; ``num_ops`` operators of ``d_in`` → ``d_out`` features, weights
    replicated): the one description of this layer's traffic."""
    p = len(row_sizes)
    h_full = p * max(row_sizes) * d_in
    tag = f"layer {layer}"
    out = step("forward", axis, "all_gather", p, h_full, f"{tag} gather H")
    if input_grad:
        out += step("backward", axis, "reduce_scatter", p, h_full, f"{tag} dH")
    out += step("backward", axis, "all_reduce", p, num_ops * d_in * d_out, f"{tag} dW")
    if bias:
        out += step("backward", axis, "all_reduce", p, d_out, f"{tag} d bias")
    return out


def summa_schedule(
    grid: tuple[int, int],
    row_sizes: list[int],
    rows: int,
    fin_sizes: list[int],
    fin: int,
    d_out: int,
    stage_nnz: list[list[int]],
    input_grad: bool,
    bias: bool,
    index_size: int,
    layer: int = 0,
) -> list[Step]:
    """The collectives of one forward and backward of a 2D (SUMMA) layer on an R × C =
    ``grid`` (x × y) grid, for the rank holding ``rows`` rows (of ``row_sizes`` over x) and
    ``fin`` input features (of ``fin_sizes`` over y); ``stage_nnz[op][j]`` is the nonzero
    count of operator ``op``'s block (i, j), streamed over y as (indptr int64, column ids
    of ``index_size`` bytes, values): the one description of this layer's traffic."""
    r, c = grid
    num_ops = len(stage_nnz)
    d_in = sum(fin_sizes)
    out_sizes = chunk_sizes(d_out, c)  # output features are split over y too
    h_col = r * max(row_sizes) * fin
    agg = c * max(fin_sizes) * rows
    tag = f"layer {layer}"
    fw, bw = "forward", "backward"
    stream: list[tuple[int, int, str]] = []  # (elements, itemsize, what) of every broadcast
    for k, per_op in enumerate(stage_nnz):
        for j, nnz in enumerate(per_op):
            what = f"{tag} stream A op {k} block {j}"
            stream += [(rows + 1, 8, f"{what} indptr"), (nnz, index_size, f"{what} indices")]
            stream += [(nnz, 0, f"{what} values")]
    out = step(fw, "x", "all_gather", r, h_col, f"{tag} gather H columns")
    for n, size, what in stream:
        out += step(fw, "y", "broadcast", c, n, what, size)
    for k in range(num_ops):
        out += step(fw, "y", "all_gather", c, agg, f"{tag} gather AGG op {k}")
    out += step(bw, "y", "all_gather", c, c * max(out_sizes) * num_ops * d_in, f"{tag} dW (y)")
    out += step(bw, "x", "all_reduce", r, num_ops * d_in * d_out, f"{tag} dW (x)")
    if input_grad:  # only H's gradient needs these (none for raw features)
        for k in range(num_ops):
            out += step(bw, "y", "reduce_scatter", c, agg, f"{tag} dAGG op {k}")
        for n, size, what in stream:
            out += step(bw, "y", "broadcast", c, n, f"{what} (backward)", size)
        out += step(bw, "x", "reduce_scatter", r, h_col, f"{tag} dH columns")
    if bias:
        out += step(bw, "y", "all_gather", c, c * max(out_sizes), f"{tag} d bias (y)")
        out += step(bw, "x", "all_reduce", r, d_out, f"{tag} d bias (x)")
    return out
