"""Full-graph 1D, 2D and 3D models against serial PyTorch, forward and backward, on every grid
shape up to 8 ranks, with byte accounting and (3D) shard sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gnnpar
from gnnpar import comm
from gnnpar.grid import factorizations
from gnnpar.sparse import parallelize_fullgraph
from gnnpar.testing import run_distributed
from tests.fullgraph_utils import make_source, normalise, serial_adj, serial_model, small_graph

DIMS = [7, 5, 3]  # odd widths: nothing divides the grid


def _close(a, b, what, tol=1e-10):
    if a.shape != b.shape or not torch.allclose(a, b, atol=tol, rtol=tol):
        diff = (a - b).abs().max() if a.shape == b.shape else (a.shape, b.shape)
        raise AssertionError(f"{what}: max diff {diff}")


def _check_shape(shape: dict, kind: str, permute: bool, dropout_seed, algorithm: str):
    # The permuted case also checks the pass without an input gradient (raw features), whose
    # backward skips the collectives that only H's gradient needs.
    input_grad = not permute
    grid = gnnpar.init(**shape)
    a, x, y, train = small_graph()
    a_hat = normalise(a, kind)
    dims = DIMS if kind == "gcn" else [7, 4, 3]
    ref = serial_model(kind, dims, dropout=0.5 if dropout_seed is not None else 0.0)
    xr = x.clone().requires_grad_(True)
    ref.train()
    logits = ref(serial_adj(a_hat), xr, dropout_seed=dropout_seed)
    loss_ref = F.cross_entropy(logits[train], y[train])
    loss_ref.backward()

    source = make_source(a_hat, x, y, train, permute)
    par = parallelize_fullgraph(ref, grid, source, algorithm=algorithm)
    par.train()
    xl = par.input_features().requires_grad_(input_grad)
    with comm.record(grid) as fwd:
        out = par(xl, dropout_seed=dropout_seed)
    rows, cols = par.logits_rows, par.logits_cols
    ids = source.node_ids(par.output_order, rows)
    tag = f"{grid.describe()} {algorithm} {kind} permute={permute}"
    _close(out.detach(), logits.detach()[ids][:, cols[0] : cols[1]], f"logits {tag}")
    loss = par.loss(out)
    _close(loss.detach(), loss_ref.detach(), f"loss {tag}")
    # backward traffic: from the logits alone (the loss adds its own scalar collectives)
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

    # bytes: forward exactly the formulas; backward the formulas plus the loss's scalars
    want = par.expected_bytes(input_grad=input_grad)
    for axis in ("x", "y", "z", "tensor"):
        got_f = fwd.bytes(axis=axis)
        exp_f = round(want["forward"].get(axis, 0.0))
        # each recorded collective rounds its fractional ring bytes once
        if abs(got_f - exp_f) > max(1, fwd.calls(axis=axis)):
            raise AssertionError(f"forward bytes on {axis}: {got_f} != {exp_f} ({tag})")
        got_b = bwd.bytes(axis=axis)
        exp_b = round(want["backward"].get(axis, 0.0))
        if abs(got_b - exp_b) > max(1, bwd.calls(axis=axis)):
            raise AssertionError(f"backward bytes on {axis}: {got_b} != {exp_b} ({tag})")

    w_total = sum(layer.stacked_weight().numel() for layer in ref.layers)
    if algorithm != "3d":
        return grid, None
    # real sharding: this rank's pieces have the sizes of its layout
    lay0 = par.layouts[0]
    numel = par.shard_numel()
    feat_rows = lay0.h_sub[1] - lay0.h_sub[0]
    if numel["features"] != feat_rows * (lay0.fin[1] - lay0.fin[0]):
        raise AssertionError(f"feature shard {numel['features']} ({tag})")
    return grid, {"w": numel["weights"], "w_total": w_total}


def _shapes(world: int, algorithm: str) -> list[tuple[int, int, int]]:
    shapes = [(x, y, z) for d, x, y, z in factorizations(world) if d == 1]
    if algorithm == "2d":
        return [s for s in shapes if s[2] == 1]
    if algorithm == "1d":
        return shapes[:1] + ([(1, 1, world)] if world > 1 else [])
    return shapes


def _check_world(world: int, kind: str, algorithm: str) -> int:
    n = 0
    for x, y, z in _shapes(world, algorithm):
        for permute, seed in ((False, None), (True, 11)):
            shape = {"x": x, "y": y, "z": z}
            grid, info = _check_shape(shape, kind, permute, seed, algorithm)
            if info is None:
                n += 1
                continue
            # weight shards: each element on exactly one rank
            total = comm.all_reduce(torch.tensor([float(info["w"])]), grid, "world")
            if int(total.item()) != info["w_total"]:
                raise AssertionError(f"weights not partitioned: {total.item()} vs {info}")
            n += 1
    return n


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["gcn", "sage"])
@pytest.mark.parametrize("algorithm", ["3d", "2d", "1d"])
def test_matches_serial_every_grid(world, kind, algorithm):
    counts = run_distributed(_check_world, world, world, kind, algorithm, timeout=600)
    assert counts[0] == 2 * len(_shapes(world, algorithm))
