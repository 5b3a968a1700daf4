"""The GPT workload's registration: ``gnnpar train gpt``."""

from gnnpar.models.gpt.planning import PLANNER
from gnnpar.models.gpt.task import GPTTask, GPTTaskConfig, plan
from gnnpar.tensor import parallelize
from gnnpar.train.config import choice_words
from gnnpar.train.spec import TrainSpec

SPEC = TrainSpec(
    name="gpt",
    help=f"GPT language model ({choice_words(GPTTaskConfig, 'model')}) with data, pipeline, "
    "context and 3D tensor parallelism and ZeRO",
    config=GPTTaskConfig,
    task=GPTTask,
    plan=plan,
    preflight=GPTTask.preflight,
    axes=("x", "y", "z", "pipe", "context", "expert"),
    parallelize=parallelize,
    planner=PLANNER,
)
