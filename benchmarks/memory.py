"""Memory per rank, measured, beside the planner's model
(:func:`gnnpar.models.fullgraph.memory.gcn_memory`).

(a) Full-graph 3-layer GCN (width 128) on R-MAT ``--scale`` (default 18; 128 features):
    for P = 1, 2, 4, 8 ranks on the shape the planner picks (what ``gnnpar train gcn``
    runs), each rank's peak resident memory over building its shards' blocks and one
    training epoch (forward, backward, Adam step), minus the same process's resident memory
    just before (the idle baseline: Python, torch, the process group). Beside it the
    model's bytes for rank 0, by part, and the ratio measured / model.
(b) With ``--scale-pipeline``: the larger-than-memory pipeline (long; run once): R-MAT
    ``--big-scale`` (default 22) generated to disk in chunks, partitioned with Fennel
    streaming from disk, cut into full-graph shards streaming, each stage in its own process
    under ``--memory-limit`` with its peak and time.
(c) With ``--minibatch``: the ``sage`` task (GraphSAGE, its default model and fan-outs,
    global batch ``--batch-size``, default 1024) on R-MAT ``--scale`` for D = 1, 2, 4 data
    ranks (``--data-ranks``; D > 1 partitioned with METIS as ``gnnpar train sage --nprocs D
    --parts D`` writes it): each rank's peak over its setup, one training epoch and one
    layer-wise evaluation, minus its idle baseline, beside
    :func:`gnnpar.models.minibatch.cost.minibatch_memory` for its part; run twice, the second
    time with glibc's mmap threshold fixed (``mallopt(M_MMAP_THRESHOLD)`` in each rank), which
    returns large freed blocks to the system instead of keeping them in the heap (the model's
    ``heap`` part), at a cost in time (each phase's seconds are in the JSON).

(d) With ``--typed``: (c) for the typed R-GCN (``--model rgcn``, its default fan-outs) on
    a mag-synth graph of ``--typed-papers`` papers (default 60,000; twice as many authors,
    featureless, as in ogbn-mag), beside the typed memory model
    (:mod:`gnnpar.models.minibatch.typed_cost`).

Every figure is a process's resident-set high-water mark (``VmHWM``) from
:func:`partitioners.metrics.measure`; ranks are one-threaded processes on one machine.

Run::

    python benchmarks/memory.py                   # (a) at scale 18 (a few minutes on 2 cores)
    python benchmarks/memory.py --quick           # scale 12, 1 and 2 ranks (a smoke run)
    python benchmarks/memory.py --scale-pipeline  # also (b) (tens of minutes)
    python benchmarks/memory.py --skip-fullgraph --minibatch  # only (c) (about 12 minutes)
    python benchmarks/memory.py --skip-fullgraph --typed --data-ranks 1,2   # only (d)

Writes ``benchmarks/out/memory.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
MIB = 2**20


def _rss_kib(field: str) -> int:
    from partitioners.metrics import _status_kib

    return _status_kib(field) or 0


def _fullgraph_worker(shards: str, dims: list[int], shape: dict[str, int]) -> dict:
    """One rank: peak memory of building the model's blocks and one epoch, over the idle
    baseline (this process just before)."""
    import gc

    import gnnpar
    from gnnpar import comm
    from gnnpar.models.fullgraph import parallelize_fullgraph
    from gnnpar.models.fullgraph.model import FullGraphGNN
    from gnnpar.models.fullgraph.shards import DiskSource
    from partitioners.metrics import measure

    grid = gnnpar.init(**shape)
    torch.manual_seed(0)
    model = FullGraphGNN(dims[0], dims[1], dims[-1], len(dims) - 1, dropout=0.0)
    comm.barrier(grid)
    gc.collect()
    baseline = _rss_kib("VmRSS") * 1024
    with measure() as m:
        source = DiskSource(shards)
        par = parallelize_fullgraph(model, grid, source)
        x = par.input_features()
        built = _rss_kib("VmHWM") * 1024 - baseline
        opt = torch.optim.Adam(par.parameters(), lr=0.01)
        opt.zero_grad()
        par.loss(par(x), "train_mask").backward()
        opt.step()
        comm.barrier(grid)
    out = {
        "rank": grid.global_rank,
        "baseline": baseline,
        "peak_over_baseline": m.peak_bytes,
        "build_peak": built,
        # the shard files this rank mapped (their pages count as its resident memory)
        "mapped": sum(source.manifest.files[f]["size"] for f in source.mapped_files()),
        "rss_file_end": _rss_kib("RssFile") * 1024,
        "rss_anon_end": _rss_kib("RssAnon") * 1024,
        "time_s": m.time_s,
    }
    gnnpar.release(grid)
    return out


def fullgraph_table(scale: int, ranks: list[int], tmp: Path) -> dict:
    """(a): the measured peaks per rank beside the model, for each world size."""
    from gnnpar.data.rmat import rmat
    from gnnpar.models.fullgraph.cost import GCNProblem
    from gnnpar.models.fullgraph.memory import gcn_memory
    from gnnpar.models.fullgraph.planning import choose_fullgraph_grid
    from gnnpar.models.fullgraph.shards import prepare_shards, read_shard_manifest
    from gnnpar.plan import local_machine
    from gnnpar.testing import run_distributed

    graph = rmat(scale=scale, feat_dim=128, num_classes=16)
    shards = prepare_shards(graph, tmp / f"shards{scale}", blocks=(8, 8))
    del graph
    meta = read_shard_manifest(shards).meta
    n, nnz = meta["num_nodes"], meta["num_edges"]
    dims = [meta["feat_dim"], 128, 128, meta["num_classes"]]
    rows = []
    for p in ranks:
        shape = choose_fullgraph_grid(p, n, dims, nnz=nnz, machine=local_machine("gloo", p))
        res = run_distributed(_fullgraph_worker, p, str(shards), dims, shape, timeout=3600)
        model = gcn_memory(GCNProblem.from_widths(n, nnz, dims), shape, host=True)
        measured = [r["peak_over_baseline"] for r in res]
        rows.append(
            {
                "ranks": p,
                "shape": shape,
                "measured_rank0": measured[0],
                "measured_max": max(measured),
                "measured": measured,
                "baseline_rank0": res[0]["baseline"],
                "rss_file_end_rank0": res[0]["rss_file_end"],
                "model_rank0": sum(model.values()),
                "model_parts": model,
                "ratio": measured[0] / sum(model.values()),
                "time_s": max(r["time_s"] for r in res),
                "per_rank": res,
            }
        )
        print(_row_line(rows[-1]), flush=True)
    return {"scale": scale, "nodes": n, "nnz": nnz, "dims": dims, "rows": rows}


def _row_line(r: dict) -> str:
    shape = "x".join(str(r["shape"].get(a, 1)) for a in ("x", "y", "z"))
    parts = r["model_parts"]
    return (
        f"| {r['ranks']} | {shape} | {r['measured_rank0'] / MIB:,.0f} | "
        f"{r['measured_max'] / MIB:,.0f} | {r['model_rank0'] / MIB:,.0f} | "
        f"{parts['adjacency'] / MIB:,.0f} / {parts['features'] / MIB:,.0f} / "
        f"{parts['weights'] / MIB:,.1f} / {parts['activations'] / MIB:,.0f} / "
        f"{parts['staging'] / MIB:,.0f} / {parts['buffers'] / MIB:,.0f} | "
        f"{r['ratio']:.2f} |"
    )


HEADER = (
    "| P | x×y×z | measured rank 0 MiB | measured max MiB | model MiB | "
    "model Â / H / W / act / staging / buffers MiB | measured / model |\n"
    "|--:|------|--:|--:|--:|------|--:|"
)


# ------------------------------------------------------------------ (c) mini-batch
def _malloc_free() -> int:
    """Bytes free in glibc's heaps (``mallinfo2().fordblks``, every arena): what the
    allocator keeps resident after the program freed it; 0 where it cannot be read."""
    import ctypes

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]  # fmt: skip

    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return 0
    fn.restype = _Mallinfo2
    return int(fn().fordblks)


def _minibatch_worker(
    graph: str, parts: str | None, batch_size: int, mmap_threshold: int | None = None,
    model: str = "sage",
) -> dict:  # fmt: skip
    """One data rank of ``gnnpar train sage`` (``model``, default fan-outs): peak memory of
    its setup (loading its part or the graph, sampler, model), one training epoch and one
    layer-wise evaluation, over the idle baseline (this process with its process group,
    just before); and the peak of each phase. ``mmap_threshold``: glibc's mmap threshold set
    with ``mallopt`` before anything runs (an environment variable would come too late:
    glibc reads ``MALLOC_MMAP_THRESHOLD_`` once, when the parent started, not in a forked
    rank)."""
    import ctypes
    import gc

    import gnnpar
    from gnnpar.models.minibatch.task import MiniBatchConfig
    from gnnpar.train.spec import build_task
    from partitioners.metrics import _reset_peak_rss, measure

    libc = ctypes.CDLL("libc.so.6")
    if mmap_threshold is not None:
        libc.mallopt(-3, int(mmap_threshold))  # M_MMAP_THRESHOLD: also ends the dynamic raise
    grid = gnnpar.init()
    world = grid.world_size
    cfg = MiniBatchConfig(
        dataset=graph, parts=world, partitions=parts, batch_size=batch_size, epochs=1,
        out=str(Path(graph).parent / "run"), device="cpu", model=model,
    )  # fmt: skip
    gc.collect()
    # The parent's freed heap is inherited resident: reusing it would hide growth
    libc.malloc_trim(0)
    baseline = _rss_kib("VmRSS") * 1024
    free0 = _malloc_free()
    phases, retained, seconds = {}, {}, {}
    with measure() as m:
        t0 = time.perf_counter()
        task = build_task("sage", cfg)
        for name, run in (("setup", None), ("train", task.train_step), ("eval", task.evaluate)):
            if run is not None:
                run(0)
            seconds[name] = time.perf_counter() - t0
            t0 = time.perf_counter()
            phases[name] = _rss_kib("VmHWM") * 1024 - baseline
            retained[name] = _malloc_free() - free0
            _reset_peak_rss()  # the next phase's own peak
    out = {
        "rank": grid.global_rank,
        "baseline": baseline,
        "peak_over_baseline": max(m.peak_bytes, *phases.values()),
        "phase_peaks": phases,
        "retained_heap": retained,
        "phase_s": seconds,
        "batches": len(task.loader),
        "time_s": m.time_s,
    }
    gnnpar.release(grid)
    return out


def minibatch_table(
    scale: int, ranks: list[int], batch_size: int, tmp: Path, typed: dict | None = None
) -> dict:
    """(c): each data rank's measured peak beside :func:`minibatch_memory`, for each D;
    ``typed``: on ``mag_synth(**typed)`` with ``--model rgcn`` instead (R-MAT ``scale``'s
    GraphSAGE)."""
    from gnnpar.data.rmat import rmat
    from gnnpar.data.storage import load_graph, save_graph
    from gnnpar.models.minibatch.cost import minibatch_memory
    from gnnpar.models.minibatch.task import MiniBatchConfig, _write_parts, plan_problem
    from gnnpar.testing import run_distributed
    from gnnpar.train.progress import Progress
    from partitioners import load_meta

    kind = "sage" if typed is None else "rgcn"
    if typed is None:
        folder = tmp / f"rmat{scale}"
        save_graph(rmat(scale=scale, feat_dim=128, num_classes=16), folder)
    else:
        from gnnpar.data.mag import mag_synth

        folder = tmp / "mag-synth"
        save_graph(mag_synth(**typed), folder)
    g = load_graph(folder)
    cfg = MiniBatchConfig(dataset=str(folder), batch_size=batch_size, model=kind)
    problem = plan_problem(cfg, g)  # what `gnnpar plan sage` prints for these flags
    del g
    rows = []
    for d in ranks:
        parts = None
        if d > 1:  # what `gnnpar train sage --nprocs D --parts D` writes once (METIS, halo 1)
            parts = tmp / f"parts{d}"
            parts = tmp / f"{kind}-parts{d}"
            _write_parts(MiniBatchConfig(dataset=str(folder), parts=d, model=kind), parts, d,
                         Progress(False))  # fmt: skip
        res = run_distributed(_minibatch_worker, d, str(folder), parts and str(parts), batch_size,
                              None, kind, timeout=3600)  # fmt: skip
        # again with glibc's mmap threshold fixed at its default (128 KiB): large freed
        # blocks then go back to the system instead of staying in the heap
        fixed = run_distributed(_minibatch_worker, d, str(folder), parts and str(parts),
                                batch_size, FIXED_MMAP, kind, timeout=3600)  # fmt: skip
        records = load_meta(parts)["parts"] if parts else [None]
        for r, f, rec in zip(res, fixed, records, strict=True):
            r["fixed_mmap"] = f
            model = minibatch_memory(problem, d, rec)
            r.update(model_parts=model, model=sum(model.values()))
            r["ratio"] = r["peak_over_baseline"] / r["model"]
            # with the threshold fixed the allocator keeps no holes: the model less its heap
            r["ratio_fixed_mmap"] = f["peak_over_baseline"] / (r["model"] - model["heap"])
            if rec:
                r["part"] = {k: rec[k] for k in ("num_owned", "num_halo", "num_local_edges")}
        rows.append({"ranks": d, "per_rank": res})
        for r in res:
            print(_minibatch_line(d, r), flush=True)
    return {"scale": scale, "typed": typed, "batch_size": batch_size, "problem": {
        k: v for k, v in vars(problem).items() if k not in ("degrees", "typed")},
        "rows": rows}  # fmt: skip


def _typed_sizes(papers: int) -> dict:
    """(d)'s mag-synth: ``papers`` papers and ogbn-mag's proportions of authors (2.0 a
    paper), institutions and fields."""
    return {"num_papers": papers, "num_authors": 2 * papers, "num_institutions": papers // 80,
            "num_fields": papers // 20}  # fmt: skip


def _minibatch_line(d: int, r: dict) -> str:
    p = {k: v / MIB for k, v in r["model_parts"].items()}
    ph = r["phase_peaks"]
    return (
        f"| {d} | {r['rank']} | {r['peak_over_baseline'] / MIB:,.0f} | "
        f"{ph['setup'] / MIB:,.0f} / {ph['train'] / MIB:,.0f} / {ph['eval'] / MIB:,.0f} | "
        f"{r['model'] / MIB:,.0f} | {p['graph']:,.0f} / {p['features']:,.0f} / "
        f"{p['node_data']:,.0f} / {p['sampler']:,.0f} / {p['batches']:,.0f} / "
        f"{p['activations']:,.0f} / {p['buffers']:,.0f} / {p['weights']:,.1f} / "
        f"{p['inference']:,.0f} / {p['staging']:,.0f} / {p['kernels']:,.0f} / "
        f"{p['runtime']:,.0f} / {p['heap']:,.0f} | "
        f"{r['fixed_mmap']['peak_over_baseline'] / MIB:,.0f} | "
        f"{r['ratio']:.2f}, {r['ratio_fixed_mmap']:.2f} |"
    )


#: glibc's mmap threshold pinned at its default, 128 KiB (no dynamic raise): the allocator
#: then maps every larger block and returns it when freed, so peaks count the working set,
#: not the retained heap.
FIXED_MMAP = 131072

MINIBATCH_HEADER = (
    "| D | rank | measured MiB | phases setup / train / eval MiB | model MiB | model graph / "
    "features / node data / sampler / batches / act / buffers / W / inference / staging / "
    "kernels / runtime / heap MiB | measured, fixed mmap threshold MiB | measured / model "
    "(default; fixed, against the model less heap) |"
    "\n|--:|--:|--:|------|--:|------|--:|--:|"
)


# ------------------------------------------------------------------ (b) scale pipeline
def _stage(name: str, code: str, log: Path) -> dict:
    """Run ``code`` in a fresh Python under ``/usr/bin/time -v``: its wall time and peak."""
    cmd = [sys.executable, "-c", code]
    timer = Path("/usr/bin/time")
    if timer.exists():
        cmd = [str(timer), "-v", *cmd]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"stage {name} failed (exit {proc.returncode}); see {log}")
    peak = None
    for line in proc.stderr.splitlines():
        if "Maximum resident set size" in line:
            peak = int(line.split()[-1]) * 1024
    return {"stage": name, "seconds": seconds, "peak_bytes": peak}


def scale_pipeline(scale: int, limit: str, parts: int, tmp: Path) -> dict:
    """(b): generate, partition (Fennel, streamed) and cut shards (streamed), each stage a
    process under ``limit``."""
    graph, part, shards = tmp / f"rmat{scale}", tmp / f"rmat{scale}-fennel{parts}", tmp / "shards"
    run = tmp / "sage"
    stages = [
        (
            "generate",
            "from gnnpar.cli import main; import sys; "
            f"sys.exit(main(['data', 'prepare', 'rmat', '--out', {str(graph)!r}, "
            f"'--dataset-options', 'scale={scale},feat_dim=128', '--memory-limit', {limit!r}]))",
        ),
        (
            "partition (fennel)",
            "from partitioners.cli import main; import sys; "
            f"sys.exit(main([{str(graph)!r}, '--parts', '{parts}', '--method', 'fennel', "
            f"'--out', {str(part)!r}, '--memory-limit', {limit!r}, '--no-progress']))",
        ),
        (
            "train sage (1 epoch, 4 ranks)",
            "from gnnpar.cli import main; import sys; "
            f"sys.exit(main(['train', 'sage', '--dataset', {str(graph)!r}, '--partitions', "
            f"{str(part)!r}, '--parts', '{parts}', '--nprocs', '{parts}', '--epochs', '1', "
            f"'--batch-size', '{MINIBATCH_SCALE_BATCH}', '--eval-every', '0', '--quiet', "
            f"'--out', {str(run)!r}]))",
        ),
        (
            "shards (8x8)",
            "from gnnpar.fmt import parse_bytes; "
            "from gnnpar.models.fullgraph.shards import prepare_shards; "
            f"prepare_shards({str(graph)!r}, {str(shards)!r}, blocks=(8, 8), "
            f"memory_limit=parse_bytes({limit!r}))",
        ),
    ]
    out = []
    for name, code in stages:
        out.append(_stage(name, code, tmp / f"{name.split()[0]}.log"))
        r = out[-1]
        print(f"| {name} | {r['seconds']:.0f} | {(r['peak_bytes'] or 0) / MIB:,.0f} |", flush=True)
        if name == "generate":
            from gnnpar.data.storage import read_meta

            meta = read_meta(graph)
            print(
                f"| (R-MAT {scale}: {meta['num_nodes']:,} nodes, {meta['num_edges']:,} edges) | | |"
            )
        if name.startswith("train"):
            ranks = minibatch_scale_ranks(graph, part, run)
    print(MINIBATCH_SCALE_HEADER)
    for r in ranks:
        print(_scale_rank_line(r))
    return {
        "scale": scale,
        "memory_limit": limit,
        "stages": out,
        "edges": meta["num_edges"],
        "minibatch_ranks": ranks,
    }


#: Global batch of the scale pipeline's mini-batch epoch (1,024 seeds a rank on 4 ranks).
MINIBATCH_SCALE_BATCH = 4096

MINIBATCH_SCALE_HEADER = (
    "\n| rank | owned / halo nodes | local edges | measured MiB | model MiB | "
    "model graph / features / inference / other MiB | measured / model |\n"
    "|--:|--:|--:|--:|--:|------|--:|"
)


def minibatch_scale_ranks(graph: Path, part: Path, run: Path) -> list[dict]:
    """Each rank's peak over its idle baseline (the run's ``memory`` record) beside
    :func:`~gnnpar.models.minibatch.cost.minibatch_memory` for its part of the partition, with the
    graph's degree histogram."""
    import numpy as np

    from gnnpar.models.minibatch.cost import MiniBatchProblem, degree_histogram, minibatch_memory
    from gnnpar.train.metrics import read_metrics
    from partitioners import load_meta

    meta = load_meta(part)
    record = next(r for r in read_metrics(run / "metrics.jsonl") if r.get("event") == "memory")
    problem = MiniBatchProblem(
        nodes=meta["num_nodes"],
        edges=meta["num_edges"],
        features=int(meta["ndata"]["feat"]["shape"][1]),
        classes=16,
        batch_size=MINIBATCH_SCALE_BATCH,
        train_nodes=sum(p["num_train"] for p in meta["parts"]),
        degrees=degree_histogram(np.load(graph / "indptr.npy", mmap_mode="r")),
    )
    rows = []
    for k, rec in enumerate(meta["parts"]):
        model = minibatch_memory(problem, data=meta["num_parts"], part=rec)
        measured = (record["peak_rss_mb"][k] - record["baseline_rss_mb"][k]) * MIB
        rows.append(
            {
                "rank": k,
                "part": rec,
                "measured": measured,
                "baseline": record["baseline_rss_mb"][k] * MIB,
                "model": sum(model.values()),
                "model_parts": model,
                "ratio": measured / sum(model.values()),
            }
        )
    return rows


