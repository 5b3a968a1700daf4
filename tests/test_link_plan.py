"""``gnnpar plan link``: the command prints its table for both modes; the full-graph plan's
pair-fetch bytes equal the all-to-all bytes ``gnnpar.comm`` records around
``LinkTask.full_scores`` and its backward on 4 ranks; the mini-batch plan's memory rises with
the batch size."""

from __future__ import annotations

import json

import pytest
import torch

from gnnpar.cli import main

SBM = "num_nodes=61,num_classes=3,feat_dim=5,avg_degree=6"
FLAGS = ["--dataset", "sbm", "--dataset-options", SBM, "--hidden", "6", "--num-negatives", "2",
         "--val-fraction", "0.1", "--test-fraction", "0.1", "--seed", "2"]  # fmt: skip


def test_plan_link_prints_a_table_for_both_modes(tmp_path, capsys):
    """Mini-batch: data = every rank, one row per ZeRO stage, the gradient reduction on the
    data axis; full: the x·y·z shapes, with the pair fetch on the tensor axis."""
    root = ["--root", str(tmp_path / "data")]
    assert main(["plan", "link", *FLAGS, *root, "--gpus", "4", "--machine", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "link (minibatch) on sbm: 61 nodes" in text and "up to 4,096 seeds" in text
    rows = [line.split() for line in text.splitlines() if line[:1].isdigit()]
    assert sorted(r[5] for r in rows) == ["0", "1", "2", "3"]  # the ZeRO column
    assert all(r[1:5] == ["d4", "x1", "y1", "z1"] for r in rows)
    assert "data" in text.splitlines()[1]
    out = tmp_path / "full.json"
    argv = ["plan", "link", *FLAGS, *root, "--mode", "full", "--gpus", "4", "--machine", "cpu",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "link (full) on sbm" in text and "tensor" in text.splitlines()[1]
    shapes = {(c["shape"]["x"], c["shape"]["y"], c["shape"]["z"])
              for c in json.loads(out.read_text())["candidates"]}  # fmt: skip
    assert shapes == {(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)}
    # a given grid is the one shape ranked; a bad one is a one-line error
    assert main([*argv, "--grid", "x=2,z=2"]) == 0
    doc = json.loads(out.read_text())
    assert [c["shape"] for c in doc["candidates"]] == [{"data": 1, "x": 2, "y": 1, "z": 2}]
    capsys.readouterr()
    assert main([*argv, "--grid", "x=3"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "x=3" in err[0], err


def test_minibatch_plan_memory_rises_with_the_batch(tmp_path):
    """A batch of b positives and k negatives is up to (2 + k)·b seeds: a larger batch holds
    larger blocks, activations and endpoint rows on every rank."""
    totals = []
    for batch in (64, 256, 1024):
        out = tmp_path / f"b{batch}.json"
        argv = ["plan", "link", *FLAGS, "--root", str(tmp_path / "data"), "--batch-size",
                str(batch), "--zero-stage", "1", "--gpus", "2", "--json", str(out)]  # fmt: skip
        assert main(argv) == 0
        (cand,) = json.loads(out.read_text())["candidates"]
        assert cand["stage"] == 1 and cand["bytes"]["data"] > 0
        totals.append(sum(cand["memory_bytes"].values()))
    assert totals[0] < totals[1] < totals[2], totals
    # partitioned sampling: the part's model, with the features fetched across parts
    out = tmp_path / "parts.json"
    argv = ["plan", "link", *FLAGS, "--root", str(tmp_path / "data"), "--zero-stage", "1",
            "--sampling", "partitioned", "--gpus", "2", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    (cand,) = json.loads(out.read_text())["candidates"]
    assert cand["memory_bytes"]["buffers"] > 0


def _pair_fetch_world(tmp: str) -> dict:
    """One full-graph step's pair scoring on x=2 × y=2 (P = 4 tensor ranks): the all-to-all
    bytes recorded around ``full_scores`` and its backward, and this rank's endpoints held
    by other ranks (``remote``) and asked of it by them (``served``)."""
    import gnnpar
    from gnnpar import comm
    from gnnpar.models.link.task import LinkTask
    from gnnpar.train.progress import Progress
    from gnnpar.train.spec import GridPlan
    from tests.test_link import _config

    shape = {"x": 2, "y": 2}
    grid = gnnpar.init(**shape)
    cfg = _config(tmp, mode="full", grid="x=2,y=2")
    task = LinkTask(cfg, grid, GridPlan(shape), Progress(enabled=False))
    task.model.train()
    h = task.model(task.features).detach().requires_grad_()  # the encoder's bytes left out
    src, dst, neg = task.full_pairs(0)
    with comm.record(grid) as traffic:
        pos, negs = task.full_scores(h, src, dst, neg)
        task._loss(pos, negs).backward()
    p, me = grid.size("tensor"), grid.rank("tensor")
    _, owner = task._owners(torch.cat([src, dst, neg.reshape(-1)]))
    asked = comm.all_to_all(torch.bincount(owner, minlength=p), grid, "tensor", [1] * p, [1] * p)
    out = {
        "rank": me,
        "pairs": int(src.numel()),
        "measured": traffic.bytes(axis="tensor", kind="all_to_all"),
        "remote": int((owner != me).sum()),
        "served": int(asked.sum() - asked[me]),
    }
    gnnpar.release(grid)
    return out


def test_full_plan_pair_fetch_bytes_equal_the_measured(tmp_path):
    """Rank r scores b_r positives and k negatives each: (2 + k)·b_r endpoint rows, a_r of
    them on other ranks, s_r of its rows asked by the others. It sends, forward, one count
    per peer, the ids and the rows asked of it, backward the gradients of its rows:

        bytes_r = (P - 1)·8 + a_r·8 + s_r·h·e + a_r·h·e        (h = 6, e = 8: float64)

    which :func:`pair_fetch_collectives` gives exactly with the realized a_r and s_r. The plan
    counts rank 0 (b_0 = ceil(E / P)) with the expectation a = s = (2 + k)·b·(P - 1)/P, each
    part rounded to a byte; summed over the ranks it is the measured total within the
    scatter of the owners (5%)."""
    from gnnpar.models.link.planning import link_problem, pair_fetch_collectives, rank_link_full
    from gnnpar.models.link.task import LinkConfig
    from gnnpar.plan.machines import get_machine
    from gnnpar.testing import run_distributed

    got = run_distributed(_pair_fetch_world, 4, str(tmp_path), timeout=120)
    p, k, h, e = 4, 2, 6, 8
    for r in got:
        exact = pair_fetch_collectives(r["pairs"], k, h, e, p, r["remote"], r["served"])
        want = (p - 1) * 8 + r["remote"] * 8 + r["served"] * h * e + r["remote"] * h * e
        assert r["measured"] == sum(c.nbytes for c in exact) == want, r
    # the plan of the same run (the same flags through the config), rank 0's slice
    cfg = LinkConfig(dataset="sbm", dataset_options=SBM, out=str(tmp_path), dtype="float64",
                     hidden=h, decoder="mlp", num_negatives=k, val_fraction=0.1,
                     test_fraction=0.1, seed=2, blocks=1, mode="full")  # fmt: skip
    problem, model = link_problem(cfg)
    shape = {"data": 1, "x": 2, "y": 2, "z": 1}
    (cand,) = rank_link_full(model, problem, h, p, get_machine("cpu"), [shape])
    planned = sum(c.nbytes for c in cand.collectives if c.what.startswith("pair fetch"))
    e_train = problem.train_edges
    b0 = -(-e_train // p)
    assert got[[r["rank"] for r in got].index(0)]["pairs"] == b0
    a = (2 + k) * b0 * (p - 1) / p
    assert planned == (p - 1) * 8 + round(a * 8) + 2 * round(a * h * e)
    # every rank's expectation against the measured, summed (E = sum of the slices)
    expected = sum((p - 1) * 8 + (2 + k) * r["pairs"] * (p - 1) / p * (8 + 2 * h * e)
                   for r in got)  # fmt: skip
    measured = sum(r["measured"] for r in got)
    assert sum(r["pairs"] for r in got) == e_train
    assert measured == pytest.approx(expected, rel=0.05)
