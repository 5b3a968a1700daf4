"""The partition folder: layout, metadata, checksums, and loading one part.

A partitioned graph is a folder. Nodes are **relabelled** so that part ``k`` owns the
contiguous range of new ids ``node_ranges[k] = [start, stop)``: part 0's nodes first (in
their original id order), then part 1's, and so on. Every array is a ``.npy`` file (load it
with ``numpy.load(path, mmap_mode="r")`` to map it instead of reading it)::

    out/
      meta.json             what is below, plus a checksum and a size per file
      node_map.npy          int64 (num_nodes,)   node_map[original id] = new id
      part-0/
        indptr.npy          int64 (num_local + 1,)  local CSR row offsets
        indices.npy         int64 (num_local_edges,) local id of each in-neighbour
        edge_ids.npy        int64 (num_local_edges,) position of each edge in the input CSR
        edge_weight.npy     (num_local_edges,)  only if the graph has edge weights
        local_to_global.npy int64 (num_local,)  new (global) id of every local node
        orig_ids.npy        int64 (num_local,)  original id of every local node
        num_owned.npy       int64 0-d           number of owned nodes
        ndata/
          feat.npy          (num_owned, ...)    node data of the owned nodes, local order;
          label.npy                             one file per ndata key (feat, label,
          train_mask.npy                        train_mask, val_mask, test_mask, ...)
          ...
      part-1/
      ...

**Local ids.** ``0 .. num_owned-1`` are the owned nodes, in new-id order, so local id ``i``
is global id ``start + i``. Then come the halo nodes (``num_local - num_owned`` of them),
in increasing global id. The CSR follows the project's convention (row ``i`` lists the
*in*-neighbours of node ``i``). With ``halo_hops = 1``, row ``i`` of an owned node holds
*every* in-edge of that node (sources outside the part appear as halo nodes); halo rows are
empty. With ``halo_hops = 0`` there are no halo nodes and only edges between owned nodes
are kept.

**meta.json** fields:

- ``format``: ``"gnnpar-partition"``; ``schema_version``: ``1``.
- ``graph_name``, ``method``, ``seed``, ``balance`` (list of names): how it was made;
  ``partition_info``: what the method reported (e.g. METIS's ``edge_cut``).
- ``num_parts``, ``num_nodes``, ``num_edges`` (stored edges of the whole graph),
  ``halo_hops`` (0 or 1), ``weighted`` (whether ``edge_weight.npy`` files exist).
- ``node_ranges``: ``[[start, stop], ...]``, one per part.
- ``parts``: per part ``{"num_owned", "num_halo", "num_local_edges"}``.
- ``ndata``: per key ``{"dtype", "shape"}``, the *global* shape (``shape[0] == num_nodes``;
  part ``k`` stores ``num_owned`` rows). ``bfloat16`` data is stored as its ``uint16`` bit
  pattern (``"stored_as": "uint16"``).
- ``files``: per file (path relative to the folder) ``{"sha256", "bytes"}``.

Example: ``gnnpar-partition citeseer --parts 2 --out citeseer-2`` writes this
``meta.json`` (abridged: 23 files are listed)::

    {"format": "gnnpar-partition", "schema_version": 1, "graph_name": "citeseer",
     "method": "metis", "seed": 0, "balance": ["nodes"], "num_parts": 2,
     "num_nodes": 3327, "num_edges": 9104, "halo_hops": 1, "weighted": false,
     "node_ranges": [[0, 1668], [1668, 3327]],
     "parts": [{"num_owned": 1668, "num_halo": 27, "num_local_edges": 5220},
               {"num_owned": 1659, "num_halo": 30, "num_local_edges": 3884}],
     "ndata": {"feat": {"dtype": "float32", "shape": [3327, 3703]},
               "label": {"dtype": "int64", "shape": [3327]},
               "train_mask": {"dtype": "bool", "shape": [3327]}, ...},
     "files": {"node_map.npy": {"sha256": "734f8d42...", "bytes": 26744},
               "part-0/indptr.npy": {"sha256": "6d04b10c...", "bytes": 13696}, ...},
     "partition_info": {"constraints": ["nodes"], "undirected_edges": 4552,
                        "edge_cut": 32, "time_s": 0.067}}

**Guarantees.** :func:`~partitioners.writer.write` builds the folder under a temporary name
next to the target and renames it at the end, so a folder with the final name is always
complete; it refuses to overwrite. :func:`load_part` reads ``meta.json`` and part ``k``'s
files only, and checks the format and schema version, the part count and each file's size
and checksum before returning.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FORMAT",
    "SCHEMA_VERSION",
    "PartData",
    "PartitionFormatError",
    "file_digest",
    "load_meta",
    "load_node_map",
    "load_part",
    "save_npy",
]

FORMAT = "gnnpar-partition"
SCHEMA_VERSION = 1
META = "meta.json"
NODE_MAP = "node_map.npy"
_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_CHUNK = 1 << 22


class PartitionFormatError(ValueError):
    """A partition folder is missing, incomplete, corrupted or of another version."""


def part_dir(k: int) -> str:
    return f"part-{k}"


def check_key(key: str) -> str:
    """A node-data key usable as a file name, or ValueError."""
    if not _KEY.match(key):
        raise ValueError(
            f"node data key {key!r} cannot be a file name: use letters, digits, '_', '.', '-'"
        )
    return key


def save_npy(path: Path, array: np.ndarray) -> dict[str, Any]:
    """Write ``array`` as a ``.npy`` file; returns its ``{"sha256", "bytes"}`` entry.

    The checksum is computed from memory while writing, so the file is never read back.
    """
    array = np.ascontiguousarray(array)
    if array.dtype.hasobject:
        raise ValueError(f"cannot store {path.name}: object arrays are not supported")
    header = io.BytesIO()
    info = np.lib.format.header_data_from_array_1_0(array)
    try:
        np.lib.format.write_array_header_1_0(header, info)
    except ValueError:  # header longer than 64 KiB: format 2.0
        header = io.BytesIO()
        np.lib.format.write_array_header_2_0(header, info)
    digest = hashlib.sha256(header.getbuffer())
    data = memoryview(array.reshape(-1)).cast("B") if array.size else memoryview(b"")
    digest.update(data)
    with open(path, "wb") as f:
        f.write(header.getbuffer())
        f.write(data)
    return {"sha256": digest.hexdigest(), "bytes": len(header.getbuffer()) + data.nbytes}


def file_digest(path: Path) -> str:
    """SHA-256 of a file, read in chunks."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            got = f.readinto(buf)
            if not got:
                break
            h.update(view[:got])
    return h.hexdigest()


