"""In-memory snapshots (:mod:`gnnpar.checkpoint.snapshot`) and chaos runs.

- One process: a torn snapshot, one of another run, one of another step, one whose file
  changed, one whose record lost an entry's digest or describes the values otherwise (a box
  marked transposed) is refused with a warning naming it, and the previous snapshot is restored (its
  exact values); a snapshot folder that cannot be written is refused before launch.
- A GPT run that shrinks from 4 data replicas to 2 (its second node lost for good) and grows
  back, each time resuming from the snapshots in memory, resharded onto the new grid, ends
  bit-identical to an uninterrupted run: ``reduce_order = tree`` sums the gradients in the
  same tree on either data size (grad_accum 2 on data=2).
- Chaos runs through ``gnnpar train --max-restarts 3``: three failures planted by failpoints
  (``$GNNPAR_FAILPOINTS``, :mod:`gnnpar.failpoints`) — a rank killed while it writes a
  snapshot, one killed while it writes a disk checkpoint, and a node lost with its snapshot
  memory (its ranks restore from the copies the next node holds) or a rank hung past the
  collectives' timeout as its step is logged (no logged step is lost) — finish with final
  parameters bit-identical (``torch.equal``) to an uninterrupted run with the same seed, for
  gcn (x=2, z=2), sage (mini-batch, 2 parts on 2 nodes) and gpt (data=2, x=2, ZeRO-3), and
  each restart resumed from where the plan says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gnnpar import checkpoint
from gnnpar.failpoints import Failpoint, parse_failpoints
from gnnpar.train.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ failpoints
def test_failpoints_parse_and_bad_items_are_one_line():
    got = parse_failpoints("snapshot@5:1, checkpoint@8:0:1,step@12:3:2=stop")
    assert got == [
        Failpoint("snapshot", 5, 1),
        Failpoint("checkpoint", 8, 0, 1),
        Failpoint("step", 12, 3, 2, "stop"),
    ]
    for bad in ("nowhere@3", "step", "step@x", "step@1:2:3:4", "step@1=melt"):
        with pytest.raises(ValueError, match="GNNPAR_FAILPOINTS") as err:
            parse_failpoints(bad)
        assert "\n" not in str(err.value)


# ------------------------------------------------------------------------ one-process store
def _state(step: int):
    torch.manual_seed(step)
    model = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    return model, opt


def test_a_tensor_pack_reads_back_what_it_was_given_and_refuses_a_bad_layout(tmp_path):
    from gnnpar.checkpoint.pack import ALIGN, load_pack, save_pack
    from gnnpar.verified import CHECKSUM, FormatError, checksum

    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "half": torch.randn(7, generator=g).to(torch.bfloat16),
        "strided": torch.randn(4, 6, generator=g)[:, ::2],  # not contiguous
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.empty(0, 4),
    }
    path = tmp_path / "p.bin"
    layout, entry = save_pack(path, tensors)
    assert entry == {"size": path.stat().st_size, CHECKSUM: checksum(path)}
    assert all(doc["offset"] % ALIGN == 0 for doc in layout.values())
    back = load_pack(path, layout)
    assert list(back) == list(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    bad = {
        "an unknown dtype": {**layout, "w": {**layout["w"], "dtype": "object"}},
        "past the end": {**layout, "w": {**layout["w"], "shape": [3, 500]}},
        "misaligned": {**layout, "w": {**layout["w"], "offset": 8}},
        "a negative size": {**layout, "w": {**layout["w"], "shape": [-1]}},
    }
    for what, doc in bad.items():
        with pytest.raises(FormatError, match="p.bin") as err:
            load_pack(path, doc)
        assert "\n" not in str(err.value), what
    # a copy received straight into a file: an older, longer file's pages, cut to the size
    from gnnpar.checkpoint.pack import filled

    with filled(path, 11) as view:
        received = torch.frombuffer(view, dtype=torch.uint8)
        received.copy_(torch.arange(11, dtype=torch.uint8))
        del received  # no export of the map may outlive the block
    assert path.read_bytes() == bytes(range(11))


def test_a_rank_s_snapshot_is_whole_in_memory_when_take_returns(tmp_path):
    """What the step waits for is this rank's whole snapshot, file and record: the step is
    logged next, and a logged step must survive the process. The writer's background thread
    (the copy to the peer) is held up here, so that nothing it does can pass for take's."""
    import threading

    import gnnpar
    from gnnpar.checkpoint.snapshot import SnapshotWriter, restore

    grid = gnnpar.init()
    writer = SnapshotWriter(tmp_path, "00000000000abc", grid)
    held, share = threading.Event(), writer._share
    writer._share = lambda *args: (held.wait(), share(*args))  # held until released
    try:
        model, opt = _state(3)
        writer.take(3, model, opt, {"task": {"step": 3}}, {"rng": torch.tensor([3])})
        restored, restored_opt = _state(7)
        found = restore(tmp_path, "00000000000abc", grid, restored, restored_opt)
        assert found is not None and found.step == 3 and found.source == "memory"
        for k, v in model.state_dict().items():
            assert torch.equal(restored.state_dict()[k], v), k
    finally:
        held.set()
        writer.close()


