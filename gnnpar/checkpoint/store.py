"""Saving and loading a checkpoint on any grid (collective operations).

``save`` writes, per rank, one file with the pieces that rank is the writer of (replicated
values once) and describes every piece in the manifest by its chunks of the full tensors.
``load`` works on any grid and any sharding: each rank works out which stored chunks overlap
its own pieces, verifies and memory-maps only the files that hold them, and copies the
overlaps. A damaged newest checkpoint is skipped with a warning for the previous complete one;
a checkpoint of another model is one error naming the first tensor that differs.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gnnpar import comm
from gnnpar.atomic import os_error_message
from gnnpar.checkpoint.chunks import Chunk, concat, copy_overlap, overlap_volume
from gnnpar.checkpoint.protocol import (
    SCHEMA,
    VERSION,
    CheckpointError,
    candidates,
    commit,
    incomplete_steps,
    step_folder,
    step_of,
    temporary_folder,
)
from gnnpar.checkpoint.state import (
    MODEL,
    OPTIM,
    ModelLayout,
    Piece,
    TensorSpec,
    model_layout,
    optimizer_pieces,
)
from gnnpar.checkpoint.validate import check_stored, entry_digest, read_checkpoint
from gnnpar.failpoints import failpoint
from gnnpar.grid import ProcessGrid
from gnnpar.verified import (
    MANIFEST,
    FormatError,
    Manifest,
    OlderFormatError,
    UnsafeContentError,
    file_entry,
    load_tensors,
    save_tensors,
    write_manifest,
)

__all__ = ["LoadResult", "apply_restore", "load", "plan_restore", "rank_pieces", "save"]

LOCAL = "local/"


def _agree(grid: ProcessGrid, value: int, op: str = "max") -> int:
    """``value`` reduced over every rank (every rank must call)."""
    t = torch.tensor([value], dtype=torch.int64, device=grid.device)
    comm.all_reduce(t, grid, "world", op=op)
    return int(t.item())


def _rank_stem(rank: int) -> str:
    return f"rank-{rank:05d}"


def save(
    directory: str | os.PathLike,
    step: int,
    grid: ProcessGrid,
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    local: Mapping[str, torch.Tensor] | None = None,
    info: Mapping[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write the checkpoint of ``step`` under ``directory`` (collective); return its folder.

    Args:
        model: a plain, tensor-parallel (:func:`gnnpar.tensor.parallelize`), sharded
            (:class:`~gnnpar.shard.ShardedModel`) or full-graph parallel model.
        optimizer: its optimizer (state resharded on load), or None.
        extra: JSON-ready state to restore as it is (trainer and loader position).
        local: per-rank tensors (RNG states), given back only on the same grid.
        info: JSON-ready description of the run (task, model sizes), for ``gnnpar ckpt info``.
        keep: complete checkpoints kept under ``directory`` (0: all).
    """
    layout, pieces, tensors, groups = rank_pieces(grid, model, optimizer)
    final = step_folder(directory, step)
    tmp = temporary_folder(final)
    rank = grid.global_rank
    failed = 0
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as err:
            failed = 1
            error: BaseException = err
    if _agree(grid, failed):
        if rank == 0:
            reason = os_error_message(error, tmp)  # type: ignore[arg-type]
            raise CheckpointError(f"{reason} (the previous checkpoint is kept)") from None
        raise CheckpointError(f"rank 0 could not create the checkpoint folder {tmp}")
    stem = _rank_stem(rank)
    try:
        blob, entries, digests = {}, {}, {}
        for p in pieces:
            if p.write and p.chunks:
                blob[p.name] = p.tensor.detach().reshape(-1).cpu()
                entries[p.name] = [c.to_json() for c in p.chunks]
                digests[p.name] = entry_digest(p.chunks, blob[p.name])
        for name, t in (local or {}).items():
            blob[LOCAL + name] = t.detach().cpu()
        save_tensors(tmp / f"{stem}.pt", blob)
        if layout.after_read is not None:
            layout.after_read()
        side = {
            "entry": file_entry(tmp / f"{stem}.pt"),
            "pieces": entries,
            "digests": digests,
            "local": sorted(local or {}),
            "tensors": {k: v.to_json() for k, v in tensors.items()},
        }
        (tmp / f"{stem}.json").write_text(json.dumps(side))
        failpoint("checkpoint", step, rank)  # a chaos run's kill mid-write
    except OSError as err:
        failed, error = 1, err
    who = _agree(grid, rank if failed else -1)
    if who >= 0:
        if rank == 0:  # every rank is done with it (the agreement above): nothing half-written
            shutil.rmtree(tmp, ignore_errors=True)
        if failed:
            reason = os_error_message(error, tmp / f"{stem}.pt")  # type: ignore[arg-type]
            raise CheckpointError(f"{reason} (the previous checkpoint is kept)") from None
        raise CheckpointError(f"rank {who} could not write its part of checkpoint {final}")
    if rank == 0:
        try:
            _write_manifest(tmp, grid, layout, groups, step, extra, info)
            commit(tmp, final, keep)
        except OSError as err:
            failed, error = 1, err
    if _agree(grid, failed):
        if rank == 0:
            raise CheckpointError(f"cannot finish checkpoint {final}: {error}") from None
        raise CheckpointError(f"rank 0 could not finish checkpoint {final}")
    return final


