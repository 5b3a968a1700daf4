"""The partition folder: layout, metadata, checksums, provenance, and loading one part.

A partitioned graph is a verified folder (:mod:`gnnpar.verified`: schema
``"gnnpar.partition"``, version 2). Nodes are **relabelled** so that part ``k`` owns the
contiguous range of new ids ``node_ranges[k] = [start, stop)``: part 0's nodes first (in
their original id order), then part 1's, and so on. Every array is a ``.npy`` file (load it
with ``numpy.load(path, mmap_mode="r")`` to map it instead of reading it)::

    out/
      manifest.json         written last: every file's size and XXH3 checksum, the meta below
      node_map.npy          int64 (num_nodes,)   node_map[original id] = new id
      part-0/
        indptr.npy          int64 (num_local + 1,)  local CSR row offsets
        indices.npy         int64 (num_local_edges,) local id of each in-neighbour
        edge_ids.npy        int64 (num_local_edges,) position of each edge in the input CSR
        edge_weight.npy     (num_local_edges,)  only if the graph has edge weights
        local_to_global.npy int64 (num_local,)  new (global) id of every local node
        orig_ids.npy        int64 (num_local,)  original id of every local node
        num_owned.npy       int64 0-d           number of owned nodes
        types/              only for a typed graph (gnnpar.graph.typed):
          edge_type.npy     int64 (num_local_edges,) relation index of each local edge
          node_ids.npy      int64 (num_local,)  the types' original id of every local node,
                                                only for a relabelled typed graph
                                                (``type_node_ids`` below)
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

**The manifest's meta** fields:

- ``source``: the graph it was cut from, ``{"fingerprint", "name", "num_nodes",
  "num_edges", "num_classes"}`` (``fingerprint`` is :meth:`gnnpar.graph.Graph.fingerprint`;
  ``null`` when the input was not a gnnpar ``Graph``). :func:`check_source` compares it with
  a dataset.
- ``graph_name``, ``method``, ``seed``, ``balance`` (list of names): how it was made;
  ``partition_info``: what the method reported (e.g. METIS's ``edge_cut``).
- ``num_parts``, ``num_nodes``, ``num_edges`` (stored edges of the whole graph),
  ``halo_hops`` (0 or 1), ``weighted`` (whether ``edge_weight.npy`` files exist).
- ``node_ranges``: ``[[start, stop], ...]``, one per part.
- ``parts``: per part ``{"num_owned", "num_halo", "num_local_edges", "num_train"}``
  (``num_train``: training seeds, ``null`` without a ``train_mask``).
- ``ndata``: per key ``{"dtype", "shape"}``, the *global* shape (``shape[0] == num_nodes``;
  part ``k`` stores ``num_owned`` rows). ``bfloat16`` data is stored as its ``uint16`` bit
  pattern (``"stored_as": "uint16"``).

**Typed graphs** (:mod:`gnnpar.graph.typed`; all absent for an untyped graph, and a folder
without them still loads):

- ``types``: the schema, :meth:`GraphTypes.meta() <gnnpar.graph.typed.GraphTypes.meta>`:
  ``node_types`` (names, in id order), ``offsets`` (type ``t`` owns the original ids
  ``[offsets[t], offsets[t+1])``), ``relations`` (``[src type, name, dst type]``; an
  edge's ``edge_type`` indexes this list), ``feat_dims`` and ``target``. A local node's
  type and type-local id follow from its original id (``orig_ids.npy``) by the offsets
  (:meth:`PartData.node_type`, :meth:`PartData.type_local_ids`, or
  :meth:`GraphTypes.node_type_of <gnnpar.graph.typed.GraphTypes.node_type_of>`).
- ``type_node_ids``: true when the partitioned graph was itself relabelled (a permutation
  or subgraph of a typed graph, whose ``types.node_ids`` give each node's original id in the
  types' id space); then every part stores ``types/node_ids.npy`` and those ids, not
  ``orig_ids.npy``, index the offsets.
- per part, besides the counts above: ``num_by_type`` (owned nodes of each node type),
  ``in_edges_by_relation`` (in-edges of the owned nodes, per relation, whatever
  ``halo_hops``) and ``cut_by_relation`` (those of them whose source another part owns):
  the per-type balance and per-relation edge cut, without the graph.

Example: ``gnnpar-partition citeseer --parts 2 --out citeseer-2`` writes this
``manifest.json`` (abridged: 23 files are listed)::

    {"schema": "gnnpar.partition", "version": 2,
     "files": {"node_map.npy": {"size": 26744, "xxh3_64": "734f8d42..."},
               "part-0/indptr.npy": {"size": 13696, "xxh3_64": "6d04b10c..."}, ...},
     "meta": {"source": {"fingerprint": "9b1e...", "name": "citeseer", "num_nodes": 3327,
                         "num_edges": 9104, "num_classes": 6},
              "graph_name": "citeseer", "method": "metis", "seed": 0, "balance": ["nodes"],
              "num_parts": 2, "num_nodes": 3327, "num_edges": 9104, "halo_hops": 1,
              "weighted": false, "node_ranges": [[0, 1668], [1668, 3327]],
              "parts": [{"num_owned": 1668, "num_halo": 27, "num_local_edges": 5220,
                         "num_train": 60}, ...],
              "ndata": {"feat": {"dtype": "float32", "shape": [3327, 3703]}, ...},
              "partition_info": {"constraints": ["nodes"], "edge_cut": 32, ...}},
     "meta_xxh3_64": "..."}

**Guarantees.** :func:`~partitioners.writer.write` builds the folder under a temporary name
next to the target and renames it at the end, so a folder with the final name is always
complete; it refuses to overwrite. :func:`load_part` reads the manifest and part ``k``'s
files only, and checks the schema and version, the meta (its checksum and consistency), the
part count, and each of *its* files' size and checksum (``verify="size"`` for very large
folders) before returning. A folder of an older gnnpar (``meta.json``) is refused with one
line: partition it again.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gnnpar.errors import UserError
from gnnpar.verified import (
    FormatError,
    Manifest,
    check_level,
    load_npy,
    read_manifest,
    save_npy,
)
from partitioners.typed import node_type_of

__all__ = [
    "FORMAT",
    "SCHEMA_VERSION",
    "PartData",
    "PartitionBalanceWarning",
    "PartitionFormatError",
    "PartitionSourceError",
    "check_source",
    "idle_parts_message",
    "load_manifest",
    "load_meta",
    "load_node_map",
    "load_part",
    "save_npy",
    "source_of",
]

FORMAT = "gnnpar.partition"
SCHEMA_VERSION = 2
NODE_MAP = "node_map.npy"
_REMEDY = "partition it again (gnnpar-partition)"
_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class PartitionFormatError(FormatError):
    """A partition folder is missing, incomplete, corrupted or of another version (a
    :class:`~gnnpar.verified.FormatError`, so a ValueError)."""


class PartitionSourceError(UserError):
    """A partition folder was cut from another graph than the one it is used with."""


class PartitionBalanceWarning(UserWarning):
    """A part holds no training seeds: its rank would idle through every epoch."""


def part_dir(k: int) -> str:
    return f"part-{k}"


def check_key(key: str) -> str:
    """A node-data key usable as a file name, or ValueError."""
    if not _KEY.match(key):
        raise UserError(
            f"node data key {key!r} cannot be a file name: use letters, digits, '_', '.', '-'"
        )
    return key


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
        meta: the meta table of the folder's manifest.
        edge_type: relation index of every local edge (a typed graph), or None.
        type_node_ids: the types' original id of every local node, for a relabelled typed
            graph only (None: ``orig_ids`` are those ids); see :attr:`type_ids`.
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
    edge_type: np.ndarray | None = None
    type_node_ids: np.ndarray | None = None

    @property
    def types(self) -> dict[str, Any] | None:
        """The typed graph's schema (``GraphTypes.meta()``), or None for an untyped one."""
        return self.meta.get("types")

    @property
    def type_ids(self) -> np.ndarray:
        """The original id of every local node in the types' id space (what the schema's
        ``offsets`` index): ``type_node_ids`` where stored, else ``orig_ids``."""
        return self.orig_ids if self.type_node_ids is None else self.type_node_ids

    def node_type(self, local: np.ndarray | None = None) -> np.ndarray:
        """Type index of the local nodes ``local`` (default: all of them); ValueError for an
        untyped part."""
        ids = self.type_ids if local is None else self.type_ids[np.asarray(local)]
        return node_type_of(self._offsets(), ids)

    def type_local_ids(self, local: np.ndarray | None = None) -> np.ndarray:
        """Type-local id of the local nodes ``local`` (default: all of them)."""
        ids = self.type_ids if local is None else self.type_ids[np.asarray(local)]
        offsets = self._offsets()
        return (ids - offsets[node_type_of(offsets, ids)]).astype(np.int64)

    def _offsets(self) -> np.ndarray:
        if self.types is None:
            raise UserError(f"part {self.part_id} is not of a typed graph: it has no node types")
        return np.asarray(self.types["offsets"], dtype=np.int64)

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


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_meta(manifest: Manifest) -> None:
    """The meta fields a reader relies on exist, have their types and agree with each
    other (part count, contiguous node ranges covering num_nodes, owned counts)."""
    meta, where = manifest.meta, manifest.folder / "manifest.json"
    for key in ("num_parts", "num_nodes", "num_edges", "halo_hops", "node_ranges", "parts"):
        if key not in meta:
            raise PartitionFormatError(f"{where}: meta lacks the field {key!r}")
    k, n = meta["num_parts"], meta["num_nodes"]
    if not (_is_int(k) and k >= 1 and _is_int(n) and n >= 0 and _is_int(meta["num_edges"])):
        raise PartitionFormatError(f"{where}: num_parts, num_nodes or num_edges is not a count")
    if meta["halo_hops"] not in (0, 1) or isinstance(meta["halo_hops"], bool):
        raise PartitionFormatError(f"{where}: halo_hops is {meta['halo_hops']!r}, not 0 or 1")
    ranges, parts = meta["node_ranges"], meta["parts"]
    if not isinstance(ranges, list) or not isinstance(parts, list):
        raise PartitionFormatError(f"{where}: node_ranges and parts must be lists")
    if len(ranges) != k or len(parts) != k:
        raise PartitionFormatError(
            f"{where}: num_parts = {k} but it lists {len(ranges)} node ranges and "
            f"{len(parts)} parts"
        )
    stop = 0
    for i, (rng, info) in enumerate(zip(ranges, parts, strict=True)):
        ok = isinstance(rng, list) and len(rng) == 2 and all(map(_is_int, rng))
        if not ok or rng[0] != stop or rng[1] < rng[0]:
            raise PartitionFormatError(f"{where}: node range {i} is {rng!r}, expected [{stop}, …]")
        stop = rng[1]
        counts = ("num_owned", "num_halo", "num_local_edges")
        if not isinstance(info, dict) or not all(_is_int(info.get(c)) for c in counts):
            raise PartitionFormatError(f"{where}: part {i}'s record is malformed")
        if info["num_owned"] != rng[1] - rng[0]:
            raise PartitionFormatError(
                f"{where}: part {i} owns {info['num_owned']} nodes but its range holds "
                f"{rng[1] - rng[0]}"
            )
    if stop != n:
        raise PartitionFormatError(f"{where}: the node ranges cover {stop} nodes, num_nodes is {n}")
    ndata = meta.get("ndata", {})
    if not isinstance(ndata, dict) or not all(
        isinstance(v, dict)
        and isinstance(v.get("shape"), list)
        and all(map(_is_int, v["shape"]))
        and isinstance(v.get("dtype"), str)
        for v in ndata.values()
    ):
        raise PartitionFormatError(f"{where}: the ndata table is malformed")
    _check_descriptions(meta, where)
    if "types" in meta:
        _check_types(meta, where)


