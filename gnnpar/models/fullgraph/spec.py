"""The full-graph workload's registration: ``gnnpar train gcn``."""

from gnnpar.models.fullgraph.parallelize import parallelize_fullgraph
from gnnpar.models.fullgraph.planning import PLANNER
from gnnpar.models.fullgraph.task import FullGraphConfig, FullGraphTask, plan
from gnnpar.train.config import choice_words
from gnnpar.train.spec import TrainSpec

SPEC = TrainSpec(
    name="gcn",
    help=f"full-graph {choice_words(FullGraphConfig, 'model')} on a 1D, 2D or 3D grid",
    config=FullGraphConfig,
    task=FullGraphTask,
    plan=plan,
    preflight=FullGraphTask.preflight,
    node_task=True,
    parallelize=parallelize_fullgraph,
    planner=PLANNER,
)
