"""Link-prediction data: the OGB link-property archives and the link split converters.

Tiny archives in exactly the layout OGB's ``ogbl-*`` zips unpack to (``tests/link_fixtures.py``)
load by catalogue name, from each folder name a data root may use, as the message-passing
graph with the official split; a split file that would run code is refused before anything
in it runs, and every malformed one is one line naming the file and the key. PyG's
``RandomLinkSplit`` outputs and DGL edge masks become the same split (every positive and
negative pair kept), and a split survives a DGL round trip and a graph folder.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from gnnpar.cli.data import add_data_commands
from gnnpar.data import load, load_graph, save_graph, sbm
from gnnpar.data.catalogue import get_entry, load_path
from gnnpar.data.ogbl import find_ogbl, ogbl_datasets, read_split_file
from gnnpar.errors import UserError
from gnnpar.graph import Graph, convert
from gnnpar.graph.edge_split import edge_keys, split_edges
from gnnpar.verified import FormatError, UnsafeContentError
from tests.link_fixtures import (
    citation2_arrays,
    collab_arrays,
    ppa_arrays,
    write_ogbl_citation2,
    write_ogbl_collab,
    write_ogbl_ppa,
)

N = 120
WRITERS = {
    "ogbl-collab": (write_ogbl_collab, collab_arrays),
    "ogbl-ppa": (write_ogbl_ppa, ppa_arrays),
    "ogbl-citation2": (write_ogbl_citation2, citation2_arrays),
}
#: Each dataset in each folder name a data root may hold it in.
FOLDERS = [
    ("ogbl-collab", "ogbl-collab"),
    ("ogbl-collab", "ogbl_collab"),
    ("ogbl-collab", "collab"),
    ("ogbl-ppa", "ogbl-ppa"),
    ("ogbl-ppa", "ppa"),
    ("ogbl-citation2", "ogbl-citation2"),
    ("ogbl-citation2", "citation-v2"),
]
PROTOCOLS = {
    "ogbl-collab": ("pairs", "hits@50", "time"),
    "ogbl-ppa": ("pairs", "hits@100", "throughput"),
    "ogbl-citation2": ("per-source", "mrr", "time"),
}


def _write(root: Path, name: str, folder: str | None = None) -> Path:
    return WRITERS[name][0](root, num_nodes=N, seed=1, folder=folder or name)


def _pair_set(pairs: torch.Tensor | np.ndarray) -> set[tuple[int, int]]:
    """The ``(2, E)`` pairs as a set of ``(src, dst)``."""
    a = torch.as_tensor(pairs)
    return set(zip(a[0].tolist(), a[1].tolist(), strict=True))


def _pair_list(pairs: torch.Tensor) -> list[tuple[int, int]]:
    return sorted(zip(pairs[0].tolist(), pairs[1].tolist(), strict=True))


def _data_command(argv: list[str]) -> int:
    """``gnnpar data ...`` (the data commands alone: the whole CLI takes seconds to set up)."""
    parser = argparse.ArgumentParser(prog="gnnpar")
    add_data_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


# ---------------------------------------------------------------------- OGB archives


@pytest.mark.parametrize(("name", "folder"), FOLDERS)
def test_archive_loads_by_name_with_its_split(tmp_path: Path, name: str, folder: str) -> None:
    written = _write(tmp_path, name, folder)
    assert find_ogbl(tmp_path, name) == written
    data = WRITERS[name][1](N, 1)
    part = data["split"]
    g = load(name, root=tmp_path)
    split = g.edge_split
    protocol, metric, scheme = PROTOCOLS[name]
    assert g.name == name and g.num_nodes == N
    assert (split.protocol, split.metric) == (protocol, metric)
    assert split.how == {"method": "ogb", "dataset": name, "scheme": scheme}
    entry = get_entry(name)
    assert entry is not None and entry.needs_files and entry.metric == metric
    # the positives and negatives exactly as the files list them
    if protocol == "pairs":
        want = {"train": part["train"]["edge"].T, "val": part["valid"]["edge"].T,
                "test": part["test"]["edge"].T, "val_neg": part["valid"]["edge_neg"].T,
                "test_neg": part["test"]["edge_neg"].T}  # fmt: skip
    else:
        want = {
            key: np.stack([part[p]["source_node"], part[p]["target_node"]])
            for key, p in (("train", "train"), ("val", "valid"), ("test", "test"))
        }
        want["val_neg"] = part["valid"]["target_node_neg"]
        want["test_neg"] = part["test"]["target_node_neg"]
        assert split.val_neg.shape == (split.val.shape[1], 20)
        assert torch.equal(g.ndata["year"], torch.from_numpy(data["year"]))
    for key, array in want.items():
        got = getattr(split, key)
        assert got.dtype == torch.int64 and torch.equal(got, torch.from_numpy(array)), key
    # the message-passing graph: the training pairs in both directions, nothing else
    train = _pair_set(want["train"])
    assert _pair_set(torch.stack(g.edges())) == train | {(d, s) for s, d in train}
    assert g.is_symmetric() and g.edge_weight is None
    np.testing.assert_allclose(g.feat.numpy(), data["feat"], rtol=1e-5, atol=1e-5)
    # the source: every positive, both directions
    every = set().union(*(_pair_set(want[k]) for k in ("train", "val", "test")))
    every |= {(d, s) for s, d in every}
    assert split.source["num_edges"] == len(every) and split.source["num_nodes"] == N


def test_a_folder_loads_by_path_and_a_missing_archive_is_named(tmp_path: Path) -> None:
    folder = _write(tmp_path, "ogbl-ppa", "ppa")
    assert load_path(folder).edge_split.metric == "hits@100"
    other = _write(tmp_path, "ogbl-ppa", "my-links")
    with pytest.raises(UserError, match=r"pass name="):
        load_path(other)
    assert load_path(other, name="ogbl-ppa").edge_split.protocol == "pairs"
    with pytest.raises(FileNotFoundError, match="ogbl_collab"):
        load("ogbl-collab", root=tmp_path)


def test_files_of_numpy_1_and_the_legacy_torch_format_load(tmp_path: Path) -> None:
    """OGB wrote its split files years ago: numpy 1 names ``numpy.core.multiarray``, older
    torch wrote a plain pickle stream instead of a zip."""
    folder = _write(tmp_path, "ogbl-collab")
    want = load("ogbl-collab", root=tmp_path).edge_split.digest()
    for part in ("train", "valid", "test"):
        path = folder / "split" / "time" / f"{part}.pt"
        torch.save(read_split_file(path), path, _use_new_zipfile_serialization=False)
        raw = path.read_bytes()
        assert b"numpy._core.multiarray" in raw or b"numpy.core.multiarray" in raw
        path.write_bytes(raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))
    assert load("ogbl-collab", root=tmp_path).edge_split.digest() == want


class _Payload:
    """A pickled object whose unpickling calls ``os.system``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def test_a_split_file_that_runs_code_is_refused_before_it_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder = _write(tmp_path, "ogbl-collab")
    path = folder / "split" / "time" / "valid.pt"
    marker = tmp_path / "ran"
    good = read_split_file(path)
    torch.save({**good, "edge_neg": _Payload(marker)}, path)
    # the payload is live: an unrestricted load runs it
    torch.load(path, weights_only=False)
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UnsafeContentError) as info:
        load("ogbl-collab", root=tmp_path)
    text = _one_line(info.value)
    assert str(path) in text and f"{os.system.__module__}.system" in text, text
    assert not marker.exists()
    # the command line: one line, exit status 2, nothing run
    assert _data_command(["data", "info", "ogbl-collab", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err, err
    assert not marker.exists()


def _edit(path: Path, **changes) -> None:
    data = read_split_file(path)
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    torch.save(data, path)


BAD_FILES = {
    "missing key": ("ogbl-collab", "valid", {"edge_neg": None}, "'edge_neg'"),
    "wrong shape": ("ogbl-ppa", "test", {"edge": np.zeros((5, 3), np.int64)}, "shape (5, 3)"),
    "float ids": ("ogbl-ppa", "train", {"edge": np.zeros((5, 2))}, "dtype float64"),
    "id out of range": ("ogbl-collab", "train", {"edge": np.full((2, 2), N)}, "outside"),
    "object array": ("ogbl-ppa", "valid", {"edge": np.array([1, "x"], dtype=object)}, "refusing"),
    "missing source": ("ogbl-citation2", "train", {"source_node": None}, "'source_node'"),
    "negatives per source": (
        "ogbl-citation2",
        "test",
        {"target_node_neg": np.zeros((1, 20), np.int64)},
        "'target_node_neg' has 1 rows",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_malformed_split_file_is_one_line_naming_file_and_key(tmp_path: Path, case: str) -> None:
    name, part, changes, words = BAD_FILES[case]
    folder = _write(tmp_path, name)
    path = folder / "split" / PROTOCOLS[name][2] / f"{part}.pt"
    _edit(path, **changes)
    with pytest.raises(UserError) as info:
        load(name, root=tmp_path)
    text = _one_line(info.value)
    assert str(path) in text and words in text, text


@pytest.mark.parametrize("how", ["truncated", "not a dict", "empty", "missing"])
def test_a_damaged_split_file_is_one_line(tmp_path: Path, how: str) -> None:
    folder = _write(tmp_path, "ogbl-ppa")
    path = folder / "split" / "throughput" / "valid.pt"
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "not a dict":
        torch.save(np.arange(4), path)
    elif how == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()
    error = FileNotFoundError if how == "missing" else FormatError
    with pytest.raises(error) as info:
        load("ogbl-ppa", root=tmp_path)
    assert str(path) in _one_line(info.value)


@pytest.mark.parametrize("name", list(WRITERS))
def test_a_saved_archive_keeps_its_split(tmp_path: Path, name: str) -> None:
    g = load(name, root=_write(tmp_path, name).parent)
    save_graph(g, tmp_path / "saved")
    back = load_graph(tmp_path / "saved")
    assert back.fingerprint() == g.fingerprint()
    a, b = g.edge_split, back.edge_split
    assert b.digest() == a.digest() and b.record() == a.record()
    assert (b.protocol, b.metric, b.source, b.how) == (a.protocol, a.metric, a.source, a.how)


def test_the_catalogue_lists_the_link_benchmarks(capsys: pytest.CaptureFixture) -> None:
    assert _data_command(["data", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, spec in ogbl_datasets().items():
        line = next(line for line in lines if line.startswith(name + " "))
        assert f"metric {spec.metric}" in line and spec.split in line, line


# ---------------------------------------------------------------------- PyG


@pytest.mark.parametrize("undirected", [True, False])
@pytest.mark.parametrize("split_labels", [False, True])
def test_pyg_random_link_split_keeps_every_pair(undirected: bool, split_labels: bool) -> None:
    from torch_geometric.transforms import RandomLinkSplit

    data = sbm(num_nodes=150, seed=2).to_pyg()
    torch.manual_seed(0)
    transform = RandomLinkSplit(
        num_val=0.1, num_test=0.2, is_undirected=undirected, split_labels=split_labels
    )
    parts = transform(data)
    g = convert.from_pyg_link_split(*parts, name="sbm-links")
    split = g.edge_split
    assert (split.protocol, split.metric, split.how["symmetric"]) == ("pairs", "rocauc", undirected)
    for part, pos_key, neg_key in zip(parts, ("train", "val", "test"),
                                      (None, "val_neg", "test_neg"), strict=True):  # fmt: skip
        if split_labels:
            pos, neg = part.pos_edge_label_index, part.neg_edge_label_index
        else:
            pos = part.edge_label_index[:, part.edge_label == 1]
            neg = part.edge_label_index[:, part.edge_label == 0]
        assert _pair_list(getattr(split, pos_key)) == _pair_list(pos), pos_key
        if neg_key is not None:
            assert neg.shape[1] > 0
            assert _pair_list(getattr(split, neg_key)) == _pair_list(neg), neg_key
    # the message-passing graph is train_data's edge_index, its node data kept
    assert _pair_list(torch.stack(g.edges())) == _pair_list(parts[0].edge_index)
    assert torch.equal(g.feat, data.x) and torch.equal(g.label, data.y)
    assert "edge_label" not in g.ndata and g.num_classes == data.num_classes


def test_pyg_link_split_refusals() -> None:
    from torch_geometric.data import HeteroData
    from torch_geometric.transforms import RandomLinkSplit

    parts = list(RandomLinkSplit(num_val=0.1, num_test=0.2)(sbm(num_nodes=60).to_pyg()))
    with pytest.raises(UserError, match="heterogeneous"):
        convert.from_pyg_link_split(HeteroData(), *parts[1:])
    bad = parts[1].clone()
    bad.edge_label = bad.edge_label * 2
    with pytest.raises(UserError, match="other than 0 and 1"):
        convert.from_pyg_link_split(parts[0], bad, parts[2])
    with pytest.raises(UserError, match="no edge_label_index"):
        convert.from_pyg_link_split(parts[0], sbm(num_nodes=60).to_pyg(), parts[2])


# ---------------------------------------------------------------------- DGL


def _same_structure(a: Graph, b: Graph) -> None:
    a, b = a.coalesce(), b.coalesce()
    assert torch.equal(a.indptr, b.indptr) and torch.equal(a.indices, b.indices)


@pytest.mark.parametrize("directed", [False, True])
def test_dgl_masks_round_trip_keeps_the_split(tmp_path: Path, directed: bool) -> None:
    dgl = pytest.importorskip("dgl")
    whole = sbm(num_nodes=200, seed=4)
    if directed:  # keep one direction of each edge
        src, dst = whole.edges()
        keep = src < dst
        whole = Graph.from_edges(src[keep], dst[keep], whole.num_nodes, ndata=whole.ndata)
    message = split_edges(whole, val=0.1, test=0.1, seed=3)
    g = convert.to_dgl_link(message)
    # as dgl.save_graphs stores it (bool masks become uint8)
    dgl.save_graphs(str(tmp_path / "g.bin"), [g])
    g = dgl.load_graphs(str(tmp_path / "g.bin"))[0][0]
    back = convert.from_dgl_link(g, seed=7)
    a, b = message.edge_split, back.edge_split
    for key in ("train", "val", "test"):
        assert torch.equal(getattr(b, key), getattr(a, key)), key
    _same_structure(back, message)
    assert back.ndata.keys() == message.ndata.keys() and torch.equal(back.feat, message.feat)
    assert back.train_mask.dtype == torch.bool
    # new negatives: one per positive, none an edge, drawn by the seed
    n = whole.num_nodes
    assert b.val_neg.shape == a.val.shape and b.test_neg.shape == a.test.shape
    src, dst = whole.edges()
    edges = set(edge_keys(src, dst, n).tolist()) | set(edge_keys(dst, src, n).tolist())
    negatives = torch.cat([b.val_neg, b.test_neg], dim=1)
    assert not set(edge_keys(negatives[0], negatives[1], n).tolist()) & edges
    assert torch.equal(convert.from_dgl_link(g, seed=7).edge_split.val_neg, b.val_neg)
    assert not torch.equal(convert.from_dgl_link(g, seed=8).edge_split.val_neg, b.val_neg)
    assert b.how["symmetric"] is not directed and b.metric == "rocauc"


def test_dgl_masks_of_a_hand_made_graph_and_refusals() -> None:
    dgl = pytest.importorskip("dgl")
    # a 6-cycle, both directions; (0,1), (1,2), (2,3) train, (3,4) val, (4,5) test, (5,0) none
    ring = [(i, (i + 1) % 6) for i in range(6)]
    src = torch.tensor([s for s, _ in ring] + [d for _, d in ring])
    dst = torch.tensor([d for _, d in ring] + [s for s, _ in ring])
    g = dgl.graph((src, dst), num_nodes=6)
    part = torch.tensor([0, 0, 0, 1, 2, 3] * 2)
    for i, key in enumerate(("train_mask", "val_mask", "test_mask")):
        g.edata[key] = part == i
    g.ndata["feat"] = torch.eye(6)
    out = convert.from_dgl_link(g)
    assert _pair_set(torch.stack(out.edges())) == {(0, 1), (1, 2), (2, 3), (1, 0), (2, 1), (3, 2)}
    split = out.edge_split
    assert split.train.tolist() == [[0, 1, 2], [1, 2, 3]]
    assert split.val.tolist() == [[3], [4]] and split.test.tolist() == [[4], [5]]
    with pytest.raises(UserError, match=r"no edge mask edata\['valid'\]"):
        convert.from_dgl_link(g, val_key="valid")
    g.edata["val_mask"] = part <= 1
    with pytest.raises(UserError, match=r"edge 0 \(0 -> 1\) is in both"):
        convert.from_dgl_link(g)
    hetero = dgl.heterograph({("a", "x", "b"): ([0], [0]), ("b", "y", "a"): ([0], [0])})
    with pytest.raises(UserError, match="heterogeneous"):
        convert.from_dgl_link(hetero)
    with pytest.raises(UserError, match="has no edge split"):
        convert.to_dgl_link(sbm(num_nodes=30))
    message = split_edges(sbm(num_nodes=60), seed=1)
    message.edge_split.train = torch.tensor([[0], [0]])  # a self loop: no message edge
    with pytest.raises(UserError, match="not an edge of the message-passing graph"):
        convert.to_dgl_link(message)
