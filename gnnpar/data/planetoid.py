"""The Planetoid citation datasets (Cora, CiteSeer, PubMed) from the GCN reference files.

Reads ``ind.<name>.{x,y,tx,ty,allx,ally,graph,test.index}`` as distributed with Kipf and
Welling's GCN code and builds the standard split exactly as that code and PyG do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from gnnpar.data.safe_pickle import load_pickle
from gnnpar.errors import UserError, first_line
from gnnpar.graph import Graph

__all__ = ["planetoid", "planetoid_names", "PLANETOID_PARTS"]

PLANETOID_PARTS = ("x", "y", "tx", "ty", "allx", "ally", "graph", "test.index")


def planetoid_names(root: str | Path) -> list[str]:
    """Dataset names with an ``ind.<name>.graph`` file in ``root``."""
    return sorted(p.name[len("ind.") : -len(".graph")] for p in Path(root).glob("ind.*.graph"))


def _dense(matrix: object, what: str) -> np.ndarray:
    if sp.issparse(matrix):
        return np.asarray(matrix.toarray(), dtype=np.float32)
    if isinstance(matrix, np.ndarray):
        return matrix.astype(np.float32)
    raise UserError(f"{what}: expected a numpy array or scipy sparse matrix, got {type(matrix)}")


def planetoid(root: str | Path, name: str = "citeseer", normalize_features: bool = False) -> Graph:
    """Load a Planetoid dataset from the folder ``root`` holding the ``ind.<name>.*`` files.

    * Nodes: ``allx`` rows, then the test rows (``tx``), placed at the ids listed in
      ``test.index``. CiteSeer's test ids have gaps (isolated nodes without features): as in
      the reference code and PyG, ``tx``/``ty`` are padded with zero rows to cover the whole
      range, so those nodes get zero features and label 0 and belong to no split.
    * Edges: the adjacency lists of ``graph``, made undirected, without self loops or
      duplicates (as PyG).
    * Split: train = the first ``len(y)`` nodes, val = the next 500, test = ``test.index``.
    * ``normalize_features``: scale every feature row to sum to 1 (zero rows stay zero).

    The pickles are read with a restricted unpickler that only builds numpy / scipy.sparse
    objects (:func:`gnnpar.data.safe_pickle.load_pickle`).
    """
    root = Path(root)
    name = name.lower()
    files = {part: root / f"ind.{name}.{part}" for part in PLANETOID_PARTS}
    missing = [p.name for p in files.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"Planetoid {name!r} files missing in {root}: {', '.join(missing)}")
    parts = {part: load_pickle(files[part]) for part in PLANETOID_PARTS if part != "test.index"}
    try:
        test_index = np.loadtxt(files["test.index"], dtype=np.int64, ndmin=1)
    except (ValueError, OSError, UnicodeDecodeError) as err:
        reason = first_line(err, 200)
        raise UserError(f"{files['test.index']}: not a list of node ids ({reason})") from None
    try:
        return _assemble(parts, test_index, name, normalize_features)
    except UserError as err:
        raise UserError(f"{root / f'ind.{name}'}.*: {err}") from None
    except (ValueError, TypeError, IndexError, KeyError, AttributeError, OverflowError) as err:
        # a crafted file that unpickles (numpy and scipy objects only) but holds the wrong
        # kinds or sizes of thing: one line naming the files, not a traceback
        raise UserError(
            f"{root / f'ind.{name}'}.*: not a consistent Planetoid dataset "
            f"({type(err).__name__}: {first_line(err, 200)})"
        ) from None


def _assemble(
    parts: dict[str, Any], test_index: np.ndarray, name: str, normalize_features: bool
) -> Graph:
    """The graph of :func:`planetoid` from its unpickled parts (UserError, or the errors
    of a part of the wrong kind, which the caller names the files for)."""
    x, tx, allx = (_dense(parts[k], f"ind.{name}.{k}") for k in ("x", "tx", "allx"))
    y, ty, ally = (np.asarray(parts[k], dtype=np.float32) for k in ("y", "ty", "ally"))
    if len(tx) != len(test_index) or len(ty) != len(test_index):
        raise UserError(
            f"ind.{name}.tx has {len(tx)} rows and ty {len(ty)}, but test.index lists "
            f"{len(test_index)} nodes"
        )
    sorted_test = np.sort(test_index)
    lo, hi = int(sorted_test[0]), int(sorted_test[-1])
    if lo != len(allx):
        raise UserError(f"test ids should start right after allx ({len(allx)}), start at {lo}")
    # Pad tx/ty to the full id range: ids missing from test.index are isolated nodes.
    tx_full = np.zeros((hi - lo + 1, tx.shape[1]), dtype=np.float32)
    tx_full[sorted_test - lo] = tx
    ty_full = np.zeros((hi - lo + 1, ty.shape[1]), dtype=np.float32)
    ty_full[sorted_test - lo] = ty

    features = np.vstack([allx, tx_full])
    onehot = np.vstack([ally, ty_full])
    # Row k of tx belongs to node test_index[k]; it was stored at the k-th smallest id.
    features[test_index] = features[sorted_test]
    onehot[test_index] = onehot[sorted_test]
    labels = onehot.argmax(axis=1).astype(np.int64)
    n = features.shape[0]
    if normalize_features:
        sums = features.sum(axis=1, keepdims=True)
        features = np.divide(features, sums, out=np.zeros_like(features), where=sums != 0)

    adjacency = parts["graph"]
    if not isinstance(adjacency, dict):
        raise UserError(f"ind.{name}.graph: expected a dict of adjacency lists")
    dst = np.fromiter((u for u, vs in adjacency.items() for _ in vs), dtype=np.int64, count=-1)
    src = np.fromiter((v for vs in adjacency.values() for v in vs), dtype=np.int64, count=-1)
    for ids in (dst, src):
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
            bad = int(ids[(ids < 0) | (ids >= n)][0])
            raise UserError(f"ind.{name}.graph names node {bad}, but the dataset has {n} nodes")
    if test_index.size and (int(test_index.min()) < 0 or int(test_index.max()) >= n):
        raise UserError(f"ind.{name}.test.index names a node outside [0, {n})")

    def mask(ids: np.ndarray) -> torch.Tensor:
        m = torch.zeros(n, dtype=torch.bool)
        m[torch.from_numpy(ids)] = True
        return m

    num_train = len(y)
    ndata = {
        "feat": torch.from_numpy(features),
        "label": torch.from_numpy(labels),
        "train_mask": mask(np.arange(num_train)),
        "val_mask": mask(np.arange(num_train, num_train + 500)),
        "test_mask": mask(test_index),
    }
    graph = Graph.from_edges(
        torch.from_numpy(src), torch.from_numpy(dst), n, ndata=ndata, name=name
    )
    graph.num_classes = int(onehot.shape[1])  # the one-hot width, not the largest label
    return graph.remove_self_loops().to_undirected()
