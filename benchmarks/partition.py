"""Partitioning benchmark: our methods beside DGL 1.1.3, and 2D block balance for SpMM.

Part 1 runs, on R-MAT (>= 1M edges) and CiteSeer, every method of ``partitioners`` and
DGL's ``metis_partition_assignment`` and ``partition_graph`` (metis and random). Each case
runs in a fresh process (so peak memory is its own: the resident-set high-water mark above
the process's size once the graph is loaded) and is repeated; the best wall time is kept.
``ours metis+write`` and ``ours random+write`` partition *and* write the folder with a 1-hop
halo and all node data, like ``partition_graph`` does.

Part 2 measures the nnz imbalance (max/mean nonzeros per block) of 4x4 and 8x8 grids of an
R-MAT scale-18 adjacency: without permutation, with Plexus's random double permutation,
with our degree-aware balanced permutation, and with its ``within="locality"`` form (the
same blocks, nodes in locality order inside each). Two node orders: Graph500's scrambled ids
(``gnnpar.data.rmat``) and the raw Kronecker order, where hubs sit on low ids.

Run::

    python benchmarks/partition.py            # full run, a few minutes on 2 cores
    python benchmarks/partition.py --quick    # smaller inputs, one repetition

Writes ``benchmarks/out/partition.json`` and prints the tables and the target checks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from partitioners.blocks import balanced_permutation, block2d, double_permutation  # noqa: E402
from partitioners.metrics import format_table  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
SHARED_DATA = ROOT.parent / "shared" / "datasets"
OURS = ("random", "range", "hash", "metis", "ldg", "fennel")
DGL_CASES = ("dgl metis_partition_assignment", "dgl partition_graph metis",
             "dgl partition_graph random")  # fmt: skip


# ---------------------------------------------------------------------- inputs


def _prepare(name: str, args: argparse.Namespace, cache: Path) -> Path | None:
    """Build the dataset once and store it as plain arrays for the worker processes."""
    from gnnpar.data import load

    if name == "citeseer":
        if not (SHARED_DATA / "planetoid" / "ind.citeseer.graph").is_file():
            return None
        g = load("citeseer", root=SHARED_DATA)
    else:
        g = load("rmat", scale=args.rmat_scale, edge_factor=16, feat_dim=64, seed=0)
    path = cache / f"{name}.npz"
    arrays = {"indptr": g.indptr.numpy(), "indices": g.indices.numpy()}
    arrays.update({f"ndata_{k}": v.numpy() for k, v in g.ndata.items()})
    np.savez(path, name=np.array(g.name), **arrays)
    return path


def _load_cached(path: Path) -> Any:
    from gnnpar.graph import Graph

    with np.load(path) as z:
        ndata = {k[6:]: z[k] for k in z.files if k.startswith("ndata_")}
        import torch

        return Graph(
            torch.from_numpy(z["indptr"]),
            torch.from_numpy(z["indices"]),
            ndata={k: torch.from_numpy(v) for k, v in ndata.items()},
            name=str(z["name"]),
            validate=False,
        )


# ---------------------------------------------------------------------- one case


@contextlib.contextmanager
def _silenced() -> Any:
    """Send this process's stdout and stderr (C code included: DGL logs a lot) to null."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def _dgl_owner(orig_nids: Any, part_json: Path, n: int) -> np.ndarray:
    ranges = json.loads(part_json.read_text())["node_map"]["_N"]
    owner = np.empty(n, dtype=np.int64)
    orig = np.asarray(orig_nids)
    for k, (start, stop) in enumerate(ranges):
        owner[orig[start:stop]] = k
    return owner


def _run_case(case: str, data_path: str, k: int, repeat: int, queue: Any) -> None:
    """Worker: load the graph, then run ``case`` ``repeat`` times; the first run, in a fresh
    process, gives the peak memory."""
    try:
        queue.put(_case(case, Path(data_path), k, repeat))
    except BaseException as err:  # report, never hang the parent
        queue.put({"case": case, "error": f"{type(err).__name__}: {err}"})


def _case(case: str, data_path: Path, k: int, repeat: int) -> dict[str, Any]:
    import partitioners
    from partitioners.metrics import measure

    graph = _load_cached(data_path)
    dgl_graph = None
    if case.startswith("dgl"):
        import dgl

        src, dst = graph.edges()
        dgl_graph = dgl.graph((src, dst), num_nodes=graph.num_nodes)
        for key, value in graph.ndata.items():
            dgl_graph.ndata[key] = value
    times, peak, source, owner = [], None, "", None
    work = Path(tempfile.mkdtemp(prefix="partbench-"))
    try:
        for r in range(repeat):
            out = work / f"run{r}"
            with _silenced(), measure() as m:
                owner = _do(case, graph, dgl_graph, k, out)
            times.append(m.time_s)
            if peak is None:
                peak, source = m.peak_bytes, m.source
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    part = partitioners.Partition(owner, k, method=case)
    from partitioners.metrics import quality

    q = quality(graph, part)
    return {
        "case": case,
        "time_s": min(times),
        "times_s": times,
        "peak_bytes": peak,
        "peak_source": source,
        "edge_cut": q.edge_cut,
        "edge_cut_fraction": q.edge_cut_fraction,
        "node_balance": q.node_balance,
        "edge_balance": q.edge_balance,
        "train_balance": q.train_balance,
        "replication_factor": q.replication_factor,
    }


