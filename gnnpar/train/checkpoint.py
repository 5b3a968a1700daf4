"""Checkpoints: one file per rank in a step folder, made visible atomically.

Layout::

    RUN/checkpoints/step-000120/rank-00000.pt ... rank-NNNNN.pt
    RUN/checkpoints/step-000120/meta.json     written last: the step, world size, grid

Every rank writes its file into ``.tmp-step-000120``; after a barrier rank 0 writes
``meta.json`` and renames the folder. A folder without ``meta.json`` (a crash mid-write) is
never loaded, so the previous checkpoint stays usable.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from gnnpar import comm
from gnnpar.grid import ProcessGrid


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def save_checkpoint(
    root: str | Path, step: int, grid: ProcessGrid, state: dict[str, Any], keep: int = 2
) -> Path:
    """Save this rank's ``state`` for ``step`` (collective); keep the newest ``keep``."""
    root = Path(root)
    final = _step_dir(root, step)
    tmp = root / f".tmp-{final.name}"
    if grid.global_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    comm.barrier(grid)
    part = tmp / f"rank-{grid.global_rank:05d}.pt"
    torch.save(state, part.with_suffix(".partial"))
    os.replace(part.with_suffix(".partial"), part)
    comm.barrier(grid)
    if grid.global_rank == 0:
        meta = {"step": step, "world_size": grid.world_size, "grid": grid.shape}
        (tmp / "meta.json").write_text(json.dumps(meta))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in sorted(complete_checkpoints(root))[:-keep] if keep > 0 else []:
            # meta.json first: a kill mid-delete must not leave a "complete" partial folder.
            (_step_dir(root, old) / "meta.json").unlink(missing_ok=True)
            shutil.rmtree(_step_dir(root, old), ignore_errors=True)
    comm.barrier(grid)
    return final


def complete_checkpoints(root: str | Path) -> list[int]:
    """Steps of every checkpoint folder that finished writing."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = []
    for d in root.glob("step-*"):
        if (d / "meta.json").is_file():
            try:
                steps.append(int(d.name.split("-", 1)[1]))
            except ValueError:
                continue
    return sorted(steps)


def load_checkpoint(
    root: str | Path, grid: ProcessGrid, step: int | None = None
) -> tuple[int, dict[str, Any]] | None:
    """This rank's state of the newest (or the given) complete checkpoint, or ``None``."""
    steps = complete_checkpoints(root)
    if not steps:
        return None
    step = steps[-1] if step is None else step
    folder = _step_dir(Path(root), step)
    meta = json.loads((folder / "meta.json").read_text())
    if meta["world_size"] != grid.world_size or meta["grid"] != grid.shape:
        raise ValueError(
            f"checkpoint {folder} was written by grid {meta['grid']} "
            f"({meta['world_size']} ranks); this run has {grid.shape}"
        )
    state = torch.load(folder / f"rank-{grid.global_rank:05d}.pt", weights_only=False)
    return step, state
