"""Full-graph GCN benchmark: ours beside PyG, and 1D / 2D / 3D at 8 ranks.

On an R-MAT graph (default scale 18: 262,144 nodes, >= 4M edges; 128 features; 3 layers of
width 128), in one run:

(a) epoch time (forward, backward, Adam step) of ours on one rank beside a PyG ``GCNConv``
    model on the same data and weights;
(b) bytes per epoch of the 1D, 2D and 3D algorithms at 8 ranks, measured by gnnpar's comm
    accounting, beside the analytic model (:mod:`gnnpar.plan` for 3D, each algorithm's
    formulas for 1D and 2D);
(c) nnz imbalance (max/mean nonzeros per rank) of the 3D layout at 8 ranks without
    permutation, with Plexus's random double permutation and with the balanced one;
(d) epoch time of every x·y·z grid shape at 8 ranks (for checking the planner).

Run::

    python benchmarks/fullgraph.py              # full run (several minutes on 2 cores)
    python benchmarks/fullgraph.py --scale 14   # smaller
    python benchmarks/fullgraph.py --quick      # scale 12, one timed epoch (a smoke run)

Writes ``benchmarks/out/fullgraph.json`` and prints the tables with ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"


def _model(dims: list[int], seed: int = 0):
    from gnnpar.nn.gcn import FullGraphGNN

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


def single_rank_vs_pyg(shards: str, graph, dims: list[int], epochs: int) -> dict:
    """(a): ours on one rank beside PyG GCNConv, same weights, same data."""
    import torch_geometric.nn as pygnn

    import gnnpar
    from gnnpar.sparse import parallelize_fullgraph
    from gnnpar.sparse.shards import DiskSource

    grid = gnnpar.init()
    model = _model(dims)
    ours = parallelize_fullgraph(model, grid, DiskSource(shards))
    x = ours.input_features()
    opt = torch.optim.Adam(ours.parameters(), lr=0.01)

    def ours_step():
        opt.zero_grad()
        loss = ours.loss(ours(x), "train_mask")
        loss.backward()
        opt.step()

    class PyG(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = torch.nn.ModuleList(
                pygnn.GCNConv(dims[i], dims[i + 1], cached=True) for i in range(len(dims) - 1)
            )

        def forward(self, x, edge_index):
            for i, conv in enumerate(self.convs):
                x = conv(x, edge_index)
                if i < len(self.convs) - 1:
                    x = torch.relu(x)
            return x

    pyg = PyG()
    with torch.no_grad():
        for conv, layer in zip(pyg.convs, model.layers, strict=True):
            conv.lin.weight.copy_(layer.weight.T)
            conv.bias.copy_(layer.bias)
    src, dst = graph.edges()
    edge_index = torch.stack([src, dst])
    feat, label, mask = graph.feat, graph.label, graph.train_mask
    popt = torch.optim.Adam(pyg.parameters(), lr=0.01)

    def pyg_step():
        popt.zero_grad()
        out = pyg(feat, edge_index)
        loss = torch.nn.functional.cross_entropy(out[mask], label[mask])
        loss.backward()
        popt.step()

    # Same loss at the start: the comparison is between equal computations.
    with torch.no_grad():
        l_ours = ours.loss(ours(x), "train_mask").item()
        out = pyg(feat, edge_index)
        l_pyg = torch.nn.functional.cross_entropy(out[mask], label[mask]).item()
    t_ours, t_pyg = [], []
    for _ in range(2):  # interleave, best of both rounds
        t_ours.append(_time_epochs(ours_step, epochs))
        t_pyg.append(_time_epochs(pyg_step, epochs))
    return {
        "ours_s": min(t_ours),
        "pyg_s": min(t_pyg),
        "ratio": min(t_ours) / min(t_pyg),
        "initial_loss_ours": l_ours,
        "initial_loss_pyg": l_pyg,
    }


def _eight_rank_worker(shards: str, dims: list[int], epochs: int, shapes: list, algos: list):
    """Runs on every rank of an 8-rank world: bytes per algorithm and time per 3D shape."""
    import gnnpar
    from gnnpar import comm
    from gnnpar.plan import fullgraph_epoch_bytes
    from gnnpar.sparse import parallelize_fullgraph
    from gnnpar.sparse.shards import DiskSource

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
    parser.add_argument("--scale", type=int, default=18)
    parser.add_argument("--edge-factor", type=int, default=16)
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=str(OUT / "fullgraph.json"))
    parser.add_argument("--quick", action="store_true", help="R-MAT scale 12, one timed epoch")
    args = parser.parse_args()
    if args.quick:
        args.scale, args.epochs = 12, 1

    from gnnpar.data import rmat
    from gnnpar.grid import factorizations
    from gnnpar.sparse.shards import prepare_shards
    from gnnpar.testing import run_distributed

    t0 = time.perf_counter()
    graph = rmat(scale=args.scale, edge_factor=args.edge_factor, feat_dim=args.features)
    dims = [args.features, 128, 128, int(graph.num_classes)]
    print(
        f"R-MAT scale {args.scale}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges "
        f"({time.perf_counter() - t0:.1f}s); dims {dims}"
    )
    tmp = Path(tempfile.mkdtemp(prefix="gnnpar-bench-"))
    shards = {}
    for perm in ("none", "random", "balanced"):
        t = time.perf_counter()
        shards[perm] = str(prepare_shards(graph, tmp / perm, blocks=(8, 8), permutation=perm))
        print(f"shards ({perm} permutation) in {time.perf_counter() - t:.1f}s")

    torch.set_num_threads(os.cpu_count() or 1)
    a = single_rank_vs_pyg(shards["random"], graph, dims, args.epochs)
    print("\n(a) one rank, epoch time (forward + backward + Adam), best of runs")
    print(
        f"    ours {a['ours_s']:.3f}s   PyG GCNConv {a['pyg_s']:.3f}s   "
        f"ratio {a['ratio']:.2f}x (target <= 1.0)   "
        f"initial losses {a['initial_loss_ours']:.5f} / {a['initial_loss_pyg']:.5f}"
    )

    shapes = [{"x": x, "y": y, "z": z} for d, x, y, z in factorizations(8) if d == 1]
    algos = [("1d", {"x": 8}), ("2d", {"x": 2, "y": 4}), ("3d", {"x": 2, "y": 2, "z": 2})]
    res = run_distributed(
        _eight_rank_worker, 8, shards["random"], dims, 1, shapes, algos, timeout=3600
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

    print("\n(d) epoch time per 3D grid shape at 8 ranks (random permutation)")
    for key, secs in sorted(res["times"].items(), key=lambda kv: kv[1]):
        print(f"    {key:<14} {secs:8.3f}s   nnz imbalance {imbalance(res['nnz'][key]):.3f}")

    print("\n(c) nnz imbalance (max/mean over ranks) of the 3D layout at 8 ranks")
    imb = {}
    for perm in ("none", "random", "balanced"):
        out = run_distributed(
            _eight_rank_worker,
            8,
            shards[perm],
            dims,
            0,
            [{"x": 2, "y": 2, "z": 2}],
            [],
            timeout=3600,
        )[0]
        imb[perm] = imbalance(out["nnz"]["x=2,y=2,z=2"])
        print(f"    {perm:<9} {imb[perm]:.3f}")

    doc = {
        "machine": {"platform": platform.platform(), "cores": os.cpu_count()},
        "graph": {"scale": args.scale, "nodes": graph.num_nodes, "edges": graph.num_edges},
        "dims": dims,
        "single_rank_vs_pyg": a,
        "eight_ranks": res,
        "imbalance_3d_2x2x2": imb,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
