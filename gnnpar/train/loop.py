"""One training loop for every workload: steps, evaluation, progress, metrics, checkpoints.

A task (full-graph GCN, mini-batch SAGE, GPT) supplies the model-specific parts through the
small :class:`Task` protocol; the loop owns everything else, the same way for all of them.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from gnnpar import checkpoint, comm
from gnnpar.atomic import check_writable
from gnnpar.checkpoint.snapshot import default_root
from gnnpar.errors import UserError
from gnnpar.failpoints import failpoint
from gnnpar.grid import ProcessGrid, fit_shape, parse_grid_spec
from gnnpar.launch import rank_and_world, restart_count
from gnnpar.train.config import RUN_CONFIG, ConfigError, write_run_config
from gnnpar.train.lock import LOCKED_ENV, check_free
from gnnpar.train.metrics import MetricsLog, peak_rss_mb
from gnnpar.train.progress import Progress, metric_text, start_lines
from gnnpar.train.recovery import RUN_ID, Snapshots
from gnnpar.train.selection import Selection
from gnnpar.train.spec import TrainSpec, specs


class BaseTask:
    """The base of every task: the defaults of the optional members of :class:`Task`, and
    an ``optimizer`` built by the task's ``_make_optimizer()`` on first use, so ``gnnpar
    evaluate`` and ``gnnpar predict``, which only load a model, never build one (torch's
    first optimizer imports ``torch._dynamo``: about a CPU-second)."""

    #: The evaluation metric that picks the best model, and whether higher or lower wins
    #: (:mod:`gnnpar.train.selection`); None: the task selects nothing.
    selection: tuple[str, str] | None = None
    #: Who chose the grid, a phrase for the start lines (e.g. "chosen by the planner").
    grid_choice: str | None = None
    #: The model's initial values were left to a restore (a resuming run's build skips
    #: making them); :meth:`initialise` makes them when nothing was there to load.
    values_deferred: bool = False

    def initialise(self) -> None:
        """Give the model the initial values of a fresh start, where they were left to a
        restore that found nothing to load (:attr:`values_deferred`); a no-op otherwise."""

    @functools.cached_property
    def optimizer(self) -> torch.optim.Optimizer:
        """The task's optimizer, built on first use."""
        return self._make_optimizer()

    def _make_optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError(f"{type(self).__name__} builds no optimizer")

    def summary(self) -> str:
        """What is trained on what data, with its sizes (the first start line)."""
        return type(self).__name__

    def finish(self) -> str | None:
        """What rank 0 prints after a finished run (a generated sample), or None."""
        return None

    def data_record(self) -> dict[str, Any] | None:
        """What the run trains on, the same on every rank: at least a ``fingerprint`` of
        the data's content (a graph's :meth:`~gnnpar.graph.Graph.fingerprint`, a token
        stream's digest) and its ``name``. Checkpoints record it and a resume compares it
        (:meth:`Trainer._check_data`); None: the task records nothing."""
        return None


