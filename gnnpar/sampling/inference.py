"""Layer-wise full-neighbour inference: exact outputs for every node, one layer at a time.

Sampling is for training. For evaluation, computing layer ``l`` for *all* nodes from the
layer ``l - 1`` outputs of all nodes costs one full-graph pass per layer, instead of the
exponentially growing neighbourhoods of per-seed sampling, and gives the exact (unsampled)
outputs. Destinations are processed in chunks of ``batch_size`` to bound memory.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gnnpar.errors import UserError
from gnnpar.graph import Graph
from gnnpar.sampling.block import Block
from gnnpar.sampling.neighbor import NeighborSampler

__all__ = ["BlockModel", "full_blocks", "layerwise_inference"]


class BlockModel(Protocol):
    """A model that can be run one layer at a time on blocks."""

    num_layers: int

    def forward_layer(self, i: int, block: Block, h_src: torch.Tensor) -> torch.Tensor:
        """Layer ``i`` (with its activation) for the block's destinations."""


def full_blocks(
    graph: Graph | tuple[torch.Tensor, torch.Tensor], batch_size: int | None = None
) -> list[Block]:
    """Full-neighbour blocks whose destinations are all nodes, in chunks of ``batch_size``
    (default: one block); a typed graph's carry its relations and node types."""
    # every in-edge, in CSR order: drawing per relation would take the same edges
    sampler = NeighborSampler(graph, [-1], per_relation=False)
    n = sampler.num_nodes
    if batch_size is not None and batch_size < 1:
        raise UserError(f"batch_size must be >= 1, got {batch_size}")
    nodes = torch.arange(n, dtype=torch.int64)
    chunks = [nodes] if batch_size is None or n == 0 else list(torch.split(nodes, batch_size))
    return [sampler.sample(chunk).blocks[0] for chunk in chunks]


@torch.no_grad()
def layerwise_inference(
    model: BlockModel,
    graph: Graph | tuple[torch.Tensor, torch.Tensor],
    features: torch.Tensor | None = None,
    batch_size: int | None = None,
    blocks: list[Block] | None = None,
) -> torch.Tensor:
    """Outputs of ``model`` for every node of ``graph`` with all neighbours, layer by layer.

    Args:
        model: has ``num_layers`` and ``forward_layer(i, block, h_src)``.
        graph: the graph (its ``feat`` is used when ``features`` is None).
        features: ``(N, F)`` input features.
        batch_size: destinations per block (default: all nodes in one block).
        blocks: precomputed :func:`full_blocks` (reused across evaluations).

    The model is put in eval mode for the call and restored after.
    """
    if features is None:
        features = graph.feat if isinstance(graph, Graph) else None
        if features is None:
            raise UserError("no features: pass features= or a graph with ndata['feat']")
    if blocks is None:
        blocks = full_blocks(graph, batch_size)
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        h = features
        for i in range(model.num_layers):
            outs = [model.forward_layer(i, b, h.index_select(0, b.src_nodes)) for b in blocks]
            h = torch.cat(outs) if outs else h[:0]
        return h
    finally:
        if was_training:
            model.train()
