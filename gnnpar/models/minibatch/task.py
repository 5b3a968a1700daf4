"""Mini-batch GNN training with neighbour or subgraph sampling (the ``sage`` task).

``sampler`` picks how a step's computation graph is drawn: ``neighbor`` (per-seed fan-outs,
the default, described below), or a subgraph sampler: GraphSAINT's ``saint-node``,
``saint-edge`` and ``saint-rw`` (with the paper's loss and aggregation normalisation,
estimated by pre-sampling) and ClusterGCN's ``cluster`` (:mod:`gnnpar.sampling.saint`,
:mod:`gnnpar.sampling.cluster`). With a subgraph sampler every rank holds the whole graph
and trains on a subgraph of its own per step (:class:`~gnnpar.sampling.SubgraphLoader`),
its gradients reduced by :mod:`gnnpar.shard` like the neighbour sampler's; an epoch is
about one pass over the nodes; evaluation is layer-wise on the full graph.

One process trains on the whole graph. With N processes, each data-parallel rank owns one
part of a partition folder (rank 0 writes it once if it is missing; every rank then reads
only its own part): it samples across parts and fetches remote features with all-to-alls
(:mod:`gnnpar.sampling.distributed`), and the gradients are reduced over the data axis by
:mod:`gnnpar.shard` (stages 0-3, FCDP, mixed precision), overlapped with backward.

A weighted graph's edge weights ride on the blocks (every sampler records its edges' weights,
:attr:`~gnnpar.sampling.Block.weight`; the distributed one sends them with the sampled
neighbours), so the model aggregates with them in training and in evaluation, on one rank or
many (:mod:`gnnpar.models.minibatch.model` says how each layer uses them).

Sampling, the parts' features and the all-to-alls that serve them stay on the host, over gloo
groups of their own; the model, its gradients and their reduction live on ``grid.device``
(a GPU under NCCL): the loader pins each batch and copies it there without blocking.

``train_step`` is **one epoch**: the Trainer's progress bar, evaluation (``eval_every``) and
checkpoints (``checkpoint_every``) count epochs. ``batch_size`` is the **global** batch: the
loader orders every training node by a hash of (seed, epoch, original id) and each rank
trains the nodes of each global batch that it owns; neighbours are drawn per (batch, node)
and dropout masks per (batch, layer, node, feature). A run is therefore the same on any
number of ranks, and a checkpoint (model, optimizer and the loader's global position)
resumes exactly on another one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import gnnpar
from gnnpar import comm
from gnnpar.errors import UserError
from gnnpar.fmt import count
from gnnpar.graph.typed import GraphTypes
from gnnpar.grid import ProcessGrid
from gnnpar.models.hetero import TypedGNN, is_unit
from gnnpar.models.minibatch.model import BlockGNN, GATConv, GCNConv, SAGEConv
from gnnpar.models.minibatch.pyg import full_graph_logits, part_logits, subgraph_logits
from gnnpar.models.pyg.model import (
    build_user_model,
    check_model_option,
    factory_options,
    factory_takes_relations,
    is_user_model,
    seeded,
)
from gnnpar.sampling import (
    ClusterSampler,
    DistNeighborSampler,
    FeatureFetcher,
    LocalPart,
    NeighborSampler,
    NodeLoader,
    SaintEdgeSampler,
    SaintNodeSampler,
    SaintWalkSampler,
    SubgraphLoader,
    compiled,
    distributed_inference,
    full_blocks,
    layerwise_inference,
    parse_fanouts,
)
from gnnpar.sampling.rng import derive_key
from gnnpar.sampling.saint import NODE_PROBABILITIES
from gnnpar.sampling.typed import parse_relation_fanouts
from gnnpar.shard import shard
from gnnpar.train import schedule
from gnnpar.train.config import (
    ConfigError,
    DataParallelConfig,
    ScheduleConfig,
    SelectionConfig,
    TrainerConfig,
    option,
)
from gnnpar.train.loop import (
    BaseTask,
    check_stored_dataset,
    dataset_options,
    load_dataset,
    load_trainable,
)
from gnnpar.train.metrics import SCORES, UndefinedScoreError, metric_for
from gnnpar.train.optim import adam
from gnnpar.train.precision import (
    LossScaler,
    compute_dtype,
    full_precision,
    master_dtype,
    shard_policy,
)
from gnnpar.train.progress import Progress, graph_sizes
from gnnpar.train.spec import GridPlan

_MODELS = ("sage", "gcn", "gat", "rgcn", "hgt")
#: Models of typed graphs (:mod:`gnnpar.models.hetero`): they need a graph with node types.
TYPED_MODELS = ("rgcn", "hgt")
#: ``--sampler`` choices (``vertex``: ScaleGNN's 4D training, :mod:`gnnpar.models.scalegnn.task`).
SAMPLERS = ("neighbor", "vertex", "saint-node", "saint-edge", "saint-rw", "cluster")
_MASKS = ("train", "val", "test")
#: The modules that are units of the data-parallel sharding (the rest: the root unit).
_UNITS = (SAGEConv, GCNConv, GATConv)


def built_in_units(name: str, module: Any) -> bool:
    """The unit policy of the built-in block models (the sage and link tasks'): each layer of
    a :class:`BlockGNN`, and a typed model's units (:func:`~gnnpar.models.hetero.is_unit`)."""
    return isinstance(module, _UNITS) or is_unit(name, module)


_DROPOUT = 0xD809  # salt of the dropout masks' seeds
_LOW31 = (1 << 31) - 1


@dataclasses.dataclass
class MiniBatchConfig(SelectionConfig, ScheduleConfig, DataParallelConfig, TrainerConfig):
    """Options of ``gnnpar train sage`` (and ``--config FILE`` keys)."""

    dataset: str = option("sbm", "dataset name or path (see `gnnpar data list`)")
    root: str | None = option(None, "dataset root folder (default: datasets/)")
    dataset_options: str | None = option(
        None, "dataset options as k=v,k=v (e.g. normalize_features=true)"
    )
    model: str = option(
        "sage",
        "sage (GraphSAGE-mean), gcn or gat; rgcn or hgt for a typed graph (docs/typed.md); "
        "or your own PyG model as module:factory or file.py:factory, trained on each batch's "
        "sampled subgraph (docs/models.md)",
        _MODELS,
    )
    model_options: str | None = option(
        None, "a module:factory model's hyper-parameters as k=v,k=v (e.g. hidden=64)"
    )
    parts: int | None = option(None, "parts of the partition, one per process (default: all)")
    partition_method: str = option("metis", "partitioning method (see gnnpar-partition)")
    partitions: str | None = option(
        None, "partition folder (default: under RUN/parts/), written by rank 0 if missing"
    )
    sampler: str = option(
        "neighbor",
        "neighbor (fan-outs per seed), vertex (ScaleGNN: uniform vertex samples on a 4D grid), "
        "saint-node, saint-edge, saint-rw (GraphSAINT subgraphs) or cluster (ClusterGCN)",
        SAMPLERS,
    )
    grid: str | None = option(
        None, "vertex sampler's grid such as data=2,x=2,y=1,z=2 (default: data = all ranks)"
    )
    fanouts: str = option(
        "10,10",
        "neighbours per hop, seeds' hop first; -1 takes all; on a typed graph per relation, "
        "and a hop may map relations as cites:5/*:10 (docs/typed.md)",
    )
    per_relation: bool = option(
        True, "typed graph: draw each hop's fan-out per relation (false: over all relations)"
    )
    bases: int = option(0, "rgcn: bases of the weight decomposition (0: one matrix per relation)")
    replace: bool = option(False, "sample neighbours with replacement")
    batch_size: int = option(32, "seeds per step over all ranks (the global batch)")
    budget: int = option(
        1000,
        "nodes per vertex sample (vertex); GraphSAINT draws per subgraph: nodes (saint-node), "
        "edges (saint-edge), roots (saint-rw)",
    )
    walk_length: int = option(2, "steps of every saint-rw random walk")
    presample: int = option(50, "subgraphs pre-sampled to estimate GraphSAINT's normalisation")
    node_probability: str = option(
        "norm",
        "saint-node's draw probability: norm (||Â[:,v]||², the paper) or degree (deg(v), "
        "the authors' code)",
        NODE_PROBABILITIES,
    )
    subgraphs_per_step: int = option(
        0,
        "subgraph samplers (saint-*, cluster): subgraphs per optimizer step over all ranks, a "
        "multiple of the ranks, each rank accumulating its share (0: one per rank)",
    )
    clusters: int = option(32, "parts of the ClusterGCN partition (by partition_method)")
    clusters_per_batch: int = option(8, "ClusterGCN parts per subgraph")
    hidden: int = option(64, "hidden width")
    layers: int = option(2, "number of layers (one fan-out each)")
    heads: int = option(4, "attention heads of hidden GAT layers")
    dropout: float = option(0.5, "dropout probability")
    lr: float = option(0.01, "Adam learning rate")
    weight_decay: float = option(5e-4, "Adam weight decay")
    epochs: int = option(50, "training epochs")
    feature_cache: int = option(0, "remote feature rows cached per rank (distributed)")
    prefetch: int = option(1, "batches sampled ahead in a background thread (0: none)")
    out: str = option("runs/sage", "run folder: metrics.jsonl, checkpoints/, parts/")
    eval_every: int = option(1, "evaluate every N epochs (0: only at the end)")

    def check(self) -> None:
        """Reject values that cannot work, naming the key."""
        self.check_trainer()
        self.check_data_parallel()
        self.check_schedule()
        self.check_selection()
        if self.offload != "none" and self.zero_stage is None:
            raise ConfigError(
                f"config key 'offload' = {self.offload} needs zero_stage 1, 2 or 3 (sage runs "
                "stage 0 unless told)"
            )
        check_model_option(self.model, _MODELS, self.model_options)
        if is_user_model(self.model):
            self._check_user_model()
        self._check_sampler()
        if self.sampler != "neighbor":
            return self._check_common()
        try:  # a typed graph's per-relation layers are checked against its relations later
            typed = self.model in TYPED_MODELS
            fanouts = self.fanouts.split(",") if typed else parse_fanouts(self.fanouts)
        except UserError as err:
            raise ConfigError(f"config key 'fanouts': {err}") from None
        if len(fanouts) != self.layers and not is_user_model(self.model):
            raise ConfigError(
                f"config key 'fanouts' gives {len(fanouts)} fan-outs but 'layers' is "
                f"{self.layers}: give one fan-out per layer"
            )
        self._check_common()

    def _check_common(self) -> None:
        if self.model in TYPED_MODELS and self.sampler != "neighbor":
            raise ConfigError(
                f"config key 'sampler': the typed models train on neighbour samples; use "
                f"neighbor, not {self.sampler!r}"
            )
        if self.bases < 0 or self.bases and self.model != "rgcn":
            raise ConfigError(f"config key 'bases' ({self.bases}) is for rgcn, >= 1 (0: none)")
        for key in ("batch_size", "hidden", "layers", "epochs", "heads"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}' must be >= 1, got {getattr(self, key)}")
        if self.parts is not None and self.parts < 1:
            raise ConfigError(f"config key 'parts' must be >= 1, got {self.parts}")
        for key in ("feature_cache", "prefetch"):
            if getattr(self, key) < 0:
                raise ConfigError(f"config key '{key}' must be >= 0, got {getattr(self, key)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"config key 'dropout' must be in [0, 1), got {self.dropout}")
        if self.model == "gat" and self.layers > 1 and self.hidden % self.heads:
            raise ConfigError(
                f"config key 'hidden' ({self.hidden}) must be divisible by 'heads' "
                f"({self.heads}) for GAT"
            )
        if self.lr <= 0:
            raise ConfigError(f"config key 'lr' must be positive, got {self.lr}")

    def _check_user_model(self) -> None:
        """A module:factory model samples neighbours (its depth is its own: the fan-outs
        say how many hops the subgraph has) and runs in its parameters' dtype."""
        if self.sampler != "neighbor":
            raise ConfigError(
                "config key 'sampler': a module:factory model trains on neighbour samples; "
                f"use neighbor, not {self.sampler!r}"
            )
        if self.mixed_precision != "none":
            raise ConfigError(
                "config key 'mixed_precision': a module:factory model runs in its parameters' "
                "dtype; use none"
            )

    def _check_sampler(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ConfigError(
                f"config key 'sampler' must be one of {SAMPLERS}, got {self.sampler!r}"
            )
        for key in ("budget", "presample", "clusters", "clusters_per_batch"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}' must be >= 1, got {getattr(self, key)}")
        if self.node_probability not in NODE_PROBABILITIES:
            raise ConfigError(
                f"config key 'node_probability' must be one of {', '.join(NODE_PROBABILITIES)}, "
                f"got {self.node_probability!r}"
            )
        if self.walk_length < 0:
            raise ConfigError(f"config key 'walk_length' must be >= 0, got {self.walk_length}")
        if self.clusters_per_batch > self.clusters:
            raise ConfigError(
                f"config key 'clusters_per_batch' ({self.clusters_per_batch}) exceeds "
                f"'clusters' ({self.clusters})"
            )
        if self.sampler.startswith("saint") and self.model != "sage":
            raise ConfigError(
                f"config key 'model': GraphSAINT's aggregation normalisation is a weighted "
                f"mean, which the sage model uses; {self.model!r} cannot take it"
            )
        self._check_vertex()
        if self.subgraphs_per_step < 0:
            raise ConfigError(
                f"config key 'subgraphs_per_step' must be >= 0, got {self.subgraphs_per_step}"
            )
        if self.subgraphs_per_step and self.sampler in ("neighbor", "vertex"):
            raise ConfigError(
                "config key 'subgraphs_per_step' is for the saint-* and cluster samplers, not "
                f"{self.sampler}"
            )
        if self.sampler != "neighbor" and self.grad_accum != 1:
            raise ConfigError(
                "config key 'grad_accum' must be 1 with a subgraph sampler (one subgraph per "
                "step and rank)"
            )

    def _check_vertex(self) -> None:
        """The options of ScaleGNN's 4D training, or ``grid`` given without it."""
        if self.sampler != "vertex":
            if self.grid is not None:
                raise ConfigError(
                    "config key 'grid' is for the vertex sampler (4D); the other samplers are "
                    "data parallel over every rank"
                )
            return
        if self.grid is not None:
            from gnnpar.grid import GridError, parse_grid_spec

            try:
                shape = parse_grid_spec(self.grid)
            except GridError as err:
                raise ConfigError(f"config key 'grid': {err}") from None
            if shape.get("pipe", 1) > 1:
                raise ConfigError("config key 'grid': the vertex sampler has no pipe axis")
        if self.model not in ("sage", "gcn"):
            raise ConfigError(
                f"config key 'model': the vertex sampler trains the 3D sage or gcn layers, "
                f"not {self.model!r}"
            )
        if self.budget < 2:
            raise ConfigError(
                f"config key 'budget' must be >= 2 with sampler vertex, got {self.budget}"
            )
        if (self.zero_stage or 0) != 0 or self.fcdp or self.mixed_precision != "none":
            raise ConfigError(
                "the vertex sampler reduces its 3D gradients at zero_stage 0, without fcdp or "
                "mixed_precision"
            )


def plan_problem(cfg: MiniBatchConfig, graph: Any) -> Any:
    """The planner's :class:`~gnnpar.models.minibatch.cost.MiniBatchProblem` for a run of
    ``cfg`` on ``graph`` (a :class:`~gnnpar.graph.Graph`): what ``gnnpar plan sage`` and
    ``benchmarks/memory.py`` hold against
    :func:`~gnnpar.models.minibatch.cost.minibatch_memory`, for the neighbour sampler's GraphSAGE
    or, on a typed graph, its R-GCN (the models the memory model describes)."""
    from gnnpar.models.minibatch.cost import MiniBatchProblem, degree_histogram
    from gnnpar.models.minibatch.typed_cost import typed_sizes

    typed = getattr(graph, "types", None) is not None
    if cfg.sampler != "neighbor" or cfg.model != ("rgcn" if typed else "sage"):
        raise ConfigError(
            "the mini-batch memory model covers GraphSAGE with the neighbour sampler (R-GCN "
            f"on a typed graph), not model {cfg.model} with sampler {cfg.sampler}"
            + (" on a typed graph" if typed else "")
        )
    sizes = None
    if typed:
        try:
            sizes = typed_sizes(graph, cfg.fanouts, cfg.bases or None)
        except UserError as err:
            raise ConfigError(f"config key 'fanouts': {err}") from None
        fanouts = tuple(max(layer) if -1 not in layer else -1 for layer in sizes.relation_fanouts)
    else:
        fanouts = tuple(parse_fanouts(cfg.fanouts))
    train = graph.ndata.get("train_mask")
    return MiniBatchProblem(
        nodes=graph.num_nodes,
        edges=graph.num_edges,
        features=int(graph.feat.shape[1]),
        classes=int(graph.num_classes),
        hidden=cfg.hidden,
        layers=cfg.layers,
        fanouts=fanouts,
        batch_size=cfg.batch_size,
        train_nodes=None if train is None else max(1, int(train.sum())),
        element_size=compute_dtype(cfg).itemsize,
        stage=cfg.zero_stage or 0,
        prefetch=cfg.prefetch,
        feature_cache=cfg.feature_cache,
        degrees=degree_histogram(graph.indptr.numpy()),
        name=Path(cfg.dataset).name or cfg.dataset,
        typed=sizes,
    )


def _partition_folder(cfg: MiniBatchConfig, parts: int) -> Path:
    """The given folder, or one under the run folder named by everything that shapes the
    partition, so that a change of dataset, options or method never reuses a stale one."""
    if cfg.partitions:
        return Path(cfg.partitions)
    keys = [cfg.dataset, cfg.root, cfg.dataset_options, cfg.partition_method, cfg.seed, parts]
    digest = hashlib.sha1(json.dumps(keys).encode()).hexdigest()[:10]
    name = Path(cfg.dataset).name or "graph"
    return Path(cfg.out) / "parts" / f"{name}-{parts}-{digest}"


def _dataset_record(cfg: MiniBatchConfig) -> dict[str, Any]:
    """The dataset's fingerprint record (from its graph folder's manifest when it has one)."""
    from gnnpar.data.catalogue import graph_record

    return graph_record(cfg.dataset, root=cfg.root, **dataset_options(cfg))


def check_partitions(cfg: MiniBatchConfig, folder: str | Path | None = None) -> dict[str, Any]:
    """Check, before any rank starts, that the partition folder (``folder`` or
    ``cfg.partitions``) was cut from ``cfg.dataset``: one ValueError naming both otherwise
    (or naming the missing dataset or the unreadable folder). Returns the folder's meta.
    A launcher may call it in the launching process."""
    import partitioners.format as pformat

    if not (folder or cfg.partitions):
        raise ConfigError("check_partitions needs a partition folder (config key 'partitions')")
    folder = Path(folder or cfg.partitions or "")
    record = _dataset_record(cfg)
    return pformat.check_source(folder, record, label=f"--dataset {cfg.dataset}")


def _warn_idle(meta: dict[str, Any], folder: Path) -> None:
    """One stderr line if some parts hold no training seeds."""
    import partitioners.format as pformat

    message = pformat.idle_parts_message(meta, folder)
    if message:
        print(f"gnnpar train sage: warning: {message}", file=sys.stderr)


def _write_parts(
    cfg: MiniBatchConfig, folder: Path, parts: int, progress: Progress
) -> dict[str, Any]:
    """Partition the dataset into ``parts`` and write ``folder``; returns its meta."""
    import partitioners

    with progress.stage(f"loading {cfg.dataset}"):
        graph = load_dataset(cfg)
        graph.check_trainable()
    # a typed graph: every node type and the target's training nodes (the default)
    metis = cfg.partition_method == "metis" and graph.types is None
    balance = ["nodes", "train"] if metis else None
    method = cfg.partition_method
    with progress.stage(f"partitioning {cfg.dataset} into {parts} parts ({method})"):
        part = partitioners.partition(graph, parts, method=method, seed=cfg.seed, balance=balance)
    with (
        progress.stage(f"writing the parts into {folder}"),
        warnings.catch_warnings(),  # reported once, as one line, by _warn_idle
    ):
        warnings.simplefilter("ignore", partitioners.format.PartitionBalanceWarning)
        partitioners.write(graph, part, folder, halo=1)
    return partitioners.load_meta(folder)


def _checked_parts(cfg: MiniBatchConfig, folder: Path, progress: Progress) -> dict[str, Any]:
    """The meta of an existing partition folder, once checked against the dataset (which
    may mean loading it: a stage of its own)."""
    with progress.stage(f"checking {folder} against {cfg.dataset}"):
        return check_partitions(cfg, folder)


def _prepare_parts(cfg: MiniBatchConfig, grid: ProcessGrid, parts: int, progress: Progress) -> Path:
    """Rank 0 partitions the dataset into ``parts`` if the folder is missing, or checks that
    an existing one was cut from the dataset; others wait."""
    folder = _partition_folder(cfg, parts)

    def check_or_write() -> None:
        if folder.exists():
            meta = _checked_parts(cfg, folder, progress)
        else:
            meta = _write_parts(cfg, folder, parts, progress)
        _warn_idle(meta, folder)

    failure = "rank 0 refused or could not write the partition folder (see its error)"
    comm.on_rank_zero(grid, check_or_write, failure)
    return folder


def check_typed(cfg: MiniBatchConfig, types: GraphTypes | None) -> GraphTypes | None:
    """The graph's types when the model needs them: a typed model on an untyped graph is one
    ConfigError, as are fan-outs that do not fit the graph's relations. An untyped model
    trains on a typed graph's homogeneous view (types ignored)."""
    if cfg.model not in TYPED_MODELS:
        return None
    if types is None:
        raise ConfigError(
            f"config key 'model': {cfg.model} needs a typed graph (node types and relations); "
            f"dataset {cfg.dataset!r} has none (docs/typed.md)"
        )
    if cfg.per_relation:
        try:
            parse_relation_fanouts(cfg.fanouts, types)
        except UserError as err:
            raise ConfigError(f"config key 'fanouts': {err}") from None
    return types


def warm_up_kernels(subgraph: bool, progress: Progress) -> compiled.WarmUp | None:
    """Compile the sampler's numba kernels now, or load them from numba's on-disk cache,
    with one stage line on rank 0 saying which. Left to their first call they would compile
    inside the first epoch (seconds on a machine's first run), and its time in the metrics
    and in the plot of epoch times would include that. None without numba."""
    if not compiled.available():
        return None
    # the blocks of layer-wise evaluation relabel too
    kernels = ("induced", "relabel") if subgraph else ("sample_rows", "relabel")
    with progress.stage("preparing the sampling kernels (numba)") as notes:
        warm = compiled.warm_up(kernels)
        if warm is not None and warm.compiled:
            notes.append("compiled (once: numba caches them for later runs)")
        elif warm is not None and warm.loaded:
            notes.append("loaded from numba's cache")
    return warm


class MiniBatchTask(BaseTask):
    """The ``sage`` task: sampled mini-batch training of GraphSAGE, GCN or GAT."""

    unit = "epoch"

    @property
    def selection(self) -> tuple[str, str]:
        """The best model is the one of the best validation score of the dataset's metric
        (``val_acc``, ``val_rocauc``; :mod:`gnnpar.train.selection`)."""
        return (f"val_{self.metric}", "max")

    @staticmethod
    def preflight(cfg: MiniBatchConfig, world_size: int) -> None:
        """Before launch: the dataset loads and has training nodes, and a given
        ``partitions`` folder that exists was cut from it (:func:`check_partitions`).
        Ranks that will read only that partition (neighbour sampling on several ranks) and a
        dataset stored as a graph folder: the folder is checked without loading it
        (:func:`~gnnpar.train.loop.check_stored_dataset`), so that a graph larger than one
        process's memory can be trained from its partition."""
        from gnnpar.data.catalogue import stored_folder

        given = cfg.partitions and Path(cfg.partitions).exists()
        folder = None
        if given and world_size > 1 and cfg.sampler == "neighbor":
            folder = stored_folder(cfg.dataset, cfg.root, **dataset_options(cfg))
        if folder is not None:
            check_stored_dataset(cfg, folder)
        else:
            graph = load_dataset(cfg, warn_directed=True)
            graph.check_trainable()
            check_typed(cfg, graph.types)
            if is_user_model(cfg.model):  # the factory runs and its modules are checked here
                options = factory_options(cfg.model_options)
                relations = None if graph.types is None else graph.types.num_relations
                build_user_model(
                    cfg.model, graph.feat.shape[1], graph.num_classes, options, relations
                )
        if given:
            check_partitions(cfg)

    def __init__(self, cfg: MiniBatchConfig, grid: ProcessGrid, plan: GridPlan, progress: Progress):
        """The task on ``grid`` (every rank on the data axis: :func:`gnnpar.train.spec.given_grid`
        of a config without ``grid``); ``progress``: where rank 0 reports the slow preparation
        stages and each epoch's batches."""
        self.cfg = cfg
        self.progress = progress
        # The model lives on the grid's device; sampling stays on the host (sample_grid).
        self.grid = grid
        self.device = self.grid.device
        world = self.grid.world_size
        parts = cfg.parts or world
        if parts != world:
            raise ConfigError(
                f"config key 'parts' is {parts} but {world} processes run: each data-parallel "
                "rank owns one part (use --nprocs equal to --parts)"
            )
        self.rank = self.grid.rank("data")
        #: Whether steps train on subgraphs (GraphSAINT, ClusterGCN): every rank then holds
        #: the whole graph and samples a subgraph of its own.
        self.subgraph = cfg.sampler != "neighbor"
        #: What preparing the compiled sampling kernels took (None without numba).
        self.kernel_warm_up = warm_up_kernels(self.subgraph, progress)
        self.typed = cfg.model in TYPED_MODELS
        self.fanouts: Any = [] if self.subgraph else cfg.fanouts if self.typed else (
            parse_fanouts(cfg.fanouts))  # fmt: skip
        self.distributed = world > 1 and not self.subgraph  # partitioned over the ranks
        if self.distributed:
            self._setup_parts(parts, progress)
        else:
            with progress.stage(f"loading {cfg.dataset}"):
                self._setup_graph()
        if self.subgraph:
            with progress.stage(f"{cfg.sampler} sampler (partition or pre-sampling)"):
                self._setup_subgraphs()
        #: Who chose the grid, for the start lines.
        self.grid_choice = (
            "data parallel, one part per rank"
            if self.distributed
            else "data parallel, one subgraph per rank and step"
            if self.subgraph and world > 1
            else None
        )
        with progress.stage("building the model"):
            self._build_model(cfg)
        self.scaler = LossScaler(cfg.mixed_precision == "fp16")
        self.num_steps = cfg.epochs

    def _build_model(self, cfg: MiniBatchConfig) -> None:
        """The GNN, sharded over the data axis, and its Adam."""
        torch.manual_seed(cfg.seed)
        self.user_model = is_user_model(cfg.model)
        #: A user's R-GCN or RGAT (its factory takes num_relations): called with each
        #: sampled edge's relation, ``model(x, edge_index, edge_type)``.
        self.relational = self.user_model and factory_takes_relations(cfg.model)
        if self.user_model:
            options = factory_options(cfg.model_options)
            types = self._graph_types()
            relations = None if types is None else types.num_relations
            net = build_user_model(cfg.model, self.in_dim, self.num_classes, options, relations)
        elif self.typed:
            net = TypedGNN(
                self.types, cfg.hidden, self.num_classes, cfg.layers, cfg.model, cfg.dropout,
                cfg.heads, num_bases=cfg.bases or None,
            )  # fmt: skip
        else:
            net = BlockGNN(
                self.in_dim, cfg.hidden, self.num_classes, cfg.layers, cfg.dropout, cfg.model,
                cfg.heads,
            )  # fmt: skip
        self.net = net.to(self.device, master_dtype(cfg))
        # the one data-parallel path: each layer a unit (its parameters gathered together at
        # stage 3, its gradients in one bucket at stages 0-2)
        self.model = shard(
            self.net,
            self.grid,
            cfg.zero_stage or 0,
            units=None if self.user_model else built_in_units,
            mixed_precision=shard_policy(cfg),
            **cfg.shard_options(),
        )

    def _make_optimizer(self) -> torch.optim.Optimizer:
        cfg = self.cfg
        return self.model.attach(
            adam(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        )

    def data_record(self) -> dict[str, Any] | None:
        """The graph trained on: the one the partition was cut from (its recorded source),
        or the loaded graph's fingerprint (taken when it was loaded)."""
        if self.distributed:
            source = self.part.meta.get("source") or {}
            return {"name": self.cfg.dataset, "fingerprint": source.get("fingerprint")}
        return {"name": self.cfg.dataset, "fingerprint": self._fingerprint}

    def summary(self) -> str:
        """What the run trains on what: the graph's sizes and its training seeds (with the
        partition, when distributed)."""
        cfg = self.cfg
        if self.distributed:
            meta = self.part.meta
            nodes, edges = int(meta["num_nodes"]), int(meta["num_edges"])
            method = meta.get("method", cfg.partition_method)
            seeds = f"{count(self.num_seeds, 'seed')} in {meta['num_parts']} parts ({method})"
        else:
            nodes, edges = self.graph.num_nodes, self.graph.num_edges
            seeds = count(self.num_seeds, "seed")
        multilabel = self.metric != "acc"
        sizes = graph_sizes(nodes, edges, self.in_dim, self.num_classes, seeds, multilabel)
        return f"{cfg.model} on {cfg.dataset}: {sizes}"

    # ------------------------------------------------------------------ setup
    def _setup_graph(self) -> None:
        cfg = self.cfg
        graph = load_trainable(cfg)
        # the graph as stored, before its features take the compute dtype: what a partition
        # of it records, so that a run resumes across process counts (data_record)
        record = graph.record()
        self._fingerprint = record["fingerprint"]
        if cfg.partitions:  # one process trains on the whole graph: only check provenance
            import partitioners.format as pformat

            pformat.check_source(cfg.partitions, record, label=f"--dataset {cfg.dataset}")
        graph.ndata["feat"] = graph.feat.to(compute_dtype(cfg))
        self.types = check_typed(cfg, graph.types)
        self.graph = graph
        self.in_dim, self.num_classes = graph.feat.shape[1], graph.num_classes
        self.metric = metric_for(graph.label)
        self.num_seeds = int(graph.train_mask.sum())
        self.fetcher: FeatureFetcher | None = None
        self._eval_blocks = [b.to(self.device) for b in full_blocks(graph)]
        if self.subgraph:
            return  # the sampler and loader: _setup_subgraphs
        sampler = NeighborSampler(
            graph, self.fanouts, cfg.replace, cfg.seed, per_relation=cfg.per_relation
        )
        self.loader: NodeLoader | SubgraphLoader = NodeLoader(
            sampler,
            graph.train_mask,
            cfg.batch_size,
            seed=cfg.seed,
            features=graph.feat,
            labels=graph.label,
            prefetch=cfg.prefetch,
            micro_batches=cfg.grad_accum,
            device=self.device,
            prepare=self._preparer(),
        )

    def _setup_subgraphs(self) -> None:
        """The GraphSAINT or ClusterGCN sampler on the whole graph, and this rank's loader."""
        cfg, graph = self.cfg, self.graph
        common: dict[str, Any] = {"train_mask": graph.train_mask, "seed": cfg.seed}
        saint = {**common, "presample": cfg.presample}
        if cfg.sampler == "saint-node":
            sampler: Any = SaintNodeSampler(
                graph, cfg.layers, cfg.budget, cfg.node_probability, **saint
            )
        elif cfg.sampler == "saint-edge":
            sampler = SaintEdgeSampler(graph, cfg.layers, cfg.budget, **saint)
        elif cfg.sampler == "saint-rw":
            sampler = SaintWalkSampler(graph, cfg.layers, cfg.budget, cfg.walk_length, **saint)
        else:
            if cfg.clusters > graph.num_nodes:
                raise ConfigError(
                    f"config key 'clusters' ({cfg.clusters}) exceeds the graph's "
                    f"{graph.num_nodes} nodes"
                )
            sampler = ClusterSampler(
                graph,
                cfg.layers,
                cfg.clusters,
                cfg.clusters_per_batch,
                method=cfg.partition_method,
                **common,
            )
        data = self.grid.size("data")
        if cfg.subgraphs_per_step % data:
            raise ConfigError(
                f"config key 'subgraphs_per_step' ({cfg.subgraphs_per_step}) must be a multiple "
                f"of the {data} data ranks"
            )
        self.loader = SubgraphLoader(
            sampler,
            features=graph.feat,
            labels=graph.label,
            rank=self.rank,
            ranks=data,
            per_step=cfg.subgraphs_per_step or None,
            prefetch=cfg.prefetch,
            device=self.device,
        )

    def _setup_parts(self, parts: int, progress: Progress) -> None:
        cfg = self.cfg
        folder = _prepare_parts(cfg, self.grid, parts, progress)
        # each rank verifies the checksums of the files it maps: its own part's
        part = LocalPart.load(folder, self.rank, verify="checksum")
        if part.num_parts != parts:
            raise ConfigError(
                f"partition folder {folder} holds {part.num_parts} parts, but {parts} processes "
                "run: remove it or point --partitions elsewhere"
            )
        for key in ("feat", "label", "train_mask"):
            if key not in part.ndata:
                raise ConfigError(f"partition folder {folder} has no node data {key!r}")
        part.ndata["feat"] = part.ndata["feat"].to(compute_dtype(cfg))
        self.part = part
        # The loader samples and fetches in a background thread: it gets process groups of
        # its own, so its all-to-alls never interleave with this thread's collectives.
        self.sample_grid = gnnpar.init(
            backend="gloo", ranks_per_node=cfg.ranks_per_node, timeout=cfg.timeout
        )
        self.types = check_typed(cfg, part.types)
        sampler = DistNeighborSampler(
            part, self.fanouts, self.sample_grid, replace=cfg.replace, seed=cfg.seed,
            per_relation=cfg.per_relation,
        )  # fmt: skip
        self.fetcher = FeatureFetcher(part, self.sample_grid, cache_size=cfg.feature_cache)
        train = part.ndata["train_mask"].to(torch.bool)
        owned = torch.nonzero(train, as_tuple=True)[0]
        seeds = part.start + owned
        # Every rank knows every training node's original id: the global batches (and so
        # the run) are then the same on any number of ranks.
        keys = part.orig_ids.index_select(0, owned)
        host = self.sample_grid
        sizes = comm.gather_sizes(keys.numel(), host, "data")
        all_keys = comm.all_gather(keys, host, "data", sizes=sizes)
        if all_keys.numel() == 0:
            raise ConfigError(f"dataset {cfg.dataset!r} has no training nodes")
        self.num_seeds = int(all_keys.numel())
        labels = part.ndata["label"]
        start = part.start
        self.loader = NodeLoader(
            sampler,
            seeds,
            cfg.batch_size,
            seed=cfg.seed,
            features=self.fetcher.fetch,
            labels=lambda ids: labels.index_select(0, ids - start),
            prefetch=cfg.prefetch,
            keys=keys,
            all_keys=all_keys,
            micro_batches=cfg.grad_accum,
            device=self.device,
            prepare=self._preparer(),
        )
        self.in_dim = int(part.ndata["feat"].shape[1])
        self.metric = metric_for(labels)
        recorded = (part.meta.get("source") or {}).get("num_classes")
        if recorded is not None:  # stored by the dataset, not inferred from the labels
            self.num_classes = int(recorded)
            return
        if self.metric != "acc":  # multi-label: one binary task per column
            self.num_classes = int(labels.shape[1])
            return
        num_classes = torch.tensor([int(labels.max()) + 1 if labels.numel() else 0])
        comm.all_reduce(num_classes, host, "data", op="max")
        self.num_classes = int(num_classes)

    # ------------------------------------------------------------------ the protocol
    def train_step(self, step: int) -> dict[str, float]:
        """One epoch of mini-batches; returns its loss, throughput and traffic."""
        cfg, net, dp = self.cfg, self.net, self.model
        lr = schedule.apply(self.optimizer, cfg, step, self.num_steps)
        self.loader.set_epoch(step)
        net.train()
        fetch_before = dict(self.fetcher.stats) if self.fetcher else {}
        # loss, correct, seeds, sampling bytes, subgraph nodes
        sums = torch.zeros(5, dtype=torch.float64, device=self.device)
        t0 = time.perf_counter()
        data = self.grid.size("data")
        # closed on the way out of an interrupt too (not by its finaliser at exit)
        with self.progress.bar(
            len(self.loader),
            unit="batch",
            show=len(self.loader) > 1,
            desc=f"epoch {step + 1}",
            leave=False,
        ) as bar:
            for batch in self.loader:
                if self.subgraph:
                    self._subgraph_update(batch, sums)
                    bar.update(1)
                    continue
                last = batch.micro == cfg.grad_accum - 1
                dropout_seed = derive_key(cfg.seed, _DROPOUT, batch.epoch, batch.index) & _LOW31
                with contextlib.nullcontext() if last else dp.no_sync():
                    logits = full_precision(self._forward(batch, dropout_seed))
                    loss = self._loss_sum(logits, batch.y)
                    # the data axis averages gradients: scale the summed loss so the result is
                    # the gradient of the mean loss over the global batch
                    self.scaler.scale_loss(loss * (data / batch.global_size)).backward()
                if last:
                    self.scaler.unscale(dp.parameters())
                    if self.scaler.update(float(dp.grad_norm()) if self.scaler.enabled else 0.0):
                        self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                sums[0] += float(loss.detach())
                if batch.num_seeds and self.metric == "acc":
                    sums[1] += float((logits.argmax(1) == batch.y).sum())
                sums[2] += batch.num_seeds
                sums[3] += batch.stats.get("sample_bytes", 0.0)
                bar.update(1)
        elapsed = time.perf_counter() - t0
        fetched = (
            {k: v - fetch_before[k] for k, v in self.fetcher.stats.items()} if self.fetcher else {}
        )
        extra = torch.tensor(
            [fetched.get("bytes", 0), fetched.get("remote", 0), fetched.get("hits", 0)],
            dtype=torch.float64,
            device=self.device,
        )
        both = torch.cat([sums, extra])
        comm.all_reduce(both, self.grid, "data")
        seeds = max(float(both[2]), 1.0)
        # a subgraph's loss is already its estimate of the mean: average over subgraphs
        subgraphs = float(len(self.loader) * data)
        record = {
            "loss": float(both[0]) / (subgraphs if self.subgraph else seeds),
            "seeds_per_s": float(both[2]) / elapsed,
            "batches": float(len(self.loader)),
            "lr": lr,
        }
        if self.metric == "acc":
            record["batch_acc"] = float(both[1]) / seeds
        if self.subgraph:
            record["subgraph_nodes"] = float(both[4]) / subgraphs
        if self.distributed:
            fetch_bytes, remote, hits = (float(v) for v in both[sums.numel() :])
            record["sample_bytes"] = float(both[3])
            record["feature_bytes"] = fetch_bytes
            record["cache_hit_rate"] = hits / remote if remote else 0.0
        return record

    def _preparer(self) -> Any:
        """What the loader runs on each batch where it samples it (its prefetch thread), on
        a CPU: :meth:`_prepare_batch`; None on a GPU (the batch moves after)."""
        return self._prepare_batch if self.device.type == "cpu" else None

    def _prepare_batch(self, batch: Any) -> Any:
        """The typed model's block indexing (kept as the batch's ``prepared``), or the block
        model's operators (kept by the blocks); nothing for a user's model."""
        if self.typed:
            return self._typed_blocks(batch)
        prepare = getattr(self.net, "prepare", None)
        return None if prepare is None else prepare(batch)

    def _typed_blocks(self, batch: Any) -> list[Any]:
        """The typed model's indexing of the batch's blocks (nodes by type, edges by
        relation): the loader builds it where it samples, in the prefetch thread, so the
        step does not."""
        dtype = None if batch.x is None else batch.x.dtype  # the features', the model's
        return [self.net.typed_block(b, dtype) for b in batch.blocks]

    def _forward(self, batch: Any, dropout_seed: int) -> torch.Tensor:
        """The seeds' logits: the built-in model on the blocks, or a user's model on the
        batch's sampled subgraph with its dropout drawn from ``dropout_seed``."""
        if self.typed:  # the blocks' typed indexing, built by the prefetch thread on a CPU
            typed = batch.prepared if self.device.type == "cpu" else None
            return self.net(batch.blocks, batch.x, dropout_seed=dropout_seed, typed=typed)
        if not self.user_model:
            return self.net(batch.blocks, batch.x, dropout_seed=dropout_seed)
        with seeded(dropout_seed, self.device):
            return subgraph_logits(self.net, batch.blocks, batch.x, self.relational)

    def _subgraph_update(self, batch: Any, sums: torch.Tensor) -> None:
        """One subgraph of this rank's share of a step: the sum of its seeds' losses
        weighted by the sampler's ``seed_weight`` (an estimate of the mean training loss),
        averaged over the rank's share (accumulated) and over the data axis (the gradient
        reduction); the last subgraph of the share steps the optimizer. Adds to ``sums``
        (see train_step)."""
        cfg, net, dp = self.cfg, self.net, self.model
        share = self.loader.micro_batches
        last = batch.micro == share - 1
        dropout_seed = derive_key(cfg.seed, _DROPOUT, batch.epoch, batch.index) & _LOW31
        with contextlib.nullcontext() if last else dp.no_sync():
            logits = full_precision(net(batch.blocks, batch.x, dropout_seed=dropout_seed))
            weight = batch.seed_weight.to(logits.dtype)
            loss = (self._loss_terms(logits, batch.y) * weight).sum()
            self.scaler.scale_loss(loss / share if share > 1 else loss).backward()
        if last:
            self.scaler.unscale(dp.parameters())
            if self.scaler.update(float(dp.grad_norm()) if self.scaler.enabled else 0.0):
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        train = weight > 0
        sums[0] += float(loss.detach())
        if self.metric == "acc":
            sums[1] += float((logits.argmax(1) == batch.y)[train].sum())
        sums[2] += float(train.sum())
        sums[4] += batch.num_seeds

    def _logits(self) -> torch.Tensor:
        """Logits of every node this rank owns (all of them on one rank), with full
        neighbourhoods (layer-wise inference)."""
        dev = self.device
        if self.user_model and not self.distributed:
            was_training = self.net.training
            self.net.eval()
            try:
                return full_graph_logits(self.net, self.graph, dev, self.relational)
            finally:
                self.net.train(was_training)
        if self.user_model:
            logits = part_logits(self.net, self.part, self.sample_grid, relational=self.relational)
            return logits.to(dev)
        if not self.distributed:
            g = self.graph
            return layerwise_inference(
                self.net, g, features=g.feat.to(dev), blocks=self._eval_blocks
            )
        part = self.part
        return distributed_inference(
            self.net, part, part.ndata["feat"], self.sample_grid, device=dev
        )

    @torch.no_grad()
    def predict(self) -> torch.Tensor:
        """Every node's prediction in original node order, on every rank (collective): its
        class (arg-max of the logits) as int64, or for multi-label targets each task's
        probability (sigmoid of the logits) as float32, N x C. A typed graph's nodes
        outside the target type get -1 (they have no classes)."""
        logits = self._logits()
        if self.metric == "acc":
            pred = logits.argmax(1).to(torch.int64)
        else:
            pred = torch.sigmoid(logits.float())
        if not self.distributed:
            return self._target_only(pred.cpu())
        part = self.part
        out = torch.full((int(part.meta["num_nodes"]), *pred.shape[1:]), -1, dtype=pred.dtype)
        out[part.orig_ids[: part.num_owned].long()] = pred.cpu()  # owned nodes first
        # each node is owned by exactly one part: the maximum is its owner's prediction
        return self._target_only(comm.all_reduce(out, self.sample_grid, "data", op="max"))

    def _graph_types(self) -> Any:
        """The graph's :class:`~gnnpar.graph.typed.GraphTypes` (this rank's part's with
        distributed sampling), None for an untyped graph."""
        return (self.part if self.distributed else self.graph).types

    def _target_only(self, pred: torch.Tensor) -> torch.Tensor:
        """``pred`` (original order) with -1 outside a typed graph's target type (whatever
        the model: an untyped or a user's model too)."""
        types = self._graph_types()
        return pred if types is None else types.target_only(pred)

    def _loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss summed over the batch's seeds: cross-entropy, or for multi-label (N x C)
        labels the binary cross-entropy with logits averaged over the tasks (so that the
        mean over seeds is ``F.binary_cross_entropy_with_logits``'s mean over entries)."""
        return self._loss_terms(logits, labels).sum()

    def _loss_terms(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Every seed's loss (see :meth:`_loss_sum`)."""
        if self.metric == "acc":
            return F.cross_entropy(logits, labels, reduction="none")
        bce = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
        return bce.mean(1)

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """The dataset's score (:attr:`metric`) on the train/val/test masks, with full
        neighbourhoods (layer-wise): accuracy from counts, or ROC-AUC from the masked rows'
        logits gathered over the data axis (skipped where no task defines it)."""
        dev = self.device
        logits = self._logits()
        source = self.graph if not self.distributed else self.part
        label, data = source.ndata["label"].to(dev), source.ndata
        if self.metric != "acc":
            return self._gathered_scores(logits, label, data)
        pred = logits.argmax(1)
        counts = torch.zeros(2 * len(_MASKS), dtype=torch.float64, device=dev)
        for i, name in enumerate(_MASKS):
            mask = data.get(f"{name}_mask")
            if mask is not None:
                mask = mask.to(dev, torch.bool)
                counts[2 * i] = (pred[mask] == label[mask]).sum()
                counts[2 * i + 1] = mask.sum()
        comm.all_reduce(counts, self.grid, "data")
        return {
            f"{name}_acc": float(counts[2 * i] / counts[2 * i + 1])
            for i, name in enumerate(_MASKS)
            if counts[2 * i + 1] > 0
        }

    def _gathered_scores(
        self, logits: torch.Tensor, label: torch.Tensor, data: dict[str, torch.Tensor]
    ) -> dict[str, float]:
        """:attr:`metric` on each mask from every rank's masked rows (one gather per mask)."""
        out = {}
        for name in _MASKS:
            mask = data.get(f"{name}_mask")
            if mask is None:  # every rank's part has the same keys
                continue
            mask = mask.to(logits.device, torch.bool)
            rows, targets = logits[mask].contiguous(), label[mask].contiguous()
            if self.distributed:
                sizes = comm.gather_sizes(rows.shape[0], self.grid, "data")
                rows = comm.all_gather(rows, self.grid, "data", sizes=sizes)
                targets = comm.all_gather(targets, self.grid, "data", sizes=sizes)
            with contextlib.suppress(UndefinedScoreError):  # the same outcome on every rank
                out[f"{name}_{self.metric}"] = SCORES[self.metric](rows.float(), targets)
        return out

    def extra_state(self) -> dict[str, Any]:
        """The loader's position (the model and optimizer go through the checkpoint)."""
        return {"loader": self.loader.state_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`extra_state`."""
        self.loader.load_state_dict(state["loader"])

    def describe(self) -> dict[str, Any]:
        """The run's task, model and sizes (recorded in its checkpoints)."""
        c = self.cfg
        return {
            "task": "sage",
            "model": c.model,
            "in_dim": self.in_dim,
            "hidden": c.hidden,
            "classes": self.num_classes,
            "layers": c.layers,
        }
