"""Full-graph 1D, 2D and 3D models against serial PyTorch, forward and backward, on every grid
shape of 1, 2, 4 and 8 ranks and of 3, 5, 6 and 7 with an odd size on each axis in turn
(``gnnpar.testing.grid_shapes``), with the bytes of each pass per axis and collective kind held
against the formulas of ``tests/byte_formulas.py`` (written out there, not taken from the
layers), and (3D) shard sizes.

Float64 throughout: logits, loss, weight, bias and input gradients agree with the serial model
to 1e-12 (relative and absolute; the largest error measured, |a−b|/(1+|b|), is 6.8e-16).
At 8 ranks the permuted cases run on a weighted graph (edges weighing 0.25 to 4, the two
directions apart): the weighted GCN degrees and SAGE means.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gnnpar
from gnnpar import comm
from gnnpar.models.fullgraph import parallelize_fullgraph
from gnnpar.models.fullgraph.model import GCN, FullGraphGNN, GraphSAGE
from gnnpar.testing import grid_shapes, run_distributed
from tests.byte_formulas import chunk_range, plexus_bytes, rows1d_bytes, summa_bytes
from tests.fullgraph_utils import (
    check_schedule,
    make_source,
    normalise,
    serial_adj,
    serial_model,
    small_graph,
)

DIMS = {"gcn": [7, 5, 3], "sage": [7, 4, 3]}  # odd widths: nothing divides the grid
N = 23
TOL = 1e-12
WORLDS = (1, 2, 3, 4, 5, 6, 7, 8)


def _close(a, b, what, tol=TOL):
    if a.shape != b.shape or not torch.allclose(a, b, atol=tol, rtol=tol):
        diff = (a - b).abs().max() if a.shape == b.shape else (a.shape, b.shape)
        raise AssertionError(f"{what}: max diff {diff}")


def _stage_nnz(a_hat, source, kind, rows, col_ranges, layers):
    """Nonzeros of block (rows, columns j′) of each layer's operators, counted on the dense
    matrix: layer ℓ multiplies order ℓ%2 (columns) into order 1−ℓ%2 (rows)."""
    out = []
    for layer in range(layers):
        parity = layer % 2
        ids_r = source.node_ids(1 - parity, rows)
        per_op = [[], []] if kind == "sage" else [[]]
        for cols in col_ranges:
            ids_c = source.node_ids(parity, cols)
            per_op[0].append(int(torch.count_nonzero(a_hat[ids_r][:, ids_c])))
            if kind == "sage":  # the identity operator between the two orders
                per_op[1].append(int(torch.isin(ids_r, ids_c).sum()))
        out.append(per_op)
    return out


def _formula(par, grid, a_hat, source, kind, algorithm, input_grad, chunks):
    dims = DIMS[kind]
    ops = 2 if kind == "sage" else 1
    shape, coords = grid.shape, grid.coords()
    if algorithm == "3d":
        return plexus_bytes(shape, coords, N, dims, ops, 8, input_grad, True, chunks)
    if algorithm == "1d":
        return rows1d_bytes(grid.size("tensor"), N, dims, ops, 8, input_grad, True)
    c = grid.size("y")
    cols = [chunk_range(N, c, j) for j in range(c)]
    nnz = _stage_nnz(a_hat, source, kind, par.rows, cols, len(dims) - 1)
    return summa_bytes(shape, coords, N, dims, ops, 8, input_grad, True, nnz)


def _check_shape(
    shape: dict, kind: str, permute: bool, dropout_seed, algorithm: str, chunks, weighted=False
):
    # The permuted case also checks the pass without an input gradient (raw features), whose
    # backward skips the collectives that only H's gradient needs.
    input_grad = not permute
    grid = gnnpar.init(**shape)
    a, x, y, train = small_graph(n=N, weighted=weighted)
    a_hat = normalise(a, kind)
    ref = serial_model(kind, DIMS[kind], dropout=0.5 if dropout_seed is not None else 0.0)
    xr = x.clone().requires_grad_(True)
    ref.train()
    logits = ref(serial_adj(a_hat), xr, dropout_seed=dropout_seed)
    loss_ref = F.cross_entropy(logits[train], y[train])
    loss_ref.backward()

    source = make_source(a_hat, x, y, train, permute, norm="mean" if kind == "sage" else "gcn")
    extra = {"overlap_chunks": chunks} if algorithm == "3d" else {}
    par = parallelize_fullgraph(ref, grid, source, algorithm=algorithm, **extra)
    par.train()
    xl = par.input_features().requires_grad_(input_grad)
    with comm.record(grid) as fwd:
        out = par(xl, dropout_seed=dropout_seed)
    rows, cols = par.logits_rows, par.logits_cols
    ids = source.node_ids(par.output_order, rows)
    tag = f"{grid.describe()} {algorithm} {kind} permute={permute} chunks={chunks} w={weighted}"
    _close(out.detach(), logits.detach()[ids][:, cols[0] : cols[1]], f"logits {tag}")
    loss = par.loss(out)
    _close(loss.detach(), loss_ref.detach(), f"loss {tag}")
    # backward traffic: from the logits alone (the loss's backward communicates nothing)
    with comm.record(grid) as bwd:
        loss.backward()
    full = par.full_weights(grads=True)
    for i, layer in enumerate(ref.layers):
        _close(full[i]["weight"], layer.stacked_weight_grad(), f"weight grad {i} {tag}")
        _close(full[i]["bias"], layer.bias.grad, f"bias grad {i} {tag}")
    if input_grad:
        in_rows, in_cols = par.input_block
        in_ids = source.node_ids(0, in_rows)
        _close(xl.grad, xr.grad[in_ids][:, in_cols[0] : in_cols[1]], f"input grad {tag}")

    want_f, want_b = _formula(par, grid, a_hat, source, kind, algorithm, input_grad, chunks)
    want_f.check(fwd.as_dict(), f"forward bytes {tag}")
    want_b.check(bwd.as_dict(), f"backward bytes {tag}")
    # ... and the layer's own schedule agrees, axis by axis (each collective rounds once)
    schedule = par.expected_bytes(input_grad=input_grad)
    check_schedule(fwd, bwd, schedule, tag)

    if algorithm == "3d":
        assert par.output_layout is par.layouts[-1]
        # real sharding: this rank's features are its block, and each weight element lives
        # on exactly one rank
        lay0 = par.layouts[0]
        feat_rows = lay0.h_sub[1] - lay0.h_sub[0]
        numel = par.shard_numel()
        if numel["features"] != feat_rows * (lay0.fin[1] - lay0.fin[0]):
            raise AssertionError(f"feature shard {numel['features']} ({tag})")
        w_total = sum(layer.stacked_weight().numel() for layer in ref.layers)
        total = comm.all_reduce(torch.tensor([float(numel["weights"])]), grid, "world")
        if int(total.item()) != w_total:
            raise AssertionError(f"weights not partitioned: {total.item()} vs {w_total} ({tag})")
    gnnpar.release(grid)


def _shapes(world: int, algorithm: str) -> list[dict[str, int]]:
    if algorithm == "2d":  # SUMMA runs on x × y
        return [{**s, "z": 1} for s in grid_shapes(world, ("x", "y"))]
    if algorithm == "1d":  # one axis of every rank: the shape only orders the ranks
        shapes = grid_shapes(world)
        return shapes[:1] + ([{"x": 1, "y": 1, "z": world}] if world > 1 else [])
    return grid_shapes(world)


def _check_world(world: int, algorithm: str) -> int:
    n = 0
    for shape in _shapes(world, algorithm):
        for kind in ("gcn", "sage"):
            # plain, and permuted with dropout (3D: the aggregate in 2 and 3 row chunks)
            for permute, seed, chunks in ((False, None, 2), (True, 11, 3)):
                # at 8 ranks the permuted case runs on a weighted graph (weighted degrees
                # and means)
                weighted = world == 8 and permute
                _check_shape(shape, kind, permute, seed, algorithm, chunks, weighted)
                n += 1
    return n


def _check_kept_gather(world: int) -> list[int]:
    """The 1D model on graphs whose rows split evenly (so its all-gathers land in the kept
    buffers) and on one whose rows do not (they cannot), and the 3D one on z (whose first
    layer gathers its input, into no kept buffer): two training passes each, equal to the
    serial model's, with dropout. Returns the number of buffers of each case."""
    counts = []
    for algorithm, shape in (("1d", {"x": world}), ("3d", {"z": world})):
        grid = gnnpar.init(**shape)
        for kind, n in (("gcn", 6 * world), ("sage", 6 * world), ("gcn", 6 * world + 1)):
            a, x, y, train = small_graph(n=n)
            a_hat = normalise(a, kind)
            ref = serial_model(kind, DIMS[kind], dropout=0.5)
            norm = "mean" if kind == "sage" else "gcn"
            source = make_source(a_hat, x, y, train, True, norm=norm)
            par = parallelize_fullgraph(ref, grid, source, algorithm=algorithm)
            par.train()
            rows, cols = par.logits_rows, par.logits_cols
            ids = source.node_ids(par.output_order, rows)
            for seed in (5, 6):  # the second pass reuses the first one's buffers
                ref.zero_grad()
                par.zero_grad()
                logits = ref(serial_adj(a_hat), x, dropout_seed=seed)
                F.cross_entropy(logits[train], y[train]).backward()
                out = par(par.input_features(), dropout_seed=seed)
                tag = f"kept gather {algorithm} {kind} n={n} {grid.describe()} pass {seed}"
                _close(out.detach(), logits.detach()[ids][:, cols[0] : cols[1]], f"logits {tag}")
                par.loss(out).backward()
                full = par.full_weights(grads=True)
                for i, layer in enumerate(ref.layers):
                    want = layer.stacked_weight_grad()
                    _close(full[i]["weight"], want, f"weight grad {i} {tag}")
                    _close(full[i]["bias"], layer.bias.grad, f"bias grad {i} {tag}")
            # 1D: one buffer per input width, of the whole graph's rows; none when the rows
            # split unevenly, nor in 3D
            even = n % world == 0 and algorithm == "1d"
            want = {(n, d) for d in DIMS[kind][:-1]} if even else set()
            got = {tuple(b.shape) for b in par._gather_buffers.values()}
            if got != want:
                raise AssertionError(f"gather buffers {got}, want {want} ({tag})")
            counts.append(len(got))
        gnnpar.release(grid)
    return counts


