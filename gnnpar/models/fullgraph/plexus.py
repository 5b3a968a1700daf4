"""The 3D full-graph GCN layer (Plexus): SpMM and GEMM on one x × y × z grid.

With roles (a, b, c) = (outer, inner, depth) of :mod:`gnnpar.models.fullgraph.layout`, one layer is

forward::

    H   = all-gather_c(h)             (first layer only: its input is split over c)
    AGG = all-reduce_a(Â_local @ H)   (optionally in row chunks, chunk k's all-reduce
                                       overlapping chunk k+1's SpMM)
    W   = all-gather_c(w_local)       (the flattened weight block is split over c)
    OUT = all-reduce_b(AGG @ W)

backward (OUT's gradient is the same on every rank of b, as OUT is replicated there)::

    W    = all-gather_c(w_local)
    gAGG = all-reduce_a(gOUT @ Wᵀ)                (async, overlapped with gW; only for gH)
    gW   = reduce-scatter_c(AGGᵀ @ gOUT)          (async)
    gH   = Âᵀ_local @ gAGG, then reduce-scatter_c (first layer) or all-reduce_c

gAGG serves gH alone: where H needs no gradient (the first layer on raw input features)
neither its GEMM nor its all-reduce runs, only gW's (and the bias's).

A layer of several sparse operators ``op_1 … op_K`` (``ops``; GraphSAGE: Â and the root,
R-GCN: each relation's Â_r and the root, K = R + 1) aggregates ``AGG = cat_k(op_k @ H)``,
K·F wide, and multiplies it by the stacked weight ``[W_1; …; W_K]``: the all-reduces of AGG
and of its gradient carry ``rows · F`` elements per operator (per relation), the weight's
gathers and gradient ``K · F · F′``; everything else is the one-operator layer's.

An R-GCN layer with **bases** (``comp``, R × B) stores B + 1 blocks [V_1; …; V_B; W_root]
instead of R + 1: those are what each rank's piece holds, what the W gathers carry and what
dW's reduce-scatter returns (``(B + 1) · F · F′``). Each rank combines its gathered blocks into
``[W_1; …; W_R; W_root]`` (``W_r = Σ_b comp[r, b] V_b``, on its fin × fout slice) and splits
the stacked weight's gradient back into the blocks' before the reduce-scatter; ``comp``'s
gradient, the sum of every rank's share (each rank's slice, partial over c), is all-reduced
over the tensor axes (R · B elements), so every rank steps the same ``comp``.

The collectives of one layer are described once, by :func:`layer_schedule`: the model's
byte accounting and the planner's communication model both come from it.
"""

from __future__ import annotations

import torch

from gnnpar import comm
from gnnpar.comm import chunk_sizes
from gnnpar.grid import GridShape, ProcessGrid
from gnnpar.models.fullgraph.layout import Layout3D
from gnnpar.models.fullgraph.model import combine_bases, split_bases_grad
from gnnpar.models.fullgraph.schedule import Step, step
from gnnpar.sparse.kernels import LocalSpMM


def _aggregate(
    ops: list[list[tuple[int, int, LocalSpMM]]],
    h: torch.Tensor,
    grid: ProcessGrid,
    axis: str,
) -> torch.Tensor:
    """cat_k(op_k @ h) over the feature dim, all-reduced over ``axis``, chunk by chunk."""
    n_chunks = len(ops[0])
    handles = []
    for i in range(n_chunks):
        pieces = [op_chunks[i][2].mm(h) for op_chunks in ops]
        part = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        handles.append(comm.all_reduce(part, grid, axis, async_op=True))
    pieces = [hd.wait() for hd in handles]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


class Plexus3DFunction(torch.autograd.Function):
    """One 3D GCN layer without bias: ``OUT = Â H W`` on sharded Â, H and W (with ``comp``:
    W combined from the gathered basis blocks)."""

    @staticmethod
    def forward(ctx, h, w_local, comp, ops, grid, lay, input_split):  # noqa: D102
        a, b, c = lay.outer, lay.inner, lay.depth
        full_h = comm.all_gather(h, grid, c, sizes=lay.h_sub_sizes) if input_split else h
        agg = _aggregate(ops, full_h, grid, a)
        blocks = _gather_weight(w_local, grid, lay, _num_blocks(ops, comp))
        w = blocks if comp is None else combine_bases(blocks, comp)
        out = comm.all_reduce(agg @ w, grid, b)
        ctx.save_for_backward(agg, w_local, comp)
        ctx.ops, ctx.grid, ctx.lay, ctx.input_split = ops, grid, lay, input_split
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        agg, w_local, comp = ctx.saved_tensors
        grid, lay, ops = ctx.grid, ctx.lay, ctx.ops
        a, c = lay.outer, lay.depth
        grad_out = grad_out.contiguous()
        blocks = _gather_weight(w_local, grid, lay, _num_blocks(ops, comp))
        w = blocks if comp is None else combine_bases(blocks, comp)
        # AGG's gradient only makes H's: none (no GEMM, no all-reduce) for raw features
        want_h = ctx.needs_input_grad[0]
        g_agg = comm.all_reduce(grad_out @ w.T, grid, a, async_op=True) if want_h else None
        g_blocks, g_comp = agg.T @ grad_out, None
        if comp is not None:
            g_blocks, g_comp = split_bases_grad(g_blocks, blocks, comp)
            g_comp = comm.all_reduce(g_comp, grid, "tensor", async_op=True)
        g_w = comm.reduce_scatter(g_blocks.reshape(-1), grid, c, sizes=lay.w_sizes, async_op=True)
        g_h = None
        if want_h:
            g_agg = g_agg.wait()
            width = lay.fin[1] - lay.fin[0]
            for k, op_chunks in enumerate(ops):
                g = g_agg[:, k * width : (k + 1) * width]
                for start, stop, chunk_op in op_chunks:
                    part = chunk_op.T.mm(g[start:stop].contiguous())
                    g_h = part if g_h is None else g_h.add_(part)
            if ctx.input_split:
                g_h = comm.reduce_scatter(g_h, grid, c, sizes=lay.h_sub_sizes)
            else:
                g_h = comm.all_reduce(g_h, grid, c)
        g_comp = None if g_comp is None else g_comp.wait()
        return g_h, g_w.wait().view_as(w_local), g_comp, None, None, None, None


