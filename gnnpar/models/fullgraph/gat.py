"""Full-graph GAT and GIN on the 3D (Plexus), 2D and 1D layouts: GEMM-first layers composed
of differentiable collectives.

A GAT layer needs ``Z = H W`` before it aggregates (the attention scores read Z), and GIN's
first MLP weight commutes with its (linear) sum, so both run the GEMM first. **3D**, layer
roles (a, b, c) = (outer, inner, depth) of :mod:`gnnpar.models.fullgraph.layout`, the rank holding Â
rows chunk c × columns chunk a, input H rows chunk a × features chunk b, and the weight rows
``fin`` (chunk b) of every output column::

    H    = all-gather_c(h)                        (first layer: the input is split over c)
    Z    = all-reduce_b(H W_b)                    (partial products over the feature axis)

then GAT::

    α_src = Z·a_src per head on the columns; α_dst = Z·a_dst, moved to the rows' order by
           the permutation block R (rows c × columns a), all-reduce_a
    e    = LeakyReLU(α_dst[i] + α_src[j]) + log w_ij on the local nonzeros (the SDDMM; w:
           the ``"raw"`` adjacency's values, the edge weights)
    att  = softmax over each row: row max and row sum all-reduced over a (the ranks holding
           the row's columns); attention dropout by (seed, edge, head)
    OUT  = reduce-scatter_a(att · Z)             (rows c × output features chunk a)

or GIN::

    AGG  = reduce-scatter_a(Σ_neighbours w·Z + (1 + ε)·R Z)      (rows c × chunk a)
    μ    = all-reduce_c(Σ_rows AGG) / N;  σ² = all-reduce_c(Σ_rows (AGG - μ)²) / N
    OUT  = reduce-scatter_a(ReLU(γ·(AGG - μ)/sqrt(σ² + ε_bn) + β) W₂[chunk a, :]) + b₂

(the BatchNorm's statistics of each feature over all N nodes: the ranks along c hold the
other rows; without ``batch_norm`` the μ, σ² line is not there and ``AGG + b₁`` takes the
BatchNorm's place)

which is exactly the layout the next layer reads (rows chunk c = its outer chunk, features
chunk a = its inner chunk, replicated over b = its depth). Backward is autograd's through
:func:`gnnpar.comm.copy_to` / ``reduce_from`` / ``scatter_to`` / ``gather_replicated``.

**2D** (R × C = x × y; rank (i, j) holds Â rows chunk i × columns chunk j, H rows chunk i ×
features chunk j and the weight rows of features chunk j): ``Z = all-reduce_y(H W_j)`` (rows
i), all-gathered over x (every node's Z, of which the block's columns are used), then the
same tail with y in a's place (the axis splitting a row's columns) and x in c's (the axis
splitting rows, over which GIN's BatchNorm statistics are summed).

**1D** (rows over one axis): ``Z_local = H_local W``, all-gather Z, everything else local (a
row's columns all live on its rank) but GIN's BatchNorm statistics, summed over the axis;
parameter gradients all-reduced.

Each layer's collectives are described once, by :func:`gat3d_layer_schedule`,
:func:`gat2d_layer_schedule`, :func:`gat1d_layer_schedule`, :func:`gin3d_layer_schedule`,
:func:`gin2d_layer_schedule` and :func:`gin1d_layer_schedule`
(:mod:`gnnpar.models.fullgraph.schedule`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from gnnpar import comm
from gnnpar.comm import chunk_sizes
from gnnpar.errors import UserError
from gnnpar.grid import GridShape, ProcessGrid
from gnnpar.models.fullgraph.layout import Layout3D, chunk, layout3d
from gnnpar.models.fullgraph.model import ACTIVATIONS, gin_aggregate, gin_batch_norm
from gnnpar.models.fullgraph.parallelize import ShardedGNN
from gnnpar.models.fullgraph.schedule import Step, step
from gnnpar.nn.dropout import index_dropout
from gnnpar.sparse import attention
from gnnpar.sparse.source import ShardSource

if TYPE_CHECKING:
    from gnnpar.models.fullgraph.model import FullGraphGNN


class _Block:
    """One rank's edges of one layer: local (row, column) of each nonzero of the ``"raw"``
    adjacency's block and its weight (the block's value, in ``dtype``), the edges' global
    (destination, source) ids, and the permutation block R's edges."""

    def __init__(self, source: ShardSource, parity: int, rows, cols, device, dtype) -> None:
        blk = source.adjacency(parity, rows, cols).to(dtype=dtype)
        self.edges = attention.Edges(blk).to(device)
        self.rows, self.cols = self.edges.rows, self.edges.cols
        self.dst = source.node_ids(1 - parity, rows).to(device)[self.rows]
        self.src = source.node_ids(parity, cols).to(device)[self.cols]
        self.neighbours = self.dst != self.src  # the edges that are not self loops
        self.weight = blk.values.to(device)[self.neighbours]  # GIN's neighbour weights
        root = source.root(parity, rows, cols)
        self.r_rows, self.r_cols = (t.to(device) for t in attention.edges(root))
        self.num_rows = rows[1] - rows[0]

    def move_rows(self, alpha: torch.Tensor) -> torch.Tensor:
        """``R @ alpha``: the column nodes' values at the rows' positions (0 elsewhere)."""
        out = alpha.new_zeros(self.num_rows, alpha.shape[1])
        return out.index_add(0, self.r_rows, alpha[self.r_cols])


