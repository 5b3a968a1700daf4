"""``gnnpar plan link`` (:data:`PLANNER`): the link task's shapes ranked with the models the
node tasks already have, plus what only link prediction does.

**Mini-batch** (``mode minibatch``): every rank on the data axis holds the graph, so the
shape is ``data = --gpus``; what is ranked are the ZeRO stages (0-3, or the one
``--zero-stage`` names). An edge batch of b positives and k negatives per positive has up to
(2 + k)·b seeds (each positive's two endpoints and its k negatives; fewer are distinct), so
the memory is :func:`~gnnpar.models.minibatch.cost.minibatch_memory` of a one-rank problem
(every rank holds the whole graph) whose batch is a rank's ``(2 + k)·b / D`` seeds, with the
link model's own parameters (:func:`~gnnpar.plan.memory.sharded_state` of the stage over D
ranks), the training edges' ids and the split's arrays in place of the node task's. The
communication is :mod:`gnnpar.shard`'s gradient reduction of one step: an all-reduce of every
gradient (stage 0), a reduce-scatter and an all-gather (1, 2), and ZeRO-3's second gather in
backward (without FCDP).

**Full graph** (``mode full``): every x·y·z shape (or the one ``--grid`` names), priced by
:func:`~gnnpar.models.fullgraph.pyg_planning.pyg_collectives` over the traced encoder (with
the decoder's gradient sums) plus the pair scoring's all-to-all
(:func:`pair_fetch_collectives`): rank 0 scores ``b = ceil(E / P)`` training positives
and their negatives, whose ``(2 + k)·b`` endpoint rows live on another of the P ranks with
expected fraction ``(P - 1) / P``; forward it sends one count per peer, the ids of those
rows (8 bytes each) and as many rows to the ranks that ask (hidden × element size each,
the same number in expectation), backward the gradients of its rows (as many bytes again).
The encoder's activations are not in the memory column (as for ``gnnpar plan gcn --model``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from gnnpar.errors import UserError
from gnnpar.fmt import count
from gnnpar.models.fullgraph.embedding import featureless_nodes
from gnnpar.models.fullgraph.layout import chunk
from gnnpar.models.fullgraph.pyg_planning import pyg_collectives, pyg_compute_seconds, trace_model
from gnnpar.models.minibatch.cost import (
    MiniBatchProblem,
    degree_histogram,
    expected_blocks,
    minibatch_memory,
)
from gnnpar.models.pyg.model import gradient_parameters
from gnnpar.plan.comm_model import Collective, collective
from gnnpar.plan.command import PlanCommand, add_machine_options, machine_from, report
from gnnpar.plan.compute import gemm_seconds, stream_seconds
from gnnpar.plan.inputs import PlanError
from gnnpar.plan.machines import Machine
from gnnpar.plan.memory import sharded_state
from gnnpar.plan.rank import Candidate, best_first, evaluate, grid_shapes
from gnnpar.train.config import ConfigError, resolve

__all__ = [
    "PLANNER",
    "LinkProblem",
    "link_full_collectives",
    "link_minibatch_memory",
    "pair_fetch_collectives",
    "rank_link_full",
    "rank_link_minibatch",
]


@dataclasses.dataclass(frozen=True)
class LinkProblem:
    """What the link planner reads of a run: the message graph (``nodes``, ``edges`` stored
    CSR entries, ``features``, its in-degree histogram ``degrees``), the split's training
    positives ``train_edges`` and its other arrays' ids (``held_out``: validation, test and
    their negatives, as ids), the negatives per positive the task draws (``negatives``: 0 on
    edge labels, which train on the positives only), and the model (``params``, the largest
    ZeRO-3 unit ``per_unit``, the element size)."""

    name: str
    nodes: int
    edges: int
    features: int
    train_edges: int
    held_out: int
    negatives: int
    params: int
    per_unit: int
    element_size: int
    degrees: tuple[tuple[int, int], ...] = ()
    #: Featureless nodes whose input rows mode full learns (their table, the input gradient).
    learnt: int = 0


# ------------------------------------------------------------------ the pair fetch
def pair_fetch_collectives(
    pairs: int,
    negatives: int,
    hidden: int,
    element_size: int,
    p: int,
    remote: float | None = None,
    served: float | None = None,
) -> list[Collective]:
    """The all-to-alls (axis ``tensor``) of one full-graph step's pair scoring on a rank
    scoring ``pairs`` positives with ``negatives`` each over ``p`` ranks
    (:func:`~gnnpar.sampling.distributed.fetch_rows`): its ``(2 + negatives)·pairs``
    endpoints, ``remote`` of which live on other ranks (default: the expected
    ``(p - 1) / p`` of them), and ``served`` rows the others ask of it (default: as many).
    Forward: one count per peer (8 bytes), the remote ids (8 bytes) and the served rows
    (``hidden × element_size`` bytes); backward the remote rows' gradients. Bytes are those
    this rank sends, as :mod:`gnnpar.comm` records them."""
    if p <= 1:
        return []
    endpoints = (2 + negatives) * pairs
    remote = endpoints * (p - 1) / p if remote is None else remote
    served = remote if served is None else served
    row = hidden * element_size
    parts = [
        ((p - 1) * 8, "pair fetch: counts"),
        (remote * 8, "pair fetch: ids"),
        (served * row, "pair fetch: rows"),
        (remote * row, "pair fetch: rows (grad)"),
    ]
    return [Collective("tensor", "all_to_all", p, round(b), what) for b, what in parts]


def link_full_collectives(
    ops: list,
    param_sizes: list[int],
    nodes: int,
    train_edges: int,
    negatives: int,
    hidden: int,
    shape: Mapping[str, int],
    element_size: int,
) -> list[Collective]:
    """Rank 0's collectives of one full-graph step on ``shape``: the traced encoder's and
    the parameters' gradient sums (:func:`pyg_collectives`), the pair fetch of its slice of
    the ``train_edges`` (the first, largest: ``ceil(E / P)``), and the loss's sum."""
    p = math.prod(shape.get(a, 1) for a in ("x", "y", "z"))
    e = element_size
    lo, hi = chunk(train_edges, p, 0)
    out = pyg_collectives(ops, param_sizes, nodes, shape, e, e)
    out += pair_fetch_collectives(hi - lo, negatives, hidden, e, p)
    return out + collective("tensor", "all_reduce", p, e, "loss sum")


