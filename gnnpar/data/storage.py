"""gnnpar's on-disk graph format: a verified folder (:mod:`gnnpar.verified`, schema
``"gnnpar.graph"``, version 2) of memory-mappable ``.npy`` files, written atomically.

Layout::

    <folder>/manifest.json       written last: every file's size and XXH3 checksum, the meta
    <folder>/indptr.npy          int64 (num_nodes + 1,)
    <folder>/indices.npy         int64 (num_edges,)
    <folder>/edge_weight.npy     float (num_edges,), only for weighted graphs
    <folder>/ndata/<key>.npy     one per node-data tensor, first dimension num_nodes
    <folder>/types/edge_type.npy only for a typed graph (:mod:`gnnpar.graph.typed`): int64
                                 (num_edges,) relation index of every edge; and
                                 ``types/node_ids.npy``, int64 (num_nodes,) original ids, for
                                 a relabelled one
    <folder>/link/<key>.npy      only for a link-prediction split (:mod:`gnnpar.graph.edge_split`):
                                 int64 ``train``, ``val``, ``test`` (2, E) positive pairs and
                                 ``val_neg``, ``test_neg`` (2, M) pairs or (E, K) per source

``manifest.json`` example::

    {"schema": "gnnpar.graph", "version": 2,
     "files": {"indptr.npy": {"size": 16136, "xxh3_64": "..."}, ...},
     "meta": {"name": "sbm", "num_nodes": 2000, "num_edges": 19874, "weighted": false,
              "num_classes": 4, "fingerprint": "3f0c...",
              "source": {"dataset": "sbm", "kwargs": {"seed": 0, ...}},
              "arrays": {"indptr": {"file": "indptr.npy", "dtype": "int64",
                                    "shape": [2001]}, ...}},
     "meta_xxh3_64": "..."}

Array names are ``indptr``, ``indices``, ``edge_weight``, ``ndata/<key>`` and ``link/<key>``.
A folder with a split is the split's message-passing graph (its training edges only) and its
meta has a ``link`` table: ``protocol`` (``pairs`` or ``per-source``), ``metric`` (the score
models are selected by), ``source`` (the record of the graph the split was cut from: its
fingerprint, name and sizes), ``how`` (method and options) and ``digest`` (of the split's
arrays, checked on load). A typed graph's meta has a ``types`` table: ``node_types`` (names
in id order), ``offsets`` (type ``t`` owns original ids ``[offsets[t], offsets[t+1])``),
``relations`` (``[src type, name, dst type]``, an edge's ``edge_type`` indexes this list),
``feat_dims`` (each type's real feature width in the zero-padded ``ndata/feat``; 0 = none)
and ``target`` (the type that labels and masks describe). ``source``
records how the graph was made (or is ``null``); ``fingerprint`` is
:meth:`Graph.fingerprint` of the stored graph, so a consumer can name the graph without
rehashing it (:func:`read_source`); ``num_classes`` is the number of classes of ``label``
(labels must lie in ``[0, num_classes)``, negative = unlabelled). A folder of an older
gnnpar (``meta.json``, no manifest) is refused: prepare it again. See ``datasets/README.md``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gnnpar.errors import UserError
from gnnpar.graph import Graph
from gnnpar.graph.edge_split import EdgeSplit
from gnnpar.graph.typed import GraphTypes
from gnnpar.verified import (
    FormatError,
    Manifest,
    check_level,
    load_npy,
    read_manifest,
    save_npy,
    write_folder,
    write_manifest,
)

__all__ = [
    "FORMAT",
    "SCHEMA_VERSION",
    "is_graph_folder",
    "is_symmetric_folder",
    "load_graph",
    "load_node_data",
    "read_manifest_of",
    "read_meta",
    "read_source",
    "save_graph",
]

FORMAT = "gnnpar.graph"
SCHEMA_VERSION = 2
_REMEDY = "prepare it again (gnnpar data prepare)"
_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_META_FIELDS = {
    "name": str,
    "num_nodes": int,
    "num_edges": int,
    "weighted": bool,
    "fingerprint": str,
    "arrays": dict,
}


def _to_numpy(tensor: torch.Tensor, name: str) -> np.ndarray:
    try:
        return tensor.detach().cpu().contiguous().numpy()
    except TypeError as err:  # e.g. bfloat16 has no numpy dtype
        raise UserError(f"cannot store {name} with dtype {tensor.dtype}: {err}") from None


def _arrays_of(graph: Graph) -> list[tuple[str, str, torch.Tensor]]:
    """``(name, file, tensor)`` of every array the folder stores."""
    arrays = [("indptr", "indptr.npy", graph.indptr), ("indices", "indices.npy", graph.indices)]
    if graph.edge_weight is not None:
        arrays.append(("edge_weight", "edge_weight.npy", graph.edge_weight))
    arrays += [(f"ndata/{k}", f"ndata/{k}.npy", v) for k, v in graph.ndata.items()]
    if graph.edge_split is not None:
        arrays += [(f"link/{k}", f"link/{k}.npy", v) for k, v in graph.edge_split.arrays().items()]
    if graph.types is not None:
        arrays += [(f"types/{k}", f"types/{k}.npy", v) for k, v in graph.types.arrays().items()]
    return arrays


def save_graph(
    graph: Graph,
    path: str | Path,
    overwrite: bool = False,
    source: dict[str, Any] | None = None,
    inputs: Sequence[str | Path] = (),
) -> Path:
    """Write ``graph`` to the folder ``path`` atomically.

    Everything is written into a temporary sibling folder that is renamed to ``path`` only
    when complete (:func:`gnnpar.verified.write_folder`), so a failure leaves no (partial)
    folder behind. An existing ``path`` is an error unless ``overwrite=True``, and then it
    must be a graph folder holding only its listed files; ``path`` must not be, hold or lie
    inside one of ``inputs`` (the files the graph was read from:
    :func:`gnnpar.verified.check_output`). ``source``
    (JSON-serialisable) is stored in the manifest's meta to record how the graph was made,
    with the graph's fingerprint and number of classes. Returns the folder path.
    """
    for key in graph.ndata:
        if not _KEY.match(key):
            raise UserError(f"ndata key {key!r} cannot be a file name (use letters, digits, _.-)")
    graph.validate()
    if graph.edge_split is not None:
        graph.edge_split.validate(graph.num_nodes, f"{graph.name}'s edge split")
    arrays = [(name, file, _to_numpy(t, name)) for name, file, t in _arrays_of(graph)]
    meta: dict[str, Any] = {
        "name": graph.name,
        "num_nodes": graph.num_nodes,
        "num_edges": graph.num_edges,
        "weighted": graph.edge_weight is not None,
        "num_classes": graph.num_classes if graph.label is not None else None,
        "fingerprint": graph.fingerprint(),
        "source": source,
        "arrays": {
            name: {"file": file, "dtype": a.dtype.name, "shape": list(a.shape)}
            for name, file, a in arrays
        },
    }
    if graph.edge_split is not None:
        meta["link"] = graph.edge_split.meta()
    if graph.types is not None:
        meta["types"] = graph.types.meta()

    def fill(tmp: Path) -> None:
        files = {file: save_npy(tmp / file, a) for _, file, a in arrays}
        write_manifest(tmp, FORMAT, SCHEMA_VERSION, files, meta)

    return write_folder(path, fill, overwrite=overwrite, schema=FORMAT, inputs=inputs)


def is_graph_folder(path: str | Path) -> bool:
    """True if ``path`` looks like a gnnpar graph folder (a manifest, or the ``meta.json``
    of an older gnnpar, which the readers then refuse with a clear message)."""
    folder = Path(path)
    return (folder / "manifest.json").is_file() or (folder / "meta.json").is_file()


def read_manifest_of(path: str | Path) -> Manifest:
    """The checked manifest of a graph folder: FormatError (a ValueError) naming the file if
    it is missing, of another schema or version, or its meta lacks a field or is edited."""
    manifest = read_manifest(path, FORMAT, (SCHEMA_VERSION,), remedy=_REMEDY)
    _check_meta(manifest)
    return manifest


def _check_meta(manifest: Manifest) -> None:
    meta, where = manifest.meta, manifest.folder / "manifest.json"
    for key, kind in _META_FIELDS.items():
        value = meta.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise FormatError(f"{where}: meta field {key!r} is {value!r}, expected {kind.__name__}")
    classes = meta.get("num_classes")
    if classes is not None and (type(classes) is not int or classes < 0):
        raise FormatError(f"{where}: meta field 'num_classes' is {classes!r}")
    for name, record in meta["arrays"].items():
        if not (
            isinstance(record, dict)
            and isinstance(record.get("file"), str)
            and isinstance(record.get("dtype"), str)
            and isinstance(record.get("shape"), list)
        ):
            raise FormatError(f"{where}: malformed record of array {name!r}")
    for required in ("indptr", "indices"):
        if required not in meta["arrays"]:
            raise FormatError(f"{where}: lists no {required!r} array")


def read_meta(path: str | Path) -> dict[str, Any]:
    """The meta table of a graph folder (name, sizes, num_classes, fingerprint, source,
    arrays), checked as :func:`read_manifest_of` does; reads no array."""
    return read_manifest_of(path).meta


def read_source(path: str | Path) -> dict[str, Any]:
    """What a derived artefact records about the graph stored at ``path``, from the
    manifest alone (no rehashing): ``fingerprint``, ``name``, ``num_nodes``, ``num_edges``,
    ``num_classes``."""
    meta = read_meta(path)
    keys = ("fingerprint", "name", "num_nodes", "num_edges", "num_classes")
    return {k: meta.get(k) for k in keys}


def _load_array(manifest: Manifest, name: str, level: str, mmap: bool) -> np.ndarray:
    record = manifest.meta["arrays"][name]
    try:
        dtype = np.dtype(record["dtype"])
    except TypeError:
        raise FormatError(
            f"{manifest.folder / 'manifest.json'}: array {name!r} has unknown dtype "
            f"{record['dtype']!r}"
        ) from None
    return load_npy(manifest, record["file"], level, mmap, dtype.name, record["shape"])


def load_node_data(
    path: str | Path, keys: list[str], verify: str = "checksum"
) -> dict[str, torch.Tensor]:
    """The node-data arrays ``keys`` of a graph folder, memory-mapped and checked like
    :func:`load_graph` checks them, without reading the structure or any other array (what
    a check before launch needs of a graph larger than memory). FormatError naming the
    folder for a key it does not hold."""
    level = check_level(verify)
    manifest = read_manifest_of(path)
    out = {}
    for key in keys:
        if f"ndata/{key}" not in manifest.meta["arrays"]:
            raise FormatError(f"{manifest.folder}: the graph has no node data {key!r}")
        out[key] = torch.from_numpy(_load_array(manifest, f"ndata/{key}", level, True))
    return out


#: Edges a streamed pass over a graph folder reads at a time (64 MiB of int64 ids).
SYMMETRY_CHUNK_EDGES = 1 << 23


def _edge_hash(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each ordered pair (splitmix64's finaliser over both ids), so that
    ``(u, v)`` and ``(v, u)`` hash differently."""
    with np.errstate(over="ignore"):
        h = src.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + dst.astype(np.uint64)
        h ^= h >> np.uint64(30)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    return h


