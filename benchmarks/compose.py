"""Composition benchmark: ``gnnpar train gpt``'s step — tensor parallelism, then
``gnnpar.shard`` — beside the PyTorch recipes for the same parallelism, on the same GPT.

Three pairs on 4 CPU ranks over gloo, each pair in the same run, its two sides alternating
in fresh process worlds, ``--repeats`` (5) runs each:

1. ``data=4``, ZeRO-3            beside FSDP2 ``fully_shard`` (per block, then the root);
2. ``data=2,x=2``, ZeRO-3        beside FSDP2 over dp + DTensor tensor parallelism over tp on
                                 the same 2-D mesh (the torchtitan recipe);
3. ``data=2,x=2``, stage 0       beside DDP over dp + DTensor tensor parallelism over tp.

The model is our GPT with the block stack of ``benchmarks/sharding.py`` — 10 blocks of width
768, 12 heads — and a vocabulary of 64 and 64 positions: 70.9M parameters. A step is AdamW
(lr 1e-4, weight decay 0.1 on matrices), gradient-norm clipping at 1.0, float32, on a global
batch of 8 sequences of 64 tokens (2 per data rank at data=4, 4 at data=2); DTensor's plan is
Megatron's (q/k/v and fc column-wise, the projections row-wise, the fused q/k/v rows ordered
so each rank holds whole heads, as ours); their embeddings and head stay replicated, ours are
split too (vocabulary-parallel loss). Ours steps with torch's fused AdamW kernel (what
``gnnpar train gpt`` uses on the host and on CUDA); the peers keep their recipes' optimizer,
torch's default (the per-tensor loop on the host), unless ``--peer-fused`` gives them the fused
kernel too.

Per run: **step time** — the median of the timed steps, of the slowest rank; **CPU time**
per step and rank (all threads; far less sensitive than wall time to other jobs on a shared
machine, though blind to waiting); **memory** —
peak RSS during the timed steps (the high-water mark reset after the warm-up steps) minus
the idle baseline (the process's RSS after torch.distributed is up, before the model exists),
the largest over ranks; both numbers are kept. Figures are medians over the runs, with their
spread; the ratios ours / peer of the medians are held against the targets (step ≤ 0.9×,
memory ≤ 1.0×).

``--planner-memory`` instead holds the planner's per-rank memory prediction against the
measured peak (minus the baseline) of ``gnnpar train gpt``'s step on 8 ranks, for every
shape with data ≥ 2 and every ZeRO stage.

``--checkpointing`` instead runs the step with each ``activation_checkpointing`` mode
(none, full, selective; :mod:`gnnpar.recompute`) on ``--ckpt-grid`` (default ``data=2,x=2``,
ZeRO-3, 4 ranks), the modes alternating in fresh worlds, ``--repeats`` runs each, with
``--seq`` tokens per sequence (positions grown to fit) and ``--dropout`` (with dropout the
host's attention runs unfused and keeps its scores, what selective recompute drops): step
time, peak RSS minus the idle baseline and the baseline, beside the planner's predicted
memory and step time for the same run, and each mode's ratio to none, measured and predicted.

    python benchmarks/compose.py                  # the three pairs (about 30 min on 2 cores)
    python benchmarks/compose.py --planner-memory # 40 runs of 8 ranks
    python benchmarks/compose.py --quick          # a small model, 2 runs each
    python benchmarks/compose.py --checkpointing --seq 256 --repeats 2   # recompute modes
    python benchmarks/compose.py --checkpointing --seq 256 --repeats 2 --dropout 0.1
    python benchmarks/compose.py --pairs d2x2-zero0 --peer-fused   # one pair, fused peers
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.sharding import MALLOC_ENV, _reset_peak_rss, _rss_kb  # noqa: E402
from gnnpar.testing import run_distributed  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
PAIRS = {
    "d4-zero3": ({"grid": "data=4", "zero_stage": 3}, "fsdp2"),
    "d2x2-zero3": ({"grid": "data=2,x=2", "zero_stage": 3}, "fsdp2+tp"),
    "d2x2-zero0": ({"grid": "data=2,x=2", "zero_stage": 0}, "ddp+tp"),
}
TARGETS = {"time": 0.9, "memory": 1.0}


def model_sizes(quick: bool) -> dict[str, int]:
    """The GPT's sizes (the full benchmark: 70.9M parameters)."""
    if quick:
        return {"vocab_size": 64, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 128}
    return {"vocab_size": 64, "block_size": 64, "n_layer": 10, "n_head": 12, "n_embd": 768}


