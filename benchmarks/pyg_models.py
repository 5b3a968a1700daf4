"""Bring your own model: plain PyG models parallelized by gnnpar against the same models in PyG.

Three parts, each skippable:

- **speed** (one rank): each composed model of ``examples/pyg_models.py`` (GATv2 with
  residuals and LayerNorm, APPNP K=10, GCNII 16 layers, GIN with jumping knowledge) built
  twice with the same seed, on an R-MAT graph (scale 16: 65,536 nodes; 128 random features,
  16 classes); one training epoch (forward, loss, backward) of ``parallelize_pyg`` on a
  1 × 1 × 1 grid against the plain PyG model, given the graph as ``edge_index`` and, for
  the models whose convolutions take one, as PyG's sparse ``adj_t`` (torch's CSR tensor; the
  faster of the two is PyG's time). Both start from the same loss (checked); medians of
  ``--reps`` interleaved rounds, one torch thread by default.
- **bytes** (8 ranks, on the x=2, y=4 grid the planner picks, R-MAT scale ``--bytes-scale``):
  each model's measured bytes per epoch against its ops' schedule and, summed over the
  ranks, against :func:`aggregation_bytes` (written out here) for the models that only
  aggregate.
- **accuracy** (``--accuracy``): ``gnnpar train gcn --model examples/pyg_models.py:...`` on
  CiteSeer (the shared Planetoid files): APPNP and GCNII (64 layers, activation
  checkpointing), the test accuracy at the best validation accuracy.

Prints tables and writes ``benchmarks/out/pyg_models.json`` (the parts not run keep their
last figures)::

    python benchmarks/pyg_models.py                   # speed and bytes
    python benchmarks/pyg_models.py --accuracy        # and CiteSeer (about 35 minutes)
    python benchmarks/pyg_models.py --quick           # scale 10, 2 reps (a smoke run)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "examples" / "pyg_models.py"
#: The composed models: factory and options, and whether PyG takes their graph as adj_t.
MODELS = {
    "GATv2 + residual + LayerNorm": (
        "gatv2_residual", {"hidden": 64, "heads": 4, "layers": 3}, False
    ),
    "APPNP K=10": ("appnp", {"hidden": 64, "K": 10}, True),
    "GCNII 16 layers": ("gcnii", {"hidden": 64, "layers": 16}, True),
    "GIN + JK (cat)": ("gin_jk", {"hidden": 64, "layers": 3}, True),
}  # fmt: skip
#: The models' hyper-parameters for CiteSeer (the papers' where they fit one weight decay).
ACCURACY = {
    "APPNP": ("appnp", "K=10,alpha=0.1,hidden=64,dropout=0.5", "--epochs 300 --weight-decay 5e-4"),
    "GCNII 64 layers": (
        "gcnii",
        "layers=64,hidden=256,theta=0.6,alpha=0.1,dropout=0.6",
        "--epochs 400 --weight-decay 5e-4 --activation-checkpointing full",
    ),
}  # fmt: skip


def zoo():
    """examples/pyg_models.py, loaded as the command line loads it."""
    spec = importlib.util.spec_from_file_location("pyg_models", ZOO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _interleaved(steps: dict, reps: int) -> dict[str, list[float]]:
    """``reps`` rounds, each running every step once in turn (after one warm-up each)."""
    for fn in steps.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, fn in steps.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def _source(graph, x):
    from gnnpar.sparse import MemorySource, make_permutations

    raw = graph.weighted_self_loops()
    perms = make_permutations("symmetric", raw.indptr, raw.indices, 0)
    data = {"label": graph.ndata["label"], "train_mask": graph.ndata["train_mask"]}
    return MemorySource(raw.indptr, raw.indices, raw.edge_weight.float(), x, data, perms,
                        norm="raw")  # fmt: skip


def speed(scale: int, reps: int, only: str | None = None) -> dict:
    """One rank's epoch, gnnpar against PyG (see the module docstring)."""
    import gnnpar
    from gnnpar.data import rmat
    from gnnpar.models.fullgraph.pyg import parallelize_pyg

    graph = rmat(scale=scale, feat_dim=128, num_classes=16, seed=0)
    x, y = graph.ndata["feat"].float(), graph.ndata["label"]
    train = graph.ndata["train_mask"]
    src, dst = graph.edges()
    edge_index = torch.stack([src, dst])  # (source, target)
    n = graph.num_nodes
    pairs = torch.stack([dst, src])  # adj_t: (target, source)
    adj_t = torch.sparse_coo_tensor(pairs, torch.ones(graph.num_edges), (n, n)).to_sparse_csr()
    source = _source(graph, x)
    grid = gnnpar.init()
    z = zoo()
    out = {}
    for label, (factory, options, sparse) in MODELS.items():
        if only and only not in label:
            continue
        torch.manual_seed(0)
        mine = getattr(z, factory)(128, 16, dropout=0.0, **options)
        torch.manual_seed(0)
        theirs = getattr(z, factory)(128, 16, dropout=0.0, **options)
        par = parallelize_pyg(mine, grid, source)
        feats = par.input_features()

        def ours(par=par, feats=feats):
            par.zero_grad(set_to_none=True)
            loss = par.loss(par(feats), "train_mask")
            loss.backward()
            return loss.detach()

        def pyg(graph_arg, model=theirs):
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x, graph_arg)[train], y[train])
            loss.backward()
            return loss.detach()

        steps = {"gnnpar": ours, "pyg edge_index": lambda: pyg(edge_index)}
        if sparse:
            steps["pyg adj_t"] = lambda: pyg(adj_t)
        losses = {k: float(fn()) for k, fn in steps.items()}
        if any(abs(v - losses["gnnpar"]) > 1e-4 * max(1.0, abs(v)) for v in losses.values()):
            raise SystemExit(f"{label}: initial losses differ: {losses}")
        times = _interleaved(steps, reps)
        medians = {k: statistics.median(v) for k, v in times.items()}
        best = min((v, k) for k, v in medians.items() if k != "gnnpar")
        out[label] = {
            "initial_loss": losses,
            "epoch_seconds": medians,
            "epoch_seconds_all": times,
            "pyg_best": best[1],
            "ratio": medians["gnnpar"] / best[0],
        }
    gnnpar.release(grid)
    return {"nodes": n, "edges": graph.num_edges, "models": out}


