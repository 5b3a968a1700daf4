"""Pipeline parallelism on the grid's ``pipe`` axis.

- :mod:`gnnpar.pipeline.schedule`: GPipe, 1F1B and interleaved 1F1B as per-rank programs of
  passes and messages, verified free of deadlock, with their in-flight bounds and bubble;
- :mod:`gnnpar.pipeline.runtime`: :class:`Pipeline` runs one rank's program (messages through
  :func:`gnnpar.comm.send` / :func:`gnnpar.comm.recv`), :class:`TiedWeight` shares a tied
  embedding between the first and last stage;
- :mod:`gnnpar.pipeline.stages`: contiguous splits by layer count or by cost.

The engine knows no model: a workload cuts its own model into chunks (the GPT's are in
:mod:`gnnpar.models.gpt.pipeline`, what ``gnnpar train gpt --grid pipe=P,...`` runs).
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