def _is_name_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(v, str) for v in x)


def _check_types(meta: dict[str, Any], where: Path) -> None:
    """A typed partition's schema and per-part counts are consistent: offsets cover
    ``num_nodes`` (unless the parts store their own node ids), relations name known types,
    and every part's counts have one entry per type or relation."""
    types = meta["types"]
    if not isinstance(types, dict):
        raise PartitionFormatError(f"{where}: meta field 'types' is not a table")
    names, offsets = types.get("node_types"), types.get("offsets")
    relations = types.get("relations")
    ok = (
        _is_name_list(names)
        and names
        and isinstance(offsets, list)
        and len(offsets) == len(names) + 1
        and all(map(_is_int, offsets))
        and offsets[0] == 0
        and all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))
        and isinstance(relations, list)
        and all(_is_name_list(r) and len(r) == 3 and r[0] in names and r[2] in names
                for r in relations)
        and (types.get("target") is None or types.get("target") in names)
    )  # fmt: skip
    if not ok:
        raise PartitionFormatError(f"{where}: meta field 'types' is malformed")
    relabelled = meta.get("type_node_ids", False)
    if not isinstance(relabelled, bool):
        raise PartitionFormatError(f"{where}: meta field 'type_node_ids' is not true or false")
    if not relabelled and offsets[-1] != meta["num_nodes"]:
        raise PartitionFormatError(
            f"{where}: the types' offsets count {offsets[-1]} nodes, num_nodes is "
            f"{meta['num_nodes']}"
        )
    sizes = {"num_by_type": len(names), "in_edges_by_relation": len(relations),
             "cut_by_relation": len(relations)}  # fmt: skip
    for i, info in enumerate(meta["parts"]):
        for key, size in sizes.items():
            value = info.get(key)
            if value is not None and not (
                isinstance(value, list) and len(value) == size and all(map(_is_int, value))
            ):
                raise PartitionFormatError(f"{where}: part {i}'s {key} is malformed")


