"""Tests of gnnpar.graph.Graph: validation, transforms against dense references, converters."""

from __future__ import annotations

import sys
import time

import networkx as nx
import numpy as np
import pytest
import scipy.sparse as sp
import torch

from gnnpar.graph import Graph, invert_permutation


def dense(g: Graph) -> torch.Tensor:
    """Dense adjacency, A[i, j] = weight of j -> i (duplicates summed)."""
    return torch.from_numpy(g.to_scipy().toarray()).to(torch.float64)


def random_graph(n: int = 9, e: int = 30, seed: int = 0, weighted: bool = False) -> Graph:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n, (e,), generator=gen)
    dst = torch.randint(0, n, (e,), generator=gen)
    w = torch.rand(e, generator=gen) + 0.5 if weighted else None
    ndata = {
        "feat": torch.randn(n, 3, generator=gen),
        "label": torch.randint(0, 4, (n,), generator=gen),
        "train_mask": torch.arange(n) % 2 == 0,
    }
    return Graph.from_edges(src, dst, n, w, ndata, name="rand")


def simple_graph(n: int = 7, seed: int = 1) -> Graph:
    """No self loops, no duplicate edges, one isolated node (n - 1)."""
    g = random_graph(n - 1, 20, seed).remove_self_loops().coalesce()
    src, dst = g.edges()
    return Graph.from_edges(src, dst, n)


def same(a: Graph, b: Graph) -> None:
    assert a.num_nodes == b.num_nodes
    assert torch.equal(a.indptr, b.indptr)
    assert torch.equal(a.indices, b.indices)
    if a.edge_weight is None or b.edge_weight is None:
        assert a.edge_weight is None and b.edge_weight is None
    else:
        torch.testing.assert_close(a.edge_weight, b.edge_weight)
    assert set(a.ndata) == set(b.ndata)
    for key in a.ndata:
        assert torch.equal(a.ndata[key], b.ndata[key]), key


# ---------------------------------------------------------------------- construction


def test_csr_rows_are_destinations() -> None:
    g = Graph.from_edges([0, 1, 2, 0], [1, 2, 0, 2])  # 0->1, 1->2, 2->0, 0->2
    assert g.num_nodes == 3 and g.num_edges == 4
    assert g.indptr.tolist() == [0, 1, 2, 4]
    assert g.indices.tolist() == [2, 0, 1, 0]
    src, dst = g.edges()
    assert src.tolist() == [2, 0, 1, 0] and dst.tolist() == [0, 1, 2, 2]
    assert g.in_degrees().tolist() == [1, 1, 2]
    assert g.out_degrees().tolist() == [2, 1, 1]
    assert g.indptr.dtype == torch.int64 and g.indices.dtype == torch.int64
    # A @ x sums the sources at each destination.
    x = torch.tensor([1.0, 10.0, 100.0])
    assert (g.to_torch_sparse() @ x).tolist() == [100.0, 1.0, 11.0]


def test_from_edges_keeps_input_order_in_rows_and_accepts_numpy() -> None:
    g = Graph.from_edges(np.array([5, 3, 4, 1]), np.array([0, 0, 2, 0]), num_nodes=6)
    assert g.indices[:3].tolist() == [5, 3, 1]
    assert g.num_nodes == 6


def test_properties_and_repr() -> None:
    g = random_graph()
    assert g.feat is g.ndata["feat"] and g.label is g.ndata["label"]
    assert g.val_mask is None and g.test_mask is None
    assert g.num_classes == int(g.label.max()) + 1
    assert Graph.from_edges([0], [1]).num_classes == 0
    text = repr(g)
    assert "rand" in text and "num_nodes=9" in text and "feat: (9, 3) float32" in text


def test_to_device_keeps_everything() -> None:
    g = random_graph(weighted=True)
    same(g.to("cpu"), g)
    assert g.to(torch.device("cpu")).name == "rand"


