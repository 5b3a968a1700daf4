"""Write a partitioned graph to disk in the format of :mod:`partitioners.format`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gnnpar.errors import UserError
from gnnpar.verified import check_output, write_folder, write_manifest
from partitioners.assignment import Partition
from partitioners.csr import CSR, as_csr, to_numpy
from partitioners.format import (
    FORMAT,
    NODE_MAP,
    SCHEMA_VERSION,
    check_key,
    part_dir,
    save_npy,
    source_of,
    warn_idle_parts,
)
from partitioners.relabel import local_part, relabel
from partitioners.typed import TypedInput, typed_input

__all__ = ["write"]


def _jsonable(x: Any) -> Any:
    """Numpy scalars and arrays inside ``x`` as plain JSON types."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    return x


def _dtype_spec(value: Any) -> dict[str, Any]:
    name = str(getattr(value, "dtype", "")).replace("torch.", "")
    spec: dict[str, Any] = {"dtype": name, "shape": [int(s) for s in value.shape]}
    if name == "bfloat16":
        spec["stored_as"] = "uint16"
    return spec


def write(
    graph: Any,
    part: Partition | np.ndarray,
    out_dir: str | Path,
    halo: int = 1,
    name: str | None = None,
    ndata: Iterable[str] | None = None,
    progress: bool = False,
    overwrite: bool = False,
    memory_limit: int | None = None,
    chunk_edges: int | None = None,
) -> Path:
    """Write ``graph`` split by ``part`` as a partition folder at ``out_dir``.

    Args:
        graph: the graph that was partitioned (``gnnpar.graph.Graph``, scipy matrix, ``CSR``...).
        part: a :class:`Partition`, or a plain owner array (method ``"custom"``).
        out_dir: the folder to create; it must not exist yet unless ``overwrite``.
        halo: 0 (owned nodes only) or 1 (every in-neighbour of an owned node).
        name: graph name stored in the meta (default: the graph's own name).
        ndata: node-data keys to store (default: all of them).
        progress: show a progress bar over the parts.
        overwrite: replace an existing ``out_dir`` (only once the new folder is complete);
            it must be a partition folder holding only the files its manifest lists, and
            not the graph folder read (:func:`gnnpar.verified.check_output`).
        memory_limit, chunk_edges: stream the edges (:func:`_write_streamed`): the process
            keeps per-node arrays (about 40 bytes a node) and one chunk of ``chunk_edges``
            edges (by default as many as ``memory_limit`` bytes allow). A graph folder
            (a path) is always streamed. The folder is the same, byte for byte, as the one
            written from memory.

    The meta records the graph's fingerprint (``source``, see
    :func:`~partitioners.format.check_source`) and every part's training seeds; a part
    without any (while others have some) is a
    :class:`~partitioners.format.PartitionBalanceWarning`. A typed graph's parts also get
    the relation of every local edge (``types/edge_type.npy``), and the meta the types'
    schema and every part's node counts per type and edges per relation
    (:mod:`partitioners.format`).

    Returns:
        The path of the finished folder.

    Raises:
        FileExistsError: ``out_dir`` exists and ``overwrite`` is false.
        OutputError: ``out_dir`` is not a folder overwriting may replace (see above).
        ValueError: ``halo`` not 0 or 1; the partition does not fit the graph.

    The folder is built under a temporary name beside ``out_dir`` and renamed when complete;
    on any error the temporary folder is removed, so nothing half-written is left behind.
    """
    if isinstance(graph, (str, Path)) or memory_limit is not None or chunk_edges is not None:
        return _write_streamed(
            graph,
            part,
            Path(out_dir),
            halo,
            name,
            ndata,
            progress,
            overwrite,
            memory_limit,
            chunk_edges,
        )
    csr: CSR = as_csr(graph, check=True)
    if not isinstance(part, Partition):
        owner = np.asarray(part)
        k = int(owner.max()) + 1 if owner.size else 1
        part = Partition(owner.astype(np.int64, copy=False), k, method="custom")
    if halo not in (0, 1):
        raise UserError(f"halo must be 0 or 1 hops, got {halo!r}")
    if part.num_nodes != csr.num_nodes:
        raise UserError(
            f"the partition covers {part.num_nodes} nodes but the graph has {csr.num_nodes}"
        )
    part.validate()
    keys = list(csr.ndata) if ndata is None else list(ndata)
    for key in keys:
        check_key(key)
        if key not in csr.ndata:
            raise UserError(f"the graph has no node data {key!r} (it has {sorted(csr.ndata)})")
    out = Path(out_dir)
    check_output(out, FORMAT, overwrite)  # an in-memory graph: no input on disk to keep apart
    source = source_of(graph)
    typed = typed_input(graph)
    meta: dict[str, Any] = {}

    def fill(tmp: Path) -> None:
        meta.update(
            _write_into(tmp, csr, part, halo, name or csr.name, keys, progress, source, typed)
        )

    write_folder(out, fill, overwrite=overwrite, schema=FORMAT)
    warn_idle_parts(meta, out)
    return out