def rank_pieces(
    grid: ProcessGrid, model: Any, optimizer: torch.optim.Optimizer | None
) -> tuple[ModelLayout, list[Piece], dict[str, TensorSpec], list[dict[str, Any]] | None]:
    """This rank's layout, its pieces of the model and of the optimizer state, the full
    tensors they belong to, and the optimizer's parameter groups (None without one)."""
    layout = model_layout(model, grid)
    pieces = list(layout.pieces)
    tensors = dict(layout.tensors)
    groups = None
    if optimizer is not None:
        extra_pieces, extra_tensors, groups = optimizer_pieces(optimizer, layout)
        pieces += extra_pieces
        tensors.update(extra_tensors)
    return layout, pieces, tensors, groups


def _write_manifest(
    tmp: Path,
    grid: ProcessGrid,
    layout: ModelLayout,
    groups: list[dict[str, Any]] | None,
    step: int,
    extra: Mapping[str, Any] | None,
    info: Mapping[str, Any] | None,
) -> None:
    files, pieces, digests, local, tensors = {}, {}, {}, {}, {}
    for r in range(grid.world_size):
        side_path = tmp / f"{_rank_stem(r)}.json"
        side = json.loads(side_path.read_text())
        name = f"{_rank_stem(r)}.pt"
        files[name] = side["entry"]
        if side["pieces"]:
            pieces[name] = side["pieces"]
            digests[name] = side["digests"]
        if side["local"]:
            local[name] = side["local"]
        tensors.update(side["tensors"])
        side_path.unlink()
    from gnnpar import __version__

    meta = {
        "step": step,
        "grid": grid.shape,
        "world_size": grid.world_size,
        "keys": layout.keys,
        "aliases": layout.aliases,
        "tensors": tensors,
        "pieces": pieces,
        "digests": digests,
        "local": local,
        "optimizer": {"param_groups": groups} if groups is not None else None,
        "extra": dict(extra or {}),
        "info": dict(info or {}),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gnnpar": __version__,
    }
    if layout.inputs:  # written only when there are any: other checkpoints stay as they were
        meta["inputs"] = layout.inputs
    write_manifest(tmp, SCHEMA, VERSION, files, meta)


# ------------------------------------------------------------------------------------ load
@dataclasses.dataclass
class LoadResult:
    """What :func:`load` found: the step, the folder, ``extra`` as saved, and this rank's
    ``local`` tensors (only when the grid is the one that saved them)."""

    step: int
    folder: Path
    extra: dict[str, Any]
    local: dict[str, torch.Tensor]
    grid: dict[str, int]


@dataclasses.dataclass
class _Source:
    file: str
    entry: str
    chunks: list[Chunk]


#: one copy of a load: (target piece, its chunk, the stored entry, its chunk)
Read = tuple[Piece, Chunk, _Source, Chunk]


def _sources(manifest: Manifest) -> dict[str, list[_Source]]:
    """Every stored chunk by full-tensor name."""
    out: dict[str, list[_Source]] = {}
    for file, entries in manifest.meta["pieces"].items():
        for entry, docs in entries.items():
            src = _Source(file, entry, [Chunk.from_json(d) for d in docs])
            for key in dict.fromkeys(c.key for c in src.chunks):
                out.setdefault(key, []).append(src)
    return out


def _check_model(manifest: Manifest, layout: ModelLayout, strict: bool) -> None:
    """One error naming the first tensor in which the checkpoint and the model differ."""
    saved = manifest.meta["tensors"]
    folder = manifest.folder
    for key in [*layout.keys, *layout.inputs]:
        canon = layout.aliases.get(key, key)
        spec = layout.tensors.get(MODEL + canon)
        if spec is None:
            continue  # held by another pipeline stage: that rank checks it
        got = saved.get(MODEL + canon)
        if got is None:
            raise CheckpointError(
                f"checkpoint {folder} has no tensor '{canon}' (shape {list(spec.shape)} in this "
                "model): it was written for another model"
            )
        if tuple(got["shape"]) != spec.shape:
            raise CheckpointError(
                f"checkpoint {folder} does not fit this model: tensor '{canon}' has shape "
                f"{got['shape']} there and {list(spec.shape)} here"
            )
    if strict:
        mine = {MODEL + layout.aliases.get(k, k) for k in [*layout.keys, *layout.inputs]}
        for key in saved:
            if key.startswith(MODEL) and key not in mine:
                raise CheckpointError(
                    f"checkpoint {folder} holds tensor '{key[len(MODEL) :]}' that this model "
                    "does not have: it was written for another model"
                )


