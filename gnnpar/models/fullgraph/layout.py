"""Where each piece of a 3D full-graph layer lives (Plexus layout), for any rank.

For layer ℓ the axis roles (outer, inner, depth) rotate with ℓ mod 3:
(x, y, z) → (z, x, y) → (y, z, x). With roles (a, b, c) and a layer of width D → D′ on N nodes:

- Â shard: rows chunk ``c`` of N × columns chunk ``a`` of N            (N/c × N/a)
- H shard: rows chunk ``a`` of N × features chunk ``b`` of D           (N/a × D/b);
  the first layer's input is further split by rows over ``c`` and all-gathered
- W shard: rows chunk ``b`` of D × columns chunk ``a`` of D′, flattened and split over ``c``
- output:  rows chunk ``c`` of N × columns chunk ``a`` of D′           (N/c × D′/a)

The output of layer ℓ is exactly the input layout of layer ℓ+1. Sizes that do not divide use
balanced chunks (:func:`gnnpar.comm.chunk_sizes`: the first ranks get one more); that is the
one padding rule, and collectives pad uneven pieces to the largest for transfer.
"""

from __future__ import annotations

import dataclasses

from gnnpar.comm import chunk_offsets, chunk_sizes
from gnnpar.grid import GridShape, ProcessGrid

ROLES: tuple[tuple[str, str, str], ...] = (("x", "y", "z"), ("z", "x", "y"), ("y", "z", "x"))


def roles(layer: int) -> tuple[str, str, str]:
    """(outer, inner, depth) axes of ``layer``."""
    return ROLES[layer % 3]


def chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` of ``n`` items split into ``parts``."""
    sizes = chunk_sizes(n, parts)
    start = chunk_offsets(sizes)[index]
    return start, start + sizes[index]


@dataclasses.dataclass(frozen=True)
class Layout3D:
    """The pieces of one 3D layer held by the rank at ``coords``."""

    layer: int
    outer: str
    inner: str
    depth: str
    rows: tuple[int, int]  # Â rows and output rows (global node positions)
    cols: tuple[int, int]  # Â columns and input rows
    fin: tuple[int, int]  # input features
    fout: tuple[int, int]  # output features
    h_sub_sizes: list[int]  # input rows split over depth (first layer)
    h_sub: tuple[int, int]  # this rank's input rows when split over depth (global)
    w_sizes: list[int]  # flattened weight block split over depth
    w_part: tuple[int, int]  # this rank's range of the flattened weight block

    @property
    def w_block_shape(self) -> tuple[int, int]:
        """Shape of the (gathered) weight block, per operator."""
        return (self.fin[1] - self.fin[0], self.fout[1] - self.fout[0])


def layout3d(
    grid: ProcessGrid | GridShape,
    layer: int,
    n: int,
    d_in: int,
    d_out: int,
    num_ops: int = 1,
    coords: dict[str, int] | None = None,
) -> Layout3D:
    """Layout of ``layer`` (N = ``n`` nodes, ``d_in`` → ``d_out`` features, ``num_ops`` sparse
    operators stacked along the input features) on the rank at ``coords`` (default: this)."""
    a, b, c = roles(layer)
    coords = grid.coords() if coords is None else coords
    size = grid.shape
    rows = chunk(n, size[c], coords[c])
    cols = chunk(n, size[a], coords[a])
    fin = chunk(d_in, size[b], coords[b])
    fout = chunk(d_out, size[a], coords[a])
    h_sub_sizes = chunk_sizes(cols[1] - cols[0], size[c])
    sub = chunk(cols[1] - cols[0], size[c], coords[c])
    w_numel = num_ops * (fin[1] - fin[0]) * (fout[1] - fout[0])
    w_sizes = chunk_sizes(w_numel, size[c])
    return Layout3D(
        layer=layer,
        outer=a,
        inner=b,
        depth=c,
        rows=rows,
        cols=cols,
        fin=fin,
        fout=fout,
        h_sub_sizes=h_sub_sizes,
        h_sub=(cols[0] + sub[0], cols[0] + sub[1]),
        w_sizes=w_sizes,
        w_part=chunk(w_numel, size[c], coords[c]),
    )
