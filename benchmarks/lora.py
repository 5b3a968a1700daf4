"""LoRA fine-tuning benchmark: one training step of gnnpar's LoRA
(:func:`gnnpar.tensor.lora.add_lora`) beside Hugging Face ``peft``, one process each, on the
same small Llama, the same weights and the same batch, in one run.

- **Model**: a ``transformers.LlamaForCausalLM`` with seeded random weights (default 4
  layers of 256, 8 heads, 2 key-value heads, SwiGLU 688, vocabulary 2,048, untied head,
  float32), saved once as a Hugging Face folder (``config.json``, ``model.safetensors``)
  that both sides load; one fixed batch of random token ids (default 4 x 128).
- **Ours**: :class:`gnnpar.models.gpt.llama.Llama` built from that folder
  (:func:`~gnnpar.models.gpt.hf_llama.llama_config_from_hf`,
  :func:`~gnnpar.models.gpt.hf_llama.llama_state_from_hf`), then
  ``add_lora(model, ["qkv", "o_proj", "gate_up", "down"], rank=8, alpha=16)``.
- **Peer**: ``LlamaForCausalLM.from_pretrained`` of the folder, then
  ``peft.get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
  target_modules=[q, k, v, o, gate, up, down]_proj))``, peft's "all linear" set; forward
  with ``use_cache=False`` (as fine-tuning runs it).

Our ``qkv`` and ``gate_up`` are fused projections: one adapter on ``qkv`` has one ``A`` for
q, k and v together, where peft gives each of q_proj, k_proj, v_proj its own ``A`` (and gate
and up likewise), so the same projections are adapted with the same rank but peft's adapters
hold more parameters (both counts are printed). Both sides compute the loss the same way
(cross-entropy of the logits against the next tokens) and step torch's ``AdamW`` over the
trainable parameters only, with the same learning rate.

**Step time** = forward + backward + AdamW step. Each side lives in its own Python process
(``MALLOC_MMAP_THRESHOLD_=131072`` as in ``benchmarks/sharding.py``, so RSS follows live
tensors), both with ``--threads`` intra-op threads (default 1, as ``fullgraph.py``'s
one-rank comparison: on a shared machine two OpenMP threads per side made steps several
times slower and their spread wide); after ``--warmup`` steps the parent runs one untimed
round and ``--reps`` timed rounds, each asking every side in turn for ``--steps`` steps (the
other side waits, blocked on its pipe), and times each request (``benchmarks/fullgraph.py``'s
``_interleaved``): the per-step time is the request's time over ``--steps``; reported are
the median over rounds with the spread (min-max), and the ratio ours / peft (of medians, and
per round). Each side also records its own clock per step (in the JSON).

**Memory** = the process's resident-set high-water mark (``VmHWM``), reset after the warm-up
steps (``/proc/self/clear_refs``) and read after the last round (so it covers the untimed and
the timed rounds), minus its idle baseline (``VmRSS`` after its imports, before it loads
anything: ours imports gnnpar's Llama, LoRA and safetensors, peft imports transformers and
peft; both import ``torch._dynamo``, which the first AdamW step would otherwise import
inside the measured window); both numbers are reported for each side, and the ratio
ours / peft of the differences. The weights and optimizer state are the same size on both
sides, so the difference is activations: our attention repeats the key-value heads
(``repeat_interleave``) before ``scaled_dot_product_attention`` and keeps the repeated keys
and values for backward, where transformers passes ``enable_gqa`` and keeps them unrepeated.

**Same function**: ``B`` starts at zero on both sides, so the adapted models start equal to
the base; each side prints the base model's loss and the first step's loss on the batch, and
the four must agree to float32 rounding.

Run::

    python benchmarks/lora.py              # 4 layers of 256, batch 4 x 128 (~2 min on 2 cores)
    python benchmarks/lora.py --quick      # a tiny model, 3 rounds of 2 steps (< 1 min)
    python benchmarks/lora.py --threads 2  # two intra-op threads per side

Writes ``benchmarks/out/lora.json`` (``lora-quick.json``) and prints the table. When peft
cannot be imported or fails, the table says why and ours is measured alone.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from benchmarks.fullgraph import _interleaved, _spread, _summary  # noqa: E402
from benchmarks.sharding import MALLOC_ENV, _reset_peak_rss, _rss_kb, _version  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
SIDES = ("ours", "peft")
OUR_TARGETS = ["qkv", "o_proj", "gate_up", "down"]
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MIB = 2**20


def model_sizes(quick: bool) -> dict[str, int]:
    """The Hugging Face ``LlamaConfig`` sizes."""
    if quick:
        return {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 176, "vocab_size": 2048}  # fmt: skip
    return {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
            "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 2048}  # fmt: skip


def write_model(folder: Path, cfg: dict[str, Any]) -> int:
    """Save the seeded random Llama as a Hugging Face folder; its number of parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(**cfg["sizes"], max_position_embeddings=cfg["seq"],
                         tie_word_embeddings=False, rms_norm_eps=1e-5)  # fmt: skip
    torch.manual_seed(cfg["seed"])
    model = LlamaForCausalLM(hf_cfg).to(torch.float32)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _batch(cfg: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch every step of both sides trains on: ids and their next tokens."""
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    ids = torch.randint(0, cfg["sizes"]["vocab_size"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# ------------------------------------------------------------------------------- one side
def _build_ours(folder: Path, cfg: dict[str, Any]):
    """Our Llama from the Hugging Face folder, with LoRA; ``(model, forward, base_loss)``."""
    from safetensors import safe_open

    from gnnpar.models.gpt import hf_llama
    from gnnpar.models.gpt.llama import Llama, LlamaConfig
    from gnnpar.tensor.lora import add_lora

    config = LlamaConfig(
        **hf_llama.llama_config_from_hf(hf_llama.read_hf_config(folder), str(folder))
    )
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        hf = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - not a dict
    state = {k: v if isinstance(v, torch.Tensor) else v[:]
             for k, v in hf_llama.llama_state_from_hf(hf, config, str(folder)).items()}  # fmt: skip
    del hf
    with torch.device("meta"):
        model = Llama(config)
    model.load_state_dict(state, strict=True, assign=True)
    del state
    model.train()
    base = _loss_of(model, cfg)
    add_lora(model, OUR_TARGETS, rank=cfg["rank"], alpha=cfg["alpha"], seed=cfg["seed"])
    return model, model, base


def _build_peft(folder: Path, cfg: dict[str, Any]):
    """Hugging Face's Llama from the folder, wrapped by peft; ``(model, forward, base)``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf.train()

    def forward(ids: torch.Tensor, model=hf) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    base = _loss_of(forward, cfg)
    lora = LoraConfig(r=cfg["rank"], lora_alpha=cfg["alpha"], lora_dropout=0.0,
                      target_modules=PEFT_TARGETS, bias="none")  # fmt: skip
    model = get_peft_model(hf, lora)
    model.train()

    def peft_forward(ids: torch.Tensor, model=model) -> torch.Tensor:
        return model(input_ids=ids, use_cache=False).logits

    return model, peft_forward, base


def _loss_of(forward, cfg: dict[str, Any]) -> float:
    x, y = _batch(cfg)
    with torch.no_grad():
        return F.cross_entropy(forward(x).flatten(0, 1), y.flatten()).item()


def _serve(side: str, cfg: dict[str, Any], proto, commands) -> None:
    """One side's process: build, warm up, then run ``steps`` steps per ``run`` request and
    answer with the times, until ``stop``, which answers with the memory."""
    torch.set_num_threads(cfg["threads"])
    # What the side imports belongs to its idle baseline: its modules, and torch._dynamo,
    # which transformers imports and torch's optimizer step would import on first use
    importlib.import_module("torch._dynamo")
    if side == "ours":
        import safetensors  # noqa: F401

        import gnnpar.models.gpt.hf_llama  # noqa: F401
        import gnnpar.models.gpt.llama  # noqa: F401
        import gnnpar.tensor.lora  # noqa: F401
    else:
        import peft  # noqa: F401
        import transformers  # noqa: F401

    gc.collect()
    baseline = _rss_kb("VmRSS") * 1024
    t0 = time.perf_counter()
    build = _build_ours if side == "ours" else _build_peft
    model, forward, base_loss = build(Path(cfg["folder"]), cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    opt = torch.optim.AdamW(trainable, lr=cfg["lr"])
    x, y = _batch(cfg)
    step_times: list[float] = []

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        step_times.append(time.perf_counter() - start)
        return loss.item()

    losses = [step() for _ in range(cfg["warmup"])]
    setup_s = time.perf_counter() - t0
    gc.collect()
    setup_peak = _rss_kb("VmHWM") * 1024
    rss_start = _rss_kb("VmRSS") * 1024
    reset = _reset_peak_rss()
    info = {
        "baseline": baseline,
        "setup_peak": setup_peak,
        "rss_at_timed_start": rss_start,
        "peak_reset": reset,
        "base_loss": base_loss,
        "first_loss": losses[0],
        "warmup_losses": losses,
        "adapter_params": sum(p.numel() for p in trainable),
        "adapter_tensors": len(trainable),
        "frozen_params": frozen,
        "setup_s": setup_s,
    }
    if side == "peft":
        info["attn_implementation"] = model.base_model.model.config._attn_implementation
    _send(proto, info)
    for line in commands:
        if line.strip() == "run":
            first = len(step_times)
            losses = [step() for _ in range(cfg["steps"])]
            _send(proto, {"times": step_times[first:], "loss": losses[-1]})
        else:
            break
    _send(proto, {"peak": _rss_kb("VmHWM") * 1024, "rss_end": _rss_kb("VmRSS") * 1024,
                  "rss_file_end": _rss_kb("RssFile") * 1024, "step_times": step_times,
                  "last_round_losses": losses})  # fmt: skip


def _send(proto, doc: dict[str, Any]) -> None:
    proto.write(json.dumps(doc) + "\n")
    proto.flush()


def side_main(side: str, cfg: dict[str, Any]) -> int:
    """A side's process: answers on the original stdout (library prints go to stderr)."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        _serve(side, cfg, proto, sys.stdin)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which goes on
        traceback.print_exc()
        _send(proto, {"error": f"{type(err).__name__}: {err}"})
        return 1
    return 0


# ---------------------------------------------------------------------------- the parent
class Side:
    """A side's process, driven over its stdin and stdout."""

    def __init__(self, side: str, cfg: dict[str, Any], log: Path):
        self.name, self.log = side, log
        cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side,
               "--config", json.dumps(cfg)]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS=str(cfg["threads"]), **MALLOC_ENV)
        self._err = log.open("w")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True, cwd=ROOT, env=env)  # fmt: skip
        self.runs: list[dict[str, Any]] = []

    def ask(self, command: str | None = None) -> dict[str, Any]:
        """Send ``command`` (if any) and read the answer; raise with the log's tail if the
        side failed."""
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        doc = json.loads(line) if line else {"error": f"exited with {self.proc.wait()}"}
        if "error" in doc:
            self.close()
            tail = self.log.read_text().strip().splitlines()[-6:]
            raise RuntimeError(doc["error"] + ("\n" + "\n".join(tail) if tail else ""))
        return doc

    def run(self) -> None:
        """One round's request: ``steps`` steps."""
        self.runs.append(self.ask("run"))

    def finish(self) -> dict[str, Any]:
        """Stop the side; its memory and its own step times."""
        doc = self.ask("stop")
        self.close()
        return doc

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        self._err.close()


