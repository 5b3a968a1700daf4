"""Pipeline parallelism on the grid's ``pipe`` axis.

- :mod:`gnnpar.pipeline.schedule`: GPipe, 1F1B and interleaved 1F1B as per-rank programs of
  passes and messages, verified free of deadlock, with their in-flight bounds and bubble;
- :mod:`gnnpar.pipeline.runtime`: :class:`Pipeline` runs one rank's program (messages through
  :func:`gnnpar.comm.send` / :func:`gnnpar.comm.recv`), :class:`TiedWeight` shares a tied
  embedding between the first and last stage;
- :mod:`gnnpar.pipeline.stages`: contiguous splits by layer count or by cost;
- :mod:`gnnpar.pipeline.gpt`: our GPT or HF GPT-2 as a pipeline, each chunk sharded over the
  data axis (what ``gnnpar train gpt --grid pipe=P,...`` runs);
- :mod:`gnnpar.pipeline.hf_gpt2`: the chunks of a ``transformers`` GPT-2.
"""

from gnnpar.pipeline.runtime import Pipeline, StepResult, TiedWeight
from gnnpar.pipeline.schedule import (
    SCHEDULES,
    ScheduleError,
    bubble_fraction,
    peak_bound,
    program,
    simulate,
    verify,
)
from gnnpar.pipeline.stages import split_layers

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "ScheduleError",
    "StepResult",
    "TiedWeight",
    "bubble_fraction",
    "peak_bound",
    "program",
    "simulate",
    "split_layers",
    "verify",
]
