"""Tests of gnnpar.data: catalogue, generators, Planetoid/OGB readers, on-disk format, CLI."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

import gnnpar.data.storage as storage
from gnnpar.cli.data import add_data_commands
from gnnpar.data import (
    UnsafePickleError,
    catalogue,
    karate,
    load,
    load_graph,
    load_pickle,
    ogb,
    planetoid,
    rmat,
    save_graph,
    sbm,
)
from gnnpar.data.options import parse_options
from gnnpar.graph import Graph
from gnnpar.verified import FormatError, file_entry
from tests.conftest import CITESEER, PLANETOID, needs_dataset

needs_citeseer = needs_dataset(CITESEER)


def assert_same(a: Graph, b: Graph) -> None:
    assert a.name == b.name and a.num_nodes == b.num_nodes
    assert torch.equal(a.indptr, b.indptr) and torch.equal(a.indices, b.indices)
    assert (a.edge_weight is None) == (b.edge_weight is None)
    if a.edge_weight is not None:
        assert torch.equal(a.edge_weight, b.edge_weight)
    assert set(a.ndata) == set(b.ndata)
    for key, value in a.ndata.items():
        assert value.dtype == b.ndata[key].dtype and torch.equal(value, b.ndata[key]), key


def split_sizes(g: Graph) -> tuple[int, int, int]:
    return int(g.train_mask.sum()), int(g.val_mask.sum()), int(g.test_mask.sum())


def assert_disjoint_masks(g: Graph) -> None:
    total = g.train_mask.long() + g.val_mask.long() + g.test_mask.long()
    assert int(total.max()) <= 1


# ---------------------------------------------------------------------- Planetoid


@needs_citeseer
def test_citeseer_planetoid_split() -> None:
    g = planetoid(PLANETOID, "citeseer")
    assert g.name == "citeseer"
    assert g.num_nodes == 3327 and g.num_classes == 6
    assert split_sizes(g) == (120, 500, 1000)
    assert g.num_edges == 2 * 4552 and g.is_symmetric() and not g.has_self_loops()
    assert g.feat.shape == (3327, 3703) and g.feat.dtype == torch.float32
    assert_disjoint_masks(g)
    assert torch.equal(torch.nonzero(g.train_mask).flatten(), torch.arange(120))
    assert torch.equal(torch.nonzero(g.val_mask).flatten(), torch.arange(120, 620))
    test_ids = np.loadtxt(PLANETOID / "ind.citeseer.test.index", dtype=np.int64)
    assert torch.equal(torch.nonzero(g.test_mask).flatten(), torch.from_numpy(np.sort(test_ids)))
    # The padded (isolated) test-range nodes have no features and no split.
    padded = torch.ones(3327, dtype=torch.bool)
    padded[: int(test_ids.min())] = False
    padded[torch.from_numpy(test_ids)] = False
    assert int(padded.sum()) == 3327 - 2312 - 1000
    assert float(g.feat[padded].abs().sum()) == 0.0
    normed = planetoid(PLANETOID, "citeseer", normalize_features=True).feat
    sums = normed.sum(1)
    assert torch.all(((sums - 1).abs() < 1e-5) | (sums == 0))


@needs_citeseer
def test_citeseer_matches_pyg_reader() -> None:
    from torch_geometric.io.planetoid import read_planetoid_data

    ours = planetoid(PLANETOID, "citeseer")
    ref = Graph.from_pyg(read_planetoid_data(str(PLANETOID), "citeseer"), name="citeseer")
    assert_same(ours, ref.coalesce())


@needs_citeseer
def test_load_citeseer_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    g = load("citeseer", root=PLANETOID.parent)
    assert g.num_nodes == 3327
    monkeypatch.setenv("GNNPAR_DATA", str(PLANETOID.parent))
    assert load("CiteSeer").num_nodes == 3327
    assert load(str(PLANETOID)).num_nodes == 3327  # a Planetoid folder path


class _RunsCode:
    """Pickles as a call to os.system: what a malicious dataset file would contain."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _CallsEval:
    def __reduce__(self):
        return (eval, ("__import__('os').getpid()",))


def test_restricted_unpickler_refuses_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps(_RunsCode(f"touch {marker}"), protocol=2))
    with pytest.raises(UnsafePickleError, match=r"refusing to unpickle (posix|os)\.system"):
        load_pickle(evil)
    assert not marker.exists()
    evil.write_bytes(pickle.dumps(_CallsEval(), protocol=2))
    with pytest.raises(UnsafePickleError, match=r"unpickle (__builtin__|builtins)\.eval"):
        load_pickle(evil)


