"""Graph500 R-MAT (Kronecker) graphs with random features and labels, for scaling runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from gnnpar.data.splits import random_split
from gnnpar.errors import UserError
from gnnpar.graph import Graph

__all__ = ["rmat", "rmat_to_disk"]


def _check(scale, edge_factor, a, b, c, feat_dim, num_classes) -> None:
    d = 1.0 - a - b - c
    if min(a, b, c, d) < 0:
        raise UserError(f"a, b, c must be >= 0 with a + b + c <= 1, got a={a}, b={b}, c={c}")
    if not 1 <= scale <= 40 or edge_factor < 0:
        raise UserError(f"need 1 <= scale <= 40 and edge_factor >= 0, got {scale}, {edge_factor}")
    if feat_dim < 1 or num_classes < 1:
        raise UserError(f"feat_dim and num_classes must be >= 1, got {feat_dim}, {num_classes}")


def _draw(
    rng: np.random.Generator, m: int, scale: int, a: float, b: float, c: float
) -> tuple[np.ndarray, np.ndarray]:
    """``m`` R-MAT edges ``(src, dst)`` before scrambling, all drawn at once per level."""
    # One 16-bit uniform per edge and level (probabilities quantised to 1/65536): drawing
    # these is most of the cost, and 16 bits are ample for a synthetic generator.
    t_a, t_ab, t_abc = (np.uint16(min(round(p * 65536), 65535)) for p in (a, a + b, a + b + c))
    src = np.zeros(m, dtype=np.int64)
    dst = np.zeros(m, dtype=np.int64)
    src_bit = np.empty(m, dtype=bool)
    dst_bit = np.empty(m, dtype=bool)
    in_d = np.empty(m, dtype=bool)
    for _ in range(scale):
        u = rng.integers(0, 65536, size=m, dtype=np.uint16)
        np.greater_equal(u, t_ab, out=src_bit)  # quadrants c, d
        np.greater_equal(u, t_a, out=dst_bit)
        np.not_equal(dst_bit, src_bit, out=dst_bit)  # quadrant b: a <= u < a + b
        np.greater_equal(u, t_abc, out=in_d)
        dst_bit |= in_d  # quadrants b, d
        src <<= 1
        src |= src_bit
        dst <<= 1
        dst |= dst_bit
    return src, dst


def rmat(
    scale: int = 16,
    edge_factor: int = 16,
    a: float = 0.57,
    b: float = 0.19,
    c: float = 0.19,
    feat_dim: int = 128,
    num_classes: int = 16,
    train_frac: float = 0.6,
    val_frac: float = 0.2,
    seed: int = 0,
) -> Graph:
    """An undirected R-MAT graph on ``2**scale`` nodes from ``edge_factor * 2**scale`` draws.

    Each edge picks one quadrant of the adjacency per recursion level with probabilities
    ``a, b, c, d = 1 - a - b - c`` (rows = sources); all edges are drawn at once per level.
    As in Graph500, node ids are then scrambled by a random permutation. Duplicate edges and
    self loops are removed and the graph is made undirected, so it has fewer than
    ``2 * edge_factor * 2**scale`` edges. Features are standard normal and labels uniform
    in ``[0, num_classes)``: not learnable, meant for throughput and scaling measurements.
    Deterministic by ``seed``.
    """
    _check(scale, edge_factor, a, b, c, feat_dim, num_classes)
    rng = np.random.default_rng(seed)
    n = 1 << scale
    src, dst = _draw(rng, edge_factor * n, scale, a, b, c)
    scramble = rng.permutation(n)
    keep = src != dst
    src, dst = scramble[src[keep]], scramble[dst[keep]]

    feat = rng.standard_normal((n, feat_dim), dtype=np.float32)
    labels = torch.from_numpy(rng.integers(0, num_classes, size=n))
    ndata = {
        "feat": torch.from_numpy(feat),
        "label": labels,
        **random_split(n, train_frac, val_frac, seed),
    }
    both_src = torch.from_numpy(np.concatenate([src, dst]))
    both_dst = torch.from_numpy(np.concatenate([dst, src]))
    graph = Graph.from_edges(both_src, both_dst, n, ndata=ndata, name=f"rmat{scale}", coalesce=True)
    graph.num_classes = num_classes
    return graph


#: Edges drawn per batch by :func:`rmat_to_disk` (fixed, so the graph does not depend on
#: the memory limit).
DISK_BATCH = 1 << 20


def rmat_to_disk(
    out: str | Path,
    scale: int = 16,
    edge_factor: int = 16,
    a: float = 0.57,
    b: float = 0.19,
    c: float = 0.19,
    feat_dim: int = 128,
    num_classes: int = 16,
    train_frac: float = 0.6,
    val_frac: float = 0.2,
    seed: int = 0,
    memory_limit: int | None = None,
    overwrite: bool = False,
    source: dict[str, Any] | None = None,
    buckets: int | None = None,
) -> Path:
    """An R-MAT graph of the same family as :func:`rmat` written straight to a graph
    folder (:mod:`gnnpar.data.storage`) in chunks, for graphs larger than memory.

    Edges are drawn in batches of :data:`DISK_BATCH` (each from its own seeded stream, so
    the graph is not the one :func:`rmat` draws in one go, and does not depend on
    ``memory_limit``), scrambled, and sorted externally: each batch is split by row range
    into bucket files, then each bucket is sorted and deduplicated in memory and appended to
    ``indices.npy``. Features are drawn in row batches. Memory: about 50 bytes a node plus
    one bucket (at most a third of ``memory_limit``; default 1 GB); ``buckets`` sets the
    number of row ranges of the external sort instead (the result is the same). ``source``
    is recorded in the meta as :func:`~gnnpar.data.storage.save_graph` does. Returns
    ``out``."""
    from gnnpar.data.splits import random_split
    from gnnpar.data.storage import FORMAT, SCHEMA_VERSION
    from gnnpar.graph import content_fingerprint
    from gnnpar.verified import NpyWriter, check_output, save_npy, write_folder, write_manifest

    _check(scale, edge_factor, a, b, c, feat_dim, num_classes)
    out = Path(out)
    check_output(out, FORMAT, overwrite)
    n = 1 << scale
    m = edge_factor * n
    budget = 10**9 if memory_limit is None else int(memory_limit)
    fixed = 50 * n
    if budget < fixed + 64 * DISK_BATCH:
        raise UserError(
            f"memory limit {budget:,} bytes is too small for R-MAT {scale}: it needs "
            f"{fixed + 64 * DISK_BATCH:,} (per-node arrays and one batch of edges)"
        )
    # a bucket's keys are sorted in place and deduplicated (about 3 copies)
    if buckets is None:
        buckets = max(1, -(-(2 * m * 8 * 3) // max(1, budget - fixed)))
    scramble = np.random.default_rng([seed, 1]).permutation(n)
    name = f"rmat{scale}"
    label = np.random.default_rng([seed, 2]).integers(0, num_classes, size=n)
    masks = {k: v.numpy() for k, v in random_split(n, train_frac, val_frac, seed).items()}

    def fill(tmp: Path) -> None:
        files: dict[str, dict[str, Any]] = {}
        parts = [tmp / f"bucket-{k}.bin" for k in range(buckets)]
        handles = [open(p, "wb") for p in parts]  # noqa: SIM115 - closed below
        try:
            for batch, lo in enumerate(range(0, m, DISK_BATCH)):
                rng = np.random.default_rng([seed, 0, batch])
                src, dst = _draw(rng, min(DISK_BATCH, m - lo), scale, a, b, c)
                keep = src != dst
                src, dst = scramble[src[keep]], scramble[dst[keep]]
                for rows, cols in ((dst, src), (src, dst)):  # both directions; rows = targets
                    keys = rows * n + cols
                    which = rows * buckets // n
                    order = np.argsort(which, kind="stable")
                    bounds = np.searchsorted(which[order], np.arange(buckets + 1))
                    for k in range(buckets):
                        keys[order[bounds[k] : bounds[k + 1]]].tofile(handles[k])
        finally:
            for h in handles:
                h.close()
        degree = np.zeros(n, dtype=np.int64)
        indices = NpyWriter(tmp / "indices.npy", np.int64)
        for path in parts:
            keys = np.fromfile(path, dtype=np.int64)
            path.unlink()
            keys.sort()
            if keys.shape[0] > 1:
                keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]
            degree += np.bincount(keys // n, minlength=n)
            indices.append(keys % n)
            del keys
        files["indices.npy"] = indices.close()
        indptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(degree, out=indptr[1:])
        del degree
        files["indptr.npy"] = save_npy(tmp / "indptr.npy", indptr)
        feat = NpyWriter(tmp / "ndata" / "feat.npy", np.float32, (feat_dim,))
        rows_per = max(1, DISK_BATCH * 8 // feat_dim)
        for batch, lo in enumerate(range(0, n, rows_per)):
            rng = np.random.default_rng([seed, 3, batch])
            feat.append(rng.standard_normal((min(rows_per, n - lo), feat_dim), dtype=np.float32))
        files["ndata/feat.npy"] = feat.close()
        ndata = {"label": label, **masks}
        for key, value in ndata.items():
            files[f"ndata/{key}.npy"] = save_npy(tmp / "ndata" / f"{key}.npy", value)
        arrays = {
            "indptr": ("indptr.npy", np.dtype(np.int64), [n + 1]),
            "indices": ("indices.npy", np.dtype(np.int64), [int(indptr[-1])]),
            "ndata/feat": ("ndata/feat.npy", np.dtype(np.float32), [n, feat_dim]),
            **{f"ndata/{k}": (f"ndata/{k}.npy", v.dtype, list(v.shape)) for k, v in ndata.items()},
        }
        order = ["indptr", "indices"] + sorted(k for k in arrays if k.startswith("ndata/"))
        fingerprint = content_fingerprint(
            n,
            ((k, arrays[k][1].name, arrays[k][2], _file_pieces(tmp / arrays[k][0])) for k in order),
        )
        meta = {
            "name": name,
            "num_nodes": n,
            "num_edges": int(indptr[-1]),
            "weighted": False,
            "num_classes": num_classes,
            "fingerprint": fingerprint,
            "source": source,
            "arrays": {
                k: {"file": f, "dtype": dt.name, "shape": shape}
                for k, (f, dt, shape) in arrays.items()
            },
        }
        write_manifest(tmp, FORMAT, SCHEMA_VERSION, files, meta)

    return write_folder(out, fill, overwrite=overwrite, schema=FORMAT)


def _file_pieces(path: Path, block: int = 8 << 20):
    """The data bytes of a ``.npy`` file (after its header), block by block."""
    with open(path, "rb") as f:
        if np.lib.format.read_magic(f) == (1, 0):
            np.lib.format.read_array_header_1_0(f)
        else:
            np.lib.format.read_array_header_2_0(f)
        while piece := f.read(block):
            yield piece
