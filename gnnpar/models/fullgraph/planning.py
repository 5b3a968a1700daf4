"""Planning the full-graph GNN's grid: every x·y·z shape ranked by the cost and memory
models (:func:`rank_gcn`), the grid ``gnnpar train gcn`` runs (:func:`choose_fullgraph_grid`),
and ``gnnpar plan gcn`` (:data:`PLANNER`). Full-graph training has no batch to split, so its
shapes all have data = 1."""

from __future__ import annotations

import argparse

from gnnpar.data.sizes import gcn_datasets
from gnnpar.errors import UserError
from gnnpar.fmt import count
from gnnpar.models.fullgraph.cost import GCNProblem, gcn_collectives, gcn_compute_seconds
from gnnpar.models.fullgraph.embedding import featureless_nodes
from gnnpar.models.fullgraph.memory import gcn_memory
from gnnpar.models.pyg.model import is_user_model
from gnnpar.plan.comm_model import bytes_by_axis
from gnnpar.plan.command import PlanCommand, add_machine_options, machine_from, report
from gnnpar.plan.inputs import PlanError, parse_count
from gnnpar.plan.machines import Machine
from gnnpar.plan.rank import Candidate, best_first, best_shape, evaluate, grid_shapes
from gnnpar.train.config import resolve
from gnnpar.train.loop import load_dataset
from gnnpar.train.precision import compute_dtype

__all__ = ["PLANNER", "choose_fullgraph_grid", "fullgraph_epoch_bytes", "rank_gcn"]


def rank_gcn(problem: GCNProblem, world: int, machine: Machine) -> list[Candidate]:
    """Every x·y·z shape of ``world`` ranks (data = 1) for a full-graph run, best first."""
    return best_first(
        evaluate(
            s,
            machine,
            lambda s=s: gcn_collectives(problem, s),
            lambda s=s: gcn_compute_seconds(problem, s, machine),
            lambda s=s: gcn_memory(problem, s),
        )
        for s in grid_shapes(world, data=False)
    )


def fullgraph_epoch_bytes(
    shape: dict[str, int],
    num_nodes: int,
    dims: list[int],
    num_ops: int = 1,
    element_size: int = 4,
    bias: bool = True,
    model: str | None = None,
    heads: tuple[int, int] = (8, 1),
    bases: int = 0,
) -> dict[str, float]:
    """Bytes per axis that rank 0 moves in one forward + backward pass of a 3D full-graph
    model with feature widths ``dims`` (biases included, the loss's few scalars not);
    ``model`` (default: gcn, or sage for 2 operators), GAT's (hidden, output) ``heads`` and
    an R-GCN's ``bases``."""
    model = model or ("sage" if num_ops == 2 else "gcn")
    problem = GCNProblem.from_widths(
        num_nodes,
        1,
        list(dims),
        model=model,
        element_size=element_size,
        bias=bias,
        heads=heads[0],
        out_heads=heads[1],
        relations=num_ops - 1 if model == "rgcn" else 0,
        bases=bases,
    )
    colls = gcn_collectives(problem, {"data": 1, **shape}, loss=False)
    out = {"x": 0.0, "y": 0.0, "z": 0.0}
    for axis, b in bytes_by_axis(colls).items():
        out[axis] += float(b)
    return out


