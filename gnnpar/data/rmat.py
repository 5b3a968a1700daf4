"""Graph500 R-MAT (Kronecker) graphs with random features and labels, for scaling runs."""

from __future__ import annotations

import numpy as np
import torch

from gnnpar.data.splits import random_split
from gnnpar.graph import Graph

__all__ = ["rmat"]


def rmat(
    scale: int = 16,
    edge_factor: int = 16,
    a: float = 0.57,
    b: float = 0.19,
    c: float = 0.19,
    feat_dim: int = 128,
    num_classes: int = 16,
    train_frac: float = 0.6,
    val_frac: float = 0.2,
    seed: int = 0,
) -> Graph:
    """An undirected R-MAT graph on ``2**scale`` nodes from ``edge_factor * 2**scale`` draws.

    Each edge picks one quadrant of the adjacency per recursion level with probabilities
    ``a, b, c, d = 1 - a - b - c`` (rows = sources); all edges are drawn at once per level.
    As in Graph500, node ids are then scrambled by a random permutation. Duplicate edges and
    self loops are removed and the graph is made undirected, so it has fewer than
    ``2 * edge_factor * 2**scale`` edges. Features are standard normal and labels uniform
    in ``[0, num_classes)``: not learnable, meant for throughput and scaling measurements.
    Deterministic by ``seed``.
    """
    d = 1.0 - a - b - c
    if min(a, b, c, d) < 0:
        raise ValueError(f"a, b, c must be >= 0 with a + b + c <= 1, got a={a}, b={b}, c={c}")
    if not 1 <= scale <= 40 or edge_factor < 0:
        raise ValueError(f"need 1 <= scale <= 40 and edge_factor >= 0, got {scale}, {edge_factor}")
    if feat_dim < 1 or num_classes < 1:
        raise ValueError(f"feat_dim and num_classes must be >= 1, got {feat_dim}, {num_classes}")
    rng = np.random.default_rng(seed)
    n = 1 << scale
    m = edge_factor * n
    # One 16-bit uniform per edge and level (probabilities quantised to 1/65536): drawing
    # these is most of the cost, and 16 bits are ample for a synthetic generator.
    t_a, t_ab, t_abc = (np.uint16(min(round(p * 65536), 65535)) for p in (a, a + b, a + b + c))
    src = np.zeros(m, dtype=np.int64)
    dst = np.zeros(m, dtype=np.int64)
    src_bit = np.empty(m, dtype=bool)
    dst_bit = np.empty(m, dtype=bool)
    in_d = np.empty(m, dtype=bool)
    for _ in range(scale):
        u = rng.integers(0, 65536, size=m, dtype=np.uint16)
        np.greater_equal(u, t_ab, out=src_bit)  # quadrants c, d
        np.greater_equal(u, t_a, out=dst_bit)
        np.not_equal(dst_bit, src_bit, out=dst_bit)  # quadrant b: a <= u < a + b
        np.greater_equal(u, t_abc, out=in_d)
        dst_bit |= in_d  # quadrants b, d
        src <<= 1
        src |= src_bit
        dst <<= 1
        dst |= dst_bit
    scramble = rng.permutation(n)
    keep = src != dst
    src, dst = scramble[src[keep]], scramble[dst[keep]]

    feat = rng.standard_normal((n, feat_dim), dtype=np.float32)
    labels = torch.from_numpy(rng.integers(0, num_classes, size=n))
    ndata = {
        "feat": torch.from_numpy(feat),
        "label": labels,
        **random_split(n, train_frac, val_frac, seed),
    }
    both_src = torch.from_numpy(np.concatenate([src, dst]))
    both_dst = torch.from_numpy(np.concatenate([dst, src]))
    graph = Graph.from_edges(
        both_src, both_dst, n, ndata=ndata, name=f"rmat{scale}", coalesce=True
    )
    graph.num_classes = num_classes
    return graph