class _Axes(NamedTuple):
    """A layer's axes: ``part`` splits a row's columns (partial sums; None in 1D), ``rows``
    splits the rows (parameters used by every row block are summed over it), ``weight``
    splits the first weight's rows (None: whole), ``out`` the output features."""

    part: str | None
    rows: str
    weight: str | None
    out: str | None


class _Pieces(nn.Module):
    """Each layer's pieces of the plain layers' parameters: one ParameterList per name."""

    def __init__(self, lists: dict[str, list[torch.Tensor]]) -> None:
        super().__init__()
        for name, tensors in lists.items():
            setattr(self, name, nn.ParameterList(nn.Parameter(t) for t in tensors))


class _GemmFirst(ShardedGNN):
    """What the GEMM-first models share: parameters cut by a spec, the layer loop,
    checkpoints, full weights and schedules. A layout subclass provides the geometry
    (``fins``, ``fouts``, ``blocks``, :meth:`axes`, :meth:`_z`, :meth:`_head_steps`); a kind
    mixin the spec ``SPEC`` of ``(state-dict name, piece)`` (piece: ``in`` rows ``fin`` of
    the first dimension, ``out`` rows ``fout``, ``whole``), :meth:`_tail`, :meth:`_tail_steps`
    and :meth:`width`."""

    SPEC: tuple[tuple[str, str], ...] = ()

    def _setup(self, model: FullGraphGNN, fins, fouts) -> None:
        self.plain_layers = list(model.layers)
        self.fins, self.fouts = list(fins), list(fouts)
        self.act = ACTIVATIONS[model.kind]
        lists: dict[str, list[torch.Tensor]] = {}
        for i, layer in enumerate(self.plain_layers):
            for name, cut in self.SPEC:
                t = getattr(layer, name)
                if t is None:
                    continue
                r = {"in": fins[i], "out": fouts[i]}.get(cut, (0, t.shape[0]))
                lists.setdefault(name, []).append(
                    t.detach()[r[0] : r[1]].to(self.device, self.dtype, copy=True)
                )
        self.params = _Pieces(lists)
        self.has_bias = model.layers[0].bias is not None

    def param(self, name: str, i: int, *axes: str | None) -> torch.Tensor:
        """Piece ``name`` of layer ``i`` in the compute dtype, its gradient summed over
        ``axes`` (those that are not None: the ranks whose blocks use it)."""
        t = self.in_compute_dtype(getattr(self.params, name)[i])
        for axis in axes:
            if axis is not None:
                t = comm.copy_to(t, self.grid, axis)
        return t

    def layer(self, i: int, h: torch.Tensor, seed: int | None) -> torch.Tensor:  # noqa: D102
        h = index_dropout(h, self.dropout, seed, self._row_ids[i], self.fins[i][0], self.training)
        z_cols, z_root = self._z(i, h)
        h = self._tail(i, z_cols, z_root, seed)
        return self.act(h) if i < self.num_layers - 1 else h

    def _scatter(self, out: torch.Tensor, i: int) -> torch.Tensor:
        """The row block's output features summed over the part axis, this rank's chunk."""
        part = self.axes(i).part
        if part is None:
            return out
        sizes = chunk_sizes(self.dims[i + 1], self.grid.size(part))
        return comm.scatter_to(out, self.grid, part, dim=1, sizes=sizes)

    def schedule(self, input_grad: bool = False) -> list[Step]:
        """The collectives of one forward and backward pass, layer by layer (no input
        gradient needs any: ``input_grad`` changes nothing)."""
        out: list[Step] = []
        for i in range(self.num_layers):
            out += self._head_steps(i, self.width(i))
            out += self._tail_steps(i)
        return out

    def _entries(self, i: int):
        """(name, parameter, full shape, offsets, sizes, split axes) of layer ``i``."""
        out = []
        ax = self.axes(i)
        for name, cut in self.SPEC:
            full = getattr(self.plain_layers[i], name)
            if full is None:
                continue
            shape = tuple(full.shape)
            r, axis = {"in": (self.fins[i], ax.weight), "out": (self.fouts[i], ax.out)}.get(
                cut, ((0, shape[0]), None)
            )
            offsets = (r[0],) + (0,) * (len(shape) - 1)
            sizes = (r[1] - r[0], *shape[1:])
            split = (axis,) if axis else ()
            out.append((name, getattr(self.params, name)[i], shape, offsets, sizes, split))
        return out

    def checkpoint_layout(self):
        """This rank's :class:`~gnnpar.checkpoint.state.ModelLayout` against the plain
        model's state dict (each piece a row range of its tensor, split over one axis or
        whole)."""
        from gnnpar.checkpoint.chunks import concat
        from gnnpar.checkpoint.state import MODEL, ModelLayout, Piece, TensorSpec, writes

        pieces, tensors, params, keys = [], {}, {}, []
        for i in range(self.num_layers):
            for name, param, shape, offsets, sizes, split in self._entries(i):
                key = f"layers.{i}.{name}"
                keys.append(key)
                tensors[MODEL + key] = TensorSpec.of(shape, self.dtype)
                chunks = concat([(MODEL + key, offsets, sizes)])
                write = writes(self.grid, split)
                pieces.append(Piece(f"{name}.{i}", param.detach(), chunks, write))
                params[id(param)] = (chunks, write)
        return ModelLayout(pieces, tensors, keys, {}, params)

    def full_weights(self, grads: bool = False) -> list[dict[str, torch.Tensor]]:
        """Every layer's full parameters (or gradients) by plain name, gathered over the
        axes that split them (collective)."""
        out = []
        for i in range(self.num_layers):
            entry = {}
            for name, param, shape, _, _, split in self._entries(i):
                t = (param.grad if grads else param).detach()
                if split:
                    sizes = chunk_sizes(shape[0], self.grid.size(split[0]))
                    t = comm.all_gather(t.contiguous(), self.grid, split[0], sizes=sizes)
                entry[name] = t
            out.append(entry)
        return out


