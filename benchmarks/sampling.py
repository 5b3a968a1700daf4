"""Mini-batch sampling benchmark: our sampler and loader beside DGL 1.1.3's.

Part 1, sampling throughput: a uniform random graph of 200,000 nodes and 4,000,000 edges,
two-layer fan-outs 15 and 10, batches of 1,024 seeds over every node, shuffled. DGL runs
``dgl.dataloading.NeighborSampler`` + ``DataLoader`` (``num_workers=0``); we run
``NeighborSampler`` + ``NodeLoader`` (``prefetch=0``; the compiled backend when numba is
installed, as the ``bench`` extra does, else the tensor one: the printout says which).
Both on one thread (``OMP_NUM_THREADS`` and torch's intra-op threads set to 1 before
anything is imported). DGL lists fan-outs input layer first and we list them in hop order,
so DGL's ``[15, 10]`` is our ``[10, 15]`` (the seeds get 10 neighbours, those get 15); both
orders are measured. Ours and DGL's runs alternate (5 of each by default) and the median is
kept, with the spread (min-max) and the load average: the machine is shared. Throughput is
given per second of wall time and per second of the thread's CPU time (which leaves out the
time other jobs hold the core).

Part 2, one epoch of GraphSAGE training (2 layers, 128 -> 256 -> 16, mean aggregation,
Adam) on the same graph with 128 random features, over 20,000 training seeds, same
fan-outs: ours (``BlockGNN``, with and without the prefetch thread) beside DGL's
``dgl.nn.SAGEConv`` fed by its ``DataLoader``. Same interleaving, medians and spread.

Part 3, traffic of distributed training: 4 ranks (one METIS part each) train one epoch of
GraphSAGE on an R-MAT graph (scale 15, 128 features) with remote-feature caches of
different sizes; it reports bytes per epoch (sampling rounds, feature fetches, gradient
all-reduce, as :mod:`gnnpar.comm` counts them) and the cache hit rate.

Run::

    python benchmarks/sampling.py            # a few minutes on 2 cores
    python benchmarks/sampling.py --quick    # fewer batches and repetitions

Writes ``benchmarks/out/sampling.json`` and prints the tables with ratios.
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
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from gnnpar.graph import Graph  # noqa: E402
from gnnpar.models.minibatch.model import BlockGNN  # noqa: E402
from gnnpar.sampling import NeighborSampler, NodeLoader, compiled  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
NUM_NODES, NUM_EDGES, BATCH = 200_000, 4_000_000, 1024
FEAT, HIDDEN, CLASSES, TRAIN = 128, 256, 16, 20_000


def random_graph(seed: int = 0) -> tuple[Graph, torch.Tensor, torch.Tensor]:
    """The uniform random graph, with its COO edges for DGL."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, NUM_NODES, (NUM_EDGES,), generator=g)
    dst = torch.randint(0, NUM_NODES, (NUM_EDGES,), generator=g)
    feat = torch.randn(NUM_NODES, FEAT, generator=g)
    label = torch.randint(0, CLASSES, (NUM_NODES,), generator=g)
    graph = Graph.from_edges(src, dst, NUM_NODES, ndata={"feat": feat, "label": label})
    return graph, src, dst


def _dgl():
    warnings.filterwarnings("ignore")
    import dgl

    return dgl


# ------------------------------------------------------------------------------ part 1
def _rates(batches: Any, count: Any, limit: int) -> tuple[float, float]:
    """Seeds per second of wall time and of this thread's CPU time over ``limit`` batches.
    CPU time leaves out the time other jobs of the shared machine hold the core."""
    wall, cpu = time.perf_counter(), time.thread_time()
    seeds = 0
    for i, batch in enumerate(batches):
        seeds += count(batch)
        if i + 1 == limit:
            break
    return seeds / (time.perf_counter() - wall), seeds / (time.thread_time() - cpu)


def _ours_sampling(graph: Graph, hops: list[int], batches: int, rep: int) -> tuple[float, float]:
    sampler = NeighborSampler(graph, hops)
    loader = NodeLoader(sampler, torch.arange(NUM_NODES), BATCH, prefetch=0, seed=rep)
    return _rates(loader, lambda b: b.num_seeds, batches)


