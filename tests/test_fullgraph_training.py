"""Full-graph training end to end: CiteSeer accuracy, grid-independent loss curves, overlap,
GIN's accuracy on ``sbm``."""

from __future__ import annotations

import pytest
import torch

import gnnpar
from gnnpar.models.fullgraph.shards import prepare_shards
from gnnpar.models.fullgraph.task import FullGraphConfig
from gnnpar.testing import run_distributed
from gnnpar.train.spec import build_task
from tests.conftest import CITESEER, PLANETOID, needs_dataset

needs_citeseer = needs_dataset(CITESEER)


@pytest.fixture(scope="module")
def citeseer_shards(tmp_path_factory) -> str:
    from gnnpar.data import load

    graph = load("citeseer", root=str(PLANETOID.parent), normalize_features=True)
    out = tmp_path_factory.mktemp("citeseer") / "shards"
    return str(prepare_shards(graph, out, norm="gcn", blocks=(8, 8), seed=0))


CITESEER_CFG = {
    "dataset": "citeseer",
    "root": str(PLANETOID.parent),
    "dataset_options": "normalize_features=true",
}


def _losses(
    shards: str,
    grid: str | None,
    epochs: int,
    dtype: str,
    chunks: int = 1,
    data: dict | None = None,
) -> dict:
    cfg = FullGraphConfig(
        **(data or CITESEER_CFG),
        shards=shards,
        grid=grid,
        epochs=epochs,
        dtype=dtype,
        overlap_chunks=chunks,
        out="unused",
    )
    task = build_task("gcn", cfg)
    losses = [task.train_step(e)["loss"] for e in range(epochs)]
    out = {"losses": losses, **task.evaluate(epochs - 1)}
    gnnpar.release(task.grid)  # the next grid of the same world makes its own groups
    return out


def _losses_per_grid(shards: str, grids: list[str], epochs: int, dtype: str) -> dict:
    """Rank body: :func:`_losses` on each grid in turn, one world for all of them."""
    return {grid: _losses(shards, grid, epochs, dtype)["losses"] for grid in grids}


@needs_citeseer
def test_citeseer_gcn_single_process_reaches_kipf(citeseer_shards, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # One thread: the suite's other worker has the other core. 100 epochs, not Kipf's 200:
    # the accuracy is measured at 69.2% after 100 (69.9% after 200) for half the time.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = _losses(citeseer_shards, None, 100, "float32")
    finally:  # the process runs other tests after this one
        torch.set_num_threads(threads)
    # Kipf & Welling report 70.3%; the issue asks for at least 68%.
    assert out["test_acc"] >= 0.68, out["test_acc"]


@needs_citeseer
def test_loss_curves_agree_across_8_rank_grids(citeseer_shards, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # Three epochs: the first loss checks the forward pass, the second the gradients and
    # one Adam step, the third a step with Adam's moments; later epochs repeat the third.
    epochs = 3
    grids = ["x=2,y=2,z=2", "x=1,y=2,z=4", "x=8,y=1,z=1"]
    serial = _losses(citeseer_shards, None, epochs, "float64")["losses"]
    per_rank = run_distributed(
        _losses_per_grid, 8, citeseer_shards, grids, epochs, "float64", timeout=600
    )
    for rank in per_rank:
        assert list(rank) == grids
        for grid, losses in rank.items():
            diff = max(abs(a - b) for a, b in zip(losses, serial, strict=True))
            assert diff < 1e-12, (grid, diff)  # float64; measured 4.4e-16


def test_overlapped_chunks_equal_plain(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    from gnnpar.data import load

    graph = load("sbm", root=str(tmp_path), num_nodes=301, feat_dim=11)
    shards = str(prepare_shards(graph, tmp_path / "s", blocks=(3, 3), seed=2))
    data = {"dataset": "sbm", "root": str(tmp_path), "dataset_options": "num_nodes=301,feat_dim=11"}
    plain = run_distributed(_losses, 4, shards, "x=2,z=2", 3, "float64", 1, data)
    chunked = run_distributed(_losses, 4, shards, "x=2,z=2", 3, "float64", 4, data)
    for a, b in zip(plain, chunked, strict=True):
        assert max(abs(u - v) for u, v in zip(a["losses"], b["losses"], strict=True)) < 1e-12


def test_gin_trains_on_sbm_out_of_the_box_on_one_rank_and_on_x2_y2(tmp_path, monkeypatch):
    """``gnnpar train gcn --model gin`` with the defaults on the default ``sbm`` graph (2,000
    nodes of mean degree 10): 30 epochs reach at least 80% test accuracy on one rank
    (measured 85.9%; GCN 91.6%), and x=2,y=2 trains the same model (float32 losses within
    1e-5 relative, measured 1.5e-7; BatchNorm statistics of each rank's own rows err by
    7e-3). Without the BatchNorm in GIN's MLP the first logits are in the hundreds, the
    output MLP's ReLUs die within 30 epochs and every node gets one class (24.8%)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    from gnnpar.data import load

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the suite's other worker has the other core
    try:
        graph = load("sbm", root=str(tmp_path))
        shards = str(prepare_shards(graph, tmp_path / "s", norm="raw", blocks=(2, 2), seed=0))
        data = {"dataset": "sbm", "root": str(tmp_path), "model": "gin"}
        serial = _losses(shards, None, 30, "float32", data=data)
    finally:  # the process runs other tests after this one
        torch.set_num_threads(threads)
    assert serial["test_acc"] >= 0.8, serial
    for rank in run_distributed(_losses, 4, shards, "x=2,y=2", 30, "float32", 1, data):
        diff = max(abs(a - b) / b for a, b in zip(rank["losses"], serial["losses"], strict=True))
        assert diff <= 1e-5, diff
        assert rank["test_acc"] >= 0.8, rank
