"""The full-graph workload's registration: ``gnnpar train gcn``."""

from gnnpar.models.fullgraph.task import FullGraphConfig, FullGraphTask, plan
from gnnpar.train.spec import TrainSpec

SPEC = TrainSpec(
    name="gcn",
    help="full-graph GCN / GraphSAGE / GAT / GIN (1D, 2D, 3D)",
    config=FullGraphConfig,
    task=FullGraphTask,
    plan=plan,
    preflight=FullGraphTask.preflight,
    node_task=True,
)