def is_symmetric_folder(path: str | Path, chunk_edges: int = SYMMETRY_CHUNK_EDGES) -> bool:
    """Whether the graph folder's edges, as a multiset, equal their reverses, read in pieces
    of ``chunk_edges`` edges (memory-mapped; memory O(chunk), not O(edges)): the sum of a
    64-bit hash of every edge ``(u, v)`` equals that of every ``(v, u)``. For a graph
    without repeated edges this is :meth:`Graph.is_symmetric`; a directed graph passes
    with probability about 2⁻⁶⁴. The arrays are checked by size only (a check before launch
    needs no checksum pass over the structure)."""
    if chunk_edges < 1:
        raise ValueError(f"chunk_edges must be at least 1, got {chunk_edges}")
    manifest = read_manifest_of(path)
    indptr = _load_array(manifest, "indptr", "size", True)
    indices = _load_array(manifest, "indices", "size", True)
    forward = backward = np.uint64(0)
    start = 0
    with np.errstate(over="ignore"):
        while start < indices.size:
            stop = min(start + chunk_edges, indices.size)
            # the source of each edge of [start, stop): the rows whose ranges overlap it,
            # each repeated for its edges inside the piece
            first, last = np.searchsorted(indptr, [start, stop - 1], side="right") - 1
            counts = np.diff(np.clip(indptr[first : last + 2], start, stop))
            rows = np.repeat(np.arange(first, last + 1, dtype=np.int64), counts)
            cols = np.asarray(indices[start:stop])
            forward += _edge_hash(rows, cols).sum(dtype=np.uint64)
            backward += _edge_hash(cols, rows).sum(dtype=np.uint64)
            start = stop
    return bool(forward == backward)


