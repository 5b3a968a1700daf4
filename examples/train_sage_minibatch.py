"""Train GraphSAGE with sampled mini-batches, in one process or on N data-parallel ranks.

    python examples/train_sage_minibatch.py --dataset citeseer --root ../shared/datasets \\
        --dataset-options normalize_features=true
    python examples/train_sage_minibatch.py --dataset citeseer --root ../shared/datasets \\
        --dataset-options normalize_features=true --nprocs 4 --batch-size 32 --feature-cache 64
    python examples/train_sage_minibatch.py --dataset sbm --fanouts 15,10 --model gat

(The documentation tests run these with ``--epochs 2``.)

One process samples the whole graph. With ``--nprocs N`` rank 0 cuts the graph into N METIS
parts (a partition folder, written once), every rank loads only its own part, samples
across parts and fetches remote features with all-to-alls, and the gradients are summed
with one all-reduce per step. ``--batch-size`` is the global batch: each rank trains the
seeds of every global batch that it owns, so N ranks train what one process trains.
Sampling and feature gathering of the next batch run in a background thread while the
current batch trains. The same recipe, with checkpoints and metrics files, is ``gnnpar train
sage``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import gnnpar
from gnnpar import comm
from gnnpar.data.options import add_dataset_options, check_dataset, split_options
from gnnpar.launch import launch_local, strip_nprocs, under_launcher
from gnnpar.models.minibatch.model import BlockGNN
from gnnpar.sampling import (
    DistNeighborSampler,
    FeatureFetcher,
    LocalPart,
    NeighborSampler,
    NodeLoader,
    distributed_inference,
    layerwise_inference,
    parse_fanouts,
)
from gnnpar.shard import shard


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="sbm", help="catalogue name or folder")
    p.add_argument("--root", default=None, help="dataset root (CiteSeer: ../shared/datasets)")
    add_dataset_options(p)
    p.add_argument("--nprocs", type=int, default=1, help="data-parallel processes (one part each)")
    p.add_argument("--parts-dir", default="runs/sage-example/parts", help="partition folder")
    p.add_argument("--fanouts", default="10,10", help="neighbours per hop, seeds' hop first")
    p.add_argument("--batch-size", type=int, default=32, help="seeds per global batch")
    p.add_argument("--model", default="sage", choices=["sage", "gcn", "gat"])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--feature-cache", type=int, default=0, help="remote rows cached per rank")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_graph(args: argparse.Namespace):
    from gnnpar.data import load

    options = check_dataset(args.dataset, split_options(args.dataset_options))
    return load(args.dataset, root=args.root, **options)


def setup_single(args: argparse.Namespace, fanouts: list[int]):
    graph = load_graph(args)
    sampler = NeighborSampler(graph, fanouts, seed=args.seed)
    loader = NodeLoader(sampler, graph.train_mask, args.batch_size, seed=args.seed,
                        features=graph.feat, labels=graph.label)  # fmt: skip
    evaluate = lambda model: _accuracy(  # noqa: E731
        layerwise_inference(model, graph).argmax(1), graph.label, graph.ndata, None
    )
    return loader, graph.feat.shape[1], graph.num_classes, evaluate, None


def setup_parts(args: argparse.Namespace, fanouts: list[int], grid: gnnpar.ProcessGrid):
    import partitioners

    folder = Path(args.parts_dir) / f"{args.dataset}-{grid.world_size}"
    if grid.global_rank == 0 and not (folder / "manifest.json").is_file():
        graph = load_graph(args)
        owner = partitioners.partition(graph, grid.world_size, "metis", balance=["nodes", "train"])
        partitioners.write(graph, owner, folder, halo=1)
    comm.barrier(grid)
    part = LocalPart.load(folder, grid.rank("data"))
    # the loader's thread gets process groups of its own (collectives never interleave)
    loader_grid = gnnpar.init(backend="gloo")
    sampler = DistNeighborSampler(part, fanouts, loader_grid, seed=args.seed)
    fetcher = FeatureFetcher(part, loader_grid, cache_size=args.feature_cache)
    owned = torch.nonzero(part.ndata["train_mask"], as_tuple=True)[0]
    keys = part.orig_ids[owned]  # every rank knows every seed's original id: global batches
    all_keys = comm.all_gather(keys, grid, "data", sizes=comm.gather_sizes(len(keys), grid, "data"))
    labels = part.ndata["label"]
    loader = NodeLoader(
        sampler, part.start + owned, args.batch_size, seed=args.seed, keys=keys,
        all_keys=all_keys, features=fetcher.fetch, labels=lambda ids: labels[ids - part.start],
    )  # fmt: skip
    classes = torch.tensor([int(labels.max()) + 1])
    comm.all_reduce(classes, grid, "data", op="max")
    evaluate = lambda model: _accuracy(  # noqa: E731
        distributed_inference(model, part, part.ndata["feat"], grid).argmax(1),
        labels,
        part.ndata,
        grid,
    )
    return loader, part.ndata["feat"].shape[1], int(classes), evaluate, fetcher


def _accuracy(pred, label, ndata, grid) -> dict[str, float]:
    counts = torch.zeros(6, dtype=torch.float64)
    for i, name in enumerate(("train", "val", "test")):
        mask = ndata[f"{name}_mask"].to(torch.bool)
        counts[2 * i : 2 * i + 2] = torch.tensor(
            [float((pred[mask] == label[mask]).sum()), float(mask.sum())]
        )
    if grid is not None:
        comm.all_reduce(counts, grid, "data")
    return {
        n: float(counts[2 * i] / counts[2 * i + 1].clamp(min=1))
        for i, n in enumerate(("train", "val", "test"))
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.nprocs > 1 and not under_launcher():
        here = str(Path(__file__).resolve().parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [here, *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        return launch_local(args.nprocs, strip_nprocs(argv), module=Path(__file__).stem)
    grid = gnnpar.init(backend="gloo")  # sampling and training on the CPU
    rank0 = grid.global_rank == 0
    fanouts = parse_fanouts(args.fanouts)
    if grid.world_size == 1:
        loader, in_dim, classes, evaluate, fetcher = setup_single(args, fanouts)
    else:
        loader, in_dim, classes, evaluate, fetcher = setup_parts(args, fanouts, grid)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = BlockGNN(in_dim, args.hidden, classes, len(fanouts), args.dropout, args.model)
    dp = shard(model, grid, stage=0)  # gradients averaged over the data axis during backward
    opt = dp.attach(torch.optim.Adam(dp.parameters(), lr=args.lr, weight_decay=args.weight_decay))

    for epoch in range(args.epochs):
        model.train()
        start, seen = time.perf_counter(), 0
        bar = tqdm(loader, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False, disable=not rank0)
        for batch in bar:  # batch i + 1 is sampled and gathered while batch i trains
            logits = model(batch.blocks, batch.x, dropout_seed=epoch * 100_003 + batch.index)
            loss = F.cross_entropy(logits, batch.y, reduction="sum")
            # the gradients are averaged over the ranks: scale the summed loss so that the
            # result is the gradient of the mean loss over the global batch
            (loss * grid.world_size / batch.global_size).backward()
            opt.step()
            opt.zero_grad()
            seen += batch.num_seeds
            bar.set_postfix(loss=f"{loss.item() / max(batch.num_seeds, 1):.3f}")
        rate = seen / (time.perf_counter() - start)
        acc = evaluate(model)
        if rank0:
            cache = f", cache hit rate {fetcher.hit_rate():.2f}" if fetcher else ""
            print(f"epoch {epoch + 1:3d}: {rate:8,.0f} seeds/s, train {acc['train']:.3f}, "
                  f"val {acc['val']:.3f}, test {acc['test']:.3f}{cache}", flush=True)  # fmt: skip
    gnnpar.shutdown(grid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
