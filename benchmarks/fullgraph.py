"""Full-graph GCN benchmark: ours beside PyG, the local SpMM kernels, 1 and 2 ranks, and
1D / 2D / 3D at 8 ranks.

On R-MAT graphs (128 features; 3 layers of width 128), in one run:

(a) for each ``--single-scales`` graph (default 16 and 18), one-rank epoch time (forward,
    backward, Adam step) on **one thread** of ours, with shards of every permutation
    (``none``, ``random``, ``balanced``, ``balanced-local``), beside a PyG ``GCNConv`` model
    fed ``edge_index`` and one fed a sparse CSR ``adj_t`` (PyG's fastest CPU path without
    torch-sparse): same weights, same initial loss; each a median of 5 interleaved runs,
    with the spread (min-max) and the load average;
(l) the float32 SpMM alone (forward and transposed) on each permutation's whole Â, CPU time
    of one thread (medians of 5 interleaved): what the locality order buys;
(k) the local SpMM variants on that graph's whole Â (forward and transposed, widths 16 and
    128, float32 / bfloat16 / float64): time of each, the fastest, and the layers' pick
    (their autotune chooses among the dtype's bit-identical variants);
(2) the 2-rank epoch (one thread per rank) of every 2-rank shape beside the 1-rank epoch,
    ``balanced-local`` shards, in 5 interleaved rounds of a fresh 1-rank world then a fresh
    2-rank world (ratio per round: median and spread); two shapes also over plain gloo, with
    the same-host shared-memory transport (:mod:`gnnpar.shm`) off;
(b) bytes per epoch of the 1D, 2D and 3D algorithms at 8 ranks (``--scale``, default 18),
    measured by gnnpar's comm accounting, beside the analytic model (:mod:`gnnpar.plan` for
    3D, each algorithm's formulas for 1D and 2D);
(c) nnz imbalance (max/mean nonzeros per rank) of the 3D layout at 8 ranks for each
    permutation;
(d) epoch time of every x·y·z grid shape at 8 ranks (for checking the planner).

Run::

    python benchmarks/fullgraph.py              # full run (tens of minutes on 2 cores)
    python benchmarks/fullgraph.py --scale 14 --single-scales 14
    python benchmarks/fullgraph.py --quick      # scale 12, 3 runs each (a smoke run)
    python benchmarks/fullgraph.py --two-ranks-only --no-eight-ranks   # (2) alone

Writes ``benchmarks/out/fullgraph.json`` and prints the tables with ratios.
"""

from __future__ import annotations

import argparse
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
PERMUTATIONS = ("none", "random", "balanced", "balanced-local")


def _model(dims: list[int], seed: int = 0):
    from gnnpar.models.fullgraph.model import FullGraphGNN

    torch.manual_seed(seed)
    return FullGraphGNN(dims[0], dims[1], dims[-1], len(dims) - 1, dropout=0.0)


def _time_epochs(step, epochs: int) -> float:
    step()  # warm-up (kernel choice, allocator)
    best = float("inf")
    for _ in range(epochs):
        t = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t)
    return best


def _summary(times: list[float]) -> dict:
    """Median and spread of repeated timings."""
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "all": times}


def _spread(d: dict) -> str:
    return f"{d['median']:.3f}s ({d['min']:.3f}-{d['max']:.3f})"


