"""Planner benchmark: predicted ranking of grid shapes against measured times at 8 ranks.

On this machine, in one 8-rank gloo world:

1. a bandwidth table: :func:`gnnpar.info.probe` on grids whose axes have 2, 4 and 8 ranks,
   at two buffer sizes (so a latency and a bandwidth are fitted), written to
   ``benchmarks/out/planner_bandwidth.json`` in the ``gnnpar info --check --json`` format;
2. GEMM / SpMM / streaming rates of one thread (:func:`gnnpar.plan.compute.measure_local_rates`);
3. the epoch time of a 3-layer full-graph GCN (R-MAT graph) on every x·y·z shape, and the
   step time of a small GPT (:func:`gnnpar.tensor.train.train_step`) on every data·x·y·z
   shape; each shape gets a fresh grid (its own process groups), one warm-up step, then the
   median of a few timed steps; two rounds, best of both;
4. the planner's prediction for each shape on the "cpu" machine with that table and those
   rates, and, for comparison, a bytes-only ranking.

Reports Spearman's rank correlation between predicted and measured times and whether the
measured best shape is in the predicted top 3; writes ``benchmarks/out/planner.json`` and
``benchmarks/out/planner.png`` (predicted against measured, one panel per workload).

    python benchmarks/planner.py            # about 4-5 minutes on 2 cores
    python benchmarks/planner.py --quick    # a smoke run (numbers are noise)
    python benchmarks/planner.py --paper-only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
GPT = {"n_layer": 2, "n_embd": 64, "n_head": 8, "vocab_size": 512, "block_size": 32,
       "batch_size": 16}  # fmt: skip


def _timed(step, grid, steps: int) -> float:
    """Median seconds of ``steps`` calls after one warm-up, slowest rank."""
    from gnnpar import comm

    step()
    times = []
    for _ in range(steps):
        comm.barrier(grid)
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    comm.all_reduce(t, grid, "world", op="max")
    return float(t)


def _gcn_time(grid, shards: str, dims: list[int], steps: int) -> float:
    from gnnpar.models.fullgraph import parallelize_fullgraph
    from gnnpar.models.fullgraph.model import FullGraphGNN
    from gnnpar.models.fullgraph.shards import DiskSource

    torch.manual_seed(0)
    model = FullGraphGNN(dims[0], dims[1], dims[-1], len(dims) - 1, dropout=0.5)
    par = parallelize_fullgraph(model, grid, DiskSource(shards))
    feats = par.input_features()
    opt = torch.optim.Adam(par.parameters(), lr=0.01)

    def step():  # what FullGraphTask.train_step does
        par.train()
        opt.zero_grad(set_to_none=True)
        par.loss(par(feats, dropout_seed=1), "train_mask").backward()
        opt.step()

    return _timed(step, grid, steps)


class _Tokens:
    """Random tokens: the corpus of the timed GPT steps."""

    vocab_size = GPT["vocab_size"]

    def split(self, val_fraction: float):
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, self.vocab_size, (20_000,), generator=gen)
        return ids, ids[:1000]


def _gpt_time(grid, steps: int) -> float:
    from gnnpar.models.gpt.task import GPTTaskConfig
    from gnnpar.train.spec import build_task

    sizes = {k: v for k, v in GPT.items() if k != "batch_size"}
    cfg = GPTTaskConfig(
        **sizes, batch_size=GPT["batch_size"], warmup=1, steps=100, zero_stage=0,
        grid=",".join(f"{a}={v}" for a, v in grid.shape.items()), sample_tokens=0,
    )  # fmt: skip
    task = build_task("gpt", cfg, corpus=_Tokens())  # the gpt task's step: TP, then gnnpar.shard
    seconds = _timed(lambda: task.train_step(0), task.grid, steps)
    import gnnpar

    gnnpar.release(task.grid)
    return seconds


def _worker(shards: str, dims: list[int], steps: int, rounds: int, sizes: list[int]) -> dict:
    import gnnpar
    from gnnpar import info
    from gnnpar.grid import factorizations

    entries = []
    for shape in ({"x": 2, "y": 2, "z": 2}, {"x": 4, "y": 2}, {"x": 8}):
        grid = gnnpar.init(**shape)
        for nbytes in sizes:
            entries += info.probe(grid, nbytes=nbytes, iters=4)
        gnnpar.release(grid)
    shapes = [dict(zip(("data", "x", "y", "z"), f, strict=True)) for f in factorizations(8)]
    gcn: dict[str, list[float]] = {}
    gpt: dict[str, list[float]] = {}
    for r in range(rounds):
        for s in shapes if r % 2 == 0 else shapes[::-1]:  # drift hits both ends
            grid = gnnpar.init(**s)
            key = json.dumps(s)
            if s["data"] == 1:
                gcn.setdefault(key, []).append(_gcn_time(grid, shards, dims, steps))
            gpt.setdefault(key, []).append(_gpt_time(grid, steps))
            gnnpar.release(grid)  # free this shape's gloo groups
    return {"entries": entries, "gcn": gcn, "gpt": gpt}


def _spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def _compare(name: str, cands, measured: dict[str, float], bytes_key) -> dict:
    """Predicted vs measured for one workload."""
    from gnnpar.plan.rank import shape_label

    fitting = [c for c in cands if c.fits and json.dumps(dict(c.shape)) in measured]
    keys = [json.dumps(dict(c.shape)) for c in fitting]
    pred = [c.step_seconds for c in fitting]
    meas = [measured[k] for k in keys]
    by_bytes = [bytes_key(c) for c in fitting]
    best = min(keys, key=lambda k: measured[k])
    predicted_top3 = keys[:3]
    rows = [
        {
            "shape": dict(c.shape),
            "label": shape_label(c.shape),
            "predicted_s": c.step_seconds,
            "predicted_compute_s": c.compute_seconds,
            "predicted_comm_s": c.comm_seconds,
            "bytes": c.total_bytes,
            "measured_s": measured[k],
        }
        for c, k in zip(fitting, keys, strict=True)
    ]
    return {
        "workload": name,
        "shapes": len(keys),
        "mirror_spread": _mirror_spread(measured),
        "spearman_time_model": _spearman(pred, meas),
        "spearman_bytes_only": _spearman(by_bytes, meas),
        "measured_best": json.loads(best),
        "predicted_best": json.loads(keys[0]),
        "measured_best_in_predicted_top3": best in predicted_top3,
        "measured_best_predicted_rank": keys.index(best) + 1,
        "predicted_best_measured_rank": sorted(meas).index(measured[keys[0]]) + 1,
        "rows": rows,
    }


def _mirror_spread(measured: dict[str, float]) -> float | None:
    """Median ratio (slower / faster) between shapes that differ only by swapping x and y:
    the model gives them equal times, so this is the noise floor of the measurement."""
    ratios = []
    for key, t in measured.items():
        s = json.loads(key)
        twin = json.dumps({**s, "x": s["y"], "y": s["x"]})
        if s["x"] < s["y"] and twin in measured:
            a, b = t, measured[twin]
            ratios.append(max(a, b) / min(a, b))
    return statistics.median(ratios) if ratios else None


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 5))
    for ax, r in zip(axes, results, strict=True):
        xs = [row["predicted_s"] * 1e3 for row in r["rows"]]
        ys = [row["measured_s"] * 1e3 for row in r["rows"]]
        ax.scatter(xs, ys, color="#4c72b0")
        for row, x, y in zip(r["rows"], xs, ys, strict=True):
            ax.annotate(row["label"], (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        ax.set_xlabel("predicted (ms)")
        ax.set_ylabel("measured (ms)")
        ax.set_title(
            f"{r['workload']}: Spearman {r['spearman_time_model']:.2f} "
            f"(bytes only {r['spearman_bytes_only']:.2f})",
            fontsize=9,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def paper_scale() -> dict:
    """The model's picks at paper scale (no measurement): 3-layer GCN, hidden 128, on
    ogbn-products and ogbn-papers100M with 64-1,024 GPUs, and a 20B GPT on 1,024 GPUs."""
    from gnnpar.data.sizes import gcn_datasets
    from gnnpar.models.fullgraph.cost import GCNProblem
    from gnnpar.models.fullgraph.planning import rank_gcn
    from gnnpar.models.gpt.cost import GPTProblem, gpt_sizes
    from gnnpar.models.gpt.planning import rank_gpt
    from gnnpar.plan import get_machine
    from gnnpar.plan.rank import shape_label

    out: dict = {"gcn": [], "gpt": []}
    for name in ("ogbn-products", "ogbn-papers100M"):
        d = gcn_datasets()[name]
        problem = GCNProblem.from_edges(
            d["nodes"], d["edges"], features=d["features"], classes=d["classes"]
        )
        for machine in ("perlmutter", "frontier"):
            m = get_machine(machine)
            for gpus in (64, 128, 256, 512, 1024):
                cands = rank_gcn(problem, gpus, m)
                best = [c for c in cands if c.fits][:3]
                out["gcn"].append(
                    {
                        "dataset": name,
                        "machine": machine,
                        "gpus": gpus,
                        "top3": [shape_label(c.shape) for c in best],
                        "epoch_ms": [round(c.step_seconds * 1e3, 2) for c in best],
                        "fits": sum(c.fits for c in cands),
                    }
                )
    for machine in ("perlmutter", "frontier"):
        problem = GPTProblem.sized(**gpt_sizes()["20B"], seq=2048, batch=1024)
        cands = rank_gpt(problem, 1024, get_machine(machine))
        best = [c for c in cands if c.fits][:3]
        out["gpt"].append(
            {
                "model": f"GPT {problem.num_params / 1e9:.1f}B (44 x 6144, 64 heads)",
                "batch": "1024 x 2048 tokens, bf16, stage 0",
                "machine": machine,
                "gpus": 1024,
                "top3": [shape_label(c.shape) for c in best],
                "step_s": [round(c.step_seconds, 3) for c in best],
                "memory_gb": [round(c.memory_bytes / 1e9, 1) for c in best],
            }
        )
    return out


def _print_paper(doc: dict) -> None:
    print("\npaper scale (model only): best three shapes, predicted time")
    for r in doc["gcn"]:
        print(
            f"    {r['dataset']:<16}{r['machine']:<11}{r['gpus']:>5} GPUs  "
            + ", ".join(f"{s} ({t} ms)" for s, t in zip(r["top3"], r["epoch_ms"], strict=True))
        )
    for r in doc["gpt"]:
        print(
            f"    {r['model']:<16} {r['machine']:<11}{r['gpus']:>5} GPUs  "
            + ", ".join(f"{s} ({t} s)" for s, t in zip(r["top3"], r["step_s"], strict=True))
        )


def main() -> None:
    """Measure, predict, compare, write JSON and PNG."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=int, default=11, help="R-MAT scale of the GCN graph")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per shape")
    parser.add_argument("--rounds", type=int, default=2, help="passes over all shapes")
    parser.add_argument("--paper-only", action="store_true", help="only the paper-scale table")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: scale 9, one round of one step"
    )
    args = parser.parse_args()
    if args.quick:
        args.scale, args.steps, args.rounds = 9, 1, 1
    OUT.mkdir(parents=True, exist_ok=True)
    paper = paper_scale()
    (OUT / "planner_paper.json").write_text(json.dumps(paper, indent=1))
    _print_paper(paper)
    if args.paper_only:
        return

    from gnnpar.data import rmat
    from gnnpar.models.fullgraph.cost import GCNProblem
    from gnnpar.models.fullgraph.planning import rank_gcn
    from gnnpar.models.fullgraph.shards import prepare_shards, read_shard_manifest
    from gnnpar.models.gpt.cost import GPTProblem
    from gnnpar.models.gpt.model import GPTConfig
    from gnnpar.models.gpt.planning import rank_gpt
    from gnnpar.plan import local_machine
    from gnnpar.plan.compute import measure_local_rates
    from gnnpar.plan.machines import load_bandwidth_table
    from gnnpar.testing import run_distributed

    t0 = time.perf_counter()
    load_before = os.getloadavg()
    OUT.mkdir(parents=True, exist_ok=True)
    graph = rmat(scale=args.scale, edge_factor=8, feat_dim=64, num_classes=8)
    dims = [64, 64, 64, 8]
    tmp = Path(tempfile.mkdtemp(prefix="gnnpar-planner-"))
    shards = prepare_shards(graph, tmp / "g", blocks=(8, 8), permutation="random")
    nnz = read_shard_manifest(shards).meta["num_edges"]
    torch.set_num_threads(1)  # as each rank of the world runs
    rates = measure_local_rates()
    print(
        f"R-MAT scale {args.scale}: {graph.num_nodes:,} nodes, {nnz:,} nonzeros of A-hat; "
        f"one thread: GEMM {rates['gemm_tflops'] * 1e3:.1f} GFLOP/s, SpMM "
        f"{rates['spmm_gflops']:.2f} GFLOP/s, stream {rates['mem_gbps']:.1f} GB/s"
    )
    sizes = [1 << 14, 1 << 18, 1 << 21]  # probe buffers: 16 KB, 256 KB, 2 MB
    res = run_distributed(
        _worker, 8, str(shards), dims, args.steps, args.rounds, sizes, timeout=1800
    )[0]
    table = {
        "schema": 1,
        "world_size": 8,
        "ranks_per_node": 8,
        "backend": "gloo",
        "grid": {"data": 1, "x": 2, "y": 2, "z": 2},
        "entries": res["entries"],
    }
    bw_path = OUT / "planner_bandwidth.json"
    bw_path.write_text(json.dumps(table, indent=1))
    machine = dataclasses.replace(local_machine("gloo"), **rates)
    machine = machine.with_table(load_bandwidth_table(bw_path))

    gcn_problem = GCNProblem.from_widths(graph.num_nodes, nnz, dims, element_size=4)
    sizes = {k: v for k, v in GPT.items() if k != "batch_size"}
    gpt_problem = GPTProblem(GPTConfig(**sizes), batch=GPT["batch_size"], element_size=4)
    gcn = _compare(
        "GCN epoch",
        rank_gcn(gcn_problem, 8, machine),
        {k: min(v) for k, v in res["gcn"].items()},
        lambda c: c.total_bytes,
    )
    gpt = _compare(
        "GPT step",
        rank_gpt(gpt_problem, 8, machine),
        {k: min(v) for k, v in res["gpt"].items()},
        lambda c: c.total_bytes,
    )
    for r in (gcn, gpt):
        print(f"\n{r['workload']} at 8 ranks ({r['shapes']} shapes), predicted order")
        print(
            f"    {'shape':<16}{'predicted ms':>13}{'compute':>9}{'comm':>8}{'measured ms':>13}"
            f"{'meas. rank':>11}"
        )
        order = sorted(r["rows"], key=lambda row: row["measured_s"])
        for row in r["rows"]:
            print(
                f"    {row['label']:<16}{row['predicted_s'] * 1e3:>13.1f}"
                f"{row['predicted_compute_s'] * 1e3:>9.1f}{row['predicted_comm_s'] * 1e3:>8.1f}"
                f"{row['measured_s'] * 1e3:>13.1f}{order.index(row) + 1:>11}"
            )
        print(
            f"    Spearman(predicted, measured) = {r['spearman_time_model']:.3f} "
            f"(bytes-only ranking: {r['spearman_bytes_only']:.3f}); measured best "
            f"{r['measured_best']} is predicted #{r['measured_best_predicted_rank']} -> in top 3: "
            f"{r['measured_best_in_predicted_top3']}; predicted best is measured "
            f"#{r['predicted_best_measured_rank']}"
        )
        if r["mirror_spread"]:
            print(
                f"    noise floor: shapes that differ only by x<->y (equal in the model) "
                f"measured {r['mirror_spread']:.2f}x apart (median)"
            )
    png = OUT / "planner.png"
    _plot([gcn, gpt], png)
    doc = {
        "machine": {
            "platform": platform.platform(),
            "cores": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "rates_one_thread": rates,
        "bandwidth_table": str(bw_path.relative_to(ROOT)),
        "gcn": {
            "graph_scale": args.scale,
            "nodes": graph.num_nodes,
            "nnz": nnz,
            "dims": dims,
            **gcn,
        },
        "gpt": {"sizes": GPT, **gpt},
        "raw_times": {"gcn": res["gcn"], "gpt": res["gpt"]},
        "seconds": time.perf_counter() - t0,
    }
    (OUT / "planner.json").write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {OUT / 'planner.json'} and {png} in {doc['seconds']:.0f}s")


if __name__ == "__main__":
    main()
