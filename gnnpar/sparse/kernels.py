"""The one local SpMM: a sparse CSR block times a dense matrix, and its transpose for backward.

Full-graph layers (1D, 2D, 3D) and mini-batch layers all multiply through :class:`LocalSpMM`.
It keeps several kernels (*variants*) for the same product ``A @ H``:

==============  ==========================  ===================================================
variant         dtypes of ``H``             kernel
==============  ==========================  ===================================================
``csr64``       float32, float64            torch's sparse CSR matmul, int64 indices (MKL)
``csr32``       float32, float64            the same with int32 indices (blocks below 2**31)
``bag``         float32, float64, bfloat16  ``embedding_bag(mode="sum")`` with the values as
                float16                     per-sample weights: the CSR product row by row
                                            (fbgemm's CPU kernel: several times faster than
                                            the sparse CSR one in float32; float64 runs a
                                            plain loop that multiplies, then adds)
``bag-tiled``   float32, bfloat16, float16  ``bag`` on column tiles of 64 features (a smaller
                                            gathered working set for wide ``H``)
``bag-up``      bfloat16                    ``H`` and values widened to float32, ``bag``,
                                            the result rounded to bfloat16 once
==============  ==========================  ===================================================

Which one is fastest depends on the block, the width and the dtype, so the first product at
each ``(width, dtype)`` times the candidates and remembers the winner for that block
(``autotune``; :attr:`LocalSpMM.choices` and :attr:`LocalSpMM.timings` show what was
measured). By default the candidates are the dtype's :data:`EXACT_GROUPS`: variants whose
products are **bit for bit the same** (each output element sums its row's nonzeros in the
same order, with the same roundings), so the choice, made by timing, never changes a result
and training stays reproducible run to run and across a resume; ``bag`` and ``bag-tiled``
for float32, bfloat16 and float16 (several times faster than torch's CSR in float32),
``csr32`` and ``csr64`` for float64. Without autotuning the group's first variant is used.

**The check.** Summing in the same order is not enough: whether a kernel rounds ``a·h``
before adding it or fuses the two (FMA, one rounding) is decided by the library at run time.
MKL, behind the CSR variants, picks its code path by CPU, vendor included: the AVX2/AVX-512
paths it takes on Intel CPUs fuse, the generic one it takes on others does not, and
``bag``'s float64 loop never does; so float64 ``bag`` equals the CSR variants on some
machines and differs from them by an ulp or two on others (it is therefore not in the
float64 group). As no group can be proven identical on every CPU, the autotune also checks:
before timing, each candidate's product is compared bit for bit with the first candidate's
(the variant used without autotuning), on the product being tuned and on a random probe of
the same shape (the tuned input may be one on which rounding never shows, ones or one-hot
features, say), and a candidate that differs is left out of the timing;
:attr:`LocalSpMM.excluded` says which and why. Naming ``variants=`` times exactly those
instead, unchecked (no identity is promised; the benchmark compares all of them this way).

**On a GPU** (:data:`DEVICE_GROUPS`) float32 and float64 products go through cuSPARSE's CSR
SpMM (``csr32``): 14x faster than embedding_bag's CUDA kernel on an H100 and 2x PyG's GCN
epoch, but its sums use atomics, so two runs of one product can differ in the last bits
(the autotune's check then keeps only the first candidate), as PyG's and DGL's GPU SpMM do.
Under ``torch.use_deterministic_algorithms(True)`` the embedding_bag variants are the
candidates instead: bit-identical run to run, and slower.

**bfloat16.** torch's CPU sparse CSR matmul has no bfloat16 kernel; every bfloat16 variant
accumulates in float32 and rounds the result once, so, elementwise,
``|out - A·H| <= 2**-8 · |A·H| + 2**-16 · (|A|·|H|)``, where ``A·H`` is the exact product of
the bfloat16 operands (round-to-nearest gives 2**-9 of the first term; float32 accumulation
over ``deg`` terms adds at most ``deg · 2**-24`` of the second, well inside 2**-16 for
degrees up to 256). Accumulating in bfloat16 would instead stall a sum of 1,000 ones at 256.

**float16** (``mixed_precision = "fp16"``) goes the same way through ``bag``: float32
accumulation, one rounding, so the bound is the one above with 2**-11 for the first term
(float16 keeps 11 significant bits); a sum of 3,001 ones gives 3,000, where float16
accumulation would stall at 2,048.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F

from gnnpar.errors import UserError
from gnnpar.sparse.csr import CSRBlock, select, transpose

__all__ = [
    "DEVICE_GROUPS",
    "EXACT_GROUPS",
    "VARIANTS",
    "LocalSpMM",
    "SpMMFunction",
    "csr_spmm",
    "spmm",
]

_INT32_MAX = 2**31 - 1
_TILE = 64  # feature columns per tile of ``bag-tiled``
_F32, _F64, _BF16, _F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


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


def _bag_arrays(block: CSRBlock, dtype: torch.dtype | None = None) -> tuple:
    values = block.values if dtype is None else block.values.to(dtype)
    return block.indices, block.indptr[:-1], values


def _bag(prepared: tuple, dense: torch.Tensor) -> torch.Tensor:
    indices, offsets, values = prepared
    return F.embedding_bag(indices, dense, offsets, mode="sum", per_sample_weights=values)


def _bag_tiled(prepared: tuple, dense: torch.Tensor) -> torch.Tensor:
    width = dense.shape[1]
    if width <= _TILE:
        return _bag(prepared, dense)
    tiles = [_bag(prepared, dense[:, s : s + _TILE].contiguous()) for s in range(0, width, _TILE)]
    return torch.cat(tiles, dim=1)


def _bag_up(prepared: tuple, dense: torch.Tensor) -> torch.Tensor:
    return _bag(prepared, dense.float()).to(dense.dtype)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel for ``A @ H``: what it supports, what it builds once per block, how it runs."""

    name: str
    dtypes: frozenset[torch.dtype]
    prepare: Callable[[CSRBlock], Any]
    run: Callable[[Any, torch.Tensor], torch.Tensor]
    int32_only: bool = False  # needs every index and the nonzero count below 2**31

    def supports(self, block: CSRBlock, dtype: torch.dtype) -> bool:
        """Whether this variant can multiply ``block`` by a dense matrix of ``dtype``."""
        fits = max(block.shape) <= _INT32_MAX and block.nnz <= _INT32_MAX
        return dtype in self.dtypes and (fits or not self.int32_only)