def _interleaved(steps: dict, reps: int) -> dict[str, dict]:
    """Each step once as a warm-up, then ``reps`` rounds running every step once in turn."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: _summary(t) for name, t in times.items()}


def _pyg_model(dims: list[int], model):
    """PyG GCNConv layers carrying ``model``'s weights."""
    import torch_geometric.nn as pygnn

    class PyG(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = torch.nn.ModuleList(
                pygnn.GCNConv(dims[i], dims[i + 1], cached=True) for i in range(len(dims) - 1)
            )

        def forward(self, x, adj):
            for i, conv in enumerate(self.convs):
                x = conv(x, adj)
                if i < len(self.convs) - 1:
                    x = torch.relu(x)
            return x

    pyg = PyG()
    with torch.no_grad():
        for conv, layer in zip(pyg.convs, model.layers, strict=True):
            conv.lin.weight.copy_(layer.weight.T)
            conv.bias.copy_(layer.bias)
    return pyg


def one_rank_vs_pyg(shards: dict[str, str], graph, dims: list[int], reps: int) -> dict:
    """(a): one thread; ours on every permutation's shards beside PyG with ``edge_index`` and
    with a sparse CSR ``adj_t``, same weights and data, interleaved run by run."""
    import warnings

    import torch.nn.functional as F

    import gnnpar
    from gnnpar.models.fullgraph import parallelize_fullgraph
    from gnnpar.models.fullgraph.shards import DiskSource

    torch.set_num_threads(1)
    grid = gnnpar.init()
    steps, losses = {}, {}
    for perm, folder in shards.items():
        ours = parallelize_fullgraph(_model(dims), grid, DiskSource(folder))
        x = ours.input_features()
        opt = torch.optim.Adam(ours.parameters(), lr=0.01)

        def ours_step(ours=ours, x=x, opt=opt):
            opt.zero_grad()
            ours.loss(ours(x), "train_mask").backward()
            opt.step()

        with torch.no_grad():
            losses[f"ours {perm}"] = ours.loss(ours(x), "train_mask").item()
        steps[f"ours {perm}"] = ours_step
    src, dst = graph.edges()
    n = graph.num_nodes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "sparse CSR is beta"
        adj_t = torch.sparse_csr_tensor(
            graph.indptr, graph.indices, torch.ones(graph.indices.numel()), (n, n)
        )
    feat, label, mask = graph.feat, graph.label, graph.train_mask
    for name, adj in (("pyg edge_index", torch.stack([src, dst])), ("pyg sparse CSR", adj_t)):
        pyg = _pyg_model(dims, _model(dims))
        popt = torch.optim.Adam(pyg.parameters(), lr=0.01)

        def pyg_step(pyg=pyg, adj=adj, popt=popt):
            popt.zero_grad()
            F.cross_entropy(pyg(feat, adj)[mask], label[mask]).backward()
            popt.step()

        with torch.no_grad():
            losses[name] = F.cross_entropy(pyg(feat, adj)[mask], label[mask]).item()
        steps[name] = pyg_step
    load_before = os.getloadavg()
    times = _interleaved(steps, reps)
    ratios = {
        f"{k} / {peer}": times[k]["median"] / times[peer]["median"]
        for k in steps
        if k.startswith("ours")
        for peer in ("pyg edge_index", "pyg sparse CSR")
    }
    if "ours none" in times:
        for perm in ("random", "balanced", "balanced-local"):
            if f"ours {perm}" in times:
                ratios[f"{perm} / none"] = (
                    times[f"ours {perm}"]["median"] / times["ours none"]["median"]
                )
    return {
        "threads": 1,
        "reps": reps,
        "epoch_s": times,
        "ratios": ratios,
        "initial_loss": losses,
        "load_average": [load_before, os.getloadavg()],
    }


def kernel_table(folder: str, dtypes: list[torch.dtype], widths=(16, 128)) -> list[dict]:
    """(k): every local SpMM variant on the whole Â of a one-rank layout (order 0, as the
    first layer reads it), forward and transposed: the autotune's timings and pick."""
    from gnnpar.models.fullgraph.shards import DiskSource
    from gnnpar.sparse.kernels import EXACT_GROUPS, VARIANTS, LocalSpMM

    torch.set_num_threads(1)
    src = DiskSource(folder)
    n = src.num_nodes
    rows = []
    for dtype in dtypes:
        block = src.adjacency(0, (0, n), (0, n)).to(dtype=dtype)
        op = LocalSpMM(block, variants=tuple(VARIANTS))  # time them all
        for direction, target in (("A @ H", op), ("Aᵀ @ G", op.T)):
            for width in widths:
                target.mm(torch.randn(n, width).to(dtype))
                timing = target.timings[(width, dtype)]
                rows.append(
                    {
                        "dtype": str(dtype).replace("torch.", ""),
                        "product": direction,
                        "width": width,
                        "ms": {k: 1e3 * v for k, v in timing.items()},
                        "fastest": target.choices[(width, dtype)],
                        # what the layers' autotune picks: the fastest bit-identical one
                        "pick": min(EXACT_GROUPS[dtype], key=lambda v: timing.get(v, 1e9)),
                    }
                )
    return rows


def spmm_by_permutation(shards: dict[str, str], reps: int, width: int = 128) -> dict:
    """(l): the float32 SpMM alone (forward and transposed, the ``bag`` kernel) on the whole
    Â of each permutation's shards, CPU time of one thread, interleaved: what locality buys
    without the epoch's other work."""
    from gnnpar.models.fullgraph.shards import DiskSource
    from gnnpar.sparse.kernels import LocalSpMM

    torch.set_num_threads(1)
    ops = {}
    for perm, folder in shards.items():
        src = DiskSource(folder)
        n = src.num_nodes
        ops[perm] = LocalSpMM(src.adjacency(0, (0, n), (0, n)), variants=("bag",))
    h = torch.randn(n, width)
    times: dict[str, list[float]] = {perm: [] for perm in ops}
    for op in ops.values():  # warm-up
        op.mm(h)
        op.T.mm(h)
    for _ in range(reps):
        for perm, op in ops.items():
            start = time.thread_time()
            op.mm(h)
            op.T.mm(h)
            times[perm].append(time.thread_time() - start)
    out = {perm: _summary(t) for perm, t in times.items()}
    base = out["none"]["median"] if "none" in out else float("nan")
    return {"cpu_s": out, "ratio_to_none": {p: v["median"] / base for p, v in out.items()}}


def _two_rank_worker(folder: str, dims: list[int], epochs: int, shapes: list) -> dict:
    """Runs on every rank of a world of 1 or 2 (one thread each): after a warm-up epoch,
    the median of ``epochs`` timed epochs of each shape."""
    import gnnpar
    from gnnpar import comm
    from gnnpar.models.fullgraph import parallelize_fullgraph
    from gnnpar.models.fullgraph.shards import DiskSource

    torch.set_num_threads(1)
    source = DiskSource(folder)
    out = {}
    for algo, shape, chunks, transport in shapes:
        # The same-host transport is on by default; "gloo" rows turn it off for comparison.
        os.environ["GNNPAR_SHM"] = "0" if transport == "gloo" else "1"
        grid = gnnpar.init(**shape)
        par = parallelize_fullgraph(
            _model(dims), grid, source, algorithm=algo, overlap_chunks=chunks
        )
        x = par.input_features()
        opt = torch.optim.Adam(par.parameters(), lr=0.01)

        def step(par=par, x=x, opt=opt, grid=grid):
            opt.zero_grad()
            par.loss(par(x), "train_mask").backward()
            opt.step()
            comm.barrier(grid)

        step()
        times = []
        for _ in range(epochs):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        key = f"{algo} " + ",".join(f"{k}={v}" for k, v in shape.items()) if shape else "1 rank"
        key += f" overlap {chunks}" if chunks > 1 else ""
        out[key + (" gloo" if transport == "gloo" else "")] = statistics.median(times)
        gnnpar.release(grid)
    return out


def two_ranks(folder: str, dims: list[int], reps: int) -> dict:
    """(2): every 2-rank shape (one thread per rank) beside one rank, interleaved: each of
    ``reps`` rounds runs a fresh 1-rank world, then a fresh 2-rank world with every shape;
    each value is the median of 2 epochs after a warm-up. Ratios are taken per round, and
    their median and spread reported. Two shapes also run with the same-host shared-memory
    transport off (plain gloo)."""
    from gnnpar.testing import run_distributed

    shapes = [
        ("3d", {"x": 2}, 1, "shm"),
        ("3d", {"y": 2}, 1, "shm"),
        ("3d", {"z": 2}, 1, "shm"),
        ("3d", {"x": 2}, 4, "shm"),
        ("1d", {"x": 2}, 1, "shm"),
        ("3d", {"x": 2}, 1, "gloo"),
        ("3d", {"z": 2}, 1, "gloo"),
    ]
    load = os.getloadavg()
    one, two = [], []
    for _ in range(reps):
        one.append(run_distributed(_two_rank_worker, 1, folder, dims, 2, [("3d", {}, 1, "shm")],
                                   timeout=3600)[0]["1 rank"])  # fmt: skip
        two.append(run_distributed(_two_rank_worker, 2, folder, dims, 2, shapes,
                                   timeout=3600)[0])  # fmt: skip
    res = {k: _summary([t[k] for t in two]) for k in two[0]}
    ratios = {k: _summary([t[k] / o for t, o in zip(two, one, strict=True)]) for k in two[0]}
    best = min(ratios, key=lambda k: ratios[k]["median"])
    return {
        "shapes": res,
        "one_rank": _summary(one),
        "ratio_to_one_rank": {k: v["median"] for k, v in ratios.items()},
        "ratio_spread": ratios,
        "best": best,
        "best_ratio": ratios[best]["median"],
        "best_ratio_range": [ratios[best]["min"], ratios[best]["max"]],
        "load_average": [load, os.getloadavg()],
    }


def _print_two_ranks(two: dict, reps: int) -> None:
    print(f"(2) 2 ranks vs 1, one thread each, balanced-local, {reps} interleaved rounds: "
          "epoch median (min-max), ratio to 1 rank per round: median (min-max)")  # fmt: skip
    print(f"    {'1 rank':<22} {_spread(two['one_rank'])}")
    for name, t in two["shapes"].items():
        r = two["ratio_spread"][name]
        print(f"    {name:<22} {_spread(t)}   {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})")
    lo, hi = two["best_ratio_range"]
    print(
        f"    best {two['best']}: {two['best_ratio']:.2f}x the 1-rank epoch "
        f"(spread {lo:.2f}-{hi:.2f}); load average {two['load_average']}",
        flush=True,
    )


def single_scale(scale: int, args, tmp: Path, graph=None) -> tuple[dict, dict, object]:
    """(a), (k) and (2) at one R-MAT scale; returns the results, the shard folders and the
    graph."""
    from gnnpar.data import rmat
    from gnnpar.models.fullgraph.shards import prepare_shards

    if graph is None:
        graph = rmat(scale=scale, edge_factor=args.edge_factor, feat_dim=args.features)
    dims = [args.features, 128, 128, int(graph.num_classes)]
    print(f"\nR-MAT scale {scale}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges")
    shards = {}
    for perm in ("balanced-local",) if args.two_ranks_only else PERMUTATIONS:
        t = time.perf_counter()
        folder = tmp / f"s{scale}-{perm}"
        shards[perm] = str(prepare_shards(graph, folder, blocks=(8, 8), permutation=perm))
        print(f"  shards ({perm} permutation) in {time.perf_counter() - t:.1f}s", flush=True)
    if args.two_ranks_only:
        two = two_ranks(shards["balanced-local"], dims, args.reps)
        _print_two_ranks(two, args.reps)
        return {"two_ranks": two}, shards, graph
    a = one_rank_vs_pyg(shards, graph, dims, args.reps)
    print(f"(a) one rank, one thread, epoch time: median of {args.reps} interleaved (min-max)")
    for name, t in a["epoch_s"].items():
        print(f"    {name:<22} {_spread(t)}   initial loss {a['initial_loss'][name]:.6f}")
    for name, r in a["ratios"].items():
        print(f"    {name:<40} {r:.2f}x")
    print(f"    load average before/after: {a['load_average']}", flush=True)
    loc = spmm_by_permutation(shards, args.reps)
    print(f"(l) float32 SpMM, forward + transposed, width 128, CPU seconds (median of {args.reps})")
    for perm, t in loc["cpu_s"].items():
        print(f"    {perm:<15} {_spread(t)}   {loc['ratio_to_none'][perm]:.2f}x none's")
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float64] if scale <= 16 else [])
    k = kernel_table(shards["balanced-local"], dtypes)
    print("(k) local SpMM on the whole Â (balanced-local), ms per product; fastest of all, and "
          "the layers' pick (the fastest of the dtype's bit-identical group)")  # fmt: skip
    for row in k:
        times = "  ".join(f"{n} {ms:.1f}" for n, ms in row["ms"].items())
        print(f"    {row['dtype']:<8} {row['product']:<7} width {row['width']:>3}: {times}"
              f"   fastest {row['fastest']}, pick {row['pick']}")  # fmt: skip
    two = two_ranks(shards["balanced-local"], dims, args.reps)
    _print_two_ranks(two, args.reps)
    return {"pyg": a, "spmm_by_permutation": loc, "kernels": k, "two_ranks": two}, shards, graph


