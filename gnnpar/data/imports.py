"""``gnnpar data import``: a graph saved by another library, read without running it.

Four kinds of file, told apart by their suffix (or ``kind``):

- ``pyg`` (``.pt``, ``.pth``): a ``torch_geometric.data.Data`` or ``HeteroData`` (a typed
  graph) written by ``torch.save``. It is read by
  :func:`~gnnpar.data.safe_pickle.load_torch_file`, our restricted unpickler, with an
  allow-list of exactly the PyG classes the two are made of (:data:`PYG_CLASSES`) and
  stand-ins for torch's tensor names, so a file that names anything else (``os.system``,
  ``ClusterData``...) is refused before anything in it is called. Not
  ``torch.load(weights_only=True)``: importing PyG widens its allow-list for the whole
  process with classes whose constructors do real work.
- ``dgl`` (``.bin``): a file of ``dgl.save_graphs`` holding one graph, homogeneous or a
  heterograph (a typed graph). DGL reads its own binary format in C++
  (``_CAPI_LoadGraphFiles_V2``, for both kinds of graph): type names are strings, data are
  tensors, no pickle is involved. A graph label ``num_classes`` (``dgl.save_graphs(path,
  [g], {"num_classes": torch.tensor([C])})``) is kept.
- ``npz`` (``.npz``): a ``scipy.sparse.save_npz`` matrix (``A[i, j]`` = weight of edge
  ``j -> i``), read with ``allow_pickle=False``; further arrays of the same file whose first
  dimension is the number of nodes (``np.savez(path, **matrix_arrays, feat=..., label=...,
  train_mask=...)``) become node data and a scalar ``num_classes`` the class count.
- ``edges`` (``.txt``, ``.edges``, ``.el``, ``.tsv``, ``.edgelist``): the edge-list text
  format of :mod:`gnnpar.graph.convert` (``src dst [weight]`` per line, ``#`` comments, ``# nodes:
  N``).

Every failure is one ValueError (or :class:`UnsafeFileError`) naming the file.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from gnnpar.data.safe_pickle import PYG_CLASSES, UnsafePickleError, load_torch_file, pyg_globals
from gnnpar.errors import MissingPackageError, UserError, first_line
from gnnpar.graph import Graph, convert
from gnnpar.verified import file_entry

__all__ = ["KINDS", "PYG_CLASSES", "UnsafeFileError", "import_source", "read_graph_file"]

#: Kind of file by suffix.
KINDS: Mapping[str, str] = MappingProxyType(
    {
        ".pt": "pyg",
        ".pth": "pyg",
        ".bin": "dgl",
        ".npz": "npz",
        ".txt": "edges",
        ".edges": "edges",
        ".el": "edges",
        ".tsv": "edges",
        ".edgelist": "edges",
    }
)
# PYG_CLASSES (re-exported from gnnpar.data.safe_pickle): the PyG classes a saved ``Data``
# or ``HeteroData`` is made of, the only globals a ``.pt`` file may name besides tensors.
_SCIPY_KEYS = frozenset({"indices", "indptr", "format", "shape", "data", "row", "col", "offsets"})
# how safe_pickle names the refused global
_UNSUPPORTED_GLOBAL = re.compile(r"refusing to unpickle ([\w.]+)")


class UnsafeFileError(UnsafePickleError):
    """A file that asks to run code (a pickle naming a function or class outside the
    allow-list): refused before anything is called."""


def _read_pyg(path: Path, name: str, target: str | None = None) -> Graph:
    try:
        allowed = pyg_globals()  # imports the PyG classes of the allow-list
    except ImportError as err:
        raise MissingPackageError(f"{path}: reading a PyG file needs torch_geometric") from err
    try:
        data = load_torch_file(path, allowed)
    except UnsafePickleError as err:
        found = _UNSUPPORTED_GLOBAL.search(str(err))  # the class it names, for the message
        what = f"it names {found.group(1)}, which is" if found else "it holds what is"
        raise UnsafeFileError(
            f"{path}: refusing to load it: {what} not a PyG graph class or a tensor (only "
            "torch_geometric Data and HeteroData files are read, never unpickled freely)"
        ) from None
    except UserError as err:  # not a torch file, a damaged one: names the file already
        raise UserError(f"{first_line(err)} (expected a torch.save file of a PyG graph)") from None
    if not hasattr(data, "edge_index") and not convert.is_heterogeneous(data):
        raise UserError(f"{path}: holds a {type(data).__name__}, not a PyG Data or HeteroData")
    try:
        return convert.from_pyg(data, name=name, target=target)
    except UserError as err:
        raise UserError(f"{path}: {err}") from None


#: The first 8 bytes of a ``dgl.save_graphs`` file (DGL's kDGLSerializeMagic, little-endian).
_DGL_MAGIC = (0xDD2E4FF046B4A13F).to_bytes(8, "little")


def _read_dgl(path: Path, name: str, target: str | None = None) -> Graph:
    convert.import_dgl("from_dgl")
    from dgl.data.utils import load_graphs

    with open(path, "rb") as f:
        if f.read(8) != _DGL_MAGIC:  # checked here: DGL's own check prints its C++ stack
            raise UserError(f"{path}: not a dgl.save_graphs file (no DGL header)")
    try:
        # safe on a user's file, homogeneous or heterograph alike: DGL parses its own binary
        # format in C++ (type names as strings, data as tensors) and unpickles nothing
        graphs, labels = load_graphs(str(path))
    except Exception as err:  # noqa: BLE001 - DGLError for a damaged file, with a C++ stack
        # not DGL's "[time] file.cc:line: Check failed:" prefix
        reason = first_line(err).split("Check failed: ")[-1][:200]
        raise UserError(f"{path}: not a readable dgl.save_graphs file ({reason})") from None
    if len(graphs) != 1:
        raise UserError(f"{path} holds {len(graphs)} graphs: import one graph per file")
    classes = labels.get("num_classes")
    try:
        return convert.from_dgl(graphs[0], name=name, num_classes=classes, target=target)
    except UserError as err:
        raise UserError(f"{path}: {err}") from None


def _read_npz(path: Path, name: str, target: str | None = None) -> Graph:
    import scipy.sparse as sp

    _untyped(path, target)
    try:
        mat = sp.load_npz(path)  # np.load(allow_pickle=False) inside
        with np.load(path, allow_pickle=False) as arrays:
            extra = {k: arrays[k] for k in arrays.files if k not in _SCIPY_KEYS}
    except (
        ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile, NotImplementedError,
        RuntimeError,
    ) as err:  # fmt: skip
        # np.load's and zipfile's errors for a damaged archive: a bad CRC, a truncated file,
        # no matrix, or header flags that now say "compressed by an unknown method" or
        # "encrypted" (zipfile raises NotImplementedError and RuntimeError for those)
        raise UserError(
            f"{path}: not a readable scipy.sparse.save_npz file ({first_line(err, 200)})"
        ) from None
    classes = extra.pop("num_classes", None)
    n = mat.shape[0]
    ndata = {}
    for key, array in extra.items():
        if array.ndim == 0 or array.shape[0] != n:
            raise UserError(
                f"{path}: array {key!r} has shape {array.shape}, expected {n} rows (one per "
                "node) or a scalar num_classes"
            )
        if array.dtype.kind not in "biuf":  # strings, objects, complex: not node data
            raise UserError(
                f"{path}: array {key!r} holds {array.dtype} values; node data are numbers "
                "or booleans"
            )
        ndata[key] = torch.from_numpy(array)
    if classes is not None:
        if classes.dtype.kind not in "iu":
            raise UserError(f"{path}: num_classes holds {classes.dtype}, not a whole number")
        classes = int(classes)
    try:
        return convert.from_scipy(mat, ndata=ndata, name=name, num_classes=classes)
    except UserError as err:
        raise UserError(f"{path}: {err}") from None


def _read_edges(path: Path, name: str, target: str | None = None) -> Graph:
    _untyped(path, target)
    return convert.from_edge_list(path, name=name)


def _untyped(path: Path, target: str | None) -> None:
    if target is not None:
        raise UserError(f"{path}: target applies to a heterogeneous PyG or DGL graph only")


_READERS: Mapping[str, Callable[[Path, str, str | None], Graph]] = MappingProxyType(
    {"pyg": _read_pyg, "dgl": _read_dgl, "npz": _read_npz, "edges": _read_edges}
)


def file_kind(path: str | Path, kind: str | None = None) -> str:
    """``kind`` when given (checked), else the kind its suffix names (:data:`KINDS`)."""
    if kind is not None:
        if kind not in _READERS:
            raise UserError(f"unknown file kind {kind!r}: one of {', '.join(_READERS)}")
        return kind
    suffix = Path(path).suffix.lower()
    if suffix not in KINDS:
        raise UserError(
            f"{path}: cannot tell its kind from the suffix {suffix or '(none)'!r}: known "
            f"suffixes {', '.join(KINDS)} (or pass the kind: {', '.join(_READERS)})"
        )
    return KINDS[suffix]


def read_graph_file(
    path: str | Path, kind: str | None = None, name: str | None = None, target: str | None = None
) -> Graph:
    """The graph in ``path`` (a PyG, DGL, scipy ``.npz`` or edge-list file; see the module
    docstring), named ``name`` (default: the file's stem); a heterogeneous PyG or DGL graph
    as a typed graph whose labels are those of node type ``target`` (needed only when
    several types have labels; :mod:`gnnpar.graph.convert_typed`). Nothing in the file is
    run."""
    path = Path(path)
    kind = file_kind(path, kind)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    return _READERS[kind](path, name or path.stem, target)


def import_source(path: str | Path, kind: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``source`` record of an imported graph folder: the file (absolute path, size,
    XXH3-64 checksum), its kind and the structure options applied (as
    :func:`gnnpar.data.catalogue.source_record` records them: under ``structure``, when
    given)."""
    entry = file_entry(path)
    record: dict[str, Any] = {
        "import": {
            "file": str(Path(path).resolve()),
            "kind": kind,
            "size": entry["size"],
            "xxh3_64": entry["xxh3_64"],
        }
    }
    if options:
        record["structure"] = dict(options)
    return record