class Task(Protocol):
    """What a workload provides to :class:`Trainer`; tasks derive from :class:`BaseTask`,
    which gives the optional members their defaults.

    ``model`` and ``optimizer`` are what :mod:`gnnpar.checkpoint` saves and reshards (a
    plain, tensor-parallel, sharded or full-graph parallel model); everything else a task
    needs to continue exactly (a loader's position) is JSON from :meth:`extra_state`.
    Node tasks (:attr:`gnnpar.train.spec.TrainSpec.node_task`) also have ``metric`` (the
    score's name) and ``predict() -> Tensor``, every node's class id in original node order
    on every rank (collective), for ``gnnpar predict``.
    """

    grid: ProcessGrid
    num_steps: int
    unit: str  # "epoch" or "step": what one call of train_step covers
    model: Any
    optimizer: torch.optim.Optimizer
    selection: tuple[str, str] | None
    grid_choice: str | None
    values_deferred: bool

    def train_step(self, step: int) -> dict[str, float]:
        """Run one step; return metrics such as loss and throughput."""

    def evaluate(self, step: int) -> dict[str, float]:
        """Return evaluation metrics (e.g. val/test accuracy)."""

    def extra_state(self) -> dict[str, Any]:
        """JSON-ready state beyond the model and optimizer (e.g. the loader position)."""

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`extra_state`."""

    def initialise(self) -> None:
        """Make the initial values left to a restore (see :attr:`BaseTask.values_deferred`)."""

    def describe(self) -> dict[str, Any]:
        """What the run trains (task, model kind and sizes), recorded in checkpoints."""

    def summary(self) -> str:
        """What is trained on what data, with its sizes (the first start line)."""

    def finish(self) -> str | None:
        """What rank 0 prints after a finished run, or None."""

    def data_record(self) -> dict[str, Any] | None:
        """What the run trains on (see :meth:`BaseTask.data_record`), or None."""


class NonFiniteLossError(RuntimeError):
    """A training step's loss was NaN or infinite (more often than ``skip_nonfinite``
    allows). Every rank raises it at the same step, so only one needs to report it."""

    same_on_every_rank = True


#: The markers of a run in a run folder: one of them present means the folder holds a run.
RUN_MARKERS = ("metrics.jsonl", "checkpoints", "plots", "tensorboard", RUN_CONFIG, RUN_ID)

#: Where a run keeps the checkpoint of its best-validation model, under ``checkpoints/``.
BEST = "best"


def checkpoint_dir(out: str | Path, which: str = "latest") -> Path:
    """The checkpoint directory of the run in ``out``: ``latest`` (the newest of its
    checkpoints) or ``best`` (its best-validation model)."""
    root = Path(out) / "checkpoints"
    return root / BEST if which == BEST else root


def run_folder_error(out: str | Path) -> FileExistsError:
    """The error for a run folder that already holds a run (neither resume nor overwrite):
    one line naming the folder and both ways out. Every rank that checks finds the same
    folder, so only one reports it."""
    err = FileExistsError(
        f"run folder {out} already holds a run: pass --resume to continue it, or "
        "--overwrite to start again (or another --out)"
    )
    err.same_on_every_rank = True
    return err


# ------------------------------------------------------------------ checks before launch
def preflight(spec: TrainSpec, cfg: Any, world_size: int) -> None:
    """Check, in the process that launches the ranks and before any starts, everything that
    needs no process group; each failure is one line (ConfigError, GridError, ValueError,
    OSError): the run folder (:func:`check_run_folder`), the grid or partition against the
    process count (:func:`check_world`), the dataset's name and options
    (:func:`check_dataset_options`), then the spec's own
    :attr:`~gnnpar.train.spec.TrainSpec.preflight` (e.g. the dataset can be loaded, a given
    partition or shard folder was made from it)."""
    check_run_folder(cfg)
    check_world(spec, cfg, world_size)
    check_dataset_options(cfg)
    if spec.preflight is not None:
        spec.preflight(cfg, world_size)


def check_run_folder(cfg: Any) -> None:
    """The run folder ``cfg.out`` may be used: it does not hold a run unless ``resume`` or
    ``overwrite`` says what to do with it (a restart attempt resumes), and a file can be
    written in it (or where it will be made), and in ``snapshot_dir`` when it snapshots."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"run folder {out} is a file, not a folder")
    # the process that will hold the lock looks (not a rank whose launcher or rank 0 does)
    if os.environ.get(LOCKED_ENV) != "1" and rank_and_world()[0] == 0:
        check_free(out)
    resume = resumes(cfg)
    holds_run = any((out / name).exists() for name in RUN_MARKERS)
    if holds_run and not resume and not getattr(cfg, "overwrite", False):
        raise run_folder_error(out)
    check_writable(out)
    if getattr(cfg, "snapshot_every", 0):  # where the snapshots go, before any rank starts
        check_writable(cfg.snapshot_dir or default_root())


def rank_state(model: Any) -> dict[str, torch.Tensor]:
    """What this rank alone holds, which only the grid that saved it can use again (a
    checkpoint's or snapshot's ``local`` tensors): its generator's state, and the model's own
    (``rank_state()``: a :class:`~gnnpar.shard.ShardedModel`'s PowerSGD compression)."""
    own = getattr(model, "rank_state", None)
    return {"torch_rng": torch.get_rng_state(), **(own() if own is not None else {})}


