"""GPU benchmarks on a world of one: what `benchmarks/gpu.sh` runs on a machine with a GPU.

Three parts, each on ``--device`` (default ``cuda``; ``cpu`` checks the script itself on a
machine without one), medians of ``--reps`` interleaved runs with their spread:

(a) full-graph GCN epoch (forward + backward + Adam; 3 layers, 128 wide) on R-MAT scale
    ``--scale`` with 128 features: ours (one rank, balanced-local shards, float32, and the
    bf16 compute path when the task supports it) beside PyG ``GCNConv`` on a sparse CSR
    ``adj_t`` on the same device, same weights and initial loss;
(b) ``gnnpar train gpt``'s step on the GPT of ``benchmarks/sharding.py`` (10 blocks of width
    768, 12 heads, vocabulary 512, 256 positions; about 73M parameters), batch 16, float32
    and bf16 mixed precision: median step time after warm-up, tokens/s;
(c) the neighbour sampler feeding CUDA batches: 200k nodes, 4M edges, fan-outs 15,10, batch
    1024, through :class:`~gnnpar.sampling.NodeLoader` with ``device`` (pinned, non-blocking
    copies) and the prefetch thread; seeds/s with the batch on the device.

Installs nothing; a peer that is missing is skipped and said so. Prints one table and writes
``benchmarks/out/gpu.json``.

    python benchmarks/gpu.py                   # on a GPU (about 6 minutes on one H100-class GPU)
    python benchmarks/gpu.py --device cpu --quick   # the script itself, on any machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "out"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _synced(step, device: torch.device):
    """``step`` followed by a wait for the device, so that a timer around it sees its work."""

    def run() -> None:
        step()
        _sync(device)

    return run


def _interleaved(steps: dict, reps: int, device: torch.device) -> dict[str, dict]:
    """The full-graph benchmark's interleaved timing, each step synchronised."""
    from benchmarks.fullgraph import _interleaved as interleaved

    _sync(device)
    return interleaved({k: _synced(s, device) for k, s in steps.items()}, reps)


def gcn_epoch(
    device: torch.device, scale: int, reps: int, tmp: Path, profile: bool = False
) -> dict:
    """(a) one-rank GCN epoch, ours beside PyG's CSR path, on ``device``."""
    import warnings

    import torch.nn.functional as F

    import gnnpar
    from benchmarks.fullgraph import _model, _pyg_model
    from gnnpar.data import rmat
    from gnnpar.models.fullgraph import parallelize_fullgraph
    from gnnpar.models.fullgraph.shards import DiskSource, prepare_shards

    graph = rmat(scale=scale, edge_factor=16, feat_dim=128)
    dims = [128, 128, 128, int(graph.num_classes)]
    folder = prepare_shards(
        graph, tmp / f"rmat{scale}", blocks=(8, 8), permutation="balanced-local"
    )
    grid = gnnpar.init(device=device)
    steps, losses = {}, {}
    ours = parallelize_fullgraph(_model(dims), grid, DiskSource(folder))
    x = ours.input_features()
    opt = torch.optim.Adam(ours.parameters(), lr=0.01)

    def ours_step() -> None:
        opt.zero_grad()
        ours.loss(ours(x), "train_mask").backward()
        opt.step()

    with torch.no_grad():
        losses["ours"] = ours.loss(ours(x), "train_mask").item()
    steps["ours"] = ours_step
    n = graph.num_nodes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adj = torch.sparse_csr_tensor(
            graph.indptr, graph.indices, torch.ones(graph.indices.numel()), (n, n)
        ).to(device)
    feat, label = graph.feat.to(device), graph.label.to(device)
    mask = graph.train_mask.to(device)
    try:
        pyg = _pyg_model(dims, _model(dims)).to(device)
    except ImportError as e:
        pyg = None
        print(f"  PyG skipped: {e}")
    if pyg is not None:
        popt = torch.optim.Adam(pyg.parameters(), lr=0.01)

        def pyg_step() -> None:
            popt.zero_grad()
            F.cross_entropy(pyg(feat, adj)[mask], label[mask]).backward()
            popt.step()

        with torch.no_grad():
            losses["pyg sparse CSR"] = F.cross_entropy(pyg(feat, adj)[mask], label[mask]).item()
        steps["pyg sparse CSR"] = pyg_step
    times = _interleaved(steps, reps, device)
    if profile:
        print("profile of ours, 3 epochs:\n" + profile_epoch(ours_step, device), flush=True)
    gnnpar.shutdown(grid)
    out = {"nodes": n, "edges": graph.num_edges, "epoch_s": times, "initial_loss": losses}
    if "pyg sparse CSR" in times:
        out["ours / pyg"] = times["ours"]["median"] / times["pyg sparse CSR"]["median"]
    return out


