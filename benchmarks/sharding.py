"""Sharded data parallelism benchmark: our stage 3 (and FCDP) beside PyTorch FSDP2
(``fully_shard``) and DeepSpeed ZeRO-3, on the same stack of GPT blocks, CPU ranks over gloo.

Every implementation trains the same model (``--blocks`` GPT blocks of width ``--width``,
about 71M parameters by default; one unit per block) from the same seed on the same data with
AdamW in float32, and reports per rank:

- **step time**: median over the timed steps (after ``--warmup`` steps) of the slowest rank,
  best of ``--repeats`` runs, each run in a fresh process (the machine is shared);
- **CPU time** per step and rank (all threads of the process, median, best run): what the
  step costs in processor work — far less sensitive than wall time to other jobs on a loaded
  machine, though it does not show waiting;
- **peak RSS during training**: the process's resident-set high-water mark, reset after the
  model is built and sharded (``/proc/self/clear_refs``), read after the last step — so it
  covers the training steps, not building the full model; the largest over ranks. Every run
  sets ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed tensors return to the system and RSS
  follows the live tensors rather than glibc's retained heap;
- **loss** after the last step (the implementations must agree);
- **bytes** per step (ours only, from ``gnnpar.comm.record``): data-axis all-gather (which
  crosses nodes), intra-node all-gather, reduce-scatter.

FCDP runs with ``ranks_per_node`` = half the ranks (two simulated nodes), so its inter-node
all-gather bytes can be set beside stage 3's (ZeRO-3 moves the same as our stage 3: two
all-gathers and one reduce-scatter of Ψ per step).

The memory tiers (``--impls tiers``): our stage 3 alone, with ``offload="host"`` and with
``offload="file"`` (:mod:`gnnpar.shard.offload`), and DeepSpeed ZeRO-3 with
``offload_optimizer: cpu`` (its DeepSpeedCPUAdam, a C++ op it compiles on first use), with
per rank the **peak RSS and peak RssAnon over the idle process** (measured after imports
and the process group, before the model is built; RssAnon sampled every 2 ms during the
steps, the kernel keeping no high-water mark of it): the file tier's masters and optimizer
state are file-backed pages, which count in RSS but not in RssAnon.

Run::

    python benchmarks/sharding.py              # 2 and 4 ranks, 3 runs each: ~25 min on 2 cores
    python benchmarks/sharding.py --quick      # a smaller model, one run each
    python benchmarks/sharding.py --impls tiers --repeats 1   # the memory tiers

Writes ``benchmarks/out/sharding.json`` and prints the table with the ratios and targets:
peak memory ≤ FSDP2's, step time ≤ 1.1× FSDP2's, FCDP inter-node all-gather bytes 0.5× ZeRO-3's.
DeepSpeed is skipped (and said so) when it is not installed
(``DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from gnnpar.models.gpt.model import Block, GPTConfig  # noqa: E402
from gnnpar.testing import run_distributed  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
TARGETS = {"memory_vs_fsdp2": 1.0, "time_vs_fsdp2": 1.1, "fcdp_inter_node_bytes": 0.5}
IMPLS = ("ours", "fcdp", "fsdp2", "deepspeed", "host", "file", "deepspeed-offload")
#: The memory-tier comparison (``--impls tiers``): stage 3, + offload to host, + file tier,
#: DeepSpeed ZeRO-3 with its optimizer offloaded to the CPU.
TIERS = ("ours", "host", "file", "deepspeed-offload")
# A fixed mmap threshold (glibc's initial one) stops glibc from raising it after the first
# large free, so freed tensors go back to the system and RSS follows the live tensors instead
# of the allocator's retained heap. The same for every implementation.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


class BlockStack(nn.Module):
    """``n`` GPT blocks (pre-norm attention + MLP) on float inputs of shape (B, T, width)."""

    def __init__(self, width: int, blocks: int, heads: int, seq: int):
        super().__init__()
        cfg = GPTConfig(vocab_size=8, block_size=seq, n_layer=blocks, n_head=heads, n_embd=width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        for b in self.blocks:
            x = b(x)
        return x


# ----------------------------------------------------------------------------- memory
def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class _AnonPeak:
    """The largest RssAnon seen while it runs: a thread samples ``/proc/self/status`` every
    ``every`` seconds (the kernel keeps a high-water mark of RSS, ``VmHWM``, but not of its
    anonymous part, which is what the file tier lowers: mapped file pages count in RSS)."""

    def __init__(self, every: float = 0.002):
        import threading

        self.every = every
        self.peak = _rss_kb("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, _rss_kb("RssAnon"))

    def __enter__(self) -> _AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_kb("RssAnon"))


def _rss_kb(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# ------------------------------------------------------------------------ one rank's run
def _setup_ours(model: nn.Module, fcdp: bool, rpn: int, offload: str = "none", folder=None):
    import gnnpar
    from gnnpar.shard import FCDP, by_type, shard

    grid = gnnpar.init(ranks_per_node=rpn)
    dp = shard(
        model,
        grid,
        3,
        units=by_type(Block),
        fcdp=FCDP() if fcdp else None,
        offload=offload,
        offload_dir=folder if offload == "file" else None,
    )
    opt = dp.attach(torch.optim.AdamW(dp.parameters(), lr=1e-4))

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step, grid, dp


def _setup_fsdp2(model: nn.Module):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _setup_deepspeed(model: nn.Module, micro_batch: int, offload: bool = False):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    zero: dict[str, Any] = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if offload:
        # ZeRO-Offload: optimizer state and step on the CPU, with DeepSpeed's own CPU Adam
        # (DeepSpeedCPUAdam, a C++ op it builds on first use), as its documentation runs it
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-4}}
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(x, y):
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss

    return step


def _rank(impl: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of one run: build, shard, train, measure."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gc.collect()
    idle_rss, idle_anon = _rss_kb("VmRSS"), _rss_kb("RssAnon")  # before anything is built
    torch.manual_seed(0)
    model = BlockStack(cfg["width"], cfg["blocks"], cfg["heads"], cfg["seq"])
    numel = sum(p.numel() for p in model.parameters())
    grid = dp = None
    if impl in ("ours", "fcdp", "host", "file"):
        rpn = max(1, world // 2) if impl == "fcdp" else world
        offload = impl if impl in ("host", "file") else "none"
        step, grid, dp = _setup_ours(model, impl == "fcdp", rpn, offload, cfg.get("offload_dir"))
    elif impl == "fsdp2":
        step = _setup_fsdp2(model)
    elif impl in ("deepspeed", "deepspeed-offload"):
        step = _setup_deepspeed(model, cfg["batch"], offload=impl == "deepspeed-offload")
    else:
        raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")
    g = torch.Generator().manual_seed(1000 + rank)
    shape = (cfg["batch"], cfg["seq"], cfg["width"])
    xs = [torch.randn(shape, generator=g) for _ in range(2)]
    ys = [torch.randn(shape, generator=g) for _ in range(2)]
    gc.collect()
    rss_start = _rss_kb("VmRSS")
    reset = _reset_peak_rss()
    times, cpu = [], []
    loss = None
    with _AnonPeak() as anon:
        for i in range(cfg["warmup"] + cfg["steps"]):
            t0, c0 = time.perf_counter(), time.process_time()
            loss = step(xs[i % 2], ys[i % 2])
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if i >= cfg["warmup"]:
                times.append(dt)
                cpu.append(dc)
    peak = _rss_kb("VmHWM")
    out: dict[str, Any] = {
        "rank": rank,
        "times": times,
        "step_s": statistics.median(times),
        "cpu_s": statistics.median(cpu),
        "peak_rss_mb": peak / 1024,
        "rss_start_mb": rss_start / 1024,
        # over the idle process (imports and process group only), during the training steps
        "peak_rss_over_idle_mb": (peak - idle_rss) / 1024,
        "peak_anon_over_idle_mb": (anon.peak - idle_anon) / 1024,
        "peak_reset": reset,
        "loss": float(loss.detach()),
        "numel": numel,
    }
    if grid is not None:
        from gnnpar import comm

        with comm.record(grid) as t:
            step(xs[0], ys[0])
        out["bytes"] = t.as_dict()
        out["tensor_bytes"] = dp.memory()
    return out


def run_case(impl: str, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One run of ``impl`` on ``world`` ranks (in this process's children)."""
    env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    with tempfile.TemporaryDirectory(prefix="offload-") as folder:  # the file tier's
        cfg = {**cfg, "offload_dir": folder}
        ranks = run_distributed(_rank, world, impl, cfg, timeout=cfg["timeout"], env=env)
    return {
        "impl": impl,
        "world": world,
        "step_s": max(r["step_s"] for r in ranks),  # the slowest rank sets the pace
        "cpu_s": sum(r["cpu_s"] for r in ranks) / len(ranks),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "rss_start_mb": max(r["rss_start_mb"] for r in ranks),
        "peak_rss_over_idle_mb": max(r["peak_rss_over_idle_mb"] for r in ranks),
        "peak_anon_over_idle_mb": max(r["peak_anon_over_idle_mb"] for r in ranks),
        "loss": ranks[0]["loss"],
        "numel": ranks[0]["numel"],
        "bytes": ranks[0].get("bytes"),
        "tensor_bytes": ranks[0].get("tensor_bytes"),
        "ranks": ranks,
    }