#: The descriptive meta fields (what ``inspect`` shows) and the types they must have.
_DESCRIPTIONS = {
    "graph_name": str, "method": str, "seed": int, "balance": list, "source": (dict, type(None)),
}  # fmt: skip


def _check_descriptions(meta: dict[str, Any], where: Path) -> None:
    """The descriptive fields, where present, have their types (a resealed manifest may
    hold anything); each part's ``num_train`` is a count or absent."""
    for key, kind in _DESCRIPTIONS.items():
        value = meta.get(key)
        if key in meta and (not isinstance(value, kind) or isinstance(value, bool)):
            raise PartitionFormatError(f"{where}: meta field {key!r} is {value!r}")
    if not all(isinstance(b, str) for b in meta.get("balance", [])):
        raise PartitionFormatError(f"{where}: meta field 'balance' must list names")
    for i, info in enumerate(meta["parts"]):
        if info.get("num_train") is not None and not _is_int(info["num_train"]):
            raise PartitionFormatError(f"{where}: part {i}'s num_train is not a count")


def load_manifest(path: str | Path) -> Manifest:
    """The checked manifest of a partition folder (schema, version, meta)."""
    try:
        manifest = read_manifest(path, FORMAT, (SCHEMA_VERSION,), remedy=_REMEDY)
    except PartitionFormatError:
        raise
    except FormatError as err:
        raise PartitionFormatError(str(err)) from None
    _check_meta(manifest)
    return manifest