def load_rank_state(model: Any, local: dict[str, torch.Tensor]) -> None:
    """Continue from :func:`rank_state`'s tensors of this rank (none where the grid that saved
    them is not this one): the generator's state, and the model's own."""
    if "torch_rng" in local:
        torch.set_rng_state(local["torch_rng"])
    own = getattr(model, "load_rank_state", None)
    if own is not None and local:
        own(local)


def resumes(cfg: Any) -> bool:
    """Whether a run of ``cfg`` continues the run in its folder: ``--resume``, or an attempt
    that torchrun's ``--max-restarts`` or a Slurm requeue started again."""
    return getattr(cfg, "resume", False) or restart_count() > 0


def check_world(spec: TrainSpec, cfg: Any, world_size: int) -> None:
    """A ``grid`` option must fit ``world_size`` processes and name only axes the task
    (``spec``) has (a pipe, context or expert axis: the gpt task), and ``parts`` must be one part
    per process."""
    grid = getattr(cfg, "grid", None)
    if grid:
        shape = fit_shape(world_size, parse_grid_spec(grid))
        for axis in ("pipe", "context", "expert"):
            if shape[axis] > 1 and axis not in spec.axes:
                having = [s.name for s in specs().values() if axis in s.axes and s.listed]
                raise ConfigError(
                    f"config key 'grid' ({grid}): a {axis} axis needs the "
                    f"{' or '.join(having)} task"
                )
    parts = getattr(cfg, "parts", None)
    if parts is not None and parts != world_size:
        raise ConfigError(
            f"config key 'parts' is {parts} but {world_size} processes run: each data-parallel "
            "rank owns one part (use --nprocs equal to --parts)"
        )


def check_dataset_options(cfg: Any) -> None:
    """``dataset`` names a catalogue entry or a folder and ``dataset_options`` parses as that
    dataset's options (known keys, values of the defaults' types)."""
    if not hasattr(cfg, "dataset"):
        return
    from gnnpar.data.options import check_dataset

    pairs = dataset_option_pairs(cfg)
    try:
        check_dataset(cfg.dataset, pairs)
    except UserError as err:
        key = "dataset_options" if pairs else "dataset"
        raise ConfigError(f"config key '{key}': {err}") from None


def dataset_option_pairs(cfg: Any) -> list[str]:
    """A task's ``dataset_options`` (``"k=v,k=v"``) as its ``k=v`` items."""
    from gnnpar.data.options import split_options

    return split_options(getattr(cfg, "dataset_options", None))


def dataset_options(cfg: Any) -> dict[str, Any]:
    """A task's ``dataset_options`` as keyword arguments, typed by the dataset's defaults
    (:func:`gnnpar.data.options.check_dataset`, the structure options included)."""
    from gnnpar.data.options import check_dataset

    return check_dataset(cfg.dataset, dataset_option_pairs(cfg))


def load_trainable(cfg: Any) -> Any:
    """:func:`load_dataset`, refused in one line naming the dataset when it cannot be
    trained on (:meth:`~gnnpar.graph.Graph.check_trainable`)."""
    graph = load_dataset(cfg)
    try:
        graph.check_trainable()
    except UserError as err:
        raise ConfigError(f"dataset {cfg.dataset!r}: {err}") from None
    return graph


def check_stored_dataset(cfg: Any, folder: str | Path) -> None:
    """The checks before launch of :func:`load_trainable` and ``load_dataset(cfg,
    warn_directed=True)`` for a dataset stored as the graph folder ``folder``, without
    loading it (for ranks that read only what was derived from it, such as a partition):
    the checks :meth:`~gnnpar.graph.Graph.validate` makes, streamed
    (:meth:`~gnnpar.data.chunked.GraphReader.validate`), its training node data,
    memory-mapped, and whether it is directed, read in pieces. ConfigError naming the
    dataset as :func:`load_trainable`'s."""
    from gnnpar.data.chunked import GraphReader
    from gnnpar.data.storage import load_node_data, read_meta
    from gnnpar.data.structure import directed_folder_warning, split_structure
    from gnnpar.graph import check_trainable_data

    try:
        GraphReader(folder, verify="size").validate()
        meta = read_meta(folder)
        needed = ("feat", "label", "train_mask", "val_mask", "test_mask")
        keys = [k for k in needed if f"ndata/{k}" in meta["arrays"]]
        check_trainable_data(meta["name"], load_node_data(folder, keys, "size"))
    except UserError as err:
        raise ConfigError(f"dataset {cfg.dataset!r}: {err}") from None
    if rank_and_world()[0] == 0:
        message = directed_folder_warning(folder, split_structure(dataset_options(cfg))[1])
        if message:
            print(f"gnnpar train: warning: {message}", file=sys.stderr, flush=True)


