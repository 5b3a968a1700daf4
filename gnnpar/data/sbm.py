"""Stochastic block model with class-correlated features: a learnable synthetic benchmark."""

from __future__ import annotations

import numpy as np
import torch

from gnnpar.data.splits import per_class_split
from gnnpar.errors import UserError
from gnnpar.graph import Graph

__all__ = ["sbm"]


def sbm(
    num_nodes: int = 2000,
    num_classes: int = 4,
    feat_dim: int = 32,
    avg_degree: float = 10.0,
    p_ratio: float = 8.0,
    feature_noise: float = 4.0,
    train_per_class: int = 20,
    num_val: int = 500,
    num_test: int = 1000,
    seed: int = 0,
) -> Graph:
    """An undirected planted-partition graph with noisy class-mean features.

    Classes are balanced and assigned at random. ``num_nodes * avg_degree / 2`` node pairs
    are drawn independently: each is inside one class with probability
    ``p_ratio / (p_ratio + num_classes - 1)``, which gives intra- and inter-class edge
    probabilities in the ratio ``p_ratio`` as in an SBM; duplicates and self loops are then
    dropped. Sampling is vectorised (O(E), never O(N^2)), so a million nodes take seconds.

    Features are ``mean[class] + feature_noise * N(0, I)`` with class means drawn from
    ``N(0, I)``: features alone classify poorly, neighbourhood averaging (a GCN) does well.
    The split is Planetoid-style (``train_per_class`` per class, ``num_val``, ``num_test``,
    scaled down for small graphs). Everything is determined by ``seed``.
    """
    if num_nodes < 1 or num_classes < 1 or num_classes > num_nodes:
        raise UserError(
            f"need 1 <= num_classes <= num_nodes, got num_classes={num_classes}, "
            f"num_nodes={num_nodes}"
        )
    if avg_degree < 0 or p_ratio <= 0 or feature_noise < 0 or feat_dim < 1:
        raise UserError(
            "avg_degree and feature_noise must be >= 0, p_ratio > 0 and feat_dim >= 1, got "
            f"avg_degree={avg_degree}, p_ratio={p_ratio}, feature_noise={feature_noise}, "
            f"feat_dim={feat_dim}"
        )
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(num_nodes) % num_classes)
    # Nodes sorted by class, so a uniform node of class c is by_class[start[c] + r * count[c]].
    by_class = np.argsort(labels, kind="stable")
    count = np.bincount(labels, minlength=num_classes)
    start = np.concatenate([[0], np.cumsum(count)[:-1]])

    m = int(round(num_nodes * avg_degree / 2))
    src = rng.integers(0, num_nodes, size=m)
    src_class = labels[src]
    p_in = p_ratio / (p_ratio + num_classes - 1)
    inside = rng.random(m) < p_in
    # Another class, uniformly: shift by 1..k-1 (k = 1 keeps everything inside).
    shift = rng.integers(1, max(num_classes, 2), size=m) % num_classes
    dst_class = np.where(inside, src_class, (src_class + shift) % num_classes)
    offset = (rng.random(m) * count[dst_class]).astype(np.int64)
    dst = by_class[start[dst_class] + offset]

    means = rng.standard_normal((num_classes, feat_dim), dtype=np.float32)
    noise = rng.standard_normal((num_nodes, feat_dim), dtype=np.float32)
    feat = means[labels] + np.float32(feature_noise) * noise

    label_t = torch.from_numpy(labels.astype(np.int64))
    ndata = {
        "feat": torch.from_numpy(feat),
        "label": label_t,
        **per_class_split(label_t, num_classes, train_per_class, num_val, num_test, seed),
    }
    keep = src != dst
    src, dst = src[keep], dst[keep]
    both_src = torch.from_numpy(np.concatenate([src, dst]))
    both_dst = torch.from_numpy(np.concatenate([dst, src]))
    graph = Graph.from_edges(both_src, both_dst, num_nodes, ndata=ndata, name="sbm", coalesce=True)
    graph.num_classes = num_classes
    return graph
