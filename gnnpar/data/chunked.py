"""Reading a graph in chunks under a memory budget: the one home of out-of-core reading.

Preparing shards, writing partitions and streaming partitioners walk the edges of a graph
row by row. :class:`GraphReader` gives them the graph either from memory (a
:class:`~gnnpar.graph.Graph`) or from a graph folder on disk (:mod:`gnnpar.data.storage`),
where every read maps the file only for that read and copies out what was asked, so the
process holds the per-node arrays it keeps plus one chunk, never the whole edge list (a
long-lived memory map would count every page it touched as resident).

:func:`row_groups` cuts a sequence of rows into groups of at most ``chunk`` entries (a row
longer than that forms a group of its own, which callers split further) and
:func:`gather` lists the entries of a group. :func:`chunk_edges_for` turns a memory budget
(``--memory-limit``) into a chunk size.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gnnpar.errors import UserError, first_line
from gnnpar.verified import FormatError, check_level

__all__ = [
    "BYTES_PER_EDGE",
    "DEFAULT_CHUNK_EDGES",
    "GraphReader",
    "chunk_edges_for",
    "entry_chunks",
    "gather",
    "row_groups",
    "rows_per_piece",
]

#: Working memory per edge of a chunk: the gathered positions, rows, columns, values,
#: sort keys and their permutation (int64/float32 arrays and temporaries), and the file
#: pages a read of scattered rows maps, rounded up.
BYTES_PER_EDGE = 128
_PAGE = 4096
#: Edges per chunk when no memory limit is given (about 0.5 GB of working memory).
DEFAULT_CHUNK_EDGES = 1 << 22


def chunk_edges_for(memory_limit: int | None, fixed_bytes: int, what: str = "this step") -> int:
    """Edges per chunk so that ``fixed_bytes`` (the per-node arrays a step keeps) plus one
    chunk's working memory stay under ``memory_limit`` bytes (None: the default chunk).
    ValueError, naming both figures, when the limit does not even cover the fixed part."""
    if memory_limit is None:
        return DEFAULT_CHUNK_EDGES
    room = int(memory_limit) - int(fixed_bytes)
    if room < 1024 * BYTES_PER_EDGE:
        raise UserError(
            f"memory limit {memory_limit:,} bytes is too small: {what} keeps {fixed_bytes:,} "
            f"bytes of per-node arrays and needs at least {1024 * BYTES_PER_EDGE:,} more for "
            "its chunks"
        )
    return room // BYTES_PER_EDGE


def rows_per_piece(chunk_edges: int, row_shape: tuple[int, ...], itemsize: int) -> int:
    """Rows of node data (one row: ``row_shape`` elements of ``itemsize`` bytes) to read at
    a time within a chunk's working memory: a piece is read (its pages mapped), copied out
    and written, so it takes a quarter of ``chunk_edges · BYTES_PER_EDGE``, counting a
    page of the file per row (the rows read are scattered)."""
    row_bytes = max(1, int(np.prod(row_shape, dtype=np.int64)) * itemsize)
    # scattered rows each map at least a page of the file while they are read
    return max(1, chunk_edges * BYTES_PER_EDGE // (4 * (row_bytes + _PAGE)))


def row_groups(lengths: np.ndarray, chunk: int) -> Iterator[tuple[int, int]]:
    """Consecutive ``[a, b)`` ranges of rows covering ``lengths`` (entries per row) in
    order: either rows whose entries add up to at most ``chunk``, or one row longer than
    ``chunk`` alone (``b == a + 1``; its caller splits it)."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 entry, got {chunk}")
    cum = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
    np.cumsum(lengths, out=cum[1:])
    a, n = 0, lengths.shape[0]
    while a < n:
        b = int(np.searchsorted(cum, cum[a] + chunk, side="right")) - 1
        b = min(max(b, a + 1), n)
        yield a, b
        a = b


