"""Plain PyG models, as a user writes them, for ``gnnpar train gcn --model FILE:FACTORY``.

Each factory takes the dataset's ``in_channels`` and ``out_channels`` (gnnpar passes them)
and its own hyper-parameters (``--model-options k=v,k=v``), and returns an ``nn.Module``
whose ``forward(x, edge_index)`` gives the logits (``forward(x, edge_index, edge_type)``
for a typed graph's R-GCN and RGAT). Nothing here knows about gnnpar.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn
from torch_geometric import nn as gnn


class TwoLayer(nn.Module):
    """conv → ReLU → dropout → conv, of any one convolution class (``make(i, o)``)."""

    def __init__(self, make, in_channels: int, hidden: int, out_channels: int, dropout=0.5):
        super().__init__()
        self.conv1, self.conv2 = make(in_channels, hidden), make(hidden, out_channels)
        self.dropout = dropout

    def forward(self, x, edge_index):  # noqa: D102
        x = F.dropout(x, self.dropout, self.training)
        x = F.relu(self.conv1(x, edge_index))
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, edge_index)


def gcn(in_channels: int, out_channels: int, hidden: int = 16, dropout: float = 0.5):
    """Kipf & Welling's GCN."""
    return TwoLayer(gnn.GCNConv, in_channels, hidden, out_channels, dropout)


def sage(in_channels: int, out_channels: int, hidden: int = 16, aggr: str = "mean",
         dropout: float = 0.5):  # fmt: skip
    """GraphSAGE with mean or max aggregation."""
    return TwoLayer(lambda i, o: gnn.SAGEConv(i, o, aggr=aggr), in_channels, hidden,
                    out_channels, dropout)  # fmt: skip


def gat(in_channels: int, out_channels: int, hidden: int = 8, heads: int = 8,
        dropout: float = 0.6):  # fmt: skip
    """GAT: ``heads`` concatenated heads, one averaged output head."""

    def make(i, o):
        last = o == out_channels
        return gnn.GATConv(i if i == in_channels else i * heads, o, heads=1 if last else heads,
                           concat=not last, dropout=dropout)  # fmt: skip

    return TwoLayer(make, in_channels, hidden, out_channels, dropout)