def _fresh(impl: str, world: int, cfg: dict[str, Any]) -> dict[str, Any] | str:
    """``run_case`` in a new Python process; the result, or the error text."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--case",
            impl,
            "--world",
            str(world),
            "--case-out",
            str(out),
            "--config",
            json.dumps(cfg),
        ]
        env = dict(os.environ, **MALLOC_ENV)
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=cfg["timeout"] + 120, env=env
        )
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            return "\n".join(tail)
        return json.loads(out.read_text())


# -------------------------------------------------------------------------------- table
def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else a / b


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Best-of-N per (impl, world) and the ratios against the targets."""
    best: dict[str, dict[str, Any]] = {}
    for key, runs in results["runs"].items():
        ok = [r for r in runs if isinstance(r, dict)]
        if not ok:
            best[key] = {"error": runs[-1] if runs else "not run"}
            continue
        fastest = min(ok, key=lambda r: r["step_s"])
        best[key] = {
            "step_s": fastest["step_s"],
            "cpu_s": min(r["cpu_s"] for r in ok),
            "peak_rss_mb": min(r["peak_rss_mb"] for r in ok),
            "rss_start_mb": min(r["rss_start_mb"] for r in ok),
            "peak_rss_over_idle_mb": min(r["peak_rss_over_idle_mb"] for r in ok),
            "peak_anon_over_idle_mb": min(r["peak_anon_over_idle_mb"] for r in ok),
            "loss": fastest["loss"],
            "bytes": fastest.get("bytes"),
            "tensor_bytes": fastest.get("tensor_bytes"),
            "runs": len(ok),
        }
    rows = []
    for world in results["worlds"]:
        fsdp = best.get(f"fsdp2/{world}", {})
        zero3 = best.get(f"ours/{world}", {})
        for impl in results["impls"]:
            b = best.get(f"{impl}/{world}")
            if b is None:
                continue
            row = {"impl": impl, "world": world, **b}
            row["time_vs_fsdp2"] = _ratio(b.get("step_s"), fsdp.get("step_s"))
            row["cpu_vs_fsdp2"] = _ratio(b.get("cpu_s"), fsdp.get("cpu_s"))
            row["memory_vs_fsdp2"] = _ratio(b.get("peak_rss_mb"), fsdp.get("peak_rss_mb"))
            if impl == "fcdp" and b.get("bytes") and zero3.get("bytes"):
                inter = b["bytes"]["data"]["all_gather"]
                row["inter_node_ag_vs_zero3"] = inter / zero3["bytes"]["data"]["all_gather"]
            rows.append(row)
    return {"rows": rows}