def gather(
    lengths: np.ndarray, a: int, b: int, lo: int = 0, hi: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Entries of rows ``[a, b)``: ``(row, offset)``, the row (an index into ``lengths``)
    and the offset inside it of every entry, row by row; with ``b == a + 1``, ``lo``/``hi``
    keep only offsets ``[lo, hi)`` of that one row."""
    if b == a + 1:
        stop = int(lengths[a]) if hi is None else min(int(hi), int(lengths[a]))
        offset = np.arange(lo, max(stop, lo), dtype=np.int64)
        return np.full(offset.shape[0], a, dtype=np.int64), offset
    deg = lengths[a:b].astype(np.int64, copy=False)
    total = int(deg.sum())
    first = np.zeros(b - a, dtype=np.int64)
    np.cumsum(deg[:-1], out=first[1:])
    rows = np.repeat(np.arange(a, b, dtype=np.int64), deg)
    offset = np.arange(total, dtype=np.int64) - np.repeat(first, deg)
    return rows, offset


def entry_chunks(lengths: np.ndarray, chunk: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every entry of the rows, in order, as ``(row, offset)`` pieces (see :func:`gather`)
    of at most ``chunk`` entries; a long row is split across pieces. No empty piece."""
    for a, b in row_groups(lengths, chunk):
        stop = int(lengths[a]) if b == a + 1 else 1
        for lo in range(0, stop, chunk):
            rows, offset = gather(lengths, a, b, lo, lo + chunk)
            if rows.shape[0]:
                yield rows, offset


class GraphReader:
    """Chunked read access to a graph in memory (a :class:`~gnnpar.graph.Graph`) or in a
    graph folder on disk (checked against its manifest at ``verify``: ``"checksum"``,
    ``"size"`` or ``"none"``, when opened).

    ``indptr`` is held (``8 · (num_nodes + 1)`` bytes); edges and node data are read on
    demand by position, each read copying out only what was asked."""

    def __init__(self, graph: Any, verify: str = "checksum"):
        from gnnpar.data.storage import read_manifest_of

        self._graph = None
        self._folder: Path | None = None
        if isinstance(graph, (str, Path)):
            manifest = read_manifest_of(graph)
            level = check_level(verify)
            for record in manifest.meta["arrays"].values():
                manifest.verify(record["file"], level)
            meta = manifest.meta
            self._folder = manifest.folder
            self._arrays: dict[str, dict[str, Any]] = meta["arrays"]
            self.name: str = meta["name"]
            self.num_nodes: int = int(meta["num_nodes"])
            self.num_edges: int = int(meta["num_edges"])
            self.num_classes: int | None = meta.get("num_classes")
            self._record = {
                k: meta.get(k) for k in ("fingerprint", "name", "num_nodes", "num_edges")
            }
            self._record["num_classes"] = self.num_classes
            self.indptr = self._read("indptr", slice(None))
            if self.indptr.shape[0] != self.num_nodes + 1:
                raise UserError(f"{self._folder}: indptr does not match {self.num_nodes} nodes")
        else:
            self._graph = graph
            self.name = graph.name
            self.num_nodes = int(graph.num_nodes)
            self.num_edges = int(graph.num_edges)
            self.num_classes = graph.num_classes if graph.label is not None else None
            self._record = None
            self.indptr = graph.indptr.cpu().numpy()

    def validate(self, chunk_edges: int = 1 << 22, chunk_rows: int = 1 << 16) -> None:
        """:meth:`Graph.validate <gnnpar.graph.Graph.validate>` without loading the edges:
        ``indptr`` from 0 to ``num_edges`` and non-decreasing, every index in
        ``[0, num_nodes)`` and every weight finite, ``chunk_edges`` at a time, and the node
        data as :func:`~gnnpar.graph.check_node_data` checks it (float data ``chunk_rows``
        rows at a time). UserError naming the folder and the first problem. A graph in
        memory was validated when it was built."""
        if self._graph is not None:
            return
        import torch

        from gnnpar.graph import check_node_data

        n, where = self.num_nodes, self._folder
        steps = np.diff(self.indptr)
        if self.indptr[0] != 0 or self.indptr[-1] != self.num_edges or (steps < 0).any():
            raise UserError(
                f"{where}: indptr must run from 0 to {self.num_edges}, non-decreasing"
            )
        for lo in range(0, self.num_edges, chunk_edges):
            pos = slice(lo, min(lo + chunk_edges, self.num_edges))
            ids = self.indices(pos)
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= n):
                bad = int(lo + np.flatnonzero((ids < 0) | (ids >= n))[0])
                raise UserError(
                    f"{where}: indices[{bad}] = {int(ids[bad - lo])} is not a node id in [0, {n})"
                )
            weights = self.weights(pos)
            if weights is not None and not np.isfinite(weights).all():
                raise UserError(f"{where}: edge_weight holds non-finite values (NaN or inf)")
        small = {}
        for key in self.ndata_keys():
            dtype, shape = self.ndata_spec(key)
            if dtype.kind != "f":
                small[key] = torch.from_numpy(self.ndata(key, slice(None)))
                continue
            if not shape or shape[0] != n:
                raise UserError(f"{where}: ndata[{key!r}] has shape {list(shape)}, not {n} rows")
            for lo in range(0, shape[0], chunk_rows):
                if not np.isfinite(self.ndata(key, slice(lo, lo + chunk_rows))).all():
                    raise UserError(f"{where}: ndata[{key!r}] holds non-finite values (NaN or inf)")
        try:
            check_node_data(n, small, self.num_classes)
        except UserError as err:
            raise UserError(f"{where}: {err}") from None

    @property
    def weighted(self) -> bool:
        """Whether the graph stores edge weights."""
        if self._graph is not None:
            return self._graph.edge_weight is not None
        return "edge_weight" in self._arrays

    def record(self) -> dict[str, Any]:
        """What a derived artefact records about the graph (as :meth:`Graph.record`); a
        folder's comes from its manifest, without rehashing."""
        if self._record is None:
            self._record = self._graph.record()
        return dict(self._record)

    def fingerprint(self) -> str:
        """The graph's :meth:`~gnnpar.graph.Graph.fingerprint`."""
        return str(self.record()["fingerprint"])

    def ndata_keys(self) -> list[str]:
        """Node-data names, in the graph's own order."""
        if self._graph is not None:
            return list(self._graph.ndata)
        return [k[len("ndata/") :] for k in self._arrays if k.startswith("ndata/")]

    def ndata_spec(self, key: str) -> tuple[np.dtype, tuple[int, ...]]:
        """``(dtype, shape)`` of node data ``key`` (as numpy sees it)."""
        if self._graph is not None:
            t = self._graph.ndata[key]
            return np.dtype(str(t.dtype).removeprefix("torch.")), tuple(t.shape)
        record = self._arrays[f"ndata/{key}"]
        return np.dtype(record["dtype"]), tuple(record["shape"])

    def ndata(self, key: str, rows: Any) -> np.ndarray:
        """Node data ``key`` at ``rows`` (positions or a slice), copied."""
        if self._graph is not None:
            return _take(self._graph.ndata[key], rows)
        return self._read(f"ndata/{key}", rows)

    def indices(self, pos: Any) -> np.ndarray:
        """Source node of the edges at positions ``pos`` (an array or a slice), copied."""
        if self._graph is not None:
            return _take(self._graph.indices, pos)
        return self._read("indices", pos)

    def weights(self, pos: Any) -> np.ndarray | None:
        """Weights of the edges at ``pos``, or None for an unweighted graph."""
        if self._graph is not None:
            w = self._graph.edge_weight
            return None if w is None else _take(w, pos)
        return self._read("edge_weight", pos) if self.weighted else None

    def _read(self, name: str, where: Any) -> np.ndarray:
        record = self._arrays[name]
        path = self._folder / record["file"]
        try:
            mapped = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError, SyntaxError) as err:  # a damaged header
            reason = first_line(err, 200)
            raise FormatError(f"{path}: not a readable .npy file ({reason})") from None
        if mapped.dtype.name != record.get("dtype") or list(mapped.shape) != record.get("shape"):
            raise FormatError(
                f"{path}: holds {mapped.dtype.name} {list(mapped.shape)}, the manifest says "
                f"{record.get('dtype')} {record.get('shape')}"
            )
        try:
            if isinstance(where, np.ndarray) and mapped.size:
                # scattered positions: no read-around, so only the pages read are mapped
                mapped._mmap.madvise(mmap.MADV_RANDOM)  # noqa: SLF001 - numpy's map
            got = mapped[where]
            # fancy indexing already copied; a slice is a view of the map: copy it out
            return np.array(got) if np.shares_memory(got, mapped) else np.asarray(got)
        finally:
            del mapped  # unmap now: the pages read stop counting as this process's memory


def _take(tensor: Any, where: Any) -> np.ndarray:
    from gnnpar.arrays import to_numpy

    whole = to_numpy(tensor)
    got = whole[where]
    return np.array(got) if np.shares_memory(got, whole) else got