def load_meta(path: str | Path) -> dict[str, Any]:
    """The manifest's meta of a partition folder, checked (see :func:`load_manifest`)."""
    return load_manifest(path).meta


def source_of(graph: Any) -> dict[str, Any] | None:
    """What a partition records about the graph it was cut from: ``fingerprint``, ``name``,
    ``num_nodes``, ``num_edges``, ``num_classes`` of a ``gnnpar.graph.Graph``; None for other
    inputs (scipy matrices, CSR tuples), which carry no fingerprint."""
    return graph.record() if hasattr(graph, "record") else None


def _describe(record: Mapping[str, Any]) -> str:
    return (
        f"{record.get('fingerprint')} ({record.get('name')}, {record.get('num_nodes')} nodes, "
        f"{record.get('num_edges')} edges)"
    )


def check_source(folder: str | Path, graph: Any, label: str = "the dataset") -> dict[str, Any]:
    """Check that the partition folder was cut from ``graph``; return its meta.

    ``graph`` is a ``gnnpar.graph.Graph`` or a record as :func:`source_of` (or
    :func:`gnnpar.data.catalogue.graph_record`, which reads a graph folder's manifest
    without rehashing) returns. ``label`` names the graph in the message (e.g.
    ``"--dataset A"``). Meant to run before ranks start.

    Raises:
        PartitionFormatError: the folder is not a readable partition folder.
        PartitionSourceError: it records another graph (or none): one line naming both.
    """
    meta = load_meta(folder)
    given = dict(graph) if isinstance(graph, Mapping) else source_of(graph)
    if given is None:
        raise TypeError(f"check_source needs a gnnpar Graph or its record, got {type(graph)}")
    recorded = meta.get("source")
    if not isinstance(recorded, dict) or not recorded.get("fingerprint"):
        raise PartitionSourceError(
            f"partition {folder} records no source graph (not cut from a gnnpar Graph); "
            f"{label} is {_describe(given)}: partition it again"
        )
    if recorded["fingerprint"] != given.get("fingerprint"):
        raise PartitionSourceError(
            f"partition {folder} was cut from graph {_describe(recorded)}; {label} is "
            f"{_describe(given)}: partition it again"
        )
    return meta


def idle_parts_message(meta: Mapping[str, Any], folder: str | Path = "") -> str | None:
    """One line if some parts hold no training seeds while others do (their ranks would
    idle), else None. Uses the per-part ``num_train`` the writer records."""
    counts = [info.get("num_train") for info in meta.get("parts", [])]
    if not counts or any(c is None for c in counts) or sum(counts) == 0:
        return None
    idle = [k for k, c in enumerate(counts) if c == 0]
    if not idle:
        return None
    where = f"partition {folder}" if str(folder) else "the partition"
    return (
        f"{where}: {len(idle)} of {len(counts)} parts hold no training seeds (parts "
        f"{', '.join(map(str, idle[:8]))}{', …' if len(idle) > 8 else ''}; training seeds per "
        f"part {counts[:16]}): their ranks idle; balance the training nodes "
        "(--balance-train with metis)"
    )


