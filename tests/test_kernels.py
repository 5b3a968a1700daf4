"""The local SpMM: every variant against a dense reference, forward and transposed; autotune;
bfloat16 and float16 within their stated bounds; the differentiable wrappers."""

from __future__ import annotations

import dataclasses
import math
import time
from types import MappingProxyType

import pytest
import torch

from gnnpar.sparse import kernels
from gnnpar.sparse.csr import CSRBlock, from_coo, transpose
from gnnpar.sparse.kernels import EXACT_GROUPS, VARIANTS, LocalSpMM, Variant, csr_spmm, spmm


def _block(rows: int, cols: int, density: float, dtype: torch.dtype, seed: int = 0) -> CSRBlock:
    """A random block with an empty row (1) and column (2) where it has more than one."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(rows, cols, generator=g) < density
    if rows > 1:
        keep[1] = False
    if cols > 2:
        keep[:, 2] = False
    r, c = keep.nonzero(as_tuple=True)
    values = torch.rand(r.numel(), generator=g, dtype=torch.float64) * 2 - 1
    return from_coo(r, c, values.to(dtype), (rows, cols))


SHAPES = [(37, 23), (23, 37), (5, 5), (1, 9), (64, 1)]


def _usable(block: CSRBlock, dtype: torch.dtype) -> list[str]:
    return [name for name, v in VARIANTS.items() if v.supports(block, dtype)]


WIDTHS = [1, 7, 70, 130]  # 70 and 130: bag-tiled cuts a last partial tile of 64 columns


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_variant_equals_the_dense_product_forward_and_transposed(dtype):
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for shape in SHAPES:
        block = _block(*shape, density=0.3, dtype=dtype, seed=shape[0])
        assert block.nnz > 0
        dense_a = block.to_dense().double()
        names = _usable(block, dtype)
        expect = {"csr64", "csr32", "bag"} | ({"bag-tiled"} if dtype == torch.float32 else set())
        assert set(names) == expect
        for width in WIDTHS:
            g = torch.Generator().manual_seed(width)
            h = torch.randn(shape[1], width, generator=g, dtype=torch.float64)
            gr = torch.randn(shape[0], width, generator=g, dtype=torch.float64)
            for name in names:
                op = LocalSpMM(block, variants=(name,))
                out = op.mm(h.to(dtype))
                assert out.dtype == dtype and out.shape == (shape[0], width)
                ref = dense_a @ h
                scale = max(ref.abs().max().item(), 1.0)
                assert (out.double() - ref).abs().max().item() <= tol * scale, (name, shape, width)
                out_t = op.T.mm(gr.to(dtype))
                ref_t = dense_a.T @ gr
                scale = max(ref_t.abs().max().item(), 1.0)
                assert (out_t.double() - ref_t).abs().max().item() <= tol * scale, (name, shape)
                assert op.T.choices == {(width, dtype): name}


def test_empty_blocks_and_zero_widths():
    for block in (
        _block(6, 4, density=0.0, dtype=torch.float32),  # no nonzeros
        CSRBlock(torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                 torch.zeros(0), (0, 4)),  # no rows
    ):  # fmt: skip
        op = LocalSpMM(block)
        out = op.mm(torch.ones(4, 3))
        assert out.shape == (block.shape[0], 3) and not out.any()
        assert op.T.mm(torch.ones(block.shape[0], 3)).shape == (4, 3)
    op = LocalSpMM(_block(6, 4, density=0.5, dtype=torch.float32))
    assert op.mm(torch.ones(4, 0)).shape == (6, 0)


def test_int32_variant_is_offered_only_for_blocks_that_fit():
    small = _block(5, 5, 0.5, torch.float32)
    huge = dataclasses.replace(small, shape=(2**31, 5))  # only the shape matters here
    assert VARIANTS["csr32"].supports(small, torch.float32)
    assert not VARIANTS["csr32"].supports(huge, torch.float32)
    assert VARIANTS["csr64"].supports(huge, torch.float32)


def test_autotune_times_every_candidate_and_keeps_one_per_width_and_dtype():
    block = _block(41, 29, 0.2, torch.float32, seed=3)
    op = LocalSpMM(block)
    ref = block.to_dense() @ torch.ones(29, 9)
    for _ in range(2):
        assert torch.allclose(op.mm(torch.ones(29, 9)), ref, atol=1e-5)
    assert set(op.timings) == {(9, torch.float32)}
    assert set(op.timings[(9, torch.float32)]) == set(op.candidates(torch.float32))
    chosen = op.choices[(9, torch.float32)]
    assert chosen == min(op.timings[(9, torch.float32)], key=op.timings[(9, torch.float32)].get)
    # without autotuning: the documented defaults, nothing timed
    plain = LocalSpMM(block, autotune=False)
    plain.mm(torch.ones(29, 4))
    plain.to(torch.float64).mm(torch.ones(29, 4, dtype=torch.float64))
    assert plain.choices == {(4, torch.float32): "bag"} and not plain.timings
    f64 = plain.to(torch.float64)
    f64.mm(torch.ones(29, 4, dtype=torch.float64))
    assert f64.choices == {(4, torch.float64): "csr32"}


@pytest.mark.parametrize(
    ("dtype", "first", "names", "ones", "want"),
    [
        # a sum of 1,000 ones: bfloat16 accumulation would stop at 256
        (torch.bfloat16, 2**-8, ("bag", "bag-tiled", "bag-up"), 1000, 1000.0),
        # 3,001 ones round once to float16's 3,000; float16 accumulation would stop at 2,048
        (torch.float16, 2**-11, ("bag", "bag-tiled"), 3001, 3000.0),
    ],
)
def test_half_precision_variants_accumulate_in_float32_within_the_stated_bound(
    dtype, first, names, ones, want
):
    # the stated bound: |out - A·H| <= first·|A·H| + 2**-16 (|A|·|H|), A·H exact
    block = _block(57, 300, 0.6, dtype, seed=7)  # rows of ~180 nonzeros
    a = block.to_dense().double()
    assert set(_usable(block, dtype)) == set(names)
    for width in (5, 70):
        h = torch.randn(300, width, generator=torch.Generator().manual_seed(width))
        h = h.to(dtype)
        exact = a @ h.double()
        bound = first * exact.abs() + 2**-16 * (a.abs() @ h.double().abs())
        for name in names:
            op = LocalSpMM(block, variants=(name,))
            out = op.mm(h)
            assert out.dtype == dtype
            assert bool(((out.double() - exact).abs() <= bound).all()), name
            exact_t = a.T @ h[:57].double() if width == 5 else None
            if exact_t is not None:
                out_t = op.T.mm(h[:57].contiguous())
                bound_t = first * exact_t.abs() + 2**-16 * (a.abs().T @ h[:57].double().abs())
                assert bool(((out_t.double() - exact_t).abs() <= bound_t).all()), name
    block = CSRBlock(
        torch.tensor([0, ones]), torch.zeros(ones, dtype=torch.int64),
        torch.ones(ones, dtype=dtype), (1, 1),
    )  # fmt: skip
    for name in names:
        out = LocalSpMM(block, variants=(name,)).mm(torch.ones(1, 3, dtype=dtype))
        assert out.float().tolist() == [[want] * 3], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_autotune_chooses_among_bit_identical_variants(dtype):
    # timing picks the variant, so results must not depend on it (resumed runs equal)
    block = _block(45, 38, 0.4, dtype, seed=11)
    assert LocalSpMM(block).candidates(dtype) == list(EXACT_GROUPS[dtype])
    assert len(EXACT_GROUPS[dtype]) >= 2  # every training dtype has variants to choose from
    for width in (7, 70):
        h = torch.randn(38, width, generator=torch.Generator().manual_seed(width)).to(dtype)
        g = torch.randn(45, width, generator=torch.Generator().manual_seed(width)).to(dtype)
        first = LocalSpMM(block, variants=EXACT_GROUPS[dtype][:1])
        for name in EXACT_GROUPS[dtype][1:]:
            op = LocalSpMM(block, variants=(name,))
            assert torch.equal(op.mm(h), first.mm(h)), name
            assert torch.equal(op.T.mm(g), first.T.mm(g)), name
        assert torch.equal(LocalSpMM(block).mm(h), first.mm(h))  # the autotuned default


def test_a_gpu_multiplies_through_cusparse_unless_runs_must_be_deterministic():
    # cuSPARSE sums with atomics (two runs differ in the last bits on an H100): it is the
    # GPU's default for speed, and left out when the user asks torch for determinism
    block = _block(9, 8, 0.5, torch.float32)
    spmm = LocalSpMM(block)
    assert spmm.candidates(torch.float32, "cuda")[0] == "csr32"
    assert LocalSpMM(block.to(torch.float64)).candidates(torch.float64, "cuda")[0] == "csr32"
    assert spmm.candidates(torch.float32) == list(EXACT_GROUPS[torch.float32])
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            names = LocalSpMM(block.to(dtype)).candidates(dtype, "cuda")
            assert names and not any(n.startswith("csr") for n in names), dtype
        # the host's groups are bit-identical already: unchanged
        assert spmm.candidates(torch.float32) == list(EXACT_GROUPS[torch.float32])
    finally:
        torch.use_deterministic_algorithms(was)


def test_the_autotune_leaves_out_a_default_candidate_that_is_not_bit_identical(monkeypatch):
    # a CPU can break a group's promise (MKL fuses multiply-add on some, bag never does):
    # a fast candidate one ulp off, and one off only where rounding shows, must not win
    def slow_csr32(a, h):
        time.sleep(0.005)  # so that either fake would win the timing if it were timed
        return VARIANTS["csr32"].run(a, h)

    def one_ulp_off(a, h):
        out = VARIANTS["csr32"].run(a, h)
        out[0, 0] = torch.nextafter(out[0, 0], torch.tensor(math.inf, dtype=out.dtype))
        return out

    def off_on_fractions(a, h):  # equal on integer inputs, where products round exactly
        return one_ulp_off(a, h) if bool((h != h.round()).any()) else VARIANTS["csr32"].run(a, h)

    prepare, f64 = VARIANTS["csr32"].prepare, frozenset({torch.float64})
    fakes = {
        name: Variant(name, f64, prepare, run)
        for name, run in (
            ("slow", slow_csr32),
            ("ulp", one_ulp_off),
            ("fraction", off_on_fractions),
        )
    }
    monkeypatch.setattr(kernels, "VARIANTS", MappingProxyType({**VARIANTS, **fakes}))
    monkeypatch.setattr(
        kernels, "EXACT_GROUPS", MappingProxyType({torch.float64: ("slow", "ulp", "fraction")})
    )
    block = _block(45, 38, 0.4, torch.float64, seed=11)
    csr32 = VARIANTS["csr32"].prepare(block)
    g = torch.Generator().manual_seed(7)
    h, later = (torch.randn(38, 7, generator=g, dtype=torch.float64) for _ in range(2))
    ones = torch.ones(38, 7, dtype=torch.float64)
    # on ones only the random probe shows the second fake's rounding
    for tuned, caught_on in ((h, "tuned product"), (ones, "random probe")):
        op = LocalSpMM(block)
        rng = torch.get_rng_state()
        out = op.mm(tuned)
        assert torch.equal(torch.get_rng_state(), rng)  # the probe leaves torch's seed alone
        key = (7, torch.float64)
        assert op.choices == {key: "slow"} and set(op.timings[key]) == {"slow"}
        why = op.excluded[key]
        assert set(why) == {"ulp", "fraction"}
        assert why["ulp"].startswith("not bit for bit slow on the tuned product: 1 of 315 ")
        assert f"on the {caught_on}" in why["fraction"]
        assert torch.equal(out, VARIANTS["csr32"].run(csr32, tuned))
        assert torch.equal(op.mm(later), VARIANTS["csr32"].run(csr32, later))
    # named variants promise nothing: they are all timed (the benchmark compares them so)
    named = LocalSpMM(block, variants=("slow", "ulp"))
    named.mm(h)
    assert set(named.timings[(7, torch.float64)]) == {"slow", "ulp"} and not named.excluded


def test_spmm_and_csr_spmm_are_differentiable():
    block = _block(13, 11, 0.4, torch.float64, seed=2)
    op = LocalSpMM(block)
    h = torch.randn(11, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: spmm(op, x), (h,))
    vals = block.values.clone()
    fn = lambda x: csr_spmm(block.indptr, block.indices, vals, x, 11)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h,))
    out = csr_spmm(block.indptr, block.indices, vals, h)
    out.sum().backward()
    torch.testing.assert_close(h.grad, block.to_dense().T @ torch.ones(13, 5, dtype=torch.float64))


def test_transpose_is_the_csr_of_the_transposed_matrix():
    block = dataclasses.replace(_block(9, 14, 0.4, torch.float64, seed=5), row_offset=3)
    t = transpose(block)
    assert t.shape == (14, 9) and (t.row_offset, t.col_offset) == (0, 3)
    torch.testing.assert_close(t.to_dense(), block.to_dense().T, rtol=0, atol=0)
    for r in range(14):  # columns sorted within each row
        seg = t.indices[t.indptr[r] : t.indptr[r + 1]]
        assert bool((seg[1:] > seg[:-1]).all())


def test_row_chunks_cover_the_block():
    block = _block(10, 6, 0.5, torch.float64, seed=1)
    op = LocalSpMM(block)
    h = torch.randn(6, 3, dtype=torch.float64)
    assert op.row_chunks(1) == [(0, 10, op)]
    pieces = op.row_chunks(3)
    assert [(s, e) for s, e, _ in pieces] == [(0, 4), (4, 7), (7, 10)]
    torch.testing.assert_close(torch.cat([c.mm(h) for _, _, c in pieces]), op.mm(h))


def test_errors_name_the_problem():
    block = _block(4, 3, 0.5, torch.float32)
    with pytest.raises(ValueError, match="unknown SpMM variant 'nope'"):
        LocalSpMM(block, variants=("nope",))
    op = LocalSpMM(block)
    with pytest.raises(ValueError, match=r"shape mismatch: sparse block \(4, 3\)"):
        op.mm(torch.ones(4, 2))
    with pytest.raises(TypeError, match="dtype mismatch"):
        op.mm(torch.ones(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="'bag-up' cannot multiply"):
        op.mm(torch.ones(3, 2), variant="bag-up")
    with pytest.raises(TypeError, match="no SpMM variant among"):
        LocalSpMM(block.to(torch.bfloat16), variants=("csr64",)).mm(
            torch.ones(3, 2, dtype=torch.bfloat16)
        )
