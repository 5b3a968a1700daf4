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
    of a node task or a pair task (link) with the checkpoint asked for, and the grid fits
    the processes. Each error is one line, the same on every rank."""
    from gnnpar.checkpoint import complete_steps
    from gnnpar.launch import PREFLIGHT_DONE_ENV, under_launcher
    from gnnpar.train.config import read_run_config
    from gnnpar.train.loop import check_dataset_options, check_world, checkpoint_dir

    registry = specs()
    try:
        check_launch_flags(args)
        name, cfg = read_run_config(args.run, {k: s.config for k, s in registry.items()})
        if not (registry[name].node_task or registry[name].pair_task):
            kinds = [k for k, s in registry.items() if (s.node_task or s.pair_task) and s.listed]
            raise ConfigError(
                f"{args.command} works on {_and(kinds)} runs; {args.run} is a {name} run"
            )
        folder = checkpoint_dir(args.run, args.checkpoint)
        if not complete_steps(folder):
            score = "score" if registry[name].pair_task else "accuracy"
            why = (
                f"no best checkpoint (no validation {score} was evaluated): use --checkpoint latest"
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


def _and(words: list[str]) -> str:
    """``["a", "b", "c"]`` as ``"a, b and c"``."""
    return " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 2 else words)


def _grid_changes(args: argparse.Namespace, spec: TrainSpec, cfg: Any) -> dict[str, Any]:
    """The config changes that put the saved model on this command's ranks, not the run's:
    ``--grid`` (default: the task's own for this many processes) for tasks with grid axes
    (gcn runs, link runs of mode full, and sage runs of the vertex sampler: ScaleGNN's 4D
    grid); no ``parts`` (one per process, made for this many) for the other sage runs, which
    are data parallel over every rank, as link runs of mode minibatch are."""
    minibatch_pairs = spec.pair_task and getattr(cfg, "mode", None) == "minibatch"
    if spec.axes and not minibatch_pairs:
        return {"grid": args.grid}
    if args.grid is not None:
        run = (
            f"a {spec.name} run of mode minibatch"
            if minibatch_pairs
            else f"a sage run of sampler {cfg.sampler}"
        )
        raise ConfigError(
            f"--grid is for gcn runs, link runs of mode full and sage runs of the vertex "
            f"sampler; {args.run} is {run}, data parallel over every rank (use --nprocs)"
        )
    return {} if minibatch_pairs else {"parts": None}


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
    if spec.pair_task and args.split == "train":
        err = ConfigError(
            f"--split train: {args.run} is a {name} run, scored on its val and test edges only"
        )
        err.same_on_every_rank = True
        raise err
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
        # a pair task's every score of the split (mrr, rocauc, hits@K), its metric first
        shown = [key] + [
            k for k in metrics if spec.pair_task and k.startswith(f"{args.split}_") and k != key
        ]
        values = " ".join(f"{k}={metrics[k]:.4f}" for k in shown)
        print(f"{values} ({name} run {args.run}, {where}, {grid.describe()})")
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


#: What ``predict --pairs`` writes in its ``--out`` folder (a pair task's run).
SCORES = "scores.npy"
#: What its values are: link prediction's scores (the decoder's logits, or with ``--sigmoid``
#: their sigmoid), edge classification's logits, edge regression's predictions.
SCORE_VALUES = {
    "logits": "logits: the decoder's score of each pair (float32)",
    "probabilities": "probabilities: the sigmoid of the decoder's score of each pair (float32)",
    "classify": "logits: the decoder's logit of each class for each pair, pairs x classes "
    "(float32)",
    "regress": "predictions: the decoder's predicted edge label of each pair (float32)",
}


def _check_predictions_out(args: argparse.Namespace, name: str = PREDICTIONS) -> Path:
    """The ``--out`` folder can take the predictions ``name`` (none there unless
    ``--overwrite``)."""
    from gnnpar.atomic import check_writable

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file, not a folder")
    if (out / name).exists() and not args.overwrite:
        raise FileExistsError(f"{out / name} exists; pass --overwrite to replace it")
    check_writable(out)
    return out


def read_pairs(path: str | Path) -> Any:
    """The node pairs of ``path`` as a (2, P) int64 tensor (sources, then destinations): a
    ``.npy`` file of integers, shape (2, P) or (P, 2) (2 × 2 is read as (2, P); no pickles:
    ``allow_pickle=False``), or a text file of ``src dst`` lines (whitespace between; blank
    lines and lines starting with ``#`` skipped). UserError naming the file otherwise."""
    import numpy as np
    import torch

    path = Path(path)
    if not path.is_file():
        raise UserError(f"pairs file {path} does not exist")
    if path.suffix == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as err:
            raise UserError(
                f"pairs file {path} is not a plain .npy array (no pickles are read): {err}"
            ) from None
        if not isinstance(array, np.ndarray):
            raise UserError(f"pairs file {path} is not a .npy array (an .npz archive?)")
        if array.dtype.kind not in "iu":
            raise UserError(f"pairs file {path} holds {array.dtype}, not integer node ids")
        if array.ndim != 2 or 2 not in array.shape:
            raise UserError(
                f"pairs file {path} has shape {tuple(array.shape)}: give (2, P) or (P, 2)"
            )
        if array.shape[0] != 2:
            array = array.T
        if array.dtype.kind == "u" and array.size and array.max() > np.iinfo(np.int64).max:
            raise UserError(f"pairs file {path}: node id {array.max()} is out of range")
        pairs = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    else:
        rows: list[tuple[int, int]] = []
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise UserError(
                f"pairs file {path} is not text: give a .npy array or 'src dst' lines"
            ) from None
        for number, line in enumerate(lines, 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            try:
                if len(words) != 2:
                    raise ValueError
                rows.append((int(words[0]), int(words[1])))
            except ValueError:
                raise UserError(
                    f"pairs file {path} line {number}: expected 'src dst' (two integer node "
                    f"ids), got {line.strip()[:60]!r}"
                ) from None
        pairs = torch.tensor(rows, dtype=torch.int64).reshape(-1, 2).T.contiguous()
    if pairs.shape[1] == 0:
        raise UserError(f"pairs file {path} holds no pairs")
    return pairs


def check_pair_ids(pairs: Any, num_nodes: int, path: str | Path) -> None:
    """Every id of ``pairs`` (2, P) is a node of a graph of ``num_nodes`` nodes; UserError
    naming the file, the first id out of range (in file order) and its pair otherwise."""
    bad = ((pairs < 0) | (pairs >= num_nodes)).T.reshape(-1).nonzero()
    if bad.numel():
        first = int(bad[0])
        node = int(pairs.T.reshape(-1)[first])
        raise UserError(
            f"pairs file {path}: node id {node} (pair {first // 2}) is out of range: the "
            f"graph has {num_nodes:,} nodes, ids 0 to {num_nodes - 1:,}"
        )


def _pairs_to_score(args: argparse.Namespace, name: str, spec: TrainSpec) -> Any:
    """The pairs of ``--pairs`` for a pair task's run (:func:`read_pairs`), None for a node
    task's; ConfigError where the flags do not fit the run."""
    if not spec.pair_task:
        for flag, given in (("--pairs", args.pairs is not None), ("--sigmoid", args.sigmoid)):
            if given:
                raise ConfigError(
                    f"{flag} is for link runs; {args.run} is a {name} run (predict writes "
                    "every node's class)"
                )
        return None
    if args.pairs is None:
        raise ConfigError(
            f"{args.run} is a {name} run: predict scores node pairs, give --pairs FILE (a .npy "
            "of shape (2, P) or (P, 2), or 'src dst' lines)"
        )
    return read_pairs(args.pairs)


def _predict(args: argparse.Namespace) -> int:
    from gnnpar.launch import under_launcher

    name, cfg, spec = _saved_run(args)
    try:
        pairs = _pairs_to_score(args, name, spec)
        out = _check_predictions_out(args, PREDICTIONS if pairs is None else SCORES)
    except (UserError, OSError) as err:
        err.same_on_every_rank = True
        raise
    if args.nprocs > 1 and not under_launcher():
        return _launch_ranks(args)
    if pairs is not None:
        return _predict_pairs(args, name, cfg, spec, pairs, out)

    import gnnpar

    task, found = _loaded(args, cfg, spec)
    pred = task.predict().numpy()
    grid = task.grid
    gnnpar.shutdown(grid)
    if grid.global_rank == 0:
        described = {"values": VALUES[task.metric != "acc"],
                     "order": "original node order: entry i is node i of the dataset"}
        _write_array(out, PREDICTIONS, pred, described, args, name, cfg, found.step)
        print(
            f"wrote {out / PREDICTIONS}: {' x '.join(f'{n:,}' for n in pred.shape)} "
            f"{'class ids' if pred.ndim == 1 else 'probabilities'} ({args.checkpoint} "
            f"checkpoint, {task.unit} {found.step}) and {out / 'predictions.json'}"
        )
    return 0


def _write_array(
    out: Path, file: str, array: Any, described: dict[str, Any], args: argparse.Namespace,
    name: str, cfg: Any, step: int,
) -> None:
    """``out/file`` (a ``.npy``, written whole or not at all) and beside it its description
    (``.json``): what ``described`` says, the array's dtype and shape, and the run, task,
    dataset and checkpoint it came from."""
    import numpy as np

    from gnnpar.atomic import atomic_write, write_json

    def save(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)

    atomic_write(out / file, save)
    doc = {"file": file, **described, "dtype": str(array.dtype), "shape": list(array.shape),
           "run": str(args.run), "task": name, "dataset": cfg.dataset,
           "dataset_options": cfg.dataset_options, "checkpoint": args.checkpoint,
           "step": step}  # fmt: skip
    write_json(out / Path(file).with_suffix(".json").name, doc, indent=1)


def _predict_pairs(
    args: argparse.Namespace, name: str, cfg: Any, spec: TrainSpec, pairs: Any, out: Path
) -> int:
    """predict on a pair task's run (one rank of it): the scores of ``pairs`` (2, P), each
    the decoder's logit (or its sigmoid with ``--sigmoid``), as float32 in ``out``; for a
    run on edge labels, each pair's class logits (P × C) or predicted value."""
    import torch

    import gnnpar

    task, found = _loaded(args, cfg, spec)
    grid = task.grid
    edge_task = getattr(task, "edge_task", None)  # "classify", "regress" or None
    try:
        check_pair_ids(pairs, task.graph.num_nodes, args.pairs)
        if args.sigmoid and edge_task is not None:
            raise ConfigError(
                f"--sigmoid is for link prediction; {args.run} is a {name} run of edge "
                f"{'classification' if edge_task == 'classify' else 'regression'} on edge labels"
            )
    except UserError as err:
        gnnpar.shutdown(grid)
        err.same_on_every_rank = True
        raise
    scores = task.score_pairs(pairs[0], pairs[1]).detach().cpu()
    if args.sigmoid:
        scores = torch.sigmoid(scores)
    values = scores.to(torch.float32).numpy()
    what = edge_task or ("probabilities" if args.sigmoid else "logits")
    gnnpar.shutdown(grid)
    if grid.global_rank == 0:
        described = {"values": SCORE_VALUES[what], "order": "entry i is pair i of the pairs file",
                     "pairs": str(args.pairs)}  # fmt: skip
        _write_array(out, SCORES, values, described, args, name, cfg, found.step)
        print(
            f"wrote {out / SCORES}: {' x '.join(f'{n:,}' for n in values.shape)} "
            f"{SCORE_VALUES[what].partition(':')[0]} of the pairs in {args.pairs} "
            f"({args.checkpoint} checkpoint, {task.unit} {found.step}) and "
            f"{out / 'scores.json'}"
        )
    return 0


def _saved_run_flags(p: argparse.ArgumentParser) -> None:
    """The flags evaluate and predict share: the run, its checkpoint, the grid."""
    p.add_argument("run", metavar="RUN", help="a run folder of gnnpar train gcn, sage or link")
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
        help="gcn, link with mode full, or sage with sampler vertex: grid such as x=2 or "
        "data=2,x=2 (default: the task's for --nprocs; any grid, the checkpoint is resharded "
        "on load)",
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
        "sage run's saved model, or a link run's MRR, ROC-AUC and Hits@K, on any grid",
    )
    _saved_run_flags(p)
    p.add_argument(
        "--split",
        choices=("test", "val", "train"),
        default="test",
        help="nodes (link runs: edges, val or test) to score (default: test)",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON")
    p.set_defaults(func=_evaluate, max_restarts=0)
    p = subparsers.add_parser(
        "predict",
        help="every node's predicted class from a trained gcn or sage run, or a link run's "
        "scores of node pairs",
    )
    _saved_run_flags(p)
    p.add_argument(
        "--out", required=True, metavar="DIR",
        help="folder for predictions.npy (class ids in original node order) and "
        "predictions.json (what it holds); with --pairs, scores.npy and scores.json",
    )  # fmt: skip
    p.add_argument(
        "--pairs", default=None, metavar="FILE",
        help="link runs: the node pairs to score, a .npy of integers of shape (2, P) or "
        "(P, 2), or a text file of 'src dst' lines; scores.npy holds one float32 logit per pair",
    )  # fmt: skip
    p.add_argument(
        "--sigmoid", action="store_true",
        help="with --pairs: write probabilities (the sigmoid of the logits) instead",
    )  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace predictions in DIR")
    p.set_defaults(func=_predict, max_restarts=0)
    report = subparsers.add_parser("report", help="plots and a summary of a run folder")
    report.add_argument("run_dir", help="the run folder (holds metrics.jsonl)")
    report.set_defaults(func=_report)
