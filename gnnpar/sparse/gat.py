"""Full-graph GAT on the 3D (Plexus) and 1D layouts, composed of differentiable collectives.

A GAT layer needs ``Z = H W`` before it aggregates (the attention scores read Z), so it runs
GEMM first. **3D**, layer roles (a, b, c) = (outer, inner, depth) of
:mod:`gnnpar.sparse.layout`, the rank holding Â rows chunk c × columns chunk a, input H rows
chunk a × features chunk b, and the weight rows ``fin`` (chunk b) of every output column::

    H    = all-gather_c(h)                        (first layer: the input is split over c)
    Z    = all-reduce_b(H W_b)                    (partial products over the feature axis)
    α_src = Z·a_src per head on the columns; α_dst = Z·a_dst, moved to the rows' order by
           the permutation block R (rows c × columns a), all-reduce_a
    e    = LeakyReLU(α_dst[i] + α_src[j]) on the local nonzeros (the SDDMM)
    att  = softmax over each row: row max and row sum all-reduced over a (the ranks holding
           the row's columns); attention dropout by (seed, edge, head)
    OUT  = reduce-scatter_a(att · Z)             (rows c × output features chunk a)

which is exactly the layout the next layer reads (rows chunk c = its outer chunk, features
chunk a = its inner chunk, replicated over b = its depth). Backward is autograd's through
:func:`gnnpar.comm.copy_to` / ``reduce_from`` / ``scatter_to`` / ``gather_replicated``; the
weight's gradient is all-reduced over a, the attention vectors' over a and c, Z's over c.

**2D** (R × C = x × y; rank (i, j) holds Â rows chunk i × columns chunk j, H rows chunk i ×
features chunk j and the weight rows of features chunk j): ``Z = all-reduce_y(H W_j)`` (rows
i), all-gathered over x (every node's Z), the destination scores taken locally from it, the
softmax row max and sum all-reduced over y, the output reduce-scattered over y into rows i ×
output features chunk j, the 2D layout of the next layer.

**1D** (rows over one axis): ``Z_local = H_local W``, all-gather Z, everything else local (a
row's columns all live on its rank), weight and attention gradients all-reduced.

:func:`gat3d_layer_schedule`, :func:`gat2d_layer_schedule` and :func:`gat1d_layer_schedule`
describe each layer's
collectives once (:mod:`gnnpar.sparse.schedule`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from gnnpar import comm
from gnnpar.comm import chunk_sizes
from gnnpar.grid import GridShape, ProcessGrid
from gnnpar.nn.dropout import index_dropout
from gnnpar.nn.gcn import ACTIVATIONS
from gnnpar.sparse import attention
from gnnpar.sparse.layout import Layout3D, chunk, layout3d
from gnnpar.sparse.parallel import ShardedGNN
from gnnpar.sparse.schedule import Step, step
from gnnpar.sparse.source import ShardSource

if TYPE_CHECKING:
    from gnnpar.nn.gcn import FullGraphGNN, GATLayer


def _all_reduce_both(x: torch.Tensor, grid: ProcessGrid, axis: str) -> torch.Tensor:
    """Sum over ``axis`` forward, and of the gradient backward (the sum feeds computations
    that differ across the group)."""
    return comm.copy_to(comm.reduce_from(x, grid, axis), grid, axis)


class _Block:
    """One rank's edges of one layer: local (row, column) of each nonzero of Â's block, the
    edges' global (destination, source) ids, and the permutation block R's edges."""

    def __init__(self, source: ShardSource, parity: int, rows, cols, device, r_cols=None):
        blk = source.adjacency(parity, rows, cols)
        self.rows, self.cols = (t.to(device) for t in attention.edges(blk))
        self.dst = source.node_ids(1 - parity, rows).to(device)[self.rows]
        self.src = source.node_ids(parity, cols).to(device)[self.cols]
        root = source.root(parity, rows, cols if r_cols is None else r_cols)
        self.r_rows, self.r_cols = (t.to(device) for t in attention.edges(root))
        self.num_rows = rows[1] - rows[0]

    def move_rows(self, alpha: torch.Tensor) -> torch.Tensor:
        """``R @ alpha``: the column nodes' values at the rows' positions (0 elsewhere)."""
        out = alpha.new_zeros(self.num_rows, alpha.shape[1])
        return out.index_add(0, self.r_rows, alpha[self.r_cols])


class _GATParams(nn.Module):
    """Each layer's weight rows ``fin`` (all output columns), attention vectors and bias
    columns ``fout`` (whole where not split)."""

    def __init__(self, model: FullGraphGNN, fins, fouts, dtype, device) -> None:
        super().__init__()

        def piece(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach().to(device, dtype, copy=True))

        layers = model.layers
        self.weights = nn.ParameterList(
            piece(layer.weight[f[0] : f[1]]) for layer, f in zip(layers, fins, strict=True)
        )
        self.att_src = nn.ParameterList(piece(layer.att_src) for layer in layers)
        self.att_dst = nn.ParameterList(piece(layer.att_dst) for layer in layers)
        self.biases = nn.ParameterList(
            piece(layer.bias[f[0] : f[1]])
            for layer, f in zip(layers, fouts, strict=True)
            if layer.bias is not None
        )


class _GATBase(ShardedGNN):
    """What the 3D and 1D GAT share: the plain layers' hyper-parameters, parameters."""

    def _setup(self, model: FullGraphGNN, fins, fouts) -> None:
        self.gat_layers: list[GATLayer] = list(model.layers)
        self.fins, self.fouts = list(fins), list(fouts)
        self.act = ACTIVATIONS["gat"]
        self.params = _GATParams(model, fins, fouts, self.dtype, self.device)
        self.has_bias = len(self.params.biases) == self.num_layers

    def _attend(self, i, z, blk: _Block, alpha_dst, seed, axes, row_max=None, row_sum=None):
        """Layer ``i``'s attention over this rank's block: rows × K × F (partial where the
        rows' columns are split)."""
        return attention.gat_aggregate(
            z, alpha_dst, self.att(i, "src", axes), blk.rows, blk.cols, (blk.dst, blk.src),
            blk.num_rows, seed, _Settings(self.gat_layers[i], self.training), row_max, row_sum,
        )  # fmt: skip

    def att(self, i: int, which: str, axes: tuple[str, ...]) -> torch.Tensor:
        """Attention vector ``which`` ("src"/"dst") of layer ``i`` in the compute dtype, its
        gradient summed over ``axes`` (the ranks whose edges use it)."""
        p = (self.params.att_src if which == "src" else self.params.att_dst)[i]
        t = self.in_compute_dtype(p)
        for axis in axes:
            t = comm.copy_to(t, self.grid, axis)
        return t

    def _finish(self, i: int, out: torch.Tensor) -> torch.Tensor:
        layer = self.gat_layers[i]
        return out.reshape(out.shape[0], -1) if layer.concat else out.mean(dim=1)

    def checkpoint_layout(self):
        """This rank's :class:`~gnnpar.checkpoint.state.ModelLayout` against the plain
        GAT's state dict: the weight rows ``fin`` (split over :meth:`weight_axis`), the
        attention vectors (whole), the bias columns ``fout`` (split over :meth:`bias_axis`)."""
        from gnnpar.checkpoint.chunks import concat
        from gnnpar.checkpoint.state import MODEL, ModelLayout, Piece, TensorSpec, writes

        pieces, tensors, params, keys = [], {}, {}, []
        for i, layer in enumerate(self.gat_layers):
            width = layer.heads * layer.head_dim
            fin, fout = self.fins[i], self.fouts[i]
            w_axis, b_axis = self.weight_axis(i), self.bias_axis(i)
            entries = [
                ("weight", self.params.weights[i], (self.dims[i], width),
                 (fin[0], 0), (fin[1] - fin[0], width), (w_axis,) if w_axis else ()),
                ("att_src", self.params.att_src[i], (layer.heads, layer.head_dim),
                 (0, 0), (layer.heads, layer.head_dim), ()),
                ("att_dst", self.params.att_dst[i], (layer.heads, layer.head_dim),
                 (0, 0), (layer.heads, layer.head_dim), ()),
            ]  # fmt: skip
            if self.has_bias:
                n = self.dims[i + 1]
                split = (b_axis,) if b_axis else ()
                entries.append(
                    ("bias", self.params.biases[i], (n,), (fout[0],), (fout[1] - fout[0],), split)
                )
            for name, param, shape, offsets, sizes, split in entries:
                key = f"layers.{i}.{name}"
                keys.append(key)
                tensors[MODEL + key] = TensorSpec.of(shape, self.dtype)
                chunks = concat([(MODEL + key, offsets, sizes)])
                write = writes(self.grid, split)
                pieces.append(Piece(f"{name}.{i}", param.detach(), chunks, write))
                params[id(param)] = (chunks, write)
        return ModelLayout(pieces, tensors, keys, {}, params)

    def full_weights(self, grads: bool = False) -> list[dict[str, torch.Tensor]]:
        """Every layer's full weight, attention vectors and bias (or their gradients),
        gathered over the axes that split them (collective)."""
        out = []
        for i in range(self.num_layers):

            def val(p):
                return (p.grad if grads else p).detach()

            w = val(self.params.weights[i])
            axis = self.weight_axis(i)
            if axis is not None:
                sizes = chunk_sizes(self.dims[i], self.grid.size(axis))
                w = comm.all_gather(w.contiguous(), self.grid, axis, sizes=sizes)
            entry = {
                "weight": w,
                "att_src": val(self.params.att_src[i]),
                "att_dst": val(self.params.att_dst[i]),
            }
            if self.has_bias:
                b = val(self.params.biases[i])
                axis = self.bias_axis(i)
                if axis is not None:
                    sizes = chunk_sizes(self.dims[i + 1], self.grid.size(axis))
                    b = comm.all_gather(b.contiguous(), self.grid, axis, sizes=sizes)
                entry["bias"] = b
            out.append(entry)
        return out