def _dgl_sampling(dgl_graph: Any, layers: list[int], batches: int, rep: int) -> tuple[float, float]:
    dgl = _dgl()
    sampler = dgl.dataloading.NeighborSampler(layers)
    torch.manual_seed(rep)
    loader = dgl.dataloading.DataLoader(
        dgl_graph, torch.arange(NUM_NODES), sampler, batch_size=BATCH, shuffle=True,
        drop_last=False, num_workers=0,
    )  # fmt: skip
    return _rates(loader, lambda b: b[1].numel(), batches)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_sampling(graph: Graph, dgl_graph: Any, batches: int, reps: int) -> list[dict]:
    rows = []
    for dgl_layers in ([15, 10], [10, 15]):
        hops = dgl_layers[::-1]
        _ours_sampling(graph, hops, 3, 99)  # warm-up (DGL builds its CSC here too)
        _dgl_sampling(dgl_graph, dgl_layers, 3, 99)
        ours, dgl = [], []
        load = os.getloadavg()
        for rep in range(reps):
            ours.append(_ours_sampling(graph, hops, batches, rep))
            dgl.append(_dgl_sampling(dgl_graph, dgl_layers, batches, rep))
        wall_o, wall_d = (_spread([r[0] for r in x]) for x in (ours, dgl))
        cpu_o, cpu_d = (_spread([r[1] for r in x]) for x in (ours, dgl))
        row = {
            "dgl_fanouts_input_first": dgl_layers,
            "our_fanouts_hop_order": hops,
            "ours_seeds_per_s": wall_o,
            "dgl_seeds_per_s": wall_d,
            "ratio": wall_o["median"] / wall_d["median"],
            "ratio_range": [wall_o["min"] / wall_d["max"], wall_o["max"] / wall_d["min"]],
            "ours_seeds_per_cpu_s": cpu_o,
            "dgl_seeds_per_cpu_s": cpu_d,
            "cpu_ratio": cpu_o["median"] / cpu_d["median"],
            "cpu_ratio_range": [cpu_o["min"] / cpu_d["max"], cpu_o["max"] / cpu_d["min"]],
            "ours_all": ours,
            "dgl_all": dgl,
            "load_average": [load, os.getloadavg()],
        }
        rows.append(row)
        print(
            f"  DGL {dgl_layers} / ours {hops}: ours {wall_o['median']:,.0f} seeds/s, DGL "
            f"{wall_d['median']:,.0f} seeds/s, ratio {row['ratio']:.2f}x "
            f"({row['ratio_range'][0]:.2f}-{row['ratio_range'][1]:.2f}); per CPU second: "
            f"{cpu_o['median']:,.0f} vs {cpu_d['median']:,.0f}, {row['cpu_ratio']:.2f}x "
            f"({row['cpu_ratio_range'][0]:.2f}-{row['cpu_ratio_range'][1]:.2f}); "
            f"load {row['load_average'][0][0]:.1f}",
            flush=True,
        )
    return rows


