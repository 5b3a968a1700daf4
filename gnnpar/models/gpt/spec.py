"""The GPT workload's registration: ``gnnpar train gpt``."""

from gnnpar.models.gpt.task import GPTTask, GPTTaskConfig, plan
from gnnpar.train.spec import TrainSpec

SPEC = TrainSpec(
    name="gpt",
    help="GPT (ours or Hugging Face GPT-2) with data x pipe x context x 3D tensor parallelism "
    "and ZeRO",
    config=GPTTaskConfig,
    task=GPTTask,
    plan=plan,
    preflight=GPTTask.preflight,
    axes=("x", "y", "z", "pipe", "context"),
)
