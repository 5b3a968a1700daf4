"""The train-spec registry: what each workload gives the trainer, looked up by task name.

A workload (a package of :mod:`gnnpar.models`, or of another distribution) describes itself
by one :class:`TrainSpec`: its name on the command line, its typed config, how it plans its
grid, how it builds its task on that grid, and its checks before launch. Everything that
runs a task goes through here: ``gnnpar train``, ``gnnpar evaluate`` / ``predict`` and
:func:`gnnpar.train.fit`; ``gnnpar plan NAME`` is the spec's :attr:`~TrainSpec.planner`, which
ranks shapes with the workload's own cost and memory models.

Registering a workload is one line:

- a package of gnnpar adds its spec module to :data:`BUILTIN`;
- another distribution names its spec in an entry point of the group
  :data:`ENTRY_POINT_GROUP` (``name = "package.module:SPEC"``, the object a
  :class:`TrainSpec`), and its task appears in ``gnnpar train --help`` once installed.

:func:`build_task` is the one place a grid is built for a task: the world grid, then the
spec's :attr:`~TrainSpec.plan` (the grid the config names, or the planner's choice from the
sizes it reads), then the task on the reshaped grid.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import TYPE_CHECKING, Any

from gnnpar.errors import UserError
from gnnpar.train.config import ConfigError

if TYPE_CHECKING:
    from gnnpar.plan.command import PlanCommand
    from gnnpar.train.loop import Task
    from gnnpar.train.progress import Progress

__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "GridPlan",
    "TrainSpec",
    "build_task",
    "get",
    "given_grid",
    "resolved",
    "specs",
]

#: The spec modules of gnnpar's own workloads (each defines ``SPEC``), in the order
#: ``gnnpar train --help`` lists them.
BUILTIN = (
    "gnnpar.models.fullgraph.spec",
    "gnnpar.models.minibatch.spec",
    "gnnpar.models.scalegnn.spec",
    "gnnpar.models.link.spec",
    "gnnpar.models.gpt.spec",
)

#: The entry-point group through which another distribution registers its workloads.
ENTRY_POINT_GROUP = "gnnpar.train_specs"


@dataclasses.dataclass(frozen=True)
class GridPlan:
    """A task's grid, chosen before the task is built: the axes for
    :func:`gnnpar.reshape` (none: every rank on the data axis), who chose them (a phrase
    for the start lines, e.g. ``"chosen by the planner"``), and what the plan read to
    choose (sizes, a prepared dataset), handed on to the task so it is read once."""

    shape: Mapping[str, int] = dataclasses.field(default_factory=dict)
    choice: str = "given"
    prepared: Any = None


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """One workload, as the trainer and the command line see it.

    ``task(cfg, grid, plan, progress)`` builds the task (a :class:`~gnnpar.train.loop.Task`)
    on the grid ``plan(cfg, world, progress, **extras)`` chose (:func:`build_task`).
    ``preflight(cfg, world_size)`` runs in the launching process before any rank starts and
    raises one-line errors (a :class:`~gnnpar.errors.UserError` such as ``ConfigError``, or
    an ``OSError``; any other error is reported as a bug, with its traceback). ``variant(cfg)``
    names another registered spec that runs this config instead (ScaleGNN's vertex sampling
    behind ``sage``), or None. ``axes``: the grid axes beyond data a ``grid`` option may
    name (checked before launch). ``node_task``: every node gets a class, so ``gnnpar
    evaluate`` and ``predict`` work on its runs. ``pair_task``: the model scores node pairs
    (its task has ``score_pairs(src, dst)`` and ``graph``), so ``gnnpar evaluate`` reports
    its pair metrics and ``gnnpar predict --pairs FILE`` scores the pairs of a file.
    ``listed``: shown as ``gnnpar train NAME`` (a variant is reached through its parent
    instead). ``parallelize``: the public function that puts the workload's plain model on
    the grid (what its task calls; for a user's own model). ``planner``: ``gnnpar plan
    NAME``, ranking shapes with the workload's cost and memory models (the same ones its
    ``plan`` chooses from), or None.
    """

    name: str
    help: str
    config: type
    task: Callable[..., Task]
    plan: Callable[..., GridPlan]
    preflight: Callable[[Any, int], None] | None = None
    variant: Callable[[Any], str | None] | None = None
    axes: tuple[str, ...] = ("x", "y", "z")
    node_task: bool = False
    pair_task: bool = False
    listed: bool = True
    parallelize: Callable[..., Any] | None = None
    planner: PlanCommand | None = None


def _load(target: str, where: str) -> TrainSpec:
    """The :class:`TrainSpec` at ``target`` (``module`` with a ``SPEC``, or
    ``module:attribute``); ``where`` names the registration in an error."""
    module, _, attribute = target.partition(":")
    spec = getattr(importlib.import_module(module), attribute or "SPEC", None)
    if not isinstance(spec, TrainSpec):
        raise TypeError(f"{where}: {target} is not a gnnpar.train.spec.TrainSpec")
    return spec


def specs() -> dict[str, TrainSpec]:
    """Every registered workload by name: gnnpar's own (:data:`BUILTIN`), then those of
    installed distributions (:data:`ENTRY_POINT_GROUP`). A name registered twice is an
    error naming both."""
    found: dict[str, tuple[TrainSpec, str]] = {}
    entries = [(name, "gnnpar") for name in BUILTIN]
    entries += [
        (ep.value, f"entry point {ep.name!r} of {ENTRY_POINT_GROUP}")
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)
    ]
    for target, where in entries:
        spec = _load(target, where)
        if spec.name in found:
            raise UserError(
                f"task {spec.name!r} is registered twice: by {found[spec.name][1]} and by {where}"
            )
        found[spec.name] = (spec, where)
    return {name: spec for name, (spec, _) in found.items()}


def get(name: str, registry: Mapping[str, TrainSpec] | None = None) -> TrainSpec:
    """The spec named ``name`` (ConfigError naming the listed ones otherwise)."""
    registry = specs() if registry is None else registry
    if name not in registry:
        listed = ", ".join(n for n, s in registry.items() if s.listed)
        raise ConfigError(f"unknown task {name!r}: one of {listed}")
    return registry[name]


def resolved(spec: TrainSpec, cfg: Any) -> TrainSpec:
    """The spec that runs ``cfg``: ``spec``, or the variant it names for this config."""
    other = spec.variant(cfg) if spec.variant is not None else None
    return spec if other is None else get(other)


def given_grid(cfg: Any, otherwise: str = "data parallel") -> GridPlan:
    """The plan of a task whose grid is the config's ``grid`` option (none: every rank on
    the data axis, described as ``otherwise``); for tasks that choose nothing themselves."""
    from gnnpar.grid import parse_grid_spec

    spec = getattr(cfg, "grid", None)
    return GridPlan(parse_grid_spec(spec), "given") if spec else GridPlan({}, otherwise)


def build_task(
    spec: TrainSpec | str, cfg: Any, progress: Progress | None = None, **extras: Any
) -> Task:
    """The task of ``cfg`` on its grid, built once here for every workload: the world grid
    on ``cfg.device``'s backend, the spec's plan, the grid reshaped to it, then the task.
    ``extras`` go to the plan (e.g. a tokenised corpus the caller already holds)."""
    import gnnpar
    from gnnpar.grid import backend_for_choice, fit_shape
    from gnnpar.train.progress import Progress

    spec = resolved(get(spec) if isinstance(spec, str) else spec, cfg)
    progress = progress if progress is not None else Progress(enabled=False)
    world = gnnpar.init(
        backend=backend_for_choice(cfg.device),
        ranks_per_node=cfg.ranks_per_node,
        timeout=cfg.timeout,
    )
    plan = spec.plan(cfg, world, progress, **extras)
    sizes = fit_shape(world.world_size, plan.shape)
    grid = world
    if any(sizes[axis] != getattr(world, axis) for axis in sizes):  # new groups cost seconds
        grid = gnnpar.reshape(world, **plan.shape, ranks_per_node=cfg.ranks_per_node)
    return spec.task(cfg, grid, plan, progress)
