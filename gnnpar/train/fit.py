"""``gnnpar.train.fit``: train a graph held in a Python script, with the trainer's options.

::

    from gnnpar.train import fit
    metrics = fit("gcn", graph=data, epochs=3, out="runs/mine")             # one process
    metrics = fit("sage", graph=data, epochs=3, out="runs/mine2", nprocs=2)  # two ranks

``graph`` is a :class:`~gnnpar.graph.Graph`, a PyG ``Data`` or a DGL graph (converted with
:func:`gnnpar.graph.convert.as_graph`). It is saved, as a verified graph folder, to ``OUT/graph``
(kept when it already holds this graph), and the task's ``dataset`` points there: the run is
then exactly ``gnnpar train TASK --dataset OUT/graph`` with the same options, the same
checks before launch and the same one-line errors. The options are the task's config keys
(``gnnpar train TASK --help``, the TOML keys): ``epochs=3``, ``hidden=16``,
``dataset_options="to_undirected=true"``...

With ``nprocs=1`` the trainer runs in this process; with ``nprocs > 1`` the ranks are
started as ``gnnpar train TASK --nprocs N`` starts them and the final metrics are read back
from the run folder's ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gnnpar.train.config import ConfigError, from_mapping

if TYPE_CHECKING:
    from gnnpar.graph import Graph

__all__ = ["GRAPH_FOLDER", "fit"]

#: Where, under the run folder, ``fit`` saves the graph it is given.
GRAPH_FOLDER = "graph"


def _save_graph(graph: Graph, folder: Path) -> None:
    """Write ``graph`` to ``folder`` unless it already holds the same graph."""
    from gnnpar.data.storage import is_graph_folder, read_source, save_graph

    if is_graph_folder(folder):
        try:
            if read_source(folder)["fingerprint"] == graph.fingerprint():
                return
        except ValueError:
            pass  # damaged or of an older gnnpar: written again below
    save_graph(graph, folder, overwrite=True, source={"fit": {"name": graph.name}})


def _flags(cfg: Any) -> list[str]:
    """The command-line flags that give ``cfg`` (those differing from the defaults)."""
    argv = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def _final_metrics(out: str | Path) -> dict[str, float]:
    """The final evaluation of a finished run: its ``end`` record, as the trainer returns it."""
    from gnnpar.train.metrics import read_metrics

    path = Path(out) / "metrics.jsonl"
    ends = [r for r in read_metrics(path) if r.get("event") == "end"]
    if not ends:
        raise RuntimeError(f"{path} has no end record: the run did not finish")
    return {k: v for k, v in ends[-1].items() if k not in ("event", "time", "skipped_steps")}


def _findable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def factory_name(factory: Any) -> str:
    """``module:name`` (or ``file.py:name`` for a script's own function) of a model factory
    given to :func:`fit` as ``model=``: what every rank imports it by."""
    import sys

    name = getattr(factory, "__qualname__", "")
    module = getattr(factory, "__module__", None)
    if not name or "<" in name or module is None:
        raise ConfigError(
            "config key 'model': a factory function must be defined at the top level of a "
            "module or script (ranks import it by name)"
        )
    loaded = sys.modules.get(module)
    file = getattr(loaded, "__file__", None)
    importable = module != "__main__" and _findable(module)
    if not importable:
        if file is None:
            raise ConfigError(
                "config key 'model': a factory defined interactively cannot be imported by "
                "the ranks; put it in a file and give file.py:factory"
            )
        return f"{Path(file).resolve()}:{name}"
    return f"{module}:{name}"


def fit(
    task: str, graph: Any = None, *, nprocs: int = 1, max_restarts: int = 0, **options: Any
) -> dict[str, float]:
    """Train ``task`` (``"gcn"`` full-graph, ``"sage"`` mini-batch) on ``graph`` with the
    task's config keys as ``options``; return the final evaluation (``train_acc``,
    ``val_acc``, ``test_acc``...), the same dict on any number of processes.

    Args:
        task: a task of ``gnnpar train`` (``gcn``, ``sage``; ``gpt`` takes no graph).
        graph: a :class:`~gnnpar.graph.Graph`, a PyG ``Data`` or a DGL graph, saved to
            ``OUT/graph``; ``None`` trains on the ``dataset`` option instead.
        nprocs: local processes (``gnnpar train --nprocs``); more than 1 starts the ranks
            with the launcher of ``gnnpar train`` (not under torchrun: there, run the
            script on every rank with ``nprocs=1`` and ``dataset=`` a graph folder).
        max_restarts: with ``nprocs > 1``: restart all ranks this often after a failure.
        **options: config keys of the task (``epochs=3``, ``out="runs/x"``, ...);
            ``model=`` also takes your own PyG model's factory function (``gcn``:
            :func:`gnnpar.models.fullgraph.pyg.parallelize_pyg`), with its keyword
            arguments as ``model_options="k=v,k=v"``.

    Raises:
        ConfigError: one line naming the key, as ``gnnpar train`` says it, for an unknown
            key, a wrong type or a bad value; the checks before launch raise their one-line
            errors (a run folder that holds a run, a grid that does not fit...).
        RuntimeError: when the launched ranks fail (their error is printed above).
    """
    from gnnpar.graph.convert import as_graph
    from gnnpar.launch import under_launcher
    from gnnpar.train.loop import check_run_folder, preflight
    from gnnpar.train.progress import Progress
    from gnnpar.train.run import check_launch_flags, launch_ranks, train_here, world_size
    from gnnpar.train.spec import get, resolved

    spec = get(task)
    launch_args = argparse.Namespace(nprocs=nprocs, max_restarts=max_restarts)
    check_launch_flags(launch_args)
    launching = nprocs > 1 and not under_launcher()
    # a path is a str in the config (what a flag or a TOML file gives)
    values = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in options.items()}
    if callable(values.get("model")):
        values["model"] = factory_name(values["model"])
    if graph is not None:
        if "dataset" not in {f.name for f in dataclasses.fields(spec.config)}:
            raise ConfigError(f"task {task!r} trains on no graph: call it without graph=")
        if "dataset" in values:
            raise ConfigError("give graph= or the option dataset=, not both")
        if under_launcher():
            raise ConfigError(
                "fit(graph=...) under a launcher: save the graph once (gnnpar.data.save_graph) "
                "and pass dataset=FOLDER on every rank, or call fit(..., nprocs=N) from one "
                "process"
            )
        graph = as_graph(graph)
    cfg = from_mapping(spec.config, values)
    if graph is not None:
        cfg = dataclasses.replace(cfg, dataset=str(Path(cfg.out) / GRAPH_FOLDER))
    ranks = world_size(launch_args, launching)
    if graph is not None:
        check_run_folder(cfg)  # before writing into it
        _save_graph(graph, Path(cfg.dataset))
    spec = resolved(spec, cfg)
    preflight(spec, cfg, ranks)
    progress = Progress.for_this_process(quiet=cfg.quiet)
    if not launching:
        return train_here(spec, cfg, progress)
    code = launch_ranks(nprocs, ["train", task, *_flags(cfg)], max_restarts, progress, out=cfg.out)
    if code:
        raise RuntimeError(f"gnnpar train {task} on {nprocs} processes failed (exit code {code})")
    return _final_metrics(cfg.out)
