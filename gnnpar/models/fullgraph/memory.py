"""Device memory of one rank during full-graph training (rank 0, which holds the largest
chunks): :func:`gcn_memory`.

GCN and GraphSAGE, per rank:

- ``adjacency``: every layer's Â block and its transpose (kept for backward), CSR with
  int64 indices: ``2 · (nnz_local·(8 + e) + rows·8)`` per sparse operator and layer;
- ``features``: the input block (rows over outer and depth, features over inner);
- ``inputs`` (with learnt featureless rows): the table's rows of the input block (the
  featureless nodes' share of its rows, spread by the node permutation) with their gradient
  and two Adam moments (4 copies);
- ``weights``: weight and bias pieces with their gradients and two Adam moments (4 copies);
- ``activations``: what backward keeps per layer (the aggregate ``Â·H`` and the output
  before and after the ReLU) plus the largest transient (a gathered ``H`` and ``W``).

GAT and GIN (``model="gat"`` / ``"gin"``, :mod:`gnnpar.models.fullgraph.gat`) instead: ``adjacency``
holds the block's edge list (local row and column, global destination and source ids: 4
int64 per nonzero) and the permutation block's (2 int64 per row); ``weights`` the weight rows
of this rank's input features for every head, the two attention vectors and the bias piece
(4 copies each); ``activations`` Z (columns × heads·F, kept) and the output (rows × heads·F
before the reduce-scatter, and the output piece before and after the ELU); ``attention`` the
per-edge, per-head tensors backward keeps: the logits before and after the LeakyReLU, the
exponentials, the attention values after the softmax and after dropout (5 · nnz · heads),
and the gathered source rows of Z each edge multiplies (nnz · heads·F). GIN keeps the
gathered neighbour rows of Z (nnz · width), its MLP's hidden output before and after the
ReLU and, for its BatchNorm, the centred and the normalised hidden output (4 · rows · fout),
and holds its MLP's second weight rows, ε and the BatchNorm's scale and shift instead of
attention.

Activation checkpointing (``activation_checkpointing`` of the problem, :mod:`gnnpar.recompute`):
``"full"`` keeps of each layer only its input (its input block, rows × width of the
previous output), plus, while backward recomputes
it, one layer's full activations.

Not counted: allocator fragmentation, communication buffers, the CUDA context (about 0.5–1
GB per GPU). The planner keeps 10% of device memory free for them (``usable``).
"""

from __future__ import annotations

from collections.abc import Mapping

from gnnpar import shm
from gnnpar.models.fullgraph.cost import GCNProblem, gcn_collectives, gcn_local_layers
from gnnpar.plan.comm_model import grid_shape
from gnnpar.plan.memory import shm_segments

__all__ = ["gcn_memory"]


