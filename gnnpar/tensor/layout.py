"""Where each piece of a sharded parameter lives on the grid (pure functions, no communication).

A :class:`ShardLayout` describes how one full tensor is cut over the tensor-parallel axes of a
:class:`~gnnpar.grid.ProcessGrid`. Two kinds exist:

``matrix`` (the weight of :class:`~gnnpar.tensor.Linear` and :class:`~gnnpar.tensor.Embedding`)
    A full ``rows × cols`` matrix. Rows are split over ``row_axis`` and columns over
    ``col_axis`` with :func:`~gnnpar.comm.chunk_sizes` (balanced; the first ranks get one more
    when a size does not divide). The local ``r × c`` block is flattened, padded with zeros to
    a multiple of ``depth`` (the size of the z axis) and split into ``depth`` equal pieces, one
    per z rank. A rank therefore stores ``ceil(r·c / depth)`` numbers: ``1/(x·y·z)`` of the
    matrix up to one row and one column of imbalance over x and y, and fewer than ``depth``
    padding zeros. The padding always stays zero (its gradient is zero).

``vector`` (biases)
    A full vector of ``rows`` entries split over ``row_axis`` only; replicated over the other
    axes.

``fused`` splits the rows of a matrix (or the entries of a vector) into ``fused`` equal parts
first and chunks each part over ``row_axis`` separately; a rank's rows are the concatenation of
its chunk of every part. A fused query/key/value projection (``3·d`` outputs) thus gives each
rank whole heads of q, k and v, in that order, so ``chunk(3, dim=-1)`` still separates them.

Layouts are plain data: they travel in checkpoints (:meth:`to_dict`) and reassemble full
tensors offline (:meth:`assemble`) with no process group.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from gnnpar.comm import chunk_offsets, chunk_sizes
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid

__all__ = ["ShardLayout"]

KINDS = ("matrix", "vector")
TENSOR_AXES = ("x", "y", "z")


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How one full tensor is split over the grid; see the module docstring.

    ``row_parts``, ``col_parts`` and ``depth`` are the sizes of ``row_axis``, ``col_axis`` and
    z on the grid the layout was made for.
    """

    kind: str
    shape: tuple[int, ...]
    row_axis: str
    col_axis: str | None
    row_parts: int
    col_parts: int
    depth: int
    fused: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"layout kind must be one of {KINDS}, got {self.kind!r}")
        want = 2 if self.kind == "matrix" else 1
        if len(self.shape) != want:
            raise ValueError(f"a {self.kind} layout needs a {want}-D shape, got {self.shape}")
        rows = self.shape[0]
        if self.fused < 1 or rows % self.fused:
            raise ValueError(f"{rows} rows cannot be fused into {self.fused} equal parts")
        if rows // self.fused < self.row_parts:
            raise UserError(
                f"cannot split {rows // self.fused} rows"
                + (f" (per fused part of {self.fused})" if self.fused > 1 else "")
                + f" over {self.row_axis}={self.row_parts}: some ranks would hold none; "
                "use a smaller axis or leave this module out of the plan"
            )
        if self.kind == "matrix" and self.shape[1] < self.col_parts:
            raise UserError(
                f"cannot split {self.shape[1]} columns over {self.col_axis}={self.col_parts}: "
                "some ranks would hold none; use a smaller axis or leave this module out"
            )

    # ----------------------------------------------------------------------- construction
    @classmethod
    def matrix(
        cls,
        rows: int,
        cols: int,
        grid: ProcessGrid,
        row_axis: str,
        col_axis: str,
        fused: int = 1,
    ) -> ShardLayout:
        """A ``rows × cols`` matrix: rows over ``row_axis``, columns over ``col_axis``, the
        local block flattened over z."""
        return cls(
            "matrix",
            (rows, cols),
            row_axis,
            col_axis,
            grid.size(row_axis),
            grid.size(col_axis),
            grid.size("z"),
            fused,
        )

    @classmethod
    def vector(cls, rows: int, grid: ProcessGrid, row_axis: str, fused: int = 1) -> ShardLayout:
        """A vector of ``rows`` entries split over ``row_axis``."""
        return cls("vector", (rows,), row_axis, None, grid.size(row_axis), 1, 1, fused)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready form (see :meth:`from_dict`)."""
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShardLayout:
        """Inverse of :meth:`to_dict`."""
        return cls(**{**d, "shape": tuple(d["shape"])})

    # ------------------------------------------------------------------------- geometry
    @property
    def split_axes(self) -> tuple[str, ...]:
        """Tensor axes over which ranks hold different pieces (axes of size one included)."""
        if self.kind == "vector":
            return (self.row_axis,)
        return (self.row_axis, self.col_axis, "z")

    @property
    def numel(self) -> int:
        """Entries of the full tensor."""
        return math.prod(self.shape)

    def row_sizes(self) -> list[int]:
        """Rows held by each index along ``row_axis``."""
        per_part = chunk_sizes(self.shape[0] // self.fused, self.row_parts)
        return [self.fused * s for s in per_part]

    def col_sizes(self) -> list[int]:
        """Columns held by each index along ``col_axis`` (``[1]`` for a vector)."""
        if self.kind == "vector":
            return [1]
        return chunk_sizes(self.shape[1], self.col_parts)

    def row_index(self, r: int) -> torch.Tensor:
        """Full-tensor row numbers held by index ``r`` along ``row_axis``, in local order."""
        part = self.shape[0] // self.fused
        sizes = chunk_sizes(part, self.row_parts)
        start = chunk_offsets(sizes)[r]
        return torch.cat(
            [torch.arange(f * part + start, f * part + start + sizes[r]) for f in range(self.fused)]
        )

    def row_order(self) -> torch.Tensor:
        """For rows gathered in rank order (rank 0's local rows, then rank 1's, ...), the
        position of each full row: ``gathered.index_select(0, row_order())`` is the full
        tensor. The identity when ``fused == 1``."""
        where = torch.cat([self.row_index(r) for r in range(self.row_parts)])
        return torch.argsort(where)

    def col_range(self, c: int) -> tuple[int, int]:
        """(start, size) of the columns held by index ``c`` along ``col_axis``."""
        sizes = self.col_sizes()
        return chunk_offsets(sizes)[c], sizes[c]

    def block_shape(self, r: int, c: int = 0) -> tuple[int, ...]:
        """Shape of the local block of index ``r`` along rows and ``c`` along columns."""
        if self.kind == "vector":
            return (self.row_sizes()[r],)
        return (self.row_sizes()[r], self.col_sizes()[c])

    def shard_numel(self, r: int, c: int = 0) -> int:
        """Entries this rank stores (padding included)."""
        n = math.prod(self.block_shape(r, c))
        return n if self.kind == "vector" else -(-n // self.depth)

    def coords(self, grid: ProcessGrid) -> tuple[int, int, int]:
        """(row index, column index, z index) of this rank of ``grid``."""
        if self.kind == "vector":
            return grid.rank(self.row_axis), 0, 0
        return grid.rank(self.row_axis), grid.rank(self.col_axis), grid.rank("z")

    def check_grid(self, grid: ProcessGrid) -> None:
        """Raise ValueError if ``grid`` has axis sizes other than those the layout was made
        for."""
        want = (self.row_parts, self.col_parts if self.kind == "matrix" else 1)
        got = (
            grid.size(self.row_axis),
            grid.size(self.col_axis) if self.kind == "matrix" else 1,
        )
        depth = grid.size("z") if self.kind == "matrix" else 1
        if want != got or depth != self.depth:
            raise ValueError(
                f"layout made for {self.row_axis}={self.row_parts}, "
                f"{self.col_axis}={self.col_parts}, z={self.depth} does not fit "
                f"{grid.describe()}"
            )

    # --------------------------------------------------------------------- full ↔ pieces
    def block(self, full: torch.Tensor, r: int, c: int = 0) -> torch.Tensor:
        """The local block of a full tensor (before the z split)."""
        if tuple(full.shape) != self.shape:
            raise ValueError(
                f"expected a full tensor of shape {self.shape}, got {tuple(full.shape)}"
            )
        rows = full.index_select(0, self.row_index(r).to(full.device))
        if self.kind == "vector":
            return rows
        start, size = self.col_range(c)
        return rows[:, start : start + size]

    def shard(self, full: torch.Tensor, r: int, c: int = 0, d: int = 0) -> torch.Tensor:
        """What the rank at (``r``, ``c``, ``d``) stores of ``full`` (a new contiguous tensor)."""
        if tuple(full.shape) != self.shape:
            raise ValueError(
                f"expected a full tensor of shape {self.shape}, got {tuple(full.shape)}"
            )
        full = full.detach()
        out = torch.empty(self.shard_numel(r, c), dtype=full.dtype, device=full.device)
        return self.read_piece(full.__getitem__, out, r, c, d)

    def read_piece(
        self,
        read: Callable[[tuple[slice, ...]], torch.Tensor],
        out: torch.Tensor,
        r: int,
        c: int = 0,
        d: int = 0,
        transposed: bool = False,
    ) -> torch.Tensor:
        """Fill ``out`` (flat, :meth:`shard_numel` entries) with what the rank at (``r``,
        ``c``, ``d``) stores, reading the full tensor box by box: ``read(slices)`` returns
        ``full[slices]`` (a tensor, a memory map, a safetensors slice, ...), so only this
        piece's boxes are ever read. With ``transposed`` the full tensor is stored transposed
        (GPT-2's ``Conv1D``). Padding is zeroed; returns ``out``. The boxes are
        :meth:`chunks`', the one description of where a piece lies."""
        if out.dim() != 1 or out.numel() != self.shard_numel(r, c):
            raise ValueError(
                f"a piece of this layout has {self.shard_numel(r, c)} entries, got a tensor "
                f"of shape {tuple(out.shape)}"
            )
        covered = 0
        for ch in self.chunks("", r, c, d, transposed):
            box = read(tuple(slice(o, o + n) for o, n in zip(ch.offsets, ch.sizes, strict=True)))
            ch.view(out).copy_(box)
            covered = max(covered, ch.at + ch.numel)
        out[covered:].zero_()  # padding (chunks cover the front of a piece contiguously)
        return out

    def chunks(self, key: str, r: int, c: int = 0, d: int = 0, transposed: bool = False):
        """Where the piece of the rank at (``r``, ``c``, ``d``) lies in the full tensor
        ``key``: :class:`~gnnpar.checkpoint.chunks.Chunk` s over the piece's flat elements
        (padding holds none). With ``transposed`` the full tensor is stored transposed (the
        ``in_out`` format of GPT-2's ``Conv1D``)."""
        from gnnpar.checkpoint.chunks import concat

        part = self.shape[0] // self.fused
        start = chunk_offsets(chunk_sizes(part, self.row_parts))[r]
        rows = [(f * part + start, self.row_sizes()[r] // self.fused) for f in range(self.fused)]
        if self.kind == "vector":
            return concat([(key, (r0,), (n,)) for r0, n in rows])
        c0, cn = self.col_range(c)
        if transposed:
            boxes = [(key, (c0, r0), (cn, n)) for r0, n in rows]
        else:
            boxes = [(key, (r0, c0), (n, cn)) for r0, n in rows]
        n = self.shard_numel(r, c)
        return concat(boxes, d * n, (d + 1) * n, transposed=transposed)

    def unflatten(self, gathered: torch.Tensor, r: int, c: int = 0) -> torch.Tensor:
        """The ``r × c`` block from its z pieces concatenated (padding dropped), as a view."""
        shape = self.block_shape(r, c)
        return gathered[: math.prod(shape)].view(shape)

    def assemble(self, pieces: Mapping[tuple[int, int, int], torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's stored piece, keyed by (row, col, z) index."""
        blocks_rows = []
        for r in range(self.row_parts):
            cols = []
            for c in range(self.col_parts if self.kind == "matrix" else 1):
                if self.kind == "vector":
                    cols.append(pieces[(r, 0, 0)])
                    continue
                flat = torch.cat([pieces[(r, c, d)] for d in range(self.depth)])
                cols.append(self.unflatten(flat, r, c))
            blocks_rows.append(cols[0] if self.kind == "vector" else torch.cat(cols, dim=1))
        gathered = torch.cat(blocks_rows, dim=0)
        return gathered.index_select(0, self.row_order()) if self.fused > 1 else gathered
