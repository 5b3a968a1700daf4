"""Chaos runs and recovery: ``gnnpar train`` under ``--max-restarts`` while ranks are killed
(SIGKILL) or hung (SIGSTOP, past the collectives' ``--timeout``) at random moments, and what
each failure cost — against the same run recovering from disk checkpoints alone.

One *chaos run* starts ``gnnpar train TASK ... --nprocs N --max-restarts K``, waits for the
steps it drew at random (``--seed``), and at each hits a random worker process (a child of
the launch agent) with SIGKILL, or with SIGSTOP when ``--stop-share`` says so. From the run's
``metrics.jsonl`` it reads, per failure: the last step logged before it, the step the restart
resumed from and from where (``memory``, ``peer`` or ``disk``), the **steps lost** (logged
before the failure, trained again after it) and the **recovery time** (from the failure to
the first step past the one it interrupted, so restart, reload and redone steps all count).
``--check`` also trains the run straight (no failure, no snapshots) and compares the final
parameters bit for bit.

``--recovery`` is the measurement the docs quote: the benchmark GPT (4 blocks of width 256,
as compile.py's, with a vocabulary of 512 BPE tokens of Shakespeare: 3.4M parameters; 8
sequences of 128 tokens, data=2,x=2 with ZeRO-3 on 4 ranks, 2 simulated
nodes) trained 110 steps with one SIGKILL at a random step in 51..100 (anywhere in a
checkpoint interval, as a failure falls: the disk side loses 25 steps on average), two
ways, each ``--repeats`` times, interleaved: no snapshots and a disk checkpoint every 50 steps (the
restart-from-disk baseline), and snapshots every step (with the same disk checkpoints); and
the snapshots' cost per step: the time the loop is held (this rank's snapshot written, the
ranks waiting for each other's) and the step's wall time, from one logged step to the next,
beside the run without snapshots.

Run::

    python benchmarks/chaos.py                                     # --recovery: the docs' figures
    python benchmarks/chaos.py --task gpt --kills 3 --check        # one chaos run, 3 failures
    python benchmarks/chaos.py --task gcn --kills 3 --stop-share 0.5 --check
    python benchmarks/chaos.py --quick       # gcn, one failure, checked (a smoke run)

Writes ``benchmarks/out/chaos-<task>.json`` or ``benchmarks/out/recovery.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.compose import _spread  # noqa: E402

OUT = ROOT / "benchmarks" / "out"

#: Each task's small run (4 ranks on 2 simulated nodes; sage: 2 parts on 2 nodes).
TASKS: dict[str, list[str]] = {
    "gcn": ["train", "gcn", "--dataset", "sbm", "--dataset-options",
            "num_nodes=2000,feat_dim=32", "--hidden", "32", "--epochs", "60",
            "--eval-every", "0", "--grid", "x=2,z=2", "--nprocs", "4", "--dropout", "0.3"],
    "sage": ["train", "sage", "--dataset", "sbm", "--dataset-options",
             "num_nodes=3000,feat_dim=16", "--epochs", "40", "--batch-size", "256",
             "--fanouts", "5,5", "--eval-every", "0", "--nprocs", "2", "--ranks-per-node", "1"],
    "gpt": ["train", "gpt", "--steps", "60", "--n-layer", "2", "--n-embd", "64", "--n-head",
            "2", "--batch-size", "8", "--block-size", "32", "--vocab-size", "300",
            "--eval-every", "1000", "--val-batches", "1", "--sample-tokens", "0",
            "--dropout", "0.1", "--grid", "data=2,x=2", "--zero-stage", "3", "--nprocs", "4"],
}  # fmt: skip
#: ``--recovery``'s GPT: compile.py's and overlap.py's benchmark model.
RECOVERY_GPT = ["train", "gpt", "--steps", "110", "--n-layer", "4", "--n-embd", "256",
                "--n-head", "4", "--block-size", "128", "--batch-size", "8", "--vocab-size",
                "512", "--eval-every", "1000", "--val-batches", "1", "--sample-tokens", "0",
                "--grid", "data=2,x=2", "--zero-stage", "3", "--nprocs", "4",
                "--ranks-per-node", "2", "--warmup", "5"]  # fmt: skip


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def _last_step(records: list[dict[str, Any]], unit: str) -> int:
    return max((r[unit] for r in records if unit in r), default=0)


def chaos_run(
    argv: list[str], out: Path, kill_at: list[int], *, stop: list[bool], seed: int,
    timeout_s: float = 20, limit_s: float = 1800, env: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run ``argv`` into ``out``, failing a random worker when the run has logged each step
    of ``kill_at`` (SIGSTOP where ``stop`` says, else SIGKILL); what each failure cost."""
    rng = random.Random(seed)
    unit = "step" if argv[1] == "gpt" else "epoch"
    cmd = [sys.executable, "-m", "gnnpar.cli", *argv, "--out", str(out), "--quiet",
           "--max-restarts", str(len(kill_at)), "--timeout", str(timeout_s)]  # fmt: skip
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    failures = []
    try:
        for target, hang in zip(kill_at, stop, strict=True):
            while _last_step(_records(out / "metrics.jsonl"), unit) < target:
                if proc.poll() is not None:
                    raise RuntimeError(f"the run ended before step {target}: {proc.stderr.read()}")
                if time.time() - t0 > limit_s:
                    raise RuntimeError("the run took too long")
                time.sleep(0.02)
            (agent,) = _children(proc.pid)
            workers = sorted(_children(agent))
            victim = rng.choice(workers)
            logged = _last_step(_records(out / "metrics.jsonl"), unit)
            os.kill(victim, signal.SIGSTOP if hang else signal.SIGKILL)
            failures.append(
                {
                    "at": time.time(),
                    "logged": logged,
                    "signal": "STOP" if hang else "KILL",
                    "rank": workers.index(victim),
                }  # fmt: skip
            )
            # the next failure only once the restart is training again
            while len([r for r in _records(out / "metrics.jsonl") if r.get("event") == "resume"]
                      ) < len(failures):  # fmt: skip
                if proc.poll() is not None:
                    break
                time.sleep(0.05)
        err = proc.communicate(timeout=limit_s)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"the chaos run failed ({proc.returncode}): {err[-2000:]}")
    records = _records(out / "metrics.jsonl")
    resumes = [r for r in records if r.get("event") == "resume"]
    for f, r in zip(failures, resumes, strict=False):
        f["resumed"], f["source"] = r["step"], r.get("source", "disk")
        f["steps_lost"] = f["logged"] - r["step"]
        back = [x["time"] for x in records if x.get(unit, -1) > f["logged"] and x["time"] > f["at"]]
        f["recovery_s"] = min(back) - f["at"] if back else None
        f["restart_s"] = r["time"] - f["at"]  # until the state was loaded
    return {"seconds": time.time() - t0, "failures": failures, "records": records, "stderr": err}