def rank_link_full(
    model: torch.nn.Module,
    problem: LinkProblem,
    hidden: int,
    world: int,
    machine: Machine,
    shapes: list[dict[str, int]] | None = None,
) -> list[Candidate]:
    """Every x·y·z shape of ``world`` ranks (or ``shapes``) for full-graph link
    prediction with ``model`` (the task's :class:`~gnnpar.models.link.encoders.LinkModel`),
    best first."""
    ops = trace_model(model, problem.features, input_grad=problem.learnt > 0)
    params = [q.numel() for q in gradient_parameters(model)]
    nnz = problem.edges + problem.nodes
    e, negatives = problem.element_size, problem.negatives

    def compute(s: dict[str, int]) -> dict[str, float]:
        p = math.prod(s.get(a, 1) for a in ("x", "y", "z"))
        out = pyg_compute_seconds(ops, nnz, s, machine)
        lo, hi = chunk(problem.train_edges, p, 0)
        # the decoder reads each endpoint row, and its gradient is written back
        out["decoder"] = stream_seconds(3 * (2 + negatives) * (hi - lo) * hidden * e, machine)
        return out

    def memory(s: dict[str, int]) -> dict[str, float]:
        p = math.prod(s.get(a, 1) for a in ("x", "y", "z"))
        out = sharded_state(problem.params, e, 0, 1, problem.params)
        out["features"] = float(chunk(problem.nodes, p, 0)[1] * problem.features * e)
        if problem.learnt:  # the learnt rows of rank 0's nodes, gradient and Adam's moments
            share = problem.learnt / problem.nodes
            out["inputs"] = 4 * chunk(problem.nodes, p, 0)[1] * share * problem.features * e
        lo, hi = chunk(problem.train_edges, p, 0)
        endpoints = (2 + negatives) * (hi - lo)
        # the fetched rows and their gradients, the ids and owners of the endpoints
        out["pair rows"] = float(endpoints * (2 * hidden * e + 3 * 8))
        return out

    return best_first(
        evaluate(
            s,
            machine,
            lambda s=s: link_full_collectives(
                ops, params, problem.nodes, problem.train_edges, negatives, hidden, s, e
            ),
            lambda s=s: compute(s),
            lambda s=s: memory(s),
        )
        for s in (shapes if shapes is not None else grid_shapes(world, data=False))
    )


