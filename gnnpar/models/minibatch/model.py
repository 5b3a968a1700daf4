"""GNN layers and models for message-flow blocks (mini-batch training), in plain PyTorch.

Each layer takes a :class:`~gnnpar.sampling.Block` and the representations of the block's
source nodes, and returns those of its destinations (the first ``num_dst`` sources):

- :class:`SAGEConv`: GraphSAGE-mean, ``W_neigh · mean(h_u, u ∈ N(v)) + W_root · h_v + b``
  (PyG's ``SAGEConv`` with the same parameters gives the same output);
- :class:`GCNConv`: ``W · mean(h_u, u ∈ N(v) ∪ {v}) + b``, GCN with a self loop and
  row normalisation (symmetric normalisation needs the degrees of sources outside the
  block, which a sample does not have);
- :class:`GATConv`: graph attention with multi-head concatenation and a self loop.

Every layer takes optional edge weights (one per edge of the block): a weighted mean (SAGE,
as the full-graph layer's ``"mean"`` adjacency), a weighted sum with the self loop weighing 1
(GCN), attention scaled by the weight before it is normalised (GAT: ``α ∝ w · exp(e)``,
:func:`gnnpar.sparse.attention.weigh_logits`, as the full-graph layer). :class:`BlockGNN`
reads them from the blocks (:attr:`~gnnpar.sampling.Block.weight`, which the samplers record
for a weighted graph) or looks a given weight vector up through the blocks' edge ids.

Aggregation is a CSR sparse-dense product through the project's one local SpMM
(:func:`gnnpar.sparse.kernels.csr_spmm`, the same kernels as the full-graph layers); its
backward uses the transposed CSR, built only when a gradient is needed. :class:`BlockGNN`
stacks layers (dropout, layer, ReLU) and runs either on a list of blocks (training) or one
layer at a time (layer-wise inference).
Nothing here imports torch.distributed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gnnpar.errors import UserError
from gnnpar.nn.dropout import index_dropout
from gnnpar.sparse.attention import log_weights, weigh_logits
from gnnpar.sparse.kernels import csr_spmm, spmm

__all__ = ["BlockGNN", "GATConv", "GCNConv", "SAGEConv", "block_mean", "block_sum"]

_KINDS = ("sage", "gcn", "gat")


def _check_rows(block: Any, h_src: torch.Tensor) -> None:
    """ValueError unless ``h_src`` has one row per source of ``block``."""
    if h_src.shape[0] != block.num_src:
        raise ValueError(
            f"the block has {block.num_src} source nodes but h_src has {h_src.shape[0]} rows"
        )


def block_sum(block: Any, h_src: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_{u -> v} w_uv h_u`` for every destination ``v`` (weights default to 1)."""
    _check_rows(block, h_src)
    if weight is None:
        if hasattr(block, "operator"):  # a sampled Block keeps its operators
            return spmm(block.operator("sum", h_src.dtype), h_src)
        weight = torch.ones(block.num_edges, dtype=h_src.dtype, device=h_src.device)
    return csr_spmm(block.indptr, block.indices, weight, h_src, block.num_src)


