"""One training loop for every workload: steps, evaluation, progress, metrics, checkpoints.

A task (full-graph GCN, mini-batch SAGE, GPT) supplies the model-specific parts through the
small :class:`Task` protocol; the loop owns everything else, the same way for all of them.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm import tqdm

from gnnpar import checkpoint, comm
from gnnpar.grid import ProcessGrid
from gnnpar.launch import restart_count
from gnnpar.train.metrics import MetricsLog, peak_rss_mb


class Task(Protocol):
    """What a workload provides to :class:`Trainer`.

    ``model`` and ``optimizer`` are what :mod:`gnnpar.checkpoint` saves and reshards (a
    plain, tensor-parallel, sharded or full-graph parallel model); everything else a task
    needs to continue exactly (a loader's position) is JSON from :meth:`extra_state`.
    """

    grid: ProcessGrid
    num_steps: int
    unit: str  # "epoch" or "step": what one call of train_step covers
    model: Any
    optimizer: torch.optim.Optimizer

    def train_step(self, step: int) -> dict[str, float]:
        """Run one step; return metrics such as loss and throughput."""

    def evaluate(self, step: int) -> dict[str, float]:
        """Return evaluation metrics (e.g. val/test accuracy)."""

    def extra_state(self) -> dict[str, Any]:
        """JSON-ready state beyond the model and optimizer (e.g. the loader position)."""

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`extra_state`."""

    def describe(self) -> dict[str, Any]:
        """What the run trains (task, model kind and sizes), recorded in checkpoints."""


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
    ):
        self.task = task
        self.grid = task.grid
        self.out = Path(out)
        self.eval_every = eval_every
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        # Ranks brought back by torchrun --max-restarts, or a Slurm job requeued after a
        # preemption, continue their own run from its newest checkpoint (or from the start
        # when none was written yet).
        self.attempt = restart_count()
        self.resume = resume or self.attempt > 0
        #: The step at which a SIGTERM stopped :meth:`run` (after a checkpoint), else None.
        self.preempted_at: int | None = None
        self.quiet = quiet
        self.is_main = self.grid.global_rank == 0
        self._check_run_folder(overwrite)
        self.metrics = MetricsLog(
            self.out / "metrics.jsonl",
            enabled=self.is_main,
            tensorboard_dir=self.out / "tensorboard" if tensorboard else None,
        )

    @classmethod
    def from_config(cls, task: Task, cfg: Any) -> Trainer:
        """A trainer with the options of a task's config (a
        :class:`~gnnpar.train.config.TrainerConfig`)."""
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
        )

    def _check_run_folder(self, overwrite: bool) -> None:
        """A finished or interrupted run is never mixed with a new one silently. Rank 0
        decides for everyone: other ranks may look only after rank 0 has started writing."""
        old = [self.out / n for n in ("metrics.jsonl", "checkpoints", "plots", "tensorboard")]
        found = torch.tensor(
            [float(self.is_main and any(p.exists() for p in old))], device=self.grid.device
        )
        found = comm.all_reduce(found, self.grid, "world", op="max")
        if self.resume or not found.item():
            return
        if not overwrite:
            raise FileExistsError(
                f"run folder {self.out} already holds a run; pass --resume to continue it "
                "or --overwrite to start again"
            )
        if self.is_main:
            for p in old:
                if p.is_dir():
                    shutil.rmtree(p)
                elif p.exists():
                    p.unlink()
        comm.barrier(self.grid)

    def _save(self, step: int) -> None:
        task = self.task
        checkpoint.save(
            self.out / "checkpoints",
            step,
            self.grid,
            task.model,
            task.optimizer,
            extra={"task": task.extra_state()},
            local={"torch_rng": torch.get_rng_state()},
            info=task.describe(),
            keep=self.keep_checkpoints,
        )

    def _resume(self) -> int:
        """Load the newest usable checkpoint of the run (onto this run's grid, whatever grid
        wrote it); return the step to continue from (0 without one)."""
        found = checkpoint.load(
            self.out / "checkpoints", self.grid, self.task.model, self.task.optimizer
        )
        if found is None:
            return 0
        self.task.load_extra_state(found.extra.get("task", {}))
        # The RNG state is per rank, so it only means something on the grid that saved it;
        # gnnpar's own randomness (dropout, sampling) is counter-based and needs none.
        if "torch_rng" in found.local:
            torch.set_rng_state(found.local["torch_rng"])
        self.metrics.write(
            {
                "event": "resume",
                "step": found.step,
                "attempt": self.attempt,
                "from_grid": found.grid,
            }
        )
        return found.step

    def run(self) -> dict[str, float]:
        """Train to the end; return the final evaluation. A SIGTERM (Slurm's ``--signal``
        before the time limit, a preemption) ends the run early but cleanly: every rank
        finishes the step, a checkpoint is written, ``preempted_at`` is set, and the
        ``preempted`` event is the last record."""
        with _SigtermFlag() as self._sigterm:
            return self._run()

    def _preemption_agreed(self) -> bool:
        """Whether any rank has received SIGTERM, so that all stop after the same step."""
        flag = torch.tensor([float(self._sigterm.raised)], device=self.grid.device)
        return bool(comm.all_reduce(flag, self.grid, "world", op="max").item())

    def _run(self) -> dict[str, float]:
        start_step = self._resume() if self.resume else 0
        if start_step == 0:
            self.metrics.write({"event": "start", "grid": self.grid.shape, "attempt": self.attempt})
        total = self.task.num_steps
        bar = tqdm(
            total=total,
            initial=start_step,
            unit=self.task.unit,
            disable=not self.is_main or self.quiet,
            dynamic_ncols=True,
        )
        last_eval: dict[str, float] = {}
        for step in range(start_step, total):
            t0 = time.perf_counter()
            with comm.record(self.grid) as traffic:
                record = self.task.train_step(step)
            record["seconds"] = time.perf_counter() - t0
            record["bytes"] = traffic.as_dict()
            done = step + 1
            if self.eval_every and (done % self.eval_every == 0 or done == total):
                last_eval = self.task.evaluate(step)
                record.update(last_eval)
            record.update({self.task.unit: done, "peak_rss_mb": peak_rss_mb()})
            self.metrics.write(record)
            shown = {k: v for k, v in record.items() if k in _SHOWN and isinstance(v, float)}
            bar.set_postfix({k: f"{v:.4f}" for k, v in shown.items()})
            bar.update(1)
            if self.quiet and self.is_main and (done % max(1, total // 10) == 0):
                text = " ".join(f"{k}={v:.4f}" for k, v in shown.items())
                print(f"{self.task.unit} {done}/{total} {text}", flush=True)
            saved = self.checkpoint_every and done % self.checkpoint_every == 0
            if saved and done < total:
                self._save(done)
            if done < total and self._preemption_agreed():
                if not saved:
                    self._save(done)
                bar.close()
                self.preempted_at = done
                self.metrics.write({"event": "preempted", "step": done})
                self.metrics.close()
                return last_eval
        bar.close()
        if start_step < total:
            self._save(total)  # every run ends with its trained model on disk
        if not last_eval:
            last_eval = self.task.evaluate(total - 1)
        self.metrics.write({"event": "end", **last_eval})
        self.metrics.close()
        return last_eval


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
    "val_loss",
    "tokens_per_s",
    "seeds_per_s",
)