def _optimizer_targets(
    optimizer: torch.optim.Optimizer, layout: ModelLayout, manifest: Manifest
) -> tuple[list[Piece], list[tuple[torch.Tensor, str, torch.Tensor]]]:
    """Empty tensors for the optimizer state the checkpoint holds, as pieces to fill, and
    where each goes (parameter, state name, tensor)."""
    saved = manifest.meta["tensors"]
    names = sorted({k[len(OPTIM) :].split("/", 1)[0] for k in saved if k.startswith(OPTIM)})
    pieces: list[Piece] = []
    where: list[tuple[torch.Tensor, str, torch.Tensor]] = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            chunks, _ = layout.params.get(id(p), ([], False))
            if not chunks:
                continue
            key = chunks[0].key[len(MODEL) :]
            model_shape = list(layout.tensors[chunks[0].key].shape)
            for name in names:
                spec = saved.get(f"{OPTIM}{name}/{key}")
                if spec is None:
                    continue
                dtype = getattr(torch, spec["dtype"])
                per_element = spec["shape"] == model_shape and not (
                    not model_shape and name == "step"
                )
                label = f"{OPTIM}{name}/g{gi}.p{pi}"
                if per_element:
                    t = torch.empty(p.shape, dtype=dtype, device=p.device)
                    moved = [
                        dataclasses.replace(c, key=f"{OPTIM}{name}/{c.key[len(MODEL) :]}")
                        for c in chunks
                    ]
                else:
                    t = torch.empty(spec["shape"], dtype=dtype)
                    full = f"{OPTIM}{name}/{key}"
                    moved = concat([(full, (0,) * t.dim(), tuple(t.shape))])
                pieces.append(Piece(label, t, moved))
                where.append((p, name, t))
    return pieces, where


def _restore_hyper(optimizer: torch.optim.Optimizer, manifest: Manifest) -> None:
    saved = (manifest.meta.get("optimizer") or {}).get("param_groups")
    if saved is None:
        return
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {manifest.folder} has {len(saved)} optimizer parameter groups, this "
            f"optimizer {len(optimizer.param_groups)}"
        )
    for group, hyper in zip(optimizer.param_groups, saved, strict=True):
        for k, v in hyper.items():
            if k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) and isinstance(v, list) else v


def plan_reads(targets: list[Piece], manifest: Manifest) -> list[Read]:
    """Every (target chunk, stored chunk) overlap: what to copy where. CheckpointError naming
    the tensor when the checkpoint does not cover all of a target chunk."""
    sources = _sources(manifest)
    pairs = []
    for piece in targets:
        for t in piece.chunks:
            covered = 0
            for src in sources.get(t.key, ()):
                for s in src.chunks:
                    n = overlap_volume(t, s)
                    if n:
                        pairs.append((piece, t, src, s))
                        covered += n
            if covered < t.numel:
                raise CheckpointError(
                    f"checkpoint {manifest.folder} does not hold all of tensor '{t.key}' "
                    f"({covered} of {t.numel} elements of this part)"
                )
    return pairs


def plan_restore(
    manifest: Manifest, layout: ModelLayout, optimizer: torch.optim.Optimizer | None, strict: bool
) -> tuple[list[Read], list[tuple[torch.Tensor, str, torch.Tensor]]]:
    """What loading ``manifest`` into a rank's ``layout`` (and ``optimizer``) copies: every
    overlap of a stored chunk with a target, and where each optimizer state tensor goes.
    CheckpointError when the stored model is another or does not cover the targets."""
    _check_model(manifest, layout, strict)
    targets = list(layout.pieces)
    opt_where: list[tuple[torch.Tensor, str, torch.Tensor]] = []
    if optimizer is not None:
        extra_targets, opt_where = _optimizer_targets(optimizer, layout, manifest)
        targets += extra_targets
    return plan_reads(targets, manifest), opt_where


def apply_restore(
    manifest: Manifest,
    pairs: list[Read],
    blobs: Mapping[str, Mapping[str, torch.Tensor]],
    layout: ModelLayout,
    optimizer: torch.optim.Optimizer | None,
    opt_where: list[tuple[torch.Tensor, str, torch.Tensor]],
) -> None:
    """Copy the planned overlaps (:func:`plan_restore`) from the loaded files ``blobs`` into
    the model and the optimizer (its hyper-parameters too), then let the layout finish
    (ZeRO-3 gathers, copies to low-precision parameters: collective)."""
    with torch.no_grad():
        for piece, t, src, s in pairs:
            copy_overlap(piece.tensor.view(-1), t, blobs[src.file][src.entry], s)
    if optimizer is not None:
        _restore_hyper(optimizer, manifest)
        optimizer.state.clear()
        for p, name, t in opt_where:
            optimizer.state[p][name] = t
    if layout.after_load is not None:
        layout.after_load()


