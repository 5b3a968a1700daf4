"""Starting under Slurm and MPI without torchrun: the launcher's environment, Slurm host lists,
real worlds of 2 and 4 processes under simulated srun / mpirun / Hydra environments, the sbatch
examples, and preemption by SIGTERM followed by a requeue."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from gnnpar.cli import main
from gnnpar.launch import (
    Launch,
    LaunchError,
    apply_master_addr,
    detect_launch,
    node_layout,
    parse_hostlist,
    parse_tasks_per_node,
    restart_count,
    under_launcher,
)
from gnnpar.testing import reserved_port
from gnnpar.train.loop import BaseTask
from gnnpar.train.metrics import read_metrics
from tests.simulated_launchers import (
    AS_HOST,
    LAUNCHER_PREFIXES,
    TORCHRUN_VARS,
    clean_env,
    finish,
    openmpi_env,
    pmi_env,
    slurm_job_env,
    srun_task_env,
    start,
)

ROOT = Path(__file__).resolve().parents[1]
SRUN = [sys.executable, str(ROOT / "tests" / "simulated_launchers.py"), "srun"]
GNNPAR = [sys.executable, "-m", "gnnpar.cli"]
TINY_SBM = ["--dataset", "sbm", "--dataset-options", "num_nodes=200,feat_dim=8"]


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for var in list(os.environ):
        if var.startswith(LAUNCHER_PREFIXES) or var in TORCHRUN_VARS:
            monkeypatch.delenv(var)


@pytest.fixture
def hold_port():
    """``hold_port(low=1, high=65536)``: a free port held until the test ends
    (:func:`gnnpar.testing.reserved_port`), so that no other process (a parallel test
    worker's world, an outgoing connection) can take it before rank 0's store binds it. A port
    that was only checked free could be, and the launch lost that race on a busy host."""
    with contextlib.ExitStack() as stack:
        yield lambda low=1, high=65536: stack.enter_context(reserved_port(low, high))


def _slurm_job_id(hold_port) -> int:
    """A job id whose port (10000 + id % 50000) is held for the test; above 50000 so that the
    modulo matters."""
    return 50000 + hold_port(10000, 60000) - 10000


# --------------------------------------------------------------------------- host lists
@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("nid[001-004,007]", ["nid001", "nid002", "nid003", "nid004", "nid007"]),
        ("tux[0-2,12]", ["tux0", "tux1", "tux2", "tux12"]),
        ("linux[08-11]", ["linux08", "linux09", "linux10", "linux11"]),
        ("node[9-10]", ["node9", "node10"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
        ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
        ("x[1,3],y[2-3]", ["x1", "x3", "y2", "y3"]),
        ("login7", ["login7"]),
        ("127.0.0.[1-2]", ["127.0.0.1", "127.0.0.2"]),
    ],
)
def test_slurm_host_list_forms(text, hosts):
    assert parse_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nid[3-1]", "runs backwards"),
        ("nid[1-", "unclosed '['"),
        ("nid1]", "unbalanced ']'"),
        ("nid[a-b]", "bad host range"),
        ("nid[]", "bad host range"),
        ("nid[1,]", "bad host range"),
        ("nid[0-99999]", "too long"),
    ],
)
def test_bad_host_lists_are_one_line_errors(text, message):
    with pytest.raises(LaunchError, match=message.replace("[", r"\[")) as err:
        parse_hostlist(text)
    assert "\n" not in str(err.value)


def test_tasks_per_node_lists():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    assert parse_tasks_per_node("4(x2)") == [4, 4]
    with pytest.raises(LaunchError, match="bad Slurm tasks per node"):
        parse_tasks_per_node("x(2)")


def test_node_layout_from_host_names():
    hosts = ["a", "a", "b", "b"]
    assert [node_layout(hosts, r) for r in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert node_layout(["a", "a", "a", "b"], 3) == (0, 3)  # the last node may hold fewer
    # Ranks dealt round-robin over nodes: consecutive ranks are not on one node.
    assert node_layout(["a", "b", "a", "b"], 2) == (1, 1)
    assert node_layout(["a"], 0) == (0, 1)


# ---------------------------------------------------------------------------- detection
def _slurm_task(rank: int, nodes: int = 2, per_node: int = 2, job_id: int = 123456) -> dict:
    job = slurm_job_env(nodes, per_node, job_id)
    return srun_task_env(job, rank, nodes * per_node, per_node)


def test_plain_process_and_batch_script_are_no_launch():
    assert detect_launch({}) is None
    # A batch script (or salloc shell) has SLURM_PROCID but no step: not a world to join.
    assert detect_launch(slurm_job_env(2, 4, 99)) is None


def test_slurm_step():
    launch = detect_launch(_slurm_task(3))
    assert launch == Launch("slurm", 3, 4, 1, 2, "127.0.0.1", 10000 + 123456 % 50000)
    env = _slurm_task(3) | {"MASTER_ADDR": "nid9", "MASTER_PORT": "4242"}
    assert (detect_launch(env).master_addr, detect_launch(env).master_port) == ("nid9", 4242)
    # srun's own step variables win over the job's (a step on part of the allocation).
    env = _slurm_task(0) | {
        "SLURM_STEP_NODELIST": "nid[003-004]",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_JOB_NODELIST": "nid[001-004]",
    }
    assert detect_launch(env) == Launch("slurm", 0, 2, 0, 1, "nid003", 33456)
    # Only --ntasks-per-node given (no tasks-per-node list).
    env = _slurm_task(1)
    del env["SLURM_TASKS_PER_NODE"]
    assert detect_launch(env).ranks_per_node == 2
    # Neither local rank nor tasks per node: learnt from host names, as under PMI.
    env = _slurm_task(1)
    for var in ("SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        del env[var]
    assert (detect_launch(env).local_rank, detect_launch(env).ranks_per_node) == (None, None)


def test_torchrun_comes_first_and_mpi_inside_an_allocation_wins_over_its_daemons():
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert detect_launch(_slurm_task(3) | torchrun).launcher == "torchrun"
    # srun --mpi=pmi2: Slurm and PMI agree, so it is a Slurm step.
    assert detect_launch(_slurm_task(3) | pmi_env(3, 4)).launcher == "slurm"
    # mpirun in a batch job starts its daemons with srun (one task per node): the ranks
    # inherit that step, and the MPI variables describe the real world.
    daemons = _slurm_task(1, nodes=2, per_node=1)
    launch = detect_launch(daemons | openmpi_env(5, 8, 4) | {"MASTER_ADDR": "nid1"})
    assert launch == Launch("openmpi", 5, 8, 1, 4, "nid1", 29500)


def test_mpi_launches():
    assert detect_launch(openmpi_env(1, 2, 2)) == Launch("openmpi", 1, 2, 1, 2, "127.0.0.1", 29500)
    env = openmpi_env(5, 8, 4) | {"MASTER_ADDR": "n1", "MASTER_PORT": "1234"}
    assert detect_launch(env) == Launch("openmpi", 5, 8, 1, 4, "n1", 1234)
    env = pmi_env(2, 4) | {"MASTER_ADDR": "n1"}
    assert detect_launch(env) == Launch("pmi", 2, 4, None, None, "n1", 29500)
    assert detect_launch(pmi_env(0, 1)) == Launch("pmi", 0, 1, 0, 1, None, None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"SLURM_JOB_NODELIST": None, "SLURM_NODELIST": None}, "without a node list"),
        ({"SLURM_PROCID": "4"}, "task rank 4 is outside a size of 4"),
        ({"SLURM_PROCID": "one"}, "SLURM_PROCID='one' is not an integer"),
        ({"SLURM_TASKS_PER_NODE": "2(x3)"}, "names 6 tasks but SLURM_NTASKS=4"),
        ({"SLURM_JOB_NODELIST": "n[1-3]"}, "names 3 hosts but SLURM_TASKS_PER_NODE"),
        ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID=2 but at most 2 tasks per node"),
        ({"SLURM_JOB_ID": None, "SLURM_JOBID": None}, "no SLURM_JOB_ID"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        ({"SLURM_JOB_NODELIST": "n[2-1]"}, "runs backwards"),
    ],
)
def test_incomplete_or_inconsistent_slurm_steps(change, message):
    env = _slurm_task(1)
    for k, v in change.items():
        env.pop(k) if v is None else env.__setitem__(k, v)
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace("[", r"\[")) as err:
        detect_launch(env)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (openmpi_env(1, 4, 2), "Open MPI launch of 4 ranks needs rank 0's host"),
        (pmi_env(1, 2), "MPICH/PMI launch of 2 ranks needs rank 0's host"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "not OMPI_COMM_WORLD_LOCAL"),
        ({"PMI_RANK": "0"}, "not PMI_SIZE"),
        (pmi_env(2, 2) | {"MASTER_ADDR": "n1"}, "world rank 2 is outside a size of 2"),
    ],
)
def test_incomplete_or_inconsistent_mpi_launches(env, message):
    with pytest.raises(LaunchError, match=message) as err:
        detect_launch(env)
    assert "\n" not in str(err.value)


def test_under_launcher(monkeypatch):
    assert not under_launcher()
    for k, v in slurm_job_env(1, 4, 7).items():  # in a batch script, --nprocs still launches
        monkeypatch.setenv(k, v)
    assert not under_launcher()
    for k, v in srun_task_env(slurm_job_env(1, 1, 7), 0, 1, 1).items():  # srun -n 1: too
        monkeypatch.setenv(k, v)
    assert not under_launcher()
    for k, v in srun_task_env(slurm_job_env(1, 2, 7), 0, 2, 2).items():
        monkeypatch.setenv(k, v)
    assert under_launcher()


def test_restart_count_and_master_addr():
    assert restart_count({}) == 0
    assert restart_count({"SLURM_RESTART_COUNT": "2"}) == 2
    assert restart_count({"SLURM_RESTART_COUNT": "1", "TORCHELASTIC_RESTART_COUNT": "1"}) == 2
    env: dict[str, str] = {}
    apply_master_addr("nid001:29600", env)
    assert env == {"MASTER_ADDR": "nid001", "MASTER_PORT": "29600"}
    env = {}
    apply_master_addr("nid001", env)
    assert env == {"MASTER_ADDR": "nid001"}
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    apply_master_addr("nid001:2", torchrun)  # torchrun's own rendezvous is kept
    assert torchrun["MASTER_ADDR"] == "h"
    with pytest.raises(LaunchError, match="names no host"):
        apply_master_addr(":29600", {})


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_cli_reports_a_bad_launch_in_one_line(monkeypatch, capsys):
    env = _slurm_task(1)
    del env["SLURM_JOB_NODELIST"], env["SLURM_NODELIST"]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["info", "--check"]) == 2
    assert "Slurm step of 4 tasks without a node list" in _err_line(capsys)
    for k, v in srun_task_env(slurm_job_env(1, 1, 7), 0, 1, 1).items():
        monkeypatch.setenv(k, v)
    assert main(["info", "--check", "--grid", "x=2"]) == 2
    line = _err_line(capsys)
    assert "does not divide the world size 1 (launched by Slurm (srun))" in line


def test_a_taken_port_is_a_one_line_error(monkeypatch, capsys):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = srun_task_env(slurm_job_env(1, 2, 7), 0, 2, 2) | {"MASTER_PORT": str(port)}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert main(["info", "--check"]) == 2
    line = _err_line(capsys)
    assert f"Slurm (srun) rank 0 of 2 could not serve the rendezvous on 127.0.0.1:{port}" in line
    assert "address already in use" in line


# ------------------------------------------------------------- real worlds, no torchrun
def _check_table(path: Path, per_node: int, intra: dict[str, bool]) -> None:
    table = json.loads(path.read_text())
    assert table["ranks_per_node"] == per_node
    seen = {e["axis"]: e["intra_node"] for e in table["entries"]}
    assert {a: seen[a] for a in intra} == intra


def _check_training(outputs: list[tuple[int, str]], run: Path, shape: str, ranks: int) -> None:
    assert all(rc == 0 for rc, _ in outputs), outputs
    describe = f"done: grid data=1 {shape} ({ranks} ranks, gloo, cpu, 2 ranks/node)"
    assert describe in outputs[0][1], outputs[0][1]
    records = read_metrics(run / "metrics.jsonl")
    assert records[-1]["event"] == "end" and max(r.get("epoch", 0) for r in records) == 2
    # every rank's peak and idle baseline, in rank order, and the line that sums them up
    memory = records[-2]
    assert memory["event"] == "memory" and len(memory["peak_rss_mb"]) == ranks
    peaks, baselines = memory["peak_rss_mb"], memory["baseline_rss_mb"]
    assert all(0 < b < p for b, p in zip(baselines, peaks, strict=True))
    top = max(range(ranks), key=peaks.__getitem__)
    assert f"peak memory: {peaks[top]:,.0f} MiB (rank {top}; ranks " in outputs[0][1]


def _info_args(tmp_path: Path, grid: str) -> list[str]:
    out = ["--mbytes", "0.01", "--iters", "1", "--json", str(tmp_path / "bw.json")]
    return ["info", "--check", "--grid", grid, *out]


def _train_args(tmp_path: Path, grid: str) -> list[str]:
    run = ["--epochs", "2", "--out", str(tmp_path / "run"), "--quiet"]
    return ["train", "gcn", *TINY_SBM, "--root", str(tmp_path / "data"), "--grid", grid, *run]


def test_slurm_step_of_four_tasks_on_two_nodes(tmp_path, hold_port):
    job_id = _slurm_job_id(hold_port)
    env = clean_env(**slurm_job_env(2, 2, job_id), GNNPAR_TIMEOUT="60")
    srun = [*SRUN, "-n", "4", *GNNPAR]
    [(rc, out)] = finish(start([*srun, *_info_args(tmp_path, "x=2,y=2")], [env], str(ROOT)), 180)
    assert rc == 0, out
    port = 10000 + job_id % 50000
    assert f"launcher: Slurm (srun): rank 0 of 4, 2 per node, rank 0 at 127.0.0.1:{port}" in out
    assert "all collectives returned correct results" in out
    _check_table(tmp_path / "bw.json", 2, {"x": True, "y": False})
    # a second job, on a port of its own
    env = clean_env(**slurm_job_env(2, 2, _slurm_job_id(hold_port)), GNNPAR_TIMEOUT="60")
    outputs = finish(start([*srun, *_train_args(tmp_path, "x=2,y=2")], [env], str(ROOT)), 180)
    _check_training(outputs, tmp_path / "run", "x=2 y=2 z=1", 4)


def test_open_mpi_launch_of_two_ranks(tmp_path, hold_port):
    port = hold_port()
    envs = [clean_env(**openmpi_env(r, 2, 2), MASTER_PORT=str(port)) for r in range(2)]
    outputs = finish(start([*GNNPAR, *_info_args(tmp_path, "x=2")], envs, str(ROOT)), 180)
    assert all(rc == 0 for rc, _ in outputs), outputs
    out = outputs[0][1]
    assert f"launcher: Open MPI: rank 0 of 2, 2 per node, rank 0 at 127.0.0.1:{port}" in out
    _check_table(tmp_path / "bw.json", 2, {"x": True})
    outputs = finish(start([*GNNPAR, *_train_args(tmp_path, "x=2")], envs, str(ROOT)), 180)
    _check_training(outputs, tmp_path / "run", "x=2 y=1 z=1", 2)


def test_pmi_launch_learns_ranks_per_node_from_host_names(tmp_path, hold_port):
    """Four ranks that look like two nodes of two (host names node0, node0, node1, node1):
    PMI gives no local size, so 2 per node can only come from exchanging the names."""
    port = hold_port()
    envs = [
        clean_env(**pmi_env(r, 4), SIMULATED_HOSTNAME=f"node{r // 2}", GNNPAR_TIMEOUT="60")
        for r in range(4)
    ]
    cmd = [sys.executable, "-c", AS_HOST, "--master-addr", f"127.0.0.1:{port}"]
    outputs = finish(start([*cmd, *_info_args(tmp_path, "x=2,y=2")], envs, str(ROOT)), 180)
    assert all(rc == 0 for rc, _ in outputs), outputs
    out = outputs[0][1]
    expected = f"MPICH/PMI: rank 0 of 4, ranks per node from host names, rank 0 at 127.0.0.1:{port}"
    assert f"launcher: {expected}" in out
    _check_table(tmp_path / "bw.json", 2, {"x": True, "y": False})
    outputs = finish(start([*cmd, *_train_args(tmp_path, "x=2,y=2")], envs, str(ROOT)), 180)
    _check_training(outputs, tmp_path / "run", "x=2 y=2 z=1", 4)


# ----------------------------------------------------------- sbatch examples, preemption
def _batch_env(
    tmp_path: Path, nodes: int, per_node: int, job_id: int, **extra: str
) -> dict[str, str]:
    """A batch job's environment with srun and scontrol stand-ins first on PATH (scontrol
    only records its arguments)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(f'#!/bin/sh\nexec {" ".join(map(str, SRUN))} "$@"\n')
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    for f in (srun, scontrol):
        f.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    return clean_env(
        **slurm_job_env(nodes, per_node, job_id),
        PATH=path,
        SHARED=str(tmp_path / "shared"),
        GNNPAR_TIMEOUT="60",
        **extra,
    )