def test_a_failed_run_exits_without_waiting_for_its_copy_to_the_peer(tmp_path):
    """A run that failed leaves its copy in flight (its peer may never answer): the process
    must exit at once, not when the copy's collective times out."""
    code = f"""
import time, torch, gnnpar
from gnnpar.checkpoint.snapshot import SnapshotWriter
writer = SnapshotWriter({str(tmp_path)!r}, "00000000000abc", gnnpar.init())
writer._share = lambda *args: time.sleep(60)  # a peer that never answers
model = torch.nn.Linear(3, 2)
writer.take(1, model, None, {{}}, {{}})
writer.close(wait=False)
"""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
    assert time.monotonic() - start < 30


_DAMAGES = ["torn", "another run", "another step", "changed file", "no digest", "edited layout"]


@pytest.mark.parametrize("damage", _DAMAGES)
def test_a_damaged_or_foreign_snapshot_is_refused_for_the_previous_one(tmp_path, capfd, damage):
    import gnnpar
    from gnnpar.checkpoint.snapshot import SnapshotWriter, restore

    grid = gnnpar.init()
    writer = SnapshotWriter(tmp_path, "00000000000abc", grid)
    saved = {}
    for step in (1, 2):
        model, opt = _state(step)
        writer.take(step, model, opt, {"task": {"step": step}}, {"rng": torch.tensor([step])})
        writer.wait()
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    writer.close()
    folder = tmp_path / "00000000000abc" / "node-000"
    newest = folder / "step-000002"
    record = newest / "rank-00000.json"
    if damage == "torn":
        record.unlink()
    elif damage == "another run":
        doc = json.loads(record.read_text())
        record.write_text(json.dumps({**doc, "run": "00000000000def"}))
    elif damage == "another step":
        for name in ("rank-00000.bin", "rank-00000.json"):
            (newest / name).write_bytes((folder / "step-000001" / name).read_bytes())
    elif damage in ("no digest", "edited layout"):
        doc = json.loads(record.read_text())
        if damage == "no digest":
            del doc["digests"]["weight"]
        else:  # the weight's box marked as stored transposed: same size, other values
            (chunk,) = doc["pieces"]["weight"]
            chunk[4] = 1
        record.write_text(json.dumps(doc))
    else:
        data = bytearray((newest / "rank-00000.bin").read_bytes())
        data[-40] ^= 1
        (newest / "rank-00000.bin").write_bytes(bytes(data))
    model, opt = _state(7)
    found = restore(tmp_path, "00000000000abc", grid, model, opt)
    assert found is not None and found.step == 1 and found.source == "memory"
    assert found.extra == {"task": {"step": 1}} and torch.equal(
        found.local["rng"], torch.tensor([1])
    )
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[1][k]), k
    assert int(opt.state[model.weight]["step"]) == 1
    warned = capfd.readouterr().err
    want = {
        "torn": "no snapshot record (a torn write)",
        "another run": "a snapshot of another run",
        "another step": "a snapshot of another step",
        "changed file": "rank-00000.bin",
        "no digest": "entry 'weight' has no digest",
        "edited layout": "does not hold the values its layout and digest describe",
    }[damage]
    assert want in warned and "step-000002" in warned, warned
    # nothing fresher than a newer disk checkpoint is restored
    assert restore(tmp_path, "00000000000abc", grid, model, opt, newer_than=1) is None


