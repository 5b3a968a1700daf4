"""The local SpMM: a sparse block times a dense matrix, with its transpose for backward.

Two variants of torch's CSR kernel are kept, one with int64 and one with int32 indices; which
is faster depends on the feature width, so the first product at each width times both and
remembers the winner (per block, not globally).
"""

from __future__ import annotations

import time
import warnings

import torch

from gnnpar.sparse.csr import CSRBlock, transpose

_INT32_MAX = 2**31 - 1


def _csr_tensor(block: CSRBlock, index_dtype: torch.dtype) -> torch.Tensor:
    with warnings.catch_warnings():
        # torch labels sparse CSR as beta; the warning says nothing actionable here.
        warnings.simplefilter("ignore")
        return torch.sparse_csr_tensor(
            block.indptr.to(index_dtype),
            block.indices.to(index_dtype),
            block.values,
            size=block.shape,
            check_invariants=False,
        )


class LocalSpMM:
    """A sparse block ready to multiply dense matrices: ``A @ H`` and ``Aᵀ @ G``."""

    def __init__(self, block: CSRBlock, autotune: bool = True):
        self.block = block
        self.shape = block.shape
        self.autotune = autotune
        fits32 = max(block.shape) <= _INT32_MAX and block.nnz <= _INT32_MAX
        self._variants = {"int64": _csr_tensor(block, torch.int64)}
        if fits32:
            self._variants["int32"] = _csr_tensor(block, torch.int32)
        self._transposed: LocalSpMM | None = None
        self._choice: dict[tuple[int, torch.dtype], str] = {}

    @property
    def nnz(self) -> int:
        """Stored nonzeros."""
        return self.block.nnz

    def to(self, dtype: torch.dtype) -> LocalSpMM:
        """The same block with values of ``dtype``."""
        return LocalSpMM(self.block.to(dtype=dtype), self.autotune)

    def mm(self, dense: torch.Tensor) -> torch.Tensor:
        """``A @ dense``."""
        if dense.shape[0] != self.shape[1]:
            raise ValueError(
                f"SpMM shape mismatch: sparse block {self.shape} times dense {tuple(dense.shape)}"
            )
        if self.nnz == 0 or dense.shape[1] == 0:
            return dense.new_zeros((self.shape[0], dense.shape[1]))
        if dense.dtype != self.block.values.dtype:
            raise TypeError(
                f"SpMM dtype mismatch: sparse {self.block.values.dtype}, dense {dense.dtype}"
            )
        dense = dense.contiguous()
        key = (dense.shape[1], dense.dtype)
        name = self._choice.get(key)
        if name is None:
            name = self._tune(dense) if self.autotune and len(self._variants) > 1 else "int64"
            self._choice[key] = name
        return self._variants[name] @ dense

    def _tune(self, dense: torch.Tensor) -> str:
        best, best_t = "int64", float("inf")
        for name, mat in self._variants.items():
            mat @ dense  # warm-up
            start = time.perf_counter()
            mat @ dense
            t = time.perf_counter() - start
            if t < best_t:
                best, best_t = name, t
        return best

    @property
    def T(self) -> LocalSpMM:  # noqa: N802 - mirrors torch's .T
        """The transposed block (built once, on first use)."""
        if self._transposed is None:
            self._transposed = LocalSpMM(transpose(self.block), self.autotune)
            self._transposed._transposed = self
        return self._transposed

    def row_chunks(self, parts: int) -> list[tuple[int, int, LocalSpMM]]:
        """Split into ``parts`` row ranges ``(start, stop, block)`` for overlapped pipelines."""
        from gnnpar.comm import chunk_offsets, chunk_sizes
        from gnnpar.sparse.csr import select

        sizes = chunk_sizes(self.shape[0], parts)
        out = []
        for start, size in zip(chunk_offsets(sizes), sizes, strict=True):
            if size == 0:
                continue
            b = select(
                self.block.indptr,
                self.block.indices,
                self.block.values,
                (start, start + size),
                (0, self.shape[1]),
            )
            out.append((start, start + size, LocalSpMM(b, self.autotune)))
        return out


class SpMMFunction(torch.autograd.Function):
    """Differentiable ``A @ H`` for a fixed sparse ``A`` (gradient only for ``H``)."""

    @staticmethod
    def forward(ctx, dense, op):  # noqa: D102
        ctx.op = op
        return op.mm(dense)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return ctx.op.T.mm(grad), None


def spmm(op: LocalSpMM, dense: torch.Tensor) -> torch.Tensor:
    """Differentiable local SpMM ``op @ dense``."""
    return SpMMFunction.apply(dense, op)
