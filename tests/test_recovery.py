"""Recovery with real kills: a rank SIGKILLed mid-run under ``--max-restarts`` and a process
SIGKILLed while it writes checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gnnpar import checkpoint
from gnnpar.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find ranks")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def _descendants(pid: int, depth: int | None = None) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...; ``depth`` levels)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [(pid, 0)]
    while todo:
        parent, level = todo.pop()
        if depth is not None and level == depth:
            continue
        for c in children.get(parent, []):
            out.append(c)
            todo.append((c, level + 1))
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def test_killed_rank_restarts_from_checkpoint(tmp_path):
    out, epochs = tmp_path / "run", 300
    cmd = [
        sys.executable,
        "-m",
        "gnnpar.cli",
        "train",
        "gcn",
        "--dataset",
        "sbm",
        "--dataset-options",
        "num_nodes=300,feat_dim=8",
        "--root",
        str(tmp_path / "data"),
        "--epochs",
        str(epochs),
        "--checkpoint-every",
        "20",
        "--eval-every",
        "20",
        "--out",
        str(out),
        "--quiet",
        "--nprocs",
        "2",
        "--grid",
        "x=2",
        "--max-restarts",
        "1",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while not checkpoint.complete_steps(out / "checkpoints"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no checkpoint appeared; output:\n{proc.communicate()[0][-3000:]}")
            time.sleep(0.05)
        # The workers are the children of gnnpar's launch agent (the command's one child: a
        # fork of it, which runs torch.distributed.run in its process and forks them).
        (agent,) = _descendants(proc.pid, depth=1)
        workers = _descendants(agent, depth=1)
        assert len(workers) == 2, [_cmdline(p) for p in workers]
        killed_after = max(r.get("epoch", 0) for r in read_metrics(out / "metrics.jsonl"))
        os.kill(workers[-1], signal.SIGKILL)
        output = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert killed_after < epochs, "the run ended before the kill; make it longer"
    records = read_metrics(out / "metrics.jsonl")
    resumes = [r for r in records if r.get("event") == "resume"]
    assert len(resumes) == 1 and resumes[0]["attempt"] == 1, resumes
    assert resumes[0]["step"] >= 20 and resumes[0]["step"] % 20 == 0
    assert records[-1]["event"] == "end"
    assert max(r.get("epoch", 0) for r in records) == epochs
    seen = [r["epoch"] for r in records if "epoch" in r]
    assert len(seen) == len(set(seen)), "the killed attempt's redone epochs are kept twice"
    from gnnpar.train.report import write_report

    summary = write_report(out)
    assert "restarted by the launcher 1 time(s)" in summary
    assert f"{epochs} epochs recorded" in summary  # the redone epochs count once


_WRITER = """
import sys, torch, gnnpar
from gnnpar import checkpoint
grid = gnnpar.init()
model = torch.nn.Linear(2_000, 1_000, bias=False)
step = max(checkpoint.complete_steps(sys.argv[1]), default=0)
while True:
    step += 1
    torch.nn.init.constant_(model.weight, float(step))
    checkpoint.save(sys.argv[1], step, grid, model, keep=2)
"""


def test_kill_during_checkpoint_writes_leaves_a_loadable_one(tmp_path):
    import gnnpar

    grid = gnnpar.init()
    root = tmp_path / "ckpt"
    for delay in (0.13, 0.41, 0.77):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root)], cwd=ROOT)
        try:
            deadline = time.monotonic() + 120
            while not checkpoint.complete_steps(root) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(delay)  # somewhere inside a later write
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        model = torch.nn.Linear(2_000, 1_000, bias=False)
        found = checkpoint.load(root, grid, model)
        assert found is not None
        assert torch.equal(model.weight, torch.full((1_000, 2_000), float(found.step)))


def _start_long_run(tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """A 2-rank gcn run that would last for hours, started once its ranks are training."""
    out = tmp_path / name
    cmd = [
        sys.executable, "-m", "gnnpar.cli", "train", "gcn", "--dataset", "sbm",
        "--dataset-options", "num_nodes=300,feat_dim=8", "--root", str(tmp_path / "data"),
        "--epochs", "1000000", "--eval-every", "0", "--checkpoint-every", "5", "--quiet",
        "--nprocs", "2", "--grid", "x=2", "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    pipe = subprocess.PIPE
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=pipe, stderr=pipe, text=True)
    deadline = time.monotonic() + 240
    while not checkpoint.complete_steps(out / "checkpoints"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no checkpoint appeared:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    return proc, out


def test_a_killed_rank_or_agent_is_named_with_what_to_do(tmp_path):
    """After a SIGKILL of rank 1 the error blamed another rank's dropped connection; after
    one of the launch agent, gnnpar exited 247 without a word. Each is one line naming what
    died, exit 128 + 9, and the way on (--resume), which then continues the run."""
    for victim in ("rank", "agent"):
        proc, out = _start_long_run(tmp_path, victim)
        try:
            (agent,) = _descendants(proc.pid, depth=1)
            ranks = sorted(_descendants(agent, depth=1))  # forked in rank order
            os.kill(ranks[1] if victim == "rank" else agent, signal.SIGKILL)
            err = proc.communicate(timeout=120)[1]
        finally:
            if proc.poll() is None:
                proc.kill()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "--resume" in lines[0], err[-3000:]
        if victim == "rank":
            # torchrun names the killed rank's signal when it sees that rank fail first; when
            # it names the peer that lost its connection, the rank that said nothing is named
            if proc.returncode == 128 + signal.SIGKILL:
                assert "rank 1 of 2 was killed by SIGKILL" in lines[0], lines
            else:
                assert proc.returncode == 1, err[-3000:]
                assert "rank 1 of 2 ended without reporting an error" in lines[0], lines
        else:
            assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
            assert "the launch agent of the 2 ranks was killed by SIGKILL" in lines[0], lines
        deadline = time.monotonic() + 30  # the ranks end too (with the agent, or stopped by it)
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in ranks)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie does not)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