# --------------------------------------------------------------------------------- kinds
class _GATKind:
    """GAT's parameters, tail and tail steps (a mixin of :class:`_GemmFirst`)."""

    SPEC = (("weight", "in"), ("att_src", "whole"), ("att_dst", "whole"), ("bias", "out"))

    def width(self, i: int) -> int:
        """Columns of Z: heads · F."""
        layer = self.plain_layers[i]
        return layer.heads * layer.head_dim

    def _tail(self, i, z_cols, z_root, seed):
        layer, blk, ax, grid = self.plain_layers[i], self.blocks[i], self.axes(i), self.grid
        shape = (layer.heads, layer.head_dim)
        z_cols, z_root = z_cols.view(-1, *shape), z_root.view(-1, *shape)
        alpha_dst = blk.move_rows((z_root * self.param("att_dst", i, ax.part, ax.rows)).sum(-1))
        row_max = row_sum = None
        if ax.part is not None:
            alpha_dst = comm.all_reduce_both(alpha_dst, grid, ax.part)
            row_max = lambda m: comm.all_reduce(m, grid, ax.part, op="max")  # noqa: E731
            row_sum = lambda s: comm.all_reduce_both(s, grid, ax.part)  # noqa: E731
        out = attention.gat_aggregate(
            z_cols, alpha_dst, self.param("att_src", i, ax.part, ax.rows), blk.edges,
            (blk.dst, blk.src), seed, _Settings(layer, self.training),
            row_max, row_sum,
        )  # fmt: skip
        out = out.reshape(out.shape[0], -1) if layer.concat else out.mean(dim=1)
        h = self._scatter(out, i)
        if self.has_bias:
            h = h + self.param("bias", i, ax.rows)
        return h

    def _tail_steps(self, i: int) -> list[Step]:
        layer = self.plain_layers[i]
        return _gat_tail_steps(
            self.grid, self.axes(i), layer.heads, layer.head_dim, self.dims[i + 1],
            self.fouts[i][1] - self.fouts[i][0], self.has_bias, i, self.blocks[i].num_rows,
        )  # fmt: skip


