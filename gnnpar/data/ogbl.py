"""Link-property datasets in the OGB folder layout, read from local files only.

Layout (as unpacked from an OGB ``ogbl-*`` archive)::

    <root>/raw/num-node-list.csv.gz   optional: the number of nodes (one line)
    <root>/raw/node-feat.csv.gz       optional: one line of comma-separated floats per node
    <root>/raw/node_year.csv.gz       optional (ogbl-citation2): one year per node
    <root>/raw/edge.csv.gz            optional, not read: the training edges once more (the
                                      graph OGB ships is its training split)
    <root>/split/<scheme>/train.pt    the training edges
    <root>/split/<scheme>/valid.pt    the validation edges and their negatives
    <root>/split/<scheme>/test.pt     the test edges and their negatives

The ``.pt`` files are ``torch.save`` files of a dict of numpy arrays (int64 node ids):

- **ogbl-collab** (scheme ``time``): ``train.pt`` has ``edge`` (E, 2), undirected pairs (a
  pair that collaborated in several years is listed once a year), and ``weight``, ``year``
  (E,), not read; ``valid.pt`` and ``test.pt`` have ``edge``, ``edge_neg`` (M, 2) negative
  pairs shared by every positive, and ``weight``, ``year`` (not read). Metric ``hits@50``.
- **ogbl-ppa** (scheme ``throughput``): ``train.pt`` has ``edge`` (E, 2), undirected pairs;
  ``valid.pt`` and ``test.pt`` have ``edge`` and ``edge_neg`` (M, 2). Metric ``hits@100``.
- **ogbl-citation2** (scheme ``time``): ``train.pt`` has ``source_node`` and
  ``target_node`` (E,), directed citations; ``valid.pt`` and ``test.pt`` have the same and
  ``target_node_neg`` (E, K), K negative targets of each positive's source (K = 1000).
  Metric ``mrr``.

Arrays saved as torch tensors are accepted too. The files are read with
``torch.load(weights_only=True)`` and an allow-list of exactly the numpy functions and
classes an integer or float array is rebuilt from (:func:`numpy_safe_globals`), never
unpickled freely: a file naming anything else (``os.system``...) is refused before anything
in it is called. Every malformed file (not a dict, a missing key, a wrong shape or dtype, a
node id out of range, truncated) is one :class:`~gnnpar.verified.FormatError` line naming the
file and the key. Plain ``.csv`` files are accepted in place of ``.csv.gz``. Nothing is ever
downloaded. ``raw/num-edge-list.csv.gz``, ``raw/edge_weight.csv.gz`` and
``raw/edge_year.csv.gz`` (ogbl-collab) are not read.

The graph returned is the split's **message-passing graph** (:mod:`gnnpar.graph.edge_split`):
the training edges in both directions, duplicates merged, unweighted (ogbl-citation2's
directed citations made undirected, as OGB's examples train on them), with the node features
(``feat``, float32; ogbl-ppa's are one-hot species) and ogbl-citation2's ``year``. Its
:attr:`~gnnpar.graph.Graph.edge_split` holds OGB's positives exactly as listed (``train``,
``val``, ``test`` as ``(2, E)``) and negatives (``"pairs"``: ``(2, M)``; ``"per-source"``:
``(E, K)``), the benchmark's metric, and as ``source`` the record of the whole graph (every
positive of the three parts, both directions).

:func:`ogbl` reads one of the three benchmarks by name from a data root (``<root>/ogbl-collab``,
or the folder names OGB's own loader and archive use: ``<root>/ogbl_collab``,
``<root>/collab``; ``citation-v2`` is ogbl-citation2's archive).
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from gnnpar.data.ogb import find_table, read_csv_table
from gnnpar.data.safe_pickle import numpy_reconstruct
from gnnpar.errors import UserError, first_line
from gnnpar.graph import Graph
from gnnpar.graph.edge_split import EdgeSplit
from gnnpar.verified import FormatError, UnsafeContentError

__all__ = [
    "OGBLinkDataset",
    "find_ogbl",
    "is_ogbl_folder",
    "numpy_safe_globals",
    "ogbl",
    "ogbl_datasets",
    "read_ogbl",
    "read_split_file",
]

# torch names the refused global as "GLOBAL module.name" in every version's message
_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_WEIGHTS_ERROR = re.compile(r"WeightsUnpickler error:\s*(\S[^\n]*)")
_PARTS = ("train", "valid", "test")


@dataclass(frozen=True)
class OGBLinkDataset:
    """One OGB link-property benchmark as its archive ships it.

    Attributes:
        name: OGB's name, e.g. ``"ogbl-collab"``.
        archive: the folder the downloaded zip unpacks to (e.g. ``"collab"``).
        split: the official split scheme (the folder under ``split/``).
        protocol: how its evaluation negatives are laid out (``pairs``, ``per-source``).
        metric: the evaluation metric (``hits@K`` or ``mrr``).
        what: one phrase for the catalogue.
        nodes, edges, features: OGB's sizes (edges: the whole graph's, each pair once).
    """

    name: str
    archive: str
    split: str
    protocol: str
    metric: str
    what: str
    nodes: int
    edges: int
    features: int

    @property
    def folders(self) -> tuple[str, ...]:
        """Folder names looked up under a data root, in order: the catalogue name, OGB's
        loader's (``ogbl_collab``), the short name and the archive's."""
        short = self.name.removeprefix("ogbl-")
        names = (self.name, self.name.replace("-", "_"), short, self.archive)
        return tuple(dict.fromkeys(names))


_OGBL = (
    OGBLinkDataset("ogbl-collab", "collab", "time", "pairs", "hits@50",
                   "author collaborations", 235_868, 1_285_465, 128),
    OGBLinkDataset("ogbl-citation2", "citation-v2", "time", "per-source", "mrr",
                   "MAG paper citations", 2_927_963, 30_561_187, 128),
    OGBLinkDataset("ogbl-ppa", "ppa", "throughput", "pairs", "hits@100",
                   "protein associations", 576_289, 30_326_273, 58),
)  # fmt: skip


def ogbl_datasets() -> Mapping[str, OGBLinkDataset]:
    """The OGB link-property benchmarks :func:`ogbl` reads, by name."""
    return MappingProxyType({d.name: d for d in _OGBL})


def _count(path: Path) -> int:
    """The single number of a ``num-*-list`` table (one graph)."""
    counts = read_csv_table(path, np.int64).reshape(-1)
    if counts.size != 1:
        raise FormatError(f"{path} lists {counts.size} graphs; an OGB link dataset has one")
    return int(counts[0])


def numpy_safe_globals() -> list[Any]:
    """What ``torch.load(weights_only=True)`` must allow to rebuild numpy arrays of numbers
    (for ``torch.serialization.safe_globals``): ``_reconstruct`` under the names numpy 1
    (``numpy.core``) and numpy 2 (``numpy._core``) pickle it by, ``ndarray``, ``dtype``, and
    the classes of the boolean, integer and float dtypes (a pickled dtype is rebuilt as an
    instance of one of them). Object, string and void arrays stay refused."""
    reconstruct = numpy_reconstruct()
    allowed: list[Any] = [
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        (reconstruct, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
    ]
    for code in "?bBhHiIlLqQefd":
        cls = type(np.dtype(code))
        allowed.append((cls, f"{cls.__module__}.{cls.__qualname__}"))
    return allowed


def read_split_file(path: str | Path) -> dict[str, np.ndarray]:
    """The dict of arrays in one ``split/<scheme>/*.pt`` file, read with
    ``torch.load(weights_only=True)`` and :func:`numpy_safe_globals` (tensors become numpy
    arrays). :class:`~gnnpar.verified.UnsafeContentError` naming the refused global for a
    file that names anything else, :class:`~gnnpar.verified.FormatError` for one that is
    not a ``torch.save`` file of a dict."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (an OGB link split file)")
    try:
        with torch.serialization.safe_globals(numpy_safe_globals()), warnings.catch_warnings():
            # a plain pickle of protocol > 2 draws a multi-line warning before the refusal
            warnings.simplefilter("ignore", UserWarning)
            data = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:  # what a weights-only load raises for any object
        text = str(err)
        found = _UNSUPPORTED_GLOBAL.search(text)
        if found:
            raise UnsafeContentError(
                f"{path}: refusing to load it: it names {found.group(1)}, which is not a "
                "numpy array's (the split files are read, never unpickled freely)"
            ) from None
        reason = _WEIGHTS_ERROR.search(text)
        detail = reason.group(1).strip() if reason else first_line(err)
        raise UnsafeContentError(
            f"{path}: refusing to load it: it holds what is not a dict of numeric arrays "
            f"({detail[:200]})"
        ) from None
    except Exception as err:  # torch raises RuntimeError, EOFError... for a damaged file
        raise FormatError(f"{path}: not a readable torch.save file: {first_line(err)}") from None
    if not isinstance(data, Mapping):
        raise FormatError(f"{path}: holds a {type(data).__name__}, not a dict of arrays")
    out = {}
    for key, value in data.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        out[str(key)] = value
    return out


class _Part:
    """One split file's arrays, checked key by key; errors name the file and the key."""

    def __init__(self, path: Path):
        self.path = path
        self.data = read_split_file(path)

    def ids(self, key: str, ndim: int, num_nodes: int, width: int | None = None) -> np.ndarray:
        """The int64 array ``key`` of ``ndim`` dimensions (``width`` columns if given), every
        id in ``[0, num_nodes)``."""
        if key not in self.data:
            raise FormatError(f"{self.path}: has no key {key!r} (has {sorted(self.data)})")
        value = self.data[key]
        if not isinstance(value, np.ndarray):
            kind = type(value).__name__
            raise FormatError(f"{self.path}: key {key!r} holds a {kind}, not an array")
        if not np.issubdtype(value.dtype, np.integer):
            raise FormatError(
                f"{self.path}: key {key!r} has dtype {value.dtype}, expected integer node ids"
            )
        if ndim == 1 and value.ndim == 2 and value.shape[1] == 1:
            value = value[:, 0]
        if value.ndim != ndim or (width is not None and value.shape[1] != width):
            want = "(E,)" if ndim == 1 else f"(E, {width})" if width else "(E, K)"
            raise FormatError(
                f"{self.path}: key {key!r} has shape {tuple(value.shape)}, expected {want}"
            )
        if value.size and (value.min() < 0 or value.max() >= num_nodes):
            raise FormatError(
                f"{self.path}: key {key!r} names node {int(value.max())} or {int(value.min())} "
                f"outside [0, {num_nodes})"
            )
        return value.astype(np.int64, copy=False)

    def check_rows(self, key: str, value: np.ndarray, length: int, what: str) -> None:
        """FormatError unless ``value`` (the array ``key``) has ``length`` rows."""
        if len(value) != length:
            raise FormatError(f"{self.path}: key {key!r} has {len(value)} rows for {length} {what}")


def is_ogbl_folder(path: str | Path) -> bool:
    """True if ``path`` has a ``split/<scheme>/train.pt`` (an OGB link-property folder)."""
    split = Path(path) / "split"
    return split.is_dir() and any((p / "train.pt").is_file() for p in split.iterdir())


def find_ogbl(root: str | Path, name: str) -> Path:
    """The folder of the OGB link benchmark ``name`` under the data root ``root``: the first
    of :attr:`OGBLinkDataset.folders` that is an OGB link folder; FileNotFoundError listing
    them otherwise."""
    spec = _spec(name)
    candidates = [Path(root) / folder for folder in spec.folders]
    for folder in candidates:
        if is_ogbl_folder(folder):
            return folder
    raise FileNotFoundError(
        f"no {name} archive under {root} (looked for split/{spec.split}/train.pt in "
        f"{', '.join(str(c) for c in candidates)}); unpack OGB's archive there"
    )


def _spec(name: str) -> OGBLinkDataset:
    if name not in ogbl_datasets():
        raise UserError(f"unknown OGB link dataset {name!r}; known: {', '.join(ogbl_datasets())}")
    return ogbl_datasets()[name]


def _spec_of_folder(folder: Path, name: str | None) -> OGBLinkDataset:
    if name is not None:
        return _spec(name)
    for spec in _OGBL:
        if folder.name in spec.folders:
            return spec
    raise UserError(
        f"{folder}: an OGB link folder whose name says not which dataset it is: pass "
        f"name= (one of {', '.join(ogbl_datasets())})"
    )


def _node_data(raw: Path, parts: Mapping[str, _Part]) -> tuple[dict[str, torch.Tensor], int]:
    """Node features (and years) and the number of nodes, checked for length."""
    count_file = find_table(raw, "num-node-list")
    feat_file, year_file = find_table(raw, "node-feat"), find_table(raw, "node_year")
    feat = None if feat_file is None else read_csv_table(feat_file, np.float32)
    year = None if year_file is None else read_csv_table(year_file, np.int64)
    if count_file is not None:
        num_nodes = _count(count_file)
    elif feat is not None or year is not None:
        num_nodes = len(feat if feat is not None else year)
    else:  # the largest id of any split file + 1
        num_nodes = 1 + max(
            (int(v.max()) for p in parts.values() for v in p.data.values()
             if isinstance(v, np.ndarray) and v.size and np.issubdtype(v.dtype, np.integer)),
            default=-1,
        )  # fmt: skip
    ndata: dict[str, torch.Tensor] = {}
    for key, path, table in (("feat", feat_file, feat), ("year", year_file, year)):
        if table is None:
            continue
        if len(table) != num_nodes:
            raise FormatError(f"{path}: {len(table)} rows for {num_nodes} nodes")
        values = table if key == "feat" else table.reshape(len(table), -1)[:, 0]
        ndata[key] = torch.from_numpy(np.ascontiguousarray(values))
    return ndata, num_nodes


def _pairs(array: np.ndarray) -> torch.Tensor:
    """``(E, 2)`` rows as ``(2, E)`` int64."""
    return torch.from_numpy(np.ascontiguousarray(array.T, dtype=np.int64))


def _split_arrays(
    spec: OGBLinkDataset, parts: Mapping[str, _Part], num_nodes: int
) -> dict[str, torch.Tensor]:
    """The split's arrays (:data:`gnnpar.graph.edge_split.KEYS`) from the three files."""
    out: dict[str, torch.Tensor] = {}
    names = {"train": "train", "valid": "val", "test": "test"}
    for part_name, part in parts.items():
        key = names[part_name]
        if spec.protocol == "pairs":
            out[key] = _pairs(part.ids("edge", 2, num_nodes, width=2))
            if key != "train":
                out[f"{key}_neg"] = _pairs(part.ids("edge_neg", 2, num_nodes, width=2))
            continue
        src = part.ids("source_node", 1, num_nodes)
        dst = part.ids("target_node", 1, num_nodes)
        part.check_rows("target_node", dst, len(src), "source nodes")
        out[key] = torch.from_numpy(np.stack([src, dst]))
        if key != "train":
            neg = part.ids("target_node_neg", 2, num_nodes)
            part.check_rows("target_node_neg", neg, len(src), "source nodes")
            out[f"{key}_neg"] = torch.from_numpy(np.ascontiguousarray(neg))
    return out


def _symmetric_graph(
    pairs: list[torch.Tensor], num_nodes: int, ndata: Mapping[str, torch.Tensor], name: str
) -> Graph:
    """The graph of ``pairs`` (each ``(2, E)``) in both directions, duplicates merged."""
    src = torch.cat([p[0] for p in pairs] + [p[1] for p in pairs])
    dst = torch.cat([p[1] for p in pairs] + [p[0] for p in pairs])
    return Graph.from_edges(src, dst, num_nodes, ndata=dict(ndata), name=name, coalesce=True)


def read_ogbl(folder: str | Path, name: str | None = None) -> Graph:
    """The OGB link benchmark unpacked in ``folder`` (module docstring): its message-passing
    graph with the official split as :attr:`~gnnpar.graph.Graph.edge_split`. ``name`` (one
    of :func:`ogbl_datasets`) says which benchmark it is; None: the folder's name must be
    one of the names :func:`find_ogbl` looks for."""
    folder = Path(folder)
    spec = _spec_of_folder(folder, name)
    scheme = folder / "split" / spec.split
    if not scheme.is_dir():
        found = sorted(p.name for p in scheme.parent.iterdir()) if scheme.parent.is_dir() else []
        raise FileNotFoundError(
            f"{scheme} does not exist ({spec.name}'s split is {spec.split!r}; found {found})"
        )
    parts = {part: _Part(scheme / f"{part}.pt") for part in _PARTS}
    ndata, num_nodes = _node_data(folder / "raw", parts)
    arrays = _split_arrays(spec, parts, num_nodes)
    graph = _symmetric_graph([arrays["train"]], num_nodes, ndata, spec.name)
    positives = [arrays[k] for k in ("train", "val", "test")]
    whole = _symmetric_graph(positives, num_nodes, ndata, spec.name)
    graph.edge_split = EdgeSplit(
        **arrays,
        protocol=spec.protocol,
        metric=spec.metric,
        source=whole.record(),
        how={"method": "ogb", "dataset": spec.name, "scheme": spec.split},
    )
    graph.edge_split.validate(num_nodes, str(folder))
    return graph


def ogbl(root: str | Path, name: str) -> Graph:
    """The OGB link benchmark ``name`` (see :func:`ogbl_datasets`) from its unpacked archive
    under the data root ``root`` (:func:`find_ogbl`): the message-passing graph of its
    official split, the split as its :attr:`~gnnpar.graph.Graph.edge_split`."""
    _spec(name)
    return read_ogbl(find_ogbl(root, name), name)
