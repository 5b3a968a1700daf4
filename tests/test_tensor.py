"""3D tensor-parallel layers against serial PyTorch, on every grid shape of 1, 2, 4 and 8 ranks.

Each world runs every factorisation of its size into (data, x, y, z), and the worlds 3, 5, 6
and 7 one shape per axis with an odd size on it (``gnnpar.testing.grid_shapes``); on each a
``Linear`` (with and without bias and transpose, easy and expert mode), an ``Embedding``
(plain and transposed) and the vocabulary-parallel cross-entropy are checked forward and
backward in float64 against ``nn.Linear``/``nn.Embedding``/``F.cross_entropy`` on the whole
batch, with sizes that no axis divides; the bytes moved per axis are checked against the
AxoNN formulas (written out below, independently of the implementation); and each rank's
weight piece is checked to be 1/(x·y·z) of the weight up to the documented padding.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gnnpar
from gnnpar import comm, tensor
from gnnpar.comm import chunk_offsets, chunk_sizes
from gnnpar.tensor import ShardLayout
from gnnpar.testing import grid_shapes, run_distributed

F64 = torch.float64
E = 8  # bytes per float64
IN, OUT, VOCAB, DIM = 11, 9, 13, 10  # no axis size up to 8 divides all of them
ROWS = (3, 2)  # leading dims of each batch shard
AXES4 = ("data", "x", "y", "z")


def _sum_batch_grads(module, grid) -> None:
    """Sum the gradients over the ranks that saw other rows of the batch (data and z): what
    the data-parallel layer does, written out here. A matrix weight's gradient is already
    summed over z by the reduce-scatter of its z all-gather; everything else is not."""
    for p in module.parameters():
        layout = next(
            (lay for m in module.modules() if isinstance(m, tensor.ShardedModule)
             for name, lay in m.layouts().items() if getattr(m, name) is p),
            None,
        )  # fmt: skip
        axes = ("data",) if layout is not None and layout.kind == "matrix" else ("z", "data")
        for axis in axes:
            comm.all_reduce(p.grad, grid, axis)


def _ar(p, v):
    return round(2 * (p - 1) / p * v) if p > 1 else 0


def _ag(p, v):
    return round((p - 1) / p * v) if p > 1 else 0


def _add(d, axis, kind, v):
    if v:
        d.setdefault(axis, {})[kind] = d.get(axis, {}).get(kind, 0) + v


def _batch_shard(grid):
    """(index, count) of this rank's batch shard: the batch is split over z and data."""
    return grid.rank("z") + grid.size("z") * grid.rank("data"), grid.size("z") * grid.size("data")


def _global(shape, salt, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(salt), dtype=dtype)


def _chunk(t, sizes, i, dim=-1):
    return t.narrow(dim, chunk_offsets(sizes)[i], sizes[i])


def _close(a, b, what, tol=1e-12):
    if a.shape != b.shape or not torch.allclose(a, b, atol=tol, rtol=tol):
        err = (a - b).abs().max().item() if a.shape == b.shape else "shape"
        raise AssertionError(f"{what}: max error {err}; shapes {a.shape} vs {b.shape}")


