"""Running a task: the launch flags' checks, the local launch of the ranks, and one rank's
training to the end. ``gnnpar train``, ``gnnpar evaluate`` / ``predict`` and
:func:`gnnpar.train.fit` run tasks through here."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any

from gnnpar.train.config import ConfigError
from gnnpar.train.lock import LOCKED_ENV, run_lock
from gnnpar.train.spec import TrainSpec, build_task


def check_launch_flags(args: argparse.Namespace) -> None:
    """``--nprocs`` and ``--max-restarts`` must make sense before anything starts."""
    if args.nprocs < 1:
        raise ConfigError(f"--nprocs must be at least 1, got {args.nprocs}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be at least 0, got {args.max_restarts}")


def world_size(args: argparse.Namespace, launching: bool) -> int:
    """The number of ranks the run will have: ``--nprocs`` when this process launches them,
    else the launcher's world (1 without one)."""
    from gnnpar.launch import detect_launch

    if launching:
        return args.nprocs
    launch = detect_launch()
    return 1 if launch is None else launch.world_size


def launch_ranks(
    nprocs: int,
    argv: list[str],
    max_restarts: int,
    progress: Any,
    agent: Any = None,
    out: str | None = None,
) -> int:
    """Start ``gnnpar ARGV`` on ``nprocs`` local ranks (:func:`gnnpar.launch.launch_local`,
    in ``agent``, a :class:`~gnnpar.launch.ForkedAgent`, when given), the checks before
    launch marked as done (the caller ran them); return the exit code. ``out``: the run
    folder, whose lock (:func:`gnnpar.train.lock.run_lock`) this process holds until every
    attempt has ended."""
    from gnnpar.launch import PREFLIGHT_DONE_ENV, launch_local

    with contextlib.ExitStack() as stack:
        env = {PREFLIGHT_DONE_ENV: "1"}
        if out is not None:
            stack.enter_context(run_lock(out))
            env[LOCKED_ENV] = "1"
        # the ranks can take seconds to start (where each is a new interpreter importing
        # torch): say what is happening
        env.update(progress.launching(nprocs))
        return launch_local(nprocs, argv, max_restarts=max_restarts, env=env, agent=agent)


def train_here(spec: TrainSpec, cfg: Any, progress: Any) -> dict[str, float]:
    """Build the task in this process (one rank of the launcher's world, or a world of its
    own), run :class:`~gnnpar.train.loop.Trainer` to the end, print the outcome on rank 0
    and shut the grid down; return the final evaluation. The process that owns the run
    (rank 0, where no launching process does) holds the run folder's lock
    (:func:`gnnpar.train.lock.run_lock`) until the end."""
    from gnnpar.launch import rank_and_world

    with contextlib.ExitStack() as stack:
        if os.environ.get(LOCKED_ENV) != "1" and rank_and_world()[0] == 0:
            stack.enter_context(run_lock(cfg.out))  # no launching process holds it
        return _train_to_the_end(spec, cfg, progress)


def _train_to_the_end(spec: TrainSpec, cfg: Any, progress: Any) -> dict[str, float]:
    """:func:`train_here` once the run folder's lock is held."""
    import gnnpar
    from gnnpar.train.loop import Trainer
    from gnnpar.train.metrics import memory_text, rss_mb
    from gnnpar.train.progress import metrics_text

    progress.ranks_started()
    baseline = rss_mb()  # the idle process: interpreter, torch and gnnpar, no data yet
    task = build_task(spec, cfg, progress)
    trainer = Trainer.from_config(task, cfg, progress=progress, baseline_rss_mb=baseline)
    result = trainer.run()
    if trainer.preempted_at is not None:
        # Exit 0: the checkpoint is written and every rank stopped cleanly; requeueing is
        # the job script's choice (examples/slurm/), and a requeued job resumes by itself.
        if task.grid.global_rank == 0:
            print(
                f"preempted by SIGTERM after {task.unit} {trainer.preempted_at}: checkpoint "
                f"in {cfg.out}/checkpoints; run again with --resume to continue"
            )
        gnnpar.shutdown(task.grid)
        return result
    sample = task.finish()
    if task.grid.global_rank == 0:
        if sample:
            print(f"sample:\n{sample}")
        summary = metrics_text(result)
        print(f"done: {task.grid.describe()} {summary}; metrics in {cfg.out}/metrics.jsonl")
        if trainer.memory is not None:
            print(memory_text(trainer.memory))
    gnnpar.shutdown(task.grid)
    return result
