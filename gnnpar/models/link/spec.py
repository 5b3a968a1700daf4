"""The link workload's registration: ``gnnpar train link``."""

from gnnpar.models.link.planning import PLANNER
from gnnpar.models.link.task import LinkConfig, LinkTask, plan
from gnnpar.shard import shard
from gnnpar.train.config import choice_words
from gnnpar.train.spec import TrainSpec

SPEC = TrainSpec(
    name="link",
    help=f"link prediction: a {choice_words(LinkConfig, 'model')} encoder and a "
    f"{choice_words(LinkConfig, 'decoder')} decoder, on sampled edge batches or the full graph",
    config=LinkConfig,
    task=LinkTask,
    plan=plan,
    preflight=LinkTask.preflight,
    axes=("x", "y", "z"),
    pair_task=True,
    parallelize=shard,
    planner=PLANNER,
)