# ------------------------------------------------------------------------------ chaos runs
def _launch(
    argv: list[str], out: Path, failpoints: str = "", timeout: float = 600, fails: bool = False
) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    if failpoints:
        env["GNNPAR_FAILPOINTS"] = failpoints
    cmd = [sys.executable, "-m", "gnnpar.cli", *argv, "--out", str(out), "--quiet"]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert (proc.returncode != 0) == fails, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stderr


def _bit_identical(a: Path, b: Path) -> None:
    sa, sb = checkpoint.consolidate(a), checkpoint.consolidate(b)
    assert list(sa) == list(sb)
    differ = [k for k in sb if not torch.equal(sa[k], sb[k])]
    assert not differ, differ
    # the runs trained: equal copies of the initial weights would prove nothing
    assert any(not torch.equal(sb[k], torch.zeros_like(sb[k])) for k in sb)


def _chaos(tmp_path: Path, argv: list[str], plan: str, third: list[tuple[int, str]]) -> None:
    """``argv`` straight, then again under ``plan`` with snapshots every step (a disk
    checkpoint every 4) and 3 restarts: the same final parameters, bit for bit, and the
    restarts resumed at step 1 and step 4 from memory, then at one of ``third`` (step,
    where from)."""
    sources = [[(1, "memory")], [(4, "memory")], third]
    straight, chaos = tmp_path / "straight", tmp_path / "chaos"
    _launch(argv, straight)
    snap = ["--snapshot-every", "1", "--snapshot-dir", str(tmp_path / "shm")]
    err = _launch([*argv, *snap, "--checkpoint-every", "4", "--max-restarts", "3"], chaos, plan)
    _bit_identical(chaos, straight)
    resumes = [r for r in read_metrics(chaos / "metrics.jsonl") if r.get("event") == "resume"]
    got = [(r["step"], r["source"]) for r in resumes]
    ok = len(got) == 3 and all(g in want for g, want in zip(got, sources, strict=True))
    assert ok, (got, err[-3000:])
    assert [r["attempt"] for r in resumes] == [1, 2, 3]
    # the finished run removed its snapshots (memory); the warnings named the torn one
    assert not any(p.is_file() for p in (tmp_path / "shm").rglob("*"))
    assert "no snapshot record (a torn write)" in err, err[-3000:]


#: Rank 1 killed while it writes its snapshot of step 2 (every rank restores step 1), rank 0
#: killed while it writes the disk checkpoint of step 4 (the snapshot of step 4 is complete:
#: the trainer finishes a snapshot before it writes a checkpoint), then a third failure, each
#: test's own: a node lost after step 6, before its snapshot (its ranks take step 5 from the
#: peers' copies, or step 4 when a copy of step 5 was still being sent), or a rank hung the
#: moment step 6 is logged (every rank's own snapshot of a logged step is in memory: step 6).
_PLAN = "snapshot@2:1,checkpoint@4:0:1,"


def test_chaos_gcn_3d_ends_bit_identical(tmp_path):
    argv = ["train", "gcn", "--dataset", "sbm", "--dataset-options", "num_nodes=90,feat_dim=6",
            "--root", str(tmp_path / "data"), "--layers", "2", "--hidden", "6", "--epochs", "8",
            "--eval-every", "0", "--grid", "x=2,z=2", "--nprocs", "4", "--ranks-per-node", "2",
            "--dropout", "0.3"]  # fmt: skip
    # the node of ranks 2 and 3 lost with its memory after step 6: they take their
    # snapshots from the copies ranks 0 and 1 hold
    _chaos(tmp_path, argv, _PLAN + "step@6:3:2=lose-node", [(5, "peer"), (4, "peer")])


def test_chaos_sage_two_parts_ends_bit_identical(tmp_path):
    from gnnpar.data import save_graph, sbm

    save_graph(sbm(num_nodes=120, feat_dim=6, seed=0), tmp_path / "graph")
    argv = ["train", "sage", "--dataset", str(tmp_path / "graph"), "--epochs", "8",
            "--batch-size", "16", "--hidden", "8", "--fanouts", "4,3", "--nprocs", "2",
            "--ranks-per-node", "1", "--eval-every", "0"]  # fmt: skip
    _chaos(tmp_path, argv, _PLAN + "step@6:1:2=lose-node", [(5, "peer"), (4, "peer")])


