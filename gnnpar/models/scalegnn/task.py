"""ScaleGNN's 4D mini-batch training: ``gnnpar train sage --sampler vertex``.

Every step, each data group draws a uniform vertex sample of ``budget`` nodes from a
counter-based key (:class:`~gnnpar.sampling.VertexSampler`): the same set on every rank of
the group, with no communication, and a different one on every other group (sample
``step * data + data_rank``, the :class:`~gnnpar.sampling.SubgraphLoader`'s order). The
sample's normalised adjacency (the full graph's entries, scaled to be unbiased;
:class:`~gnnpar.sampling.vertex.SubgraphSource`) is a smaller Â for the full-graph 3D layer
(:class:`~gnnpar.models.fullgraph.parallelize.Parallel3DGNN`) over the group's x × y × z grid: each
rank
builds only its blocks and gathers only its feature rows. The loss is the sharded
cross-entropy weighted to an unbiased estimate of the mean training loss; the gradients are
averaged over the data axis by :func:`gnnpar.shard.shard` (stage 0).

Evaluation runs the same model on the whole graph (every layer over all nodes, the unscaled
Â), so a model trained on samples is scored on the full graph. An epoch is a pure function
of (seed, epoch, index): checkpoints hold the model, Adam and the loader's position, and
resume on any grid.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gnnpar import comm
from gnnpar.fmt import count
from gnnpar.grid import ProcessGrid
from gnnpar.models.fullgraph.model import FullGraphGNN
from gnnpar.models.fullgraph.parallelize import parallelize_fullgraph
from gnnpar.models.fullgraph.task import sharded_scores
from gnnpar.models.minibatch.task import MiniBatchTask
from gnnpar.sampling import SubgraphLoader, VertexSampler
from gnnpar.sampling.rng import derive_key
from gnnpar.sampling.vertex import SubgraphSource, loss_scale
from gnnpar.shard import shard
from gnnpar.train import schedule
from gnnpar.train.config import ConfigError
from gnnpar.train.loop import BaseTask, load_trainable
from gnnpar.train.metrics import metric_for
from gnnpar.train.optim import adam
from gnnpar.train.precision import compute_dtype, master_dtype
from gnnpar.train.progress import Progress, graph_sizes
from gnnpar.train.spec import GridPlan, given_grid

_DROPOUT = 0xD809  # the salt of the other samplers' dropout seeds
_LOW31 = (1 << 31) - 1
_MASKS = ("label", "train_mask", "val_mask", "test_mask")


def plan(cfg: Any, world: ProcessGrid, progress: Progress) -> GridPlan:
    """The config's ``grid`` (4D: data × x × y × z), else every rank on the data axis with
    a sample of its own."""
    return given_grid(cfg, otherwise="data parallel, one sample per rank")


class VertexTask(BaseTask):
    """The ``sage`` task with ``sampler = "vertex"`` (see the module docstring)."""

    unit = "epoch"

    def __init__(self, cfg: Any, grid: ProcessGrid, plan: GridPlan, progress: Progress):
        """The task on ``grid``, the config's (:func:`plan`); ``progress``: where rank 0
        reports the slow preparation stages."""
        self.cfg = cfg
        self.progress = progress
        self.grid = grid
        self.device = self.grid.device
        self.grid_choice = plan.choice
        with progress.stage(f"loading {cfg.dataset}"):
            self._setup_graph()
        with progress.stage("building the model"):
            self._build_model()
        self.num_steps = cfg.epochs

    selection = MiniBatchTask.selection

    def _setup_graph(self) -> None:
        cfg = self.cfg
        graph = load_trainable(cfg)
        if cfg.budget > graph.num_nodes:
            raise ConfigError(
                f"config key 'budget' ({cfg.budget}) exceeds the graph's {graph.num_nodes} nodes"
            )
        self.graph = graph
        self._fingerprint = graph.fingerprint()
        norm = graph.row_normalize() if cfg.model == "sage" else graph.gcn_norm()
        dtype = master_dtype(cfg)
        self.adjacency = (norm.indptr, norm.indices, norm.edge_weight.to(dtype))
        self.features = graph.feat.to(dtype)
        self.node_data = {k: graph.ndata[k] for k in _MASKS if k in graph.ndata}
        self.in_dim, self.num_classes = int(graph.feat.shape[1]), graph.num_classes
        self.metric = metric_for(graph.label)
        self.num_train = int(graph.train_mask.sum())
        self.num_seeds = self.num_train
        sampler = VertexSampler(graph, cfg.budget, cfg.layers, seed=cfg.seed)
        self.loader = SubgraphLoader(
            sampler,
            rank=self.grid.rank("data"),
            ranks=self.grid.size("data"),
            prefetch=cfg.prefetch,
        )
        #: The whole graph, unscaled: what evaluation runs on.
        self.full = self.source(torch.arange(graph.num_nodes))

    def source(self, nodes: torch.Tensor) -> SubgraphSource:
        """The :class:`SubgraphSource` of the sample ``nodes``."""
        return SubgraphSource(
            *self.adjacency, self.features, self.node_data, nodes, self.num_classes
        )

    def _build_model(self) -> None:
        cfg = self.cfg
        dtype = master_dtype(cfg)
        torch.manual_seed(cfg.seed)
        plain = FullGraphGNN(
            self.in_dim, cfg.hidden, self.num_classes, cfg.layers, cfg.dropout, kind=cfg.model
        ).to(dtype)
        self.net = parallelize_fullgraph(
            plain, self.grid, self.full, "3d", dtype=dtype, compute_dtype=compute_dtype(cfg),
            data_parallel=True,
        )  # fmt: skip
        # the one data-parallel path: stage 0 averages the complete 3D gradients over data
        self.model = shard(self.net, self.grid, 0)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        cfg = self.cfg
        return self.model.attach(
            adam(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        )

    def data_record(self) -> dict[str, Any]:
        """The graph trained on (its fingerprint as loaded)."""
        return {"name": self.cfg.dataset, "fingerprint": self._fingerprint}

    def summary(self) -> str:
        """What the run trains on what."""
        g = self.graph
        samples = f"{count(self.num_train, 'seed')}, vertex samples of {self.cfg.budget}"
        multilabel = self.metric != "acc"
        sizes = graph_sizes(
            g.num_nodes, g.num_edges, self.in_dim, self.num_classes, samples, multilabel
        )
        return f"{self.cfg.model} on {self.cfg.dataset}: {sizes}"

    # ------------------------------------------------------------------ the protocol
    def step_loss(self, nodes: torch.Tensor, dropout_seed: int | None) -> tuple[torch.Tensor, int]:
        """Forward on the sample ``nodes``: the weighted loss (an unbiased estimate of the
        mean training loss; the same scalar on every rank of the group), and the sample's
        training nodes."""
        net = self.net
        net.set_source(self.source(nodes))
        logits = net(net.input_features(), dropout_seed=dropout_seed)
        train = int(self.graph.train_mask.index_select(0, nodes).sum())
        weight = train * loss_scale(self.graph.num_nodes, nodes.numel(), self.num_train)
        # the sharded mean over the sample's training nodes, times their count and weight
        self._logits = logits
        return net.loss(logits, "train_mask") * weight, train

    def train_step(self, step: int) -> dict[str, float]:
        """One epoch of vertex samples; returns its loss, throughput and subgraph size."""
        cfg = self.cfg
        lr = schedule.apply(self.optimizer, cfg, step, self.num_steps)
        self.loader.set_epoch(step)
        self.net.train()
        # loss, correct, train nodes, sampled (on the device: NCCL reduces device tensors)
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)
        t0 = time.perf_counter()
        with self.progress.bar(
            len(self.loader), unit="batch", show=len(self.loader) > 1,
            desc=f"epoch {step + 1}", leave=False,
        ) as bar:  # fmt: skip
            for batch in self.loader:
                seed = derive_key(cfg.seed, _DROPOUT, batch.epoch, batch.index) & _LOW31
                loss, train = self.step_loss(batch.seeds, seed)
                loss.backward()
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                sums[0] += float(loss.detach())
                if self.metric == "acc":
                    sums[1] += self.net.accuracy(self._logits.detach(), "train_mask") * train
                sums[2] += train
                sums[3] += batch.num_seeds
                bar.update(1)
        self._logits = None
        elapsed = time.perf_counter() - t0
        data = self.grid.size("data")
        # every rank of a group holds the same sums: reduce over data only
        comm.all_reduce(sums, self.grid, "data")
        samples = float(len(self.loader) * data)
        record = {
            "loss": float(sums[0]) / samples,
            "seeds_per_s": float(sums[2]) / elapsed,
            "batches": float(len(self.loader)),
            "lr": lr,
            "subgraph_nodes": float(sums[3]) / samples,
        }
        if self.metric == "acc":
            record["batch_acc"] = float(sums[1]) / max(float(sums[2]), 1.0)
        return record

    def _full_logits(self) -> torch.Tensor:
        """The model over the whole graph (every layer on all nodes)."""
        self.net.set_source(self.full)
        self.net.eval()
        return self.net(self.net.input_features())

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """The dataset's score on the train, validation and test nodes of the full graph."""
        return sharded_scores(self.net, self._full_logits(), self.metric, self.node_data)

    @torch.no_grad()
    def predict(self) -> torch.Tensor:
        """Every node's prediction in original node order, on every rank (collective)."""
        return self.net.predictions(self._full_logits()).cpu()

    # the loader's position and the run's description: the sage task's
    extra_state = MiniBatchTask.extra_state
    load_extra_state = MiniBatchTask.load_extra_state

    def describe(self) -> dict[str, Any]:
        """The run's task, model and sizes (recorded in its checkpoints)."""
        return {**MiniBatchTask.describe(self), "sampler": "vertex"}