def _gather_weight(
    w_local: torch.Tensor, grid: ProcessGrid, lay: Layout3D, num_blocks: int
) -> torch.Tensor:
    """The rank's ``num_blocks`` weight blocks (each stored block's fin × fout slice,
    stacked), gathered over the depth axis."""
    rows, cols = lay.w_block_shape
    full = comm.all_gather(w_local.reshape(-1), grid, lay.depth, sizes=lay.w_sizes)
    return full.view(num_blocks * rows, cols)


def _num_blocks(ops: list, comp: torch.Tensor | None) -> int:
    """Stored weight blocks: one per operator, or with bases B + 1."""
    return len(ops) if comp is None else comp.shape[1] + 1


def plexus_layer(
    h: torch.Tensor,
    w_local: torch.Tensor,
    ops: list[list[tuple[int, int, LocalSpMM]]],
    grid: ProcessGrid,
    lay: Layout3D,
    input_split: bool,
    comp: torch.Tensor | None = None,
) -> torch.Tensor:
    """Differentiable 3D layer; ``ops`` holds each sparse operator's row chunks; ``comp``:
    the R-GCN basis coefficients (R × B, whole on every rank) where ``w_local`` is a piece
    of the basis blocks [V_1; …; V_B; W_root]."""
    return Plexus3DFunction.apply(h, w_local, comp, ops, grid, lay, input_split)


def layer_schedule(
    grid: ProcessGrid | GridShape,
    lay: Layout3D,
    num_ops: int,
    input_split: bool,
    input_grad: bool,
    bias: bool,
    chunks: int = 1,
    bases: int = 0,
) -> list[Step]:
    """The collectives of one forward and backward of the 3D layer ``lay`` (with its bias,
    whose gradient is all-reduced over the depth axis), as the rank of ``lay`` runs them:
    the one description of this layer's traffic (see :mod:`gnnpar.models.fullgraph.schedule`).
    ``num_ops`` is the layer's sparse operators K (1: GCN; 2: GraphSAGE; R + 1: R-GCN of R
    relations), whose aggregates the all-reduces of AGG and dAGG carry side by side (K·F
    wide) and whose weights the W gathers and dW reduce-scatter carry stacked (K·F × F′).
    ``input_grad``: the layer's input H needs a gradient (every layer but the first, and the
    first with ``input_grad`` or learnt input rows); only then are dAGG = dOUT·Wᵀ and dH
    computed and sent (raw features need neither, and dW does not read dAGG).
    ``chunks`` is the forward aggregate's row chunks (``overlap_chunks``). ``bases`` B > 0:
    an R-GCN with bases (``lay`` laid out for its B + 1 weight blocks, which the W steps
    then carry), whose coefficients' gradient (R · B, R = ``num_ops`` − 1) is all-reduced over
    the tensor axes."""
    a, b, c = lay.outer, lay.inner, lay.depth
    pa, pb, pc = grid.size(a), grid.size(b), grid.size(c)
    rows = lay.rows[1] - lay.rows[0]
    fin = lay.fin[1] - lay.fin[0]
    fout = lay.fout[1] - lay.fout[0]
    h_full = pc * max(lay.h_sub_sizes) * fin
    w_full = pc * max(lay.w_sizes)
    tag = f"layer {lay.layer}"
    fw, bw = "forward", "backward"
    out: list[Step] = []
    if input_split:
        out += step(fw, c, "all_gather", pc, h_full, f"{tag} gather H")
    pieces = [r for r in chunk_sizes(rows, chunks) if r] if chunks > 1 else [rows]
    agg = "A·H" if num_ops == 1 else f"cat(A_k·H, k < {num_ops})"
    for k, piece in enumerate(pieces):
        what = f"{tag} AGG = {agg}" + (f" (chunk {k})" if len(pieces) > 1 else "")
        out += step(fw, a, "all_reduce", pa, piece * num_ops * fin, what)
    out += step(fw, c, "all_gather", pc, w_full, f"{tag} gather W")
    out += step(fw, b, "all_reduce", pb, rows * fout, f"{tag} OUT = AGG·W")
    out += step(bw, c, "all_gather", pc, w_full, f"{tag} gather W (backward)")
    if input_grad:  # dAGG only makes dH: none for raw features
        out += step(bw, a, "all_reduce", pa, rows * num_ops * fin, f"{tag} dAGG")
    if bases:
        tensor = pa * pb * pc
        out += step(bw, "tensor", "all_reduce", tensor, (num_ops - 1) * bases, f"{tag} d comp")
    out += step(bw, c, "reduce_scatter", pc, w_full, f"{tag} dW")
    if input_grad:
        if input_split:
            out += step(bw, c, "reduce_scatter", pc, h_full, f"{tag} dH")
        else:
            h_rows = lay.cols[1] - lay.cols[0]
            out += step(bw, c, "all_reduce", pc, h_rows * fin, f"{tag} dH")
    if bias:
        out += step(bw, c, "all_reduce", pc, fout, f"{tag} d bias")
    return out
