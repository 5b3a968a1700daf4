"""ClusterGCN batches (Chiang et al., KDD 2019): several random partition parts per batch.

The graph is cut once into ``num_clusters`` parts by :func:`partitioners.partition`
(METIS by default). Every epoch orders the parts by a counter-based hash of ``(seed,
epoch)`` and cuts that order into groups of ``clusters_per_batch``; a batch is the subgraph
induced by its group's nodes, so the edges *between* its chosen clusters are restored
(ClusterGCN's stochastic multiple partitions). Its loss is the mean over the batch's
training nodes; aggregation is the subgraph's own mean (the paper's, no re-weighting).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gnnpar.errors import UserError
from gnnpar.graph import Graph
from gnnpar.sampling.block import MiniBatch
from gnnpar.sampling.rng import derive_key, random_bits
from gnnpar.sampling.saint import graph_csr, graph_weight, subgraph_batch, train_mask_of

__all__ = ["ClusterSampler"]

_ORDER = 0xC1A5  # salt of the per-epoch order of the clusters


class ClusterSampler:
    """ClusterGCN mini-batches of ``clusters_per_batch`` random parts.

    Args:
        graph: a :class:`~gnnpar.graph.Graph` or ``(indptr, indices)``.
        num_layers: blocks per mini-batch (the same induced block for every layer).
        num_clusters: parts of the partition.
        clusters_per_batch: parts per batch.
        train_mask: the nodes whose loss counts (default: the graph's ``train_mask``).
        seed: the seed of the partition and of the order of the parts.
        method: the :mod:`partitioners` method (``"metis"``).
        owner: a given part of every node, instead of partitioning.
    """

    def __init__(
        self,
        graph: Graph | tuple[torch.Tensor, torch.Tensor],
        num_layers: int,
        num_clusters: int,
        clusters_per_batch: int,
        *,
        train_mask: Any = None,
        seed: int = 0,
        method: str = "metis",
        owner: Any = None,
    ):
        self.indptr, self.indices = graph_csr(graph)
        self.weight = graph_weight(graph)  # a weighted graph's: the blocks record them
        self.num_nodes = self.indptr.numel() - 1
        for name, value in (
            ("num_layers", num_layers),
            ("num_clusters", num_clusters),
            ("clusters_per_batch", clusters_per_batch),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be an integer >= 1, got {value!r}")
        if num_clusters > self.num_nodes:
            raise UserError(f"num_clusters {num_clusters} exceeds the {self.num_nodes} nodes")
        if clusters_per_batch > num_clusters:
            raise UserError(
                f"clusters_per_batch {clusters_per_batch} exceeds num_clusters {num_clusters}"
            )
        self.num_layers, self.seed = num_layers, int(seed)
        self.num_clusters, self.clusters_per_batch = num_clusters, clusters_per_batch
        self.train_mask = train_mask_of(graph, train_mask, self.num_nodes)
        if owner is None:
            import partitioners

            cut = partitioners.partition(
                (self.indptr, self.indices), num_clusters, method=method, seed=self.seed
            )
            owner = cut.owner
        self.owner = torch.as_tensor(owner, dtype=torch.int64)
        if self.owner.shape != (self.num_nodes,):
            raise UserError(f"owner must have shape ({self.num_nodes},), got {self.owner.shape}")
        if int(self.owner.min()) < 0 or int(self.owner.max()) >= num_clusters:
            raise UserError(f"owner must hold part ids in [0, {num_clusters})")
        # Every part's nodes in id order, so a batch gathers its parts' nodes by slicing
        # (its own size) instead of testing every node of the graph.
        self._part_nodes = torch.argsort(self.owner, stable=True)
        self._part_ptr = torch.zeros(num_clusters + 1, dtype=torch.int64)
        torch.cumsum(torch.bincount(self.owner, minlength=num_clusters), 0, out=self._part_ptr[1:])
        self._order: tuple[tuple[int, int], torch.Tensor] | None = None  # the last pass's order

    @property
    def batches_per_epoch(self) -> int:
        """Groups of ``clusters_per_batch`` in one pass over the parts."""
        return math.ceil(self.num_clusters / self.clusters_per_batch)

    def clusters(self, epoch: int, index: int) -> torch.Tensor:
        """The parts of batch ``index`` of ``epoch`` (indices past one pass over the parts
        continue with further orders)."""
        rounds, j = divmod(int(index), self.batches_per_epoch)
        cached = self._order  # one read: a prefetch thread may replace it meanwhile
        if cached is None or cached[0] != (epoch, rounds):
            parts = torch.arange(self.num_clusters, dtype=torch.int64)
            bits = random_bits(derive_key(self.seed, _ORDER, epoch, rounds), parts, 2)
            cached = ((epoch, rounds), torch.argsort((bits[0] << 31) | (bits[1] >> 1)))
            self._order = cached
        order = cached[1]
        q = self.clusters_per_batch
        return torch.sort(order[j * q : (j + 1) * q]).values

    def batch(self, epoch: int, index: int) -> MiniBatch:
        """Batch ``index`` of ``epoch``: the subgraph induced by its parts' nodes."""
        chosen = self.clusters(epoch, index)
        ptr = self._part_ptr
        pieces = [self._part_nodes[ptr[c] : ptr[c + 1]] for c in chosen.tolist()]
        nodes = torch.sort(torch.cat(pieces)).values
        train = self.train_mask.index_select(0, nodes)
        seed_weight = torch.zeros(self.num_nodes, dtype=torch.float64)
        seed_weight[nodes[train]] = 1.0 / max(int(train.sum()), 1)  # mean over training nodes
        return subgraph_batch(
            self.indptr, self.indices, nodes, self.num_layers, seed_weight, weight=self.weight
        )

    def __repr__(self) -> str:
        return (
            f"ClusterSampler(num_nodes={self.num_nodes}, num_clusters={self.num_clusters}, "
            f"clusters_per_batch={self.clusters_per_batch})"
        )