def _eight_rank_worker(shards: str, dims: list[int], epochs: int, shapes: list, algos: list):
    """Runs on every rank of an 8-rank world: bytes per algorithm and time per 3D shape."""
    import gnnpar
    from gnnpar import comm
    from gnnpar.models.fullgraph import parallelize_fullgraph
    from gnnpar.models.fullgraph.planning import fullgraph_epoch_bytes
    from gnnpar.models.fullgraph.shards import DiskSource

    source = DiskSource(shards)
    result: dict = {"bytes": {}, "times": {}, "nnz": {}}
    for algo, shape in algos:
        grid = gnnpar.init(**shape)
        par = parallelize_fullgraph(_model(dims), grid, source, algorithm=algo)
        x = par.input_features()
        with comm.record(grid) as traffic:
            par(x).sum().backward()
        measured = traffic.bytes()
        if algo == "3d":
            analytic = sum(fullgraph_epoch_bytes(shape, source.num_nodes, dims).values())
        else:
            want = par.expected_bytes()
            analytic = sum(sum(v.values()) for v in want.values())
        result["bytes"][algo] = {"shape": shape, "measured": measured, "analytic": analytic}
        gnnpar.release(grid)
    for shape in shapes:
        grid = gnnpar.init(**shape)
        par = parallelize_fullgraph(_model(dims), grid, source)
        x = par.input_features()
        opt = torch.optim.Adam(par.parameters(), lr=0.01)

        def step(par=par, x=x, opt=opt, grid=grid):
            opt.zero_grad()
            par.loss(par(x), "train_mask").backward()
            opt.step()
            comm.barrier(grid)

        key = "x={x},y={y},z={z}".format(**shape)
        result["times"][key] = _time_epochs(step, epochs)
        nnz = torch.tensor([float(par.shard_numel()["adjacency_nnz"])])
        result["nnz"][key] = comm.all_gather(nnz, grid, "world").tolist()
        gnnpar.release(grid)
    return result


