"""gnnpar's on-disk graph format: a folder of memory-mappable ``.npy`` files plus
``meta.json``, written atomically.

Layout::

    <folder>/meta.json
    <folder>/indptr.npy          int64 (num_nodes + 1,)
    <folder>/indices.npy         int64 (num_edges,)
    <folder>/edge_weight.npy     float (num_edges,), only for weighted graphs
    <folder>/ndata/<key>.npy     one per node-data tensor, first dimension num_nodes

``meta.json`` example::

    {"format": "gnnpar.graph", "schema_version": 1, "name": "sbm",
     "num_nodes": 2000, "num_edges": 19874, "weighted": false,
     "source": {"dataset": "sbm", "kwargs": {"seed": 0, ...}},
     "arrays": [{"name": "indptr", "file": "indptr.npy", "dtype": "int64",
                 "shape": [2001], "bytes": 16136, "sha256": "..."}, ...]}

Array names are ``indptr``, ``indices``, ``edge_weight`` and ``ndata/<key>``. ``source``
records how the graph was made (or is ``null``). See ``datasets/README.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gnnpar.graph import Graph

__all__ = ["save_graph", "load_graph", "read_meta", "FORMAT", "SCHEMA_VERSION"]

FORMAT = "gnnpar.graph"
SCHEMA_VERSION = 1
_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_array(folder: Path, name: str, file: str, array: np.ndarray) -> dict[str, Any]:
    """Write one ``.npy`` file (flushed to disk) and return its ``meta.json`` record."""
    path = folder / file
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.save(f, array, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return {
        "name": name,
        "file": file,
        "dtype": array.dtype.name,
        "shape": list(array.shape),
        "bytes": path.stat().st_size,
        "sha256": _sha256(path),
    }


def _to_numpy(tensor: torch.Tensor, name: str) -> np.ndarray:
    try:
        return tensor.detach().cpu().contiguous().numpy()
    except TypeError as err:  # e.g. bfloat16 has no numpy dtype
        raise ValueError(f"cannot store {name} with dtype {tensor.dtype}: {err}") from None


def save_graph(
    graph: Graph,
    path: str | Path,
    overwrite: bool = False,
    source: dict[str, Any] | None = None,
) -> Path:
    """Write ``graph`` to the folder ``path`` atomically.

    Everything is written into a temporary sibling folder that is renamed to ``path`` only
    when complete, so a failure leaves no (partial) folder behind. An existing ``path`` is an
    error unless ``overwrite=True``. ``source`` (JSON-serialisable) is stored in
    ``meta.json`` to record how the graph was made. Returns the folder path.
    """
    dest = Path(path)
    if dest.exists() and not overwrite:
        raise FileExistsError(f"{dest} already exists (use overwrite=True to replace it)")
    if dest.exists() and not dest.is_dir():
        raise FileExistsError(f"{dest} exists and is not a folder")
    for key in graph.ndata:
        if not _KEY.match(key):
            raise ValueError(f"ndata key {key!r} cannot be a file name (use letters, digits, _.-)")
    graph.validate()
    meta: dict[str, Any] = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "name": graph.name,
        "num_nodes": graph.num_nodes,
        "num_edges": graph.num_edges,
        "weighted": graph.edge_weight is not None,
        "source": source,
    }
    json.dumps(meta)  # fail early, before writing anything, if source is not serialisable
    arrays = [("indptr", "indptr.npy", graph.indptr), ("indices", "indices.npy", graph.indices)]
    if graph.edge_weight is not None:
        arrays.append(("edge_weight", "edge_weight.npy", graph.edge_weight))
    arrays += [(f"ndata/{k}", f"ndata/{k}.npy", v) for k, v in graph.ndata.items()]

    dest.parent.mkdir(parents=True, exist_ok=True)
    # A hidden sibling on the same file system, so the final rename is atomic. (mkdir, not
    # mkdtemp: the folder should get the usual permissions, not 0700.)
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        meta["arrays"] = [
            _write_array(tmp, name, file, _to_numpy(t, name)) for name, file, t in arrays
        ]
        with open(tmp / "meta.json", "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _replace(tmp, dest, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _replace(tmp: Path, dest: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``dest``; an existing ``dest`` is moved aside first and removed
    only after the new folder is in place (and restored if the rename fails)."""
    if not dest.exists():
        os.rename(tmp, dest)  # fails if someone created dest meanwhile: never merge folders
        return
    if not overwrite:
        raise FileExistsError(f"{dest} already exists (use overwrite=True to replace it)")
    old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(dest, old)
    try:
        os.rename(tmp, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)


