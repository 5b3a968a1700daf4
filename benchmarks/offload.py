"""Parameter offload (ZeRO-Infinity): a GPT whose parameters, gradients and Adam state
together are at least 1.5x this machine's free memory takes optimizer steps on 4 CPU ranks
with the file tier, through the trainer's task (``gnnpar train gpt``'s step, the same code).

The model is sized at run time from ``MemAvailable`` (``/proc/meminfo``): width 2,560 (20
heads), as many blocks as it takes for 16 bytes a parameter (float32 parameters and
gradients, Adam's two moments) to reach ``--factor`` (1.5) times the free memory; vocabulary
2,048 (the Shakespeare BPE), 4 sequences of 32 tokens a step. Grid ``x=4`` (tensor-parallel
over the 4 ranks: each rank builds only its quarter of every matrix, so the build needs a
quarter of the model per rank), ZeRO stage 3 with ``offload = file`` (each unit's
parameters, the float32 master, and Adam's moments in memory-mapped files), full activation
checkpointing, ``prefetch_depth`` 1 (``--prefetch-depth``: another depth, for the time it
saves).

Per rank it records:

- **memory**: the idle baseline (resident set after torch.distributed is up, before the model
  is built), the peak of the build, and the peak of the steps (``VmHWM``, reset with
  ``/proc/self/clear_refs`` after the build), both minus the baseline, against the planner's
  prediction for the run (``gpt_memory`` of the same problem: every part but the ``file``
  one, which is on disk; on this machine host memory is the device's);
- **file traffic per step**: what the tier copied out of and into its files (its own count,
  equal to the model: per step every unit's chunk is read for its forward gather and again
  for its recompute, and the step reads and writes the master and both moments: ``20 · Ψ_r``
  bytes read and ``12 · Ψ_r`` written, Ψ_r the rank's elements) and what the machine's disks
  read and wrote during the step (``/proc/diskstats``, all ranks together: page-cache hits
  read nothing, and the kernel writes dirty pages back when it chooses; ``/proc/self/io``
  does not see writes through a shared mapping);
- the step time and the loss.

The script restarts itself with ``MALLOC_MMAP_THRESHOLD_=131072`` (as
``benchmarks/sharding.py``), so that the build's freed pieces leave the resident set.

Run::

    python benchmarks/offload.py                 # 5 steps; about 20-30 minutes on 2 cores
    python benchmarks/offload.py --factor 0.05 --steps 2    # a small smoke run (a minute)

It needs disk for the files (about 12 bytes a parameter: 27 GB at the default size) in
``--offload-dir`` (default: a temporary folder). Writes ``benchmarks/out/offload.json``
(``offload-depth<D>.json`` for another depth) and
prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "out"

from benchmarks.sharding import MALLOC_ENV, _reset_peak_rss, _rss_kb  # noqa: E402

WIDTH, HEADS, VOCAB, SEQ, BATCH, RANKS = 2560, 20, 2048, 32, 4, 4
BYTES_PER_PARAM = 16  # float32 parameter and gradient, Adam's two moments


def mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def gpt_params(layers: int) -> int:
    """Parameters of our GPT at these sizes (biases on, tied head)."""
    h = WIDTH
    per_block = 12 * h * h + 13 * h
    return layers * per_block + VOCAB * h + SEQ * h + 2 * h


def layers_for(target_bytes: float) -> int:
    """The fewest blocks whose 16 bytes a parameter reach ``target_bytes``."""
    layers = 1
    while gpt_params(layers) * BYTES_PER_PARAM < target_bytes:
        layers += 1
    return layers


def disk_bytes() -> dict[str, int]:
    """Bytes read and written by this machine's disks so far (``/proc/diskstats``, whole
    disks of ``/sys/block`` other than loop and RAM devices; 512-byte sectors)."""
    disks = {d.name for d in Path("/sys/block").iterdir()
             if not d.name.startswith(("loop", "ram", "zram"))}  # fmt: skip
    read = written = 0
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if f[2] in disks:
            read, written = read + int(f[5]) * 512, written + int(f[9]) * 512
    return {"read": read, "written": written}


def _rank(layers: int, steps: int, folder: str, text: str, depth: int) -> dict[str, Any]:
    """One rank: build the task, take ``steps`` steps, measure."""
    import torch

    torch.set_num_threads(1)
    import gnnpar
    from gnnpar.models.gpt.task import GPTTaskConfig
    from gnnpar.train.spec import build_task

    cfg = GPTTaskConfig(
        data=text, vocab_size=VOCAB, n_layer=layers, n_embd=WIDTH, n_head=HEADS,
        block_size=SEQ, batch_size=BATCH, steps=steps, warmup=0, lr=3e-5, dtype="float32",
        grid=f"x={RANKS}", zero_stage=3, offload="file", offload_dir=f"{folder}/offload",
        activation_checkpointing="full", sample_tokens=0, val_batches=1, eval_every=0,
        out=f"{folder}/run", prefetch_depth=depth,
    )  # fmt: skip
    baseline = _rss_kb("VmRSS") * 1024
    t0 = time.perf_counter()
    task = build_task("gpt", cfg)
    build_s = time.perf_counter() - t0
    build_peak = _rss_kb("VmHWM") * 1024
    _reset_peak_rss()  # VmHWM := the current resident set
    tier = task.dp.offload
    records = []
    for step in range(steps):
        io0, t0, tr0 = disk_bytes(), time.perf_counter(), dict(tier.traffic)
        rec = task.train_step(step)
        io1 = disk_bytes()
        records.append({
            "seconds": time.perf_counter() - t0,
            "loss": float(rec["loss"]),
            "tier_read": tier.traffic["read"] - tr0["read"],
            "tier_written": tier.traffic["written"] - tr0["written"],
            "disk_read": io1["read"] - io0["read"],
            "disk_written": io1["written"] - io0["written"],
        })  # fmt: skip
    chunk = sum(g.master.numel() for g in task.dp._groups(("trainable",)))
    out = {
        "baseline": baseline,
        "build_peak": build_peak,
        "step_peak": _rss_kb("VmHWM") * 1024,
        "build_seconds": build_s,
        "chunk_elements": chunk,
        "file_bytes": tier.file_bytes(),
        "reads": dict(tier.reads),
        "steps": records,
    }
    gnnpar.release(task.grid)
    return out


def predicted(layers: int, depth: int = 1) -> dict[str, float]:
    """The planner's memory of rank 0 for this run, by part."""
    from gnnpar.models.gpt.memory import gpt_memory
    from gnnpar.models.gpt.task import GPTTaskConfig, plan_problem

    cfg = GPTTaskConfig(
        vocab_size=VOCAB, n_layer=layers, n_embd=WIDTH, n_head=HEADS, block_size=SEQ,
        batch_size=BATCH, dtype="float32", zero_stage=3, offload="file",
        activation_checkpointing="full", prefetch_depth=depth,
    )  # fmt: skip
    problem = dataclasses.replace(plan_problem(cfg), stage=3, schedule=None)
    return gpt_memory(problem, {"x": RANKS})


