"""Offline tools over a checkpoint (no process group): one plain state dict, and a summary."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from gnnpar.checkpoint.chunks import concat, copy_overlap
from gnnpar.checkpoint.protocol import CheckpointError, candidates
from gnnpar.checkpoint.state import MODEL
from gnnpar.checkpoint.store import plan_reads
from gnnpar.checkpoint.validate import check_stored, read_checkpoint
from gnnpar.fmt import count
from gnnpar.verified import Manifest, load_tensors

__all__ = ["consolidate", "consolidate_inputs", "describe", "open_checkpoint"]


def open_checkpoint(path: str | os.PathLike) -> Manifest:
    """The manifest of the checkpoint at ``path`` (a step folder, or a run's checkpoint
    directory or run folder, whose newest complete checkpoint is used)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    folders = candidates(path)
    if not folders and (path / "checkpoints").is_dir():
        folders = candidates(path / "checkpoints")
    if not folders:
        raise CheckpointError(f"{path} holds no checkpoint")
    return read_checkpoint(folders[0])


def consolidate(path: str | os.PathLike, verify: str = "checksum") -> dict[str, torch.Tensor]:
    """The plain model's full state dict (keys in the model's order, tied keys sharing one
    tensor) from any checkpoint gnnpar writes, whatever grid and sharding wrote it."""
    manifest = open_checkpoint(path)
    meta = manifest.meta
    aliases = meta["aliases"]
    full = _read_full(manifest, [k for k in meta["keys"] if k not in aliases], verify)
    return {key: full[aliases.get(key, key)] for key in meta["keys"]}


def consolidate_inputs(
    path: str | os.PathLike, verify: str = "checksum"
) -> dict[str, torch.Tensor]:
    """The full tensors a checkpoint keeps beyond the plain state dict (its meta's
    ``inputs``: a full-graph run's learnt input rows, :mod:`gnnpar.models.fullgraph.embedding`),
    by name; empty for most checkpoints."""
    manifest = open_checkpoint(path)
    return _read_full(manifest, list(manifest.meta.get("inputs", [])), verify)


def _read_full(manifest: Manifest, keys: list[str], verify: str) -> dict[str, torch.Tensor]:
    """The full tensors ``model/<key>`` of ``keys``, assembled from every rank's pieces."""
    from gnnpar.checkpoint.state import Piece

    meta = manifest.meta
    full: dict[str, torch.Tensor] = {}
    targets = []
    for key in keys:
        spec = meta["tensors"][MODEL + key]
        t = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
        full[key] = t
        targets.append(Piece(key, t, concat([(MODEL + key, (0,) * t.dim(), tuple(t.shape))])))
    pairs = plan_reads(targets, manifest)
    blobs: dict[str, dict[str, torch.Tensor]] = {}
    for _, _, src, _ in pairs:
        if src.file not in blobs:
            blobs[src.file] = load_tensors(manifest.verify(src.file, verify))
            check_stored(manifest, src.file, blobs[src.file], verify)
    with torch.no_grad():
        for piece, t, src, s in pairs:
            copy_overlap(piece.tensor.view(-1), t, blobs[src.file][src.entry], s)
    return full


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


def describe(path: str | os.PathLike) -> str:
    """A summary of a checkpoint: step, grid, run, model tensors and their sizes, files."""
    m = open_checkpoint(path)
    meta = m.meta
    grid = " ".join(f"{a}={v}" for a, v in meta["grid"].items() if v > 1) or "one rank"
    lines = [
        f"checkpoint {m.folder}",
        f"  step {meta['step']}, written {meta.get('created', '?')} by gnnpar "
        f"{meta.get('gnnpar', '?')} on {count(meta['world_size'], 'rank')} ({grid})",
    ]
    info: dict[str, Any] = meta.get("info") or {}
    if info:
        lines.append("  run: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    model = [(k[len(MODEL) :], v) for k, v in meta["tensors"].items() if k.startswith(MODEL)]
    numel = sum(math.prod(v["shape"]) for _, v in model)
    lines.append(f"  model: {len(model)} tensors, {numel:,} numbers")
    for key, v in model:
        lines.append(f"    {key:<48} {str(v['shape']):<18} {v['dtype']}")
    for alias, key in meta["aliases"].items():
        lines.append(f"    {alias:<48} = {key}")
    optim = sorted({k.split("/")[1] for k in meta["tensors"] if k.startswith("optim/")})
    if optim:
        lines.append("  optimizer state: " + ", ".join(optim))
    total = sum(f["size"] for f in m.files.values())
    lines.append(f"  files: {len(m.files)}, {_size(total)} on disk")
    return "\n".join(lines)