class _Settings:
    """A layer's attention hyper-parameters in this model's training mode."""

    def __init__(self, layer, training: bool) -> None:
        self.negative_slope, self.attn_dropout = layer.negative_slope, layer.attn_dropout
        self.training = training


class _GINKind:
    """GIN's parameters, tail and tail steps (a mixin of :class:`_GemmFirst`)."""

    SPEC = (("weight", "in"), ("hidden_bias", "out"), ("norm_weight", "out"),
            ("norm_bias", "out"), ("weight_out", "out"), ("bias", "out"),
            ("eps", "whole"))  # fmt: skip

    def width(self, i: int) -> int:
        """Columns of Z: the MLP's width (the layer's output width)."""
        return self.dims[i + 1]

    def _tail(self, i, z_cols, z_root, seed):
        blk, ax = self.blocks[i], self.axes(i)
        keep = blk.neighbours
        agg = gin_aggregate(
            z_cols, z_root, (blk.rows[keep], blk.cols[keep], blk.weight),
            (blk.r_rows, blk.r_cols),
            blk.num_rows, self.param("eps", i, ax.part, ax.rows),
        )  # fmt: skip
        h = self._scatter(agg, i)
        if self.has_bias and not self.has_norm:
            h = h + self.param("hidden_bias", i, ax.rows)
        if self.has_norm:
            # this rank holds some rows of its features: the ranks along ax.rows the others
            h = gin_batch_norm(
                h, self.param("norm_weight", i, ax.rows), self.param("norm_bias", i, ax.rows),
                self.num_nodes, lambda t: comm.all_reduce_both(t, self.grid, ax.rows),
            )  # fmt: skip
        h = self._scatter(torch.relu(h) @ self.param("weight_out", i, ax.rows), i)
        if self.has_bias:
            h = h + self.param("bias", i, ax.rows)
        return h

    @property
    def has_norm(self) -> bool:
        """Whether the layers' MLPs hold a BatchNorm
        (:class:`~gnnpar.models.fullgraph.model.GINLayer`)."""
        return self.plain_layers[0].norm_weight is not None

    def _tail_steps(self, i: int) -> list[Step]:
        return _gin_tail_steps(
            self.grid, self.axes(i), self.dims[i + 1], self.fouts[i][1] - self.fouts[i][0],
            self.blocks[i].num_rows, self.has_bias, i, self.has_norm,
        )  # fmt: skip


def _gat_tail_steps(grid, ax: _Axes, heads, head_dim, d_out, fout, bias, layer, rows):
    """GAT's collectives after Z (see the module docstring)."""
    return _tail_common(grid, ax, layer, rows, d_out, fout, bias, gat=(heads, head_dim))


def _gin_tail_steps(grid, ax: _Axes, d_out, fout, rows, bias, layer, norm):
    """GIN's collectives after Z (see the module docstring)."""
    return _tail_common(grid, ax, layer, rows, d_out, fout, bias, gat=None, norm=norm)


