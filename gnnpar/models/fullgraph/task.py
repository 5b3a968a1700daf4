"""Full-graph GCN / GraphSAGE / GAT / GIN / R-GCN training on an x × y × z grid (the ``gcn``
task). R-GCN (``model = "rgcn"``) trains on a typed graph (:mod:`gnnpar.graph.typed`): its
shards hold one normalised adjacency per relation (``"mean-per-relation"``,
:mod:`gnnpar.models.fullgraph.relations`), and the target type's masks choose the nodes it
trains and scores on (the other types' labels are -1, their masks False).

Rank 0 cuts the dataset into a shard folder (next to the run, or where ``shards`` points)
and records the dataset's fingerprint in it; a later run compares that with the dataset it
is given and rebuilds a folder it owns that was made from other data or options (one line
on stderr), or refuses a given ``shards`` folder made from another graph. Every rank then
reads only its own blocks, each file checked against the manifest when first mapped
(``verify``: checksum, or size for very large folders). The grid comes from ``grid`` or, when
not given, from the workload's cost model (:mod:`gnnpar.models.fullgraph.planning`).

``mixed_precision = "bf16"``: master weights and Adam's state in ``dtype`` (float32), Â,
features, activations, products and every collective in bfloat16, the loss in float32 from
the bfloat16 logits (:func:`gnnpar.models.fullgraph.parallelize_fullgraph`'s ``compute_dtype``).
``"fp16"`` is refused: it would need loss scaling, which the full-graph loop does not have
(the SpMM multiplies float16 for the ``sage`` task).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

import gnnpar
from gnnpar import comm
from gnnpar.errors import PeerFailedError, UserError
from gnnpar.fmt import parse_bytes
from gnnpar.grid import ProcessGrid, parse_grid_spec
from gnnpar.models.fullgraph.embedding import FEATURELESS, featureless_nodes
from gnnpar.models.fullgraph.model import FullGraphGNN, norm_of
from gnnpar.models.fullgraph.parallelize import ALGORITHMS, check_norm, parallelize_fullgraph
from gnnpar.models.fullgraph.planning import choose_fullgraph_grid
from gnnpar.models.fullgraph.pyg import parallelize_pyg
from gnnpar.models.fullgraph.pyg_planning import choose_pyg_grid
from gnnpar.models.fullgraph.relations import RELATION_NORM
from gnnpar.models.fullgraph.shards import (
    DiskSource,
    OldShardFolderError,
    ShardFormatError,
    prepare_shards,
    read_shard_manifest,
    shard_provenance,
)
from gnnpar.models.pyg.model import (
    build_user_model,
    check_model_option,
    factory_options,
    factory_takes_relations,
    is_user_model,
)
from gnnpar.plan import local_machine
from gnnpar.sparse.source import PERMUTATIONS
from gnnpar.train import schedule
from gnnpar.train.config import (
    ConfigError,
    RecomputeConfig,
    ScheduleConfig,
    SelectionConfig,
    TrainerConfig,
    one_of,
    option,
)
from gnnpar.train.loop import BaseTask, load_dataset
from gnnpar.train.metrics import SCORES, UndefinedScoreError, metric_for
from gnnpar.train.optim import adam
from gnnpar.train.precision import compute_dtype, master_dtype
from gnnpar.train.progress import Progress, graph_sizes
from gnnpar.train.spec import GridPlan

#: The models of the task (``model``).
MODELS = ("gcn", "sage", "gat", "gin", "rgcn")
#: How each rank checks the shard files it maps (``verify``).
VERIFY_LEVELS = ("checksum", "size")


@dataclasses.dataclass
class FullGraphConfig(RecomputeConfig, SelectionConfig, ScheduleConfig, TrainerConfig):
    """Options of ``gnnpar train gcn`` (and ``--config FILE`` keys)."""

    dataset: str = option("sbm", "dataset name or path (see `gnnpar data list`)")
    root: str | None = option(None, "dataset root folder (default: datasets/)")
    dataset_options: str | None = option(
        None, "dataset options as k=v,k=v (e.g. normalize_features=true)"
    )
    model: str = option(
        "gcn",
        "gcn, sage (GraphSAGE-mean), gat (graph attention), gin (isomorphism network), rgcn "
        "(relational GCN, typed graphs), or your own PyG model as module:factory or "
        "file.py:factory (docs/models.md)",
        MODELS,
    )
    model_options: str | None = option(
        None, "a module:factory model's hyper-parameters as k=v,k=v (e.g. K=10,alpha=0.1)"
    )
    hidden: int = option(16, "hidden width (gat: of all heads together)")
    bases: int = option(
        0, "rgcn: bases of the weight decomposition (0: one matrix per relation; 3d algorithm)"
    )
    heads: int = option(8, "gat: attention heads of each hidden layer (concatenated)")
    out_heads: int = option(1, "gat: attention heads of the output layer (averaged)")
    attn_dropout: float = option(0.6, "gat: dropout probability of the attention values")
    layers: int = option(2, "number of layers")
    dropout: float = option(0.5, "dropout probability")
    lr: float = option(0.01, "Adam learning rate")
    weight_decay: float = option(5e-4, "Adam weight decay")
    decay_all_layers: bool = option(
        False, "weight decay on every layer (default: the first only, as Kipf & Welling)"
    )
    epochs: int = option(200, "training epochs")
    algorithm: str = option("3d", "3d (Plexus), 2d (SUMMA) or 1d", ALGORITHMS)
    grid: str | None = option(None, "grid such as x=2,y=2,z=2 (default: the planner's)")
    shards: str | None = option(None, "shard folder (default: RUN/shards), made if missing")
    blocks: int = option(8, "file blocks per side when cutting shards")
    permutation: str = option(
        "random", "node relabelling: random (Plexus), balanced, balanced-local, none", PERMUTATIONS
    )
    memory_limit: str | None = option(
        None,
        "cut the shards streaming the edges in chunks under this many bytes (e.g. 3GB; "
        "permutation random or none)",
    )
    featureless: str = option(
        "zero",
        "typed graph: a featureless type's input rows are zero (as stored) or learn (a learnt "
        "row per node, sharded as the features; rgcn or a factory taking num_relations)",
        FEATURELESS,
    )
    overlap_chunks: int = option(1, "row chunks whose all-reduce overlaps the next SpMM")
    verify: str = option(
        "checksum",
        "shard files each rank maps are checked at open: checksum, or size (very large folders)",
        VERIFY_LEVELS,
    )
    out: str = option("runs/gcn", "run folder: metrics.jsonl, checkpoints/, plots/, shards/")

    def check(self) -> None:
        """Reject values that cannot work, naming the key."""
        self.check_trainer()
        self.check_schedule()
        self.check_selection()
        if self.activation_checkpointing == "selective":
            raise ConfigError(
                "config key 'activation_checkpointing': selective recomputes a transformer's "
                "attention core; full-graph layers take none or full"
            )
        self.check_recompute(("none", "full"))
        check_model_option(self.model, MODELS, self.model_options)
        if is_user_model(self.model):
            self._check_user_model()
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"config key 'algorithm' must be one of {ALGORITHMS}")
        if self.permutation not in PERMUTATIONS:
            raise ConfigError(f"config key 'permutation' must be one of {', '.join(PERMUTATIONS)}")
        if self.verify not in VERIFY_LEVELS:
            raise ConfigError(f"config key 'verify' must be checksum or size, got {self.verify!r}")
        if self.mixed_precision == "fp16":
            raise ConfigError(
                "config key 'mixed_precision': full-graph training supports none or bf16 "
                "(fp16 would need loss scaling, which full-graph training does not have); use bf16"
            )
        for key in ("hidden", "layers", "epochs", "blocks", "overlap_chunks", "heads", "out_heads"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}' must be positive")
        for key in ("dropout", "attn_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"config key '{key}' must be in [0, 1)")
        if self.bases < 0 or (self.bases and self.model != "rgcn"):
            raise ConfigError(f"config key 'bases' ({self.bases}) is for rgcn, >= 1 (0: none)")
        one_of(self, "featureless", FEATURELESS)
        if self.featureless == "learn" and not (self.model == "rgcn" or is_user_model(self.model)):
            raise ConfigError(
                "config key 'featureless': learnt rows need a typed graph's shards, which rgcn "
                f"or a factory taking num_relations reads; {self.model} reads the untyped view"
            )
        if self.bases and self.algorithm != "3d":
            raise ConfigError(
                f"config key 'bases': R-GCN bases run on the 3d algorithm, not {self.algorithm!r}"
            )
        if self.model == "gat" and self.layers > 1 and self.hidden % self.heads:
            raise ConfigError(
                f"config key 'hidden' ({self.hidden}) must be a multiple of 'heads' ({self.heads})"
            )
        if self.grid is not None:
            parse_grid_spec(self.grid)
        if self.memory_limit is not None:
            try:
                parse_bytes(self.memory_limit)
            except UserError as err:
                raise ConfigError(f"config key 'memory_limit': {err}") from None
            if self.permutation not in ("random", "none"):
                raise ConfigError(
                    "config key 'memory_limit' streams the shards, which takes permutation "
                    f"random or none, not {self.permutation!r}"
                )
            if self.model == "rgcn":
                raise ConfigError(
                    "config key 'memory_limit': rgcn's shards (one adjacency per relation) "
                    "are cut in memory; leave it unset"
                )

    def _check_user_model(self) -> None:
        """A module:factory model has one layout, on shards of one node order."""
        if self.algorithm != "3d":
            raise ConfigError(
                "config key 'algorithm': a module:factory model has one layout (rows over the "
                "grid, the adjacency in 2D over x and y·z; docs/models.md): leave it at 3d"
            )
        if self.permutation not in ("random", "symmetric", "none"):
            raise ConfigError(
                "config key 'permutation': a module:factory model needs one node order: "
                f"random (read as symmetric), symmetric or none, not {self.permutation!r}"
            )


def _permutation(cfg: FullGraphConfig) -> str:
    """The shards' relabelling: a user model's ``random`` is one random order (symmetric)."""
    if is_user_model(cfg.model) and cfg.permutation == "random":
        return "symmetric"
    return cfg.permutation


def _shard_folder(cfg: FullGraphConfig) -> Path:
    """The given folder, or one under the run folder named by the options that shape the
    shards (its content is checked against the dataset's fingerprint by :func:`_prepare`)."""
    if cfg.shards:
        return Path(cfg.shards)
    keys = (cfg.dataset, cfg.root, cfg.dataset_options, _norm(cfg), cfg.blocks, _permutation(cfg))
    digest = hashlib.sha1(json.dumps([*keys, cfg.seed]).encode()).hexdigest()[:10]
    name = Path(cfg.dataset).name or "graph"
    return Path(cfg.out) / "shards" / f"{name}-{digest}"


def _norm(cfg: FullGraphConfig) -> str:
    """The adjacency the model reads (:func:`~gnnpar.models.fullgraph.model.norm_of`: GAT and
    GIN the ``raw`` one, whose values are the edge weights; R-GCN one per relation; a user's
    PyG model the ``raw`` one, which each of its convolutions normalises its own way, or the
    relations' when its factory takes ``num_relations``: an R-GCN or RGAT of the user's)."""
    if is_user_model(cfg.model):  # RGCNConv and RGATConv read each relation's Â_r
        return RELATION_NORM if factory_takes_relations(cfg.model) else "raw"
    return norm_of(cfg.model)


def check_typed(cfg: FullGraphConfig, graph: Any) -> None:
    """An rgcn model reads a typed graph's relations, and learnt featureless rows need a
    featureless type and a model that reads the relations: ConfigError naming the key
    otherwise."""
    if cfg.model == "rgcn" and graph.types is None:
        raise ConfigError(
            f"config key 'model': rgcn reads a typed graph's relations, and dataset "
            f"{cfg.dataset!r} has none (use a typed dataset such as mag-synth)"
        )
    if cfg.featureless != "learn":
        return
    if not featureless_nodes(graph.types):
        raise ConfigError(
            f"config key 'featureless': dataset {cfg.dataset!r} has no featureless node type, "
            "so there are no input rows to learn; use zero"
        )
    if is_user_model(cfg.model) and not factory_takes_relations(cfg.model):
        raise ConfigError(
            "config key 'featureless': learnt rows need a typed graph's shards, which a "
            f"factory taking num_relations reads; {cfg.model} reads the untyped view"
        )


def _stale(
    folder: Path, expected: dict[str, Any], owned: bool, need_types: bool = False
) -> str | None:
    """Why ``folder`` does not hold the shards ``expected`` describes (None if it does).
    A folder the run owns must match every option (and with ``need_types``, learnt
    featureless rows, a typed folder must record the node types); a given one only the
    graph."""
    try:
        meta = read_shard_manifest(folder).meta
        recorded = meta["source"]
    except OldShardFolderError:
        if not owned:
            raise
        return f"shard folder {folder} was written by an older gnnpar"
    except ShardFormatError as err:
        if not owned:
            raise
        return str(err)
    keys = expected if owned else ("graph",)
    if owned and need_types and meta.get("norm") == RELATION_NORM and "types" not in meta:
        return f"shard folder {folder} was written before shards recorded the node types"
    if all(recorded.get(k) == expected[k] for k in keys):
        return None
    return (
        f"shard folder {folder} was made from graph {recorded.get('graph')} "
        f"({_options_text(recorded)}), not from this dataset's {expected['graph']} "
        f"({_options_text(expected)})"
    )


def _options_text(source: dict[str, Any]) -> str:
    return ", ".join(f"{k}={source.get(k)}" for k in ("norm", "blocks", "permutation", "seed"))


def _expected_source(cfg: FullGraphConfig, fingerprint: str) -> dict[str, Any]:
    """The provenance shards made from the graph ``fingerprint`` with ``cfg`` would record."""
    blocks = (cfg.blocks, cfg.blocks)
    return shard_provenance(fingerprint, _norm(cfg), blocks, cfg.seed, _permutation(cfg))


def _check_given_shards(cfg: FullGraphConfig, fingerprint: str) -> None:
    """The ``shards`` folder the user gave was made from the graph ``fingerprint``:
    ConfigError naming both otherwise (or the folder's FormatError)."""
    reason = _stale(Path(cfg.shards), _expected_source(cfg, fingerprint), owned=False)
    if reason is not None:
        raise ConfigError(f"{reason}: prepare it again or point 'shards' elsewhere")


def _build_or_check(cfg: FullGraphConfig, folder: Path, progress: Progress) -> int:
    """Rank 0: make the shards if missing; rebuild a folder the run owns if it was made
    from other data or options (one line on stderr); refuse a given folder that was.
    Returns the dataset's number of edges (the shards hold Â's, self-loops included)."""
    with progress.stage(f"loading {cfg.dataset}"):
        graph = load_dataset(cfg)
        graph.check_trainable()
        check_typed(cfg, graph)
        fingerprint = graph.fingerprint()
    if folder.exists() and cfg.shards:
        _check_given_shards(cfg, fingerprint)
        return graph.num_edges
    if folder.exists():
        learn = cfg.featureless == "learn"
        reason = _stale(folder, _expected_source(cfg, fingerprint), owned=True, need_types=learn)
        if reason is None:
            return graph.num_edges
        print(f"gnnpar: {reason}; rebuilding the shards", file=sys.stderr, flush=True)
    with progress.stage(f"cutting shards into {folder}"):
        prepare_shards(
            graph,
            folder,
            norm=_norm(cfg),
            blocks=(cfg.blocks, cfg.blocks),
            seed=cfg.seed,
            permutation=_permutation(cfg),
            overwrite=True,
            fingerprint=fingerprint,
            memory_limit=None if cfg.memory_limit is None else parse_bytes(cfg.memory_limit),
        )
    return graph.num_edges


def _prepare(
    cfg: FullGraphConfig, world: gnnpar.ProcessGrid, progress: Progress
) -> tuple[Path, int]:
    """Rank 0 makes, checks or rebuilds the shards (:func:`_build_or_check`); the others
    wait. Returns the folder and the dataset's number of edges (rank 0's count, which the
    one collective that tells every rank the outcome also carries)."""
    folder = _shard_folder(cfg)
    outcome = torch.zeros(2, dtype=torch.float64, device=world.device)  # failed, edges
    if world.global_rank == 0:
        try:
            outcome[1] = _build_or_check(cfg, folder, progress)
        except Exception:
            outcome[0] = 1
            comm.all_reduce(outcome, world, "world")
            raise
    comm.all_reduce(outcome, world, "world")
    if outcome[0].item():
        raise PeerFailedError("rank 0 could not prepare the graph shards (see its error)")
    return folder, int(outcome[1].item())


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """What :func:`plan` read, for the task: the shards, the dataset's edge count and the
    layer widths."""

    source: DiskSource
    num_edges: int
    dims: list[int]


def plan(cfg: FullGraphConfig, world: ProcessGrid, progress: Progress) -> GridPlan:
    """The grid of a ``gcn`` run: rank 0 prepares the shards (:func:`_prepare`), whose
    sizes choose the grid when the config names none (what ``gnnpar plan gcn --machine cpu``,
    or a GPU node, ranks first)."""
    folder, num_edges = _prepare(cfg, world, progress)
    source = DiskSource(folder, verify=cfg.verify)
    meta = source.meta
    if is_user_model(cfg.model):
        prepared = _Prepared(source, num_edges, [meta["feat_dim"], meta["num_classes"]])
        if cfg.grid:
            return GridPlan(parse_grid_spec(cfg.grid), "given", prepared)
        options = factory_options(cfg.model_options)
        model = build_user_model(cfg.model, meta["feat_dim"], meta["num_classes"], options,
                                 source.num_relations)  # fmt: skip
        gpus_per_node = world.ranks_per_node if world.backend == "nccl" else None
        shape = choose_pyg_grid(
            model, meta["feat_dim"], meta["num_nodes"], meta["num_edges"] + meta["num_nodes"],
            world.world_size, local_machine(world.backend, gpus_per_node),
            compute_dtype(cfg).itemsize, cfg.activation_checkpointing == "full",
            cfg.featureless == "learn",
        )  # fmt: skip
        return GridPlan(shape, "chosen by the planner", prepared)
    try:  # a given folder cut for another model (a folder the run owns was rebuilt)
        check_norm(cfg.model, source)
    except UserError as err:
        raise ConfigError(f"{err}, or point 'shards' elsewhere") from None
    dims = [meta["feat_dim"]] + [cfg.hidden] * (cfg.layers - 1) + [meta["num_classes"]]
    prepared = _Prepared(source, num_edges, dims)
    # sparse operators per layer: sage's Â and root, rgcn's Â_r of every relation and root
    num_ops = {"sage": 2, "rgcn": source.num_relations + 1}.get(cfg.model, 1)
    if cfg.grid:
        return GridPlan(parse_grid_spec(cfg.grid), "given", prepared)
    gpus_per_node = world.ranks_per_node if world.backend == "nccl" else None
    shape = choose_fullgraph_grid(
        world.world_size,
        meta["num_nodes"],
        dims,
        num_ops,
        nnz=meta["num_edges"] + meta["num_nodes"],
        machine=local_machine(world.backend, gpus_per_node),
        element_size=compute_dtype(cfg).itemsize,
        algorithm=cfg.algorithm,
        model=cfg.model,
        heads=(cfg.heads, cfg.out_heads),
        activation_checkpointing=cfg.activation_checkpointing,
        bases=cfg.bases if cfg.model == "rgcn" else 0,
        featureless_nodes=featureless_nodes(source.types) if cfg.featureless == "learn" else 0,
    )
    return GridPlan(shape, "chosen by the planner", prepared)


class FullGraphTask(BaseTask):
    """The ``gcn`` task: full-graph training of a GCN, GraphSAGE, GAT or GIN on sharded
    data."""

    unit = "epoch"

    @property
    def selection(self) -> tuple[str, str]:
        """The best model is the one of the best validation score of the dataset's metric
        (``val_acc``, ``val_rocauc``; :mod:`gnnpar.train.selection`)."""
        return (f"val_{self.metric}", "max")

    @staticmethod
    def preflight(cfg: FullGraphConfig, world_size: int) -> None:
        """Before launch: the dataset loads and can be trained on, and a given ``shards``
        folder was made from it (a folder the run owns is rebuilt by rank 0 instead)."""
        graph = load_dataset(cfg, warn_directed=True)
        graph.check_trainable()
        check_typed(cfg, graph)
        if is_user_model(cfg.model):  # the factory runs and its modules are checked here
            options = factory_options(cfg.model_options)
            relations = graph.types.num_relations if graph.types is not None else None
            build_user_model(cfg.model, graph.feat.shape[1], graph.num_classes, options, relations)
        if cfg.shards and Path(cfg.shards).exists():
            _check_given_shards(cfg, graph.fingerprint())

    def __init__(self, cfg: FullGraphConfig, grid: ProcessGrid, plan: GridPlan, progress: Progress):
        """The task on ``grid``, the one :func:`plan` chose (:func:`gnnpar.train.spec.build_task`
        builds both); ``progress``: where rank 0 reports the slow preparation stages."""
        self.cfg = cfg
        self.grid = grid
        prepared: _Prepared = plan.prepared
        self.source, self.num_edges = prepared.source, prepared.num_edges
        #: Who chose the grid, for the start lines.
        self.grid_choice = plan.choice
        # reading this rank's blocks of Â and the first optimizer's setup take seconds
        with progress.stage("building the model"):
            self._build_model(cfg, prepared.dims)
        self.num_steps = cfg.epochs

    def _build_model(self, cfg: FullGraphConfig, dims: list[int]) -> None:
        """The parallel model on this rank's blocks, its input features and Adam."""
        dtype = master_dtype(cfg)
        torch.manual_seed(cfg.seed)
        if is_user_model(cfg.model):
            options = factory_options(cfg.model_options)
            relations = self.source.num_relations
            plain = build_user_model(cfg.model, dims[0], dims[-1], options, relations).to(dtype)
            self.model = parallelize_pyg(plain, self.grid, self.source, compute_dtype(cfg))
            self.model.activation_checkpointing = cfg.activation_checkpointing
            if cfg.featureless == "learn":
                self.model.learn_featureless(cfg.seed)
            self.features = self.model.input_features()
            self.metric = metric_for(self.model.node_data("label"))
            return
        relations = self.source.num_relations if cfg.model == "rgcn" else None
        model = FullGraphGNN(
            dims[0], cfg.hidden, dims[-1], cfg.layers, cfg.dropout, kind=cfg.model,
            heads=cfg.heads, out_heads=cfg.out_heads, attn_dropout=cfg.attn_dropout,
            num_relations=relations, num_bases=cfg.bases or None,
        ).to(dtype)  # fmt: skip
        self.model = parallelize_fullgraph(
            model,
            self.grid,
            self.source,
            cfg.algorithm,
            cfg.overlap_chunks,
            dtype,
            compute_dtype=compute_dtype(cfg),
        )
        self.model.activation_checkpointing = cfg.activation_checkpointing
        if cfg.featureless == "learn":
            self.model.learn_featureless(cfg.seed)
        self.features = self.model.input_features()
        #: The score evaluation reports (``acc``, or ``rocauc`` for multi-label labels).
        self.metric = metric_for(self.model.node_data("label"))

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return adam(self._param_groups(self.cfg), lr=self.cfg.lr)

    def data_record(self) -> dict[str, Any]:
        """The graph the shards were made from (their provenance; every rank has it)."""
        return {"name": self.cfg.dataset, "fingerprint": self.source.meta["source"]["graph"]}

    def summary(self) -> str:
        """What the run trains on what: ``gcn on sbm: 2,000 nodes, 19,874 edges, ...``."""
        meta = self.source.meta
        sizes = graph_sizes(
            meta["num_nodes"],
            self.num_edges,
            meta["feat_dim"],
            meta["num_classes"],
            multilabel=self.metric != "acc",
        )
        return f"{self.cfg.model} on {self.cfg.dataset}: {sizes}"

    def _param_groups(self, cfg: FullGraphConfig) -> list[dict[str, Any]]:
        """A user's model: one group, the weight decay on every parameter; a built-in one a
        group per layer (the decay on the first, or on all). Learnt featureless rows: a
        group of their own, without weight decay (an embedding table's usual)."""
        inputs = self.model.inputs
        table = [] if inputs is None else [{"params": [inputs.weight], "weight_decay": 0.0}]
        named = [(n, p) for n, p in self.model.named_parameters() if not n.startswith("inputs.")]
        if is_user_model(cfg.model):
            return [{"params": [p for _, p in named], "weight_decay": cfg.weight_decay}, *table]
        groups = []
        for i in range(self.model.num_layers):
            params = [p for name, p in named if _layer_of(name) == i]
            decay = cfg.weight_decay if (i == 0 or cfg.decay_all_layers) else 0.0
            groups.append({"params": params, "weight_decay": decay})
        return groups + table

    def train_step(self, step: int) -> dict[str, float]:
        """One full-graph epoch."""
        lr = schedule.apply(self.optimizer, self.cfg, step, self.num_steps)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(self.features, dropout_seed=self.cfg.seed * 1_000_003 + step)
        loss = self.model.loss(logits, "train_mask")
        loss.backward()
        self.optimizer.step()
        return {"loss": float(loss.item()), "lr": lr}

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """The dataset's score (:attr:`metric`) on the train, validation and test nodes, as
        ``train_acc`` ... or ``train_rocauc`` ... (masks the dataset lacks are skipped, and
        so is a ROC-AUC that no task defines). ROC-AUC gathers the masked rows' logits on
        every rank once; accuracy needs only per-row statistics."""
        self.model.eval()
        logits = self.model(self.features)
        return sharded_scores(self.model, logits, self.metric, self.source.meta["node_data"])

    @torch.no_grad()
    def predict(self) -> torch.Tensor:
        """Every node's prediction in original node order, on every rank (collective): class
        ids, or each task's probability for multi-label targets
        (:meth:`~gnnpar.models.fullgraph.parallelize.ShardedGNN.predictions`); on a typed
        graph -1 outside the target type, which alone has classes."""
        self.model.eval()
        pred = self.model.predictions(self.model(self.features)).cpu()
        types = getattr(self.source, "types", None)
        return pred if types is None else types.target_only(pred)

    def extra_state(self) -> dict[str, Any]:
        """Nothing beyond the model and optimizer: an epoch is a pure function of its index."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Nothing to restore (see :meth:`extra_state`)."""

    def describe(self) -> dict[str, Any]:
        """The run's task, model and sizes (recorded in its checkpoints)."""
        cfg = self.cfg
        return {
            "task": "gcn",
            "model": cfg.model,
            "dims": self.model.dims,
            "dataset": cfg.dataset,
            "mixed_precision": cfg.mixed_precision,
        }


def sharded_scores(
    model: Any, logits: torch.Tensor, metric: str, node_data: Any
) -> dict[str, float]:
    """``metric`` on the train, validation and test nodes of a parallel full-graph model's
    logits (``train_acc``, ... or ``train_rocauc``, ...; masks not in ``node_data`` are
    skipped, and so is a ROC-AUC that no task defines; collective)."""
    out = {}
    for name in ("train", "val", "test"):
        key = f"{name}_mask"
        if key not in node_data:
            continue
        if metric == "acc":
            out[f"{name}_acc"] = model.accuracy(logits, key)
            continue
        scores, labels = model.gather_masked(logits, key)
        with contextlib.suppress(UndefinedScoreError):  # the same outcome on every rank
            out[f"{name}_{metric}"] = SCORES[metric](scores, labels)
    return out


def _layer_of(param_name: str) -> int:
    """Layer index of a parameter named like ``weights.0`` or ``params.biases.1``."""
    return int(param_name.rsplit(".", 1)[1])
