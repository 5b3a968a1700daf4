"""The mini-batch memory model of a typed graph's R-GCN (``gnnpar train sage --model rgcn``):
what :func:`~gnnpar.models.minibatch.cost.minibatch_memory` counts when its problem carries
:class:`TypedSizes`, part by part as for GraphSAGE (:data:`~.cost.MINIBATCH_PARTS`).

What differs from the homogeneous model:

- **the graph** carries each edge's relation (int64), the evaluation block each node's type
  too, and the sampler one virtual row per (node, relation): ``(rows · R + 1)`` offsets;
- **a batch's blocks** are drawn per relation: a destination of type b draws
  ``min(k_r, deg_r)`` sources in every relation r into b (:func:`expected_typed_blocks`), and
  each block keeps its relation and node-type arrays and the typed model's operators (per
  relation its CSR, its transpose and their mean weights), built ahead in the prefetch thread;
- **the parameters**: per featured type an input projection (F_t × H), per featureless type
  an embedding table (N_t × H, a dense parameter with its gradient and Adam state), per layer
  R + 1 weights (H × H; with bases B of them and R × B coefficients), the classifier;
- **the step** keeps per layer the dropout mask and output of its sources, the mean of each
  relation whose sources outnumber its destinations (``rgcn.py`` aggregates first then) and
  the ReLU output, and backward makes each embedding table's dense gradient once.

Expected sizes take a hop's destinations of a type as spread uniformly over the type's nodes,
and sources hit uniformly within their type (the homogeneous model weighs by degree).
``benchmarks/memory.py --typed`` holds the model against measured peaks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gnnpar.plan.inputs import PlanError

__all__ = [
    "TypedSizes",
    "expected_typed_blocks",
    "typed_parameters",
    "typed_sizes",
    "typed_terms",
]


@dataclasses.dataclass(frozen=True)
class TypedSizes:
    """What the typed memory model reads of a typed graph and its run: per node type its
    nodes and real feature width (0: featureless, an embedding per node); per relation its
    (source type, destination type) and the in-degree histogram of the destination type's
    nodes in it, as ``(degree, nodes)`` pairs over every node of that type (degree 0
    included); per layer (seeds' hop first) each relation's fan-out (-1: every edge); the
    target type; the number of bases (None: one weight per relation)."""

    type_nodes: tuple[int, ...]
    type_features: tuple[int, ...]
    relations: tuple[tuple[int, int], ...]
    relation_degrees: tuple[tuple[tuple[int, int], ...], ...]
    relation_fanouts: tuple[tuple[int, ...], ...]
    target: int
    bases: int | None = None

    def __post_init__(self) -> None:
        types = len(self.type_nodes)
        if len(self.type_features) != types or not types:
            raise PlanError("typed sizes: one node count and one feature width per type")
        if len(self.relation_degrees) != len(self.relations) or not self.relations:
            raise PlanError("typed sizes: one degree histogram per relation")
        for (a, b), hist in zip(self.relations, self.relation_degrees, strict=True):
            if not (0 <= a < types and 0 <= b < types):
                raise PlanError(f"typed sizes: relation ({a}, {b}) names no node type")
            if sum(c for _, c in hist) != self.type_nodes[b]:
                raise PlanError(
                    f"typed sizes: relation ({a}, {b})'s histogram counts "
                    f"{sum(c for _, c in hist)} nodes, type {b} has {self.type_nodes[b]}"
                )
        if any(len(layer) != len(self.relations) for layer in self.relation_fanouts):
            raise PlanError("typed sizes: each layer needs one fan-out per relation")
        if not 0 <= self.target < types:
            raise PlanError(f"typed sizes: target type {self.target} is not a node type")

    @property
    def num_relations(self) -> int:
        """R."""
        return len(self.relations)

    def relation_edges(self, r: int) -> int:
        """Edges of relation ``r``."""
        return sum(d * c for d, c in self.relation_degrees[r])


def typed_sizes(graph: Any, fanouts: Any, bases: int | None) -> TypedSizes:
    """The :class:`TypedSizes` of a typed :class:`~gnnpar.graph.Graph` and a run's fan-outs
    (as ``gnnpar train sage --fanouts`` takes them: one per layer, or per relation)."""
    import numpy as np

    from gnnpar.sampling.typed import parse_relation_fanouts

    types = graph.types
    offsets = [int(o) for o in types.offsets]
    indptr = graph.indptr.numpy()
    rel = types.edge_type.numpy()
    dst = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    names = list(types.node_types)
    relations, histograms = [], []
    for r, (src_type, _, dst_type) in enumerate(types.relations):
        a, b = names.index(src_type), names.index(dst_type)
        lo, hi = offsets[b], offsets[b + 1]
        degree = np.bincount(dst[rel == r] - lo, minlength=hi - lo)
        counts = np.bincount(degree)
        relations.append((a, b))
        histograms.append(tuple((int(d), int(c)) for d, c in enumerate(counts) if c))
    layers = parse_relation_fanouts(fanouts, types)
    return TypedSizes(
        type_nodes=tuple(offsets[t + 1] - offsets[t] for t in range(len(names))),
        type_features=tuple(int(f) for f in types.feat_dims),
        relations=tuple(relations),
        relation_degrees=tuple(histograms),
        relation_fanouts=tuple(tuple(int(k) for k in layer) for layer in layers),
        target=names.index(types.target),
        bases=bases,
    )


def expected_typed_blocks(
    typed: TypedSizes, seeds: float
) -> list[tuple[list[float], list[float], list[float]]]:
    """Per hop (seeds' first): the expected destinations and sources by node type and edges
    by relation, for ``seeds`` seeds of the target type."""
    n = [float(c) for c in typed.type_nodes]
    miss = [1.0] * len(n)
    miss[typed.target] = 1.0 - min(seeds, n[typed.target]) / n[typed.target]
    drawn = [0.0] * len(n)  # draws that landed on each source type, over all hops
    dst = [0.0] * len(n)
    dst[typed.target] = float(seeds)
    out = []
    for layer in typed.relation_fanouts:
        edges = []
        for r, ((a, b), k) in enumerate(zip(typed.relations, layer, strict=True)):
            share = dst[b] / n[b] if n[b] else 0.0
            hist = typed.relation_degrees[r]
            m = share * sum(c * (d if k < 0 else min(k, d)) for d, c in hist)
            edges.append(m)
            drawn[a] += m
        src = [
            max(dst[t], n[t] * (1 - miss[t] * math.exp(-drawn[t] / n[t])) if n[t] else 0.0)
            for t in range(len(n))
        ]
        out.append((list(dst), src, edges))
        dst = src
    return out


def typed_parameters(typed: TypedSizes, hidden: int, classes: int, layers: int) -> tuple[int, int]:
    """``(parameters, largest ZeRO-3 unit)`` of the typed R-GCN: the input (projections and
    embedding tables, one unit), each layer, the classifier."""
    h, r = hidden, typed.num_relations
    inputs = sum(
        f * h + h if f else nodes * h
        for nodes, f in zip(typed.type_nodes, typed.type_features, strict=True)
    )
    if typed.bases is None:
        layer = r * h * h + h * h + h
    else:
        layer = typed.bases * h * h + r * typed.bases + h * h + h
    head = h * classes + classes
    return inputs + layers * layer + head, max(inputs, layer, head)


def typed_terms(
    problem: Any, data: int, batch: float, owned: float, rows: float, edges: float
) -> Any:
    """The typed R-GCN's :class:`~gnnpar.models.minibatch.cost.ModelTerms` for
    :func:`~gnnpar.models.minibatch.cost.minibatch_memory` (see the module docstring): each
    edge's relation beside the CSR, the sampler's virtual row per (node, relation), the
    blocks of :func:`expected_typed_blocks`."""
    from gnnpar.models.minibatch.cost import ModelTerms

    typed: TypedSizes = problem.typed
    sampled = problem.nodes if data == 1 else owned  # the rows the sampler draws from
    blocks = expected_typed_blocks(typed, batch)
    params, unit = typed_parameters(typed, problem.hidden, problem.classes, problem.layers)
    return ModelTerms(
        edge_arrays=2,
        sampler_rows=(sampled * typed.num_relations + 1) * 8,
        inputs=sum(blocks[-1][1]),
        batch=_batch_tensors(problem, blocks, batch, data),
        step=_step_tensors(problem, blocks),
        parameters=params,
        unit=unit,
        inference=_typed_inference(problem, owned, rows, edges, data),
    )


def _batch_tensors(
    problem: Any, blocks: list[tuple[list[float], list[float], list[float]]], batch: float,
    data: int,
) -> list[float]:  # fmt: skip
    """The tensors of one sampled typed batch, in bytes: per hop the block (sources, CSR,
    local sources, edge ids or the sources' keys, each edge's relation, each source's type)
    and the typed model's operators built ahead (the rows grouped by type; per relation its
    CSR and transpose with their mean weights); the input rows' padded features, the labels."""
    typed: TypedSizes = problem.typed
    e, out = problem.element_size, []
    for dst_t, src_t, edges_r in blocks:
        d, s, m = sum(dst_t), sum(src_t), sum(edges_r)
        ids = m * 8 if data == 1 else s * 8
        out += [s * 8, (d + 1) * 8, m * 8, ids, m * 8, s * 8]
        out += [4 * s * 8, d * 8]
        for (a, b), m_r in zip(typed.relations, edges_r, strict=True):
            out += [(dst_t[b] + 1) * 8 + m_r * 8 + m_r * e, (src_t[a] + 1) * 8 + m_r * 8 + m_r * e]
    return out + [sum(blocks[-1][1]) * problem.features * e, batch * 8]


def _step_tensors(
    problem: Any, blocks: list[tuple[list[float], list[float], list[float]]]
) -> list[float]:
    """What a training step's forward keeps for backward, in bytes, and the largest of
    backward's transients: the input rows (a featured type's features, a featureless type's
    ids); per layer its sources' dropout mask and output, each relation's mean when it is
    taken before the transform, the ReLU output; the logits and the loss's copies."""
    typed: TypedSizes = problem.typed
    e, h, c = problem.element_size, problem.hidden, problem.classes
    first_src = blocks[-1][1]
    kept = [
        s * f * e if f else s * 8
        for s, f in zip(first_src, typed.type_features, strict=True)
    ]  # fmt: skip
    for dst_t, src_t, _ in reversed(blocks):
        s, d = sum(src_t), sum(dst_t)
        kept += [s * h, s * h * e, d * h * e]
        kept += [dst_t[b] * h * e for a, b in typed.relations if src_t[a] >= dst_t[b]]
    seeds = sum(blocks[0][0])
    kept += [seeds * h, seeds * h * e, 2 * seeds * c * e, seeds * 8, seeds * c * 4]
    embeddings = sum(
        nodes * h * e
        for nodes, f in zip(typed.type_nodes, typed.type_features, strict=True)
        if not f
    )  # fmt: skip
    hashes = max(sum(src) * h * 4 for _, src, _ in blocks)
    return [*kept, max(embeddings, hashes)]


def _typed_inference(problem: Any, owned: float, rows: float, edges: float, data: int) -> float:
    """Layer-wise evaluation's largest layer over this rank's rows (one block of all of
    them): the typed operators rebuilt for the block (relations, CSR per relation, mean
    weights, and the build's sort), its gathered input, the previous layer's output, and the
    layer's temporaries (the split by type, the per-relation aggregates, the merge, the
    root term, bias and ReLU: about five of rows × hidden)."""
    typed: TypedSizes = problem.typed
    e, h = problem.element_size, problem.hidden
    share = rows / sum(typed.type_nodes)  # this rank's rows of each type, as a share
    per_relation = sum(typed.type_nodes[b] * share + 1 for _, b in typed.relations) * 8
    index = edges * (8 + e) + per_relation + 8 * edges * 8
    peak, previous = 0.0, 0.0
    for fin in [problem.features] + [h] * problem.layers:
        gathered = rows * fin * e
        if data > 1:
            gathered += (rows - owned) * fin * e * 2
        layer = 5 * rows * h * e
        peak = max(peak, previous + gathered + layer + index)
        previous = owned * h * e
    return peak
