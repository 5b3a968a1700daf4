"""bf16 full-graph training (``compute_dtype=torch.bfloat16``, ``mixed_precision = "bf16"``):
fp32 masters, bfloat16 Â, features, activations, products and collectives.

Each check builds the float64 serial model and, from it, the parallel model twice on the same
grid: in float32 and in bf16 (float32 masters). Per rank, pass and collective kind:

- bytes: the bf16 run's are exactly half of the float32 run's (checked as ``2·bf16 ==
  fp32``) on a graph whose sizes make every collective's ring bytes whole (N = 24, even
  widths); on the odd graph (N = 23, widths 7-5-3) within the one rounding per collective of
  ``comm.record``; and both equal ``tests/byte_formulas.py`` with 2-byte elements. 2D's
  broadcasts carry Â's int64 row pointers and int32 column ids besides its values, so only
  their values halve (checked against the formula); every other kind halves;
- precision: parameters and their gradients are float32, logits bfloat16, the loss float32;
- accuracy against the float64 serial model, the worst over ranks, shapes, models and graphs
  (dropout on): |a−b|/(1+|b|) for logits and loss, max|a−b| / max|b| for each layer's weight
  and bias gradients. The bounds below are about 3× the worst measured; the floors show the
  run really computes in bfloat16 (float32 compute would sit near 2e-7, as the float32 run,
  which must stay under ``FP32_BOUND``, does), and the dtype checks that it is bfloat16, not
  float16 (2 bytes as well, smaller errors);
- masters: one Adam step of ``lr = 2**-12`` moves every parameter by about lr; for those
  (most) where that is less than half a bfloat16 ulp, bfloat16 masters would not move.

On one rank nothing is reduced, so the bf16 model is the serial float64 model with every
operand and every result rounded to bfloat16 once (SpMM and GEMM accumulate in float32; the
SpMM kernel, fbgemm's ``embedding_bag``, rounds ties away from zero, the GEMM and additions to
even): its logits and its gradients (from the same logit gradient) equal that emulation bit
for bit. One rounding more or fewer — a float32 payload or product, a bfloat16 accumulation —
fails.

Then ``gnnpar train gcn --mixed-precision bf16`` through the CLI: a run, and a run stopped and
resumed, end with bit-identical float32 checkpoints; fp16 is refused in one line.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gnnpar
from gnnpar import checkpoint, comm
from gnnpar.cli import main
from gnnpar.models.fullgraph import parallelize_fullgraph
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

BF16 = torch.bfloat16
GRAPHS = {  # name: (nodes, widths per model)
    "odd": (23, {"gcn": [7, 5, 3], "sage": [7, 4, 3]}),
    "even": (24, {"gcn": [8, 6, 4], "sage": [8, 4, 4]}),
}
DROPOUT_SEED = 11
# Worst errors measured over every check of this file (see the module docstring):
#   bf16     logits 1.4e-2, loss 2.3e-3, weight grads 1.4e-2, bias grads 7.1e-3
#   float32  logits 2.2e-7, loss 3.1e-8, weight grads 2.1e-7, bias grads 2.5e-7
# The bounds are about 3x the bf16 worst; the floors (each world's worst must reach them)
# about a tenth of it and a thousand times the float32 bound.
BOUNDS = {"logits": 4e-2, "loss": 6e-3, "weight": 4e-2, "bias": 2e-2}
FLOORS = {"logits": 1e-3, "loss": 2e-4, "weight": 1e-3, "bias": 7e-4}
FP32_BOUND = 1e-6
LR = 2.0**-12

# 3D on several shapes of 2, 4 and 8 ranks; 1D and 2D on one shape each.
CASES = {
    2: [("3d", s) for s in grid_shapes(2)],
    4: [("3d", {"x": 4}), ("3d", {"x": 2, "y": 2}), ("3d", {"y": 1, "z": 4}),
        ("2d", {"x": 2, "y": 2}), ("1d", {"x": 4})],
    8: [("3d", {"x": 2, "y": 2, "z": 2}), ("3d", {"x": 8}), ("3d", {"z": 8}),
        ("3d", {"x": 1, "y": 2, "z": 4})],
}  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a−b| / (1+|b|), in float64."""
    a, b = a.double(), b.double()
    return float(((a - b).abs() / (1 + b.abs())).max()) if b.numel() else 0.0