def table(result: dict[str, Any]) -> str:
    """The per-rank table."""
    mib = 2**20
    pred = result["predicted_rss"]
    lines = [
        f"GPT {result['params'] / 1e9:.2f}B ({result['layers']} blocks of {WIDTH}), "
        f"{result['state_gb']:.1f} GB of parameters, gradients and Adam state = "
        f"{result['state_gb'] / result['available_gb']:.2f}x the {result['available_gb']:.1f} "
        f"GB free; x={RANKS}, ZeRO-3, offload file",
        "",
        "| rank | baseline MiB | build peak MiB | step peak MiB | predicted MiB | peak / "
        "predicted | step s (median) | tier read / written per step (GB) | model (GB) | disks "
        "read / written per step, all ranks (GB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, res in enumerate(result["ranks"]):
        steps = res["steps"][1:] or res["steps"]  # the first step creates the state files
        med = sorted(s["seconds"] for s in steps)[len(steps) // 2]
        tr = sum(s["tier_read"] for s in steps) / len(steps) / 1e9
        tw = sum(s["tier_written"] for s in steps) / len(steps) / 1e9
        dr = sum(s["disk_read"] for s in steps) / len(steps) / 1e9
        dw = sum(s["disk_written"] for s in steps) / len(steps) / 1e9
        n = res["chunk_elements"] * 4
        peak = (res["step_peak"] - res["baseline"]) / mib
        lines.append(
            f"| {r} | {res['baseline'] / mib:,.0f} | "
            f"{(res['build_peak'] - res['baseline']) / mib:,.0f} | {peak:,.0f} | "
            f"{pred / mib:,.0f} | {peak / (pred / mib):.2f} | {med:.1f} | {tr:.2f} / {tw:.2f} | "
            f"{5 * n / 1e9:.2f} / {3 * n / 1e9:.2f} | {dr:.2f} / {dw:.2f} |"
        )
    losses = [s["loss"] for s in result["ranks"][0]["steps"]]
    lines += ["", "losses: " + ", ".join(f"{v:.4f}" for v in losses)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--factor", type=float, default=1.5, help="state bytes / free memory")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--offload-dir", default=None, help="folder for the files (default: temp)")
    p.add_argument("--data", default="shakespeare", help="the text to train on")
    p.add_argument("--prefetch-depth", type=int, default=1, help="ZeRO-3 units gathered ahead")
    p.add_argument("--layers", type=int, default=None, help="blocks (default: from --factor)")
    args = p.parse_args(argv)
    if any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        # glibc reads these at process start and the forked ranks inherit its state: restart,
        # so that freed tensors leave the resident set (the build's pieces would otherwise
        # stay in glibc's heap through the steps)
        script = [sys.executable, str(Path(__file__).resolve()), *(argv or sys.argv[1:])]
        os.execve(sys.executable, script, {**os.environ, **MALLOC_ENV})
    from gnnpar.testing import run_distributed

    available = mem_available()
    layers = args.layers or layers_for(args.factor * available)
    params = gpt_params(layers)
    parts = predicted(layers, args.prefetch_depth)
    folder = tempfile.mkdtemp(prefix="gnnpar-offload-", dir=args.offload_dir)
    print(f"{params / 1e9:.2f}B parameters ({layers} blocks): "
          f"{params * BYTES_PER_PARAM / 1e9:.1f} GB of state, "
          f"{available / 1e9:.1f} GB free; files in {folder}", flush=True)  # fmt: skip
    try:
        ranks = run_distributed(
            _rank,
            RANKS,
            layers,
            args.steps,
            folder,
            args.data,
            args.prefetch_depth,
            timeout=4 * 3600,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {
        "layers": layers,
        "params": params,
        "available_gb": available / 1e9,
        "state_gb": params * BYTES_PER_PARAM / 1e9,
        "predicted": parts,
        "predicted_rss": sum(v for k, v in parts.items() if k != "file"),
        "ranks": ranks,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    depth = args.prefetch_depth
    name = "offload.json" if depth == 1 else f"offload-depth{depth}.json"
    (OUT / name).write_text(json.dumps({**result, "prefetch_depth": args.prefetch_depth}, indent=1))
    print(table(result))
    return 0 if math.isfinite(ranks[0]["steps"][-1]["loss"]) else 1


if __name__ == "__main__":
    sys.exit(main())
