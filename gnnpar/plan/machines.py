"""Machine descriptions for the planner, and the measured bandwidth table they can carry.

A :class:`Machine` says how many devices a node holds, how much memory each has (and the
node's host memory, where it is not the device memory), how fast
collectives run inside a node and between nodes (an α–β model per placement: a latency per
ring step and a bus bandwidth per rank), and how fast a device multiplies (dense GEMM and
sparse SpMM rates, and a memory bandwidth that bounds small GEMMs).

Built-in machines (:func:`builtin_machines`; every number is an assumption from vendor data
sheets and public system descriptions, not a measurement, except where a measured table is
attached):

==============  =========================================================================
``cpu``         this machine: ``os.cpu_count()`` cores as devices, gloo over loopback, all
                ranks on one node (more ranks than cores share them); defaults are rough
                until a table from ``gnnpar info --check --json FILE`` is attached; its
                "device" memory is the host's RAM (``host_memory_gb`` None)
``a100x4``      a 4×A100-40GB node: 200 GB/s NVLink bus bandwidth inside the node, 25 GB/s
                per GPU between nodes, 312 TFLOP/s bf16 peak, 256 GB of host memory
``a100x4-80``   the same with 80 GB A100s
``h100x8``      an 8×H100-80GB node: ~450 GB/s NVLink, 50 GB/s per GPU between nodes,
                ~990 TFLOP/s bf16 peak, 2 TB of host memory (a DGX H100)
``perlmutter``  Perlmutter GPU nodes as Plexus used them (4×A100-80GB, Slingshot-11: four
                25 GB/s NICs per node, i.e. 25 GB/s per GPU; 256 GB of host memory)
``frontier``    Frontier nodes: 8 MI250X GCDs of 64 GB, ~50 GB/s Infinity Fabric between
                GCDs, four 25 GB/s NICs per node (12.5 GB/s per GCD), ~191 TFLOP/s bf16 per
                GCD, 512 GB of host memory
==============  =========================================================================

**Measured bandwidth table** — the JSON that ``gnnpar info --check --json FILE`` writes
(:func:`gnnpar.info.write_table`), field by field::

    {"schema": 1,                      # format version (1)
     "world_size": 8,                  # ranks that took part
     "ranks_per_node": 8,              # ranks per node when it was measured
     "backend": "gloo",                # collective backend
     "grid": {"data": 1, "x": 2, "y": 2, "z": 2},   # the grid whose axes were probed
     "entries": [                      # one per (axis, collective, buffer size)
       {"axis": "x",                   # grid axis of the group
        "group_size": 2,               # ranks in the group
        "intra_node": true,            # whether the group sat inside one node
        "kind": "all_reduce",          # all_reduce | all_gather | reduce_scatter | ...
        "bytes": 4194304,              # buffer bytes per rank (the input)
        "seconds": 0.0021,             # time of one collective (slowest rank)
        "busbw_gbps": 3.9}, ...]}      # ring bytes moved per rank / seconds, in GB/s

A table describes links, not memory: a file given as the machine is the CPU box with that
table (host memory = device memory, ``host_memory_gb`` None); keys other than ``schema`` and
``entries`` (a ``host_memory_gb`` among them) are ignored, so a table with or without one
reads the same.

Several files (e.g. probes with ``--mbytes 0.0625`` and ``--mbytes 4``) can be merged by
:func:`load_bandwidth_table`. Where one (placement, collective, group size) was measured at
two or more buffer sizes, a latency and a bandwidth are fitted (``t = α + bytes/β``);
with one size, the measured bus bandwidth is used as it is. Collectives the table does not
cover (an inter-node group on a one-node measurement, say) fall back to the machine's
defaults.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gnnpar.plan.inputs import PlanError

__all__ = [
    "BandwidthFit",
    "Link",
    "Machine",
    "builtin_machines",
    "get_machine",
    "load_bandwidth_table",
    "local_machine",
    "ring_steps",
]


@dataclasses.dataclass(frozen=True)
class Link:
    """An α–β collective model for one placement: ``latency_us`` per ring step and
    ``gbps`` of bus bandwidth per rank (GB/s, 1e9 bytes)."""

    gbps: float
    latency_us: float


@dataclasses.dataclass(frozen=True)
class BandwidthFit:
    """Time of one measured kind of collective: ``alpha_s + ring_bytes * sec_per_byte``,
    for groups of ``group_size`` ranks placed ``intra_node`` or not."""

    intra_node: bool
    kind: str
    group_size: int
    alpha_s: float
    sec_per_byte: float


def ring_steps(kind: str, p: int) -> int:
    """Ring steps of a collective over ``p`` ranks (2(p−1) for all-reduce, else p−1)."""
    if p <= 1:
        return 0
    return 2 * (p - 1) if kind == "all_reduce" else p - 1


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the planner knows about a machine (per device unless said otherwise).

    Attributes:
        name, description: how it is called and a line about it.
        devices_per_node: GPUs (or CPU cores) per node.
        memory_gb: device memory (GB, 1e9 bytes).
        intra, inter: collective models inside a node and between nodes.
        peak_tflops: peak dense rate (bf16 on GPUs), for reporting.
        gemm_tflops: achieved dense GEMM rate.
        spmm_gflops: achieved SpMM rate (2·nnz·width flops per product).
        mem_gbps: memory bandwidth (bounds GEMMs too small to be compute-bound).
        single_node: every rank runs on this one node (the CPU box), sharing its devices
            when there are more ranks than devices.
        fits: measured collective times (from a bandwidth table) that replace ``intra``
            and ``inter`` where they apply.
        assumptions: where the numbers come from.
        host_memory_gb: host memory (RAM) of one node, GB, which its ranks share (the offload
            tiers' host part, :func:`gnnpar.plan.memory.memory_shortfall`); None: the host is
            the device memory (the CPU box), so host offload frees nothing there.
    """

    name: str
    description: str
    devices_per_node: int
    memory_gb: float
    intra: Link
    inter: Link
    peak_tflops: float
    gemm_tflops: float
    spmm_gflops: float
    mem_gbps: float
    single_node: bool = False
    fits: tuple[BandwidthFit, ...] = ()
    assumptions: str = ""
    host_memory_gb: float | None = None

    def ranks_per_node(self, world: int) -> int:
        """Ranks sharing one node in a world of ``world`` ranks."""
        return world if self.single_node else min(world, self.devices_per_node)

    def compute_share(self, world: int) -> float:
        """Fraction of a device each rank gets (below 1 when ranks outnumber devices)."""
        return min(1.0, self.devices_per_node / self.ranks_per_node(world))

    def with_table(self, fits: Iterable[BandwidthFit]) -> Machine:
        """This machine with a measured bandwidth table attached."""
        fits = tuple(fits)
        name = self.name if self.name.endswith("+measured") else f"{self.name}+measured"
        return dataclasses.replace(self, name=name, fits=fits)

    def collective_seconds(self, kind: str, p: int, ring_bytes: float, intra: bool) -> float:
        """Seconds of one collective of ``kind`` over ``p`` ranks moving ``ring_bytes`` per
        rank (the ring bytes of :func:`gnnpar.comm.ring_bytes`)."""
        if p <= 1:
            return 0.0
        fit = self._nearest_fit(kind, p, intra)
        if fit is not None:
            scale = ring_steps(kind, p) / max(1, ring_steps(fit.kind, fit.group_size))
            return fit.alpha_s * scale + ring_bytes * fit.sec_per_byte
        link = self.intra if intra else self.inter
        return ring_steps(kind, p) * link.latency_us * 1e-6 + ring_bytes / (link.gbps * 1e9)

    def _nearest_fit(self, kind: str, p: int, intra: bool) -> BandwidthFit | None:
        pool = [f for f in self.fits if f.intra_node == intra]
        same = [f for f in pool if f.kind == kind]
        pool = same or pool
        if not pool:
            return None
        return min(pool, key=lambda f: (abs(math.log(f.group_size / p)), f.group_size))