class Tokens:
    """Random tokens: the corpus every side trains on (a pure function of the seed)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def split(self, val_fraction: float):
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, self.vocab_size, (100_000,), generator=gen)
        return ids, ids[:20_000]  # a validation batch of long sequences fits too


# ------------------------------------------------------------------------ one rank's run
def _ours(cfg: dict[str, Any], parallel: dict[str, Any]):
    from gnnpar.models.gpt.task import GPTTaskConfig
    from gnnpar.train.spec import build_task

    task_cfg = GPTTaskConfig(
        **cfg["sizes"], batch_size=cfg["batch"], lr=1e-4, min_lr=1e-4, warmup=1,
        steps=1000, sample_tokens=0, grad_clip=1.0, **parallel,
    )  # fmt: skip
    task = build_task("gpt", task_cfg, corpus=Tokens(cfg["sizes"]["vocab_size"]))
    return lambda step: task.train_step(step)["loss"]


def _peer(cfg: dict[str, Any], kind: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from benchmarks.tensor_parallel import _permute_qkv_for_dtensor
    from gnnpar.data.text import TokenBlocks
    from gnnpar.models.gpt.model import GPT, GPTConfig

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1337)
    model = GPT(GPTConfig(**cfg["sizes"]))
    tp = 1 if kind == "fsdp2" else 2
    dp = world // tp
    if tp > 1:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        _permute_qkv_for_dtensor(model, tp)
        plan = {
            "attn.qkv": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(),
        }
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = init_device_mesh("cpu", (world,))
    if kind in ("fsdp2", "fsdp2+tp"):
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        net = model
    else:  # DDP over dp, after TP (torch's own composition of the two)
        from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform
        from torch.nn.parallel import DistributedDataParallel

        _pre_dp_module_transform(model)
        net = DistributedDataParallel(model, device_mesh=dp_mesh)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-4,
        betas=(0.9, 0.99),
        fused=True if cfg.get("peer_fused") else None,
    )
    train, _ = Tokens(cfg["sizes"]["vocab_size"]).split(0.05)
    shard = rank // tp  # the data-parallel rank: tp ranks share a batch
    blocks = TokenBlocks(train, cfg["sizes"]["block_size"], cfg["batch"], shard, dp, 1337)

    params = list(model.parameters())

    def step(i: int) -> float:
        x, y = blocks.batch(i)
        loss = F.cross_entropy(net(x).reshape(-1, cfg["sizes"]["vocab_size"]), y.reshape(-1))
        loss.backward()
        _clip(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()  # the global batch's mean, as ours reports it
        dist.all_reduce(mean, group=dp_mesh.get_group())
        return float(mean) / dp

    return step


def _clip(params: list, max_norm: float) -> None:
    """Gradient-norm clipping over parameters that live on different device meshes (the
    tensor-parallel blocks on (dp, tp), the rest on dp): one norm per mesh, combined, as
    torchtitan does."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list] = {}
    for p in params:
        if p.grad is not None:
            g = p.grad
            key = None
            if isinstance(g, DTensor):
                key = (g.device_mesh.mesh_dim_names, g.device_mesh.ndim)
            groups.setdefault(key, []).append(p)
    total = torch.zeros(())
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total = total + norm**2
    for group in groups.values():  # foreach kernels take one mesh at a time
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.sqrt())