def _write_into(
    folder: Path,
    csr: CSR,
    part: Partition,
    halo: int,
    name: str,
    keys: list[str],
    progress: bool,
    source: dict[str, Any] | None,
    typed: TypedInput | None = None,
) -> dict[str, Any]:
    """Write every file of the folder, the manifest last; returns the meta."""
    files: dict[str, dict[str, Any]] = {}

    def save(rel: str, array: np.ndarray) -> None:
        files[rel] = save_npy(folder / rel, array)

    rl = relabel(part.owner, part.num_parts)
    save(NODE_MAP, rl.node_map)
    data = {key: to_numpy(csr.ndata[key]) for key in keys}
    weight = None if csr.edge_weight is None else to_numpy(csr.edge_weight)
    train = csr.ndata.get("train_mask")
    train = None if train is None else to_numpy(train).astype(bool)
    by_relation = None if typed is None else _relation_counts(csr, part, typed)
    parts_meta = []
    steps: Iterable[int] = range(part.num_parts)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="writing parts", unit="part", leave=False)
    for k in steps:
        sub = part_dir(k)
        (folder / sub / "ndata").mkdir(parents=True)
        local = local_part(csr.indptr, csr.indices, rl, k, halo)
        if typed is not None:
            (folder / sub / "types").mkdir()
            save(f"{sub}/types/edge_type.npy", typed.edge_type(local.edge_ids))
            if typed.node_ids is not None:
                orig = rl.order[local.local_to_global]
                save(f"{sub}/types/node_ids.npy", typed.node_ids[orig])
        save(f"{sub}/indptr.npy", local.indptr)
        save(f"{sub}/indices.npy", local.indices)
        save(f"{sub}/edge_ids.npy", local.edge_ids)
        if weight is not None:
            save(f"{sub}/edge_weight.npy", weight[local.edge_ids])
        save(f"{sub}/local_to_global.npy", local.local_to_global)
        save(f"{sub}/orig_ids.npy", rl.order[local.local_to_global])
        save(f"{sub}/num_owned.npy", np.array(local.num_owned, dtype=np.int64))
        owned = rl.order[rl.offsets[k] : rl.offsets[k + 1]]
        for key, value in data.items():
            save(f"{sub}/ndata/{key}.npy", value[owned])
        parts_meta.append(
            {
                "num_owned": local.num_owned,
                "num_halo": local.num_halo,
                "num_local_edges": int(local.indices.shape[0]),
                "num_train": None if train is None else int(train[owned].sum()),
            }
        )
        if by_relation is not None:
            parts_meta[-1].update(_typed_counts(typed, owned, by_relation[0][k], by_relation[1][k]))
    meta = {
        "source": source,
        "graph_name": name,
        "method": part.method,
        "seed": part.seed,
        "balance": list(part.balance),
        "num_parts": part.num_parts,
        "num_nodes": csr.num_nodes,
        "num_edges": csr.num_edges,
        "halo_hops": halo,
        "weighted": weight is not None,
        "node_ranges": np.stack([rl.offsets[:-1], rl.offsets[1:]], axis=1).tolist(),
        "parts": parts_meta,
        "ndata": {key: _dtype_spec(csr.ndata[key]) for key in keys},
        "partition_info": _jsonable(part.info),
    }
    _add_types(meta, typed)
    write_manifest(folder, FORMAT, SCHEMA_VERSION, files, meta)
    return meta


def _add_types(meta: dict[str, Any], typed: TypedInput | None) -> None:
    """The meta fields of a typed partition: the schema and whether parts store node ids."""
    if typed is not None:
        meta["types"] = _jsonable(typed.meta)
        meta["type_node_ids"] = typed.node_ids is not None


def _relation_counts(csr: CSR, part: Partition, typed: TypedInput) -> tuple[np.ndarray, np.ndarray]:
    """``(in_edges, cut)``, ``(K, R)``: every part's in-edges of each relation, and those of
    them whose source lies in another part."""
    from partitioners.csr import csr_rows

    k, r = part.num_parts, typed.num_relations
    dst = part.owner[csr_rows(csr.indptr)]
    et = typed.edge_type(slice(None))
    key = dst * r + et
    cross = dst != part.owner[csr.indices]
    total = np.bincount(key, minlength=k * r).reshape(k, r)
    cut = np.bincount(key[cross], minlength=k * r).reshape(k, r)
    return total, cut


