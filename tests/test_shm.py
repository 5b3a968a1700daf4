"""The same-host shared-memory transport (gnnpar.shm) under gnnpar.comm's collectives.

Every collective over shared memory is checked against a serial reference computed from every
rank's input (each rank can rebuild them all from the seed): gathers and broadcasts exactly,
reductions bit-identically to the sum in group order (the order the transport promises), on
odd, uneven shapes and several dtypes. The transport must really carry them (a usable channel
per group), count the same bytes as gloo, give every rank the same bits, and fall back to
gloo on every rank alike when one rank cannot create the segment.
"""

from __future__ import annotations

import os

import pytest
import torch

from gnnpar.testing import run_distributed


def _inputs(p: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> list[torch.Tensor]:
    """Every rank's input, reproducible on every rank."""
    out = []
    for r in range(p):
        g = torch.Generator().manual_seed(1000 * salt + r)
        t = torch.randn(shape, generator=g, dtype=torch.float64) * 4
        out.append(t.round() if not dtype.is_floating_point else t.to(dtype))
    return [t.to(dtype) for t in out]


def _ordered(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = parts[0].clone()
    for t in parts[1:]:
        if op in ("sum", "avg"):
            acc = acc + t
        elif op == "product":
            acc = acc * t
        elif op == "max":
            acc = torch.maximum(acc, t)
        else:
            acc = torch.minimum(acc, t)
    return acc / len(parts) if op == "avg" else acc


def _check_collectives(p: int, transport: str = "shm", segment: int | None = None) -> dict:
    """Runs on every rank of an x=p grid with the transport on for every size (or off, for
    gloo's bytes: gloo's ring sums in another order, so its sums are close, not identical).
    ``segment`` caps the segment's bytes, so the collectives walk it in several windows."""
    import gnnpar
    from gnnpar import comm, shm

    os.environ["GNNPAR_SHM_MIN_BYTES"] = "0"
    os.environ["GNNPAR_SHM"] = "1" if transport == "shm" else "0"
    if segment is not None:
        os.environ["GNNPAR_SHM_MAX_BYTES"] = str(segment)
    exact = {"rtol": 0, "atol": 0} if transport == "shm" else {"rtol": 0.05, "atol": 0.1}
    grid = gnnpar.init(x=p)
    me = grid.rank("x")
    bits = []
    with comm.record(grid) as traffic:
        for salt, dtype in enumerate((torch.float64, torch.bfloat16, torch.int64)):
            # all-gather along dim 1 with uneven pieces (5, 4, 3, ...): padded transfer
            sizes = [5 - (i % 3) for i in range(p)]
            pieces = [t[:, : sizes[i]] for i, t in enumerate(_inputs(p, (3, 7), dtype, salt))]
            got = comm.all_gather(pieces[me], grid, "x", dim=1, sizes=sizes)
            torch.testing.assert_close(got, torch.cat(pieces, dim=1), rtol=0, atol=0)
            # reduce-scatter of 2p+1 rows (uneven chunks), bits of the ordered sum
            full = _inputs(p, (2 * p + 1, 3), dtype, salt + 10)
            got = comm.reduce_scatter(full[me], grid, "x")
            chunks = comm.chunk_sizes(2 * p + 1, p)
            start = sum(chunks[:me])
            want = _ordered(full, "sum")[start : start + chunks[me]]
            torch.testing.assert_close(got, want, **exact)
            # all-reduce, every op, odd element count
            for op in ("sum", "avg", "max", "min", "product"):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                parts = _inputs(p, (13, 3), dtype, salt + 20)
                got = comm.all_reduce(parts[me].clone(), grid, "x", op=op)
                torch.testing.assert_close(got, _ordered(parts, op), **exact)
                bits.append(got.view(torch.uint8 if dtype != torch.bfloat16 else torch.int16))
            # broadcast from the last rank, async form
            parts = _inputs(p, (11,), dtype, salt + 30)
            got = comm.broadcast(parts[me].clone(), grid, "x", src=p - 1, async_op=True).wait()
            torch.testing.assert_close(got, parts[p - 1], rtol=0, atol=0)
    chan = grid.channels.get(id(grid.group("x")))
    used = chan is not None and chan.usable
    if used:  # the segment's name is gone as soon as every rank has mapped it
        leftover = f"gnnpar-{chan.token & (2**64 - 1):016x}-"
        assert not [f for f in os.listdir(shm.shm_dir()) if f.startswith(leftover)]
    # strided views are reduced and broadcast in place (gloo once ignored the view)
    base = _inputs(p, (6, 4), torch.float64, 99)
    view = base[me].clone().t()
    got = comm.all_reduce(view, grid, "x")
    torch.testing.assert_close(view, _ordered([b.t() for b in base], "sum"))
    assert got is view
    view = base[me].clone().t()
    comm.broadcast(view, grid, "x", src=0)
    torch.testing.assert_close(view, base[0].t(), rtol=0, atol=0)
    largest = chan._bytes.numel() if used else 0
    gnnpar.release(grid)
    return {
        "used": used,
        "segment_bytes": largest,
        "bytes": traffic.as_dict(),
        "bits": [b.flatten().tolist() for b in bits],
        "min_default": shm.DEFAULT_MIN_BYTES,
    }


@pytest.mark.parametrize("p", [2, 3])
def test_shared_memory_collectives_equal_the_serial_reference(p):
    results = run_distributed(_check_collectives, p, p)
    assert all(r["used"] for r in results), "the collectives did not go through shared memory"
    # every rank holds the same bits after every all-reduce
    assert all(r["bits"] == results[0]["bits"] for r in results)
    gloo = run_distributed(_check_collectives, p, p, "gloo")
    assert not any(r["used"] for r in gloo)
    assert [r["bytes"] for r in results] == [r["bytes"] for r in gloo]


def test_a_small_segment_carries_large_collectives_in_windows():
    # 3 ranks, a 200-byte cap: every collective above (up to 45 float64 values per rank, 15
    # rows per reduce-scatter destination) needs several windows, some of one element
    results = run_distributed(_check_collectives, 3, 3, "shm", 200)
    assert all(r["used"] for r in results)
    assert all(r["bits"] == results[0]["bits"] for r in results)
    # the cap holds (it is at least p aligned 64-byte slots)
    assert all(0 < r["segment_bytes"] <= 200 for r in results)


def _fallback(p: int) -> dict:
    """Rank 1 cannot create the segment: every rank must fall back to gloo together."""
    import gnnpar
    from gnnpar import comm

    os.environ["GNNPAR_SHM_MIN_BYTES"] = "0"
    grid = gnnpar.init(x=p)
    me = grid.rank("x")
    if me == 1:
        os.environ["GNNPAR_SHM_DIR"] = os.path.join(os.sep, "nonexistent-gnnpar-shm")
    parts = _inputs(p, (5, 3), torch.float64, 7)
    first = comm.all_reduce(parts[me].clone(), grid, "x")
    second = comm.all_gather(parts[me], grid, "x")
    chan = grid.channels[id(grid.group("x"))]
    torch.testing.assert_close(first, _ordered(parts, "sum"))
    torch.testing.assert_close(second, torch.cat(parts))
    gnnpar.release(grid)
    return chan.usable


def _threshold() -> bool:
    """Below the default size no channel is made (small collectives stay on gloo)."""
    import gnnpar
    from gnnpar import comm

    os.environ.pop("GNNPAR_SHM_MIN_BYTES", None)
    grid = gnnpar.init(x=2)
    comm.all_reduce(torch.ones(16), grid, "x")
    small = len(grid.channels)
    # an async collective stays on gloo, whose threads overlap it with compute
    comm.all_reduce(torch.ones(128 * 1024), grid, "x", async_op=True).wait()
    overlapped = len(grid.channels)
    comm.all_reduce(torch.ones(128 * 1024), grid, "x")  # 512 KiB
    large = len(grid.channels)
    gnnpar.release(grid)
    return small == 0 and overlapped == 0 and large == 1


def test_a_rank_that_cannot_make_the_segment_sends_every_rank_to_gloo():
    assert run_distributed(_fallback, 3, 3) == [False, False, False]


def test_only_large_blocking_collectives_use_shared_memory():
    assert run_distributed(_threshold, 2) == [True, True]


def test_a_bad_threshold_is_one_line():
    from gnnpar import shm

    os.environ["GNNPAR_SHM_MIN_BYTES"] = "lots"
    try:
        with pytest.raises(ValueError, match="GNNPAR_SHM_MIN_BYTES"):
            shm.min_bytes()
    finally:
        del os.environ["GNNPAR_SHM_MIN_BYTES"]
