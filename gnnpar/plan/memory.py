"""Device memory of one rank during training: the parts every workload's memory model shares
(the full-graph GNN's :func:`gnnpar.models.fullgraph.memory.gcn_memory`, the GPT's
:func:`gnnpar.models.gpt.memory.gpt_memory`, the mini-batch GNN's
:func:`gnnpar.models.minibatch.cost.minibatch_memory`).

- :func:`sharded_state`: ``parameters`` (e each), ``gradients`` (e each), ``optimizer``
  (Adam's two moments in float32, plus float32 master weights when e < 4); the data-axis
  ``stage`` divides the optimizer state (≥ 1), the gradients (≥ 2) and the parameters (3, plus
  two gathered blocks — the running one and the prefetched next — and one block's full
  gradient before its reduce-scatter) by the data size, as :mod:`gnnpar.shard` does. Stages
  1–2 also hold this rank's float32 master chunk (a copy even when e = 4) and its reduced
  float32 gradient chunk, and stage 1 keeps the full gradient buffers;
- :func:`shm_segments`: the same-host shared-memory segments a rank maps for its groups;
- :func:`device_bytes`: a breakdown's device memory (offloaded parts, :data:`OFF_DEVICE`,
  are not).

Not counted: allocator fragmentation, communication buffers, the CUDA context (about 0.5–1
GB per GPU). The planner keeps 10% of device memory free for them (``usable``).
"""

from __future__ import annotations

from collections.abc import Mapping

from gnnpar import shm
from gnnpar.comm import ring_bytes
from gnnpar.plan.comm_model import Collective

__all__ = ["OFF_DEVICE", "USABLE_FRACTION", "device_bytes", "sharded_state", "shm_segments"]

#: Fraction of device memory the planner lets a shape use.
USABLE_FRACTION = 0.9


#: Parts of a memory breakdown that are not device memory (the offload tiers).
OFF_DEVICE = ("host", "file")


def device_bytes(parts: Mapping[str, float]) -> float:
    """The device memory of a breakdown: every part but the offloaded ones."""
    return sum(v for k, v in parts.items() if k not in OFF_DEVICE)


def shm_segments(collectives: list[Collective]) -> int:
    """Bytes of the same-host shared-memory segments a rank maps for these collectives
    (:func:`gnnpar.shm.segment_bytes`): one per axis, as large as its largest need."""
    per_axis: dict[str, int] = {}
    for c in collectives:
        ring = ring_bytes(c.kind, 1.0, c.group)
        need = shm.segment_bytes(c.kind, c.nbytes / ring, c.group) if ring else 0
        per_axis[c.axis] = max(per_axis.get(c.axis, 0), need)
    return sum(per_axis.values())


def sharded_state(n: float, e: int, stage: int, d: int, per_unit: float) -> dict[str, float]:
    """``parameters``, ``gradients`` and ``optimizer`` bytes of ``n`` parameters of ``e``
    bytes trained with Adam on ``d`` data ranks at ZeRO ``stage`` (:mod:`gnnpar.shard`; see
    the module docstring); ``per_unit``: the parameters of the largest unit stage 3 gathers."""
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
        # the chunk plus two gathered units (the one running and the next, prefetched); in
        # backward a unit's full gradient lives until its reduce-scatter
        out["parameters"] = n * e / d + 2 * per_unit * e
        out["gradients"] = n * e / d + per_unit * e
    return out
