"""The CUDA/NCCL path: every task on the GPU equals the CPU run; bytes on NCCL equal gloo's.

Skipped where torch sees no GPU (this project's CI has none); ``benchmarks/gpu.sh`` runs
these on a GPU machine. The runs are float64 so that "equal" can mean ≤ 1e-9 relative even
though GPU kernels sum in another order than the CPU's. With two or more GPUs the gcn and
gpt tasks also run on a world of every GPU (up to 8) through ``--nprocs``, and their bytes
per axis and kind, logged in ``metrics.jsonl``, must equal a gloo world's of the same grid.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gnnpar.cli import main
from gnnpar.train.metrics import read_metrics

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no GPU")

_SBM = ["--dataset", "sbm", "--dataset-options", "num_nodes=500", "--dtype", "float64"]
_GPT = [
    "--vocab-size", "280", "--block-size", "16", "--n-layer", "2", "--n-head", "2",
    "--n-embd", "32", "--batch-size", "8", "--steps", "4", "--eval-every", "4",
    "--val-batches", "1", "--sample-tokens", "4", "--dtype", "float64", "--zero-stage", "0",
]  # fmt: skip
TASKS = {
    "gcn": ["gcn", *_SBM, "--epochs", "4", "--eval-every", "4"],
    "gcn-1d-sage": ["gcn", *_SBM, "--epochs", "3", "--algorithm", "1d", "--model", "sage"],
    "sage": ["sage", *_SBM, "--epochs", "1", "--batch-size", "64"],
    "sage-gat": ["sage", *_SBM, "--epochs", "1", "--model", "gat", "--zero-stage", "3"],
    "gpt": ["gpt", *_GPT],
    "gpt-zero3": ["gpt", *_GPT[:-2], "--zero-stage", "3"],
}  # fmt: skip
_SKIP = ("seconds", "_per_s", "rss", "time", "bytes")


def _run(task: str, device: str, out: Path, text: Path, *extra: str) -> list[dict]:
    argv = ["train", *TASKS[task], "--device", device, "--out", str(out), "--quiet", *extra]
    if TASKS[task][0] == "gpt":
        argv += ["--data", str(text)]
    assert main(argv) == 0
    return list(read_metrics(out / "metrics.jsonl"))


def _close(cpu: list[dict], gpu: list[dict], rel: float = 1e-9) -> None:
    assert len(cpu) == len(gpu)
    for c, g in zip(cpu, gpu, strict=True):
        for k, v in c.items():
            if any(s in k for s in _SKIP) or k not in g:
                continue
            if isinstance(v, float):
                assert g[k] == pytest.approx(v, rel=rel, abs=1e-12), k
            elif k != "event" or v != "start":
                assert g[k] == v, k


@pytest.mark.parametrize("task", list(TASKS))
def test_task_on_the_gpu_equals_the_cpu_run(task, one_process, tmp_path):
    cpu = _run(task, "cpu", tmp_path / "cpu", one_process)
    gpu = _run(task, "cuda", tmp_path / "gpu", one_process)
    _close(cpu, gpu)
    done = [r for r in gpu if r.get("event") == "start"]
    assert not done or "cuda" in str(done[0].get("device", "cuda"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs or more")
@pytest.mark.parametrize("task", ["gcn", "gpt"])
def test_nccl_world_moves_the_bytes_of_a_gloo_world(task, one_process, tmp_path):
    world = min(torch.cuda.device_count(), 8)
    world -= world % 2
    grid = {"gcn": f"x=1,y=2,z={world // 2}", "gpt": f"data=2,x={world // 2}"}[task]
    extra = ("--nprocs", str(world), "--grid", grid)
    cpu = _run(task, "cpu", tmp_path / "cpu", one_process, *extra)
    gpu = _run(task, "cuda", tmp_path / "gpu", one_process, *extra)
    _close(cpu, gpu)
    for c, g in zip(cpu, gpu, strict=True):
        assert c.get("bytes") == g.get("bytes")


def test_the_gpu_spmm_is_cusparse_and_bit_stable_under_deterministic_algorithms():
    from gnnpar.sparse.csr import from_coo
    from gnnpar.sparse.kernels import LocalSpMM

    g = torch.Generator().manual_seed(0)
    r, c = (torch.rand(3000, 2000, generator=g) < 0.01).nonzero(as_tuple=True)
    block = from_coo(r, c, torch.rand(r.numel(), generator=g), (3000, 2000)).to(device="cuda")
    h = torch.randn(2000, 128, generator=g).cuda()
    fast = LocalSpMM(block)
    want = fast.mm(h)
    assert fast.choices == {(128, torch.float32): "csr32"}
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        stable = LocalSpMM(block)
        first, again = stable.mm(h), stable.mm(h)
        assert stable.choices[(128, torch.float32)].startswith("bag")
        assert torch.equal(first, again)
        torch.testing.assert_close(first, want)
    finally:
        torch.use_deterministic_algorithms(was)