# ------------------------------------------------------------------ mini-batch
def _batch_problem(cfg: Any, problem: LinkProblem, data: int) -> MiniBatchProblem:
    """The node task's problem of one rank's share of an edge batch: up to (2 + k)·b / D
    seeds (capped at the graph's nodes by :func:`minibatch_memory`), on the whole graph."""
    from gnnpar.sampling import parse_fanouts

    fanouts = tuple(parse_fanouts(cfg.fanouts))
    seeds = max(1, math.ceil((2 + problem.negatives) * cfg.batch_size / data))
    return MiniBatchProblem(
        nodes=problem.nodes, edges=problem.edges, features=problem.features,
        classes=cfg.hidden, hidden=cfg.hidden, layers=len(fanouts), fanouts=fanouts,
        batch_size=seeds, element_size=problem.element_size, prefetch=cfg.prefetch,
        degrees=problem.degrees, name=problem.name,
    )  # fmt: skip


def link_minibatch_memory(
    cfg: Any, problem: LinkProblem, data: int, stage: int
) -> dict[str, float]:
    """Peak bytes of one of ``data`` ranks of a mini-batch link run at ZeRO ``stage``:
    :func:`minibatch_memory` of the one-rank problem of a rank's seeds (every rank holds
    the graph), with ``weights`` the link model's sharded state, ``sampler`` the training
    edges' ids and keys instead of the nodes', and ``pairs`` the split's arrays and each
    batch's pairs and negatives (ids, in flight as the batches are) with the decoder's
    endpoint rows. With ``sampling partitioned`` (D > 1) the node task's partitioned model
    of the same seeds (a part, its halo, the features fetched across parts), plus the whole
    message graph every rank still loads (for evaluation's full blocks)."""
    mb = _batch_problem(cfg, problem, data)
    out = minibatch_memory(mb, 1)
    if getattr(cfg, "sampling", "local") == "partitioned" and data > 1:
        whole = out
        out = minibatch_memory(_batch_problem(cfg, problem, 1), data)
        out["staging"], out["graph"] = whole["staging"], out["graph"] + whole["graph"]
    e, t = problem.element_size, problem.train_edges
    out["weights"] = sum(sharded_state(problem.params, e, stage, data, problem.per_unit).values())
    # the relabeler's scratch; this rank's edge ids and their keys, every edge's key
    out["sampler"] = problem.nodes * 8 + (3 * t / data + t) * 8
    k, b = problem.negatives, cfg.batch_size / data
    in_flight = (mb.prefetch + 2) * (2 + k) * b * 8
    rows = (2 + k) * b * cfg.hidden * e * 2  # gathered endpoint rows, then their gradients
    out["pairs"] = 2 * t * 8 + problem.held_out * 8 + problem.edges * 8 + in_flight + rows
    return out


def minibatch_collectives(problem: LinkProblem, data: int, stage: int, fcdp: bool) -> list:
    """One step's gradient reduction by :mod:`gnnpar.shard` over ``data`` ranks."""
    nbytes = problem.params * problem.element_size
    if stage == 0:
        return collective("data", "all_reduce", data, nbytes, "gradient all-reduce")
    out = collective("data", "reduce_scatter", data, nbytes, "ZeRO gradient reduce-scatter")
    out += collective("data", "all_gather", data, nbytes, "ZeRO parameter all-gather")
    if stage == 3 and not fcdp:
        out += collective("data", "all_gather", data, nbytes, "ZeRO-3 backward re-gather")
    return out