def read_meta(path: str | Path) -> dict[str, Any]:
    """Read and check ``meta.json`` of a graph folder (format and schema version)."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"no graph folder at {folder}")
    meta_file = folder / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{folder} has no meta.json: not a gnnpar graph folder")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{meta_file} is not valid JSON: {err}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{meta_file} does not describe a {FORMAT!r} folder")
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"{meta_file} has schema version {version}; this gnnpar reads version {SCHEMA_VERSION}"
        )
    for field in ("name", "num_nodes", "num_edges", "arrays"):
        if field not in meta:
            raise ValueError(f"{meta_file} lacks the field {field!r}")
    return meta


def _load_array(folder: Path, record: dict[str, Any], mmap: bool, verify: bool) -> np.ndarray:
    path = folder / record["file"]
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (listed in meta.json as {record['name']!r})")
    size = path.stat().st_size
    if size != record["bytes"]:
        raise ValueError(
            f"{path} is truncated or altered: {size} bytes on disk, meta.json says "
            f"{record['bytes']}"
        )
    if verify and _sha256(path) != record["sha256"]:
        raise ValueError(f"{path} does not match its sha256 checksum in meta.json")
    try:
        # "c" (copy-on-write): pages load lazily and the array stays writable for torch.
        array = np.load(path, mmap_mode="c" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ValueError(f"{path} is not a readable .npy file: {err}") from None
    if list(array.shape) != list(record["shape"]) or array.dtype != np.dtype(record["dtype"]):
        raise ValueError(
            f"{path} holds {array.dtype}{list(array.shape)}, meta.json says "
            f"{record['dtype']}{record['shape']}"
        )
    return array


def load_graph(
    path: str | Path, mmap: bool = True, validate: bool = True, verify_checksums: bool = False
) -> Graph:
    """Load a graph folder written by :func:`save_graph`.

    With ``mmap=True`` the arrays are memory-mapped (copy-on-write): nothing is read until
    used. File sizes, dtypes and shapes are checked against ``meta.json``; sha256 checksums
    only with ``verify_checksums=True`` (it reads every byte). ``validate`` runs
    :meth:`Graph.validate`.
    """
    folder = Path(path)
    meta = read_meta(folder)
    arrays: dict[str, torch.Tensor] = {}
    for record in meta["arrays"]:
        array = _load_array(folder, record, mmap, verify_checksums)
        arrays[record["name"]] = torch.from_numpy(array)
    for required in ("indptr", "indices"):
        if required not in arrays:
            raise ValueError(f"{folder}/meta.json lists no {required!r} array")
    if int(meta["num_nodes"]) + 1 != arrays["indptr"].numel():
        raise ValueError(
            f"{folder}: meta.json says {meta['num_nodes']} nodes but indptr has "
            f"{arrays['indptr'].numel()} entries"
        )
    if int(meta["num_edges"]) != arrays["indices"].numel():
        raise ValueError(
            f"{folder}: meta.json says {meta['num_edges']} edges but indices has "
            f"{arrays['indices'].numel()} entries"
        )
    ndata = {name[len("ndata/") :]: t for name, t in arrays.items() if name.startswith("ndata/")}
    return Graph(
        arrays["indptr"],
        arrays["indices"],
        int(meta["num_nodes"]),
        arrays.get("edge_weight"),
        ndata,
        meta["name"],
        validate=validate,
    )
