"""Planning the GPT's grid: pipelines (:func:`pipeline_plan`), every (pipe, data, x, y, z)
shape and ZeRO stage ranked by the cost and memory models (:func:`rank_gpt`,
:func:`rank_gpt_stages`), the plan ``gnnpar train gpt`` runs (:func:`choose_gpt_plan`), the
longest sequence and the deepest model that fit (:func:`longest_sequence`,
:func:`largest_gpt`), the offload tier of a shape and stage (:func:`choose_offload`), and
``gnnpar plan gpt`` (:data:`PLANNER`).

**Offload tiers.** With ``offload`` ``"host"`` or ``"file"`` every candidate has that tier
(stage 0, which shards nothing to offload, is not ranked); with ``"auto"`` (the planner's
only) each candidate of stage ≥ 1 gets the smallest tier that fits, in the order none, host,
file (stage 0: none): ``none`` when its device bytes fit; ``host`` when its device part fits
and the node's ranks' host parts (``ranks_per_node · host``) fit the machine's
``host_memory_gb`` (90% of it, as of device memory) — never on a machine whose host is its
device memory (``host_memory_gb`` None, the CPU box), where the tier frees nothing; ``file``
when its device part fits (and its host part, where the machine states one). The tier does
not change the predicted time. :attr:`~gnnpar.plan.rank.Candidate.offload` records it.

The pipe axis: a GPT step on ``pipe`` stages of ``data × x × y × z`` ranks.

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

import argparse
import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from gnnpar.fmt import count, format_count
from gnnpar.grid import AXES
from gnnpar.models.gpt.cost import (
    PLAN_OFFLOAD_MODES,
    GPTProblem,
    batch_per_rank,
    gpt_collectives,
    gpt_compute_seconds,
    gpt_layout,
    gpt_sizes,
    grid_shape,
    meta_gpt,
)
from gnnpar.models.gpt.memory import gpt_memory
from gnnpar.pipeline.schedule import ScheduleError, bubble_fraction, check_sizes, peak_bound
from gnnpar.plan.comm_model import Collective, Infeasible
from gnnpar.plan.command import PlanCommand, add_machine_options, machine_from, report
from gnnpar.plan.inputs import PlanError, parse_count
from gnnpar.plan.machines import Machine
from gnnpar.plan.memory import memory_shortfall
from gnnpar.plan.rank import (
    Candidate,
    PipelinePlan,
    best_first,
    evaluate,
    grid_shapes,
    largest_fitting,
    shape_label,
)
from gnnpar.train.config import resolve

__all__ = [
    "PLANNER",
    "choose_gpt_plan",
    "choose_offload",
    "largest_gpt",
    "longest_sequence",
    "p2p_collectives",
    "pipeline_plan",
    "rank_gpt",
    "rank_gpt_stages",
    "stage_problem",
]


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


def rank_gpt(
    problem: GPTProblem, world: int, machine: Machine, context: int = 1
) -> list[Candidate]:
    """Every data·x·y·z shape of ``world`` ranks for a GPT step, and with ``problem.schedule``
    every pipe·data·x·y·z shape with pipe > 1 (pipelines of that schedule), best first; with
    ``context`` > 1, the shapes with that context axis (sequences split over it; no pipe);
    with a mixture of experts, also those with every expert axis that divides the experts."""
    model = meta_gpt(problem)
    out = []
    if context < 1 or world % context:
        raise PlanError(f"context={context} does not divide {world} ranks")
    pipes = [1]
    if problem.schedule and context == 1:
        pipes += [p for p in range(2, min(world, problem.layers) + 1) if world % p == 0]
    experts = [1]
    if problem.experts and context == 1:
        experts += [e for e in range(2, world + 1) if world % e == 0 and problem.experts % e == 0]
    for pipe in pipes:
        for expert in experts:
            if (world // pipe // context) % expert:
                continue
            for s in grid_shapes(world // pipe // context // expert, data=True):
                shape = {**s, "pipe": pipe} if pipe > 1 else s
                if context > 1:
                    shape = {**shape, "context": context}
                if expert > 1:
                    shape = {**shape, "expert": expert}
                out.append(_gpt_candidate(problem, shape, machine, model))
    return best_first(out)


def _tiers(problem: GPTProblem) -> tuple[str, ...]:
    """The offload tiers a candidate of ``problem`` may get, smallest first (stage 0 has
    nothing sharded to offload: none)."""
    if problem.stage == 0:
        return ("none",)
    return ("none", "host", "file") if problem.offload == "auto" else (problem.offload,)


def _gpt_candidate(
    problem: GPTProblem, shape: dict[str, int], machine: Machine, model: Any
) -> Candidate:
    """One GPT candidate; with a pipe axis, its busiest stage; with ``offload="auto"``,
    the smallest tier that fits (the module docstring)."""
    pipe = shape.get("pipe", 1)
    rest = {a: v for a, v in shape.items() if a != "pipe"}
    plan = None
    try:
        busiest = problem
        if pipe > 1:
            plan = pipeline_plan(problem, pipe)
            busiest = stage_problem(problem, pipe)
        layout = gpt_layout(busiest, rest, model)
        p2p = p2p_collectives(problem, shape, plan) if plan is not None else []
    except Infeasible as err:
        return Candidate(shape, False, str(err), stage=problem.stage, pipeline=plan)

    def compute() -> dict[str, float]:
        out = gpt_compute_seconds(busiest, rest, machine, layout)
        if plan is not None:
            # the stage's ranks share the devices with every other stage's
            world = math.prod(shape.values())
            slower = machine.compute_share(world // pipe) / machine.compute_share(world)
            out = {k: v * slower for k, v in out.items()}
            # and it waits for the others this part of the step
            out["bubble"] = sum(out.values()) * plan.bubble / (1.0 - plan.bubble)
        return out

    world = math.prod(shape.values())
    picked: list[str] = []

    def memory_of(tier: str) -> dict[str, float]:
        out = gpt_memory(dataclasses.replace(busiest, offload=tier), rest, layout)
        if plan is not None:  # the chunk passes in flight, of the m·v of a step
            out["activations"] *= plan.in_flight / (plan.micro_batches * plan.virtual)
        return out

    def memory() -> dict[str, float]:
        tiers = _tiers(problem)
        if machine.host_memory_gb is None and len(tiers) > 1:
            tiers = tuple(t for t in tiers if t != "host")  # the host is the device memory
        for tier in tiers:
            out = memory_of(tier)
            if not memory_shortfall(out, machine, world):
                break
        picked.append(tier)
        return out

    c = evaluate(
        shape,
        machine,
        lambda: gpt_collectives(busiest, rest, layout=layout) + p2p,
        compute,
        memory,
    )
    tier = picked[-1] if picked else None
    if picked:  # the host part too, where the machine states its host memory
        reason = memory_shortfall(c.memory, machine, world)
        if reason and problem.offload == "auto" and tier != "none":
            reason = f"{reason} (offload {tier})"
        c = dataclasses.replace(c, fits=not reason, reason=reason)
    return dataclasses.replace(c, stage=problem.stage, pipeline=plan, offload=tier)


def rank_gpt_stages(
    problem: GPTProblem,
    world: int,
    machine: Machine,
    stages: Iterable[int] = (0, 1, 2, 3),
    context: int = 1,
) -> list[Candidate]:
    """Every (shape, ZeRO stage) for a GPT step, best first: :func:`rank_gpt` for each stage,
    merged (at equal predicted time the lower stage first). With ``problem.offload`` a tier
    (``"host"``, ``"file"``) stage 0 (nothing sharded to offload) is left out; with
    ``"auto"`` it stays, without offload."""
    if problem.offload in ("host", "file"):
        stages = [s for s in stages if s >= 1]
    cands = [
        c
        for stage in stages
        for c in rank_gpt(dataclasses.replace(problem, stage=stage), world, machine, context)
    ]
    return best_first(cands)


def _of_shape(cands: list[Candidate], shape: Mapping[str, int] | None) -> list[Candidate]:
    """The candidates of grid ``shape`` (all of them for None)."""
    if shape is None:
        return cands
    want = {a: shape.get(a, 1) for a in ("pipe", "data", *AXES[:3])}
    return [c for c in cands if {a: c.shape.get(a, 1) for a in want} == want]


def longest_sequence(
    problem: GPTProblem,
    world: int,
    machine: Machine,
    stages: Iterable[int] = (0, 1, 2, 3),
    shape: Mapping[str, int] | None = None,
) -> tuple[int, Candidate | None]:
    """The longest sequence (a multiple of 2·context, at most ``1 << 24``) for which some
    shape (``shape``'s when given: its context axis and the axes it names) and stage fit
    ``machine``'s memory, with the best such candidate; (0, None) when none does. Memory grows
    with the sequence, so a bisection over multiples of 2·context finds it."""
    stages = tuple(stages)
    context = (shape or {}).get("context", 1)
    want = {a: v for a, v in (shape or {}).items() if a != "context"}

    def best(seq: int) -> Candidate | None:
        p = dataclasses.replace(problem, model=dataclasses.replace(problem.model, block_size=seq))
        for c in rank_gpt_stages(p, world, machine, stages, context):
            if c.fits and all(c.shape.get(a, 1) == v for a, v in want.items()):
                return c
        return None

    unit = 2 * context
    units = largest_fitting(lambda n: best(n * unit) is not None, (1 << 24) // unit)
    return units * unit, best(units * unit) if units else None


def choose_offload(problem: GPTProblem, shape: Mapping[str, int], machine: Machine) -> str:
    """The offload tier for ``problem`` (at its ZeRO ``stage``) on grid ``shape`` of
    ``machine``: with ``offload="auto"`` the smallest that fits, in the order none, host,
    file (the module docstring), else ``problem.offload`` if it fits. PlanError, one line
    naming the option, when none fits (or the shape cannot run the problem)."""
    if problem.offload in ("host", "file") and problem.stage == 0:
        raise PlanError(f"offload {problem.offload!r} needs ZeRO stage 1, 2 or 3, not 0")
    full = {"data": 1, "x": 1, "y": 1, "z": 1, **shape}
    c = _gpt_candidate(problem, full, machine, meta_gpt(problem))
    if not c.fits or c.offload is None:
        which = "no tier fits" if problem.offload == "auto" else "does not fit"
        raise PlanError(
            f"offload {problem.offload!r}: {which} shape {shape_label(full)} at ZeRO stage "
            f"{problem.stage} on {machine.name}: {c.reason}"
        )
    return c.offload


def choose_gpt_plan(
    problem: GPTProblem,
    world: int,
    machine: Machine,
    shape: Mapping[str, int] | None = None,
    stage: int | None = None,
) -> tuple[dict[str, int], int]:
    """The (shape, ZeRO stage) predicted fastest for ``problem`` among those that fit:
    ``shape`` or ``stage`` fix one of them (what ``gnnpar train gpt`` runs when it is given
    no grid or no stage, and ``gnnpar plan gpt`` recommends)."""
    stages = (0, 1, 2, 3) if stage is None else (stage,)
    context = 1 if shape is None else shape.get("context", 1)
    cands = _of_shape(rank_gpt_stages(problem, world, machine, stages, context), shape)
    fitting = [c for c in cands if c.fits]
    if not fitting:
        reasons = sorted({c.reason for c in cands})[:3]
        raise PlanError(f"no grid shape and stage can run this model: {'; '.join(reasons)}")
    return dict(fitting[0].shape), fitting[0].stage


def largest_gpt(
    problem: GPTProblem,
    world: int,
    machine: Machine,
    stages: Iterable[int] = (0, 1, 2, 3),
    shape: Mapping[str, int] | None = None,
    limit: int = 4096,
) -> tuple[GPTProblem, list[Candidate]]:
    """The deepest GPT of ``problem``'s width, heads, sequence and batch (its ``n_layer``
    grown, at most ``limit``) for which some shape (``shape``: that one) and stage fits
    ``machine``'s per-device memory on ``world`` ranks, and its ranking. Memory grows with
    the layers, so a doubling search and a bisection find it; PlanError when even one layer
    does not fit."""
    stages = tuple(stages)
    context = (shape or {}).get("context", 1)

    def ranked(layers: int) -> list[Candidate]:
        sized = dataclasses.replace(
            problem, model=dataclasses.replace(problem.model, n_layer=layers)
        )
        return _of_shape(rank_gpt_stages(sized, world, machine, stages, context), shape)

    def fits(layers: int) -> bool:
        return any(c.fits for c in ranked(layers))

    layers = largest_fitting(fits, limit)
    if not layers:
        reasons = sorted({c.reason for c in ranked(1)})[:3]
        raise PlanError(f"not even a 1-layer GPT of this width fits: {'; '.join(reasons)}")
    best = dataclasses.replace(problem, model=dataclasses.replace(problem.model, n_layer=layers))
    return best, _of_shape(rank_gpt_stages(best, world, machine, stages, context), shape)


# ------------------------------------------------------------------ gnnpar plan gpt
# ``offload`` is the planner's own flag (:func:`_gpt_arguments`): it also takes ``auto``
GPT_OPTIONS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "tie_weights",
               "batch_size", "dtype", "mixed_precision", "grad_clip", "grad_accum", "schedule",
               "virtual_stages", "activation_checkpointing", "moe_experts", "moe_top_k",
               "moe_capacity", "sequence_parallel", "quantized_weights", "quantized_grads",
               "prefetch_depth")  # fmt: skip


def _gpt_problem(args: argparse.Namespace) -> GPTProblem:
    from gnnpar.models.gpt.task import GPTTaskConfig, plan_problem  # it plans with this module

    if args.params:
        wanted = parse_count(args.params)
        presets = gpt_sizes()
        match = [k for k in presets if abs(parse_count(k) - wanted) <= 0.1 * wanted]
        if not match:
            raise PlanError(
                f"no GPT shape of about {args.params} parameters is built in "
                f"({', '.join(presets)}); give --n-layer, --n-embd and --n-head"
            )
        preset = presets[match[0]]
        for key, name in (("layers", "n_layer"), ("hidden", "n_embd"), ("heads", "n_head")):
            if getattr(args, name) is None:  # a flag given beside --params wins
                setattr(args, name, preset[key])
    offload = getattr(args, "offload", None)
    if offload is not None and offload not in PLAN_OFFLOAD_MODES:
        raise PlanError(
            f"--offload must be one of {', '.join(PLAN_OFFLOAD_MODES)}, got {offload!r}"
        )
    # the trainer's config takes a tier, not the planner's "auto"
    trainer = argparse.Namespace(
        **{**vars(args), "offload": None if offload == "auto" else offload}
    )
    cfg = resolve(GPTTaskConfig, trainer, None)
    problem = plan_problem(cfg)
    return dataclasses.replace(
        problem,
        stage=args.stage or 0,
        name=args.params or "gpt",
        offload=offload or problem.offload,
        prefetch_depth=getattr(cfg, "prefetch_depth", problem.prefetch_depth),
    )


def _grid_shape(args: argparse.Namespace) -> dict[str, int]:
    """The axes ``--grid`` fixes (none without it)."""
    from gnnpar.grid import GridError, parse_grid_spec

    if not args.grid:
        return {}
    try:
        return parse_grid_spec(args.grid)
    except GridError as err:
        raise PlanError(str(err)) from None


def _cmd_gpt(args: argparse.Namespace) -> int:
    problem = _gpt_problem(args)
    machine = machine_from(args)
    low = 1 if problem.offload in ("host", "file") else 0
    if args.stage is not None and args.stage < low:
        raise PlanError(f"--offload {problem.offload} needs --stage 1, 2 or 3, not 0")
    stages = tuple(range(low, 4)) if args.stage is None else (args.stage,)
    shape = _grid_shape(args)
    if args.longest_sequence:
        seq, best = longest_sequence(problem, args.gpus, machine, stages, shape)
        where = f"{count(args.gpus, 'rank')} of {machine.memory_gb:g} GB"
        if best is None:
            print(f"no sequence length fits {where}")
            return 0
        print(
            f"longest sequence: {seq:,} tokens on {where} (shape {shape_label(best.shape)}, "
            f"ZeRO stage {best.stage}, {best.memory_bytes / 1e9:,.2f} GB per rank, "
            f"batch {problem.batch}"
            + (f", offload {best.offload})" if problem.offload == "auto" else ")")
        )
        return 0
    if args.largest:
        problem, cands = largest_gpt(problem, args.gpus, machine, stages, shape or None)
    else:
        cands = rank_gpt_stages(problem, args.gpus, machine, stages, shape.get("context", 1))
    fixed = {a: v for a, v in shape.items() if a != "context"}
    cands = [c for c in cands if all(c.shape.get(a, 1) == v for a, v in fixed.items())]
    which = f"ZeRO stage {low}-3" if args.stage is None else f"ZeRO stage {args.stage}"
    if problem.offload == "auto":
        which += ", offload auto (the smallest tier that fits each shape)"
    elif problem.offload != "none":
        which += f", offload {problem.offload}"
    if problem.prefetch_depth != 1:
        which += f", prefetch depth {problem.prefetch_depth}"
    title = (
        f"GPT {format_count(problem.num_params)} ({problem.layers} layers, "
        f"hidden {problem.hidden}, {problem.heads} heads), "
        f"batch {problem.batch} x {problem.seq} tokens, {which}; "
        f"{count(args.gpus, 'rank')} on {machine.name} "
        f"({machine.ranks_per_node(args.gpus)} per node, {machine.memory_gb:g} GB each"
        + (f", {machine.host_memory_gb:g} GB host memory" if machine.host_memory_gb else "")
        + ")"
    )
    if args.largest:
        title = f"largest that fits: {title}"
    return report(cands, args, title, tiers=problem.offload == "auto")


def _gpt_arguments(t: argparse.ArgumentParser) -> None:
    t.add_argument(
        "--params",
        default=None,
        help=f"a built-in size: {', '.join(gpt_sizes())} (sets n_layer, n_embd, n_head)",
    )
    t.add_argument(
        "--grid",
        default=None,
        help="fix these axes (the trainer's --grid, e.g. context=4 or x=2,data=2)",
    )
    t.add_argument(
        "--offload",
        default=None,
        metavar="{" + ",".join(PLAN_OFFLOAD_MODES) + "}",
        help="the trainer's offload tier for every shape (host, file: ZeRO stages 1-3 only), "
        "or auto: the smallest tier that fits each shape and stage, in the order none, host, "
        "file (host only on a machine with host memory of its own); default none",
    )
    t.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="memory per rank in GB (default: the machine's)",
    )
    t.add_argument(
        "--longest-sequence",
        action="store_true",
        help="print the longest block size that fits the memory per rank instead",
    )
    t.add_argument(
        "--stage",
        type=int,
        default=None,
        choices=(0, 1, 2, 3),
        help="data-axis sharding (ZeRO) stage; default: rank every stage",
    )
    t.add_argument(
        "--largest",
        action="store_true",
        help="find the most layers (at the given width, heads, sequence and batch) that fit "
        "the per-rank memory on --gpus ranks, and rank its shapes",
    )
    add_machine_options(t, "a100x4")


#: ``gnnpar plan gpt``.
PLANNER = PlanCommand(
    help="GPT with pipeline x data x 3D tensor parallelism",
    description="Rank (pipe, data, x, y, z) shapes and ZeRO stages for `gnnpar train gpt` "
    "with the same options (and the same defaults), or for a built-in size (--params); "
    "pipelines run --schedule with --grad-accum micro-batches.",
    options=GPT_OPTIONS,
    run=_cmd_gpt,
    add_arguments=_gpt_arguments,
)
