"""Preparation under a memory budget: shards, partition folders and LDG/Fennel assignments
made by streaming the edges in chunks (from a Graph or a graph folder on disk) are the same,
byte for byte, as the in-memory ones, for chunk sizes down to one edge (smaller than every
row, so long rows are split and sorted externally)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gnnpar.data import save_graph
from gnnpar.data.sbm import sbm
from gnnpar.fmt import parse_bytes
from gnnpar.graph import Graph
from gnnpar.models.fullgraph.shards import prepare_shards
from gnnpar.verified import NpyWriter, save_npy
from partitioners import partition
from partitioners.cli import main as partition_main
from partitioners.writer import write

CHUNKS = (2, 5, 1 << 20)  # 2 and 5 are smaller than most rows


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _same(a: Path, b: Path, skip: tuple[str, ...] = ()) -> None:
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    differ = [name for name in fa if name not in skip and fa[name] != fb[name]]
    assert differ == [], f"{b} differs from {a} in {differ}"


@pytest.fixture(scope="module")
def graphs(tmp_path_factory) -> dict[str, tuple[Graph, Path]]:
    """An SBM graph and a weighted multigraph with duplicate edges, self loops and one
    hub row, each also saved as a graph folder."""
    root = tmp_path_factory.mktemp("graphs")
    plain = sbm(num_nodes=60, seed=3)
    rng = np.random.default_rng(0)
    n, m = 60, 400
    src = np.concatenate([rng.integers(0, n, m), np.arange(n), [5] * 4])
    dst = np.concatenate([rng.integers(0, n, m), np.full(n, 7), [5] * 4])  # node 7: a hub
    multi = Graph.from_edges(
        torch.from_numpy(src),
        torch.from_numpy(dst),
        n,
        edge_weight=torch.from_numpy(rng.random(src.shape[0]).astype(np.float32)),
        ndata={
            "feat": torch.from_numpy(rng.standard_normal((n, 5)).astype(np.float32)),
            "label": torch.from_numpy(rng.integers(0, 3, n)),
            "train_mask": torch.from_numpy(rng.random(n) < 0.5),
        },
        name="multi",
    )
    out = {}
    for name, g in (("plain", plain), ("multi", multi)):
        out[name] = (g, save_graph(g, root / name))
    return out


@pytest.mark.parametrize("norm", ["gcn", "mean", "raw"])
def test_streamed_shards_are_byte_identical(graphs, tmp_path, norm):
    for name, (graph, folder) in graphs.items():
        if norm == "raw" and name == "plain":  # the weights, self loops and hub row suffice
            continue
        ref = prepare_shards(graph, tmp_path / f"{name}-ref", norm=norm, blocks=(2, 3), seed=1)
        for chunk in CHUNKS if norm != "raw" else (5,):  # 5: the hub row streams long
            for source in (graph, folder):
                out = prepare_shards(
                    source,
                    tmp_path / "s",
                    norm=norm,
                    blocks=(2, 3),
                    seed=1,
                    chunk_edges=chunk,
                    overwrite=True,
                )
                _same(ref, out)


def test_shards_under_a_memory_limit(graphs, tmp_path):
    graph, folder = graphs["plain"]
    ref = prepare_shards(graph, tmp_path / "ref", blocks=(2, 2), permutation="none")
    _same(
        ref,
        prepare_shards(
            folder,
            tmp_path / "a",
            blocks=(2, 2),
            permutation="none",
            memory_limit=parse_bytes("2MB"),
        ),
    )
    with pytest.raises(ValueError, match="memory limit 1,000 bytes is too small"):
        prepare_shards(folder, tmp_path / "b", memory_limit=1000)
    with pytest.raises(ValueError, match="'balanced' needs the whole graph"):
        prepare_shards(folder, tmp_path / "c", permutation="balanced")


@pytest.mark.parametrize("halo", [0, 1])
def test_streamed_partition_folders_are_byte_identical(graphs, tmp_path, halo):
    for name, (graph, folder) in graphs.items():
        part = partition(graph, 3, method="random", seed=2)
        ref = write(graph, part, tmp_path / f"{name}-ref", halo=halo)
        for chunk in CHUNKS:
            for source in (graph, folder):
                out = write(
                    source, part, tmp_path / "p", halo=halo, chunk_edges=chunk, overwrite=True
                )
                _same(ref, out)


@pytest.mark.parametrize("method", ["ldg", "fennel"])
def test_streaming_partitioners_read_chunks_from_disk(graphs, method):
    for graph, folder in graphs.values():
        for order in ("natural", "random"):
            ref = partition(graph, 3, method=method, order=order, passes=2, seed=4).owner
            for chunk in CHUNKS:
                for source in (graph, str(folder)):
                    got = partition(
                        source, 3, method=method, order=order, passes=2, seed=4, chunk_edges=chunk
                    )
                    np.testing.assert_array_equal(got.owner, ref)


def test_partition_cli_memory_limit(graphs, tmp_path, capsys):
    _, folder = graphs["plain"]
    args = [str(folder), "--parts", "3", "--method", "fennel", "--no-progress"]
    assert partition_main([*args, "--out", str(tmp_path / "a"), "--memory-limit", "1MB"]) == 0
    assert partition_main([*args, "--out", str(tmp_path / "b")]) == 0
    _same(tmp_path / "b", tmp_path / "a", skip=("manifest.json",))
    meta = [json.loads((tmp_path / x / "manifest.json").read_text())["meta"] for x in "ab"]
    for m in meta:
        m["partition_info"].pop("time_s")
    assert meta[0] == meta[1]
    capsys.readouterr()
    assert partition_main([*args, "--out", str(tmp_path / "c"), "--memory-limit", "1kB"]) == 2
    assert (
        partition_main(
            ["sbm", "--parts", "2", "--out", str(tmp_path / "d"), "--memory-limit", "1GB"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert "too small" in err[0] and "not one" in err[1]


def test_npy_writer_matches_save_npy(tmp_path):
    rng = np.random.default_rng(1)
    for array in (np.arange(1000), np.zeros(0, np.float32), rng.random((50, 3)), np.ones(7, bool)):
        whole = save_npy(tmp_path / "a.npy", array)
        writer = NpyWriter(tmp_path / "b.npy", array.dtype, array.shape[1:])
        for lo in range(0, max(len(array), 1), 13):
            writer.append(array[lo : lo + 13])
        assert writer.close() == whole
        assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()


def test_parse_bytes():
    assert parse_bytes("4GB") == parse_bytes("4G") == 4 * 10**9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1e6") == parse_bytes(1_000_000) == 10**6
    for bad in ("x", "0", "-3", "4XB"):
        with pytest.raises(ValueError, match="byte count"):
            parse_bytes(bad)


def test_rmat_to_disk(tmp_path, capsys):
    from gnnpar.cli import main
    from gnnpar.data.rmat import rmat_to_disk
    from gnnpar.data.storage import load_graph, read_meta

    one = rmat_to_disk(tmp_path / "one", scale=8, feat_dim=4, buckets=1)
    three = rmat_to_disk(tmp_path / "three", scale=8, feat_dim=4, buckets=3)
    _same(one, three)  # the external sort's row ranges do not change the graph
    graph = load_graph(three)  # validates: ids in range, masks disjoint, labels in range
    assert graph.fingerprint() == read_meta(three)["fingerprint"]
    rows, cols = graph.rows(), graph.indices
    assert not bool((rows == cols).any())  # no self loops
    keys = (rows * graph.num_nodes + cols).tolist()
    assert keys == sorted(set(keys))  # sorted rows, no duplicates
    assert sorted(keys) == sorted((cols * graph.num_nodes + rows).tolist())  # symmetric
    args = ["data", "prepare", "rmat", "--dataset-options", "scale=8,feat_dim=4"]
    assert main([*args, "--out", str(tmp_path / "cli"), "--memory-limit", "200MB"]) == 0
    _same(one, tmp_path / "cli", skip=("manifest.json",))
    assert read_meta(tmp_path / "cli")["source"]["generator"] == "rmat_to_disk"
    assert main([*args, "--out", str(tmp_path / "x"), "--memory-limit", "1MB"]) == 2
    assert "too small" in capsys.readouterr().err
