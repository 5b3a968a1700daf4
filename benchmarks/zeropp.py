"""ZeRO++ (qwZ, hpZ, qgZ) through ``gnnpar train gpt``: bytes per axis, step time and the loss
after 200 steps, against plain ZeRO-3 on the same run.

The benchmark GPT (4 blocks of width 256, a vocabulary of 512 BPE tokens of Shakespeare:
3.4M parameters; 8 sequences of 128 tokens a step) on data=4 with ZeRO-3, 4 CPU ranks as 2
simulated nodes of 2 (``--ranks-per-node 2``), float32, ``--steps`` steps (200) with the
same seed, five ways:

- ``zero3``: plain ZeRO-3;
- ``qwz``: ``--quantized-weights`` (int8 parameter all-gathers);
- ``hpz``: ``--fcdp`` (FCDP's slice cache is ZeRO++'s hpZ: backward gathers inside the node);
- ``qgz``: ``--quantized-grads`` (the int4 hierarchical gradient all-to-all);
- ``zero++``: all three.

For each: the train loss of the last step and the validation loss at the end, the median
step time (and its spread), and the bytes of one step by axis and kind, read from the
run's ``metrics.jsonl`` (``gnnpar.comm.record``). ``data.intra`` is inside a node,
``data.inter`` across nodes, and ``data`` spans the nodes (its all-gather crosses them).

Run::

    python benchmarks/zeropp.py              # 200 steps each: about 15 min on 2 cores
    python benchmarks/zeropp.py --quick      # 12 steps each, a smoke run

Writes ``benchmarks/out/zeropp.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
VARIANTS = {
    "zero3": [],
    "qwz": ["--quantized-weights"],
    "hpz": ["--fcdp"],
    "qgz": ["--quantized-grads"],
    "zero++": ["--quantized-weights", "--fcdp", "--quantized-grads"],
}
MODEL = ["--n-layer", "4", "--n-embd", "256", "--n-head", "4", "--vocab-size", "512",
         "--block-size", "128", "--batch-size", "8"]  # fmt: skip


def run(variant: str, steps: int, folder: Path) -> dict[str, Any]:
    """One ``gnnpar train gpt`` run of ``variant``; its figures from metrics.jsonl."""
    out = folder / variant
    cmd = [sys.executable, "-m", "gnnpar.cli", "train", "gpt", *MODEL, "--steps", str(steps),
           "--grid", "data=4", "--zero-stage", "3", "--nprocs", "4", "--ranks-per-node", "2",
           "--eval-every", str(steps), "--val-batches", "4", "--sample-tokens", "0",
           "--warmup", "20", "--out", str(out), "--quiet", *VARIANTS[variant]]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{variant}: {proc.stderr.strip().splitlines()[-1]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "loss" in r and "seconds" in r]
    times = [r["seconds"] for r in steps_[5:]]  # past the first steps' warm-up
    return {
        "loss": steps_[-1]["loss"],
        "val_loss": steps_[-1].get("val_loss"),
        "step_s": {"median": statistics.median(times), "min": min(times), "max": max(times)},
        "bytes": steps_[-2]["bytes"],  # a step without the evaluation's
    }


def _total(bytes_: dict[str, dict[str, int]], axis: str, kind: str) -> int:
    return bytes_.get(axis, {}).get(kind, 0)


def table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown table of the runs, with the ratios to plain ZeRO-3."""
    base = results["zero3"]
    rows = ["| run | loss | val loss | step s (min–max) | data all-gather | intra all-gather "
            "| data reduce-scatter | intra all-to-all | inter all-to-all | step vs zero3 |",
            "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in results.items():
        b, t = r["bytes"], r["step_s"]
        cells = [
            _total(b, "data", "all_gather"),
            _total(b, "data.intra", "all_gather"),
            _total(b, "data", "reduce_scatter"),
            _total(b, "data.intra", "all_to_all"),
            _total(b, "data.inter", "all_to_all"),
        ]
        ratio = t["median"] / base["step_s"]["median"]
        rows.append(
            f"| {name} | {r['loss']:.4f} | {r['val_loss']:.4f} | {t['median']:.3f} "
            f"({t['min']:.3f}–{t['max']:.3f}) | "
            + " | ".join(f"{c / 1e6:.2f} MB" if c else "—" for c in cells)
            + f" | {ratio:.2f}× |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    ap.add_argument("--quick", action="store_true", help="12 steps each (a smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 12
    results = {}
    with tempfile.TemporaryDirectory(prefix="zeropp-") as tmp:
        for name in args.variants.split(","):
            results[name] = run(name, args.steps, Path(tmp))
            print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "zeropp.json").write_text(json.dumps({"steps": args.steps, "runs": results}, indent=1))
    if "zero3" in results:
        print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
