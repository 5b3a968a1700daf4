"""The partition folder: exact round trip, halo semantics, and clear errors on bad folders."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import partitioners
from partitioners import PartitionFormatError, load_meta, load_node_map, load_part, partition
from partitioners.format import SCHEMA_VERSION, load_manifest


@pytest.fixture(scope="module")
def graph():
    """A directed graph (so in- and out-neighbours differ) with weights and node data."""
    from gnnpar.graph import Graph

    rng = np.random.default_rng(0)
    n, m = 300, 2400
    src, dst = rng.integers(0, n, m), rng.integers(0, n, m)
    train = rng.random(n) < 0.3
    ndata = {
        "feat": torch.from_numpy(rng.standard_normal((n, 5)).astype(np.float32)),
        "label": torch.from_numpy(rng.integers(0, 3, n)),
        "train_mask": torch.from_numpy(train),
        "val_mask": torch.from_numpy((rng.random(n) < 0.2) & ~train),  # the split is disjoint
        "emb": torch.from_numpy(rng.standard_normal((n, 2, 3))).to(torch.bfloat16),
    }
    weight = torch.from_numpy(rng.random(m).astype(np.float32) + 0.5)
    return Graph.from_edges(src, dst, n, edge_weight=weight, ndata=ndata, name="toy")


@pytest.fixture(scope="module")
def written(graph, tmp_path_factory):
    part = partition(graph, 4, method="metis", seed=1)
    out = tmp_path_factory.mktemp("parts") / "toy-4"
    partitioners.write(graph, part, out, halo=1)
    return out, part


def _in_edges(graph, v):
    ip, ix = graph.indptr.numpy(), graph.indices.numpy()
    return ix[ip[v] : ip[v + 1]]


def test_round_trip_is_exact(graph, written):
    out, part = written
    meta = load_meta(out)
    assert load_manifest(out).version == SCHEMA_VERSION and meta["num_parts"] == 4
    assert meta["source"]["fingerprint"] == graph.fingerprint()
    assert meta["num_nodes"] == graph.num_nodes and meta["num_edges"] == graph.num_edges
    assert meta["method"] == "metis" and meta["seed"] == 1 and meta["halo_hops"] == 1
    assert meta["graph_name"] == "toy" and meta["weighted"] is True
    assert meta["ndata"]["feat"] == {"dtype": "float32", "shape": [300, 5]}
    assert meta["ndata"]["emb"]["stored_as"] == "uint16"
    node_map = load_node_map(out)
    np.testing.assert_array_equal(np.sort(node_map), np.arange(graph.num_nodes))
    seen = np.zeros(graph.num_nodes, dtype=int)
    for k in range(4):
        p = load_part(out, k)
        start, stop = p.node_range
        assert [start, stop] == meta["node_ranges"][k]
        owned_orig = p.orig_ids[: p.num_owned]
        np.testing.assert_array_equal(p.local_to_global[: p.num_owned], np.arange(start, stop))
        np.testing.assert_array_equal(node_map[p.orig_ids], p.local_to_global)
        # The owned nodes are exactly the partition's part k, in original id order.
        np.testing.assert_array_equal(owned_orig, part.nodes(k))
        seen[owned_orig] += 1
        # Node data lands on its owner.
        for key in ("feat", "label", "train_mask", "val_mask"):
            np.testing.assert_array_equal(p.ndata[key], graph.ndata[key].numpy()[owned_orig])
        emb = torch.from_numpy(np.array(p.ndata["emb"]).view(np.int16)).view(torch.bfloat16)
        assert torch.equal(emb, graph.ndata["emb"][torch.from_numpy(np.array(owned_orig))])
        # Edge weights and ids follow their edges.
        np.testing.assert_array_equal(p.edge_weight, graph.edge_weight.numpy()[p.edge_ids])
    np.testing.assert_array_equal(seen, 1)


def test_halo_one_holds_every_in_edge_with_global_ids(graph, written):
    out, _ = written
    total_local_edges = 0
    for k in range(4):
        p = load_part(out, k)
        ip, ix = np.asarray(p.indptr), np.asarray(p.indices)
        assert np.all(np.diff(ip[p.num_owned :]) == 0)  # halo rows are empty
        halo = p.halo_global_ids
        assert np.all(np.diff(halo) > 0)
        start, stop = p.node_range
        assert np.all((halo < start) | (halo >= stop))
        for i in range(p.num_owned):
            v = p.orig_ids[i]
            got = np.sort(p.orig_ids[ix[ip[i] : ip[i + 1]]])
            np.testing.assert_array_equal(got, np.sort(_in_edges(graph, v)))
        np.testing.assert_array_equal(p.global_to_local(p.local_to_global), np.arange(p.num_local))
        total_local_edges += ix.shape[0]
    assert total_local_edges == graph.num_edges  # every edge stored once, at its destination


def test_halo_zero_keeps_only_internal_edges(graph, tmp_path):
    part = partition(graph, 3, method="random", seed=0)
    out = partitioners.write(graph, part, tmp_path / "h0", halo=0, ndata=["label"])
    meta = load_meta(out)
    assert meta["halo_hops"] == 0 and list(meta["ndata"]) == ["label"]
    for k in range(3):
        p = load_part(out, k)
        assert p.num_halo == 0 and p.num_local == p.num_owned
        ip, ix = np.asarray(p.indptr), np.asarray(p.indices)
        for i in range(p.num_owned):
            inner = [u for u in _in_edges(graph, p.orig_ids[i]) if part.owner[u] == k]
            np.testing.assert_array_equal(
                np.sort(p.orig_ids[ix[ip[i] : ip[i + 1]]]), np.sort(inner)
            )


def test_arrays_are_memory_mapped_and_plain_owner_arrays_work(graph, written, tmp_path):
    out, part = written
    p = load_part(out, 2, mmap=True)
    assert isinstance(p.indices, np.memmap) and isinstance(p.ndata["feat"], np.memmap)
    assert not isinstance(load_part(out, 2, mmap=False).indices, np.memmap)
    again = partitioners.write(graph, part.owner, tmp_path / "plain")
    assert load_meta(again)["method"] == "custom"


def test_loading_part_k_reads_only_part_k(written, tmp_path):
    out, _ = written
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    # Damage every other part and the global node map: part 0 still loads and verifies.
    for k in (1, 2, 3):
        for f in (copy / f"part-{k}").rglob("*.npy"):
            f.write_bytes(b"garbage")
    (copy / "node_map.npy").write_bytes(b"garbage")
    p = load_part(copy, 0)
    assert p.part_id == 0 and p.num_owned > 0
    with pytest.raises(PartitionFormatError, match="part-1"):
        load_part(copy, 1)


def _copy(out: Path, tmp_path: Path) -> Path:
    import shutil

    dst = tmp_path / "damaged"
    shutil.copytree(out, dst)
    return dst


def test_missing_truncated_and_changed_files(written, tmp_path):
    out, _ = written
    bad = _copy(out, tmp_path)
    (bad / "part-1" / "indices.npy").unlink()
    with pytest.raises(PartitionFormatError, match=r"part-1/indices.npy: missing"):
        load_part(bad, 1)

    f = bad / "part-2" / "ndata" / "feat.npy"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 7])
    with pytest.raises(PartitionFormatError, match="truncated"):
        load_part(bad, 2)

    f = bad / "part-3" / "indptr.npy"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    f.write_bytes(bytes(data))
    with pytest.raises(PartitionFormatError, match="checksum"):
        load_part(bad, 3)
    load_part(bad, 3, verify=False)  # sizes still match: loads without the checksum

    (bad / "manifest.json").unlink()
    with pytest.raises(PartitionFormatError, match="no manifest.json"):
        load_part(bad, 0)
    with pytest.raises(PartitionFormatError, match="no such folder"):
        load_part(tmp_path / "nowhere", 0)


def test_schema_version_and_part_count_are_checked(written, tmp_path):
    out, _ = written
    bad = _copy(out, tmp_path)
    doc = json.loads((bad / "manifest.json").read_text())
    doc["version"] = SCHEMA_VERSION + 1
    (bad / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(PartitionFormatError, match="gnnpar.partition version 3"):
        load_part(bad, 0)
    (bad / "manifest.json").write_text("{not json")
    with pytest.raises(PartitionFormatError, match="unreadable manifest"):
        load_meta(bad)
    with pytest.raises(PartitionFormatError, match="parts 0..3"):
        load_part(out, 4)
    with pytest.raises(PartitionFormatError, match="holds 4 parts, but 8 were expected"):
        load_part(out, 0, expect_parts=8)
    fewer = tmp_path / "fewer"
    import shutil

    shutil.copytree(out, fewer)
    shutil.rmtree(fewer / "part-3")
    with pytest.raises(PartitionFormatError, match="3 part folders but its manifest says 4"):
        load_part(fewer, 0)


def test_existing_output_and_failed_writes_leave_nothing(graph, written, tmp_path, monkeypatch):
    out, part = written
    before = sorted(os.listdir(out))
    with pytest.raises(FileExistsError, match="already exists"):
        partitioners.write(graph, part, out)
    assert sorted(os.listdir(out)) == before

    target = tmp_path / "fails"
    calls = {"n": 0}
    import partitioners.writer as writer_module

    real_save = writer_module.save_npy

    def flaky_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 12:
            raise OSError("disk full")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(writer_module, "save_npy", flaky_save)
    with pytest.raises(OSError, match="disk full"):
        partitioners.write(graph, part, target)
    monkeypatch.undo()
    assert not target.exists()
    assert os.listdir(tmp_path) == []  # no temporary folder left either

    with pytest.raises(ValueError, match="halo must be 0 or 1"):
        partitioners.write(graph, part, target, halo=2)
    with pytest.raises(ValueError, match="covers 5 nodes"):
        partitioners.write(graph, np.arange(5) % 2, target)
    with pytest.raises(ValueError, match="no node data 'colour'"):
        partitioners.write(graph, part, target, ndata=["colour"])
    assert os.listdir(tmp_path) == []