class GATv2Residual(nn.Module):
    """GATv2 layers with residual connections and LayerNorm after each hidden layer."""

    def __init__(self, in_channels, out_channels, hidden=16, heads=2, layers=3, dropout=0.5):
        super().__init__()
        self.inp = nn.Linear(in_channels, hidden)
        self.convs = nn.ModuleList(
            gnn.GATv2Conv(hidden, hidden // heads, heads=heads) for _ in range(layers)
        )
        self.norms = nn.ModuleList(gnn.LayerNorm(hidden) for _ in range(layers))
        self.out = nn.Linear(hidden, out_channels)
        self.dropout = dropout

    def forward(self, x, edge_index):  # noqa: D102
        h = self.inp(F.dropout(x, self.dropout, self.training))
        for conv, norm in zip(self.convs, self.norms, strict=True):
            h = h + F.elu(norm(conv(h, edge_index)))
            h = F.dropout(h, self.dropout, self.training)
        return self.out(h)


def gatv2_residual(in_channels: int, out_channels: int, **options):
    """:class:`GATv2Residual`."""
    return GATv2Residual(in_channels, out_channels, **options)


class APPNPNet(nn.Module):
    """APPNP (Gasteiger et al.): an MLP, then K steps of personalised PageRank."""

    def __init__(self, in_channels, out_channels, hidden=64, K=10, alpha=0.1, dropout=0.5):  # noqa: N803
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(in_channels, hidden), nn.Linear(hidden, out_channels)
        self.prop = gnn.APPNP(K, alpha)
        self.dropout = dropout

    def forward(self, x, edge_index):  # noqa: D102
        x = F.dropout(x, self.dropout, self.training)
        x = F.relu(self.lin1(x))
        x = F.dropout(x, self.dropout, self.training)
        return self.prop(self.lin2(x), edge_index)


def appnp(in_channels: int, out_channels: int, **options):
    """:class:`APPNPNet`."""
    return APPNPNet(in_channels, out_channels, **options)


class GCNII(nn.Module):
    """GCNII (Chen et al.): initial residual and identity mapping, ``layers`` deep."""

    def __init__(self, in_channels, out_channels, hidden=64, layers=64, alpha=0.1, theta=0.5,
                 dropout=0.6):  # fmt: skip
        super().__init__()
        self.lins = nn.ModuleList([nn.Linear(in_channels, hidden), nn.Linear(hidden, out_channels)])
        self.convs = nn.ModuleList(
            gnn.GCN2Conv(hidden, alpha, theta, layer + 1, shared_weights=True)
            for layer in range(layers)
        )
        self.dropout = dropout

    def forward(self, x, edge_index):  # noqa: D102
        x = F.dropout(x, self.dropout, self.training)
        x = x_0 = F.relu(self.lins[0](x))
        for conv in self.convs:
            x = F.dropout(x, self.dropout, self.training)
            x = F.relu(conv(x, x_0, edge_index))
        x = F.dropout(x, self.dropout, self.training)
        return self.lins[1](x)


def gcnii(in_channels: int, out_channels: int, **options):
    """:class:`GCNII`."""
    return GCNII(in_channels, out_channels, **options)


class GINJK(nn.Module):
    """GIN layers (MLPs with BatchNorm) and jumping knowledge over every layer."""

    def __init__(self, in_channels, out_channels, hidden=16, layers=3, mode="cat", dropout=0.5):
        super().__init__()
        dims = [in_channels] + [hidden] * layers
        self.convs = nn.ModuleList(
            gnn.GINConv(nn.Sequential(nn.Linear(dims[i], hidden), nn.BatchNorm1d(hidden),
                                      nn.ReLU(), nn.Linear(hidden, hidden)), train_eps=True)
            for i in range(layers)
        )  # fmt: skip
        self.jk = gnn.JumpingKnowledge(mode)
        width = hidden * layers if mode == "cat" else hidden
        self.out = nn.Linear(width, out_channels)
        self.dropout = dropout

    def forward(self, x, edge_index):  # noqa: D102
        xs = []
        for conv in self.convs:
            x = F.relu(conv(x, edge_index))
            xs.append(F.dropout(x, self.dropout, self.training))
        return self.out(self.jk(xs))


def gin_jk(in_channels: int, out_channels: int, **options):
    """:class:`GINJK`."""
    return GINJK(in_channels, out_channels, **options)


def sgc(in_channels: int, out_channels: int, K: int = 2):  # noqa: N803
    """SGC (Wu et al.): K propagation steps, then one linear layer."""

    class SGC(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = gnn.SGConv(in_channels, out_channels, K=K)

        def forward(self, x, edge_index):
            return self.conv(x, edge_index)

    return SGC()


class RGCN(nn.Module):
    """R-GCN (Schlichtkrull et al.) on a typed graph: ``layers`` RGCNConv layers (mean per
    relation, a root weight), ReLU and dropout between; ``forward(x, edge_index,
    edge_type)``. ``num_bases`` shares the relations' weights through that many bases."""

    def __init__(self, in_channels, out_channels, num_relations, hidden=16, layers=2,
                 num_bases=None, dropout=0.5):  # fmt: skip
        super().__init__()
        dims = [in_channels] + [hidden] * (layers - 1) + [out_channels]
        self.convs = nn.ModuleList(
            gnn.RGCNConv(i, o, num_relations, num_bases=num_bases)
            for i, o in zip(dims[:-1], dims[1:], strict=True)
        )
        self.dropout = dropout

    def forward(self, x, edge_index, edge_type):  # noqa: D102
        for i, conv in enumerate(self.convs):
            x = F.dropout(x, self.dropout, self.training)
            x = conv(x, edge_index, edge_type)
            x = F.relu(x) if i < len(self.convs) - 1 else x
        return x


def rgcn(in_channels: int, out_channels: int, num_relations: int, **options):
    """R-GCN on a typed graph (the trainer passes the graph's ``num_relations``)."""
    return RGCN(in_channels, out_channels, num_relations, **options)


class RGAT(nn.Module):
    """Relational graph attention (Busbridge et al.) on a typed graph: RGATConv layers
    (``heads`` concatenated heads, the last averaged), ELU between; ``forward(x, edge_index,
    edge_type)``."""

    def __init__(self, in_channels, out_channels, num_relations, hidden=8, heads=2,
                 num_bases=None, dropout=0.5):  # fmt: skip
        super().__init__()
        self.conv1 = gnn.RGATConv(in_channels, hidden, num_relations, heads=heads,
                                  num_bases=num_bases)  # fmt: skip
        self.conv2 = gnn.RGATConv(hidden * heads, out_channels, num_relations, heads=heads,
                                  concat=False, num_bases=num_bases)  # fmt: skip
        self.dropout = dropout

    def forward(self, x, edge_index, edge_type):  # noqa: D102
        x = F.dropout(x, self.dropout, self.training)
        x = F.elu(self.conv1(x, edge_index, edge_type))
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, edge_index, edge_type)


def rgat(in_channels: int, out_channels: int, num_relations: int, **options):
    """RGAT on a typed graph (the trainer passes the graph's ``num_relations``)."""
    return RGAT(in_channels, out_channels, num_relations, **options)