def _do(case: str, graph: Any, dgl_graph: Any, k: int, out: Path) -> np.ndarray:
    import partitioners

    if case.startswith("ours "):
        method, _, rest = case[5:].partition("+")
        part = partitioners.partition(graph, k, method=method, seed=0)
        if rest == "write":
            partitioners.write(graph, part, out, halo=1)
        return part.owner
    if case == "dgl metis_partition_assignment":
        from dgl.partition import metis_partition_assignment

        return metis_partition_assignment(dgl_graph, k).numpy().astype(np.int64)
    from dgl.distributed import partition_graph

    method = case.rsplit(" ", 1)[1]
    orig_nids, _ = partition_graph(
        dgl_graph, "g", k, str(out), num_hops=1, part_method=method, return_mapping=True
    )
    return _dgl_owner(orig_nids, out / "g.json", graph.num_nodes)


def _spawn(case: str, data: Path, k: int, repeat: int, timeout: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_run_case, args=(case, str(data), k, repeat, queue))
    proc.start()
    try:
        result = queue.get(timeout=timeout)
    except Exception:  # noqa: BLE001 - a timeout or a dead worker
        result = {"case": case, "error": f"no result within {timeout:.0f} s"}
    proc.join(timeout=10)
    if proc.is_alive():
        proc.kill()
    return result


# ---------------------------------------------------------------------- part 1


def bench_partitioners(args: argparse.Namespace, cache: Path) -> dict[str, Any]:
    try:
        import dgl  # noqa: F401

        have_dgl = True
    except ImportError:
        have_dgl = False
        print("DGL is not installed: only our methods run (pip install 'gnnpar[dgl]')")
    cases = [f"ours {m}" for m in OURS] + ["ours random+write", "ours metis+write"]
    if have_dgl:
        cases += list(DGL_CASES)
    results: dict[str, Any] = {}
    for name in ("rmat", "citeseer"):
        data = _prepare(name, args, cache)
        if data is None:
            print(f"{name}: dataset files not found under {SHARED_DATA}; skipped")
            continue
        with np.load(data) as z:
            n, e = int(z["indptr"].shape[0] - 1), int(z["indices"].shape[0])
        print(f"\n{name}: {n} nodes, {e} edges, K = {args.parts}, best of {args.repeat}")
        rows = []
        for case in cases:
            t0 = time.perf_counter()
            row = _spawn(case, data, args.parts, args.repeat, args.timeout)
            rows.append(row)
            status = row.get("error") or f"{row['time_s']:.2f} s"
            print(f"  {case:<34} {status}  ({time.perf_counter() - t0:.0f} s with start-up)")
        results[name] = {"num_nodes": n, "num_edges": e, "num_parts": args.parts, "rows": rows}
        print(format_table(_table(rows)))
    return results


def _table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if "error" in r:
            out.append({"case": r["case"], "cut %": None, "error": r["error"]})
            continue
        out.append({
            "case": r["case"],
            "cut %": 100 * r["edge_cut_fraction"],
            "nodes bal": r["node_balance"],
            "edges bal": r["edge_balance"],
            "train bal": r["train_balance"],
            "time s": r["time_s"],
            "peak MiB": r["peak_bytes"] / 2**20,
        })  # fmt: skip
    return out


# ---------------------------------------------------------------------- part 2