def warn_idle_parts(meta: Mapping[str, Any], folder: str | Path = "") -> str | None:
    """:func:`idle_parts_message` as a :class:`PartitionBalanceWarning`; returns it."""
    message = idle_parts_message(meta, folder)
    if message:
        warnings.warn(message, PartitionBalanceWarning, stacklevel=3)
    return message


def _load(
    manifest: Manifest,
    rel: str,
    mmap: bool,
    level: str,
    dtype: str | None = None,
    shape: tuple[int, ...] | None = None,
) -> np.ndarray:
    try:
        return load_npy(manifest, rel, level, mmap, dtype, shape)
    except PartitionFormatError:
        raise
    except FormatError as err:
        raise PartitionFormatError(str(err)) from None


def load_part(
    path: str | Path,
    k: int,
    mmap: bool = True,
    verify: str | bool = "checksum",
    expect_parts: int | None = None,
) -> PartData:
    """Load part ``k`` of a partition folder, reading nothing of the other parts.

    Args:
        path: the folder written by :func:`~partitioners.writer.write`.
        k: the part, in ``[0, num_parts)``.
        mmap: memory-map the arrays (copy-on-write) instead of reading them.
        verify: how each of part ``k``'s files is checked against the manifest:
            ``"checksum"`` (default; ``True``), ``"size"`` (``False``; for very large
            folders) or ``"none"``.
        expect_parts: if given, the folder must have exactly this many parts (e.g. the
            world size).

    Raises:
        PartitionFormatError: (a ValueError) naming the file and the problem.
    """
    level = check_level(verify)
    folder = Path(path)
    manifest = load_manifest(folder)
    meta = manifest.meta
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
            f"{folder} has {len(present)} part folders but its manifest says {num_parts}"
        )
    sub = part_dir(k)
    info = meta["parts"][k]
    start, stop = (int(x) for x in meta["node_ranges"][k])
    num_owned, num_local = stop - start, info["num_owned"] + info["num_halo"]
    edges = (info["num_local_edges"],)

    def arr(name: str, shape: tuple[int, ...] | None = None, dtype: str | None = "int64"):
        return _load(manifest, f"{sub}/{name}", mmap, level, dtype, shape)

    stored_owned = arr("num_owned.npy").reshape(-1)
    if stored_owned.shape != (1,) or int(stored_owned[0]) != num_owned:
        raise PartitionFormatError(
            f"{folder / sub}/num_owned.npy holds {stored_owned.tolist()}, expected {num_owned}"
        )
    ndata = {}
    for key, spec in meta.get("ndata", {}).items():
        shape = (num_owned, *spec["shape"][1:])
        ndata[key] = arr(f"ndata/{check_key(key)}.npy", shape, None)
    edge_type = type_node_ids = None
    if "types" in meta:
        edge_type = arr("types/edge_type.npy", edges)
        num_relations = len(meta["types"]["relations"])
        if edge_type.size and (int(edge_type.min()) < 0 or int(edge_type.max()) >= num_relations):
            raise PartitionFormatError(
                f"{folder / sub}/types/edge_type.npy holds relations outside [0, {num_relations})"
            )
        if meta.get("type_node_ids"):
            type_node_ids = arr("types/node_ids.npy", (num_local,))
            total = int(meta["types"]["offsets"][-1])
            if type_node_ids.size and (
                int(type_node_ids.min()) < 0 or int(type_node_ids.max()) >= total
            ):
                raise PartitionFormatError(
                    f"{folder / sub}/types/node_ids.npy holds ids outside [0, {total})"
                )
    return PartData(
        part_id=k,
        num_parts=num_parts,
        node_range=(start, stop),
        num_owned=num_owned,
        indptr=arr("indptr.npy", (num_local + 1,)),
        indices=arr("indices.npy", edges),
        edge_ids=arr("edge_ids.npy", edges),
        edge_weight=arr("edge_weight.npy", edges, None) if meta.get("weighted") else None,
        local_to_global=arr("local_to_global.npy", (num_local,)),
        orig_ids=arr("orig_ids.npy", (num_local,)),
        ndata=ndata,
        meta=meta,
        edge_type=edge_type,
        type_node_ids=type_node_ids,
    )


def load_node_map(
    path: str | Path, mmap: bool = True, verify: str | bool = "checksum"
) -> np.ndarray:
    """``node_map[original id] = new id`` for the whole graph."""
    manifest = load_manifest(path)
    n = int(manifest.meta["num_nodes"])
    return _load(manifest, NODE_MAP, mmap, check_level(verify), "int64", (n,))
