"""Choosing grid shapes from communication models (the planner's full-graph part).

:func:`fullgraph_epoch_bytes` sums, over the layers of a 3D full-graph GCN, the per-rank bytes
of :func:`gnnpar.sparse.plexus.layer_bytes` for the busiest rank (rank 0 holds the largest
chunks); :func:`choose_fullgraph_grid` ranks every x·y·z factorisation of the world by it.
"""

from __future__ import annotations

from gnnpar.comm import ring_bytes
from gnnpar.grid import GridShape, factorizations
from gnnpar.sparse.layout import layout3d
from gnnpar.sparse.plexus import layer_bytes


def fullgraph_epoch_bytes(
    shape: dict[str, int],
    num_nodes: int,
    dims: list[int],
    num_ops: int = 1,
    element_size: int = 4,
    bias: bool = True,
) -> dict[str, float]:
    """Bytes per axis that rank 0 moves in one training epoch (forward + backward) of a 3D
    full-graph model with feature widths ``dims`` (and biases, whose gradients are summed
    over the depth axis)."""
    g = GridShape(**shape)
    total: dict[str, float] = {"x": 0.0, "y": 0.0, "z": 0.0}
    for i in range(len(dims) - 1):
        lay = layout3d(g, i, num_nodes, dims[i], dims[i + 1], num_ops)
        part = layer_bytes(g, lay, num_ops, i == 0, i > 0, element_size)
        for k, v in part.items():
            total[k] += v
        if bias:
            width = (lay.fout[1] - lay.fout[0]) * element_size
            total[lay.depth] += ring_bytes("all_reduce", width, g.size(lay.depth))
    return total


def choose_fullgraph_grid(
    world: int, num_nodes: int, dims: list[int], num_ops: int = 1
) -> dict[str, int]:
    """The x·y·z shape (data=1) with the fewest bytes per epoch; ties go to the shape whose
    busiest axis moves least, then to x before y before z."""
    best = None
    for data, x, y, z in factorizations(world):
        if data != 1:
            continue
        shape = {"x": x, "y": y, "z": z}
        b = fullgraph_epoch_bytes(shape, num_nodes, dims, num_ops)
        key = (sum(b.values()), max(b.values()), -x, -y)
        if best is None or key < best[0]:
            best = (key, shape)
    return best[1]