VARIANTS: MappingProxyType[str, Variant] = MappingProxyType(
    {
        v.name: v
        for v in (
            Variant("csr64", frozenset({_F32, _F64}), lambda b: _csr_tensor(b, torch.int64),
                    lambda a, h: a @ h),
            Variant("csr32", frozenset({_F32, _F64}), lambda b: _csr_tensor(b, torch.int32),
                    lambda a, h: a @ h, int32_only=True),
            Variant("bag", frozenset({_F32, _F64, _BF16, _F16}), _bag_arrays, _bag),
            Variant("bag-tiled", frozenset({_F32, _BF16, _F16}), _bag_arrays, _bag_tiled),
            Variant("bag-up", frozenset({_BF16}), lambda b: _bag_arrays(b, _F32), _bag_up),
        )
    }
)  # fmt: skip
"""Every variant by name (read-only)."""

EXACT_GROUPS: MappingProxyType[torch.dtype, tuple[str, ...]] = MappingProxyType(
    {
        _F32: ("bag", "bag-tiled"),
        _BF16: ("bag", "bag-tiled"),
        _F16: ("bag", "bag-tiled"),
        # not bag: its float64 loop rounds each product, MKL's CSR kernels fuse multiply-add
        # on the CPUs they vectorise for
        _F64: ("csr32", "csr64"),
    }
)
"""Per dtype, the variants whose products are bit-identical: the default candidates of the
autotune (each checked against the first at tuning), the first one the default without it
(``csr32`` gives way to ``csr64`` for blocks too large for int32)."""

DEVICE_GROUPS: MappingProxyType[str, MappingProxyType] = MappingProxyType(
    {
        # cuSPARSE's CSR SpMM on a GPU: 14x faster than embedding_bag's CUDA kernel on an
        # H100 (docs/benchmarks.md), but it sums with atomics, so two runs differ in the last
        # bits (as PyG's and DGL's GPU SpMM do)
        "cuda": MappingProxyType({_F32: ("csr32", "csr64"), _F64: ("csr32", "csr64")}),
    }
)
"""Per device type, the groups that replace :data:`EXACT_GROUPS` for some dtypes (unless
``torch.use_deterministic_algorithms(True)`` is on, see :func:`exact_group`)."""

_DETERMINISTIC_ON_A_GPU = MappingProxyType(
    {_F32: ("bag", "bag-tiled"), _F64: ("bag",), _BF16: ("bag", "bag-tiled"),
     _F16: ("bag", "bag-tiled")}
)  # fmt: skip


def exact_group(dtype: torch.dtype, device_type: str = "cpu") -> tuple[str, ...]:
    """The default candidates for ``dtype`` products on a device of ``device_type``: the
    device's group (:data:`DEVICE_GROUPS`), else :data:`EXACT_GROUPS`; on a GPU under
    ``torch.use_deterministic_algorithms(True)``, embedding_bag's kernels, whose sums run in
    a fixed order (bit-identical run to run, slower)."""
    if device_type == "cuda" and torch.are_deterministic_algorithms_enabled():
        return _DETERMINISTIC_ON_A_GPU.get(dtype, ())
    group = DEVICE_GROUPS.get(device_type, MappingProxyType({})).get(dtype)
    return group if group is not None else EXACT_GROUPS.get(dtype, ())