def _fit(entries: list[Mapping[str, Any]]) -> tuple[float, float]:
    """(α seconds, seconds per ring byte) from entries of one collective kind and size."""
    pts = []
    for e in entries:
        seconds = float(e["seconds"])
        moved = float(e["busbw_gbps"]) * 1e9 * seconds
        pts.append((moved, seconds))
    sizes = {round(m) for m, _ in pts}
    if len(sizes) < 2:
        moved = sum(m for m, _ in pts)
        seconds = sum(s for _, s in pts)
        return 0.0, seconds / moved if moved > 0 else 0.0
    n = len(pts)
    mx = sum(m for m, _ in pts) / n
    my = sum(s for _, s in pts) / n
    var = sum((m - mx) ** 2 for m, _ in pts)
    slope = sum((m - mx) * (s - my) for m, s in pts) / var
    slope = max(slope, 0.0)
    alpha = max(my - slope * mx, 0.0)
    return alpha, slope


_ENTRY_KEYS = ("group_size", "intra_node", "kind", "seconds", "busbw_gbps")


def load_bandwidth_table(paths: str | Path | Iterable[str | Path]) -> tuple[BandwidthFit, ...]:
    """Read one or more measured bandwidth tables (the JSON of ``gnnpar info --check
    --out``) and fit each (placement, collective, group size); see the module docstring."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    groups: dict[tuple[bool, str, int], list[Mapping[str, Any]]] = {}
    for path in paths:
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise PlanError(f"bandwidth table {path} does not exist") from None
        except json.JSONDecodeError as e:
            raise PlanError(f"bandwidth table {path} is not JSON: {e}") from None
        if not isinstance(doc, dict) or doc.get("schema") != 1:
            raise PlanError(
                f"bandwidth table {path} is not a schema-1 table from `gnnpar info --check --json`"
            )
        entries = doc.get("entries")
        if not isinstance(entries, list):
            raise PlanError(f"bandwidth table {path} has no 'entries' list")
        for i, e in enumerate(entries):
            missing = [k for k in _ENTRY_KEYS if not isinstance(e, dict) or k not in e]
            if missing:
                raise PlanError(f"bandwidth table {path}: entry {i} lacks {', '.join(missing)}")
            if float(e["seconds"]) <= 0 or float(e["busbw_gbps"]) <= 0:
                raise PlanError(f"bandwidth table {path}: entry {i} has a non-positive time")
            key = (bool(e["intra_node"]), str(e["kind"]), int(e["group_size"]))
            groups.setdefault(key, []).append(e)
    fits = []
    for (intra, kind, p), entries in sorted(groups.items()):
        alpha, spb = _fit(entries)
        fits.append(BandwidthFit(intra, kind, p, alpha, spb))
    return tuple(fits)


def _physical_memory_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError, AttributeError):
        return 8.0


def local_machine(backend: str = "gloo", devices: int | None = None) -> Machine:
    """This machine: the CPU box for gloo (all ranks on one node, sharing its cores; its
    device memory is the RAM), or a node of ``devices`` (default: ``LOCAL_WORLD_SIZE``)
    A100-class GPUs for NCCL, with this machine's RAM as its host memory."""
    if backend == "nccl":
        n = devices or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return dataclasses.replace(
            builtin_machines()["a100x4-80"],
            name="local-gpu",
            devices_per_node=max(1, n),
            host_memory_gb=round(_physical_memory_gb(), 1),
        )
    cores = devices or os.cpu_count() or 1
    return Machine(
        name="cpu",
        description=f"this machine: {cores} CPU cores, gloo over loopback, one node",
        devices_per_node=cores,
        memory_gb=round(_physical_memory_gb(), 1),
        intra=Link(gbps=1.0, latency_us=100.0),
        inter=Link(gbps=1.0, latency_us=100.0),
        peak_tflops=0.05,
        gemm_tflops=0.02,
        spmm_gflops=0.5,
        mem_gbps=5.0,
        single_node=True,
        assumptions=(
            "defaults are rough guesses (1 GB/s and 100 us per ring step for gloo, "
            "20 GFLOP/s GEMM and 0.5 GFLOP/s SpMM per core); attach a table from "
            "`gnnpar info --check --json FILE` (and calibrate the rates) for real numbers"
        ),
    )


