"""Device memory of one rank during training: the parts every workload's memory model shares
(the full-graph GNN's :func:`gnnpar.models.fullgraph.memory.gcn_memory`, the GPT's
:func:`gnnpar.models.gpt.memory.gpt_memory`, the mini-batch GNN's
:func:`gnnpar.models.minibatch.cost.minibatch_memory`).

- :func:`sharded_state`: ``parameters`` (e each), ``gradients`` (e each), ``optimizer``
  (Adam's two moments in float32, plus float32 master weights when e < 4); the data-axis
  ``stage`` divides the optimizer state (≥ 1), the gradients (≥ 2) and the parameters (3) by
  the data size, as :mod:`gnnpar.shard` does. Stages 1–2 also hold this rank's float32
  master chunk (a copy even when e = 4) and its reduced float32 gradient chunk, and stage 1
  keeps the full gradient buffers. Stage 3 holds ``1 + prefetch_depth`` gathered units (the
  running one and the ``prefetch_depth`` whose gathers started ahead; 2 at the default depth
  1) and, in backward, one unit's full gradient before its reduce-scatter. For ``n``
  parameters, ``d`` data ranks, ``P`` the parameters of the largest unit and ``D`` the
  prefetch depth::

      stage  parameters             gradients                optimizer
      0      n·e                    n·e                      n·(8 + 4·[e<4])
      1      n·e                    n·e + 4n/d               n·(8 + 4)/d
      2      n·e                    4n/d                     n·(8 + 4)/d
      3      n·e/d + (1 + D)·P·e    n·e/d + P·e              n·(8 + 4·[e<4])/d

  The offload tiers (``host``, ``file``) move parts of this off the device; the GPT's model
  applies them (:mod:`gnnpar.models.gpt.memory`, whose docstring has the formulas);
- :func:`shm_segments`: the same-host shared-memory segments a rank maps for its groups;
- :func:`device_bytes`: a breakdown's device memory (offloaded parts, :data:`OFF_DEVICE`,
  are not);
- :func:`memory_shortfall`: whether a breakdown fits a machine: its device parts in
  ``USABLE_FRACTION`` of the device memory, and, where the machine states its host memory
  (:attr:`~gnnpar.plan.machines.Machine.host_memory_gb`), the ``host`` part of every rank of
  a node in the same fraction of it (``ranks_per_node · host ≤ 0.9 · host_memory_gb``).
  ``file`` bytes are page cache, which the kernel writes back and evicts: never counted.

Not counted: allocator fragmentation, communication buffers, the CUDA context (about 0.5–1
GB per GPU). The planner keeps 10% of device memory free for them (``usable``).
"""

from __future__ import annotations

from collections.abc import Mapping

from gnnpar import shm
from gnnpar.comm import ring_bytes
from gnnpar.plan.comm_model import Collective
from gnnpar.plan.machines import Machine

__all__ = [
    "OFF_DEVICE",
    "USABLE_FRACTION",
    "device_bytes",
    "memory_shortfall",
    "sharded_state",
    "shm_segments",
]

#: Fraction of device memory the planner lets a shape use.
USABLE_FRACTION = 0.9


#: Parts of a memory breakdown that are not device memory (the offload tiers).
OFF_DEVICE = ("host", "file")


def device_bytes(parts: Mapping[str, float]) -> float:
    """The device memory of a breakdown: every part but the offloaded ones."""
    return sum(v for k, v in parts.items() if k not in OFF_DEVICE)


def memory_shortfall(parts: Mapping[str, float], machine: Machine, world: int) -> str:
    """Why one rank's ``parts`` do not fit ``machine`` in a world of ``world`` ranks, or
    ``""`` when they do: the device parts (:func:`device_bytes`) against
    :data:`USABLE_FRACTION` of ``memory_gb``; the ``host`` part of the node's ranks
    (``machine.ranks_per_node(world)`` of them) against the same fraction of
    ``host_memory_gb`` when the machine gives one (None: the host is the device memory, as
    on the CPU box, and only the device parts are checked, as before)."""
    need = device_bytes(parts)
    if need > USABLE_FRACTION * machine.memory_gb * 1e9:
        return f"needs {need / 1e9:.1f} GB of {machine.memory_gb:g} GB"
    host = parts.get("host", 0.0) * machine.ranks_per_node(world)
    if machine.host_memory_gb is not None and host > USABLE_FRACTION * machine.host_memory_gb * 1e9:
        return f"needs {host / 1e9:.1f} GB of host memory of {machine.host_memory_gb:g} GB a node"
    return ""


def shm_segments(collectives: list[Collective]) -> int:
    """Bytes of the same-host shared-memory segments a rank maps for these collectives
    (:func:`gnnpar.shm.segment_bytes`): one per axis, as large as its largest need."""
    per_axis: dict[str, int] = {}
    for c in collectives:
        ring = ring_bytes(c.kind, 1.0, c.group)
        need = shm.segment_bytes(c.kind, c.nbytes / ring, c.group) if ring else 0
        per_axis[c.axis] = max(per_axis.get(c.axis, 0), need)
    return sum(per_axis.values())


def sharded_state(
    n: float, e: int, stage: int, d: int, per_unit: float, prefetch_depth: int = 1
) -> dict[str, float]:
    """``parameters``, ``gradients`` and ``optimizer`` bytes of ``n`` parameters of ``e``
    bytes trained with Adam on ``d`` data ranks at ZeRO ``stage`` (:mod:`gnnpar.shard`; see
    the module docstring); ``per_unit``: the parameters of the largest unit stage 3 gathers;
    ``prefetch_depth``: the units whose gathers stage 3 starts ahead of the running one."""
    out = {"parameters": float(n * e), "gradients": float(n * e)}
    out["optimizer"] = float(n * (8 + (4 if e < 4 else 0)))
    if stage >= 1:
        out["optimizer"] /= d
    if stage in (1, 2):
        # the master chunk the optimizer steps (a separate float32 copy even when the
        # parameters are float32) and the reduced float32 gradient chunk it reads
        if e >= 4:
            out["optimizer"] += n * 4 / d
        out["gradients"] = (n * e if stage == 1 else 0.0) + n * 4 / d
    if stage >= 3:
        # the chunk plus 1 + prefetch_depth gathered units (the one running and those
        # prefetched); in backward a unit's full gradient lives until its reduce-scatter
        out["parameters"] = n * e / d + (1 + prefetch_depth) * per_unit * e
        out["gradients"] = n * e / d + per_unit * e
    return out
