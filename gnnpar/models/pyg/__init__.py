"""A user's own PyG model on gnnpar's engines: what it may hold (:mod:`.model`) and the
parallel forward of each supported layer on a graph share (:mod:`.layers`). The workloads
put it to use: full-graph on the grid (:func:`gnnpar.models.fullgraph.pyg.parallelize_pyg`),
mini-batch on sampled subgraphs (:mod:`gnnpar.models.minibatch.pyg`)."""

from gnnpar.models.pyg.model import SUPPORTED, build_user_model, check_model

__all__ = ["SUPPORTED", "build_user_model", "check_model"]