# ------------------------------------------------------------------------------ part 2
def _ours_epoch(graph: Graph, train: torch.Tensor, hops: list[int], prefetch: int) -> float:
    torch.manual_seed(0)
    model = BlockGNN(FEAT, HIDDEN, CLASSES, num_layers=2, dropout=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=0.003)
    loader = NodeLoader(
        NeighborSampler(graph, hops), train, BATCH, features=graph.feat, labels=graph.label,
        prefetch=prefetch, prepare=model.prepare,  # as the sage task: operators built ahead
    )  # fmt: skip
    start = time.perf_counter()
    for batch in loader:
        loss = F.cross_entropy(model(batch.blocks, batch.x), batch.y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def _dgl_epoch(graph: Graph, dgl_graph: Any, train: torch.Tensor, layers: list[int]) -> float:
    dgl = _dgl()
    from dgl.nn import SAGEConv

    class SAGE(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                [SAGEConv(FEAT, HIDDEN, "mean"), SAGEConv(HIDDEN, CLASSES, "mean")]
            )

        def forward(self, blocks: list, x: torch.Tensor) -> torch.Tensor:
            h = x
            for i, (layer, block) in enumerate(zip(self.layers, blocks, strict=True)):
                h = layer(block, h)
                if i == 0:
                    h = torch.relu(h)
            return h

    torch.manual_seed(0)
    model = SAGE()
    opt = torch.optim.Adam(model.parameters(), lr=0.003)
    loader = dgl.dataloading.DataLoader(
        dgl_graph, train, dgl.dataloading.NeighborSampler(layers), batch_size=BATCH,
        shuffle=True, num_workers=0,
    )  # fmt: skip
    start = time.perf_counter()
    for input_nodes, output_nodes, blocks in loader:
        x = graph.feat.index_select(0, input_nodes)
        y = graph.label.index_select(0, output_nodes)
        loss = F.cross_entropy(model(blocks, x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return time.perf_counter() - start


def bench_training(graph: Graph, dgl_graph: Any, reps: int, train_size: int) -> dict:
    train = torch.randperm(NUM_NODES, generator=torch.Generator().manual_seed(1))[:train_size]
    dgl_layers, hops = [15, 10], [10, 15]
    times: dict[str, list[float]] = {"ours": [], "ours_prefetch": [], "dgl": []}
    for _ in range(reps):
        times["ours"].append(_ours_epoch(graph, train, hops, prefetch=0))
        times["dgl"].append(_dgl_epoch(graph, dgl_graph, train, dgl_layers))
        times["ours_prefetch"].append(_ours_epoch(graph, train, hops, prefetch=1))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "train_seeds": train_size,
        "model": f"GraphSAGE-mean {FEAT}-{HIDDEN}-{CLASSES}, Adam",
        "epoch_s": med,
        "spread_s": {k: [min(v), max(v)] for k, v in times.items()},
        "all_s": times,
        "ratio_ours_vs_dgl": med["dgl"] / med["ours"],
        "ratio_prefetch_vs_dgl": med["dgl"] / med["ours_prefetch"],
    }
    print(
        f"  epoch of {train_size:,} seeds (medians): ours {med['ours']:.2f} s, ours+prefetch "
        f"{med['ours_prefetch']:.2f} s, DGL {med['dgl']:.2f} s "
        f"(speed ratio {result['ratio_ours_vs_dgl']:.2f}x, "
        f"{result['ratio_prefetch_vs_dgl']:.2f}x with prefetch)",
        flush=True,
    )
    return result


# ------------------------------------------------------------------------------ part 3
def _traffic_rank(folder: str, caches: list[int], scale: int) -> list[dict]:
    from gnnpar import comm
    from gnnpar.models.minibatch.task import MiniBatchConfig
    from gnnpar.train.config import from_mapping
    from gnnpar.train.spec import build_task

    rows = []
    for cache in caches:
        cfg = from_mapping(
            MiniBatchConfig,
            {
                "dataset": "rmat",
                "dataset_options": f"scale={scale},feat_dim={FEAT},num_classes={CLASSES}",
                "fanouts": "10,15",
                "batch_size": 256,
                "hidden": HIDDEN,
                "epochs": 1,
                "out": folder,
                "partitions": f"{folder}/parts",
                "feature_cache": cache,
                "quiet": True,
                "prefetch": 0,
            },
        )
        task = build_task("sage", cfg)
        with comm.record(task.grid) as traffic:
            record = task.train_step(0)
        rows.append(
            {
                "cache_rows_per_rank": cache,
                "sample_bytes": record["sample_bytes"],
                "feature_bytes": record["feature_bytes"],
                "gradient_bytes": traffic.bytes(kind="all_reduce"),
                "cache_hit_rate": record["cache_hit_rate"],
                "cache_fill_bytes": task.fetcher.cache_bytes,
                "batches": record["batches"],
            }
        )
    return rows


def bench_traffic(caches: list[int], scale: int) -> list[dict]:
    from gnnpar.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        per_rank = run_distributed(_traffic_rank, 4, tmp, caches, scale, timeout=1800)
    rows = []
    for i, cache in enumerate(caches):
        r = per_rank[0][i]  # sample and feature bytes are summed over ranks already
        grad = sum(rank[i]["gradient_bytes"] for rank in per_rank)
        fill = sum(rank[i]["cache_fill_bytes"] for rank in per_rank)
        total = r["sample_bytes"] + r["feature_bytes"] + grad
        rows.append({**r, "gradient_bytes": grad, "cache_fill_bytes": fill, "total_bytes": total})
        print(
            f"  cache {cache:>6} rows/rank: sampling {r['sample_bytes'] / 1e6:7.2f} MB, "
            f"features {r['feature_bytes'] / 1e6:8.2f} MB, gradients {grad / 1e6:6.2f} MB, "
            f"hit rate {r['cache_hit_rate']:.3f}",
            flush=True,
        )
    return rows


# ------------------------------------------------------------------------------ report
def markdown(result: dict) -> str:
    lines = [
        "| fan-outs: DGL (input layer first) / ours (hop order) | ours seeds/s | DGL seeds/s "
        "| ratio (spread) | ours seeds/CPU-s | DGL seeds/CPU-s | CPU ratio (spread) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["sampling"]:
        lo, hi = r["ratio_range"]
        clo, chi = r["cpu_ratio_range"]
        lines.append(
            f"| {r['dgl_fanouts_input_first']} / {r['our_fanouts_hop_order']} | "
            f"{r['ours_seeds_per_s']['median']:,.0f} | {r['dgl_seeds_per_s']['median']:,.0f} | "
            f"{r['ratio']:.2f}x ({lo:.2f}-{hi:.2f}) | "
            f"{r['ours_seeds_per_cpu_s']['median']:,.0f} | "
            f"{r['dgl_seeds_per_cpu_s']['median']:,.0f} | "
            f"{r['cpu_ratio']:.2f}x ({clo:.2f}-{chi:.2f}) |"
        )
    lines.append(f"\nmedians of {result['reps']} interleaved runs; load average at the start: "
                 f"{result['sampling'][0]['load_average'][0][0]:.1f}")  # fmt: skip
    t = result["training"]
    lines += ["", "| one epoch of GraphSAGE (median) | seconds | speed vs DGL |", "|---|---:|---:|"]
    lines.append(f"| DGL 1.1.3 | {t['epoch_s']['dgl']:.2f} | 1.00x |")
    lines.append(f"| ours | {t['epoch_s']['ours']:.2f} | {t['ratio_ours_vs_dgl']:.2f}x |")
    lines.append(
        f"| ours, prefetch thread | {t['epoch_s']['ours_prefetch']:.2f} | "
        f"{t['ratio_prefetch_vs_dgl']:.2f}x |"
    )
    if result.get("traffic"):
        lines += ["", "| feature cache (rows/rank) | sampling MB | features MB | gradients MB | "
                  "total MB | hit rate |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in result["traffic"]:
            lines.append(
                f"| {r['cache_rows_per_rank']:,} | {r['sample_bytes'] / 1e6:.2f} | "
                f"{r['feature_bytes'] / 1e6:.2f} | {r['gradient_bytes'] / 1e6:.2f} | "
                f"{r['total_bytes'] / 1e6:.2f} | {r['cache_hit_rate']:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer batches and repetitions")
    p.add_argument("--reps", type=int, default=None, help="interleaved runs (median is kept)")
    p.add_argument("--no-traffic", action="store_true", help="skip the distributed part")
    p.add_argument("--json", default=str(OUT / "sampling.json"), help="JSON file to write")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    reps = args.reps or (3 if args.quick else 5)
    batches = 15 if args.quick else 40
    dgl = _dgl()
    print(f"building a random graph: {NUM_NODES:,} nodes, {NUM_EDGES:,} edges", flush=True)
    graph, src, dst = random_graph()
    dgl_graph = dgl.graph((src, dst), num_nodes=NUM_NODES)
    result: dict[str, Any] = {
        "graph": {"nodes": NUM_NODES, "edges": NUM_EDGES, "kind": "uniform random"},
        "batch_size": BATCH,
        "threads": 1,
        "reps": reps,
        "batches_per_rep": batches,
        "versions": {
            "torch": torch.__version__,
            "dgl": dgl.__version__,
            "python": platform.python_version(),
        },  # fmt: skip
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
    }
    backend = "numba" if compiled.available() else "torch"
    result["sampler_backend"] = backend
    print(f"sampling throughput (median of {reps}, interleaved; our backend: {backend}):",
          flush=True)  # fmt: skip
    result["sampling"] = bench_sampling(graph, dgl_graph, batches, reps)
    print("training epoch:", flush=True)
    result["training"] = bench_training(graph, dgl_graph, reps, 5_000 if args.quick else TRAIN)
    if not args.no_traffic:
        print("distributed training traffic, 4 ranks, one epoch:", flush=True)
        scale = 13 if args.quick else 15
        caches = [0, 1_000, 4_000] if args.quick else [0, 2_000, 8_000]
        result["traffic_graph"] = f"rmat scale {scale}, {FEAT} features, METIS, 4 parts"
        result["traffic"] = bench_traffic(caches, scale)
    result["target"] = {
        "need": 1.0,
        "aim": 1.5,
        "wall_ratios": [r["ratio"] for r in result["sampling"]],  # of medians
        "cpu_ratios": [r["cpu_ratio"] for r in result["sampling"]],
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    print()
    print(markdown(result))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
