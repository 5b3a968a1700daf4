"""Typed graphs to and from PyG ``HeteroData`` and DGL heterographs
(:mod:`gnnpar.graph.convert_typed`), and ``gnnpar data import`` of their files: every array
survives a trip through both libraries (edges per relation in the canonical (destination,
source) order, features per type at their real width, the target's labels and masks, the
class count) and the two gnnpar graphs have one fingerprint."""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import dgl
import pytest
import torch
from torch_geometric.data import HeteroData

from gnnpar.cli import main
from gnnpar.data import load_graph
from gnnpar.data.safe_pickle import UnsafePickleError, load_torch_file, pyg_globals
from gnnpar.errors import UserError
from gnnpar.graph import Graph, convert
from gnnpar.graph.convert_typed import typed_parts

# node types on purpose not in name order (DGL sorts them); odd sizes
COUNTS = {"paper": 7, "author": 5, "field": 3}
RELATIONS = (
    ("paper", "cites", "paper"),  # source and destination of one type
    ("author", "writes", "paper"),
    ("paper", "has_topic", "field"),
    ("field", "empty", "author"),  # no edges
)


def hetero(weighted: bool = False) -> HeteroData:
    """A HeteroData with a featureless type (author), two feature widths, labels, masks and
    an extra array on the target (paper), edges out of order with a duplicate."""
    gen = torch.Generator().manual_seed(3)
    data = HeteroData()
    data["paper"].x = torch.randn(7, 5, generator=gen)
    data["paper"].y = torch.tensor([0, 2, 1, 0, 2, 2, 1])
    data["paper"].year = torch.arange(2000, 2007)
    role = torch.arange(7) % 3
    for i, key in enumerate(("train_mask", "val_mask", "test_mask")):
        data["paper"][key] = role == i
    data["author"].num_nodes = 5
    data["field"].x = torch.randn(3, 2, generator=gen)
    edges = {
        RELATIONS[0]: [[3, 0, 1, 6, 0, 4], [1, 2, 1, 0, 2, 1]],  # (0 -> 2) twice
        RELATIONS[1]: [[4, 0, 2, 1, 3], [6, 1, 1, 5, 0]],
        RELATIONS[2]: [[0, 5, 6], [2, 0, 2]],
        RELATIONS[3]: [[], []],
    }
    for rel, pairs in edges.items():
        data[rel].edge_index = torch.tensor(pairs, dtype=torch.int64).reshape(2, -1)
        if weighted:
            data[rel].edge_weight = torch.rand(data[rel].edge_index.shape[1], generator=gen)
    data.num_classes = 4  # more than the labels use
    return data


def canonical(index: torch.Tensor, *extra: torch.Tensor) -> list[torch.Tensor]:
    """``index`` (2, E) and per-edge ``extra`` in (destination, source) order, stable."""
    key = index[1] * (int(index.max()) + 1 if index.numel() else 1) + index[0]
    order = torch.argsort(key, stable=True)
    return [index[:, order], *(t[order] for t in extra)]


def same_graph(a: Graph, b: Graph) -> None:
    """Every array of two typed graphs equal, and their fingerprints."""
    assert torch.equal(a.indptr, b.indptr) and torch.equal(a.indices, b.indices)
    assert (a.edge_weight is None) == (b.edge_weight is None)
    if a.edge_weight is not None:
        assert torch.equal(a.edge_weight, b.edge_weight)
    assert set(a.ndata) == set(b.ndata)
    for key in a.ndata:
        assert a.ndata[key].dtype == b.ndata[key].dtype and torch.equal(a.ndata[key], b.ndata[key])
    assert a.types.meta() == b.types.meta()
    assert torch.equal(a.types.edge_type, b.types.edge_type)
    assert a.num_classes == b.num_classes
    assert a.fingerprint() == b.fingerprint()