class _Settings:
    """A layer's attention hyper-parameters in this model's training mode."""

    def __init__(self, layer: GATLayer, training: bool) -> None:
        self.negative_slope, self.attn_dropout = layer.negative_slope, layer.attn_dropout
        self.training = training


class Parallel3DGAT(_GATBase):
    """GAT on the x × y × z grid (see the module docstring)."""

    def __init__(
        self,
        model: FullGraphGNN,
        grid: ProcessGrid,
        source: ShardSource,
        dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype | None = None,
    ):
        super().__init__(model, grid, source, dtype, compute_dtype)
        n, dims = self.num_nodes, self.dims
        self.layouts = [layout3d(grid, i, n, dims[i], dims[i + 1]) for i in range(self.num_layers)]
        self._setup(model, [lay.fin for lay in self.layouts], [lay.fout for lay in self.layouts])
        self.blocks = [
            _Block(source, i % 2, lay.rows, lay.cols, self.device)
            for i, lay in enumerate(self.layouts)
        ]
        self._row_ids = [
            source.node_ids(i % 2, lay.h_sub if i == 0 else lay.cols).to(self.device)
            for i, lay in enumerate(self.layouts)
        ]
        first, last = self.layouts[0], self.layouts[-1]
        self.input_block = (first.h_sub, first.fin)
        self.logits_rows, self.logits_cols = last.rows, last.fout
        self.row_axis, self.class_axis = last.depth, last.outer

    def forward(self, x: torch.Tensor, dropout_seed: int | None = None) -> torch.Tensor:
        """This rank's block of the logits."""
        h, grid = x, self.grid
        for i, lay in enumerate(self.layouts):
            a, b, c = lay.outer, lay.inner, lay.depth
            layer = self.gat_layers[i]
            seed = None if dropout_seed is None else dropout_seed * 1009 + i
            h = index_dropout(h, self.dropout, seed, self._row_ids[i], lay.fin[0], self.training)
            if i == 0:
                h = comm.gather_replicated(h, grid, c, sizes=lay.h_sub_sizes)
            w = comm.copy_to(self.in_compute_dtype(self.params.weights[i]), grid, a)
            z = comm.copy_to(comm.reduce_from(h @ w, grid, b), grid, c)
            z = z.view(z.shape[0], layer.heads, layer.head_dim)
            blk = self.blocks[i]
            alpha_in = (z * self.att(i, "dst", (a, c))).sum(-1)
            alpha_dst = _all_reduce_both(blk.move_rows(alpha_in), grid, a)
            out = self._attend(
                i, z, blk, alpha_dst, seed, (a, c),
                lambda m, a=a: comm.all_reduce(m, grid, a, op="max"),
                lambda s, a=a: _all_reduce_both(s, grid, a),
            )  # fmt: skip
            out = self._finish(i, out)
            sizes = chunk_sizes(self.dims[i + 1], grid.size(a))
            h = comm.scatter_to(out, grid, a, dim=1, sizes=sizes)
            if self.has_bias:
                h = h + comm.copy_to(self.in_compute_dtype(self.params.biases[i]), grid, c)
            if i < self.num_layers - 1:
                h = self.act(h)
        return h

    def bias_axis(self, layer: int) -> str | None:
        """The axis that splits ``layer``'s bias (its output features)."""
        return self.layouts[layer].outer

    def weight_axis(self, layer: int) -> str | None:
        """The axis that splits ``layer``'s weight rows (its input features)."""
        return self.layouts[layer].inner

    def schedule(self, input_grad: bool = False) -> list[Step]:
        """The collectives of one forward and backward pass, layer by layer."""
        out: list[Step] = []
        for i, lay in enumerate(self.layouts):
            layer = self.gat_layers[i]
            out += gat3d_layer_schedule(
                self.grid, lay, layer.heads, layer.head_dim, self.dims[i + 1], i == 0,
                self.has_bias,
            )  # fmt: skip
        return out