def _minibatch_compute(
    cfg: Any, problem: LinkProblem, data: int, machine: Machine
) -> dict[str, float]:
    """One step on one rank: each hop's transforms (root and neighbour, forward and
    backward) and aggregation over the expected blocks, the decoder's pass over the
    endpoint rows, and Adam's pass over the parameters."""
    mb = _batch_problem(cfg, problem, data)
    e = problem.element_size
    blocks = expected_blocks(mb, min(mb.batch_size, mb.nodes))
    gemm = aggregation = 0.0
    for (dst, src, m), fin, w in zip(reversed(blocks), mb.dims[:-1], mb.dims[1:], strict=True):
        gemm += 3 * (gemm_seconds(src, fin, w, e, machine) + gemm_seconds(dst, fin, w, e, machine))
        aggregation += stream_seconds(3 * m * min(fin, w) * e, machine)
    rows = (2 + problem.negatives) * cfg.batch_size / data * cfg.hidden * e
    return {
        "gemm": gemm,
        "aggregation": aggregation,
        "decoder": stream_seconds(3 * rows, machine),
        "optimizer": stream_seconds(problem.params * (3 * e + 16), machine),
    }


def rank_link_minibatch(
    cfg: Any, problem: LinkProblem, world: int, machine: Machine
) -> list[Candidate]:
    """Data parallel on ``world`` ranks at each ZeRO stage (or ``cfg.zero_stage``), best
    first."""
    stages = (0, 1, 2, 3) if cfg.zero_stage is None else (cfg.zero_stage,)
    shape = {"data": world, "x": 1, "y": 1, "z": 1}
    cands = [
        dataclasses.replace(
            evaluate(
                shape,
                machine,
                lambda s=s: minibatch_collectives(problem, world, s, cfg.fcdp),
                lambda: _minibatch_compute(cfg, problem, world, machine),
                lambda s=s: link_minibatch_memory(cfg, problem, world, s),
            ),
            stage=s,
        )
        for s in stages
    ]
    return best_first(cands)


# ------------------------------------------------------------------ gnnpar plan link
#: The trainer's options ``gnnpar plan link`` takes (spelled and defaulted alike).
LINK_OPTIONS = ("dataset", "root", "dataset_options", "split", "val_fraction", "test_fraction",
                "eval_negatives", "eval_num_negatives", "edge_labels", "relation",
                "reverse_relation", "per_relation", "featureless", "mode", "sampling", "grid",
                "model", "model_options",
                "hidden", "layers", "heads", "decoder", "decoder_layers", "num_negatives",
                "fanouts", "batch_size", "prefetch", "zero_stage", "fcdp", "dtype",
                "seed")  # fmt: skip


def link_model(cfg: Any, graph: Any, block: bool) -> torch.nn.Module:
    """The task's model for ``graph`` (:func:`gnnpar.models.link.task.link_model`), in its
    dtype, on the CPU."""
    from gnnpar.models.link.task import link_model as build
    from gnnpar.train.precision import master_dtype

    return build(cfg, graph, block).to(master_dtype(cfg))


def _largest_unit(model: torch.nn.Module, user_model: bool) -> int:
    """The parameters of the largest unit ZeRO-3 gathers (the task's units: each
    convolution, the rest as the root's; a user's model: all of it)."""
    from gnnpar.models.minibatch.model import GATConv, GCNConv, SAGEConv

    total = sum(p.numel() for p in model.parameters())
    if user_model:
        return total
    units = [sum(p.numel() for p in m.parameters()) for m in model.modules()
             if isinstance(m, (SAGEConv, GCNConv, GATConv))]  # fmt: skip
    return max([*units, total - sum(units)])