def same_as_source(out: HeteroData, data: HeteroData) -> None:
    """``out`` holds ``data``'s arrays exactly, each relation's edges in canonical order."""
    assert out.node_types == data.node_types and out.edge_types == data.edge_types
    for t in data.node_types:
        assert out[t].num_nodes == data[t].num_nodes
        keys = set(data[t].keys()) - {"num_nodes"}
        assert set(out[t].keys()) - {"num_nodes"} == keys, t
        for key in keys:
            assert out[t][key].dtype == data[t][key].dtype and torch.equal(
                out[t][key], data[t][key]
            )
    for rel in data.edge_types:
        weights = [data[rel].edge_weight] if "edge_weight" in data[rel] else []
        expected = canonical(data[rel].edge_index, *weights)
        assert torch.equal(out[rel].edge_index, expected[0]), rel
        if weights:
            assert torch.equal(out[rel].edge_weight, expected[1]), rel
    assert out.num_classes == data.num_classes


def dgl_arrays(g: dgl.DGLGraph) -> dict:
    """Every array of a DGL heterograph by type and relation."""
    out = {t: (g.num_nodes(t), dict(g.nodes[t].data)) for t in g.ntypes}
    for rel in g.canonical_etypes:
        out[rel] = (torch.stack(g.edges(etype=rel)), dict(g.edges[rel].data))
    return out


def same_dgl(a: dgl.DGLGraph, b: dgl.DGLGraph) -> None:
    """Two DGL heterographs hold the same types, relations and arrays."""
    assert a.ntypes == b.ntypes and a.canonical_etypes == b.canonical_etypes
    x, y = dgl_arrays(a), dgl_arrays(b)
    for key, (size, arrays) in x.items():
        other_size, other = y[key]
        assert torch.equal(torch.as_tensor(size), torch.as_tensor(other_size)), key
        assert set(arrays) == set(other), key
        for k, v in arrays.items():
            assert v.dtype == other[k].dtype and torch.equal(v, other[k]), (key, k)


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("weighted", [False, True])
def test_pyg_to_dgl_and_back_keeps_every_array(weighted: bool) -> None:
    data = hetero(weighted)
    a = Graph.from_pyg(data, name="mag")
    types = a.types
    assert types.node_types == tuple(COUNTS) and types.relations == RELATIONS
    assert types.offsets == (0, 7, 12, 15) and types.feat_dims == (5, 0, 2)
    assert types.target == "paper" and a.num_classes == 4
    assert types.relation_counts() == [6, 5, 3, 0]
    d = a.to_dgl()  # DGL lists types and relations by name
    assert d.ntypes == sorted(COUNTS) and d.canonical_etypes == sorted(RELATIONS)
    masks = {f"{s}_mask" for s in ("train", "val", "test")}
    assert set(d.nodes["paper"].data) == {"feat", "label", "year", *masks}
    assert not d.nodes["author"].data and set(d.nodes["field"].data) == {"feat"}
    assert torch.equal(d.nodes["field"].data["feat"], data["field"].x)
    assert torch.equal(d.nodes["paper"].data["label"], data["paper"].y)
    for rel in RELATIONS:
        weights = [data[rel].edge_weight] if weighted else []
        expected = canonical(data[rel].edge_index, *weights)
        assert torch.equal(torch.stack(d.edges(etype=rel)), expected[0]), rel
        if weighted:
            assert torch.equal(d.edges[rel].data["w"], expected[1])
    b = Graph.from_dgl(d, num_classes=4)  # DGL's order: other offsets, the same arrays
    assert b.types.node_types == ("author", "field", "paper")
    parts_a, parts_b = typed_parts(a), typed_parts(b)
    for t in COUNTS:
        assert parts_a.node_data[t].keys() == parts_b.node_data[t].keys()
        for key, value in parts_a.node_data[t].items():
            assert torch.equal(value, parts_b.node_data[t][key])
    for rel in RELATIONS:
        pairs = zip(parts_a.edges[rel], parts_b.edges[rel], strict=True)
        assert all(torch.equal(x, y) for x, y in pairs), rel
    b = convert.from_dgl(d, num_classes=4, node_types=types.node_types, relations=types.relations)
    same_graph(a, b)
    same_as_source(b.to_pyg(), data)


