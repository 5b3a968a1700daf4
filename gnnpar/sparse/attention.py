"""Graph attention on a block's nonzeros (GAT, Veličković et al.): the local pieces.

For a block of the adjacency (rows: destination nodes i, columns: source nodes j; only its
structure is read) and per-head node scores ``α_dst`` (rows) and ``α_src`` (columns):

- :func:`edge_logits`: the SDDMM ``e_ij = LeakyReLU(α_dst[i] + α_src[j])`` on the nonzeros;
- :func:`edge_softmax`: the numerically stable softmax of ``e`` over each row's nonzeros.
  A row's columns may be split over ranks: ``row_max`` and ``row_sum`` then reduce the
  per-row maximum and sum over the ranks that hold the row (identity for a whole row);
- :func:`attend`: ``out[i, k] = Σ_j att_ijk · Z[j, k]`` (the SpMM with the attention values).

Everything is plain differentiable torch on an edge list (gather, scatter-add), so the
backward is autograd's; :func:`gnnpar.nn.dropout.edge_dropout` draws the attention dropout
from (seed, edge, head) alone, as feature dropout does from (seed, node, feature).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from gnnpar.nn.dropout import edge_dropout
from gnnpar.sparse.csr import CSRBlock, coo_rows

Reduce = Callable[[torch.Tensor], torch.Tensor]


def edges(block: CSRBlock) -> tuple[torch.Tensor, torch.Tensor]:
    """Local (row, column) of every nonzero of ``block``, int64."""
    return coo_rows(block), block.indices.long()


def edge_logits(
    alpha_dst: torch.Tensor,
    alpha_src: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    negative_slope: float,
) -> torch.Tensor:
    """``LeakyReLU(α_dst[row] + α_src[col])`` per edge and head (E × K)."""
    return F.leaky_relu(alpha_dst[rows] + alpha_src[cols], negative_slope)


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
    ex = torch.exp(logits - m[rows])
    s = torch.zeros(num_rows, heads, dtype=logits.dtype, device=logits.device)
    s = s.index_add(0, rows, ex)
    if row_sum is not None:
        s = row_sum(s)
    return ex / s[rows]


def attend(
    att: torch.Tensor, z: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """``out[i, k, :] = Σ_j att[e(i, j), k] · z[j, k, :]`` (z: C × K × F; out: R × K × F)."""
    msg = att[:, :, None] * z[cols]
    out = torch.zeros(num_rows, *z.shape[1:], dtype=z.dtype, device=z.device)
    return out.index_add(0, rows, msg)


class AttentionSettings(Protocol):
    """The hyper-parameters of a GAT layer the attention reads."""

    negative_slope: float
    attn_dropout: float
    training: bool


def gat_aggregate(
    z: torch.Tensor,
    alpha_dst: torch.Tensor,
    att_src: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    edge_ids: tuple[torch.Tensor, torch.Tensor],
    num_rows: int,
    seed: int | None,
    settings: AttentionSettings,
    row_max: Reduce | None = None,
    row_sum: Reduce | None = None,
) -> torch.Tensor:
    """GAT's attention over one block (R × K × F): the columns' scores from ``z`` (C × K ×
    F) and ``att_src``, the rows' scores ``alpha_dst`` (R × K), logits, the softmax (its row
    reductions ``row_max`` / ``row_sum`` over the ranks sharing the rows), attention dropout
    by the edges' global (destination, source) ``edge_ids``, then the SpMM."""
    alpha_src = (z * att_src).sum(-1)
    e = edge_logits(alpha_dst, alpha_src, rows, cols, settings.negative_slope)
    att = edge_softmax(e, rows, num_rows, row_max, row_sum)
    att = edge_dropout(att, settings.attn_dropout, seed, *edge_ids, settings.training)
    return attend(att, z, rows, cols, num_rows)