def _typed_counts(
    typed: TypedInput, owned: np.ndarray, in_edges: np.ndarray, cut: np.ndarray
) -> dict[str, list[int]]:
    """A typed part's record: owned nodes per type, in-edges and cut in-edges per relation."""
    return {
        "num_by_type": np.bincount(typed.node_type[owned], minlength=typed.num_types).tolist(),
        "in_edges_by_relation": [int(x) for x in in_edges],
        "cut_by_relation": [int(x) for x in cut],
    }


# ------------------------------------------------------------------ streamed writing
#: Per-node bytes the streamed writer keeps: the relabelling (order, node_map, offsets), the
#: halo marks, the training mask and one part's row offsets.
_STREAM_BYTES_PER_NODE = 40


def _as_partition(part: Partition | np.ndarray) -> Partition:
    if isinstance(part, Partition):
        return part
    owner = np.asarray(part)
    k = int(owner.max()) + 1 if owner.size else 1
    return Partition(owner.astype(np.int64, copy=False), k, method="custom")


def _write_streamed(
    graph: Any,
    part: Partition | np.ndarray,
    out: Path,
    halo: int,
    name: str | None,
    ndata: Iterable[str] | None,
    progress: bool,
    overwrite: bool,
    memory_limit: int | None,
    chunk_edges: int | None,
) -> Path:
    """:func:`write` reading the edges of ``graph`` (a Graph or a graph folder) in chunks."""
    from gnnpar.data.chunked import GraphReader, chunk_edges_for

    reader = GraphReader(graph, verify="size")
    part = _as_partition(part)
    if halo not in (0, 1):
        raise UserError(f"halo must be 0 or 1 hops, got {halo!r}")
    if part.num_nodes != reader.num_nodes:
        raise UserError(
            f"the partition covers {part.num_nodes} nodes but the graph has {reader.num_nodes}"
        )
    part.validate()
    known = reader.ndata_keys()
    keys = known if ndata is None else list(ndata)
    for key in keys:
        check_key(key)
        if key not in known:
            raise UserError(f"the graph has no node data {key!r} (it has {sorted(known)})")
    # the graph folder read while the partition is written
    inputs = (graph,) if isinstance(graph, (str, Path)) else ()
    check_output(out, FORMAT, overwrite, inputs)
    if chunk_edges is None:
        chunk_edges = chunk_edges_for(
            memory_limit, _STREAM_BYTES_PER_NODE * reader.num_nodes, "writing a partition"
        )
    typed = typed_input(graph)
    meta: dict[str, Any] = {}

    def fill(tmp: Path) -> None:
        meta.update(
            _write_streamed_into(
                tmp, reader, part, halo, name or reader.name, keys, progress, chunk_edges, typed
            )
        )

    write_folder(out, fill, overwrite=overwrite, schema=FORMAT, inputs=inputs)
    warn_idle_parts(meta, out)
    return out