_PROBE_SEED = 0  # the autotune's random probe input: the same on every rank and run


def _difference(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """Why ``out`` is not bit for bit ``ref`` (None when it is)."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"gives {out.dtype} {tuple(out.shape)}, not {ref.dtype} {tuple(ref.shape)}"
    # compare the bits, not the values: -0.0 and 0.0 differ, NaNs of the same bits do not
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[ref.element_size()]
    differ = out.contiguous().view(bits) != ref.contiguous().view(bits)
    n = int(differ.sum())
    if n == 0:
        return None
    largest = (out.double() - ref.double()).abs()[differ].max().item()
    return f"{n} of {ref.numel()} elements differ (largest by {largest:.3g})"


def _wait_for(device: torch.device) -> None:
    """Wait until ``device`` has finished the work queued on it (a no-op on the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Variants that share one prepared form (a block builds it once for all of them).
_PREPARED_AS = MappingProxyType({"bag-tiled": "bag"})


class LocalSpMM:
    """A sparse block ready to multiply dense matrices: ``A @ H`` and ``Aᵀ @ G``.

    Args:
        block: the CSR block (its values' dtype is the dtype of the products).
        autotune: time the candidates at the first product of each ``(width, dtype)`` and
            keep the fastest; otherwise use the first candidate.
        variants: the candidates, by name (default: the dtype's :data:`EXACT_GROUPS`, whose
            results do not depend on the choice).

    Kernels are built lazily, on first use, and kept; the transpose (:attr:`T`) is built
    once, on first use, with the same settings.

    Attributes:
        timings: per ``(width, dtype)`` tuned, each timed candidate's best time in seconds.
        excluded: per ``(width, dtype)`` tuned, the default candidates left out because their
            product was not bit for bit the first candidate's, each with the reason.
    """

    def __init__(
        self, block: CSRBlock, autotune: bool = True, variants: tuple[str, ...] | None = None
    ):
        unknown = [v for v in variants or () if v not in VARIANTS]
        if unknown:
            raise UserError(f"unknown SpMM variant {unknown[0]!r}; use one of {list(VARIANTS)}")
        self.block = block
        self.shape = block.shape
        self.autotune = autotune
        self.variants = tuple(variants) if variants else None
        self._prepared: dict[str, Any] = {}
        self._transposed: LocalSpMM | None = None
        self._choice: dict[tuple[int, torch.dtype], str] = {}
        self.timings: dict[tuple[int, torch.dtype], dict[str, float]] = {}
        self.excluded: dict[tuple[int, torch.dtype], dict[str, str]] = {}

    @property
    def nnz(self) -> int:
        """Stored nonzeros."""
        return self.block.nnz

    @property
    def choices(self) -> dict[tuple[int, torch.dtype], str]:
        """The variant used for each ``(width, dtype)`` multiplied so far."""
        return dict(self._choice)

    def to(self, dtype: torch.dtype) -> LocalSpMM:
        """The same block with values of ``dtype``."""
        return LocalSpMM(self.block.to(dtype=dtype), self.autotune, self.variants)

    def candidates(self, dtype: torch.dtype, device_type: str = "cpu") -> list[str]:
        """The variants the autotune chooses from for ``dtype`` matrices on a device of
        ``device_type``."""
        names = self.variants if self.variants else exact_group(dtype, device_type)
        return [n for n in names if VARIANTS[n].supports(self.block, dtype)]

    def mm(self, dense: torch.Tensor, variant: str | None = None) -> torch.Tensor:
        """``A @ dense``, with the tuned variant or the named one."""
        if dense.dim() != 2 or dense.shape[0] != self.shape[1]:
            raise ValueError(
                f"SpMM shape mismatch: sparse block {self.shape} times dense {tuple(dense.shape)}"
            )
        if dense.dtype != self.block.values.dtype:
            raise TypeError(
                f"SpMM dtype mismatch: sparse {self.block.values.dtype}, dense {dense.dtype}"
            )
        if self.nnz == 0 or dense.shape[1] == 0 or self.shape[0] == 0:
            return dense.new_zeros((self.shape[0], dense.shape[1]))
        dense = dense.contiguous()
        if variant is None:
            key = (dense.shape[1], dense.dtype)
            variant = self._choice.get(key)
            if variant is None:
                variant = self._pick(dense)
                self._choice[key] = variant
        elif variant not in VARIANTS or not VARIANTS[variant].supports(self.block, dense.dtype):
            usable = [n for n, v in VARIANTS.items() if v.supports(self.block, dense.dtype)]
            raise UserError(
                f"SpMM variant {variant!r} cannot multiply this block by {dense.dtype}; "
                f"use one of {usable}"
            )
        return VARIANTS[variant].run(self._kernel(variant), dense)

    def _kernel(self, name: str) -> Any:
        base = _PREPARED_AS.get(name, name)
        if base not in self._prepared:
            self._prepared[base] = VARIANTS[base].prepare(self.block)
        return self._prepared[base]

    def _pick(self, dense: torch.Tensor) -> str:
        names = self.candidates(dense.dtype, dense.device.type)
        if not names:
            raise TypeError(
                f"no SpMM variant among {list(self.variants or VARIANTS)} multiplies by "
                f"{dense.dtype}"
            )
        if not self.autotune or len(names) == 1:
            return names[0]
        if self.variants is None:  # the default group promises identical results: hold it to that
            names = self._identical(names, dense)
        times = {}
        for name in names:
            run, kernel = VARIANTS[name].run, self._kernel(name)
            run(kernel, dense)  # warm-up: first-touch allocations, MKL's analysis
            best = float("inf")
            for _ in range(2):
                _wait_for(dense.device)
                start = time.perf_counter()
                run(kernel, dense)
                _wait_for(dense.device)  # a GPU kernel returns at launch, not at its end
                best = min(best, time.perf_counter() - start)
            times[name] = best
        self.timings[(dense.shape[1], dense.dtype)] = times
        # keep only the kernels that some width uses
        winner = min(times, key=times.__getitem__)
        keep = {_PREPARED_AS.get(n, n) for n in (winner, *self._choice.values())}
        self._prepared = {k: v for k, v in self._prepared.items() if k in keep}
        return winner

    def _identical(self, names: list[str], dense: torch.Tensor) -> list[str]:
        """``names`` without those whose product differs from the first one's in any bit, on
        ``dense`` or on a random probe of its shape (recorded in :attr:`excluded`)."""
        gen = torch.Generator().manual_seed(_PROBE_SEED)  # not the global generator
        probe = torch.randn(dense.shape, generator=gen, dtype=torch.float64)
        probe = probe.to(device=dense.device, dtype=dense.dtype)  # made on the host
        inputs = {"tuned product": dense, "random probe": probe}
        run, kernel = VARIANTS[names[0]].run, self._kernel(names[0])
        refs = {what: run(kernel, x) for what, x in inputs.items()}
        kept, why = [names[0]], {}
        for name in names[1:]:
            run, kernel = VARIANTS[name].run, self._kernel(name)
            for what, x in inputs.items():
                reason = _difference(run(kernel, x), refs[what])
                if reason is not None:
                    why[name] = f"not bit for bit {names[0]} on the {what}: {reason}"
                    break
            else:
                kept.append(name)
        if why:
            self.excluded[(dense.shape[1], dense.dtype)] = why
        return kept

    @property
    def T(self) -> LocalSpMM:  # noqa: N802 - mirrors torch's .T
        """The transposed block (built once, on first use)."""
        if self._transposed is None:
            self._transposed = LocalSpMM(transpose(self.block), self.autotune, self.variants)
            self._transposed._transposed = self
        return self._transposed

    def row_chunks(self, parts: int) -> list[tuple[int, int, LocalSpMM]]:
        """Split into ``parts`` row ranges ``(start, stop, block)`` for overlapped pipelines
        (one part is this block itself)."""
        from gnnpar.comm import chunk_offsets, chunk_sizes

        if parts == 1:
            return [(0, self.shape[0], self)] if self.shape[0] else []
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
            out.append((start, start + size, LocalSpMM(b, self.autotune, self.variants)))
        return out


class SpMMFunction(torch.autograd.Function):
    """Differentiable ``A @ H`` for a fixed sparse ``A`` (gradient only for ``H``)."""

    @staticmethod
    def forward(ctx, dense, op):  # noqa: D102
        ctx.op = op
        return op.mm(dense)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        if not ctx.needs_input_grad[0]:
            return None, None
        return ctx.op.T.mm(grad.contiguous()), None


def spmm(op: LocalSpMM, dense: torch.Tensor) -> torch.Tensor:
    """Differentiable local SpMM ``op @ dense``."""
    return SpMMFunction.apply(dense, op)


def csr_spmm(
    indptr: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
    dense: torch.Tensor,
    num_cols: int | None = None,
) -> torch.Tensor:
    """Differentiable ``A @ dense`` for a one-off CSR ``A`` given by its arrays (a sampled
    block: no autotuning, the default variant; the transpose is built only if a gradient
    is needed). ``num_cols`` defaults to ``dense``'s rows."""
    cols = dense.shape[0] if num_cols is None else int(num_cols)
    block = CSRBlock(indptr, indices, values.to(dense.dtype), (indptr.numel() - 1, cols))
    return spmm(LocalSpMM(block, autotune=False), dense)