def aggregation_bytes(n: int, x: int, yz: int, width: int, element_size: int = 4) -> float:
    """Written out: one ``Â·H`` of ``width`` features, forward and backward (its adjoints),
    summed over the ``x · yz`` ranks: each all-gathers its x chunk's rows over y·z (sub-chunks
    padded to the largest) and reduce-scatters its block's rows over x (padded likewise)."""
    from gnnpar.comm import chunk_sizes

    total = 0.0
    for cols in chunk_sizes(n, x):
        for c in range(yz):
            sub = max(chunk_sizes(cols, yz))
            rows = max(chunk_sizes(other, yz)[c] for other in chunk_sizes(n, x))
            gather = (yz - 1) * sub * width if yz > 1 else 0
            scatter = (x - 1) * rows * width if x > 1 else 0
            total += 2 * (gather + scatter) * element_size
    return float(total)


def _bytes_rank(scale: int) -> dict:
    import gnnpar
    from gnnpar import comm
    from gnnpar.data import rmat
    from gnnpar.models.fullgraph.pyg import parallelize_pyg

    graph = rmat(scale=scale, feat_dim=128, num_classes=16, seed=0)
    source = _source(graph, graph.ndata["feat"].float())
    grid = gnnpar.init(x=2, y=4)
    z = zoo()
    out = {}
    for label, (factory, options, _) in MODELS.items():
        torch.manual_seed(0)
        par = parallelize_pyg(getattr(z, factory)(128, 16, dropout=0.0, **options), grid, source)
        feats = par.input_features()
        with comm.record(grid) as forward:
            logits = par(feats)
        loss = par.loss(logits, "train_mask")  # its scalar all-reduces are not the model's
        with comm.record(grid) as backward:
            loss.backward()
        sched = par.expected_bytes()
        out[label] = {
            "measured": sum(forward.by_axis().values()) + sum(backward.by_axis().values()),
            "schedule": sum(sum(p.values()) for p in sched.values()),
        }
    gnnpar.release(grid)
    return out


def bytes_8(scale: int) -> dict:
    """Every model's bytes per epoch summed over 8 ranks: measured, schedule, formula."""
    from gnnpar.comm import ring_bytes
    from gnnpar.testing import run_distributed

    per_rank = run_distributed(_bytes_rank, 8, scale, timeout=1800)
    n = 1 << scale
    z = zoo()
    out = {}
    for label, (factory, options, _) in MODELS.items():
        entry = {k: sum(r[label][k] for r in per_rank) for k in ("measured", "schedule")}
        if factory == "appnp":
            numel = sum(p.numel() for p in getattr(z, factory)(128, 16, **options).parameters())
            formula = options["K"] * aggregation_bytes(n, 2, 4, 16)
            formula += 8 * ring_bytes("all_reduce", numel * 4, 8)
            entry["formula"] = formula
        out[label] = entry
    return out


