"""The mini-batch GNN's cost model: what the planner plans (:class:`MiniBatchProblem`) and the
peak memory of one data rank (:func:`minibatch_memory`), from the expected sizes of a
sampled batch's blocks (:func:`expected_blocks`) and of a rank's part of a partitioned graph
(:func:`estimated_part`, or the partition folder's own record). ``gnnpar plan sage`` prints
it per data rank (:mod:`.planning`); ``benchmarks/memory.py`` holds it against measured
peaks."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from gnnpar.plan.inputs import PlanError, positive
from gnnpar.plan.memory import sharded_state

if TYPE_CHECKING:
    from gnnpar.models.minibatch.typed_cost import TypedSizes

__all__ = [
    "HEAP_CEILING",
    "HEAP_RETAINED",
    "KERNEL_BYTES",
    "MINIBATCH_PARTS",
    "RUNTIME_BYTES",
    "MiniBatchProblem",
    "degree_histogram",
    "estimated_part",
    "expected_blocks",
    "minibatch_memory",
]


@dataclasses.dataclass(frozen=True)
class MiniBatchProblem:
    """A mini-batch GraphSAGE run (the ``sage`` task with the neighbour sampler), in the
    task's words and with its defaults: ``batch_size`` seeds per global batch, one fan-out
    per layer (``fanouts``, seeds' hop first), ``prefetch`` batches sampled ahead,
    ``feature_cache`` remote feature rows cached per rank, ``stage`` the ZeRO stage of
    :mod:`gnnpar.shard`. ``edges`` is the stored CSR entries (in-edges; both directions of an
    undirected edge), ``train_nodes`` the training seeds (default: all nodes).
    ``degrees``: the graph's in-degree histogram as ``(degree, nodes)`` pairs, which the
    expected batch sizes read (:func:`degree_histogram`; default: every node of the mean
    degree, which over-counts the distinct nodes of a batch on a skewed graph). ``typed``:
    the run is a typed graph's R-GCN (:mod:`.typed_cost`; ``features`` is then the padded
    width, ``fanouts`` each layer's largest)."""

    nodes: int
    edges: int
    features: int
    classes: int
    hidden: int = 64
    layers: int = 2
    fanouts: tuple[int, ...] = (10, 10)
    batch_size: int = 32
    train_nodes: int | None = None
    element_size: int = 4
    stage: int = 0
    prefetch: int = 1
    feature_cache: int = 0
    degrees: tuple[tuple[int, int], ...] = ()
    name: str = ""
    typed: TypedSizes | None = None

    def __post_init__(self) -> None:
        for key in ("nodes", "features", "classes", "hidden", "layers", "batch_size"):
            positive(key, getattr(self, key))
        positive("element_size", self.element_size)
        for key in ("edges", "prefetch", "feature_cache"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PlanError(f"{key} must be an integer >= 0, got {value!r}")
        if len(self.fanouts) != self.layers:
            raise PlanError(
                f"fanouts {list(self.fanouts)} give {len(self.fanouts)} fan-outs for "
                f"{self.layers} layers: give one per layer"
            )
        for f in self.fanouts:
            if not isinstance(f, int) or isinstance(f, bool) or (f < 1 and f != -1):
                raise PlanError(f"a fan-out must be a positive integer or -1, got {f!r}")
        if self.stage not in (0, 1, 2, 3):
            raise PlanError(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.train_nodes is not None and not 1 <= self.train_nodes <= self.nodes:
            raise PlanError(f"train_nodes must be in 1..{self.nodes}, got {self.train_nodes}")
        if self.degrees and sum(c for _, c in self.degrees) != self.nodes:
            raise PlanError(
                f"the degree histogram counts {sum(c for _, c in self.degrees)} nodes, "
                f"the problem has {self.nodes}"
            )

    @property
    def dims(self) -> list[int]:
        """Widths of every layer boundary: features, hidden…, classes."""
        return [self.features] + [self.hidden] * (self.layers - 1) + [self.classes]

    @property
    def seeds(self) -> int:
        """Training seeds over all ranks."""
        return self.nodes if self.train_nodes is None else self.train_nodes


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
    ``degrees`` of a :class:`MiniBatchProblem` (one pass over N)."""
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
    terms = _sage_terms
    if problem.typed is not None:
        from gnnpar.models.minibatch.typed_cost import typed_terms as terms
    out = _minibatch_parts(problem, data, part, terms)
    if not host:
        for key in ("staging", "kernels", "runtime", "heap"):
            out.pop(key)
    return out


@dataclasses.dataclass(frozen=True)
class ModelTerms:
    """What a model brings to :func:`minibatch_memory`, whose other parts are counted alike
    for every model: ``edge_arrays`` int64 arrays per stored edge (the CSR's sources, and a
    typed graph's relations; the evaluation block keeps as many per node and one more per
    edge), ``sampler_rows`` the sampler's own row index in bytes, ``inputs`` a batch's input
    rows, one batch's tensors and one step's (:func:`_mapped` reads them), the parameters
    and the largest ZeRO-3 unit, and layer-wise evaluation's peak."""

    edge_arrays: int
    sampler_rows: float
    inputs: float
    batch: list[float]
    step: list[float]
    parameters: int
    unit: int
    inference: float


def _minibatch_parts(
    problem: MiniBatchProblem,
    data: int,
    part: Mapping[str, float] | None,
    terms: Callable[..., ModelTerms],
) -> dict[str, float]:
    """The parts of :func:`minibatch_memory`, the model's own from ``terms(problem, data,
    batch, owned, rows, edges)``."""
    e, f, n = problem.element_size, problem.features, problem.nodes
    out = dict.fromkeys(MINIBATCH_PARTS, 0.0)
    seeds = problem.seeds / data  # this rank's training seeds
    batch = min(problem.batch_size, problem.seeds) / data  # its seeds of a global batch
    if data == 1:
        rows, owned, edges = float(n), float(n), float(problem.edges)
    else:
        p = estimated_part(problem, data) if part is None else part
        owned, halo = float(p["num_owned"]), float(p["num_halo"])
        edges = float(p["num_local_edges"])
        rows = owned + halo
    t = terms(problem, data, batch, owned, rows, edges)
    if data == 1:
        # the graph folder is memory-mapped: the CSR (and relations), features and node data
        # are its pages
        out["staging"] = (n + 1) * 8 + t.edge_arrays * edges * 8 + n * f * 4
        out["staging"] += n * NODE_DATA_BYTES
        # the full-neighbour block layer-wise evaluation reuses (its sources, CSR, edge ids,
        # and a typed graph's node types and relations)
        out["graph"] = (n + 1) * 8 + t.edge_arrays * n * 8 + (t.edge_arrays + 1) * edges * 8
    else:
        # local CSR (and relations) over owned then halo rows, each local node's global and
        # original id
        out["graph"] = (rows + 1) * 8 + t.edge_arrays * edges * 8 + 2 * rows * 8
        out["features"] = (owned + problem.feature_cache) * f * e
        out["node_data"] = owned * NODE_DATA_BYTES
    out["graph"] += t.sampler_rows
    # the relabeler's scratch (one int64 per node of the graph), the seeds and their keys
    out["sampler"] = n * 8 + (3 * seeds + problem.seeds) * 8
    out["batches"] = (problem.prefetch + 2) * sum(t.batch)
    out["activations"] = sum(t.step)
    remote = t.inputs * (1 - 1 / data)
    if data > 1:
        # the feature fetch of a batch: the remote rows received and the rows served to the
        # other ranks (as many, on average), with their ids
        out["buffers"] = 2 * remote * (f * e + 8)
    out["weights"] = sum(sharded_state(t.parameters, e, problem.stage, data, t.unit).values())
    train = out["batches"] + out["activations"] + out["buffers"]
    out["inference"] = max(0.0, t.inference - train)
    if compiled_sampling():
        out["kernels"] = float(KERNEL_BYTES)
    out["runtime"] = float(RUNTIME_BYTES)
    # the allocator's holes: the step's blocks under the ceiling (the larger are mapped)
    mapped = (problem.prefetch + 2) * _mapped(t.batch) + _mapped(t.step)
    mapped += 2 * _mapped([remote * f * e, remote * 8]) if data > 1 else 0.0
    out["heap"] = HEAP_RETAINED * max(0.0, train - mapped)
    return out


def _sage_terms(
    problem: MiniBatchProblem, data: int, batch: float, owned: float, rows: float, edges: float
) -> ModelTerms:
    """GraphSAGE's :class:`ModelTerms`: per layer a neighbour weight with its bias and a
    root weight; the blocks of :func:`expected_blocks`."""
    dims = problem.dims
    blocks = expected_blocks(problem, batch)
    n_p = sum(d * w + w for d, w in zip(dims[:-1], dims[1:], strict=True))  # neigh + bias
    n_p += sum(d * w for d, w in zip(dims[:-1], dims[1:], strict=True))  # root
    return ModelTerms(
        edge_arrays=1,
        sampler_rows=0.0,
        inputs=blocks[-1][1],
        batch=_per_batch_blocks(problem, blocks, batch),
        step=_step_activation_blocks(problem, blocks),
        parameters=n_p,
        unit=max(2 * d * w + w for d, w in zip(dims[:-1], dims[1:], strict=True)),
        inference=_inference_peak(problem, owned, rows, edges, data),
    )


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
