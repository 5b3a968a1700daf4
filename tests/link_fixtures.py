"""Small OGB link-property archives, written in exactly the layout OGB's ``ogbl-*`` zips unpack
to (``raw/*.csv.gz`` tables, ``split/<scheme>/{train,valid,test}.pt`` as ``torch.save`` files of
dicts of numpy arrays), with links that can be predicted.

The graphs are stochastic block models: every node belongs to one of ``BLOCKS`` blocks, most
edges join two nodes of one block, and the node features are the block's mean plus noise, so
both the structure (common neighbours) and the features tell a held-out edge from a random
pair. :func:`collab_arrays`, :func:`ppa_arrays` and :func:`citation2_arrays` return what the
writers write (deterministic by ``seed``), for a test to compare a loaded graph against.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "BLOCKS",
    "blocks_of",
    "citation2_arrays",
    "collab_arrays",
    "ppa_arrays",
    "write_ogbl_citation2",
    "write_ogbl_collab",
    "write_ogbl_ppa",
]

#: Blocks of the planted partition.
BLOCKS = 4
#: Share of the edges inside a block.
INSIDE = 0.9
FEAT_DIM = 8


def blocks_of(num_nodes: int, seed: int = 0) -> np.ndarray:
    """The block of every node (balanced, shuffled by ``seed``)."""
    rng = np.random.default_rng([seed, 1])
    return rng.permutation(np.arange(num_nodes) % BLOCKS)


def _features(blocks: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 2])
    means = rng.normal(size=(BLOCKS, FEAT_DIM))
    return (means[blocks] + 0.5 * rng.normal(size=(len(blocks), FEAT_DIM))).astype(np.float32)


def _block_pairs(blocks: np.ndarray, count: int, seed: int) -> np.ndarray:
    """``count`` distinct unordered pairs ``(u, v)``, ``u != v``, each inside one block with
    probability :data:`INSIDE`, in the order drawn; ``(count, 2)`` int64."""
    rng = np.random.default_rng([seed, 3])
    n = len(blocks)
    members = [np.flatnonzero(blocks == b) for b in range(BLOCKS)]
    seen: set[tuple[int, int]] = set()
    out: list[tuple[int, int]] = []
    while len(out) < count:
        u = int(rng.integers(n))
        if rng.random() < INSIDE:
            v = int(rng.choice(members[blocks[u]]))
        else:
            v = int(rng.integers(n))
        key = (min(u, v), max(u, v))
        if u != v and key not in seen:
            seen.add(key)
            out.append((u, v))
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def _non_edges(edges: np.ndarray, num_nodes: int, count: int, seed: int) -> np.ndarray:
    """``count`` random pairs ``(u, v)``, ``u != v``, neither direction an edge; (count, 2)."""
    rng = np.random.default_rng([seed, 4])
    taken = {(int(u), int(v)) for u, v in edges} | {(int(v), int(u)) for u, v in edges}
    out: list[tuple[int, int]] = []
    while len(out) < count:
        u, v = (int(x) for x in rng.integers(num_nodes, size=2))
        if u != v and (u, v) not in taken:
            out.append((u, v))
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def _cut(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """80 / 10 / 10 % of the pairs, in order (the latest last)."""
    n_val = n_test = max(1, len(pairs) // 10)
    n_train = len(pairs) - n_val - n_test
    return pairs[:n_train], pairs[n_train : n_train + n_val], pairs[n_train + n_val :]


def collab_arrays(num_nodes: int = 200, seed: int = 0) -> dict[str, Any]:
    """What :func:`write_ogbl_collab` writes: ``feat`` and the three split dicts (a few pairs
    of the training edges collaborate again in a later year, as in ogbl-collab)."""
    blocks = blocks_of(num_nodes, seed)
    pairs = _block_pairs(blocks, 4 * num_nodes, seed)
    train, val, test = _cut(pairs)
    rng = np.random.default_rng([seed, 5])
    again = train[rng.choice(len(train), size=max(1, len(train) // 20), replace=False)]
    train = np.concatenate([train, again])
    year = np.concatenate([np.full(len(train) - len(again), 2015), np.full(len(again), 2017)])
    negatives = _non_edges(pairs, num_nodes, len(val) + len(test), seed)
    split = {
        "train": {"edge": train, "weight": np.ones(len(train), np.int64), "year": year},
        "valid": {"edge": val, "edge_neg": negatives[: len(val)]},
        "test": {"edge": test, "edge_neg": negatives[len(val) :]},
    }
    for part, year_of in (("valid", 2018), ("test", 2019)):
        n = len(split[part]["edge"])
        split[part].update(weight=np.ones(n, np.int64), year=np.full(n, year_of, np.int64))
    return {"feat": _features(blocks, seed), "split": split, "blocks": blocks}


def ppa_arrays(num_nodes: int = 200, seed: int = 0) -> dict[str, Any]:
    """What :func:`write_ogbl_ppa` writes: one-hot ``feat`` (the block, as ogbl-ppa's
    species) and the three split dicts."""
    blocks = blocks_of(num_nodes, seed)
    pairs = _block_pairs(blocks, 4 * num_nodes, seed)
    train, val, test = _cut(pairs)
    negatives = _non_edges(pairs, num_nodes, 2 * (len(val) + len(test)), seed)
    cut = 2 * len(val)
    split = {
        "train": {"edge": train},
        "valid": {"edge": val, "edge_neg": negatives[:cut]},
        "test": {"edge": test, "edge_neg": negatives[cut:]},
    }
    feat = np.eye(BLOCKS, dtype=np.float32)[blocks]
    return {"feat": feat, "split": split, "blocks": blocks}


def citation2_arrays(num_nodes: int = 200, seed: int = 0, num_negatives: int = 20) -> dict:
    """What :func:`write_ogbl_citation2` writes: ``feat``, ``year`` and the three split dicts.
    Papers cite older papers (source newer than target); validation and test hold one
    citation of each of some recent papers, each with ``num_negatives`` negative targets."""
    blocks = blocks_of(num_nodes, seed)
    rng = np.random.default_rng([seed, 6])
    year = np.sort(rng.integers(2000, 2020, size=num_nodes))  # node i is no older than i - 1
    pairs = _block_pairs(blocks, 4 * num_nodes, seed)
    src, dst = pairs.max(axis=1), pairs.min(axis=1)  # the newer paper cites the older
    # one held-out citation of each of the newest sources: the last one it makes
    recent = np.unique(src[src >= num_nodes * 3 // 4])
    held = np.array([np.flatnonzero(src == s)[-1] for s in recent], dtype=np.int64)
    rng.shuffle(held)
    val_idx, test_idx = held[: len(held) // 2], held[len(held) // 2 :]
    train_idx = np.setdiff1d(np.arange(len(src)), held)
    taken = {(int(s), int(d)) for s, d in zip(src, dst, strict=True)}

    def negatives(sources: np.ndarray) -> np.ndarray:
        out = np.empty((len(sources), num_negatives), dtype=np.int64)
        for i, s in enumerate(sources):
            row = []
            while len(row) < num_negatives:
                d = int(rng.integers(num_nodes))
                if d != s and (int(s), d) not in taken:
                    row.append(d)
            out[i] = row
        return out

    split: dict[str, dict[str, np.ndarray]] = {
        "train": {"source_node": src[train_idx], "target_node": dst[train_idx]}
    }
    for part, idx in (("valid", val_idx), ("test", test_idx)):
        split[part] = {
            "source_node": src[idx],
            "target_node": dst[idx],
            "target_node_neg": negatives(src[idx]),
        }
    return {"feat": _features(blocks, seed), "year": year, "split": split, "blocks": blocks}


def _table(path: Path, rows: np.ndarray, fmt: str) -> None:
    """A headerless, gzipped CSV table, as OGB ships them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = rows.reshape(len(rows), -1)
    with gzip.open(path, "wt") as f:
        f.writelines(",".join(fmt % v for v in row) + "\n" for row in rows)