def test_planetoid_refuses_malicious_file(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    for part in ("x", "y", "tx", "ty", "allx", "ally", "graph"):
        (tmp_path / f"ind.fake.{part}").write_bytes(pickle.dumps(np.zeros(2), protocol=2))
    (tmp_path / "ind.fake.test.index").write_text("2\n3\n")
    payload = pickle.dumps(_RunsCode(f"touch {marker}"), protocol=2)
    (tmp_path / "ind.fake.graph").write_bytes(payload)
    (tmp_path / "ind.fake.x").write_bytes(payload)
    with pytest.raises(UnsafePickleError, match=r"ind\.fake\.x.*refusing.*system"):
        planetoid(tmp_path, "fake")
    assert not marker.exists()


def test_restricted_unpickler_loads_allowed_globals(tmp_path: Path) -> None:
    from collections import defaultdict

    path = tmp_path / "ok.pkl"
    # Protocol 2 writes the Python 2 names the Planetoid graph file uses (__builtin__.list).
    path.write_bytes(pickle.dumps(defaultdict(list, {0: [1, 2], 2: [0]}), protocol=2))
    assert load_pickle(path) == {0: [1, 2], 2: [0]}


def test_planetoid_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"ind\.citeseer\.x"):
        planetoid(tmp_path, "citeseer")
    with pytest.raises(FileNotFoundError, match=r"no ind\.citeseer\.\* files"):
        load("citeseer", root=tmp_path)


# ---------------------------------------------------------------------- OGB layout


def _write_csv_gz(path: Path, rows: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.write("\n".join(rows) + "\n")


def _ogb_folder(root: Path, schemes: tuple[str, ...] = ("random",)) -> Path:
    folder = root / "ogbn-tiny"
    _write_csv_gz(folder / "raw/edge.csv.gz", ["0,1", "1,2", "2,0", "3,4", "1,0"])
    _write_csv_gz(folder / "raw/num-node-list.csv.gz", ["6"])
    _write_csv_gz(folder / "raw/node-feat.csv.gz", [f"{i}.5,{-i}" for i in range(6)])
    _write_csv_gz(folder / "raw/node-label.csv.gz", ["0", "1", "2", "nan", "1", "0"])
    for scheme in schemes:
        _write_csv_gz(folder / f"split/{scheme}/train.csv.gz", ["0", "1"])
        _write_csv_gz(folder / f"split/{scheme}/valid.csv.gz", ["2", "3"])
        _write_csv_gz(folder / f"split/{scheme}/test.csv.gz", ["4", "5"])
    return folder


def test_ogb_reader(tmp_path: Path) -> None:
    folder = _ogb_folder(tmp_path)
    g = ogb(folder)
    assert g.name == "ogbn-tiny" and g.num_nodes == 6
    assert g.is_symmetric() and g.num_edges == 8  # {0-1, 1-2, 2-0, 3-4} both ways
    assert g.feat.dtype == torch.float32 and g.feat[3].tolist() == [3.5, -3.0]
    assert g.label.tolist() == [0, 1, 2, -1, 1, 0] and g.num_classes == 3
    assert g.train_mask.nonzero().flatten().tolist() == [0, 1]
    assert g.val_mask.nonzero().flatten().tolist() == [2, 3]
    assert g.test_mask.nonzero().flatten().tolist() == [4, 5]
    directed = ogb(folder, undirected=False)
    assert sorted(zip(*[t.tolist() for t in directed.edges()], strict=True)) == [
        (0, 1),
        (1, 0),
        (1, 2),
        (2, 0),
        (3, 4),
    ]
    assert load(str(folder)).num_edges == 8  # detected as an OGB folder


def test_ogb_reader_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"not an OGB folder"):
        ogb(tmp_path)
    folder = _ogb_folder(tmp_path, schemes=("a", "b"))
    with pytest.raises(ValueError, match=r"several split schemes \['a', 'b'\]"):
        ogb(folder)
    assert ogb(folder, split="b").train_mask.sum() == 2
    with pytest.raises(ValueError, match=r"split 'c' not found"):
        ogb(folder, split="c")
    _write_csv_gz(folder / "split/a/test.csv.gz", ["4", "6"])
    with pytest.raises(ValueError, match=r"test\.csv\.gz: node ids must lie in \[0, 6\)"):
        ogb(folder, split="a")
    _write_csv_gz(folder / "raw/node-feat.csv.gz", ["1,2", "3"])
    with pytest.raises(ValueError, match=r"node-feat\.csv\.gz: expected 2 rows of 2 values"):
        ogb(folder, split="b")
    _write_csv_gz(folder / "raw/edge.csv.gz", ["0,x"])
    with pytest.raises(ValueError, match=r"edge\.csv\.gz: cannot parse"):
        ogb(folder, split="b")


