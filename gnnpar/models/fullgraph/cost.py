"""The full-graph GNN's cost model: what the planner plans (:class:`GCNProblem`), the
collectives of one training epoch of :mod:`gnnpar.models.fullgraph.plexus` (forward, the
sharded loss, backward with the bias gradients; :func:`gcn_collectives`), each layer's part
taken from the layer's own schedule (:func:`gnnpar.models.fullgraph.plexus.layer_schedule`),
so the sums equal measured traffic byte for byte (tests check this for every grid of 8
ranks), and the compute time of an epoch (:func:`gcn_compute_seconds`).

Each SpMM costs ``max(2·nnz·width / SpMM rate, bytes / memory bandwidth)``, each GEMM the
roofline of :func:`gnnpar.plan.compute.gemm_seconds`; nonzeros are assumed spread evenly over
blocks (Plexus's permutation gets within 1%). Memory: :mod:`.memory`; ranking shapes and the
grid the trainer runs: :mod:`.planning`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

from gnnpar.models.fullgraph.gat import gat3d_layer_schedule, gin3d_layer_schedule
from gnnpar.models.fullgraph.layout import layout3d
from gnnpar.models.fullgraph.plexus import layer_schedule
from gnnpar.plan.comm_model import Collective, Infeasible, collective, grid_shape
from gnnpar.plan.compute import gemm_seconds, stream_seconds
from gnnpar.plan.inputs import PlanError, checkpointing, positive
from gnnpar.plan.machines import Machine

__all__ = [
    "GCNProblem",
    "LocalLayer",
    "gcn_collectives",
    "gcn_compute_seconds",
    "gcn_local_layers",
]


@dataclasses.dataclass(frozen=True)
class GCNProblem:
    """A full-graph GCN (or GraphSAGE-mean, GAT, GIN, R-GCN) training run of ``layers`` layers.

    ``nnz`` is the number of nonzeros of the normalised adjacency Â (stored entries, self
    loops included); :meth:`from_edges` derives it from an undirected edge count as
    ``2·E + N``. ``element_size`` is the bytes of a feature, weight and activation (4:
    float32, as Plexus trains). ``input_grad`` asks for the gradient of the input features
    (the trainer does not need it). GAT (``model="gat"``): hidden layers have ``heads`` heads
    concatenated (a hidden width splits into them), the output layer ``out_heads`` averaged.
    ``activation_checkpointing`` ``"full"``: each layer keeps only its input and runs its
    forward again in backward (:mod:`gnnpar.recompute`). R-GCN (``model="rgcn"``) has
    ``relations`` relations, whose operators' entries add up to ``nnz`` (self loops: the root
    operator's, one per node), and with ``bases`` > 0 that many bases of its weights.
    """

    nodes: int
    nnz: int
    features: int
    classes: int
    hidden: int = 128
    layers: int = 3
    model: str = "gcn"
    element_size: int = 4
    bias: bool = True
    input_grad: bool = False
    name: str = ""
    widths: tuple[int, ...] = ()
    heads: int = 8
    out_heads: int = 1
    activation_checkpointing: str = "none"
    relations: int = 0
    bases: int = 0
    #: Nodes of featureless types whose input rows are learnt (``featureless = "learn"``,
    #: :mod:`gnnpar.models.fullgraph.embedding`): the table, cut as the input block, and
    #: the first layer's input gradient, which gives the table its gradient.
    featureless_nodes: int = 0

    @property
    def wants_input_grad(self) -> bool:
        """Whether the first layer computes its input's gradient."""
        return self.input_grad or self.featureless_nodes > 0

    def __post_init__(self) -> None:
        checkpointing(self.activation_checkpointing, ("none", "full"))
        keys = ("nodes", "nnz", "features", "classes", "hidden", "layers", "element_size")
        for key in (*keys, "heads", "out_heads"):
            positive(key, getattr(self, key))
        if self.model not in ("gcn", "sage", "gat", "gin", "rgcn"):
            raise PlanError(f"model must be gcn, sage, gat, gin or rgcn, got {self.model!r}")
        if (self.model == "rgcn") != (self.relations > 0):
            raise PlanError(
                f"relations ({self.relations}) must be positive for rgcn and 0 for other models"
            )
        if self.bases < 0 or (self.bases and self.model != "rgcn"):
            raise PlanError(f"bases ({self.bases}) are an rgcn's, >= 1 (0: none)")
        if self.widths:
            for w in self.widths:
                positive("width", w)
            w = self.widths
            if len(w) != self.layers + 1 or w[0] != self.features or w[-1] != self.classes:
                raise PlanError(
                    f"widths {list(w)} must run from features {self.features} to classes "
                    f"{self.classes} over {self.layers} layers"
                )

    @classmethod
    def from_widths(cls, nodes: int, nnz: int, widths: list[int], **kwargs: object) -> GCNProblem:
        """A problem whose layer boundaries have the given ``widths`` (features first,
        classes last; hidden widths may differ)."""
        if len(widths) < 2:
            raise PlanError(f"widths need at least an input and an output, got {widths}")
        hidden = widths[1] if len(widths) > 2 else widths[-1]
        return cls(
            nodes=nodes,
            nnz=nnz,
            features=widths[0],
            classes=widths[-1],
            hidden=hidden,
            layers=len(widths) - 1,
            widths=tuple(widths),
            **kwargs,
        )

    @classmethod
    def from_edges(cls, nodes: int, edges: int, **kwargs: object) -> GCNProblem:
        """A problem on a graph of ``edges`` undirected edges: Â holds both directions of
        each and a self loop per node (``nnz = 2·edges + nodes``)."""
        positive("edges", edges)
        positive("nodes", nodes)
        return cls(nodes=nodes, nnz=2 * edges + nodes, **kwargs)

    @property
    def dims(self) -> list[int]:
        """Feature widths of every layer boundary: features, hidden…, classes."""
        if self.widths:
            return list(self.widths)
        return [self.features] + [self.hidden] * (self.layers - 1) + [self.classes]

    def layer_heads(self, layer: int) -> tuple[int, int]:
        """GAT: (heads, features per head) of ``layer`` (hidden layers concatenate their
        heads, the output layer averages ``out_heads`` heads of the classes)."""
        dims = self.dims
        if layer == len(dims) - 2:
            return self.out_heads, dims[-1]
        if dims[layer + 1] % self.heads:
            raise PlanError(
                f"hidden width {dims[layer + 1]} does not split into {self.heads} heads"
            )
        return self.heads, dims[layer + 1] // self.heads

    @property
    def num_ops(self) -> int:
        """Sparse operators per layer (GraphSAGE-mean stacks the root term: 2; R-GCN one per
        relation and the root: relations + 1)."""
        if self.model == "rgcn":
            return self.relations + 1
        return 2 if self.model == "sage" else 1

    @property
    def weight_blocks(self) -> int:
        """(in × out) weight blocks a layer stores: one per operator, or with R-GCN bases
        the bases and the root."""
        return self.bases + 1 if self.bases else self.num_ops

    def operator_entries(self, nnz: float, rows: int) -> float:
        """Stored entries of a layer's operators on a block of ``nnz`` adjacency entries and
        ``rows`` rows: every operator's ``nnz`` (as for GraphSAGE's root), but R-GCN's
        relations split the entries among them, and its root has one per row."""
        return nnz + rows if self.model == "rgcn" else self.num_ops * nnz


