"""Device memory of one rank during training (rank 0, which holds the largest chunks).

Full-graph GCN (:func:`gcn_memory`), per rank:

- ``adjacency``: every layer's Â block and its transpose (kept for backward), CSR with
  int64 indices: ``2 · (nnz_local·(8 + e) + rows·8)`` per sparse operator and layer;
- ``features``: the input block (rows over outer and depth, features over inner);
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

GPT (:func:`gpt_memory`), per rank, with ``e`` bytes per element:

- ``parameters`` (e each), ``gradients`` (e each), ``optimizer`` (Adam's two moments in
  float32, plus float32 master weights when e < 4); the data-axis ``stage`` divides the
  optimizer state (≥ 1), the gradients (≥ 2) and the parameters (3, plus two gathered blocks
  — the running one and the prefetched next — and one block's full gradient before its
  reduce-scatter) by the data size, as :mod:`gnnpar.shard` does. Stages 1–2 also hold this
  rank's float32 master chunk (a copy even when e = 4) and its reduced float32 gradient
  chunk, and stage 1 keeps the full gradient buffers;
- ``gathered``: with z > 1, every matrix's z-gathered block (``z`` times the local piece),
  which autograd keeps from the layer's forward to its backward;
- ``activations``: Megatron's per-layer count (Korthikanti et al., 2022) for tensor
  parallelism without the attention-score term (our attention goes through
  ``scaled_dot_product_attention``, whose fused kernels keep no score matrix):
  ``tokens · h · (10 + 24/t)`` bytes at 2 bytes per element, ``t`` the size of the axis that
  splits the heads, scaled by e/2; plus float32 logits and their softmax for this rank's
  vocabulary chunk. ``tokens`` are this rank's: its sequences (the batch over data and z)
  times its part of each (the sequence over context: context parallelism is this model's
  sequence parallelism, every activation split, the tensor-parallel ones not);
- with ``offload`` (stages 1–3, :mod:`gnnpar.shard.offload`) the ``optimizer`` part (Adam's
  moments and the float32 master chunk) — and at stage 3 with e = 4 the parameter chunk,
  which is the master itself — leave the device: ``"host"`` bytes (host memory) or
  ``"file"`` bytes (memory-mapped files: page cache, not anonymous memory). These parts are
  not device memory (:func:`device_bytes`).
- ``ring`` (context > 1): what ring attention holds beyond that in the busiest layer's
  backward: the travelling key/value block, its gradients and the received copies (8 blocks
  of this rank's keys' size), the saved log-sum-exp (one float per query and head), and one
  tile of a chunk pair's score matrices (scores, probabilities and their gradient: 3 · L²
  per head and sequence, L = T/(2C), computed a slice of sequences·heads at a time so that
  one tile holds at most ``TILE_BYTES``, or one L × L matrix when that is larger).

Activation checkpointing (``activation_checkpointing`` of the problem, :mod:`gnnpar.recompute`):
``"full"`` keeps of each layer or block only its input (a GCN layer's input block, rows ×
width of the previous output; a GPT block's ``tokens · h``), plus, while backward recomputes
it, one layer's full activations. ``"selective"`` (GPT) drops the attention core's score,
softmax and dropout tensors, which the count above already leaves out (the fused kernels keep
none), so it predicts no saving: it pays off where attention runs unfused (the CPU's math
kernel with dropout) or the sequence is long.

Not counted: allocator fragmentation, communication buffers, the CUDA context (about 0.5–1
GB per GPU). The planner keeps 10% of device memory free for them (``usable``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from gnnpar import shm
from gnnpar.comm import ring_bytes
from gnnpar.plan.comm_model import (
    Collective,
    ShardedLayer,
    batch_per_rank,
    gcn_collectives,
    gcn_local_layers,
    gpt_layout,
    grid_shape,
    local_params,
    seq_per_rank,
)
from gnnpar.plan.problems import GCNProblem, GPTProblem, MiniBatchProblem, PlanError
from gnnpar.tensor.context import TILE_BYTES

__all__ = [
    "HEAP_CEILING",
    "HEAP_RETAINED",
    "KERNEL_BYTES",
    "MINIBATCH_PARTS",
    "OFF_DEVICE",
    "RUNTIME_BYTES",
    "USABLE_FRACTION",
    "degree_histogram",
    "device_bytes",
    "estimated_part",
    "expected_blocks",
    "gcn_memory",
    "gpt_memory",
    "minibatch_memory",
    "sharded_state",
]

#: Fraction of device memory the planner lets a shape use.
USABLE_FRACTION = 0.9
#: Parts of a memory breakdown that are not device memory (the offload tiers).
OFF_DEVICE = ("host", "file")


def device_bytes(parts: Mapping[str, float]) -> float:
    """The device memory of a breakdown: every part but the offloaded ones."""
    return sum(v for k, v in parts.items() if k not in OFF_DEVICE)


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
                out["staging"] += ops * (nnz * 12 + rows * 8)
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
        out["adjacency"] += ops * 2 * (nnz * (8 + e) + (rows + cols + 2) * 8)
        if i == 0:
            out["features"] = (lay.h_sub[1] - lay.h_sub[0]) * fin * e
        w_local = lay.w_part[1] - lay.w_part[0]
        out["weights"] += 4 * (w_local + (fout if problem.bias else 0)) * e
        kept.append((rows * ops * fin + 2 * rows * fout) * e)
        inputs += rows * fout * e
        transient = max(transient, (cols * fin + ops * fin * fout) * e)
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


def shm_segments(collectives: list[Collective]) -> int:
    """Bytes of the same-host shared-memory segments a rank maps for these collectives
    (:func:`gnnpar.shm.segment_bytes`): one per axis, as large as its largest need."""
    per_axis: dict[str, int] = {}
    for c in collectives:
        ring = ring_bytes(c.kind, 1.0, c.group)
        need = shm.segment_bytes(c.kind, c.nbytes / ring, c.group) if ring else 0
        per_axis[c.axis] = max(per_axis.get(c.axis, 0), need)
    return sum(per_axis.values())


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


def sharded_state(n: float, e: int, stage: int, d: int, per_unit: float) -> dict[str, float]:
    """``parameters``, ``gradients`` and ``optimizer`` bytes of ``n`` parameters of ``e``
    bytes trained with Adam on ``d`` data ranks at ZeRO ``stage`` (:mod:`gnnpar.shard`; see
    the module docstring); ``per_unit``: the parameters of the largest unit stage 3 gathers."""
    out = {"parameters": float(n * e), "gradients": float(n * e)}
    out["optimizer"] = float(n * (8 + (4 if e < 4 else 0)))
    if stage >= 1:
        out["optimizer"] /= d
    if stage in (1, 2):
        # the master chunk the optimizer steps (a separate float32 copy even when the
        # parameters are float32) and the reduced float32 gradient chunk it reads
        if e >= 4:
            out["optimizer"] += n * 4 / d
        out["gradients"] = (n * e if stage == 1 else 0.0) + n * 4 / d
    if stage >= 3:
        # the chunk plus two gathered units (the one running and the next, prefetched); in
        # backward a unit's full gradient lives until its reduce-scatter
        out["parameters"] = n * e / d + 2 * per_unit * e
        out["gradients"] = n * e / d + per_unit * e
    return out


def gpt_memory(
    problem: GPTProblem, shape: Mapping[str, int], layout: list[ShardedLayer] | None = None
) -> dict[str, float]:
    """Bytes on rank 0 of one GPT training step, by part (see the module docstring);
    ``layout`` is :func:`gpt_layout` of the shape (computed when not given)."""
    g = grid_shape(shape)
    mods = gpt_layout(problem, shape) if layout is None else layout
    coords = g.coords(0)
    matrix, other = local_params(problem, mods, coords)
    n = matrix + other
    e = problem.element_size
    d = g.data * g.context  # context ranks shard with the data ranks (fold_context)
    per_block = (n - other) / max(1, problem.layers)
    out = {**sharded_state(n, e, problem.stage, d, per_block), "gathered": 0.0, "activations": 0.0}
    if g.z > 1:
        # every matrix's z-gathered block, saved by autograd from its forward to its backward
        out["gathered"] = matrix * g.z * e
    rows, t_loc = batch_per_rank(problem, g), seq_per_rank(problem, g)
    tokens = rows * t_loc
    qkv = next(m for m in mods if m.name.endswith("attn.qkv"))
    head = next(m for m in mods if m.name == "lm_head")
    t = qkv.layout.row_parts
    per_layer = tokens * problem.hidden * (10 + 24 / t) * e / 2
    logits = 2 * tokens * head.layout.row_sizes()[0] * 4
    if problem.activation_checkpointing == "full":
        # each block's input, and one block's activations while backward recomputes it
        out["activations"] = problem.layers * tokens * problem.hidden * e + per_layer + logits
    else:
        out["activations"] = problem.layers * per_layer + logits
    if g.context > 1:
        heads = problem.heads // t
        keys = tokens * heads * (problem.hidden // problem.heads) * e
        square = (t_loc // 2) ** 2 * e
        tile = min(rows * heads * square, max(TILE_BYTES // square, 1) * square)
        out["ring"] = float(8 * keys + tokens * heads * e + 3 * tile)
    if problem.offload != "none" and problem.stage >= 1:
        moved = out["optimizer"]
        if problem.stage >= 3 and e >= 4:  # the parameter chunk is the master
            moved += n * e / d
            out["parameters"] -= n * e / d
        out["optimizer"] = 0.0
        out[problem.offload] = moved
    return out


# ---------------------------------------------------------------------- mini-batch (sage)
#: What importing numba and compiling the sampler's kernels adds to a process (measured on
#: x86-64 Linux with numba 0.68: 45 MiB anonymous, 83 MiB of mapped libraries), counted by
#: :func:`minibatch_memory` with ``host=True`` when numba is installed.
KERNEL_BYTES = 128 * 2**20
#: What torch imports the first time a process builds an optimizer (``torch._dynamo``,
#: ``sympy`` and some 800 other modules: 470,000 Python objects), measured on x86-64 Linux
#: with torch 2.13 and Python 3.11 (67 MiB anonymous, 4 MiB of mapped files).
RUNTIME_BYTES = 72 * 2**20
#: How many times the training step's heap-served blocks glibc's allocator keeps resident
#: after one epoch: every batch's blocks differ in size, the freed ones stay in the heap as
#: holes (the dynamic mmap threshold serves blocks up to its ceiling from the heap once such
#: a block was freed). Fitted on R-MAT 17 and 18 at batch 1024 (1.2-3.4 on seven ranks);
#: the heap stops growing after about two epochs.
HEAP_RETAINED = 2.5
#: glibc's largest dynamic mmap threshold on 64-bit: blocks of this size or more are always
#: mapped, and returned when freed.
HEAP_CEILING = 32 * 2**20
#: Bytes a node's label (int64) and its train, validation and test masks (bool) take.
NODE_DATA_BYTES = 8 + 3


def degree_histogram(indptr: object) -> tuple[tuple[int, int], ...]:
    """The ``(degree, nodes)`` pairs of a CSR's rows (``indptr``: N + 1 offsets), the
    ``degrees`` of a :class:`~gnnpar.plan.problems.MiniBatchProblem` (one pass over N)."""
    import numpy as np

    ptr = np.asarray(indptr, dtype=np.int64)
    counts = np.bincount(np.diff(ptr))
    return tuple((int(d), int(c)) for d, c in enumerate(counts) if c)


def _histogram(problem: MiniBatchProblem) -> list[tuple[float, float]]:
    if problem.degrees:
        return [(float(d), float(c)) for d, c in problem.degrees]
    return [(problem.edges / problem.nodes, float(problem.nodes))]


def expected_blocks(problem: MiniBatchProblem, seeds: float) -> list[tuple[float, float, float]]:
    """Expected ``(destinations, sources, edges)`` of every hop's block (seeds' hop first)
    for ``seeds`` seeds drawn uniformly (see :func:`minibatch_memory`)."""
    hist, n, e = _histogram(problem), problem.nodes, max(problem.edges, 1)
    miss = 1.0 - min(seeds, n) / n  # a node is not a seed
    drawn = 0.0  # neighbours drawn so far, over all hops
    dst, out = float(seeds), []
    for k in problem.fanouts:
        # a node is in the frontier unless it is no seed and no draw has hit it yet
        edges = sum(c * (1 - miss * math.exp(-drawn * d / e)) * (d if k < 0 else min(k, d))
                    for d, c in hist)  # fmt: skip
        drawn += edges
        src = sum(c * (1 - miss * math.exp(-drawn * d / e)) for d, c in hist)
        out.append((dst, max(src, dst), edges))
        dst = max(src, dst)
    return out


def estimated_part(problem: MiniBatchProblem, data: int) -> dict[str, float]:
    """A part's ``num_owned``, ``num_halo`` and ``num_local_edges`` (the keys of a partition
    folder's per-part record) when none is given: ``N/D`` nodes, ``E/D`` in-edges, and as
    halo the expected distinct sources of those edges that other parts own, edges falling on
    sources in proportion to their degree and sources on parts at random (a partitioner
    that cuts fewer edges, such as METIS, has a smaller halo)."""
    n, e = problem.nodes, max(problem.edges, 1)
    local = problem.edges / data
    halo = (1 - 1 / data) * sum(c * (1 - math.exp(-local * d / e)) for d, c in _histogram(problem))
    return {"num_owned": n / data, "num_halo": halo, "num_local_edges": local}


def minibatch_memory(
    problem: MiniBatchProblem,
    data: int = 1,
    part: Mapping[str, float] | None = None,
    host: bool = True,
) -> dict[str, float]:
    """Bytes one data rank of the ``sage`` task holds at its peak, by part (see
    :func:`_minibatch_parts`); ``data`` ranks (more than one: partitioned, one part each),
    ``part`` this rank's record of the partition folder's meta (``num_owned``, ``num_halo``,
    ``num_local_edges``; default :func:`estimated_part`). ``host=False`` leaves out the
    host-only parts (``staging``, ``kernels``, ``runtime``, ``heap``)."""
    if not isinstance(data, int) or isinstance(data, bool) or data < 1:
        raise PlanError(f"data must be a positive integer, got {data!r}")
    if part is not None:
        missing = {"num_owned", "num_halo", "num_local_edges"} - set(part)
        if missing:
            raise PlanError(f"part lacks {', '.join(sorted(missing))}")
    out = _minibatch_parts(problem, data, part)
    if not host:
        for key in ("staging", "kernels", "runtime", "heap"):
            out.pop(key)
    return out


def _minibatch_parts(
    problem: MiniBatchProblem, data: int, part: Mapping[str, float] | None
) -> dict[str, float]:
    e, f, n = problem.element_size, problem.features, problem.nodes
    dims = problem.dims
    out = dict.fromkeys(MINIBATCH_PARTS, 0.0)
    seeds = problem.seeds / data  # this rank's training seeds
    batch = min(problem.batch_size, problem.seeds) / data  # its seeds of a global batch
    if data == 1:
        # the graph folder is memory-mapped: the CSR, features and node data are its pages
        rows, owned, edges = float(n), float(n), float(problem.edges)
        out["staging"] = (n + 1) * 8 + edges * 8 + n * f * 4 + n * NODE_DATA_BYTES
        # the full-neighbour block layer-wise evaluation reuses (its sources, CSR, edge ids)
        out["graph"] = (2 * n + 1) * 8 + 2 * edges * 8
    else:
        p = estimated_part(problem, data) if part is None else part
        owned, halo = float(p["num_owned"]), float(p["num_halo"])
        edges = float(p["num_local_edges"])
        rows = owned + halo
        # local CSR over owned then halo rows, each local node's global and original id
        out["graph"] = (rows + 1) * 8 + edges * 8 + 2 * rows * 8
        out["features"] = (owned + problem.feature_cache) * f * e
        out["node_data"] = owned * NODE_DATA_BYTES
    # the relabeler's scratch (one int64 per node of the graph), the seeds and their keys
    out["sampler"] = n * 8 + (3 * seeds + problem.seeds) * 8
    blocks = expected_blocks(problem, batch)
    inputs = blocks[-1][1]
    # per hop: sources, CSR offsets, local sources and edge ids (or the sources' keys);
    # the input rows' features and the seeds' labels
    per_batch = sum(_per_batch_blocks(problem, blocks, batch))
    out["batches"] = (problem.prefetch + 2) * per_batch
    out["activations"] = _step_activations(problem, blocks)
    remote = inputs * (1 - 1 / data)
    if data > 1:
        # the feature fetch of a batch: the remote rows received and the rows served to the
        # other ranks (as many, on average), with their ids
        out["buffers"] = 2 * remote * (f * e + 8)
    n_p = sum(d * w + w for d, w in zip(dims[:-1], dims[1:], strict=True))  # neigh + bias
    n_p += sum(d * w for d, w in zip(dims[:-1], dims[1:], strict=True))  # root
    per_unit = max(2 * d * w + w for d, w in zip(dims[:-1], dims[1:], strict=True))
    out["weights"] = sum(sharded_state(n_p, e, problem.stage, data, per_unit).values())
    train = out["batches"] + out["activations"] + out["buffers"]
    evaluation = _inference_peak(problem, owned, rows, edges, data)
    out["inference"] = max(0.0, evaluation - train)
    if compiled_sampling():
        out["kernels"] = float(KERNEL_BYTES)
    out["runtime"] = float(RUNTIME_BYTES)
    # the allocator's holes: the step's blocks under the ceiling (the larger are mapped)
    mapped = (problem.prefetch + 2) * _mapped(_per_batch_blocks(problem, blocks, batch))
    mapped += _mapped(_step_activation_blocks(problem, blocks))
    mapped += 2 * _mapped([remote * f * e, remote * 8]) if data > 1 else 0.0
    out["heap"] = HEAP_RETAINED * max(0.0, train - mapped)
    return out


def _mapped(sizes: list[float]) -> float:
    """The bytes of the blocks glibc always maps (:data:`HEAP_CEILING` or more)."""
    return sum(b for b in sizes if b >= HEAP_CEILING)


def _per_batch_blocks(
    problem: MiniBatchProblem, blocks: list[tuple[float, float, float]], batch: float
) -> list[float]:
    """The tensors of one sampled batch, in bytes (they add up to one batch of the
    ``batches`` part): per hop its sources, CSR offsets, local sources and edge ids; the input
    rows' features and the seeds' labels."""
    out = []
    for d, s, m in blocks:
        out += [s * 8, (d + 1) * 8, m * 8, m * 8]
    return out + [blocks[-1][1] * problem.features * problem.element_size, batch * 8]


def _step_activation_blocks(
    problem: MiniBatchProblem, blocks: list[tuple[float, float, float]]
) -> list[float]:
    """The tensors, in bytes, that one training step's forward keeps for backward, and the
    largest group of backward's transients."""
    e, dims = problem.element_size, problem.dims
    kept: list[float] = []
    transient: list[float] = []
    for (dst, src, m), fin, w in zip(reversed(blocks), dims[:-1], dims[1:], strict=True):
        narrow = min(fin, w)  # SAGE aggregates after the transform when that is narrower
        # dropout: its mask (a byte) and output; the aggregated rows, the per-edge mean
        # weights, and the destinations' neighbour, root, sum and ReLU outputs
        kept += [src * fin, src * fin * e, src * narrow * e, m * e, *[dst * w * e] * 4]
        # dropout's int32 hash, and backward's transposed block (CSR and edge order)
        for group in ([src * fin * 4], [m * 8, m * 8, src * 8, src * fin * e]):
            if sum(group) > sum(transient):
                transient = group
    return kept + transient


