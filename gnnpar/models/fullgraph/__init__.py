"""The full-graph GNN workload (``gnnpar train gcn``): plain models (:mod:`.model`), their
parallel form on 1D / 2D / 3D grids (:mod:`.parallelize`, with the layers of :mod:`.plexus`,
:mod:`.cagnet` and :mod:`.gat`, their :mod:`.layout` and :mod:`.schedule`), R-GCN's
per-relation operators (:mod:`.relations`), the sharded losses (:mod:`.loss`), the on-disk
shards (:mod:`.shards`) and the task (:mod:`.task`)."""

from gnnpar.models.fullgraph.layout import Layout3D, layout3d, roles
from gnnpar.models.fullgraph.model import GAT, GCN, GIN, RGCN, FullGraphGNN, GraphSAGE
from gnnpar.models.fullgraph.parallelize import Parallel3DGNN, parallelize_fullgraph

__all__ = [
    "GAT",
    "GCN",
    "GIN",
    "FullGraphGNN",
    "GraphSAGE",
    "Layout3D",
    "Parallel3DGNN",
    "RGCN",
    "layout3d",
    "parallelize_fullgraph",
    "roles",
]
