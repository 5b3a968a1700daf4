"""The planner's model of a user's PyG model on the full-graph grid (``gnnpar plan gcn
--model FILE:FACTORY``, and the grid ``gnnpar train gcn --model`` picks without ``--grid``).

The model is run once on a tiny stand-in graph through a :class:`TraceShare`, which records
every op the parallel forwards ask of a share (what, how wide, whether a gradient flows back
through it) and moves nothing. :func:`pyg_collectives` prices that trace on any x · y·z
shape with the same formulas the :class:`~gnnpar.models.fullgraph.share.GraphShare` records
as it sends (the tests hold both against the measured bytes), and :func:`rank_pyg` ranks the
shapes with the machine's bandwidths and the SpMM's speed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gnnpar.comm import chunk_sizes
from gnnpar.models.fullgraph.layout import chunk
from gnnpar.models.pyg.model import gradient_parameters, parallel_forwards, typed_model
from gnnpar.plan.comm_model import Collective, collective
from gnnpar.plan.machines import Machine
from gnnpar.plan.rank import Candidate, best_first, evaluate, grid_shapes
from gnnpar.sparse import attention
from gnnpar.sparse.csr import from_coo

#: Nodes of the stand-in graph the trace runs on (only the widths matter).
TRACE_NODES = 4


@dataclasses.dataclass(frozen=True)
class TracedOp:
    """One op a parallel forward asked of its share: ``op`` (a method of the share's),
    ``width`` (values per node row, or per statistic) and ``grad`` (its adjoint runs)."""

    op: str
    width: int
    grad: bool


class TraceShare:
    """A share over a graph of :data:`TRACE_NODES` self loops that records each op."""

    checkpointing = False
    num_nodes = num_block_rows = TRACE_NODES

    def __init__(self) -> None:
        self.ops: list[TracedOp] = []
        n = TRACE_NODES
        ids = torch.arange(n)
        self._block = from_coo(ids, ids, torch.ones(n), (n, n))
        self._edges = attention.Edges(self._block)

    def _note(self, op: str, t: torch.Tensor) -> None:
        width = t[0].numel() if t.dim() > 1 else t.numel()
        self.ops.append(TracedOp(op, int(width), bool(t.requires_grad)))

    def gather_cols(self, h, what=""):  # noqa: D102
        self._note("gather_cols", h)
        return h

    def gather_rows(self, v, what=""):  # noqa: D102
        self._note("gather_rows", v)
        return v

    def scatter_rows(self, p, what=""):  # noqa: D102
        self._note("scatter_rows", p)
        return p

    def propagate(self, kind, h, what=""):  # noqa: D102
        return self.scatter_rows(self.gather_cols(h))

    def edges(self, kind):  # noqa: D102
        return self._edges.rows, self._edges.cols

    def attention_edges(self):  # noqa: D102
        return self._edges

    def softmax(self, e, rows):  # noqa: D102
        self._note("row_max", e.detach())
        self._note("row_sum", e)
        return torch.ones_like(e)

    def neighbour_max(self, h):  # noqa: D102
        self._note("gather_cols", h)
        self._note("row_max", h.detach())
        self._note("row_max", h.detach())  # the count of the entries attaining it
        self._note("max_gradient", h)
        return h

    def node_sum(self, t, what):  # noqa: D102
        self._note("node_sum", t)
        return t

    def relation_edges(self, relations):  # noqa: D102
        return [(self._edges.rows, self._edges.cols)] * relations

    def relation_partials(self, hc, relations):  # noqa: D102
        return [hc] * relations  # local products: nothing sent


def trace_model(model: nn.Module, in_channels: int, input_grad: bool = False) -> list[TracedOp]:
    """The ops one forward of ``model`` (in training mode) asks of its share; ``input_grad``:
    the input's gradient is wanted (learnt featureless rows), so the first ops' adjoints
    run too."""
    share = TraceShare()
    was_training = model.training
    model.train()
    try:
        with parallel_forwards(model, share):
            first = next(iter(model.parameters()), None)
            dtype = first.dtype if first is not None else torch.float32
            x = torch.zeros(TRACE_NODES, in_channels, dtype=dtype, requires_grad=input_grad)
            # a typed model (RGCNConv, RGATConv) is called as model(x, edge_index, edge_type)
            model(x, share, share) if typed_model(model) else model(x, share)
    finally:
        model.train(was_training)
    return share.ops


def pyg_collectives(
    ops: list[TracedOp],
    param_sizes: list[int],
    nodes: int,
    shape: Mapping[str, int],
    element_size: int = 4,
    param_element_size: int = 4,
    recompute: bool = False,
) -> list[Collective]:
    """The collectives of one forward and backward on rank 0 of ``shape`` (x, y, z) for the
    traced ``ops`` of a graph of ``nodes`` nodes, and the gradient sums of parameters of
    ``param_sizes`` elements; ``recompute``: activation checkpointing runs the forward ones
    again (those of the convolutions)."""
    x = shape.get("x", 1)
    yz = shape.get("y", 1) * shape.get("z", 1)
    p = x * yz
    lo, hi = chunk(nodes, x, 0)
    sub = max(chunk_sizes(hi - lo, yz))
    row_parts = [chunk_sizes(n, yz)[0] for n in chunk_sizes(nodes, x)]
    rows_x, row_max = sum(row_parts), max(row_parts)
    e = element_size
    forward: list[Collective] = []
    backward: list[Collective] = []
    for t in ops:
        w = t.width
        if t.op == "gather_cols":
            f = collective("yz", "all_gather", yz, yz * sub * w * e, "gather columns")
            b = collective("yz", "reduce_scatter", yz, yz * sub * w * e, "gather columns (grad)")
        elif t.op in ("gather_rows", "scatter_rows"):
            kinds = ("all_gather", "reduce_scatter")
            fwd, bwd = kinds if t.op == "gather_rows" else kinds[::-1]
            f = collective("x", fwd, x, x * row_max * w * e, t.op)
            b = collective("x", bwd, x, x * row_max * w * e, t.op + " (grad)")
        elif t.op in ("row_max", "row_sum"):
            f = collective("x", "all_reduce", x, rows_x * w * e, t.op)
            b = collective("x", "all_reduce", x, rows_x * w * e, t.op + " (grad)")
        elif t.op == "max_gradient":
            f, b = [], collective("x", "all_gather", x, x * row_max * w * e, "max (grad)")
        elif t.op == "node_sum":
            f = collective("tensor", "all_reduce", p, w * e, "node sum")
            b = collective("tensor", "all_reduce", p, w * e, "node sum (grad)")
        else:
            raise ValueError(f"unknown traced op {t.op!r}")
        forward += f
        if t.grad:
            backward += b
    grads = [
        c
        for n in param_sizes
        for c in collective("tensor", "all_reduce", p, n * param_element_size, "gradient")
    ]
    again = [dataclasses.replace(c, what=f"recompute: {c.what}") for c in forward]
    return forward + backward + grads + (again if recompute else [])


def pyg_compute_seconds(ops: list[TracedOp], nnz: int, shape, machine) -> dict[str, float]:
    """The aggregations' SpMMs on rank 0 (nonzeros spread evenly), forward and backward."""
    p = math.prod(shape.get(a, 1) for a in ("x", "y", "z"))
    passes = [(t.width, 2 if t.grad else 1) for t in ops if t.op == "gather_cols"]
    flops = sum(2.0 * nnz / p * width * n for width, n in passes)
    return {"spmm": flops / (machine.spmm_gflops * 1e9) / machine.compute_share(p)}


def rank_pyg(
    model: nn.Module,
    in_channels: int,
    nodes: int,
    nnz: int,
    world: int,
    machine: Machine,
    element_size: int = 4,
    recompute: bool = False,
    input_grad: bool = False,
) -> list[Candidate]:
    """Every x·y·z shape of ``world`` ranks for ``model`` full-graph, best first
    (``input_grad``: with learnt featureless rows, :func:`trace_model`)."""
    ops = trace_model(model, in_channels, input_grad)
    params = [q.numel() for q in gradient_parameters(model)]
    return best_first(
        evaluate(
            s,
            machine,
            lambda s=s: pyg_collectives(ops, params, nodes, s, element_size, 4, recompute),
            lambda s=s: pyg_compute_seconds(ops, nnz, s, machine),
            lambda: {},
        )
        for s in grid_shapes(world, data=False)
    )


def choose_pyg_grid(model: nn.Module, *args: Any, **options: Any) -> dict[str, int]:
    """The best shape of :func:`rank_pyg` (called with its arguments): what ``gnnpar train
    gcn --model`` runs on."""
    from gnnpar.plan.rank import best_shape

    shape = best_shape(rank_pyg(model, *args, **options), "user model")
    return {a: shape.get(a, 1) for a in ("x", "y", "z")}
