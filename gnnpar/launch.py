"""How gnnpar processes are started: the launcher that started this one, and N local ones.

:func:`detect_launch` recognises, in this order,

- **torchrun** (``RANK``/``WORLD_SIZE``, or ``TORCHELASTIC_RUN_ID``): its env rendezvous;
- a **Slurm step** started by ``srun`` (``SLURM_PROCID`` and ``SLURM_STEP_ID``; a batch
  script or an ``salloc`` shell has no step id and is not a launch): rank ``SLURM_PROCID``
  of ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``, local rank ``SLURM_LOCALID``, ranks per
  node from ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE``/``SLURM_NTASKS_PER_NODE``,
  rank 0's host = the first host of ``SLURM_STEP_NODELIST``/``SLURM_JOB_NODELIST`` and the
  port ``10000 + job id % 50000``;
- an **MPI launch**: Open MPI (``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE``) or
  MPICH/Hydra/Intel MPI (``PMI_RANK``/``PMI_SIZE``, no local rank: it is learnt by
  exchanging host names); rank 0's address from ``MASTER_ADDR`` (or ``gnnpar
  --master-addr``; Open MPI on one node needs none), the port from ``MASTER_PORT`` (default
  29500).

``MASTER_ADDR``/``MASTER_PORT`` override the Slurm address and port too. An incomplete or
inconsistent environment is a :class:`LaunchError` of one line. :func:`launch_local` starts
N local processes under PyTorch's own launcher (the code behind torchrun).

**Failures of a local launch.** :func:`launch_local` runs the launcher in a small agent
process (:func:`agent`; the ``gnnpar`` command forks it before its own work,
:class:`ForkedAgent`, instead of starting an interpreter) that gives every rank a folder
(``GNNPAR_ERROR_DIR``) for one failure record (:func:`record_failure`) instead of a
printout. When the launcher reports a failed rank, the agent prints one line naming the rank
and the root cause (the first failure that is not a peer's lost connection; a crash's
traceback follows) and exits with that rank's status (2 for a user error) instead of
torchrun's ``ChildFailedError`` report. Under plain torchrun, srun or mpirun, the failing rank
prints (an error every rank raises alike: rank 0 only) and the launcher's own report follows.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gnnpar.errors import UserError

#: Port of the rendezvous under MPI when ``MASTER_PORT`` is not set (torch's default).
DEFAULT_MPI_PORT = 29500
#: How :meth:`Launch.describe` names each launcher.
LAUNCHER_NAMES: Mapping[str, str] = MappingProxyType(
    {"torchrun": "torchrun", "slurm": "Slurm (srun)", "openmpi": "Open MPI", "pmi": "MPICH/PMI"}
)
#: Hosts one compressed Slurm host list may expand to (Slurm's own hostlist limit is 64k).
MAX_HOSTS = 1 << 16
#: How :func:`launch_local` starts its agent (``python -c``, arguments after it).
_AGENT = "import sys; from gnnpar.launch import agent; sys.exit(agent(sys.argv[1:]))"
#: Where the ranks of a local launch record their failure (set by the launch agent).
ERROR_DIR_ENV = "GNNPAR_ERROR_DIR"
#: Seconds an interrupted command waits for its forked agent to stop the ranks and exit.
AGENT_GRACE_S = 30.0
#: ``0`` makes a local launch start each rank as a new interpreter instead of forking it.
FORK_ENV = "GNNPAR_LAUNCH_FORK"
#: Set for the ranks of a local launch: the launching process ran the checks before launch.
PREFLIGHT_DONE_ENV = "GNNPAR_PREFLIGHT_DONE"
#: What gloo's own errors say when a peer went away (see :func:`_gloo_lost_peer`).
_GLOO_PEER_LOSS = (
    "connection reset",
    "connection closed",
    "connection refused",
    "broken pipe",
    "connectfullmesh",
    "timed out",
)


class LaunchError(UserError):
    """The launcher's environment is incomplete or inconsistent."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """Where this process sits in a launched world.

    ``local_rank`` and ``ranks_per_node`` are ``None`` when the launcher does not give them
    (MPICH/PMI): :func:`gnnpar.init` then learns them from every rank's host name.
    ``ranks_per_node`` is the same on every rank (the first node's count), because the grid
    and the planner take one value for all nodes.
    """

    launcher: str  # "torchrun", "slurm", "openmpi" or "pmi"
    rank: int
    world_size: int
    local_rank: int | None
    ranks_per_node: int | None
    master_addr: str | None
    master_port: int | None

    def describe(self) -> str:
        """One line naming the launcher, the rank and the rendezvous address."""
        per_node = (
            f"{self.ranks_per_node} per node"
            if self.ranks_per_node is not None
            else "ranks per node from host names"
        )
        where = f", rank 0 at {self.master_addr}:{self.master_port}" if self.master_addr else ""
        name = LAUNCHER_NAMES[self.launcher]
        return f"{name}: rank {self.rank} of {self.world_size}, {per_node}{where}"


# ----------------------------------------------------------------------------- parsing
def _int(env: Mapping[str, str], name: str, launcher: str) -> int:
    value = env.get(name, "")
    try:
        out = int(value)
    except ValueError:
        raise LaunchError(f"{launcher}: {name}={value!r} is not an integer") from None
    if out < 0:
        raise LaunchError(f"{launcher}: {name}={value!r} is negative")
    return out


def _first(env: Mapping[str, str], *names: str) -> str | None:
    """The first of ``names`` set (non-empty) in ``env``."""
    return next((n for n in names if env.get(n)), None)


def _split_outside_brackets(text: str, where: str) -> list[str]:
    """``text`` cut at commas and white space that are not inside ``[...]``."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"{where}: unbalanced ']' in {text!r}")
        if depth == 0 and (ch == "," or ch.isspace()):
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise LaunchError(f"{where}: unclosed '[' in {text!r}")
    parts.append("".join(cur))
    return [p for p in parts if p]


def _expand_ranges(body: str, text: str) -> list[str]:
    """``"001-003,7"`` → ``["001", "002", "003", "7"]``: every number keeps the width of the
    range's first number (Slurm's zero padding)."""
    out: list[str] = []
    for part in body.split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise LaunchError(f"bad host range [{body}] in host list {text!r}")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise LaunchError(f"host range {part} in host list {text!r} runs backwards")
        if last - first >= MAX_HOSTS:
            raise LaunchError(f"host range {part} in host list {text!r} is too long")
        out.extend(str(i).zfill(len(lo)) for i in range(first, last + 1))
    return out


def parse_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list: ``"nid[001-004,007]"``, ``"tux[0-5,12]"``,
    ``"rack[1-2]-node[01-02]"`` (several bracket groups: the first varies slowest),
    ``"a,b[1-2],c"`` (comma-separated hosts), ``"127.0.0.[1-2]"``."""
    hosts: list[str] = []
    for token in _split_outside_brackets(text.strip(), "Slurm host list"):
        expanded, rest = [""], token
        while rest:
            literal, bracket, rest = rest.partition("[")
            if not bracket:
                expanded = [e + literal for e in expanded]
                break
            body, _, rest = rest.partition("]")
            numbers = _expand_ranges(body, text)
            expanded = [e + literal + n for e in expanded for n in numbers]
            if len(hosts) + len(expanded) > MAX_HOSTS:
                raise LaunchError(f"host list {text!r} names more than {MAX_HOSTS} hosts")
        hosts.extend(expanded)
    return hosts


def parse_tasks_per_node(text: str) -> list[int]:
    """Expand Slurm's tasks-per-node list: ``"2(x3),1"`` → ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if m is None:
            raise LaunchError(f"bad Slurm tasks per node {text!r} (expected e.g. '4(x2),3')")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    if not out:
        raise LaunchError(f"bad Slurm tasks per node {text!r} (expected e.g. '4(x2),3')")
    return out


def node_layout(hosts: Sequence[str], rank: int) -> tuple[int, int]:
    """This rank's local rank and the grid's ranks per node, from every rank's host name.

    The grid numbers nodes as blocks of ``ranks_per_node`` consecutive ranks. When the hosts
    are such blocks (the last may be shorter) that is their size; otherwise (ranks dealt
    round-robin over the nodes) no two consecutive ranks are trusted to share one: 1.
    """
    local_rank = sum(1 for h in hosts[:rank] if h == hosts[rank])
    per_node = sum(1 for h in hosts if h == hosts[0])
    blocks = [hosts[i : i + per_node] for i in range(0, len(hosts), per_node)]
    firsts = [b[0] for b in blocks]
    blocked = all(len(set(b)) == 1 for b in blocks) and len(set(firsts)) == len(firsts)
    return local_rank, per_node if blocked else 1


# ---------------------------------------------------------------------------- launchers
def _is_torchrun(env: Mapping[str, str]) -> bool:
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)


