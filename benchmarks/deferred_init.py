"""Deferred initialisation: per-rank peak memory of building a tensor-parallel GPT on the meta
device (only this rank's pieces materialised) against the memory bound below, and against the
eager path (every rank builds the full model, then slices it) at a size where that fits.

Per rank, on 8 CPU ranks over gloo (build only: no optimizer, no step):

- **baseline**: resident set after torch.distributed is up and the code is imported and
  warmed (fake tensors load ~90 MB of code on first use, whatever the model; recorded as
  ``fake_tensor_warmup_mb``), before the model exists (the idle process);
- **peak**: the resident-set high-water mark while the model is built and parallelized (reset
  with ``/proc/self/clear_refs`` at the baseline), minus the baseline;
- **bound**: ``1.2 × model bytes / ranks + largest parameter bytes`` (the target);
- the bytes of this rank's pieces, and the build time.

Models (GPT-3 paper sizes, our GPT, float32, tied head, context 2048, vocabulary 50257):
``xl`` 24 layers × 2048 wide, 16 heads: 1.316 B parameters; ``small`` 12 × 768, 12 heads:
125 M (the eager contrast runs at this size; at ``xl`` it would need 8 × 5.3 GB).

The script restarts itself with ``MALLOC_MMAP_THRESHOLD_=131072`` (as ``benchmarks/sharding.py``;
glibc reads it at process start and the forked ranks inherit it) so freed tensors go back to
the system and RSS follows the live tensors, not glibc's retained heap; ``--default-malloc``
measures without it.

Run::

    python benchmarks/deferred_init.py            # xl deferred + small deferred/eager, ~10 min
    python benchmarks/deferred_init.py --quick    # small only

Writes ``benchmarks/out/deferred_init.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.sharding import MALLOC_ENV, _reset_peak_rss, _rss_kb  # noqa: E402
from gnnpar.testing import run_distributed  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
SIZES = {
    "xl": dict(n_layer=24, n_embd=2048, n_head=16),
    "small": dict(n_layer=12, n_embd=768, n_head=12),
}
COMMON = dict(vocab_size=50257, block_size=2048, tie_weights=True)
SLACK = 1.2


def _rank(size: str, path: str, grid_shape: dict[str, int]) -> dict[str, Any]:
    """One rank: bring up the grid, take the baseline, build, measure."""
    import torch._subclasses.fake_tensor  # noqa: F401 - imported code is part of the idle process

    import gnnpar
    from gnnpar import tensor
    from gnnpar.models.gpt.model import GPT, GPTConfig

    grid = gnnpar.init(**grid_shape)
    cfg = GPTConfig(**SIZES[size], **COMMON)
    # Fake tensors load code lazily on first use (tens of MB, whatever the model): part of
    # the idle process, recorded apart.
    before = _rss_kb("VmRSS")
    tensor.record_init(lambda: torch.nn.Linear(2, 2))
    gc.collect()
    baseline = _rss_kb("VmRSS")
    reset = _reset_peak_rss()
    start = time.perf_counter()
    torch.manual_seed(0)
    if path == "deferred":
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    unique = {id(p): p for p in model.parameters()}.values()
    model_bytes = sum(p.numel() * p.element_size() for p in unique)
    largest = max(p.numel() * p.element_size() for p in unique)
    numel = sum(p.numel() for p in unique)
    tensor.parallelize(model, grid)
    seconds = time.perf_counter() - start
    peak = _rss_kb("VmHWM")
    pieces = sum(
        p.numel() * p.element_size() for p in {id(q): q for q in model.parameters()}.values()
    )
    gnnpar.release(grid)
    return {
        "rank": grid.global_rank,
        "baseline_mb": baseline / 1024,
        "fake_tensor_warmup_mb": (baseline - before) / 1024,
        "peak_mb": (peak - baseline) / 1024,
        "peak_reset": reset,
        "pieces_mb": pieces / 2**20,
        "model_mb": model_bytes / 2**20,
        "largest_param_mb": largest / 2**20,
        "params": numel,
        "seconds": seconds,
    }


def run_case(size: str, path: str, world: int, grid_shape: dict[str, int]) -> dict[str, Any]:
    """Every rank's figures and the summary of one (size, path)."""
    ranks = run_distributed(_rank, world, size, path, grid_shape, timeout=1800)
    model_mb, largest_mb = ranks[0]["model_mb"], ranks[0]["largest_param_mb"]
    bound = SLACK * model_mb / world + largest_mb
    worst = max(r["peak_mb"] for r in ranks)
    return {
        "size": size,
        "path": path,
        "world": world,
        "grid": grid_shape,
        "params": ranks[0]["params"],
        "model_mb": model_mb,
        "largest_param_mb": largest_mb,
        "bound_mb": bound,
        "peak_mb_max": worst,
        "peak_mb_mean": sum(r["peak_mb"] for r in ranks) / world,
        "pieces_mb_max": max(r["pieces_mb"] for r in ranks),
        "baseline_mb_max": max(r["baseline_mb"] for r in ranks),
        "fake_tensor_warmup_mb_max": max(r["fake_tensor_warmup_mb"] for r in ranks),
        "seconds_max": max(r["seconds"] for r in ranks),
        "peak_over_bound": worst / bound,
        "within_bound": worst <= bound,
        "ranks": ranks,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a fixed-width table."""
    head = (
        f"{'model':>6} {'path':>8} {'params':>8} {'model MB':>9} {'largest':>8} "
        f"{'pieces':>7} {'peak max':>9} {'bound':>7} {'peak/bound':>10} {'build s':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['size']:>6} {r['path']:>8} {r['params'] / 1e9:>7.3f}B {r['model_mb']:>9.0f} "
            f"{r['largest_param_mb']:>8.0f} {r['pieces_mb_max']:>7.0f} {r['peak_mb_max']:>9.0f} "
            f"{r['bound_mb']:>7.0f} {r['peak_over_bound']:>10.2f} {r['seconds_max']:>8.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the cases, print the table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--grid", default="x=2,y=2,z=2", help="tensor grid of the world")
    ap.add_argument("--quick", action="store_true", help="the small model only")
    ap.add_argument(
        "--default-malloc", action="store_true", help="leave glibc's dynamic mmap threshold on"
    )
    args = ap.parse_args(argv)
    if not args.default_malloc and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        # glibc reads these at process start and forked ranks inherit its state: restart.
        script = [sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:])]
        os.execve(sys.executable, script, {**os.environ, **MALLOC_ENV})
    from gnnpar.grid import parse_grid_spec

    grid_shape = parse_grid_spec(args.grid)
    cases = [("small", "deferred"), ("small", "eager")]
    if not args.quick:
        cases.insert(0, ("xl", "deferred"))
    rows = []
    for size, path in cases:
        print(f"{size} {path} on {args.world} ranks ({args.grid}) ...", flush=True)
        rows.append(run_case(size, path, args.world, grid_shape))
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / (
        "deferred_init-default-malloc.json" if args.default_malloc else "deferred_init.json"
    )
    doc = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "torch": torch.__version__,
        "slack": SLACK,
        "sizes": {k: {**v, **COMMON} for k, v in SIZES.items()},
        "malloc_env": {} if args.default_malloc else MALLOC_ENV,
        "cases": rows,
    }
    out.write_text(json.dumps(doc, indent=1))
    print()
    print("MB = MiB per rank; peak = high-water RSS above the idle baseline;")
    print(f"bound = {SLACK} × model / {args.world} + largest parameter")
    print(table(rows))
    print(f"\nwrote {out}")
    return 0 if all(r["within_bound"] for r in rows if r["path"] == "deferred") else 1


if __name__ == "__main__":
    sys.exit(main())