# ---------------------------------------------------------------------- on-disk format


@pytest.mark.parametrize("mmap", [True, False])
def test_save_load_exact(tmp_path: Path, mmap: bool) -> None:
    g = sbm(num_nodes=300, seed=2)
    g.edge_weight = torch.rand(g.num_edges, dtype=torch.float64)
    g.ndata["extra.score"] = torch.arange(300, dtype=torch.int32)
    out = save_graph(g, tmp_path / "g", source={"dataset": "custom"})
    assert out == tmp_path / "g"
    doc = json.loads((out / "manifest.json").read_text())
    meta = doc["meta"]
    assert doc["schema"] == "gnnpar.graph" and doc["version"] == 2
    assert meta["num_nodes"] == 300 and meta["num_classes"] == 4
    assert meta["source"] == {"dataset": "custom"} and meta["fingerprint"] == g.fingerprint()
    names = list(meta["arrays"])
    assert names[:3] == ["indptr", "indices", "edge_weight"] and "ndata/feat" in names
    assert all(len(e["xxh3_64"]) == 16 for e in doc["files"].values())
    assert not (out / "meta.json").exists()
    back = load_graph(out, mmap=mmap, verify="checksum")
    assert_same(back, g)
    assert back.num_classes == 4 and back.fingerprint() == g.fingerprint()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]  # no temporary leftovers


def test_save_load_empty_graph(tmp_path: Path) -> None:
    g = Graph.from_edges([], [], num_nodes=3, name="empty")
    assert_same(load_graph(save_graph(g, tmp_path / "e")), g)


def test_existing_destination_is_an_error(tmp_path: Path) -> None:
    g = karate()
    save_graph(g, tmp_path / "k")
    with pytest.raises(FileExistsError, match=r"already exists"):
        save_graph(g, tmp_path / "k")
    h = sbm(num_nodes=100)
    save_graph(h, tmp_path / "k", overwrite=True)
    assert_same(load_graph(tmp_path / "k"), h)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]


def test_failed_save_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = storage.save_npy
    calls = []

    def failing(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(storage, "save_npy", failing)
    with pytest.raises(OSError, match="simulated"):
        save_graph(karate(), tmp_path / "k")
    assert list(tmp_path.iterdir()) == []
    # With overwrite, a failure keeps the previous folder intact.
    monkeypatch.setattr(storage, "save_npy", real)
    old = sbm(num_nodes=100)
    save_graph(old, tmp_path / "k")
    monkeypatch.setattr(storage, "save_npy", failing)
    calls.clear()
    with pytest.raises(OSError, match="simulated"):
        save_graph(karate(), tmp_path / "k", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]
    assert_same(load_graph(tmp_path / "k"), old)


def test_save_rejects_bad_input(tmp_path: Path) -> None:
    g = karate()
    g.ndata["../escape"] = torch.zeros(34)
    with pytest.raises(ValueError, match=r"ndata key '\.\./escape' cannot be a file name"):
        save_graph(g, tmp_path / "k")
    with pytest.raises(TypeError):
        save_graph(karate(), tmp_path / "k", source={"bad": object()})
    assert list(tmp_path.iterdir()) == []


def test_load_graph_errors(tmp_path: Path) -> None:
    folder = save_graph(karate(), tmp_path / "k")
    with pytest.raises(FormatError, match=r"missing: no such folder"):
        load_graph(tmp_path / "missing")
    feat = folder / "ndata/feat.npy"
    data = feat.read_bytes()
    feat.write_bytes(data[:-8])
    with pytest.raises(FormatError, match=r"feat\.npy: \d+ bytes, the manifest says \d+"):
        load_graph(folder)
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    feat.write_bytes(bytes(flipped))
    load_graph(folder, verify="size")  # sizes match; only the checksum notices
    with pytest.raises(FormatError, match=r"feat\.npy: checksum differs"):
        load_graph(folder)  # checksums are verified by default
    feat.unlink()
    with pytest.raises(FormatError, match=r"feat\.npy: missing"):
        load_graph(folder)
    manifest = folder / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["version"] = 99
    manifest.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"gnnpar.graph version 99; this gnnpar reads 2"):
        load_graph(folder)
    manifest.write_text("{not json")
    with pytest.raises(FormatError, match=r"unreadable manifest"):
        load_graph(folder)
    manifest.unlink()
    with pytest.raises(FormatError, match=r"no manifest\.json"):
        load_graph(folder)


