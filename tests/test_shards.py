"""Full-graph shards on disk: exact against memory, any runtime grid, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import gnnpar
from gnnpar.graph import Graph
from gnnpar.models.fullgraph import parallelize_fullgraph
from gnnpar.models.fullgraph.shards import DiskSource, ShardFormatError, prepare_shards
from gnnpar.sparse.csr import CSRBlock
from gnnpar.sparse.kernels import LocalSpMM
from gnnpar.sparse.source import MemorySource, make_permutations
from gnnpar.testing import run_distributed
from tests.fullgraph_utils import serial_model, small_graph


def _graph() -> Graph:
    a, x, y, train = small_graph(n=29, feat=7)
    src, dst = a.nonzero(as_tuple=True)
    return Graph.from_edges(
        src, dst, num_nodes=29, ndata={"feat": x.float(), "label": y, "train_mask": train}
    )


def _memory(graph: Graph, norm: str, seed: int, method: str) -> MemorySource:
    g = graph.gcn_norm() if norm == "gcn" else graph.row_normalize()
    return MemorySource(
        g.indptr,
        g.indices,
        g.edge_weight.float(),
        graph.feat,
        {k: v for k, v in graph.ndata.items() if k != "feat"},
        make_permutations(method, g.indptr, g.indices, seed, blocks=4),
    )


@pytest.mark.parametrize(
    "norm,method",
    [("gcn", "random"), ("mean", "balanced"), ("gcn", "balanced-local"), ("gcn", "none")],
)
def test_disk_blocks_equal_memory_blocks(tmp_path, norm, method):
    graph = _graph()
    path = prepare_shards(
        graph, tmp_path / "s", norm=norm, blocks=(3, 4), seed=5, permutation=method
    )
    disk, mem = DiskSource(path, verify=True), _memory(graph, norm, 5, method)
    # runtime blocks that do not line up with the 3 × 4 file blocks
    for rows in ((0, 29), (3, 17), (10, 11), (28, 29)):
        for cols in ((0, 29), (2, 9), (13, 29)):
            for parity in (0, 1):
                a, b = disk.adjacency(parity, rows, cols), mem.adjacency(parity, rows, cols)
                assert torch.equal(a.to_dense(), b.to_dense())
                assert torch.equal(
                    disk.root(parity, rows, cols).to_dense(),
                    mem.root(parity, rows, cols).to_dense(),
                )
            assert torch.equal(
                disk.features(rows, cols[:1] + (5,)), mem.features(rows, (cols[0], 5))
            )
        for order in (0, 1):
            assert torch.equal(disk.node_ids(order, rows), mem.node_ids(order, rows))
            for name in ("label", "train_mask"):
                assert torch.equal(
                    disk.node_data(name, order, rows), mem.node_data(name, order, rows)
                )


def _train_from_disk(path: str, shape: dict) -> float:
    grid = gnnpar.init(**shape)
    source = DiskSource(path)
    model = serial_model("gcn", [7, 5, 3]).float()
    par = parallelize_fullgraph(model, grid, source)
    out = par(par.input_features())
    return float(par.loss(out).item())


def test_any_runtime_grid_reads_its_blocks(tmp_path):
    graph = _graph()
    path = str(prepare_shards(graph, tmp_path / "s", blocks=(2, 2), seed=1))
    ref = serial_model("gcn", [7, 5, 3]).float()
    g = graph.gcn_norm()
    adj = LocalSpMM(CSRBlock(g.indptr, g.indices, g.edge_weight.float(), (29, 29)))
    want = F.cross_entropy(ref(adj, graph.feat)[graph.train_mask], graph.label[graph.train_mask])
    for shape in ({"x": 2, "y": 2}, {"x": 1, "y": 1, "z": 4}, {"x": 4}):
        losses = run_distributed(_train_from_disk, 4, path, shape)
        assert all(abs(v - want.item()) < 1e-5 for v in losses), (shape, losses, want)


def test_bad_shard_folders(tmp_path):
    graph = _graph()
    path = prepare_shards(graph, tmp_path / "s", blocks=(2, 2), seed=1)
    with pytest.raises(FileExistsError, match="already exists"):
        prepare_shards(graph, path)
    with pytest.raises(ShardFormatError, match="no manifest.json"):
        DiskSource(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    # truncated file: caught when the file is first mapped, at every level but "none"
    f = path / "adj0" / "r0_c0.values.npy"
    data = f.read_bytes()
    f.write_bytes(data[:-4])
    with pytest.raises(ShardFormatError, match=r"r0_c0.values.npy: \d+ bytes, the manifest"):
        DiskSource(path, verify="size").adjacency(0, (0, 29), (0, 29))
    # same size, changed content: caught by the checksum (the default level)
    f.write_bytes(data[:-4] + b"\x00\x00\x80\x7f")
    DiskSource(path, verify="size").adjacency(0, (0, 29), (0, 29))
    with pytest.raises(ShardFormatError, match="r0_c0.values.npy: checksum differs"):
        DiskSource(path).adjacency(0, (0, 29), (0, 29))
    f.write_bytes(data)
    # missing file
    (path / "feat.npy").rename(path / "feat.bak")
    with pytest.raises(ShardFormatError, match="feat.npy: missing"):
        DiskSource(path).features((0, 29), (0, 7))
    (path / "feat.bak").rename(path / "feat.npy")
    # version, edited meta
    for key, value, message in (
        ("version", 99, "version 99"),
        ("schema", "gnnpar.graph", "schema 'gnnpar.graph'"),
    ):
        (path / "manifest.json").write_text(json.dumps({**manifest, key: value}))
        with pytest.raises(ShardFormatError, match=message):
            DiskSource(path)
    edited = {**manifest, "meta": {**manifest["meta"], "num_nodes": 30}}
    (path / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(ShardFormatError, match="edited after it was written"):
        DiskSource(path)
    # a failed write leaves nothing behind
    bad = Graph.from_edges([0, 1], [1, 0], num_nodes=2)
    with pytest.raises(ValueError, match="no node features"):
        prepare_shards(bad, tmp_path / "t")
    assert not (tmp_path / "t").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".t.")]
