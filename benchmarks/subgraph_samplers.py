"""Subgraph sampler benchmark: GraphSAINT and ClusterGCN samplers beside DGL 1.1.3's.

A uniform random graph (100,000 nodes and 1,000,000 edges by default; ``--quick``: 20,000
and 200,000). Each pair draws the same number of subgraphs of about the same size, on one
thread (``OMP_NUM_THREADS`` and torch's intra-op threads set to 1 before anything is
imported), sampling only (no features):

- ``saint-node``: ours :class:`~gnnpar.sampling.SaintNodeSampler` (budget 6,000 draws, each
  node with probability ∝ its degree, as DGL draws) vs DGL's ``SAINTSampler(mode="node",
  budget=6000)``;
- ``saint-edge``: ours ``SaintEdgeSampler`` (4,000 edges) vs ``SAINTSampler("edge", 4000)``;
- ``saint-rw``: ours ``SaintWalkSampler`` (3,000 roots, 2 steps) vs
  ``SAINTSampler("walk", (3000, 2))``;
- ``cluster``: ours :class:`~gnnpar.sampling.ClusterSampler` (METIS from ``partitioners``,
  500 parts, 10 per batch) vs DGL's ``ClusterGCNSampler(g, 500)`` fed 10 part ids per batch
  by its ``DataLoader``.

Ours also attach GraphSAINT's normalisation weights to every subgraph (DGL's sampler leaves
them to the user); the one-off set-up (our pre-sampling or partition, DGL's METIS) is timed
apart. Ours and DGL's runs alternate (3 of each by default) and the median subgraphs per
second is kept, with the spread and the load average: the machine is shared.

Run::

    python benchmarks/subgraph_samplers.py            # a few minutes on 2 cores
    python benchmarks/subgraph_samplers.py --quick    # a smaller graph, fewer runs

Writes ``benchmarks/out/subgraph_samplers.json`` and prints the table.

``--vertex-4d`` compares instead ScaleGNN's 4D training with neighbour sampling, on 4 ranks
and an R-MAT graph (``scale`` 13: 8,192 nodes, 64 features, 16 classes), GraphSAGE-mean,
2 layers, hidden 64, at equal output nodes per step: ``gnnpar train sage --sampler vertex
--grid data=2,x=2 --budget 512`` (two groups of 512 sampled nodes) against ``gnnpar train
sage --parts 4 --batch-size 1024 --fanouts 10,10`` (1,024 seeds over the 4 ranks). Each run
trains 2 epochs; the second epoch's seconds and bytes (the trainer's per-axis traffic, plus
the neighbour sampler's sampling and feature-fetch bytes), per rank, are kept, per epoch and
per step, with the load average. Writes ``benchmarks/out/vertex_4d.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and dgl are imported

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from gnnpar.graph import Graph  # noqa: E402
from gnnpar.sampling import (  # noqa: E402
    ClusterSampler,
    SaintEdgeSampler,
    SaintNodeSampler,
    SaintWalkSampler,
)

OUT = ROOT / "benchmarks" / "out"


def random_graph(nodes: int, edges: int, seed: int = 0) -> tuple[Graph, torch.Tensor, torch.Tensor]:
    """A uniform random graph, with its COO edges for DGL."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, nodes, (edges,), generator=g)
    dst = torch.randint(0, nodes, (edges,), generator=g)
    return Graph.from_edges(src, dst, nodes), src, dst


def _dgl() -> Any:
    warnings.filterwarnings("ignore")
    import dgl

    return dgl


def _ours(kind: str, graph: Graph, parts: int, seed: int) -> Any:
    if kind == "saint-node":
        # DGL's node mode draws each node in proportion to its out-degree: ours the same way
        return SaintNodeSampler(graph, 2, 6000, "degree", presample=5, seed=seed)
    if kind == "saint-edge":
        return SaintEdgeSampler(graph, 2, 4000, presample=5, seed=seed)
    if kind == "saint-rw":
        return SaintWalkSampler(graph, 2, 3000, 2, presample=5, seed=seed)
    return ClusterSampler(graph, 2, parts, 10, seed=seed)


def _dgl_sampler(kind: str, dgl_graph: Any, parts: int, cache: str) -> Any:
    dgl = _dgl()
    if kind == "saint-node":
        return dgl.dataloading.SAINTSampler("node", 6000)
    if kind == "saint-edge":
        return dgl.dataloading.SAINTSampler("edge", 4000)
    if kind == "saint-rw":
        return dgl.dataloading.SAINTSampler("walk", (3000, 2))
    return dgl.dataloading.ClusterGCNSampler(dgl_graph, parts, cache_path=cache)


