"""Node-property datasets in the OGB folder layout, read from local files only.

Layout (as unpacked from an OGB ``ogbn-*`` archive)::

    <root>/raw/edge.csv.gz            one "src,dst" line per edge (no header)
    <root>/raw/num-node-list.csv.gz   optional: the number of nodes (one line)
    <root>/raw/num-edge-list.csv.gz   optional: the number of edges (one line)
    <root>/raw/node-feat.csv.gz       optional: one line of comma-separated floats per node
    <root>/raw/edge-feat.csv.gz       optional: one line of comma-separated floats per edge
    <root>/raw/node-label.csv.gz      optional: one line per node (NaN = unlabelled); several
                                      0/1 columns for a multi-label dataset (ogbn-proteins)
    <root>/raw/node_species.csv.gz    optional (ogbn-proteins): one integer per node
    <root>/split/<scheme>/{train,valid,test}.csv.gz   optional: node ids, one per line

or, for the binary archives (ogbn-papers100M), ``raw/data.npz`` (``edge_index`` 2 x E,
``num_nodes_list``, ``num_edges_list``, optional ``node_feat``, ``edge_feat``) and
``raw/node-label.npz`` (``node_label``) in place of the ``.csv.gz`` tables. Plain ``.csv``
files are accepted in place of ``.csv.gz``; ``.npz`` files are read without pickle.
Nothing is ever downloaded.

A graph without node features but with edge features (ogbn-proteins) gets, as node
features, the mean of the features of its incident edges (either end), as OGB's examples do.

:func:`ogbn` reads one of the four OGB node-property benchmarks by name from a data root
(``<root>/ogbn-arxiv``, or the folder names OGB's own loader and archive use:
``<root>/ogbn_arxiv``, ``<root>/arxiv``), with its official split and class count.
"""

from __future__ import annotations

import gzip
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch

from gnnpar.errors import UserError
from gnnpar.graph import Graph

__all__ = [
    "OGBNodeDataset",
    "ogb",
    "ogbn",
    "ogbn_datasets",
    "find_ogbn",
    "find_table",
    "read_csv_table",
    "is_ogb_folder",
]


@dataclass(frozen=True)
class OGBNodeDataset:
    """One OGB node-property benchmark as its archive ships it.

    Attributes:
        name: OGB's name, e.g. ``"ogbn-arxiv"``.
        archive: the folder the downloaded zip unpacks to (e.g. ``"arxiv"``).
        split: the official split scheme (the folder under ``split/``).
        num_classes: classes (or, multi-label, binary tasks), as OGB's ``master.csv``.
        metric: the evaluation metric (:data:`gnnpar.train.metrics.SCORES`).
        what: one phrase for the catalogue.
    """

    name: str
    archive: str
    split: str
    num_classes: int
    metric: str
    what: str

    @property
    def folders(self) -> tuple[str, str, str]:
        """Folder names looked up under a data root, in order: the catalogue name, OGB's
        loader's (``ogbn_arxiv``) and the archive's."""
        return (self.name, self.name.replace("-", "_"), self.archive)


_OGBN = (
    OGBNodeDataset("ogbn-arxiv", "arxiv", "time", 40, "acc", "arXiv CS citation graph"),
    OGBNodeDataset("ogbn-products", "products", "sales_ranking", 47, "acc", "Amazon co-purchase"),
    OGBNodeDataset("ogbn-proteins", "proteins", "species", 112, "rocauc", "protein association"),
    OGBNodeDataset("ogbn-papers100M", "papers100M-bin", "time", 172, "acc", "MAG paper citations"),
)


def ogbn_datasets() -> Mapping[str, OGBNodeDataset]:
    """The OGB node-property benchmarks :func:`ogbn` reads, by name."""
    return MappingProxyType({d.name: d for d in _OGBN})


def find_table(folder: Path, stem: str) -> Path | None:
    """``folder/stem.csv.gz`` or ``folder/stem.csv``, whichever is there (None if neither)."""
    for suffix in (".csv.gz", ".csv"):
        path = folder / f"{stem}{suffix}"
        if path.is_file():
            return path
    return None


def is_ogb_folder(path: str | Path) -> bool:
    """True if ``path`` has ``raw/edge.csv.gz`` (or ``raw/edge.csv``, or ``raw/data.npz``)."""
    raw = Path(path) / "raw"
    return find_table(raw, "edge") is not None or (raw / "data.npz").is_file()