def _epochs(path: Path) -> int:
    return sum("epoch" in r for r in read_metrics(path)) if path.is_file() else 0


def test_sbatch_gcn_preempted_by_sigterm_is_requeued_and_resumes(tmp_path, hold_port):
    """SIGTERM reaches one task only (rank 1): the ranks agree, stop after the same epoch,
    write a checkpoint and exit 0; the script requeues the job; the requeued job
    (SLURM_RESTART_COUNT=1, no --resume) continues from that epoch."""
    script = str(ROOT / "examples" / "slurm" / "gcn_products.sbatch")
    pids = tmp_path / "pids"
    env = _batch_env(tmp_path, 2, 1, _slurm_job_id(hold_port), SIMULATED_SRUN_PIDS=str(pids))
    small = [*TINY_SBM, "--layers", "2", "--hidden", "8", "--grid", "x=2"]
    small += ["--eval-every", "0", "--checkpoint-every", "0"]
    metrics = tmp_path / "shared" / "gnnpar" / "runs" / "gcn-products" / "metrics.jsonl"
    [proc] = start(["bash", script, *small, "--epochs", "100000"], [env], str(ROOT))
    try:
        deadline = time.monotonic() + 120
        while _epochs(metrics) < 3:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no epochs recorded:\n{proc.communicate()[0][-3000:]}")
            time.sleep(0.05)
        os.kill(int(pids.read_text().split()[1]), signal.SIGTERM)
    finally:
        [(rc, out)] = finish([proc], 120)
    assert rc == 0, out
    last = read_metrics(metrics)[-1]
    assert last["event"] == "preempted" and last["step"] >= 3, last
    stopped = last["step"]
    assert f"preempted by SIGTERM after epoch {stopped}" in out
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", env["SLURM_JOB_ID"]]

    # The requeued job: same job id (so the same port), a restart count, two more epochs.
    env["SLURM_RESTART_COUNT"] = "1"
    [proc] = start(["bash", script, *small, "--epochs", str(stopped + 2)], [env], str(ROOT))
    [(rc, out)] = finish([proc], 120)
    assert rc == 0, out
    records = read_metrics(metrics)
    resumes = [r for r in records if r.get("event") == "resume"]
    assert [(r["step"], r["attempt"]) for r in resumes] == [(stopped, 1)]
    steps = [r for r in records if "epoch" in r and "event" not in r]
    assert [r["epoch"] for r in steps[-3:]] == [stopped, stopped + 1, stopped + 2]
    assert records[-1]["event"] == "end" and "epoch" in records[-3]  # then memory, then end
    assert records[-1]["event"] == "end"
    assert len((tmp_path / "scontrol.log").read_text().splitlines()) == 1  # not requeued again


