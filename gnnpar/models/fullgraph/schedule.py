"""The collectives a distributed full-graph layer performs: one description per layer kind.

Each distributed layer (:mod:`gnnpar.models.fullgraph.plexus` for 3D,
:mod:`gnnpar.models.fullgraph.cagnet` for
1D and 2D) lists the collectives one forward and one backward pass of it perform as
:class:`Step` s: the axis, the collective kind, the group size and the element count of the
full (padded) buffer. Everything that needs those bytes computes them from these steps:

- the layers' own accounting (``expected_bytes()`` of the parallel models), which the tests
  hold the measured traffic against;
- the planner's communication model (:func:`gnnpar.models.fullgraph.cost.gcn_collectives`).

So a layer's formulas are written once, beside the code that sends the bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from gnnpar.comm import ring_bytes

PHASES = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class Step:
    """One collective of one pass, as one rank performs it.

    ``elements`` counts the full buffer the ring formula prices (pieces that do not divide
    padded to the largest, as the collectives send them); ``itemsize`` is the bytes of one
    element, 0 for the compute dtype's (the activations, weights and their gradients)."""

    phase: str
    axis: str
    kind: str
    group: int
    elements: int
    what: str
    itemsize: int = 0

    def nbytes(self, element_size: int) -> float:
        """Per-rank ring bytes of this collective with ``element_size``-byte values."""
        size = self.itemsize or element_size
        return ring_bytes(self.kind, self.elements * size, self.group)


def step(
    phase: str, axis: str, kind: str, group: int, elements: int, what: str, itemsize: int = 0
) -> list[Step]:
    """``[Step]``, or ``[]`` for a group of one rank (such a collective moves nothing and is
    not recorded)."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if group <= 1:
        return []
    return [Step(phase, axis, kind, group, int(elements), what, itemsize)]


def bytes_by_phase(steps: Iterable[Step], element_size: int) -> dict[str, dict[str, float]]:
    """``{"forward": {axis: bytes}, "backward": {axis: bytes}}`` of ``steps`` (unrounded)."""
    out: dict[str, dict[str, float]] = {p: {} for p in PHASES}
    for s in steps:
        d = out[s.phase]
        d[s.axis] = d.get(s.axis, 0.0) + s.nbytes(element_size)
    return out