def _torchrun(env: Mapping[str, str]) -> Launch:
    world = int(env.get("WORLD_SIZE", "1"))
    return Launch(
        launcher="torchrun",
        rank=int(env.get("RANK", "0")),
        world_size=world,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        ranks_per_node=int(env.get("LOCAL_WORLD_SIZE", world)),
        master_addr=env.get("MASTER_ADDR"),
        master_port=int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None,
    )


def _master_port(env: Mapping[str, str], launcher: str) -> int | None:
    if not env.get("MASTER_PORT"):
        return None
    port = _int(env, "MASTER_PORT", launcher)
    if not 0 < port < 65536:
        raise LaunchError(f"{launcher}: MASTER_PORT={port} is not a TCP port")
    return port


def _check_rank(launcher: str, what: str, rank: int, size: int) -> None:
    if size < 1:
        raise LaunchError(f"{launcher}: {what} size {size} must be positive")
    if rank >= size:
        raise LaunchError(f"{launcher}: {what} rank {rank} is outside a size of {size}")


def _slurm(env: Mapping[str, str]) -> Launch:
    who = "Slurm step"
    rank = _int(env, "SLURM_PROCID", who)
    size_var = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if size_var is None:
        raise LaunchError(f"{who}: SLURM_PROCID is set but not SLURM_NTASKS")
    world = _int(env, size_var, who)
    _check_rank(who, "task", rank, world)
    local_rank = _int(env, "SLURM_LOCALID", who) if env.get("SLURM_LOCALID") else None

    per_node: int | None = None
    counts_var = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    counts = parse_tasks_per_node(env[counts_var]) if counts_var else None
    if counts is not None:
        if sum(counts) != world:
            raise LaunchError(
                f"{who}: {counts_var}={env[counts_var]} names {sum(counts)} tasks but "
                f"{size_var}={world}"
            )
        per_node = counts[0]
    elif env.get("SLURM_NTASKS_PER_NODE"):
        per_node = min(world, _int(env, "SLURM_NTASKS_PER_NODE", who))
    if per_node is not None and local_rank is not None:
        most = max(counts) if counts else per_node
        if local_rank >= most:
            raise LaunchError(
                f"{who}: SLURM_LOCALID={local_rank} but at most {most} tasks per node"
            )
    if local_rank is None or per_node is None:
        local_rank = per_node = None  # learnt from host names, as under PMI

    nodes_var = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    addr = env.get("MASTER_ADDR")
    if not addr and world > 1:
        if nodes_var is None:
            raise LaunchError(
                f"{who} of {world} tasks without a node list (SLURM_JOB_NODELIST) to find "
                "rank 0's host; set MASTER_ADDR"
            )
        hosts = parse_hostlist(env[nodes_var])
        if not hosts:
            raise LaunchError(f"{who}: {nodes_var} is empty")
        if counts is not None and len(counts) != len(hosts):
            raise LaunchError(
                f"{who}: {nodes_var}={env[nodes_var]} names {len(hosts)} hosts but "
                f"{counts_var}={env[counts_var]} names {len(counts)} nodes"
            )
        addr = hosts[0]
    port = _master_port(env, who)
    if port is None and world > 1:
        if not env.get("SLURM_JOB_ID"):
            raise LaunchError(f"{who}: no SLURM_JOB_ID to derive the port from; set MASTER_PORT")
        port = 10000 + _int(env, "SLURM_JOB_ID", who) % 50000
    return Launch("slurm", rank, world, local_rank, per_node, addr or None, port)