def test_load_graph_checks_shapes(tmp_path: Path) -> None:
    folder = save_graph(karate(), tmp_path / "k")
    np.save(folder / "ndata/label.npy", np.zeros(34, dtype=np.int32))  # same size, new dtype
    doc = json.loads((folder / "manifest.json").read_text())
    doc["files"]["ndata/label.npy"] = file_entry(folder / "ndata/label.npy")
    (folder / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"label\.npy: holds int32, the manifest says int64"):
        load_graph(folder)


# ---------------------------------------------------------------------- generators


def test_sbm_deterministic_and_seeded() -> None:
    a, b, c = sbm(num_nodes=500, seed=1), sbm(num_nodes=500, seed=1), sbm(num_nodes=500, seed=2)
    assert_same(a, b)
    assert not torch.equal(a.label, c.label)
    assert not torch.equal(a.feat, c.feat)
    assert a.is_symmetric() and not a.has_self_loops()
    assert torch.equal(a.coalesce().indices, a.indices)  # no duplicate edges
    assert 8.0 < a.num_edges / a.num_nodes <= 10.0
    assert a.num_classes == 4 and torch.bincount(a.label).tolist() == [125] * 4
    assert_disjoint_masks(a)
    assert split_sizes(sbm()) == (80, 500, 1000)
    train, val, test = split_sizes(a)  # scaled down for a small graph
    assert train == 4 * 12 and val + test == 500 - train


def test_sbm_is_homophilous_and_learnable() -> None:
    g = sbm(num_nodes=600, seed=0)
    src, dst = g.edges()
    assert float((g.label[src] == g.label[dst]).float().mean()) > 0.6  # 8 / 11 expected

    def accuracy(propagate) -> float:
        torch.manual_seed(0)
        w1 = torch.nn.Linear(g.feat.shape[1], 16)
        w2 = torch.nn.Linear(16, g.num_classes)
        opt = torch.optim.Adam([*w1.parameters(), *w2.parameters()], lr=0.02, weight_decay=5e-4)
        for _ in range(100):
            out = propagate(w2(torch.relu(propagate(w1(g.feat)))))
            loss = torch.nn.functional.cross_entropy(out[g.train_mask], g.label[g.train_mask])
            opt.zero_grad()
            loss.backward()
            opt.step()
        pred = out.argmax(1)
        return float((pred[g.test_mask] == g.label[g.test_mask]).float().mean())

    adj = g.gcn_norm().to_torch_sparse()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add contention on a busy machine
    try:
        gcn = accuracy(lambda h: adj @ h)
        mlp = accuracy(lambda h: h)
    finally:
        torch.set_num_threads(threads)
    assert gcn > 0.8 and gcn > mlp + 0.2, (gcn, mlp)


def test_sbm_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match=r"num_classes <= num_nodes"):
        sbm(num_nodes=3, num_classes=5)
    with pytest.raises(ValueError, match=r"p_ratio=0"):
        sbm(p_ratio=0)


def test_rmat_deterministic_and_seeded() -> None:
    a, b, c = rmat(scale=10, seed=0), rmat(scale=10, seed=0), rmat(scale=10, seed=1)
    assert_same(a, b)
    assert not torch.equal(a.indices, c.indices) and not torch.equal(a.feat, c.feat)
    assert a.num_nodes == 1024 and a.name == "rmat10"
    assert a.is_symmetric() and not a.has_self_loops()
    assert torch.equal(a.coalesce().indices, a.indices)
    assert a.num_edges <= 2 * 16 * 1024
    deg = a.in_degrees().float()
    assert float(deg.max()) > 10 * float(deg.mean())  # power-law skew
    assert a.feat.shape == (1024, 128) and a.num_classes == 16
    assert split_sizes(a) == (614, 205, 205)
    with pytest.raises(ValueError, match=r"a \+ b \+ c <= 1"):
        rmat(scale=4, a=0.6, b=0.3, c=0.3)


def test_karate() -> None:
    g = karate()
    assert g.num_nodes == 34 and g.num_edges == 156 and g.is_symmetric()
    assert g.num_classes == 2 and torch.bincount(g.label).tolist() == [17, 17]
    assert g.label[0] == 0 and g.label[33] == 1  # Mr. Hi and the Officer
    assert torch.equal(g.feat, torch.eye(34))
    assert split_sizes(g) == (4, 10, 20)
    assert_disjoint_masks(g)
    assert karate(features="random", feat_dim=5).feat.shape == (34, 5)
    with pytest.raises(ValueError, match=r"features must be 'identity' or 'random'"):
        karate(features="onehot")