def test_empty_graph() -> None:
    g = Graph.from_edges([], [], num_nodes=4)
    assert g.num_edges == 0 and g.in_degrees().tolist() == [0, 0, 0, 0]
    assert g.coalesce().num_edges == 0 and g.to_undirected().num_edges == 0
    assert g.add_self_loops().num_edges == 4
    assert Graph.from_edges([], []).num_nodes == 0


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"indptr": [0, 1, 2], "indices": [0, -1]}, r"negative node id -1"),
        ({"indptr": [0, 1, 2], "indices": [0, 5]}, r"node id 5.*num_nodes is 2"),
        ({"indptr": [0, 1, 2], "indices": [0.0, 1.0]}, r"indices must have an integer dtype"),
        ({"indptr": np.array([0.0, 1.0]), "indices": [0]}, r"indptr must have an integer dtype"),
        ({"indptr": [0, 1, 2], "indices": [0, 1], "num_nodes": 3}, r"length 3.*num_nodes \+ 1"),
        ({"indptr": [1, 1, 2], "indices": [0, 1]}, r"indptr\[0\] must be 0, got 1"),
        ({"indptr": [0, 1, 3], "indices": [0, 1]}, r"indptr\[-1\] \(3\).*len\(indices\) \(2\)"),
        ({"indptr": [0, 2, 1, 2], "indices": [0, 1]}, r"not monotone.*indptr\[1\] = 2"),
        ({"indptr": [0, 1, 2], "indices": [[0, 1]]}, r"indices must be 1-D"),
        (
            {"indptr": [0, 1, 2], "indices": [0, 1], "edge_weight": [1.0]},
            r"edge_weight has 1 entries but the graph has 2 edges",
        ),
        (
            {"indptr": [0, 1, 2], "indices": [0, 1], "edge_weight": [1.0, float("nan")]},
            r"edge_weight contains 1 non-finite",
        ),
        (
            {"indptr": [0, 1, 2], "indices": [0, 1], "ndata": {"feat": torch.zeros(3, 2)}},
            r"ndata\['feat'\] has 3 rows but the graph has 2 nodes",
        ),
        (
            {
                "indptr": [0, 1, 2],
                "indices": [0, 1],
                "ndata": {"feat": torch.tensor([[1.0], [float("nan")]])},
            },
            r"ndata\['feat'\] contains 1 non-finite",
        ),
        (
            {
                "indptr": [0, 1, 2],
                "indices": [0, 1],
                "ndata": {"feat": torch.tensor([float("inf"), -float("inf")])},
            },
            r"ndata\['feat'\] contains 2 non-finite",
        ),
        ({"indptr": [0, 1, 2], "indices": [0, 1], "num_nodes": -1}, r"num_nodes must be >= 0"),
        ({"indptr": [], "indices": []}, r"indptr is empty"),
    ],
)
def test_bad_input_is_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Graph(**kwargs)


@pytest.mark.parametrize(
    ("src", "dst", "num_nodes", "match"),
    [
        ([0, 1], [1], None, r"src has 2 entries but dst has 1"),
        ([0, 3], [1, 1], 3, r"src contain node id 3.*position 1.*num_nodes is 3"),
        ([0, 1], [-2, 1], None, r"dst contain a negative node id -2"),
        ([0.5], [1], None, r"src must have an integer dtype"),
        (torch.tensor([True]), [1], None, r"src must have an integer dtype"),
    ],
)
def test_from_edges_rejects_bad_ids(src, dst, num_nodes, match) -> None:
    with pytest.raises(ValueError, match=match):
        Graph.from_edges(src, dst, num_nodes)


def test_from_edges_rejects_bad_data() -> None:
    with pytest.raises(ValueError, match=r"edge_weight has 1 entries but there are 2 edges"):
        Graph.from_edges([0, 1], [1, 0], edge_weight=[1.0])
    with pytest.raises(ValueError, match=r"ndata\['label'\] has 5 rows"):
        Graph.from_edges([0, 1], [1, 0], ndata={"label": torch.zeros(5)})
    with pytest.raises(ValueError, match=r"non-finite"):
        Graph.from_edges([0, 1], [1, 0], ndata={"feat": torch.tensor([0.0, float("nan")])})
    with pytest.raises(TypeError, match=r"ndata\['feat'\] must be a torch.Tensor"):
        Graph.from_edges([0, 1], [1, 0], ndata={"feat": [1.0, 2.0]})


def test_validate_catches_later_corruption() -> None:
    g = random_graph()
    g.validate()
    g.indices[0] = 100
    with pytest.raises(ValueError, match=r"node id 100"):
        g.validate()
    g = random_graph()
    g.indices = g.indices.to(torch.int32)
    with pytest.raises(ValueError, match=r"indices must be torch.int64, got torch.int32"):
        g.validate()
    g = Graph([0, 1, 2], [0, 1], validate=False)
    g.ndata["x"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"ndata\['x'\] has 3 rows"):
        g.validate()


# ---------------------------------------------------------------------- transforms