def link_problem(cfg: Any) -> tuple[LinkProblem, torch.nn.Module]:
    """The :class:`LinkProblem` of ``cfg`` (its dataset and split loaded as the task loads
    them) and the task's model."""
    from gnnpar.models.link.task import load_link_graph
    from gnnpar.models.pyg.model import is_user_model

    graph = load_link_graph(cfg)
    split, in_dim = graph.edge_split, int(graph.feat.shape[1])
    model = link_model(cfg, graph, block=cfg.mode == "minibatch")
    held = sum(int(t.numel()) for t in (split.val, split.test, split.val_neg, split.test_neg)
               if t is not None)  # fmt: skip
    problem = LinkProblem(
        name=cfg.dataset, nodes=graph.num_nodes, edges=graph.num_edges, features=in_dim,
        train_edges=int(split.train.shape[1]), held_out=held,
        negatives=0 if getattr(split, "label_kind", None) else cfg.num_negatives,
        params=sum(p.numel() for p in model.parameters()),
        per_unit=_largest_unit(model, is_user_model(cfg.model)),
        element_size=next(model.parameters()).element_size(),
        degrees=degree_histogram(graph.indptr.numpy()),
        learnt=featureless_nodes(graph.types) if cfg.featureless == "learn" else 0,
    )  # fmt: skip
    return problem, model


def _given_shapes(cfg: Any, world: int) -> list[dict[str, int]] | None:
    if cfg.grid is None:
        return None
    from gnnpar.grid import GridError, fit_shape, parse_grid_spec

    try:
        shape = fit_shape(world, parse_grid_spec(cfg.grid))
    except GridError as err:
        raise PlanError(f"--grid {cfg.grid}: {err}") from None
    if shape["data"] != 1:
        raise PlanError(f"--grid {cfg.grid} leaves {shape['data']} of {world} ranks off x·y·z")
    return [{a: shape[a] for a in ("data", "x", "y", "z")}]


def _cmd_link(args: argparse.Namespace) -> int:
    from gnnpar.models.link.task import LinkConfig

    try:
        cfg = resolve(LinkConfig, args, None)
        problem, model = link_problem(cfg)
    except (ConfigError, UserError) as err:
        raise PlanError(str(err)) from None
    machine = machine_from(args)
    k, world = problem.negatives, args.gpus
    head = (
        f"link ({cfg.mode}) on {problem.name}: {problem.nodes:,} nodes, {problem.edges:,} "
        f"message edges, {problem.train_edges:,} training edges; {cfg.model} encoder + "
        f"{cfg.decoder} decoder, {problem.params:,} parameters, {k} negatives per positive"
    )
    where = f"{count(world, 'rank')} on {machine.name} ({machine.ranks_per_node(world)} per node)"
    if cfg.mode == "minibatch":
        cands = rank_link_minibatch(cfg, problem, world, machine)
        title = (
            f"{head}; batch {cfg.batch_size} positives = up to {(2 + k) * cfg.batch_size:,} "
            f"seeds, fan-outs {cfg.fanouts}; {where}; per step (one batch)"
        )
    else:
        cands = rank_link_full(model, problem, cfg.hidden, world, machine,
                               _given_shapes(cfg, world))  # fmt: skip
        title = f"{head}; {where}; per epoch (one full-graph step, pair fetch included)"
    return report(cands, args, title)


#: ``gnnpar plan link``.
PLANNER = PlanCommand(
    help="link prediction: ZeRO stages of edge batches, or x*y*z shapes of the full graph",
    description="Rank the shapes of `gnnpar train link` with the same options (and the same "
    "defaults): mode minibatch, data parallel over --gpus ranks at each ZeRO stage, by the "
    "mini-batch memory model (an edge batch of b positives and k negatives is up to (2+k)*b "
    "seeds) and the gradient reduction's bytes; mode full, every x*y*z shape by the traced "
    "PyG encoder's collectives plus the pair scoring's all-to-all of endpoint ids and rows.",
    options=LINK_OPTIONS,
    run=_cmd_link,
    add_arguments=lambda p: add_machine_options(p, "a100x4"),
)