def read_csv_table(path: str | Path, dtype: type = np.int64) -> np.ndarray:
    """Read a headerless comma-separated numeric table (optionally gzipped) as a 2-D array.

    Uses numpy's C text parser on the whole file (much faster than ``np.loadtxt`` for the
    tens of millions of rows of large OGB graphs).
    """
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read().strip()
    except (OSError, EOFError) as err:  # a truncated or non-gzip .gz file
        raise UserError(f"{path}: cannot read ({err})") from None
    if not raw:
        return np.zeros((0, 1), dtype=dtype)
    num_cols = raw.split(b"\n", 1)[0].count(b",") + 1
    num_rows = raw.count(b"\n") + 1
    try:
        values = np.fromstring(raw.replace(b",", b" "), dtype=dtype, sep=" ")
    except ValueError as err:
        raise UserError(f"{path}: cannot parse as {np.dtype(dtype).name} numbers: {err}") from None
    if values.size != num_rows * num_cols:
        raise UserError(
            f"{path}: expected {num_rows} rows of {num_cols} values, read {values.size} values"
        )
    return values.reshape(num_rows, num_cols)


class _Npz:
    """The arrays of an ``.npz`` file, read without pickle; errors name the file and key."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._file = np.load(path, allow_pickle=False)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
            raise UserError(f"{path}: not a readable .npz file ({err})") from None
        if not isinstance(self._file, np.lib.npyio.NpzFile):
            raise UserError(f"{path}: a single .npy array, not an .npz archive of named arrays")

    def __contains__(self, key: str) -> bool:
        return key in self._file.files

    def get(self, key: str, required: bool = True) -> np.ndarray | None:
        """The array ``key`` (None if absent and not ``required``)."""
        if key not in self._file.files:
            if required:
                raise UserError(f"{self.path}: has no array {key!r} (has {self._file.files})")
            return None
        try:
            return self._file[key]
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
            raise UserError(f"{self.path}: array {key!r} is unreadable ({err})") from None


@dataclass
class _Raw:
    """What a ``raw/`` folder holds, as numpy arrays."""

    edges: np.ndarray  # E x 2 (src, dst)
    num_nodes: int | None
    node_feat: np.ndarray | None
    edge_feat: np.ndarray | None
    label: np.ndarray | None  # float64, NaN = unlabelled
    species: np.ndarray | None


def _single_count(values: np.ndarray, where: str) -> int:
    counts = np.asarray(values).reshape(-1)
    if counts.size != 1:
        raise UserError(
            f"{where} lists {counts.size} graphs; only single-graph (node property) "
            "datasets are supported"
        )
    return int(counts[0])


def read_edge_table(folder: Path, missing: str) -> tuple[np.ndarray, Path]:
    """``(edges, path)``: the ``(E, 2)`` int64 (src, dst) rows of ``folder``'s ``edge``
    table, checked against its ``num-edge-list`` where there is one; FileNotFoundError
    ``missing`` without the table. An OGB folder's ``raw/`` and a typed one's relation
    folders hold one each."""
    edge_file = find_table(folder, "edge")
    if edge_file is None:
        raise FileNotFoundError(missing)
    edges = read_csv_table(edge_file, np.int64)
    if edges.shape[0] and edges.shape[1] != 2:
        raise UserError(f"{edge_file}: expected 2 columns (src,dst), got {edges.shape[1]}")
    edges = edges.reshape(-1, 2)
    edge_count_file = find_table(folder, "num-edge-list")
    if edge_count_file is not None:
        listed = _single_count(read_csv_table(edge_count_file, np.int64), str(edge_count_file))
        if listed != edges.shape[0]:
            raise UserError(f"{edge_count_file} says {listed} edges, {edge_file} has {len(edges)}")
    return edges, edge_file


def _read_csv_raw(raw: Path) -> _Raw:
    missing = f"{raw.parent} is not an OGB folder: {raw}/edge.csv.gz is missing"
    edges, _ = read_edge_table(raw, missing)
    count_file = find_table(raw, "num-node-list")
    num_nodes = None
    if count_file is not None:
        num_nodes = _single_count(read_csv_table(count_file, np.int64), str(count_file))
    tables = {}
    for stem, dtype in (
        ("node-feat", np.float32),
        ("edge-feat", np.float32),
        ("node-label", np.float64),
    ):
        path = find_table(raw, stem)
        tables[stem] = None if path is None else read_csv_table(path, dtype)
    species_file = find_table(raw, "node_species") or find_table(raw, "species")
    species = None if species_file is None else read_csv_table(species_file, np.int64)[:, 0]
    return _Raw(
        edges,
        num_nodes,
        tables["node-feat"],
        tables["edge-feat"],
        tables["node-label"],
        species,
    )


def _read_npz_raw(raw: Path) -> _Raw:
    data = _Npz(raw / "data.npz")
    edge_index = data.get("edge_index")
    if edge_index.ndim != 2 or edge_index.shape[0] != 2:
        raise UserError(f"{data.path}: 'edge_index' has shape {edge_index.shape}, expected 2 x E")
    if not np.issubdtype(edge_index.dtype, np.integer):
        raise UserError(f"{data.path}: 'edge_index' is {edge_index.dtype}, expected integers")
    num_nodes = _single_count(data.get("num_nodes_list"), f"{data.path} 'num_nodes_list'")
    num_edges = _single_count(data.get("num_edges_list"), f"{data.path} 'num_edges_list'")
    if num_edges != edge_index.shape[1]:
        raise UserError(
            f"{data.path}: 'num_edges_list' says {num_edges} edges, 'edge_index' has "
            f"{edge_index.shape[1]}"
        )
    label = None
    if (raw / "node-label.npz").is_file():
        label = _Npz(raw / "node-label.npz").get("node_label").astype(np.float64)
        label = label.reshape(label.shape[0], -1)
    species = data.get("node_species", required=False)
    return _Raw(
        edge_index.T.astype(np.int64),
        num_nodes,
        data.get("node_feat", required=False),
        data.get("edge_feat", required=False),
        label,
        None if species is None else species.reshape(-1).astype(np.int64),
    )


def _mean_edge_features(edges: np.ndarray, edge_feat: np.ndarray, num_nodes: int) -> torch.Tensor:
    """Each node's mean over the features of the edges it is an end of (zeros if none)."""
    feat = torch.from_numpy(np.ascontiguousarray(edge_feat, dtype=np.float32))
    sums = torch.zeros(num_nodes, feat.shape[1], dtype=torch.float32)
    counts = torch.zeros(num_nodes, dtype=torch.float32)
    for end in (0, 1):  # an edge counts at both of its ends (a self-loop twice)
        ids = torch.from_numpy(np.ascontiguousarray(edges[:, end]))
        sums.index_add_(0, ids, feat)
        counts += torch.bincount(ids, minlength=num_nodes)
    return sums / counts.clamp_(min=1)[:, None]


