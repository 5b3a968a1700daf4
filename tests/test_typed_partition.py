"""Partitions of typed graphs: per-type balance, relations kept in the parts, typed id maps,
the per-relation quality report."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import partitioners
from gnnpar.errors import UserError
from gnnpar.graph.typed import typed_graph
from partitioners import METHODS, load_meta, load_part, partition
from partitioners.metrics import quality

COUNTS = {"paper": 2000, "author": 300, "inst": 37}
RELATIONS = [
    ("paper", "cites", "paper", 6000),
    ("author", "writes", "paper", 3000),
    ("paper", "written_by", "author", 3000),
    ("author", "affiliated", "inst", 400),
    ("inst", "employs", "author", 400),
]
CASES = [(m, k) for k in (4, 8) for m in METHODS]


@pytest.fixture(scope="module")
def graph():
    """3 node types of skewed sizes, 5 relations; edges mostly inside 8 communities (so the
    cut-driven methods have something to find), duplicates kept; 30% of papers train."""
    rng = np.random.default_rng(0)
    comm = {t: rng.integers(0, 8, n) for t, n in COUNTS.items()}

    def ends(t: str, m: int, near: np.ndarray | None = None) -> np.ndarray:
        if near is None:
            return rng.integers(0, COUNTS[t], m)
        by_comm = np.argsort(comm[t], kind="stable")  # a node of community c, drawn at random
        starts = np.searchsorted(comm[t][by_comm], np.arange(9))
        size = starts[near + 1] - starts[near]
        same = by_comm[starts[near] + (rng.random(m) * size).astype(np.int64)]
        return np.where(rng.random(m) < 0.8, same, rng.integers(0, COUNTS[t], m))

    edges = {}
    for s, r, d, m in RELATIONS:
        src = ends(s, m)
        edges[(s, r, d)] = (src, ends(d, m, comm[s][src]))
    train = torch.from_numpy(rng.random(COUNTS["paper"]) < 0.3)
    label = torch.from_numpy(rng.integers(0, 4, COUNTS["paper"]))
    feats = {"paper": torch.randn(COUNTS["paper"], 4), "author": torch.randn(COUNTS["author"], 2)}
    return typed_graph(
        COUNTS, edges, feats, "paper", {"train_mask": train, "label": label}, "toyhet", 4
    )


@pytest.fixture(scope="module")
def parts(graph):
    """Every method at 4 and 8 parts, with the default balance (``types``)."""
    return {(m, k): partition(graph, k, method=m, seed=0) for m, k in CASES}


@pytest.fixture(scope="module")
def folders(graph, parts, tmp_path_factory):
    root = tmp_path_factory.mktemp("typed")
    out = {}
    with pytest.MonkeyPatch.context() as mp:  # 700 files: skip the fsyncs (not tested here)
        mp.setattr("gnnpar.verified.os.fsync", lambda fd: None)
        for (m, k), part in parts.items():
            out[m, k] = partitioners.write(graph, part, root / f"{m}-{k}", halo=1)
    return out


def _node_types(graph) -> np.ndarray:
    return graph.types.node_type_of(torch.arange(graph.num_nodes)).numpy()


def _edge_list(graph) -> np.ndarray:
    """``(E, 3)`` rows ``(relation, src, dst)`` in original ids, sorted."""
    src, dst = graph.edges()
    rows = np.stack([graph.types.edge_type.numpy(), src.numpy(), dst.numpy()], axis=1)
    return rows[np.lexsort(rows.T[::-1])]


@pytest.mark.parametrize(("method", "k"), CASES)
def test_every_type_and_the_training_nodes_are_balanced(graph, parts, method, k):
    part = parts[method, k]
    assert part.balance == ("types",)
    types = _node_types(graph)
    train = graph.train_mask.numpy()
    groups = {f"type:{t}": types == i for i, t in enumerate(COUNTS)} | {"train:paper": train}
    report = part.info["types"]["max_over_mean"]
    for name, members in groups.items():
        counts = np.bincount(part.owner[members], minlength=k)
        mean = members.sum() / k
        # 1.05 x the mean, rounded up: 37 nodes in 8 parts cannot do better than 5 (1.08)
        assert counts.max() <= math.ceil(1.05 * mean - 1e-9), (name, counts)
        assert report[name] == pytest.approx(counts.max() / mean)
    assert part.sizes().max() <= math.ceil(1.05 * graph.num_nodes / k) + 2


def test_metis_uses_one_constraint_per_type_and_the_training_nodes(parts):
    info = parts["metis", 4].info
    assert info["constraints"] == ["type:paper", "type:author", "type:inst", "train:paper"]


def test_the_rebalancing_moves_few_nodes_and_keeps_metis_cut(graph, parts):
    """METIS with type constraints then the rebalancing: few moves, a cut close to plain
    METIS's (and far below a random assignment's)."""
    ip, ix = graph.indptr.numpy(), graph.indices.numpy()
    for k in (4, 8):
        typed = parts["metis", k]
        plain = partition(graph, k, method="metis", seed=0, balance="nodes")
        cut = partitioners.metrics.edge_cut(ip, ix, typed.owner)[1]
        assert "types" not in plain.info
        assert typed.info["types"]["moved"] < 0.05 * graph.num_nodes
        assert cut < partitioners.metrics.edge_cut(ip, ix, plain.owner)[1] + 0.05
        assert cut < partitioners.metrics.edge_cut(ip, ix, parts["random", k].owner)[1] - 0.2


@pytest.mark.parametrize(("method", "k"), CASES)
def test_every_edge_keeps_its_relation_in_the_parts(graph, folders, method, k):
    got = []
    for p in range(k):
        part = load_part(folders[method, k], p)
        owned = part.indptr[part.num_owned]
        dst = np.repeat(part.orig_ids[: part.num_owned], np.diff(part.indptr[: part.num_owned + 1]))
        src = part.orig_ids[part.indices[:owned]]
        got.append(np.stack([part.edge_type[:owned], src, dst], axis=1))
        assert part.edge_type.shape == part.indices.shape
    rows = np.concatenate(got)
    rows = rows[np.lexsort(rows.T[::-1])]
    np.testing.assert_array_equal(rows, _edge_list(graph))  # the same multiset, per relation


def test_parts_know_each_local_nodes_type(graph, folders):
    out = folders["metis", 4]
    meta = load_meta(out)
    assert meta["types"] == graph.types.meta() and meta["type_node_ids"] is False
    types = _node_types(graph)
    local_ids = graph.types.local_ids_of(torch.arange(graph.num_nodes)).numpy()
    for p in range(4):
        part = load_part(out, p)
        np.testing.assert_array_equal(part.node_type(), types[part.orig_ids])
        np.testing.assert_array_equal(part.type_local_ids(), local_ids[part.orig_ids])
        owned = part.orig_ids[: part.num_owned]
        assert meta["parts"][p]["num_by_type"] == np.bincount(types[owned], minlength=3).tolist()


def test_local_part_loads_the_types(graph, folders):
    from gnnpar.graph import Graph
    from gnnpar.sampling.distributed import LocalPart

    out = folders["fennel", 8]
    types = _node_types(graph)
    for p in (0, 7):
        lp = LocalPart.load(out, p)
        raw = load_part(out, p)
        np.testing.assert_array_equal(lp.edge_type.numpy(), raw.edge_type)
        assert lp.types.meta() == graph.types.meta() and lp.types.edge_type is lp.edge_type
        local = torch.arange(lp.local_to_global.numel())
        got = lp.types.node_type_of(lp.types.original_ids(local)).numpy()
        np.testing.assert_array_equal(got, types[lp.orig_ids.numpy()])
        # the part's types describe its local graph: every edge's ends have its relation's types
        n = local.numel()
        Graph(lp.indptr, lp.indices, n).types = None  # a plain graph builds
        lp.types._validate_edges(Graph(lp.indptr, lp.indices, n), "part")


def test_untyped_folders_load_without_types(tmp_path):
    from gnnpar.graph import Graph
    from gnnpar.sampling.distributed import LocalPart

    rng = np.random.default_rng(1)
    g = Graph.from_edges(rng.integers(0, 50, 200), rng.integers(0, 50, 200), 50)
    out = partitioners.write(g, partition(g, 2, method="random"), tmp_path / "plain")
    assert "types" not in load_meta(out) and "num_by_type" not in load_meta(out)["parts"][0]
    assert load_part(out, 0).edge_type is None
    lp = LocalPart.load(out, 1)
    assert lp.edge_type is None and lp.types is None
    with pytest.raises(UserError, match="not of a typed graph"):
        load_part(out, 0).node_type()
    with pytest.raises(UserError, match="balance 'types' needs a typed graph"):
        partition(g, 2, method="random", balance="types")


def test_per_relation_report(graph, parts, folders):
    part = parts["ldg", 4]
    q = quality(graph, part)
    # one relation counted directly: author -writes-> paper edges with ends in two parts
    src, dst = (x.numpy() for x in graph.edges())
    writes = graph.types.edge_type.numpy() == 1
    cut = int(np.count_nonzero(part.owner[src[writes]] != part.owner[dst[writes]]))
    r = q.relation_cut["author___writes___paper"]
    assert r == {"edges": 3000, "cut": cut, "fraction": cut / 3000}
    assert sum(r["edges"] for r in q.relation_cut.values()) == graph.num_edges
    assert sum(r["cut"] for r in q.relation_cut.values()) == q.edge_cut
    assert set(q.type_balance) == {"type:paper", "type:author", "type:inst", "train:paper"}
    assert q.type_balance["train:paper"] == pytest.approx(q.train_balance)
    # the folder's meta records the same per part (in-edges of the owned nodes)
    meta = load_meta(folders["ldg", 4])
    assert sum(p["cut_by_relation"][1] for p in meta["parts"]) == cut
    assert sum(p["in_edges_by_relation"][1] for p in meta["parts"]) == 3000
    untyped = quality((graph.indptr, graph.indices), part)
    assert untyped.relation_cut is None and untyped.type_balance is None


def test_balance_nodes_turns_the_type_balance_off(graph):
    part = partition(graph, 4, method="range", balance="nodes")
    assert part.balance == ("nodes",) and "types" not in part.info
    assert np.bincount(part.owner[_node_types(graph) == 2], minlength=4).tolist() == [0, 0, 0, 37]


def test_a_relabelled_typed_graph_stores_its_type_ids(graph, tmp_path):
    perm = torch.from_numpy(np.random.default_rng(2).permutation(graph.num_nodes))
    g = graph.permute(perm)
    part = partition(g, 4, method="hash")
    out = partitioners.write(g, part, tmp_path / "perm")
    assert load_meta(out)["type_node_ids"] is True
    p = load_part(out, 2)
    np.testing.assert_array_equal(p.type_ids, g.types.node_ids.numpy()[p.orig_ids])
    np.testing.assert_array_equal(p.node_type(), _node_types(graph)[p.type_ids])
    types = g.types.node_type_of(g.types.node_ids).numpy()
    for t in range(3):
        counts = np.bincount(part.owner[types == t], minlength=4)
        assert counts.max() <= math.ceil(1.05 * counts.sum() / 4 - 1e-9)


def test_cli_partitions_a_typed_folder_and_streams_it(graph, tmp_path, capsys):
    from gnnpar.data.storage import save_graph
    from partitioners.cli import main

    folder = tmp_path / "graph"
    save_graph(graph, folder)
    args = ["--parts", "4", "--method", "ldg", "--no-progress"]
    assert main([str(folder), *args, "--out", str(tmp_path / "mem")]) == 0
    text = capsys.readouterr().out
    assert "author___writes___paper" in text and "type:inst" in text and "train:paper" in text
    streamed = [*args, "--out", str(tmp_path / "disk"), "--memory-limit", "1MB"]
    assert main([str(folder), *streamed]) == 0
    text = capsys.readouterr().out
    assert "author___writes___paper" in text
    mem, disk = load_meta(tmp_path / "mem"), load_meta(tmp_path / "disk")
    assert mem["balance"] == disk["balance"] == ["types"]
    assert mem["parts"] == disk["parts"] and mem["types"] == disk["types"]
    for k in range(4):  # the same files, streamed or not
        a, b = load_part(tmp_path / "mem", k), load_part(tmp_path / "disk", k)
        np.testing.assert_array_equal(a.edge_type, b.edge_type)
    assert main(["inspect", str(tmp_path / "disk")]) == 0
    text = capsys.readouterr().out
    assert "3 node types" in text and "paper___cites___paper" in text


def test_a_malformed_types_table_is_one_line(graph, folders, tmp_path):
    import json
    import shutil

    from gnnpar.verified import meta_digest
    from partitioners import PartitionFormatError

    bad = tmp_path / "bad"
    shutil.copytree(folders["hash", 4], bad)
    doc = json.loads((bad / "manifest.json").read_text())
    doc["meta"]["types"]["relations"][0] = ["paper", "cites", "venue"]  # no such type
    doc["meta_xxh3_64"] = meta_digest(doc["meta"])  # resealed: only the check can tell
    (bad / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(PartitionFormatError, match="meta field 'types' is malformed"):
        load_part(bad, 0)