def _tail_common(grid, ax: _Axes, layer, rows, d_out, fout, bias, gat, norm=False) -> list[Step]:
    fw, bw = "forward", "backward"
    pp = grid.size(ax.part) if ax.part else 1
    pr = grid.size(ax.rows)
    out_full = pp * -(-d_out // pp) * rows
    tag = f"layer {layer}"
    out: list[Step] = []
    if gat is not None:
        heads, head_dim = gat
        width = heads * head_dim
        if ax.part:
            for what in ("α_dst to the rows", "softmax row max", "softmax row sum"):
                out += step(fw, ax.part, "all_reduce", pp, rows * heads, f"{tag} {what}")
            out += step(fw, ax.part, "reduce_scatter", pp, out_full, f"{tag} OUT = att·Z")
            out += step(bw, ax.part, "all_gather", pp, out_full, f"{tag} dOUT")
            for what in ("d row sum", "d α_dst"):
                out += step(bw, ax.part, "all_reduce", pp, rows * heads, f"{tag} {what}")
        for which in ("a_src", "a_dst"):
            out += step(bw, ax.rows, "all_reduce", pr, width, f"{tag} d {which} (rows)")
            if ax.part:
                out += step(bw, ax.part, "all_reduce", pp, width, f"{tag} d {which} (part)")
        if bias:
            out += step(bw, ax.rows, "all_reduce", pr, fout, f"{tag} d bias")
        return out
    if ax.part:
        for what in ("AGG", "OUT"):
            out += step(fw, ax.part, "reduce_scatter", pp, out_full, f"{tag} {what}")
            out += step(bw, ax.part, "all_gather", pp, out_full, f"{tag} d{what}")
        out += step(bw, ax.part, "all_reduce", pp, 1, f"{tag} d ε (part)")
    if norm:
        for what in ("mean", "variance"):
            out += step(fw, ax.rows, "all_reduce", pr, fout, f"{tag} BatchNorm {what}")
            out += step(bw, ax.rows, "all_reduce", pr, fout, f"{tag} d BatchNorm {what}")
        for which in ("weight", "bias"):
            out += step(bw, ax.rows, "all_reduce", pr, fout, f"{tag} d BatchNorm {which}")
    out += step(bw, ax.rows, "all_reduce", pr, 1, f"{tag} d ε (rows)")
    out += step(bw, ax.rows, "all_reduce", pr, fout * d_out, f"{tag} d W_out")
    if bias and not norm:  # a BatchNorm replaces the hidden bias by its shift
        out += step(bw, ax.rows, "all_reduce", pr, fout, f"{tag} d hidden bias")
    if bias:
        out += step(bw, ax.rows, "all_reduce", pr, fout, f"{tag} d bias")
    return out


# ------------------------------------------------------------------------------- layouts
class _Layout3D(_GemmFirst):
    """The x × y × z layout (see the module docstring)."""

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
            _Block(source, i % 2, lay.rows, lay.cols, self.device, self.compute_dtype)
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

    def axes(self, i: int) -> _Axes:
        """Columns split over the outer axis, rows over depth, input features over inner."""
        lay = self.layouts[i]
        return _Axes(lay.outer, lay.depth, lay.inner, lay.outer)

    def _z(self, i: int, h: torch.Tensor):
        lay, grid = self.layouts[i], self.grid
        a, b, c = lay.outer, lay.inner, lay.depth
        if i == 0:
            h = comm.gather_replicated(h, grid, c, sizes=lay.h_sub_sizes)
        z = h @ self.param("weight", i, a)
        z = comm.copy_to(comm.reduce_from(z, grid, b), grid, c)
        return z, z

    def _head_steps(self, i: int, width: int) -> list[Step]:
        return _head3d_steps(self.grid, self.layouts[i], width, i == 0)


class _Layout2D(_GemmFirst):
    """The x × y layout (see the module docstring)."""

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
        n, r, c = self.num_nodes, grid.size("x"), grid.size("y")
        i, j = grid.rank("x"), grid.rank("y")
        self.row_sizes = chunk_sizes(n, r)
        self.rows = chunk(n, r, i)
        self.cols = chunk(n, c, j)
        self.fin = [chunk(d, c, j) for d in self.dims]
        self._setup(model, self.fin[:-1], self.fin[1:])
        self.blocks = [
            _Block(source, k % 2, self.rows, self.cols, self.device, self.compute_dtype)
            for k in range(self.num_layers)
        ]
        self._row_ids = [
            source.node_ids(k % 2, self.rows).to(self.device) for k in range(self.num_layers)
        ]
        self.input_block = (self.rows, self.fin[0])
        self.logits_rows, self.logits_cols = self.rows, self.fin[-1]
        self.row_axis, self.class_axis = "x", "y"

    def axes(self, i: int) -> _Axes:
        """Columns and features split over y, rows over x."""
        return _Axes("y", "x", "y", "y")

    def _z(self, i: int, h: torch.Tensor):
        z = comm.all_reduce_both(h @ self.param("weight", i, "x"), self.grid, "y")  # rows i
        z = comm.gather_from(z, self.grid, "x", sizes=self.row_sizes)  # every node
        z = z[self.cols[0] : self.cols[1]]  # the block's columns
        return z, z

    def _head_steps(self, i: int, width: int) -> list[Step]:
        shape = (self.grid.size("x"), self.grid.size("y"))
        fin = self.fin[i][1] - self.fin[i][0]
        return _head2d_steps(shape, self.row_sizes, self.rows[1] - self.rows[0], fin, width, i)


class _Layout1D(_GemmFirst):
    """Rows over one axis (see the module docstring)."""

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
            _Block(source, i % 2, self.rows, (0, n), self.device, self.compute_dtype)
            for i in range(self.num_layers)
        ]
        self._row_ids = [
            source.node_ids(i % 2, self.rows).to(self.device) for i in range(self.num_layers)
        ]
        self.input_block = (self.rows, (0, self.dims[0]))
        self.logits_rows, self.logits_cols = self.rows, (0, self.dims[-1])
        self.row_axis, self.class_axis = axis, None

    def axes(self, i: int) -> _Axes:
        """Only rows are split; parameters are whole."""
        return _Axes(None, self.axis, None, None)

    def _z(self, i: int, h: torch.Tensor):
        z = h @ self.param("weight", i, self.axis)
        z = comm.gather_from(z, self.grid, self.axis, sizes=self.row_sizes)
        return z, z

    def _head_steps(self, i: int, width: int) -> list[Step]:
        return _head1d_steps(self.axis, self.row_sizes, self.dims[i], width, i)