def _scale_rank_line(r: dict) -> str:
    part, parts = r["part"], r["model_parts"]
    other = sum(v for k, v in parts.items() if k not in ("graph", "features", "inference"))
    return (
        f"| {r['rank']} | {part['num_owned']:,} / {part['num_halo']:,} | "
        f"{part['num_local_edges']:,} | {r['measured'] / MIB:,.0f} | {r['model'] / MIB:,.0f} | "
        f"{parts['graph'] / MIB:,.0f} / {parts['features'] / MIB:,.0f} / "
        f"{parts['inference'] / MIB:,.0f} / {other / MIB:,.0f} | {r['ratio']:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=int, default=18, help="R-MAT scale of table (a)")
    parser.add_argument("--ranks", default="1,2,4,8", help="world sizes of table (a)")
    parser.add_argument("--quick", action="store_true", help="scale 12, 1 and 2 ranks")
    parser.add_argument(
        "--scale-pipeline", action="store_true", help="also run (b), the long scale pipeline"
    )
    parser.add_argument("--big-scale", type=int, default=22, help="R-MAT scale of (b)")
    parser.add_argument("--memory-limit", default="3GB", help="per-stage budget of (b)")
    parser.add_argument("--skip-fullgraph", action="store_true", help="skip (a)")
    parser.add_argument(
        "--minibatch", action="store_true", help="also run (c), the mini-batch task per data rank"
    )
    parser.add_argument("--data-ranks", default="1,2,4", help="data ranks of table (c)")
    parser.add_argument(
        "--typed", action="store_true", help="also run (d): (c) for R-GCN on a typed graph"
    )
    parser.add_argument(
        "--typed-papers", type=int, default=60000, help="papers of (d)'s mag-synth graph"
    )
    parser.add_argument("--batch-size", type=int, default=1024, help="global batch of (c)")
    parser.add_argument("--tmp", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", default=str(OUT / "memory.json"), help="JSON results file")
    args = parser.parse_args()
    if args.quick:
        args.scale, args.ranks, args.big_scale, args.data_ranks = 12, "1,2", 12, "1,2"
        args.typed_papers = 4000
    ranks = [int(r) for r in args.ranks.split(",")]
    doc: dict = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as scratch:
        tmp = Path(scratch)
        if not args.skip_fullgraph:
            print(f"Full-graph GCN, R-MAT {args.scale}, 3 layers x 128: peak minus idle baseline")
            print(HEADER, flush=True)
            doc["fullgraph"] = fullgraph_table(args.scale, ranks, tmp)
        if args.minibatch:
            print(
                f"\nMini-batch GraphSAGE (sage task), R-MAT {args.scale}, batch "
                f"{args.batch_size}: peak minus idle baseline per data rank"
            )
            print(MINIBATCH_HEADER, flush=True)
            doc["minibatch"] = minibatch_table(
                args.scale, [int(r) for r in args.data_ranks.split(",")], args.batch_size, tmp
            )
        if args.typed:
            sizes = _typed_sizes(args.typed_papers)
            print(
                f"\nMini-batch R-GCN (sage task, --model rgcn), mag-synth {sizes}, batch "
                f"{args.batch_size}: peak minus idle baseline per data rank"
            )
            print(MINIBATCH_HEADER, flush=True)
            doc["minibatch_typed"] = minibatch_table(
                0, [int(r) for r in args.data_ranks.split(",")], args.batch_size, tmp, sizes
            )
        if args.scale_pipeline:
            print(
                f"\nR-MAT {args.big_scale} to disk and shards, every stage under "
                f"{args.memory_limit}"
            )
            print("| stage | seconds | peak RSS MiB |\n|------|--:|--:|", flush=True)
            doc["pipeline"] = scale_pipeline(args.big_scale, args.memory_limit, 4, tmp)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