def test_chaos_gpt_zero3_ends_bit_identical_after_a_hung_rank(tmp_path, one_process):
    argv = ["train", "gpt", "--data", str(one_process), "--steps", "8", "--n-layer", "2",
            "--n-embd", "16", "--n-head", "2", "--batch-size", "4", "--block-size", "8",
            "--vocab-size", "300", "--warmup", "2", "--eval-every", "100", "--val-batches", "1",
            "--sample-tokens", "0", "--dropout", "0.1", "--grid", "data=2,x=2",
            "--zero-stage", "3", "--nprocs", "4", "--ranks-per-node", "2",
            "--timeout", "10"]  # fmt: skip
    # rank 2 hangs as step 6 is logged: the others time out after 10 s, all restart, and
    # no logged step is lost
    _chaos(tmp_path, argv, _PLAN + "logged@6:2:2=stop", [(6, "memory")])


def test_shrink_to_two_data_replicas_and_grow_back_ends_bit_identical(tmp_path, one_process):
    """A GPT on data=4 (ZeRO-3, reduce_order = tree) loses its second node (ranks 2, 3) for
    good after step 4: the run continues on the first node alone — a relaunch on 2 ranks, as a
    requeue with fewer nodes or torchrun's elastic ``--nnodes 1:2`` does — from the snapshots
    its memory holds (its own and the lost node's copies), resharded onto data=2 with
    grad_accum 2 (the resume keeps the run's 4 micro-batches); a rank of that run is killed
    after step 7, and the run grows back to data=4 from the 2-rank snapshots. The final
    parameters are bit-identical to an uninterrupted data=4 run."""

    def argv(grid: str, nprocs: int) -> list[str]:
        return ["train", "gpt", "--data", str(one_process), "--steps", "10", "--n-layer", "2",
                "--n-embd", "16", "--n-head", "2", "--batch-size", "8", "--block-size", "8",
                "--vocab-size", "300", "--warmup", "2", "--eval-every", "100",
                "--val-batches", "1", "--sample-tokens", "0", "--reduce-order", "tree",
                "--grid", grid, "--zero-stage", "3", "--nprocs", str(nprocs),
                "--snapshot-every", "1", "--snapshot-dir", str(tmp_path / "shm"),
                "--resume"]  # fmt: skip

    run, straight = tmp_path / "run", tmp_path / "straight"
    two_nodes = ["--ranks-per-node", "2"]
    _launch(argv("data=4", 4)[:-5], straight)  # no snapshots, not resumed
    _launch([*argv("data=4", 4), *two_nodes], run, "step@4:3=lose-node", fails=True)
    _launch(argv("data=2", 2), run, "step@7:1", fails=True)
    _launch([*argv("data=4", 4), *two_nodes], run)
    resumes = [r for r in read_metrics(run / "metrics.jsonl") if r.get("event") == "resume"]
    got = [(r["step"], r["source"], r["from_grid"]["data"]) for r in resumes]
    # the first resume: step 3 (or 2, when a step-3 snapshot was still being written)
    assert len(got) == 2 and got[0][1:] == ("memory", 4) and got[0][0] in (2, 3), got
    assert got[1][1:] == ("memory", 2) and got[1][0] in (5, 6), got
    _bit_identical(run, straight)


def test_a_snapshot_folder_that_cannot_be_written_is_refused_before_launch(tmp_path, capfd):
    from gnnpar.cli import main

    (tmp_path / "afile").write_text("")
    argv = ["train", "gcn", "--dataset", "sbm", "--root", str(tmp_path / "data"), "--epochs",
            "1", "--nprocs", "2", "--snapshot-every", "1", "--snapshot-dir",
            str(tmp_path / "afile" / "shm"), "--out", str(tmp_path / "run"), "--quiet"]  # fmt: skip
    assert main(argv) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"gnnpar train: error: {tmp_path / 'afile'}: not a folder"], err
    assert not (tmp_path / "run").exists()  # no rank started
