"""Overlap by decomposition: a sequence-parallel MLP chain (column layer h → 4h, GELU, row
layer 4h → h; ``gnnpar.tensor.Linear`` with ``sequence="gather"`` / ``"scatter"``), forward and
backward, with its sequence all-gathers and reduce-scatters run as collectives
(``decompose=False``) and decomposed into point-to-point steps that overlap the matmuls
(``decompose=True``, :mod:`gnnpar.tensor.overlap`), on 2 and 4 ranks.

Measured per iteration, in rounds that interleave the five kinds (each kind ``--iters``
iterations, after warm-up; the slowest rank's time of each round; median of ``--rounds``
rounds with the min–max spread):

- ``none``: the chain with collectives; ``decompose``: the chain decomposed;
- ``collectives``: the chain's collectives alone (two all-gathers and two reduce-scatters of
  the residual stream, forward and backward), the same transport as ``none``;
- ``exchanges``: the decomposed schedule's point-to-point exchanges alone (the same bytes);
- ``compute``: the chain's products alone (``nn.Linear`` layers of this rank's shapes on the
  whole sequence, the same flops).

On the host the collectives of ``none`` take the shared-memory transport (:mod:`gnnpar.shm`:
copies through one segment, no sockets), while point-to-point messages go through gloo's TCP
sockets; ``none-gloo`` and ``collectives-gloo`` are the same with gloo's collectives
(``GNNPAR_SHM=0``), the transport the exchanges use.

Derived: ``hidden`` = (none − decompose) / collectives, the share of the collective time that
decomposition took off the step (negative: it added time), against gloo's collectives
(``hidden-gloo``) and against the host's default (``hidden``); and ``overlap`` = (compute +
exchanges − decompose) / exchanges, the share of the point-to-point time hidden behind the
products.

The device is the grid's (``gnnpar.init``: CUDA where there are GPUs for the ranks, else the
host with gloo and one thread per rank). Run::

    python benchmarks/overlap.py            # a few minutes on 2 cores
    python benchmarks/overlap.py --quick    # smaller, fewer rounds

Writes ``benchmarks/out/overlap.json`` and prints a table.
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
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from gnnpar.testing import run_distributed  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
KINDS = ("none", "none-gloo", "decompose", "collectives", "collectives-gloo", "exchanges",
         "compute")  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(p: int, batch: int, seq: int, width: int, iters: int, rounds: int) -> dict[str, Any]:
    import torch.nn.functional as F

    import gnnpar
    from gnnpar import comm, tensor
    from gnnpar.tensor.sequence import SequenceSplit

    grid = gnnpar.init(x=p)
    dev, me = grid.device, grid.rank("x")
    split = SequenceSplit(grid)
    sizes = split.begin(seq)
    inner = 4 * width

    def chain(decompose: bool):
        torch.manual_seed(0)
        kw = {"sequence_split": split, "decompose": decompose, "device": dev}
        up = tensor.Linear(width, inner, grid, transpose=True, gather_output=False,
                           sequence="gather", **kw)  # fmt: skip
        down = tensor.Linear(inner, width, grid, scatter_input=False, sequence="scatter", **kw)
        return up, down

    layers = {"none": chain(False), "decompose": chain(True)}
    os.environ.pop("GNNPAR_SHM", None)
    local = layers["none"][0].local_out_features
    serial = (torch.nn.Linear(width, local).to(dev), torch.nn.Linear(local, width).to(dev))
    gen = torch.Generator().manual_seed(me)
    x = torch.randn(batch, sizes[me], width, generator=gen).to(dev).requires_grad_(True)
    dy = torch.randn(batch, sizes[me], width, generator=gen).to(dev)
    whole = torch.randn(batch, seq, width, generator=gen).to(dev).requires_grad_(True)
    dwhole = torch.randn(batch, seq, width, generator=gen).to(dev)
    full = torch.randn(batch, seq, width, generator=gen).to(dev)
    piece = torch.randn(batch, max(sizes), width, generator=gen).to(dev)

    def run_chain(kind: str) -> None:
        up, down = layers[kind]
        down(F.gelu(up(x))).backward(dy)

    def run_compute() -> None:
        up, down = serial
        down(F.gelu(up(whole))).backward(dwhole)

    def run_collectives() -> None:  # forward: gather, scatter; backward: scatter, gather
        for _ in range(2):
            comm.all_gather(x.detach(), grid, "x", dim=1, sizes=sizes)
            comm.reduce_scatter(full, grid, "x", dim=1, sizes=sizes)

    def run_exchanges() -> None:  # the four schedules' messages, none of their products
        for _ in range(4):
            handles = [comm.exchange(piece, grid, "x", (me + k) % p, (me - k) % p)
                       for k in range(1, p)]  # fmt: skip
            for h in handles:
                h.wait()

    def on_gloo(fn):
        def run() -> None:
            os.environ["GNNPAR_SHM"] = "0"  # read at every collective
            try:
                fn()
            finally:
                del os.environ["GNNPAR_SHM"]

        return run

    work = {
        "none": lambda: run_chain("none"),
        "none-gloo": on_gloo(lambda: run_chain("none")),
        "decompose": lambda: run_chain("decompose"),
        "collectives": run_collectives,
        "collectives-gloo": on_gloo(run_collectives),
        "exchanges": run_exchanges,
        "compute": run_compute,
    }
    moved = {}
    for kind in KINDS:  # warm-up, and the bytes of one iteration of each
        with comm.record(grid) as traffic:
            work[kind]()
        moved[kind] = traffic.bytes(axis="x")
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in range(rounds):
        order = KINDS if r % 2 == 0 else tuple(reversed(KINDS))
        for kind in order:
            comm.barrier(grid)
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(iters):
                work[kind]()
            _sync(dev)
            times[kind].append((time.perf_counter() - t0) / iters)
    gnnpar.release(grid)
    return {"times": times, "bytes": moved, "device": str(dev)}


def _summary(ranks: list[dict]) -> dict[str, Any]:
    rounds = len(ranks[0]["times"]["none"])
    # each round: the slowest rank's time (every rank waits for it)
    per_round = {k: [max(r["times"][k][i] for r in ranks) for i in range(rounds)] for k in KINDS}
    med = {k: statistics.median(v) for k, v in per_round.items()}
    spread = {k: (min(v), max(v)) for k, v in per_round.items()}
    t = per_round

    def share(a: str, b: str, c: str, sign: int) -> list[float]:
        """Per round: (t[a] − t[b]) / t[c] (sign 1), or (t[a] + t[c] − t[b]) / t[c] (−1)."""
        rows = zip(t[a], t[b], t[c], strict=True)
        return [((x - y) if sign > 0 else (x + z - y)) / z for x, y, z in rows]

    shares = {  # per round, then the median and the spread over the rounds
        "hidden": share("none", "decompose", "collectives", 1),
        "hidden-gloo": share("none-gloo", "decompose", "collectives-gloo", 1),
        "overlap": share("compute", "decompose", "exchanges", -1),
    }
    out = {"median_s": med, "spread_s": spread, "bytes": ranks[0]["bytes"]}
    for k, v in shares.items():
        out[k] = statistics.median(v)
        out[f"{k}_spread"] = (min(v), max(v))
    return {**out, "device": ranks[0]["device"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small chain, 3 rounds")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.quick:
        args.seq, args.width, args.iters, args.rounds = 256, 64, 2, 3
    env = {"OMP_NUM_THREADS": "1"}
    rows = []
    for p in args.ranks:
        ranks = run_distributed(
            _rank, p, p, args.batch, args.seq, args.width, args.iters, args.rounds,
            timeout=3600, env=env,
        )  # fmt: skip
        rows.append({"ranks": p, **_summary(ranks)})
        print(f"{p} ranks: hidden-gloo {rows[-1]['hidden-gloo']:.2f}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    doc = {"batch": args.batch, "seq": args.seq, "width": args.width, "iters": args.iters,
           "rounds": args.rounds, "rows": rows}  # fmt: skip
    name = "overlap-quick.json" if args.quick else "overlap.json"
    (OUT / name).write_text(json.dumps(doc, indent=1) + "\n")
    print(
        f"\nMLP chain {args.width} → {4 * args.width} → {args.width}, {args.batch}×{args.seq} "
        f"tokens, float32, forward + backward, on {rows[0]['device']}; ms per iteration, "
        f"median of {args.rounds} interleaved rounds (min–max)"
    )
    print("| ranks | " + " | ".join(KINDS) + " | hidden | hidden-gloo | overlap |")
    print("|---" * (len(KINDS) + 4) + "|")
    for r in rows:
        cells = [
            f"{r['median_s'][k] * 1e3:.1f} ({r['spread_s'][k][0] * 1e3:.1f}–"
            f"{r['spread_s'][k][1] * 1e3:.1f})"
            for k in KINDS
        ]
        for k in ("hidden", "hidden-gloo", "overlap"):
            lo, hi = r[f"{k}_spread"]
            cells.append(f"{r[k]:.2f} ({lo:.2f}–{hi:.2f})")
        print(f"| {r['ranks']} | " + " | ".join(cells) + " |")
    for r in rows:
        print(f"{r['ranks']} ranks, bytes per rank on x of one iteration: {r['bytes']}")


if __name__ == "__main__":
    main()
