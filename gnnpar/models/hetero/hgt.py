"""The Heterogeneous Graph Transformer (Hu et al.) on a typed block, with PyG ``HGTConv``'s
semantics.

For an edge ``u -> v`` of relation ``r`` and head ``h`` (``D = out_dim / heads``):
``k, q, v`` are per-node-type linears of the input; the key and value are moved into the
relation's space, ``k_u W^K_{r,h}`` and ``v_u W^V_{r,h}``; the logit is
``<q_v, k_u W^K_{r,h}> · p_{r,h} / sqrt(D)``, softmax-normalised over **all** of ``v``'s
incoming edges (every relation together); the messages ``α · v_u W^V_{r,h}`` are summed,
GELU, then a per-type output linear, and, where the widths agree, a gated skip
``σ(s_t) · out + (1 - σ(s_t)) · h_v``.

Layout: ``kqv[t]`` and ``out_lin[t]`` are PyG's ``kqv_lin.lins[t]`` and ``out_lin.lins[t]``
(``kqv``'s rows: keys, queries, values); ``k_rel``, ``v_rel`` are ``(R, heads, D, D)`` (PyG's
``k_rel.weight`` is ``(heads · R, D, D)``, head-major: ``view(heads, R, D, D).transpose(0,
1)``); ``p_rel`` is ``(R, heads)``, ``skip`` ``(num_types,)``.

Unlike PyG, whose output leaves out the node types that are no relation's destination,
every destination gets an output (no message: ``out_lin(GELU(0))`` and the skip).
The attention reuses :mod:`gnnpar.sparse.attention`: the keys and values of a relation
are computed once per source node of its source type, and each edge reads the column
``(relation, source)``, so the softmax (:func:`~gnnpar.sparse.attention.edge_softmax`) and
the SpMM (:func:`~gnnpar.sparse.attention.attend`) run on one CSR over all relations.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gnnpar.errors import UserError
from gnnpar.models.hetero.index import TypedBlock
from gnnpar.sparse.attention import Edges, attend, edge_softmax
from gnnpar.sparse.csr import CSRBlock

__all__ = ["HGTConv"]


class HGTConv(nn.Module):
    """One HGT layer on a typed block (module docstring).

    Args:
        in_dim, out_dim: input and output widths (the same for every node type).
        num_types: number of node types.
        num_relations: number of relations.
        heads: attention heads (dividing ``out_dim``).
    """

    def __init__(self, in_dim: int, out_dim: int, num_types: int, num_relations: int,
                 heads: int = 1):  # fmt: skip
        super().__init__()
        if heads < 1 or out_dim % heads:
            raise UserError(f"heads ({heads}) must be >= 1 and divide out_dim ({out_dim})")
        self.in_dim, self.out_dim, self.heads = in_dim, out_dim, heads
        self.num_types, self.num_relations = num_types, num_relations
        d = out_dim // heads
        self.kqv = nn.ModuleList(nn.Linear(in_dim, 3 * out_dim) for _ in range(num_types))
        self.out_lin = nn.ModuleList(nn.Linear(out_dim, out_dim) for _ in range(num_types))
        bound = 1.0 / math.sqrt(d)
        self.k_rel = nn.Parameter(torch.empty(num_relations, heads, d, d).uniform_(-bound, bound))
        self.v_rel = nn.Parameter(torch.empty(num_relations, heads, d, d).uniform_(-bound, bound))
        self.p_rel = nn.Parameter(torch.ones(num_relations, heads))
        self.skip = nn.Parameter(torch.ones(num_types))

    def forward(
        self, block: Any, h_src: torch.Tensor, typed: TypedBlock | None = None
    ) -> torch.Tensor:
        """Outputs of the block's destinations from its sources' ``h_src``. ``typed``: the
        block's :class:`~gnnpar.models.hetero.index.TypedBlock`, when already built."""
        if h_src.shape != (block.num_src, self.in_dim):
            raise UserError(
                f"h_src must have shape ({block.num_src}, {self.in_dim}), got {tuple(h_src.shape)}"
            )
        if typed is None:
            typed = TypedBlock.build(block, self.num_types, self.num_relations)
        elif typed.num_relations != self.num_relations or typed.groups.num_types != self.num_types:
            raise UserError(
                f"the typed block has {typed.groups.num_types} node types and "
                f"{typed.num_relations} relations, the layer {self.num_types} and "
                f"{self.num_relations}"
            )
        g = typed.groups
        nd, fo, heads = block.num_dst, self.out_dim, self.heads
        xs = g.split(h_src)
        keys, values, queries = [], [], []
        for t, lin in enumerate(self.kqv):
            w, b = lin.weight, lin.bias
            keys.append(F.linear(xs[t], w[:fo], b[:fo]).view(-1, heads, fo // heads))
            queries.append(F.linear(xs[t][: g.dst_counts[t]], w[fo : 2 * fo], b[fo : 2 * fo]))
            values.append(F.linear(xs[t], w[2 * fo :], b[2 * fo :]).view(-1, heads, fo // heads))
        agg = self._attention(typed, keys, values, g.merge(queries, dst=True))
        a = g.split(F.gelu(agg.reshape(nd, fo)), dst=True)
        outs = []
        for t, lin in enumerate(self.out_lin):
            out = lin(a[t])
            if self.in_dim == fo:
                gate = torch.sigmoid(self.skip[t])
                out = gate * out + (1 - gate) * xs[t][: g.dst_counts[t]]
            outs.append(out)
        return g.merge(outs, dst=True)

    def _attention(
        self,
        typed: TypedBlock,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        queries: torch.Tensor,
    ) -> torch.Tensor:
        """``Σ_e α_e v_e W^V`` per destination and head, ``(num_dst, heads, D)``."""
        block, nd = typed.block, typed.block.num_dst
        heads, d = self.heads, self.out_dim // self.heads
        if not block.num_edges:
            return queries.new_zeros(nd, heads, d)
        k_cols, v_cols, starts, start = [], [], [], 0
        for r, rel in enumerate(typed.relations):
            starts.append(start)
            if rel is None:
                continue
            s = typed.ends[r][0]
            k_cols.append(torch.einsum("nhd,hde->nhe", keys[s], self.k_rel[r]))
            v_cols.append(torch.einsum("nhd,hde->nhe", values[s], self.v_rel[r]))
            start += rel.num_src
        etype = block.edge_type
        first = torch.tensor(starts, dtype=torch.int64, device=etype.device)
        cols = first.index_select(0, etype) + typed.groups.rank.index_select(0, block.indices)
        ones = torch.ones(block.num_edges, dtype=queries.dtype, device=queries.device)
        edges = Edges(CSRBlock(block.indptr, cols, ones, (nd, start)))
        k, v = torch.cat(k_cols), torch.cat(v_cols)
        q = queries.view(nd, heads, d).index_select(0, edges.rows)
        logits = (q * k.index_select(0, edges.cols)).sum(-1) * self.p_rel.index_select(0, etype)
        att = edge_softmax(logits / math.sqrt(d), edges.rows, nd)
        return attend(att, v, edges)