def _peft_unavailable() -> str | None:
    """Why peft cannot run here, or None (an import that fails is reported by its side)."""
    if importlib.util.find_spec("peft") is None:
        return "peft is not installed (pip install peft)"
    return None


def compare(cfg: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Both sides' processes, their setup, the interleaved rounds and their memory."""
    res: dict[str, Any] = {"skipped": {}, "setup": {}, "memory": {}}
    why = _peft_unavailable()
    names = ["ours"] if why else list(SIDES)
    if why:
        res["skipped"]["peft"] = why
    sides = {}
    started = {name: Side(name, cfg, tmp / f"{name}.log") for name in names}  # set up together
    for name, side in started.items():
        try:
            res["setup"][name] = side.ask()
            sides[name] = side
        except RuntimeError as err:
            res["skipped"][name] = f"failed to set up: {err}"
        print(f"{name}: {res['setup'].get(name) or res['skipped'][name]}"[:300],
              file=sys.stderr, flush=True)  # fmt: skip
    if not sides:
        return res
    load = os.getloadavg()
    try:
        rounds = _interleaved({name: side.run for name, side in sides.items()}, cfg["reps"])
    except RuntimeError as err:  # a side failed mid-run: measure the others alone
        failed = next(n for n, s in sides.items() if s.proc.poll() is not None)
        res["skipped"][failed] = f"failed while stepping: {err}"
        sides.pop(failed)
        rounds = _interleaved({name: side.run for name, side in sides.items()}, cfg["reps"])
    res["load_average"] = [load, os.getloadavg()]
    res["step_s"] = {name: _summary([t / cfg["steps"] for t in r["all"]])
                     for name, r in rounds.items()}  # fmt: skip
    for name, side in sides.items():
        end = side.finish()
        setup = res["setup"][name]
        res["memory"][name] = {
            "peak": end["peak"],
            "baseline": setup["baseline"],
            "over_baseline": end["peak"] - setup["baseline"],
            "rss_at_timed_start": setup["rss_at_timed_start"],
            "setup_peak": setup["setup_peak"],
            "rss_file_end": end["rss_file_end"],
            "peak_reset": setup["peak_reset"],
        }
        # the side's own clock: every step (warm-up ones first), for a check on the parent's
        res.setdefault("side_step_times", {})[name] = end["step_times"]
        res.setdefault("last_round_losses", {})[name] = end["last_round_losses"]
    if "ours" in sides and "peft" in sides:
        o, p = res["step_s"]["ours"], res["step_s"]["peft"]
        res["time_ratio"] = o["median"] / p["median"]
        res["time_ratio_per_round"] = _summary([a / b for a, b in zip(o["all"], p["all"],
                                                                    strict=True)])  # fmt: skip
        mo, mp = res["memory"]["ours"], res["memory"]["peft"]
        res["memory_ratio"] = mo["over_baseline"] / mp["over_baseline"]
        so, sp = res["setup"]["ours"], res["setup"]["peft"]
        res["first_loss_diff"] = abs(so["first_loss"] - sp["first_loss"])
        res["base_loss_diff"] = abs(so["base_loss"] - sp["base_loss"])
        res["losses_agree"] = max(res["first_loss_diff"], res["base_loss_diff"]) <= 1e-5 * abs(
            sp["first_loss"]
        )
    return res


def table(res: dict[str, Any], cfg: dict[str, Any]) -> str:
    s = cfg["sizes"]
    lines = [
        f"LoRA step (forward + backward + AdamW) on a Llama of {cfg['params'] / 1e6:.2f}M "
        f"parameters ({s['num_hidden_layers']} layers of {s['hidden_size']}, "
        f"{s['num_attention_heads']} heads, {s['num_key_value_heads']} kv heads, SwiGLU "
        f"{s['intermediate_size']}, vocabulary {s['vocab_size']}), batch {cfg['batch']} x "
        f"{cfg['seq']} tokens, float32, rank {cfg['rank']}, alpha {cfg['alpha']}, "
        f"{cfg['threads']} thread{'s' if cfg['threads'] > 1 else ''} a side; step: median of "
        f"{cfg['reps']} interleaved rounds of {cfg['steps']} steps (min-max) after "
        f"{cfg['warmup']} warm-up; memory: peak RSS during the rounds minus the idle baseline",
        "",
        "| side | adapted | adapter params (tensors) | step | peak RSS MiB | baseline MiB "
        "| peak − baseline MiB | base loss | first-step loss |",
        "|---|---|--:|---|--:|--:|--:|--:|--:|",
    ]
    what = {"ours": "gnnpar add_lora: " + ", ".join(OUR_TARGETS),
            "peft": f"peft {cfg.get('peft_version')}: " + ", ".join(PEFT_TARGETS)}  # fmt: skip
    for name in SIDES:
        if name in res["skipped"]:
            why = res["skipped"][name].splitlines()[0]
            lines.append(f"| {name} | not run: {why} | | | | | | | |")
            continue
        st, m = res["setup"][name], res["memory"][name]
        lines.append(
            f"| {name} | {what[name]} | {st['adapter_params']:,} ({st['adapter_tensors']}) "
            f"| {_spread(res['step_s'][name])} | {m['peak'] / MIB:.0f} | {m['baseline'] / MIB:.0f} "
            f"| {m['over_baseline'] / MIB:.1f} | {st['base_loss']:.6f} | {st['first_loss']:.6f} |"
        )
    if "time_ratio" in res:
        r = res["time_ratio_per_round"]
        so, sp = res["setup"]["ours"], res["setup"]["peft"]
        extra = sp["adapter_params"] - so["adapter_params"]
        lines += [
            "",
            f"ours / peft: step **{res['time_ratio']:.2f}x** (per round {r['median']:.2f}x, "
            f"{r['min']:.2f}-{r['max']:.2f}), memory over baseline **{res['memory_ratio']:.2f}x**",
            f"losses {'agree' if res['losses_agree'] else 'DIFFER'}: first step |Δ| = "
            f"{res['first_loss_diff']:.2e}, base model |Δ| = {res['base_loss_diff']:.2e}",
            f"adapter parameters: peft {sp['adapter_params']:,} = ours {so['adapter_params']:,} "
            f"+ {extra:,} ({extra / so['adapter_params']:.1%} more: separate A for q, k, v and "
            "for gate, up, where ours has one A per fused projection)",
        ]
    for name, why in res["skipped"].items():
        lines.append(f"\n{name}: not measured: {why}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, 3 rounds (< 1 min)")
    p.add_argument("--reps", type=int, default=5, help="interleaved rounds (median kept)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per side per round")
    p.add_argument("--warmup", type=int, default=2, help="steps before the rounds")
    p.add_argument("--batch", type=int, default=4, help="sequences per batch")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    p.add_argument(
        "--threads", type=int, default=1, help="intra-op threads of each side (see above)"
    )
    p.add_argument("--json", default=None, help="JSON file to write")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:  # one side's process (started by Side)
        return side_main(args.side, json.loads(args.config))
    if args.quick:
        args.reps, args.steps, args.batch, args.seq = 3, 2, 4, 64
    cfg: dict[str, Any] = {
        "sizes": model_sizes(args.quick), "batch": args.batch, "seq": args.seq,
        "rank": args.rank, "alpha": args.alpha, "lr": args.lr, "reps": args.reps,
        "steps": args.steps, "warmup": args.warmup, "threads": args.threads, "seed": 0,
    }  # fmt: skip
    out = Path(args.json or OUT / f"lora{'-quick' if args.quick else ''}.json")
    start = time.perf_counter()
    versions = {n: _version(n) for n in ("torch", "transformers", "peft", "accelerate")}
    cfg["peft_version"] = versions["peft"]
    with tempfile.TemporaryDirectory(prefix="gnnpar-lora-") as scratch:
        tmp = Path(scratch)
        cfg["folder"] = str(tmp / "llama")
        cfg["params"] = write_model(tmp / "llama", cfg)
        res = compare(cfg, tmp)
    doc = {"config": cfg, "result": res, "versions": versions,
           "machine": {"platform": platform.platform(), "cores": os.cpu_count()},
           "seconds": time.perf_counter() - start}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(res, cfg))
    load = res.get("load_average", [os.getloadavg()])
    print(
        f"load average (1 min) before / after the rounds: "
        f"{' / '.join(f'{x[0]:.1f}' for x in load)}; {doc['seconds']:.0f} s in all; wrote {out}"
    )
    return 0 if "ours" in res.get("step_s", {}) else 1


if __name__ == "__main__":
    sys.exit(main())
