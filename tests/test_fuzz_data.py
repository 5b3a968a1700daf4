"""Property-based tests of the graph validator and the graph- and partition-folder readers:
every input ends in a clear ValueError (FormatError is one) or in a correct result, never in
another exception or a silently changed load."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import partitioners
from gnnpar.data import load_graph, save_graph, sbm
from gnnpar.graph import Graph
from gnnpar.verified import meta_digest

FUZZ = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=5,
)


def _clear(err: Exception) -> None:
    text = str(err)
    assert text and "\n" not in text, repr(text)


# ---------------------------------------------------------------------- the validator


@st.composite
def raw_graphs(draw):
    """Mostly well-formed CSR graphs with node data, some with one structural defect."""
    n = draw(st.integers(0, 6))
    degrees = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    indptr = np.concatenate([[0], np.cumsum(degrees, dtype=np.int64)]).tolist()
    high = max(n - 1, 0)
    indices = draw(st.lists(st.integers(0, high), min_size=indptr[-1], max_size=indptr[-1]))
    defect = draw(st.sampled_from(["none", "none", "indptr", "indices", "length"]))
    if defect == "indptr" and len(indptr) > 1:
        indptr[draw(st.integers(0, len(indptr) - 1))] = draw(st.integers(-2, 12))
    elif defect == "indices" and indices:
        indices[draw(st.integers(0, len(indices) - 1))] = draw(st.sampled_from([-1, n, n + 5]))
    elif defect == "length":
        indices.append(0)
    ndata = {}
    if draw(st.booleans()):
        rows = draw(st.sampled_from([n, n, max(n - 1, 0)]))
        kind = draw(st.sampled_from(["int", "int", "float"]))
        if kind == "int":
            values = draw(st.lists(st.integers(-2, 5), min_size=rows, max_size=rows))
            ndata["label"] = torch.tensor(values, dtype=torch.int64)
        else:
            values = draw(st.lists(st.floats(-2, 5, width=16), min_size=rows, max_size=rows))
            ndata["label"] = torch.tensor(values, dtype=torch.float32)
    for key in ("train_mask", "test_mask"):
        if draw(st.booleans()):
            bits = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
            ndata[key] = torch.tensor(bits, dtype=torch.int64)
    classes = draw(st.none() | st.integers(-1, 6))
    return indptr, indices, n, ndata, classes


@FUZZ
@given(raw_graphs())
def test_validator_gives_a_clean_error_or_a_valid_graph(raw):
    indptr, indices, n, ndata, classes = raw
    try:
        g = Graph(indptr, indices, n, ndata=ndata, num_classes=classes)
    except ValueError as err:
        _clear(err)
        return
    g.validate()  # a graph that was accepted stays valid
    assert g.indptr.numel() == n + 1 and int(g.indptr[-1]) == g.num_edges
    assert g.num_edges == 0 or 0 <= int(g.indices.min()) <= int(g.indices.max()) < n
    if "label" in ndata and classes is not None:
        assert not g.label.is_floating_point() and bool((g.label < classes).all())
    if "train_mask" in ndata and "test_mask" in ndata:
        assert not bool((g.train_mask.bool() & g.test_mask.bool()).any())


# ---------------------------------------------------------------------- folder damage


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


@st.composite
def damage(draw, count: int):
    """One of: truncate a file, flip one bit of a file, edit a meta value (resealed or not)."""
    kind = draw(st.sampled_from(["truncate", "flip", "meta", "meta", "forge"]))
    index = draw(st.integers(0, count - 1))
    where = draw(st.floats(0, 1, exclude_max=True))
    bit = draw(st.integers(0, 7))
    value = draw(st.just(_NUDGE) | JSON_VALUES)
    return kind, index, where, bit, value


_NUDGE = "<nudge>"  # edit the value in kind (a count + 1, a string changed, a flag flipped)


def _nudged(old):
    if isinstance(old, bool):
        return not old
    if isinstance(old, int):
        return old + 1
    if isinstance(old, str):
        return old + "x"
    if isinstance(old, list):
        return old[:-1]
    if isinstance(old, dict):
        return {k: _nudged(v) for k, v in old.items()}
    return 0


def _apply(folder: Path, kind: str, index: int, where: float, bit: int, value, key: str) -> None:
    if kind in ("truncate", "flip"):
        path = _files(folder)[index % len(_files(folder))]
        data = bytearray(path.read_bytes())
        at = int(where * len(data))
        if kind == "truncate":
            del data[at:]
        elif data:
            data[at] ^= 1 << bit
        path.write_bytes(bytes(data))
        return
    manifest = folder / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["meta"][key] = _nudged(doc["meta"].get(key)) if value == _NUDGE else value
    if kind == "forge":  # a manifest rewritten with a valid seal: only the checks stand
        doc["meta_xxh3_64"] = meta_digest(doc["meta"])
    manifest.write_text(json.dumps(doc))


def _same_graph(a: Graph, b: Graph) -> bool:
    same = a.num_nodes == b.num_nodes and a.name == b.name and a.num_classes == b.num_classes
    same = same and torch.equal(a.indptr, b.indptr) and torch.equal(a.indices, b.indices)
    same = same and sorted(a.ndata) == sorted(b.ndata)
    return same and all(
        a.ndata[k].dtype == b.ndata[k].dtype and torch.equal(a.ndata[k], b.ndata[k])
        for k in a.ndata
    )


@pytest.fixture(scope="module")
def graph_folder(tmp_path_factory):
    g = sbm(num_nodes=60, feat_dim=3, seed=1)
    return g, save_graph(g, tmp_path_factory.mktemp("fuzz") / "g")


GRAPH_KEYS = ["name", "num_nodes", "num_edges", "weighted", "num_classes", "fingerprint", "arrays"]


@FUZZ
@given(damage(count=8), st.sampled_from(GRAPH_KEYS))
def test_graph_folder_reader_errors_cleanly_or_loads_what_was_written(graph_folder, hurt, key):
    graph, folder = graph_folder
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "g"
        shutil.copytree(folder, copy)
        _apply(copy, *hurt, key=key)
        try:
            back = load_graph(copy, mmap=False)
        except ValueError as err:
            _clear(err)
            return
        if hurt[0] != "forge":  # unsealed damage is never loaded as something else
            assert _same_graph(back, graph)


@pytest.fixture(scope="module")
def partition_folder(tmp_path_factory):
    g = sbm(num_nodes=60, feat_dim=3, seed=1)
    out = tmp_path_factory.mktemp("fuzz") / "p"
    partitioners.write(g, partitioners.partition(g, 2, method="random"), out)
    parts = [partitioners.load_part(out, k, mmap=False) for k in range(2)]
    return out, parts, partitioners.load_node_map(out, mmap=False)


PART_KEYS = ["num_parts", "num_nodes", "num_edges", "halo_hops", "node_ranges", "parts"]
PART_KEYS += ["ndata", "weighted", "source"]
ARRAYS = ["indptr", "indices", "edge_ids", "local_to_global", "orig_ids"]


def _same_part(a, b) -> bool:
    same = a.node_range == b.node_range and a.num_owned == b.num_owned
    same = same and all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ARRAYS)
    same = same and sorted(a.ndata) == sorted(b.ndata)
    return same and all(np.array_equal(a.ndata[k], b.ndata[k]) for k in a.ndata)


@settings(FUZZ, max_examples=25)
@given(damage(count=40), st.sampled_from(PART_KEYS))
def test_partition_reader_errors_cleanly_or_loads_what_was_written(partition_folder, hurt, key):
    folder, parts, node_map = partition_folder
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "p"
        shutil.copytree(folder, copy)
        _apply(copy, *hurt, key=key)
        for k, want in enumerate(parts):
            try:
                got = partitioners.load_part(copy, k, mmap=False)
            except ValueError as err:
                _clear(err)
                continue
            if hurt[0] != "forge":
                assert _same_part(got, want)
        try:
            got_map = partitioners.load_node_map(copy, mmap=False)
        except ValueError as err:
            _clear(err)
            return
        if hurt[0] != "forge":
            assert np.array_equal(got_map, node_map)
