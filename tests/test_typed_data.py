"""Typed datasets: the synthetic ``mag-synth`` (deterministic, valid, a planted relational
signal that a typed one-hop aggregate finds and paper features alone do not) and OGB's
``ogbn-mag`` read from a tiny archive in the official layout (every array, the reverse
relations, the folder names a root may use, one-line errors naming a damaged file), and
what ``gnnpar data info`` / ``prepare`` show of a typed graph."""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gnnpar.allocation import AllocationError
from gnnpar.cli.data import add_data_commands
from gnnpar.data import load
from gnnpar.data.catalogue import get_entry
from gnnpar.data.mag import MAG_NODE_TYPES, MAG_RELATIONS, mag_synth, read_ogb_typed
from gnnpar.data.storage import load_graph
from gnnpar.errors import UserError
from gnnpar.graph import Graph
from tests.typed_fixtures import relation_pairs, write_ogbn_mag

REVERSES = [
    ("institution", "rev_affiliated_with", "author"),
    ("paper", "rev_writes", "author"),
    ("field_of_study", "rev_has_topic", "paper"),
]


def _papers(graph: Graph) -> slice:
    t = graph.types.type_index("paper")
    return slice(graph.types.offsets[t], graph.types.offsets[t + 1])


# ---------------------------------------------------------------------- mag-synth
def test_mag_synth_is_deterministic_typed_and_fast() -> None:
    g = mag_synth()
    types = g.types
    assert types.node_types == MAG_NODE_TYPES and types.target == "paper"
    assert list(types.relations) == [*MAG_RELATIONS, *REVERSES]
    assert types.feat_dims == (0, 0, 0, 64) and g.feat.shape == (g.num_nodes, 64)
    assert g.num_classes == 8 and g.name == "mag-synth"
    p = _papers(g)
    assert bool((g.label[p] >= 0).all()) and int((g.label >= 0).sum()) == 2000
    year = g.ndata["year"][p]
    assert torch.equal(g.train_mask[p], year < 2018) and torch.equal(g.test_mask[p], year == 2019)
    assert int(g.val_mask.sum()) > 100 and int(g.test_mask.sum()) > 100
    # each reverse relation holds its relation's edges turned round; cites both ways
    for rel, rev in zip(MAG_RELATIONS[:2] + MAG_RELATIONS[3:], REVERSES, strict=True):
        turned = [(d, s) for s, d in relation_pairs(g, "___".join(rel))]
        assert sorted(turned) == relation_pairs(g, "___".join(rev))
    cites = relation_pairs(g, "cites")
    assert cites == sorted((d, s) for s, d in cites) and len(set(cites)) == len(cites)
    assert all(s != d for s, d in cites)
    assert [a for a, _ in relation_pairs(g, "affiliated_with")] == list(range(1000))
    small = {"num_papers": 200, "num_authors": 100}
    again = mag_synth(**small).fingerprint()
    assert again == mag_synth(**small).fingerprint() != mag_synth(**small, seed=1).fingerprint()
    plain = mag_synth(**small, reverse=False)
    assert list(plain.types.relations) == list(MAG_RELATIONS)


def _typed_mean(graph: Graph, rel: str) -> torch.Tensor:
    """Row-normalised ``(dst nodes, src nodes)`` adjacency of one relation (a typed mean)."""
    types = graph.types
    src_t, _, dst_t = types.relations[types.relation_index(rel)]
    pairs = torch.tensor(relation_pairs(graph, rel)).T
    adj = torch.zeros(types.num_nodes_of(dst_t), types.num_nodes_of(src_t))
    adj.index_put_((pairs[1], pairs[0]), torch.ones(pairs.shape[1]), accumulate=True)
    return adj / adj.sum(1, keepdim=True).clamp(min=1)


def _linear_probe_accuracy(
    x: torch.Tensor, y: torch.Tensor, train: torch.Tensor, test: torch.Tensor
) -> float:
    """Test accuracy of a linear classifier fit in closed form (ridge regression onto the
    one-hot classes, standardised inputs): one solve, cheap and deterministic."""
    x = (x - x[train].mean(0)) / x[train].std(0).clamp(min=1e-6)
    x = torch.cat([x, torch.ones(len(x), 1)], 1).double()
    onehot = F.one_hot(y[train], int(y.max()) + 1).double()
    gram = x[train].T @ x[train] + 10.0 * torch.eye(x.shape[1], dtype=x.dtype)
    weight = torch.linalg.solve(gram, x[train].T @ onehot)
    return float(((x[test] @ weight).argmax(1) == y[test]).double().mean())