@dataclass
class PartData:
    """One loaded part (arrays are memory maps when loaded with ``mmap=True``).

    Attributes:
        part_id, num_parts: which part of how many.
        node_range: ``(start, stop)``, the new ids this part owns.
        num_owned: ``stop - start``.
        indptr, indices: local CSR over owned + halo nodes (see the module docstring).
        edge_ids: position of every local edge in the input CSR.
        edge_weight: per local edge, or None.
        local_to_global: new id of every local node; ``orig_ids``: original id.
        ndata: node data of the owned nodes (``feat``, ``label``, masks, ...).
        meta: the folder's ``meta.json``.
    """

    part_id: int
    num_parts: int
    node_range: tuple[int, int]
    num_owned: int
    indptr: np.ndarray
    indices: np.ndarray
    edge_ids: np.ndarray
    edge_weight: np.ndarray | None
    local_to_global: np.ndarray
    orig_ids: np.ndarray
    ndata: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_local(self) -> int:
        return int(self.local_to_global.shape[0])

    @property
    def num_halo(self) -> int:
        return self.num_local - self.num_owned

    @property
    def halo_global_ids(self) -> np.ndarray:
        return self.local_to_global[self.num_owned :]

    def global_to_local(self, ids: np.ndarray) -> np.ndarray:
        """Local ids of global (new) ids; -1 for nodes that are neither owned nor halo."""
        ids = np.asarray(ids, dtype=np.int64)
        start, stop = self.node_range
        out = np.full(ids.shape, -1, dtype=np.int64)
        owned = (ids >= start) & (ids < stop)
        out[owned] = ids[owned] - start
        halo = self.halo_global_ids
        if halo.shape[0]:
            rest = ~owned
            at = np.searchsorted(halo, ids[rest])
            found = at < halo.shape[0]
            found[found] = halo[at[found]] == ids[rest][found]
            local = np.where(found, self.num_owned + at, -1)
            out[rest] = local
        return out