def _fmt(v: Any, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def table(summary: dict[str, Any]) -> str:
    """The printed table (and docs/sharding.md's)."""
    head = (
        "| ranks | implementation | step (s) | × FSDP2 | CPU s/step/rank | × FSDP2 "
        "| peak RSS (MB) | × FSDP2 | data all-gather (MB) | intra-node all-gather (MB) | loss |"
    )
    lines = [head, "|" + "---|" * 11]
    names = NAMES
    for r in summary["rows"]:
        if r["impl"] not in ("ours", "fcdp", "fsdp2", "deepspeed"):
            continue  # the memory tiers have their own table
        if "error" in r:
            msg = r["error"].splitlines()[-1] if r["error"] else "failed"
            lines.append(f"| {r['world']} | {names[r['impl']]} | failed: {msg[:80]} |||||||||")
            continue
        by = r.get("bytes") or {}
        ag = by.get("data", {}).get("all_gather")
        intra = by.get("data.intra", {}).get("all_gather")
        lines.append(
            f"| {r['world']} | {names[r['impl']]} | {r['step_s']:.2f} "
            f"| {_fmt(r['time_vs_fsdp2'], '.2f')} | {r['cpu_s']:.2f} "
            f"| {_fmt(r['cpu_vs_fsdp2'], '.2f')} | {r['peak_rss_mb']:.0f} "
            f"| {_fmt(r['memory_vs_fsdp2'], '.2f')} "
            f"| {_fmt(ag / 1e6 if ag else None, '.1f')} "
            f"| {_fmt(intra / 1e6 if intra else None, '.1f')} | {r['loss']:.5f} |"
        )
    return "\n".join(lines)


NAMES = {
    "ours": "gnnpar stage 3",
    "fcdp": "gnnpar FCDP",
    "fsdp2": "FSDP2 fully_shard",
    "deepspeed": "DeepSpeed ZeRO-3",
    "host": "gnnpar stage 3 + offload host",
    "file": "gnnpar stage 3 + offload file",
    "deepspeed-offload": "DeepSpeed ZeRO-3 + CPU offload",
}


def tiers_table(summary: dict[str, Any]) -> str:
    """The memory tiers: per-rank peak RSS and RssAnon over the idle process during the
    training steps (largest over ranks), step time, each against our stage 3."""
    lines = [
        "| ranks | implementation | step (s) | × stage 3 | CPU s/step/rank | peak RSS − idle (MB) "
        "| peak RssAnon − idle (MB) | × stage 3 | loss |",
        "|" + "---|" * 9,
    ]
    base = {r["world"]: r for r in summary["rows"] if r["impl"] == "ours" and "error" not in r}
    for r in summary["rows"]:
        if r["impl"] not in TIERS:
            continue
        if "error" in r:
            msg = r["error"].splitlines()[-1] if r["error"] else "failed"
            lines.append(f"| {r['world']} | {NAMES[r['impl']]} | failed: {msg[:100]} |||||||")
            continue
        b = base.get(r["world"], {})
        anon = _ratio(r["peak_anon_over_idle_mb"], b.get("peak_anon_over_idle_mb"))
        lines.append(
            f"| {r['world']} | {NAMES[r['impl']]} | {r['step_s']:.2f} "
            f"| {_fmt(_ratio(r['step_s'], b.get('step_s')), '.2f')} | {r['cpu_s']:.2f} "
            f"| {r['peak_rss_over_idle_mb']:.0f} | {r['peak_anon_over_idle_mb']:.0f} "
            f"| {_fmt(anon, '.2f')} "
            f"| {r['loss']:.5f} |"
        )
    return "\n".join(lines)


def verdicts(summary: dict[str, Any]) -> list[str]:
    """One line per target: met or missed, with the number."""
    out = []
    for r in summary["rows"]:
        if "error" in r:
            continue
        w = r["world"]
        if r["impl"] == "ours":
            t, m = r["time_vs_fsdp2"], r["memory_vs_fsdp2"]
            if t is not None:
                ok = "met" if t <= TARGETS["time_vs_fsdp2"] else "missed"
                out.append(f"{w} ranks: step time {t:.2f}× FSDP2 (target ≤ 1.1×): {ok}")
            if m is not None:
                ok = "met" if m <= TARGETS["memory_vs_fsdp2"] else "missed"
                out.append(f"{w} ranks: peak RSS {m:.2f}× FSDP2 (target ≤ 1.0×): {ok}")
        if r["impl"] == "fcdp" and r.get("inter_node_ag_vs_zero3") is not None:
            v = r["inter_node_ag_vs_zero3"]
            ok = "met" if abs(v - 0.5) < 1e-9 else "missed"
            out.append(f"{w} ranks: FCDP inter-node all-gather {v:.3f}× ZeRO-3 (target 0.5×): {ok}")
    return out


# --------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Run every case (or one, with ``--case``) and write the JSON and the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small model, one run per case")
    ap.add_argument("--worlds", default="2,4", help="rank counts, e.g. 2,4")
    ap.add_argument(
        "--impls",
        default=",".join(IMPLS[:4]),
        help=f"which implementations, of {', '.join(IMPLS)}; 'tiers' for {', '.join(TIERS)}",
    )
    ap.add_argument("--repeats", type=int, default=None, help="runs per case (best counts)")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=str(OUT / "sharding.json"), help="JSON file to write")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--case-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.case is not None:  # one run, in this fresh process
        result = run_case(args.case, args.world, json.loads(args.config))
        Path(args.case_out).write_text(json.dumps(result))
        return 0

    if args.quick:
        args.width, args.blocks, args.heads, args.steps = 256, 4, 4, 3
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    cfg = {
        "width": args.width,
        "blocks": args.blocks,
        "heads": args.heads,
        "seq": args.seq,
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "timeout": 900,
    }
    worlds = [int(w) for w in args.worlds.split(",")]
    impls = list(TIERS) if args.impls == "tiers" else [i for i in args.impls.split(",") if i]
    for i in impls:
        if i not in IMPLS:
            raise SystemExit(f"unknown implementation {i!r}; choose from {', '.join(IMPLS)}")
    skipped = {}
    if importlib.util.find_spec("deepspeed") is None:
        for name in ("deepspeed", "deepspeed-offload"):
            if name in impls:
                impls.remove(name)
                skipped[name] = (
                    "not installed (DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)"
                )
    runs: dict[str, list] = {f"{i}/{w}": [] for w in worlds for i in impls}
    for rep in range(repeats):  # interleave implementations so load drifts hit all alike
        for w in worlds:
            for impl in impls:
                t0 = time.perf_counter()
                res = _fresh(impl, w, cfg)
                runs[f"{impl}/{w}"].append(res)
                status = (
                    f"{res['step_s']:.2f}s/step, {res['peak_rss_mb']:.0f} MB, over idle: RSS "
                    f"{res['peak_rss_over_idle_mb']:.0f} MB, RssAnon "
                    f"{res['peak_anon_over_idle_mb']:.0f} MB, loss {res['loss']:.5f}"
                    if isinstance(res, dict)
                    else "failed: " + res.splitlines()[-1]
                    if res
                    else "failed"
                )
                print(
                    f"[{rep + 1}/{repeats}] {impl:9s} {w} ranks: {status} "
                    f"({time.perf_counter() - t0:.0f}s)",
                    flush=True,
                )
    results = {
        "config": cfg,
        "worlds": worlds,
        "impls": impls,
        "skipped": skipped,
        "repeats": repeats,
        "runs": runs,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "deepspeed": _version("deepspeed"),
        },
        "targets": TARGETS,
        "malloc_env": MALLOC_ENV,
    }
    summary = summarize(results)
    results["summary"] = summary
    results["verdicts"] = verdicts(summary)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    numel = next((r["numel"] for v in runs.values() for r in v if isinstance(r, dict)), 0)
    print(
        f"\n{args.blocks} GPT blocks of width {args.width} ({numel / 1e6:.1f}M parameters), "
        f"{args.batch}×{args.seq} tokens per rank, AdamW float32, best of {repeats}\n"
    )
    print(table(summary))
    if any(i in TIERS[1:] for i in impls):
        print()
        print(tiers_table(summary))
    print()
    for line in results["verdicts"]:
        print(line)
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")
    print(f"\nwrote {out}")
    return 0


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


if __name__ == "__main__":
    sys.exit(main())
