"""Collectives and their autograd pairs against serial references, with byte accounting.

Every collective and pair runs over every axis of size > 1 of every data·x·y·z shape of 2, 4
and 8 ranks and of the shapes of 3, 5, 6 and 7 ranks that put an odd size on each axis
(``gnnpar.testing.grid_shapes``); its bytes are held against the ring formulas of
``tests/byte_formulas.py``, and a few cases on 3 ranks against numbers worked out by hand.
gnnpar.comm has no point-to-point send/receive: every transfer is one of the collectives below.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import gnnpar
from gnnpar import comm
from gnnpar.comm import CommError, chunk_offsets, chunk_sizes, ring_bytes
from gnnpar.testing import grid_shapes, run_distributed
from tests.byte_formulas import (
    all_reduce_bytes,
    biggest,
    broadcast_bytes,
    chunk_range,
    gather_bytes,
)

F64 = torch.float64


def _data(rank: int, rows: int, cols: int = 3, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(rows, cols, generator=g, dtype=F64)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape or not torch.allclose(a, b, atol=1e-12, rtol=1e-12):
        raise AssertionError(f"{what}: got {a} expected {b}")


def _expect_bytes(traffic, axis, kind, expected, what):
    got = traffic.bytes(axis=axis, kind=kind)
    if got != round(expected) or traffic.bytes() != got:
        raise AssertionError(f"{what}: recorded {traffic.as_dict()}, expected {expected}")


def _check_collectives(grid, axis):
    """Plain collectives over one axis: values and bytes."""
    members = grid.ranks(axis)
    p, me = len(members), grid.rank(axis)
    es = 8  # float64
    tag = f"{grid.describe()} axis {axis}"

    # all-reduce (sum, avg, max), sync and async
    x = _data(grid.global_rank, 5)
    ref = sum(_data(r, 5) for r in members)
    with comm.record(grid) as t:
        out = comm.all_reduce(x.clone(), grid, axis)
    _close(out, ref, f"all_reduce {tag}")
    _expect_bytes(t, axis, "all_reduce", all_reduce_bytes(p, 5 * 3 * es), tag)
    h = comm.all_reduce(x.clone(), grid, axis, op="avg", async_op=True)
    _close(h.wait(), ref / p, f"all_reduce avg {tag}")
    _close(
        comm.all_reduce(x.clone(), grid, axis, op="max"),
        torch.stack([_data(r, 5) for r in members]).amax(0),
        f"all_reduce max {tag}",
    )

    # all-gather: equal and uneven pieces, along dims 0 and 1
    with comm.record(grid) as t:
        out = comm.all_gather(x, grid, axis)
    _close(out, torch.cat([_data(r, 5) for r in members]), f"all_gather {tag}")
    _expect_bytes(t, axis, "all_gather", gather_bytes(p, p * 5 * 3 * es), tag)
    sizes = [i + 1 for i in range(p)]
    mine = _data(grid.global_rank, sizes[me], salt=1)
    with comm.record(grid) as t:
        out = comm.all_gather(mine.T.contiguous(), grid, axis, dim=1, sizes=sizes, async_op=True)
        out = out.wait()
    ref = torch.cat([_data(r, sizes[i], salt=1) for i, r in enumerate(members)]).T
    _close(out, ref, f"all_gather uneven dim 1 {tag}")
    _expect_bytes(t, axis, "all_gather", gather_bytes(p, p * p * 3 * es), tag)  # padded to p

    # reduce-scatter: 7 rows (odd; uneven unless p divides 7), along dim 0 and dim 1
    y = _data(grid.global_rank, 7, salt=2)
    total = sum(_data(r, 7, salt=2) for r in members)
    lo, hi = chunk_range(7, p, me)
    with comm.record(grid) as t:
        out = comm.reduce_scatter(y, grid, axis)
    _close(out, total[lo:hi], f"reduce_scatter {tag}")
    _expect_bytes(t, axis, "reduce_scatter", gather_bytes(p, p * biggest(7, p) * 3 * es), tag)
    out = comm.reduce_scatter(y.T.contiguous(), grid, axis, dim=1, async_op=True).wait()
    _close(out, total[lo:hi].T, f"reduce_scatter dim 1 {tag}")

    # broadcast from the last index of the group
    z = _data(grid.global_rank, 4, salt=3)
    with comm.record(grid) as t:
        comm.broadcast(z, grid, axis, src=p - 1)
    _close(z, _data(members[-1], 4, salt=3), f"broadcast {tag}")
    _expect_bytes(t, axis, "broadcast", broadcast_bytes(p, 4 * 3 * es), tag)

    # all-to-all: equal splits, then uneven splits with exchanged counts
    a = _data(grid.global_rank, 2 * p, salt=4)
    out = comm.all_to_all(a, grid, axis)
    ref = torch.cat([_data(r, 2 * p, salt=4)[2 * me : 2 * me + 2] for r in members])
    _close(out, ref, f"all_to_all {tag}")

    # rank index i sends (i + j) % 3 rows to peer j
    def splits(i):
        return [(i + j) % 3 for j in range(p)]

    b = _data(grid.global_rank, sum(splits(me)), salt=5)
    with comm.record(grid) as t:
        out = comm.all_to_all(b, grid, axis, input_splits=splits(me), async_op=True).wait()
    pieces = []
    for i, r in enumerate(members):
        s = splits(i)
        pieces.append(_data(r, sum(s), salt=5)[sum(s[:me]) : sum(s[:me]) + s[me]])
    _close(out, torch.cat(pieces), f"all_to_all uneven {tag}")
    sent = sum(s for j, s in enumerate(splits(me)) if j != me)
    counts_sent = (p - 1) * 8
    _expect_bytes(t, axis, "all_to_all", sent * 3 * es + counts_sent, tag)


def _serial_grad(fn, leaves, weights):
    """Gradient of sum_r <w_r, fn_r(leaves)> for each leaf, by serial autograd."""
    leaves = [leaf.detach().clone().requires_grad_(True) for leaf in leaves]
    outs = fn(leaves)
    loss = sum((o * w).sum() for o, w in zip(outs, weights, strict=True))
    loss.backward()
    return outs, [leaf.grad for leaf in leaves]


def _check_autograd_pairs(grid, axis):
    """Each differentiable pair against serial autograd on the whole group's data."""
    members = grid.ranks(axis)
    p, me, gr = len(members), grid.rank(axis), grid.global_rank
    tag = f"{grid.describe()} axis {axis}"
    rows = 5  # odd: uneven chunks for every p > 1 except 5
    per_rank = [_data(r, rows, salt=10) for r in members]
    weights = [_data(r, rows * p, salt=11) for r in members]
    shared_w = _data(0, rows * p, salt=12)  # replicated downstream

    def run(fn, x, w):
        x = x.detach().clone().requires_grad_(True)
        out = fn(x)
        (out * w).sum().backward()
        return out.detach(), x.grad

    cs = [chunk_range(rows, p, i)[1] - chunk_range(rows, p, i)[0] for i in range(p)]
    off = [chunk_range(rows, p, i)[0] for i in range(p)]

    # copy_to: replicated x; each rank's own downstream weight
    w_small = [_data(r, rows, salt=13) for r in members]
    out, g = run(lambda x: comm.copy_to(x, grid, axis), per_rank[0], w_small[me])
    ref_out, ref_g = _serial_grad(lambda ls: [ls[0]] * p, [per_rank[0]], w_small)
    _close(out, ref_out[me].detach(), f"copy_to fwd {tag}")
    _close(g, ref_g[0], f"copy_to bwd {tag}")

    # reduce_from: replicated downstream
    out, g = run(lambda x: comm.reduce_from(x, grid, axis), per_rank[me], w_small[0])
    ref_out, ref_g = _serial_grad(lambda ls: [sum(ls)], per_rank, [w_small[0]])
    _close(out, ref_out[0].detach(), f"reduce_from fwd {tag}")
    _close(g, ref_g[me], f"reduce_from bwd {tag}")

    # gather_from: all-gather forward, reduce-scatter backward (dim 1, odd sizes)
    out, g = run(lambda x: comm.gather_from(x.T, grid, axis, dim=1).T, per_rank[me], weights[me])
    ref_out, ref_g = _serial_grad(lambda ls: [torch.cat(ls)] * p, per_rank, weights)
    _close(out, ref_out[me].detach(), f"gather_from fwd {tag}")
    _close(g, ref_g[me], f"gather_from bwd {tag}")

    # scatter_to: reduce-scatter forward (uneven chunks), all-gather backward
    w_chunk = [_data(r, cs[i], salt=14) for i, r in enumerate(members)]
    out, g = run(lambda x: comm.scatter_to(x, grid, axis), per_rank[me], w_chunk[me])
    ref_out, ref_g = _serial_grad(
        lambda ls: [sum(ls)[off[i] : off[i] + cs[i]] for i in range(p)], per_rank, w_chunk
    )
    _close(out, ref_out[me].detach(), f"scatter_to fwd {tag}")
    _close(g, ref_g[me], f"scatter_to bwd {tag}")

    # split_to: replicated x, keep own chunk; all-gather backward
    out, g = run(lambda x: comm.split_to(x, grid, axis), per_rank[0], w_chunk[me])
    ref_out, ref_g = _serial_grad(
        lambda ls: [ls[0][off[i] : off[i] + cs[i]] for i in range(p)], [per_rank[0]], w_chunk
    )
    _close(out, ref_out[me].detach(), f"split_to fwd {tag}")
    _close(g, ref_g[0], f"split_to bwd {tag}")

    # gather_replicated: uneven pieces gathered, replicated downstream; own chunk backward
    piece = [_data(r, cs[i], salt=15) for i, r in enumerate(members)]
    out, g = run(
        lambda x: comm.gather_replicated(x, grid, axis, sizes=cs), piece[me], shared_w[:rows]
    )
    ref_out, ref_g = _serial_grad(lambda ls: [torch.cat(ls)], piece, [shared_w[:rows]])
    _close(out, ref_out[0].detach(), f"gather_replicated fwd {tag}")
    _close(g, ref_g[me], f"gather_replicated bwd {tag}")
    del gr