def gcn_memory(
    problem: GCNProblem, shape: Mapping[str, int], host: bool = False
) -> dict[str, float]:
    """Bytes on rank 0 of one full-graph training run, by part (see the module docstring).

    ``host=True`` adds what a CPU rank (gloo) holds beside the device model, measured by
    ``benchmarks/memory.py``: ``"staging"``, the pages of the shard files it maps, resident
    while its source is open (every distinct Â block its layers read, 12 bytes a stored
    entry and 8 a row, and its input-feature rows at full width, since rows share pages);
    and ``"buffers"``: the same-host shared-memory segments of the rank's groups
    (:func:`shm_segments`), plus one more copy of the largest backward step's all-reduced
    gradients that gloo carries (``Â·H``'s over the outer axis and ``H``'s over the depth
    axis, below the transport's threshold or with ``GNNPAR_SHM=0``), which gloo's all-reduce
    stages in a buffer of the tensor's size."""
    if problem.model in ("gat", "gin"):
        return _gemm_first_memory(problem, shape)
    e, ops = problem.element_size, problem.num_ops
    out = {"adjacency": 0.0, "features": 0.0, "weights": 0.0, "activations": 0.0}
    if host:
        out["staging"] = 0.0
        out["buffers"] = 0.0
        seen: set[tuple[int, int, int, int, int]] = set()
    g = grid_shape(shape)
    transient = 0.0
    kept: list[float] = []  # per layer: what backward keeps without recompute
    inputs = 0.0  # per layer with recompute: its output, the next layer's input
    for i, lay, rows, cols, fin, fout, nnz in gcn_local_layers(problem, shape):
        if host:
            key = (i % 2, *lay.rows, *lay.cols)
            if key not in seen:
                seen.add(key)
                out["staging"] += problem.operator_entries(nnz, rows) * 12 + ops * rows * 8
            if i == 0:
                out["staging"] += (lay.h_sub[1] - lay.h_sub[0]) * problem.features * 4
            # gloo stages an all-reduce it carries in a copy of its size (the transport's
            # segments are added below)
            reduced = sum(
                size
                for axis, size in ((lay.outer, rows * ops * fin * e), (lay.depth, cols * fin * e))
                if g.size(axis) > 1 and not shm.segment_bytes("all_reduce", size, g.size(axis))
            )
            out["buffers"] = max(out["buffers"], float(reduced))
        entries = problem.operator_entries(nnz, rows)
        out["adjacency"] += 2 * (entries * (8 + e) + ops * (rows + cols + 2) * 8)
        if i == 0:
            out["features"] = (lay.h_sub[1] - lay.h_sub[0]) * fin * e
            if problem.featureless_nodes:
                share = problem.featureless_nodes / problem.nodes
                out["inputs"] = 4 * (lay.h_sub[1] - lay.h_sub[0]) * share * fin * e
        w_local = lay.w_part[1] - lay.w_part[0]
        comp = problem.relations * problem.bases  # R-GCN bases' coefficients, whole
        out["weights"] += 4 * (w_local + comp + (fout if problem.bias else 0)) * e
        kept.append((rows * ops * fin + 2 * rows * fout) * e)
        inputs += rows * fout * e
        # the gathered weight blocks, and with bases the relations' weights combined from them
        combined = ops * fin * fout if problem.bases else 0
        transient = max(transient, (cols * fin + problem.weight_blocks * fin * fout + combined) * e)
    out["activations"] = _layer_activations(problem, kept, inputs) + transient
    if host:
        out["buffers"] += float(shm_segments(gcn_collectives(problem, shape)))
    return out


def _layer_activations(problem: GCNProblem, kept: list[float], inputs: float) -> float:
    """What backward keeps over all layers: each layer's ``kept``, or with full recompute the
    layers' inputs (``inputs``) and one layer's ``kept`` while it is recomputed."""
    if problem.activation_checkpointing == "full":
        return inputs + max(kept, default=0.0)
    return sum(kept)


def _gemm_first_memory(problem: GCNProblem, shape: Mapping[str, int]) -> dict[str, float]:
    """:func:`gcn_memory` of a GAT or GIN (see the module docstring)."""
    e = problem.element_size
    gat = problem.model == "gat"
    out = {"adjacency": 0.0, "features": 0.0, "weights": 0.0, "activations": 0.0}
    if gat:
        out["attention"] = 0.0
    kept: list[float] = []
    inputs = 0.0
    for i, lay, rows, cols, fin, fout, nnz in gcn_local_layers(problem, shape):
        heads, head_dim = problem.layer_heads(i) if gat else (1, problem.dims[i + 1])
        width = heads * head_dim
        out["adjacency"] += nnz * 4 * 8 + rows * 2 * 8
        if i == 0:
            out["features"] = (lay.h_sub[1] - lay.h_sub[0]) * fin * e
        # GAT: two attention vectors; GIN: the MLP's second weight rows, ε, the BatchNorm's
        # scale and shift
        extra = 2 * width if gat else fout * width + 1 + 2 * fout
        out["weights"] += 4 * (fin * width + extra + (fout if problem.bias else 0)) * e
        layer = (cols * width + rows * width + 2 * rows * fout) * e
        if not gat:  # the gathered neighbour rows of Z; the MLP's hidden output around the
            # ReLU, and the BatchNorm's centred and normalised copies of it
            layer += (nnz * width + 4 * rows * fout) * e
        attention = nnz * (5 * heads + width) * e if gat else 0.0
        kept.append(layer + attention)
        inputs += rows * fout * e
        out["activations"] += layer
        if gat:
            out["attention"] += attention
    if problem.activation_checkpointing == "full":
        # the attention tensors are recomputed too: one layer's worth, inside "activations"
        out["activations"] = _layer_activations(problem, kept, inputs)
        if gat:
            out["attention"] = 0.0
    return out