def imbalance(values: list[float]) -> float:
    """max / mean."""
    return max(values) / (sum(values) / len(values))


def main() -> None:
    """Run every part and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=int, default=18, help="R-MAT scale of the 8-rank parts")
    parser.add_argument(
        "--single-scales", default="16,18", help="R-MAT scales of the 1- and 2-rank parts"
    )
    parser.add_argument("--edge-factor", type=int, default=16)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5, help="interleaved runs (median kept)")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per 8-rank shape")
    parser.add_argument("--no-eight-ranks", action="store_true", help="skip (b), (c) and (d)")
    parser.add_argument("--json", default=str(OUT / "fullgraph.json"), help="JSON file to write")
    parser.add_argument("--quick", action="store_true", help="R-MAT scale 12, 3 runs each")
    parser.add_argument(
        "--two-ranks-only", action="store_true", help="of the single-scale parts, only (2)"
    )
    args = parser.parse_args()
    if args.quick:
        args.scale, args.single_scales, args.epochs, args.reps = 12, "12", 1, 3

    from gnnpar.data import rmat
    from gnnpar.grid import factorizations
    from gnnpar.models.fullgraph.shards import prepare_shards
    from gnnpar.testing import run_distributed

    tmp = Path(tempfile.mkdtemp(prefix="gnnpar-bench-"))
    doc: dict = {
        "machine": {"platform": platform.platform(), "cores": os.cpu_count()},
        "torch": torch.__version__,
        "single": {},
    }
    shards, graph = {}, None
    for scale in [int(s) for s in args.single_scales.split(",") if s.strip()]:
        doc["single"][scale], shards, graph = single_scale(scale, args, tmp)
        if scale != args.scale:
            graph = None
    if args.no_eight_ranks:
        _write(doc, args.json)
        return

    if graph is None:
        graph = rmat(scale=args.scale, edge_factor=args.edge_factor, feat_dim=args.features)
        shards = {
            perm: str(prepare_shards(graph, tmp / f"s{args.scale}-{perm}", permutation=perm))
            for perm in PERMUTATIONS
        }
    dims = [args.features, 128, 128, int(graph.num_classes)]
    print(f"\nR-MAT scale {args.scale} at 8 ranks: dims {dims}")
    shapes = [{"x": x, "y": y, "z": z} for d, x, y, z in factorizations(8) if d == 1]
    algos = [("1d", {"x": 8}), ("2d", {"x": 2, "y": 4}), ("3d", {"x": 2, "y": 2, "z": 2})]
    res = run_distributed(
        _eight_rank_worker, 8, shards["random"], dims, args.epochs, shapes, algos, timeout=3600
    )[0]
    print("\n(b) bytes per epoch at 8 ranks (rank 0), measured vs analytic")
    for algo, r in res["bytes"].items():
        dev = r["measured"] / r["analytic"] - 1 if r["analytic"] else 0.0
        print(
            f"    {algo}  {r['shape']}  measured {r['measured'] / 1e6:9.2f} MB   "
            f"analytic {r['analytic'] / 1e6:9.2f} MB   deviation {100 * dev:+.2f}%"
        )
    b1, b3 = res["bytes"]["1d"]["measured"], res["bytes"]["3d"]["measured"]
    print(f"    3D / 1D bytes: {b3 / b1:.3f} (target < 1)")

    print("\n(d) epoch time per 3D grid shape at 8 ranks (random permutation), best of runs")
    for key, secs in sorted(res["times"].items(), key=lambda kv: kv[1]):
        print(f"    {key:<14} {secs:8.3f}s   nnz imbalance {imbalance(res['nnz'][key]):.3f}")

    print("\n(c) nnz imbalance (max/mean over ranks) of the 3D layout at 8 ranks")
    imb = {}
    for perm in PERMUTATIONS:
        out = run_distributed(
            _eight_rank_worker, 8, shards[perm], dims, 0, [{"x": 2, "y": 2, "z": 2}], [],
            timeout=3600,
        )[0]  # fmt: skip
        imb[perm] = imbalance(out["nnz"]["x=2,y=2,z=2"])
        print(f"    {perm:<15} {imb[perm]:.3f}")
    doc["graph"] = {"scale": args.scale, "nodes": graph.num_nodes, "edges": graph.num_edges}
    doc["dims"] = dims
    doc["eight_ranks"] = res
    doc["imbalance_3d_2x2x2"] = imb
    _write(doc, args.json)


def _write(doc: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(out).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
