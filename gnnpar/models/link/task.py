"""Link prediction (the ``link`` task): an encoder embeds every node, a decoder scores node
pairs, and the model learns to score the training edges above sampled negatives.

**Data.** The dataset's own edge split where it has one (an ``ogbl-*`` catalogue entry, a
folder written by ``gnnpar data split-edges``), else one cut here (``split``: ``random`` or
``time:ATTR``, fractions ``val_fraction`` / ``test_fraction``). The graph the encoder reads is
the split's message-passing graph: validation and test edges never carry messages.

**Mini-batch** (``mode = "minibatch"``, the default). The batches are global batches of
training edges (``batch_size`` positives over all ranks) handed out by the one
:class:`~gnnpar.sampling.NodeLoader`, whose "seeds" are edge ids
(:class:`~gnnpar.sampling.edge.EdgeSampler`): each positive's ``num_negatives`` negatives
(:class:`~gnnpar.sampling.negative.NegativeSampler`, keyed by the edge id) and the
neighbourhoods of every endpoint are sampled in one set of blocks, with the batch's target
edges and their reverses left out of message passing (``exclude``). Every rank holds the
graph and trains the edges of each global batch it owns (edge id mod ranks); the gradients
are reduced by :mod:`gnnpar.shard` (ZeRO stages, FCDP, offload), so a run is the same on any
number of ranks.

**Full graph** (``mode = "full"``). The encoder (a PyG model: the built-in
:class:`~gnnpar.models.link.encoders.PyGEncoder`, ``RGCNConv`` layers on a typed graph's
relations' operators, or the user's ``module:factory``) runs on the
x × y × z grid through :func:`~gnnpar.models.fullgraph.pyg.parallelize_pyg` (each rank holds
its rows of every embedding); each step scores every training positive and its negatives,
each rank a slice of them, with the endpoints' rows fetched from their owners
(:func:`~gnnpar.sampling.distributed.fetch_rows`, differentiable).

**Evaluation.** Embeddings of every node with full neighbourhoods, then the split's
validation and test positives against its negatives: ``mrr``, ``rocauc`` and ``hits@K``
(OGB's semantics, :func:`gnnpar.train.metrics.link_scores`); the best model is the one of the
best validation score of the split's metric.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gnnpar import comm
from gnnpar.errors import UserError
from gnnpar.fmt import count
from gnnpar.graph import Graph
from gnnpar.graph.edge_split import check_metric, split_edges
from gnnpar.grid import ProcessGrid
from gnnpar.models.fullgraph.embedding import FEATURELESS, featureless_nodes
from gnnpar.models.fullgraph.relations import RELATION_NORM
from gnnpar.models.hetero import TypedGNN
from gnnpar.models.link.decoders import DECODERS, LOSSES, bce_sum, make_decoder, margin_sum
from gnnpar.models.link.encoders import (
    ENCODERS,
    FULL_TYPED_ENCODERS,
    TYPED_ENCODERS,
    LinkModel,
    PyGEncoder,
)
from gnnpar.models.minibatch.model import BlockGNN
from gnnpar.models.minibatch.pyg import full_graph_logits
from gnnpar.models.minibatch.task import built_in_units
from gnnpar.models.pyg.model import (
    build_user_model,
    check_model_option,
    factory_options,
    factory_takes_relations,
    is_user_model,
    seeded,
)
from gnnpar.sampling import NeighborSampler, NodeLoader, full_blocks, parse_fanouts
from gnnpar.sampling.edge import EXCLUDE, EdgeSampler, graph_keys, sorted_edge_keys
from gnnpar.sampling.negative import NegativeSampler, load_candidates
from gnnpar.sampling.rng import derive_key
from gnnpar.shard import shard
from gnnpar.train import schedule
from gnnpar.train.config import (
    ConfigError,
    DataParallelConfig,
    ScheduleConfig,
    SelectionConfig,
    TrainerConfig,
    one_of,
    option,
)
from gnnpar.train.loop import BaseTask, load_dataset
from gnnpar.train.metrics import UndefinedScoreError, link_scores
from gnnpar.train.optim import adam
from gnnpar.train.precision import master_dtype, shard_policy
from gnnpar.train.progress import Progress
from gnnpar.train.spec import GridPlan

MODES = ("minibatch", "full")
NEGATIVES = ("uniform", "degree")
_DROPOUT = 0xD809  # salt of the dropout masks' seeds (as the node task's)
_FULL_NEG = 0x46E6  # salt of the full-graph step's negatives

_LOW31 = (1 << 31) - 1


@dataclasses.dataclass
class LinkConfig(SelectionConfig, ScheduleConfig, DataParallelConfig, TrainerConfig):
    """Options of ``gnnpar train link`` (and ``--config FILE`` keys)."""

    dataset: str = option("sbm", "dataset name or path (see `gnnpar data list`)")
    root: str | None = option(None, "dataset root folder (default: datasets/)")
    dataset_options: str | None = option(None, "dataset options as k=v,k=v")
    split: str = option(
        "auto",
        "the edge split: auto (the dataset's own, else random), stored (the dataset's own: an "
        "ogbl-* entry or a folder of `gnnpar data split-edges`), random, or time:ATTR (the "
        "latest edges by a node attribute test)",
    )
    val_fraction: float = option(0.05, "validation edges of a split cut here")
    test_fraction: float = option(0.1, "test edges of a split cut here")
    eval_negatives: str = option(
        "pairs", "negatives of a split cut here: pairs (1 per positive, shared) or per-source"
    )
    eval_num_negatives: int = option(1, "negatives per positive of a split cut here")
    edge_labels: str | None = option(
        None,
        "edge classification or regression on a split cut here: weight (regress the graph's "
        "edge weights) or a .npy of one label per edge in CSR order (int64 classes, or floats)",
    )
    mode: str = option(
        "minibatch",
        "minibatch (sampled edge batches, data parallel) or full (full-graph encoder on an "
        "x × y × z grid)",
        MODES,
    )
    sampling: str = option(
        "local",
        "minibatch: local (every rank holds the graph) or partitioned (each rank one METIS part "
        "of the message graph, sampling and features fetched across parts)",
        ("local", "partitioned"),
    )
    partition_method: str = option("metis", "partitioned sampling's method (see gnnpar-partition)")
    grid: str | None = option(None, "full mode's grid such as x=2,y=1,z=2 (default: x = all)")
    blocks: int = option(8, "full mode: file blocks per side when cutting the graph's shards")
    model: str = option(
        "sage", "the encoder: sage, gcn or gat; rgcn or hgt on a typed graph (hgt minibatch "
        "only); or your own PyG model as module:factory", ENCODERS,
    )  # fmt: skip
    relation: str | None = option(
        None, "typed graph: the relation to predict (e.g. writes, or author___writes___paper)"
    )
    reverse_relation: str | None = option(
        None, "typed graph: the relation holding its reverses (default: rev_<relation>)"
    )
    per_relation: bool = option(
        True, "typed graph: draw each hop's fan-out per relation (false: over all relations)"
    )
    featureless: str = option(
        "zero",
        "typed graph, mode full: a featureless type's input rows are zero (as stored) or learn "
        "(a learnt row per node, sharded as the features)",
        FEATURELESS,
    )
    model_options: str | None = option(None, "a module:factory model's options as k=v,k=v")
    hidden: int = option(64, "hidden and embedding width")
    layers: int = option(2, "encoder layers (one fan-out each in minibatch mode)")
    heads: int = option(4, "attention heads of hidden GAT layers")
    dropout: float = option(0.0, "dropout probability of the encoder")
    decoder: str = option("dot", "dot, mlp (on h_s * h_d) or distmult", DECODERS)
    decoder_layers: int = option(2, "layers of the MLP decoder")
    loss: str = option("bce", "bce (positives 1, negatives 0) or margin", LOSSES)
    margin: float = option(1.0, "margin of the margin loss")
    negatives: str = option(
        "uniform",
        "training negatives: uniform, degree (degree^0.75) or a .npy file of hard-negative "
        "candidates per source node (num_nodes x C, -1 pads)",
    )
    num_negatives: int = option(1, "training negatives per positive")
    exclude_true: bool = option(False, "redraw training negatives that are true edges")
    exclude: str = option(
        "reverse",
        "what a batch's target edges take out of its message passing: reverse (the edge and "
        "its reverse), self (the edge) or none (leaks the target; for ablations)",
        EXCLUDE,
    )
    fanouts: str = option("10,10", "neighbours per hop, seeds' hop first; -1 takes all")
    replace: bool = option(False, "sample neighbours with replacement")
    batch_size: int = option(1024, "positive edges per step over all ranks (minibatch)")
    lr: float = option(0.01, "Adam learning rate")
    weight_decay: float = option(0.0, "Adam weight decay")
    epochs: int = option(20, "training epochs (full mode: one step over every edge each)")
    hits: str = option("10,50,100", "the K of the Hits@K reported")
    prefetch: int = option(1, "batches sampled ahead in a background thread (0: none)")
    out: str = option("runs/link", "run folder: metrics.jsonl, checkpoints/")
    eval_every: int = option(1, "evaluate every N epochs (0: only at the end)")

    def check(self) -> None:
        """Reject values that cannot work, naming the key."""
        self.check_trainer()
        self.check_data_parallel()
        self.check_schedule()
        self.check_selection()
        check_model_option(self.model, ENCODERS, self.model_options)
        if self.mode not in MODES:
            raise ConfigError(f"config key 'mode' must be one of {MODES}, got {self.mode!r}")
        if self.decoder not in DECODERS:
            raise ConfigError(f"config key 'decoder' must be one of {DECODERS}")
        if self.loss not in LOSSES:
            raise ConfigError(f"config key 'loss' must be one of {LOSSES}")
        if self.exclude not in EXCLUDE:
            raise ConfigError(f"config key 'exclude' must be one of {EXCLUDE}")
        self._check_split()
        for key in ("hidden", "layers", "heads", "epochs", "batch_size", "num_negatives",
                    "decoder_layers", "eval_num_negatives", "blocks"):  # fmt: skip
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}' must be >= 1, got {getattr(self, key)}")
        if self.prefetch < 0:
            raise ConfigError(f"config key 'prefetch' must be >= 0, got {self.prefetch}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"config key 'dropout' must be in [0, 1), got {self.dropout}")
        if self.lr <= 0:
            raise ConfigError(f"config key 'lr' must be positive, got {self.lr}")
        if self.negatives not in NEGATIVES and not self.negatives.endswith(".npy"):
            raise ConfigError(
                f"config key 'negatives' must be uniform, degree or a .npy file, got "
                f"{self.negatives!r}"
            )
        try:
            ks = hits_ks(self.hits)
        except ValueError:
            ks = []
        if not ks:
            raise ConfigError(f"config key 'hits' must list integers >= 1, got {self.hits!r}")
        self._check_mode()

    def _check_split(self) -> None:
        if not (self.split in ("auto", "stored", "random") or self.split.startswith("time:")):
            raise ConfigError(
                f"config key 'split' must be auto, stored, random or time:ATTR, got {self.split!r}"
            )
        for key in ("val_fraction", "test_fraction"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"config key '{key}' must be in [0, 1)")
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ConfigError("config keys 'val_fraction' + 'test_fraction' must be below 1")
        if self.eval_negatives not in ("pairs", "per-source"):
            raise ConfigError("config key 'eval_negatives' must be pairs or per-source")
        if self.edge_labels not in (None, "weight") and not str(self.edge_labels).endswith(".npy"):
            raise ConfigError(
                f"config key 'edge_labels' must be weight or a .npy file, got {self.edge_labels!r}"
            )

    def _check_mode(self) -> None:
        if self.sampling not in ("local", "partitioned"):
            raise ConfigError(f"config key 'sampling' must be local or partitioned, got "
                              f"{self.sampling!r}")  # fmt: skip
        partitioned = self.sampling == "partitioned"
        typed = self.model in TYPED_ENCODERS
        one_of(self, "featureless", FEATURELESS)
        if self.featureless == "learn" and self.mode != "full":
            raise ConfigError(
                "config key 'featureless': learn is for mode full (the minibatch rgcn and hgt "
                "learn an embedding per featureless node of their own)"
            )
        if typed and self.mode != "minibatch" and self.model not in FULL_TYPED_ENCODERS:
            raise ConfigError(f"config key 'model': {self.model} trains in mode minibatch")
        if partitioned and (self.mode != "minibatch" or is_user_model(self.model)):
            raise ConfigError(
                "config key 'sampling': partitioned sampling is for mode minibatch with a "
                "built-in encoder"
            )
        if self.mode == "minibatch":
            if self.grid is not None:
                raise ConfigError("config key 'grid' is for mode full (minibatch is data parallel)")
            try:  # a typed graph's per-relation layers are checked when it is loaded
                fanouts = self.fanouts.split(",") if typed else parse_fanouts(self.fanouts)
            except UserError as err:
                raise ConfigError(f"config key 'fanouts': {err}") from None
            if len(fanouts) != self.layers and not is_user_model(self.model):
                raise ConfigError(
                    f"config key 'fanouts' gives {len(fanouts)} fan-outs but 'layers' is "
                    f"{self.layers}: give one fan-out per layer"
                )
            if self.mixed_precision != "none":
                raise ConfigError("config key 'mixed_precision': the link task runs in its dtype")
            return
        if (self.zero_stage or 0) != 0 or self.fcdp or self.offload != "none":
            raise ConfigError(
                "mode full replicates its weights over the grid (the graph is what is split): "
                "no zero_stage, fcdp or offload"
            )
        if self.reduce_order != "ring" or self.powersgd_rank:
            raise ConfigError(
                "config keys 'reduce_order' / 'powersgd_rank': mode full has no data axis"
            )
        if self.mixed_precision != "none" or self.grad_accum != 1:
            raise ConfigError("mode full: no mixed_precision, grad_accum 1")
        if self.grid is not None:
            from gnnpar.grid import GridError, parse_grid_spec

            try:
                shape = parse_grid_spec(self.grid)
            except GridError as err:
                raise ConfigError(f"config key 'grid': {err}") from None
            extra = [a for a in shape if a not in ("x", "y", "z") and shape[a] > 1]
            if extra:
                raise ConfigError(f"config key 'grid': mode full runs on x, y, z, not {extra}")


def hits_ks(text: str) -> list[int]:
    """The K values of ``hits`` ("10,50,100")."""
    ks = [int(k) for k in str(text).split(",") if k.strip()]
    if any(k < 1 for k in ks):
        raise ValueError(text)
    return ks


def load_link_graph(cfg: LinkConfig) -> Graph:
    """The message-passing graph of ``cfg``'s dataset with its edge split (the dataset's
    own, or one cut with ``cfg.seed``), coalesced; ConfigError naming the key otherwise."""
    graph = load_dataset(cfg)
    stored = graph.edge_split
    if cfg.split == "stored" and stored is None:
        raise ConfigError(
            f"config key 'split' is stored but dataset {cfg.dataset!r} has no edge split "
            "(cut one with `gnnpar data split-edges`, or use split random)"
        )
    if stored is not None and cfg.split not in ("auto", "stored"):
        raise ConfigError(
            f"config key 'split' is {cfg.split} but dataset {cfg.dataset!r} has its own edge "
            "split: use split auto or stored"
        )
    if graph.feat is None:
        raise ConfigError(f"dataset {cfg.dataset!r} has no node features (ndata 'feat')")
    if stored is None:
        time_key = cfg.split.partition(":")[2] if cfg.split.startswith("time:") else None
        try:
            graph = split_edges(
                graph, cfg.val_fraction, cfg.test_fraction, cfg.seed, time_key,
                cfg.eval_negatives, cfg.eval_num_negatives, labels=edge_labels(cfg, graph),
                relation=cfg.relation, reverse_relation=cfg.reverse_relation,
            )  # fmt: skip
        except UserError as err:
            raise ConfigError(f"dataset {cfg.dataset!r}: {err}") from None
    elif cfg.edge_labels is not None:
        raise ConfigError(
            f"config key 'edge_labels' is for a split cut by the run; dataset {cfg.dataset!r} "
            "has its own split"
        )
    split = graph.edge_split
    if cfg.model in TYPED_ENCODERS and graph.types is None:
        raise ConfigError(
            f"config key 'model': {cfg.model} needs a typed graph; dataset {cfg.dataset!r} "
            "has no node types (docs/typed.md)"
        )
    if cfg.mode == "full" and graph.types is not None and _full_norm(cfg) == "raw":
        raise ConfigError(
            f"config key 'model': mode full on the typed graph {cfg.dataset!r} needs an R-GCN "
            f"encoder (rgcn, or a factory taking num_relations); {cfg.model} reads one untyped "
            "adjacency"
        )
    if cfg.featureless == "learn" and not featureless_nodes(graph.types):
        raise ConfigError(
            f"config key 'featureless': dataset {cfg.dataset!r} has no featureless node type, "
            "so there are no input rows to learn; use zero"
        )
    if graph.types is None:  # a typed graph keeps its CSR (rows grouped by relation)
        try:
            graph_keys(graph)
        except UserError:
            graph = graph.coalesce()
    graph.edge_split = split
    split.validate(graph.num_nodes, f"dataset {cfg.dataset!r}")
    check_metric(split.metric)
    return graph


def edge_labels(cfg: LinkConfig, graph: Graph) -> torch.Tensor | None:
    """The per-edge labels ``edge_labels`` names (CSR order), or None; one line naming the
    file or the graph otherwise."""
    if cfg.edge_labels is None:
        return None
    if cfg.edge_labels == "weight":
        if graph.edge_weight is None:
            raise ConfigError(f"config key 'edge_labels': dataset {cfg.dataset!r} is unweighted")
        return graph.edge_weight
    import numpy as np

    path = Path(cfg.edge_labels)
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: not a readable .npy of edge labels ({err})") from None
    if array.dtype.kind not in "if" or array.shape != (graph.num_edges,):
        raise ConfigError(
            f"{path}: edge labels must be {graph.num_edges} integers or floats (one per edge), "
            f"got {array.dtype} {array.shape}"
        )
    return torch.from_numpy(array.astype(np.int64 if array.dtype.kind == "i" else np.float32))


def link_model(cfg: LinkConfig, graph: Graph, block: bool) -> LinkModel:
    """The run's model for ``graph`` (carrying its edge split), seeded by the caller: the
    encoder (a block model for edge batches, a PyG model for the full graph, or the user's
    ``module:factory``) and the decoder (a score per pair, or one logit per class of edge
    classification). The task and the planner build it here."""
    in_dim, split = int(graph.feat.shape[1]), graph.edge_split
    relations = graph.types.num_relations if graph.types is not None else None
    if is_user_model(cfg.model):
        options = factory_options(cfg.model_options)
        encoder = build_user_model(cfg.model, in_dim, cfg.hidden, options, relations)
    elif cfg.model in FULL_TYPED_ENCODERS and not block:  # PyG's RGCNConv layers
        encoder = PyGEncoder(cfg.model, in_dim, cfg.hidden, cfg.hidden, cfg.layers, cfg.dropout,
                             cfg.heads, num_relations=relations)  # fmt: skip
    elif cfg.model in TYPED_ENCODERS:  # its classifier is the embeddings' last linear
        encoder = TypedGNN(graph.types, cfg.hidden, cfg.hidden, cfg.layers, cfg.model,
                           cfg.dropout, cfg.heads)  # fmt: skip
    elif block:
        encoder = BlockGNN(in_dim, cfg.hidden, cfg.hidden, cfg.layers, cfg.dropout, cfg.model,
                           cfg.heads)  # fmt: skip
    else:
        encoder = PyGEncoder(cfg.model, in_dim, cfg.hidden, cfg.hidden, cfg.layers, cfg.dropout,
                             cfg.heads)  # fmt: skip
    out = split.num_classes if split.label_kind == "classify" else 1
    try:
        decoder = make_decoder(cfg.decoder, cfg.hidden, cfg.hidden, cfg.decoder_layers, out)
    except UserError as err:
        raise ConfigError(f"config key 'decoder': {err}") from None
    return LinkModel(encoder, decoder)


def _link_parts(cfg: LinkConfig, graph: Graph, grid: ProcessGrid, progress: Progress) -> Path:
    """Rank 0 partitions the message graph into one part per data rank (unless a folder
    cut from it exists under the run folder); every rank gets the folder."""
    import warnings

    import partitioners

    parts = grid.size("data")
    keys = [graph.fingerprint(), cfg.partition_method, cfg.seed, parts]
    digest = hashlib.sha1(json.dumps(keys).encode()).hexdigest()[:10]
    folder = Path(cfg.out) / "parts" / f"{Path(cfg.dataset).name or 'graph'}-{parts}-{digest}"

    def write() -> None:
        if folder.exists():
            return
        with progress.stage(f"partitioning the message graph into {parts} parts"):
            balance = None if graph.types is not None else ["nodes"]  # typed: per type
            part = partitioners.partition(graph, parts, method=cfg.partition_method,
                                          seed=cfg.seed, balance=balance)  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", partitioners.format.PartitionBalanceWarning)
            partitioners.write(graph, part, folder, halo=1)

    comm.on_rank_zero(grid, write, "rank 0 could not partition the message graph (see its error)")
    return folder


def _full_norm(cfg: LinkConfig) -> str:
    """The adjacency full mode's encoder reads: each relation's mean for an R-GCN (the
    built-in ``rgcn``, or a user's factory that takes ``num_relations``), else the raw one."""
    typed = cfg.model in FULL_TYPED_ENCODERS or (
        is_user_model(cfg.model) and factory_takes_relations(cfg.model)
    )
    return RELATION_NORM if typed else "raw"


def _shard_folder(cfg: LinkConfig, graph: Graph) -> Path:
    """Where full mode's shards of the message-passing graph go (named by the graph)."""
    keys = [graph.fingerprint(), cfg.seed, cfg.blocks, _full_norm(cfg)]
    digest = hashlib.sha1(json.dumps(keys).encode()).hexdigest()[:10]
    return Path(cfg.out) / "shards" / f"{Path(cfg.dataset).name or 'graph'}-{digest}"


def _full_source(cfg: LinkConfig, graph: Graph, grid: ProcessGrid, progress: Progress) -> Any:
    """Full mode's shard source: rank 0 writes the message graph's shards (``raw``, or each
    relation's mean for an R-GCN: :func:`_full_norm`; one node order, ``symmetric``) unless a
    folder made from it exists; every rank reads its blocks."""
    from gnnpar.models.fullgraph.shards import DiskSource, prepare_shards

    folder = _shard_folder(cfg, graph)

    def write() -> None:
        if not folder.exists():
            with progress.stage(f"writing the graph's shards into {folder}"):
                prepare_shards(graph, folder, norm=_full_norm(cfg), permutation="symmetric",
                               seed=cfg.seed, blocks=(cfg.blocks, cfg.blocks))  # fmt: skip

    comm.on_rank_zero(grid, write, "rank 0 could not write the link task's shards (see its error)")
    source = DiskSource(folder)
    if source.meta["source"]["graph"] != graph.fingerprint():
        raise UserError(f"{folder} was cut from another graph: remove it")
    return source


def plan(cfg: LinkConfig, world: ProcessGrid, progress: Progress) -> GridPlan:
    """Minibatch: every rank on the data axis; full: the given grid, else x = every rank."""
    if cfg.mode == "minibatch":
        return GridPlan()
    if cfg.grid:
        from gnnpar.grid import parse_grid_spec

        return GridPlan(parse_grid_spec(cfg.grid), "given")
    return GridPlan({"x": world.world_size}, "x = every rank (give grid to choose)")


class LinkTask(BaseTask):
    """The ``link`` task (module docstring)."""

    unit = "epoch"

    @staticmethod
    def preflight(cfg: LinkConfig, world_size: int) -> None:
        """Before launch: the dataset loads with a usable split, a negatives file reads,
        and a user's encoder builds and is supported."""
        graph = load_link_graph(cfg)
        if cfg.negatives.endswith(".npy"):
            load_candidates(cfg.negatives, graph.num_nodes)
        if is_user_model(cfg.model):
            relations = graph.types.num_relations if graph.types is not None else None
            build_user_model(cfg.model, graph.feat.shape[1], cfg.hidden,
                             factory_options(cfg.model_options), relations)  # fmt: skip

    def __init__(self, cfg: LinkConfig, grid: ProcessGrid, plan: GridPlan, progress: Progress):
        self.cfg, self.grid, self.progress = cfg, grid, progress
        self.device = grid.device
        self.grid_choice = plan.choice if cfg.mode == "full" else None
        with progress.stage(f"loading {cfg.dataset} and its edge split"):
            graph = load_link_graph(cfg)
        self.graph, self.split = graph, graph.edge_split
        self.num_train = int(self.split.train.shape[1])
        self.metric = self.split.metric
        #: ``"classify"`` or ``"regress"`` on edge labels, None for link prediction.
        self.edge_task = self.split.label_kind
        self.hits = hits_ks(cfg.hits)
        self.user_model = is_user_model(cfg.model)
        #: A user's encoder reading the relations (its factory takes num_relations).
        self.relational = self.user_model and factory_takes_relations(cfg.model)
        self.num_steps = cfg.epochs
        torch.manual_seed(cfg.seed)
        self.negatives = None if self.edge_task else self._negative_sampler()
        #: This rank's part with partitioned sampling, else None.
        self.part: Any = None
        #: The embeddings an evaluation computed once for all its pairs (None outside one).
        self._embedded: torch.Tensor | None = None
        self._reuse_embeddings = False
        with progress.stage("building the model"):
            if cfg.mode == "minibatch":
                self._setup_minibatch()
            else:
                self._setup_full(progress)

    @property
    def selection(self) -> tuple[str, str]:
        """The best model is the one of the best validation score of the split's metric."""
        return (f"val_{self.metric}", "min" if self.metric == "rmse" else "max")

    # ------------------------------------------------------------------ setup
    def _negative_sampler(self) -> NegativeSampler:
        cfg, g = self.cfg, self.graph
        kwargs: dict[str, Any] = {"seed": cfg.seed}
        method = cfg.negatives
        if method == "degree":
            kwargs["degrees"] = (g.in_degrees() + g.out_degrees()).to(torch.float64)
        elif method.endswith(".npy"):
            kwargs["candidates"] = load_candidates(method, g.num_nodes)
            method = "candidates"
        if cfg.exclude_true:
            kwargs["exclude"] = (g.indptr, g.indices)
        relation = self.split.how.get("relation")
        if relation is not None:  # a typed split: destinations of the relation's type
            types = g.types
            kwargs["dst_range"] = types.id_range(types.relations[types.relation_index(relation)][2])
        return NegativeSampler(g.num_nodes, method, cfg.num_negatives, **kwargs)

    def _setup_minibatch(self) -> None:
        cfg, g, grid = self.cfg, self.graph, self.grid
        self.net = link_model(cfg, g, block=True).to(self.device, master_dtype(cfg))
        self.features = g.feat.to(master_dtype(cfg))
        units = None if self.user_model else built_in_units
        self.model = shard(
            self.net, grid, cfg.zero_stage or 0, units=units, mixed_precision=shard_policy(cfg),
            **cfg.shard_options(),
        )  # fmt: skip
        data, rank = grid.size("data"), grid.rank("data")
        ids = torch.arange(self.num_train, dtype=torch.int64)
        if cfg.sampling == "partitioned" and data > 1:
            edges, owned, features = self._partitioned_sampler()
        else:
            fanouts = cfg.fanouts if g.types is not None else parse_fanouts(cfg.fanouts)
            sampler = NeighborSampler(g, fanouts, replace=cfg.replace, seed=cfg.seed,
                                      per_relation=cfg.per_relation)  # fmt: skip
            keys = graph_keys(g) if g.types is None else sorted_edge_keys(g)
            edges = EdgeSampler(sampler, self.split.train, self.negatives, keys, cfg.exclude)
            owned, features = ids[rank::data], self.features  # every rank knows every edge
        self.loader = NodeLoader(
            edges, owned, cfg.batch_size, seed=cfg.seed, features=features,
            prefetch=cfg.prefetch, keys=owned, all_keys=ids, micro_batches=cfg.grad_accum,
            device=self.device, num_nodes=self.num_train,
            prepare=self.net.prepare if self.device.type == "cpu" else None,
        )  # fmt: skip
        self._eval_blocks = None if self.user_model else [b.to(self.device) for b in full_blocks(g)]

    def _partitioned_sampler(self) -> tuple[EdgeSampler, torch.Tensor, Any]:
        """Each rank one part of the message graph (rank 0 writes the partition folder
        under the run folder): the distributed neighbour sampler, the feature fetcher, the
        map of original to partition ids, and the training edges this rank owns (those
        whose destination its part owns, as DistDGL assigns them)."""
        import gnnpar
        from gnnpar.sampling import DistNeighborSampler, FeatureFetcher, LocalPart

        cfg, grid = self.cfg, self.grid
        folder = _link_parts(cfg, self.graph, grid, self.progress)
        part = LocalPart.load(folder, grid.rank("data"), verify="checksum")
        part.ndata["feat"] = part.ndata["feat"].to(master_dtype(cfg))
        # the prefetch thread's collectives run on process groups of their own
        host = gnnpar.init(backend="gloo", ranks_per_node=cfg.ranks_per_node, timeout=cfg.timeout)
        fanouts = cfg.fanouts if part.types is not None else parse_fanouts(cfg.fanouts)
        sampler = DistNeighborSampler(part, fanouts, host, replace=cfg.replace, seed=cfg.seed,
                                      per_relation=cfg.per_relation)  # fmt: skip
        fetcher = FeatureFetcher(part, host)
        owned_ids = torch.arange(part.start, part.start + part.num_owned, dtype=torch.int64)
        pairs = torch.stack([part.orig_ids[: part.num_owned], owned_ids], 1)
        sizes = comm.gather_sizes(pairs.shape[0], host, "data")
        every = comm.all_gather(pairs, host, "data", sizes=sizes)
        node_map = torch.empty(part.num_nodes, dtype=torch.int64)
        node_map[every[:, 0]] = every[:, 1]
        self.part, self.sample_grid, self.node_map = part, host, node_map
        edges = EdgeSampler(sampler, self.split.train, self.negatives, None, cfg.exclude, node_map)
        dst = node_map.index_select(0, self.split.train[1])
        owned = torch.nonzero(part.owner(dst) == part.part_id, as_tuple=True)[0]
        return edges, owned, fetcher.fetch

    def _setup_full(self, progress: Progress) -> None:
        from gnnpar.models.fullgraph.pyg import parallelize_pyg

        cfg = self.cfg
        source = _full_source(cfg, self.graph, self.grid, progress)
        plain = link_model(cfg, self.graph, block=False).to(master_dtype(cfg))
        self.model = parallelize_pyg(plain, self.grid, source)
        if cfg.featureless == "learn":
            self.model.learn_featureless(cfg.seed)
        self.net = self.model.module
        self.features = self.model.input_features()
        self.source = source

    def _make_optimizer(self) -> torch.optim.Optimizer:
        cfg = self.cfg
        params = self.model.parameters()
        opt = adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        return self.model.attach(opt) if cfg.mode == "minibatch" else opt

    # ------------------------------------------------------------------ records
    def data_record(self) -> dict[str, Any]:
        """The message-passing graph and the split it carries."""
        record = self.split.record()
        return {
            "name": self.cfg.dataset,
            "fingerprint": f"{self.graph.fingerprint()}+{record['digest']}",
        }

    def summary(self) -> str:
        """The encoder, the graph and the split's sizes."""
        g, s = self.graph, self.split
        return (
            f"link prediction, {self.cfg.model} encoder + {self.cfg.decoder} decoder on "
            f"{self.cfg.dataset}: {count(g.num_nodes, 'node')}, "
            f"{count(g.num_edges, 'message edge')}, edges train/val/test "
            f"{s.train.shape[1]}/{s.val.shape[1]}/{s.test.shape[1]} ({s.protocol} negatives, "
            f"selected by {s.metric}, {self.cfg.mode})"
        )

    def describe(self) -> dict[str, Any]:
        """The run's task, model and sizes (recorded in its checkpoints)."""
        c = self.cfg
        return {"task": "link", "model": c.model, "decoder": c.decoder, "mode": c.mode,
                "in_dim": int(self.graph.feat.shape[1]), "hidden": c.hidden,
                "layers": c.layers}  # fmt: skip

    def extra_state(self) -> dict[str, Any]:
        """The loader's position (minibatch)."""
        return {"loader": self.loader.state_dict()} if self.cfg.mode == "minibatch" else {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`extra_state`."""
        if self.cfg.mode == "minibatch":
            self.loader.load_state_dict(state["loader"])

    # ------------------------------------------------------------------ training
    def _loss(self, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        """The summed loss of positives (b,) and their negatives (b, k), each positive's
        terms averaged over its 1 + k pairs (bce) or its k pairs (margin)."""
        k = neg.shape[1]
        if self.cfg.loss == "bce":
            return bce_sum(pos, neg) / (1 + k)
        return margin_sum(pos, neg, self.cfg.margin) / k

    def loss_of(self, first: torch.Tensor, rest: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The summed loss of the positives ``ids`` (columns of the split's ``train``) from
        their scores ``first`` and their negatives' ``rest`` (link prediction: :meth:`_loss`),
        or, on edge labels, cross-entropy of the class logits ``first`` (b, C) or the squared
        error of the values ``first`` (b,)."""
        if self.edge_task is None:
            return self._loss(first, rest)
        labels = self.split.train_label.index_select(0, ids.cpu()).to(first.device)
        if self.edge_task == "classify":
            return F.cross_entropy(first, labels, reduction="sum")
        return F.mse_loss(first, labels.to(first.dtype), reduction="sum")

    def score_batch(self, batch: Any, dropout_seed: int | None) -> tuple[torch.Tensor, ...]:
        """``(pos (b,), neg (b, k))`` scores of a mini-batch's pairs (one call of the model:
        ZeRO-3 gathers its parameters once)."""
        src, dst = batch.pairs
        targets = torch.cat([dst[:, None], batch.neg], 1)
        if self.user_model:
            from gnnpar.models.minibatch.pyg import subgraph_inputs

            graph = subgraph_inputs(batch.blocks, batch.x.device, self.relational)
            with seeded(dropout_seed or 0, self.device):
                scores = self.net(batch.x, *graph, src=src, dst=targets)
        else:
            scores = self.net(batch.blocks, batch.x, dropout_seed=dropout_seed, src=src,
                              dst=targets)  # fmt: skip
        return scores[:, 0], scores[:, 1:]

    def train_step(self, step: int) -> dict[str, float]:
        """One epoch over the training edges; returns its loss and throughput."""
        if self.cfg.mode == "full":
            return self._full_step(step)
        cfg, dp = self.cfg, self.model
        lr = schedule.apply(self.optimizer, cfg, step, self.num_steps)
        self.loader.set_epoch(step)
        self.net.train()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss, positives
        data = self.grid.size("data")
        t0 = time.perf_counter()
        with self.progress.bar(len(self.loader), unit="batch", show=len(self.loader) > 1,
                               desc=f"epoch {step + 1}", leave=False) as bar:  # fmt: skip
            for batch in self.loader:
                last = batch.micro == cfg.grad_accum - 1
                seed = derive_key(cfg.seed, _DROPOUT, batch.epoch, batch.index) & _LOW31
                with contextlib.nullcontext() if last else dp.no_sync():
                    pos, neg = self.score_batch(batch, seed)
                    loss = self.loss_of(pos, neg, batch.edge_ids)
                    (loss * (data / batch.global_size)).backward()
                if last:
                    self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                sums[0] += float(loss.detach())
                sums[1] += pos.numel()
                bar.update(1)
        elapsed = time.perf_counter() - t0
        comm.all_reduce(sums, self.grid, "data")
        edges = max(float(sums[1]), 1.0)
        return {"loss": float(sums[0]) / edges, "edges_per_s": float(sums[1]) / elapsed,
                "batches": float(len(self.loader)), "lr": lr}  # fmt: skip

    # ------------------------------------------------------------------ full graph
    def _owners(self, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, owner)`` of nodes in the share's one order: each node's row and
        the tensor-axis rank holding it."""
        if not hasattr(self, "_perm"):
            src = self.source
            n = src.num_nodes
            self._perm = torch.empty(n, dtype=torch.int64)
            self._perm[src.node_ids(0, (0, n))] = torch.arange(n)
            rows = self.model.share.rows
            bounds = torch.tensor([rows[0], rows[1]], dtype=torch.int64, device=self.grid.device)
            starts = comm.all_gather(bounds, self.grid, "tensor").view(-1, 2)[:, 0].cpu()
            # the tensor ranks' rows are not in rank order (x varies fastest, rows by x chunk)
            self._starts, self._rank_of = torch.sort(starts)
        pos = self._perm.index_select(0, nodes)
        owner = self._rank_of[torch.bucketize(pos, self._starts, right=True) - 1]
        return pos, owner

    def _fetch(self, h: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``nodes`` from their owners (differentiable)."""
        from gnnpar.sampling.distributed import fetch_rows

        pos, owner = self._owners(nodes)
        return fetch_rows(h, pos.to(h.device), owner.to(h.device), self.model.share.rows[0],
                          self.grid, "tensor")  # fmt: skip

    def full_pairs(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's slice of the step's positives and their negatives: ``(src, dst,
        neg (b, k))``; the slices of the tensor ranks, in order, are every training edge."""
        from gnnpar.models.fullgraph.layout import chunk

        p, r = self.grid.size("tensor"), self.grid.rank("tensor")
        lo, hi = chunk(self.num_train, p, r)
        ids = torch.arange(lo, hi, dtype=torch.int64)
        src, dst = self.split.train[:, lo:hi]
        if self.negatives is None:  # edge labels: the positives only
            return src, dst, torch.zeros((hi - lo, 0), dtype=torch.int64)
        key = derive_key(self.cfg.seed, _FULL_NEG, step)
        return src, dst, self.negatives.sample(src, ids, key)

    def _full_ids(self) -> torch.Tensor:
        """The edge ids of this rank's slice (:meth:`full_pairs`)."""
        from gnnpar.models.fullgraph.layout import chunk

        lo, hi = chunk(self.num_train, self.grid.size("tensor"), self.grid.rank("tensor"))
        return torch.arange(lo, hi, dtype=torch.int64)

    def full_scores(self, h: torch.Tensor, src, dst, neg) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores of this rank's pairs from the rows ``h`` every rank holds (collective)."""
        b, k = neg.shape
        rows = self._fetch(h, torch.cat([src, dst, neg.reshape(-1)]))
        first = torch.arange(b, device=rows.device)
        # rows: the b sources, the b destinations, then each source's k negatives
        after = torch.arange(k, device=rows.device)
        targets = torch.cat([(b + first)[:, None], 2 * b + first[:, None] * k + after], 1)
        scores = self.net(embeddings=rows, src=first, dst=targets)
        return scores[:, 0], scores[:, 1:]

    def _full_step(self, step: int) -> dict[str, float]:
        cfg = self.cfg
        lr = schedule.apply(self.optimizer, cfg, step, self.num_steps)
        self.model.train()
        t0 = time.perf_counter()
        seed = derive_key(cfg.seed, _DROPOUT, step) & _LOW31
        h = self.model(self.features, dropout_seed=seed)
        pos, neg = self.full_scores(h, *self.full_pairs(step))
        loss = self.loss_of(pos, neg, self._full_ids()) / self.num_train
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = comm.all_reduce(loss.detach().reshape(1).clone(), self.grid, "tensor")
        return {"loss": float(total), "edges_per_s": self.num_train / (time.perf_counter() - t0),
                "lr": lr}  # fmt: skip

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def embeddings(self) -> torch.Tensor:
        """Every node's embedding with full neighbourhoods (minibatch mode, every rank)."""
        from gnnpar.sampling import layerwise_inference

        g = self.graph
        if self.user_model:
            was = self.net.training
            self.net.eval()
            try:
                return full_graph_logits(
                    self.net, g, self.device, self.relational, features=self.features
                )
            finally:
                self.net.train(was)
        return layerwise_inference(self.net, g, features=self.features.to(self.device),
                                   blocks=self._eval_blocks)  # fmt: skip

    @torch.no_grad()
    def score_pairs(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """The model's scores of the pairs ``(src[i], dst[i])`` (every rank; collective),
        ``dst`` may be (b, k) for k destinations per source."""
        if self.part is not None:
            return self._part_pair_scores(src, dst)
        if self.cfg.mode == "minibatch":
            h, flat = self._node_rows(), dst.view(src.numel(), -1)
            scores = self.net(embeddings=h, src=src, dst=flat)
            return scores.view(*dst.shape, *scores.shape[2:])  # (b[, k][, classes])
        return self._full_pair_scores(src, dst)

    def _node_rows(self) -> torch.Tensor:
        """This rank's embedding rows with full neighbourhoods: every node's (local
        sampling), its part's owned nodes' (partitioned), its share's rows (full graph);
        computed once per evaluation (:meth:`evaluate` scores four sets of pairs)."""
        if self._embedded is not None:
            return self._embedded
        if self.part is not None:
            from gnnpar.sampling import distributed_inference

            h = distributed_inference(self.net, self.part, self.part.ndata["feat"],
                                      self.sample_grid, device=self.device).cpu()  # fmt: skip
        elif self.cfg.mode == "minibatch":
            h = self.embeddings()
        else:
            self.model.eval()
            try:
                h = self.model(self.features)
            finally:
                self.model.train()
        if self._reuse_embeddings:
            self._embedded = h
        return h

    @contextlib.contextmanager
    def _one_embedding(self):
        """Within: :meth:`_node_rows` computes the embeddings once and reuses them."""
        self._reuse_embeddings, self._embedded = True, None
        try:
            yield
        finally:
            self._reuse_embeddings, self._embedded = False, None

    def _part_pair_scores(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """Partitioned sampling: every node's full-neighbour embedding at its owner, then
        each rank scores a slice of the pairs with their rows fetched from the owners."""
        from gnnpar.models.fullgraph.layout import chunk
        from gnnpar.sampling import request_rows

        part, host, h = self.part, self.sample_grid, self._node_rows()
        p, r = host.size("data"), host.rank("data")
        lo, hi = chunk(src.numel(), p, r)
        mine = dst.view(src.numel(), -1)[lo:hi]
        b, k = hi - lo, mine.shape[1]
        ids = self.node_map.index_select(0, torch.cat([src[lo:hi], mine.reshape(-1)]))
        rows = request_rows(ids, part.owner(ids), h, part.start, host, "data").to(self.device)
        targets = torch.arange(b, b + b * k).view(b, k)
        scores = self.net(embeddings=rows, src=torch.arange(b), dst=targets).contiguous()
        sizes = comm.gather_sizes(scores.shape[0], host, "data")
        every = comm.all_gather(scores.cpu(), host, "data", sizes=sizes)
        return every.view(*dst.shape, *every.shape[2:])

    def _full_pair_scores(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        from gnnpar.models.fullgraph.layout import chunk

        h = self._node_rows()
        p, r = self.grid.size("tensor"), self.grid.rank("tensor")
        lo, hi = chunk(src.numel(), p, r)
        mine_dst = dst[lo:hi]
        k = mine_dst.shape[1] if mine_dst.dim() == 2 else 0
        rows = self._fetch(h, torch.cat([src[lo:hi], mine_dst.reshape(-1)]))
        b = hi - lo
        targets = torch.arange(b, b + b * max(k, 1)).view(b, max(k, 1))
        scores = self.net(embeddings=rows, src=torch.arange(b), dst=targets)
        scores = (scores if k else scores[:, 0]).contiguous()
        sizes = comm.gather_sizes(scores.shape[0], self.grid, "tensor")
        return comm.all_gather(scores, self.grid, "tensor", sizes=sizes)

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """``mrr``, ``rocauc`` and ``hits@K`` of the validation and test positives against
        the split's negatives (on edge labels: ``acc``, or ``rmse`` and ``mae``), from one
        computation of the embeddings."""
        with self._one_embedding():
            if self.edge_task is not None:
                return self._evaluate_labels()
            return self._evaluate_links()

    def _evaluate_links(self) -> dict[str, float]:
        split, out = self.split, {}
        names = [self.metric, "mrr", "rocauc", *(f"hits@{k}" for k in self.hits)]
        names = list(dict.fromkeys(names))
        for which in ("val", "test"):
            pos_pairs, neg = getattr(split, which), getattr(split, f"{which}_neg")
            if neg is None or pos_pairs.shape[1] == 0:
                continue
            pos = self.score_pairs(pos_pairs[0], pos_pairs[1]).double()
            if split.protocol == "pairs":
                neg_scores = self.score_pairs(neg[0], neg[1]).double()
            else:
                neg_scores = self.score_pairs(pos_pairs[0], neg).double()
            with contextlib.suppress(UndefinedScoreError):
                scores = link_scores(pos.cpu(), neg_scores.cpu(), split.protocol, names)
                out.update({f"{which}_{k}": v for k, v in scores.items()})
        return out

    def _evaluate_labels(self) -> dict[str, float]:
        """Edge classification: ``acc`` of the validation and test pairs; regression:
        ``rmse`` and ``mae``."""
        out = {}
        for which in ("val", "test"):
            pairs, labels = getattr(self.split, which), getattr(self.split, f"{which}_label")
            if pairs.shape[1] == 0:
                continue
            scores = self.score_pairs(pairs[0], pairs[1]).cpu()
            if self.edge_task == "classify":
                out[f"{which}_acc"] = float((scores.argmax(-1) == labels).double().mean())
            else:
                err = scores.double() - labels.double()
                out[f"{which}_rmse"] = float(err.pow(2).mean().sqrt())
                out[f"{which}_mae"] = float(err.abs().mean())
        return out