class LocalLayer(NamedTuple):
    """Rank 0's block of full-graph layer ``index``: the 3D layout and its sizes, with the
    nonzeros of its Â block assuming they spread evenly (Plexus's permutation gets within 1%)."""

    index: int
    layout: Any
    rows: int
    cols: int
    fin: int
    fout: int
    nnz: float


def gcn_local_layers(problem: GCNProblem, shape: Mapping[str, int]) -> list[LocalLayer]:
    """Rank 0's block of every layer of ``problem`` on ``shape`` (for the compute and memory
    models)."""
    g = grid_shape(shape)
    n, dims = problem.nodes, problem.dims
    out = []
    for i in range(len(dims) - 1):
        lay = layout3d(g, i, n, dims[i], dims[i + 1], problem.weight_blocks)
        rows = lay.rows[1] - lay.rows[0]
        cols = lay.cols[1] - lay.cols[0]
        nnz = problem.nnz * (rows / n) * (cols / n)
        out.append(
            LocalLayer(i, lay, rows, cols, lay.fin[1] - lay.fin[0], lay.fout[1] - lay.fout[0], nnz)
        )
    return out


def gcn_collectives(
    problem: GCNProblem,
    shape: Mapping[str, int],
    coords: Mapping[str, int] | None = None,
    loss: bool = True,
) -> list[Collective]:
    """Collectives of one full-graph training epoch (forward, loss, backward) on the rank
    at ``coords`` (default: rank 0, which holds the largest chunks)."""
    g = grid_shape(shape, coords)
    if g.data != 1:
        raise Infeasible(f"full-graph training has no batch to split over data={g.data}")
    e, ops, n = problem.element_size, problem.num_ops, problem.nodes
    dims = problem.dims
    out: list[Collective] = []
    last = None
    for i in range(len(dims) - 1):
        lay = layout3d(g, i, n, dims[i], dims[i + 1], problem.weight_blocks)
        grad_in = i > 0 or problem.wants_input_grad
        # the layer's own description of its traffic (what the layer's accounting uses too)
        if problem.model == "gat":
            heads, head_dim = problem.layer_heads(i)
            steps = gat3d_layer_schedule(g, lay, heads, head_dim, dims[i + 1], i == 0, problem.bias)
        elif problem.model == "gin":
            steps = gin3d_layer_schedule(g, lay, dims[i + 1], i == 0, problem.bias)
        else:
            steps = layer_schedule(g, lay, ops, i == 0, grad_in, problem.bias, bases=problem.bases)
        out += [Collective(s.axis, s.kind, s.group, round(s.nbytes(e)), s.what) for s in steps]
        if problem.activation_checkpointing == "full":  # backward runs the forward again
            out += [
                Collective(s.axis, s.kind, s.group, round(s.nbytes(e)), f"recompute: {s.what}")
                for s in steps
                if s.phase == "forward"
            ]
        last = lay
    if loss and last is not None:
        rows = last.rows[1] - last.rows[0]
        pcls, prow = g.size(last.outer), g.size(last.depth)
        for what in ("loss row max", "loss sum exp", "loss target logit"):
            out += collective(last.outer, "all_reduce", pcls, rows * e, what)
        out += collective(last.depth, "all_reduce", prow, e, "loss value")
        out += collective(last.depth, "all_reduce", prow, 8, "loss mask count (float64)")
    return out


