"""Full-graph GCN training on a 3D process grid, in one readable file.

Copy it and edit it. It does what ``gnnpar train gcn`` does, without the trainer's
checkpoints and metrics files:

    python examples/train_gcn_fullgraph.py --nprocs 4 --grid x=1,y=2,z=2
    python examples/train_gcn_fullgraph.py --dataset citeseer --root ../shared/datasets \\
        --dataset-options normalize_features=true --nprocs 4
    torchrun --nproc-per-node 4 examples/train_gcn_fullgraph.py --algorithm 2d

(The documentation tests run these with ``--epochs 2``.)

1. rank 0 cuts the graph into shards on disk (once); every rank reads only its blocks;
2. a plain GCN is built and sharded over the grid from outside;
3. full-graph epochs with Adam; accuracy every 10 epochs, computed on sharded logits.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import gnnpar
from gnnpar import comm
from gnnpar.data.options import add_dataset_options, check_dataset, split_options
from gnnpar.grid import parse_grid_spec
from gnnpar.launch import launch_local, strip_nprocs, under_launcher
from gnnpar.models.fullgraph import parallelize_fullgraph
from gnnpar.models.fullgraph.model import GCN
from gnnpar.models.fullgraph.planning import choose_fullgraph_grid
from gnnpar.models.fullgraph.shards import DiskSource, prepare_shards
from gnnpar.verified import MANIFEST


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="sbm")
    p.add_argument("--root", default=None, help="dataset root (default: datasets/)")
    add_dataset_options(p)
    p.add_argument("--grid", default=None, help="x=2,y=2,z=2 (default: planner)")
    p.add_argument("--algorithm", default="3d", choices=["3d", "2d", "1d"])
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--shards", default="runs/example-shards")
    p.add_argument("--nprocs", type=int, default=1)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.nprocs > 1 and not under_launcher():
        # Start N local processes through torch.distributed.run, running this same file.
        sys.exit(launch_local(args.nprocs, strip_nprocs(sys.argv[1:]), script=__file__))

    world = gnnpar.init()
    shards = Path(args.shards) / args.dataset.replace("/", "_")
    if world.global_rank == 0 and not (shards / MANIFEST).exists():
        from gnnpar.data import load

        options = check_dataset(args.dataset, split_options(args.dataset_options))
        prepare_shards(load(args.dataset, root=args.root, **options), shards, norm="gcn")
    comm.barrier(world)
    source = DiskSource(shards)

    dims = [source.feat_dim, args.hidden, source.num_classes]
    shape = parse_grid_spec(args.grid) if args.grid else None
    if shape is None:  # a grid for the chosen algorithm (2D: x*y, 1D: x)
        shape = choose_fullgraph_grid(
            world.world_size, source.num_nodes, dims, algorithm=args.algorithm
        )
    grid = gnnpar.init(**shape)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = parallelize_fullgraph(GCN(*dims), grid, source, algorithm=args.algorithm)
    x = model.input_features()  # this rank's block of the features
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=5e-4)

    main_rank = grid.global_rank == 0
    if main_rank:
        print(f"{grid.describe()}, {args.algorithm}, {source.num_nodes:,} nodes")
    for epoch in range(args.epochs):
        start = time.perf_counter()
        model.train()
        optimizer.zero_grad()
        loss = model.loss(model(x, dropout_seed=epoch), "train_mask")
        loss.backward()
        optimizer.step()
        if (epoch + 1) % 10 == 0:
            model.eval()
            with torch.no_grad():
                logits = model(x)
            acc = {m: model.accuracy(logits, f"{m}_mask") for m in ("val", "test")}
            if main_rank:
                print(
                    f"epoch {epoch + 1:4d}  loss {loss.item():.4f}  val {acc['val']:.4f}  "
                    f"test {acc['test']:.4f}  {time.perf_counter() - start:.3f}s/epoch"
                )
    gnnpar.shutdown(grid)


if __name__ == "__main__":
    main()