class Parallel3DGAT(_GATKind, _Layout3D):
    """GAT on the x × y × z grid."""


class Parallel2DGAT(_GATKind, _Layout2D):
    """GAT on an x × y grid."""


class Parallel1DGAT(_GATKind, _Layout1D):
    """GAT with rows over one axis."""


class Parallel3DGIN(_GINKind, _Layout3D):
    """GIN on the x × y × z grid."""


class Parallel2DGIN(_GINKind, _Layout2D):
    """GIN on an x × y grid."""


class Parallel1DGIN(_GINKind, _Layout1D):
    """GIN with rows over one axis."""


def parallel_gemm_first(model: FullGraphGNN, algorithm: str) -> type[_GemmFirst]:
    """The parallel class of ``model`` (kind gat or gin) on ``algorithm`` (3d, 2d, 1d)."""
    return {
        ("gat", "3d"): Parallel3DGAT, ("gat", "2d"): Parallel2DGAT, ("gat", "1d"): Parallel1DGAT,
        ("gin", "3d"): Parallel3DGIN, ("gin", "2d"): Parallel2DGIN, ("gin", "1d"): Parallel1DGIN,
    }[(model.kind, algorithm)]  # fmt: skip


# ----------------------------------------------------------------------------- schedules
def _head3d_steps(grid, lay: Layout3D, width: int, input_split: bool) -> list[Step]:
    a, b, c = lay.outer, lay.inner, lay.depth
    pa, pb, pc = grid.size(a), grid.size(b), grid.size(c)
    cols = lay.cols[1] - lay.cols[0]
    fin = lay.fin[1] - lay.fin[0]
    tag = f"layer {lay.layer}"
    out: list[Step] = []
    if input_split:
        h_full = pc * max(lay.h_sub_sizes) * fin
        out += step("forward", c, "all_gather", pc, h_full, f"{tag} gather H")
    out += step("forward", b, "all_reduce", pb, cols * width, f"{tag} Z = H·W")
    out += step("backward", c, "all_reduce", pc, cols * width, f"{tag} dZ")
    out += step("backward", a, "all_reduce", pa, fin * width, f"{tag} dW")
    return out


