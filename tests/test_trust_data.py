"""Issue 17, graph data and partition folders: nothing on disk is trusted. Each test is one
case of the issue: a stale or foreign partition, a changed file or meta value, bad labels, no
training nodes, a random partition correlated with the split, an older folder."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import partitioners
from gnnpar.cli import main
from gnnpar.data import load_graph, save_graph, sbm
from gnnpar.graph import Graph
from gnnpar.testing import run_distributed
from partitioners.cli import main as partition_main

SMALL = "feat_dim=8,seed=3"
TRAIN = ["--epochs", "1", "--fanouts", "3,3", "--batch-size", "16", "--hidden", "8", "--quiet"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _partition(tmp_path: Path, num_nodes: int, parts: int = 2, method: str = "metis") -> Path:
    """``gnnpar-partition sbm --dataset-options num_nodes=N`` into ``tmp_path/parts-N``."""
    out = tmp_path / f"parts-{num_nodes}"
    argv = ["sbm", "--dataset-options", f"num_nodes={num_nodes},feat_dim=8,seed=3"]
    argv += ["--parts", str(parts), "--method", method, "--out", str(out), "--no-progress"]
    assert partition_main(argv) == 0
    return out


def _train(capsys, *argv: str) -> tuple[int, str]:
    code = main(["train", "sage", *argv, *TRAIN])
    return code, capsys.readouterr().err.strip()


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _meta_file(folder: Path) -> tuple[Path, dict, dict]:
    """The file holding a folder's metadata (the manifest, or an older meta.json), its
    document and the meta table inside it."""
    manifest = folder / "manifest.json"
    path = manifest if manifest.is_file() else folder / "meta.json"
    doc = json.loads(path.read_text())
    return path, doc, doc["meta"] if path == manifest else doc


# ---------------------------------------------------------------------- provenance


def test_partition_of_another_graph_is_refused_by_the_trainer(tmp_path, capsys):
    parts = _partition(tmp_path, 300)
    code, err = _train(
        capsys, "--dataset", "sbm", "--dataset-options", f"num_nodes=400,{SMALL}",
        "--partitions", str(parts), "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert code == 2
    line = _one_line(err)
    recorded = partitioners.load_meta(parts)["source"]["fingerprint"]
    given = sbm(num_nodes=400, feat_dim=8, seed=3).fingerprint()
    assert recorded in line and given in line and recorded != given
    assert "300 nodes" in line and "400 nodes" in line and "partition it again" in line
    # the dataset it was cut from passes the check the trainer runs (training itself is
    # covered by tests/test_minibatch.py)
    from gnnpar.models.minibatch.task import MiniBatchConfig, check_partitions
    from gnnpar.train.config import from_mapping

    same = {"dataset": "sbm", "dataset_options": f"num_nodes=300,{SMALL}"}
    cfg = from_mapping(MiniBatchConfig, same | {"partitions": str(parts), "fanouts": "3,3"})
    assert check_partitions(cfg)["num_parts"] == 2


def test_check_source_is_a_plain_function(tmp_path):
    from gnnpar.data.catalogue import graph_record

    parts = _partition(tmp_path, 300)
    graph = sbm(num_nodes=300, feat_dim=8, seed=3)
    assert partitioners.format.check_source(parts, graph)["num_parts"] == 2
    folder = save_graph(graph, tmp_path / "g")
    assert graph_record(str(folder))["fingerprint"] == graph.fingerprint()  # from the manifest
    partitioners.format.check_source(parts, graph_record(str(folder)))
    graph.ndata["feat"][0, 0] += 1  # the same size, another content
    with pytest.raises(partitioners.format.PartitionSourceError, match="was cut from graph"):
        partitioners.format.check_source(parts, graph)


def _dist_task(cfg_values: dict) -> str:
    """Rank body: build the sage task; return the error it raised, or "ok"."""
    from gnnpar.models.minibatch.task import MiniBatchConfig
    from gnnpar.train.config import from_mapping
    from gnnpar.train.spec import build_task

    try:
        build_task("sage", from_mapping(MiniBatchConfig, cfg_values))
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return "ok"


def test_missing_dataset_with_partitions_fails_on_every_rank(tmp_path):
    parts = _partition(tmp_path, 300)
    values = {"dataset": str(tmp_path / "no" / "such" / "folder"), "partitions": str(parts)}
    values |= {"out": str(tmp_path / "run"), "fanouts": "3,3", "quiet": True}
    out = run_distributed(_dist_task, 2, values, timeout=120)
    assert "no such folder" in out[0] and "UserError" in out[0], out
    assert out[1] != "ok" and "rank 0" in out[1], out
    # and the check a launcher can run before starting ranks says the same
    from gnnpar.models.minibatch.task import MiniBatchConfig, check_partitions
    from gnnpar.train.config import from_mapping

    with pytest.raises(ValueError, match="no such folder"):
        check_partitions(from_mapping(MiniBatchConfig, values))


# ---------------------------------------------------------------------- changed files


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x55
    path.write_bytes(bytes(data))


def test_same_size_edit_of_a_graph_block_is_refused_at_load(tmp_path, capsys):
    folder = save_graph(sbm(num_nodes=300, feat_dim=8, seed=3), tmp_path / "g")
    _flip_last_byte(folder / "ndata" / "feat.npy")
    code, err = _train(capsys, "--dataset", str(folder), "--out", str(tmp_path / "run"))
    assert code == 2
    assert "feat.npy" in _one_line(err) and "checksum" in err


def test_same_size_edit_of_a_part_block_is_refused_at_open(tmp_path):
    from gnnpar.sampling import LocalPart

    parts = _partition(tmp_path, 300)
    _flip_last_byte(parts / "part-1" / "ndata" / "feat.npy")
    LocalPart.load(parts, 0)  # a rank verifies only the files it maps
    with pytest.raises(ValueError, match=r"part-1/ndata/feat\.npy.*checksum") as err:
        LocalPart.load(parts, 1)
    assert "\n" not in str(err.value)
    LocalPart.load(parts, 1, verify="size")  # the size-only level for very large folders


def test_edited_num_nodes_in_partition_meta_is_refused(tmp_path):
    parts = _partition(tmp_path, 300)
    path, doc, meta = _meta_file(parts)
    meta["num_nodes"] = 301
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="manifest.json") as err:
        partitioners.load_part(parts, 0)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------- labels and splits


def test_label_outside_the_classes_names_node_and_value(tmp_path):
    g = sbm(num_nodes=300, feat_dim=8, seed=3)
    assert g.num_classes == 4
    g.ndata["label"][7] = 99
    with pytest.raises(ValueError, match=r"\[7\] = 99 .*4-class") as err:
        g.validate()
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="= 99"):
        save_graph(g, tmp_path / "g")
    assert not (tmp_path / "g").exists()


def test_fractional_labels_are_refused():
    src, dst = [0, 1, 2], [1, 2, 0]
    with pytest.raises(ValueError, match=r"fractional class ids \(node 1: 0.5\)"):
        Graph.from_edges(src, dst, 3, ndata={"label": torch.tensor([0.0, 0.5, 1.0])})
    with pytest.raises(ValueError, match="integer dtype"):
        Graph.from_edges(src, dst, 3, ndata={"label": torch.tensor([0.0, 1.0, 1.0])})


def test_graph_without_training_nodes_is_refused_by_the_trainer(tmp_path, capsys):
    g = sbm(num_nodes=300, feat_dim=8, seed=3)
    g.ndata["train_mask"] = torch.zeros(300, dtype=torch.bool)
    folder = save_graph(g, tmp_path / "g")
    code, err = _train(capsys, "--dataset", str(folder), "--out", str(tmp_path / "run"))
    assert code == 2 and "no training nodes" in _one_line(err)


@pytest.mark.parametrize("key", ["val_mask", "test_mask"])
def test_an_empty_split_that_selection_or_the_report_needs_is_refused(tmp_path, capsys, key):
    """An empty validation split once trained, reported val_acc=0.0000 and picked a "best"
    model on no nodes. Every path into training refuses it before any rank starts: gcn,
    sage, and sage on 2 ranks from a partition (where the folder is checked unloaded)."""
    g = sbm(num_nodes=300, feat_dim=8, seed=3)
    g.ndata[key] = torch.zeros(300, dtype=torch.bool)
    folder = save_graph(g, tmp_path / "g")
    parts = tmp_path / "parts"
    argv = [str(folder), "--parts", "2", "--out", str(parts), "--no-progress"]
    assert partition_main(argv) == 0
    words = f"empty {key.split('_')[0]} split ({key} is all False)"
    base = ["--dataset", str(folder), "--out", str(tmp_path / "run")]
    code, err = _train(capsys, *base)
    assert code == 2 and words in _one_line(err)
    code, err = _train(capsys, *base, "--partitions", str(parts), "--nprocs", "2")
    assert code == 2 and words in _one_line(err)
    assert main(["train", "gcn", *base, "--epochs", "1", "--quiet"]) == 2
    assert words in _one_line(capsys.readouterr().err)


def _tamper(folder: Path, array: str, change) -> None:
    """Change one array of a graph folder and record its new size and checksum in the
    manifest, as a hostile user who knows the format would: only the content checks can
    tell."""
    from gnnpar.verified import file_entry

    manifest = folder / "manifest.json"
    doc = json.loads(manifest.read_text())
    name = doc["meta"]["arrays"][array]["file"]
    values = np.load(folder / name)
    change(values)
    np.save(folder / name, values)
    doc["files"][name] = file_entry(folder / name)
    manifest.write_text(json.dumps(doc))


DAMAGE = {
    "negative id": ("indices", lambda a: a.__setitem__(3, -1), "is not a node id in [0, 300)"),
    "id out of range": ("indices", lambda a: a.__setitem__(5, 10**6), "is not a node id"),
    "NaN feature": ("ndata/feat", lambda a: a.__setitem__((7, 1), np.nan), "non-finite"),
    "label past the classes": ("ndata/label", lambda a: a.__setitem__(9, 99), "[9] = 99"),
    # Fennel's own message for it named neither the folder nor the array
    "indptr not monotone": ("indptr", lambda a: a.__setitem__(10, a[9] - 1), "indptr must run"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_every_path_into_training_checks_the_graph(tmp_path, capsys, damage):
    """The streamed partitioners (--memory-limit: ldg, fennel) wrote partitions of such
    graphs (an out-of-range id was an IndexError) and `train sage --partitions` trained on
    them; each is one line naming the folder now, as loading the graph always was."""
    folder = save_graph(sbm(num_nodes=300, feat_dim=8, seed=3), tmp_path / "g")
    parts = tmp_path / "parts"
    assert partition_main([str(folder), "--parts", "2", "--out", str(parts), "--no-progress"]) == 0
    array, change, words = DAMAGE[damage]
    _tamper(folder, array, change)
    for method in ("ldg", "fennel"):
        argv = [str(folder), "--parts", "2", "--method", method, "--memory-limit", "64MB"]
        capsys.readouterr()
        assert partition_main([*argv, "--out", str(tmp_path / method), "--no-progress"]) == 2
        line = _one_line(capsys.readouterr().err)
        assert str(folder) in line and words in line, line
    code, err = _train(
        capsys, "--dataset", str(folder), "--partitions", str(parts), "--nprocs", "2",
        "--out", str(tmp_path / "run"),
    )  # fmt: skip
    assert code == 2 and str(folder) in _one_line(err) and words in err, err


def test_overlapping_split_masks_are_refused():
    g = sbm(num_nodes=300, feat_dim=8, seed=3)
    first = int(torch.nonzero(g.train_mask)[0, 0])
    g.ndata["test_mask"][first] = True
    with pytest.raises(ValueError, match=rf"node {first} is in both train_mask and test_mask"):
        g.validate()


# ---------------------------------------------------------------------- balance of seeds


@pytest.mark.parametrize("dataset", ["sbm", "rmat"])
def test_random_partitioner_spreads_training_nodes(dataset):
    from gnnpar.data import rmat

    g = sbm(num_nodes=2000, feat_dim=4) if dataset == "sbm" else rmat(scale=10, feat_dim=4)
    owner = partitioners.partition(g, 4, method="random", seed=0).owner
    counts = np.bincount(owner[g.train_mask.numpy()], minlength=4)
    # seed 0 used to put every training node in the first part(s), leaving others empty
    assert counts.min() > 0 and counts.max() < 2 * counts.mean(), counts


def test_parts_without_training_seeds_warn(tmp_path, capsys):
    g = sbm(num_nodes=300, feat_dim=8, seed=3)
    owner = np.where(g.train_mask.numpy(), 0, 1 + np.arange(300) % 2)  # parts 1, 2: no seeds
    with pytest.warns(partitioners.format.PartitionBalanceWarning, match="2 of 3 parts"):
        partitioners.write(g, owner, tmp_path / "p")
    assert partition_main(["inspect", str(tmp_path / "p")]) == 0
    assert "2 of 3 parts hold no training seeds" in _one_line(capsys.readouterr().err)


# ---------------------------------------------------------------------- older folders


def _write_v1_graph(graph: Graph, folder: Path) -> None:
    """A graph folder as the gnnpar before manifests wrote it (meta.json, sha256)."""
    folder.mkdir()
    (folder / "ndata").mkdir()
    arrays = [("indptr", graph.indptr), ("indices", graph.indices)]
    arrays += [(f"ndata/{k}", v) for k, v in graph.ndata.items()]
    records = []
    for name, tensor in arrays:
        path = folder / f"{name}.npy"
        np.save(path, tensor.numpy())
        records.append({
            "name": name, "file": f"{name}.npy", "dtype": tensor.numpy().dtype.name,
            "shape": list(tensor.shape), "bytes": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        })  # fmt: skip
    meta = {"format": "gnnpar.graph", "schema_version": 1, "name": graph.name}
    meta |= {"num_nodes": graph.num_nodes, "num_edges": graph.num_edges, "weighted": False}
    (folder / "meta.json").write_text(json.dumps(meta | {"source": None, "arrays": records}))


def test_folders_of_an_older_gnnpar_are_refused(tmp_path, capsys):
    old = tmp_path / "old"
    _write_v1_graph(sbm(num_nodes=100, feat_dim=4), old)
    with pytest.raises(ValueError, match="written by an older gnnpar.*prepare it again"):
        load_graph(old)
    assert main(["data", "info", str(old)]) == 2
    assert "prepare it again" in _one_line(capsys.readouterr().err)
    parts = _partition(tmp_path, 300)
    (parts / "manifest.json").rename(parts / "meta.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="written by an older gnnpar.*partition it again"):
            partitioners.load_part(parts, 0)