def load_dataset(cfg: Any, warn_directed: bool = False) -> Any:
    """The graph a task's ``dataset``, ``root`` and ``dataset_options`` name (a catalogue
    entry prepared under ``root``, or a graph folder), with the structure options
    (``to_undirected``, ``self_loops``: :mod:`gnnpar.data.structure`) applied: every task
    loads its graph here. ``warn_directed``: rank 0 prints one line on stderr when the graph
    is directed and ``to_undirected`` was not given (the tasks' preflight asks, so that a
    run says it once, before any rank starts)."""
    from gnnpar.data import load
    from gnnpar.data.structure import directed_warning, split_structure

    options = dataset_options(cfg)
    graph = load(cfg.dataset, root=cfg.root, **options)
    if warn_directed and rank_and_world()[0] == 0:
        message = directed_warning(graph, split_structure(options)[1])
        if message:
            print(f"gnnpar train: warning: {message}", file=sys.stderr, flush=True)
    return graph


class _Undo:
    """Copies of a task's parameters, buffers and optimizer state, to undo one step."""

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self.tensors = _state_tensors(model, optimizer)
        self.copies = [t.detach().clone() for t in self.tensors]
        self.state = {
            p: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
            for p, st in optimizer.state.items()
        }

    def restore(self) -> None:
        """Put every copied tensor back (in place) and the optimizer state as it was; a
        sharded model then gathers its parameters from the restored masters."""
        with torch.no_grad():
            for t, c in zip(self.tensors, self.copies, strict=True):
                t.copy_(c)
        self.optimizer.state.clear()
        for p, st in self.state.items():
            self.optimizer.state[p] = {
                k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()
            }
        sync = getattr(self.model, "sync_params", None)
        if callable(sync):
            sync(force=True)