def test_coalesce_sorts_and_sums_duplicates() -> None:
    g = Graph.from_edges([2, 0, 2, 1], [0, 0, 0, 1], 3, edge_weight=[1.0, 2.0, 3.0, 4.0])
    c = g.coalesce()
    assert c.indptr.tolist() == [0, 2, 3, 3]
    assert c.indices.tolist() == [0, 2, 1]
    assert c.edge_weight.tolist() == [2.0, 4.0, 4.0]
    torch.testing.assert_close(dense(c), dense(g))
    u = Graph.from_edges([2, 0, 2], [0, 0, 0], 3).coalesce()
    assert u.indices.tolist() == [0, 2] and u.edge_weight is None


def test_to_undirected() -> None:
    g = random_graph()
    a = (dense(g) > 0).to(torch.float64)
    u = g.to_undirected()
    assert u.is_symmetric() and not g.is_symmetric()
    torch.testing.assert_close(dense(u), ((a + a.T) > 0).to(torch.float64))
    assert torch.equal(u.to_undirected().indices, u.indices)
    # Weighted: "max" merges an edge and its reverse, "sum" adds them.
    w = Graph.from_edges([0, 1, 1], [1, 0, 2], 3, edge_weight=[1.0, 3.0, 2.0])
    assert dense(w.to_undirected())[1, 0] == 3.0 and dense(w.to_undirected())[0, 1] == 3.0
    assert dense(w.to_undirected("sum"))[1, 0] == 4.0
    assert dense(w.to_undirected("sum"))[2, 1] == 2.0 and dense(w.to_undirected())[1, 2] == 2.0
    with pytest.raises(ValueError, match="reduce must be one of"):
        w.to_undirected("min")


def test_self_loops() -> None:
    g = simple_graph()
    n = g.num_nodes
    torch.testing.assert_close(
        dense(g.add_self_loops()), dense(g) + torch.eye(n, dtype=torch.float64)
    )
    torch.testing.assert_close(
        dense(g.add_self_loops(weight=2.5)), dense(g) + 2.5 * torch.eye(n, dtype=torch.float64)
    )
    assert g.add_self_loops().edge_weight is None
    looped = g.add_self_loops()
    assert looped.has_self_loops() and not g.has_self_loops()
    same(looped.remove_self_loops(), g)
    # The loop is appended at the end of each row; existing loops are kept, not doubled.
    h = Graph.from_edges([1, 0, 2], [0, 0, 1], 3, edge_weight=[1.0, 5.0, 2.0])  # 0 -> 0 exists
    hl = h.add_self_loops(weight=3.0)
    assert hl.indptr.tolist() == [0, 2, 4, 5] and hl.indices.tolist() == [1, 0, 2, 1, 2]
    assert dense(hl).diagonal().tolist() == [5.0, 3.0, 3.0]
    assert dense(hl.add_self_loops()).diagonal().tolist() == [5.0, 3.0, 3.0]
    # GAT's and GIN's "raw" adjacency: the weights as they are, unit loops where missing
    raw = h.weighted_self_loops()
    assert torch.equal(dense(raw), dense(h) + torch.diag(torch.tensor([0.0, 1.0, 1.0])).double())
    plain = Graph.from_edges([1, 2], [0, 1], 3).weighted_self_loops()
    assert plain.edge_weight.tolist() == [1.0] * 5


def test_gcn_norm_matches_dense_reference() -> None:
    for g in (simple_graph(), simple_graph().to_undirected()):
        a = dense(g) + torch.eye(g.num_nodes, dtype=torch.float64)
        d = a.sum(1).pow(-0.5)
        ref = d[:, None] * a * d[None, :]
        torch.testing.assert_close(dense(g.gcn_norm()), ref, rtol=1e-6, atol=1e-7)
    # Weighted, without self loops: isolated rows stay zero.
    g = random_graph(weighted=True).remove_self_loops()
    a = dense(g)
    d = a.sum(1).pow(-0.5)
    d[torch.isinf(d)] = 0
    torch.testing.assert_close(
        dense(g.gcn_norm(add_self_loops=False)), d[:, None] * a * d[None, :], rtol=1e-6, atol=1e-7
    )


def test_gcn_norm_matches_pyg() -> None:
    from torch_geometric.nn.conv.gcn_conv import gcn_norm

    g = simple_graph().to_undirected()
    src, dst = g.edges()
    edge_index, weight = gcn_norm(torch.stack([src, dst]), num_nodes=g.num_nodes)
    ref = Graph.from_edges(edge_index[0], edge_index[1], g.num_nodes, weight)
    torch.testing.assert_close(dense(g.gcn_norm()), dense(ref), rtol=1e-6, atol=1e-7)


def test_row_normalize() -> None:
    g = random_graph(weighted=True)
    r = g.row_normalize()
    a = dense(g)
    sums = a.sum(1, keepdim=True)
    ref = torch.where(sums > 0, a / sums, torch.zeros_like(a))
    torch.testing.assert_close(dense(r), ref)
    rows = dense(r).sum(1)
    assert torch.all(((rows - 1).abs() < 1e-6) | (g.in_degrees() == 0))


