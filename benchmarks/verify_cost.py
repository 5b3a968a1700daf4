"""Open-time verification cost of a full-graph shard folder (issue 17).

Builds the R-MAT graph of ``benchmarks/fullgraph.py`` (scale 18: 262,144 nodes, ~7.6M
edges, 128 features) and its shard folder (8 × 8 file blocks, random permutation), then
measures, against the first training epoch of one rank (one thread, dims 128-128-128-C):

- the time to check the files a rank maps, at ``verify="checksum"`` and ``"size"``: for the
  single rank (it maps every file it reads) and for each rank of an 8-rank 2 × 2 × 2 layout
  (computed with :func:`gnnpar.models.fullgraph.layout.layout3d`, no processes started);
- the time of ``Graph.fingerprint()`` of the source graph, which rank 0 of ``gnnpar train
  gcn`` computes every run to check the shards' provenance.

The files were just written, so they are in the page cache: the checksum times are the
hashing cost, not a cold read from disk (a cold read costs the same for an unverified run
that maps the same pages). Prints a table and writes ``benchmarks/out/verify_cost.json``::

    python benchmarks/verify_cost.py                 # scale 18
    python benchmarks/verify_cost.py --scale 12      # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _model(dims: list[int]):
    from gnnpar.models.fullgraph.model import FullGraphGNN

    torch.manual_seed(0)
    return FullGraphGNN(dims[0], dims[1], dims[-1], len(dims) - 1, dropout=0.0)


def one_rank_epoch(folder: Path, dims: list[int]) -> tuple[list[str], float, float, float]:
    """(files the rank maps, seconds to open the folder and cut the model's blocks unchecked,
    first epoch's seconds, second epoch's seconds) for one rank."""
    import gnnpar
    from gnnpar.models.fullgraph import parallelize_fullgraph
    from gnnpar.models.fullgraph.shards import DiskSource

    grid = gnnpar.init()
    t = time.perf_counter()
    source = DiskSource(folder, verify="none")
    par = parallelize_fullgraph(_model(dims), grid, source)
    x = par.input_features()
    setup = time.perf_counter() - t
    source.node_data("train_mask", par.output_order, par.logits_rows)
    opt = torch.optim.Adam(par.parameters(), lr=0.01)
    epochs = []
    for _ in range(2):
        t = time.perf_counter()
        opt.zero_grad()
        par.loss(par(x), "train_mask").backward()
        opt.step()
        epochs.append(time.perf_counter() - t)
    return source.mapped_files(), setup, epochs[0], epochs[1]


def rank_files(folder: Path, dims: list[int], shape: dict[str, int], rank: int) -> list[str]:
    """The files rank ``rank`` of a 3D grid of ``shape`` maps (the reads of
    :class:`~gnnpar.models.fullgraph.parallelize.Parallel3DGNN`, replayed without processes)."""
    from gnnpar.grid import GridShape
    from gnnpar.models.fullgraph.layout import layout3d
    from gnnpar.models.fullgraph.shards import DiskSource

    grid = GridShape(**shape, global_rank=rank)
    source = DiskSource(folder, verify="none")
    n, layers = source.num_nodes, len(dims) - 1
    lays = [layout3d(grid, i, n, dims[i], dims[i + 1], 1, grid.coords()) for i in range(layers)]
    for i, lay in enumerate(lays):
        source.adjacency(i % 2, lay.rows, lay.cols)
        source.node_ids(i % 2, lay.h_sub if i == 0 else lay.cols)
    source.features(lays[0].h_sub, lays[0].fin)
    for name in ("label", "train_mask"):
        source.node_data(name, layers % 2, lays[-1].rows)
    return source.mapped_files()


def verify_times(folder: Path, files: list[str], reps: int) -> dict[str, float]:
    """Median seconds to check ``files`` at each level."""
    from gnnpar.models.fullgraph.shards import DiskSource

    return {
        level: _median_time(lambda lv=level: DiskSource(folder, lv).verify_files(files), reps)
        for level in ("checksum", "size")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=int, default=18)
    parser.add_argument("--edge-factor", type=int, default=16)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="benchmarks/out/verify_cost.json", help="JSON to write")
    parser.add_argument("--quick", action="store_true", help="R-MAT scale 12, 2 repetitions")
    args = parser.parse_args()
    if args.quick:
        args.scale, args.reps = 12, 2
        args.json = args.json.replace(".json", "-quick.json")
    os.environ.pop("WORLD_SIZE", None)
    torch.set_num_threads(args.threads)

    from gnnpar.data import rmat
    from gnnpar.models.fullgraph.shards import prepare_shards

    t = time.perf_counter()
    graph = rmat(scale=args.scale, edge_factor=args.edge_factor, feat_dim=args.features)
    build_s = time.perf_counter() - t
    fingerprint_s = _median_time(graph.fingerprint, args.reps)
    dims = [args.features, 128, 128, int(graph.num_classes)]
    tmp = Path(tempfile.mkdtemp(prefix="gnnpar-verify-"))
    try:
        t = time.perf_counter()
        folder = prepare_shards(graph, tmp / "s", blocks=(8, 8), fingerprint=graph.fingerprint())
        prepare_s = time.perf_counter() - t
        sizes = {f: (folder / f).stat().st_size for f in _listed(folder)}
        del graph
        files, setup_s, epoch1_s, epoch2_s = one_rank_epoch(folder, dims)
        one = {"files": len(files), "bytes": sum(sizes[f] for f in files)}
        one.update(verify_times(folder, files, args.reps))
        eight = []
        for rank in range(8):
            mine = rank_files(folder, dims, {"x": 2, "y": 2, "z": 2}, rank)
            row = {"rank": rank, "files": len(mine), "bytes": sum(sizes[f] for f in mine)}
            row.update(verify_times(folder, mine, args.reps))
            eight.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {
        "scale": args.scale,
        "nodes": 1 << args.scale,
        "folder_files": len(sizes),
        "folder_bytes": sum(sizes.values()),
        "threads": args.threads,
        "graph_build_s": build_s,
        "prepare_shards_s": prepare_s,
        "fingerprint_s": fingerprint_s,
        "open_unchecked_s": setup_s,
        "first_epoch_s": epoch1_s,
        "second_epoch_s": epoch2_s,
        "one_rank": one,
        "eight_ranks_2x2x2": eight,
        "load_average": os.getloadavg(),
    }
    _print(doc)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.json}")


def _listed(folder: Path) -> list[str]:
    from gnnpar.models.fullgraph.shards import read_shard_manifest

    return sorted(read_shard_manifest(folder).files)


def _print(doc: dict) -> None:
    e = doc["first_epoch_s"]
    print(
        f"R-MAT scale {doc['scale']}: folder {doc['folder_files']} files, "
        f"{doc['folder_bytes'] / 1e6:.0f} MB; first epoch {e:.2f} s, second "
        f"{doc['second_epoch_s']:.2f} s (1 rank, {doc['threads']} thread)"
    )
    print(f"{'who':<16}{'files':>7}{'MB':>8}{'checksum s':>12}{'% epoch':>9}{'size s':>10}")
    rows = [("1 rank", doc["one_rank"])]
    rows += [(f"rank {r['rank']} of 8", r) for r in doc["eight_ranks_2x2x2"]]
    for who, r in rows:
        print(
            f"{who:<16}{r['files']:>7}{r['bytes'] / 1e6:>8.1f}{r['checksum']:>12.4f}"
            f"{100 * r['checksum'] / e:>8.2f}%{r['size']:>10.5f}"
        )
    print(
        f"Graph.fingerprint() of the source: {doc['fingerprint_s']:.3f} s "
        f"({100 * doc['fingerprint_s'] / e:.1f}% of the first epoch)"
    )


if __name__ == "__main__":
    main()