# ---------------------------------------------------------------------- catalogue and load


def test_catalogue() -> None:
    entries = {e.name: e for e in catalogue()}
    assert {"karate", "sbm", "rmat", "citeseer"} <= set(entries)
    assert entries["sbm"].defaults["num_nodes"] == 2000
    assert all(e.description for e in entries.values())
    with pytest.raises(TypeError):
        entries["sbm"].defaults["num_nodes"] = 5  # immutable


def test_load_names_options_and_errors(tmp_path: Path) -> None:
    assert load("karate", root=tmp_path).num_nodes == 34
    assert load("sbm", root=tmp_path, num_nodes=200).num_nodes == 200
    with pytest.raises(ValueError, match=r"unknown dataset 'nope'.*karate"):
        load("nope", root=tmp_path)
    with pytest.raises(ValueError, match=r"unknown option\(s\) bogus for dataset 'sbm'"):
        load("sbm", root=tmp_path, bogus=1)
    with pytest.raises(ValueError, match=r"is not a gnnpar graph folder"):
        load(str(tmp_path))


def test_load_prefers_matching_prepared_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gnnpar.data.catalogue import source_record

    g = sbm(num_nodes=200)
    g.name = "prepared-copy"
    save_graph(g, tmp_path / "sbm", source=source_record("sbm", {"num_nodes": 200}))
    assert load("sbm", root=tmp_path, num_nodes=200).name == "prepared-copy"
    assert load("sbm", root=tmp_path, num_nodes=200, seed=0).name == "prepared-copy"
    assert load("sbm", root=tmp_path, num_nodes=201).name == "sbm"  # options differ: rebuilt
    monkeypatch.setenv("GNNPAR_DATA", str(tmp_path))
    assert load("sbm", num_nodes=200).name == "prepared-copy"
    assert load(str(tmp_path / "sbm")).name == "prepared-copy"


# ---------------------------------------------------------------------- CLI


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gnnpar")
    add_data_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_prepare_info_list(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "sbm"
    options = ["--dataset-options", "num_nodes=300,seed=3"]
    rc = _run_cli(["data", "prepare", "sbm", "--out", str(out), *options])
    assert rc == 0 and "wrote" in capsys.readouterr().out
    assert_same(load_graph(out), sbm(num_nodes=300, seed=3))
    assert load("sbm", root=tmp_path, num_nodes=300, seed=3).num_nodes == 300

    assert _run_cli(["data", "info", str(out)]) == 0
    text = capsys.readouterr().out
    for expected in ("nodes       300", "features    32", "classes     4", "split", "in-degree"):
        assert expected in text
    assert _run_cli(["data", "info", "karate"]) == 0
    assert "train 4 / val 10 / test 20" in capsys.readouterr().out

    assert _run_cli(["data", "list", "--root", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "sbm" in listing and "rmat" in listing and "[prepared:" in listing


_PREPARE_X = ["data", "prepare", "sbm", "--out", "{tmp}/x", "--dataset-options"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["data", "info", "nope"], "unknown dataset 'nope'"),
        ([*_PREPARE_X, "num_nodes=abc"], "expected int"),
        ([*_PREPARE_X, "bogus=1"], "unknown option(s) bogus"),
        ([*_PREPARE_X, "seed"], "expected KEY=VALUE"),
        (["data", "prepare", "sbm", "--out", "{tmp}"], "already exists"),
        (["data", "info", "{tmp}"], "is not a gnnpar graph folder"),
    ],
)
def test_cli_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str], message: str
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert _run_cli(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in captured.err


def test_parse_options() -> None:
    defaults = {"n": 1, "x": 0.5, "flag": False, "mode": "a"}
    assert parse_options(["n=3", "x=2", "flag=yes", "mode=7"], defaults) == {
        "n": 3,
        "x": 2.0,
        "flag": True,
        "mode": "7",
    }
    assert parse_options(["a=1", "b=1.5", "c=true", "d=text", "e-f=2"]) == {
        "a": 1,
        "b": 1.5,
        "c": True,
        "d": "text",
        "e_f": 2,
    }
    with pytest.raises(ValueError, match=r"option flag: expected true or false"):
        parse_options(["flag=maybe"], defaults)
    # a value whose own conversion error mentions "option" is still named by its key
    with pytest.raises(ValueError, match=r"^option n: expected int, got 'option'$"):
        parse_options(["n=option"], defaults)
