"""Context-parallelism benchmark: sequences of 4,096 tokens, per-rank peak memory and step time
of the ``gpt`` task with the sequence split over 4 context ranks (ring attention) beside the
same global batch without context parallelism, in the same run.

Sides (a small GPT, float32, ZeRO stage 0, gloo on the CPU, one thread per rank):

- global batch 1: ``context=4`` on 4 ranks vs one rank (no other way to split one sequence);
- global batch 4: ``context=4`` on 4 ranks vs ``data=4`` on 4 ranks (each rank holds as many
  tokens either way: the ring only moves keys and values, and memory per rank stays close).

Memory is the peak resident set of the measured steps minus the idle baseline (after
torch.distributed is up and a warm-up backward and optimizer step, before the model exists),
the largest over the ranks; step time is the median over the steps, the slowest rank's. The
planner's prediction for each side is printed beside it.

Run::

    python benchmarks/context_parallel.py           # a few minutes on 2 cores
    python benchmarks/context_parallel.py --quick   # 1,024 tokens, fewer steps

Writes ``benchmarks/out/context_parallel.json`` and prints a table with the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
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
MODEL = {"vocab_size": 256, "n_layer": 4, "n_embd": 256, "n_head": 8}
# (label, grid, world, global batch)
SIDES = [
    ("1 sequence, context=4", "context=4", 4, 1),
    ("1 sequence, one rank", "data=1", 1, 1),
    ("4 sequences, context=4", "context=4", 4, 4),
    ("4 sequences, data=4", "data=4", 4, 4),
]


class _Tokens:
    """Random tokens (what the task needs of a tokenised text)."""

    vocab_size = MODEL["vocab_size"]

    def __init__(self, seq: int):
        self.n = 12 * seq

    def split(self, val_fraction: float):
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab_size, (self.n,), generator=gen)
        return ids, ids[: self.n // 2]


def _config(grid: str, batch: int, seq: int, steps: int):
    from gnnpar.models.gpt.task import GPTTaskConfig

    return GPTTaskConfig(
        **MODEL, block_size=seq, batch_size=batch, grid=grid, zero_stage=0, steps=steps,
        warmup=1, sample_tokens=0, val_batches=1,
    )  # fmt: skip


def _rank(grid: str, batch: int, seq: int, steps: int) -> dict[str, Any]:
    import gnnpar
    from gnnpar.train.spec import build_task

    world = gnnpar.init()
    # the code every side imports while it builds (its pages count in RSS), and torch's lazy
    # set-up of backward and the optimizer: before the baseline
    import gnnpar.data.text
    import gnnpar.models.gpt.planning
    import gnnpar.shard
    import gnnpar.tensor.context  # noqa: F401

    w = torch.zeros(2, requires_grad=True)
    (w * 2).sum().backward()
    torch.optim.AdamW([w]).step()
    gc.collect()
    baseline = _rss_kb("VmRSS") / 1024
    task = build_task("gpt", _config(grid, batch, seq, steps + 1), corpus=_Tokens(seq))
    task.train_step(0)
    gc.collect()
    reset = _reset_peak_rss()
    times = []
    for i in range(1, steps + 1):
        t0 = time.perf_counter()
        loss = task.train_step(i)["loss"]
        times.append(time.perf_counter() - t0)
    peak = _rss_kb("VmHWM") / 1024
    gnnpar.release(task.grid)
    gnnpar.shutdown(world)
    return {"step_s": statistics.median(times), "peak_mb": peak, "baseline_mb": baseline,
            "reset": reset, "loss": loss}  # fmt: skip


def _predicted_mb(grid: str, world: int, batch: int, seq: int) -> float:
    from gnnpar.grid import fit_shape, parse_grid_spec
    from gnnpar.models.gpt.memory import gpt_memory
    from gnnpar.models.gpt.task import plan_problem

    cfg = _config(grid, batch, seq, 1)
    problem = dataclasses.replace(plan_problem(cfg), stage=0)
    mem = gpt_memory(problem, fit_shape(world, parse_grid_spec(grid)))
    return sum(mem.values()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1,024 tokens, 2 steps")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    seq, steps = (1024, 2) if args.quick else (args.seq, args.steps)
    env = {"OMP_NUM_THREADS": "1", **MALLOC_ENV}
    rows = []
    for label, grid, world, batch in SIDES:
        ranks = run_distributed(_rank, world, grid, batch, seq, steps, timeout=1800, env=env)
        rows.append({
            "side": label, "grid": grid, "world": world, "batch": batch, "seq": seq,
            "step_s": max(r["step_s"] for r in ranks),
            "memory_mb": max(r["peak_mb"] - r["baseline_mb"] for r in ranks),
            "baseline_mb": max(r["baseline_mb"] for r in ranks),
            "predicted_mb": _predicted_mb(grid, world, batch, seq),
            "loss": ranks[0]["loss"], "reset": all(r["reset"] for r in ranks),
        })  # fmt: skip
        print(f"{label}: {rows[-1]['step_s']:.2f} s, {rows[-1]['memory_mb']:.0f} MB", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    doc = {"model": MODEL, "seq": seq, "steps": steps, "rows": rows}
    (OUT / "context_parallel.json").write_text(json.dumps(doc, indent=1))
    print(f"\nGPT {MODEL}, {seq} tokens per sequence, float32, stage 0, one thread per rank")
    print("| side | step (s) | memory: peak − baseline (MB) | planner (MB) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['side']} | {r['step_s']:.2f} | {r['memory_mb']:.0f} | "
              f"{r['predicted_mb']:.0f} |")  # fmt: skip
    for a, b in ((0, 1), (2, 3)):
        ra, rb = rows[a], rows[b]
        print(f"{ra['side']} / {rb['side']}: step {ra['step_s'] / rb['step_s']:.2f}x, "
              f"memory {ra['memory_mb'] / max(rb['memory_mb'], 1e-9):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
