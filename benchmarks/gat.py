"""Full-graph GAT: one rank's epoch beside PyG's ``GATConv``, and bytes of 3D vs 1D at 8 ranks.

On an R-MAT graph (scale 16: 65,536 nodes; 128 random features, 16 classes) a two-layer
GAT (8 heads × 8 hidden concatenated, one averaged output head; no dropout, so both
compute the same function) is built once; PyG's ``GATConv`` stack gets the same weights.
Both start from the same loss (checked), then one training epoch (forward, loss, backward)
is timed for each, median of ``--reps`` rounds that run both in turn (one thread by
default): gnnpar's is what ``gnnpar train gcn --model gat``
runs on one rank (:class:`gnnpar.models.fullgraph.gat.Parallel3DGAT` on a 1 × 1 × 1 grid).

The bytes per epoch of the GAT's layers on 8 ranks, summed over all ranks, come from the
layers' schedules (:func:`~gnnpar.models.fullgraph.gat.gat3d_layer_schedule` on x=2,y=2,z=2 and
:func:`~gnnpar.models.fullgraph.gat.gat1d_layer_schedule` on 8 rows; the tests hold measured traffic
against both). Prints a table and writes ``benchmarks/out/gat.json``::

    python benchmarks/gat.py             # scale 16
    python benchmarks/gat.py --quick     # scale 10, a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def _interleaved(steps: dict, reps: int) -> dict[str, list[float]]:
    """``reps`` rounds, each running every step once in turn (after one warm-up each)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, fn in steps.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def _pyg_stack(model):
    from torch_geometric.nn import GATConv

    convs = []
    for i, layer in enumerate(model.layers):
        conv = GATConv(model.dims[i], layer.head_dim, heads=layer.heads, concat=layer.concat)
        with torch.no_grad():
            conv.lin.weight.copy_(layer.weight.T)
            conv.att_src.copy_(layer.att_src[None])
            conv.att_dst.copy_(layer.att_dst[None])
            conv.bias.copy_(layer.bias)
        convs.append(conv)
    return torch.nn.ModuleList(convs)


def _bytes_8_ranks(n: int, dims: list[int], heads: list[int]) -> dict[str, float]:
    """Bytes per epoch of the layers (forward + backward) summed over the 8 ranks."""
    from gnnpar.comm import chunk_sizes
    from gnnpar.grid import GridShape
    from gnnpar.models.fullgraph.gat import gat1d_layer_schedule, gat3d_layer_schedule
    from gnnpar.models.fullgraph.layout import layout3d

    def head_dim(i):
        return dims[i + 1] // heads[i] if i < len(dims) - 2 else dims[-1]

    out = {"3d x=2,y=2,z=2": 0.0, "1d x=8": 0.0}
    for rank in range(8):
        g = GridShape(x=2, y=2, z=2, global_rank=rank)
        for i in range(len(dims) - 1):
            lay = layout3d(g, i, n, dims[i], dims[i + 1])
            steps = gat3d_layer_schedule(g, lay, heads[i], head_dim(i), dims[i + 1], i == 0, True)
            out["3d x=2,y=2,z=2"] += sum(s.nbytes(4) for s in steps)
            steps = gat1d_layer_schedule(
                "tensor", chunk_sizes(n, 8), dims[i], heads[i], head_dim(i), dims[i + 1], True, i
            )
            out["1d x=8"] += sum(s.nbytes(4) for s in steps)
    return out


def main() -> None:
    """Run the benchmark and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=int, default=16, help="R-MAT scale (2**scale nodes)")
    parser.add_argument("--reps", type=int, default=5, help="timed epochs per model")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--quick", action="store_true", help="scale 10, 2 reps (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.scale, args.reps = 10, 2
    torch.set_num_threads(args.threads)

    import gnnpar
    from gnnpar.data import rmat
    from gnnpar.models.fullgraph import parallelize_fullgraph
    from gnnpar.models.fullgraph.model import GAT
    from gnnpar.sparse import MemorySource

    graph = rmat(scale=args.scale, feat_dim=128, num_classes=16, seed=0)
    norm = graph.weighted_self_loops()  # GAT's "raw" adjacency A + I
    x, y = graph.ndata["feat"].float(), graph.ndata["label"]
    train = graph.ndata["train_mask"]
    torch.manual_seed(0)
    model = GAT(128, 64, 16, dropout=0.0, heads=8, attn_dropout=0.0)
    source = MemorySource(
        norm.indptr, norm.indices, norm.edge_weight.float(), x,
        {"label": y, "train_mask": train}, norm="raw",
    )  # fmt: skip
    grid = gnnpar.init()
    par = parallelize_fullgraph(model, grid, source)
    feats = par.input_features()
    pyg = _pyg_stack(model)
    rows = graph.rows()
    edge_index = torch.stack([graph.indices, rows])  # (source, target)

    def ours():
        par.zero_grad(set_to_none=True)
        loss = par.loss(par(feats), "train_mask")
        loss.backward()
        return loss.detach()

    def theirs():
        pyg.zero_grad(set_to_none=True)
        h = F.elu(pyg[0](x, edge_index))
        loss = F.cross_entropy(pyg[1](h, edge_index)[train], y[train])
        loss.backward()
        return loss.detach()

    l_ours, l_theirs = float(ours()), float(theirs())
    if abs(l_ours - l_theirs) > 1e-4 * max(1.0, abs(l_theirs)):
        raise SystemExit(f"initial losses differ: gnnpar {l_ours} vs PyG {l_theirs}")
    times = _interleaved({"gnnpar": ours, "pyg": theirs}, args.reps)
    t_ours, t_theirs = (statistics.median(times[k]) for k in ("gnnpar", "pyg"))
    ratios = [a / b for a, b in zip(times["gnnpar"], times["pyg"], strict=True)]
    nbytes = _bytes_8_ranks(graph.num_nodes, model.dims, [8, 1])
    result = {
        "nodes": graph.num_nodes,
        "edges": graph.num_edges,
        "initial_loss": {"gnnpar": l_ours, "pyg": l_theirs},
        "epoch_seconds": {"gnnpar": t_ours, "pyg": t_theirs},
        "ratio": t_ours / t_theirs,
        "epoch_seconds_all": times,
        "ratio_per_round": ratios,
        "bytes_8_ranks": nbytes,
        "threads": args.threads,
    }
    sizes = f"{graph.num_nodes:,} nodes, {graph.num_edges:,} edges"
    print(f"## GAT, R-MAT scale {args.scale}: {sizes}, 128-64(8 heads)-16, float32, "
          f"{args.threads} threads\n")  # fmt: skip
    print(f"| | initial loss | epoch (s, median of {args.reps} interleaved; min-max) |")
    print("|---|---|---|")
    table = (("gnnpar", "gnnpar (1 rank)", l_ours), ("pyg", "PyG GATConv", l_theirs))
    for name, label, loss in table:
        t = times[name]
        print(f"| {label} | {loss:.6f} | {statistics.median(t):.3f} ({min(t):.3f}-{max(t):.3f}) |")
    print(f"\ngnnpar / PyG epoch time: {t_ours / t_theirs:.2f}x "
          f"(per round {min(ratios):.2f}-{max(ratios):.2f})\n")  # fmt: skip
    print("| 8 ranks | bytes per epoch (all ranks, layers) |")
    print("|---|---|")
    for k, v in nbytes.items():
        print(f"| {k} | {v / 1e6:,.1f} MB |")
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / "gat.json").write_text(json.dumps(result, indent=1))
    gnnpar.release(grid)


if __name__ == "__main__":
    main()
