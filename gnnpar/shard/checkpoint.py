"""Sharded checkpoints of a :class:`~gnnpar.shard.ShardedModel` and its optimizer: one file
per rank, reloadable on another data size or stage, and consolidation into one state dict.

A checkpoint is a folder per step::

    <dir>/step-000100/
        rank-00003.pt     torch.save({"params": {name: 1-D tensor},      this rank's elements
                                      "state": {name: {key: tensor}},    optimizer state of them
                                      "groups": [{hyper-parameters..., "names": [name, ...]}],
                                      "buffers": {key: tensor}})         (data index 0 only)
        rank-00003.json   {"rank": 3, "coords": {"x": .., "y": .., "z": .., "data": ..},
                           "params": {name: {"shape": [...], "start": a, "stop": b}}}
        meta.json         {"format": "gnnpar.shard/1", "step": 100, "stage": 3,
                           "grid": {"data": D, "x": X, "y": Y, "z": Z}, "keys": [...],
                           "aliases": {name: [state-dict keys]},
                           "sharded": {name: {"layout": ShardLayout.to_dict(),
                                              "full_format": "out_in" | "in_out"}},
                           "files": ["rank-00000", ...], "extra": {...}}
    <dir>/latest          the name of the newest complete step folder

Placement: ``name`` is a parameter's state-dict key; ``shape`` is the tensor this rank's
tensor-parallel coordinates hold before data sharding (the whole parameter without tensor
parallelism), and the file holds elements ``[start, stop)`` of it, flattened. Per-element
optimizer state (``exp_avg``, ``momentum_buffer``, ...) is stored with the same range;
other state (``step``) as it is. Data replicas of a replicated tensor (stage 0) are written
by data index 0 only. ``sharded`` gives the tensor-parallel layout of the parameters that a
:mod:`gnnpar.tensor` layer splits, so :func:`consolidate` can assemble them.

Loading reads, for each element range this rank needs, the overlapping ranges of the files
with the same tensor-parallel coordinates (memory-mapped), so the data size and the stage
may differ between save and load; the tensor-parallel shape must match. Files are written
under temporary names and renamed; ``meta.json`` is written last after a barrier, then
``latest``, so an interrupted save is never picked up.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from gnnpar import comm
from gnnpar.atomic import atomic_write, latest_checkpoint, mark_latest, read_meta, write_json
from gnnpar.shard.api import ShardedModel

__all__ = ["FORMAT", "consolidate", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

FORMAT = "gnnpar.shard/1"


def _stem(rank: int) -> str:
    return f"rank-{rank:05d}"


def _optimizer_names(dp: ShardedModel, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    index = dp.piece_index()
    out = []
    for group in optimizer.param_groups:
        names = []
        for p in group["params"]:
            if id(p) not in index:
                raise ValueError(
                    "the optimizer holds a parameter that is not one of the ShardedModel's "
                    "parameters(); build it from dp.parameters()"
                )
            names.append(index[id(p)][0].name)
        out.append(names)
    return out


def save_checkpoint(
    directory: str | os.PathLike,
    dp: ShardedModel,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` under ``directory`` (collective); return its folder."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    grid = dp.grid
    folder = Path(directory) / f"step-{step:06d}"
    if grid.global_rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    comm.barrier(grid)
    first = grid.rank("data") == 0
    params: dict[str, torch.Tensor] = {}
    ranges: dict[str, dict[str, Any]] = {}
    for slot, start, stop, values, replicated in dp.local_pieces():
        if replicated and not first:
            continue
        params[slot.name] = values.detach().clone()
        ranges[slot.name] = {"shape": list(slot.shape), "start": start, "stop": stop}
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    if optimizer is not None:
        index = dp.piece_index()
        names = _optimizer_names(dp, optimizer)
        for group, group_names in zip(optimizer.param_groups, names, strict=True):
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "names": group_names})
            for p, name in zip(group["params"], group_names, strict=True):
                slot, start, stop = index[id(p)]
                if name not in ranges:  # a replicated parameter another rank writes
                    continue
                per, other = {}, {}
                for key, value in optimizer.state.get(p, {}).items():
                    if _per_element(key, value, p):
                        per[key] = value.detach().reshape(-1).clone()
                    elif isinstance(value, torch.Tensor):
                        other[key] = value.detach().clone()
                    else:
                        other[key] = value
                entry = {"per_element": per, "other": other}
                state[name] = entry
    buffers = {}
    if first:
        buffers = {k: v.detach().clone() for k, v in dp.module.named_buffers()}
    blob = {"params": params, "state": state, "groups": groups, "buffers": buffers}
    stem = _stem(grid.global_rank)
    atomic_write(folder / f"{stem}.pt", lambda tmp: torch.save(blob, tmp))
    index_doc = {"rank": grid.global_rank, "coords": grid.coords(), "params": ranges}
    write_json(folder / f"{stem}.json", index_doc)
    comm.barrier(grid)
    if grid.global_rank == 0:
        sharded = {}
        for s in dp.slots:
            if s.layout is not None:
                fmt = getattr(s.owner, "weight_format", "out_in")
                sharded[s.name] = {
                    "layout": s.layout.to_dict(),
                    "full_format": fmt if s.owner_attr == "weight" else "out_in",
                }
        meta = {
            "format": FORMAT,
            "step": step,
            "stage": dp.stage,
            "grid": {"data": grid.data, "x": grid.x, "y": grid.y, "z": grid.z},
            "keys": dp._keys,
            "aliases": {s.name: s.aliases for s in dp.slots},
            "sharded": sharded,
            "files": [_stem(r) for r in range(grid.world_size)],
            "extra": dict(extra or {}),
        }
        write_json(folder / "meta.json", meta, indent=1)
        mark_latest(directory, folder)
    comm.barrier(grid)
    return folder


def _read_meta(folder: Path) -> dict[str, Any]:
    meta = read_meta(folder)
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{folder} is not a gnnpar.shard checkpoint (format {meta.get('format')!r})"
        )
    return meta


class _Files:
    """The rank files of one checkpoint, indexed by tensor-parallel coordinates and loaded
    lazily (memory-mapped)."""

    def __init__(self, folder: Path, meta: dict[str, Any]):
        self.folder = folder
        self.index: list[dict[str, Any]] = []
        for stem in meta["files"]:
            path = folder / f"{stem}.json"
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint {folder} lacks {path.name}")
            doc = json.loads(path.read_text())
            doc["stem"] = stem
            self.index.append(doc)
        self._blobs: dict[str, dict[str, Any]] = {}

    def blob(self, stem: str) -> dict[str, Any]:
        if stem not in self._blobs:
            self._blobs[stem] = torch.load(
                self.folder / f"{stem}.pt", map_location="cpu", weights_only=True, mmap=True
            )
        return self._blobs[stem]

    def of(self, coords: Mapping[str, int]) -> list[dict[str, Any]]:
        """Index entries of the files with these tensor-parallel coordinates."""
        return [d for d in self.index if all(d["coords"][a] == coords[a] for a in ("x", "y", "z"))]

    def assemble(
        self,
        docs: list[dict[str, Any]],
        name: str,
        start: int,
        stop: int,
        pick: Callable[[dict[str, Any], str], torch.Tensor | None],
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of ``name`` from the files in ``docs``, each file's part
        picked by ``pick(blob, name)`` (a 1-D tensor over that file's range)."""
        out: torch.Tensor | None = None
        filled = 0
        for d in docs:
            rng = d["params"].get(name)
            if rng is None:
                continue
            a, b = max(start, rng["start"]), min(stop, rng["stop"])
            if a >= b:
                continue
            part = pick(self.blob(d["stem"]), name)
            if part is None:
                continue
            if out is None:
                out = torch.empty(stop - start, dtype=part.dtype)
            out[a - start : b - start] = part[a - rng["start"] : b - rng["start"]]
            filled += b - a
        if out is None or filled < stop - start:
            if stop == start and out is None:
                return torch.empty(0)
            raise ValueError(
                f"checkpoint {self.folder} does not cover elements [{start}, {stop}) of {name!r}"
            )
        return out


