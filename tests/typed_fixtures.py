"""A tiny ogbn-mag archive, written in exactly the layout OGB's ``mag.zip`` unpacks to, and
helpers to read a typed graph's relations back as type-local edge lists.

:func:`write_ogbn_mag` writes gzip CSV tables (``raw/num-node-dict.csv.gz`` with its header,
``raw/triplet-type-list.csv.gz``, ``raw/relations/<src>___<rel>___<dst>/{edge,num-edge-list,
edge_reltype}.csv.gz``, ``raw/node-feat/paper/{node-feat,node_year}.csv.gz``,
``raw/node-label/paper/node-label.csv.gz``, ``raw/nodetype-has-label.csv.gz`` and
``split/time/paper/{train,valid,test}.csv.gz`` with ``split/time/nodetype-has-split.csv.gz``)
and returns what it wrote (:func:`mag_arrays`, deterministic by ``seed``), for a test to
compare a loaded graph against. Load it with ``gnnpar.data.load("ogbn-mag", root=<parent>)``
(the folder is ``<parent>/ogbn-mag`` by default).
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "MAG_COUNTS",
    "mag_arrays",
    "relation_edges",
    "relation_pairs",
    "write_ogbn_mag",
]

#: Node counts of the tiny archive, in OGB's (sorted) type order.
MAG_COUNTS = {"author": 15, "field_of_study": 6, "institution": 4, "paper": 20}
#: Edges per relation (distinct pairs), in OGB's (sorted) relation order.
_EDGES = {
    ("author", "affiliated_with", "institution"): 15,
    ("author", "writes", "paper"): 32,
    ("paper", "cites", "paper"): 24,
    ("paper", "has_topic", "field_of_study"): 30,
}
FEAT_DIM = 5


def _pairs(rng: np.random.Generator, n_src: int, n_dst: int, count: int, loops: bool) -> np.ndarray:
    """``count`` distinct ``(src, dst)`` pairs in the order drawn; no self-loops unless
    ``loops`` (and, for cites, no pair in both directions, so symmetrising doubles them)."""
    seen: dict[tuple[int, int], None] = {}
    while len(seen) < count:
        s, d = int(rng.integers(n_src)), int(rng.integers(n_dst))
        if loops or (s != d and (d, s) not in seen):
            seen[(s, d)] = None
    return np.array(list(seen), dtype=np.int64).reshape(-1, 2)


def mag_arrays(seed: int = 0) -> dict[str, Any]:
    """What :func:`write_ogbn_mag` writes: ``counts``, ``edges`` (relation -> (E, 2) int64),
    ``feat`` (papers x 5, float32, exact in decimal), ``label`` (class ids < 349), ``year``
    and ``split`` (part -> paper ids: before 2018 train, 2018 valid, 2019 test)."""
    rng = np.random.default_rng(seed)
    n = MAG_COUNTS
    edges = {}
    for rel, count in _EDGES.items():
        if rel[1] == "affiliated_with":  # one institution per author
            edges[rel] = np.stack([np.arange(n["author"]), rng.integers(0, 4, n["author"])], 1)
        else:
            edges[rel] = _pairs(rng, n[rel[0]], n[rel[2]], count, rel[0] != rel[2])
    papers = n["paper"]
    year = np.concatenate([rng.integers(2010, 2018, papers - 6), [2018] * 3, [2019] * 3])
    year = rng.permutation(year).astype(np.int64)
    return {
        "counts": dict(n),
        "edges": edges,
        "feat": (rng.integers(-40, 40, (papers, FEAT_DIM)) / 8).astype(np.float32),
        "label": rng.integers(0, 349, papers).astype(np.int64),
        "year": year,
        "split": {
            "train": np.flatnonzero(year < 2018),
            "valid": np.flatnonzero(year == 2018),
            "test": np.flatnonzero(year == 2019),
        },
    }


def _gz(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.write(text)


def _table(path: Path, rows: np.ndarray, fmt: str = "%d") -> None:
    rows = np.asarray(rows).reshape(len(rows), -1)
    _gz(path, "".join(",".join(fmt % v for v in row) + "\n" for row in rows))


def write_ogbn_mag(
    folder: str | Path,
    seed: int = 0,
    triplet_list: bool = True,
    year_folder: str = "node-feat",
) -> dict[str, Any]:
    """Write a tiny ogbn-mag archive into ``folder`` (e.g. ``<root>/ogbn-mag``) and return
    :func:`mag_arrays`. ``triplet_list=False`` leaves out ``raw/triplet-type-list.csv.gz``
    (the relations are then the folders); ``year_folder="node_year"`` writes the years to
    ``raw/node_year/paper/node_year.csv.gz`` instead of OGB's ``raw/node-feat/paper/``."""
    data = mag_arrays(seed)
    raw, split = Path(folder) / "raw", Path(folder) / "split" / "time"
    types = ",".join(MAG_COUNTS)
    _gz(raw / "num-node-dict.csv.gz", f"{types}\n" + ",".join(map(str, MAG_COUNTS.values())) + "\n")
    if triplet_list:
        _gz(raw / "triplet-type-list.csv.gz", "".join(",".join(r) + "\n" for r in _EDGES))
    for i, (rel, edges) in enumerate(data["edges"].items()):
        rel_dir = raw / "relations" / "___".join(rel)
        _table(rel_dir / "edge.csv.gz", edges)
        _table(rel_dir / "num-edge-list.csv.gz", np.array([len(edges)]))
        _table(rel_dir / "edge_reltype.csv.gz", np.full(len(edges), i))
    _table(raw / "node-feat" / "paper" / "node-feat.csv.gz", data["feat"], "%.3f")
    _table(raw / year_folder / "paper" / "node_year.csv.gz", data["year"])
    _table(raw / "node-label" / "paper" / "node-label.csv.gz", data["label"])
    flags = ",".join("True" if t == "paper" else "False" for t in MAG_COUNTS)
    _gz(raw / "nodetype-has-label.csv.gz", f"{types}\n{flags}\n")
    _gz(split / "nodetype-has-split.csv.gz", f"{types}\n{flags}\n")
    for part, ids in data["split"].items():
        _table(split / "paper" / f"{part}.csv.gz", ids)
    return data


def relation_edges(graph: Any, rel: str) -> np.ndarray:
    """A typed graph's edges of relation ``rel`` (a triple name or an unambiguous relation
    name) as ``(E, 2)`` type-local ``(src, dst)`` ids, in CSR order."""
    types = graph.types
    r = types.relation_index(rel)
    src, dst = graph.edges()
    keep = types.edge_type == r
    ends = [
        types.local_ids_of(types.original_ids(nodes[keep])) for nodes in (src, dst)
    ]  # fmt: skip
    return torch.stack(ends, 1).numpy()


def relation_pairs(graph: Any, rel: str) -> list[tuple[int, int]]:
    """:func:`relation_edges` as a sorted list of pairs (duplicates kept)."""
    return sorted(map(tuple, relation_edges(graph, rel).tolist()))