def gpt_step(device: torch.device, quick: bool, tmp: Path) -> dict:
    """(b) ``gnnpar train gpt``'s step time, float32 and bf16, on ``device``."""
    import os

    from gnnpar.cli import main
    from gnnpar.train.metrics import read_metrics

    text = tmp / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 20_000, encoding="utf-8")
    os.environ["GNNPAR_DATA"] = str(tmp / "cache")
    sizes = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4"] if quick else [
        "--n-layer", "10", "--n-embd", "768", "--n-head", "12"]  # fmt: skip
    out = {}
    for precision in ("none", "bf16"):
        run = tmp / f"gpt-{precision}"
        argv = [
            "train", "gpt", "--data", str(text), "--vocab-size", "512", "--block-size", "256",
            "--batch-size", "16", "--steps", "6" if quick else "30", "--eval-every", "0",
            "--val-batches", "1", "--sample-tokens", "0", "--quiet", "--zero-stage", "0",
            "--mixed-precision", precision, "--device", device.type, "--out", str(run),
            *sizes,
        ]  # fmt: skip
        if main(argv) != 0:
            out[precision] = {"error": "gnnpar train gpt failed"}
            continue
        steps = [r for r in read_metrics(run / "metrics.jsonl") if "tokens_per_s" in r]
        rates = [r["tokens_per_s"] for r in steps[len(steps) // 3 :]]  # after the warm-up
        rate = statistics.median(rates)
        out[precision] = {
            "tokens_per_s": rate,
            "step_s": 16 * 256 / rate,
            "spread": [min(rates), max(rates)],
        }
    return out


def sampler_to_device(device: torch.device, quick: bool, reps: int) -> dict:
    """(c) seeds/s of the neighbour sampler with batches delivered on ``device``."""
    from benchmarks.fullgraph import _summary
    from gnnpar.graph import Graph
    from gnnpar.sampling import NeighborSampler, NodeLoader

    n, m = (20_000, 400_000) if quick else (200_000, 4_000_000)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, n, (m,), generator=g)
    dst = torch.randint(0, n, (m,), generator=g)
    ndata = {"feat": torch.randn(n, 128, generator=g), "label": torch.zeros(n, dtype=torch.long)}
    graph = Graph.from_edges(src, dst, n, ndata=ndata)
    sampler = NeighborSampler(graph, [15, 10])
    rates = {}
    for prefetch in (0, 1):
        runs = []
        for rep in range(reps):
            loader = NodeLoader(
                sampler, torch.arange(n), 1024, seed=rep, features=graph.feat,
                labels=graph.label, prefetch=prefetch, device=device,
            )  # fmt: skip
            t = time.perf_counter()
            seeds = 0
            for batch in loader:
                seeds += batch.num_seeds
                if batch.x.device != device:
                    raise RuntimeError(f"batch arrived on {batch.x.device}, not {device}")
            _sync(device)
            runs.append(seeds / (time.perf_counter() - t))
        rates[f"prefetch {prefetch}"] = _summary(runs)
    return {"nodes": n, "edges": m, "seeds_per_s": rates}


def spmm_variants(device: torch.device, scale: int, reps: int) -> dict:
    """(d) every SpMM variant on R-MAT ``scale``'s adjacency at width 128, ``A @ H`` and
    ``Aᵀ @ G`` (each a median of ``reps``), with the largest difference from ``csr32``, and
    what the default autotune picks and leaves out on this device."""
    from benchmarks.fullgraph import _summary
    from gnnpar.data import rmat
    from gnnpar.sparse.csr import CSRBlock
    from gnnpar.sparse.kernels import VARIANTS, LocalSpMM

    graph = rmat(scale=scale, edge_factor=16, feat_dim=1)
    n, nnz = graph.num_nodes, graph.indices.numel()
    values = torch.rand(nnz, generator=torch.Generator().manual_seed(0))
    block = CSRBlock(graph.indptr, graph.indices, values, (n, n)).to(device=device)
    h = torch.randn(n, 128, generator=torch.Generator().manual_seed(1)).to(device)
    out: dict = {"nodes": n, "nnz": nnz, "variants": {}}
    for dtype in (torch.float32, torch.bfloat16):
        spmm, x = LocalSpMM(block.to(dtype=dtype)), h.to(dtype)
        ref = spmm.mm(x, variant="csr32").double() if dtype == torch.float32 else None
        for name, variant in VARIANTS.items():
            if not variant.supports(spmm.block, dtype):
                continue
            row = {}
            for what, op in (("A @ H", spmm), ("At @ G", spmm.T)):
                op.mm(x, variant=name)  # warm-up: the kernel is prepared once
                runs = []
                for _ in range(reps):
                    _sync(device)
                    t = time.perf_counter()
                    op.mm(x, variant=name)
                    _sync(device)
                    runs.append(time.perf_counter() - t)
                row[what] = _summary(runs)
            if ref is not None:
                row["max |diff| vs csr32"] = (
                    (spmm.mm(x, variant=name).double() - ref).abs().max().item()
                )
            out["variants"][f"{name} {str(dtype).removeprefix('torch.')}"] = row
        tuned = LocalSpMM(block.to(dtype=dtype))
        tuned.mm(x)
        out[f"autotune {str(dtype).removeprefix('torch.')}"] = {
            "choice": next(iter(tuned.choices.values())),
            "excluded": next(iter(tuned.excluded.values()), {}),
        }
    return out


def profile_epoch(step, device: torch.device, rows: int = 15) -> str:
    """The ops that take the device's time in a few calls of ``step`` (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    step()
    _sync(device)
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        _sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def versions(device: torch.device) -> dict:
    """What ran: Python, torch, CUDA and the device's name."""
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        import torch_geometric

        info["torch_geometric"] = torch_geometric.__version__
    except ImportError:
        info["torch_geometric"] = "absent"
    return info


def _table(result: dict, scale: int) -> list[tuple[str, str]]:
    """The rows of the summary printed at the end, for the parts that ran."""
    rows = []
    if "spmm" in result:
        spmm = result["spmm"]
        rows.append((f"(d) SpMM, R-MAT {scale} ({spmm['nnz']} nonzeros) x 128 columns", ""))
        for name, r in spmm["variants"].items():
            ms = " / ".join(f"{r[k]['median'] * 1e3:.2f}" for k in ("A @ H", "At @ G"))
            diff = r.get("max |diff| vs csr32")
            rows.append(
                (f"    {name}", f"{ms} ms" + ("" if diff is None else f", diff {diff:.2g}"))
            )
        for key in ("autotune float32", "autotune bfloat16"):
            rows.append((f"    {key} picks", spmm[key]["choice"]))
    if "gcn" in result:
        gcn = result["gcn"]
        rows.append((f"(a) GCN epoch, R-MAT {scale} ({gcn['nodes']} nodes)", ""))
        for name, t in gcn["epoch_s"].items():
            ms = {k: t[k] * 1e3 for k in ("median", "min", "max")}
            rows.append((f"    {name}", f"{ms['median']:.1f} ms ({ms['min']:.1f}-{ms['max']:.1f})"))
        if "ours / pyg" in gcn:
            rows.append(("    ours / PyG", f"{gcn['ours / pyg']:.2f}x"))
    if "gpt" in result:
        rows.append(("(b) gnnpar train gpt step, batch 16 x 256", ""))
        for precision, r in result["gpt"].items():
            value = (
                r.get("error") or f"{r['step_s'] * 1e3:.1f} ms, {r['tokens_per_s']:.3g} tokens/s"
            )
            rows.append((f"    mixed_precision={precision}", value))
    if "sampler" in result:
        rows.append(("(c) sampler to device, fan-outs 15,10, batch 1024", ""))
        for name, r in result["sampler"]["seeds_per_s"].items():
            rows.append(
                (f"    {name}", f"{r['median']:.3g} seeds/s ({r['min']:.3g}-{r['max']:.3g})")
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--scale", type=int, default=18, help="R-MAT scale of part (a)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="small sizes (checks the script)")
    p.add_argument("--profile", action="store_true", help="print where (a)'s epoch spends time")
    p.add_argument(
        "--only", nargs="+", choices=("spmm", "gcn", "gpt", "sampler"), help="run only these parts"
    )
    p.add_argument("--json", default=str(OUT / "gpu.json"), help="JSON file to write")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu.py: torch sees no GPU here (use --device cpu to check the script)")
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    scale = 10 if args.quick else args.scale
    reps = 2 if args.quick else args.reps
    result = {"versions": versions(device)}
    print(" ".join(f"{k} {v}" for k, v in result["versions"].items()), flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        # Each part prints its result as it ends, so a run cut off by a time limit keeps it.
        parts = {
            "spmm": lambda: spmm_variants(device, scale, reps),
            "gcn": lambda: gcn_epoch(device, scale, reps, tmp, args.profile),
            "gpt": lambda: gpt_step(device, args.quick, tmp),
            "sampler": lambda: sampler_to_device(device, args.quick, reps),
        }
        for part in args.only or parts:
            result[part] = parts[part]()
            print(f"[{part}]", json.dumps(result[part]), flush=True)
    rows = _table(result, scale)
    width = max(len(a) for a, _ in rows)
    print("\n".join(f"{a:<{width}}  {b}" for a, b in rows))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    from gnnpar.atomic import write_json

    write_json(args.json, result, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