def _openmpi(env: Mapping[str, str]) -> Launch:
    who = "Open MPI launch"
    for name in ("SIZE", "LOCAL_RANK", "LOCAL_SIZE"):
        name = f"OMPI_COMM_WORLD_{name}"
        if not env.get(name):
            raise LaunchError(f"{who}: OMPI_COMM_WORLD_RANK is set but not {name}")
    rank = _int(env, "OMPI_COMM_WORLD_RANK", who)
    world = _int(env, "OMPI_COMM_WORLD_SIZE", who)
    _check_rank(who, "world", rank, world)
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", who)
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", who)
    _check_rank(who, "local", local_rank, local_size)
    # All ranks on this node: rank 0 is here too.
    addr = env.get("MASTER_ADDR") or ("127.0.0.1" if local_size == world else None)
    return _mpi_launch("openmpi", who, rank, world, local_rank, local_size, addr, env)


def _pmi(env: Mapping[str, str]) -> Launch:
    who = "MPICH/PMI launch"
    if not env.get("PMI_SIZE"):
        raise LaunchError(f"{who}: PMI_RANK is set but not PMI_SIZE")
    rank, world = _int(env, "PMI_RANK", who), _int(env, "PMI_SIZE", who)
    _check_rank(who, "world", rank, world)
    local_rank, per_node = (0, 1) if world == 1 else (None, None)
    return _mpi_launch("pmi", who, rank, world, local_rank, per_node, env.get("MASTER_ADDR"), env)