def block_mean(
    block: Any, h_src: torch.Tensor, edge_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean of the in-neighbours' rows for every destination (0 where there are none);
    with ``edge_weight`` (one per edge, aligned with ``block.indices``) the weighted mean
    ``Σ w_uv h_u / Σ w_uv``. A block that carries its own ``edge_weight`` (a subgraph
    sampler's normalisation, which already includes the mean) is summed with those weights
    as they are."""
    given = getattr(block, "edge_weight", None)
    if given is not None:
        return block_sum(block, h_src, given.to(h_src.dtype))
    if edge_weight is None and hasattr(block, "operator"):  # a sampled Block keeps its operators
        _check_rows(block, h_src)
        return spmm(block.operator("mean", h_src.dtype), h_src)
    deg = block.in_degrees()
    if edge_weight is None:
        inv = 1.0 / deg.clamp(min=1).to(h_src.dtype)
        weight = torch.repeat_interleave(inv, deg, output_size=block.num_edges)
        return block_sum(block, h_src, weight)
    total = _weight_sums(block, edge_weight.to(h_src.dtype))
    inv = torch.where(total != 0, 1.0 / total, 0.0)
    weight = edge_weight.to(h_src.dtype) * torch.repeat_interleave(
        inv, deg, output_size=block.num_edges
    )
    return block_sum(block, h_src, weight)


def _weight_sums(block: Any, edge_weight: torch.Tensor) -> torch.Tensor:
    """``Σ_u w_uv`` for every destination v."""
    out = torch.zeros(block.num_dst, dtype=edge_weight.dtype, device=edge_weight.device)
    return out.index_add(0, block.dst_index(), edge_weight)


def _check_weights(block: Any, edge_weight: torch.Tensor | None) -> None:
    if edge_weight is not None and edge_weight.shape != (block.num_edges,):
        raise ValueError(
            f"edge_weight has shape {tuple(edge_weight.shape)}; the block has "
            f"{block.num_edges} edges"
        )


class SAGEConv(nn.Module):
    """GraphSAGE with mean aggregation on a block.

    ``lin_neigh`` (with the bias) and ``lin_root`` play the roles of PyG's ``lin_l`` and
    ``lin_r``. The neighbour transform is applied before aggregating when that is narrower.
    """

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True):
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.lin_neigh = nn.Linear(in_dim, out_dim, bias=bias)
        self.lin_root = nn.Linear(in_dim, out_dim, bias=False)

    def forward(
        self, block: Any, h_src: torch.Tensor, edge_weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Outputs of the block's destinations from its sources' ``h_src`` (``edge_weight``:
        the weighted mean of the neighbours)."""
        _check_weights(block, edge_weight)
        h_dst = h_src[: block.num_dst]
        if self.in_dim > self.out_dim:
            agg = block_mean(block, h_src @ self.lin_neigh.weight.t(), edge_weight)
            if self.lin_neigh.bias is not None:
                agg = agg + self.lin_neigh.bias
        else:
            agg = self.lin_neigh(block_mean(block, h_src, edge_weight))
        # the root term accumulated into the neighbour term's buffer (one matmul, no add)
        return torch.addmm(agg, h_dst, self.lin_root.weight.t())


class GCNConv(nn.Module):
    """GCN on a block: ``W · (h_v + sum_{u in N(v)} h_u) / (deg(v) + 1) + b``; with edge
    weights ``W · (h_v + Σ w_uv h_u) / (1 + Σ w_uv) + b`` (the self loop weighs 1)."""

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True):
        super().__init__()
        self.in_dim, self.out_dim = in_dim, out_dim
        self.lin = nn.Linear(in_dim, out_dim, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_dim)) if bias else None

    def forward(
        self, block: Any, h_src: torch.Tensor, edge_weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Outputs of the block's destinations from its sources' ``h_src``."""
        _check_weights(block, edge_weight)
        if self.in_dim > self.out_dim:
            h_src = self.lin(h_src)
        w = None if edge_weight is None else edge_weight.to(h_src.dtype)
        total = block_sum(block, h_src, w) + h_src[: block.num_dst]
        if w is None:
            out = total / (block.in_degrees() + 1).to(total.dtype)[:, None]
        else:
            out = total / (1 + _weight_sums(block, w))[:, None]
        if self.in_dim <= self.out_dim:
            out = self.lin(out)
        return out if self.bias is None else out + self.bias


class GATConv(nn.Module):
    """Graph attention (Veličković et al.) on a block, with a self loop per destination.

    ``heads`` attention heads of ``out_dim // heads`` features each are concatenated
    (``concat=True``) or averaged (``concat=False``, then each head has ``out_dim``). Edge
    weights scale the attention before it is normalised: ``α_uv ∝ w_uv · exp(e_uv)`` (the
    self loop weighs 1), i.e. ``log w`` added to the logits.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        heads: int = 1,
        concat: bool = True,
        negative_slope: float = 0.2,
        attn_dropout: float = 0.0,
        bias: bool = True,
    ):
        super().__init__()
        if heads < 1:
            raise UserError(f"heads must be >= 1, got {heads}")
        if concat and out_dim % heads:
            raise UserError(f"out_dim {out_dim} is not divisible by {heads} heads")
        self.heads, self.concat = heads, concat
        self.head_dim = out_dim // heads if concat else out_dim
        self.negative_slope, self.attn_dropout = negative_slope, attn_dropout
        self.lin = nn.Linear(in_dim, heads * self.head_dim, bias=False)
        self.att_src = nn.Parameter(torch.empty(heads, self.head_dim))
        self.att_dst = nn.Parameter(torch.empty(heads, self.head_dim))
        self.bias = nn.Parameter(torch.zeros(out_dim)) if bias else None
        nn.init.xavier_uniform_(self.att_src)
        nn.init.xavier_uniform_(self.att_dst)

    def forward(
        self, block: Any, h_src: torch.Tensor, edge_weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Outputs of the block's destinations from its sources' ``h_src``."""
        _check_weights(block, edge_weight)
        nd, heads = block.num_dst, self.heads
        z = self.lin(h_src).view(-1, heads, self.head_dim)
        a_src = (z * self.att_src).sum(-1)
        a_dst = (z[:nd] * self.att_dst).sum(-1)
        loops = torch.arange(nd, device=h_src.device)
        src = torch.cat([block.indices, loops])
        dst = torch.cat([block.dst_index(), loops])
        e = F.leaky_relu(a_src[src] + a_dst[dst], self.negative_slope)
        if edge_weight is not None:
            ones = torch.ones(nd, dtype=e.dtype, device=e.device)
            e = weigh_logits(e, log_weights(torch.cat([edge_weight.to(e.dtype), ones])))
        e_max = torch.full((nd, heads), float("-inf"), dtype=e.dtype, device=e.device)
        e_max = e_max.scatter_reduce(0, dst[:, None].expand_as(e), e, "amax", include_self=True)
        w = torch.exp(e - e_max[dst])
        denom = torch.zeros((nd, heads), dtype=e.dtype, device=e.device).index_add_(0, dst, w)
        alpha = w / denom[dst]
        alpha = F.dropout(alpha, self.attn_dropout, self.training)
        out = torch.zeros((nd, heads, self.head_dim), dtype=z.dtype, device=z.device)
        out = out.index_add_(0, dst, alpha[:, :, None] * z[src])
        out = out.reshape(nd, -1) if self.concat else out.mean(1)
        return out if self.bias is None else out + self.bias


class BlockGNN(nn.Module):
    """A stack of block layers: dropout, layer, ReLU (no ReLU after the last).

    Args:
        in_dim, hidden, out_dim: widths of the input, hidden layers and output.
        num_layers: number of layers (one block each).
        dropout: dropout probability on every layer's input.
        kind: ``"sage"``, ``"gcn"`` or ``"gat"``.
        heads: attention heads of the hidden GAT layers (the last has one).

    ``forward(blocks, x)`` takes the blocks of a mini-batch (input layer first) and the
    features of ``blocks[0]``'s sources; ``forward_layer`` runs one layer, for layer-wise
    inference. With a ``dropout_seed`` the dropout mask of every element is a hash of (seed,
    layer, the node's key, feature): the same whichever rank or batch computes the node, so
    training does not depend on how the batch is split over ranks; without one, dropout
    draws from torch's generator like ``nn.Dropout``.
    """

    def __init__(
        self,
        in_dim: int,
        hidden: int,
        out_dim: int,
        num_layers: int = 2,
        dropout: float = 0.5,
        kind: str = "sage",
        heads: int = 4,
    ):
        super().__init__()
        if kind not in _KINDS:
            raise UserError(f"unknown block model {kind!r}; use one of {', '.join(_KINDS)}")
        if num_layers < 1:
            raise UserError(f"num_layers must be at least 1, got {num_layers}")
        if not 0.0 <= dropout < 1.0:
            raise UserError(f"dropout must be in [0, 1), got {dropout}")
        dims = [in_dim] + [hidden] * (num_layers - 1) + [out_dim]
        layers: list[nn.Module] = []
        for i in range(num_layers):
            last = i == num_layers - 1
            if kind == "sage":
                layers.append(SAGEConv(dims[i], dims[i + 1]))
            elif kind == "gcn":
                layers.append(GCNConv(dims[i], dims[i + 1]))
            else:
                layers.append(GATConv(dims[i], dims[i + 1], heads=1 if last else heads))
        self.kind = kind
        self.dropout = dropout
        self.layers = nn.ModuleList(layers)

    @property
    def num_layers(self) -> int:
        """Number of layers (and of blocks a forward pass takes)."""
        return len(self.layers)

    def prepare(self, batch: Any) -> None:
        """Build each block's aggregation operator now, and its transpose where backward
        multiplies by it (every layer after the first, and the first when it transforms
        before aggregating): a loader's ``prepare``, run in its prefetch thread while the
        previous batch trains (:meth:`~gnnpar.sampling.Block.prepare_operators`). GAT and
        weighted blocks aggregate otherwise and build nothing."""
        if self.kind == "gat":
            return
        kind = "mean" if self.kind == "sage" else "sum"
        # the features' dtype, the model's (a ZeRO-3 model may hold no parameter to ask)
        dtype = torch.get_default_dtype() if batch.x is None else batch.x.dtype
        for i, (block, layer) in enumerate(zip(batch.blocks, self.layers, strict=False)):
            if block.weight is not None or block.edge_weight is not None:
                continue
            grad = i > 0 or layer.in_dim > layer.out_dim
            block.prepare_operators(kind, dtype, transpose=grad)

    def forward_layer(
        self,
        i: int,
        block: Any,
        h_src: torch.Tensor,
        dropout_seed: int | None = None,
        edge_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer ``i`` on ``block``: dropout (in training), the layer, ReLU unless last;
        ``edge_weight``: the block's edges' weights (aligned with ``block.indices``; default:
        those the block records, :attr:`~gnnpar.sampling.Block.weight`)."""
        if edge_weight is None:
            edge_weight = block.weight
        if dropout_seed is None:
            h = F.dropout(h_src, self.dropout, self.training)
        else:
            keys = block.keys
            h = index_dropout(h_src, self.dropout, dropout_seed * 1009 + i, keys, 0, self.training)
        h = self.layers[i](block, h, edge_weight)
        # in place: no layer's backward reads its own output
        return h if i == self.num_layers - 1 else torch.relu_(h)

    def forward(
        self,
        blocks: list[Any],
        x: torch.Tensor,
        dropout_seed: int | None = None,
        edge_weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of the seeds (``blocks[-1]``'s destinations). ``edge_weight``: the sampled
        graph's weight per edge (its CSR order), looked up through each block's
        ``edge_ids``; without it, the weights the blocks record (a weighted graph's)."""
        if len(blocks) != self.num_layers:
            raise UserError(f"the model has {self.num_layers} layers but got {len(blocks)} blocks")
        h = x
        for i, block in enumerate(blocks):
            w = None
            if edge_weight is not None:
                if block.edge_ids is None:
                    raise UserError(
                        "edge weights need the blocks' edge ids, which this sampler does not "
                        "record (distributed sampling: its blocks carry the weights instead)"
                    )
                w = edge_weight[block.edge_ids]
            h = self.forward_layer(i, block, h, dropout_seed, w)
        return h
