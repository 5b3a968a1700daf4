"""The environments that Slurm's srun, Open MPI's mpirun and MPICH's Hydra (PMI) give each
process, for tests on one machine without those launchers.

Run as a script it is a stand-in for ``srun`` inside a batch job::

    python tests/simulated_launchers.py srun [-n N] [-N NODES] [--ntasks-per-node=K]
        [-K | --kill-on-bad-exit[=0|1]] [--any-other-option=VALUE ...] COMMAND ...

It reads the allocation from the environment a batch job has (:func:`slurm_job_env`),
starts the step's tasks with the variables srun sets (:func:`srun_task_env`), writes their
process ids, one a line, to ``$SIMULATED_SRUN_PIDS`` if set, and exits with the highest
exit status of its tasks, as srun does. With ``--kill-on-bad-exit`` (``-K``), as srun's, the
first task to exit with a non-zero status ends the step: the others are killed, and the
status is that of the tasks that exited by themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "MPI_LOCAL")
TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables (so that none leaks from
    the parent into a simulated launch), one thread per process, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(LAUNCHER_PREFIXES) and k not in TORCHRUN_VARS
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _tasks_per_node(ntasks: int, per_node: int) -> str:
    """Slurm's compressed tasks-per-node list for a block distribution: ``"2(x3),1"``."""
    counts = [per_node] * (ntasks // per_node) + ([ntasks % per_node] if ntasks % per_node else [])
    out = []
    for c in dict.fromkeys(counts):
        n = counts.count(c)
        out.append(f"{c}(x{n})" if n > 1 else str(c))
    return ",".join(out)


def slurm_job_env(nodes: int, tasks_per_node: int, job_id: int) -> dict[str, str]:
    """What a batch script of ``nodes`` × ``tasks_per_node`` tasks sees (on the first node;
    the batch step has a process id but no step id). The nodes are ``127.0.0.[1-N]``, which
    all reach this machine."""
    hosts = f"127.0.0.[1-{nodes}]" if nodes > 1 else "127.0.0.1"
    ntasks = nodes * tasks_per_node
    return {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_JOB_NODELIST": hosts,
        "SLURM_NODELIST": hosts,
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NPROCS": str(ntasks),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_TASKS_PER_NODE": _tasks_per_node(ntasks, tasks_per_node),
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }


def srun_task_env(
    job: Mapping[str, str], rank: int, ntasks: int, per_node: int, step_id: int = 0
) -> dict[str, str]:
    """What srun gives task ``rank`` of a step of ``ntasks`` tasks, ``per_node`` a node in
    blocks (Slurm's default distribution)."""
    env = dict(job)
    env.update(
        SLURM_STEP_ID=str(step_id),
        SLURM_STEPID=str(step_id),
        SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank % per_node),
        SLURM_NODEID=str(rank // per_node),
        SLURM_NTASKS=str(ntasks),
        SLURM_NPROCS=str(ntasks),
        SLURM_TASKS_PER_NODE=_tasks_per_node(ntasks, per_node),
    )
    return env


def openmpi_env(rank: int, size: int, per_node: int) -> dict[str, str]:
    """What Open MPI's mpirun gives rank ``rank`` of ``size``, ``per_node`` a node."""
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % per_node),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(per_node),
        "OMPI_COMM_WORLD_NODE_RANK": str(rank // per_node),
    }


def pmi_env(rank: int, size: int) -> dict[str, str]:
    """What MPICH's Hydra (PMI) gives rank ``rank`` of ``size``: no local rank or size."""
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(size)}


#: ``python -c AS_HOST gnnpar-args...`` runs the gnnpar command with ``socket.gethostname()``
#: answering ``$SIMULATED_HOSTNAME``, so that ranks on one machine look like several nodes.
AS_HOST = (
    "import os, runpy, socket, sys; "
    "socket.gethostname = lambda: os.environ['SIMULATED_HOSTNAME']; "
    "runpy.run_module('gnnpar.cli', run_name='__main__', alter_sys=True)"
)


def start(
    command: Sequence[str], envs: Sequence[Mapping[str, str]], cwd: str | None = None
) -> list[subprocess.Popen]:
    """Start ``command`` once per environment, output captured (stderr into stdout)."""
    return [
        subprocess.Popen(
            list(command),
            env=dict(env),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for env in envs
    ]


def finish(procs: Sequence[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Every process's exit status and output; kills them all if one outlives ``timeout``."""
    out = []
    try:
        for p in procs:
            text = p.communicate(timeout=timeout)[0]
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _srun(argv: list[str]) -> int:
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    per_node = int(os.environ.get("SLURM_NTASKS_PER_NODE", "1"))
    ntasks = int(os.environ.get("SLURM_NTASKS", nodes * per_node))
    args = list(argv)
    kill_on_bad_exit = False
    while args and args[0].startswith("-"):
        opt = args.pop(0)
        name, _, value = opt.partition("=")
        if name in ("-n", "--ntasks", "-N", "--nodes", "--ntasks-per-node") and not value:
            value = args.pop(0)
        if name in ("-n", "--ntasks"):
            ntasks = int(value)
        elif name in ("-N", "--nodes"):
            nodes = int(value)
        elif name == "--ntasks-per-node":
            per_node = int(value)
        elif name in ("-K", "--kill-on-bad-exit"):
            kill_on_bad_exit = value != "0"
        elif not value:
            raise SystemExit(f"simulated srun: give {opt} as {opt}=VALUE")
    if not args:
        raise SystemExit("simulated srun: no command")
    envs = [srun_task_env(os.environ, r, ntasks, per_node) for r in range(ntasks)]
    procs = [subprocess.Popen(args, env=env) for env in envs]
    if os.environ.get("SIMULATED_SRUN_PIDS"):
        with open(os.environ["SIMULATED_SRUN_PIDS"], "w") as f:
            f.write("".join(f"{p.pid}\n" for p in procs))
    killed = _wait_step(procs, kill_on_bad_exit)
    codes = [p.returncode for p in procs if p not in killed]
    return max(128 - c if c < 0 else c for c in codes)


def _wait_step(procs: list[subprocess.Popen], kill_on_bad_exit: bool) -> list[subprocess.Popen]:
    """Wait for every task; with ``kill_on_bad_exit``, kill the rest once one exits with a
    non-zero status (a peer of a failed rank may wait for it until its timeout). The tasks
    killed here."""
    if not kill_on_bad_exit:
        for p in procs:
            p.wait()
        return []
    while any(p.poll() is None for p in procs):
        if any(p.returncode for p in procs if p.returncode is not None):
            killed = [p for p in procs if p.poll() is None]
            for p in killed:
                p.kill()
                p.wait()
            return killed
        time.sleep(0.05)
    return []


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "srun":
        raise SystemExit(__doc__)
    sys.exit(_srun(sys.argv[2:]))