def _mpi_launch(
    launcher: str,
    who: str,
    rank: int,
    world: int,
    local_rank: int | None,
    per_node: int | None,
    addr: str | None,
    env: Mapping[str, str],
) -> Launch:
    if world > 1 and not addr:
        raise LaunchError(
            f"{who} of {world} ranks needs rank 0's host: set MASTER_ADDR (e.g. "
            "mpirun -x MASTER_ADDR=$(hostname)) or pass gnnpar --master-addr HOST"
        )
    port = _master_port(env, who) or (DEFAULT_MPI_PORT if world > 1 else None)
    return Launch(launcher, rank, world, local_rank, per_node, addr, port)


def detect_launch(environ: Mapping[str, str] | None = None) -> Launch | None:
    """The launch this process belongs to, or ``None`` for a plain process; raises
    :class:`LaunchError` when the launcher's variables are incomplete or inconsistent."""
    env = os.environ if environ is None else environ
    if _is_torchrun(env):
        return _torchrun(env)
    if env.get("SLURM_PROCID") and (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
        slurm = _slurm(env)
        # mpirun inside an allocation starts its daemons with srun: the ranks inherit the
        # daemons' step (one task per node), and the MPI variables describe the real world.
        # (srun --mpi=pmi2 sets PMI variables that agree with the step.)
        mpi = _mpi_rank_size(env)
        if mpi is None or mpi == (slurm.rank, slurm.world_size):
            return slurm
    if env.get("OMPI_COMM_WORLD_RANK"):
        return _openmpi(env)
    if env.get("PMI_RANK"):
        return _pmi(env)
    return None


def _mpi_rank_size(env: Mapping[str, str]) -> tuple[int, int] | None:
    for rank, size in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if env.get(rank) and env.get(size):
            return _int(env, rank, "MPI launch"), _int(env, size, "MPI launch")
    return None


def under_launcher() -> bool:
    """Whether a launcher already started this process as part of a world (torchrun, or a
    Slurm step / MPI launch of more than one process), so ``--nprocs`` must not start more."""
    launch = detect_launch()
    return launch is not None and (launch.launcher == "torchrun" or launch.world_size > 1)


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How often this run has been started again: torchrun's ``--max-restarts`` attempts
    plus Slurm requeues (``SLURM_RESTART_COUNT``)."""
    env = os.environ if environ is None else environ
    return sum(int(env.get(v) or 0) for v in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def apply_master_addr(value: str, environ: dict[str, str] | None = None) -> None:
    """``gnnpar --master-addr HOST[:PORT]``: set ``MASTER_ADDR`` (and ``MASTER_PORT``) for
    Slurm and MPI launches. Under torchrun its own rendezvous address is kept."""
    env = os.environ if environ is None else environ
    if _is_torchrun(env):
        return
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        host, port = value, ""
    if not host:
        raise LaunchError(f"--master-addr {value!r} names no host")
    env["MASTER_ADDR"] = host
    if port:
        env["MASTER_PORT"] = port


# ------------------------------------------------------------------------ local launch
def launch_local(
    nprocs: int,
    module_argv: Sequence[str],
    max_restarts: int = 0,
    module: str = "gnnpar.cli",
    script: str | None = None,
    env: Mapping[str, str] | None = None,
    agent: ForkedAgent | None = None,
) -> int:
    """Run ``python -m module *module_argv`` (or ``python script *module_argv``) on
    ``nprocs`` local processes under ``torch.distributed.run --standalone`` (in gnnpar's
    launch agent, which condenses a failure to one line: see the module docstring); return
    the exit code (a failed rank's own, e.g. 2 for a user error). ``env``: more variables for
    the ranks. ``agent``: a :class:`ForkedAgent` to run the launch in (else the agent starts
    as a new interpreter)."""
    if nprocs < 1:
        raise UserError(f"--nprocs must be at least 1, got {nprocs}")
    target = [script] if script is not None else ["-m", module]
    agent_argv = [
        "--standalone",
        f"--nproc-per-node={nprocs}",
        f"--max-restarts={max_restarts}",
        *target,
        *module_argv,
    ]
    env = {**os.environ, **(env or {})}
    # Ranks share the cores: one intra-op thread each unless the user chose otherwise.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The launcher logs a warning per rank about OMP_NUM_THREADS; keep the console readable.
    env.setdefault("LOGLEVEL", "ERROR")
    if agent is not None:
        return _agent_outcome(agent.launch(agent_argv, env), module_argv, nprocs)
    proc = subprocess.Popen([sys.executable, "-c", _AGENT, *agent_argv], env=env)
    try:
        return _agent_outcome(proc.wait(), module_argv, nprocs)
    except KeyboardInterrupt:
        try:
            proc.wait(timeout=AGENT_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        raise ReportedInterrupt from None


#: What to do after a death the launcher reports: a training run's checkpoints outlive it.
RESUME_HINT = "run the same command again with --resume to continue from the newest checkpoint"


def _agent_outcome(code: int, module_argv: Sequence[str], nprocs: int) -> int:
    """The launch's exit code; an agent killed by a signal (negative ``code``: it printed
    nothing, and its exit status was 247 for SIGKILL) is one line saying so and what to
    do, and exit status 128 + the signal, as a shell reports it."""
    if code >= 0:
        return code
    name = _signal_name(code).strip(" ()") or f"signal {-code}"
    print(
        f"{_command_name(module_argv)}: error: the launch agent of the {nprocs} ranks was "
        f"killed by {name}, which stops its ranks; {RESUME_HINT}",
        file=sys.stderr,
        flush=True,
    )
    return 128 - code


class ReportedInterrupt(KeyboardInterrupt):
    """Ctrl-C (or a kill) during a local launch that the launch agent has answered: it
    stopped the ranks, said so in one line and exited. The command adds no line of its
    own."""


class ForkedAgent:
    """The launch agent as a fork of the launching command, made before the command does any
    work, so a local launch costs no new interpreter (about a second and a half of CPU: Python,
    torch and gnnpar imported again).

    :meth:`start` forks while the process holds only its imports: no data of the checks before
    launch (a fork shares every page, and each rank's resident memory would count them) and no
    OpenMP thread pool (GNU OpenMP's does not survive a fork: the child's first parallel region
    waits forever). The fork waits on a pipe; :meth:`launch` hands it the agent's arguments and
    environment and waits for its exit code, :meth:`close` (the command ended without
    launching) lets it exit."""

    def __init__(self, pid: int, pipe: int):
        self.pid = pid
        self._pipe: int | None = pipe

    @classmethod
    def start(cls) -> ForkedAgent | None:
        """Fork the waiting agent, or None where ranks are not forked (:func:`_forks`) or
        this process already runs other threads."""
        import threading

        if threading.active_count() > 1 or not _forks():
            return None
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child would print the parent's buffered text again
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write)
            _serve_launch(read)
        os.close(read)
        return cls(pid, write)

    def launch(self, argv: Sequence[str], env: Mapping[str, str]) -> int:
        """Run :func:`agent` with ``argv`` and ``env`` in the fork; its exit code (negative:
        the signal that ended it, as :func:`subprocess.call` returns it)."""
        if self._pipe is None:
            raise RuntimeError("this forked agent has launched or been closed already")
        job = json.dumps({"argv": list(argv), "env": dict(env)}).encode()
        with os.fdopen(self._pipe, "wb") as pipe:
            self._pipe = None
            pipe.write(job)
        return self._wait()

    def close(self) -> None:
        """Let an agent that was not used exit (no-op after :meth:`launch`)."""
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
            self._wait()

    def _wait(self) -> int:
        try:
            _, status = os.waitpid(self.pid, 0)
        except BaseException as stop:
            # Interrupted (Ctrl-C reaches the agent too): give it the time to stop its ranks,
            # then do not leave it behind.
            if self._reap(grace=AGENT_GRACE_S) and isinstance(stop, KeyboardInterrupt):
                raise ReportedInterrupt from None
            raise
        return os.waitstatus_to_exitcode(status)

    def _reap(self, grace: float) -> bool:
        """Wait up to ``grace`` seconds for the agent, then kill it; whether it exited by
        itself."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if os.waitpid(self.pid, os.WNOHANG)[0]:
                return True
            time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        return False


def _serve_launch(pipe: int) -> None:
    """The forked agent: wait for a job on ``pipe``, run it, exit (never returns)."""
    code = 1
    try:
        with os.fdopen(pipe, "rb") as source:
            job = source.read()
        if not job:
            code = 0
        else:
            request = json.loads(job)
            os.environ.clear()
            os.environ.update(request["env"])
            import torch

            # the environment came after torch's import: its thread count, set for the ranks
            threads = os.environ.get("OMP_NUM_THREADS", "")
            torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) else 1)
            code = agent(request["argv"])
    except KeyboardInterrupt:  # before the ranks started: the one line is this one
        print("interrupted", file=sys.stderr)
        code = 130
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


