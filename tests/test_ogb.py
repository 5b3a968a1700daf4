"""OGB node-property datasets, multi-label training and the evaluation scores.

Tiny archives are written here in exactly the layouts OGB's archives unpack to (``raw/*.csv.gz``
tables, or ``raw/data.npz`` and ``raw/node-label.npz`` for ogbn-papers100M; the official split
under ``split/<scheme>/``), each in one of the folder names a data root may use for it. They
load with the right shapes, splits and symmetrisation, train through ``gnnpar train`` (sage and
gcn, one process), and the multi-label full-graph loss and gathered scores agree with serial
PyTorch on every 4-rank grid. The scores agree with scikit-learn's.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gnnpar
from gnnpar.cli import main
from gnnpar.data import load
from gnnpar.data.catalogue import get_entry
from gnnpar.data.ogb import find_ogbn, ogbn_datasets
from gnnpar.models.fullgraph import parallelize_fullgraph
from gnnpar.sparse.source import MemorySource, make_permutations
from gnnpar.testing import grid_shapes, run_distributed
from gnnpar.train.metrics import SCORES, UndefinedScoreError, rocauc
from tests.fullgraph_utils import dense_to_block, normalise, serial_adj, serial_model

N, E, F_IN = 48, 150, 6
# where each archive is unpacked: the catalogue name, OGB loader's and the zip's folder names
FOLDERS = {
    "ogbn-arxiv": "ogbn_arxiv",
    "ogbn-products": "ogbn-products",
    "ogbn-proteins": "ogbn-proteins",
    "ogbn-papers100M": "papers100M-bin",
}


def _csv_gz(path: Path, rows: np.ndarray, fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = rows.reshape(len(rows), -1)
    text = "".join(",".join(fmt % v for v in row) + "\n" for row in rows)
    with gzip.open(path, "wt") as f:
        f.write(text)


def _edges(rng: np.random.Generator) -> np.ndarray:
    """E distinct directed pairs without self-loops, none listed in both directions."""
    pairs: dict[tuple[int, int], None] = {}
    while len(pairs) < E:
        s, d = (int(v) for v in rng.integers(0, N, 2))
        if s != d and (d, s) not in pairs:
            pairs[(s, d)] = None
    return np.array(list(pairs), dtype=np.int64)


def write_archive(folder: Path, name: str, seed: int = 0) -> dict:
    """Write a tiny ``name`` archive into ``folder``; returns what it holds."""
    rng = np.random.default_rng(seed)
    spec = ogbn_datasets()[name]
    edges = _edges(rng)
    raw, split = folder / "raw", folder / "split" / spec.split
    out: dict = {"edges": edges}
    if name == "ogbn-proteins":
        label = (rng.random((N, spec.num_classes)) < 0.3).astype(np.int64)
        edge_feat = rng.random((E, 8)).astype(np.float32)
        species = np.repeat(np.array([3702, 4932, 6239]), N // 3)  # OGB's split is by species
        _csv_gz(raw / "edge-feat.csv.gz", edge_feat, "%.6f")
        _csv_gz(raw / "node_species.csv.gz", species, "%d")
        _csv_gz(raw / "node-label.csv.gz", label, "%d")
        parts = [np.flatnonzero(species == s) for s in (3702, 4932, 6239)]
        out.update(label=label, edge_feat=edge_feat, species=species)
    else:
        label = rng.integers(0, 4, N).astype(np.float64)
        feat = (np.eye(4)[label.astype(int)] @ rng.random((4, F_IN))).astype(np.float32)
        feat += 0.1 * rng.random((N, F_IN)).astype(np.float32)
        order = rng.permutation(N)
        parts = [np.sort(order[:24]), np.sort(order[24:34]), np.sort(order[34:44])]
        if name == "ogbn-papers100M":  # nodes outside the split are unlabelled (NaN)
            label[order[44:]] = np.nan
        out.update(label=label, feat=feat)
        if name == "ogbn-papers100M":
            raw.mkdir(parents=True)
            np.savez(
                raw / "data.npz",
                edge_index=edges.T.copy(),
                node_feat=feat,
                node_year=rng.integers(2000, 2020, (N, 1)),
                num_nodes_list=np.array([N]),
                num_edges_list=np.array([E]),
            )
            np.savez(raw / "node-label.npz", node_label=label[:, None])
        else:
            _csv_gz(raw / "node-feat.csv.gz", feat, "%.6f")
            _csv_gz(raw / "node-label.csv.gz", label, "%d")
    if name != "ogbn-papers100M":
        _csv_gz(raw / "edge.csv.gz", edges, "%d")
        _csv_gz(raw / "num-node-list.csv.gz", np.array([N]), "%d")
        _csv_gz(raw / "num-edge-list.csv.gz", np.array([E]), "%d")
    for part, ids in zip(("train", "valid", "test"), parts, strict=True):
        _csv_gz(split / f"{part}.csv.gz", ids, "%d")
    (folder / "RELEASE_v1.txt").write_text("tiny test archive\n")
    out["split"] = parts
    return out


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("ogb")
    written = {
        name: write_archive(root / FOLDERS[name], name, seed=i) for i, name in enumerate(FOLDERS)
    }
    return root, written


@pytest.mark.parametrize("name", list(FOLDERS))
def test_archive_loads_with_split_symmetrised_edges_and_labels(archives, name):
    root, written = archives
    data, spec = written[name], ogbn_datasets()[name]
    assert find_ogbn(root, name) == root / FOLDERS[name]
    g = load(name, root=root)
    assert g.name == name and g.num_nodes == N and g.num_classes == spec.num_classes
    # symmetrised: every listed edge in both directions, nothing else
    src, dst = (t.tolist() for t in g.edges())
    listed = {(int(s), int(d)) for s, d in data["edges"]}
    assert set(zip(src, dst, strict=True)) == listed | {(d, s) for s, d in listed}
    assert g.num_edges == 2 * E
    for key, ids in zip(("train_mask", "val_mask", "test_mask"), data["split"], strict=True):
        assert torch.equal(torch.nonzero(g.ndata[key]).flatten(), torch.from_numpy(ids))
    entry = get_entry(name)
    assert entry is not None and entry.metric == spec.metric and entry.needs_files
    if name == "ogbn-proteins":
        assert g.is_multilabel and torch.equal(g.label, torch.from_numpy(data["label"]))
        assert torch.equal(g.ndata["species"], torch.from_numpy(data["species"]))
        # node features: the mean of the incident edges' features, summed here edge by edge
        sums, counts = np.zeros((N, 8)), np.zeros(N)
        for (s, d), f in zip(data["edges"], data["edge_feat"], strict=True):
            for v in (s, d):
                sums[v] += f
                counts[v] += 1
        want = sums / np.maximum(counts, 1)[:, None]
        assert g.feat.shape == (N, 8)
        np.testing.assert_allclose(g.feat.numpy(), want, rtol=1e-5, atol=1e-6)
    else:
        label = np.where(np.isnan(data["label"]), -1, data["label"]).astype(np.int64)
        assert not g.is_multilabel and torch.equal(g.label, torch.from_numpy(label))
        np.testing.assert_allclose(g.feat.numpy(), data["feat"], rtol=1e-5, atol=1e-6)
    g.check_trainable()


def test_missing_and_unsafe_archives_are_one_line_errors(archives, tmp_path):
    root, _ = archives
    with pytest.raises(FileNotFoundError, match="ogbn_arxiv"):
        load("ogbn-arxiv", root=tmp_path)
    raw = tmp_path / "ogbn-papers100M" / "raw"
    raw.mkdir(parents=True)
    np.savez(raw / "data.npz", edge_index=np.array([object(), 1], dtype=object))
    with pytest.raises(ValueError, match="data.npz"):
        load("ogbn-papers100M", root=tmp_path)
    # a multi-label entry that is not 0/1 is named
    bad = tmp_path / "p" / "ogbn-proteins"
    write_archive(bad, "ogbn-proteins")
    label = np.zeros((N, 112), dtype=np.int64)
    label[5, 7] = 2
    _csv_gz(bad / "raw" / "node-label.csv.gz", label, "%d")
    with pytest.raises(ValueError, match=r"\[5, 7\]"):
        load("ogbn-proteins", root=tmp_path / "p")


def test_data_list_shows_the_ogb_entries_and_their_metric(capsys):
    assert main(["data", "list"]) == 0
    text = capsys.readouterr().out
    for name in FOLDERS:
        line = next(line for line in text.splitlines() if line.startswith(name + " "))
        assert f"metric {ogbn_datasets()[name].metric}" in line, line


def _last_eval(run: Path) -> dict:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in reversed(lines) if r.get("event") == "end"), lines


@pytest.mark.parametrize("task", ["sage", "gcn"])
def test_each_archive_trains_and_reports_its_metric(
    archives, tmp_path, task, monkeypatch, capsys
):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    root, _ = archives
    extra = ["--fanouts", "5,5", "--batch-size", "16"] if task == "sage" else ["--blocks", "1"]
    for name, spec in ogbn_datasets().items():
        run = tmp_path / name
        argv = ["train", task, "--dataset", name, "--root", str(root), "--epochs", "3"]
        assert main([*argv, "--hidden", "8", "--out", str(run), *extra]) == 0, name
        targets = "binary tasks" if spec.metric == "rocauc" else "classes"
        assert f" {targets}" in capsys.readouterr().out, name  # the start line says which
        end, records = _last_eval(run)
        other = "acc" if spec.metric == "rocauc" else "rocauc"
        assert 0.0 <= end[f"test_{spec.metric}"] <= 1.0 and f"test_{other}" not in end
        losses = [r["loss"] for r in records if "loss" in r]
        assert len(losses) == 3 and all(np.isfinite(losses)), (name, losses)
        # the best model is chosen by the dataset's metric, and evaluate reproduces its score
        evals = [r for r in records if f"val_{spec.metric}" in r and "event" not in r]
        best = max(evals, key=lambda r: r[f"val_{spec.metric}"])
        assert end["best_step"] == best["epoch"], (name, end, evals)
        assert main(["evaluate", str(run), "--json", str(run / "eval.json")]) == 0, name
        doc = json.loads((run / "eval.json").read_text())
        assert doc["metric"] == f"test_{spec.metric}" and doc["value"] == end[doc["metric"]]


def test_minibatch_multilabel_loss_is_the_mean_bce_of_the_model(archives, tmp_path, monkeypatch):
    """One batch of every training node with all neighbours and no dropout: the epoch's loss
    is ``F.binary_cross_entropy_with_logits`` (mean over nodes and tasks) of the model's
    full-neighbourhood logits before the step."""
    from gnnpar.models.minibatch.task import MiniBatchConfig
    from gnnpar.sampling import layerwise_inference
    from gnnpar.train.spec import build_task

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    root, _ = archives
    cfg = MiniBatchConfig(
        dataset="ogbn-proteins",
        root=str(root),
        fanouts="-1,-1",
        batch_size=N,
        dropout=0.0,
        hidden=8,
        prefetch=0,
        out=str(tmp_path),
    )
    task = build_task("sage", cfg)
    g = task.graph
    with torch.no_grad():
        logits = layerwise_inference(task.net, g, features=g.feat, blocks=task._eval_blocks)
    train = g.train_mask
    want = F.binary_cross_entropy_with_logits(logits[train], g.label[train].float())
    record = task.train_step(0)
    gnnpar.release(task.grid)
    assert record["loss"] == pytest.approx(float(want), rel=1e-5) and "batch_acc" not in record


def test_minibatch_multilabel_on_2_ranks_equals_one_process(archives, tmp_path, monkeypatch):
    """The sage task is the same run on any number of ranks: on 2 (parts, remote features,
    ROC-AUC from the rows gathered over the data axis) its losses and scores equal one
    process's."""
    from tests.cli_world import run_commands

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    root, _ = archives
    argv = ["train", "sage", "--dataset", "ogbn-proteins", "--root", str(root), "--epochs", "2"]
    argv += ["--hidden", "8", "--fanouts", "5,5", "--batch-size", "16", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    assert main(["predict", str(tmp_path / "one"), "--out", str(tmp_path / "pred-one")]) == 0
    run_commands(2, [
        [*argv, "--out", str(tmp_path / "two"), "--partition-method", "random"],
        ["predict", str(tmp_path / "two"), "--nprocs", "2", "--out", str(tmp_path / "pred-two")],
    ])  # fmt: skip
    (one_end, one), (two_end, two) = (_last_eval(tmp_path / r) for r in ("one", "two"))
    # predictions: each task's probability, in original node order, the same from 2 parts
    got = [np.load(tmp_path / p / "predictions.npy") for p in ("pred-one", "pred-two")]
    assert got[0].shape == got[1].shape == (N, load_proteins(root).label.shape[1])
    assert got[0].dtype == np.float32 and ((got[0] > 0) & (got[0] < 1)).all()
    np.testing.assert_allclose(got[1], got[0], rtol=1e-5)
    assert one_end.keys() == two_end.keys() and "test_rocauc" in one_end
    for key in ("train_rocauc", "val_rocauc", "test_rocauc"):
        assert two_end[key] == pytest.approx(one_end[key], abs=1e-6), key
    losses = [[r["loss"] for r in records if "loss" in r] for records in (one, two)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


# ------------------------------------------------------------------ scores vs scikit-learn
def load_proteins(root: Path):
    return load("ogbn-proteins", root=root)


def test_full_graph_multilabel_predictions_on_any_grid(archives, tmp_path, monkeypatch):
    """gnnpar predict of a multi-label gcn run writes each task's probability in original
    node order: their ROC-AUC on the test nodes is the run's test_rocauc, and 2 ranks on
    another grid write the same array."""
    from tests.cli_world import run_commands

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    root, _ = archives
    run = tmp_path / "run"
    argv = ["train", "gcn", "--dataset", "ogbn-proteins", "--root", str(root), "--epochs", "3"]
    assert main([*argv, "--hidden", "8", "--blocks", "1", "--out", str(run), "--quiet"]) == 0
    assert main(["predict", str(run), "--out", str(tmp_path / "one")]) == 0
    grid = ["--nprocs", "2", "--grid", "z=2"]  # z splits the classes of the last layer here
    run_commands(2, [["predict", str(run), *grid, "--out", str(tmp_path / "two")]])
    one, two = (np.load(tmp_path / p / "predictions.npy") for p in ("one", "two"))
    from gnnpar.train.report import write_report

    assert "test_rocauc" in write_report(run)  # and the score's figure shows ROC-AUC
    assert (run / "plots" / "accuracy.png").is_file()
    np.testing.assert_allclose(two, one, rtol=1e-6)
    about = json.loads((tmp_path / "one" / "predictions.json").read_text())
    assert about["shape"] == list(one.shape) and "probabilities" in about["values"]
    g = load_proteins(root)
    test = g.test_mask.numpy()
    end, _ = _last_eval(run)
    assert rocauc(torch.from_numpy(one[test]), g.label[test]) == pytest.approx(
        end["test_rocauc"], abs=1e-9
    )


def test_scores_equal_scikit_learn():
    from sklearn.metrics import accuracy_score, f1_score, roc_auc_score

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 8, generator=g)
    logits[:, 7] = -1e3  # class 7 neither true nor predicted: macro-F1 leaves it out
    labels = torch.randint(0, 6, (200,), generator=g)  # class 6 never true, sometimes predicted
    pred = logits.argmax(1).numpy()
    assert SCORES["acc"](logits, labels) == pytest.approx(accuracy_score(labels, pred))
    for avg in ("micro", "macro"):
        want = f1_score(labels.numpy(), pred, average=avg)
        assert SCORES[f"f1_{avg}"](logits, labels) == pytest.approx(want, abs=1e-12)

    scores = torch.round(torch.randn(120, 9, generator=g) * 2) / 2  # many ties
    y = (torch.rand(120, 9, generator=g) < 0.3).long()
    y[:, 4] = 1  # a task with one class only: OGB skips it
    y[:, 6] = (scores[:, 6] > 0).long()  # a perfectly ranked task
    want = [roc_auc_score(y[:, t], scores[:, t]) for t in range(9) if t != 4]
    assert rocauc(scores, y) == pytest.approx(float(np.mean(want)), abs=1e-12)
    with pytest.raises(UndefinedScoreError):
        rocauc(scores, torch.ones_like(y))


# ------------------------------------------------------------------ multi-rank BCE vs serial
T = 5  # tasks (the logits' columns)


def _multilabel_graph(n: int = 23):
    g = torch.Generator().manual_seed(1)
    src, dst = (
        torch.randint(0, n, (4 * n,), generator=g),
        torch.randint(0, n, (4 * n,), generator=g),
    )
    a = torch.zeros(n, n, dtype=torch.float64)
    a[src, dst] = a[dst, src] = 1.0
    a.fill_diagonal_(0.0)
    x = torch.randn(n, 7, generator=g, dtype=torch.float64)
    y = (torch.rand(n, T, generator=g) < 0.4).long()
    train = torch.rand(n, generator=g) < 0.6
    return a, x, y, train


def _bce_every_grid(world: int) -> list[tuple[int, int]]:
    """Rank body: on each 3D grid shape of ``world`` ranks (and the 2D and 1D layouts), the
    multi-label loss and every weight gradient equal serial PyTorch's, and the gathered
    masked rows give the serial ROC-AUC. Returns (row, class) axis sizes per case."""
    a, x, y, train = _multilabel_graph()
    a_hat = normalise(a, "gcn")
    ref = serial_model("gcn", [7, 6, T])
    logits = ref(serial_adj(a_hat), x)
    loss_ref = F.binary_cross_entropy_with_logits(logits[train], y[train].double())
    loss_ref.backward()
    auc_ref = rocauc(logits.detach()[~train], y[~train])
    cases = [(s, "3d") for s in grid_shapes(world)]
    cases += [({"x": 2, "y": 2, "z": 1}, "2d"), ({"x": 1, "y": 1, "z": 4}, "1d")]
    split = []
    for shape, algorithm in cases:
        grid = gnnpar.init(**shape)
        blk = dense_to_block(a_hat)
        perms = make_permutations("random", blk.indptr, blk.indices, 3)
        data = {"label": y, "train_mask": train, "test_mask": ~train}
        source = MemorySource(blk.indptr, blk.indices, blk.values, x, data, perms)
        par = parallelize_fullgraph(ref, grid, source, algorithm=algorithm)
        out = par(par.input_features())
        loss = par.loss(out)
        torch.testing.assert_close(loss.detach(), loss_ref.detach(), rtol=1e-12, atol=1e-12)
        loss.backward()
        for i, layer in enumerate(ref.layers):
            full = par.full_weights(grads=True)[i]
            torch.testing.assert_close(
                full["weight"], layer.stacked_weight_grad(), rtol=1e-12, atol=1e-12
            )
            torch.testing.assert_close(full["bias"], layer.bias.grad, rtol=1e-12, atol=1e-12)
        rows, labels = par.gather_masked(out.detach(), "test_mask")
        assert rows.shape == (int((~train).sum()), T) and labels.shape == rows.shape
        assert rocauc(rows, labels) == pytest.approx(auc_ref, abs=1e-12)
        axes = (par.row_axis, par.class_axis)
        split.append(tuple(1 if ax is None else grid.size(ax) for ax in axes))
        gnnpar.release(grid)
    return split


def test_multilabel_full_graph_loss_and_gather_match_serial_on_4_ranks():
    split = run_distributed(_bce_every_grid, 4, 4, timeout=300)[0]
    # some grids split the rows and the tasks both, some only one of them
    assert any(r > 1 and c > 1 for r, c in split) and any(c == 1 for r, c in split), split
