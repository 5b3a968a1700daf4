"""Zachary's karate club (from networkx): 34 nodes, 2 classes from the ``club`` attribute."""

from __future__ import annotations

import numpy as np
import torch

from gnnpar.data.splits import per_class_split
from gnnpar.errors import UserError
from gnnpar.graph import Graph

__all__ = ["karate"]


def karate(features: str = "identity", feat_dim: int = 16, seed: int = 0) -> Graph:
    """The karate club graph, undirected and unweighted.

    Labels: 0 for ``Mr. Hi``'s club, 1 for the ``Officer``'s. Features: the identity matrix
    (``features="identity"``) or ``feat_dim`` standard-normal columns (``"random"``). Split:
    2 training nodes per class, 10 validation, 20 test, drawn with ``seed``.
    """
    import networkx as nx  # imported here: only this dataset needs it

    g = nx.karate_club_graph()
    labels = torch.tensor(
        [0 if g.nodes[v]["club"] == "Mr. Hi" else 1 for v in g.nodes], dtype=torch.int64
    )
    n = labels.numel()
    if features == "identity":
        feat = torch.eye(n, dtype=torch.float32)
    elif features == "random":
        rng = np.random.default_rng(seed)
        feat = torch.from_numpy(rng.standard_normal((n, feat_dim), dtype=np.float32))
    else:
        raise UserError(f"features must be 'identity' or 'random', got {features!r}")
    ndata = {"feat": feat, "label": labels, **per_class_split(labels, 2, seed=seed)}
    graph = Graph.from_networkx(g, weight_key=None, ndata=ndata, name="karate").coalesce()
    graph.num_classes = 2
    return graph
