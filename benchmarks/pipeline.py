"""Pipeline bubble, measured: the idle fraction of each stage for GPipe, 1F1B and the
interleaved schedule at p = 4, beside the formula ``(p − 1)/(m·v + p − 1)``.

Each stage's work is a fixed artificial cost: a forward pass of a micro-batch sleeps
``FORWARD_MS`` (50 ms) and its backward ``2 × FORWARD_MS`` (split over the ``v`` chunks of the
interleaved schedule, so every rank does the same work per step under each schedule). Sleeping
stages let four processes on two cores measure the schedule, not the oversubscription: a
sleeping rank holds no core. The activations are a few numbers, sent through
:func:`gnnpar.comm.send` over the pipe axis by the same runtime that trains the GPT
(:class:`gnnpar.pipeline.runtime.Pipeline`).

Per stage and step: idle = 1 − (the time it spent in its sleeps) / (the step's wall time,
between two barriers);
the schedules take turns step by step in one world; the table gives the median over
``STEPS`` steps (after one warm-up step) of each stage's
idle fraction, their mean, and the formula; and the median step time beside the planner's
prediction ``3·FORWARD_MS·m / (1 − bubble)`` (the stage's work stretched by the bubble; the
messages' own cost, a few milliseconds each on a loaded CPU, is what the two differ by).

Run::

    python benchmarks/pipeline.py            # m = 8, 50 ms forward, 5 steps per schedule
    python benchmarks/pipeline.py --quick    # m = 4, shorter sleeps

Writes ``benchmarks/out/pipeline.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from gnnpar.testing import run_distributed  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
PIPE = 4
STEPS = 5
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))


class _Sleep(torch.autograd.Function):
    """Identity that sleeps a fixed time forward and another backward (a stage of fixed
    cost); the seconds it took (a loaded machine oversleeps) are added to ``busy``."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s, busy):  # noqa: D102
        ctx.backward_s, ctx.busy = backward_s, busy
        start = time.perf_counter()
        time.sleep(forward_s)
        busy[0] += time.perf_counter() - start
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        start = time.perf_counter()
        time.sleep(ctx.backward_s)
        ctx.busy[0] += time.perf_counter() - start
        return g, None, None, None


def _stage_idle(m: int, forward_ms: float) -> dict[str, tuple[list[float], list[float]]]:
    """This stage's idle fraction and the step's wall seconds per measured step, for every
    schedule; the schedules take turns step by step, so a change of load hits all alike."""
    import gnnpar
    from gnnpar import comm
    from gnnpar.pipeline.runtime import Pipeline

    grid = gnnpar.init(pipe=PIPE)
    busy = [0.0]
    pipes = {}
    for schedule, v in SCHEDULES:
        f, b = forward_ms / 1e3 / v, 2 * forward_ms / 1e3 / v
        weights = [torch.nn.Parameter(torch.ones(1)) for _ in range(v)]
        chunks = [lambda x, w=w, f=f, b=b: _Sleep.apply(x * w, f, b, busy) for w in weights]
        pipes[schedule] = Pipeline(grid, chunks, schedule, m, v)
    inputs = [torch.ones(1, 4) for _ in range(m)]

    def loss_fn(out, target):
        loss = out.sum()
        return loss, float(loss.detach())

    out: dict[str, tuple[list[float], list[float]]] = {s: ([], []) for s in pipes}
    for step in range(STEPS + 1):
        for schedule, pipe in pipes.items():
            comm.barrier(grid)
            busy[0] = 0.0
            start = time.perf_counter()
            pipe.train_step(inputs, [None] * m, loss_fn, lambda i: (1, 4), torch.float32)
            comm.barrier(grid)  # the step ends when the last stage is done
            wall = time.perf_counter() - start
            if step:  # the first is a warm-up
                out[schedule][0].append(1.0 - busy[0] / wall)
                out[schedule][1].append(wall)
    gnnpar.shutdown(grid)
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure every schedule; print the table and write the JSON."""
    from gnnpar.pipeline.schedule import bubble_fraction

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 micro-batches, shorter sleeps")
    args = ap.parse_args(argv)
    m, forward_ms = (4, 10.0) if args.quick else (8, 50.0)
    rows = []
    per_rank = run_distributed(_stage_idle, PIPE, m, forward_ms, timeout=600)
    for schedule, v in SCHEDULES:
        medians = [statistics.median(r[schedule][0]) for r in per_rank]
        bubble = bubble_fraction(PIPE, m, v)
        rows.append({
            "schedule": schedule, "virtual": v, "micro_batches": m, "pipe": PIPE,
            "idle_per_stage": medians, "idle_mean": statistics.mean(medians),
            "formula": bubble, "steps": STEPS,
            "step_s": statistics.median(per_rank[0][schedule][1]),
            "predicted_step_s": 3 * forward_ms / 1e3 * m / (1 - bubble),
            "forward_ms": forward_ms, "backward_ms": 2 * forward_ms,
        })  # fmt: skip
    print(f"pipeline bubble at p={PIPE}, m={m}: forward {forward_ms:g} ms + backward "
          f"{2 * forward_ms:g} ms of sleep per micro-batch and stage; medians of {STEPS} "
          "steps")  # fmt: skip
    head = (f"{'schedule':<12}{'v':>3}  {'idle per stage (ranks 0-3)':<30}{'mean':>8}"
            f"{'formula':>9}{'step s':>9}{'predicted':>11}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in rows:
        stages = " ".join(f"{x:6.1%}" for x in r["idle_per_stage"])
        print(f"{r['schedule']:<12}{r['virtual']:>3}  {stages:<30}{r['idle_mean']:>8.1%}"
              f"{r['formula']:>9.1%}{r['step_s']:>9.3f}{r['predicted_step_s']:>11.3f}")  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "pipeline.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
