"""Device neutrality: every task keeps its tensors on ``grid.device``.

A CPU-only machine cannot see a missing ``.to(device)``; :mod:`gnnpar.virtual_device` makes
the grid's device a simulated accelerator whose tensors carry real host values. Each task
then runs through ``gnnpar train`` as a user runs it and must (1) finish, (2) do no matrix
product, embedding bag, softmax or loss on host tensors, and (3) log exactly the metrics of
the plain CPU run — so nothing was silently left on the host or computed differently (bit
for bit for the GNN tasks; the GPT's attention kernel is chosen by device type, so there
the figures agree to 1e-6).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gnnpar import comm
from gnnpar.cli import main
from gnnpar.train.metrics import read_metrics
from gnnpar.virtual_device import (
    VIRTUAL,
    CrossDeviceError,
    VirtualTensor,
    active,
    simulated_device,
)

_GPT = [
    "--vocab-size", "280", "--block-size", "16", "--n-layer", "1", "--n-head", "2",
    "--n-embd", "16", "--batch-size", "4", "--steps", "3", "--eval-every", "3",
    "--val-batches", "1", "--sample-tokens", "4",
]  # fmt: skip
_HF = ["--model", "hf-gpt2", "--model-config", "n_layer=1,n_head=2,n_embd=16,n_positions=16"]
_SBM = ["--dataset", "sbm", "--dataset-options", "num_nodes=300"]
_MAG_SIZES = "num_papers=60,num_authors=30,num_institutions=5,num_fields=7,num_classes=3,feat_dim=6"
_MAG = ["--dataset", "mag-synth", "--dataset-options", _MAG_SIZES]

TASKS = {
    "gcn-3d": ["gcn", *_SBM, "--epochs", "3", "--eval-every", "3"],
    "gcn-2d-sage": ["gcn", *_SBM, "--epochs", "2", "--algorithm", "2d", "--model", "sage"],
    "gcn-1d": ["gcn", *_SBM, "--epochs", "2", "--algorithm", "1d"],
    "gcn-3d-bf16": ["gcn", *_SBM, "--epochs", "2", "--mixed-precision", "bf16"],
    "sage": ["sage", *_SBM, "--epochs", "1", "--prefetch", "0", "--grad-accum", "2"],
    "sage-gat-zero3": ["sage", *_SBM, "--epochs", "1", "--prefetch", "0", "--model", "gat",
                       "--zero-stage", "3"],
    "gpt": ["gpt", *_GPT],
    "gpt-zero2-clip": ["gpt", *_GPT, "--zero-stage", "2", "--grad-clip", "1.0"],
    "hf-gpt2": ["gpt", *_GPT, *_HF],
    "gpt-moe": ["gpt", *_GPT, "--moe-experts", "4", "--zero-stage", "3"],
    "gpt-snapshots": ["gpt", *_GPT, "--snapshot-every", "1"],  # device state written to host
    "link-full": ["link", *_SBM, "--mode", "full", "--epochs", "1"],
    "link-minibatch": ["link", *_SBM, "--epochs", "1", "--prefetch", "0"],
    "rgcn-full": ["gcn", *_MAG, "--model", "rgcn", "--epochs", "2"],
    "hgt-minibatch": ["sage", *_MAG, "--model", "hgt", "--epochs", "1", "--prefetch", "0"],
}  # fmt: skip

# Wall-clock and memory figures differ between any two runs.
_TIMING = ("seconds", "_per_s", "rss", "time", "snapshot_")




def _metrics(run: Path) -> list[dict]:
    out = []
    for rec in read_metrics(run / "metrics.jsonl"):
        out.append({k: v for k, v in rec.items() if not any(t in k for t in _TIMING)})
    return out


def _argv(task: str, text: Path, out: Path) -> list[str]:
    args = ["train", *TASKS[task], "--out", str(out), "--quiet"]
    if args[1] == "gpt":
        args += ["--data", str(text)]
    return args


@pytest.mark.parametrize("task", list(TASKS))
def test_task_keeps_its_tensors_on_the_device(task, one_process, tmp_path):
    assert main(_argv(task, one_process, tmp_path / "host")) == 0
    with simulated_device() as sim:
        assert main(_argv(task, one_process, tmp_path / "device")) == 0
    assert sim.host_compute == [], f"host arithmetic in a device run: {sim.host_compute[:5]}"
    host, device = _metrics(tmp_path / "host"), _metrics(tmp_path / "device")
    if TASKS[task][0] != "gpt":
        assert host == device
    else:
        # torch picks scaled-dot-product attention's kernel by device type (the fused CPU
        # kernel on the host, the math path elsewhere, as on a GPU): equal to rounding.
        assert len(host) == len(device)
        for h, d in zip(host, device, strict=True):
            assert h.keys() == d.keys()
            for k, v in h.items():
                if isinstance(v, float):
                    assert d[k] == pytest.approx(v, rel=1e-6), k
                else:
                    assert d[k] == v, k


def test_a_device_run_resumes_from_a_host_checkpoint_and_continues_exactly(
    one_process, tmp_path
):
    base = ["train", "gcn", *_SBM, "--quiet", "--eval-every", "100"]
    assert main([*base, "--epochs", "4", "--out", str(tmp_path / "whole")]) == 0
    assert main([*base, "--epochs", "2", "--out", str(tmp_path / "split")]) == 0
    with simulated_device() as sim:
        assert main([*base, "--epochs", "4", "--out", str(tmp_path / "split"), "--resume"]) == 0
    assert sim.host_compute == []
    loss = lambda run: [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]  # noqa: E731
    assert loss(tmp_path / "split")[-2:] == loss(tmp_path / "whole")[-2:]


def test_the_simulated_device_fails_where_an_accelerator_fails():
    with simulated_device() as sim:
        assert active() and sim.device == VIRTUAL
        x = torch.ones(3, device=sim.device)
        assert isinstance(x, VirtualTensor) and x.device == VIRTUAL
        with pytest.raises(CrossDeviceError, match="aten.add.*host tensor of shape \\(3,\\)"):
            x + torch.ones(3)
        with pytest.raises(CrossDeviceError, match="numpy"):
            x.numpy()
        assert (x * torch.tensor(2.0)).cpu().tolist() == [2.0, 2.0, 2.0]  # 0-d host scalars
        # values are real: autograd through a host → device copy, an optimizer step, reads
        w = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
        loss = (w.to(sim.device) @ torch.ones(2, device=sim.device)).sum()
        loss.backward()
        assert type(w.grad) is torch.Tensor and w.grad.tolist() == [[1.0, 1.0], [1.0, 1.0]]
        assert float(loss.detach()) == 10.0 and type(loss.detach().cpu()) is torch.Tensor
        sim.clear()
        torch.ones(2, 2) @ torch.ones(2, 2)
        assert sim.host_compute == ["aten.mm((2, 2), (2, 2))"]
    assert not active()


def test_collectives_refuse_tensors_off_the_grid_device():
    import gnnpar

    grid = gnnpar.init()
    with simulated_device():
        device_grid = gnnpar.init()
        assert device_grid.device == VIRTUAL
        comm.all_reduce(torch.ones(2, device=VIRTUAL), device_grid, "world")
        with pytest.raises(comm.CommError, match="is on cpu, the grid's device is lazy"):
            comm.all_reduce(torch.ones(2), device_grid, "world")
    with pytest.raises(comm.CommError, match="is on meta, the grid's device is cpu"):
        comm.all_gather(torch.ones(2, device="meta"), grid, "x")
