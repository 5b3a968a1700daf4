"""Plain full-graph GNN models: GCN, GraphSAGE (mean), GAT, GIN and R-GCN, serial, readable.

They take the (normalised) adjacency as a :class:`~gnnpar.sparse.kernels.LocalSpMM` over the
whole graph (R-GCN: one per relation, :func:`~gnnpar.models.fullgraph.relations.relation_spmms`);
parallelism is applied from outside by
:func:`gnnpar.models.fullgraph.parallelize_fullgraph`, which reads these modules' parameters.
Nothing here imports torch.distributed.

Edge weights w enter through that adjacency, one normalisation per kind (:func:`norm_of`):

- GCN: ``Â = D^-1/2 (A + I) D^-1/2`` with the weighted degrees (``"gcn"``);
- GraphSAGE: the weighted mean ``Σ_j w_ij h_j / Σ_j w_ij`` (``"mean"``, row-normalised A);
- GAT: ``α_ij ∝ w_ij · exp(e_ij)`` over ``A + I`` (``"raw"``: the weights as they are, a self
  loop of weight 1 where a node has none), :func:`gnnpar.sparse.attention.weigh_logits`;
- GIN: ``(1 + ε) h_i + Σ_{j ≠ i} w_ij h_j`` over the same ``"raw"`` adjacency, its self loops
  replaced by the ε term, then the MLP ``Linear → BatchNorm → ReLU → Linear``
  (:func:`gin_batch_norm`);
- R-GCN: each relation r's weighted mean ``Σ_{j ∈ N_r(i)} w_ij h_j / Σ_{j ∈ N_r(i)} w_ij``
  (``"mean-per-relation"``: one row-normalised Â_r per relation of a typed graph,
  :mod:`gnnpar.models.fullgraph.relations`).

A layer with several sparse operators (SAGE: Â and the identity; R-GCN: Â_1 … Â_R and the
identity) is ``cat_k(op_k H) @ [W_1; …; W_K]``: :attr:`num_ops` operators whose weights
:meth:`stacked_weight` stacks along the input dimension, in the operators' order, and
:meth:`operator_keys` names (the plain state dict's keys, which checkpoints use).

An unweighted graph is the graph whose weights are all 1: the same results, exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gnnpar.errors import UserError
from gnnpar.nn.dropout import index_dropout
from gnnpar.sparse import attention
from gnnpar.sparse.kernels import LocalSpMM, spmm


def _glorot(shape: tuple[int, int], generator: torch.Generator | None = None) -> torch.Tensor:
    bound = math.sqrt(6.0 / (shape[0] + shape[1]))
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


class GCNLayer(nn.Module):
    """``Â H W + b`` with W of shape (in, out)."""

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(_glorot((in_dim, out_dim)))
        self.bias = nn.Parameter(torch.zeros(out_dim)) if bias else None

    num_ops = 1

    def stacked_weight(self) -> torch.Tensor:
        """Weights of every sparse operator stacked along the input dimension."""
        return self.weight

    def operator_keys(self) -> list[str]:
        """The parameter of each sparse operator's weight, in :meth:`stacked_weight`'s order."""
        return ["weight"]

    def stacked_weight_grad(self) -> torch.Tensor | None:
        """Gradient of :meth:`stacked_weight`."""
        return self.weight.grad

    def forward(self, adj: LocalSpMM, h: torch.Tensor) -> torch.Tensor:  # noqa: D102
        out = spmm(adj, h) @ self.weight
        return out if self.bias is None else out + self.bias


class SAGELayer(nn.Module):
    """GraphSAGE with mean aggregation: ``mean_A(H) W_neigh + H W_root + b``."""

    num_ops = 2

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True):
        super().__init__()
        self.weight_neigh = nn.Parameter(_glorot((in_dim, out_dim)))
        self.weight_root = nn.Parameter(_glorot((in_dim, out_dim)))
        self.bias = nn.Parameter(torch.zeros(out_dim)) if bias else None

    def stacked_weight(self) -> torch.Tensor:
        """[W_neigh; W_root]: the operators are (row-normalised A, identity)."""
        return torch.cat([self.weight_neigh, self.weight_root], dim=0)

    def operator_keys(self) -> list[str]:
        """The parameter of each sparse operator's weight, in :meth:`stacked_weight`'s order."""
        return ["weight_neigh", "weight_root"]

    def stacked_weight_grad(self) -> torch.Tensor | None:
        """Gradient of :meth:`stacked_weight`."""
        if self.weight_neigh.grad is None or self.weight_root.grad is None:
            return None
        return torch.cat([self.weight_neigh.grad, self.weight_root.grad], dim=0)

    def forward(self, adj: LocalSpMM, h: torch.Tensor) -> torch.Tensor:  # noqa: D102
        out = spmm(adj, h) @ self.weight_neigh + h @ self.weight_root
        return out if self.bias is None else out + self.bias


def combine_bases(blocks: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
    """[W_1; …; W_R; W_root] from the blocks [V_1; …; V_B; W_root] (B + 1 blocks of equal
    rows, stacked) and the coefficients ``comp`` (R × B): ``W_r = Σ_b comp[r, b] · V_b``,
    differentiably. Any column slice of the blocks combines to the same slice of the
    weights, so a rank applies it to its own (fin × fout) blocks."""
    num_rel, num_bases = comp.shape
    rows = blocks.shape[0] // (num_bases + 1)
    bases = blocks[: num_bases * rows].reshape(num_bases, -1)
    relations = (comp @ bases).view(num_rel * rows, blocks.shape[1])
    return torch.cat([relations, blocks[num_bases * rows :]])


def split_bases_grad(
    grad: torch.Tensor, blocks: torch.Tensor, comp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of :func:`combine_bases`: from the gradient of [W_1; …; W_R; W_root],
    that of the blocks [V_1; …; V_B; W_root] and of ``comp`` (R × B). On a slice of the
    blocks both are the slice's share: the blocks' gradient is the slice's own, ``comp``'s a
    partial sum over the slices."""
    num_rel, num_bases = comp.shape
    rows = grad.shape[0] // (num_rel + 1)
    g_rel = grad[: num_rel * rows].reshape(num_rel, -1)
    bases = blocks[: num_bases * rows].reshape(num_bases, -1)
    g_bases = (comp.T @ g_rel).view(num_bases * rows, grad.shape[1])
    return torch.cat([g_bases, grad[num_rel * rows :]]), g_rel @ bases.T