def _state_tensors(model: Any, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The model's parameters and buffers and the optimizer's parameters, each once."""
    found: dict[int, torch.Tensor] = {}
    for name in ("parameters", "buffers"):
        getter = getattr(model, name, None)
        if callable(getter):
            found.update((id(t), t) for t in getter())
    for group in optimizer.param_groups:
        found.update((id(p), p) for p in group["params"])
    return list(found.values())


def _data_text(record: dict[str, Any]) -> str:
    """A data record as an error names it: its name and fingerprint."""
    return f"{record.get('name', '?')} (fingerprint {record.get('fingerprint', '?')})"


class Trainer:
    """Runs a :class:`Task`: progress bar on rank 0, JSONL metrics with bytes per axis and
    peak memory, a checkpoint every ``checkpoint_every`` steps and always one at the end
    (the newest ``keep_checkpoints`` are kept), and ``resume`` from the newest usable
    checkpoint, on any grid."""

    def __init__(
        self,
        task: Task,
        out: str | Path,
        eval_every: int = 10,
        checkpoint_every: int = 0,
        resume: bool = False,
        quiet: bool = False,
        overwrite: bool = False,
        tensorboard: bool = False,
        keep_checkpoints: int = 2,
        skip_nonfinite: int = 0,
        progress: Progress | None = None,
        early_stop: int = 0,
        config: tuple[str, Any] | None = None,
        baseline_rss_mb: float | None = None,
        other_data: bool = False,
        snapshot_every: int = 0,
        snapshot_dir: str | None = None,
    ):
        """``progress``: the run's console (the one its task printed its preparation on);
        by default one of its own. It prints on rank 0 only, whatever it is given.
        ``early_stop``: evaluations without a better selection metric before the run stops
        (0: never; for tasks with a ``selection``). ``config``: (task name, config) written
        to the run folder's ``config.toml`` at the start (what evaluate and predict read).
        ``baseline_rss_mb``: this process's resident memory before the task was built (its
        idle baseline), reported beside each rank's peak at the end (:meth:`rank_memory`).
        ``other_data``: a resume may continue a checkpoint of other data (recorded).
        ``snapshot_every``: also keep the state of every N steps in node-local shared memory
        under ``snapshot_dir`` (:mod:`gnnpar.train.recovery`), where a restart resumes from
        when it is at least as fresh as the newest checkpoint (0: no snapshots)."""
        self.task = task
        self.other_data = other_data
        #: The data a resume moved the run onto, for the ``resume`` event (None: the same).
        self._data_change: dict[str, Any] | None = None
        self.baseline_rss_mb = baseline_rss_mb
        #: Every rank's peak and baseline resident memory, set at the end of :meth:`run`.
        self.memory: dict[str, list[float]] | None = None
        self.grid = task.grid
        self.out = Path(out)
        self.eval_every = eval_every
        self.checkpoint_every = checkpoint_every
        self.snapshot_every = snapshot_every
        self.snapshot_dir = snapshot_dir
        #: The run's in-memory snapshots (made in :meth:`run`; None without them).
        self.snapshots: Snapshots | None = None
        #: Where :meth:`_resume` loaded the run from: disk, memory or peer.
        self._resumed_from = "disk"
        self.keep_checkpoints = keep_checkpoints
        #: Steps with a non-finite loss that may be undone before the run stops with an error.
        self.skip_nonfinite = skip_nonfinite
        #: Steps undone so far because their loss was not finite.
        self.skipped_steps = 0
        selection = task.selection
        #: The best evaluation so far and early stopping (None: the task selects nothing).
        self.selection = (
            Selection(selection[0], selection[1], early_stop) if selection is not None else None
        )
        self.config = config
        # Ranks brought back by torchrun --max-restarts, or a Slurm job requeued after a
        # preemption, continue their own run from its newest checkpoint (or from the start
        # when none was written yet).
        self.attempt = restart_count()
        self.resume = resume or self.attempt > 0
        #: The step at which a SIGTERM stopped :meth:`run` (after a checkpoint), else None.
        self.preempted_at: int | None = None
        self.quiet = quiet
        self.is_main = self.grid.global_rank == 0
        if progress is None or not self.is_main:
            progress = Progress(enabled=self.is_main, quiet=quiet)
        self.progress = progress
        self._check_run_folder(overwrite)
        self.metrics = MetricsLog(
            self.out / "metrics.jsonl",
            enabled=self.is_main,
            tensorboard_dir=self.out / "tensorboard" if tensorboard else None,
        )

    @classmethod
    def from_config(
        cls,
        task: Task,
        cfg: Any,
        progress: Progress | None = None,
        baseline_rss_mb: float | None = None,
    ) -> Trainer:
        """A trainer with the options of a task's config (a
        :class:`~gnnpar.train.config.TrainerConfig`), printing on ``progress``."""
        return cls(
            task,
            cfg.out,
            eval_every=cfg.eval_every,
            checkpoint_every=cfg.checkpoint_every,
            resume=cfg.resume,
            quiet=cfg.quiet,
            overwrite=cfg.overwrite,
            tensorboard=cfg.tensorboard,
            keep_checkpoints=cfg.keep_checkpoints,
            skip_nonfinite=getattr(cfg, "skip_nonfinite", 0),
            progress=progress,
            early_stop=getattr(cfg, "early_stop", 0),
            config=(task.describe()["task"], cfg),
            baseline_rss_mb=baseline_rss_mb,
            other_data=getattr(cfg, "other_data", False),
            snapshot_every=getattr(cfg, "snapshot_every", 0),
            snapshot_dir=getattr(cfg, "snapshot_dir", None),
        )

    def _check_run_folder(self, overwrite: bool) -> None:
        """A finished or interrupted run is never mixed with a new one silently. Rank 0
        decides for everyone: other ranks may look only after rank 0 has started writing."""
        old = [self.out / n for n in RUN_MARKERS]
        found = torch.tensor(
            [float(self.is_main and any(p.exists() for p in old))], device=self.grid.device
        )
        found = comm.all_reduce(found, self.grid, "world", op="max")
        if self.resume or not found.item():
            return
        if not overwrite:
            raise run_folder_error(self.out)
        if self.is_main:
            for p in old:
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
        comm.barrier(self.grid)

    def _extra(self) -> dict[str, Any]:
        """The JSON state of a checkpoint: the task's, and the trainer's selection."""
        extra: dict[str, Any] = {"task": self.task.extra_state()}
        data = self.task.data_record()
        if data is not None:
            extra["data"] = data
        if self.selection is not None:
            extra["selection"] = self.selection.state()
        return extra

    def _save(self, step: int) -> None:
        if self.snapshots is not None:  # one write at a time; and the snapshot is complete
            self.snapshots.writer.wait()
        task = self.task
        checkpoint.save(
            checkpoint_dir(self.out),
            step,
            self.grid,
            task.model,
            task.optimizer,
            extra=self._extra(),
            local=rank_state(task.model),
            info=task.describe(),
            keep=self.keep_checkpoints,
        )

    def _save_best(self, step: int) -> None:
        """The model of ``step``, the best so far, as the run's one ``best`` checkpoint
        (no optimizer state: it is for evaluation and prediction)."""
        checkpoint.save(
            checkpoint_dir(self.out, BEST),
            step,
            self.grid,
            self.task.model,
            None,
            extra=self._extra(),
            info=self.task.describe(),
            keep=1,
        )

    def _select(self, evaluation: dict[str, float], done: int) -> None:
        """Compare an evaluation with the best so far; save the model when it is better."""
        if self.selection is not None and self.selection.update(evaluation, done):
            self._save_best(done)

    def _resume(self) -> int:
        """Load the newest usable snapshot or checkpoint of the run, whichever is fresher (a
        checkpoint onto this run's grid, whatever grid wrote it); return the step to continue
        from (0 without one)."""
        found: Any = None
        if self.snapshots is not None:
            found = self.snapshots.restore(self.out / "checkpoints", self.task)
        source = found.source if found is not None else "disk"
        self._resumed_from = source
        if found is None:
            found = checkpoint.load(
                self.out / "checkpoints", self.grid, self.task.model, self.task.optimizer
            )
        if found is None:
            if getattr(self.task, "values_deferred", False):  # a task of its own may lack it
                self.task.initialise()  # every rank: none found one (the loads agree)
            return 0
        unit, total = self.task.unit, self.task.num_steps
        if found.step > total:  # it would train nothing and report the old run as this one
            err = ConfigError(
                f"{found.folder}: the checkpoint is at {unit} {found.step}, past this run's "
                f"{total} {unit}s: pass --{unit}s {found.step} or more to continue it, or "
                "--overwrite to start again"
            )
            err.same_on_every_rank = True
            raise err
        self._check_data(found)
        self.task.load_extra_state(found.extra.get("task", {}))
        if self.selection is not None:
            self.selection.load(found.extra.get("selection", {}))
        # The RNG state is per rank, so it only means something on the grid that saved it;
        # gnnpar's own randomness (dropout, sampling) is counter-based and needs none.
        load_rank_state(self.task.model, found.local)
        # the killed attempt's records past the checkpoint are redone: not kept twice
        dropped = self.metrics.drop_after(self.task.unit, found.step)
        self.metrics.write(
            {
                "event": "resume",
                "step": found.step,
                "attempt": self.attempt,
                "from_grid": found.grid,
                "source": source,
                "dropped_records": dropped,
                **({"data_changed": self._data_change} if self._data_change else {}),
            }
        )
        return found.step

    def _check_data(self, found: Any) -> None:
        """A checkpoint of other data is refused (the run would report the old data's
        metrics as its own) unless ``other_data`` was given; then the change is recorded
        in the ``resume`` event. Every rank compares the same records."""
        saved, now = found.extra.get("data"), self.task.data_record()
        if saved is None or now is None:
            return
        if saved.get("fingerprint") == now.get("fingerprint"):
            return
        if self.other_data:
            self._data_change = {"from": saved, "to": now}
            return
        err = ConfigError(
            f"{found.folder}: the checkpoint was trained on {_data_text(saved)}, this run "
            f"trains on {_data_text(now)}: pass --other-data to continue on it (recorded in "
            "metrics.jsonl), or --overwrite to start again"
        )
        err.same_on_every_rank = True
        raise err

    def run(self) -> dict[str, float]:
        """Train to the end; return the final evaluation. A SIGTERM (Slurm's ``--signal``
        before the time limit, a preemption) ends the run early but cleanly: every rank
        finishes the step, a checkpoint is written, ``preempted_at`` is set, and the
        ``preempted`` event is the last record."""
        with _SigtermFlag() as self._sigterm:
            return self._run()

    def _agree(self, bad_loss: bool) -> tuple[bool, bool]:
        """Whether any rank saw a non-finite loss and whether any has received SIGTERM, so
        that every rank takes the same decision after the same step (one collective)."""
        flags = torch.tensor(
            [float(bad_loss), float(self._sigterm.raised)], device=self.grid.device
        )
        flags = comm.all_reduce(flags, self.grid, "world", op="max")
        return bool(flags[0].item()), bool(flags[1].item())

    def _undo_point(self) -> _Undo | None:
        """A copy of the state to undo the next step, when bad steps may be skipped."""
        if self.skipped_steps >= self.skip_nonfinite:
            return None
        return _Undo(self.task.model, self.task.optimizer)

    def _skip_or_stop(self, snapshot: _Undo | None, loss: Any, done: int) -> None:
        """Undo the step that gave a non-finite loss (counted), or raise
        :class:`NonFiniteLossError` when no more may be skipped."""
        if snapshot is None:
            where = f"loss is {loss} at {self.task.unit} {done} of {self.task.num_steps}"
            if self.skip_nonfinite:
                where += (
                    f", after {self.skipped_steps} skipped steps (--skip-nonfinite "
                    f"{self.skip_nonfinite})"
                )
                hint = ""
            else:
                hint = ", or pass --skip-nonfinite N to skip up to N such steps"
            raise NonFiniteLossError(f"{where}: lower the learning rate or check the data{hint}")
        snapshot.restore()
        self.skipped_steps += 1

    def _announce(self, start_step: int, source: str = "disk") -> None:
        """Rank 0's start lines, and where a resumed run continues from."""
        for text in start_lines(self.task, self.out):
            self.progress.line(text)
        if start_step:
            unit, total = self.task.unit, self.task.num_steps
            what = {"disk": "the checkpoint", "memory": "the snapshot in memory"}.get(
                source, "the snapshot held by the next node"
            )
            self.progress.line(f"resumed from {what} of {unit} {start_step} (of {total})")

    def _run(self) -> dict[str, float]:
        self.task.optimizer  # noqa: B018 -- built before the first step, not inside its time
        if self.snapshot_every:
            self.snapshots = Snapshots(
                self.out, self.grid, self.snapshot_every, self.snapshot_dir, self.resume
            )
        finished = False
        try:
            result = self._train()
            finished = self.preempted_at is None
        finally:
            if self.snapshots is not None:
                self.snapshots.close(finished)
        return result

    def _train(self) -> dict[str, float]:
        start_step = self._resume() if self.resume else 0
        if self.config is not None and self.is_main:
            write_run_config(self.out, *self.config)
        if start_step == 0:
            self.metrics.write({"event": "start", "grid": self.grid.shape, "attempt": self.attempt})
        self._announce(start_step, self._resumed_from)
        total = self.task.num_steps
        last_eval: dict[str, float] = {}
        # a run that early stopping ended stays ended when resumed
        end_step = start_step if self.selection and self.selection.stopped else total
        saved_at = start_step
        # closed on the way out of an interrupt too (not by its finaliser at exit, where a
        # second signal, such as the one the launch agent forwards, prints a traceback)
        with self.progress.bar(total, initial=start_step, unit=self.task.unit) as bar:
            for step in range(start_step, end_step):
                t0 = time.perf_counter()
                snapshot = self._undo_point()
                with comm.record(self.grid) as traffic:
                    record = self.task.train_step(step)
                record["seconds"] = time.perf_counter() - t0
                record["bytes"] = traffic.as_dict()
                done = step + 1
                loss = record.get("loss", 0.0)
                bad, preempted = self._agree(not _finite(loss))
                if bad:
                    self._skip_or_stop(snapshot, loss, done)
                    record["skipped"] = True  # undone: the weights are those before the step
                if self.skip_nonfinite:
                    record["skipped_steps"] = self.skipped_steps
                if self.eval_every and (done % self.eval_every == 0 or done == total):
                    last_eval = self.task.evaluate(step)
                    record.update(last_eval)
                    self._select(last_eval, done)
                    if self.selection is not None and self.selection.best_step is not None:
                        record["best_step"] = self.selection.best_step
                lose = self.snapshots.lose_node if self.snapshots is not None else None
                failpoint("step", done, self.grid.global_rank, lose)  # a chaos run's failure
                if self.snapshots is not None and self.snapshots.due(done, total):
                    record.update(
                        self.snapshots.take(
                            done, self.task, self._extra(), rank_state(self.task.model)
                        )
                    )
                record.update({self.task.unit: done, "peak_rss_mb": peak_rss_mb()})
                self.metrics.write(record)
                failpoint("logged", done, self.grid.global_rank, lose)
                shown = {k: v for k, v in record.items() if k in _SHOWN and isinstance(v, float)}
                bar.set_postfix({k: metric_text(k, v) for k, v in shown.items()})
                bar.update(1)
                self.progress.log_step(self.task.unit, done, total, shown)
                saved = self.checkpoint_every and done % self.checkpoint_every == 0
                if saved and done < total:
                    self._save(done)
                    saved_at = done
                if self.selection is not None and self.selection.stopped and done < total:
                    self.metrics.write(
                        {"event": "early_stop", "step": done, "best_step": self.selection.best_step}
                    )
                    self.progress.line(
                        f"early stop after {self.task.unit} {done}: no better "
                        f"{self.selection.metric} in {self.selection.patience} evaluations since "
                        f"{self.task.unit} {self.selection.best_step}"
                    )
                    end_step = done
                    break
                if done < total and preempted:
                    if not saved:
                        self._save(done)
                    self.preempted_at = done
                    self.metrics.write({"event": "preempted", "step": done})
                    self.metrics.close()
                    return last_eval
        if saved_at < end_step:
            self._save(end_step)  # every run ends with its trained model on disk
        result = self._final(last_eval, end_step)
        self.memory = self.rank_memory()
        self.metrics.write({"event": "memory", **self.memory})
        end = {"skipped_steps": self.skipped_steps} if self.skip_nonfinite else {}
        self.metrics.write({"event": "end", **result, **end})
        self.metrics.close()
        return result

    def rank_memory(self) -> dict[str, list[float]]:
        """Every rank's peak resident memory and idle baseline in MiB, in rank order (one
        small all-gather; a baseline nobody measured is NaN)."""
        baseline = self.baseline_rss_mb
        mine = torch.tensor(
            [peak_rss_mb(), math.nan if baseline is None else baseline],
            dtype=torch.float64,
            device=self.grid.device,
        )
        every = comm.all_gather(mine, self.grid, "world").reshape(-1, 2).cpu()
        return {"peak_rss_mb": every[:, 0].tolist(), "baseline_rss_mb": every[:, 1].tolist()}

    def _final(self, last_eval: dict[str, float], end_step: int) -> dict[str, float]:
        """The run's final evaluation: the best model's when the task selects one (with
        ``best_step``), else the last model's (evaluated now when the loop did not)."""
        best = self.selection is not None and self.selection.best_step is not None
        if not last_eval and not best:
            last_eval = self.task.evaluate(end_step - 1)
            self._select(last_eval, end_step)
        if self.selection is None or self.selection.best_step is None:
            return last_eval
        return {**self.selection.best, "best_step": self.selection.best_step}


def _finite(value: Any) -> bool:
    """Whether a reported loss is a finite number (anything else counts as finite)."""
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return True


class _SigtermFlag:
    """While entered, SIGTERM only raises a flag that the loop reads between steps (in the
    main thread only, where Python delivers signals); the previous handler comes back on
    exit."""

    def __init__(self) -> None:
        self.raised = False
        self._previous: Any = None
        self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        self.raised = True

    def __enter__(self) -> _SigtermFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            # None: the previous handler was not set from Python; the default is the best guess.
            previous = signal.SIG_DFL if self._previous is None else self._previous
            signal.signal(signal.SIGTERM, previous)


_SHOWN = (
    "loss",
    "train_acc",
    "val_acc",
    "test_acc",
    "val_rocauc",
    "test_rocauc",
    "val_loss",
    "tokens_per_s",
    "seeds_per_s",
)
