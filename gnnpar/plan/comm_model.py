"""Communication of one training step, collective by collective, and its time.

:func:`gcn_collectives` lists what one full-graph epoch of :mod:`gnnpar.models.fullgraph.plexus`
sends (forward, the sharded loss, backward with the bias gradients), each layer's part taken
from the layer's own schedule (:func:`gnnpar.models.fullgraph.plexus.layer_schedule`);
:func:`gpt_collectives`
what one optimizer step of :func:`gnnpar.tensor.train.train_step` sends (embeddings, every
3D tensor-parallel ``Linear`` as :func:`gnnpar.tensor.parallelize` lays it out, the
vocabulary-parallel loss, the data/z gradient reduction, the gradient-norm and loss
all-reduces, and with a context axis the ring attention's point-to-point sends). Each
:class:`Collective` carries the per-rank ring bytes exactly as :mod:`gnnpar.comm` records them
(pieces padded to the largest, rounded once per call), so the sums equal measured traffic byte
for byte; tests check this for every grid of 8 ranks.

Placement (:func:`intra_node_axes`): ranks are numbered x fastest, then y, z, context, data,
pipe; a node holds ``ranks_per_node`` consecutive ranks; a group is intra-node when every
group along that axis lies inside one node (for a single axis: stride × size divides
ranks_per_node). :func:`comm_seconds` prices each collective with the machine's α–β model for
its placement.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch

from gnnpar.comm import ring_bytes
from gnnpar.grid import AXES, COMBINED_AXES, GridShape, _rank_at, axes_of
from gnnpar.models.fullgraph.gat import gat3d_layer_schedule, gin3d_layer_schedule
from gnnpar.models.fullgraph.layout import layout3d
from gnnpar.models.fullgraph.plexus import layer_schedule
from gnnpar.plan.machines import Machine
from gnnpar.plan.problems import GCNProblem, GPTProblem, PlanError
from gnnpar.tensor.layout import ShardLayout

__all__ = [
    "Collective",
    "ShardedLayer",
    "batch_per_rank",
    "context_collectives",
    "seq_per_rank",
    "bytes_by_axis_kind",
    "grid_shape",
    "Infeasible",
    "LocalLayer",
    "bytes_by_axis",
    "comm_seconds",
    "gcn_collectives",
    "gcn_local_layers",
    "gpt_collectives",
    "gpt_layout",
    "intra_node_axes",
    "local_params",
    "meta_gpt",
]


class Infeasible(PlanError):
    """The grid shape cannot run this problem (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective (repeated ``count`` times) as this rank sees it: ``nbytes`` are the
    ring bytes of one call, rounded as :mod:`gnnpar.comm` records them."""

    axis: str
    kind: str
    group: int
    nbytes: int
    what: str
    count: int = 1

    @property
    def total(self) -> int:
        """Bytes of all ``count`` calls."""
        return self.nbytes * self.count


def _coll(axis: str, kind: str, p: int, full_bytes: float, what: str, count: int = 1):
    """[Collective] for a buffer of ``full_bytes`` over ``p`` ranks, or [] when p == 1."""
    if p <= 1:
        return []
    return [Collective(axis, kind, p, round(ring_bytes(kind, full_bytes, p)), what, count)]


def bytes_by_axis(collectives: Iterable[Collective]) -> dict[str, int]:
    """Total bytes per axis (what ``Traffic.by_axis()`` measures)."""
    out: dict[str, int] = {}
    for c in collectives:
        out[c.axis] = out.get(c.axis, 0) + c.total
    return out


def bytes_by_axis_kind(collectives: Iterable[Collective]) -> dict[str, dict[str, int]]:
    """``{axis: {kind: bytes}}`` (what ``Traffic.as_dict()`` measures)."""
    out: dict[str, dict[str, int]] = {}
    for c in collectives:
        d = out.setdefault(c.axis, {})
        d[c.kind] = d.get(c.kind, 0) + c.total
    return out


# ------------------------------------------------------------------------------ placement
def intra_node_axes(shape: Mapping[str, int], ranks_per_node: int) -> dict[str, bool]:
    """For every axis name (single and combined): whether all its groups sit inside one
    node, for ranks numbered x fastest and nodes of ``ranks_per_node`` consecutive ranks."""
    full = {a: int(shape.get(a, 1)) for a in AXES}
    stride, s = {}, 1
    for a in AXES:
        stride[a] = s
        s *= full[a]
    out = {}
    for name in (*AXES, *COMBINED_AXES):
        axes = axes_of(name)
        inside = [a for a in axes if full[a] > 1]
        if not inside:
            out[name] = True
            continue
        others = [a for a in AXES if a not in axes]
        # members lie between base and base + span; a node is a range of ranks, so the
        # group is inside one node when its first and last member are
        span = sum((full[a] - 1) * stride[a] for a in inside)
        ok = True
        for combo in itertools.product(*(range(full[a]) for a in others)):
            base = sum(i * stride[a] for a, i in zip(others, combo, strict=True))
            if base // ranks_per_node != (base + span) // ranks_per_node:
                ok = False
                break
        out[name] = ok
    return out


def comm_seconds(
    collectives: Iterable[Collective],
    shape: Mapping[str, int],
    machine: Machine,
) -> dict[str, float]:
    """Seconds per axis of ``collectives`` on ``machine`` (no overlap with compute)."""
    world = 1
    for a in AXES:
        world *= int(shape.get(a, 1))
    intra = intra_node_axes(shape, machine.ranks_per_node(world))
    out: dict[str, float] = {}
    for c in collectives:
        t = machine.collective_seconds(c.kind, c.group, c.nbytes, intra[c.axis]) * c.count
        out[c.axis] = out.get(c.axis, 0.0) + t
    return out


def grid_shape(shape: Mapping[str, int], coords: Mapping[str, int] | None = None) -> GridShape:
    """The :class:`GridShape` of ``shape`` seen from the rank at ``coords`` (default 0)."""
    g = GridShape(**{a: int(shape.get(a, 1)) for a in AXES})
    if coords is None:
        return g
    return dataclasses.replace(g, global_rank=_rank_at(g.sizes(), coords))


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
        lay = layout3d(g, i, n, dims[i], dims[i + 1], problem.num_ops)
        rows = lay.rows[1] - lay.rows[0]
        cols = lay.cols[1] - lay.cols[0]
        nnz = problem.nnz * (rows / n) * (cols / n)
        out.append(
            LocalLayer(i, lay, rows, cols, lay.fin[1] - lay.fin[0], lay.fout[1] - lay.fout[0], nnz)
        )
    return out


# --------------------------------------------------------------------------- full graph
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
        lay = layout3d(g, i, n, dims[i], dims[i + 1], ops)
        grad_in = i > 0 or problem.input_grad
        # the layer's own description of its traffic (what the layer's accounting uses too)
        if problem.model == "gat":
            heads, head_dim = problem.layer_heads(i)
            steps = gat3d_layer_schedule(g, lay, heads, head_dim, dims[i + 1], i == 0, problem.bias)
        elif problem.model == "gin":
            steps = gin3d_layer_schedule(g, lay, dims[i + 1], i == 0, problem.bias)
        else:
            steps = layer_schedule(g, lay, ops, i == 0, grad_in, problem.bias)
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
            out += _coll(last.outer, "all_reduce", pcls, rows * e, what)
        out += _coll(last.depth, "all_reduce", prow, e, "loss value")
        out += _coll(last.depth, "all_reduce", prow, 8, "loss mask count (float64)")
    return out


# ---------------------------------------------------------------------------------- GPT
@dataclasses.dataclass(frozen=True)
class ShardedLayer:
    """One sharded layer of the GPT as :func:`gnnpar.tensor.parallelize` lays it out."""

    name: str
    kind: str  # "linear" or "embedding"
    layout: ShardLayout
    transpose: bool
    scatter_input: bool
    gather_output: bool
    tokens: str  # "batch" (B·T tokens of this rank) or "positions" (T)
    bias: ShardLayout | None
    count: int
    tied_to: str | None = None


def meta_gpt(problem: GPTProblem) -> torch.nn.Module:
    """A one-block GPT of ``problem``'s widths on the meta device (no memory): what
    :func:`gpt_layout` lays out. Build it once when laying out many shapes."""
    from gnnpar.models.gpt.model import GPT

    with torch.device("meta"):
        return GPT(dataclasses.replace(problem.model, n_layer=1))


def gpt_layout(
    problem: GPTProblem, shape: Mapping[str, int], model: torch.nn.Module | None = None
) -> list[ShardedLayer]:
    """The sharded layers of one GPT (block 0 stands for all ``layers`` blocks), with the
    styles :func:`gnnpar.tensor.plan_styles` chooses on this shape; raises
    :class:`Infeasible` when the shape cannot hold the model (heads or features that do
    not split). ``model`` is :func:`meta_gpt` of the problem (built when not given)."""
    from gnnpar.tensor.parallelize import plan_styles

    g = grid_shape(shape, None)
    model = meta_gpt(problem) if model is None else model
    try:
        styles = plan_styles(model, g)["styles"]
    except ValueError as err:
        raise Infeasible(str(err)) from None
    mods = dict(model.named_modules())
    out = []
    for name, style in styles.items():
        m = mods[name]
        in_axis, out_axis = ("y", "x") if style.transpose else ("x", "y")
        count = problem.layers if name.startswith("blocks.") else 1
        try:
            if isinstance(m, torch.nn.Embedding):
                lay = ShardLayout.matrix(m.num_embeddings, m.embedding_dim, g, out_axis, in_axis)
                kind, bias = "embedding", None
            else:
                lay = ShardLayout.matrix(
                    m.out_features, m.in_features, g, out_axis, in_axis, style.fused
                )
                kind = "linear"
                bias = None
                if m.bias is not None:
                    bias = ShardLayout.vector(m.out_features, g, out_axis, style.fused)
        except ValueError as err:
            raise Infeasible(f"{name}: {err}") from None
        tied = "lm_head" if (problem.tie and name == "wte") else None
        out.append(
            ShardedLayer(
                name,
                kind,
                lay,
                style.transpose,
                style.scatter_input,
                style.gather_output,
                "positions" if name == "wpe" else "batch",
                bias,
                count,
                tied,
            )
        )
    return out


def batch_per_rank(problem: GPTProblem, g: GridShape) -> int:
    """Sequences each rank holds (the batch is split over data and z)."""
    shards = g.data * g.z
    if problem.batch % shards:
        raise Infeasible(f"batch {problem.batch} does not divide over data*z = {shards}")
    return problem.batch // shards


def seq_per_rank(problem: GPTProblem, g: GridShape) -> int:
    """Tokens of each sequence a rank holds (the sequence is split over context)."""
    if g.context > 1 and problem.seq % (2 * g.context):
        raise Infeasible(
            f"sequence of {problem.seq} does not cut into 2·context = {2 * g.context} chunks"
        )
    return problem.seq // g.context


def _folded(g: GridShape, coords: Mapping[str, int]) -> tuple[GridShape, dict[str, int]]:
    """The grid and coordinates :mod:`gnnpar.shard` sees (:func:`gnnpar.grid.fold_context`)."""
    if g.context == 1:
        return g, dict(coords)
    folded = dataclasses.replace(g, data=g.data * g.context, context=1)
    c = dict(coords)
    c["data"], c["context"] = c["context"] + g.context * c["data"], 0
    return folded, c


def context_collectives(
    problem: GPTProblem, g: GridShape, heads_parts: int
) -> list[Collective]:
    """The ring attention's point-to-point sends of one step (:mod:`gnnpar.tensor.context`):
    per layer, forward (C−1) hops of this rank's keys and values, backward (C−1) hops of them
    and C hops of their gradients; ``heads_parts`` ranks split the heads."""
    from gnnpar.tensor.context import ring_bytes as context_ring_bytes

    c = g.context
    if c == 1:
        return []
    keys = (
        batch_per_rank(problem, g) * (problem.heads // heads_parts) * seq_per_rank(problem, g)
        * (problem.hidden // problem.heads) * problem.element_size
    )  # fmt: skip
    forward, backward = context_ring_bytes(keys, c)
    return [
        Collective("context", "p2p", c, forward, "ring attention: keys and values", problem.layers),
        Collective("context", "p2p", c, backward, "ring attention backward: keys, values and "
                   "their gradients", problem.layers),
    ]  # fmt: skip


def _module_collectives(
    m: ShardedLayer,
    g: GridShape,
    coords: Mapping[str, int],
    tokens: int,
    e: int,
    forward_only: bool = False,
) -> list[Collective]:
    """One sharded layer's collectives, forward and backward (``forward_only``: the forward's,
    which a recompute runs again)."""
    lay = m.layout
    r, c = coords[lay.row_axis], coords[lay.col_axis]
    rs, cs = lay.row_sizes(), lay.col_sizes()
    po, pi, pz = lay.row_parts, lay.col_parts, lay.depth
    z_full = pz * lay.shard_numel(r, c) * e
    out: list[Collective] = []
    if m.kind == "linear" and po * pi * pz == 1:
        return out
    i_ax, o_ax, n = lay.col_axis, lay.row_axis, m.count
    out += _coll("z", "all_gather", pz, z_full, f"{m.name} gather W over z", n)
    if m.kind == "embedding":
        out += _coll(o_ax, "all_reduce", po, tokens * cs[c] * e, f"{m.name} lookup", n)
        if m.gather_output:
            out += _coll(i_ax, "all_gather", pi, pi * max(cs) * tokens * e, f"{m.name} out", n)
        out += _coll("z", "reduce_scatter", pz, z_full, f"{m.name} dW over z", n)
        return out
    out += _coll(i_ax, "all_reduce", pi, tokens * rs[r] * e, f"{m.name} Y = X·Wᵀ", n)
    if m.gather_output:
        out += _coll(o_ax, "all_gather", po, po * max(rs) * tokens * e, f"{m.name} gather Y", n)
    if forward_only:
        return out
    out += _coll(o_ax, "all_reduce", po, tokens * cs[c] * e, f"{m.name} dX", n)
    out += _coll("z", "reduce_scatter", pz, z_full, f"{m.name} dW over z", n)
    if m.scatter_input:
        out += _coll(i_ax, "all_gather", pi, pi * max(cs) * tokens * e, f"{m.name} gather dX", n)
    return out


def local_params(
    problem: GPTProblem, mods: list[ShardedLayer], coords: Mapping[str, int]
) -> tuple[int, int]:
    """(matrix elements, other elements) this rank stores (tied matrices once)."""
    matrix = vector = 0
    for m in mods:
        lay = m.layout
        if m.name != "lm_head" or not problem.tie:
            matrix += lay.shard_numel(coords[lay.row_axis], coords[lay.col_axis]) * m.count
        if m.bias is not None:
            vector += m.bias.row_sizes()[coords[m.bias.row_axis]] * m.count
    norms = (2 if problem.bias else 1) * problem.hidden
    vector += norms * (2 * problem.layers + 1)
    return matrix, vector


def gpt_collectives(
    problem: GPTProblem,
    shape: Mapping[str, int],
    coords: Mapping[str, int] | None = None,
    layout: list[ShardedLayer] | None = None,
) -> list[Collective]:
    """Collectives of one GPT optimizer step on the rank at ``coords`` (default rank 0);
    ``layout`` is :func:`gpt_layout` of the shape (computed when not given)."""
    g = grid_shape(shape, None)
    coords = g.coords(0) if coords is None else dict(coords)
    mods = gpt_layout(problem, shape) if layout is None else layout
    b_loc, t_loc = batch_per_rank(problem, g), seq_per_rank(problem, g)
    e = problem.element_size
    out: list[Collective] = []
    for m in mods:
        tokens = t_loc if m.tokens == "positions" else b_loc * t_loc
        out += _module_collectives(m, g, coords, tokens, e)
        if problem.activation_checkpointing == "full" and m.name.startswith("blocks."):
            again = _module_collectives(m, g, coords, tokens, e, forward_only=True)
            out += [dataclasses.replace(c, what=f"recompute: {c.what}") for c in again]
    qkv = next(m for m in mods if m.name.endswith("attn.qkv"))
    out += context_collectives(problem, g, qkv.layout.row_parts)
    head = next(m for m in mods if m.name == "lm_head")
    p = head.layout.row_parts
    ce = max(e, 4)  # the loss works in float32 at least
    tokens = b_loc * t_loc
    out += _coll(head.layout.row_axis, "all_reduce", p, tokens * ce, "loss max")
    out += _coll(head.layout.row_axis, "all_reduce", p, 2 * tokens * ce, "loss sums")
    # context ranks reduce their gradients with the data ranks (bytes count under "data")
    fg, fcoords = _folded(g, coords)
    out += _gradient_sync(problem, mods, fg, fcoords)
    if problem.grad_clip:
        if problem.stage > 0:  # each data rank holds part of every gradient
            out += _coll("data", "all_reduce", fg.data, 8, "grad norm over data (float64)")
        out += _coll("tensor", "all_reduce", g.size("tensor"), 8, "grad norm (float64)")
    out += _coll("z", "all_reduce", g.z, 8, "loss mean over z (float64)")
    out += _coll("context", "all_reduce", g.context, 8, "loss mean over context (float64)")
    out += _coll("data", "all_reduce", g.data, 8, "loss mean over data (float64)")
    return out


def _gradient_sync(
    problem: GPTProblem, mods: list[ShardedLayer], g: GridShape, coords: Mapping[str, int]
) -> list[Collective]:
    """:mod:`gnnpar.shard`'s gradient reduction (stage 0): every gradient all-reduced over
    data, those the tensor layers replicate over z (not the matrices) first summed over z;
    stages 1–3 replace the data-axis all-reduce with ZeRO's reduce-scatter and all-gathers."""
    e = problem.element_size
    matrix, other = local_params(problem, mods, coords)
    buckets: dict[tuple[str, ...], int] = {}
    for axes, n in ((("data",), matrix), (("z", "data"), other)):
        key = tuple(a for a in axes if g.size(a) > 1)
        if key:
            buckets[key] = buckets.get(key, 0) + n
    out: list[Collective] = []
    for axes, n in buckets.items():
        for a in axes:
            if a == "data" and problem.stage > 0:
                out += _coll(a, "reduce_scatter", g.data, n * e, "ZeRO gradient reduce-scatter")
                out += _coll(a, "all_gather", g.data, n * e, "ZeRO parameter all-gather")
                if problem.stage == 3:
                    out += _coll(a, "all_gather", g.data, n * e, "ZeRO-3 backward re-gather")
            else:
                out += _coll(a, "all_reduce", g.size(a), n * e, f"gradient sync over {a}")
    return out