def test_subgraph() -> None:
    g = random_graph(weighted=True)
    nodes = torch.tensor([7, 2, 0, 5])
    s = g.subgraph(nodes)
    assert s.num_nodes == 4
    torch.testing.assert_close(dense(s), dense(g)[nodes][:, nodes])
    for key in g.ndata:
        assert torch.equal(s.ndata[key], g.ndata[key][nodes])
    mask = torch.zeros(g.num_nodes, dtype=torch.bool)
    mask[nodes] = True
    torch.testing.assert_close(
        dense(g.subgraph(mask)), dense(g)[nodes.sort().values][:, nodes.sort().values]
    )
    assert g.subgraph([]).num_nodes == 0
    with pytest.raises(ValueError, match=r"node 2 2 times"):
        g.subgraph([2, 1, 2])
    with pytest.raises(ValueError, match=r"node id 9.*num_nodes is 9"):
        g.subgraph([9])
    with pytest.raises(ValueError, match=r"boolean node mask must have shape \(9,\)"):
        g.subgraph(torch.ones(3, dtype=torch.bool))


def test_permute_convention_new_i_is_old_perm_i() -> None:
    g = random_graph(weighted=True)
    perm = torch.randperm(g.num_nodes, generator=torch.Generator().manual_seed(3))
    p = g.permute(perm)
    torch.testing.assert_close(dense(p), dense(g)[perm][:, perm])
    # Same as P A P^T with P[i, perm[i]] = 1.
    pm = torch.zeros(g.num_nodes, g.num_nodes, dtype=torch.float64)
    pm[torch.arange(g.num_nodes), perm] = 1
    torch.testing.assert_close(dense(p), pm @ dense(g) @ pm.T)
    assert torch.equal(p.feat, g.feat[perm]) and torch.equal(p.label, g.label[perm])
    # An edge u -> v becomes inv[u] -> inv[v].
    inv = invert_permutation(perm)
    src, dst = g.edges()
    new_edges = set(zip(*[t.tolist() for t in p.edges()], strict=True))
    assert new_edges == set(zip(inv[src].tolist(), inv[dst].tolist(), strict=True))
    same(p.permute(inv), g)


def test_permute_rejects_non_permutations() -> None:
    g = random_graph()
    with pytest.raises(ValueError, match=r"perm has 3 entries but the graph has 9 nodes"):
        g.permute([0, 1, 2])
    with pytest.raises(ValueError, match=r"not a permutation of 0..8: node 0 appears 2 times"):
        g.permute([0, 0, 2, 3, 4, 5, 6, 7, 8])
    with pytest.raises(ValueError, match=r"node id 9"):
        g.permute([9, 1, 2, 3, 4, 5, 6, 7, 8])


# ---------------------------------------------------------------------- converters


def test_scipy_round_trip() -> None:
    g = random_graph(weighted=True)
    m = g.to_scipy()
    assert isinstance(m, sp.csr_matrix) and m.shape == (9, 9)
    same(Graph.from_scipy(m, ndata=g.ndata), g)
    u = random_graph()
    back = Graph.from_scipy(u.to_scipy(), ndata=u.ndata)
    assert back.edge_weight is None
    same(back, u)
    coo = sp.coo_matrix(([2.0, 3.0], ([0, 1], [1, 2])), shape=(3, 3))
    h = Graph.from_scipy(coo)
    assert h.edges()[0].tolist() == [1, 2] and h.edge_weight.tolist() == [2.0, 3.0]
    assert Graph.from_scipy(coo, weighted=False).edge_weight is None
    with pytest.raises(ValueError, match=r"square"):
        Graph.from_scipy(sp.csr_matrix((2, 3)))
    with pytest.raises(TypeError, match=r"scipy sparse matrix"):
        Graph.from_scipy(np.eye(3))


def test_pyg_round_trip() -> None:
    g = random_graph(weighted=True)
    data = g.to_pyg()
    src, dst = g.edges()
    assert torch.equal(data.edge_index[0], src) and torch.equal(data.edge_index[1], dst)
    assert torch.equal(data.x, g.feat) and torch.equal(data.y, g.label)
    assert torch.equal(data.train_mask, g.train_mask) and data.num_nodes == 9
    assert torch.equal(data.edge_weight, g.edge_weight)
    same(Graph.from_pyg(data), g)