def gcn_compute_seconds(
    problem: GCNProblem, shape: Mapping[str, int], machine: Machine
) -> dict[str, float]:
    """Seconds of one full-graph epoch on rank 0: ``{"spmm", "gemm", "elementwise"}``.
    Nonzeros are assumed spread evenly over blocks (Plexus's permutation gets within 1%).
    A layer whose input needs no gradient (the first, on raw features) runs neither the
    transposed SpMM nor dAGG's GEMM. Full activation checkpointing runs every layer's
    forward once more."""
    e, ops = problem.element_size, problem.num_ops
    out = {"spmm": 0.0, "gemm": 0.0, "elementwise": 0.0}
    g = grid_shape(shape)
    for i, lay, rows, cols, fin, fout, nnz in gcn_local_layers(problem, shape):
        entries = problem.operator_entries(nnz, rows)
        spmm_flops = 2.0 * entries * fin
        spmm_bytes = entries * (8 + e) + ops * (rows + cols) * fin * e
        one = max(spmm_flops / (machine.spmm_gflops * 1e9), stream_seconds(spmm_bytes, machine))
        # backward's SpMM and dAGG = dOUT·Wᵀ only make H's gradient: none for raw features
        grad_in = i > 0 or problem.wants_input_grad
        again = problem.activation_checkpointing == "full"  # the forward, once more
        out["spmm"] += (1 + grad_in + again) * one
        gemms = 2 + grad_in + again  # AGG·W and dW = AGGᵀ·dOUT, then dAGG
        out["gemm"] += gemms * gemm_seconds(rows, ops * fin, fout, e, machine)
        out["elementwise"] += stream_seconds((8 + 4 * again) * rows * fout * e, machine)
        out["elementwise"] += stream_seconds(28 * ops * fin * fout / g.size(lay.depth), machine)
    share = machine.compute_share(g.world_size)
    return {k: v / share for k, v in out.items()}
