"""ZeRO++'s quantized collectives (:mod:`gnnpar.shard.quantize`): qwZ and qgZ.

- Blocks: every dequantized element lies within half a step of its block's own scale (the
  block's largest magnitude over 127, or 7 for int4) and is a whole number of steps — so the
  check fails on values that were never quantized and on a scale shared by the whole tensor
  (the small blocks of the input then err by far more than their own step).
- On 4 ranks (data=4, 2 simulated nodes of 2) at stage 3 with a float32 model of odd sizes:
  the bytes of one step against formulas written out here from the unit sizes, for the plain
  run, qwZ (int8 codes + a float32 scale per 256 elements: (1 + 4/256)/4 of float32's) and
  qgZ (int4 all-to-alls inside then across the nodes: across them (N−1)/N · Ψ/k · (1/2 +
  4/256) bytes, an eighth of a float32 hierarchical reduce-scatter's); the gradients and the
  trained weights within measured bounds of the unquantized run, and not equal to them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gnnpar
from gnnpar import comm
from gnnpar.shard import MixedPrecision, by_type, shard
from gnnpar.shard.quantize import BLOCK, dequantize, quantize
from gnnpar.testing import run_distributed

IN, DIM, OUT, BATCH = 13, 300, 7, 16  # a unit of 2 blocks: 181,200 + 2,107 elements


# ------------------------------------------------------------------------------ the blocks
def _mixed_blocks() -> torch.Tensor:
    """Blocks whose magnitudes span eight orders, an all-zero block, a partial last block."""
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(BLOCK, generator=g) * 10.0**e for e in range(-4, 4)]
    parts += [torch.zeros(BLOCK), torch.randn(100, generator=g)]
    return torch.cat(parts)


@pytest.mark.parametrize("bits", [8, 4])
def test_each_block_keeps_its_own_scale(bits):
    x = _mixed_blocks()
    codes, scales = quantize(x, bits)
    blocks = -(-x.numel() // BLOCK)
    assert codes.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert codes.numel() == blocks * BLOCK * bits // 8 and scales.shape == (blocks,)
    got = dequantize(codes, scales, x.numel(), torch.float32, bits)
    padded = torch.zeros(blocks * BLOCK)
    padded[: x.numel()] = x
    step = padded.view(-1, BLOCK).abs().amax(1) / {8: 127, 4: 7}[bits]  # written out here
    step = step.repeat_interleave(BLOCK)[: x.numel()]
    # within half a step of its own block (float32 rounding of the product aside) ...
    assert bool(((got - x).abs() <= step / 2 * (1 + 1e-6) + 1e-30).all())
    # ... and a whole number of steps: fails on values that were never quantized
    whole = torch.where(step > 0, got / torch.where(step > 0, step, 1), 0)
    assert bool(((whole - whole.round()).abs() < 1e-3).all())
    assert not torch.equal(got, x)


# ------------------------------------------------------------------------------ 4 ranks
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return self.head(x)


def _units() -> list[tuple[int, int]]:
    """(elements, all-gathers a step) of each unit, every Linear: backward gathers a unit
    again, except the first (its input needs no gradient, so its weight is not used)."""
    net = _Net()
    linears = [net.inp, *net.blocks, net.head]
    return [(sum(p.numel() for p in m.parameters()), 1 if m is net.inp else 2) for m in linears]


def _step(quantized: str) -> dict:
    """One step of the net on data=4 over 2 nodes (stage 3, AdamW): bytes by (axis, kind),
    the gathered weights of the first block, the gradient and the weights after the step."""
    grid = gnnpar.init(data=4, ranks_per_node=2)
    torch.manual_seed(0)
    net = _Net()
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    dp = shard(net, grid, 3, units=by_type(nn.Linear), quantized_weights="w" in quantized,
               quantized_grads="g" in quantized,
               mixed_precision=bf16 if "b" in quantized else None)  # fmt: skip
    opt = dp.attach(torch.optim.AdamW(dp.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)
    rows = slice(grid.rank("data") * BATCH // 4, (grid.rank("data") + 1) * BATCH // 4)
    with comm.record(grid) as traffic:
        F.mse_loss(net(x[rows]).float(), y[rows]).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in dp.parameters()])
    with dp.gathered() as m:
        gathered = m.blocks[0].weight.detach().clone()
    opt.step()
    # numpy arrays travel back by value (a forked rank's tensors would be shared memory)
    out = {"bytes": dict(traffic.nbytes), "gathered": gathered.float().numpy()}
    out["grads"] = grads.float().numpy()
    out["state"] = {k: v.float().numpy() for k, v in dp.full_state_dict().items()}
    gnnpar.release(grid)
    return out


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    out = {q: run_distributed(_step, 4, q) for q in ("", "w", "g", "b", "bw")}
    for res in out.values():
        for r in res:
            for key in ("gathered", "grads"):
                r[key] = torch.from_numpy(r[key])
            r["state"] = {k: torch.from_numpy(v) for k, v in r["state"].items()}
    return out


def _pad(n: int, p: int) -> int:
    return -(-n // p) * p


def test_bytes_of_qwz_and_qgz_against_the_formulas(runs):
    p, k, nodes, e = 4, 2, 2, 4  # float32
    units = [(_pad(n, p) // p, times) for n, times in _units()]  # each rank's shard
    shards = [s for s, _ in units]
    plain_gather = sum(t * (p - 1) * s * e for s, t in units)
    rs = sum((p - 1) * s * e for s in shards)
    # qwZ: int8 codes of each shard padded to whole blocks, and a float32 scale per block
    q_gather = sum(t * (p - 1) * (_pad(s, BLOCK) + 4 * _pad(s, BLOCK) // BLOCK) for s, t in units)

    def int4(n: int) -> int:  # bytes of n elements as int4 blocks and their scales
        return _pad(n, BLOCK) // 2 + 4 * _pad(n, BLOCK) // BLOCK

    # qgZ: inside the node each rank sends k−1 slices of one shard per node; across the
    # nodes, N−1 pieces of one shard
    intra = sum((k - 1) * int4(nodes * s) for s in shards)
    inter = sum((nodes - 1) * int4(s) for s in shards)
    want = {
        "": {("data", "all_gather"): plain_gather, ("data", "reduce_scatter"): rs},
        "w": {("data", "all_gather"): q_gather, ("data", "reduce_scatter"): rs},
        "g": {("data", "all_gather"): plain_gather, ("data.intra", "all_to_all"): intra,
              ("data.inter", "all_to_all"): inter},
    }  # fmt: skip
    for q, res in ((q, runs[q]) for q in want):
        for r in res:
            got = {key: v for key, v in r["bytes"].items() if v}
            assert got == want[q], (q, got, want[q])
    assert 0.25 < q_gather / plain_gather < 0.26  # (1 + 4/256) / 4
    # with bf16 parameters (mixed precision) the plain gathers move 2 bytes an element and
    # qwZ's the same int8 blocks: (1 + 4/256) / 2 of them
    gathers = {q: runs[q][0]["bytes"][("data", "all_gather")] for q in ("b", "bw")}
    assert gathers == {"b": plain_gather // 2, "bw": q_gather}, gathers
    assert 0.5 < gathers["bw"] / gathers["b"] < 0.52  # 0.508, and the small units' padding
    # across nodes: an eighth of a float32 hierarchical reduce-scatter's (N−1)/N · Ψ/k · e
    fp32_inter = sum((nodes - 1) * s * e for s in shards)
    assert 0.125 < inter / fp32_inter < 0.135  # above 1/8: the small head unit's padding


def test_quantized_runs_stay_within_measured_bounds(runs):
    plain = runs[""]
    # every rank computes with the same weights: its own shard dequantized like the others'
    assert all(torch.equal(r["gathered"], runs["w"][0]["gathered"]) for r in runs["w"])
    for r, base in zip(runs["w"], plain, strict=True):
        w, ref = r["gathered"], base["gathered"]
        # int8: within half a step of the largest weight of any block (256 / 300 rows)
        assert not torch.equal(w, ref)
        assert float((w - ref).abs().max()) <= float(ref.abs().max()) / 254 * (1 + 1e-6)
    torch.manual_seed(0)
    start = _Net().state_dict()
    # measured: gradients 0.008 (w) and 0.16 (g) of the largest off; AdamW's first step (about
    # lr whatever the gradient's size) the same way for 99.75% (w) and 93.8% (g) of weights
    for q, bound, agree in (("w", 0.02, 0.99), ("g", 0.3, 0.9)):
        for r, base in zip(runs[q], plain, strict=True):
            err = float((r["grads"] - base["grads"]).abs().max() / base["grads"].abs().max())
            assert 0 < err <= bound, (q, err)
        same = total = 0
        for key, v in runs[q][0]["state"].items():
            moved, ref = v - start[key], plain[0]["state"][key] - start[key]
            same += int((moved.sign() == ref.sign()).sum())
            total += v.numel()
        assert agree <= same / total < 1, (q, same / total)


def test_the_planner_prices_qwz_and_qgz_bytes():
    from gnnpar.models.gpt.cost import GPTProblem, gpt_collectives
    from gnnpar.models.gpt.model import GPTConfig

    model = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=96, block_size=16)

    def data_bytes(quantized: bool) -> dict[str, int]:
        problem = GPTProblem(model, batch=8, element_size=4, stage=3, grad_clip=False,
                             schedule=None, quantized_weights=quantized,
                             quantized_grads=quantized)  # fmt: skip
        plan = gpt_collectives(problem, {"data": 4})
        return {c.what: c.nbytes for c in plan if c.axis == "data" and c.kind != "all_reduce"}

    plain, quant = data_bytes(False), data_bytes(True)
    elements = plain["ZeRO parameter all-gather"] / (3 / 4 * 4)  # a rank's (p−1)/p·Ψ·e
    for what in ("ZeRO parameter all-gather", "ZeRO-3 backward re-gather"):
        assert quant[what] == round(3 / 4 * elements * (1 + 4 / 256))  # int8 + scales
    assert quant["ZeRO gradient reduce-scatter"] == round(3 / 4 * elements * (0.5 + 4 / 256))


def test_zeropp_through_the_trainer_with_tensor_parallelism_and_a_resume(tmp_path, one_process):
    """qwZ + hpZ (FCDP) + qgZ on data=2 × x=2 over 2 nodes trains, and its checkpoint (full
    precision masters) resumes on data=4 with the same options."""
    import json

    from gnnpar.cli import main

    def argv(grid: str, steps: int, *more: str) -> list[str]:
        return ["train", "gpt", "--data", str(one_process), "--steps", str(steps),
                "--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--batch-size", "8",
                "--block-size", "8", "--vocab-size", "300", "--warmup", "2", "--lr", "3e-3",
                "--eval-every", "100", "--val-batches", "1", "--sample-tokens", "0",
                "--grid", grid, "--zero-stage", "3", "--quantized-weights", "--fcdp",
                "--quantized-grads", "--nprocs", "4", "--ranks-per-node", "2",
                "--out", str(tmp_path / "run"), "--quiet", *more]  # fmt: skip

    assert main(argv("data=2,x=2", 6)) == 0
    assert main(argv("data=4", 10, "--resume")) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    losses = [r["loss"] for r in records if "loss" in r and "seconds" in r]
    resumes = [r for r in records if r.get("event") == "resume"]
    assert [(r["step"], r["from_grid"]["x"]) for r in resumes] == [(6, 2)], resumes
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.1, losses
    step = next(r for r in records if r.get("step") == 8 and "bytes" in r)
    assert step["bytes"]["data.inter"]["all_to_all"] > 0  # qgZ's across-node exchange
