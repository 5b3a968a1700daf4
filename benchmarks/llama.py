"""Llama benchmark: ``gnnpar train gpt --model llama``'s training step beside torchtitan's
recipe for the same parallelism, on the same model and the same batches, 4 CPU ranks over
gloo, float32.

- **Ours**: the command itself, ``gnnpar train gpt --model llama --grid data=2,x=2
  --zero-stage 3 --nprocs 4`` (our tensor parallelism over x, ZeRO-3 over data, torch's fused
  AdamW), read back from the run folder's ``metrics.jsonl``: each step's ``seconds`` (the
  trainer's wall time around the step, rank 0) and the ``memory`` record (every rank's peak
  RSS and its idle baseline).
- **Peer**: torchtitan's recipe in plain PyTorch (torchtitan is not needed): a 2-D
  ``DeviceMesh`` (dp=2, tp=2), the same :class:`~gnnpar.models.gpt.llama.Llama` built eagerly
  after the same ``torch.manual_seed``, tensor parallelism with ``parallelize_module``, then
  FSDP2 ``fully_shard`` over dp per block (the last block kept unsharded after forward, as
  torchtitan's default policy) and on the root; AdamW with torch's fused kernel
  (torchtitan's default), the gradient norm clipped at 1.0 over both mesh dimensions.
  ``--peer-plan torchtitan`` (default) is torchtitan's Llama plan: ``attn.qkv`` and
  ``mlp.gate_up`` column-wise (its q/k/v and w1/w3), ``attn.o_proj`` and ``mlp.down``
  row-wise with sequence-sharded output (wo, w2), the norms ``SequenceParallel``, the
  embedding row-wise (vocabulary-parallel), the head column-wise into ``loss_parallel``.
  ``--peer-plan blocks`` keeps only the four projections (embedding, norms and head
  replicated over tp, plain all-reduces in the blocks).

Our ``qkv`` is one projection laid out by key-value group, and ``gate_up`` is [gate; up]
(see :mod:`gnnpar.models.gpt.llama`). A plain column split of ``qkv`` gives each tp rank
contiguous rows, which are whole groups exactly when ``n_kv_head`` is a multiple of tp
(required here, as our trainer requires it); of ``gate_up`` it would give rank 0 all of gate
and rank 1 all of up, which is not SwiGLU. So before parallelizing, the peer's ``gate_up``
rows are reordered to [gate_0; up_0; gate_1; up_1] (rank r's halves side by side): the same
function and the same weights, stored so that a contiguous split is torchtitan's separate
w1/w3 splits. The first step's loss of both sides is printed and must agree to float32
rounding.

Both sides train on the built-in Shakespeare text (BPE, 2,048 ids, the trainer's cached
tokenization, read by every rank after its baseline with ``load_corpus``, rank 0 first, as
the trainer reads it), the same global batch of step ``i`` (``TokenBlocks``, seed 1337), a constant
learning rate, weight decay 0.1 on matrices, beta2 0.99. Each repetition runs both sides in
fresh process worlds, the order alternating; per run: **step time** = median of rank 0's
step times after ``--warmup`` steps; **memory** = the largest over ranks of peak RSS
(``ru_maxrss``, the whole run) minus the idle baseline (RSS when the rank is up, before the
process group, data and model: the trainer's own two numbers, ``gnnpar.train.metrics``; the
peer measures them with the same functions at the same point, its ranks forked, like our
launcher's, after importing torch, ``torch._dynamo`` and what they run; our command imports
more before it forks, so its baseline is higher). Ours' peak also covers the
trainer's end of run (one validation batch, ``--val-batches 1``, and the checkpoint), which
the peer does not do; the JSON keeps rank 0's peak after each step to tell them apart.
Every run sets ``MALLOC_MMAP_THRESHOLD_=131072`` (as ``benchmarks/sharding.py``), so RSS
follows live tensors. Reported: medians over ``--repeats`` runs (5) with min-max, and the
ratios ours / peer against the targets (step ≤ 0.9×, memory ≤ 1.0×).

Run::

    python benchmarks/llama.py                      # 4 layers of 256, 5 runs a side
    python benchmarks/llama.py --quick              # a tiny model, one run a side
    python benchmarks/llama.py --peer-plan blocks   # the peer with the four projections only

On 2 cores the default takes about 6 minutes (344–489 s measured at load average 7–9, from
other jobs), nearly all of it the start-up of the 10 fresh worlds; ``--quick`` under a
minute at moderate load (44 s at load 4; 67 s at load 9). Writes
``benchmarks/out/llama.json`` (``llama-quick.json``, ``llama-blocks.json``) and prints the
table.
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
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.compose import _clip  # noqa: E402
from benchmarks.fullgraph import _summary  # noqa: E402
from benchmarks.sharding import MALLOC_ENV  # noqa: E402
from gnnpar.testing import run_distributed  # noqa: E402
from gnnpar.train.metrics import peak_rss_mb, rss_mb  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
TARGETS = {"time": 0.9, "memory": 1.0}
WORLD, DP, TP = 4, 2, 2
SEED = 1337
PLANS = ("torchtitan", "blocks")


def model_sizes(quick: bool) -> dict[str, int]:
    """The Llama's sizes (vocabulary: the trainer's BPE of 2,048 ids)."""
    if quick:
        return {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "block_size": 32}
    return {"n_layer": 4, "n_head": 8, "n_kv_head": 2, "n_embd": 256, "block_size": 128}


def _threads() -> int:
    """Intra-op threads per rank, the same for both sides: what our launcher gives."""
    return max(1, (os.cpu_count() or 1) // WORLD)


# ---------------------------------------------------------------------------------- ours
def run_ours(cfg: dict[str, Any]) -> dict[str, Any] | str:
    """One run of ``gnnpar train gpt --model llama`` (a fresh launcher and 4 ranks); its
    numbers from ``metrics.jsonl``, or the tail of its output when it failed."""
    s = cfg["sizes"]
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [
            sys.executable, "-m", "gnnpar.cli", "train", "gpt", "--model", "llama",
            "--n-layer", str(s["n_layer"]), "--n-head", str(s["n_head"]),
            "--n-kv-head", str(s["n_kv_head"]), "--n-embd", str(s["n_embd"]),
            "--ffn-hidden", str(cfg["ffn_hidden"]), "--block-size", str(s["block_size"]),
            "--vocab-size", str(cfg["vocab_size"]), "--batch-size", str(cfg["batch"]),
            "--grid", f"data={DP},x={TP}", "--zero-stage", "3", "--nprocs", str(WORLD),
            "--steps", str(cfg["warmup"] + cfg["steps"]), "--lr", str(cfg["lr"]),
            "--lr-schedule", "constant", "--warmup", "0", "--seed", str(SEED),
            "--eval-every", "0", "--val-batches", "1", "--sample-tokens", "0", "--quiet",
            "--dtype", "float32", "--out", str(run),
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(_threads()), **MALLOC_ENV)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=cfg["timeout"])  # fmt: skip
        wall = time.perf_counter() - start
        metrics = run / "metrics.jsonl"
        if proc.returncode != 0 or not metrics.is_file():
            return "\n".join((proc.stderr + proc.stdout).strip().splitlines()[-12:])
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if "step" in r and "loss" in r]
    memory = next(r for r in records if r.get("event") == "memory")
    timed = [r["seconds"] for r in steps[cfg["warmup"] :]]
    return {
        "step_s": statistics.median(timed),
        "step_times": timed,
        "losses": [r["loss"] for r in steps],
        # rank 0's peak after each step, over its baseline: the last is before the end of
        # the run (one validation batch, the checkpoint)
        "rank0_memory_by_step_mb": [
            r["peak_rss_mb"] - memory["baseline_rss_mb"][0] for r in steps
        ],  # fmt: skip
        "wall_s": wall,
        **_memory(memory["peak_rss_mb"], memory["baseline_rss_mb"]),
    }


def _memory(peaks: list[float], baselines: list[float]) -> dict[str, Any]:
    """A run's memory from its ranks' peaks and baselines (MiB): the largest peak minus
    baseline over ranks, and the largest peak and baseline."""
    return {
        "memory_mb": max(p - b for p, b in zip(peaks, baselines, strict=True)),
        "peak_mb": max(peaks),
        "baseline_mb": max(baselines),
        "rank_peak_mb": peaks,
        "rank_baseline_mb": baselines,
    }


# ---------------------------------------------------------------------------------- peer
def _split_gate_up(model: torch.nn.Module, tp: int) -> None:
    """Reorder each ``mlp.gate_up``'s rows from [gate; up] to [gate_0; up_0; ...; gate_{tp-1};
    up_{tp-1}], so a contiguous split over tp gives rank r [gate_r; up_r]: torchtitan's
    separate column splits of w1 and w3, the same weights and the same function."""
    for block in model.blocks:
        lin = block.mlp.gate_up
        hidden = lin.out_features // 2
        per = hidden // tp
        order = torch.cat([torch.arange(part * hidden + r * per, part * hidden + (r + 1) * per)
                           for r in range(tp) for part in range(2)])  # fmt: skip
        with torch.no_grad():
            lin.weight.copy_(lin.weight[order])
            if lin.bias is not None:
                lin.bias.copy_(lin.bias[order])


def _tensor_parallel(model: torch.nn.Module, tp_mesh: Any, plan: str) -> bool:
    """Apply the peer's tensor-parallel plan; return whether the loss is vocabulary-parallel
    (``loss_parallel``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if plan == "blocks":
        block_plan = {
            "attn.qkv": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(),
            "mlp.gate_up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(),
        }
        for block in model.blocks:
            parallelize_module(block, tp_mesh, block_plan)
        return False
    # torchtitan's Llama plan (parallelize_llama / apply_tp), loss parallel on
    parallelize_module(
        model,
        tp_mesh,
        {
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "ln_f": SequenceParallel(),
            "lm_head": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        },
    )
    block_plan = {
        "ln1": SequenceParallel(),
        "attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
        ),
        "attn.qkv": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln2": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
    }
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan)
    return True


