"""ScaleGNN's registration: the spec ``gnnpar train sage --sampler vertex`` runs (a variant of
the ``sage`` spec, so not a command of its own)."""

from gnnpar.models.fullgraph.parallelize import parallelize_fullgraph
from gnnpar.models.minibatch.task import MiniBatchConfig, MiniBatchTask
from gnnpar.models.scalegnn.task import VertexTask, plan
from gnnpar.train.spec import TrainSpec

SPEC = TrainSpec(
    name="scalegnn",
    help="ScaleGNN's 4D mini-batch training: uniform vertex samples on the 3D full-graph layers",
    config=MiniBatchConfig,
    task=VertexTask,
    plan=plan,
    preflight=MiniBatchTask.preflight,
    node_task=True,
    listed=False,
    parallelize=parallelize_fullgraph,
)