def load_graph(
    path: str | Path, mmap: bool = True, validate: bool = True, verify: str = "checksum"
) -> Graph:
    """Load a graph folder written by :func:`save_graph`.

    With ``mmap=True`` the arrays are memory-mapped (copy-on-write): nothing but what is
    checked is read until used. ``verify`` (``"checksum"``, the default, reads every byte
    once at ~15 GB/s; ``"size"`` for very large folders; ``"none"``) says how each file is
    checked against the manifest; dtypes and shapes are always checked. ``validate`` runs
    :meth:`Graph.validate` (labels within the stored ``num_classes`` included).

    Raises:
        FormatError: (a ValueError) naming the file, for a missing, truncated, changed or
            older-format folder; ValueError for a graph that fails validation.
    """
    level = check_level(verify)
    manifest = read_manifest_of(path)
    meta = manifest.meta
    arrays = {
        name: torch.from_numpy(_load_array(manifest, name, level, mmap)) for name in meta["arrays"]
    }
    for what, count, want in (
        ("nodes", arrays["indptr"].numel() - 1, meta["num_nodes"]),
        ("edges", arrays["indices"].numel(), meta["num_edges"]),
    ):
        if count != want:
            raise FormatError(
                f"{manifest.folder}: the manifest says {want} {what}, the arrays hold {count}"
            )
    ndata = {name[len("ndata/") :]: t for name, t in arrays.items() if name.startswith("ndata/")}
    try:
        graph = Graph(
            arrays["indptr"],
            arrays["indices"],
            meta["num_nodes"],
            arrays.get("edge_weight"),
            ndata,
            meta["name"],
            validate=validate,
            num_classes=meta.get("num_classes"),
        )
        link = {name[len("link/") :]: t for name, t in arrays.items() if name.startswith("link/")}
        if link or "link" in meta:
            where = str(manifest.folder)
            graph.edge_split = EdgeSplit.from_arrays(link, meta.get("link") or {}, where)
            graph.edge_split.validate(graph.num_nodes, where)
        typed = {n[len("types/") :]: t for n, t in arrays.items() if n.startswith("types/")}
        if typed or "types" in meta:
            graph.types = GraphTypes.from_arrays(typed, meta.get("types"), str(manifest.folder))
            if validate:  # O(E), as the graph's own checks
                graph.types.validate(graph, str(manifest.folder))
            else:  # the schema was checked when read
                graph.types.check_shapes(graph, str(manifest.folder))
    except UserError as err:
        message = str(err)
        raise UserError(
            message if message.startswith(str(manifest.folder)) else f"{manifest.folder}: {message}"
        ) from None
    return graph