def test_mag_synth_relations_beat_features() -> None:
    """The planted signal: each paper's fields (one hop, rev_has_topic) and its authors'
    institutions (writes, then rev_affiliated_with), as typed means of one-hot memberships,
    classify test papers far better than the paper's own features (linear probes)."""
    g = mag_synth()
    p = _papers(g)
    y, train, test = g.label[p], g.train_mask[p], g.test_mask[p]
    fields = _typed_mean(g, "rev_has_topic")  # paper x field: mean one-hot field
    institutions = _typed_mean(g, "writes") @ _typed_mean(g, "rev_affiliated_with")
    relational = _linear_probe_accuracy(torch.cat([fields, institutions], 1), y, train, test)
    features = _linear_probe_accuracy(g.feat[p], y, train, test)
    print(f"mag-synth test accuracy: relational {relational:.3f}, features {features:.3f}")
    assert relational > 0.85 and features < 0.4 and relational - features > 0.5


def test_mag_synth_options_are_checked() -> None:
    for kwargs, match in (
        ({"num_classes": 100}, r"num_classes <= num_authors.*num_institutions=40"),
        ({"num_papers": 0}, r"num_papers must be an integer >= 1, got 0"),
        ({"homophily": 1.5}, r"homophily must lie in \[0, 1\]"),
        ({"feat_dim": 2.5}, r"feat_dim must be an integer"),
    ):
        with pytest.raises(UserError, match=match) as err:
            mag_synth(**kwargs)
        assert "\n" not in str(err.value)


def test_mag_synth_in_the_catalogue(tmp_path: Path) -> None:
    entry = get_entry("mag-synth")
    assert entry is not None and not entry.needs_files and entry.defaults["num_papers"] == 2000
    g = load("mag-synth", root=tmp_path, num_papers=100, num_authors=50, seed=3)
    assert g.types.num_nodes_of("paper") == 100
    assert g.fingerprint() == mag_synth(num_papers=100, num_authors=50, seed=3).fingerprint()
    with pytest.raises(AllocationError, match=r"mag_synth with .*num_papers=10000000000000"):
        load("mag-synth", root=tmp_path, num_papers=10**13)


# ---------------------------------------------------------------------- ogbn-mag
def test_ogbn_mag_reads_every_array(tmp_path: Path) -> None:
    data = write_ogbn_mag(tmp_path / "ogbn-mag")
    g = load("ogbn-mag", root=tmp_path)
    types = g.types
    assert g.name == "ogbn-mag" and g.num_classes == 349 and types.target == "paper"
    assert types.node_types == MAG_NODE_TYPES
    assert list(types.offsets) == [0, 15, 21, 25, 45] and g.num_nodes == 45
    assert list(types.relations) == [*MAG_RELATIONS, *REVERSES]
    assert types.feat_dims == (0, 0, 0, 5)
    p = _papers(g)
    assert torch.equal(g.feat[p], torch.from_numpy(data["feat"]))
    assert not bool(g.feat[: p.start].any())
    assert torch.equal(g.label[p], torch.from_numpy(data["label"]))
    assert bool((g.label[: p.start] == -1).all())
    assert torch.equal(g.ndata["year"][p], torch.from_numpy(data["year"]))
    for part, key in (("train", "train_mask"), ("valid", "val_mask"), ("test", "test_mask")):
        assert torch.equal(torch.nonzero(g.ndata[key]).reshape(-1), torch.from_numpy(
            data["split"][part] + p.start))  # fmt: skip
    for rel, edges in data["edges"].items():
        listed = sorted(map(tuple, edges.tolist()))
        turned = sorted((d, s) for s, d in listed)
        if rel[0] == rel[2]:  # cites: both ways in the one relation
            assert relation_pairs(g, "___".join(rel)) == sorted(listed + turned)
        else:
            assert relation_pairs(g, "___".join(rel)) == listed
            rev = (rel[2], f"rev_{rel[1]}", rel[0])
            assert relation_pairs(g, "___".join(rev)) == turned
    # as shipped: the four relations exactly as listed
    plain = load("ogbn-mag", root=tmp_path, reverse=False)
    assert list(plain.types.relations) == list(MAG_RELATIONS)
    for rel, edges in data["edges"].items():
        assert relation_pairs(plain, "___".join(rel)) == sorted(map(tuple, edges.tolist()))
    assert plain.num_edges == sum(len(e) for e in data["edges"].values())


