"""``gnnpar train TASK``: flags or a TOML file onto a typed config, local launch, the loop;
``gnnpar evaluate RUN`` and ``gnnpar predict RUN``: a trained run's saved model, rebuilt from
the run's ``config.toml`` on any grid, without training."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from gnnpar.errors import UserError
from gnnpar.train.config import ConfigError, add_flags, resolve, to_toml
from gnnpar.train.run import check_launch_flags, launch_ranks, train_here, world_size
from gnnpar.train.spec import TrainSpec, build_task, get, resolved, specs


def _preflight(args: argparse.Namespace, spec: TrainSpec, cfg: Any, launching: bool) -> None:
    """The checks before launch (:func:`gnnpar.train.loop.preflight`), skipped in ranks whose
    launching process ran them."""
    from gnnpar.launch import PREFLIGHT_DONE_ENV
    from gnnpar.train.loop import preflight

    if not launching and os.environ.get(PREFLIGHT_DONE_ENV) == "1":
        return
    preflight(spec, cfg, world_size(args, launching))


def _checked_config(args: argparse.Namespace, launching: bool) -> Any:
    """The run's config, after every check that needs no process group. An error is marked
    as the same on every rank (each rank of a plain torchrun checks the same: rank 0 says)."""
    spec = get(args.task)
    try:
        cfg = resolve(spec.config, args, args.config)
        if not args.print_config:
            check_launch_flags(args)
            _preflight(args, resolved(spec, cfg), cfg, launching)
    except (UserError, OSError) as err:
        err.same_on_every_rank = True
        raise
    return cfg


def _run(args: argparse.Namespace) -> int:
    from gnnpar.launch import strip_nprocs, under_launcher
    from gnnpar.train.progress import Progress

    launching = args.nprocs > 1 and not under_launcher()
    cfg = _checked_config(args, launching)
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    progress = Progress.for_this_process(quiet=cfg.quiet)
    if launching:
        argv = _strip_flag(strip_nprocs(args.argv), "--max-restarts")
        return launch_ranks(
            args.nprocs, argv, args.max_restarts, progress, args.launch_agent, out=cfg.out
        )
    train_here(get(args.task), cfg, progress)
    return 0


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


# ------------------------------------------------------------------ evaluate and predict
def _saved_run(args: argparse.Namespace) -> tuple[str, Any, TrainSpec]:
    """(task name, config, the spec that runs it) of the run folder ``args.run``, with this
    command's grid, after every check that needs no process group: the folder holds a run
    of a node task with the checkpoint asked for, and the grid fits the processes. Each
    error is one line, the same on every rank."""
    from gnnpar.checkpoint import complete_steps
    from gnnpar.launch import PREFLIGHT_DONE_ENV, under_launcher
    from gnnpar.train.config import read_run_config
    from gnnpar.train.loop import check_dataset_options, check_world, checkpoint_dir

    registry = specs()
    try:
        check_launch_flags(args)
        name, cfg = read_run_config(args.run, {k: s.config for k, s in registry.items()})
        if not registry[name].node_task:
            node_tasks = [k for k, s in registry.items() if s.node_task and s.listed]
            raise ConfigError(
                f"{args.command} works on {' and '.join(node_tasks)} runs; {args.run} is a "
                f"{name} run"
            )
        folder = checkpoint_dir(args.run, args.checkpoint)
        if not complete_steps(folder):
            why = (
                "no best checkpoint (no validation accuracy was evaluated): use --checkpoint latest"
                if args.checkpoint == "best"
                else "no checkpoint"
            )
            raise ConfigError(f"run folder {args.run} holds {why}")
        spec = resolved(registry[name], cfg)
        cfg = dataclasses.replace(cfg, **_grid_changes(args, spec, cfg), quiet=True)
        launching = args.nprocs > 1 and not under_launcher()
        if launching or os.environ.get(PREFLIGHT_DONE_ENV) != "1":
            world = world_size(args, launching)
            check_world(spec, cfg, world)
            check_dataset_options(cfg)
            if spec.preflight is not None:
                spec.preflight(cfg, world)
    except (UserError, OSError) as err:
        err.same_on_every_rank = True
        raise
    return name, cfg, spec


def _grid_changes(args: argparse.Namespace, spec: TrainSpec, cfg: Any) -> dict[str, Any]:
    """The config changes that put the saved model on this command's ranks, not the run's:
    ``--grid`` (default: the task's own for this many processes) for tasks with grid axes
    (gcn runs, and sage runs of the vertex sampler: ScaleGNN's 4D grid); no ``parts`` (one
    per process, made for this many) for the other sage runs, which are data parallel over
    every rank."""
    if spec.axes:
        return {"grid": args.grid}
    if args.grid is not None:
        raise ConfigError(
            f"--grid is for gcn runs and sage runs of the vertex sampler; {args.run} is a sage "
            f"run of sampler {cfg.sampler}, data parallel over every rank (use --nprocs)"
        )
    return {"parts": None}


def _launch_ranks(args: argparse.Namespace) -> int:
    """evaluate or predict on ``args.nprocs`` local ranks (:func:`launch_ranks`, silently)."""
    from gnnpar.launch import strip_nprocs
    from gnnpar.train.progress import Progress

    return launch_ranks(
        args.nprocs, strip_nprocs(args.argv), 0, Progress(enabled=False), args.launch_agent
    )


def _loaded(args: argparse.Namespace, cfg: Any, spec: TrainSpec) -> tuple[Any, Any]:
    """The task of ``cfg`` built on this command's ranks, with the model of the run's
    checkpoint (``args.checkpoint``) loaded onto its grid; and what :func:`checkpoint.load`
    found."""
    from gnnpar import checkpoint
    from gnnpar.train.loop import checkpoint_dir

    task = build_task(spec, cfg)
    found = checkpoint.load(checkpoint_dir(args.run, args.checkpoint), task.grid, task.model)
    if found is None:  # removed since the check before launch
        raise checkpoint.CheckpointError(f"run folder {args.run} holds no checkpoint")
    return task, found


def _evaluate(args: argparse.Namespace) -> int:
    from gnnpar.atomic import write_json
    from gnnpar.launch import under_launcher

    name, cfg, spec = _saved_run(args)
    if args.nprocs > 1 and not under_launcher():
        return _launch_ranks(args)
    import gnnpar

    task, found = _loaded(args, cfg, spec)
    metrics = task.evaluate(found.step - 1)
    grid = task.grid
    gnnpar.shutdown(grid)
    key = f"{args.split}_{task.metric}"
    if key not in metrics:
        err = ConfigError(f"the dataset of run {args.run} has no {args.split} split")
        err.same_on_every_rank = True
        raise err
    if grid.global_rank == 0:
        where = f"{args.checkpoint} checkpoint, {task.unit} {found.step}"
        print(f"{key}={metrics[key]:.4f} ({name} run {args.run}, {where}, {grid.describe()})")
        if args.json:
            doc = {
                "run": str(args.run),
                "task": name,
                "checkpoint": args.checkpoint,
                "step": found.step,
                "split": args.split,
                "metric": key,
                "value": metrics[key],
                "metrics": metrics,
                "grid": grid.shape,
            }
            write_json(args.json, doc, indent=1)
    return 0


#: What ``predict`` writes in its ``--out`` folder.
PREDICTIONS = "predictions.npy"
#: What its values are: class ids, or (multi-label targets) each task's probability.
VALUES = (
    "class ids: the arg-max of the model's logits (ties to the lowest id)",
    "probabilities: the sigmoid of the model's logits, one column per task",
)


def _check_predictions_out(args: argparse.Namespace) -> Path:
    """The ``--out`` folder can take the predictions (none there unless ``--overwrite``)."""
    from gnnpar.atomic import check_writable

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file, not a folder")
    if (out / PREDICTIONS).exists() and not args.overwrite:
        raise FileExistsError(f"{out / PREDICTIONS} exists; pass --overwrite to replace it")
    check_writable(out)
    return out


def _predict(args: argparse.Namespace) -> int:
    from gnnpar.atomic import atomic_write, write_json
    from gnnpar.launch import under_launcher

    name, cfg, spec = _saved_run(args)
    try:
        out = _check_predictions_out(args)
    except OSError as err:
        err.same_on_every_rank = True
        raise
    if args.nprocs > 1 and not under_launcher():
        return _launch_ranks(args)
    import numpy as np

    import gnnpar

    task, found = _loaded(args, cfg, spec)
    pred = task.predict().numpy()
    grid = task.grid
    gnnpar.shutdown(grid)
    if grid.global_rank == 0:

        def save(tmp: str) -> None:
            with open(tmp, "wb") as f:
                np.save(f, pred, allow_pickle=False)

        atomic_write(out / PREDICTIONS, save)
        doc = {
            "file": PREDICTIONS,
            "values": VALUES[task.metric != "acc"],
            "order": "original node order: entry i is node i of the dataset",
            "dtype": str(pred.dtype),
            "shape": list(pred.shape),
            "run": str(args.run),
            "task": name,
            "dataset": cfg.dataset,
            "dataset_options": cfg.dataset_options,
            "checkpoint": args.checkpoint,
            "step": found.step,
        }
        write_json(out / "predictions.json", doc, indent=1)
        print(
            f"wrote {out / PREDICTIONS}: {' x '.join(f'{n:,}' for n in pred.shape)} "
            f"{'class ids' if pred.ndim == 1 else 'probabilities'} ({args.checkpoint} "
            f"checkpoint, {task.unit} {found.step}) and {out / 'predictions.json'}"
        )
    return 0


def _saved_run_flags(p: argparse.ArgumentParser) -> None:
    """The flags evaluate and predict share: the run, its checkpoint, the grid."""
    p.add_argument("run", metavar="RUN", help="a run folder of gnnpar train gcn or sage")
    p.add_argument(
        "--checkpoint",
        choices=("best", "latest"),
        default="best",
        help="the best-validation model or the newest checkpoint (default: best)",
    )
    p.add_argument("--nprocs", type=int, default=1, help="local processes to start")
    p.add_argument(
        "--grid",
        default=None,
        help="gcn, or sage with sampler vertex: grid such as x=2 or data=2,x=2 (default: "
        "the task's for --nprocs; any grid, the checkpoint is resharded on load)",
    )


def add_train_commands(subparsers: Any) -> None:
    """Register ``gnnpar train TASK`` on an argparse sub-parsers object."""
    train = subparsers.add_parser(
        "train", help="train a model: gcn (full graph), sage (mini-batch) or gpt"
    )
    tasks = train.add_subparsers(dest="task", required=True)
    for name, spec in specs().items():
        if not spec.listed:
            continue
        # the launch flags get a group of their own: argparse's default one would be a
        # second "options" section next to the task's
        p = tasks.add_parser(name, help=spec.help, add_help=False)
        launch = p.add_argument_group("help, config file and launch")
        launch.add_argument("-h", "--help", action="help", help="show this help and exit")
        launch.add_argument(
            "--config", default=None, metavar="FILE", help="TOML file with the options below"
        )
        launch.add_argument("--print-config", action="store_true", help="show the merged config")
        launch.add_argument("--nprocs", type=int, default=1, help="local processes to start")
        launch.add_argument(
            "--max-restarts",
            type=int,
            default=0,
            help="with --nprocs: restart all ranks this often after a failure (use --resume)",
        )
        add_flags(p, spec.config)
        p.set_defaults(func=_run)
    p = subparsers.add_parser(
        "evaluate",
        help="the score (accuracy, or ROC-AUC for multi-label targets) of a trained gcn or "
        "sage run's saved model, on any grid",
    )
    _saved_run_flags(p)
    p.add_argument(
        "--split",
        choices=("test", "val", "train"),
        default="test",
        help="nodes to score (default: test)",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON")
    p.set_defaults(func=_evaluate, max_restarts=0)
    p = subparsers.add_parser(
        "predict", help="every node's predicted class from a trained gcn or sage run"
    )
    _saved_run_flags(p)
    p.add_argument(
        "--out", required=True, metavar="DIR",
        help="folder for predictions.npy (class ids in original node order) and "
        "predictions.json (what it holds)",
    )  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace predictions in DIR")
    p.set_defaults(func=_predict, max_restarts=0)
    report = subparsers.add_parser("report", help="plots and a summary of a run folder")
    report.add_argument("run_dir", help="the run folder (holds metrics.jsonl)")
    report.set_defaults(func=_report)
