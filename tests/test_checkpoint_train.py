"""``gnnpar train ... --resume`` on another grid: every task saved on one grid continues on
another (and on another number of processes) to the same parameters as an uninterrupted run
on the new grid (float64, <= 1e-12 relative), through the trainer and the command line.

The reference is an uninterrupted run on the *new* grid: a resumed run can only match it if
the checkpoint carries everything (parameters, optimizer state, loader position) and training
is the same function on both grids — full-graph dropout keyed by node and feature, global
mini-batches ordered by original node ids, GPT batches split over data × z.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gnnpar import checkpoint
from gnnpar.cli import main

REL = 1e-12


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def _same(a: Path, b: Path) -> float:
    """Largest relative difference between the models of two runs' newest checkpoints."""
    sa, sb = checkpoint.consolidate(a), checkpoint.consolidate(b)
    assert list(sa) == list(sb)
    worst = 0.0
    for k, v in sb.items():
        scale = max(float(v.abs().max()), 1e-300)
        worst = max(worst, float((sa[k] - v).abs().max()) / scale)
    return worst


def _gcn(out: Path, epochs: int, grid: str, nprocs: int, *extra: str) -> int:
    return main(
        ["train", "gcn", "--dataset", "sbm", "--dataset-options", "num_nodes=90,feat_dim=6",
         "--root", str(out.parent / "data"), "--layers", "3", "--hidden", "5",
         "--dtype", "float64", "--epochs", str(epochs), "--grid", grid, "--nprocs", str(nprocs),
         "--out", str(out), "--eval-every", "0", "--quiet", "--blocks", "3", *extra]
    )  # fmt: skip


def test_gcn_resumes_on_another_grid_and_on_one_rank(tmp_path):
    saved = tmp_path / "x2y2z2"
    assert _gcn(saved, 2, "x=2,y=2,z=2", 8) == 0
    for name, grid, nprocs in (("x1y2z4", "x=1,y=2,z=4", 8), ("one", "x=1", 1)):
        resumed = tmp_path / f"resumed-{name}"
        import shutil

        shutil.copytree(saved, resumed)
        assert _gcn(resumed, 4, grid, nprocs, "--resume") == 0
        straight = tmp_path / f"straight-{name}"
        assert _gcn(straight, 4, grid, nprocs) == 0
        err = _same(resumed, straight)
        assert err <= REL, f"gcn resumed on {grid}: {err:.3g}"


def _sage(out: Path, epochs: int, nprocs: int, *extra: str) -> int:
    return main(
        ["train", "sage", "--dataset", "sbm", "--dataset-options", "num_nodes=120,feat_dim=6",
         "--root", str(out.parent / "data"), "--dtype", "float64", "--epochs", str(epochs),
         "--batch-size", "16", "--hidden", "8", "--fanouts", "4,3", "--nprocs", str(nprocs),
         "--out", str(out), "--eval-every", "0", "--quiet", "--prefetch", "0", *extra]
    )  # fmt: skip


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_sage_resumes_on_another_number_of_data_ranks(tmp_path, before, after):
    import shutil

    saved = tmp_path / "saved"
    assert _sage(saved, 2, before) == 0
    shutil.copytree(saved, tmp_path / "resumed")
    assert _sage(tmp_path / "resumed", 4, after, "--resume") == 0
    assert _sage(tmp_path / "straight", 4, after) == 0
    err = _same(tmp_path / "resumed", tmp_path / "straight")
    assert err <= REL, f"sage {before} -> {after} ranks: {err:.3g}"


def _gpt(out: Path, steps: int, grid: str, nprocs: int, *extra: str) -> int:
    return main(
        ["train", "gpt", "--steps", str(steps), "--n-layer", "2", "--n-embd", "16",
         "--n-head", "2", "--batch-size", "4", "--block-size", "8", "--vocab-size", "300",
         "--warmup", "2", "--eval-every", "100", "--val-batches", "1", "--sample-tokens", "0",
         "--dtype", "float64", "--grid", grid, "--nprocs", str(nprocs), "--out", str(out),
         "--quiet", *extra]
    )  # fmt: skip


def test_gpt_resumes_on_another_tensor_and_data_grid(tmp_path):
    import shutil

    saved = tmp_path / "saved"
    assert _gpt(saved, 2, "data=2,x=2", 4) == 0
    shutil.copytree(saved, tmp_path / "resumed")
    assert _gpt(tmp_path / "resumed", 4, "data=1,x=2,y=2", 4, "--resume") == 0
    assert _gpt(tmp_path / "straight", 4, "data=1,x=2,y=2", 4) == 0
    err = _same(tmp_path / "resumed", tmp_path / "straight")
    assert err <= REL, f"gpt data=2,x=2 -> data=1,x=2,y=2: {err:.3g}"
