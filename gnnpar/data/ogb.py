"""Node-property datasets in the OGB folder layout, read from local files only.

Layout (as unpacked from an OGB ``ogbn-*`` archive)::

    <root>/raw/edge.csv.gz            one "src,dst" line per edge (no header)
    <root>/raw/num-node-list.csv.gz   optional: the number of nodes (one line)
    <root>/raw/node-feat.csv.gz       optional: one line of comma-separated floats per node
    <root>/raw/node-label.csv.gz      optional: one line per node (NaN = unlabelled)
    <root>/split/<scheme>/{train,valid,test}.csv.gz   optional: node ids, one per line

Plain ``.csv`` files are accepted in place of ``.csv.gz``. Nothing is ever downloaded.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

from gnnpar.graph import Graph

__all__ = ["ogb", "read_csv_table", "is_ogb_folder"]


def _find(folder: Path, stem: str) -> Path | None:
    for suffix in (".csv.gz", ".csv"):
        path = folder / f"{stem}{suffix}"
        if path.is_file():
            return path
    return None


def is_ogb_folder(path: str | Path) -> bool:
    """True if ``path`` has ``raw/edge.csv.gz`` (or ``raw/edge.csv``)."""
    return _find(Path(path) / "raw", "edge") is not None


def read_csv_table(path: str | Path, dtype: type = np.int64) -> np.ndarray:
    """Read a headerless comma-separated numeric table (optionally gzipped) as a 2-D array.

    Uses numpy's C text parser on the whole file (much faster than ``np.loadtxt`` for the
    tens of millions of rows of large OGB graphs).
    """
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read().strip()
    if not raw:
        return np.zeros((0, 1), dtype=dtype)
    num_cols = raw.split(b"\n", 1)[0].count(b",") + 1
    num_rows = raw.count(b"\n") + 1
    try:
        values = np.fromstring(raw.replace(b",", b" "), dtype=dtype, sep=" ")
    except ValueError as err:
        raise ValueError(f"{path}: cannot parse as {np.dtype(dtype).name} numbers: {err}") from None
    if values.size != num_rows * num_cols:
        raise ValueError(
            f"{path}: expected {num_rows} rows of {num_cols} values, read {values.size} values"
        )
    return values.reshape(num_rows, num_cols)


def ogb(
    root: str | Path, split: str | None = None, undirected: bool = True, name: str | None = None
) -> Graph:
    """Load an OGB node-property folder (see the module docstring for the layout).

    Args:
        root: the dataset folder (holding ``raw/`` and optionally ``split/``).
        split: the split scheme folder under ``split/``; ``None`` picks the only one.
        undirected: add reverse edges and merge duplicates (what GNN training on OGB
            graphs usually does); ``False`` keeps the edges exactly as listed.
        name: graph name; defaults to the folder name.

    Labels become an int64 vector (NaN, i.e. unlabelled, becomes -1), or an ``N x C``
    int64 matrix for multi-label datasets. Edge features (``edge-feat``) are not read.
    """
    root = Path(root)
    raw = root / "raw"
    edge_file = _find(raw, "edge")
    if edge_file is None:
        raise FileNotFoundError(f"{root} is not an OGB folder: {raw}/edge.csv.gz is missing")
    edges = read_csv_table(edge_file, np.int64)
    if edges.shape[0] and edges.shape[1] != 2:
        raise ValueError(f"{edge_file}: expected 2 columns (src,dst), got {edges.shape[1]}")
    edges = edges.reshape(-1, 2)

    ndata: dict[str, torch.Tensor] = {}
    feat_file = _find(raw, "node-feat")
    if feat_file is not None:
        ndata["feat"] = torch.from_numpy(read_csv_table(feat_file, np.float32))
    label_file = _find(raw, "node-label")
    if label_file is not None:
        labels = read_csv_table(label_file, np.float64)
        unlabelled = np.isnan(labels)
        labels = np.where(unlabelled, -1, labels).astype(np.int64)
        ndata["label"] = torch.from_numpy(labels[:, 0] if labels.shape[1] == 1 else labels)

    num_nodes = _num_nodes(raw, edges, ndata)
    ndata.update(_split_masks(root / "split", split, num_nodes))
    src, dst = torch.from_numpy(edges[:, 0].copy()), torch.from_numpy(edges[:, 1].copy())
    graph = Graph.from_edges(src, dst, num_nodes, ndata=ndata, name=name or root.name)
    if "label" in ndata:  # OGB ships no class count: record what the labels span
        graph.num_classes = graph.num_classes
    return graph.to_undirected() if undirected else graph


def _num_nodes(raw: Path, edges: np.ndarray, ndata: dict[str, torch.Tensor]) -> int:
    count_file = _find(raw, "num-node-list")
    if count_file is not None:
        counts = read_csv_table(count_file, np.int64).reshape(-1)
        if counts.size != 1:
            raise ValueError(
                f"{count_file} lists {counts.size} graphs; only single-graph (node property) "
                "datasets are supported"
            )
        return int(counts[0])
    if ndata:
        return int(next(iter(ndata.values())).shape[0])
    return int(edges.max()) + 1 if edges.size else 0


def _split_masks(folder: Path, scheme: str | None, num_nodes: int) -> dict[str, torch.Tensor]:
    if not folder.is_dir():
        if scheme is not None:
            raise FileNotFoundError(f"split {scheme!r} requested but {folder} does not exist")
        return {}
    schemes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if scheme is None:
        if len(schemes) > 1:
            raise ValueError(f"{folder} holds several split schemes {schemes}: pass split=...")
        if not schemes:
            return {}
        scheme = schemes[0]
    if scheme not in schemes:
        raise ValueError(f"split {scheme!r} not found in {folder}; available: {schemes}")
    masks = {}
    for part, key in (("train", "train_mask"), ("valid", "val_mask"), ("test", "test_mask")):
        path = _find(folder / scheme, part)
        if path is None:
            raise FileNotFoundError(f"{folder / scheme}/{part}.csv.gz is missing")
        ids = read_csv_table(path, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= num_nodes):
            raise ValueError(f"{path}: node ids must lie in [0, {num_nodes})")
        mask = torch.zeros(num_nodes, dtype=torch.bool)
        mask[torch.from_numpy(ids)] = True
        masks[key] = mask
    return masks