def _node_data(raw: _Raw, where: Path) -> tuple[dict[str, torch.Tensor], int]:
    """Node data (features, labels, species) and the number of nodes, checked for length."""
    num_nodes = raw.num_nodes
    if num_nodes is None:  # no count file: the node tables', else the edges' extent
        sized = [a for a in (raw.node_feat, raw.label, raw.species) if a is not None]
        num_nodes = len(sized[0]) if sized else int(raw.edges.max()) + 1 if raw.edges.size else 0
    ndata: dict[str, torch.Tensor] = {}
    if raw.edges.size and (raw.edges.min() < 0 or raw.edges.max() >= num_nodes):
        raise UserError(f"{where}: edge endpoints must lie in [0, {num_nodes})")
    for key, arr in (("feat", raw.node_feat), ("label", raw.label), ("species", raw.species)):
        if arr is not None and len(arr) != num_nodes:
            raise UserError(f"{where}: node {key} has {len(arr)} rows for {num_nodes} nodes")
    if raw.node_feat is not None:
        ndata["feat"] = torch.from_numpy(np.ascontiguousarray(raw.node_feat, dtype=np.float32))
    elif raw.edge_feat is not None:
        if len(raw.edge_feat) != len(raw.edges):
            raise UserError(
                f"{where}: {len(raw.edge_feat)} edge feature rows for {len(raw.edges)} edges"
            )
        ndata["feat"] = _mean_edge_features(raw.edges, raw.edge_feat, num_nodes)
    if raw.label is not None:
        labels = np.where(np.isnan(raw.label), -1, raw.label).astype(np.int64)
        ndata["label"] = torch.from_numpy(labels[:, 0] if labels.shape[1] == 1 else labels)
    if raw.species is not None:
        ndata["species"] = torch.from_numpy(raw.species)
    return ndata, num_nodes


