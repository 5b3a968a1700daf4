"""The pipe axis in the planner: a GPT step on ``pipe`` stages of ``data × x × y × z`` ranks.

The busiest stage is modelled as a GPT of ``ceil(layers / pipe)`` blocks that also holds the
embedding and the head (the first stage has the first, the last the second; counting both is
a bound on either) on the stage's ``data × x × y × z`` ranks, with every model of the planner
(compute, collectives, memory) applied to it. On top:

- **bubble**: with ``m`` micro-batches (the trainer's ``grad_accum``) and ``v`` chunks per
  rank, a stage idles ``(p − 1)/(m·v + p − 1)`` of the step
  (:func:`gnnpar.pipeline.schedule.bubble_fraction`), so compute takes ``1/(1 − bubble)``
  times the stage's own;
- **activations**: a stage holds the activations of at most ``peak_bound`` chunk passes at
  once (``m`` for GPipe, ``p`` for 1F1B, ``2(p−1) + (v−1)p + 1`` for the interleaved
  schedule, each pass ``1/(m·v)`` of the step's activations);
- **point-to-point**: an interior rank sends ``2·m·v`` messages of one micro-batch's
  activations (or their gradients), ``rows·T·h`` elements each, over the pipe axis; an end
  rank ``(2v − 1)·m`` of them plus, for a tied embedding, the embedding piece
  (``V·h / tensor``) once per step. The rank that sends most is reported.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from gnnpar.pipeline.schedule import ScheduleError, bubble_fraction, check_sizes, peak_bound
from gnnpar.plan.comm_model import Collective, Infeasible, batch_per_rank, grid_shape
from gnnpar.plan.problems import GPTProblem

__all__ = ["PipelinePlan", "p2p_collectives", "pipeline_plan", "stage_problem"]


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """How a candidate pipelines: its schedule, micro-batches, chunks per rank, bubble and
    peak in-flight chunk passes."""

    pipe: int
    schedule: str
    micro_batches: int
    virtual: int
    bubble: float
    in_flight: int

    def as_dict(self) -> dict:  # noqa: D102
        return dataclasses.asdict(self)


def pipeline_plan(problem: GPTProblem, pipe: int) -> PipelinePlan:
    """The pipeline ``problem`` runs on ``pipe`` stages; :class:`Infeasible` when its
    schedule cannot (micro-batches that do not divide, fewer layers than stages)."""
    m = problem.micro_batches
    v = problem.virtual if problem.schedule == "interleaved" else 1
    try:
        check_sizes(problem.schedule, pipe, m, v)
    except ScheduleError as err:
        raise Infeasible(str(err)) from None
    if problem.layers < pipe * v:
        raise Infeasible(f"{problem.layers} layers cannot fill {pipe}x{v} pipeline stages")
    return PipelinePlan(
        pipe, problem.schedule, m, v, bubble_fraction(pipe, m, v),
        peak_bound(problem.schedule, pipe, m, v, 0),
    )  # fmt: skip


def stage_problem(problem: GPTProblem, pipe: int) -> GPTProblem:
    """The busiest stage as a GPT of its own (``ceil(layers / pipe)`` blocks)."""
    layers = math.ceil(problem.layers / pipe)
    return dataclasses.replace(problem, model=dataclasses.replace(problem.model, n_layer=layers))


def p2p_collectives(
    problem: GPTProblem, shape: Mapping[str, int], plan: PipelinePlan
) -> list[Collective]:
    """The point-to-point messages of the rank that sends most (see the module docstring)."""
    g = grid_shape({a: v for a, v in shape.items() if a != "pipe"})
    rows = batch_per_rank(problem, g)
    m, v = plan.micro_batches, plan.virtual
    if rows % m:
        raise Infeasible(f"{rows} sequences per rank do not split into {m} micro-batches")
    act = rows // m * problem.seq * problem.hidden * problem.element_size
    tie = problem.vocab * problem.hidden * problem.element_size // g.size("tensor")
    interior = [Collective("pipe", "p2p", 2, act, "activations and their gradients", 2 * m * v)]
    end = [Collective("pipe", "p2p", 2, act, "activations and their gradients", (2 * v - 1) * m)]
    if problem.tie:
        end.append(Collective("pipe", "p2p", 2, tie, "tied embedding and its gradient"))
    if plan.pipe > 2 and sum(c.total for c in interior) >= sum(c.total for c in end):
        return interior
    return end