def test_ogbn_mag_folder_names_and_layout_variants(tmp_path: Path) -> None:
    data = write_ogbn_mag(tmp_path / "mag", triplet_list=False, year_folder="node_year")
    g = load("ogbn-mag", root=tmp_path)
    assert torch.equal(g.ndata["year"][_papers(g)], torch.from_numpy(data["year"]))
    assert list(g.types.relations)[:4] == list(MAG_RELATIONS)
    by_path = load(str(tmp_path / "mag"))  # a folder of the layout, by path
    assert by_path.name == "mag" and by_path.fingerprint() == g.fingerprint()
    with pytest.raises(FileNotFoundError, match=r"no ogbn-mag archive under .*ogbn_mag"):
        load("ogbn-mag", root=tmp_path / "empty")


def _break(path: Path, text: bytes | None = None) -> None:
    """Truncate a gzip file in the middle (``text`` None) or gzip ``text`` in its place."""
    if text is None:
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    else:
        path.write_bytes(gzip.compress(text))


@pytest.mark.parametrize(
    "where, text, match",
    [
        ("relations/paper___cites___paper/edge.csv.gz", None, r"cannot read"),
        ("relations/author___writes___paper/edge.csv.gz", b"1,2\n3\n", r"expected 2 rows"),
        ("relations/author___writes___paper/edge.csv.gz", b"1,2\n" * 31 + b"3,20\n", r"lie in"),
        ("relations/paper___cites___paper/num-edge-list.csv.gz", b"7\n", r"says 7 edges"),
        ("node-feat/paper/node-feat.csv.gz", b"0.5,1\n", r"1 rows for 20 nodes"),
        ("node-label/paper/node-label.csv.gz", b"x\n" * 20, r"cannot parse|expected 20 rows"),
        ("num-node-dict.csv.gz", b"author,paper\n3\n", r"header of node types"),
        ("num-node-dict.csv.gz", None, r"cannot read"),
        ("triplet-type-list.csv.gz", b"paper,cites,venue\n", r"not src___rel___dst"),
    ],
)
def test_ogbn_mag_damaged_file_is_one_line_naming_it(
    tmp_path: Path, where: str, text: bytes | None, match: str
) -> None:
    write_ogbn_mag(tmp_path / "ogbn-mag")
    path = tmp_path / "ogbn-mag" / "raw" / where
    _break(path, text)
    with pytest.raises(UserError, match=match) as err:
        load("ogbn-mag", root=tmp_path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message


def test_ogbn_mag_split_ids_out_of_range(tmp_path: Path) -> None:
    write_ogbn_mag(tmp_path / "ogbn-mag")
    path = tmp_path / "ogbn-mag" / "split" / "time" / "paper" / "test.csv.gz"
    _break(path, b"20\n")
    with pytest.raises(UserError, match=r"test.csv.gz: paper node ids must lie in \[0, 20\)"):
        read_ogb_typed(tmp_path / "ogbn-mag")


# ---------------------------------------------------------------------- the CLI
def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gnnpar")
    add_data_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_prepare_and_info_of_a_typed_graph(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = "num_papers=60,num_authors=30,seed=2"
    out = tmp_path / "mag-synth"
    assert _cli(["data", "prepare", "mag-synth", "--out", str(out), "--dataset-options",
                 options]) == 0  # fmt: skip
    assert "wrote" in capsys.readouterr().out
    stored = load_graph(out)
    assert stored.fingerprint() == mag_synth(num_papers=60, num_authors=30, seed=2).fingerprint()
    assert _cli(["data", "info", "mag-synth", "--root", str(tmp_path), "--dataset-options",
                 options]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "node types  author 30, field_of_study 80, institution 40, paper 60 (64 features)" in (
        text
    )
    assert "target      paper" in text
    assert "relations   author___affiliated_with___institution 30" in text
    assert "field_of_study___rev_has_topic___paper" in text
    write_ogbn_mag(tmp_path / "ogbn-mag")
    assert _cli(["data", "info", "ogbn-mag", "--root", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "classes     349" in text and "paper___cites___paper 48" in text