def ogb(
    root: str | Path,
    split: str | None = None,
    undirected: bool = True,
    name: str | None = None,
    num_classes: int | None = None,
) -> Graph:
    """Load an OGB node-property folder (see the module docstring for the layout).

    Args:
        root: the dataset folder (holding ``raw/`` and optionally ``split/``).
        split: the split scheme folder under ``split/``; ``None`` picks the only one.
        undirected: add reverse edges and merge duplicates (what GNN training on OGB
            graphs usually does); ``False`` keeps the edges exactly as listed.
        name: graph name; defaults to the folder name.
        num_classes: the number of classes (or binary tasks); ``None`` records what the
            labels span.

    Labels become an int64 vector (NaN, i.e. unlabelled, becomes -1), or an ``N x C``
    0/1 int64 matrix for multi-label datasets. Edge features become node features only
    when the folder has none (their mean over each node's incident edges).
    """
    root = Path(root)
    raw_dir = root / "raw"
    if find_table(raw_dir, "edge") is None and (raw_dir / "data.npz").is_file():
        raw = _read_npz_raw(raw_dir)
    else:
        raw = _read_csv_raw(raw_dir)
    ndata, num_nodes = _node_data(raw, raw_dir)
    ndata.update(_split_masks(root / "split", split, num_nodes))
    edges = raw.edges
    src, dst = torch.from_numpy(edges[:, 0].copy()), torch.from_numpy(edges[:, 1].copy())
    graph = Graph.from_edges(src, dst, num_nodes, ndata=ndata, name=name or root.name)
    if "label" in ndata:  # checks the labels against the count (or records what they span)
        graph.num_classes = num_classes if num_classes is not None else graph.num_classes
    return graph.to_undirected() if undirected else graph


def find_ogbn(root: str | Path, name: str) -> Path:
    """The folder of the OGB benchmark ``name`` under the data root ``root``: the first of
    ``<root>/<name>``, ``<root>/<name with _>`` and ``<root>/<archive folder>`` that is an
    OGB folder; FileNotFoundError listing them otherwise."""
    spec = ogbn_datasets()[name]
    candidates = [Path(root) / folder for folder in spec.folders]
    for folder in candidates:
        if is_ogb_folder(folder):
            return folder
    raise FileNotFoundError(
        f"no {name} archive under {root} (looked for raw/ in "
        f"{', '.join(str(c) for c in candidates)}); unpack OGB's archive there"
    )


def ogbn(root: str | Path, name: str, undirected: bool = True) -> Graph:
    """The OGB node-property benchmark ``name`` (see :func:`ogbn_datasets`) from its
    unpacked archive under the data root ``root`` (:func:`find_ogbn`), with its official
    split and class count; ``undirected`` adds the reverse edges (as the leaderboard
    baselines train on every one of these graphs)."""
    if name not in ogbn_datasets():
        raise UserError(f"unknown OGB dataset {name!r}; known: {', '.join(ogbn_datasets())}")
    spec = ogbn_datasets()[name]
    folder = find_ogbn(root, name)
    return ogb(folder, spec.split, undirected, name=name, num_classes=spec.num_classes)


def _split_masks(folder: Path, scheme: str | None, num_nodes: int) -> dict[str, torch.Tensor]:
    if not folder.is_dir():
        if scheme is not None:
            raise FileNotFoundError(f"split {scheme!r} requested but {folder} does not exist")
        return {}
    schemes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if scheme is None:
        if len(schemes) > 1:
            raise UserError(f"{folder} holds several split schemes {schemes}: pass split=...")
        if not schemes:
            return {}
        scheme = schemes[0]
    if scheme not in schemes:
        raise UserError(f"split {scheme!r} not found in {folder}; available: {schemes}")
    masks = {}
    for part, key in (("train", "train_mask"), ("valid", "val_mask"), ("test", "test_mask")):
        path = find_table(folder / scheme, part)
        if path is None:
            raise FileNotFoundError(f"{folder / scheme}/{part}.csv.gz is missing")
        ids = read_csv_table(path, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= num_nodes):
            raise UserError(f"{path}: node ids must lie in [0, {num_nodes})")
        mask = torch.zeros(num_nodes, dtype=torch.bool)
        mask[torch.from_numpy(ids)] = True
        masks[key] = mask
    return masks