class RGCNLayer(nn.Module):
    """Relational GCN (Schlichtkrull et al.; PyG's ``RGCNConv`` with ``aggr="mean"``):
    ``h_v' = W_root h_v + b + Σ_r mean_{u ∈ N_r(v)} W_r h_u``, i.e.
    ``cat(Â_1 H, …, Â_R H, H) @ [W_1; …; W_R; W_root] + b`` with Â_r relation r's
    row-normalised adjacency (``"mean-per-relation"``): :attr:`num_ops` = R + 1 operators,
    the last the identity, as GraphSAGE's root term.

    ``num_bases`` B (PyG's basis decomposition): ``W_r = Σ_b comp[r, b] · bases[b]``, fewer
    parameters for many relations. The parallel 3D model shards the stored blocks
    [V_1; …; V_B; W_root] (:meth:`weight_blocks`) and keeps ``comp`` whole on every rank;
    each layer combines the relations' weights after gathering its blocks
    (:func:`combine_bases`).

    The input is a typed graph's ``ndata["feat"]`` as stored, each type's features
    left-aligned and zero-padded (:mod:`gnnpar.graph.typed`): a featureless type's rows start
    at zero and receive their first messages in layer 1 (its bias and its in-relations). A
    learnable embedding per featureless node, as ogbn-mag's R-GCN baselines use, is the
    mini-batch model's business: on the full graph it would be a (nodes × width) parameter
    sharded like the features, which this model does not have."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        num_relations: int,
        bias: bool = True,
        num_bases: int | None = None,
    ):
        super().__init__()
        if num_relations < 1:
            raise UserError(f"an R-GCN layer needs at least one relation, got {num_relations}")
        if num_bases is not None and num_bases < 1:
            raise UserError(f"num_bases must be at least 1 (or None), got {num_bases}")
        self.num_relations = num_relations
        self.num_bases = num_bases
        #: Sparse operators: the R relations' Â_r, then the identity (the root term).
        self.num_ops = num_relations + 1
        if num_bases is None:
            self.weights = nn.ParameterList(
                nn.Parameter(_glorot((in_dim, out_dim))) for _ in range(num_relations)
            )
            self.bases = self.comp = None
        else:
            self.weights = None
            self.bases = nn.Parameter(
                torch.stack([_glorot((in_dim, out_dim)) for _ in range(num_bases)])
            )
            self.comp = nn.Parameter(_glorot((num_relations, num_bases)))
        self.weight_root = nn.Parameter(_glorot((in_dim, out_dim)))
        self.bias = nn.Parameter(torch.zeros(out_dim)) if bias else None

    def relation_weights(self) -> list[torch.Tensor]:
        """W_1 … W_R (with bases: combined from them, differentiably)."""
        if self.weights is not None:
            return list(self.weights)
        in_dim, out_dim = self.bases.shape[1:]
        relations = combine_bases(self.weight_blocks(), self.comp)[:-in_dim]
        return list(relations.view(self.num_relations, in_dim, out_dim).unbind(0))

    def stacked_weight(self) -> torch.Tensor:
        """[W_1; …; W_R; W_root]: the operators are (Â_1, …, Â_R, identity)."""
        return torch.cat([*self.relation_weights(), self.weight_root], dim=0)

    def stacked_weight_grad(self) -> torch.Tensor | None:
        """Gradient of :meth:`stacked_weight` (None with bases: the stack is not a
        parameter then)."""
        if self.weights is None:
            return None
        grads = [w.grad for w in self.weights] + [self.weight_root.grad]
        if any(g is None for g in grads):
            return None
        return torch.cat(grads, dim=0)

    def weight_blocks(self) -> torch.Tensor:
        """The stored blocks stacked along the input dimension, what the parallel model
        shards: :meth:`stacked_weight` itself, or with bases [V_1; …; V_B; W_root] (from
        which :func:`combine_bases` and ``comp`` make the stacked weight)."""
        if self.bases is None:
            return self.stacked_weight()
        return torch.cat([self.bases.reshape(-1, self.bases.shape[2]), self.weight_root])

    def weight_blocks_grad(self) -> torch.Tensor | None:
        """Gradient of :meth:`weight_blocks` (None before a backward)."""
        if self.bases is None:
            return self.stacked_weight_grad()
        if self.bases.grad is None or self.weight_root.grad is None:
            return None
        return torch.cat([self.bases.grad.reshape(-1, self.bases.shape[2]), self.weight_root.grad])

    def block_keys(self) -> list[tuple[str, int | None]]:
        """The parameter of each of :meth:`weight_blocks`' blocks: ``(name, None)`` for a
        whole (in × out) parameter, ``(name, b)`` for the slice ``b`` of a stacked one
        (``bases``)."""
        if self.bases is None:
            return [(k, None) for k in self.operator_keys()]
        return [("bases", b) for b in range(self.bases.shape[0])] + [("weight_root", None)]

    def operator_keys(self) -> list[str]:
        """The parameter of each sparse operator's weight, in :meth:`stacked_weight`'s order
        (``weights.0`` … ``weights.{R-1}``, ``weight_root``); bases have none."""
        if self.weights is None:
            raise UserError(
                "an R-GCN layer with num_bases has no weight per relation to shard: leave "
                "num_bases unset"
            )
        return [f"weights.{r}" for r in range(self.num_relations)] + ["weight_root"]

    def forward(self, adjs: Sequence[LocalSpMM], h: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if len(adjs) != self.num_relations:
            raise UserError(
                f"an R-GCN layer of {self.num_relations} relations got {len(adjs)} operators"
            )
        out = h @ self.weight_root
        for adj, w in zip(adjs, self.relation_weights(), strict=True):
            out = out + spmm(adj, h) @ w
        return out if self.bias is None else out + self.bias


class GATLayer(nn.Module):
    """Multi-head graph attention (Veličković et al.; PyG's ``GATConv`` with its defaults):
    ``Z = H W`` split into ``heads`` heads of ``F`` features, per head
    ``e_ij = LeakyReLU(a_dstᵀ Z_i + a_srcᵀ Z_j)`` on the nonzeros of the ``"raw"`` adjacency
    ``A + I`` (:meth:`~gnnpar.graph.Graph.weighted_self_loops`), whose values are the edge
    weights: ``α_ij ∝ w_ij · exp(e_ij)``, a softmax over each row's edges,
    attention dropout, then ``out_i = Σ_j att_ij Z_j``; heads concatenated (hidden layers) or
    averaged (``concat=False``, the output layer), plus the bias."""

    num_ops = 1

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        heads: int = 1,
        concat: bool = True,
        attn_dropout: float = 0.0,
        negative_slope: float = 0.2,
        bias: bool = True,
    ):
        super().__init__()
        if concat and out_dim % heads:
            raise UserError(f"a GAT layer of width {out_dim} cannot split into {heads} heads")
        self.heads, self.concat = heads, concat
        self.head_dim = out_dim // heads if concat else out_dim
        self.out_dim = out_dim
        self.attn_dropout, self.negative_slope = attn_dropout, negative_slope
        self.weight = nn.Parameter(_glorot((in_dim, heads * self.head_dim)))
        self.att_src = nn.Parameter(_glorot((heads, self.head_dim)))
        self.att_dst = nn.Parameter(_glorot((heads, self.head_dim)))
        self.bias = nn.Parameter(torch.zeros(out_dim)) if bias else None

    def stacked_weight(self) -> torch.Tensor:
        """The weight (in × heads·F)."""
        return self.weight

    def stacked_weight_grad(self) -> torch.Tensor | None:
        """Gradient of :meth:`stacked_weight`."""
        return self.weight.grad

    def forward(  # noqa: D102
        self, adj: LocalSpMM, h: torch.Tensor, seed: int | None = None
    ) -> torch.Tensor:
        z = (h @ self.weight).view(h.shape[0], self.heads, self.head_dim)
        e = attention.Edges(adj.block)
        alpha_dst = (z * self.att_dst).sum(-1)
        out = attention.gat_aggregate(z, alpha_dst, self.att_src, e, (e.rows, e.cols), seed, self)
        out = out.reshape(h.shape[0], -1) if self.concat else out.mean(dim=1)
        return out if self.bias is None else out + self.bias


class GINLayer(nn.Module):
    """Graph isomorphism network layer (Xu et al.; PyG's ``GINConv`` with ``train_eps``, DGL's
    ``GINConv`` with edge weights): ``MLP((1 + ε)·h_i + Σ_{j ≠ i} w_ij h_j)`` over the
    ``"raw"`` adjacency (values: the edge weights) without its self loops, ε learnable
    (starts at 0). The MLP is ``Linear → BatchNorm → ReLU → Linear`` of width ``out_dim``, as
    in PyG's GIN examples, its first Linear without a bias (the BatchNorm subtracts it again
    with the mean, so its gradient would be rounding noise; the BatchNorm's shift takes its
    place); ``batch_norm=False``: ``Linear → ReLU → Linear``, both with biases.

    The BatchNorm (:func:`gin_batch_norm`) normalises each feature by the mean and variance
    over all nodes of the pass, in training and in evaluation alike (the batch is the whole
    graph; PyG's ``BatchNorm1d(track_running_stats=False)``), then scales by
    ``norm_weight`` (starts at 1) and shifts by ``norm_bias`` (starts at 0). Without it, the
    sum over a node's neighbours grows with its degree: on a graph of mean degree 10 the
    first logits are in the hundreds and Adam's first steps leave the output MLP's ReLUs
    dead."""

    num_ops = 1

    def __init__(self, in_dim: int, out_dim: int, bias: bool = True, batch_norm: bool = True):
        super().__init__()
        self.weight = nn.Parameter(_glorot((in_dim, out_dim)))
        hidden_bias = bias and not batch_norm
        self.hidden_bias = nn.Parameter(torch.zeros(out_dim)) if hidden_bias else None
        self.norm_weight = nn.Parameter(torch.ones(out_dim)) if batch_norm else None
        self.norm_bias = nn.Parameter(torch.zeros(out_dim)) if batch_norm else None
        self.weight_out = nn.Parameter(_glorot((out_dim, out_dim)))
        self.bias = nn.Parameter(torch.zeros(out_dim)) if bias else None
        self.eps = nn.Parameter(torch.zeros(1))

    def stacked_weight(self) -> torch.Tensor:
        """The MLP's first weight (in × out)."""
        return self.weight

    def forward(self, adj: LocalSpMM, h: torch.Tensor) -> torch.Tensor:  # noqa: D102
        rows, cols = attention.edges(adj.block)
        keep = rows != cols  # the self loops of A + I are GIN's ε term
        z = h @ self.weight  # the MLP's first Linear commutes with the (linear) aggregation
        ids = torch.arange(h.shape[0], device=h.device)
        w = adj.block.values[keep].to(z.dtype)
        out = gin_aggregate(z, z, (rows[keep], cols[keep], w), (ids, ids), h.shape[0], self.eps)
        if self.hidden_bias is not None:
            out = out + self.hidden_bias
        if self.norm_weight is not None:
            out = gin_batch_norm(out, self.norm_weight, self.norm_bias, h.shape[0])
        out = torch.relu(out) @ self.weight_out
        return out if self.bias is None else out + self.bias


BATCH_NORM_EPS = 1e-5
"""The ε under the square root of GIN's BatchNorm (PyTorch's and PyG's default)."""


def gin_batch_norm(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    num_rows: int,
    row_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """GIN's BatchNorm of the rows of ``h`` (nodes × features): ``(h - μ) / sqrt(σ² + ε)``
    scaled by ``weight`` and shifted by ``bias``, with μ and the biased σ² of each feature
    over all ``num_rows`` nodes. ``h`` may hold only some of the rows: ``row_sum`` then sums
    a per-feature partial sum over the ranks holding the others (forward, and its gradient
    backward); None: ``h`` holds them all. Two passes (the mean, then the squared deviations
    from it), which keeps the variance of large, shifted features accurate in low precision."""
    total = row_sum if row_sum is not None else (lambda t: t)
    mean = total(h.sum(0)) / num_rows
    centred = h - mean
    var = total((centred * centred).sum(0)) / num_rows
    return centred * torch.rsqrt(var + BATCH_NORM_EPS) * weight + bias


def gin_aggregate(
    z: torch.Tensor,
    z_self: torch.Tensor,
    edges: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    root: tuple[torch.Tensor, torch.Tensor],
    num_rows: int,
    eps: torch.Tensor,
) -> torch.Tensor:
    """GIN's sum over one block: ``Σ_j w·z[j]`` over ``edges`` (row ← column of ``z``, weight
    w: neighbours, no self loops) plus ``(1 + ε)·z_self[c]`` at row r for each ``root`` pair
    (r, c) (row ← column of ``z_self`` holding the same node)."""
    rows, cols, weight = edges
    out = z.new_zeros(num_rows, z.shape[1]).index_add(0, rows, z[cols] * weight[:, None])
    return out.index_add(0, root[0], (1 + eps) * z_self[root[1]])


ACTIVATIONS = {
    "gcn": torch.relu, "sage": torch.relu, "gat": F.elu, "gin": torch.relu, "rgcn": torch.relu,
}  # fmt: skip
"""The nonlinearity between layers of each kind (ELU for GAT, as in its paper)."""

NORMS = {"gcn": "gcn", "sage": "mean", "gat": "raw", "gin": "raw"}
"""The adjacency each kind of one adjacency reads (the ``norm`` of
:func:`gnnpar.sparse.prepare_shards`): ``"gcn"`` D^-1/2 (A + I) D^-1/2, ``"mean"``
row-normalised A, ``"raw"`` A + I with the edge weights as they are
(:meth:`~gnnpar.graph.Graph.weighted_self_loops`)."""

RELATION_NORMS = {"rgcn": "mean-per-relation"}
"""The kinds that read one adjacency per relation of a typed graph, and its normalisation:
``"mean-per-relation"``, each relation's row-normalised Â_r
(:mod:`gnnpar.models.fullgraph.relations`)."""


def norm_of(kind: str) -> str:
    """The normalisation a model of ``kind`` reads (:data:`NORMS`, :data:`RELATION_NORMS`)."""
    norms = {**NORMS, **RELATION_NORMS}
    if kind not in norms:
        raise UserError(f"unknown full-graph model {kind!r}; use one of {list(norms)}")
    return norms[kind]


class FullGraphGNN(nn.Module):
    """A stack of GCN, SAGE, GAT, GIN or R-GCN layers with index-seeded dropout and the kind's
    nonlinearity (:data:`ACTIVATIONS`) between them.

    R-GCN (``kind="rgcn"``): ``num_relations`` relations (required), optionally
    ``num_bases`` (:class:`RGCNLayer`); its ``adj`` is the sequence of the relations'
    operators Â_1 … Â_R.

    GAT: ``hidden`` is the width of a hidden layer, ``heads`` heads of ``hidden / heads``
    features concatenated; the output layer averages ``out_heads`` heads of ``out_dim``;
    ``attn_dropout`` drops attention values (by (seed, edge, head)). GIN: ``batch_norm``
    puts a BatchNorm in each layer's MLP (:class:`GINLayer`); the other kinds ignore it."""

    def __init__(
        self,
        in_dim: int,
        hidden: int,
        out_dim: int,
        num_layers: int = 2,
        dropout: float = 0.5,
        kind: str = "gcn",
        bias: bool = True,
        heads: int = 1,
        out_heads: int = 1,
        attn_dropout: float = 0.0,
        batch_norm: bool = True,
        num_relations: int | None = None,
        num_bases: int | None = None,
    ):
        super().__init__()
        if num_layers < 1:
            raise UserError(f"num_layers must be at least 1, got {num_layers}")
        if kind not in ACTIVATIONS:
            raise UserError(f"unknown full-graph model {kind!r}; use one of {list(ACTIVATIONS)}")
        dims = [in_dim] + [hidden] * (num_layers - 1) + [out_dim]
        self.kind = kind
        self.dropout = dropout
        self._dims = dims
        if kind == "gat":
            self.layers = nn.ModuleList(
                GATLayer(
                    dims[i],
                    dims[i + 1],
                    heads if i < num_layers - 1 else out_heads,
                    concat=i < num_layers - 1,
                    attn_dropout=attn_dropout,
                    bias=bias,
                )
                for i in range(num_layers)
            )
        elif kind == "gin":
            self.layers = nn.ModuleList(
                GINLayer(dims[i], dims[i + 1], bias, batch_norm) for i in range(num_layers)
            )
        elif kind == "rgcn":
            if num_relations is None:
                raise UserError("an rgcn model needs num_relations (the typed graph's relations)")
            self.layers = nn.ModuleList(
                RGCNLayer(dims[i], dims[i + 1], num_relations, bias, num_bases)
                for i in range(num_layers)
            )
        else:
            layer_cls = {"gcn": GCNLayer, "sage": SAGELayer}[kind]
            self.layers = nn.ModuleList(
                layer_cls(dims[i], dims[i + 1], bias) for i in range(num_layers)
            )

    @property
    def dims(self) -> list[int]:
        """Feature widths from input to output."""
        return list(self._dims)

    def act(self, h: torch.Tensor) -> torch.Tensor:
        """The nonlinearity between layers."""
        return ACTIVATIONS[self.kind](h)

    def forward(
        self,
        adj: LocalSpMM | Sequence[LocalSpMM],
        x: torch.Tensor,
        dropout_seed: int | None = None,
    ) -> torch.Tensor:
        """Logits for every node (``adj``: the normalised adjacency, or for R-GCN the
        relations' Â_1 … Â_R). ``dropout_seed`` (e.g. derived from the epoch) turns dropout
        on; the same seed draws the same masks on any grid."""
        rows = torch.arange(x.shape[0])
        h = x
        for i, layer in enumerate(self.layers):
            seed = None if dropout_seed is None else dropout_seed * 1009 + i
            h = index_dropout(h, self.dropout, seed, rows, 0, self.training)
            h = layer(adj, h, seed) if self.kind == "gat" else layer(adj, h)
            if i < len(self.layers) - 1:
                h = self.act(h)
        return h


def GCN(in_dim: int, hidden: int, out_dim: int, num_layers: int = 2, dropout: float = 0.5):  # noqa: N802
    """A Kipf & Welling GCN (use with the GCN-normalised adjacency)."""
    return FullGraphGNN(in_dim, hidden, out_dim, num_layers, dropout, kind="gcn")


def GraphSAGE(  # noqa: N802
    in_dim: int, hidden: int, out_dim: int, num_layers: int = 2, dropout: float = 0.5
):
    """Full-graph GraphSAGE-mean (use with the row-normalised adjacency)."""
    return FullGraphGNN(in_dim, hidden, out_dim, num_layers, dropout, kind="sage")


def GAT(  # noqa: N802
    in_dim: int,
    hidden: int,
    out_dim: int,
    num_layers: int = 2,
    dropout: float = 0.6,
    heads: int = 8,
    out_heads: int = 1,
    attn_dropout: float = 0.6,
):
    """Full-graph GAT (Veličković et al.): ``heads`` heads concatenated in hidden layers,
    ``out_heads`` averaged in the output layer (use with the ``"raw"`` adjacency A + I, whose
    values are the edge weights)."""
    return FullGraphGNN(
        in_dim, hidden, out_dim, num_layers, dropout, "gat",
        heads=heads, out_heads=out_heads, attn_dropout=attn_dropout,
    )  # fmt: skip


def GIN(  # noqa: N802
    in_dim: int,
    hidden: int,
    out_dim: int,
    num_layers: int = 2,
    dropout: float = 0.5,
    batch_norm: bool = True,
):
    """Full-graph GIN (Xu et al.; use with the ``"raw"`` adjacency A + I, whose weighted
    neighbours it sums, its self loops replaced by the learnable ε term), each layer's MLP
    ``Linear → BatchNorm → ReLU → Linear`` (``batch_norm=False``: without the BatchNorm)."""
    return FullGraphGNN(
        in_dim, hidden, out_dim, num_layers, dropout, kind="gin", batch_norm=batch_norm
    )


def RGCN(  # noqa: N802
    in_dim: int,
    hidden: int,
    out_dim: int,
    num_relations: int,
    num_layers: int = 2,
    dropout: float = 0.5,
    num_bases: int | None = None,
):
    """Full-graph R-GCN (Schlichtkrull et al., mean aggregation per relation; use with the
    relations' row-normalised adjacencies, :func:`gnnpar.models.fullgraph.relations.relation_spmms`
    or the ``"mean-per-relation"`` shards)."""
    return FullGraphGNN(
        in_dim, hidden, out_dim, num_layers, dropout, kind="rgcn",
        num_relations=num_relations, num_bases=num_bases,
    )  # fmt: skip
