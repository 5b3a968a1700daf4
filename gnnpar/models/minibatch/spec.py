"""The mini-batch workload's registration: ``gnnpar train sage`` (``--sampler vertex`` runs
the ScaleGNN spec, :mod:`gnnpar.models.scalegnn.spec`)."""

from typing import Any

from gnnpar.models.minibatch.planning import PLANNER
from gnnpar.models.minibatch.task import MiniBatchConfig, MiniBatchTask
from gnnpar.shard import shard
from gnnpar.train.config import choice_words
from gnnpar.train.spec import GridPlan, TrainSpec


def _every_rank_on_data(cfg: MiniBatchConfig, world: Any, progress: Any) -> GridPlan:
    """One part (or one subgraph a step) per rank: every rank on the data axis."""
    return GridPlan()


def _variant(cfg: MiniBatchConfig) -> str | None:
    """ScaleGNN's vertex sampling trains on a 4D grid: a workload of its own."""
    return "scalegnn" if cfg.sampler == "vertex" else None


SPEC = TrainSpec(
    name="sage",
    help=f"mini-batch {choice_words(MiniBatchConfig, 'model')} with the "
    f"{choice_words(MiniBatchConfig, 'sampler')} sampler (vertex: ScaleGNN's, on a 4D grid)",
    config=MiniBatchConfig,
    task=MiniBatchTask,
    plan=_every_rank_on_data,
    preflight=MiniBatchTask.preflight,
    variant=_variant,
    axes=(),
    node_task=True,
    parallelize=shard,
    planner=PLANNER,
)