def _normwise(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a−b| / max |b|, in float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _formula(par, grid, a_hat, source, kind, algorithm, n, dims, es):
    ops = 2 if kind == "sage" else 1
    if algorithm == "3d":
        return plexus_bytes(grid.shape, grid.coords(), n, dims, ops, es, False, True)
    if algorithm == "1d":
        return rows1d_bytes(grid.size("tensor"), n, dims, ops, es, False, True)
    c = grid.size("y")
    cols = [chunk_range(n, c, j) for j in range(c)]
    nnz = []
    for layer in range(len(dims) - 1):  # nonzeros of block (rows, cols j′), as test_fullgraph
        ids_r = source.node_ids(1 - layer % 2, par.rows)
        per_op = [[] for _ in range(ops)]
        for cc in cols:
            ids_c = source.node_ids(layer % 2, cc)
            per_op[0].append(int(torch.count_nonzero(a_hat[ids_r][:, ids_c])))
            if ops == 2:
                per_op[1].append(int(torch.isin(ids_r, ids_c).sum()))
        nnz.append(per_op)
    return summa_bytes(grid.shape, grid.coords(), n, dims, ops, es, False, True, nnz)


def _run(par, source, ref_out):
    """Forward and backward of ``par`` under byte records; its errors against the serial
    model (``ref_out``: logits, loss, per-layer weight and bias gradients)."""
    grid = par.grid
    par.train()
    x = par.input_features()
    with comm.record(grid) as fwd:
        out = par(x, dropout_seed=DROPOUT_SEED)
    loss = par.loss(out)
    with comm.record(grid) as bwd:
        loss.backward()
    logits, loss_ref, grads = ref_out
    ids = source.node_ids(par.output_order, par.logits_rows)
    cols = par.logits_cols
    err = {
        "logits": _rel(out.detach(), logits[ids][:, cols[0] : cols[1]]),
        "loss": _rel(loss.detach(), loss_ref),
        "weight": 0.0,
        "bias": 0.0,
    }
    for mine, (w_ref, b_ref) in zip(par.full_weights(grads=True), grads, strict=True):
        err["weight"] = max(err["weight"], _normwise(mine["weight"], w_ref))
        err["bias"] = max(err["bias"], _normwise(mine["bias"], b_ref))
    return out, loss, fwd, bwd, err


def _halves(low, full, exact: bool, skip: tuple[str, ...], what: str) -> None:
    """Measured bytes of ``low`` are half of ``full``'s, per axis and kind (``exact``: to the
    byte; otherwise within the rounding of each collective)."""
    for axis in set(low.as_dict()) | set(full.as_dict()):
        for kind in comm.KINDS:
            if kind in skip:
                continue
            b, f = low.bytes(axis, kind), full.bytes(axis, kind)
            slack = 0 if exact else low.calls(axis, kind)
            if abs(2 * b - f) > slack or (f and not b):
                raise AssertionError(f"{what}: {axis} {kind} bf16 {b} B vs float32 {f} B")


def _check(shape, algorithm, kind, graph, step_masters):
    grid = gnnpar.init(**shape)
    n, widths = GRAPHS[graph]
    dims = widths[kind]
    a, x, y, train = small_graph(n=n, feat=dims[0], classes=dims[-1])
    a_hat = normalise(a, kind)
    ref = serial_model(kind, dims, dropout=0.5)
    ref.train()
    logits = ref(serial_adj(a_hat), x, dropout_seed=DROPOUT_SEED)
    loss_ref = F.cross_entropy(logits[train], y[train])
    loss_ref.backward()
    grads = [(layer.stacked_weight_grad(), layer.bias.grad) for layer in ref.layers]
    ref_out = (logits.detach(), loss_ref.detach(), grads)
    source = make_source(a_hat, x, y, train, permute=True)
    tag = f"{grid.describe()} {algorithm} {kind} {graph}"

    full = parallelize_fullgraph(ref, grid, source, algorithm, dtype=torch.float32)
    _, _, fwd32, bwd32, err32 = _run(full, source, ref_out)
    par = parallelize_fullgraph(
        ref, grid, source, algorithm, dtype=torch.float32, compute_dtype=BF16
    )
    out, loss, fwd, bwd, err = _run(par, source, ref_out)

    # precision of every piece
    if out.dtype != BF16 or loss.dtype != torch.float32 or par.input_features().dtype != BF16:
        raise AssertionError(f"{tag}: logits {out.dtype}, loss {loss.dtype}")
    for name, p in par.named_parameters():
        if p.dtype != torch.float32 or p.grad is None or p.grad.dtype != torch.float32:
            raise AssertionError(f"{tag}: master {name} {p.dtype}, grad {p.grad}")

    # bytes: half of float32's, the formula with 2-byte elements, and the layer's schedule
    skip = ("broadcast",) if algorithm == "2d" else ()
    for low, hi, part in ((fwd, fwd32, "forward"), (bwd, bwd32, "backward")):
        _halves(low, hi, graph == "even", skip, f"{part} {tag}")
    want_f, want_b = _formula(par, grid, a_hat, source, kind, algorithm, n, dims, 2)
    want_f.check(fwd.as_dict(), f"bf16 forward bytes {tag}")
    want_b.check(bwd.as_dict(), f"bf16 backward bytes {tag}")
    schedule = par.expected_bytes()
    check_schedule(fwd, bwd, schedule, tag)

    if step_masters:  # one Adam step moves each master by about LR: less than half a
        # bfloat16 ulp of most of them, so bfloat16 masters would keep those unchanged
        opt = torch.optim.Adam(par.parameters(), lr=LR)
        before = [p.detach().clone() for p in par.parameters()]
        opt.step()
        sub_ulp = 0
        for p, old in zip(par.parameters(), before, strict=True):
            half_ulp = torch.ldexp(torch.ones_like(old), torch.frexp(old).exponent - 9)
            pick = (p.grad != 0) & (half_ulp > 2 * LR)
            moved = (p.detach() - old).abs()[pick]
            if moved.numel() and not (moved.min() > 0.5 * LR and moved.max() < 1.5 * LR):
                raise AssertionError(f"{tag}: master moved {moved.min()}..{moved.max()}")
            sub_ulp += moved.numel()
        if not sub_ulp:
            raise AssertionError(f"{tag}: no parameter whose bf16 ulp exceeds the step")
    gnnpar.release(grid)
    return err, err32


def _check_world(world: int) -> list[tuple[str, dict, dict]]:
    out = []
    for i, (algorithm, shape) in enumerate(CASES[world]):
        kinds = ("gcn", "sage") if world < 8 or i == 0 else ("gcn",)  # 8 ranks: time
        for kind in kinds:
            for graph in GRAPHS:
                err, err32 = _check(shape, algorithm, kind, graph, step_masters=i == 0)
                out.append((f"{algorithm} {shape} {kind} {graph}", err, err32))
    return out


@pytest.fixture
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("world", sorted(CASES))
def test_bf16_bytes_precision_and_masters(world):
    results = run_distributed(_check_world, world, world, timeout=300)
    worst = {k: 0.0 for k in BOUNDS}
    for rank in results:
        for tag, err, err32 in rank:
            for k, bound in BOUNDS.items():
                worst[k] = max(worst[k], err[k])
                assert err[k] <= bound, f"{tag}: bf16 {k} error {err[k]:.3g} > {bound}"
                assert err32[k] <= FP32_BOUND, f"{tag}: float32 {k} error {err32[k]:.3g}"
    # the errors are bf16's, not float32's: a run that silently computed in float32 fails
    for k, floor in FLOORS.items():
        assert worst[k] >= floor, f"world {world}: bf16 {k} error {worst[k]:.3g} < {floor}"
    print(f"world {world}: worst bf16 errors", {k: f"{v:.2g}" for k, v in worst.items()})


@pytest.mark.usefixtures("_single_process")
def _bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bfloat16, back in float64."""
    return t.to(BF16).double()


def _bf16_away(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to float32, then to bfloat16 with ties away from zero (as the SpMM)."""
    bits = t.float().contiguous().view(torch.int32)
    return ((bits + 0x8000) & ~0xFFFF).view(torch.float32).double()


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a−b| in bfloat16 ulps of ``b`` (an ulp of 0: the smallest normal's)."""
    a, b = a.double(), b.double()
    exp = torch.frexp(b.abs().clamp(min=torch.finfo(BF16).tiny)).exponent
    return float(((a - b).abs() / torch.ldexp(torch.ones_like(b), exp - 8)).max())


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """``a`` equals the emulation ``b`` bit for bit."""
    if not torch.equal(a.double(), b):
        differ = int((a.double() != b).sum())
        raise AssertionError(f"{what}: {differ} of {b.numel()} differ, {_ulps(a, b)} ulps")


@pytest.mark.usefixtures("_single_process")
@pytest.mark.parametrize("kind", ["gcn", "sage"])
def test_one_rank_is_the_serial_model_rounded_to_bf16(kind):
    n, widths = GRAPHS["odd"]
    dims = widths[kind]
    a, x, y, train = small_graph(n=n, feat=dims[0], classes=dims[-1])
    a_hat = normalise(a, kind)
    ref = serial_model(kind, dims)
    grid = gnnpar.init()
    source = make_source(a_hat, x, y, train, permute=False)
    par = parallelize_fullgraph(ref, grid, source, dtype=torch.float32, compute_dtype=BF16)
    out = par(par.input_features())
    out.retain_grad()
    par.loss(out).backward()
    grads = par.full_weights(grads=True)
    gnnpar.release(grid)

    ops = [_bf16(a_hat)] + ([torch.eye(n, dtype=torch.float64)] if kind == "sage" else [])
    h, saved = _bf16(x), []
    for i, layer in enumerate(ref.layers):
        w, b = _bf16(layer.stacked_weight().detach()), _bf16(layer.bias.detach())
        agg = torch.cat([_bf16_away(op @ h) for op in ops], dim=1)
        o = _bf16(_bf16(agg @ w) + b)
        saved.append((agg, w, o))
        h = torch.relu(o) if i < len(ref.layers) - 1 else o
    _same(out, h, f"{kind} logits")
    g = out.grad.double()  # the float32 loss's gradient, rounded to bf16 by the cast
    for i in reversed(range(len(ref.layers))):
        agg, w, _ = saved[i]
        _same(grads[i]["weight"], _bf16(agg.T @ g), f"{kind} weight grad {i}")
        _same(grads[i]["bias"], _bf16(g.sum(0)), f"{kind} bias grad {i}")
        if i:
            g_agg = _bf16(g @ w.T)
            d = g_agg.shape[1] // len(ops)
            g_h = None  # each operator's product rounded, then summed in bf16 (as the layer)
            for k, op in enumerate(ops):
                part = _bf16_away(op.T @ g_agg[:, k * d : (k + 1) * d])
                g_h = part if g_h is None else _bf16(g_h + part)
            g = g_h * (saved[i - 1][2] > 0)


@pytest.mark.usefixtures("_single_process")
def test_fp16_and_bad_compute_dtype_are_refused(capsys):
    from gnnpar.models.fullgraph.model import FullGraphGNN
    from gnnpar.models.fullgraph.parallelize import Parallel3DGNN

    assert main(["train", "gcn", "--mixed-precision", "fp16", "--epochs", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config key 'mixed_precision'" in err[0] and "bf16" in err[0], err
    a, x, y, train = small_graph(n=9, feat=4)
    source = make_source(normalise(a, "gcn"), x, y, train, permute=False)
    with pytest.raises(ValueError, match="compute_dtype torch.float16"):
        Parallel3DGNN(FullGraphGNN(4, 3, 3), gnnpar.init(), source, compute_dtype=torch.float16)


# --------------------------------------------------------------------------------- the CLI
def _gcn(out: Path, epochs: int, *extra: str) -> int:
    return main(
        ["train", "gcn", "--dataset", "sbm", "--dataset-options", "num_nodes=120,feat_dim=8",
         "--root", str(out.parent / "data"), "--mixed-precision", "bf16", "--blocks", "2",
         "--epochs", str(epochs), "--out", str(out), "--eval-every", "2", "--quiet", *extra]
    )  # fmt: skip


@pytest.mark.usefixtures("_single_process")
def test_cli_bf16_trains_checkpoints_and_resumes(tmp_path):
    import json

    straight, half = tmp_path / "straight", tmp_path / "half"
    assert _gcn(straight, 6) == 0
    assert _gcn(half, 3, "--checkpoint-every", "3") == 0
    assert _gcn(half, 6, "--resume") == 0
    a, b = checkpoint.consolidate(straight), checkpoint.consolidate(half)
    assert list(a) == list(b) and a
    for k, v in a.items():
        assert v.dtype == torch.float32, k  # the masters are what is saved
        assert torch.equal(v, b[k]), k
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
    assert any("test_acc" in r for r in records)