def _run_ours(sampler: Any, count: int, rep: int) -> tuple[float, float]:
    start, nodes = time.perf_counter(), 0
    for i in range(count):
        nodes += sampler.batch(rep, i).num_seeds
    return count / (time.perf_counter() - start), nodes / count


def _run_dgl(kind: str, sampler: Any, dgl_graph: Any, count: int, parts: int, rep: int):
    dgl = _dgl()
    torch.manual_seed(rep)
    ids = torch.arange(parts if kind == "cluster" else count)
    loader = dgl.dataloading.DataLoader(
        dgl_graph, ids, sampler, batch_size=10 if kind == "cluster" else 1,
        shuffle=True, drop_last=False, num_workers=0,
    )  # fmt: skip
    start, nodes, done = time.perf_counter(), 0, 0
    for sg in loader:
        nodes += sg.num_nodes()
        done += 1
        if done == count:
            break
    return done / (time.perf_counter() - start), nodes / done


def bench(kind: str, graph: Graph, dgl_graph: Any, count: int, reps: int, parts: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ours = _ours(kind, graph, parts, 0)
        t1 = time.perf_counter()
        theirs = _dgl_sampler(kind, dgl_graph, parts, str(Path(tmp) / "cluster.pkl"))
        t2 = time.perf_counter()
        count = min(count, parts // 10) if kind == "cluster" else count
        rates: dict[str, list[float]] = {"ours": [], "dgl": []}
        sizes: dict[str, float] = {}
        for rep in range(reps):  # interleaved: the shared machine's load hits both
            rate, sizes["ours"] = _run_ours(ours, count, rep)
            rates["ours"].append(rate)
            rate, sizes["dgl"] = _run_dgl(kind, theirs, dgl_graph, count, parts, rep)
            rates["dgl"].append(rate)
    ratios = [a / b for a, b in zip(rates["ours"], rates["dgl"], strict=True)]
    row = {
        "sampler": kind,
        "subgraphs_per_rep": count,
        "ours_per_s": statistics.median(rates["ours"]),
        "dgl_per_s": statistics.median(rates["dgl"]),
        "ratio": statistics.median(rates["ours"]) / statistics.median(rates["dgl"]),
        "ratio_range": [min(ratios), max(ratios)],
        "mean_nodes": sizes,
        "setup_s": {"ours": t1 - t0, "dgl": t2 - t1},
        "load_average": os.getloadavg()[0],
    }
    print(f"  {kind}: ours {row['ours_per_s']:.1f}/s, DGL {row['dgl_per_s']:.1f}/s, "
          f"{row['ratio']:.2f}x", flush=True)  # fmt: skip
    return row


def markdown(result: dict) -> str:
    lines = [
        "| sampler | ours subgraphs/s | DGL subgraphs/s | ratio (spread) | mean nodes ours / DGL "
        "| set-up s ours / DGL |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lo, hi = r["ratio_range"]
        lines.append(
            f"| {r['sampler']} | {r['ours_per_s']:.1f} | {r['dgl_per_s']:.1f} | "
            f"{r['ratio']:.2f}x ({lo:.2f}-{hi:.2f}) | {r['mean_nodes']['ours']:,.0f} / "
            f"{r['mean_nodes']['dgl']:,.0f} | {r['setup_s']['ours']:.2f} / "
            f"{r['setup_s']['dgl']:.2f} |"
        )
    g = result["graph"]
    lines.append(
        f"\n{g['nodes']:,} nodes, {g['edges']:,} edges (uniform random), one thread; medians "
        f"of {result['reps']} interleaved runs; our set-up includes pre-sampling 5 subgraphs "
        "(normalisation) or the METIS partition"
    )
    return "\n".join(lines)


def _train(out: Path, *flags: str) -> dict[str, Any]:
    """One 4-rank ``gnnpar train sage`` run of 2 epochs; its second epoch's record."""
    import subprocess

    argv = [sys.executable, "-m", "gnnpar.cli", "train", "sage", "--nprocs", "4",
            "--dataset", "rmat", "--dataset-options", "scale=13,feat_dim=64",
            "--root", str(out.parent / "data"), "--hidden", "64", "--epochs", "2",
            "--eval-every", "0", "--quiet", "--out", str(out), *flags]  # fmt: skip
    subprocess.run(argv, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("epoch") == 2][0]


def _epoch_row(name: str, record: dict[str, Any], ranks: int = 4) -> dict[str, Any]:
    """Seconds and bytes of one rank: the trainer's traffic is rank 0's, the neighbour
    sampler's sampling and feature bytes are summed over the ``ranks`` data ranks."""
    traffic = sum(v for kinds in record.get("bytes", {}).values() for v in kinds.values())
    extra = (record.get("sample_bytes", 0.0) + record.get("feature_bytes", 0.0)) / ranks
    steps = record["batches"]
    return {
        "run": name,
        "seconds": record["seconds"],
        "steps": steps,
        "seconds_per_step": record["seconds"] / steps,
        "bytes": traffic + extra,
        "bytes_per_step": (traffic + extra) / steps,
        "bytes_by_axis": record.get("bytes", {}),
    }


def vertex_4d(json_path: str) -> int:
    """ScaleGNN's 4D epoch against the neighbour-sampling epoch (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        load = os.getloadavg()
        vertex = _train(Path(tmp) / "vertex", "--sampler", "vertex", "--grid", "data=2,x=2",
                        "--budget", "512")  # fmt: skip
        neighbor = _train(Path(tmp) / "neighbor", "--parts", "4", "--batch-size", "1024",
                          "--fanouts", "10,10")  # fmt: skip
        load_after = os.getloadavg()
    rows = [_epoch_row("vertex 4D (data=2,x=2, 2 x 512)", vertex),
            _epoch_row("neighbour (4 parts, 1024 seeds)", neighbor)]  # fmt: skip
    result = {
        "graph": "rmat scale=13 feat_dim=64",
        "rows": rows,
        "step_time_ratio": rows[1]["seconds_per_step"] / rows[0]["seconds_per_step"],
        "step_bytes_ratio": rows[1]["bytes_per_step"] / max(rows[0]["bytes_per_step"], 1.0),
        "load_average": [load, load_after],
    }
    out = Path(json_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print("| run | s / epoch | steps | s / step | MB / step |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['seconds']:.2f} | {r['steps']:.0f} | "
              f"{r['seconds_per_step']:.3f} | {r['bytes_per_step'] / 1e6:.2f} |")  # fmt: skip
    print(f"neighbour / vertex per step: time {result['step_time_ratio']:.2f}x, bytes "
          f"{result['step_bytes_ratio']:.2f}x; load average {load} -> {load_after}")  # fmt: skip
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller graph and fewer runs")
    p.add_argument(
        "--vertex-4d", action="store_true", help="ScaleGNN 4D epoch vs neighbour-sampling epoch"
    )
    p.add_argument("--reps", type=int, default=None, help="interleaved runs (median is kept)")
    p.add_argument("--json", default=str(OUT / "subgraph_samplers.json"), help="JSON to write")
    args = p.parse_args(argv)
    if args.vertex_4d:
        default = str(OUT / "subgraph_samplers.json")
        return vertex_4d(str(OUT / "vertex_4d.json") if args.json == default else args.json)
    torch.set_num_threads(1)
    reps = args.reps or (2 if args.quick else 3)
    nodes, edges = (20_000, 200_000) if args.quick else (100_000, 1_000_000)
    count = 10 if args.quick else 30
    parts = 100 if args.quick else 500
    dgl = _dgl()
    graph, src, dst = random_graph(nodes, edges)
    dgl_graph = dgl.graph((src, dst), num_nodes=nodes)
    result: dict[str, Any] = {
        "graph": {"nodes": nodes, "edges": edges, "kind": "uniform random"},
        "reps": reps,
        "threads": 1,
        "versions": {
            "torch": torch.__version__,
            "dgl": dgl.__version__,
            "python": platform.python_version(),
        },
    }
    print(f"subgraph sampling, {nodes:,} nodes, {edges:,} edges, medians of {reps}:", flush=True)
    kinds = ("saint-node", "saint-edge", "saint-rw", "cluster")
    result["rows"] = [bench(k, graph, dgl_graph, count, reps, parts) for k in kinds]
    result["target"] = {"need": 1.0, "ratios": [r["ratio"] for r in result["rows"]]}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print()
    print(markdown(result))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
