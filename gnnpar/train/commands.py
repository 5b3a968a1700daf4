"""``gnnpar train TASK``: flags or a TOML file onto a typed config, local launch, the loop."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from gnnpar.train.config import ConfigError, add_flags, resolve, to_toml


def _tasks() -> dict[str, tuple[type, Callable[[Any], Any], str]]:
    """TASK name → (config class, task factory, help)."""
    from gnnpar.train.fullgraph import FullGraphConfig, FullGraphTask
    from gnnpar.train.gpt import GPTTask, GPTTaskConfig
    from gnnpar.train.minibatch import MiniBatchConfig, MiniBatchTask

    return {
        "gcn": (FullGraphConfig, FullGraphTask, "full-graph GCN / GraphSAGE (1D, 2D, 3D)"),
        "sage": (
            MiniBatchConfig,
            MiniBatchTask,
            "mini-batch GraphSAGE / GCN / GAT with neighbour sampling (one part per rank)",
        ),
        "gpt": (
            GPTTaskConfig,
            GPTTask,
            "GPT (ours or Hugging Face GPT-2) with data x 3D tensor parallelism and ZeRO",
        ),
    }


def _check_launch_flags(args: argparse.Namespace) -> None:
    """``--nprocs`` and ``--max-restarts`` must make sense before anything starts."""
    if args.nprocs < 1:
        raise ConfigError(f"--nprocs must be at least 1, got {args.nprocs}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be at least 0, got {args.max_restarts}")


def _world_size(args: argparse.Namespace, launching: bool) -> int:
    """The number of ranks the run will have: ``--nprocs`` when this process launches them,
    else the launcher's world (1 without one)."""
    from gnnpar.launch import detect_launch

    if launching:
        return args.nprocs
    launch = detect_launch()
    return 1 if launch is None else launch.world_size


def _preflight(args: argparse.Namespace, factory: Any, cfg: Any, launching: bool) -> None:
    """The checks before launch (:func:`gnnpar.train.loop.preflight`), skipped in ranks whose
    launching process ran them."""
    from gnnpar.launch import PREFLIGHT_DONE_ENV
    from gnnpar.train.loop import preflight

    if not launching and os.environ.get(PREFLIGHT_DONE_ENV) == "1":
        return
    preflight(factory, cfg, _world_size(args, launching))


def _checked_config(args: argparse.Namespace, launching: bool) -> Any:
    """The run's config, after every check that needs no process group. An error is marked
    as the same on every rank (each rank of a plain torchrun checks the same: rank 0 says)."""
    cls, factory, _ = _tasks()[args.task]
    try:
        cfg = resolve(cls, args, args.config)
        if not args.print_config:
            _check_launch_flags(args)
            _preflight(args, factory, cfg, launching)
    except (ValueError, OSError) as err:
        err.same_on_every_rank = True
        raise
    return cfg


def _run(args: argparse.Namespace) -> int:
    from gnnpar.launch import strip_nprocs, under_launcher
    from gnnpar.train.progress import Progress

    _, factory, _ = _tasks()[args.task]
    launching = args.nprocs > 1 and not under_launcher()
    cfg = _checked_config(args, launching)
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    progress = Progress.for_this_process(quiet=cfg.quiet)
    if launching:
        argv = _strip_flag(strip_nprocs(args.argv), "--max-restarts")
        return launch_ranks(args.nprocs, argv, args.max_restarts, progress)
    train_here(factory, cfg, progress)
    return 0


def launch_ranks(nprocs: int, argv: list[str], max_restarts: int, progress: Any) -> int:
    """Start ``gnnpar ARGV`` on ``nprocs`` local ranks (:func:`gnnpar.launch.launch_local`),
    the checks before launch marked as done (the caller ran them); return the exit code."""
    from gnnpar.launch import PREFLIGHT_DONE_ENV, launch_local

    # the ranks take seconds to start (each imports torch): say what is happening
    env = {PREFLIGHT_DONE_ENV: "1", **progress.launching(nprocs)}
    return launch_local(nprocs, argv, max_restarts=max_restarts, env=env)


def train_here(factory: Callable[..., Any], cfg: Any, progress: Any) -> dict[str, float]:
    """Build the task in this process (one rank of the launcher's world, or a world of its
    own), run :class:`~gnnpar.train.loop.Trainer` to the end, print the outcome on rank 0
    and shut the grid down; return the final evaluation."""
    import gnnpar
    from gnnpar.train.loop import Trainer
    from gnnpar.train.progress import metrics_text

    progress.ranks_started()
    task = factory(cfg, progress=progress)
    trainer = Trainer.from_config(task, cfg, progress=progress)
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
    sample = task.finish() if hasattr(task, "finish") else None
    if task.grid.global_rank == 0:
        if sample:
            print(f"sample:\n{sample}")
        summary = metrics_text(result)
        print(f"done: {task.grid.describe()} {summary}; metrics in {cfg.out}/metrics.jsonl")
    gnnpar.shutdown(task.grid)
    return result


def _strip_flag(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag VALUE`` / ``flag=VALUE`` (options for the launcher only)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def _report(args: argparse.Namespace) -> int:
    from gnnpar.train.report import write_report

    print(write_report(args.run_dir))
    return 0


def add_train_commands(subparsers: Any) -> None:
    """Register ``gnnpar train TASK`` on an argparse sub-parsers object."""
    train = subparsers.add_parser(
        "train", help="train a model: gcn (full graph), sage (mini-batch) or gpt"
    )
    tasks = train.add_subparsers(dest="task", required=True)
    for name, (cls, _, help_text) in _tasks().items():
        p = tasks.add_parser(name, help=help_text)
        p.add_argument("--config", default=None, help="TOML file with options")
        p.add_argument("--print-config", action="store_true", help="show the merged config")
        p.add_argument("--nprocs", type=int, default=1, help="local processes to start")
        p.add_argument(
            "--max-restarts",
            type=int,
            default=0,
            help="with --nprocs: restart all ranks this often after a failure (use --resume)",
        )
        add_flags(p, cls)
        p.set_defaults(func=_run)
    report = subparsers.add_parser("report", help="plots and a summary of a run folder")
    report.add_argument("run_dir", help="the run folder (holds metrics.jsonl)")
    report.set_defaults(func=_report)
