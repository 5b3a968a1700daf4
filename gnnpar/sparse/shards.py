"""Full-graph shards on disk: written once, read per rank, for any runtime grid.

A shard folder holds the normalised adjacency in both orders of the double permutation, cut
into an R × C grid of file blocks, plus the node data. At run time each rank memory-maps and
reads only the file blocks that overlap its own block of Â (and only the rows it needs of
the features, labels and masks); blocks of a different grid are merged, as Plexus does, so
the runtime grid need not match the grid the files were cut for.

Layout (every array is a ``.npy`` file, memory-mappable)::

    meta.json
    adj0/r{i}_c{j}.{indptr,indices,values}.npy   Â₁ = P·Â·P₂ᵀ, file block (i, j)
    adj1/r{i}_c{j}.{indptr,indices,values}.npy   Â₂ = P₂·Â·Pᵀ
    feat.npy                                     input features, order 0 (N × F, float32)
    node/{name}.{0,1}.npy                        label, train_mask, ... in order 0 and 1
    perm.{0,1}.npy, inv.{0,1}.npy                order o: position of node v / node at position

``meta.json`` fields:

- ``schema`` (int, 1): format version; loading another version is an error.
- ``name`` (str), ``norm`` (``"gcn"`` or ``"mean"``): the graph and its normalisation.
- ``num_nodes``, ``num_edges`` (int), ``feat_dim``, ``num_classes`` (int).
- ``permutation`` (``"random"``, ``"balanced"``, ``"balanced-local"`` or ``"none"``) and its
  ``seed`` (int).
- ``row_bounds``, ``col_bounds`` (lists of R+1 / C+1 ints): file-block boundaries.
- ``node_data`` (list of str): names under ``node/``.
- ``files`` ({relative path: {"bytes": int, "crc32": int}}): every file, checked on open
  (sizes always, checksums of the files a rank reads with ``verify=True``).

Example::

    prepare_shards(graph, "shards/citeseer", norm="gcn", blocks=(4, 4), seed=0)
    source = DiskSource("shards/citeseer")
    block = source.adjacency(0, rows=(0, 100), cols=(0, 3327))
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np
import torch

from gnnpar.sparse import csr
from gnnpar.sparse.csr import CSRBlock
from gnnpar.sparse.layout import chunk
from gnnpar.sparse.source import inverse, make_permutations, root_block

SCHEMA = 1


class ShardFormatError(ValueError):
    """A shard folder that is missing, truncated, changed or of another schema."""


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk_ := f.read(1 << 22):
            crc = zlib.crc32(chunk_, crc)
    return crc


def _save(root: Path, rel: str, array: np.ndarray, files: dict) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, np.ascontiguousarray(array))
    files[rel] = {"bytes": path.stat().st_size, "crc32": _crc32(path)}


def prepare_shards(
    graph,
    out: str | Path,
    norm: str = "gcn",
    blocks: tuple[int, int] = (8, 8),
    seed: int = 0,
    permutation: str = "random",
    overwrite: bool = False,
) -> Path:
    """Normalise ``graph`` (``norm``: ``"gcn"`` for Â = D^-1/2 (A+I) D^-1/2, ``"mean"`` for
    row-normalised A), permute it (``permutation``: ``"random"`` as Plexus, ``"balanced"``
    degree-aware over the file blocks, ``"balanced-local"`` the same blocks with a locality
    order inside each, or ``"none"``) and write the shard folder ``out``
    atomically (a temporary sibling renamed at the end). Returns ``out``."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"shard folder {out} already exists (pass overwrite=True)")
    if graph.feat is None:
        raise ValueError(f"graph {graph.name!r} has no node features ('feat')")
    if norm == "gcn":
        g = graph.gcn_norm()
    elif norm == "mean":
        g = graph.row_normalize()
    else:
        raise ValueError(f"unknown normalisation {norm!r}; use 'gcn' or 'mean'")
    n = graph.num_nodes
    r_parts, c_parts = blocks
    if r_parts < 1 or c_parts < 1:
        raise ValueError(f"file blocks must be positive, got {blocks}")
    values = g.edge_weight.to(torch.float32)
    p, p2 = make_permutations(permutation, g.indptr, g.indices, seed, max(r_parts, c_parts))
    inv = (p2, p)  # order o: node at each position (order 0 uses P₂)
    perms = (inverse(p2), inverse(p))  # order o: position of each node
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    files: dict[str, dict[str, int]] = {}
    try:
        row_bounds = [chunk(n, r_parts, i)[0] for i in range(r_parts)] + [n]
        col_bounds = [chunk(n, c_parts, j)[0] for j in range(c_parts)] + [n]
        for parity, (rp, cp) in enumerate(((perms[1], perms[0]), (perms[0], perms[1]))):
            a = csr.permute(g.indptr, g.indices, values, rp, cp)
            for i in range(r_parts):
                for j in range(c_parts):
                    b = csr.select(
                        a.indptr,
                        a.indices,
                        a.values,
                        (row_bounds[i], row_bounds[i + 1]),
                        (col_bounds[j], col_bounds[j + 1]),
                    )
                    stem = f"adj{parity}/r{i}_c{j}"
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
        meta = {
            "schema": SCHEMA,
            "name": graph.name,
            "norm": norm,
            "num_nodes": n,
            "num_edges": int(g.num_edges),
            "feat_dim": int(graph.feat.shape[1]),
            "num_classes": int(graph.num_classes) if graph.label is not None else 0,
            "seed": seed,
            "permutation": permutation,
            "row_bounds": row_bounds,
            "col_bounds": col_bounds,
            "node_data": names,
            "files": files,
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _overlap(bounds: list[int], lo: int, hi: int) -> list[int]:
    return [k for k in range(len(bounds) - 1) if bounds[k] < hi and bounds[k + 1] > lo]


class DiskSource:
    """A :class:`~gnnpar.sparse.source.ShardSource` over a shard folder, reading only what
    the caller asks for (memory-mapped)."""

    def __init__(self, path: str | Path, verify: bool = False):
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not meta_path.is_file():
            raise ShardFormatError(f"{self.path} is not a shard folder (no meta.json)")
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError as e:
            raise ShardFormatError(f"{meta_path} is not valid JSON: {e}") from None
        if meta.get("schema") != SCHEMA:
            raise ShardFormatError(
                f"{self.path} has shard schema {meta.get('schema')!r}; this gnnpar reads {SCHEMA}"
            )
        self.meta = meta
        self.verify = verify
        self.num_nodes = int(meta["num_nodes"])
        self.feat_dim = int(meta["feat_dim"])
        self.num_classes = int(meta["num_classes"])
        self.name = meta["name"]
        for rel, info in meta["files"].items():
            f = self.path / rel
            if not f.is_file():
                raise ShardFormatError(f"shard file {rel} is missing from {self.path}")
            if f.stat().st_size != info["bytes"]:
                raise ShardFormatError(
                    f"shard file {rel} has {f.stat().st_size} bytes, expected {info['bytes']}"
                    " (truncated or changed)"
                )

    def _array(self, rel: str) -> np.ndarray:
        info = self.meta["files"].get(rel)
        if info is None:
            raise KeyError(f"{self.path} has no array {rel}")
        if self.verify and _crc32(self.path / rel) != info["crc32"]:
            raise ShardFormatError(f"shard file {rel} fails its checksum (changed on disk)")
        return np.load(self.path / rel, mmap_mode="r")

    def adjacency(self, parity: int, rows: tuple[int, int], cols: tuple[int, int]) -> CSRBlock:
        """Block of Â₁ (parity 0) or Â₂ (parity 1), merged from the overlapping file blocks."""
        rb, cb = self.meta["row_bounds"], self.meta["col_bounds"]
        all_r, all_c, all_v = [], [], []
        for i in _overlap(rb, *rows):
            for j in _overlap(cb, *cols):
                stem = f"adj{parity}/r{i}_c{j}"
                indptr = self._array(f"{stem}.indptr.npy")
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
        return root_block(
            torch.from_numpy(np.array(self._array(f"inv.{1 - parity}.npy")[rows[0] : rows[1]])),
            _LazyTake(self._array(f"perm.{parity}.npy")),
            (0, rows[1] - rows[0]),
            cols,
            torch.float32,
            row_offset=rows[0],
        )

    def features(self, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """Input features (order 0) of positions ``rows``, columns ``cols``."""
        arr = self._array("feat.npy")
        return torch.from_numpy(np.array(arr[rows[0] : rows[1], cols[0] : cols[1]]))

    def node_ids(self, order: int, rows: tuple[int, int]) -> torch.Tensor:
        """Original node ids at positions ``rows`` of ``order``."""
        return torch.from_numpy(np.array(self._array(f"inv.{order}.npy")[rows[0] : rows[1]]))

    def node_data(self, name: str, order: int, rows: tuple[int, int]) -> torch.Tensor:
        """Labels or masks at positions ``rows`` of ``order``."""
        rel = f"node/{name}.{order}.npy"
        if rel not in self.meta["files"]:
            raise KeyError(f"shard folder {self.path} has no node data {name!r}")
        return torch.from_numpy(np.array(self._array(rel)[rows[0] : rows[1]]))


class _LazyTake:
    """Index a memory-mapped array with a tensor of ids, reading only those entries."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.array[ids.numpy()]))
