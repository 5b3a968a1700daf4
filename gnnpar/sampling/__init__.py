"""Mini-batch GNN training data: neighbour sampling, message-flow blocks, a prefetching
loader, layer-wise inference, and distributed sampling and feature fetching over partitions.

Quick start::

    from gnnpar.sampling import NeighborSampler, NodeLoader, layerwise_inference
    from gnnpar.models.minibatch.model import BlockGNN

    sampler = NeighborSampler(graph, fanouts=[15, 10])          # hop order: seeds first
    loader = NodeLoader(sampler, graph.train_mask, batch_size=1024,
                        features=graph.feat, labels=graph.label)
    model = BlockGNN(graph.feat.shape[1], 256, graph.num_classes, num_layers=2)
    for epoch in range(10):
        for batch in loader:                                    # prefetched in a thread
            loss = F.cross_entropy(model(batch.blocks, batch.x), batch.y)
            ...
    logits = layerwise_inference(model, graph)                  # exact, every node

Modules: :mod:`~gnnpar.sampling.rng` (counter-based random numbers),
:mod:`~gnnpar.sampling.block` (``Block``, ``MiniBatch``), :mod:`~gnnpar.sampling.neighbor`
(``NeighborSampler``), :mod:`~gnnpar.sampling.vertex` (ScaleGNN's ``VertexSampler``),
:mod:`~gnnpar.sampling.saint` (GraphSAINT's ``SaintNodeSampler``, ``SaintEdgeSampler``,
``SaintWalkSampler``), :mod:`~gnnpar.sampling.cluster` (ClusterGCN's ``ClusterSampler``),
:mod:`~gnnpar.sampling.loader` (``NodeLoader``, ``SubgraphLoader``),
:mod:`~gnnpar.sampling.inference`
(``layerwise_inference``), :mod:`~gnnpar.sampling.distributed` (``LocalPart``,
``DistNeighborSampler``, ``FeatureFetcher``, ``distributed_inference``),
:mod:`~gnnpar.sampling.negative` (link prediction's ``NegativeSampler``, ``per_source``,
``load_candidates``).
"""

from gnnpar.sampling.block import Block, MiniBatch
from gnnpar.sampling.cluster import ClusterSampler
from gnnpar.sampling.distributed import (
    DistNeighborSampler,
    FeatureFetcher,
    LocalPart,
    distributed_inference,
    request_rows,
)
from gnnpar.sampling.inference import BlockModel, full_blocks, layerwise_inference
from gnnpar.sampling.loader import NodeLoader, Sampler, SubgraphLoader, batch_sizes
from gnnpar.sampling.negative import NegativeSampler, load_candidates, per_source
from gnnpar.sampling.neighbor import (
    NeighborSampler,
    Relabeler,
    as_node_ids,
    parse_fanouts,
    sample_rows,
)
from gnnpar.sampling.rng import derive_key, random_bits, uniform_below
from gnnpar.sampling.saint import (
    SaintEdgeSampler,
    SaintNodeSampler,
    SaintSampler,
    SaintWalkSampler,
)
from gnnpar.sampling.vertex import VertexSampler, induced_block, uniform_subset

__all__ = [
    "Block",
    "BlockModel",
    "ClusterSampler",
    "DistNeighborSampler",
    "FeatureFetcher",
    "LocalPart",
    "MiniBatch",
    "NegativeSampler",
    "NeighborSampler",
    "NodeLoader",
    "Relabeler",
    "SaintEdgeSampler",
    "SaintNodeSampler",
    "SaintSampler",
    "SaintWalkSampler",
    "Sampler",
    "SubgraphLoader",
    "VertexSampler",
    "as_node_ids",
    "batch_sizes",
    "derive_key",
    "distributed_inference",
    "full_blocks",
    "induced_block",
    "layerwise_inference",
    "load_candidates",
    "parse_fanouts",
    "per_source",
    "random_bits",
    "request_rows",
    "sample_rows",
    "uniform_below",
    "uniform_subset",
]