def test_dgl_to_pyg_and_back_keeps_every_array(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    g = dgl.heterograph(
        {
            ("user", "follows", "user"): ([4, 0, 2, 0, 1], [1, 3, 1, 3, 0]),
            ("user", "buys", "item"): ([0, 3, 3], [2, 0, 2]),
            ("item", "bought_by", "user"): ([2, 0, 2], [0, 3, 3]),
        },
        num_nodes_dict={"item": 3, "shop": 1, "user": 5},  # shop: no edges, no features
    )
    g.nodes["user"].data["feat"] = torch.randn(5, 3, generator=gen)
    g.nodes["item"].data["feat"] = torch.randn(3, 4, generator=gen)
    g.nodes["user"].data["label"] = torch.tensor([1, 0, 1, 1, 0])
    g.nodes["user"].data["train_mask"] = torch.tensor([1, 1, 0, 0, 1], dtype=torch.uint8)
    dgl.save_graphs(str(tmp_path / "g.bin"), [g])  # what a loaded file holds (uint8 masks)
    g = dgl.load_graphs(str(tmp_path / "g.bin"))[0][0]
    a = Graph.from_dgl(g, num_classes=2)
    assert a.types.node_types == ("item", "shop", "user") and a.types.feat_dims == (4, 0, 3)
    assert a.train_mask.dtype == torch.bool and a.types.target == "user"
    p = a.to_pyg()
    assert p.node_types == ["item", "shop", "user"] and p.num_classes == 2
    assert "x" not in p["shop"] and p["shop"].num_nodes == 1
    assert torch.equal(p["item"].x, g.nodes["item"].data["feat"])
    b = Graph.from_pyg(p)
    same_graph(a, b)
    back = b.to_dgl()
    for rel in g.canonical_etypes:
        expected = canonical(torch.stack(g.edges(etype=rel)))[0]
        assert torch.equal(torch.stack(back.edges(etype=rel)), expected), rel
    assert torch.equal(
        back.nodes["user"].data["train_mask"], g.nodes["user"].data["train_mask"].bool()
    )
    same_dgl(back, Graph.from_dgl(back, num_classes=2).to_dgl())


def test_a_permuted_typed_graph_converts_as_the_graph_it_permutes() -> None:
    a = Graph.from_pyg(hetero(weighted=True))
    perm = torch.randperm(a.num_nodes, generator=torch.Generator().manual_seed(1))
    moved = a.permute(perm)
    assert moved.types.node_ids is not None
    same_as_source(moved.to_pyg(), a.to_pyg())
    same_graph(Graph.from_pyg(moved.to_pyg()), a)
    same_dgl(moved.to_dgl(), a.to_dgl())
    part = a.subgraph(torch.arange(0, a.num_nodes, 2))
    with pytest.raises(UserError, match=r"holds 8 nodes of a typed graph of 15 \(a subgraph\)"):
        part.to_pyg()


# ---------------------------------------------------------------------- choices and refusals
def test_the_target_is_the_labelled_type_or_target() -> None:
    data = hetero()
    data["field"].y = torch.tensor([1, 0, 1])
    with pytest.raises(UserError, match="node types paper, field all have labels.*target="):
        Graph.from_pyg(data)
    g = convert.from_pyg(data, target="field")  # the paper labels, masks, year stay behind
    assert g.types.target == "field" and set(g.ndata) == {"feat", "label"}
    assert g.label.tolist() == [-1] * 12 + [1, 0, 1]
    del data["field"].y
    data["author"].year = torch.arange(5)
    with pytest.raises(UserError, match="node type author has node data 'year'.*target="):
        Graph.from_pyg(data)
    assert "year" not in typed_parts(convert.from_pyg(data, target="paper")).node_data["author"]
    with pytest.raises(UserError, match="target 'venue' is not a node type"):
        convert.from_pyg(hetero(), target="venue")


def test_refusals_are_one_line_naming_the_type() -> None:
    data = hetero()
    data["field"].x = data["field"].x.double()
    with pytest.raises(UserError, match="node features differ in dtype .paper float32, field"):
        Graph.from_pyg(data)
    data = hetero()
    del data["author"].num_nodes
    with pytest.raises(UserError, match=r"PyG node type author has no num_nodes"):
        Graph.from_pyg(data)
    data = hetero(weighted=True)
    del data[RELATIONS[1]].edge_weight
    with pytest.raises(UserError, match="relation author___writes___paper has no edge weights"):
        Graph.from_pyg(data)
    with pytest.raises(UserError, match="node types .'paper'. must list each"):
        convert.from_pyg(hetero(), node_types=["paper"])
    with pytest.raises(UserError, match="target= applies to heterogeneous graphs only"):
        convert.from_pyg(Graph.from_edges([0], [1]).to_pyg(), target="paper")
    lonely = Graph.from_pyg(HeteroData({"a": {"num_nodes": 2}}))
    with pytest.raises(UserError, match="has no relations: a DGL heterograph needs"):
        lonely.to_dgl()
    assert lonely.to_pyg().node_types == ["a"]


# ---------------------------------------------------------------------- gnnpar data import
def test_import_a_hetero_data_file(tmp_path: Path) -> None:
    data = hetero(weighted=True)
    torch.save(data, tmp_path / "mag.pt")
    assert main(["data", "import", str(tmp_path / "mag.pt"), "--out", str(tmp_path / "g")]) == 0
    folder = load_graph(tmp_path / "g")
    same_graph(folder, Graph.from_pyg(data))
    same_as_source(folder.to_pyg(), data)


def test_import_a_dgl_heterograph_file(tmp_path: Path) -> None:
    data = hetero()
    d = Graph.from_pyg(data).to_dgl()
    dgl.save_graphs(str(tmp_path / "mag.bin"), [d], {"num_classes": torch.tensor([4])})
    assert main(["data", "import", str(tmp_path / "mag.bin"), "--out", str(tmp_path / "g")]) == 0
    folder = load_graph(tmp_path / "g")
    assert folder.types.node_types == ("author", "field", "paper") and folder.num_classes == 4
    same_graph(folder, Graph.from_dgl(d, num_classes=4))
    same_as_source(folder.to_pyg(), convert.to_pyg(Graph.from_dgl(d, num_classes=4)))


class _Cluster:
    """Pickles as a call to PyG's ClusterData, which torch's own weights-only loader allows
    once torch_geometric is imported (it partitions a graph and writes files)."""

    def __reduce__(self):
        from torch_geometric.loader import ClusterData

        return (ClusterData, ("not a graph", 2))


def test_import_refuses_what_a_pyg_pickle_must_not_name(tmp_path: Path, capsys) -> None:
    torch.save(_Cluster(), tmp_path / "cluster.pt")
    assert main(["data", "import", str(tmp_path / "cluster.pt"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1 and "it names torch_geometric.loader.cluster.ClusterData" in err
    )
    # a pickle that sets an attribute of an allowed class (BUILD on the class itself)
    from torch_geometric.data.feature_store import TensorAttr

    body = (
        b"\x80\x02ctorch_geometric.data.feature_store\nTensorAttr\n"  # GLOBAL: the class
        b"N}X\x05\x00\x00\x00pwnedK\x01s\x86b."  # BUILD it with state (None, {"pwned": 1})
    )
    with zipfile.ZipFile(tmp_path / "build.pt", "w") as z:
        z.writestr("build/data.pkl", body)
    with pytest.raises(UnsafePickleError, match="sets a class's attributes"):
        load_torch_file(tmp_path / "build.pt", pyg_globals())
    assert not hasattr(TensorAttr, "pwned")
    (tmp_path / "plain.pt").write_bytes(pickle.dumps(hetero()))  # not a torch.save archive
    assert main(["data", "import", str(tmp_path / "plain.pt"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "plain.pt: not a torch.save file (a zip archive" in err


def test_a_damaged_torch_file_is_one_line(tmp_path: Path) -> None:
    torch.save(hetero(), tmp_path / "good.pt")
    with zipfile.ZipFile(tmp_path / "good.pt") as z:
        members = {info.filename: z.read(info) for info in z.infolist()}
    storage = next(name for name in members if "/data/" in name)
    for what, pack, cut in (
        ("compressed", zipfile.ZIP_DEFLATED, 0),
        ("cut", zipfile.ZIP_STORED, 4),
    ):
        path = tmp_path / f"{what}.pt"
        with zipfile.ZipFile(path, "w", compression=pack) as z:
            for name, body in members.items():
                z.writestr(name, body[: len(body) - cut] if name == storage else body)
        with pytest.raises(UserError) as err:
            load_torch_file(path, pyg_globals())
        message = str(err.value)
        assert len(message.splitlines()) == 1 and str(path) in message
        assert ("is compressed" if what == "compressed" else f"storage {storage} holds") in message