def test_from_pyg_data() -> None:
    from torch_geometric.data import Data

    edge_index = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    data = Data(edge_index=edge_index, x=torch.randn(5, 2), y=torch.arange(5), num_nodes=5)
    data.val_mask = torch.tensor([True, False, False, False, True])
    data.edge_attr = torch.tensor([1.0, 2.0, 3.0, 4.0])
    g = Graph.from_pyg(data, name="pyg")
    assert g.num_nodes == 5 and g.name == "pyg"
    assert set(g.ndata) == {"feat", "label", "val_mask"}
    assert dense(g)[1, 0] == 1.0 and dense(g)[0, 3] == 4.0
    back = g.to_pyg()
    assert sorted(map(tuple, back.edge_index.T.tolist())) == sorted(
        map(tuple, edge_index.T.tolist())
    )
    with pytest.raises(ValueError, match="no edge_index"):
        Graph.from_pyg(Data(x=torch.zeros(2, 1)))


def test_networkx_round_trip() -> None:
    g = random_graph(weighted=True).coalesce()
    nxg = g.to_networkx()
    assert isinstance(nxg, nx.DiGraph) and nxg.number_of_edges() == g.num_edges
    assert nxg.nodes[3]["label"] == int(g.label[3])
    back = Graph.from_networkx(nxg, node_attrs=["feat", "label", "train_mask"]).coalesce()
    same(back, g)
    assert back.name == "rand"
    # Duplicate edges give a MultiDiGraph.
    assert isinstance(Graph.from_edges([0, 0], [1, 1]).to_networkx(), nx.MultiDiGraph)


def test_from_undirected_networkx() -> None:
    nxg = nx.Graph()
    nxg.add_edges_from([("a", "b"), ("b", "c"), ("c", "c")])
    g = Graph.from_networkx(nxg)
    assert g.num_nodes == 3 and g.num_edges == 5  # both directions, the loop once
    assert g.is_symmetric()
    nxg.nodes["a"]["score"] = 1.0
    with pytest.raises(ValueError, match=r"node 'b' has no attribute 'score'"):
        Graph.from_networkx(nxg, node_attrs=["score"])


def test_dgl_round_trip() -> None:
    g = random_graph(weighted=True)
    d = g.to_dgl()
    assert d.num_nodes() == 9 and d.num_edges() == g.num_edges
    same(Graph.from_dgl(d), g)


def test_dgl_missing_is_a_clear_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "dgl", None)  # makes "import dgl" fail
    with pytest.raises(ImportError, match=r"to_dgl needs DGL"):
        random_graph().to_dgl()


def test_edge_list_round_trip(tmp_path) -> None:
    g = random_graph()
    edges = g.to_edge_list()
    assert edges.shape == (g.num_edges, 2) and edges.dtype == np.int64
    same(Graph.from_edge_list(edges, g.num_nodes, ndata=g.ndata, name="rand"), g)
    path = tmp_path / "edges.txt"
    g.to_edge_list(path)
    assert path.read_text().startswith("# rand")
    same(Graph.from_edge_list(path, g.num_nodes, ndata=g.ndata), g)
    w = random_graph(weighted=True)
    w.to_edge_list(path)
    back = Graph.from_edge_list(path, w.num_nodes)
    torch.testing.assert_close(back.edge_weight, w.edge_weight)
    path.write_text("0 1 2 3\n")
    with pytest.raises(ValueError, match=r"2 or 3 columns"):
        Graph.from_edge_list(path)
    with pytest.raises(ValueError, match=r"shape \(E, 2\)"):
        Graph.from_edge_list(np.zeros((3, 3), dtype=np.int64))


def test_to_torch_sparse_layouts() -> None:
    g = random_graph(weighted=True)
    ref = dense(g).to(torch.float32)
    torch.testing.assert_close(g.to_torch_sparse().to_dense(), ref)
    torch.testing.assert_close(g.to_torch_sparse(torch.sparse_coo).to_dense(), ref)


# ---------------------------------------------------------------------- speed promise


@pytest.mark.timeout(120)
def test_from_edges_16m_edges_is_fast() -> None:
    """The speed promise: 16M edges into CSR in a few seconds (budget 10 s on 2 cores)."""
    n, e = 1 << 20, 16_000_000
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, n, (e,), generator=gen)
    dst = torch.randint(0, n, (e,), generator=gen)
    start = time.perf_counter()
    g = Graph.from_edges(src, dst, n)
    elapsed = time.perf_counter() - start
    assert g.num_edges == e and int(g.indptr[-1]) == e
    assert torch.equal(g.in_degrees(), torch.bincount(dst, minlength=n))
    assert elapsed < 10.0, f"from_edges took {elapsed:.1f} s for 16M edges"