AXES = ("x", "y", "z", "data", "tensor", "xz")


def _axes_checked(shape: dict[str, int]) -> int:
    sizes = {**shape, "tensor": shape["x"] * shape["y"] * shape["z"], "xz": shape["x"] * shape["z"]}
    return sum(sizes[a] > 1 for a in AXES)


def _check_world(world: int) -> int:
    checked = 0
    for shape in grid_shapes(world, ("data", "x", "y", "z")):
        grid = gnnpar.init(**shape)
        for axis in AXES:
            if grid.size(axis) > 1:
                _check_collectives(grid, axis)
                _check_autograd_pairs(grid, axis)
                checked += 1
        gnnpar.release(grid)
    return checked


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_collectives_and_pairs_match_serial(world):
    out = run_distributed(_check_world, world, world, timeout=400)
    want = sum(_axes_checked(s) for s in grid_shapes(world, ("data", "x", "y", "z")))
    assert out == [want] * world


def _by_hand() -> dict:
    """Every collective over 3 ranks with uneven pieces; the bytes worked out by hand."""
    grid = gnnpar.init(x=3)
    me = grid.rank("x")
    f64 = torch.ones(5, 3, dtype=F64)
    out = {}
    with comm.record(grid) as t:
        comm.all_reduce(f64, grid, "x")
    out["all_reduce"] = t.as_dict()
    with comm.record(grid) as t:  # rows 3, 2, 2 padded to 3 each: 9 × 3 × 8 = 216 bytes
        comm.all_gather(torch.ones([3, 2, 2][me], 3, dtype=F64), grid, "x", sizes=[3, 2, 2])
    out["all_gather"] = t.as_dict()
    with comm.record(grid) as t:  # 7 rows → chunks 3, 2, 2, sent padded as 9 rows
        comm.reduce_scatter(torch.ones(7, 3, dtype=F64), grid, "x")
    out["reduce_scatter"] = t.as_dict()
    with comm.record(grid) as t:
        comm.broadcast(torch.ones(4, 3, dtype=F64), grid, "x", src=2)
    out["broadcast"] = t.as_dict()
    with comm.record(grid) as t:  # float32, 2 × 2 from every rank: 3 × 16 = 48 bytes gathered
        comm.all_gather(torch.ones(2, 2), grid, "x")
    out["all_gather f32"] = t.as_dict()
    splits = [[0, 1, 2], [1, 2, 0], [2, 0, 1]][me]  # rows this rank sends to each peer
    with comm.record(grid) as t:
        comm.all_to_all(torch.ones(3, 3, dtype=F64), grid, "x", input_splits=splits)
    out["all_to_all"] = t.as_dict()
    out["by_axis"] = t.by_axis()
    return out