def _linear_bytes(grid, transpose, easy):
    """AxoNN byte formulas of one Linear, forward and backward, per rank."""
    i_ax, o_ax = ("y", "x") if transpose else ("x", "y")
    pi, po, z = grid.size(i_ax), grid.size(o_ax), grid.size("z")
    rs, cs = chunk_sizes(OUT, po), chunk_sizes(IN, pi)
    r, c = rs[grid.rank(o_ax)], cs[grid.rank(i_ax)]
    b = math.prod(ROWS)
    shard = -(-r * c // z)
    fwd, bwd = {}, {}
    _add(fwd, "z", "all_gather", _ag(z, z * shard * E))
    _add(fwd, i_ax, "all_reduce", _ar(pi, b * r * E))
    if easy:
        _add(fwd, o_ax, "all_gather", _ag(po, po * max(rs) * b * E))
    _add(bwd, o_ax, "all_reduce", _ar(po, b * c * E))
    _add(bwd, "z", "reduce_scatter", _ag(z, z * shard * E))
    if easy:
        _add(bwd, i_ax, "all_gather", _ag(pi, pi * max(cs) * b * E))
    return fwd, bwd


def _check_linear(grid, bias, transpose, easy):
    tag = f"{grid.describe()} bias={bias} transpose={transpose} easy={easy}"
    s, n = _batch_shard(grid)
    torch.manual_seed(7)
    ref = nn.Linear(IN, OUT, bias=bias, dtype=F64)
    X = _global((n, *ROWS, IN), 1)
    G = _global((n, *ROWS, OUT), 2)
    Xr = X.clone().requires_grad_(True)
    (ref(Xr) * G).sum().backward()

    layer = tensor.Linear(
        IN, OUT, grid, bias=bias, transpose=transpose, expert_mode=not easy, dtype=F64
    )
    layer.load_full(ref.weight.detach(), None if ref.bias is None else ref.bias.detach())
    i_ax, o_ax = layer.in_axis, layer.out_axis
    x, g, y_ref, dx_ref = X[s], G[s], ref(X[s]).detach(), Xr.grad[s]
    if not easy:
        ii, oi = grid.rank(i_ax), grid.rank(o_ax)
        x, dx_ref = _chunk(x, layer.in_sizes, ii), _chunk(dx_ref, layer.in_sizes, ii)
        g, y_ref = _chunk(g, layer.out_sizes, oi), _chunk(y_ref, layer.out_sizes, oi)
    x = x.clone().requires_grad_(True)
    with comm.record(grid) as fwd:
        y = layer(x)
    with comm.record(grid) as bwd:
        (y * g).sum().backward()
    _sum_batch_grads(layer, grid)
    _close(y, y_ref, f"Linear forward {tag}")
    _close(x.grad, dx_ref, f"Linear dX {tag}")
    lay = layer.weight_layout
    r, c, d = lay.coords(grid)
    _close(layer.weight.grad, lay.shard(ref.weight.grad, r, c, d), f"Linear dW {tag}")
    if bias:
        _close(layer.bias.grad, layer.bias_layout.shard(ref.bias.grad, r), f"Linear db {tag}")
    want_f, want_b = _linear_bytes(grid, transpose, easy)
    if fwd.as_dict() != want_f or bwd.as_dict() != want_b:
        raise AssertionError(
            f"Linear bytes {tag}: forward {fwd.as_dict()} (formula {want_f}), backward "
            f"{bwd.as_dict()} (formula {want_b})"
        )
    # 1/(x·y·z) of the weight: this rank's block is at most ceil(out/po)×ceil(in/pi), padded
    # to a multiple of z; over the tensor group the pieces add up to the weight + padding.
    po, pi, z = grid.size(o_ax), grid.size(i_ax), grid.size("z")
    bound = math.ceil(math.ceil(OUT / po) * math.ceil(IN / pi) / z)
    held = layer.weight.numel()
    if held != math.ceil(math.prod(lay.block_shape(r, c)) / z) or held > bound:
        raise AssertionError(f"Linear holds {held} weights, bound {bound} ({tag})")
    total = torch.tensor([held], dtype=torch.int64)
    comm.all_reduce(total, grid, "tensor")
    if not OUT * IN <= int(total) < OUT * IN + z * po * pi:
        raise AssertionError(f"pieces add up to {int(total)}, weight has {OUT * IN} ({tag})")


def _check_embedding_and_loss(grid, transpose):
    tag = f"{grid.describe()} transpose={transpose}"
    s, n = _batch_shard(grid)
    torch.manual_seed(3)
    ref = nn.Embedding(VOCAB, DIM, dtype=F64)
    ids = torch.randint(0, VOCAB, (n, *ROWS), generator=torch.Generator().manual_seed(4))
    G = _global((n, *ROWS, DIM), 5)
    (ref(ids) * G).sum().backward()
    emb = tensor.Embedding(VOCAB, DIM, grid, transpose=transpose, dtype=F64)
    emb.load_full(ref.weight.detach())
    with comm.record(grid) as fwd:
        e = emb(ids[s])
    with comm.record(grid) as bwd:
        (e * G[s]).sum().backward()
    _sum_batch_grads(emb, grid)
    _close(e, ref(ids[s]).detach(), f"Embedding forward {tag}")
    lay = emb.weight_layout
    r, c, d = lay.coords(grid)
    _close(emb.weight.grad, lay.shard(ref.weight.grad, r, c, d), f"Embedding grad {tag}")
    i_ax, o_ax = emb.in_axis, emb.out_axis
    pi, po, z = grid.size(i_ax), grid.size(o_ax), grid.size("z")
    cs = chunk_sizes(DIM, pi)
    blk = lay.block_shape(r, c)
    shard = -(-blk[0] * blk[1] // z)
    b = math.prod(ROWS)
    want_f, want_b = {}, {}
    _add(want_f, "z", "all_gather", _ag(z, z * shard * E))
    _add(want_f, o_ax, "all_reduce", _ar(po, b * cs[grid.rank(i_ax)] * E))
    _add(want_f, i_ax, "all_gather", _ag(pi, pi * max(cs) * b * E))
    _add(want_b, "z", "reduce_scatter", _ag(z, z * shard * E))
    if fwd.as_dict() != want_f or bwd.as_dict() != want_b:
        raise AssertionError(
            f"Embedding bytes {tag}: {fwd.as_dict()} / {bwd.as_dict()}, formula {want_f} / {want_b}"
        )

    # Cross-entropy over logits split by a head (Linear DIM → VOCAB, output kept sharded).
    torch.manual_seed(9)
    ref_head = nn.Linear(DIM, VOCAB, bias=False, dtype=F64)
    H = _global((n, *ROWS, DIM), 6)
    tgt = torch.randint(0, VOCAB, (n, *ROWS), generator=torch.Generator().manual_seed(8))
    tgt[..., 0] = -100  # ignored positions
    Hr = H.clone().requires_grad_(True)
    loss_ref = F.cross_entropy(ref_head(Hr).reshape(-1, VOCAB), tgt.reshape(-1), reduction="sum")
    loss_ref.backward()
    head = tensor.Linear(
        DIM, VOCAB, grid, bias=False, transpose=transpose, gather_output=False, dtype=F64
    )
    head.load_full(ref_head.weight.detach())
    h = H[s].clone().requires_grad_(True)
    logits = head(h)
    with comm.record(grid) as ce:
        loss = tensor.cross_entropy(logits, tgt[s], head, reduction="sum")
    loss.backward()
    _sum_batch_grads(head, grid)
    per_shard = F.cross_entropy(
        ref_head(H[s]).reshape(-1, VOCAB), tgt[s].reshape(-1), reduction="sum"
    )
    _close(loss.detach(), per_shard.detach(), f"cross-entropy value {tag}")
    _close(h.grad, Hr.grad[s], f"cross-entropy dH {tag}")
    hl = head.weight_layout
    r, c, d = hl.coords(grid)
    _close(head.weight.grad, hl.shard(ref_head.weight.grad, r, c, d), f"head dW {tag}")
    with torch.no_grad():  # the mean counts only the targets that are not ignored
        mean = tensor.cross_entropy(head(H[s]), tgt[s], head)
        ref_mean = F.cross_entropy(ref_head(H[s]).reshape(-1, VOCAB), tgt[s].reshape(-1))
    _close(mean, ref_mean, f"cross-entropy mean {tag}")
    p = grid.size(o_ax)
    want = {o_ax: {"all_reduce": _ar(p, b * E) + _ar(p, 2 * b * E)}} if p > 1 else {}
    if ce.as_dict() != want:
        raise AssertionError(f"cross-entropy bytes {tag}: {ce.as_dict()}, formula {want}")


def _check_world(world: int) -> int:
    checked = 0
    for shape in grid_shapes(world, AXES4):
        grid = gnnpar.init(**shape)
        for bias in (True, False):
            for transpose in (False, True):
                for easy in (True, False):
                    _check_linear(grid, bias, transpose, easy)
                    checked += 1
        for transpose in (False, True):
            _check_embedding_and_loss(grid, transpose)
        gnnpar.release(grid)
    return checked


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 6, 7, 8])
def test_layers_match_serial_on_every_grid(world):
    out = run_distributed(_check_world, world, world, timeout=300)
    assert out == [8 * len(grid_shapes(world, AXES4))] * world


