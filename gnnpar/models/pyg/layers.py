"""The parallel forward of each supported PyG layer on a graph *share*.

Each function has the signature of the PyG module's own ``forward``, ``edge_index`` being
the share (a plain ``edge_index`` runs the module's own forward), and the same arithmetic, in
the same order, on this rank's node rows; the module's parameters are used as they are. A
share is what one rank holds of the graph and how its rows meet the others' (:class:`Share`):
the full-graph grid's :class:`~gnnpar.models.fullgraph.share.GraphShare`, or a partition's
for layer-wise inference (:mod:`gnnpar.models.minibatch.pyg`). :func:`forwards` maps each
class to its function, :func:`operators_of` to the adjacency values it reads, and
:func:`refusal` says why a module's options cannot run (None when they can).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gnnpar.errors import UserError
from gnnpar.recompute import in_backward, recompute
from gnnpar.sparse import attention

if TYPE_CHECKING:  # imported where used: PyG takes seconds, and naming a model must not pay
    import torch_geometric.nn as pyg


def pyg_nn() -> Any:
    """``torch_geometric.nn``, imported on first use."""
    import torch_geometric.nn

    return torch_geometric.nn


class Share(Protocol):
    """What the parallel forwards ask of a share: this rank's rows ``R``, the block's rows
    ``X`` and columns ``C`` (its ``Â`` is X × C), and the collectives between them."""

    num_nodes: int
    num_block_rows: int
    checkpointing: bool

    def propagate(self, kind: str, h: torch.Tensor, what: str = "") -> torch.Tensor:
        """``Â·h`` (R rows in, R rows out) with the values of ``kind``."""

    def gather_cols(self, h: torch.Tensor, what: str = "") -> torch.Tensor:
        """R rows → the block's columns C."""

    def gather_rows(self, v: torch.Tensor, what: str = "") -> torch.Tensor:
        """R rows → the block's rows X."""

    def scatter_rows(self, p: torch.Tensor, what: str = "") -> torch.Tensor:
        """Partial sums over X → R rows."""

    def edges(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(row in X, column in C) of each edge of ``kind``."""

    def attention_edges(self) -> attention.Edges:
        """The block's edges with one self loop per node, as the attention SpMM reads them."""

    def softmax(self, e: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """PyG's softmax over each row's edges."""

    def neighbour_max(self, h: torch.Tensor) -> torch.Tensor:
        """Max over each row's neighbours (R rows in, R rows out)."""

    def node_sum(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """A sum over every node of the graph."""

    def relation_edges(self, relations: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each of the ``relations`` relations' edges: (row in X, column in C)."""

    def relation_partials(self, hc: torch.Tensor, relations: int) -> list[torch.Tensor]:
        """Each of the ``relations`` relations' ``Â_r`` block times ``hc`` (C rows in,
        partial sums over X out)."""


def _is_share(edge_index: Any) -> bool:
    return hasattr(edge_index, "propagate") and not isinstance(edge_index, torch.Tensor)


def _dispatch(parallel: Callable[..., torch.Tensor], where: int = 1):
    """``parallel`` when argument ``where`` (``edge_index``) is a share, else the class's
    own forward (a module keeps working on a plain ``edge_index``)."""

    def forward(module: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) <= where and _is_share(kwargs.get("edge_index")):  # edge_index=share
            args = (*args, kwargs.pop("edge_index"))
        if len(args) > where and _is_share(args[where]):
            return parallel(module, *args, **kwargs)
        return type(module).forward(module, *args, **kwargs)

    forward.__doc__ = parallel.__doc__
    return forward


def _no_weights(edge_weight: Any, module: nn.Module) -> None:
    if edge_weight is not None:
        raise UserError(
            f"{type(module).__name__}: a parallelized model takes its edge weights from the "
            "graph; call the convolution without edge_weight"
        )


def _checkpointed(body: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``body(module, share, *tensors)`` recomputed in backward when the share says so."""

    def run(module: nn.Module, share: Share, *tensors: torch.Tensor) -> torch.Tensor:
        fn = lambda *t: body(module, share, *t)  # noqa: E731
        return recompute(fn, *tensors, enabled=share.checkpointing)

    return run


# ---------------------------------------------------------------------- convolutions
@_checkpointed
def _gcn(m: pyg.GCNConv, g: Share, x: torch.Tensor) -> torch.Tensor:
    out = g.propagate("gcn", m.lin(x), "Â·XW (GCNConv)")
    return out if m.bias is None else out + m.bias


def gcn_conv(m, x, edge_index, edge_weight=None):  # noqa: D103
    _no_weights(edge_weight, m)
    return _gcn(m, edge_index, x)


@_checkpointed
def _sage(m: pyg.SAGEConv, g: Share, x: torch.Tensor) -> torch.Tensor:
    src = F.relu(m.lin(x)) if m.project and hasattr(m, "lin") else x
    if str(m.aggr) == "max":
        agg = g.neighbour_max(src)
    else:
        agg = g.propagate("mean", src, "mean(H) (SAGEConv)")
    out = m.lin_l(agg)
    if m.root_weight:
        out = out + m.lin_r(x)
    return F.normalize(out, p=2.0, dim=-1) if m.normalize else out


def sage_conv(m, x, edge_index, size=None):  # noqa: D103
    return _sage(m, edge_index, x)


def _attend(m, g: Share, src: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """softmax → attention dropout → Σ att·src over each row's edges (the attention SpMM of
    :func:`gnnpar.sparse.attention.attend`), summed over x: this rank's rows, heads
    concatenated or averaged."""
    e = g.attention_edges()
    heads, channels = m.heads, m.out_channels
    att = g.softmax(logits, e.rows)
    att = F.dropout(att, p=m.dropout, training=m.training)
    part = attention.attend(att.to(src.dtype), src, e)
    out = g.scatter_rows(part.reshape(part.shape[0], -1), "OUT = att·Z").view(-1, heads, channels)
    return out.reshape(out.shape[0], -1) if m.concat else out.mean(dim=1)


@_checkpointed
def _gat(m: pyg.GATConv, g: Share, x: torch.Tensor) -> torch.Tensor:
    heads, channels = m.heads, m.out_channels
    res = m.res(x) if getattr(m, "res", None) is not None else None
    lin = m.lin if getattr(m, "lin", None) is not None else m.lin_src
    z = lin(x).view(-1, heads, channels)
    a_src = (z * m.att_src).sum(-1)
    a_dst = (z * m.att_dst).sum(-1)
    both = g.gather_cols(torch.cat([z.reshape(z.shape[0], -1), a_src], 1), "gather Z, α_src")
    z_cols = both[:, : heads * channels].view(-1, heads, channels)
    a_src_cols = both[:, heads * channels :]
    a_dst_rows = g.gather_rows(a_dst, "gather α_dst")
    e = g.attention_edges()
    logits = attention.edge_logits(a_dst_rows, a_src_cols, e.rows, e.cols, m.negative_slope)
    out = _attend(m, g, z_cols, logits)
    if res is not None:
        out = out + res
    return out if m.bias is None else out + m.bias


def gat_conv(m, x, edge_index, edge_attr=None, size=None, return_attention_weights=None):  # noqa: D103
    _no_weights(edge_attr, m)
    return _gat(m, edge_index, x)


@_checkpointed
def _gatv2(m: pyg.GATv2Conv, g: Share, x: torch.Tensor) -> torch.Tensor:
    heads, channels = m.heads, m.out_channels
    res = m.res(x) if getattr(m, "res", None) is not None else None
    x_l = m.lin_l(x).view(-1, heads, channels)
    x_r = x_l if m.share_weights else m.lin_r(x).view(-1, heads, channels)
    l_cols = g.gather_cols(x_l.reshape(x_l.shape[0], -1), "gather X_l").view(-1, heads, channels)
    r_rows = g.gather_rows(x_r.reshape(x_r.shape[0], -1), "gather X_r")
    r_rows = r_rows.view(-1, heads, channels)
    e = g.attention_edges()
    # GATv2: the nonlinearity before the dot product with the attention vector
    z = F.leaky_relu(r_rows.index_select(0, e.rows) + l_cols.index_select(0, e.cols),
                     m.negative_slope)  # fmt: skip
    out = _attend(m, g, l_cols, (z * m.att).sum(-1))
    if res is not None:
        out = out + res
    return out if m.bias is None else out + m.bias


def gatv2_conv(m, x, edge_index, edge_attr=None, return_attention_weights=None):  # noqa: D103
    _no_weights(edge_attr, m)
    return _gatv2(m, edge_index, x)


@_checkpointed
def _gin(m: pyg.GINConv, g: Share, x: torch.Tensor) -> torch.Tensor:
    out = g.propagate("sum", x, "Σ neighbours (GINConv)") + (1 + m.eps) * x
    return m.nn(out)


def gin_conv(m, x, edge_index, size=None):  # noqa: D103
    return _gin(m, edge_index, x)


@_checkpointed
def _sgc(m: pyg.SGConv, g: Share, x: torch.Tensor) -> torch.Tensor:
    for k in range(m.K):
        x = g.propagate("gcn", x, f"Â·H step {k} (SGConv)")
    return m.lin(x)


def sg_conv(m, x, edge_index, edge_weight=None):  # noqa: D103
    _no_weights(edge_weight, m)
    return _sgc(m, edge_index, x)


@_checkpointed
def _appnp(m: pyg.APPNP, g: Share, x: torch.Tensor) -> torch.Tensor:
    h = x
    for k in range(m.K):
        x = g.propagate("gcn", x, f"Â·H step {k} (APPNP)")
        x = x * (1 - m.alpha)
        x = x + m.alpha * h
    return x


def appnp(m, x, edge_index, edge_weight=None):  # noqa: D103
    _no_weights(edge_weight, m)
    return _appnp(m, edge_index, x)


@_checkpointed
def _gcn2(m: pyg.GCN2Conv, g: Share, x: torch.Tensor, x_0: torch.Tensor) -> torch.Tensor:
    x = g.propagate("gcn", x, "Â·H (GCN2Conv)") * (1 - m.alpha)
    x_0 = m.alpha * x_0[: x.shape[0]]
    if m.weight2 is None:
        out = x + x_0
        return torch.addmm(out, out, m.weight1, beta=1.0 - m.beta, alpha=m.beta)
    out = torch.addmm(x, x, m.weight1, beta=1.0 - m.beta, alpha=m.beta)
    return out + torch.addmm(x_0, x_0, m.weight2, beta=1.0 - m.beta, alpha=m.beta)


def gcn2_conv(m, x, x_0, edge_index, edge_weight=None):  # noqa: D103
    _no_weights(edge_weight, m)
    return _gcn2(m, edge_index, x, x_0)


@_checkpointed
def _rgcn(m: pyg.RGCNConv, g: Share, x: torch.Tensor) -> torch.Tensor:
    # PyG's arithmetic: Σ_r mean_r(x)·W_r (W_r from the bases or block-diagonal), then the
    # root and the bias; the relations' partial sums leave the x group in one reduce-scatter
    weight = m.weight
    if m.num_bases is not None:
        weight = (m.comp @ weight.view(m.num_bases, -1)).view(
            m.num_relations, m.in_channels_l, m.out_channels
        )
    hc = g.gather_cols(x, "gather H for Σ_r Â_r·H·W_r (RGCNConv)")
    part = None
    for r, h in enumerate(g.relation_partials(hc, m.num_relations)):
        if m.num_blocks is not None:
            h = h.view(-1, weight.size(1), weight.size(2))
            h = torch.einsum("abc,bcd->abd", h, weight[r]).contiguous().view(-1, m.out_channels)
        else:
            h = h @ weight[r]
        part = h if part is None else part + h
    out = g.scatter_rows(part, "OUT = Σ_r Â_r·H·W_r (RGCNConv)")
    if m.root is not None:
        out = out + x @ m.root
    return out if m.bias is None else out + m.bias


@_checkpointed
def _rgat(m: pyg.RGATConv, g: Share, x: torch.Tensor) -> torch.Tensor:
    # PyG's default RGAT (additive self-attention across relations, no cardinality
    # modification): per edge j→i of relation r, z = x·W_r at both ends, logit
    # LeakyReLU(z_i·q + z_j·k), softmax over all of i's edges, Σ α·z_j, heads concatenated
    # or averaged, bias. Both ends' x are gathered once; each relation's z is local.
    heads, channels = m.heads, m.out_channels
    if m.num_bases is not None:
        weight = (m.att @ m.basis.view(m.num_bases, -1)).view(
            m.num_relations, m.in_channels, heads * channels
        )
    else:
        weight = m.weight
    hc = g.gather_cols(x, "gather H for its sources (RGATConv)")
    hx = g.gather_rows(x, "gather H for its destinations (RGATConv)")
    logits, values, rows = [], [], []
    for r, (row, col) in enumerate(g.relation_edges(m.num_relations)):
        zc, zx = hc @ weight[r], hx @ weight[r]
        logits.append(F.leaky_relu((zx @ m.q)[row] + (zc @ m.k)[col], m.negative_slope))
        values.append(zc[col])
        rows.append(row)
    row = torch.cat(rows)
    alpha = g.softmax(torch.cat(logits), row)
    alpha = F.dropout(alpha, p=m.dropout, training=m.training)
    msg = alpha.view(-1, heads, 1) * torch.cat(values).view(-1, heads, channels)
    part = msg.new_zeros(g.num_block_rows, heads * channels).index_add(0, row, msg.flatten(1))
    out = g.scatter_rows(part, "OUT = Σ α·x_j·W_r (RGATConv)").view(-1, heads, channels)
    out = out.reshape(out.shape[0], -1) if m.concat else out.mean(dim=1)
    return out if m.bias is None else out + m.bias


def rgat_conv(m, x, edge_index, edge_type=None, edge_attr=None, size=None,  # noqa: D103
              return_attention_weights=None):  # fmt: skip
    _no_weights(edge_attr, m)
    if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
        raise UserError("RGATConv: a parallelized model gives it node features (a float tensor)")
    return _rgat(m, edge_index, x)


def rgcn_conv(m, x, edge_index, edge_type=None):  # noqa: D103
    if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
        raise UserError(
            "RGCNConv: a parallelized model gives it node features (a float tensor), not node "
            "indices or a pair"
        )
    return _rgcn(m, edge_index, x)


# ----------------------------------------------------------------------------- norms
def batch_norm(m: nn.BatchNorm1d, x: torch.Tensor) -> torch.Tensor:
    """``BatchNorm1d`` over every node of the graph: the mean and the biased variance of
    each feature summed over the grid (two passes), the running statistics updated as
    torch does (unbiased variance, ``momentum`` or the cumulative average), and not again
    when activation checkpointing runs the layer a second time in backward."""
    share: Share | None = getattr(m, "_gnnpar_share", None)
    if share is None:  # not inside a parallel pass
        return type(m).forward(m, x)
    batch_stats = m.training or not m.track_running_stats
    if not batch_stats:
        return F.batch_norm(x, m.running_mean, m.running_var, m.weight, m.bias, False, 0.0, m.eps)
    n = share.num_nodes
    mean = share.node_sum(x.sum(0), "BatchNorm mean") / n
    centred = x - mean
    var = share.node_sum((centred * centred).sum(0), "BatchNorm variance") / n
    if m.training and m.track_running_stats and not in_backward():
        with torch.no_grad():
            m.num_batches_tracked.add_(1)
            factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else float(m.momentum)
            unbiased = var.detach() * (n / max(n - 1, 1))
            m.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
            m.running_var.mul_(1 - factor).add_(unbiased * factor)
    out = centred * torch.rsqrt(var + m.eps)
    if m.weight is not None:
        out = out * m.weight + m.bias
    return out


def graph_layer_norm(
    m: pyg.LayerNorm, x: torch.Tensor, batch=None, batch_size=None
) -> torch.Tensor:
    """PyG's ``LayerNorm(mode="graph")`` of the one graph: every entry shifted by the mean of
    all N × D entries and divided by their (biased) standard deviation plus ε."""
    if batch is not None:
        raise UserError("LayerNorm(mode='graph'): a parallelized model has one graph, no batch")
    share: Share | None = getattr(m, "_gnnpar_share", None)
    if share is None:
        return type(m).forward(m, x, batch, batch_size)
    count = share.num_nodes * x.shape[1]
    x = x - share.node_sum(x.sum().reshape(1), "LayerNorm mean") / count
    var = share.node_sum((x * x).sum().reshape(1), "LayerNorm variance") / count
    out = x / (var.sqrt() + m.eps)
    if m.weight is not None and m.bias is not None:
        out = out * m.weight + m.bias
    return out


def forwards() -> dict[type, Callable[..., torch.Tensor]]:
    """The parallel forward of each supported class that talks to the grid."""
    geo = pyg_nn()
    return {
        geo.GCNConv: _dispatch(gcn_conv),
        geo.SAGEConv: _dispatch(sage_conv),
        geo.GATConv: _dispatch(gat_conv),
        geo.GATv2Conv: _dispatch(gatv2_conv),
        geo.GINConv: _dispatch(gin_conv),
        geo.SGConv: _dispatch(sg_conv),
        geo.APPNP: _dispatch(appnp),
        geo.GCN2Conv: _dispatch(gcn2_conv, where=2),
        geo.RGCNConv: _dispatch(rgcn_conv),
        geo.RGATConv: _dispatch(rgat_conv),
        nn.BatchNorm1d: batch_norm,
    }


def operators_of(module: nn.Module) -> list[str]:
    """The adjacency values (:data:`~.share.OPERATORS`) ``module`` reads."""
    geo = pyg_nn()
    if isinstance(module, (geo.GCNConv, geo.SGConv, geo.APPNP, geo.GCN2Conv)):
        return ["gcn"]
    if isinstance(module, geo.SAGEConv):
        return ["mean"]
    if isinstance(module, geo.GINConv):
        return ["sum"]
    if isinstance(module, (geo.GATConv, geo.GATv2Conv)):
        return ["attention"]
    if isinstance(module, (geo.RGCNConv, geo.RGATConv)):
        return ["relations"]
    return []


def unused_parameters(module: nn.Module) -> tuple[str, ...]:
    """Parameters of ``module`` its forward never reads, so never given a gradient (their
    sum over the grid is not in the schedule): RGATConv's cardinality terms without
    ``mod``."""
    if isinstance(module, pyg_nn().RGATConv) and module.mod is None:
        return ("w", "l1", "b1", "l2", "b2")
    return ()


def refusal(module: nn.Module) -> str | None:
    """Why ``module``'s options cannot run parallelized (the option, in words), or None."""
    geo = pyg_nn()
    cls = type(module).__name__
    gcn_like = (geo.GCNConv, geo.SGConv, geo.APPNP, geo.GCN2Conv)
    if isinstance(module, gcn_like):
        if getattr(module, "improved", False):
            return f"{cls}(improved=True) weighs the self loops 2"
        if not getattr(module, "add_self_loops", True) or not getattr(module, "normalize", True):
            return f"{cls} without add_self_loops or normalize (the GCN normalisation is built in)"
    if isinstance(module, geo.APPNP) and module.dropout > 0:
        return f"APPNP(dropout={module.dropout}) drops edges of the adjacency"
    if isinstance(module, geo.SAGEConv) and str(module.aggr) not in ("mean", "max"):
        return f"SAGEConv(aggr={module.aggr!r}): mean and max are supported"
    if isinstance(module, (geo.GATConv, geo.GATv2Conv)):
        if getattr(module, "edge_dim", None) is not None:
            return f"{cls}(edge_dim=...) reads edge features"
        if not module.add_self_loops:
            return f"{cls}(add_self_loops=False)"
    if isinstance(module, geo.RGCNConv) and str(module.aggr) != "mean":
        return f"RGCNConv(aggr={module.aggr!r}): mean is supported (each relation's Â_r)"
    if isinstance(module, geo.RGATConv):
        if module.mod is not None:
            return f"RGATConv(mod={module.mod!r}) (cardinality preservation)"
        if module.attention_mechanism != "across-relation":
            return f"RGATConv(attention_mechanism={module.attention_mechanism!r})"
        if module.attention_mode != "additive-self-attention":
            return f"RGATConv(attention_mode={module.attention_mode!r})"
        if module.num_blocks is not None or module.edge_dim is not None:
            return "RGATConv with num_blocks or edge_dim"
    if isinstance(module, geo.LayerNorm) and module.mode not in ("graph", "node"):
        return f"LayerNorm(mode={module.mode!r})"
    return None