def builtin_machines() -> Mapping[str, Machine]:
    """The built-in machines by name (a read-only mapping built on each call)."""
    a100 = Machine(
        name="a100x4",
        description="4x A100-40GB per node, NVLink 200 GB/s, 25 GB/s per GPU between nodes",
        devices_per_node=4,
        memory_gb=40.0,
        intra=Link(gbps=200.0, latency_us=5.0),
        inter=Link(gbps=25.0, latency_us=10.0),
        peak_tflops=312.0,
        gemm_tflops=0.6 * 312.0,
        spmm_gflops=300.0,
        mem_gbps=1555.0,
        assumptions=(
            "bandwidths from the issue (NVLink3 bus bandwidth, one 25 GB/s NIC per GPU); "
            "312 TFLOP/s bf16 peak (data sheet), GEMMs at 60% of it; SpMM 300 GFLOP/s and "
            "ring-step latencies 5/10 us are assumptions; 256 GB of host memory per node, "
            "as a Perlmutter GPU node (NERSC's Perlmutter architecture page)"
        ),
        host_memory_gb=256.0,
    )
    h100 = Machine(
        name="h100x8",
        description="8x H100-80GB per node, NVLink ~450 GB/s, 50 GB/s per GPU between nodes",
        devices_per_node=8,
        memory_gb=80.0,
        intra=Link(gbps=450.0, latency_us=4.0),
        inter=Link(gbps=50.0, latency_us=8.0),
        peak_tflops=990.0,
        gemm_tflops=0.6 * 990.0,
        spmm_gflops=600.0,
        mem_gbps=3350.0,
        assumptions=(
            "NVLink4 all-reduce bus bandwidth ~450 GB/s and one 400 Gb/s NIC per GPU; "
            "990 TFLOP/s bf16 dense peak (data sheet), GEMMs at 60%; SpMM 600 GFLOP/s and "
            "latencies are assumptions; 2 TB of host memory per node (DGX H100 data sheet)"
        ),
        host_memory_gb=2000.0,
    )
    perlmutter = dataclasses.replace(
        a100,
        name="perlmutter",
        description="Perlmutter GPU node: 4x A100-80GB, Slingshot-11 (25 GB/s per GPU)",
        memory_gb=80.0,
        mem_gbps=2039.0,
        assumptions="as a100x4, with the 80 GB nodes Plexus ran on (hbm80g; 256 GB of host "
        "memory, NERSC's Perlmutter architecture page)",
    )
    frontier = Machine(
        name="frontier",
        description="Frontier node: 8 MI250X GCDs of 64 GB, 4x 25 GB/s NICs per node",
        devices_per_node=8,
        memory_gb=64.0,
        intra=Link(gbps=50.0, latency_us=6.0),
        inter=Link(gbps=12.5, latency_us=12.0),
        peak_tflops=191.5,
        gemm_tflops=0.5 * 191.5,
        spmm_gflops=200.0,
        mem_gbps=1600.0,
        assumptions=(
            "191.5 TFLOP/s bf16 per GCD (383 per MI250X), GEMMs at 50%; 50 GB/s Infinity "
            "Fabric between GCDs and 100 GB/s of NICs per node shared by 8 GCDs; SpMM rate "
            "and latencies are assumptions; 512 GB of DDR4 host memory per node (OLCF's "
            "Frontier user guide)"
        ),
        host_memory_gb=512.0,
    )
    machines = {
        "cpu": local_machine("gloo"),
        "a100x4": a100,
        "a100x4-80": dataclasses.replace(
            a100,
            name="a100x4-80",
            memory_gb=80.0,
            mem_gbps=2039.0,
            description="4x A100-80GB per node, NVLink 200 GB/s, 25 GB/s per GPU between nodes",
        ),
        "h100x8": h100,
        "perlmutter": perlmutter,
        "frontier": frontier,
    }
    return MappingProxyType(machines)


def get_machine(name: str, bandwidth: str | Path | Iterable[str | Path] | None = None) -> Machine:
    """A built-in machine by name, or a bandwidth-table file (the CPU box with that table);
    ``bandwidth`` attaches measured tables to the chosen machine."""
    machines = builtin_machines()
    if name in machines:
        machine = machines[name]
    elif name.endswith(".json") or Path(name).is_file():
        machine = machines["cpu"]
        bandwidth = [name, *([] if bandwidth is None else _as_list(bandwidth))]
    else:
        raise PlanError(
            f"unknown machine {name!r}; built-in machines: {', '.join(machines)} "
            "(or a bandwidth table from `gnnpar info --check --json FILE`)"
        )
    if bandwidth is not None:
        machine = machine.with_table(load_bandwidth_table(bandwidth))
    return machine


def _as_list(paths: str | Path | Iterable[str | Path]) -> list[str | Path]:
    return [paths] if isinstance(paths, (str, Path)) else list(paths)