def gat3d_layer_schedule(
    grid: ProcessGrid | GridShape,
    lay: Layout3D,
    heads: int,
    head_dim: int,
    d_out: int,
    input_split: bool,
    bias: bool,
) -> list[Step]:
    """The collectives of one forward and backward of the 3D GAT layer ``lay`` (``heads``
    heads of ``head_dim`` features, ``d_out`` output features: heads·F concatenated or F
    averaged), as its rank runs them."""
    a, b, c = lay.outer, lay.inner, lay.depth
    pa, pb, pc = grid.size(a), grid.size(b), grid.size(c)
    rows = lay.rows[1] - lay.rows[0]
    cols = lay.cols[1] - lay.cols[0]
    fin = lay.fin[1] - lay.fin[0]
    width = heads * head_dim
    out_full = pa * -(-d_out // pa) * rows
    tag = f"layer {lay.layer}"
    fw, bw = "forward", "backward"
    out: list[Step] = []
    if input_split:
        out += step(fw, c, "all_gather", pc, pc * max(lay.h_sub_sizes) * fin, f"{tag} gather H")
    out += step(fw, b, "all_reduce", pb, cols * width, f"{tag} Z = H·W")
    out += step(fw, a, "all_reduce", pa, rows * heads, f"{tag} α_dst to the rows")
    out += step(fw, a, "all_reduce", pa, rows * heads, f"{tag} softmax row max")
    out += step(fw, a, "all_reduce", pa, rows * heads, f"{tag} softmax row sum")
    out += step(fw, a, "reduce_scatter", pa, out_full, f"{tag} OUT = att·Z")
    out += step(bw, a, "all_gather", pa, out_full, f"{tag} dOUT")
    out += step(bw, a, "all_reduce", pa, rows * heads, f"{tag} d row sum")
    out += step(bw, a, "all_reduce", pa, rows * heads, f"{tag} d α_dst")
    out += step(bw, c, "all_reduce", pc, cols * width, f"{tag} dZ")
    for which in ("a_src", "a_dst"):
        out += step(bw, c, "all_reduce", pc, width, f"{tag} d {which} (depth)")
        out += step(bw, a, "all_reduce", pa, width, f"{tag} d {which} (outer)")
    out += step(bw, a, "all_reduce", pa, fin * width, f"{tag} dW")
    if bias:
        out += step(bw, c, "all_reduce", pc, lay.fout[1] - lay.fout[0], f"{tag} d bias")
    return out


class Parallel1DGAT(_GATBase):
    """GAT with rows over one axis (CAGNET's 1D layout; see the module docstring)."""

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
        full = [(0, d) for d in self.dims]
        self._setup(model, full[:-1], full[1:])
        self.blocks = [
            _Block(source, i % 2, self.rows, (0, n), self.device) for i in range(self.num_layers)
        ]
        self._row_ids = [
            source.node_ids(i % 2, self.rows).to(self.device) for i in range(self.num_layers)
        ]
        self.input_block = (self.rows, (0, self.dims[0]))
        self.logits_rows, self.logits_cols = self.rows, (0, self.dims[-1])
        self.row_axis, self.class_axis = axis, None

    def forward(self, x: torch.Tensor, dropout_seed: int | None = None) -> torch.Tensor:
        """This rank's rows of the logits (all classes)."""
        h, grid, axis = x, self.grid, self.axis
        for i in range(self.num_layers):
            layer = self.gat_layers[i]
            seed = None if dropout_seed is None else dropout_seed * 1009 + i
            h = index_dropout(h, self.dropout, seed, self._row_ids[i], 0, self.training)
            w = comm.copy_to(self.in_compute_dtype(self.params.weights[i]), grid, axis)
            z = comm.gather_from(h @ w, grid, axis, sizes=self.row_sizes)
            z = z.view(z.shape[0], layer.heads, layer.head_dim)
            blk = self.blocks[i]
            alpha_dst = blk.move_rows((z * self.att(i, "dst", (axis,))).sum(-1))
            out = self._finish(i, self._attend(i, z, blk, alpha_dst, seed, (axis,)))
            if self.has_bias:
                h = out + comm.copy_to(self.in_compute_dtype(self.params.biases[i]), grid, axis)
            else:
                h = out
            if i < self.num_layers - 1:
                h = self.act(h)
        return h

    def bias_axis(self, layer: int) -> str | None:
        """Biases are whole on every rank."""
        return None

    def weight_axis(self, layer: int) -> str | None:
        """Weights are whole on every rank."""
        return None

    def schedule(self, input_grad: bool = False) -> list[Step]:
        """The collectives of one forward and backward pass, layer by layer."""
        out: list[Step] = []
        for i in range(self.num_layers):
            layer = self.gat_layers[i]
            out += gat1d_layer_schedule(
                self.axis, self.row_sizes, self.dims[i], layer.heads, layer.head_dim,
                self.dims[i + 1], self.has_bias, i,
            )  # fmt: skip
        return out


def gat1d_layer_schedule(
    axis: str,
    row_sizes: list[int],
    d_in: int,
    heads: int,
    head_dim: int,
    d_out: int,
    bias: bool,
    layer: int = 0,
) -> list[Step]:
    """The collectives of one forward and backward of a 1D GAT layer over ``axis``."""
    p = len(row_sizes)
    width = heads * head_dim
    z_full = p * max(row_sizes) * width
    tag = f"layer {layer}"
    out = step("forward", axis, "all_gather", p, z_full, f"{tag} gather Z")
    out += step("backward", axis, "reduce_scatter", p, z_full, f"{tag} dZ")
    out += step("backward", axis, "all_reduce", p, width, f"{tag} d a_src")
    out += step("backward", axis, "all_reduce", p, width, f"{tag} d a_dst")
    out += step("backward", axis, "all_reduce", p, d_in * width, f"{tag} dW")
    if bias:
        out += step("backward", axis, "all_reduce", p, d_out, f"{tag} d bias")
    return out


class Parallel2DGAT(_GATBase):
    """GAT on an x × y grid (CAGNET's 2D layout; see the module docstring)."""

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
            raise ValueError(f"the 2D algorithm runs on x × y grids; this grid has z={grid.z}")
        n, r, c = self.num_nodes, grid.size("x"), grid.size("y")
        i, j = grid.rank("x"), grid.rank("y")
        self.row_sizes = chunk_sizes(n, r)
        self.rows = chunk(n, r, i)
        self.cols = chunk(n, c, j)
        self.fin = [chunk(d, c, j) for d in self.dims]
        self._setup(model, self.fin[:-1], self.fin[1:])
        self.blocks = [
            _Block(source, k % 2, self.rows, self.cols, self.device, r_cols=(0, n))
            for k in range(self.num_layers)
        ]
        self._row_ids = [
            source.node_ids(k % 2, self.rows).to(self.device) for k in range(self.num_layers)
        ]
        self.input_block = (self.rows, self.fin[0])
        self.logits_rows, self.logits_cols = self.rows, self.fin[-1]
        self.row_axis, self.class_axis = "x", "y"

    def forward(self, x: torch.Tensor, dropout_seed: int | None = None) -> torch.Tensor:
        """This rank's block of the logits (rows i, classes j)."""
        h, grid = x, self.grid
        for i in range(self.num_layers):
            layer = self.gat_layers[i]
            seed = None if dropout_seed is None else dropout_seed * 1009 + i
            h = index_dropout(
                h, self.dropout, seed, self._row_ids[i], self.fin[i][0], self.training
            )
            w = comm.copy_to(self.in_compute_dtype(self.params.weights[i]), grid, "x")
            z = _all_reduce_both(h @ w, grid, "y")  # rows i, all heads
            z = comm.gather_from(z, grid, "x", sizes=self.row_sizes)  # every node
            z = z.view(z.shape[0], layer.heads, layer.head_dim)
            blk = self.blocks[i]
            alpha_dst = blk.move_rows((z * self.att(i, "dst", ("x", "y"))).sum(-1))
            out = self._attend(
                i, z[self.cols[0] : self.cols[1]], blk, alpha_dst, seed, ("x", "y"),
                lambda m: comm.all_reduce(m, grid, "y", op="max"),
                lambda s: _all_reduce_both(s, grid, "y"),
            )  # fmt: skip
            sizes = chunk_sizes(self.dims[i + 1], grid.size("y"))
            h = comm.scatter_to(self._finish(i, out), grid, "y", dim=1, sizes=sizes)
            if self.has_bias:
                h = h + comm.copy_to(self.in_compute_dtype(self.params.biases[i]), grid, "x")
            if i < self.num_layers - 1:
                h = self.act(h)
        return h

    def bias_axis(self, layer: int) -> str | None:
        """Output features are split over y."""
        return "y"

    def weight_axis(self, layer: int) -> str | None:
        """Input features are split over y."""
        return "y"

    def schedule(self, input_grad: bool = False) -> list[Step]:
        """The collectives of one forward and backward pass, layer by layer."""
        out: list[Step] = []
        shape = (self.grid.size("x"), self.grid.size("y"))
        for i in range(self.num_layers):
            layer = self.gat_layers[i]
            out += gat2d_layer_schedule(
                shape, self.row_sizes, self.rows[1] - self.rows[0],
                self.fin[i][1] - self.fin[i][0], layer.heads, layer.head_dim,
                self.dims[i + 1], self.fin[i + 1][1] - self.fin[i + 1][0], self.has_bias, i,
            )  # fmt: skip
        return out


def gat2d_layer_schedule(
    grid: tuple[int, int],
    row_sizes: list[int],
    rows: int,
    fin: int,
    heads: int,
    head_dim: int,
    d_out: int,
    fout: int,
    bias: bool,
    layer: int = 0,
) -> list[Step]:
    """The collectives of one forward and backward of a 2D GAT layer on an R × C = ``grid``
    (x × y) grid, for the rank holding ``rows`` rows (of ``row_sizes`` over x), ``fin``
    input features and ``fout`` of the ``d_out`` output features."""
    r, c = grid
    width = heads * head_dim
    out_sizes = chunk_sizes(d_out, c)
    out_full = c * max(out_sizes) * rows
    z_all = r * max(row_sizes) * width
    tag = f"layer {layer}"
    fw, bw = "forward", "backward"
    out = step(fw, "y", "all_reduce", c, rows * width, f"{tag} Z = H·W")
    out += step(fw, "x", "all_gather", r, z_all, f"{tag} gather Z")
    out += step(fw, "y", "all_reduce", c, rows * heads, f"{tag} softmax row max")
    out += step(fw, "y", "all_reduce", c, rows * heads, f"{tag} softmax row sum")
    out += step(fw, "y", "reduce_scatter", c, out_full, f"{tag} OUT = att·Z")
    out += step(bw, "y", "all_gather", c, out_full, f"{tag} dOUT")
    out += step(bw, "y", "all_reduce", c, rows * heads, f"{tag} d row sum")
    out += step(bw, "x", "reduce_scatter", r, z_all, f"{tag} dZ (x)")
    out += step(bw, "y", "all_reduce", c, rows * width, f"{tag} dZ (y)")
    for which in ("a_src", "a_dst"):
        out += step(bw, "y", "all_reduce", c, width, f"{tag} d {which} (y)")
        out += step(bw, "x", "all_reduce", r, width, f"{tag} d {which} (x)")
    out += step(bw, "x", "all_reduce", r, fin * width, f"{tag} dW")
    if bias:
        out += step(bw, "x", "all_reduce", r, fout, f"{tag} d bias")
    return out