@pytest.mark.parametrize("world", [2, 3])
def test_gathers_into_kept_buffers_and_equal_serial_twice(world):
    assert run_distributed(_check_kept_gather, world, world) == [[2, 2, 0, 0, 0, 0]] * world


def test_gcn_and_graphsage_are_the_plain_model_of_each_kind():
    for make, kind in ((GCN, "gcn"), (GraphSAGE, "sage")):
        model = make(7, 5, 3, num_layers=3, dropout=0.1)
        assert isinstance(model, FullGraphGNN) and model.kind == kind
        assert model.dims == [7, 5, 5, 3] and model.dropout == 0.1


def _as_recorded(steps, es: int, phase: str) -> dict[str, dict[str, int]]:
    """``Traffic.as_dict()`` of ``steps`` of one phase, each collective rounding once."""
    out: dict[str, dict[str, int]] = {}
    for s in steps:
        if s.phase == phase:
            d = out.setdefault(s.axis, {})
            d[s.kind] = d.get(s.kind, 0) + round(s.nbytes(es))
    return out


@pytest.mark.parametrize("kind", ["gcn", "sage"])
def test_every_layer_schedule_equals_the_written_formula_on_every_rank(kind):
    """One process, every rank of uneven shapes: each layer kind's schedule (the one
    description the models' accounting and the planner use) equals the formulas written out
    in tests/byte_formulas.py, per axis and collective kind, forward and backward."""
    from gnnpar.comm import chunk_sizes
    from gnnpar.grid import GridShape
    from gnnpar.models.fullgraph.cagnet import rows1d_schedule, summa_schedule
    from gnnpar.models.fullgraph.layout import layout3d
    from gnnpar.models.fullgraph.plexus import layer_schedule

    dims, ops, es = DIMS[kind], 2 if kind == "sage" else 1, 8
    for (x, y, z), grad, chunks in (((3, 2, 5), True, 1), ((2, 3, 1), False, 3)):
        g0 = GridShape(x=x, y=y, z=z)
        for rank in range(g0.world_size):
            g = GridShape(x=x, y=y, z=z, global_rank=rank)
            coords = g.coords()
            steps = []
            for i in range(len(dims) - 1):
                lay = layout3d(g, i, N, dims[i], dims[i + 1], ops)
                steps += layer_schedule(g, lay, ops, i == 0, grad or i > 0, True, chunks)
            f, b = plexus_bytes(g.shape, coords, N, dims, ops, es, grad, True, chunks)
            f.check(_as_recorded(steps, es, "forward"), f"3d forward {coords}")
            b.check(_as_recorded(steps, es, "backward"), f"3d backward {coords}")
            # 2D on x × y (z folded away), arbitrary per-stage nonzero counts
            r, c = x, y
            i_, j_ = rank % r, (rank // r) % c
            rows = chunk_range(N, r, i_)
            nnz = [
                [[3 + layer + k + jj for jj in range(c)] for k in range(ops)] for layer in (0, 1)
            ]
            steps = []
            for i in range(len(dims) - 1):
                fin = chunk_range(dims[i], c, j_)
                steps += summa_schedule(
                    (r, c), chunk_sizes(N, r), rows[1] - rows[0], chunk_sizes(dims[i], c),
                    fin[1] - fin[0], dims[i + 1], nnz[i], grad or i > 0, True, 4, i,
                )  # fmt: skip
            f, b = summa_bytes(
                {"x": r, "y": c}, {"x": i_, "y": j_}, N, dims, ops, es, grad, True, nnz
            )
            f.check(_as_recorded(steps, es, "forward"), f"2d forward {(i_, j_)}")
            b.check(_as_recorded(steps, es, "backward"), f"2d backward {(i_, j_)}")
        p = g0.world_size
        steps = []
        for i in range(len(dims) - 1):
            d_in, d_out = dims[i], dims[i + 1]
            steps += rows1d_schedule(
                "tensor", chunk_sizes(N, p), d_in, d_out, ops, grad or i > 0, True, i
            )
        f, b = rows1d_bytes(p, N, dims, ops, es, grad, True)
        f.check(_as_recorded(steps, es, "forward"), f"1d forward p={p}")
        b.check(_as_recorded(steps, es, "backward"), f"1d backward p={p}")


@pytest.mark.parametrize("algorithm", ["3d", "2d", "1d"])
@pytest.mark.parametrize("world", WORLDS)  # small worlds of every algorithm first
def test_matches_serial_every_grid(world, algorithm):
    counts = run_distributed(_check_world, world, world, algorithm, timeout=600)
    assert counts == [4 * len(_shapes(world, algorithm))] * world