def _warn(grid: ProcessGrid, text: str) -> None:
    if grid.global_rank == 0:
        print(f"warning: {text}", file=sys.stderr, flush=True)


def load(
    path: str | os.PathLike,
    grid: ProcessGrid,
    model: Any,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    verify: str = "checksum",
) -> LoadResult | None:
    """Load the newest usable checkpoint at ``path`` (a step folder, or a directory of them)
    into ``model`` (and ``optimizer``), whatever grid and sharding wrote it (collective).

    Returns None when ``path`` holds no checkpoint at all. A newest checkpoint with a
    missing, truncated or corrupted file is skipped with a warning naming the file, for the
    previous complete one; CheckpointError when none is usable or the checkpoint belongs to
    another model (naming the first tensor that differs); FormatError for a file that holds
    anything but tensors (nothing in it is run). ``verify``: ``"checksum"`` (default),
    ``"size"`` or ``"none"`` — how far each rank checks the files it reads.
    """
    layout = model_layout(model, grid)
    folders = candidates(path)
    newest = step_of(folders[0]) if folders else None
    incomplete = [d for d in incomplete_steps(path) if newest is None or step_of(d) > newest]
    problems = [f"{d}: no {MANIFEST} (incomplete or damaged)" for d in incomplete]
    for problem in problems:
        _warn(grid, f"{problem}; {'using the previous checkpoint' if folders else 'skipped'}")
    if not folders and problems:
        raise CheckpointError(f"no usable checkpoint in {path}: " + "; ".join(problems[:3]))
    if not folders:
        return None
    for folder in folders:
        try:
            manifest = read_checkpoint(folder)
        except OlderFormatError:
            raise  # no other checkpoint of the folder is newer: this one must be made again
        except FormatError as err:
            problems.append(str(err))
            _warn(grid, f"{err}; trying the previous checkpoint")
            continue
        pairs, opt_where = plan_restore(manifest, layout, optimizer, strict)
        files = sorted({src.file for _, _, src, _ in pairs})
        same_grid = manifest.meta.get("grid") == grid.shape
        own = f"{_rank_stem(grid.global_rank)}.pt"
        if same_grid and own in manifest.meta.get("local", {}) and own not in files:
            files.append(own)
        ordered = sorted(manifest.files)
        damaged, unsafe = len(ordered), len(ordered)
        blobs: dict[str, dict[str, torch.Tensor]] = {}
        for name in files:
            try:
                blobs[name] = load_tensors(manifest.verify(name, verify))
                check_stored(manifest, name, blobs[name], verify)
            except FormatError as err:
                index = ordered.index(name)
                if isinstance(err, UnsafeContentError):
                    unsafe = min(unsafe, index)
                else:
                    damaged = min(damaged, index)
        unsafe = _agree(grid, unsafe, "min")
        if unsafe < len(ordered):
            raise FormatError(
                f"{folder / ordered[unsafe]}: holds objects other than tensors; refused "
                "(nothing in it was run)"
            )
        damaged = _agree(grid, damaged, "min")
        if damaged < len(ordered):
            reason = _reason(manifest, ordered[damaged], verify) if grid.global_rank == 0 else ""
            problems.append(f"{folder / ordered[damaged]}: {reason}")
            _warn(grid, f"{folder / ordered[damaged]}: {reason}; using the previous checkpoint")
            continue
        apply_restore(manifest, pairs, blobs, layout, optimizer, opt_where)
        local = {}
        if same_grid and own in blobs:
            for name in manifest.meta.get("local", {}).get(own, []):
                local[name] = blobs[own][LOCAL + name].clone()
        return LoadResult(
            step=int(manifest.meta["step"]),
            folder=folder,
            extra=dict(manifest.meta.get("extra") or {}),
            local=local,
            grid=dict(manifest.meta.get("grid") or {}),
        )
    raise CheckpointError(f"no usable checkpoint in {path}: " + "; ".join(problems[:3]))


def _reason(manifest: Manifest, name: str, verify: str) -> str:
    """Why a file failed (re-checked on the reporting rank)."""
    try:
        check_stored(manifest, name, load_tensors(manifest.verify(name, verify)), verify)
    except FormatError as err:
        text = str(err)
        return text.split(": ", 1)[1] if text.startswith(str(manifest.folder)) else text
    return "damaged (size or checksum differs from the manifest)"