def _rank(side: str, cfg: dict[str, Any]) -> dict[str, Any]:
    import gnnpar

    grid = gnnpar.init()  # torch.distributed up: what the idle process holds
    import gc

    # the first optimizer step and backward import and set up modules (torch._dynamo, ...)
    # that any run pays for: warm them up before the baseline, on a tiny tensor
    w = torch.zeros(2, requires_grad=True)
    (w * 2).sum().backward()
    torch.optim.AdamW([w]).step()
    gc.collect()
    baseline = _rss_kb("VmRSS") / 1024
    if side.startswith("ours:"):
        step = _ours(cfg, json.loads(side[5:]))
    else:
        step = _peer(cfg, side)
    for i in range(cfg["warmup"]):
        step(i)
    gc.collect()
    reset = _reset_peak_rss()
    times, cpu = [], []
    for i in range(cfg["warmup"], cfg["warmup"] + cfg["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step(i)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = _rss_kb("VmHWM") / 1024
    gnnpar.shutdown(grid)
    return {"step_s": statistics.median(times), "cpu_s": statistics.median(cpu),
            "peak_mb": peak, "baseline_mb": baseline, "reset": reset, "loss": loss}  # fmt: skip


def run_side(side: str, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One run of one side on ``world`` ranks (in this process's children)."""
    env = {"OMP_NUM_THREADS": "1", **MALLOC_ENV}
    ranks = run_distributed(_rank, world, side, cfg, timeout=cfg["timeout"], env=env)
    return {
        "step_s": max(r["step_s"] for r in ranks),
        "cpu_s": sum(r["cpu_s"] for r in ranks) / len(ranks),
        "memory_mb": max(r["peak_mb"] - r["baseline_mb"] for r in ranks),
        "peak_mb": max(r["peak_mb"] for r in ranks),
        "baseline_mb": max(r["baseline_mb"] for r in ranks),
        "loss": ranks[0]["loss"],
    }


def _fresh(
    side: str, world: int, cfg: dict[str, Any], script: str = __file__
) -> dict[str, Any] | str:
    """``run_side`` of ``script`` (a benchmark with ``--side``, ``--world``, ``--side-out``
    and ``--config``; this one by default) in a new Python process, so its memory (and its
    compile caches) start clean; its JSON result, or the tail of its error output."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "side.json"
        cmd = [sys.executable, script, "--side", side, "--world", str(world),
               "--side-out", str(out), "--config", json.dumps(cfg)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg["timeout"] + 120,
                              env=dict(os.environ, **MALLOC_ENV))  # fmt: skip
        if proc.returncode != 0 or not out.is_file():
            return "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-12:])
        return json.loads(out.read_text())


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# ------------------------------------------------------------------------------ the pairs
def pairs(cfg: dict[str, Any], repeats: int, names: list[str]) -> dict[str, Any]:
    """The pairs ``names``, their sides alternating in fresh worlds, ``repeats`` runs each."""
    results: dict[str, Any] = {}
    for name in names:
        parallel, peer = PAIRS[name]
        sides = {"ours": "ours:" + json.dumps(parallel), "peer": peer}
        runs: dict[str, list] = {"ours": [], "peer": []}
        for r in range(repeats):
            order = ("ours", "peer") if r % 2 == 0 else ("peer", "ours")
            for who in order:
                runs[who].append(_fresh(sides[who], 4, cfg))
                print(f"{name} {who} run {r + 1}: {runs[who][-1]}", file=sys.stderr, flush=True)
        row: dict[str, Any] = {"peer_name": peer, "parallel": parallel, "runs": runs}
        for who in ("ours", "peer"):
            ok = [x for x in runs[who] if isinstance(x, dict)]
            if ok:
                row[who] = {k: _spread([x[k] for x in ok]) for k in
                            ("step_s", "cpu_s", "memory_mb", "peak_mb", "baseline_mb")}  # fmt: skip
                row[who]["loss"] = ok[0]["loss"]
        if "ours" in row and "peer" in row:
            for k, key in (("time", "step_s"), ("cpu", "cpu_s"), ("memory", "memory_mb")):
                row[f"{k}_ratio"] = row["ours"][key]["median"] / row["peer"][key]["median"]
        results[name] = row
    return results


def _cell(d: dict[str, float], fmt: str) -> str:
    """``median (min–max)`` of a spread."""
    return f"{d['median']:{fmt}} ({d['min']:{fmt}}–{d['max']:{fmt}})"


def pairs_table(results: dict[str, Any], cfg: dict[str, Any]) -> str:
    lines = [
        f"GPT of {cfg['params'] / 1e6:.1f}M parameters, global batch {cfg['batch']} x "
        f"{cfg['sizes']['block_size']} tokens, 4 ranks; medians of {cfg['repeats']} runs "
        "(min-max); memory = peak RSS of the steps minus the idle baseline",
        "",
        "| gnnpar train gpt | peer | step (s): ours / peer | × peer | CPU s/step/rank | × peer "
        "| memory (MB): ours / peer | × peer | baseline (MB) ours / peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        if "ours" not in row or "peer" not in row:
            lines.append(f"| {name} | {row['peer_name']} | failed: see JSON | | | | | | |")
            continue
        o, p = row["ours"], row["peer"]

        lines.append(
            f"| {row['parallel']['grid']}, ZeRO-{row['parallel']['zero_stage']} "
            f"| {row['peer_name']} "
            f"| {_cell(o['step_s'], '.2f')} / {_cell(p['step_s'], '.2f')} | "
            f"**{row['time_ratio']:.2f}×** | {o['cpu_s']['median']:.2f} / "
            f"{p['cpu_s']['median']:.2f} | {row['cpu_ratio']:.2f}× | "
            f"{_cell(o['memory_mb'], '.0f')} / "
            f"{_cell(p['memory_mb'], '.0f')} | **{row['memory_ratio']:.2f}×** | "
            f"{o['baseline_mb']['median']:.0f} / {p['baseline_mb']['median']:.0f} |"
        )
    lines.append(f"\ntargets: step time ≤ {TARGETS['time']}× the peer's, memory ≤ "
                 f"{TARGETS['memory']}×")  # fmt: skip
    return "\n".join(lines)


# ------------------------------------------------------------------ planner vs measured
def planner_memory(cfg: dict[str, Any], stages: tuple[int, ...] = (0, 1, 2, 3)) -> list[dict]:
    """Predicted vs measured per-rank memory of the gpt task's step, every 8-rank shape with
    data ≥ 2, for each ZeRO stage of ``stages``."""
    from gnnpar.grid import factorizations
    from gnnpar.models.gpt.cost import GPTProblem
    from gnnpar.models.gpt.model import GPTConfig
    from gnnpar.models.gpt.planning import rank_gpt
    from gnnpar.plan.machines import local_machine

    machine = local_machine("gloo", devices=8)
    rows = []
    for stage in stages:
        problem = GPTProblem(GPTConfig(**cfg["sizes"]), batch=cfg["batch"], element_size=4,
                             stage=stage)  # fmt: skip
        predicted = {
            tuple(c.shape[a] for a in ("data", "x", "y", "z")): c
            for c in rank_gpt(problem, 8, machine)
        }
        for d, x, y, z in factorizations(8):
            if d < 2:
                continue
            c = predicted[(d, x, y, z)]
            parallel = {"grid": f"data={d},x={x},y={y},z={z}", "zero_stage": stage}
            got = _fresh("ours:" + json.dumps(parallel), 8, cfg)
            row = {"shape": parallel["grid"], "stage": stage,
                   "predicted_mb": c.memory_bytes / 1e6 if c.fits or c.memory else None,
                   "parts_mb": {k: v / 1e6 for k, v in c.memory.items()}}  # fmt: skip
            if isinstance(got, dict):
                row["measured_mb"] = got["memory_mb"]
                row["baseline_mb"] = got["baseline_mb"]
                if row["predicted_mb"]:
                    row["ratio"] = got["memory_mb"] / row["predicted_mb"]
            else:
                row["error"] = got
            print(f"planner memory {row}", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


# ------------------------------------------------------------- activation checkpointing
CKPT_MODES = ("none", "full", "selective")


def checkpointing(cfg: dict[str, Any], grid: str, stage: int, repeats: int) -> dict[str, Any]:
    """Each mode of :data:`CKPT_MODES` on ``grid``, alternating in fresh worlds, with the
    planner's prediction for the same run (memory of rank 0, step seconds)."""
    from gnnpar.grid import parse_grid_spec
    from gnnpar.models.gpt.cost import GPTProblem
    from gnnpar.models.gpt.model import GPTConfig
    from gnnpar.models.gpt.planning import rank_gpt
    from gnnpar.plan.machines import local_machine

    shape = {"data": 1, "x": 1, "y": 1, "z": 1, **parse_grid_spec(grid)}
    world = shape["data"] * shape["x"] * shape["y"] * shape["z"]
    machine = local_machine("gloo", devices=world)
    runs: dict[str, list] = {m: [] for m in CKPT_MODES}
    for r in range(repeats):
        order = CKPT_MODES if r % 2 == 0 else CKPT_MODES[::-1]
        for mode in order:
            parallel = {"grid": grid, "zero_stage": stage, "activation_checkpointing": mode}
            runs[mode].append(_fresh("ours:" + json.dumps(parallel), world, cfg))
            print(f"checkpointing {mode} run {r + 1}: {runs[mode][-1]}", file=sys.stderr,
                  flush=True)  # fmt: skip
    rows: dict[str, Any] = {}
    for mode in CKPT_MODES:
        problem = GPTProblem(GPTConfig(**cfg["sizes"]), batch=cfg["batch"], element_size=4,
                             stage=stage, grad_clip=True, schedule=None,
                             activation_checkpointing=mode)  # fmt: skip
        cand = next(c for c in rank_gpt(problem, world, machine)
                    if all(c.shape.get(a, 1) == v for a, v in shape.items()))  # fmt: skip
        row: dict[str, Any] = {"runs": runs[mode], "predicted_mb": cand.memory_bytes / 1e6,
                               "predicted_parts_mb": {k: v / 1e6 for k, v in cand.memory.items()},
                               "predicted_step_s": cand.step_seconds}  # fmt: skip
        ok = [x for x in runs[mode] if isinstance(x, dict)]
        if ok:
            for key in ("step_s", "cpu_s", "memory_mb", "peak_mb", "baseline_mb"):
                row[key] = _spread([x[key] for x in ok])
        rows[mode] = row
    for mode in CKPT_MODES:
        row, base = rows[mode], rows["none"]
        row["predicted_memory_vs_none"] = row["predicted_mb"] / base["predicted_mb"]
        row["predicted_step_vs_none"] = row["predicted_step_s"] / base["predicted_step_s"]
        if "memory_mb" in row and "memory_mb" in base:
            row["memory_vs_none"] = row["memory_mb"]["median"] / base["memory_mb"]["median"]
            row["step_vs_none"] = row["step_s"]["median"] / base["step_s"]["median"]
            row["cpu_vs_none"] = row["cpu_s"]["median"] / base["cpu_s"]["median"]
    return {"grid": grid, "stage": stage, "world": world, "modes": rows}


def checkpointing_table(res: dict[str, Any], cfg: dict[str, Any]) -> str:
    lines = [
        f"GPT of {cfg['params'] / 1e6:.1f}M parameters, global batch {cfg['batch']} x "
        f"{cfg['sizes']['block_size']} tokens, {res['grid']} ZeRO-{res['stage']}; medians of "
        f"{cfg['repeats']} runs (min-max)",
        "",
        "| activation checkpointing | step (s) | × none | CPU s/step/rank | × none | memory: peak "
        "− baseline (MB) | × none | baseline (MB) | planner: memory (MB) | × none | planner: "
        "step (s) | × none |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in res["modes"].items():
        if "memory_mb" not in r:
            lines.append(f"| {mode} | failed: see JSON | | | | | | | | | | |")
            continue

        lines.append(
            f"| {mode} | {_cell(r['step_s'], '.2f')} | {r.get('step_vs_none', float('nan')):.2f} "
            f"| {r['cpu_s']['median']:.2f} | {r.get('cpu_vs_none', float('nan')):.2f} "
            f"| {_cell(r['memory_mb'], '.0f')} | {r.get('memory_vs_none', float('nan')):.2f} "
            f"| {r['baseline_mb']['median']:.0f} | {r['predicted_mb']:.0f} "
            f"| {r['predicted_memory_vs_none']:.2f} | {r['predicted_step_s']:.3f} "
            f"| {r['predicted_step_vs_none']:.2f} |"
        )
    return "\n".join(lines)


def planner_table(rows: list[dict[str, Any]]) -> str:
    head = "| shape | ZeRO | predicted (MB) | measured peak − baseline (MB) | measured / predicted"
    lines = [head + " |", "|---|---|---|---|---|"]
    for r in rows:
        if "measured_mb" not in r:
            lines.append(f"| {r['shape']} | {r['stage']} | {r['predicted_mb']} | failed | |")
            continue
        lines.append(f"| {r['shape']} | {r['stage']} | {r['predicted_mb']:.0f} | "
                     f"{r['measured_mb']:.0f} | {r.get('ratio', float('nan')):.2f} |")  # fmt: skip
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    if ratios:
        inside = sum(0.75 <= q <= 1.25 for q in ratios)
        lines.append(f"\n{inside} of {len(ratios)} within ±25%; median ratio "
                     f"{statistics.median(ratios):.2f}")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="a small model, 2 runs each")
    p.add_argument("--planner-memory", action="store_true", help="planner vs measured memory")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages for --planner-memory")
    p.add_argument("--pairs", default=",".join(PAIRS), help="which pairs to run (comma list)")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing modes")
    p.add_argument("--ckpt-grid", default="data=2,x=2", help="grid of --checkpointing")
    p.add_argument("--ckpt-stage", type=int, default=3, help="ZeRO stage of --checkpointing")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (--checkpointing)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout (--checkpointing)")
    p.add_argument(
        "--peer-fused", action="store_true",
        help="give the peers torch's fused AdamW too (ours uses it; the peers' recipes keep "
        "torch's default, the per-tensor loop on the host)",
    )  # fmt: skip
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
    if args.seq:
        sizes["block_size"] = args.seq
    if args.dropout:
        sizes["dropout"] = args.dropout
    from gnnpar.models.gpt.model import GPT, GPTConfig

    with torch.device("meta"):
        params = sum(t.numel() for t in GPT(GPTConfig(**sizes)).parameters())
    cfg = {"sizes": sizes, "batch": 8, "warmup": 2, "steps": 3 if args.quick else 4,
           "timeout": 1800, "params": params,
           "repeats": 2 if args.quick else args.repeats}  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    tag = "-quick" if args.quick else ""
    if args.planner_memory:
        cfg["steps"] = 2  # a peak, not a time: two measured steps reach it
        stages = tuple(int(s) for s in args.stages.split(","))
        rows = planner_memory(cfg, stages)
        part = "" if stages == (0, 1, 2, 3) else "-stages" + "".join(map(str, stages))
        (OUT / f"compose-planner-memory{tag}{part}.json").write_text(json.dumps(rows, indent=1))
        print(planner_table(rows))
        return 0
    if args.checkpointing:
        res = checkpointing(cfg, args.ckpt_grid, args.ckpt_stage, cfg["repeats"])
        res["load_average"] = os.getloadavg()
        res["config"] = cfg
        name = f"compose-checkpointing{tag}-seq{sizes['block_size']}"
        name += f"-dropout{args.dropout:g}.json" if args.dropout else ".json"
        (OUT / name).write_text(json.dumps(res, indent=1))
        print(checkpointing_table(res, cfg))
        print(f"load average {os.getloadavg()[0]:.1f}")
        return 0
    names = [n for n in args.pairs.split(",") if n]
    unknown = sorted(set(names) - set(PAIRS))
    if unknown:
        p.error(f"unknown pair(s) {', '.join(unknown)}; known: {', '.join(PAIRS)}")
    cfg["peer_fused"] = args.peer_fused
    results = pairs(cfg, cfg["repeats"], names)
    doc = {"config": cfg, "pairs": results, "load_average": os.getloadavg()}
    if args.peer_fused:
        tag += "-peer-fused"
    if names != list(PAIRS):
        tag += "-" + "-".join(names)
    (OUT / f"compose{tag}.json").write_text(json.dumps(doc, indent=1))
    print(pairs_table(results, cfg))
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