def test_single_process_grid_matches_torch(monkeypatch):
    """On a 1×1×1 grid (no torch.distributed) the layers are nn.Linear / nn.Embedding."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    grid = gnnpar.init()
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT)
    torch.manual_seed(0)
    ours = tensor.Linear(IN, OUT, grid)  # same seed → same initial values as nn.Linear
    assert torch.equal(ours.weight.view(OUT, IN), ref.weight)
    assert torch.equal(ours.bias, ref.bias)
    x = torch.randn(4, IN)
    assert torch.allclose(ours(x), ref(x))
    assert f"in_features={IN}, out_features={OUT}, bias=True" in repr(ours)
    emb = tensor.Embedding(VOCAB, DIM, grid)
    assert f"{VOCAB}, {DIM}, transpose=False" in repr(emb)
    ids = torch.tensor([[0, 12, 3]])
    assert torch.equal(emb(ids), emb.weight.view(VOCAB, DIM)[ids])
    logits = torch.randn(2, 3, VOCAB)
    t = torch.randint(0, VOCAB, (2, 3))
    assert torch.allclose(
        tensor.cross_entropy(logits, t, ours),
        F.cross_entropy(logits.reshape(-1, VOCAB), t.view(-1)),
    )


def test_layout_round_trip_and_sizes():
    grid_like = dict(row_axis="y", col_axis="x")
    for rows, cols, rp, cp, depth, fused in [
        (9, 11, 2, 4, 3, 1),
        (12, 5, 2, 1, 4, 3),
        (30, 7, 4, 3, 2, 3),
        (5, 5, 1, 1, 1, 1),
    ]:
        lay = ShardLayout(
            "matrix",
            (rows, cols),
            **grid_like,
            row_parts=rp,
            col_parts=cp,
            depth=depth,
            fused=fused,
        )
        full = torch.arange(rows * cols, dtype=F64).view(rows, cols)
        pieces = {
            (r, c, d): lay.shard(full, r, c, d)
            for r in range(rp)
            for c in range(cp)
            for d in range(depth)
        }
        assert torch.equal(lay.assemble(pieces), full)
        assert all(p.numel() == lay.shard_numel(r, c) for (r, c, _), p in pieces.items())
        # fused: each rank's rows are whole chunks of every part, in part order
        part = rows // fused
        idx = lay.row_index(0)
        assert idx.tolist()[: len(idx) // fused] == list(range(len(idx) // fused))
        assert all(int(i) // part == k for k, chunk in enumerate(idx.chunk(fused)) for i in chunk)
        vec = ShardLayout("vector", (rows,), "x", None, rp, 1, 1, fused)
        v = torch.arange(rows, dtype=F64)
        assert torch.equal(vec.assemble({(r, 0, 0): vec.shard(v, r) for r in range(rp)}), v)
        assert ShardLayout.from_dict(lay.to_dict()) == lay
        assert lay.numel == rows * cols


def test_layout_errors_are_clear():
    with pytest.raises(ValueError, match="cannot split 3 rows over y=4"):
        ShardLayout("matrix", (3, 8), "y", "x", 4, 1, 1)
    with pytest.raises(ValueError, match="cannot split 2 columns over x=4"):
        ShardLayout("matrix", (8, 2), "y", "x", 1, 4, 1)
    with pytest.raises(ValueError, match="cannot be fused into 3 equal parts"):
        ShardLayout("matrix", (8, 2), "y", "x", 1, 1, 1, fused=3)
    lay = ShardLayout("matrix", (4, 4), "y", "x", 2, 2, 1)
    with pytest.raises(ValueError, match=r"expected a full tensor of shape \(4, 4\)"):
        lay.shard(torch.zeros(4, 5), 0, 0, 0)


def _bad_inputs() -> list[str]:
    grid = gnnpar.init(x=2, y=2)
    msgs = []
    calls = [
        lambda: tensor.Linear(1, 4, grid),  # 1 input feature over x=2
        lambda: tensor.Linear(4, 1, grid),  # 1 output feature over y=2
        lambda: tensor.Linear(4, 4, grid, expert_mode=True)(torch.zeros(2, 4)),
        lambda: tensor.Linear(4, 4, grid)(torch.zeros(2, 3)),
        lambda: tensor.Embedding(5, 4, grid)(torch.tensor([0, 5])),
        lambda: tensor.Linear(4, 4, grid, weight_format="rows"),
        lambda: tensor.vocab_parallel_cross_entropy(
            torch.zeros(2, 3), torch.tensor([0, 7]), grid, "y", 6
        ),
        lambda: tensor.vocab_parallel_cross_entropy(
            torch.zeros(2, 2), torch.tensor([0, 1]), grid, "y", 6
        ),
    ]
    for call in calls:
        try:
            call()
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_bad_inputs_give_clear_errors():
    msgs = run_distributed(_bad_inputs, 4)[0]
    assert "cannot split 1 input features over x=2" in msgs[0]
    assert "cannot split 1 rows over y=2" in msgs[1]
    assert "expected this rank's 2 of 4 input features split over x (expert mode)" in msgs[2]
    assert "expected input with 4 features (easy mode), got shape (2, 3)" in msgs[3]
    assert "ids must lie in [0, 5), got [0, 5]" in msgs[4]
    assert "weight_format must be one of" in msgs[5]
    assert "targets must lie in [0, 6)" in msgs[6]
    assert "this rank's chunk of 6 classes over y=2 has 3" in msgs[7]