def test_bytes_worked_out_by_hand_on_3_ranks():
    res = run_distributed(_by_hand, 3)
    for rank, r in enumerate(res):
        # all-reduce of 5 × 3 float64 = 120 bytes: 2 · 2/3 · 120
        assert r["all_reduce"] == {"x": {"all_reduce": 160}}
        # all-gather of 216 padded bytes: 2/3 · 216
        assert r["all_gather"] == {"x": {"all_gather": 144}}
        assert r["reduce_scatter"] == {"x": {"reduce_scatter": 144}}
        # broadcast of 4 × 3 float64 = 96 bytes: each rank receives 2/3 of it on average
        assert r["broadcast"] == {"x": {"broadcast": 64}}
        assert r["all_gather f32"] == {"x": {"all_gather": 32}}
        # all-to-all: the rows sent to the two others (3 float64 each = 24 bytes a row), plus
        # the exchange of counts (one int64 to each of the two others = 16 bytes)
        sent_rows = [1 + 2, 1 + 0, 2 + 0][rank]
        assert r["all_to_all"] == {"x": {"all_to_all": sent_rows * 24 + 16}}, (rank, r)
        assert r["by_axis"] == {"x": sent_rows * 24 + 16}


def test_size_one_axis_moves_nothing(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    grid = gnnpar.init()
    x = torch.randn(3, 2, requires_grad=True)
    with comm.record(grid) as t:
        for f in (comm.copy_to, comm.reduce_from):
            assert f(x, grid, "x") is x
        assert comm.gather_from(x, grid, "y") is x
        assert comm.all_gather(x, grid, "tensor") is x
        assert comm.reduce_scatter(x, grid, "z") is x
    assert t.bytes() == 0 and t.calls() == 0


def test_chunking_and_formulas():
    assert chunk_sizes(7, 3) == [3, 2, 2]
    assert chunk_offsets([3, 2, 2]) == [0, 3, 5]
    assert ring_bytes("all_reduce", 800, 4) == 1200
    assert ring_bytes("all_gather", 800, 4) == 600
    assert ring_bytes("reduce_scatter", 800, 1) == 0
    assert ring_bytes("broadcast", 800, 4) == 600  # what a rank receives on average
    with pytest.raises(ValueError, match="no ring formula"):
        ring_bytes("gossip", 1, 2)
    with pytest.raises(ValueError, match="cannot split into 0 parts"):
        chunk_sizes(3, 0)


def _dead_peer() -> str:
    grid = gnnpar.init(x=2, timeout=3)
    if dist.get_rank() == 1:
        return "absent"  # never joins the collective
    try:
        comm.all_reduce(torch.ones(4), grid, "x")
    except CommError as e:
        return str(e)
    return "no error"


def test_dead_peer_gives_error_naming_axis():
    out = run_distributed(_dead_peer, 2, timeout=60)
    assert "all_reduce over grid axis 'x' (ranks [0, 1]) on rank 0 failed" in out[0], out[0]


def _bad_sizes() -> list[str]:
    grid = gnnpar.init(x=2)
    msgs = []
    for call in (
        lambda: comm.all_gather(torch.ones(2), grid, "x", sizes=[2, 2, 2]),
        lambda: comm.reduce_scatter(torch.ones(4), grid, "x", sizes=[1, 2]),
        lambda: comm.all_to_all(torch.ones(3), grid, "x"),
        lambda: comm.all_reduce(torch.ones(1), grid, "x", op="mean"),
        lambda: comm.broadcast(torch.ones(1), grid, "x", src=2),
    ):
        try:
            call()
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_bad_arguments_are_clear():
    msgs = run_distributed(_bad_sizes, 2)[0]
    assert "sizes [2, 2, 2] do not fit 2 ranks" in msgs[0]
    assert "do not split 4 rows over 2 ranks" in msgs[1]
    assert "3 rows do not divide over 2 ranks" in msgs[2]
    assert "unknown reduce op 'mean'" in msgs[3]
    assert "broadcast source 2 is outside axis 'x'" in msgs[4]


def _kept_buffer() -> dict:
    """All-gathers into a caller's buffer, through the shared-memory transport (a large
    tensor) and through gloo (a small one)."""
    grid = gnnpar.init(x=2)
    me = grid.rank("x")
    out = {}
    for rows in (3, 4096):  # 3 × 3 float64 goes through gloo, 4096 × 3 (96 KiB) above 64 KiB
        pieces = [_data(r, rows, salt=21) for r in range(2)]
        buf = torch.empty(2 * rows, pieces[0].shape[1], dtype=F64)
        with mock.patch.dict(os.environ, {"GNNPAR_SHM_MIN_BYTES": "65536"}):
            got = comm.all_gather(pieces[me], grid, "x", out=buf)
        out[f"equal {rows}"] = torch.equal(got, torch.cat(pieces))
        out[f"transport {rows}"] = bool(grid.channels) == (rows > 3)
        out[f"in buffer {rows}"] = got.data_ptr() == buf.data_ptr()
        # through autograd: the result aliases the buffer, the buffer keeps no history
        w = torch.ones(pieces[0].shape[1], dtype=F64, requires_grad=True)
        x = pieces[me].clone().requires_grad_(True)
        full = comm.gather_from(x, grid, "x", out=buf)
        saved = full * w  # keeps ``full`` for w's gradient
        out[f"aliased {rows}"] = full.data_ptr() == buf.data_ptr() and buf.grad_fn is None
        comm.gather_from(x, grid, "x", out=buf)  # the next gather overwrites it...
        try:  # ...so the use saved past it fails instead of reading the new contents
            saved.sum().backward()
            out[f"stale use caught {rows}"] = False
        except RuntimeError as e:
            out[f"stale use caught {rows}"] = "modified by an inplace operation" in str(e)
    try:
        comm.all_gather(torch.ones(2, 3), grid, "x", out=torch.empty(3, 3))
    except ValueError as e:
        out["wrong shape"] = str(e)
    # uneven pieces are compacted into a new tensor; the buffer holds the padded transfer
    buf = torch.empty(4, 2)
    got = comm.all_gather(torch.full((2 - me, 2), float(me)), grid, "x", sizes=[2, 1], out=buf)
    out["uneven"] = got.tolist()
    gnnpar.release(grid)
    return out


def test_all_gather_into_a_kept_buffer():
    res = run_distributed(_kept_buffer, 2)
    for r in res:
        flags = {k: v for k, v in r.items() if k not in ("wrong shape", "uneven")}
        assert all(flags.values()), flags
        assert "out must be a contiguous torch.float32 tensor of shape (4, 3)" in r["wrong shape"]
        assert r["uneven"] == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]


