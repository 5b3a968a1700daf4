"""Sharded checkpoints of a tensor-parallel model and its optimizer, and their consolidation
into one full state dict.

A checkpoint is a folder per step::

    <dir>/step-000100/
        rank-00000.pt     torch.save({"model": this rank's state_dict (its pieces),
                                      "optimizer": its optimizer state_dict,
                                      "coords": {"x": .., "y": .., "z": .., "data": 0}})
        rank-00001.pt     ... one file per rank of data index 0 (data replicas hold the same)
        meta.json         {"step": 100, "grid": {"data": D, "x": X, "y": Y, "z": Z},
                           "files": {"<global rank>": "rank-00001.pt", ...},
                           "sharded": {"<state-dict key>": {"layout": ShardLayout.to_dict(),
                                                            "full_format": "out_in" | "in_out"}},
                           "extra": {...}}
    <dir>/latest          the name of the newest complete step folder

Each file is written under a temporary name and renamed; ``meta.json`` is written last,
after every rank has finished, and ``latest`` after it, so a folder without ``meta.json`` is
an interrupted save and is never picked up. :func:`consolidate` rebuilds the full (plain
model) state dict from the files alone, without a process group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gnnpar import comm
from gnnpar.atomic import atomic_write, latest_checkpoint, mark_latest, read_meta, write_json
from gnnpar.grid import ProcessGrid
from gnnpar.tensor.layers import Linear
from gnnpar.tensor.layout import ShardLayout
from gnnpar.tensor.state import sharded_parameters

__all__ = ["consolidate", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def save_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    grid: ProcessGrid,
    step: int,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` under ``directory`` (collective); return its folder."""
    folder = Path(directory) / f"step-{step:06d}"
    if grid.global_rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    comm.barrier(grid)
    coords = grid.coords()
    if coords["data"] == 0:
        blob = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "coords": coords,
        }
        atomic_write(folder / _rank_file(grid.global_rank), lambda tmp: torch.save(blob, tmp))
    comm.barrier(grid)
    if grid.global_rank == 0:
        files = {
            str(r): _rank_file(r) for r in range(grid.world_size) if grid.coords(r)["data"] == 0
        }
        sharded = {}
        for key, (module, _, layout) in sharded_parameters(model).items():
            fmt = module.weight_format if isinstance(module, Linear) else "out_in"
            sharded[key] = {
                "layout": layout.to_dict(),
                "full_format": fmt if key.endswith("weight") else "out_in",
            }
        meta = {
            "step": step,
            "grid": {"data": grid.data, "x": grid.x, "y": grid.y, "z": grid.z},
            "files": files,
            "sharded": sharded,
            "extra": dict(extra or {}),
        }
        write_json(folder / "meta.json", meta, indent=1)
        mark_latest(directory, folder)
    comm.barrier(grid)
    return folder


def load_checkpoint(
    folder: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    grid: ProcessGrid,
) -> dict[str, Any]:
    """Load this rank's pieces of a checkpoint saved on a grid with the same x, y and z (the
    data axis may differ); return its meta (``step``, ``extra``). For another grid shape,
    :func:`consolidate` it and load with :func:`gnnpar.tensor.load_full_state_dict`."""
    folder = Path(folder)
    meta = read_meta(folder)
    saved = meta["grid"]
    if (saved["x"], saved["y"], saved["z"]) != (grid.x, grid.y, grid.z):
        raise ValueError(
            f"checkpoint {folder} was saved on x={saved['x']} y={saved['y']} z={saved['z']}, "
            f"this run has x={grid.x} y={grid.y} z={grid.z}; consolidate it and load the full "
            "state dict instead"
        )
    c = grid.coords()
    source = c["x"] + grid.x * (c["y"] + grid.y * c["z"])
    blob = torch.load(folder / meta["files"][str(source)], map_location="cpu", weights_only=True)
    model.load_state_dict(blob["model"])
    if optimizer is not None and blob["optimizer"] is not None:
        optimizer.load_state_dict(blob["optimizer"])
    return meta


def consolidate(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full state dict of the plain model from a sharded checkpoint (no process group)."""
    folder = Path(folder)
    meta = read_meta(folder)
    blobs = {}
    for name in meta["files"].values():
        blob = torch.load(folder / name, map_location="cpu", weights_only=True)
        c = blob["coords"]
        blobs[(c["x"], c["y"], c["z"])] = blob["model"]
    first = next(iter(blobs.values()))
    out: dict[str, torch.Tensor] = {}
    for key in first:
        info = meta["sharded"].get(key)
        if info is None:
            out[key] = first[key]
            continue
        layout = ShardLayout.from_dict(info["layout"])
        pieces = {}
        for (x, y, z), sd in blobs.items():
            pos = {"x": x, "y": y, "z": z}
            col = pos[layout.col_axis] if layout.col_axis else 0
            depth = z if layout.kind == "matrix" else 0
            pieces[(pos[layout.row_axis], col, depth)] = sd[key]
        full = layout.assemble(pieces)
        out[key] = full.t().contiguous() if info["full_format"] == "in_out" else full
    return out
