"""The trainer's in-memory snapshots: the run's identity, when to take one, and where a restart
resumes from (the fresher of the newest snapshot and the newest disk checkpoint).

A run that snapshots has an identity, ``OUT/run-id`` (14 hex digits, made at a fresh start,
kept by restarts and resumes, replaced by ``--overwrite``): its snapshots live under
``<snapshot_dir>/<run id>/`` and each record names it, so another run's snapshots — an
earlier run of the same folder, another folder's — are never restored
(:mod:`gnnpar.checkpoint.snapshot`).
"""

from __future__ import annotations

import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from gnnpar import checkpoint, comm
from gnnpar.atomic import atomic_write
from gnnpar.checkpoint.snapshot import Restored, SnapshotWriter, default_root, restore
from gnnpar.grid import ProcessGrid

__all__ = ["RUN_ID", "Snapshots"]

#: The run folder's file naming the run (its snapshots' folder and records).
RUN_ID = "run-id"
_DIGITS = 14  # 56 bits: one int64 broadcast carries it


def _run_id(out: Path, grid: ProcessGrid, keep: bool) -> str:
    """Rank 0's run id, made (or, when ``keep`` and one exists, read) and given to every rank."""
    value = 0
    if grid.global_rank == 0:
        path = out / RUN_ID
        text = path.read_text().strip() if keep and path.is_file() else ""
        if len(text) != _DIGITS or any(c not in "0123456789abcdef" for c in text):
            text = secrets.token_hex(_DIGITS // 2)
            atomic_write(path, lambda tmp: Path(tmp).write_text(text + "\n"))
        value = int(text, 16)
    t = torch.tensor([value], dtype=torch.int64, device=grid.device)
    comm.broadcast(t, grid, "world")
    return f"{int(t.item()):0{_DIGITS}x}"


class Snapshots:
    """A trainer's snapshots every ``every`` steps under ``root`` (default
    :func:`~gnnpar.checkpoint.snapshot.default_root`); made on every rank together."""

    def __init__(
        self, out: Path, grid: ProcessGrid, every: int, root: str | None, resume: bool
    ) -> None:
        self.every = every
        self.grid = grid
        self.root = Path(root) if root else default_root()
        self.run_id = _run_id(out, grid, keep=resume)
        self.writer = SnapshotWriter(self.root, self.run_id, grid)

    def due(self, done: int, total: int) -> bool:
        """Whether the state after step ``done`` is snapshotted (not the last step's: the
        run's final checkpoint is written then)."""
        return done % self.every == 0 and done < total

    def take(
        self, done: int, task: Any, extra: dict[str, Any], local: dict[str, torch.Tensor]
    ) -> dict[str, float]:
        """Snapshot the state after step ``done`` (collective): once it returns, every rank's
        snapshot is in its node's memory, so the step, logged next, survives any killed
        process. The seconds the loop was held (waiting for the previous copy to the peer,
        writing this rank's file, waiting for the other ranks' to be written) and the
        previous background copy's. ``local``: this rank's own tensors
        (:func:`~gnnpar.train.loop.rank_state`)."""
        t0 = time.perf_counter()
        self.writer.take(done, task.model, task.optimizer, extra, local)
        comm.barrier(self.grid)  # the ranks meet at the next step's first collective anyway
        w = self.writer
        return {
            "snapshot_s": time.perf_counter() - t0,
            "snapshot_copy_s": w.last_copy_s,
            "snapshot_write_s": w.last_write_s,
        }

    def restore(self, checkpoints: Path, task: Any) -> Restored | None:
        """Load the newest snapshot if it is at least as fresh as the newest disk checkpoint
        under ``checkpoints`` (collective); None: load from disk (or start)."""
        disk = max(checkpoint.complete_steps(checkpoints), default=-1)
        return restore(
            self.root, self.run_id, self.grid, task.model, task.optimizer, newer_than=disk - 1
        )

    def lose_node(self) -> None:
        """Delete this node's snapshot folder: what a lost node takes with it (a chaos run's
        ``lose-node`` failpoint)."""
        shutil.rmtree(self.writer.place.node_dir, ignore_errors=True)

    def close(self, finished: bool) -> None:
        """Finish the pending write; a ``finished`` run's snapshots are deleted (they are
        memory): once every rank is done, each node's first rank removes its node's folder,
        other grids' files included (collective when ``finished``)."""
        self.writer.close(wait=finished)  # a failed run does not wait for its peers
        if not finished:
            return
        comm.barrier(self.grid)
        if self.grid.global_rank % self.grid.ranks_per_node == 0:
            node_dir = self.writer.place.node_dir
            shutil.rmtree(node_dir, ignore_errors=True)
            try:
                node_dir.parent.rmdir()
            except OSError:
                pass  # another node's folder is still there (on this host)