# ------------------------------------------------------------------------------ tree order
def _spread(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 values over twelve orders of magnitude: a sum of them depends on its order."""
    g = torch.Generator().manual_seed(rank)
    scale = 10.0 ** torch.randint(-6, 6, shape, generator=g)
    return torch.randn(shape, generator=g) * scale


def _tree_world() -> dict:
    """On 4 ranks: tree collectives over data=4 against the serial tree, and the same sums
    on data=2 × x=2 where each rank first adds a pair, as a rank of two micro-batches does."""
    rows, cols = 7, 3  # chunks 2, 2, 2, 1: uneven, padded
    grid = gnnpar.init(data=4)
    me, world = grid.rank("data"), 4
    want = comm.tree_sum(torch.stack([_spread(r, (rows, cols)) for r in range(world)]))
    out: dict = {}
    with comm.record(grid) as t:
        got = comm.reduce_scatter(_spread(me, (rows, cols)), grid, "data", order="tree")
    start = chunk_offsets(chunk_sizes(rows, world))[me]
    out["rs"] = torch.equal(got, want[start : start + chunk_sizes(rows, world)[me]])
    out["rs_bytes"] = t.as_dict()
    with comm.record(grid) as t:
        x = _spread(me, (rows, cols))
        comm.all_reduce(x, grid, "data", order="tree")
    out["ar"] = torch.equal(x, want)
    out["ar_bytes"] = t.as_dict()
    y = _spread(me, (rows, cols))
    comm.all_reduce(y, grid, "data", op="avg", order="tree", async_op=True).wait()
    out["avg"] = torch.equal(y, want / world)
    gnnpar.release(grid)
    grid = gnnpar.init(data=2, x=2)  # data ranks (0, 2) and (1, 3)
    d = grid.rank("data")
    pair = _spread(2 * d, (rows, cols)) + _spread(2 * d + 1, (rows, cols))
    comm.all_reduce(pair, grid, "data", order="tree")
    out["pairs"] = torch.equal(pair, want)
    gnnpar.release(grid)
    return out


def test_tree_order_sums_in_one_tree_whatever_the_data_size():
    for r in run_distributed(_tree_world, 4):
        assert r["rs"] and r["ar"] and r["avg"] and r["pairs"], r
        # the ring's bytes: 7 rows padded to 4 × 2 of 3 float32 = 96 bytes; 3/4 of it, and
        # twice that for the all-reduce (a reduce-scatter then an all-gather)
        assert r["rs_bytes"] == {"data": {"reduce_scatter": 72}}, r
        assert r["ar_bytes"] == {"data": {"all_reduce": 144}}, r


def test_tree_sum_is_pairwise_and_orders_are_checked():
    a, b, c = torch.tensor([1e8]), torch.tensor([-1e8]), torch.tensor([1.0])
    # ((a + b) + (c + c)) + c: an odd last row waits a level
    assert comm.tree_sum(torch.stack([a, b, c, c, c])).item() == 3.0
    grid = gnnpar.init()
    with pytest.raises(ValueError, match="unknown order 'spiral'"):
        comm.all_reduce(torch.ones(2), grid, "data", order="spiral")
    with pytest.raises(ValueError, match="order 'tree' is a sum"):
        comm.all_reduce(torch.ones(2), grid, "data", op="max", order="tree")
