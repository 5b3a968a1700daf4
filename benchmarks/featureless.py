"""Full-graph R-GCN with learnt rows for the featureless types, beside zero rows and DGL 1.1.3.

**Graph.** ``mag-synth`` (ogbn-mag's schema; :func:`benchmarks.rgcn.build_graph`): 10,000
papers, 5,000 authors, 200 institutions, 400 fields of study (``--quick``: a fifth), 8
classes, 64 paper features (the other types have none), homophily 0.5, seed 0; 7 relations.

**Three full-graph trainings**, one thread each, 2 layers of 64, Adam (lr 0.01, no weight
decay), no dropout, every epoch one step on the whole graph:

- ``zero``: gnnpar's full-graph R-GCN (``gnnpar train gcn --model rgcn``'s model,
  :func:`~gnnpar.models.fullgraph.parallelize_fullgraph` on one rank) on the padded
  features, the featureless types' rows zero;
- ``learn``: the same with ``--featureless learn`` (a learnt 64-row per featureless node,
  :mod:`gnnpar.models.fullgraph.embedding`);
- ``dgl``: DGL's ``examples/pytorch/rgcn-hetero/entity_classify.py`` path on the whole
  heterograph (``RelGraphEmbed`` tables for the featureless types, a projection of the paper
  features, ``HeteroGraphConv`` of ``GraphConv(norm="right")`` per relation with a weight
  per relation, self loop and bias: :class:`benchmarks.rgcn.DGLRGCN`), plus its classifier.

The models differ in shape (ours maps the 64 input columns straight to 64 hidden, then the
classes, in its two layers; DGL's projects every type to 64 first and classifies after its
two layers), so the figures compare what a user of each trains, not one function.

**Measured**: the median epoch time (forward, backward, Adam step; epochs after the first
5), 5 interleaved rounds (zero, learn, dgl in turn), with the spread; the test accuracy after
``--epochs`` (default 60) epochs of the last round; the process's peak RSS growth per side.

Run::

    python benchmarks/featureless.py           # about 2-4 minutes on 2 shared cores
    python benchmarks/featureless.py --quick   # a fifth of the graph, 3 rounds

Writes ``benchmarks/out/featureless.json`` and prints a table.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and dgl are imported

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import gnnpar  # noqa: E402
from benchmarks.rgcn import DGLRGCN, HIDDEN, LAYERS, LR, build_graph  # noqa: E402
from gnnpar.models.fullgraph import RGCN, parallelize_fullgraph  # noqa: E402
from gnnpar.models.fullgraph.relations import relation_memory_source  # noqa: E402
from gnnpar.sparse.source import make_permutations  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
SIZES = {"num_papers": 10_000, "num_authors": 5_000, "num_institutions": 200,
         "num_fields": 400}  # fmt: skip
SKIP = 5  # epochs left out of the median (warm-up)


def _ours(data: dict, learn: bool, epochs: int, seed: int) -> dict[str, Any]:
    """gnnpar's full-graph R-GCN on one rank: epoch times and the final test accuracy."""
    g = data["graph"]
    grid = gnnpar.init()
    try:
        perms = make_permutations("random", g.indptr, g.indices, seed)
        source = relation_memory_source(g, perms)
        torch.manual_seed(seed)
        model = RGCN(g.feat.shape[1], HIDDEN, g.num_classes, g.types.num_relations, dropout=0.0)
        par = parallelize_fullgraph(model, grid, source)
        if learn:
            par.learn_featureless(seed)
        x = par.input_features()
        opt = torch.optim.Adam(par.parameters(), lr=LR)
        times = []
        for _ in range(epochs):
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            par.loss(par(x), "train_mask").backward()
            opt.step()
            times.append(time.perf_counter() - t)
        par.eval()
        with torch.no_grad():
            acc = par.accuracy(par(x), "test_mask")
        return {"epoch_s": times, "test_acc": acc}
    finally:
        gnnpar.release(grid)


def _dgl(data: dict, epochs: int, seed: int) -> dict[str, Any]:
    """DGL's full-graph entity classification: epoch times and the final test accuracy."""
    hg, feats, target = data["dgl_graph"], data["feats"], data["target"]
    labels, split = data["labels"], data["split"]
    torch.manual_seed(seed)
    model = DGLRGCN(data)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    nodes = {t: torch.arange(hg.num_nodes(t)) for t in hg.ntypes}
    train = split["train"]
    times = []
    for _ in range(epochs):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        h = model.inputs(nodes, feats)
        for layer in model.layers:
            h = layer(hg, h)
        logits = model.classifier(h[target])
        F.cross_entropy(logits[train], labels[train]).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    pred = model.full(hg, feats)[target].argmax(1)
    test = split["test"]
    return {"epoch_s": times, "test_acc": float((pred[test] == labels[test]).float().mean())}


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fifth of the graph, 3 rounds")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--epochs", type=int, default=60, help="epochs per training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=str(OUT / "featureless.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sizes = {k: v // 5 for k, v in SIZES.items()} if args.quick else SIZES
    rounds = 3 if args.quick else args.rounds
    data = build_graph({**sizes, "homophily": 0.5, "feat_dim": 64}, args.seed)
    g = data["graph"]
    sides = {"zero": lambda: _ours(data, False, args.epochs, args.seed),
             "learn": lambda: _ours(data, True, args.epochs, args.seed),
             "dgl": lambda: _dgl(data, args.epochs, args.seed)}  # fmt: skip
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for r in range(rounds):
        for name, run in sides.items():
            before = _peak_rss_mb()
            out = run()
            out["rss_growth_mb"] = _peak_rss_mb() - before
            runs[name].append(out)
            med = statistics.median(out["epoch_s"][SKIP:])
            print(f"round {r + 1}: {name:5s} epoch {med * 1e3:7.1f} ms  "
                  f"test acc {out['test_acc']:.4f}", flush=True)  # fmt: skip
    summary = {}
    for name, rs in runs.items():
        meds = [statistics.median(o["epoch_s"][SKIP:]) for o in rs]
        summary[name] = {
            "epoch_ms": statistics.median(meds) * 1e3,
            "spread_ms": [min(meds) * 1e3, max(meds) * 1e3],
            "test_acc": rs[-1]["test_acc"],
            "rss_growth_mb": max(o["rss_growth_mb"] for o in rs),
        }
    base = summary["zero"]["epoch_ms"]
    sizes_line = f"mag-synth {g.num_nodes:,} nodes, {g.num_edges:,} edges"
    print(f"\n{sizes_line}, {g.types.num_relations} relations; {args.epochs} epochs, "
          f"{rounds} rounds, 1 thread")  # fmt: skip
    print("| side | epoch ms (median, spread) | vs zero | vs dgl | test acc |")
    print("|---|---|---|---|---|")
    for name, s in summary.items():
        lo, hi = s["spread_ms"]
        print(f"| {name} | {s['epoch_ms']:.1f} ({lo:.1f}-{hi:.1f}) | "
              f"{s['epoch_ms'] / base:.2f}x | {s['epoch_ms'] / summary['dgl']['epoch_ms']:.2f}x | "
              f"{s['test_acc']:.4f} |")  # fmt: skip
    result = {"sizes": sizes, "nodes": g.num_nodes, "edges": g.num_edges, "epochs": args.epochs,
              "rounds": rounds, "summary": summary, "hidden": HIDDEN, "layers": LAYERS,
              "load": os.getloadavg()}  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