def strip_nprocs(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--nprocs N`` / ``--nprocs=N`` (the child runs with the launcher's
    environment instead)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nprocs":
            skip = True
            continue
        if a.startswith("--nprocs="):
            continue
        out.append(a)
    return out


# ------------------------------------------------------------------ failures of a launch
def rank_and_world() -> tuple[int, int]:
    """This process's rank and world size under a launcher, ``(0, 1)`` without one (or with
    an inconsistent launcher environment, which :func:`gnnpar.init` reports)."""
    try:
        launch = detect_launch()
    except LaunchError:
        return 0, 1
    return (0, 1) if launch is None else (launch.rank, launch.world_size)


def is_secondary(err: BaseException) -> bool:
    """Whether ``err`` only says that a peer went away: the consequence of another rank's
    failure, not its cause. Told by type, of ``err`` and of the errors it was raised from
    (``raise ... from``, its ``__cause__`` chain: a :class:`~gnnpar.comm.CommError` raised
    from a lost connection counts, one raised for a tensor on the wrong device does not; an
    error raised while handling a lost connection, its ``__context__``, is its own):

    - :class:`~gnnpar.errors.PeerFailedError`: a rank that stops because another one failed
      (rank 0 could not prepare the shards, "see its error");
    - ``ConnectionError`` (reset, refused, aborted, broken pipe) and ``TimeoutError``;
    - torch.distributed's ``DistNetworkError`` (a socket to a peer failed or timed out) and
      ``DistStoreError`` (a peer never wrote what the store waited for);
    - gloo's lost connections and timeouts, which torch raises untyped
      (:func:`_gloo_lost_peer`).

    Not ``DistBackendError``: NCCL raises it for every failed call, a misuse (a bug) too.
    """
    from gnnpar.errors import PeerFailedError

    dist = sys.modules.get("torch.distributed")  # none of its errors without it imported
    lost: tuple[type[BaseException], ...] = (PeerFailedError, ConnectionError, TimeoutError)
    if dist is not None:
        lost += (dist.DistNetworkError, dist.DistStoreError)
    return any(isinstance(e, lost) or _gloo_lost_peer(e) for e in _chain(err))


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the errors it was raised from (``raise ... from``), innermost last."""
    out: list[BaseException] = []
    cur: BaseException | None = err
    while cur is not None and not any(cur is e for e in out):
        out.append(cur)
        cur = cur.__cause__
    return out


def _gloo_lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is gloo's report of a lost peer: a connection reset or closed by the
    peer, refused, a broken pipe, a failed ``connectFullMesh``, or a send or receive that
    timed out. torch turns gloo's exceptions (``gloo::IoException``, ``gloo::TimeoutException``,
    its enforce failures) into a plain ``RuntimeError`` (torch 2.13 still does: only NCCL's
    and the store's errors get a ``DistError`` type), whose message starts with the gloo
    source file that raised it; so this is the one place that reads an error's text, and only
    a plain ``RuntimeError``'s that names gloo."""
    if type(err) is not RuntimeError:
        return False
    text = str(err).lower()
    return "gloo" in text and any(marker in text for marker in _GLOO_PEER_LOSS)


def record_failure(
    directory: str | os.PathLike,
    rank: int,
    message: str,
    code: int,
    detail: str = "",
    secondary: bool = False,
) -> None:
    """Write this rank's failure (one line, the exit code it will have, and e.g. a traceback
    as ``detail``) for the launch agent; the newest attempt's records are the ones read.
    ``secondary``: the failure only echoes a peer's (:func:`is_secondary` of the error), so
    the agent names another rank's first."""
    record = {
        "rank": rank,
        "attempt": restart_count(),
        "time": time.time(),
        "message": message,
        "code": code,
        "detail": detail,
        "secondary": bool(secondary),
    }
    path = Path(directory) / f"rank-{rank}-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def read_failures(directory: str | os.PathLike) -> list[dict[str, Any]]:
    """The failure records of the newest attempt in ``directory``, root cause first: the
    failures that are not peers' lost connections before those that are, each in the order
    they happened."""
    records = []
    for path in sorted(Path(directory).glob("rank-*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # a rank killed while writing: the others still tell the story
    if not records:
        return []
    newest = max(r["attempt"] for r in records)
    records = [r for r in records if r["attempt"] == newest]
    return sorted(records, key=lambda r: (r["secondary"], r["time"]))


def _signal_name(exitcode: int) -> str:
    try:
        return f" ({signal.Signals(-exitcode).name})" if exitcode < 0 else ""
    except ValueError:
        return ""


def _killed_without_record(error: Any, records: list[dict[str, Any]]) -> tuple[int, int] | None:
    """(rank, exit code) of the first rank the launcher saw end by a signal (a SIGKILL, the
    kernel's out-of-memory killer) that wrote no failure record, or None."""
    reported = {r["rank"] for r in records}
    failures = getattr(error, "failures", None) or {}
    dead = [
        (f.timestamp, rank, f.exitcode)
        for rank, f in failures.items()
        if f.exitcode < 0 and rank not in reported and _signal_name(f.exitcode)
    ]
    return (min(dead)[1], min(dead)[2]) if dead else None


def summarise_failure(error: Any, records: list[dict[str, Any]], nprocs: int) -> tuple[str, int]:
    """The agent's report of a failed launch (its first line names the rank and the root
    cause) and the exit code, from the ranks' records or, without any, from the launcher's
    ``ChildFailedError``."""
    killed = _killed_without_record(error, records)
    if killed is not None and all(r["secondary"] for r in records):
        # the others only lost their connection to it: the dead rank is the cause
        rank, code = killed
        return (
            f"rank {rank} of {nprocs} was killed by {_signal_name(code).strip(' ()')} before "
            f"it could report anything (the other ranks lost their connection to it); "
            f"{RESUME_HINT}",
            128 - code,
        )
    silent = sorted(set(range(int(nprocs))) - {r["rank"] for r in records})
    if records and silent and all(r["secondary"] for r in records):
        # torchrun names one failed rank, not always the first: when it names a peer that
        # only lost its connection, the ranks that reported nothing are where it began
        who = f"rank {silent[0]}" if len(silent) == 1 else f"one of ranks {silent}"
        return (
            f"{who} of {nprocs} ended without reporting an error (killed by a signal, such as "
            f"the out-of-memory killer's; the other ranks lost their connection to it); "
            f"{RESUME_HINT}",
            1,
        )
    if records:
        # an error several ranks raised alike (a NaN loss every rank sees) is named by the
        # lowest of them, not by whichever wrote first
        alike = [r for r in records if r["message"] == records[0]["message"]]
        root = min(alike, key=lambda r: r["rank"])
        line = f"rank {root['rank']} of {nprocs}: {root['message']}"
        if root["detail"]:
            line += f" (its traceback follows)\n{root['detail'].rstrip()}"
        return line, int(root["code"]) or 1
    rank, failure = error.get_first_failure()
    code = failure.exitcode
    return (
        f"rank {rank} of {nprocs} exited with status {code}{_signal_name(code)} without "
        "reporting an error (see its output above)",
        code if code > 0 else 1,
    )


def agent(argv: Sequence[str]) -> int:
    """The launch agent of :func:`launch_local`: ``torch.distributed.run`` with arguments
    ``argv``, reporting a failed launch as one line (and exiting with the failed rank's code)
    instead of its ``ChildFailedError`` report. For a ``--standalone`` launch where ranks can be
    forked (:func:`_forks`: Linux, no accelerator), they are forked from this process after
    it has imported what every rank imports (see :func:`run_rank`), instead of each starting
    a new interpreter."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The agent's own log lines ("failed (exitcode: 2)", "Sending process ... SIGTERM", and
    # from forked ranks "Terminating process ... via signal SIGTERM") repeat what the summary
    # says.
    for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    args = parse_args(list(argv))
    directory = tempfile.mkdtemp(prefix="gnnpar-errors-")
    os.environ[ERROR_DIR_ENV] = directory
    try:
        if args.standalone and _forks():
            _run_forked(args)
        else:
            run(args)
        return 0
    except ChildFailedError as error:
        line, code = summarise_failure(error, read_failures(directory), args.nproc_per_node)
        command = _command_name(args.training_script_args)
        print(f"{command}: error: {line}", file=sys.stderr, flush=True)
        return code
    except SignalException as stop:  # Ctrl-C or a kill: the launcher stopped the ranks
        command = _command_name(args.training_script_args)
        name = getattr(stop.sigval, "name", stop.sigval)
        print(f"{command}: interrupted by {name}; the ranks were stopped", file=sys.stderr)
        return 128 + int(stop.sigval)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _forks() -> bool:
    """Whether the agent forks its ranks: on Linux without an accelerator (a GPU runtime
    does not survive a fork once the driver is up, so ranks that may use one start as new
    interpreters), unless ``GNNPAR_LAUNCH_FORK=0``."""
    import multiprocessing

    if sys.platform != "linux" or "fork" not in multiprocessing.get_all_start_methods():
        return False
    if os.environ.get(FORK_ENV, "1") == "0":
        return False
    import torch

    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6: CUDA, ROCm, XPU, ...
    if accelerator is not None:
        return not accelerator.is_available()
    return not torch.cuda.is_available()


def _run_forked(args: Any) -> None:
    """``torch.distributed.run``'s ``run(args)`` for ``--standalone`` (its one-node
    rendezvous, set here as ``run`` sets it), with the ranks forked
    from this process (its ``fork`` start method for function entry points) after importing
    torch, gnnpar and ``torch._dynamo`` once here: each rank would otherwise spend seconds of
    CPU on them (``torch._dynamo`` is imported by the first optimizer step), which on a small
    machine is most of a short run's start-up."""
    import importlib
    import uuid

    import torch._dynamo  # noqa: F401
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    # What every rank imports first, imported before the fork: the grid and the collectives
    # (a rank forked before them, which then imported them beside this process's threads,
    # was once seen stuck in a futex wait), and the module the ranks run; by name, as the
    # ranks name it.
    importlib.import_module("gnnpar.comm")
    if args.module:
        importlib.import_module(args.training_script)

    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    kind = "module" if args.module else "script"
    elastic_launch(config, entrypoint=run_rank)(
        kind, args.training_script, *args.training_script_args
    )


def stacks_on_request() -> None:
    """Let ``kill -USR1 PID`` print every thread's Python stack of this process to its stderr
    and go on (:mod:`faulthandler`): a hung rank then says where it waits. Every launched
    rank calls it (:func:`run_rank`, :func:`gnnpar.init` under a launcher); SIGUSR1 keeps a
    handler the program installed, and only the main thread can install one."""
    import faulthandler
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
        return
    try:  # the process's own stderr: sys.stderr may be a capture with no descriptor
        fd = sys.__stderr__.fileno() if sys.__stderr__ is not None else -1
    except (OSError, ValueError):
        fd = -1
    if fd >= 0:
        faulthandler.register(signal.SIGUSR1, file=fd, all_threads=True)


def run_rank(kind: str, target: str, *argv: str) -> None:
    """One forked rank: run ``target`` as ``python -m target *argv`` (``kind="module"``) or
    ``python target *argv`` (``kind="script"``) would."""
    import runpy
    import warnings

    stacks_on_request()
    if kind == "module":
        sys.argv = [target, *argv]
        # The agent imported the module already (to warm up): running it as __main__ is then a
        # second module object, as it is for ``python -m`` when anything imports it again.
        warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning, "runpy")
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, str(Path(target).resolve().parent))
        sys.argv = [target, *argv]
        runpy.run_path(target, run_name="__main__")


def _command_name(argv: Sequence[str]) -> str:
    """``gnnpar train`` for the ranks' ``train gcn ...`` (the prefix of their errors)."""
    words = [a for a in argv if not a.startswith("-")][:1]
    return " ".join(["gnnpar", *words])
