"""PowerSGD on stage 0's buckets (:mod:`gnnpar.shard.powersgd`): torch's hook, composed.

On 2 ranks a model whose first weight gradient has rank at most 4 (2 rows a rank through a
64 × 64 layer): with ``powersgd_rank=4`` the compressed gradient is exact, so every step's
gradient equals the plain all-reduce's (float32, 5e-5: measured 1.3e-5); with rank 1 it is
not (the hook really compresses). The bytes of a plain step (the first two) and of a
compressed one against formulas written out here: 2(p−1)/p · 4 bytes · (what is
all-reduced), where a matrix that compresses more than 2× sends its factors P (n × r) and
Q (m × r) and the rest is sent whole (the biases; the 8 × 64 head at rank 4, not at rank 1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gnnpar
from gnnpar import comm
from gnnpar.errors import UserError
from gnnpar.shard import shard
from gnnpar.testing import run_distributed

WIDTH, OUT, ROWS = 64, 8, 2  # rows a rank


def _run(rank_r: int) -> dict:
    grid = gnnpar.init(data=2)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, OUT))
    dp = shard(net, grid, 0, powersgd_rank=rank_r)
    opt = dp.attach(torch.optim.SGD(dp.parameters(), lr=0.1))
    grads, traffic = [], []
    for step in range(4):
        g = torch.Generator().manual_seed(10 * step + grid.rank("data"))
        x, y = torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, OUT, generator=g)
        with comm.record(grid) as t:
            F.mse_loss(net(x), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in dp.parameters()]).numpy())
        traffic.append(dict(t.nbytes))
        opt.step()
        opt.zero_grad()
    gnnpar.release(grid)
    return {"grads": grads, "bytes": traffic}


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return {r: run_distributed(_run, 2, r) for r in (0, 4, 1)}


def test_an_exact_rank_gives_the_plain_gradients_and_a_low_one_does_not(runs):
    for step in range(4):
        for plain, exact, low in zip(runs[0], runs[4], runs[1], strict=True):
            want = torch.from_numpy(plain["grads"][step])
            scale = float(want.abs().max())
            err = float((torch.from_numpy(exact["grads"][step]) - want).abs().max()) / scale
            assert err <= 5e-5, (step, err)  # measured 1.3e-5: float32 Gram-Schmidt
            low_err = float((torch.from_numpy(low["grads"][step]) - want).abs().max()) / scale
            # the first two steps are plain all-reduces; then rank 1 compresses for real
            assert (low_err <= 1e-6) if step < 2 else (low_err > 1e-3), (step, low_err)


def _sent(n: int, m: int, r: int) -> int:
    """Elements the hook all-reduces for an n × m gradient (a vector is n × 1): its factors
    P (n × r') and Q (m × r'), r' = min(n, m, r), when that is less than half of it, else the
    whole matrix (PowerSGD's rule with its default min_compression_rate of 2)."""
    rr = min(n, m, r)
    return (n + m) * rr if 2 * (n + m) * rr < n * m else n * m


def test_bytes_of_plain_and_compressed_steps(runs):
    ring = 2 * (2 - 1) / 2 * 4  # a 2-rank all-reduce, float32: bytes per element sent
    shapes = [(WIDTH, WIDTH), (WIDTH, 1), (OUT, WIDTH), (OUT, 1)]
    everything = sum(n * m for n, m in shapes)
    for r, compressed in ((4, 2 * WIDTH * 4 + WIDTH + OUT * WIDTH + OUT),
                          (1, 2 * WIDTH + WIDTH + (OUT + WIDTH) + OUT)):  # fmt: skip
        assert sum(_sent(n, m, r) for n, m in shapes) == compressed
        for res in runs[r]:
            for step, got in enumerate(res["bytes"]):
                sent = everything if step < 2 else compressed
                assert got == {("data", "all_reduce"): round(ring * sent)}, (r, step, got)


def test_powersgd_is_stage_0s():
    grid = gnnpar.init()
    with pytest.raises(UserError, match="powersgd_rank compresses stage 0's all-reduce"):
        shard(nn.Linear(3, 3), grid, 2, powersgd_rank=2)


def test_powersgd_through_the_trainer_with_tensor_parallelism(tmp_path, one_process):
    """gpt on data=2 × x=2 at stage 0 with PowerSGD of rank 2 trains (past the 2 plain steps)
    and resumes on data=4; each compressed step all-reduces less over data than a plain one."""
    import json

    from gnnpar.cli import main

    def argv(grid: str, steps: int, *more: str) -> list[str]:
        return ["train", "gpt", "--data", str(one_process), "--steps", str(steps),
                "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--batch-size", "8",
                "--block-size", "8", "--vocab-size", "300", "--warmup", "2", "--lr", "3e-3",
                "--eval-every", "100", "--val-batches", "1", "--sample-tokens", "0",
                "--grid", grid, "--zero-stage", "0", "--powersgd-rank", "2", "--nprocs", "4",
                "--out", str(tmp_path / "run"), "--quiet", *more]  # fmt: skip

    assert main(argv("data=2,x=2", 6)) == 0
    assert main(argv("data=4", 10, "--resume")) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    steps = [r for r in records if "loss" in r and "seconds" in r]
    assert len(steps) == 10 and steps[-1]["loss"] < steps[0]["loss"] - 0.1, steps
    data = [r["bytes"]["data"]["all_reduce"] for r in steps[:6]]
    assert data[3] < data[0] / 2, data  # steps 1-2 plain, then compressed


def test_a_resume_on_the_same_grid_continues_the_compression_exactly(tmp_path, one_process):
    """A checkpoint keeps each rank's PowerSGD state (step count, generator, error feedback,
    warm start) beside its generator: gpt on data=2 saved after its first compressed step
    and resumed ends bit for bit where the straight run does (float64). Without the state
    the resumed run would start the compression again, with two plain steps. A resume with
    another rank r, whose factors have other shapes, starts the compression again."""
    from gnnpar import checkpoint
    from gnnpar.train.metrics import read_metrics
    from tests.cli_world import run_commands

    def argv(out: str, steps: int, *more: str, r: int = 2) -> list[str]:
        return ["train", "gpt", "--data", str(one_process), "--steps", str(steps),
                "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--batch-size", "4",
                "--block-size", "8", "--vocab-size", "300", "--warmup", "2", "--lr", "3e-3",
                "--eval-every", "100", "--val-batches", "1", "--sample-tokens", "0",
                "--dtype", "float64", "--grid", "data=2", "--zero-stage", "0",
                "--powersgd-rank", str(r), "--nprocs", "2", "--out", str(tmp_path / out),
                "--quiet", *more]  # fmt: skip

    codes = run_commands(2, [
        argv("straight", 5), argv("saved", 3), argv("saved", 5, "--resume"),
        ("copy", tmp_path / "saved", tmp_path / "other"), argv("other", 6, "--resume", r=1),
    ])  # fmt: skip
    assert codes == [[0, 0, 0, 0]] * 2
    saved = checkpoint.open_checkpoint(tmp_path / "saved" / "checkpoints")
    assert any(n.startswith("powersgd.") for n in saved.meta["local"]["rank-00000.pt"])
    straight = checkpoint.consolidate(tmp_path / "straight" / "checkpoints")
    resumed = checkpoint.consolidate(tmp_path / "saved" / "checkpoints")
    assert list(resumed) == list(straight)
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    # the resume at rank 1 began again with a plain step: the whole buckets, as step 1 sent
    steps = {out: read_metrics(tmp_path / out / "metrics.jsonl") for out in ("straight", "other")}
    sent = {
        out: [r["bytes"]["data"]["all_reduce"] for r in records if "seconds" in r]
        for out, records in steps.items()
    }
    assert sent["other"][-1] == sent["straight"][0] > sent["straight"][-1], sent