def _head2d_steps(grid, row_sizes, rows: int, fin: int, width: int, layer: int) -> list[Step]:
    r, c = grid
    z_all = r * max(row_sizes) * width
    tag = f"layer {layer}"
    out = step("forward", "y", "all_reduce", c, rows * width, f"{tag} Z = H·W")
    out += step("forward", "x", "all_gather", r, z_all, f"{tag} gather Z")
    out += step("backward", "x", "reduce_scatter", r, z_all, f"{tag} dZ (x)")
    out += step("backward", "y", "all_reduce", c, rows * width, f"{tag} dZ (y)")
    out += step("backward", "x", "all_reduce", r, fin * width, f"{tag} dW")
    return out


def _head1d_steps(axis: str, row_sizes, d_in: int, width: int, layer: int) -> list[Step]:
    p = len(row_sizes)
    z_full = p * max(row_sizes) * width
    tag = f"layer {layer}"
    out = step("forward", axis, "all_gather", p, z_full, f"{tag} gather Z")
    out += step("backward", axis, "reduce_scatter", p, z_full, f"{tag} dZ")
    out += step("backward", axis, "all_reduce", p, d_in * width, f"{tag} dW")
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
    ax = _Axes(lay.outer, lay.depth, lay.inner, lay.outer)
    rows, fout = lay.rows[1] - lay.rows[0], lay.fout[1] - lay.fout[0]
    head = _head3d_steps(grid, lay, heads * head_dim, input_split)
    return head + _gat_tail_steps(grid, ax, heads, head_dim, d_out, fout, bias, lay.layer, rows)


def gin3d_layer_schedule(
    grid: ProcessGrid | GridShape,
    lay: Layout3D,
    d_out: int,
    input_split: bool,
    bias: bool,
    batch_norm: bool = True,
) -> list[Step]:
    """The collectives of one forward and backward of the 3D GIN layer ``lay`` (MLP width
    ``d_out``, with or without its BatchNorm), as its rank runs them."""
    ax = _Axes(lay.outer, lay.depth, lay.inner, lay.outer)
    rows, fout = lay.rows[1] - lay.rows[0], lay.fout[1] - lay.fout[0]
    head = _head3d_steps(grid, lay, d_out, input_split)
    return head + _gin_tail_steps(grid, ax, d_out, fout, rows, bias, lay.layer, batch_norm)


class _Shape2D(NamedTuple):
    x: int
    y: int

    def size(self, axis: str) -> int:
        return self.x if axis == "x" else self.y


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
    head = _head2d_steps(grid, row_sizes, rows, fin, heads * head_dim, layer)
    ax = _Axes("y", "x", "y", "y")
    tail = _gat_tail_steps(_Shape2D(*grid), ax, heads, head_dim, d_out, fout, bias, layer, rows)
    return head + tail


def gin2d_layer_schedule(
    grid: tuple[int, int],
    row_sizes: list[int],
    rows: int,
    fin: int,
    d_out: int,
    fout: int,
    bias: bool,
    layer: int = 0,
    batch_norm: bool = True,
) -> list[Step]:
    """The collectives of one forward and backward of a 2D GIN layer (as
    :func:`gat2d_layer_schedule`; MLP width ``d_out``, with or without its BatchNorm)."""
    head = _head2d_steps(grid, row_sizes, rows, fin, d_out, layer)
    ax = _Axes("y", "x", "y", "y")
    tail = _gin_tail_steps(_Shape2D(*grid), ax, d_out, fout, rows, bias, layer, batch_norm)
    return head + tail


class _Shape1D(NamedTuple):
    p: int

    def size(self, axis: str) -> int:
        return self.p


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
    head = _head1d_steps(axis, row_sizes, d_in, heads * head_dim, layer)
    ax = _Axes(None, axis, None, None)
    g = _Shape1D(len(row_sizes))
    return head + _gat_tail_steps(g, ax, heads, head_dim, d_out, d_out, bias, layer, 0)


def gin1d_layer_schedule(
    axis: str,
    row_sizes: list[int],
    d_in: int,
    d_out: int,
    bias: bool,
    layer: int = 0,
    batch_norm: bool = True,
) -> list[Step]:
    """The collectives of one forward and backward of a 1D GIN layer over ``axis`` (with or
    without its BatchNorm)."""
    head = _head1d_steps(axis, row_sizes, d_in, d_out, layer)
    ax = _Axes(None, axis, None, None)
    g = _Shape1D(len(row_sizes))
    return head + _gin_tail_steps(g, ax, d_out, d_out, 0, bias, layer, batch_norm)