def load_checkpoint(
    folder: str | os.PathLike,
    dp: ShardedModel,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load this rank's parameters (and optimizer state) from a checkpoint saved on any data
    size and stage with the same tensor-parallel shape; return its meta (``step``,
    ``extra``). No communication: each rank reads what it needs."""
    folder = Path(folder)
    meta = _read_meta(folder)
    grid = dp.grid
    saved = meta["grid"]
    if (saved["x"], saved["y"], saved["z"]) != (grid.x, grid.y, grid.z):
        raise ValueError(
            f"checkpoint {folder} was saved on x={saved['x']} y={saved['y']} z={saved['z']}, "
            f"this run has x={grid.x} y={grid.y} z={grid.z}; consolidate it and load the "
            "full state dict instead"
        )
    files = _Files(folder, meta)
    docs = files.of(grid.coords())
    known = {name for d in docs for name in d["params"]}
    missing = [s.name for s in dp.slots if s.name not in known]
    if missing:
        raise ValueError(f"checkpoint {folder} lacks parameters {missing}")
    for d in docs:
        for name, rng in d["params"].items():
            slot = next((s for s in dp.slots if s.name == name), None)
            if slot is not None and list(slot.shape) != rng["shape"]:
                raise ValueError(
                    f"{name}: the checkpoint holds shape {rng['shape']}, this model "
                    f"{list(slot.shape)}"
                )

    def param_part(blob, name):
        return blob["params"].get(name)

    values = {
        s.name: files.assemble(docs, s.name, 0, s.numel, param_part).view(s.shape) for s in dp.slots
    }
    if optimizer is not None:
        _load_optimizer(files, docs, dp, optimizer)
    dp.load_local(values)
    first = next((d for d in docs if d["coords"]["data"] == 0), None)
    if first is not None:
        buffers = files.blob(first["stem"])["buffers"]
        with torch.no_grad():
            for key, b in dp.module.named_buffers():
                if key in buffers:
                    b.copy_(buffers[key])
    return meta


def _load_optimizer(
    files: _Files, docs: list[dict[str, Any]], dp: ShardedModel, optimizer: torch.optim.Optimizer
) -> None:
    saved_groups = None
    for d in docs:
        groups = files.blob(d["stem"])["groups"]
        if groups:
            saved_groups = groups
            break
    if saved_groups is None:
        raise ValueError(f"checkpoint {files.folder} holds no optimizer state")
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this one "
            f"{len(optimizer.param_groups)}"
        )
    index = dp.piece_index()
    names = _optimizer_names(dp, optimizer)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    i = 0
    for group, saved, group_names in zip(optimizer.param_groups, saved_groups, names, strict=True):
        hyper = {k: v for k, v in saved.items() if k != "names"}
        ids = []
        for p, name in zip(group["params"], group_names, strict=True):
            slot, start, stop = index[id(p)]
            entry = _state_of(files, docs, name, start, stop, p)
            if entry:
                state[i] = entry
            ids.append(i)
            i += 1
        groups.append({**hyper, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _per_element(key: str, value: Any, param: torch.Tensor) -> bool:
    """Whether optimizer state ``value`` holds one number per parameter element (same shape
    as the parameter; for a 0-dim parameter every 0-dim state but ``step``)."""
    if not isinstance(value, torch.Tensor) or value.shape != param.shape:
        return False
    return param.dim() > 0 or key != "step"


def _state_of(
    files: _Files, docs: list[dict[str, Any]], name: str, start: int, stop: int, p: torch.Tensor
) -> dict[str, Any]:
    """The optimizer state of elements ``[start, stop)`` of ``name``."""
    per_keys: list[str] = []
    out: dict[str, Any] = {}
    for d in docs:
        if name not in d["params"]:
            continue
        entry = files.blob(d["stem"])["state"].get(name)
        if not entry:
            continue
        for k in entry["per_element"]:
            if k not in per_keys:
                per_keys.append(k)
        for k, v in entry["other"].items():
            if k not in out:
                out[k] = v.clone() if isinstance(v, torch.Tensor) else v
    for k in per_keys:

        def pick(blob, n, k=k):
            e = blob["state"].get(n)
            return None if not e else e["per_element"].get(k)

        out[k] = files.assemble(docs, name, start, stop, pick).view(p.shape).clone()
    return out


def consolidate(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full state dict of the plain model from a checkpoint (or the newest checkpoint
    under a run directory), without a process group."""
    folder = Path(folder)
    if not (folder / "meta.json").is_file():
        latest = latest_checkpoint(folder) if folder.is_dir() else None
        if latest is None:
            raise FileNotFoundError(f"{folder} holds no complete gnnpar.shard checkpoint")
        folder = latest
    meta = _read_meta(folder)
    files = _Files(folder, meta)
    by_coords: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for d in files.index:
        c = d["coords"]
        by_coords.setdefault((c["x"], c["y"], c["z"]), []).append(d)

    def param_part(blob, name):
        return blob["params"].get(name)

    values: dict[str, torch.Tensor] = {}
    for name, aliases in meta["aliases"].items():
        info = meta["sharded"].get(name)
        pieces = {}
        for (x, y, z), docs in by_coords.items():
            shape = next((d["params"][name]["shape"] for d in docs if name in d["params"]), None)
            if shape is None:
                raise ValueError(
                    f"checkpoint {folder} lacks parameter {name!r} at x={x} y={y} z={z}"
                )
            n = 1
            for s in shape:
                n *= s
            local = files.assemble(docs, name, 0, n, param_part).view(shape)
            if info is None:
                pieces = {(0, 0, 0): local}
                break
            from gnnpar.tensor.layout import ShardLayout

            layout = ShardLayout.from_dict(info["layout"])
            pos = {"x": x, "y": y, "z": z}
            col = pos[layout.col_axis] if layout.col_axis else 0
            depth = z if layout.kind == "matrix" else 0
            pieces[(pos[layout.row_axis], col, depth)] = local
        if info is None:
            full = pieces[(0, 0, 0)]
        else:
            from gnnpar.tensor.layout import ShardLayout

            full = ShardLayout.from_dict(info["layout"]).assemble(pieces)
            if info["full_format"] == "in_out":
                full = full.t().contiguous()
        for key in aliases:
            values[key] = full
    buffers: dict[str, torch.Tensor] = {}
    for d in files.index:
        if d["coords"]["data"] == 0:
            buffers = files.blob(d["stem"])["buffers"]
            break
    out = {}
    for key in meta["keys"]:
        if key in values:
            out[key] = values[key].clone()
        elif key in buffers:
            out[key] = buffers[key].clone()
    return out