def accuracy() -> dict:
    """CiteSeer test accuracy at the best validation accuracy, through the command line."""
    out = {}
    for label, (factory, options, flags) in ACCURACY.items():
        with tempfile.TemporaryDirectory() as tmp:
            argv = [sys.executable, "-m", "gnnpar.cli", "train", "gcn", "--dataset", "citeseer",
                    "--root", str(ROOT.parent / "shared" / "datasets"), "--dataset-options",
                    "normalize_features=true", "--model", f"{ZOO}:{factory}", "--model-options",
                    options, "--out", tmp, "--quiet", *flags.split()]  # fmt: skip
            t = time.perf_counter()
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
            lines = (Path(tmp) / "metrics.jsonl").read_text().splitlines()
            end = [json.loads(line) for line in lines if '"event": "end"' in line][-1]
            out[label] = {"test_acc": end["test_acc"], "val_acc": end["val_acc"],
                          "best_step": end["best_step"], "seconds": time.perf_counter() - t,
                          "options": options, "flags": flags}  # fmt: skip
    return out


def main() -> None:
    """Run the benchmark and print its tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=int, default=16, help="R-MAT scale of the speed part")
    parser.add_argument("--bytes-scale", type=int, default=12, help="R-MAT scale of the bytes")
    parser.add_argument("--reps", type=int, default=5, help="timed epochs per model")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--skip-speed", action="store_true", help="no speed part")
    parser.add_argument("--skip-bytes", action="store_true", help="no 8-rank bytes part")
    parser.add_argument("--accuracy", action="store_true", help="also train on CiteSeer")
    parser.add_argument("--only", help="the speed of the models whose name contains this")
    parser.add_argument("--quick", action="store_true", help="scale 10, 2 reps (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.scale, args.bytes_scale, args.reps = 10, 8, 2
    torch.set_num_threads(args.threads)
    result: dict = {"threads": args.threads}
    if not args.skip_speed:
        result["speed"] = s = speed(args.scale, args.reps, args.only)
        print(f"## One-rank epoch, R-MAT scale {args.scale}: {s['nodes']:,} nodes, "
              f"{s['edges']:,} edges, 128 features, 16 classes, float32, {args.threads} threads\n")
        print("| model | gnnpar (s) | PyG edge_index (s) | PyG adj_t (s) | gnnpar / PyG's best |")
        print("|---|---|---|---|---|")
        for label, m in s["models"].items():
            t = m["epoch_seconds"]
            sparse = f"{t['pyg adj_t']:.3f}" if "pyg adj_t" in t else "-"
            print(f"| {label} | {t['gnnpar']:.3f} | {t['pyg edge_index']:.3f} | {sparse} | "
                  f"**{m['ratio']:.2f}×** |")  # fmt: skip
    if not args.skip_bytes:
        result["bytes_8_ranks"] = b = bytes_8(args.bytes_scale)
        print(f"\n## Bytes per epoch on 8 ranks (x=2, y=4), R-MAT scale {args.bytes_scale}, "
              "all ranks\n")
        print("| model | measured | schedule | formula |")
        print("|---|---|---|---|")
        for label, e in b.items():
            formula = f"{e['formula'] / 1e6:,.3f} MB" if "formula" in e else "-"
            print(f"| {label} | {e['measured'] / 1e6:,.3f} MB | {e['schedule'] / 1e6:,.3f} MB | "
                  f"{formula} |")  # fmt: skip
    if args.accuracy:
        result["accuracy"] = acc = accuracy()
        print("\n## CiteSeer through `--model examples/pyg_models.py:FACTORY`\n")
        print("| model | test acc | val acc | best epoch | seconds |")
        print("|---|---|---|---|---|")
        for label, e in acc.items():
            print(f"| {label} | {e['test_acc']:.3f} | {e['val_acc']:.3f} | {e['best_step']} | "
                  f"{e['seconds']:.0f} |")  # fmt: skip
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    path = out / "pyg_models.json"
    kept = json.loads(path.read_text()) if path.exists() else {}  # parts not rerun stay
    path.write_text(json.dumps({**kept, **result}, indent=1))


if __name__ == "__main__":
    main()
