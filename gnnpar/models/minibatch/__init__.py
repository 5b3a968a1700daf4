"""The mini-batch GNN workload (``gnnpar train sage``): models on message-flow blocks
(:mod:`.model`) and the task over sampled, distributed or local, mini-batches (:mod:`.task`)."""

from gnnpar.models.minibatch.model import BlockGNN, GATConv, GCNConv, SAGEConv

__all__ = ["BlockGNN", "GATConv", "GCNConv", "SAGEConv"]