def _rmat_kronecker(scale: int, edge_factor: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric R-MAT (a, b, c = 0.57, 0.19, 0.19) *without* Graph500's id scrambling."""
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    n, m = 1 << scale, edge_factor << scale
    src = np.zeros(m, dtype=np.int64)
    dst = np.zeros(m, dtype=np.int64)
    for _ in range(scale):
        u = rng.random(m)
        src = (src << 1) | (u >= 0.76)
        dst = (dst << 1) | (((u >= 0.57) & (u < 0.76)) | (u >= 0.95))
    keep = src != dst
    src, dst = src[keep], dst[keep]
    rows, cols = np.concatenate([dst, src]), np.concatenate([src, dst])
    adj = sp.csr_matrix((np.ones(rows.shape[0], dtype=np.int8), (rows, cols)), shape=(n, n))
    adj.sum_duplicates()
    return adj.indptr.astype(np.int64), adj.indices.astype(np.int64)


def bench_blocks(args: argparse.Namespace) -> dict[str, Any]:
    from gnnpar.data import rmat

    scale = args.block_scale
    g = rmat(scale=scale, edge_factor=16, feat_dim=1, seed=0)
    inputs = {
        f"rmat{scale} scrambled ids": (g.indptr.numpy(), g.indices.numpy()),
        f"rmat{scale} Kronecker order": _rmat_kronecker(scale, 16),
    }
    del g
    rows = []
    for label, (ip, ix) in inputs.items():
        n = ip.shape[0] - 1
        for grid in (4, 8):
            p, p2 = double_permutation(n, seed=0)
            t0 = time.perf_counter()
            b, b2 = balanced_permutation(ip, ix, grid, grid, seed=0)
            bal_time = time.perf_counter() - t0
            t0 = time.perf_counter()
            lb, lb2 = balanced_permutation(ip, ix, grid, grid, seed=0, within="locality")
            local_time = time.perf_counter() - t0
            row = {
                "input": label,
                "nnz": int(ix.shape[0]),
                "grid": f"{grid}x{grid}",
                "none": block2d(ip, ix, grid, grid).imbalance,
                "plexus double": block2d(ip, ix, grid, grid, p, p2).imbalance,
                "ours balanced": block2d(ip, ix, grid, grid, b, b2).imbalance,
                "ours A2": block2d(ip, ix, grid, grid, b2, b).imbalance,
                "ours balanced-local": block2d(ip, ix, grid, grid, lb, lb2).imbalance,
                "balanced time s": bal_time,
                "balanced-local time s": local_time,
            }
            rows.append(row)
            print(f"  {label}, {row['grid']}: done")
    print(format_table(rows))
    return {"rows": rows}


# ---------------------------------------------------------------------- targets


def _row(results: dict[str, Any], name: str, case: str) -> dict[str, Any] | None:
    for r in results.get(name, {}).get("rows", []):
        if r["case"] == case and "error" not in r:
            return r
    return None


def check_targets(part1: dict[str, Any], part2: dict[str, Any]) -> list[dict[str, Any]]:
    checks = []

    def add(what: str, value: float | None, target: str, ok: bool | None) -> None:
        verdict = "n/a" if ok is None else ("met" if ok else "MISSED")
        checks.append({"target": what, "value": value, "goal": target, "verdict": verdict})

    for name in part1:
        ours, dgl = (
            _row(part1, name, "ours metis"),
            _row(part1, name, "dgl metis_partition_assignment"),
        )
        if ours and dgl:
            ratio = ours["edge_cut"] / max(dgl["edge_cut"], 1)
            add(f"{name}: our METIS cut / DGL's", ratio, "<= 1.03", ratio <= 1.03)
        ours_w, dgl_w = (
            _row(part1, name, "ours metis+write"),
            _row(part1, name, "dgl partition_graph metis"),
        )
        if ours_w and dgl_w:
            ratio = ours_w["time_s"] / dgl_w["time_s"]
            add(
                f"{name}: our metis+write time / DGL partition_graph", ratio, "<= 1.0", ratio <= 1.0
            )
        fen, rnd, met = (_row(part1, name, f"ours {m}") for m in ("fennel", "random", "metis"))
        if fen and rnd:
            ratio = fen["edge_cut"] / max(rnd["edge_cut"], 1)
            add(f"{name}: fennel cut / random cut", ratio, "< 0.7", ratio < 0.7)
        if fen and met:
            ratio = fen["peak_bytes"] / max(met["peak_bytes"], 1)
            add(f"{name}: fennel peak memory / METIS", ratio, "clearly < 1", ratio < 0.5)
    for row in part2.get("rows", []):
        goal = 1.02 if row["grid"] == "4x4" else 1.04
        for name in ("ours balanced", "ours balanced-local"):
            ok = row[name] <= goal and row[name] < row["plexus double"]
            add(f"{row['input']} {row['grid']}: {name[5:]} imbalance", row[name],
                f"<= {goal} and < double ({row['plexus double']:.4f})", ok)  # fmt: skip
    return checks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", type=int, default=8)
    p.add_argument("--rmat-scale", type=int, default=16, help="R-MAT scale for part 1")
    p.add_argument("--block-scale", type=int, default=18, help="R-MAT scale for part 2")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per case")
    p.add_argument("--quick", action="store_true", help="small inputs, one repetition")
    p.add_argument("--skip-partition", action="store_true")
    p.add_argument("--skip-blocks", action="store_true")
    p.add_argument("--json", default=str(OUT / "partition.json"), help="JSON file to write")
    args = p.parse_args(argv)
    if args.quick:
        args.rmat_scale, args.block_scale, args.repeat = 12, 14, 1
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="partbench-data-") as cache:
        part1 = {} if args.skip_partition else bench_partitioners(args, Path(cache))
    print(f"\nblock balance (nnz max/mean), R-MAT scale {args.block_scale}, edge factor 16")
    part2 = {} if args.skip_blocks else bench_blocks(args)
    checks = check_targets(part1, part2)
    print("\ntargets")
    print(format_table(checks))
    result = {
        "benchmark": "partition",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },  # fmt: skip
        "args": vars(args),
        "partitioners": part1,
        "blocks": part2,
        "targets": checks,
        "total_s": time.perf_counter() - started,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print(f"\nwritten {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
