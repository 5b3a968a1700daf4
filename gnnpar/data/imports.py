"""``gnnpar data import``: a graph saved by another library, read without running it.

Four kinds of file, told apart by their suffix (or ``kind``):

- ``pyg`` (``.pt``, ``.pth``): a ``torch_geometric.data.Data`` written by ``torch.save``.
  It is read with ``torch.load(weights_only=True)`` and an allow-list of exactly the PyG
  classes a ``Data`` is made of (:data:`PYG_CLASSES`), so a file that names anything else
  (``os.system``...) is refused before anything in it is called; a ``HeteroData`` is
  refused as heterogeneous.
- ``dgl`` (``.bin``): a file of ``dgl.save_graphs`` holding one homogeneous graph. DGL reads
  its own binary format in C++ (``_CAPI_LoadGraphFiles_V2``): no pickle is involved. A graph
  label ``num_classes`` (``dgl.save_graphs(path, [g], {"num_classes": torch.tensor([C])})``)
  is kept.
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

import pickle
import re
import warnings
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from gnnpar.data.safe_pickle import UnsafePickleError
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
#: The PyG classes a saved ``Data`` (and, to name it as heterogeneous, a ``HeteroData``) is
#: made of: the only globals a ``.pt`` file may name besides torch's tensors.
PYG_CLASSES = (
    "torch_geometric.data.data.Data",
    "torch_geometric.data.data.DataEdgeAttr",
    "torch_geometric.data.data.DataTensorAttr",
    "torch_geometric.data.storage.GlobalStorage",
    "torch_geometric.data.hetero_data.HeteroData",
    "torch_geometric.data.storage.BaseStorage",
    "torch_geometric.data.storage.NodeStorage",
    "torch_geometric.data.storage.EdgeStorage",
)
_SCIPY_KEYS = frozenset({"indices", "indptr", "format", "shape", "data", "row", "col", "offsets"})
# torch names the refused global as "GLOBAL module.name" in every version's message
_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


class UnsafeFileError(UnsafePickleError):
    """A file that asks to run code (a pickle naming a function or class outside the
    allow-list): refused before anything is called."""


def _pyg_classes() -> list[type]:
    import importlib

    found = []
    for dotted in PYG_CLASSES:
        module, _, name = dotted.rpartition(".")
        cls = getattr(importlib.import_module(module), name, None)
        if cls is not None:
            found.append(cls)
    return found


def _read_pyg(path: Path, name: str) -> Graph:
    try:
        import torch_geometric  # noqa: F401 - the classes of the allow-list
    except ImportError as err:
        raise MissingPackageError(f"{path}: reading a PyG file needs torch_geometric") from err
    try:
        with torch.serialization.safe_globals(_pyg_classes()), warnings.catch_warnings():
            # a plain pickle of protocol > 2 draws a multi-line warning before the refusal
            warnings.simplefilter("ignore", UserWarning)
            data = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:  # what a weights-only load raises for any object
        found = _UNSUPPORTED_GLOBAL.search(str(err))  # the class it names, for the message
        what = f"it names {found.group(1)}, which is" if found else "it holds what is"
        raise UnsafeFileError(
            f"{path}: refusing to load it: {what} not a PyG graph class or a tensor (only "
            "torch_geometric Data files are read, never unpickled freely)"
        ) from None
    except Exception as err:  # torch raises RuntimeError, EOFError... for a damaged file
        raise UserError(f"{path}: not a torch.save file of a PyG Data: {first_line(err)}") from None
    if not hasattr(data, "edge_index") and not convert.is_heterogeneous(data):
        raise UserError(f"{path}: holds a {type(data).__name__}, not a PyG Data")
    try:
        return convert.from_pyg(data, name=name)
    except UserError as err:
        raise UserError(f"{path}: {err}") from None


#: The first 8 bytes of a ``dgl.save_graphs`` file (DGL's kDGLSerializeMagic, little-endian).
_DGL_MAGIC = (0xDD2E4FF046B4A13F).to_bytes(8, "little")


def _read_dgl(path: Path, name: str) -> Graph:
    convert.import_dgl("from_dgl")
    from dgl.data.utils import load_graphs

    with open(path, "rb") as f:
        if f.read(8) != _DGL_MAGIC:  # checked here: DGL's own check prints its C++ stack
            raise UserError(f"{path}: not a dgl.save_graphs file (no DGL header)")
    try:
        graphs, labels = load_graphs(str(path))
    except Exception as err:  # noqa: BLE001 - DGLError for a damaged file, with a C++ stack
        # not DGL's "[time] file.cc:line: Check failed:" prefix
        reason = first_line(err).split("Check failed: ")[-1][:200]
        raise UserError(f"{path}: not a readable dgl.save_graphs file ({reason})") from None
    if len(graphs) != 1:
        raise UserError(f"{path} holds {len(graphs)} graphs: import one graph per file")
    classes = labels.get("num_classes")
    try:
        return convert.from_dgl(graphs[0], name=name, num_classes=classes)
    except UserError as err:
        raise UserError(f"{path}: {err}") from None


def _read_npz(path: Path, name: str) -> Graph:
    import scipy.sparse as sp

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


def _read_edges(path: Path, name: str) -> Graph:
    return convert.from_edge_list(path, name=name)


_READERS: Mapping[str, Callable[[Path, str], Graph]] = MappingProxyType(
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


def read_graph_file(path: str | Path, kind: str | None = None, name: str | None = None) -> Graph:
    """The graph in ``path`` (a PyG, DGL, scipy ``.npz`` or edge-list file; see the module
    docstring), named ``name`` (default: the file's stem). Nothing in the file is run."""
    path = Path(path)
    kind = file_kind(path, kind)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    return _READERS[kind](path, name or path.stem)


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
