"""Compiled blocks benchmark: ``gnnpar train gpt``'s step with ``compile`` (each transformer
block's forward through ``torch.compile``, :mod:`gnnpar.compile`) beside the eager step, on 1
rank and on 4 CPU ranks over gloo (``--grid``, default ``data=2,x=2`` with ZeRO-3: the
tensor-parallel layers run eagerly between compiled pieces, ZeRO-3's hooks around them).

The model is our GPT (``--model gpt`` or ``llama``) of 4 blocks of width 256, 4 heads, 128
tokens per sequence, a vocabulary of 256: 3.3M parameters; a step is the trainer's
(:meth:`GPTTask.train_step`: AdamW, clipping at 1.0, float32) on a global batch of 8
sequences. Each side runs in a fresh process world, the two sides alternating, ``--repeats``
(5) runs each; every rank takes ``cores / ranks`` threads (2 on one rank, 1 on four here).

Per run: **compile time** — the first step's seconds minus the eager run's first step (the
first compiled step traces and compiles the blocks: forward and backward graphs); **step
time** — the median of ``--steps`` timed steps after ``--warmup`` steps (which cover every
compilation), of the slowest rank; **CPU time** per step and rank; **memory** — peak RSS
during the timed steps minus the idle baseline (the process's RSS after torch.distributed
is up, before the model exists; the compiled side's includes the compiler's residue and
the kernels), and the step's own: the peak minus the RSS right before the timed steps, the
largest over ranks. Figures are medians over the runs with their spread (min–max); the ratio
is compiled / eager of the medians.

Run::

    python benchmarks/compile.py                # 1 and 4 ranks, 5 runs each side
    python benchmarks/compile.py --quick        # a smaller model, 2 runs each

Writes ``benchmarks/out/compile.json`` (``compile-quick.json``) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.compose import Tokens, _cell, _fresh, _spread  # noqa: E402
from benchmarks.sharding import MALLOC_ENV, _reset_peak_rss, _rss_kb  # noqa: E402
from gnnpar.testing import run_distributed  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
SIDES = ("eager", "compiled")


def model_sizes(quick: bool) -> dict[str, int]:
    """The model's sizes (3.3M parameters; quick: 0.2M)."""
    if quick:
        return {"vocab_size": 64, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64}
    return {"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 256}


# ------------------------------------------------------------------------ one rank's run
def _rank(side: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import gc

    import gnnpar
    from gnnpar.models.gpt.task import GPTTaskConfig
    from gnnpar.train.spec import build_task

    world = gnnpar.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world.world_size))
    w = torch.zeros(2, requires_grad=True)  # first-use setup that any run pays, before the
    (w * 2).sum().backward()  # baseline
    torch.optim.AdamW([w]).step()
    gc.collect()
    baseline = _rss_kb("VmRSS") / 1024
    grid, stage = cfg["grids"][str(world.world_size)]
    task_cfg = GPTTaskConfig(
        model=cfg["model"], **cfg["sizes"], batch_size=cfg["batch"], lr=1e-4, min_lr=1e-4,
        warmup=1, steps=1000, sample_tokens=0, grad_clip=1.0, grid=grid, zero_stage=stage,
        compile=side == "compiled",
    )  # fmt: skip
    task = build_task("gpt", task_cfg, corpus=Tokens(cfg["sizes"]["vocab_size"]))
    first = []
    for i in range(cfg["warmup"]):
        t0 = time.perf_counter()
        task.train_step(i)
        first.append(time.perf_counter() - t0)
    gc.collect()
    before = _rss_kb("VmRSS") / 1024
    reset = _reset_peak_rss()
    times, cpu = [], []
    for i in range(cfg["warmup"], cfg["warmup"] + cfg["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = task.train_step(i)["loss"]
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = _rss_kb("VmHWM") / 1024
    counters = torch._dynamo.utils.counters
    out = {
        "first_step_s": first[0],
        "warmup_s": first,
        "step_s": statistics.median(times),
        "cpu_s": statistics.median(cpu),
        "peak_mb": peak,
        "baseline_mb": baseline,
        "step_mb": peak - before,
        "reset": reset,
        "loss": loss,
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
    }
    gnnpar.shutdown(task.grid)
    return out


def run_side(side: str, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One run of one side on ``world`` ranks (in this process's children)."""
    ranks = run_distributed(_rank, world, side, cfg, timeout=cfg["timeout"], env=MALLOC_ENV)
    return {
        "first_step_s": max(r["first_step_s"] for r in ranks),
        "step_s": max(r["step_s"] for r in ranks),
        "cpu_s": sum(r["cpu_s"] for r in ranks) / len(ranks),
        "memory_mb": max(r["peak_mb"] - r["baseline_mb"] for r in ranks),
        "step_mb": max(r["step_mb"] for r in ranks),
        "peak_mb": max(r["peak_mb"] for r in ranks),
        "baseline_mb": max(r["baseline_mb"] for r in ranks),
        "loss": ranks[0]["loss"],
        "graphs": ranks[0]["graphs"],
        "graph_breaks": ranks[0]["graph_breaks"],
    }


KEYS = ("first_step_s", "step_s", "cpu_s", "memory_mb", "step_mb", "peak_mb", "baseline_mb")


def compare(cfg: dict[str, Any], worlds: list[int]) -> dict[str, Any]:
    """Both sides on each of ``worlds``, alternating in fresh worlds, ``repeats`` runs each."""
    results: dict[str, Any] = {}
    for world in worlds:
        runs: dict[str, list] = {s: [] for s in SIDES}
        for r in range(cfg["repeats"]):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                runs[side].append(_fresh(side, world, cfg, __file__))
                print(f"{world} ranks {side} run {r + 1}: {runs[side][-1]}", file=sys.stderr,
                      flush=True)  # fmt: skip
        row: dict[str, Any] = {"grid": cfg["grids"][str(world)], "runs": runs}
        for side in SIDES:
            ok = [x for x in runs[side] if isinstance(x, dict)]
            if ok:
                row[side] = {k: _spread([x[k] for x in ok]) for k in KEYS}
                row[side].update({k: ok[0][k] for k in ("loss", "graphs", "graph_breaks")})
        if all(s in row for s in SIDES):
            e, c = row["eager"], row["compiled"]
            row["step_ratio"] = c["step_s"]["median"] / e["step_s"]["median"]
            row["cpu_ratio"] = c["cpu_s"]["median"] / e["cpu_s"]["median"]
            row["memory_ratio"] = c["memory_mb"]["median"] / e["memory_mb"]["median"]
            row["compile_s"] = c["first_step_s"]["median"] - e["first_step_s"]["median"]
            row["loss_rel"] = abs(c["loss"] - e["loss"]) / abs(e["loss"])
        results[str(world)] = row
    return results


def table(results: dict[str, Any], cfg: dict[str, Any]) -> str:
    lines = [
        f"{cfg['model']} of {cfg['params'] / 1e6:.1f}M parameters, global batch {cfg['batch']} "
        f"x {cfg['sizes']['block_size']} tokens; medians of {cfg['repeats']} runs (min-max); "
        "memory = peak RSS of the steps minus the idle baseline; step = the peak minus the RSS "
        "before the steps",
        "",
        "| ranks | grid, ZeRO | step (s): eager | compiled | × eager | CPU s/step/rank: eager "
        "| compiled | × eager | compile (s) | graphs (breaks) | memory (MB): eager / compiled "
        "| step memory (MB): eager / compiled |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world, row in results.items():
        grid, stage = row["grid"]
        if not all(s in row for s in SIDES):
            lines.append(f"| {world} | {grid}, {stage} | failed: see JSON | | | | | | | | | |")
            continue
        e, c = row["eager"], row["compiled"]
        lines.append(
            f"| {world} | {grid}, {stage} | {_cell(e['step_s'], '.3f')} "
            f"| {_cell(c['step_s'], '.3f')} | **{row['step_ratio']:.2f}×** "
            f"| {_cell(e['cpu_s'], '.3f')} | {_cell(c['cpu_s'], '.3f')} "
            f"| **{row['cpu_ratio']:.2f}×** "
            f"| {row['compile_s']:.1f} | {c['graphs']} ({c['graph_breaks']}) "
            f"| {_cell(e['memory_mb'], '.0f')} / {_cell(c['memory_mb'], '.0f')} "
            f"| {_cell(e['step_mb'], '.0f')} / {_cell(c['step_mb'], '.0f')} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="a small model, 2 runs each")
    p.add_argument("--model", default="gpt", choices=("gpt", "llama"))
    p.add_argument("--worlds", default="1,4", help="rank counts (comma list)")
    p.add_argument("--grid", default="data=2,x=2", help="grid of the 4-rank world")
    p.add_argument("--zero-stage", type=int, default=3, help="ZeRO stage of the 4-rank world")
    p.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--side-out", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:  # one fresh run (called by _fresh)
        out = run_side(args.side, args.world, json.loads(args.config))
        Path(args.side_out).write_text(json.dumps(out))
        return 0
    sizes = model_sizes(args.quick)
    from gnnpar.models.gpt.llama import Llama, LlamaConfig
    from gnnpar.models.gpt.model import GPT, GPTConfig

    with torch.device("meta"):
        plain = GPT(GPTConfig(**sizes)) if args.model == "gpt" else Llama(LlamaConfig(**sizes))
        params = sum(t.numel() for t in plain.parameters())
    worlds = [int(w) for w in args.worlds.split(",") if w]
    cfg = {
        "model": args.model, "sizes": sizes, "batch": 8, "warmup": args.warmup,
        "steps": args.steps, "timeout": 1800, "params": params,
        "repeats": 2 if args.quick else args.repeats,
        "grids": {"1": ("data=1", 0), "4": (args.grid, args.zero_stage)},
    }  # fmt: skip
    if any(str(w) not in cfg["grids"] for w in worlds):
        p.error("--worlds: 1 and 4 ranks only")
    results = compare(cfg, worlds)
    OUT.mkdir(parents=True, exist_ok=True)
    tag = ("-quick" if args.quick else "") + ("" if args.model == "gpt" else f"-{args.model}")
    doc = {"config": cfg, "results": results, "load_average": os.getloadavg()}
    (OUT / f"compile{tag}.json").write_text(json.dumps(doc, indent=1))
    print(table(results, cfg))
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