def load_meta(path: str | Path) -> dict[str, Any]:
    """Read and check ``meta.json`` (format, schema version, consistent part count)."""
    folder = Path(path)
    if not folder.is_dir():
        raise PartitionFormatError(f"{folder} is not a partition folder (no such directory)")
    meta_path = folder / META
    if not meta_path.is_file():
        raise PartitionFormatError(f"{meta_path} is missing: not a partition folder")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PartitionFormatError(f"{meta_path} is not valid JSON: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PartitionFormatError(f"{meta_path} does not describe a {FORMAT} folder")
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PartitionFormatError(
            f"{meta_path} has schema version {version!r}; this reader supports version "
            f"{SCHEMA_VERSION}"
        )
    for key in ("num_parts", "num_nodes", "num_edges", "halo_hops", "node_ranges", "parts"):
        if key not in meta:
            raise PartitionFormatError(f"{meta_path} lacks the field {key!r}")
    k = meta["num_parts"]
    if len(meta["node_ranges"]) != k or len(meta["parts"]) != k:
        raise PartitionFormatError(
            f"{meta_path} says num_parts = {k} but lists {len(meta['node_ranges'])} node "
            f"ranges and {len(meta['parts'])} parts"
        )
    return meta


def _check_file(folder: Path, rel: str, meta: dict[str, Any], verify: bool) -> Path:
    entry = meta.get("files", {}).get(rel)
    path = folder / rel
    if entry is None:
        raise PartitionFormatError(f"{folder / META} has no checksum for {rel}")
    if not path.is_file():
        raise PartitionFormatError(f"{path} is missing")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise PartitionFormatError(
            f"{path} has {size} bytes, expected {entry['bytes']} (truncated or replaced)"
        )
    if verify:
        digest = file_digest(path)
        if digest != entry["sha256"]:
            raise PartitionFormatError(
                f"{path} does not match its checksum (sha256 {digest[:12]}..., expected "
                f"{entry['sha256'][:12]}...): the file was changed after it was written"
            )
    return path


def _load(folder: Path, rel: str, meta: dict[str, Any], mmap: bool, verify: bool) -> np.ndarray:
    path = _check_file(folder, rel, meta, verify)
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise PartitionFormatError(f"{path} is not a readable .npy file: {err}") from err


def load_part(
    path: str | Path,
    k: int,
    mmap: bool = True,
    verify: bool = True,
    expect_parts: int | None = None,
) -> PartData:
    """Load part ``k`` of a partition folder, reading nothing of the other parts.

    Args:
        path: the folder written by :func:`~partitioners.writer.write`.
        k: the part, in ``[0, num_parts)``.
        mmap: memory-map the arrays instead of reading them.
        verify: check every file's SHA-256 (sizes are always checked).
        expect_parts: if given, the folder must have exactly this many parts (e.g. the
            world size).

    Raises:
        PartitionFormatError: (a ValueError) naming the file and the problem.
    """
    folder = Path(path)
    meta = load_meta(folder)
    num_parts = int(meta["num_parts"])
    if expect_parts is not None and expect_parts != num_parts:
        raise PartitionFormatError(
            f"{folder} holds {num_parts} parts, but {expect_parts} were expected"
        )
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k < num_parts:
        raise PartitionFormatError(
            f"part {k!r} does not exist: {folder} has parts 0..{num_parts - 1}"
        )
    k = int(k)
    present = sorted(p.name for p in folder.glob("part-*") if p.is_dir())
    if len(present) != num_parts:
        raise PartitionFormatError(
            f"{folder} has {len(present)} part folders but meta.json says {num_parts}"
        )
    sub = part_dir(k)

    def arr(name: str) -> np.ndarray:
        return _load(folder, f"{sub}/{name}", meta, mmap, verify)

    info = meta["parts"][k]
    start, stop = (int(x) for x in meta["node_ranges"][k])
    num_owned = int(_load(folder, f"{sub}/num_owned.npy", meta, False, verify).reshape(-1)[0])
    indptr = arr("indptr.npy")
    local_to_global = arr("local_to_global.npy")
    expected = {
        "num_owned": (num_owned, stop - start),
        "num_local": (local_to_global.shape[0], info["num_owned"] + info["num_halo"]),
        "indptr length": (indptr.shape[0], local_to_global.shape[0] + 1),
    }
    for what, (got, want) in expected.items():
        if got != want:
            raise PartitionFormatError(f"{folder / sub}: {what} is {got}, expected {want}")
    ndata = {}
    for key, spec in meta.get("ndata", {}).items():
        ndata[key] = arr(f"ndata/{check_key(key)}.npy")
        if ndata[key].shape[:1] != (num_owned,) or list(ndata[key].shape[1:]) != spec["shape"][1:]:
            raise PartitionFormatError(
                f"{folder / sub}/ndata/{key}.npy has shape {ndata[key].shape}, expected "
                f"({num_owned}, {', '.join(map(str, spec['shape'][1:]))})"
            )
    return PartData(
        part_id=k,
        num_parts=num_parts,
        node_range=(start, stop),
        num_owned=num_owned,
        indptr=indptr,
        indices=arr("indices.npy"),
        edge_ids=arr("edge_ids.npy"),
        edge_weight=arr("edge_weight.npy") if meta.get("weighted") else None,
        local_to_global=local_to_global,
        orig_ids=arr("orig_ids.npy"),
        ndata=ndata,
        meta=meta,
    )


def load_node_map(path: str | Path, mmap: bool = True, verify: bool = True) -> np.ndarray:
    """``node_map[original id] = new id`` for the whole graph."""
    folder = Path(path)
    return _load(folder, NODE_MAP, load_meta(folder), mmap, verify)