def _write(folder: Path, scheme: str, arrays: dict[str, Any], edge_file: bool) -> Path:
    raw = folder / "raw"
    num_nodes = len(arrays["feat"])
    train = arrays["split"]["train"]
    edges = train["edge"] if "edge" in train else np.stack(
        [train["source_node"], train["target_node"]], axis=1)  # fmt: skip
    _table(raw / "num-node-list.csv.gz", np.array([num_nodes]), "%d")
    _table(raw / "num-edge-list.csv.gz", np.array([len(edges)]), "%d")
    _table(raw / "node-feat.csv.gz", arrays["feat"], "%.6g")
    if "year" in arrays:
        _table(raw / "node_year.csv.gz", arrays["year"], "%d")
    if edge_file:
        _table(raw / "edge.csv.gz", edges, "%d")
    (folder / "split" / scheme).mkdir(parents=True, exist_ok=True)
    for part, data in arrays["split"].items():
        torch.save(data, folder / "split" / scheme / f"{part}.pt")
    return folder


def write_ogbl_collab(
    root: Path, num_nodes: int = 200, seed: int = 0, folder: str = "ogbl-collab"
) -> Path:
    """An ogbl-collab stand-in (:func:`collab_arrays`) in ``root / folder``; returns the
    folder. ``raw/edge.csv.gz`` lists the training edges, as the archive's does."""
    return _write(Path(root) / folder, "time", collab_arrays(num_nodes, seed), edge_file=True)


def write_ogbl_ppa(
    root: Path, num_nodes: int = 200, seed: int = 0, folder: str = "ogbl-ppa"
) -> Path:
    """An ogbl-ppa stand-in (:func:`ppa_arrays`) in ``root / folder``; returns the folder."""
    return _write(Path(root) / folder, "throughput", ppa_arrays(num_nodes, seed), edge_file=True)


def write_ogbl_citation2(
    root: Path,
    num_nodes: int = 200,
    seed: int = 0,
    folder: str = "ogbl-citation2",
    num_negatives: int = 20,
) -> Path:
    """An ogbl-citation2 stand-in (:func:`citation2_arrays`) in ``root / folder``, without
    ``raw/edge.csv.gz`` (its graph is the training split); returns the folder."""
    arrays = citation2_arrays(num_nodes, seed, num_negatives)
    return _write(Path(root) / folder, "time", arrays, edge_file=False)
