"""Partitioning methods: valid, deterministic, and as good as they should be."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import partitioners
from partitioners import METHODS, Partition, partition
from partitioners.metrics import balance, edge_cut
from partitioners.simple import hash_owner, range_owner


def _sbm(n: int = 600, k: int = 4, p_in: float = 0.05, p_out: float = 0.002, seed: int = 0):
    """A symmetric planted-partition graph as a scipy CSR, with its planted classes."""
    rng = np.random.default_rng(seed)
    cls = np.repeat(np.arange(k), n // k)
    same = cls[:, None] == cls[None, :]
    probs = np.where(same, p_in, p_out)
    upper = np.triu(rng.random((n, n)) < probs, 1)
    adj = sp.csr_matrix((upper | upper.T).astype(np.float32))
    return adj, cls


@pytest.fixture(scope="module")
def sbm_graph():
    from gnnpar.data import sbm

    return sbm(num_nodes=1200, num_classes=4, avg_degree=12.0, p_ratio=20.0, seed=3)


@pytest.fixture(scope="module")
def rmat_graph():
    from gnnpar.data import rmat

    return rmat(scale=11, edge_factor=8, feat_dim=4, seed=1)


def _cut(graph, owner):
    return edge_cut(graph.indptr.numpy(), graph.indices.numpy(), owner)[1]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_every_method_gives_a_valid_deterministic_assignment(sbm_graph, method, k):
    a = partition(sbm_graph, k, method=method, seed=5)
    b = partition(sbm_graph, k, method=method, seed=5)
    assert isinstance(a, Partition)
    assert a.owner.shape == (sbm_graph.num_nodes,) and a.owner.dtype == np.int64
    assert a.owner.min() >= 0 and a.owner.max() < k
    assert np.all(a.sizes() > 0), a.sizes()
    assert a.sizes().sum() == sbm_graph.num_nodes
    np.testing.assert_array_equal(a.owner, b.owner)
    assert a.method == method and a.num_parts == k and a.seed == 5
    assert a.info["time_s"] >= 0


@pytest.mark.parametrize("method", METHODS)
def test_one_node_per_part_and_tiny_graphs(method):
    adj, _ = _sbm(n=40, k=4, seed=1)
    n = adj.shape[0]
    part = partition(adj, n, method=method, seed=0)
    np.testing.assert_array_equal(np.sort(part.owner), np.arange(n))
    # A graph without edges still splits into non-empty parts.
    empty = (np.zeros(11, dtype=np.int64), np.zeros(0, dtype=np.int64))
    assert np.all(partition(empty, 4, method=method).sizes() > 0)


@pytest.mark.parametrize("method", ["random", "hash", "fennel"])
def test_seed_changes_the_randomised_methods(sbm_graph, method):
    opts = {"order": "random"} if method == "fennel" else {}
    a = partition(sbm_graph, 4, method=method, seed=0, **opts).owner
    b = partition(sbm_graph, 4, method=method, seed=1, **opts).owner
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("bad", [0, -2, 1201, 2.5, True, "4"])
def test_bad_number_of_parts_is_a_clear_error(sbm_graph, bad):
    with pytest.raises(ValueError, match="num_parts|parts"):
        partition(sbm_graph, bad, method="random")


def test_bad_method_balance_and_options(sbm_graph):
    with pytest.raises(ValueError, match="unknown method 'spectral'"):
        partition(sbm_graph, 2, method="spectral")
    with pytest.raises(ValueError, match="unknown balance"):
        partition(sbm_graph, 2, balance=["nodes", "colour"])
    with pytest.raises(ValueError, match="'fennel' can balance only nodes"):
        partition(sbm_graph, 2, method="fennel", balance=["train"])
    with pytest.raises(ValueError, match="does not take"):
        partition(sbm_graph, 2, method="random", passes=2)
    with pytest.raises(ValueError, match="train_mask"):
        partition((np.array([0, 1, 2]), np.array([1, 0])), 2, balance="train")
    with pytest.raises(TypeError, match="expected a gnnpar Graph"):
        partition([1, 2, 3], 2)


def test_accepts_graph_scipy_tuple_and_int32(sbm_graph):
    ip, ix = sbm_graph.indptr.numpy(), sbm_graph.indices.numpy()
    ref = partition(sbm_graph, 4, method="metis", seed=2).owner
    as_tuple = partition((ip.astype(np.int32), ix.astype(np.int32)), 4, method="metis", seed=2)
    as_scipy = partition(sbm_graph.to_scipy(), 4, method="metis", seed=2)
    as_torch = partition((torch.from_numpy(ip), torch.from_numpy(ix)), 4, method="metis", seed=2)
    for other in (as_tuple, as_scipy, as_torch):
        np.testing.assert_array_equal(other.owner, ref)


def test_metis_cut_far_below_random(sbm_graph, rmat_graph):
    for graph, factor in ((sbm_graph, 0.3), (rmat_graph, 0.8)):
        random_cut = _cut(graph, partition(graph, 4, method="random").owner)
        metis = partition(graph, 4, method="metis")
        cut = _cut(graph, metis.owner)
        assert cut < factor * random_cut, (graph.name, cut, random_cut)
        assert balance(metis.sizes()) <= 1.031
        # METIS reports each undirected edge once; we count both stored directions.
        assert 2 * metis.info["edge_cut"] == int(cut * graph.num_edges + 0.5)


def test_metis_finds_planted_blocks():
    adj, cls = _sbm()
    part = partition(adj, 4, method="metis", seed=0)
    # Each part is (almost) one planted class.
    agree = sum(np.bincount(cls[part.owner == k]).max() for k in range(4))
    assert agree >= 0.97 * adj.shape[0]


def test_metis_multi_constraint_balances_training_nodes(sbm_graph):
    # Training nodes all in the first planted class: an edge-cut partition would give
    # them to one part, the train constraint spreads them.
    from gnnpar.graph import Graph

    label = sbm_graph.label.numpy()
    train = torch.from_numpy(label == 0)
    g = Graph(
        sbm_graph.indptr, sbm_graph.indices, ndata={"train_mask": train, "label": sbm_graph.label}
    )
    counts = lambda p: np.bincount(p.owner[train.numpy()], minlength=4)  # noqa: E731
    plain = partition(g, 4, method="metis", seed=0)
    balanced = partition(g, 4, method="metis", seed=0, balance=["nodes", "train"])
    assert balance(counts(plain)) > 2.0
    assert balance(counts(balanced)) < 1.15
    assert balance(balanced.sizes()) < 1.1
    assert balanced.info["constraints"] == ["train_nodes", "other_nodes"]


def test_metis_edge_constraint_balances_edges(rmat_graph):
    deg = np.diff(rmat_graph.indptr.numpy())
    plain = partition(rmat_graph, 4, method="metis", seed=0)
    edges = partition(rmat_graph, 4, method="metis", seed=0, balance=["nodes", "edges"])
    edge_bal = lambda p: balance(np.bincount(p.owner, weights=deg, minlength=4))  # noqa: E731
    assert edge_bal(edges) < 1.1 < edge_bal(plain)
    assert edges.info["constraints"] == ["nodes", "edges"]


def test_metis_vertex_and_edge_weights(sbm_graph):
    # A ring whose edges (2i, 2i+1) weigh 100 and the others 1: no heavy edge is cut.
    n = 200
    src = np.arange(n)
    dst = (src + 1) % n
    w = np.where(src % 2 == 0, 100.0, 1.0)
    rows, cols = np.concatenate([dst, src]), np.concatenate([src, dst])
    adj = sp.csr_matrix((np.concatenate([w, w]), (rows, cols)), shape=(n, n))
    part = partition(adj, 4, method="metis", edge_weight=True, seed=0)
    np.testing.assert_array_equal(part.owner[0::2], part.owner[1::2])
    assert np.all(part.sizes() > 40)
    # Vertex weights replace the node count: a quarter of the nodes weigh 5.
    weights = np.ones(sbm_graph.num_nodes, dtype=np.int64)
    weights[: sbm_graph.num_nodes // 4] = 5
    part = partition(sbm_graph, 2, method="metis", node_weight=weights, seed=0)
    assert balance(np.bincount(part.owner, weights=weights)) <= 1.031
    assert part.info["constraints"] == ["weight0"]
    with pytest.raises(ValueError, match="node_weight"):
        partition(adj, 2, method="metis", node_weight=np.ones(3, dtype=np.int64))
    with pytest.raises(ValueError, match="no edge weights"):
        partition((adj.indptr, adj.indices), 2, method="metis", edge_weight=True)
    with pytest.raises(ValueError, match="positive"):
        partition(adj, 2, method="metis", edge_weight=-np.ones(adj.nnz))


def test_streaming_cut_and_capacity(sbm_graph, rmat_graph):
    for graph in (sbm_graph, rmat_graph):
        random_cut = _cut(graph, partition(graph, 4, method="random").owner)
        fennel = partition(graph, 4, method="fennel")
        assert _cut(graph, fennel.owner) < 0.7 * random_cut
        assert fennel.sizes().max() <= fennel.info["capacity"]
        ldg = partition(graph, 4, method="ldg", slack=1.05)
        assert ldg.sizes().max() <= ldg.info["capacity"] == int(np.ceil(1.05 * graph.num_nodes / 4))
        assert _cut(graph, ldg.owner) < random_cut
    # Restreaming sees every neighbour and does not do worse on a clustered graph.
    one = _cut(sbm_graph, partition(sbm_graph, 4, method="fennel", order="random").owner)
    three = _cut(
        sbm_graph, partition(sbm_graph, 4, method="fennel", order="random", passes=3).owner
    )
    assert three <= one
    with pytest.raises(ValueError, match="passes"):
        partition(sbm_graph, 4, method="fennel", passes=0)
    with pytest.raises(ValueError, match="order"):
        partition(sbm_graph, 4, method="ldg", order="bfs")


def test_streaming_reads_a_memory_mapped_csr(tmp_path, sbm_graph):
    ip, ix = tmp_path / "indptr.npy", tmp_path / "indices.npy"
    np.save(ip, sbm_graph.indptr.numpy())
    np.save(ix, sbm_graph.indices.numpy())
    mapped = (np.load(ip, mmap_mode="r"), np.load(ix, mmap_mode="r"))
    got = partition(mapped, 4, method="fennel").owner
    np.testing.assert_array_equal(got, partition(sbm_graph, 4, method="fennel").owner)


def test_range_and_hash():
    ip = np.array([0, 10, 20, 21, 22, 23, 24, 25, 26, 36, 37])
    ix = np.zeros(37, dtype=np.int64)
    by_nodes = partition((ip, ix), 3, method="range")
    assert np.all(np.diff(by_nodes.owner) >= 0)
    np.testing.assert_array_equal(by_nodes.sizes(), [4, 3, 3])
    by_edges = range_owner(10, 3, ip, by_edges=True)
    assert np.all(np.diff(by_edges) >= 0) and np.all(np.bincount(by_edges) > 0)
    edges_per_part = np.bincount(by_edges, weights=np.diff(ip))
    assert edges_per_part.max() <= 20
    # Edge cut points never leave a block empty, even when one row holds every edge.
    heavy = np.array([0, 0, 0, 100, 100, 100])
    assert np.all(np.bincount(range_owner(5, 5, heavy, by_edges=True)) == 1)
    # Hash: stateless, any process can recompute any owner.
    part = partition((ip, ix), 3, method="hash", seed=9)
    np.testing.assert_array_equal(part.owner, hash_owner(10, 3, seed=9))


def test_partition_validate_catches_bad_assignments():
    with pytest.raises(ValueError, match="outside"):
        Partition(np.array([0, 1, 3]), 3).validate()
    with pytest.raises(ValueError, match="empty"):
        Partition(np.array([0, 0, 2]), 3).validate()
    assert partitioners.METHODS == ("random", "range", "hash", "metis", "ldg", "fennel")


def test_symmetrize_merges_directions_and_drops_loops():
    from partitioners.csr import symmetrize

    # Row i lists the sources of edges into i: 0 <- 0 (loop), 0 <- 1, 1 <- 2, 2 <- 0.
    ip, ix = np.array([0, 2, 3, 4]), np.array([0, 1, 2, 0])
    ptr, idx, w = symmetrize(ip, ix, 3, np.array([1.0, 2.0, 3.0, 4.0]))
    dense = sp.csr_matrix((w, idx, ptr), shape=(3, 3)).toarray()
    np.testing.assert_array_equal(dense, [[0, 2, 4], [2, 0, 3], [4, 3, 0]])
    assert symmetrize(ip, ix, 3)[2] is None


def test_malformed_csr_is_refused_before_metis():
    with pytest.raises(ValueError, match="node id 5, outside"):
        partition((np.array([0, 1, 2]), np.array([0, 5])), 2)
    with pytest.raises(ValueError, match="indptr"):
        partition((np.array([0, 3, 2]), np.array([0, 1])), 2)


def test_metis_cut_matches_dgl(rmat_graph):
    pytest.importorskip("dgl")
    from dgl.partition import metis_partition_assignment

    ours = partition(rmat_graph, 4, method="metis", seed=0).owner
    theirs = metis_partition_assignment(rmat_graph.to_dgl(), 4).numpy()
    assert _cut(rmat_graph, ours) <= 1.03 * _cut(rmat_graph, theirs)