def _part_chunks(
    reader: Any, rl: Any, rows: np.ndarray, deg: np.ndarray, chunk_edges: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The in-edges of ``rows`` in chunks: (row index into ``rows``, position in the CSR,
    new id of the source) per chunk."""
    from gnnpar.data.chunked import entry_chunks

    for r, offset in entry_chunks(deg, chunk_edges):
        pos = reader.indptr[rows[r]] + offset
        yield r, pos, rl.node_map[reader.indices(pos)]


def _write_streamed_into(
    folder: Path,
    reader: Any,
    part: Partition,
    halo: int,
    name: str,
    keys: list[str],
    progress: bool,
    chunk_edges: int,
    typed: TypedInput | None = None,
) -> dict[str, Any]:
    """:func:`_write_into` part by part, each part's edges read ``chunk_edges`` at a time
    (twice: once to find the halo, once to write), producing the same files."""
    from gnnpar.data.chunked import rows_per_piece
    from gnnpar.verified import NpyWriter

    files: dict[str, dict[str, Any]] = {}
    n, indptr = reader.num_nodes, reader.indptr

    def save(rel: str, array: np.ndarray) -> None:
        files[rel] = save_npy(folder / rel, array)

    rl = relabel(part.owner, part.num_parts)
    save(NODE_MAP, rl.node_map)
    train = None
    if "train_mask" in reader.ndata_keys():
        train = reader.ndata("train_mask", slice(None)).astype(bool)
    parts_meta = []
    steps: Iterable[int] = range(part.num_parts)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="writing parts", unit="part", leave=False)
    for k in steps:
        sub = part_dir(k)
        (folder / sub / "ndata").mkdir(parents=True)
        start, stop = int(rl.offsets[k]), int(rl.offsets[k + 1])
        rows = rl.order[start:stop]
        deg = indptr[rows + 1] - indptr[rows]

        kept = np.zeros(stop - start, dtype=np.int64)  # local edges per owned row
        seen = np.zeros(n if halo else 0, dtype=bool)
        for r, _, src in _part_chunks(reader, rl, rows, deg, chunk_edges):
            inside = (src >= start) & (src < stop)
            if halo:
                seen[src[~inside]] = True
            else:
                kept += np.bincount(r[inside], minlength=stop - start)
        halo_ids = np.flatnonzero(seen).astype(np.int64)
        del seen
        ptr = np.zeros(stop - start + 1 + halo_ids.shape[0], dtype=np.int64)
        np.cumsum(deg if halo else kept, out=ptr[1 : stop - start + 1])
        ptr[stop - start + 1 :] = ptr[stop - start]
        save(f"{sub}/indptr.npy", ptr)
        writers = {
            "indices": NpyWriter(folder / sub / "indices.npy", np.int64),
            "edge_ids": NpyWriter(folder / sub / "edge_ids.npy", np.int64),
        }
        if reader.weighted:
            wdtype = reader.weights(slice(0, 0)).dtype
            writers["edge_weight"] = NpyWriter(folder / sub / "edge_weight.npy", wdtype)
        if typed is not None:
            (folder / sub / "types").mkdir()
            writers["types/edge_type"] = NpyWriter(folder / sub / "types/edge_type.npy", np.int64)
            in_edges = np.zeros(typed.num_relations, dtype=np.int64)
            cut = np.zeros(typed.num_relations, dtype=np.int64)
        try:
            for _, pos, src in _part_chunks(reader, rl, rows, deg, chunk_edges):
                inside = (src >= start) & (src < stop)
                et = None
                if typed is not None:
                    et = typed.edge_type(pos)
                    in_edges += np.bincount(et, minlength=typed.num_relations)
                    cut += np.bincount(et[~inside], minlength=typed.num_relations)
                if halo:
                    local = np.where(inside, src - start, 0)
                    outside = ~inside
                    local[outside] = (stop - start) + np.searchsorted(halo_ids, src[outside])
                else:
                    pos, local = pos[inside], src[inside] - start
                    et = None if et is None else et[inside]
                writers["indices"].append(local)
                writers["edge_ids"].append(pos)
                if "edge_weight" in writers:
                    writers["edge_weight"].append(reader.weights(pos))
                if et is not None:
                    writers["types/edge_type"].append(et)
        except BaseException:
            for w in writers.values():
                w.abort()
            raise
        for key, w in writers.items():
            files[f"{sub}/{key}.npy"] = w.close()
        num_local_edges = writers["indices"].rows
        local_to_global = np.concatenate([np.arange(start, stop, dtype=np.int64), halo_ids])
        save(f"{sub}/local_to_global.npy", local_to_global)
        save(f"{sub}/orig_ids.npy", rl.order[local_to_global])
        if typed is not None and typed.node_ids is not None:
            save(f"{sub}/types/node_ids.npy", typed.node_ids[rl.order[local_to_global]])
        save(f"{sub}/num_owned.npy", np.array(stop - start, dtype=np.int64))
        for key in keys:
            dtype, shape = reader.ndata_spec(key)
            per = rows_per_piece(chunk_edges, shape[1:], dtype.itemsize)
            w = NpyWriter(folder / sub / "ndata" / f"{key}.npy", dtype, shape[1:])
            for lo in range(0, stop - start, per):
                w.append(reader.ndata(key, rows[lo : lo + per]))
            files[f"{sub}/ndata/{key}.npy"] = w.close()
        parts_meta.append(
            {
                "num_owned": stop - start,
                "num_halo": int(halo_ids.shape[0]),
                "num_local_edges": num_local_edges,
                "num_train": None if train is None else int(train[rows].sum()),
            }
        )
        if typed is not None:
            parts_meta[-1].update(_typed_counts(typed, rows, in_edges, cut))
    meta = {
        "source": reader.record(),
        "graph_name": name,
        "method": part.method,
        "seed": part.seed,
        "balance": list(part.balance),
        "num_parts": part.num_parts,
        "num_nodes": n,
        "num_edges": reader.num_edges,
        "halo_hops": halo,
        "weighted": reader.weighted,
        "node_ranges": np.stack([rl.offsets[:-1], rl.offsets[1:]], axis=1).tolist(),
        "parts": parts_meta,
        "ndata": {
            key: {"dtype": reader.ndata_spec(key)[0].name, "shape": list(reader.ndata_spec(key)[1])}
            for key in keys
        },
        "partition_info": _jsonable(part.info),
    }
    _add_types(meta, typed)
    write_manifest(folder, FORMAT, SCHEMA_VERSION, files, meta)
    return meta