def choose_fullgraph_grid(
    world: int,
    num_nodes: int,
    dims: list[int],
    num_ops: int = 1,
    *,
    nnz: int | None = None,
    machine: Machine | None = None,
    element_size: int = 4,
    algorithm: str = "3d",
    model: str | None = None,
    heads: tuple[int, int] = (8, 1),
    activation_checkpointing: str = "none",
    bases: int = 0,
    featureless_nodes: int = 0,
) -> dict[str, int]:
    """The grid shape for a full-graph run of ``algorithm`` on ``world`` ranks.

    3D, with a ``machine`` (and the adjacency's ``nnz``): the fastest predicted x·y·z shape
    that fits (:func:`rank_gcn`; what ``gnnpar plan gcn`` ranks first). Without: the shape
    with the fewest bytes per epoch; ties go to the shape whose busiest axis moves least, then
    to x before y before z. 2D (SUMMA): the squarest x·y; 1D: x = ``world``. ``model``
    (default: gcn, or sage for 2 operators; rgcn: ``num_ops`` is its relations + 1) and GAT's
    (hidden, output) ``heads`` pick the layers' schedules and memory,
    ``activation_checkpointing`` (none or full) the memory, compute and bytes of the
    recompute; ``bases``: an R-GCN's bases (its weight blocks and their traffic);
    ``featureless_nodes``: nodes whose input rows are learnt (their table's memory and the
    first layer's input gradient).
    """
    model = model or ("sage" if num_ops == 2 else "gcn")
    if algorithm == "2d":
        x = int(world**0.5)
        while world % x:
            x -= 1
        return {"x": x, "y": world // x}
    if algorithm == "1d":
        return {"x": world}
    if algorithm != "3d":
        raise PlanError(f"unknown full-graph algorithm {algorithm!r}: 3d, 2d or 1d")
    if machine is not None:
        problem = GCNProblem.from_widths(
            num_nodes,
            nnz or num_nodes,
            list(dims),
            model=model,
            element_size=element_size,
            heads=heads[0],
            out_heads=heads[1],
            activation_checkpointing=activation_checkpointing,
            relations=num_ops - 1 if model == "rgcn" else 0,
            bases=bases,
            featureless_nodes=featureless_nodes,
        )
        best = best_shape(rank_gcn(problem, world, machine), "graph")
        return {a: best[a] for a in ("x", "y", "z")}
    chosen = None
    for s in grid_shapes(world, data=False):
        shape = {a: s[a] for a in ("x", "y", "z")}
        b = fullgraph_epoch_bytes(
            shape, num_nodes, dims, num_ops, model=model, heads=heads, bases=bases
        )
        key = (sum(b.values()), max(b.values()), -shape["x"], -shape["y"])
        if chosen is None or key < chosen[0]:
            chosen = (key, shape)
    return chosen[1]


# ------------------------------------------------------------------ gnnpar plan gcn
# The trainer's options that ``gnnpar plan`` takes, spelled and defaulted as the trainer's:
# the same flags describe the same run, so both pick the same grid.
GCN_OPTIONS = ("dataset", "root", "dataset_options", "model", "model_options", "hidden",
               "heads", "out_heads", "layers", "dtype", "mixed_precision",
               "activation_checkpointing", "bases", "featureless")  # fmt: skip


def _gcn_problem(args: argparse.Namespace) -> GCNProblem:
    from gnnpar.models.fullgraph.task import FullGraphConfig  # the task plans with this module

    sizes_given = args.nodes is not None or args.edges is not None
    if sizes_given and args.dataset is not None:
        raise PlanError("give either --dataset or --nodes/--edges, not both")
    cfg = resolve(FullGraphConfig, args, None)
    common = {
        "hidden": cfg.hidden,
        "layers": cfg.layers,
        "model": "gcn" if is_user_model(cfg.model) else cfg.model,  # a user model: its sizes
        "element_size": compute_dtype(cfg).itemsize,
        "heads": cfg.heads,
        "out_heads": cfg.out_heads,
        "activation_checkpointing": cfg.activation_checkpointing,
        "bases": cfg.bases if cfg.model == "rgcn" else 0,
    }
    if cfg.model == "rgcn" and sizes_given:
        raise PlanError("an rgcn plan needs --dataset (a typed graph: its relations)")
    if not sizes_given:
        presets = gcn_datasets()
        if cfg.dataset in presets and not cfg.dataset_options and cfg.model != "rgcn":
            d = presets[cfg.dataset]
            return GCNProblem.from_edges(
                d["nodes"],
                d["edges"],
                features=d["features"],
                classes=d["classes"],
                name=cfg.dataset,
                **common,
            )
        try:
            graph = load_dataset(cfg)
        except (KeyError, FileNotFoundError, UserError) as err:
            known = ", ".join(presets)
            raise PlanError(
                f"cannot load dataset {cfg.dataset!r} ({err}); sizes are built in for {known}, "
                "or give --nodes, --edges, --features and --classes"
            ) from None
        if cfg.model == "rgcn" and graph.types is None:
            raise PlanError(f"rgcn reads a typed graph's relations; {cfg.dataset!r} has none")
        learnt = featureless_nodes(graph.types) if cfg.featureless == "learn" else 0
        if cfg.featureless == "learn" and not learnt:
            raise PlanError(f"--featureless learn: {cfg.dataset!r} has no featureless node type")
        return GCNProblem(
            featureless_nodes=learnt,
            nodes=graph.num_nodes,
            nnz=graph.num_edges + graph.num_nodes,
            features=graph.feat.shape[1],
            classes=graph.num_classes,
            name=cfg.dataset,
            relations=graph.types.num_relations if cfg.model == "rgcn" else 0,
            **common,
        )
    missing = [
        f"--{k}" for k in ("nodes", "edges", "features", "classes") if getattr(args, k) is None
    ]
    if missing:
        raise PlanError(f"give --dataset NAME, or {', '.join(missing)}")
    return GCNProblem.from_edges(
        parse_count(args.nodes),
        parse_count(args.edges),
        features=args.features,
        classes=args.classes,
        name="graph",
        **common,
    )


def _cmd_gcn(args: argparse.Namespace) -> int:
    problem = _gcn_problem(args)
    machine = machine_from(args)
    if is_user_model(args.model or ""):
        return _cmd_user_model(args, problem, machine)
    cands = rank_gcn(problem, args.gpus, machine)
    title = (
        f"{problem.model} on {problem.name}: {problem.nodes:,} nodes, {problem.nnz:,} nonzeros, "
        f"widths {problem.dims}; {count(args.gpus, 'rank')} on {machine.name} "
        f"({machine.ranks_per_node(args.gpus)} per node)"
    )
    return report(cands, args, title)


def _cmd_user_model(args: argparse.Namespace, problem: GCNProblem, machine: Machine) -> int:
    """``gnnpar plan gcn --model FILE:FACTORY``: the user's model traced and priced on every
    shape (:mod:`gnnpar.models.fullgraph.pyg_planning`)."""
    from gnnpar.models.fullgraph.pyg_planning import rank_pyg
    from gnnpar.models.fullgraph.task import FullGraphConfig
    from gnnpar.models.pyg.model import build_user_model, factory_options, factory_takes_relations

    cfg = resolve(FullGraphConfig, args, None)
    try:
        options = factory_options(cfg.model_options)
        relations = None
        if factory_takes_relations(cfg.model) and cfg.dataset is not None:  # a user's R-GCN
            types = load_dataset(cfg).types
            relations = types.num_relations if types is not None else None
        model = build_user_model(cfg.model, problem.features, problem.classes, options, relations)
    except UserError as err:
        raise PlanError(str(err)) from None
    recompute = cfg.activation_checkpointing == "full"
    cands = rank_pyg(model, problem.features, problem.nodes, problem.nnz, args.gpus, machine,
                     problem.element_size, recompute)  # fmt: skip
    title = (
        f"{cfg.model} on {problem.name}: {problem.nodes:,} nodes, {problem.nnz:,} nonzeros, "
        f"{problem.features} features, {problem.classes} classes; {count(args.gpus, 'rank')} "
        f"on {machine.name} ({machine.ranks_per_node(args.gpus)} per node)"
    )
    return report(cands, args, title)


def _sizes_arguments(p: argparse.ArgumentParser) -> None:
    sizes = p.add_argument_group("a graph by its sizes (instead of --dataset)")
    sizes.add_argument("--nodes", default=None, help="nodes (e.g. 2.4M)")
    sizes.add_argument("--edges", default=None, help="undirected edges (nnz = 2E + N)")
    sizes.add_argument("--features", type=int, default=None, help="input features")
    sizes.add_argument("--classes", type=int, default=None, help="output classes")
    add_machine_options(p, "a100x4")


#: ``gnnpar plan gcn``.
PLANNER = PlanCommand(
    help="full-graph GCN / GraphSAGE on an x*y*z grid",
    description="Rank x*y*z shapes for `gnnpar train gcn` with the same options (and the "
    "same defaults), or for a graph of given sizes.",
    options=GCN_OPTIONS,
    run=_cmd_gcn,
    add_arguments=_sizes_arguments,
)
