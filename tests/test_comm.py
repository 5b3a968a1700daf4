"""Collectives and their autograd pairs against serial references, with byte accounting."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gnnpar
from gnnpar import comm
from gnnpar.comm import CommError, chunk_offsets, chunk_sizes, ring_bytes
from gnnpar.testing import run_distributed

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
    _expect_bytes(t, axis, "all_reduce", ring_bytes("all_reduce", 5 * 3 * es, p), tag)
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
    _expect_bytes(t, axis, "all_gather", ring_bytes("all_gather", p * 5 * 3 * es, p), tag)
    sizes = [i + 1 for i in range(p)]
    mine = _data(grid.global_rank, sizes[me], salt=1)
    with comm.record(grid) as t:
        out = comm.all_gather(mine.T.contiguous(), grid, axis, dim=1, sizes=sizes, async_op=True)
        out = out.wait()
    ref = torch.cat([_data(r, sizes[i], salt=1) for i, r in enumerate(members)]).T
    _close(out, ref, f"all_gather uneven dim 1 {tag}")
    _expect_bytes(t, axis, "all_gather", ring_bytes("all_gather", p * p * 3 * es, p), tag)

    # reduce-scatter: 7 rows (odd; uneven unless p divides 7), along dim 0 and dim 1
    y = _data(grid.global_rank, 7, salt=2)
    total = sum(_data(r, 7, salt=2) for r in members)
    cs = chunk_sizes(7, p)
    off = chunk_offsets(cs)[me]
    with comm.record(grid) as t:
        out = comm.reduce_scatter(y, grid, axis)
    _close(out, total[off : off + cs[me]], f"reduce_scatter {tag}")
    _expect_bytes(
        t, axis, "reduce_scatter", ring_bytes("reduce_scatter", p * max(cs) * 3 * es, p), tag
    )
    out = comm.reduce_scatter(y.T.contiguous(), grid, axis, dim=1, async_op=True).wait()
    _close(out, total[off : off + cs[me]].T, f"reduce_scatter dim 1 {tag}")

    # broadcast from the last index of the group
    z = _data(grid.global_rank, 4, salt=3)
    with comm.record(grid) as t:
        comm.broadcast(z, grid, axis, src=p - 1)
    _close(z, _data(members[-1], 4, salt=3), f"broadcast {tag}")
    _expect_bytes(t, axis, "broadcast", ring_bytes("broadcast", 4 * 3 * es, p), tag)

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

    cs = chunk_sizes(rows, p)
    off = chunk_offsets(cs)

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
    out, g = run(
        lambda x: comm.gather_from(x.T, grid, axis, dim=1).T, per_rank[me], weights[me]
    )
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


SHAPES = {
    2: [dict(x=2), dict(data=2)],
    4: [dict(x=2, y=2), dict(z=4), dict(data=2, z=2)],
    8: [dict(x=2, y=2, z=2), dict(data=2, x=4), dict(y=2, z=2, data=2)],
}


def _check_world(world: int) -> int:
    checked = 0
    for shape in SHAPES[world]:
        grid = gnnpar.init(**shape)
        for axis in ("x", "y", "z", "data", "tensor"):
            if grid.size(axis) > 1:
                _check_collectives(grid, axis)
                _check_autograd_pairs(grid, axis)
                checked += 1
    return checked


@pytest.mark.parametrize("world", [2, 4, 8])
def test_collectives_and_pairs_match_serial(world):
    out = run_distributed(_check_world, world, world, timeout=400)
    assert out[0] > 0 and len(set(out)) == 1


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
