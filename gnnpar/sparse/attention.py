"""Graph attention on a block's nonzeros (GAT, Veličković et al.): the local pieces.

For a block of the adjacency (rows: destination nodes i, columns: source nodes j; only its
structure is read) and per-head node scores ``α_dst`` (rows) and ``α_src`` (columns):

- :func:`edge_logits`: the SDDMM ``e_ij = LeakyReLU(α_dst[i] + α_src[j])`` on the nonzeros;
- :func:`edge_softmax`: the numerically stable softmax of ``e`` over each row's nonzeros.
  A row's columns may be split over ranks: ``row_max`` and ``row_sum`` then reduce the
  per-row maximum and sum over the ranks that hold the row (identity for a whole row);
- :func:`attend`: ``out[i, k] = Σ_j att_ijk · Z[j, k]`` (the SpMM with the attention values).

Edge weights enter the attention in one way, :func:`weigh_logits`: ``α_ij ∝ w_ij ·
exp(e_ij)``, i.e. ``log w_ij`` added to every head's logit before the softmax (the self loop
weighs 1; a weight of 1 leaves a logit exactly as it is, 0 masks the edge). The full-graph
layers read w from the block's values (the ``"raw"`` adjacency,
:data:`gnnpar.models.fullgraph.model.NORMS`),
the mini-batch :class:`~gnnpar.models.minibatch.model.GATConv` from the sampled edges' weights.

The logits and the softmax are plain differentiable torch on the edge list (gathers,
scatters; E × heads values). The SpMM is the expensive part (E × heads × F): :func:`attend`
runs it without materialising a message per edge, as one ``embedding_bag`` per head over the
CSR rows forward and over the transposed order (kept in :class:`Edges`) for Z's gradient;
the attention's gradient is the SDDMM ``<G[i, k], Z[j, k]>`` per edge.
:func:`gnnpar.nn.dropout.edge_dropout` draws the attention dropout from (seed, edge, head)
alone, as feature dropout does from (seed, node, feature).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from gnnpar.errors import UserError
from gnnpar.nn.dropout import edge_dropout
from gnnpar.sparse.csr import CSRBlock, coo_rows

Reduce = Callable[[torch.Tensor], torch.Tensor]
#: Edges per piece of the attention gradient (E × heads × F products are never whole).
_SDDMM_EDGES = 1 << 14


def edges(block: CSRBlock) -> tuple[torch.Tensor, torch.Tensor]:
    """Local (row, column) of every nonzero of ``block``, int64."""
    return coo_rows(block), block.indices.long()


def log_weights(weight: torch.Tensor) -> torch.Tensor | None:
    """``log w`` per edge (what :func:`weigh_logits` adds), or None when every weight is 1
    (nothing to add)."""
    if bool((weight == 1).all()):
        return None
    if bool((weight < 0).any()):
        raise UserError("attention edge weights must be non-negative (they scale exp(e))")
    return torch.log(weight)


def weigh_logits(logits: torch.Tensor, log_weight: torch.Tensor | None) -> torch.Tensor:
    """The logits (E × K) of edges of weights ``exp(log_weight)`` (E, from
    :func:`log_weights`): ``α ∝ w · exp(e)`` after the softmax."""
    return logits if log_weight is None else logits + log_weight[:, None].to(logits.dtype)


class Edges:
    """A block's nonzeros in CSR order, with the row offsets and the transposed (by column)
    order that :func:`attend` needs, and the log of its values (the edge weights, None when
    all are 1); built once per block."""

    def __init__(self, block: CSRBlock) -> None:
        self.rows, self.cols = edges(block)
        self.log_weight = log_weights(block.values)
        self.num_rows, self.num_cols = block.shape
        self.offsets = block.indptr.long()
        self.by_col = torch.argsort(self.cols, stable=True)
        self.t_rows = self.rows.index_select(0, self.by_col)
        counts = torch.bincount(self.cols, minlength=self.num_cols)
        self.t_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])

    def to(self, device: torch.device) -> Edges:
        """These edges on ``device``."""
        for name in ("rows", "cols", "offsets", "by_col", "t_rows", "t_offsets", "log_weight"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device))
        return self


def edge_logits(
    alpha_dst: torch.Tensor,
    alpha_src: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    negative_slope: float,
) -> torch.Tensor:
    """``LeakyReLU(α_dst[row] + α_src[col])`` per edge and head (E × K)."""
    pair = alpha_dst.index_select(0, rows) + alpha_src.index_select(0, cols)
    return F.leaky_relu(pair, negative_slope)


def edge_softmax(
    logits: torch.Tensor,
    rows: torch.Tensor,
    num_rows: int,
    row_max: Reduce | None = None,
    row_sum: Reduce | None = None,
) -> torch.Tensor:
    """Softmax of ``logits`` (E × K) over the edges of each row. ``row_max`` / ``row_sum``
    reduce the local per-row (R × K) maximum and sum over the ranks sharing the rows; the
    maximum is only a shift (no gradient flows through it)."""
    heads = logits.shape[1]
    idx = rows[:, None].expand(-1, heads)
    with torch.no_grad():
        m = torch.full((num_rows, heads), -torch.inf, dtype=logits.dtype, device=logits.device)
        m = m.scatter_reduce(0, idx, logits.detach(), "amax", include_self=True)
        if row_max is not None:
            m = row_max(m)
        m = torch.where(torch.isfinite(m), m, 0.0)  # rows without edges
    ex = torch.exp(logits - m.index_select(0, rows))
    s = torch.zeros(num_rows, heads, dtype=logits.dtype, device=logits.device)
    s = s.index_add(0, rows, ex)
    if row_sum is not None:
        s = row_sum(s)
    return ex / s.index_select(0, rows)


def _bag_spmm(
    index: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor, table: torch.Tensor
) -> torch.Tensor:
    """``out[b] = Σ_{e in bag b} weights[e] · table[index[e]]`` for CSR-like ``offsets``."""
    return F.embedding_bag(
        index, table, offsets, mode="sum", per_sample_weights=weights, include_last_offset=True
    )


class _Attend(torch.autograd.Function):
    """The attention SpMM and its adjoints, per head, without an E × F message."""

    @staticmethod
    def forward(ctx, att, z, e):  # noqa: D102
        ctx.save_for_backward(att, z)
        ctx.edges = e
        out = z.new_empty(e.num_rows, *z.shape[1:])
        for k in range(z.shape[1]):
            out[:, k] = _bag_spmm(e.cols, e.offsets, att[:, k].contiguous(), z[:, k].contiguous())
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        att, z = ctx.saved_tensors
        e = ctx.edges
        g = g.contiguous()
        grad_att = grad_z = None
        if ctx.needs_input_grad[0]:  # the SDDMM <G[i, k], Z[j, k]>, in cache-sized pieces
            grad_att = att.new_empty(att.shape)
            for lo in range(0, att.shape[0], _SDDMM_EDGES):
                rows, cols = e.rows[lo : lo + _SDDMM_EDGES], e.cols[lo : lo + _SDDMM_EDGES]
                piece = g.index_select(0, rows) * z.index_select(0, cols)
                grad_att[lo : lo + rows.numel()] = piece.sum(-1)
        if ctx.needs_input_grad[1]:  # Aᵀ G, over the edges in column order
            t_att = att.index_select(0, e.by_col)
            grad_z = torch.empty_like(z)
            for k in range(z.shape[1]):
                grad_z[:, k] = _bag_spmm(
                    e.t_rows, e.t_offsets, t_att[:, k].contiguous(), g[:, k].contiguous()
                )
        return grad_att, grad_z, None


def attend(att: torch.Tensor, z: torch.Tensor, e: Edges) -> torch.Tensor:
    """``out[i, k, :] = Σ_j att[e(i, j), k] · z[j, k, :]`` (z: C × K × F; out: R × K × F)."""
    if z.shape[0] != e.num_cols:
        raise ValueError(f"attention over {e.num_cols} columns got {z.shape[0]} rows of Z")
    return _Attend.apply(att, z, e)


class AttentionSettings(Protocol):
    """The hyper-parameters of a GAT layer the attention reads."""

    negative_slope: float
    attn_dropout: float
    training: bool


def gat_aggregate(
    z: torch.Tensor,
    alpha_dst: torch.Tensor,
    att_src: torch.Tensor,
    e: Edges,
    edge_ids: tuple[torch.Tensor, torch.Tensor],
    seed: int | None,
    settings: AttentionSettings,
    row_max: Reduce | None = None,
    row_sum: Reduce | None = None,
) -> torch.Tensor:
    """GAT's attention over one block (R × K × F): the columns' scores from ``z`` (C × K ×
    F) and ``att_src``, the rows' scores ``alpha_dst`` (R × K), logits, the softmax (its row
    reductions ``row_max`` / ``row_sum`` over the ranks sharing the rows), attention dropout
    by the edges' global (destination, source) ``edge_ids``, then the SpMM. The edges'
    weights (``e.log_weight``) enter the logits by :func:`weigh_logits`."""
    alpha_src = (z * att_src).sum(-1)
    logits = edge_logits(alpha_dst, alpha_src, e.rows, e.cols, settings.negative_slope)
    logits = weigh_logits(logits, e.log_weight)
    att = edge_softmax(logits, e.rows, e.num_rows, row_max, row_sum)
    att = edge_dropout(att, settings.attn_dropout, seed, *edge_ids, settings.training)
    return attend(att, z, e)