#: The parts of :func:`minibatch_memory`, in order.
MINIBATCH_PARTS = ("graph", "features", "node_data", "sampler", "batches", "activations",
                   "buffers", "weights", "inference", "staging", "kernels", "runtime",
                   "heap")  # fmt: skip


def compiled_sampling() -> bool:
    """Whether the sampler runs numba's compiled kernels (numba is installed)."""
    from gnnpar.sampling import compiled

    return compiled.available()


def _step_activations(problem: MiniBatchProblem, blocks: list[tuple[float, float, float]]) -> float:
    """What one training step's forward keeps for backward, plus backward's transient."""
    return sum(_step_activation_blocks(problem, blocks))


def _inference_peak(
    problem: MiniBatchProblem, owned: float, rows: float, edges: float, data: int
) -> float:
    """The largest layer of layer-wise evaluation over this rank's rows (all of them in one
    block): its gathered input (sources × in; on D > 1 ranks the halo's rows fetched and
    concatenated with the owned ones), the previous layer's output, and the layer's
    temporaries, the larger of (transformed sources, per-edge weights, aggregate) and
    (aggregate, root, sum), each destinations × out."""
    e, dims = problem.element_size, problem.dims
    peak, previous = 0.0, 0.0
    for fin, w in zip(dims[:-1], dims[1:], strict=True):
        gathered = rows * fin * e
        if data > 1:
            gathered += (rows - owned) * fin * e * 2  # the fetched halo rows, and the served
        narrow = min(fin, w)
        layer = max(rows * narrow * e + edges * e + owned * w * e, 3 * owned * w * e)
        peak = max(peak, previous + gathered + layer)
        previous = owned * w * e
    return peak
