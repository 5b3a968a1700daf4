"""CSR pieces as plain tensors: build, slice by rows and columns, transpose.

A block is ``(indptr, indices, values, shape)`` with int64 ``indptr`` and ``indices``. These
helpers never materialise a dense matrix.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class CSRBlock:
    """One block of a sparse matrix in CSR form, with its place in the global matrix."""

    indptr: torch.Tensor
    indices: torch.Tensor
    values: torch.Tensor
    shape: tuple[int, int]
    row_offset: int = 0
    col_offset: int = 0

    @property
    def nnz(self) -> int:
        """Number of stored nonzeros."""
        return int(self.indices.numel())

    def nbytes(self) -> int:
        """Bytes held by the three arrays."""
        return sum(t.numel() * t.element_size() for t in (self.indptr, self.indices, self.values))

    def to(self, dtype: torch.dtype | None = None, device: torch.device | None = None) -> CSRBlock:
        """The same block with values of ``dtype`` and arrays on ``device``."""
        return dataclasses.replace(
            self,
            indptr=self.indptr.to(device=device),
            indices=self.indices.to(device=device),
            values=self.values.to(dtype=dtype, device=device),
        )

    def to_dense(self) -> torch.Tensor:
        """Dense copy (tests and small blocks only)."""
        out = torch.zeros(self.shape, dtype=self.values.dtype, device=self.values.device)
        rows = coo_rows(self)
        out.index_put_((rows, self.indices), self.values, accumulate=True)
        return out


def from_coo(
    rows: torch.Tensor,
    cols: torch.Tensor,
    values: torch.Tensor,
    shape: tuple[int, int],
    row_offset: int = 0,
    col_offset: int = 0,
) -> CSRBlock:
    """CSR from coordinates (local to the block); entries are sorted by (row, col)."""
    rows, cols = rows.long(), cols.long()
    order = torch.argsort(rows * max(shape[1], 1) + cols, stable=True)
    rows, cols, values = rows[order], cols[order], values[order]
    indptr = torch.zeros(shape[0] + 1, dtype=torch.int64, device=rows.device)
    if rows.numel():
        indptr[1:] = torch.bincount(rows, minlength=shape[0]).cumsum(0)
    return CSRBlock(indptr, cols, values, (int(shape[0]), int(shape[1])), row_offset, col_offset)


def coo_rows(block: CSRBlock) -> torch.Tensor:
    """Row index of every stored entry."""
    return torch.repeat_interleave(
        torch.arange(block.shape[0], dtype=torch.int64, device=block.indptr.device),
        block.indptr[1:] - block.indptr[:-1],
        output_size=block.nnz,
    )


def select(
    indptr: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
    row_range: tuple[int, int],
    col_range: tuple[int, int],
) -> CSRBlock:
    """The block ``[r0:r1, c0:c1]`` of a CSR matrix, as a block with local indices."""
    r0, r1 = row_range
    c0, c1 = col_range
    lo, hi = int(indptr[r0]), int(indptr[r1])
    sub_ptr = indptr[r0 : r1 + 1] - lo
    cols = indices[lo:hi].long()
    vals = values[lo:hi]
    keep = (cols >= c0) & (cols < c1)
    if bool(keep.all()):
        return CSRBlock(sub_ptr.clone(), cols - c0, vals.clone(), (r1 - r0, c1 - c0), r0, c0)
    device = indptr.device
    rows = torch.repeat_interleave(
        torch.arange(r1 - r0, device=device), sub_ptr[1:] - sub_ptr[:-1], output_size=hi - lo
    )
    rows, cols, vals = rows[keep], cols[keep] - c0, vals[keep]
    ptr = torch.zeros(r1 - r0 + 1, dtype=torch.int64, device=device)
    if rows.numel():
        ptr[1:] = torch.bincount(rows, minlength=r1 - r0).cumsum(0)
    return CSRBlock(ptr, cols, vals.clone(), (r1 - r0, c1 - c0), r0, c0)


def transpose(block: CSRBlock) -> CSRBlock:
    """The transposed block (CSR of Bᵀ, columns sorted within rows), offsets swapped.

    One stable sort of the column ids: entries are stored row by row, so each new row keeps
    its old rows in increasing order."""
    n_rows, n_cols = block.shape
    device = block.indices.device
    order = torch.sort(block.indices, stable=True).indices
    indptr = torch.zeros(n_cols + 1, dtype=torch.int64, device=device)
    if block.nnz:
        torch.cumsum(torch.bincount(block.indices, minlength=n_cols), 0, out=indptr[1:])
    return CSRBlock(
        indptr,
        coo_rows(block)[order],
        block.values[order],
        (n_cols, n_rows),
        block.col_offset,
        block.row_offset,
    )


def permute(
    indptr: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
    row_perm: torch.Tensor,
    col_perm: torch.Tensor,
) -> CSRBlock:
    """``R · A · Cᵀ`` for permutations given as new-id arrays: entry (i, j) moves to
    (row_perm[i], col_perm[j])."""
    n_rows = indptr.numel() - 1
    rows = torch.repeat_interleave(
        torch.arange(n_rows, device=indptr.device), indptr[1:] - indptr[:-1]
    )
    return from_coo(
        row_perm[rows], col_perm[indices.long()], values, (n_rows, int(col_perm.numel()))
    )
