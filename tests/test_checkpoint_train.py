"""``gnnpar train ... --resume`` on another grid: every task saved on one grid continues on
another (and on another number of processes) to the same parameters as an uninterrupted run
on the new grid (float64, <= 1e-12 relative), through the trainer and the command line.

The reference is an uninterrupted run on the *new* grid: a resumed run can only match it if
the checkpoint carries everything (parameters, optimizer state, loader position) and training
is the same function on both grids — full-graph dropout keyed by node and feature, global
mini-batches ordered by original node ids, GPT batches split over data × z.

The multi-rank runs of a test share one world of forked ranks that run the command line as
a ``--nprocs`` launch's ranks do (tests/cli_world.py): a launch per run would cost more than
the training. The sage case that saves on 2 ranks launches for real.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from gnnpar import checkpoint
from gnnpar.cli import main
from tests.cli_world import run_commands

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


def _resumed_against_straight(
    argv, world: int, saved: Path, resumed: Path, straight: Path, first: str, then: str
) -> float:
    """On one world of ``world`` ranks: train ``saved`` 2 units on grid ``first``, copy it,
    resume the copy to 4 units on grid ``then``, and train ``straight`` 4 units on ``then``;
    the largest relative difference of the two final states."""
    codes = run_commands(world, [
        argv(saved, 2, first, world),
        ("copy", saved, resumed),
        argv(resumed, 4, then, world, "--resume"),
        argv(straight, 4, then, world),
    ])  # fmt: skip
    assert codes == [[0, 0, 0]] * world
    return _same(resumed, straight)


def _gcn_argv(out: Path, epochs: int, grid: str, nprocs: int, *extra: str) -> list[str]:
    return ["train", "gcn", "--dataset", "sbm", "--dataset-options", "num_nodes=90,feat_dim=6",
            "--root", str(out.parent / "data"), "--layers", "3", "--hidden", "5",
            "--dtype", "float64", "--epochs", str(epochs), "--grid", grid, "--nprocs",
            str(nprocs), "--out", str(out), "--eval-every", "0", "--quiet", "--blocks", "3",
            *extra]  # fmt: skip


def test_gcn_resumes_on_another_grid_and_on_one_rank(tmp_path):
    import shutil

    saved = tmp_path / "x2y2z2"
    resumed, straight = tmp_path / "resumed-x1y2z4", tmp_path / "straight-x1y2z4"
    # one rank, straight through (first: it also makes the dataset the 8 ranks read)
    assert main(_gcn_argv(tmp_path / "straight-one", 4, "x=1", 1)) == 0
    err = _resumed_against_straight(
        _gcn_argv, 8, saved, resumed, straight, "x=2,y=2,z=2", "x=1,y=2,z=4"
    )
    assert err <= REL, f"gcn resumed on x=1,y=2,z=4: {err:.3g}"
    shutil.copytree(saved, tmp_path / "resumed-one")
    assert main(_gcn_argv(tmp_path / "resumed-one", 4, "x=1", 1, "--resume")) == 0
    err = _same(tmp_path / "resumed-one", tmp_path / "straight-one")
    assert err <= REL, f"gcn resumed on x=1: {err:.3g}"


def _weighted_sbm(root: Path) -> Path:
    """A graph folder of a small SBM graph whose edges weigh 0.25 to 4: the sage runs train on
    the weights through the local sampler (1 rank) and the distributed one (2 ranks), so a
    path that dropped them would break the resumed-equals-straight checks."""
    import torch

    from gnnpar.data import save_graph, sbm

    g = sbm(num_nodes=120, feat_dim=6, seed=0)
    gen = torch.Generator().manual_seed(1)
    g.edge_weight = torch.exp2(torch.rand(g.num_edges, generator=gen) * 4 - 2)
    return save_graph(g, root / "weighted-sbm")


def _sage_argv(out: Path, epochs: int, nprocs: int, *extra: str) -> list[str]:
    return ["train", "sage", "--dataset", str(out.parent / "weighted-sbm"),
            "--dtype", "float64", "--epochs", str(epochs),
            "--batch-size", "16", "--hidden", "8", "--fanouts", "4,3", "--nprocs", str(nprocs),
            "--out", str(out), "--eval-every", "0", "--quiet", "--prefetch", "0",
            *extra]  # fmt: skip


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_sage_resumes_on_another_number_of_data_ranks(tmp_path, before, after):
    import shutil

    saved, resumed, straight = tmp_path / "saved", tmp_path / "resumed", tmp_path / "straight"
    _weighted_sbm(tmp_path)
    if before == 2:  # a real --nprocs launch (the one of the sage task in the suite)
        assert main(_sage_argv(saved, 2, before)) == 0
        shutil.copytree(saved, resumed)
        assert main(_sage_argv(resumed, 4, after, "--resume")) == 0
        assert main(_sage_argv(straight, 4, after)) == 0
    else:  # saved on one rank (this process), both 2-rank runs in one world
        assert main(_sage_argv(saved, 2, before)) == 0
        codes = run_commands(2, [
            ("copy", saved, resumed),
            _sage_argv(resumed, 4, after, "--resume"),
            _sage_argv(straight, 4, after),
        ])  # fmt: skip
        assert codes == [[0, 0]] * 2
    err = _same(resumed, straight)
    assert err <= REL, f"sage {before} -> {after} ranks: {err:.3g}"


def _gpt_argv(out: Path, steps: int, grid: str, nprocs: int, *extra: str) -> list[str]:
    return ["train", "gpt", "--steps", str(steps), "--n-layer", "2", "--n-embd", "16",
            "--n-head", "2", "--batch-size", "4", "--block-size", "8", "--vocab-size", "300",
            "--warmup", "2", "--eval-every", "100", "--val-batches", "1", "--sample-tokens",
            "0", "--dtype", "float64", "--grid", grid, "--nprocs", str(nprocs), "--out",
            str(out), "--quiet", *extra]  # fmt: skip


def test_gpt_resumes_on_another_tensor_and_data_grid(tmp_path):
    saved, resumed, straight = tmp_path / "saved", tmp_path / "resumed", tmp_path / "straight"
    err = _resumed_against_straight(
        _gpt_argv, 4, saved, resumed, straight, "data=2,x=2", "data=1,x=2,y=2"
    )
    assert err <= REL, f"gpt data=2,x=2 -> data=1,x=2,y=2: {err:.3g}"


def test_a_resuming_gpt_leaves_its_initial_values_to_the_restore(tmp_path, monkeypatch):
    """A resuming run whose checkpoint loads every value makes none first: the recorded build
    that gives them is never run (it raises here), and the run ends bit for bit where a
    straight one does. A resume with nothing to load makes them after all: a fresh start."""
    # the module, not the function the package exports under its name
    parallelize_module = importlib.import_module("gnnpar.tensor.parallelize")
    straight, saved, empty = tmp_path / "straight", tmp_path / "saved", tmp_path / "empty"
    assert main(_gpt_argv(straight, 4, "data=1", 1)) == 0
    assert main(_gpt_argv(saved, 2, "data=1", 1)) == 0

    def recorded(*args, **kwargs):
        raise AssertionError("a resume recorded the model's initialisation")

    with monkeypatch.context() as patched:
        patched.setattr(parallelize_module, "record_init", recorded)
        assert main(_gpt_argv(saved, 4, "data=1", 1, "--resume")) == 0
    assert _same(saved, straight) == 0.0
    assert main(_gpt_argv(empty, 4, "data=1", 1, "--resume")) == 0
    assert _same(empty, straight) == 0.0