def _peer_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of the peer: torchtitan's recipe on the same Llama and the same batches."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from gnnpar.data.text import TokenBlocks, load_corpus
    from gnnpar.models.gpt.llama import Llama, LlamaConfig

    torch.set_num_threads(_threads())
    baseline = rss_mb()  # the idle rank, at the point where the trainer takes its own
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_mesh = mesh["dp"]
    # the trainer's cached tokens, read as the trainer reads them: rank 0 first (it builds
    # the cache if there is none), then the others
    if dist.get_rank() == 0:
        corpus = load_corpus("shakespeare", cfg["vocab_size"])
    dist.barrier()
    if dist.get_rank() != 0:
        corpus = load_corpus("shakespeare", cfg["vocab_size"])
    train, _ = corpus.split(0.05)
    s = cfg["sizes"]
    vocab = corpus.vocab_size
    blocks = TokenBlocks(train, s["block_size"], cfg["batch"], dp_mesh.get_local_rank(), DP, SEED)

    torch.manual_seed(SEED)
    model = Llama(LlamaConfig(vocab_size=vocab, ffn_hidden=cfg["ffn_hidden"], **s))
    _split_gate_up(model, TP)
    vocab_parallel = _tensor_parallel(model, mesh["tp"], cfg["peer_plan"])
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=i < last)
    fully_shard(model, mesh=dp_mesh)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=cfg["lr"], betas=(0.9, 0.99), fused=True,
    )  # fmt: skip
    params = list(model.parameters())
    context = loss_parallel if vocab_parallel else contextlib.nullcontext

    def step(i: int) -> float:
        x, y = blocks.batch(i)
        with context():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1))
            loss.backward()
        _clip(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach()
        mean = (mean.full_tensor() if isinstance(mean, DTensor) else mean).clone()
        dist.all_reduce(mean, group=dp_mesh.get_group())  # the global batch's mean
        return float(mean) / DP

    times, losses, by_step = [], [], [peak_rss_mb() - baseline]
    for i in range(cfg["warmup"] + cfg["steps"]):
        t0 = time.perf_counter()
        losses.append(step(i))
        times.append(time.perf_counter() - t0)
        by_step.append(peak_rss_mb() - baseline)
    peak = peak_rss_mb()
    dist.barrier()
    dist.destroy_process_group()
    return {"times": times[cfg["warmup"] :], "losses": losses, "peak_mb": peak,
            "baseline_mb": baseline, "memory_by_step_mb": by_step}  # fmt: skip


def peer_world(cfg: dict[str, Any]) -> dict[str, Any]:
    """The peer on 4 ranks forked from this process after the imports its ranks need, as our
    launcher forks its ranks after importing torch, gnnpar and ``torch._dynamo`` (which the
    first optimizer step imports): both idle baselines hold them, and ``tokenizers``, which
    our command has imported (through ``transformers``) before it forks. The text is not read
    here: each rank reads it after its baseline, as each of ours does."""
    import tokenizers  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401

    from gnnpar.data import text  # noqa: F401
    from gnnpar.models.gpt import llama  # noqa: F401

    ranks = run_distributed(_peer_rank, WORLD, cfg, timeout=cfg["timeout"], env=MALLOC_ENV)
    timed = ranks[0]["times"]
    return {
        "step_s": statistics.median(timed),
        "step_times": timed,
        "losses": ranks[0]["losses"],
        # rank 0's peak over its baseline once the model is built, then after each step
        "rank0_memory_by_step_mb": ranks[0]["memory_by_step_mb"],
        **_memory([r["peak_mb"] for r in ranks], [r["baseline_mb"] for r in ranks]),
    }


def run_peer(cfg: dict[str, Any]) -> dict[str, Any] | str:
    """:func:`peer_world` in a fresh Python process (its memory starts clean)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.json"
        cmd = [sys.executable, __file__, "--side-out", str(out), "--config", json.dumps(cfg)]
        env = dict(os.environ, OMP_NUM_THREADS=str(_threads()), **MALLOC_ENV)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=cfg["timeout"] + 60)  # fmt: skip
        if proc.returncode != 0 or not out.is_file():
            return "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-12:])
        return {**json.loads(out.read_text()), "wall_s": time.perf_counter() - start}


# ------------------------------------------------------------------------------ the pair
def compare(cfg: dict[str, Any]) -> dict[str, Any]:
    """``repeats`` runs of each side in fresh worlds, the order alternating; medians, spreads
    and the ratios ours / peer."""
    sides = {"ours": run_ours, "peer": run_peer}
    runs: dict[str, list] = {"ours": [], "peer": []}
    for r in range(cfg["repeats"]):
        for who in ("ours", "peer") if r % 2 == 0 else ("peer", "ours"):
            got = sides[who](cfg)
            runs[who].append(got)
            brief = got if isinstance(got, str) else {
                k: round(got[k], 3)
                for k in ("step_s", "memory_mb", "peak_mb", "baseline_mb", "wall_s")
            }  # fmt: skip
            print(f"run {r + 1} {who}: {brief}", file=sys.stderr, flush=True)
    res: dict[str, Any] = {"runs": runs}
    for who in ("ours", "peer"):
        ok = [x for x in runs[who] if isinstance(x, dict)]
        if ok:
            res[who] = {k: _summary([x[k] for x in ok])
                        for k in ("step_s", "memory_mb", "peak_mb", "baseline_mb")}  # fmt: skip
            res[who]["first_loss"] = ok[0]["losses"][0]
    if "ours" in res and "peer" in res:
        o, p = res["ours"], res["peer"]
        res["time_ratio"] = o["step_s"]["median"] / p["step_s"]["median"]
        res["memory_ratio"] = o["memory_mb"]["median"] / p["memory_mb"]["median"]
        res["loss_diff"] = abs(o["first_loss"] - p["first_loss"])
        res["losses_agree"] = res["loss_diff"] <= 1e-5 * abs(p["first_loss"])
        # the same batches and learning rate: the runs' losses should agree at every step
        pairs = zip(runs["ours"], runs["peer"], strict=True)
        res["loss_max_diff"] = max(
            (abs(a - b) for x, y in pairs if isinstance(x, dict) and isinstance(y, dict)
             for a, b in zip(x["losses"], y["losses"], strict=True)),
            default=float("nan"),
        )  # fmt: skip
    return res


def _cell(d: dict[str, float], fmt: str) -> str:
    return f"{d['median']:{fmt}} ({d['min']:{fmt}}–{d['max']:{fmt}})"


def table(res: dict[str, Any], cfg: dict[str, Any]) -> str:
    s = cfg["sizes"]
    lines = [
        f"Llama of {cfg['params'] / 1e6:.2f}M parameters ({s['n_layer']} layers of "
        f"{s['n_embd']}, {s['n_head']} heads, {s['n_kv_head']} kv heads, SwiGLU "
        f"{cfg['ffn_hidden']}, vocabulary {cfg['vocab_size']}), global batch {cfg['batch']} x "
        f"{s['block_size']} tokens, 4 ranks (dp=2, tp=2), float32; medians of "
        f"{cfg['repeats']} runs (min–max), each the median of {cfg['steps']} steps after "
        f"{cfg['warmup']} warm-up; memory = peak RSS − idle baseline, largest rank",
        "",
        "| side | step (s) | memory (MiB) | peak RSS (MiB) | baseline (MiB) | first-step loss |",
        "|---|---|---|---|---|---|",
    ]
    names = {"ours": "gnnpar train gpt --model llama, data=2,x=2 ZeRO-3",
             "peer": f"FSDP2 + DTensor TP ({cfg['peer_plan']} plan)"}  # fmt: skip
    for who in ("ours", "peer"):
        if who not in res:
            lines.append(f"| {names[who]} | failed: see {cfg['json']} | | | | |")
            continue
        r = res[who]
        lines.append(
            f"| {names[who]} | {_cell(r['step_s'], '.3f')} | {_cell(r['memory_mb'], '.0f')} "
            f"| {_cell(r['peak_mb'], '.0f')} | {_cell(r['baseline_mb'], '.0f')} "
            f"| {r['first_loss']:.6f} |"
        )
    if "time_ratio" in res:
        ok = lambda v, t: "met" if v <= t else "not met"  # noqa: E731
        lines += [
            "",
            f"ours / peer: step **{res['time_ratio']:.2f}×** (target ≤ {TARGETS['time']}×: "
            f"{ok(res['time_ratio'], TARGETS['time'])}), memory **{res['memory_ratio']:.2f}×** "
            f"(target ≤ {TARGETS['memory']}×: {ok(res['memory_ratio'], TARGETS['memory'])})",
            f"first-step losses {'agree' if res['losses_agree'] else 'DIFFER'}: "
            f"|Δ| = {res['loss_diff']:.2e}; largest |Δ| over every step of every run "
            f"{res['loss_max_diff']:.2e}",
        ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, one run a side")
    p.add_argument("--repeats", type=int, default=5, help="runs of each side")
    p.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    p.add_argument("--steps", type=int, default=4, help="timed steps per run")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--peer-plan", choices=PLANS, default="torchtitan",
                   help="the peer's tensor-parallel plan")  # fmt: skip
    p.add_argument("--side-out", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side_out:  # one fresh peer world (called by run_peer)
        Path(args.side_out).write_text(json.dumps(peer_world(json.loads(args.config))))
        return 0
    from gnnpar.models.gpt.llama import Llama, LlamaConfig

    sizes = model_sizes(args.quick)
    if sizes["n_kv_head"] % TP:
        p.error(f"n_kv_head must be a multiple of tp={TP} (whole groups per rank)")
    vocab = 2048
    llama = LlamaConfig(vocab_size=vocab, **sizes)
    with torch.device("meta"):
        params = sum(t.numel() for t in Llama(llama).parameters())
    tag = ("-quick" if args.quick else "") + ("-blocks" if args.peer_plan == "blocks" else "")
    cfg = {"sizes": sizes, "vocab_size": vocab, "ffn_hidden": llama.ffn_hidden,
           "batch": args.batch, "lr": 1e-3, "warmup": 1 if args.quick else args.warmup,
           "steps": 2 if args.quick else args.steps, "repeats": 1 if args.quick else args.repeats,
           "peer_plan": args.peer_plan, "params": params, "timeout": 900,
           "json": f"benchmarks/out/llama{tag}.json"}  # fmt: skip
    start = time.perf_counter()
    res = compare(cfg)
    doc = {"config": cfg, "result": res, "load_average": os.getloadavg(),
           "seconds": time.perf_counter() - start, "torch": torch.__version__}  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (ROOT / cfg["json"]).write_text(json.dumps(doc, indent=1))
    print(table(res, cfg))
    print(f"load average {os.getloadavg()[0]:.1f}; {doc['seconds']:.0f} s in all")
    return 0 if "time_ratio" in res else 1


if __name__ == "__main__":
    sys.exit(main())