def _same(a: Path, b: Path) -> bool:
    import torch

    from gnnpar import checkpoint

    sa, sb = checkpoint.consolidate(a), checkpoint.consolidate(b)
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sb)


def _straight(argv: list[str], out: Path) -> None:
    cmd = [sys.executable, "-m", "gnnpar.cli", *argv, "--out", str(out), "--quiet"]
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip


def one_chaos(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``--task``: one chaos run with ``--kills`` failures at random steps."""
    argv = [*TASKS[args.task], "--ranks-per-node", "2"] if args.task != "sage" else TASKS[args.task]
    total = int(argv[argv.index("--steps" if args.task == "gpt" else "--epochs") + 1])
    rng = random.Random(args.seed)
    kill_at = sorted(rng.sample(range(3, total - 3), args.kills))
    stop = [rng.random() < args.stop_share for _ in kill_at]
    snap = ["--snapshot-every", "1", "--snapshot-dir", str(work / "shm"),
            "--checkpoint-every", "10"]  # fmt: skip
    got = chaos_run([*argv, *snap], work / "chaos", kill_at, stop=stop, seed=args.seed)
    result = {"task": args.task, "kill_at": kill_at, "failures": got["failures"],
              "seconds": got["seconds"]}  # fmt: skip
    if args.check:
        _straight(argv, work / "straight")
        result["bit_identical"] = _same(work / "chaos", work / "straight")
    return result


def recovery(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``--recovery``: recovery from disk alone against snapshots every step, and the
    snapshots' cost per step (see the module docstring)."""
    rng = random.Random(args.seed)
    sides = {
        "disk every 50": ["--checkpoint-every", "50"],
        "snapshot every step": [
            "--checkpoint-every",
            "50",
            "--snapshot-every",
            "1",
            "--snapshot-dir",
            str(work / "shm"),
        ],  # fmt: skip
    }
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
    for i in range(args.repeats):
        at = rng.randrange(51, 101)  # uniform over the second checkpoint interval
        for name, extra in sides.items():
            out = work / f"{name.split()[0]}-{i}"
            got = chaos_run([*RECOVERY_GPT, *extra], out, [at], stop=[False], seed=args.seed + i)
            steps = [r for r in got["records"] if "step" in r and "seconds" in r]
            f = got["failures"][0]
            before = [r["time"] for r in steps if r["time"] < f["at"]][5:]
            gaps = [b - a for a, b in zip(before, before[1:], strict=False)]
            runs[name].append({
                **{k: f[k] for k in ("logged", "resumed", "source", "steps_lost", "recovery_s",
                                     "restart_s")},
                # wall time from one logged step to the next: the snapshot's share included
                "step_s": statistics.median(gaps),
                "snapshot_s": statistics.median(r.get("snapshot_s", 0.0) for r in steps[5:]),
                "snapshot_write_s": statistics.median(
                    r.get("snapshot_write_s", 0.0) for r in steps[5:]),
            })  # fmt: skip
            print(name, runs[name][-1], flush=True)
    summary = {}
    for name, rows in runs.items():
        summary[name] = {k: _spread([r[k] for r in rows]) for k in rows[0] if k != "source"}
        summary[name]["sources"] = [r["source"] for r in rows]
    disk, snap = summary["disk every 50"], summary["snapshot every step"]
    summary["ratios"] = {
        "recovery (snapshot / disk)": snap["recovery_s"]["median"] / disk["recovery_s"]["median"],
        "step (snapshot / none)": snap["step_s"]["median"] / disk["step_s"]["median"],
        "loop held by the snapshot / step": snap["snapshot_s"]["median"] / disk["step_s"]["median"],
    }
    return {"runs": runs, "summary": summary}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", choices=sorted(TASKS), help="one chaos run of this task")
    p.add_argument("--kills", type=int, default=3, help="failures in the chaos run")
    p.add_argument("--stop-share", type=float, default=0.34, help="share of SIGSTOPs")
    p.add_argument("--check", action="store_true", help="also compare with a straight run")
    p.add_argument("--recovery", action="store_true", help="the recovery measurement (default)")
    p.add_argument("--quick", action="store_true", help="gcn, one failure, checked")
    p.add_argument("--repeats", type=int, default=5, help="--recovery: runs per side")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.task, args.kills, args.check = "gcn", 1, True
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.recovery or args.task is None:
            result = recovery(args, Path(tmp))
            name = "recovery.json"
        else:
            result = one_chaos(args, Path(tmp))
            name = f"chaos-{args.task}.json"
    (OUT / name).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result.get("summary", result), indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