def test_sbatch_gpt_4d_runs(tmp_path, hold_port):
    words = "the of and to in is was he for it with as his on be at by this had not".split()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(words[(i * 7) % len(words)] for i in range(5000)))
    env = _batch_env(tmp_path, 2, 1, _slurm_job_id(hold_port))
    tiny = ["--data", str(corpus), "--vocab-size", "300", "--n-layer", "1", "--n-head", "2"]
    tiny += ["--n-embd", "32", "--block-size", "16", "--batch-size", "4", "--steps", "2"]
    tiny += ["--grid", "x=2", "--eval-every", "0", "--sample-tokens", "4"]
    script = str(ROOT / "examples" / "slurm" / "gpt_4d.sbatch")
    [(rc, out)] = finish(start(["bash", script, *tiny], [env], str(ROOT)), 240)
    assert rc == 0, out
    assert "done: grid data=1 x=2 y=1 z=1 (2 ranks, gloo, cpu, 1 rank/node)" in out
    assert not (tmp_path / "scontrol.log").exists()


def test_sbatch_with_a_taken_master_port_fails_at_once_in_one_line(tmp_path, hold_port):
    """A job script that exports a MASTER_PORT another server holds: rank 0 cannot bind it
    and says so at once, in one line naming the address, the port and what to do; srun
    --kill-on-bad-exit (as the example passes it) then stops rank 1, which would otherwise
    wait for rank 0: connected to the other server, without end (a port held by a socket
    that does not listen: for its timeout, then torch's retries with their C++ frames)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = _batch_env(tmp_path, 2, 1, _slurm_job_id(hold_port), MASTER_PORT=str(port))
        words = ["--data", str(tmp_path / "corpus.txt"), "--steps", "1", "--grid", "x=2"]
        (tmp_path / "corpus.txt").write_text("the of and to in is was " * 100)
        script = str(ROOT / "examples" / "slurm" / "gpt_4d.sbatch")
        began = time.monotonic()
        [(rc, out)] = finish(start(["bash", script, *words], [env], str(ROOT)), 120)
        took = time.monotonic() - began
    assert rc == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    assert f"could not serve the rendezvous on 127.0.0.1:{port}: address already in use" in out
    assert f"another process holds port {port}); export MASTER_PORT=<a free port>" in out
    assert took < 30, f"{took:.0f}s"


class _SignalledTask(BaseTask):
    """Counts steps; sends this process SIGTERM during step ``signal_at``."""

    unit = "step"

    def __init__(self, grid, num_steps: int, signal_at: int | None):
        import torch

        self.grid, self.num_steps, self.signal_at, self.done = grid, num_steps, signal_at, 0
        self.model = torch.nn.Linear(1, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_step(self, step: int) -> dict[str, float]:
        if step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        self.done += 1
        return {"loss": float(step)}

    def evaluate(self, step: int) -> dict[str, float]:
        return {"steps_done": float(self.done)}

    def extra_state(self) -> dict:
        return {"done": self.done}

    def load_extra_state(self, state: dict) -> None:
        self.done = state["done"]

    def describe(self) -> dict:
        return {"task": "signalled"}


def test_sigterm_checkpoints_and_restores_the_previous_handler(tmp_path):
    import gnnpar
    from gnnpar.train.loop import Trainer

    grid = gnnpar.init()

    def previous(signum, frame):
        raise AssertionError("the trainer's handler should have taken SIGTERM")

    old = signal.signal(signal.SIGTERM, previous)
    try:
        trainer = Trainer(_SignalledTask(grid, 10, signal_at=3), tmp_path, eval_every=0, quiet=True)
        trainer.run()
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, old)
    assert trainer.preempted_at == 4
    last = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert (last["event"], last["step"]) == ("preempted", 4)
    task = _SignalledTask(grid, 10, signal_at=None)
    result = Trainer(task, tmp_path, eval_every=0, quiet=True, resume=True).run()
    assert result == {"steps_done": 10.0}  # 4 before the signal (restored) + 6 after
    resumes = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("event") == "resume"]
    assert [r["step"] for r in resumes] == [4]
