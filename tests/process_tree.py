"""Run a command whose processes may hang (a launch of several ranks) with a time limit: past
it, every process of the command's tree that has no child of its own (the ranks) is asked for
its threads' stacks (SIGUSR1: gnnpar's ranks print them, :func:`gnnpar.launch.stacks_on_request`),
and then the whole tree is killed, so a hung launch neither leaves ranks running for the rest
of the suite nor fails without saying where it waited."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

#: Seconds the ranks get to print their stacks before the tree is killed.
STACKS_GRACE_S = 3.0


def _children() -> dict[int, list[int]]:
    """Every process's children, read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended meanwhile
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """Every process below ``pid``, nearest first."""
    children = _children() if children is None else children
    out, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        out += below
        todo += below
    return out


def run_tree(
    argv: Sequence[str], *, timeout: float, cwd: str | Path, env: Mapping[str, str]
) -> tuple[int | None, str]:
    """``(exit code, output)`` of ``argv`` (stdout and stderr together); the exit code is
    None when it ran past ``timeout`` seconds, the output then ending with the stacks its
    leaf processes printed before the tree was killed."""
    proc = subprocess.Popen(
        list(argv), cwd=cwd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, errors="replace", start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        children = _children()
        tree = descendants(proc.pid, children)
        for pid in (p for p in tree if p not in children):  # the leaves: the ranks
            _signal(pid, signal.SIGUSR1)
        time.sleep(STACKS_GRACE_S)
        _signal(-proc.pid, signal.SIGKILL)  # the session: the command and all it started
        for pid in tree:
            _signal(pid, signal.SIGKILL)  # any that left the session
        out, _ = proc.communicate()
        return None, out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig) if pid > 0 else os.killpg(-pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
