"""`gnnpar info`: versions, backends and devices; with ``--check``, a bandwidth probe that runs
every collective on every grid axis and reports measured bus bandwidth per axis.

The probe's JSON (``--json FILE``) is a measured bandwidth table::

    {"schema": 1, "world_size": 4, "ranks_per_node": 4, "backend": "gloo",
     "grid": {"data": 1, "x": 2, "y": 2, "z": 1},
     "entries": [{"axis": "x", "group_size": 2, "intra_node": true, "kind": "all_reduce",
                  "bytes": 4194304, "seconds": 0.0021, "busbw_gbps": 3.9,
                  "transport": "shm"}, ...]}

``busbw_gbps`` is the NCCL-tests convention: the ring bytes each rank moves (see
:func:`gnnpar.comm.ring_bytes`) divided by the time, in GB/s. ``transport`` says what carried
it: ``shm`` for the same-host shared-memory transport (:mod:`gnnpar.shm`), else the backend.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gnnpar import comm
from gnnpar.grid import ProcessGrid

PROBED = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")


def versions() -> dict[str, str]:
    """Versions of Python, gnnpar and the libraries it uses or compares against."""
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for name in ("gnnpar", "torch", "numpy", "scipy", "torch_geometric", "pymetis", "dgl"):
        try:
            mod = importlib.import_module(name)
            out[name] = getattr(mod, "__version__", "installed")
        except Exception:  # noqa: BLE001 - any import failure means "not usable here"
            out[name] = "not installed"
    return out


def environment() -> dict[str, str]:
    """Backends, devices and cores available to this process."""
    return {
        "cpu cores": str(os.cpu_count()),
        "gloo": str(dist.is_available() and dist.is_gloo_available()),
        "nccl": str(dist.is_available() and dist.is_nccl_available()),
        "cuda devices": str(torch.cuda.device_count()),
        "default backend": "nccl" if torch.cuda.is_available() else "gloo",
        "torch threads": str(torch.get_num_threads()),
    }


def _expected(kind: str, grid: ProcessGrid, axis: str, n: int) -> torch.Tensor:
    """What a probe collective must produce on this rank, from every member's input."""
    members = grid.ranks(axis)
    p = len(members)
    if kind == "all_reduce":
        return torch.full((n,), float(sum(members)))
    if kind == "all_gather":
        return torch.cat([torch.full((n,), float(r)) for r in members])
    if kind == "reduce_scatter":
        return torch.full((n // p,), float(sum(members)))
    if kind == "broadcast":
        return torch.full((n,), float(members[0]))
    return torch.cat([torch.full((n // p,), float(r)) for r in members])  # all_to_all


def _run_once(kind: str, grid: ProcessGrid, axis: str, n: int) -> torch.Tensor:
    x = torch.full((n,), float(grid.global_rank), device=grid.device)
    if kind == "all_reduce":
        return comm.all_reduce(x, grid, axis)
    if kind == "all_gather":
        return comm.all_gather(x, grid, axis)
    if kind == "reduce_scatter":
        return comm.reduce_scatter(x, grid, axis)
    if kind == "broadcast":
        return comm.broadcast(x, grid, axis, src=0)
    return comm.all_to_all(x, grid, axis)


def probe(grid: ProcessGrid, nbytes: int = 4 << 20, iters: int = 5) -> list[dict]:
    """Time every collective on every axis of size > 1; check each result; return entries."""
    entries = []
    for axis in ("x", "y", "z", "expert", "context", "data", "tensor"):
        p = grid.size(axis)
        if p == 1:
            continue
        n = max(p, (nbytes // 4) // p * p)  # float32 elements, divisible by p
        for kind in PROBED:
            out = _run_once(kind, grid, axis, n)  # warm-up, and the correctness check
            want = _expected(kind, grid, axis, n)
            if not torch.equal(out.cpu(), want):
                raise RuntimeError(f"{kind} over axis {axis} returned a wrong result")
            comm.barrier(grid, axis)
            start = time.perf_counter()
            for _ in range(iters):
                _run_once(kind, grid, axis, n)
            if grid.device.type == "cuda":
                torch.cuda.synchronize(grid.device)
            seconds = (time.perf_counter() - start) / iters
            # Slowest rank defines the collective's time.
            t = torch.tensor([seconds], dtype=torch.float64, device=grid.device)
            comm.all_reduce(t, grid, axis, op="max")
            seconds = t.item()
            full = n * 4 * (p if kind == "all_gather" else 1)
            if kind == "all_to_all":
                moved = (p - 1) / p * n * 4
            else:
                moved = comm.ring_bytes(kind, full, p)
            entries.append(
                {
                    "axis": axis,
                    "group_size": p,
                    "intra_node": grid.is_intra_node(axis),
                    "kind": kind,
                    "bytes": n * 4,
                    "seconds": seconds,
                    "busbw_gbps": moved / seconds / 1e9,
                    "transport": _transport(grid, axis, kind),
                }
            )
    return entries


def _transport(grid: ProcessGrid, axis: str, kind: str) -> str:
    """What carried a probed collective: ``shm`` (the same-host transport, :mod:`gnnpar.shm`)
    or the backend."""
    group = grid.group(axis)
    chan = grid.channels.get(id(group)) if group is not None else None
    if kind != "all_to_all" and chan is not None and chan.usable:
        return "shm"
    return grid.backend


def format_table(entries: list[dict]) -> str:
    """A plain-text table of probe entries."""
    head = f"{'axis':<7}{'ranks':>6}{'intra':>7}  {'collective':<15}{'MB':>8}{'ms':>10}{'GB/s':>9}"
    lines = [head, "-" * len(head)]
    for e in entries:
        lines.append(
            f"{e['axis']:<7}{e['group_size']:>6}{('yes' if e['intra_node'] else 'no'):>7}  "
            f"{e['kind']:<15}{e['bytes'] / 1e6:>8.2f}{e['seconds'] * 1e3:>10.3f}"
            f"{e['busbw_gbps']:>9.2f}"
        )
    return "\n".join(lines)


def write_table(path: str | Path, grid: ProcessGrid, entries: list[dict]) -> None:
    """Write the measured bandwidth table as JSON, atomically."""
    path = Path(path)
    doc = {
        "schema": 1,
        "world_size": grid.world_size,
        "ranks_per_node": grid.ranks_per_node,
        "backend": grid.backend,
        "grid": grid.shape,
        "entries": entries,
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(path)
