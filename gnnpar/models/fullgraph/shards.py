"""Full-graph shards on disk: written once, read per rank, for any runtime grid.

A shard folder holds the normalised adjacency in both orders of the double permutation, cut
into an R × C grid of file blocks, plus the node data. At run time each rank memory-maps and
reads only the file blocks that overlap its own block of Â (and only the rows it needs of
the features, labels and masks); blocks of a different grid are merged, as Plexus does, so
the runtime grid need not match the grid the files were cut for.

The folder is a verified folder (:mod:`gnnpar.verified`, schema ``"gnnpar.shards"``,
version 2, or 3 for a typed graph's); every array is a ``.npy`` file, memory-mappable::

    manifest.json                                written last: schema, version, files, meta
    adj0/r{i}_c{j}.{indptr,indices,values}.npy   Â₁ = P·Â·P₂ᵀ, file block (i, j)
    adj1/r{i}_c{j}.{indptr,indices,values}.npy   Â₂ = P₂·Â·Pᵀ
    feat.npy                                     input features, order 0 (N × F, float32)
    node/{name}.{0,1}.npy                        label, train_mask, ... in order 0 and 1
    perm.{0,1}.npy, inv.{0,1}.npy                order o: position of node v / node at position

**Typed graphs** (version 3, ``norm = "mean-per-relation"``: R-GCN's operators,
:mod:`gnnpar.models.fullgraph.relations`): instead of ``adj{0,1}/r{i}_c{j}`` the folder holds
one adjacency per relation r (its index in ``meta.relations``), cut into the same file
blocks and permuted with the same P and P₂ as everything else::

    adj0/rel{r}/r{i}_c{j}.{indptr,indices,values}.npy   Â_r,₁ = P·Â_r·P₂ᵀ, file block (i, j)
    adj1/rel{r}/r{i}_c{j}.{indptr,indices,values}.npy   Â_r,₂ = P₂·Â_r·Pᵀ

with the typed graph's padded ``feat`` and its target type's node data as any graph's. An
untyped folder stays version 2, byte for byte what it was; this version reads both, and an
older gnnpar refuses a typed folder by its version.

``files`` lists every array with its size and XXH3-64 checksum. ``meta`` fields:

- ``name`` (str), ``norm`` (``"gcn"``, ``"mean"``, ``"raw"`` or ``"mean-per-relation"``): the
  graph and the adjacency the values hold (:func:`gnnpar.models.fullgraph.model.norm_of`: the
  one each model kind reads; ``"raw"`` holds the edge weights themselves, GAT's and GIN's;
  ``"mean-per-relation"`` each relation's row-normalised Â_r, R-GCN's).
- ``num_nodes``, ``num_edges`` (int: stored entries of Â, of all the relations' Â_r together
  in a typed folder), ``feat_dim`` (the padded width), ``num_classes`` (int).
- typed folders only: ``relations`` (list of ``[src type, relation, dst type]``, in the
  graph's relation order), ``relation_edges`` (list of int: each Â_r's entries) and ``types``
  (the graph's schema, :meth:`~gnnpar.graph.typed.TypeSchema.meta`: ``node_types``,
  ``offsets``, ``relations``, ``feat_dims``, ``target``; which rows are a featureless type's,
  whose embeddings a run may learn; absent from folders written before it was recorded).
- ``permutation`` (``"random"``, ``"balanced"``, ``"balanced-local"``, ``"symmetric"`` or
  ``"none"``) and its ``seed`` (int).
- ``row_bounds``, ``col_bounds`` (lists of R+1 / C+1 ints): file-block boundaries.
- ``node_data`` (list of str): names under ``node/``.
- ``source`` (provenance, :func:`shard_provenance`): ``graph`` (the source graph's
  :meth:`~gnnpar.graph.Graph.fingerprint`, which covers a typed graph's types and each edge's
  relation), ``norm``, ``blocks``, ``permutation``, ``seed``.

The manifest's ``meta_xxh3_64`` seals the meta table (:func:`gnnpar.verified.meta_digest`), so
an edited value is an error like a changed file.

Reading (:class:`DiskSource`) checks the manifest when it opens the folder and, the first
time it maps a file, that file against its entry (``verify``: ``"checksum"``, the default;
``"size"`` for very large folders; ``"none"``), so each rank checks only the files it reads
and a changed file is one :class:`ShardFormatError` naming it. A folder of the format before
the manifest (``meta.json`` with crc32s) is refused: "written by an older gnnpar: prepare it
again". Writing goes to a temporary sibling renamed at the end: never a half-written folder.

Example::

    prepare_shards(graph, "shards/citeseer", norm="gcn", blocks=(4, 4), seed=0)
    source = DiskSource("shards/citeseer")
    block = source.adjacency(0, rows=(0, 100), cols=(0, 3327))

    prepare_shards(mag, "shards/mag", norm="mean-per-relation", blocks=(4, 4))
    block = DiskSource("shards/mag").relation_adjacency(2, 0, rows=(0, 100), cols=(0, 500))
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from gnnpar.errors import UserError
from gnnpar.models.fullgraph.layout import chunk
from gnnpar.models.fullgraph.relations import RELATION_NORM, relation_adjacencies
from gnnpar.sparse import csr
from gnnpar.sparse.csr import CSRBlock
from gnnpar.sparse.source import inverse, make_permutations, root_block
from gnnpar.verified import (
    LEVELS,
    MANIFEST,
    FormatError,
    Manifest,
    NpyWriter,
    check_level,
    check_output,
    read_manifest,
    save_npy,
    write_folder,
    write_manifest,
)

__all__ = [
    "SCHEMA",
    "TYPED_VERSION",
    "VERIFY_LEVELS",
    "VERSION",
    "VERSIONS",
    "DiskSource",
    "OldShardFolderError",
    "ShardFormatError",
    "prepare_shards",
    "read_shard_manifest",
    "shard_provenance",
]

SCHEMA = "gnnpar.shards"
VERSION = 2
#: The version of a typed graph's folder (one adjacency per relation).
TYPED_VERSION = 3
#: The versions this gnnpar reads.
VERSIONS = (VERSION, TYPED_VERSION)
VERIFY_LEVELS = LEVELS
"""``verify`` levels of :class:`DiskSource` (those of :meth:`Manifest.verify`)."""


class ShardFormatError(FormatError):
    """A shard folder that is missing, truncated, changed or of another schema."""


class OldShardFolderError(ShardFormatError):
    """A shard folder written before the manifest (``meta.json``, crc32 checksums)."""


# ------------------------------------------------------------------------ provenance
def shard_provenance(
    graph_fingerprint: str,
    norm: str,
    blocks: tuple[int, int],
    seed: int,
    permutation: str,
) -> dict[str, Any]:
    """What a shard folder is made from: the source graph's
    :meth:`~gnnpar.graph.Graph.fingerprint` and the options that shaped the shards (the
    ``source`` field of the folder's meta)."""
    return {
        "graph": graph_fingerprint,
        "norm": norm,
        "blocks": [int(blocks[0]), int(blocks[1])],
        "seed": int(seed),
        "permutation": permutation,
    }


# --------------------------------------------------------------------------- writing
def _save(root: Path, rel: str, array: np.ndarray, files: dict) -> None:
    files[rel] = save_npy(root / rel, array)


NORMALISATIONS = ("gcn", "mean", "raw", RELATION_NORM)
"""The ``norm`` values a shard folder may hold (:func:`gnnpar.models.fullgraph.model.norm_of`)."""


def _normalised(graph, norm: str):
    if norm == "gcn":
        return graph.gcn_norm()
    if norm == "mean":
        return graph.row_normalize()
    if norm == "raw":
        return graph.weighted_self_loops()
    if norm == RELATION_NORM:  # the operators are the relations' (relation_adjacencies)
        if graph.types is None:
            raise UserError(
                f"norm {RELATION_NORM!r} needs a typed graph (one adjacency per relation); "
                f"{graph.name!r} has no relations"
            )
        return graph
    raise UserError(f"unknown normalisation {norm!r}; use one of {', '.join(NORMALISATIONS)}")


def prepare_shards(
    graph,
    out: str | Path,
    norm: str = "gcn",
    blocks: tuple[int, int] = (8, 8),
    seed: int = 0,
    permutation: str = "random",
    overwrite: bool = False,
    fingerprint: str | None = None,
    memory_limit: int | None = None,
    chunk_edges: int | None = None,
) -> Path:
    """Normalise ``graph`` (``norm``: ``"gcn"`` for Â = D^-1/2 (A+I) D^-1/2, ``"mean"`` for
    row-normalised A, ``"raw"`` for A + I with the edge weights as they are,
    ``"mean-per-relation"`` for a typed graph's Â_r of every relation), permute it
    (``permutation``: ``"random"`` as Plexus, ``"balanced"`` degree-aware over the file
    blocks, ``"balanced-local"`` the same blocks with a locality order inside each, or
    ``"none"``) and write the shard folder ``out`` atomically (a temporary sibling renamed
    at the end). The folder records :func:`shard_provenance` of ``graph`` (``fingerprint``:
    its :meth:`~gnnpar.graph.Graph.fingerprint` when the caller already has it). Returns
    ``out``.

    ``graph`` is a :class:`~gnnpar.graph.Graph` or a graph folder. With a folder, a
    ``memory_limit`` (bytes) or ``chunk_edges``, the edges are streamed (:func:`_fill_streamed`):
    the process keeps per-node arrays (about 60 bytes a node) and one chunk of
    ``chunk_edges`` edges (by default as many as ``memory_limit`` allows); the folder is the
    same, byte for byte, as the one written from memory. ``"mean-per-relation"`` is prepared
    in memory only (a graph folder is loaded)."""
    out = Path(out)
    check_output(out, SCHEMA, overwrite, (graph,) if isinstance(graph, (str, Path)) else ())
    if norm == RELATION_NORM and (memory_limit is not None or chunk_edges is not None):
        raise UserError(
            f"norm {RELATION_NORM!r} (R-GCN's operators) is prepared in memory: drop "
            "memory_limit and chunk_edges"
        )
    if norm == RELATION_NORM and isinstance(graph, (str, Path)):
        from gnnpar.data.storage import load_graph

        graph = load_graph(graph)
    if isinstance(graph, (str, Path)) or memory_limit is not None or chunk_edges is not None:
        return _prepare_streamed(
            graph, out, norm, blocks, seed, permutation, overwrite, memory_limit, chunk_edges
        )
    if graph.feat is None:
        raise UserError(f"graph {graph.name!r} has no node features ('feat')")
    g = _normalised(graph, norm)
    n = graph.num_nodes
    r_parts, c_parts = blocks
    if r_parts < 1 or c_parts < 1:
        raise UserError(f"file blocks must be positive, got {blocks}")
    source = shard_provenance(fingerprint or graph.fingerprint(), norm, blocks, seed, permutation)
    typed = norm == RELATION_NORM
    # each operator (its folder under adj{parity}/, its CSR): Â, or every relation's Â_r
    if typed:
        operators = [
            (f"rel{r}/", ip, ix, v.to(torch.float32))
            for r, (ip, ix, v) in enumerate(relation_adjacencies(graph))
        ]
    else:
        operators = [("", g.indptr, g.indices, g.edge_weight.to(torch.float32))]
    # one node permutation for every operator: the homogeneous view's
    p, p2 = make_permutations(permutation, g.indptr, g.indices, seed, max(r_parts, c_parts))
    inv = (p2, p)  # order o: node at each position (order 0 uses P₂)
    perms = (inverse(p2), inverse(p))  # order o: position of each node
    row_bounds = [chunk(n, r_parts, i)[0] for i in range(r_parts)] + [n]
    col_bounds = [chunk(n, c_parts, j)[0] for j in range(c_parts)] + [n]

    def fill(tmp: Path) -> None:
        files: dict[str, dict[str, Any]] = {}
        for parity, (rp, cp) in enumerate(((perms[1], perms[0]), (perms[0], perms[1]))):
            for sub, indptr, indices, values in operators:
                a = csr.permute(indptr, indices, values, rp, cp)
                for i in range(r_parts):
                    for j in range(c_parts):
                        b = csr.select(
                            a.indptr,
                            a.indices,
                            a.values,
                            (row_bounds[i], row_bounds[i + 1]),
                            (col_bounds[j], col_bounds[j + 1]),
                        )
                        stem = f"adj{parity}/{sub}r{i}_c{j}"
                        _save(tmp, f"{stem}.indptr.npy", b.indptr.numpy(), files)
                        _save(tmp, f"{stem}.indices.npy", b.indices.numpy(), files)
                        _save(tmp, f"{stem}.values.npy", b.values.numpy(), files)
        _save(tmp, "feat.npy", graph.feat.to(torch.float32)[inv[0]].numpy(), files)
        names = []
        for name, arr in graph.ndata.items():
            if name == "feat" or arr.shape[0] != n:
                continue
            names.append(name)
            for o in (0, 1):
                _save(tmp, f"node/{name}.{o}.npy", arr[inv[o]].numpy(), files)
        for o in (0, 1):
            _save(tmp, f"perm.{o}.npy", perms[o].numpy(), files)
            _save(tmp, f"inv.{o}.npy", inv[o].numpy(), files)
        classes = int(graph.num_classes) if graph.label is not None else 0
        entries = [int(op[2].numel()) for op in operators]
        meta = _manifest_meta(
            graph.name, norm, n, sum(entries), int(graph.feat.shape[1]), classes, seed,
            permutation, row_bounds, col_bounds, names, source,
        )  # fmt: skip
        if typed:
            meta["relations"] = [list(r) for r in graph.types.relations]
            meta["relation_edges"] = entries
            if graph.types.node_ids is None:  # node v is original id v: its type follows
                meta["types"] = graph.types.meta()
        write_manifest(tmp, SCHEMA, TYPED_VERSION if typed else VERSION, files, meta)

    write_folder(out, fill, overwrite, schema=SCHEMA)
    return out


def _manifest_meta(
    name, norm, num_nodes, num_edges, feat_dim, num_classes, seed, permutation,
    row_bounds, col_bounds, node_data, source,
) -> dict:  # fmt: skip
    """The manifest's description of a shard folder, one layout for the in-memory and the
    streamed writers (their folders are byte-identical)."""
    return {
        "name": name,
        "norm": norm,
        "num_nodes": num_nodes,
        "num_edges": num_edges,
        "feat_dim": feat_dim,
        "num_classes": num_classes,
        "seed": seed,
        "permutation": permutation,
        "row_bounds": row_bounds,
        "col_bounds": col_bounds,
        "node_data": node_data,
        "source": source,
    }


# ------------------------------------------------------------------ streamed writing
#: Per-node bytes the streamed path keeps: two permutations and their inverses (int64),
#: indptr, degrees and their normalisation, the loop flags and the rows of one file block.
_STREAM_BYTES_PER_NODE = 72


def _prepare_streamed(
    graph: Any,
    out: Path,
    norm: str,
    blocks: tuple[int, int],
    seed: int,
    permutation: str,
    overwrite: bool,
    memory_limit: int | None,
    chunk_edges: int | None,
) -> Path:
    """:func:`prepare_shards` reading the edges in chunks (see :func:`_fill_streamed`)."""
    from gnnpar.data.chunked import GraphReader, chunk_edges_for, rows_per_piece

    reader = GraphReader(graph, verify="size")
    n = reader.num_nodes
    if chunk_edges is None:
        chunk_edges = chunk_edges_for(memory_limit, _STREAM_BYTES_PER_NODE * n, "preparing shards")
    reader.validate(chunk_edges)  # what a loaded graph is checked for, streamed
    if "feat" not in reader.ndata_keys():
        raise UserError(f"graph {reader.name!r} has no node features ('feat')")
    if norm not in NORMALISATIONS:
        raise UserError(f"unknown normalisation {norm!r}; use one of {', '.join(NORMALISATIONS)}")
    r_parts, c_parts = blocks
    if r_parts < 1 or c_parts < 1:
        raise UserError(f"file blocks must be positive, got {blocks}")
    source = shard_provenance(reader.fingerprint(), norm, blocks, seed, permutation)
    if permutation not in ("random", "symmetric", "none"):
        # the degree-aware permutations look at all of Â at once
        raise UserError(
            f"permutation {permutation!r} needs the whole graph in memory; streamed "
            "preparation (a graph folder, a memory limit) takes 'random', 'symmetric' or 'none'"
        )
    p, p2 = make_permutations(permutation, torch.from_numpy(reader.indptr), torch.zeros(0), seed)
    inv = (p2.numpy(), p.numpy())
    perms = (inverse(p2).numpy(), inverse(p).numpy())
    del p, p2
    row_bounds = [chunk(n, r_parts, i)[0] for i in range(r_parts)] + [n]
    col_bounds = [chunk(n, c_parts, j)[0] for j in range(c_parts)] + [n]

    def fill(tmp: Path) -> None:
        files: dict[str, dict[str, Any]] = {}
        num_edges = _fill_streamed(
            tmp, files, reader, norm, perms, inv, row_bounds, col_bounds, chunk_edges
        )
        feat_dtype, feat_shape = reader.ndata_spec("feat")
        rows_per = rows_per_piece(chunk_edges, feat_shape[1:], 4)
        files["feat.npy"] = _write_rows(
            tmp / "feat.npy",
            lambda r: reader.ndata("feat", r).astype(np.float32, copy=False),
            inv[0],
            np.float32,
            feat_shape[1:],
            rows_per,
        )
        names = []
        for name in reader.ndata_keys():
            dtype, shape = reader.ndata_spec(name)
            if name == "feat" or shape[0] != n:
                continue
            names.append(name)
            per = rows_per_piece(chunk_edges, shape[1:], dtype.itemsize)
            for o in (0, 1):
                files[f"node/{name}.{o}.npy"] = _write_rows(
                    tmp / f"node/{name}.{o}.npy",
                    lambda r, k=name: reader.ndata(k, r),
                    inv[o],
                    dtype,
                    shape[1:],
                    per,
                )
        for o in (0, 1):
            _save(tmp, f"perm.{o}.npy", perms[o], files)
            _save(tmp, f"inv.{o}.npy", inv[o], files)
        classes = int(reader.num_classes or 0) if "label" in reader.ndata_keys() else 0
        meta = _manifest_meta(
            reader.name, norm, n, num_edges, int(feat_shape[1]), classes, seed, permutation,
            row_bounds, col_bounds, names, source,
        )  # fmt: skip
        write_manifest(tmp, SCHEMA, VERSION, files, meta)

    inputs = (graph,) if isinstance(graph, (str, Path)) else ()  # the folder streamed from
    write_folder(out, fill, overwrite, schema=SCHEMA, inputs=inputs)
    return out


def _write_rows(
    path: Path, read: Any, order: np.ndarray, dtype: Any, tail: tuple, rows_per: int
) -> dict[str, Any]:
    """``read(order)`` written to ``path`` in pieces of ``rows_per`` rows."""
    writer = NpyWriter(path, dtype, tuple(tail))
    try:
        for lo in range(0, order.shape[0], rows_per):
            writer.append(read(order[lo : lo + rows_per]))
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def _norm_factors(reader: Any, norm: str, chunk_edges: int):
    """Per node: the self loop to add (gcn and raw: 1 where the row has none) and the factors
    of the normalisation, computed in one pass over the edges with the arithmetic of
    :meth:`~gnnpar.graph.Graph.gcn_norm` / :meth:`~gnnpar.graph.Graph.row_normalize` (raw:
    none, the weights are kept)."""
    from gnnpar.data.chunked import entry_chunks

    n = reader.num_nodes
    indptr = reader.indptr
    lengths = np.diff(indptr)
    if reader.weighted:
        wdtype = torch.from_numpy(reader.weights(slice(0, 0))).dtype
    else:
        fdtype, _ = reader.ndata_spec("feat")
        wdtype = torch.from_numpy(np.zeros(0, fdtype)).dtype
        wdtype = wdtype if wdtype.is_floating_point else torch.float32
    deg = torch.zeros(n, dtype=wdtype)
    has_loop = np.zeros(n, dtype=bool)
    for rows, offset in entry_chunks(lengths, chunk_edges):
        pos = indptr[rows] + offset
        cols = reader.indices(pos)
        if norm != "mean":
            has_loop[rows[cols == rows]] = True
        w = reader.weights(pos)
        w = torch.ones(rows.shape[0], dtype=wdtype) if w is None else torch.from_numpy(w)
        deg.index_add_(0, torch.from_numpy(rows), w)
    add = ~has_loop if norm != "mean" else np.zeros(n, dtype=bool)
    if norm == "gcn":
        deg[torch.from_numpy(add)] += 1.0
        factor = deg.pow(-0.5)
    else:
        factor = 1.0 / deg
    factor[~torch.isfinite(factor)] = 0.0
    return add, factor, wdtype


def _fill_streamed(
    tmp: Path,
    files: dict[str, dict[str, Any]],
    reader: Any,
    norm: str,
    perms: tuple[np.ndarray, np.ndarray],
    inv: tuple[np.ndarray, np.ndarray],
    row_bounds: list[int],
    col_bounds: list[int],
    chunk_edges: int,
) -> int:
    """Write ``adj{0,1}/`` reading the edges ``chunk_edges`` at a time; returns the number
    of entries of Â (self loops included).

    For each order and row block, the block's rows (original ids in the new row order) are
    taken in groups of at most ``chunk_edges`` entries; each group is normalised, its
    columns permuted and sorted inside each row (stable, as :func:`csr.permute`), and
    appended to the file blocks of its columns. A row longer than a chunk is sorted
    externally: its entries are counted per column range, then read once per range of at
    most ``chunk_edges`` entries and emitted range by range."""
    from gnnpar.data.chunked import row_groups

    add, factor, wdtype = _norm_factors(reader, norm, chunk_edges)
    lengths = np.diff(reader.indptr) + add
    cb = np.asarray(col_bounds, dtype=np.int64)
    c_parts = len(col_bounds) - 1
    total = 0
    for parity, cp in enumerate(perms):  # column order of Â₁ = P·Â·P₂ᵀ, Â₂ = P₂·Â·Pᵀ
        row_of = inv[1 - parity]  # original node at each new row
        for i in range(len(row_bounds) - 1):
            rows = row_of[row_bounds[i] : row_bounds[i + 1]]
            out = _BlockRow(tmp, files, f"adj{parity}/r{i}", c_parts)
            try:
                row_len = lengths[rows]
                for a, b in row_groups(row_len, chunk_edges):
                    entries = _Entries(reader, rows, row_len, add, factor, wdtype, norm, cp)
                    if b == a + 1 and row_len[a] > chunk_edges:
                        _emit_long_row(entries, a, chunk_edges, cb, out)
                    else:
                        loc, col, val = entries.read(a, b)
                        key = np.argsort(loc * max(len(cp), 1) + col, kind="stable")
                        out.emit(loc[key] - a, col[key], val[key], b - a, cb)
                total += out.close()
            except BaseException:
                out.abort()
                raise
    return total // 2


class _Entries:
    """Reads the normalised, column-permuted entries of rows of one file block."""

    def __init__(self, reader, rows, row_len, add, factor, wdtype, norm, cp):
        self.reader, self.rows, self.row_len, self.add = reader, rows, row_len, add
        self.factor, self.wdtype, self.norm, self.cp = factor, wdtype, norm, cp

    def read(self, a: int, b: int, lo: int = 0, hi: int | None = None):
        """``(row, new column, value)`` of rows ``[a, b)`` (offsets ``[lo, hi)`` of one)."""
        from gnnpar.data.chunked import gather

        loc, offset = gather(self.row_len, a, b, lo, hi)
        node = self.rows[loc]
        start, stop = self.reader.indptr[node], self.reader.indptr[node + 1]
        is_edge = start + offset < stop
        pos = (start + offset)[is_edge]
        cols = node.copy()  # the added self loop is the last entry of its row
        cols[is_edge] = self.reader.indices(pos)
        w = torch.ones(node.shape[0], dtype=self.wdtype)
        weights = self.reader.weights(pos)
        if weights is not None:
            w[torch.from_numpy(is_edge)] = torch.from_numpy(weights)
        r, c = torch.from_numpy(node), torch.from_numpy(cols)
        if self.norm == "gcn":
            val = self.factor.index_select(0, r) * w * self.factor.index_select(0, c)
        elif self.norm == "raw":
            val = w
        else:
            val = w * self.factor.index_select(0, r)
        return loc, self.cp[cols], val.to(torch.float32).numpy()


def _emit_long_row(entries: _Entries, a: int, chunk_edges: int, cb: np.ndarray, out) -> None:
    """Row ``a`` (longer than a chunk), sorted by new column externally: one pass counts
    its entries per column bucket, consecutive buckets are grouped into column ranges of at
    most ``chunk_edges`` entries, and each range is read, sorted and emitted in turn (a
    bucket still over the limit is split the same way)."""
    length = int(entries.row_len[a])

    def pieces(lo_col: int, hi_col: int):
        for lo in range(0, length, chunk_edges):
            _, col, val = entries.read(a, a + 1, lo, lo + chunk_edges)
            keep = (col >= lo_col) & (col < hi_col)
            yield col[keep], val[keep]

    def emit(lo_col: int, hi_col: int) -> None:
        got = list(pieces(lo_col, hi_col))
        col = np.concatenate([c for c, _ in got])
        val = np.concatenate([v for _, v in got])
        key = np.argsort(col, kind="stable")
        out.emit(np.zeros(col.shape[0], dtype=np.int64), col[key], val[key], None, cb)

    def split(lo_col: int, hi_col: int, count: int) -> None:
        buckets = min(hi_col - lo_col, 4 * -(-count // chunk_edges))
        edges = np.linspace(lo_col, hi_col, buckets + 1).astype(np.int64)
        counts = np.zeros(buckets, dtype=np.int64)
        for col, _ in pieces(lo_col, hi_col):
            counts += np.bincount(np.searchsorted(edges, col, side="right") - 1, minlength=buckets)
        k = 0
        while k < buckets:  # group consecutive buckets up to chunk_edges entries
            stop, total = k + 1, int(counts[k])
            while stop < buckets and total + counts[stop] <= chunk_edges:
                total += int(counts[stop])
                stop += 1
            lo, hi = int(edges[k]), int(edges[stop])
            if total > chunk_edges and hi - lo > 1:
                split(lo, hi, total)
            elif total:
                emit(lo, hi)
            k = stop

    split(0, int(cb[-1]), length)
    out.end_row()


class _BlockRow:
    """The file blocks ``(i, 0..C-1)`` of one row block, written as rows arrive."""

    def __init__(self, tmp: Path, files: dict, stem: str, c_parts: int):
        self.tmp, self.files, self.stem = tmp, files, stem
        self.writers = [
            {
                part: NpyWriter(tmp / f"{stem}_c{j}.{part}.npy", dtype)
                for part, dtype in (
                    ("indptr", np.int64),
                    ("indices", np.int64),
                    ("values", np.float32),
                )
            }
            for j in range(c_parts)
        ]
        self.counts = np.zeros(c_parts, dtype=np.int64)  # entries written per block
        self.open_row = np.zeros(c_parts, dtype=np.int64)  # of a long row so far
        for w in self.writers:
            w["indptr"].append(np.zeros(1, dtype=np.int64))

    def emit(self, loc, col, val, num_rows: int | None, cb: np.ndarray) -> None:
        """Append sorted entries of ``num_rows`` whole rows (``loc``: 0-based row in the
        group), or with ``num_rows=None`` a column range of the one long row being written
        (finished by :meth:`end_row`)."""
        c_parts = len(self.writers)
        block = np.searchsorted(cb, col, side="right") - 1
        for j in range(c_parts):
            sel = block == j
            w = self.writers[j]
            w["indices"].append(col[sel] - cb[j])
            w["values"].append(val[sel])
            if num_rows is None:
                self.open_row[j] += int(sel.sum())
            else:
                per_row = np.bincount(loc[sel], minlength=num_rows)
                w["indptr"].append(self.counts[j] + np.cumsum(per_row))
                self.counts[j] += int(per_row.sum())

    def end_row(self) -> None:
        """Close the long row written range by range."""
        for j, w in enumerate(self.writers):
            self.counts[j] += self.open_row[j]
            w["indptr"].append(self.counts[j : j + 1].copy())
            self.open_row[j] = 0

    def close(self) -> int:
        """Finish every file (listing it in ``files``); returns the entries written."""
        for j, w in enumerate(self.writers):
            for part, writer in w.items():
                self.files[f"{self.stem}_c{j}.{part}.npy"] = writer.close()
        return int(self.counts.sum())

    def abort(self) -> None:
        for w in self.writers:
            for writer in w.values():
                writer.abort()


# --------------------------------------------------------------------------- reading
_INT_FIELDS = ("num_nodes", "num_edges", "feat_dim", "num_classes", "seed")
_STR_FIELDS = ("name", "norm", "permutation")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_bounds(bounds: Any, n: int) -> bool:
    """Block boundaries: ints from 0 to ``n``, non-decreasing, at least one block."""
    return (
        isinstance(bounds, list)
        and len(bounds) >= 2
        and all(_is_int(b) for b in bounds)
        and bounds[0] == 0
        and bounds[-1] == n
        and all(bounds[k] <= bounds[k + 1] for k in range(len(bounds) - 1))
    )


def _check_meta(meta: dict[str, Any], where: Path, version: int = VERSION) -> None:
    """FormatError naming the first field of ``meta`` that is missing or of a wrong type."""
    for key in _INT_FIELDS:
        if not _is_int(meta.get(key)) or meta[key] < 0:
            raise ShardFormatError(f"{where}: meta field {key!r} must be a non-negative integer")
    for key in _STR_FIELDS:
        if not isinstance(meta.get(key), str):
            raise ShardFormatError(f"{where}: meta field {key!r} must be a string")
    if meta["norm"] not in NORMALISATIONS:
        raise ShardFormatError(
            f"{where}: meta field 'norm' is {meta['norm']!r}, not one of "
            f"{', '.join(NORMALISATIONS)}"
        )
    for key in ("row_bounds", "col_bounds"):
        if not _check_bounds(meta.get(key), meta["num_nodes"]):
            raise ShardFormatError(f"{where}: meta field {key!r} is not a list of block bounds")
    names = meta.get("node_data")
    if not isinstance(names, list) or not all(isinstance(s, str) for s in names):
        raise ShardFormatError(f"{where}: meta field 'node_data' must be a list of names")
    if not isinstance(meta.get("source"), dict):
        raise ShardFormatError(f"{where}: meta field 'source' (provenance) is missing")
    _check_relations(meta, version, where)


def _check_relations(meta: dict[str, Any], version: int, where: Path) -> None:
    """A typed folder (version 3, ``mean-per-relation``) lists its relations and their
    entries; an untyped one (version 2) neither."""
    typed = meta["norm"] == RELATION_NORM
    if typed != (version == TYPED_VERSION) or typed != ("relations" in meta):
        raise ShardFormatError(
            f"{where}: version {version} with norm {meta['norm']!r} and "
            f"{'a' if 'relations' in meta else 'no'} meta field 'relations': a typed folder is "
            f"version {TYPED_VERSION}, norm {RELATION_NORM!r}, with relations; others neither"
        )
    if not typed:
        return
    rels, counts = meta["relations"], meta.get("relation_edges")
    if (
        not isinstance(rels, list)
        or not rels
        or not all(
            isinstance(r, list) and len(r) == 3 and all(isinstance(t, str) for t in r) for r in rels
        )
    ):
        raise ShardFormatError(
            f"{where}: meta field 'relations' must be a non-empty list of [src, relation, dst]"
        )
    if (
        not isinstance(counts, list)
        or len(counts) != len(rels)
        or not all(_is_int(c) and c >= 0 for c in counts)
        or sum(counts) != meta["num_edges"]
    ):
        raise ShardFormatError(
            f"{where}: meta field 'relation_edges' must list each relation's entries "
            "(non-negative integers summing to num_edges)"
        )
    if "types" in meta:  # written since the featureless types' embeddings (optional before)
        _check_types(meta, where)


def _check_types(meta: dict[str, Any], where: Path) -> None:
    """A typed folder's ``types`` is the graph's schema, of its relations and its nodes."""
    from gnnpar.graph.typed import TypeSchema

    try:
        schema = TypeSchema.of(meta["types"], f"{where}: meta field 'types'")
    except UserError as err:
        raise ShardFormatError(str(err)) from None
    if [list(r) for r in schema.relations] != meta["relations"] or (
        schema.offsets[-1] != meta["num_nodes"]
    ):
        raise ShardFormatError(
            f"{where}: meta field 'types' does not fit the folder's relations and nodes"
        )


def read_shard_manifest(path: str | Path) -> Manifest:
    """The manifest of the shard folder ``path``, checked (schema and version, files table,
    meta checksum and fields): :class:`ShardFormatError` naming what is wrong,
    :class:`OldShardFolderError` for a folder of the format before the manifest."""
    path = Path(path)
    if not (path / MANIFEST).is_file() and (path / "meta.json").is_file():
        raise OldShardFolderError(
            f"{path}: written by an older gnnpar (meta.json, no {MANIFEST}): prepare it again"
        )
    try:
        manifest = read_manifest(path, SCHEMA, VERSIONS)
    except ShardFormatError:
        raise
    except FormatError as err:
        raise ShardFormatError(str(err)) from None
    _check_meta(manifest.meta, path / MANIFEST, manifest.version)
    return manifest


def _overlap(bounds: list[int], lo: int, hi: int) -> list[int]:
    return [k for k in range(len(bounds) - 1) if bounds[k] < hi and bounds[k + 1] > lo]


class DiskSource:
    """A :class:`~gnnpar.sparse.source.ShardSource` over a shard folder, reading only what
    the caller asks for (memory-mapped). Opening checks the manifest; each file is checked
    against it (``verify``: ``"checksum"``, ``"size"`` or ``"none"``) the first time it is
    mapped, so a rank verifies only the files it reads."""

    def __init__(self, path: str | Path, verify: bool | str = "checksum"):
        self.path = Path(path)
        self.verify = check_level(verify)
        self.manifest = read_shard_manifest(self.path)
        meta = self.manifest.meta
        self.meta = meta
        self.num_nodes = int(meta["num_nodes"])
        self.feat_dim = int(meta["feat_dim"])
        self.num_classes = int(meta["num_classes"])
        self.name = meta["name"]
        self.provenance: dict[str, Any] = meta["source"]
        #: The adjacency the values hold (``"gcn"``, ``"mean"``, ``"raw"``).
        self.norm: str = meta["norm"]
        #: Where :attr:`norm` is recorded, for errors that name it.
        self.norm_where = f"{self.path / MANIFEST}: meta field 'norm'"
        #: A typed folder's relations (``src___rel___dst``, one operator each); [] if untyped.
        self.relations: list[str] = ["___".join(r) for r in meta.get("relations", [])]
        #: A typed folder's schema (node types, their id ranges and feature widths), None
        #: for an untyped folder or a typed one written before it was recorded.
        self.types = None
        if "types" in meta:
            from gnnpar.graph.typed import TypeSchema

            self.types = TypeSchema.of(meta["types"])
        self._arrays: dict[str, np.ndarray] = {}

    @property
    def num_relations(self) -> int:
        """Relations whose operators the folder holds (0: an untyped folder)."""
        return len(self.relations)

    def _array(self, rel: str, length: int | None = None) -> np.ndarray:
        """The memory-mapped array ``rel``, checked the first time (``length``: its expected
        first dimension)."""
        if rel in self._arrays:
            return self._arrays[rel]
        path = self._verify(rel)
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:
            raise ShardFormatError(f"{path}: not a readable .npy array ({err})") from None
        if length is not None and (arr.ndim < 1 or arr.shape[0] != length):
            raise ShardFormatError(f"{path}: shape {arr.shape}, expected {length} rows")
        self._arrays[rel] = arr
        return arr

    def verify_files(self, names: list[str] | None = None) -> list[str]:
        """Check ``names`` (default: every listed file) at this source's level now; returns
        the names checked. :meth:`adjacency` and the others do this lazily."""
        names = sorted(self.manifest.files) if names is None else names
        for rel in names:
            self._verify(rel)
        return names

    def _verify(self, rel: str) -> Path:
        """``rel`` checked against the manifest at this source's level."""
        try:
            return self.manifest.verify(rel, self.verify)
        except ShardFormatError:
            raise
        except FormatError as err:
            raise ShardFormatError(str(err)) from None

    def mapped_files(self) -> list[str]:
        """The files mapped (and checked) so far, sorted."""
        return sorted(self._arrays)

    def adjacency(self, parity: int, rows: tuple[int, int], cols: tuple[int, int]) -> CSRBlock:
        """Block of Â₁ (parity 0) or Â₂ (parity 1), merged from the overlapping file blocks."""
        if self.relations:
            raise UserError(
                f"{self.path} holds one adjacency per relation ({RELATION_NORM!r}, for an "
                "rgcn model): read relation_adjacency(r, ...)"
            )
        return self._merged(f"adj{parity}/", rows, cols)

    def relation_adjacency(
        self, relation: int, parity: int, rows: tuple[int, int], cols: tuple[int, int]
    ) -> CSRBlock:
        """Block of relation ``relation``'s Â_r in the order pair of ``parity`` (as
        :meth:`adjacency`), merged from its file blocks ``adj{parity}/rel{r}/``."""
        if not 0 <= relation < len(self.relations):
            raise UserError(
                f"{self.path} holds operators of {len(self.relations)} relations, not of "
                f"relation {relation}"
            )
        return self._merged(f"adj{parity}/rel{relation}/", rows, cols)

    def _merged(self, prefix: str, rows: tuple[int, int], cols: tuple[int, int]) -> CSRBlock:
        """Block ``rows × cols`` of the operator whose file blocks are ``{prefix}r{i}_c{j}``."""
        rb, cb = self.meta["row_bounds"], self.meta["col_bounds"]
        all_r, all_c, all_v = [], [], []
        for i in _overlap(rb, *rows):
            for j in _overlap(cb, *cols):
                stem = f"{prefix}r{i}_c{j}"
                indptr = self._array(f"{stem}.indptr.npy", rb[i + 1] - rb[i] + 1)
                lo = max(rows[0], rb[i]) - rb[i]
                hi = min(rows[1], rb[i + 1]) - rb[i]
                start, stop = int(indptr[lo]), int(indptr[hi])
                ptr = torch.from_numpy(np.array(indptr[lo : hi + 1])) - start
                idx = torch.from_numpy(np.array(self._array(f"{stem}.indices.npy")[start:stop]))
                val = torch.from_numpy(np.array(self._array(f"{stem}.values.npy")[start:stop]))
                local_rows = torch.repeat_interleave(torch.arange(hi - lo), ptr[1:] - ptr[:-1])
                gcol = idx + cb[j]
                keep = (gcol >= cols[0]) & (gcol < cols[1])
                all_r.append(local_rows[keep] + (rb[i] + lo - rows[0]))
                all_c.append(gcol[keep] - cols[0])
                all_v.append(val[keep])
        cat = lambda xs, dt: torch.cat(xs) if xs else torch.zeros(0, dtype=dt)  # noqa: E731
        return csr.from_coo(
            cat(all_r, torch.int64),
            cat(all_c, torch.int64),
            cat(all_v, torch.float32),
            (rows[1] - rows[0], cols[1] - cols[0]),
            rows[0],
            cols[0],
        )

    def root(self, parity: int, rows: tuple[int, int], cols: tuple[int, int]) -> CSRBlock:
        """Block of the permutation from order ``parity`` to order ``1 - parity``."""
        n = self.num_nodes
        return root_block(
            torch.from_numpy(np.array(self._array(f"inv.{1 - parity}.npy", n)[rows[0] : rows[1]])),
            _LazyTake(self._array(f"perm.{parity}.npy", n)),
            (0, rows[1] - rows[0]),
            cols,
            torch.float32,
            row_offset=rows[0],
        )

    def features(self, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """Input features (order 0) of positions ``rows``, columns ``cols``."""
        arr = self._array("feat.npy", self.num_nodes)
        return torch.from_numpy(np.array(arr[rows[0] : rows[1], cols[0] : cols[1]]))

    def node_ids(self, order: int, rows: tuple[int, int]) -> torch.Tensor:
        """Original node ids at positions ``rows`` of ``order``."""
        arr = self._array(f"inv.{order}.npy", self.num_nodes)
        return torch.from_numpy(np.array(arr[rows[0] : rows[1]]))

    def node_data(self, name: str, order: int, rows: tuple[int, int]) -> torch.Tensor:
        """Labels or masks at positions ``rows`` of ``order``."""
        if name not in self.meta["node_data"]:
            raise KeyError(f"shard folder {self.path} has no node data {name!r}")
        arr = self._array(f"node/{name}.{order}.npy", self.num_nodes)
        return torch.from_numpy(np.array(arr[rows[0] : rows[1]]))


class _LazyTake:
    """Index a memory-mapped array with a tensor of ids, reading only those entries."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.array[ids.numpy()]))
