"""Property-based tests of the shard-folder reader: truncated files, flipped bits and edited
manifest values end in one clear FormatError/ValueError naming the folder, or in a load equal
to what was written; never another exception, never a silently changed result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gnnpar.graph import Graph
from gnnpar.models.fullgraph.shards import DiskSource, prepare_shards
from tests.fullgraph_utils import small_graph
from tests.fuzz_folders import check_outcome, flip_bit, truncate

N = 23
FUZZ = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _read_all(path: Path) -> dict[str, torch.Tensor]:
    """Everything a shard folder holds, through the reader (every file is mapped)."""
    src = DiskSource(path)
    whole = (0, src.num_nodes)
    out = {"features": src.features(whole, (0, src.feat_dim))}
    for parity in (0, 1):
        out[f"adj{parity}"] = src.adjacency(parity, whole, whole).to_dense()
        out[f"root{parity}"] = src.root(parity, whole, whole).to_dense()
        out[f"ids{parity}"] = src.node_ids(parity, whole)
        for name in src.meta["node_data"]:
            out[f"{name}{parity}"] = src.node_data(name, parity, whole)
    out["shape"] = torch.tensor([src.num_nodes, src.feat_dim, src.num_classes])
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], list[str]]:
    a, x, y, train = small_graph(n=N, feat=5)
    src, dst = a.nonzero(as_tuple=True)
    graph = Graph.from_edges(
        src, dst, num_nodes=N, ndata={"feat": x.float(), "label": y, "train_mask": train}
    )
    folder = prepare_shards(graph, tmp_path_factory.mktemp("fuzz") / "s", blocks=(2, 3), seed=3)
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return folder, _read_all(folder), names


def _outcome(pristine, mutate) -> None:
    """Copy the folder, ``mutate(copy)``, read it: a clear error or the written data."""
    folder, want, _ = pristine
    check_outcome(folder, _read_all, want, mutate)


@FUZZ
@given(data=st.data())
def test_truncated_file(pristine, data):
    _outcome(pristine, truncate(data, data.draw(st.sampled_from(pristine[2]))))


@FUZZ
@given(data=st.data())
def test_flipped_bit(pristine, data):
    _outcome(pristine, flip_bit(data, data.draw(st.sampled_from(pristine[2]))))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=6,
)


def _near(value):
    """Plausible edits of ``value``: an integer moved a little, one element of a list of
    integers moved, anything of the same kind."""
    if isinstance(value, int) and not isinstance(value, bool):
        return st.integers(value - 3, value + 3)
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return st.tuples(st.integers(0, len(value) - 1), st.integers(-2, 2)).map(
            lambda t: [v + (t[1] if k == t[0] else 0) for k, v in enumerate(value)]
        )
    return _JSON


@settings(FUZZ, max_examples=50)
@given(data=st.data())
def test_edited_manifest_value(pristine, data):
    doc = json.loads((pristine[0] / "manifest.json").read_text())
    table = data.draw(st.sampled_from(["meta", "files", "top"]))
    if table == "top":
        key = data.draw(st.sampled_from(sorted(doc)))
        target = doc
    else:
        key = data.draw(st.sampled_from(sorted(doc[table])))
        target = doc[table]
    keep_value = data.draw(st.booleans())
    target[key] = target[key] if keep_value else data.draw(_near(target[key]) | _JSON)

    def edit(copy: Path) -> None:
        (copy / "manifest.json").write_text(json.dumps(doc))

    _outcome(pristine, edit)
