"""Plain full-graph GNN models: GCN and GraphSAGE (mean), serial and readable.

They take the (normalised) adjacency as a :class:`~gnnpar.sparse.kernels.LocalSpMM` over the
whole graph; parallelism is applied from outside by :func:`gnnpar.sparse.parallelize_fullgraph`,
which reads these modules' parameters. Nothing here imports torch.distributed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gnnpar.nn.dropout import index_dropout
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

    def stacked_weight_grad(self) -> torch.Tensor | None:
        """Gradient of :meth:`stacked_weight`."""
        if self.weight_neigh.grad is None or self.weight_root.grad is None:
            return None
        return torch.cat([self.weight_neigh.grad, self.weight_root.grad], dim=0)

    def forward(self, adj: LocalSpMM, h: torch.Tensor) -> torch.Tensor:  # noqa: D102
        out = spmm(adj, h) @ self.weight_neigh + h @ self.weight_root
        return out if self.bias is None else out + self.bias


class FullGraphGNN(nn.Module):
    """A stack of GCN or SAGE layers with ReLU and index-seeded dropout between them."""

    def __init__(
        self,
        in_dim: int,
        hidden: int,
        out_dim: int,
        num_layers: int = 2,
        dropout: float = 0.5,
        kind: str = "gcn",
        bias: bool = True,
    ):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {num_layers}")
        layer_cls = {"gcn": GCNLayer, "sage": SAGELayer}.get(kind)
        if layer_cls is None:
            raise ValueError(f"unknown full-graph model {kind!r}; use 'gcn' or 'sage'")
        dims = [in_dim] + [hidden] * (num_layers - 1) + [out_dim]
        self.kind = kind
        self.dropout = dropout
        self.layers = nn.ModuleList(
            layer_cls(dims[i], dims[i + 1], bias) for i in range(num_layers)
        )

    @property
    def dims(self) -> list[int]:
        """Feature widths from input to output."""
        return [self.layers[0].stacked_weight().shape[0] // self.layers[0].num_ops] + [
            layer.stacked_weight().shape[1] for layer in self.layers
        ]

    def forward(
        self, adj: LocalSpMM, x: torch.Tensor, dropout_seed: int | None = None
    ) -> torch.Tensor:
        """Logits for every node. ``dropout_seed`` (e.g. derived from the epoch) turns
        dropout on; the same seed draws the same masks on any grid."""
        rows = torch.arange(x.shape[0])
        h = x
        for i, layer in enumerate(self.layers):
            seed = None if dropout_seed is None else dropout_seed * 1009 + i
            h = index_dropout(h, self.dropout, seed, rows, 0, self.training)
            h = layer(adj, h)
            if i < len(self.layers) - 1:
                h = torch.relu(h)
        return h


def GCN(in_dim: int, hidden: int, out_dim: int, num_layers: int = 2, dropout: float = 0.5):  # noqa: N802
    """A Kipf & Welling GCN (use with the GCN-normalised adjacency)."""
    return FullGraphGNN(in_dim, hidden, out_dim, num_layers, dropout, kind="gcn")


def GraphSAGE(  # noqa: N802
    in_dim: int, hidden: int, out_dim: int, num_layers: int = 2, dropout: float = 0.5
):
    """Full-graph GraphSAGE-mean (use with the row-normalised adjacency)."""
    return FullGraphGNN(in_dim, hidden, out_dim, num_layers, dropout, kind="sage")
