"""Run a function on a world of real processes (gloo), for tests and examples.

:func:`run_distributed` starts ``world_size`` processes once, runs ``fn`` on each with the
torch.distributed environment set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), and returns every rank's return value. Group many checks
into one ``fn``: starting a world costs seconds. If any rank raises, the test fails with that
rank's traceback; if the world outlives ``timeout`` seconds, every process is killed and the
failure says which ranks were still running.

:func:`grid_shapes` lists the grid shapes a distributed test runs on: every factorisation
of the worlds 1, 2, 4 and 8 over the axes a layer uses, and for the worlds 3, 5, 6 and 7 one
shape per axis with an odd size on that axis.

:func:`reserved_port` holds a free port for a block (no other process can take it between the
choice and the rendezvous store's bind, as it can with :func:`free_port`'s port).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gnnpar.grid import factorizations

#: Seconds a world whose ranks all returned gets to exit before its processes are killed.
EXIT_GRACE = 10.0
#: The worlds whose every factorisation is tested (others get one shape per axis).
EVERY_SHAPE_WORLDS = (1, 2, 4, 8)


def grid_shapes(world: int, axes: Sequence[str] = ("x", "y", "z")) -> list[dict[str, int]]:
    """The grid shapes of ``world`` ranks over ``axes`` (each shape a dict ``axis -> size``
    whose product is ``world``; axes not listed are left to the grid, i.e. 1 or data).

    Worlds 1, 2, 4 and 8: every ordered factorisation over ``axes``. Any other world: one
    shape per axis, with the world's largest prime factor on that axis and the rest of the
    world on the next axis (cyclically), so that an odd split shows on every axis: 6 over
    (x, y, z) gives x=3·y=2, y=3·z=2 and z=3·x=2.
    """
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    if not axes:
        raise ValueError("grid_shapes needs at least one axis")
    if world in EVERY_SHAPE_WORLDS:
        return [dict(zip(axes, f, strict=True)) for f in factorizations(world, len(axes))]
    prime = max(p for p in range(2, world + 1) if world % p == 0 and _is_prime(p))
    shapes = []
    for i, axis in enumerate(axes):
        shape = dict.fromkeys(axes, 1)
        shape[axis] = prime
        shape[axes[(i + 1) % len(axes)]] *= world // prime
        if shape not in shapes:
            shapes.append(shape)
    return shapes


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


class DistributedTestError(AssertionError):
    """A rank of a test world raised, or the world timed out."""


#: Ports :func:`reserved_port` draws before it gives up finding one in the range asked for.
RESERVE_TRIES = 256


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now (and may be taken by
    another process before it is used: :func:`reserved_port` holds one instead)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def reserved_port(low: int = 1, high: int = 65536) -> Iterator[int]:
    """A free TCP port in ``[low, high)``, held until the block ends.

    The port is held by a socket bound to it with ``SO_REUSEADDR`` that never listens. While
    it is bound, the kernel gives the port to no other socket that binds port 0 and uses it
    for no outgoing connection, and an explicit bind without ``SO_REUSEADDR`` fails; a server
    that sets ``SO_REUSEADDR`` (torch's ``TCPStore`` does) still binds and listens on it. So a
    rendezvous on this port cannot lose it to another process between the choice and the
    store's bind, which a port that was only checked free (:func:`free_port`) can.
    """
    held: list[socket.socket] = []
    try:
        for _ in range(RESERVE_TRIES):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if low <= port < high:
                # the ports drawn outside the range stay bound until now, so none repeats
                for other in held[:-1]:
                    other.close()
                del held[:-1]
                yield port
                return
        raise RuntimeError(
            f"no free port in [{low}, {high}) among {RESERVE_TRIES} the kernel handed out "
            "(its range of ephemeral ports may not reach it)"
        )
    finally:
        for s in held:
            s.close()


def _worker(
    rank: int,
    world_size: int,
    port: int,
    env: dict[str, str],
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    results: mp.Queue,
) -> None:
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    # Many ranks share few cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        out = fn(*args, **kwargs)
        results.put((rank, "ok", out))
    except BaseException as err:  # noqa: BLE001 - the parent reports whatever the rank raised
        from gnnpar.launch import is_secondary

        # the type is known here only: the parent gets the traceback's text and the verdict
        results.put((rank, "error", (traceback.format_exc(), is_secondary(err))))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` processes; return the per-rank results.

    ``fn`` must be importable by name (defined at module level). ``env`` adds environment
    variables in every rank (e.g. ``GNNPAR_TIMEOUT``).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    # fork starts a world in a fraction of spawn's time; the parent never touches
    # torch.distributed, so nothing unsafe is inherited.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    results = ctx.Queue()
    with reserved_port() as port:  # held while the world runs: rank 0's store binds it
        return _run_world(ctx, results, port, fn, world_size, args, kwargs, timeout, env)


def _run_world(
    ctx: Any,
    results: mp.Queue,
    port: int,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    kwargs: dict,
    timeout: float,
    env: dict[str, str] | None,
) -> list[Any]:
    extra = {"GNNPAR_TIMEOUT": str(int(timeout)), **(env or {})}
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, extra, fn, args, kwargs, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise DistributedTestError(
                    f"world of {world_size} timed out after {timeout:.0f}s; ranks still "
                    f"running: {missing}" + _first_error(outcomes)
                )
            try:
                rank, status, payload = results.get(timeout=min(left, 1.0))
                outcomes[rank] = (status, payload)
                if status == "error":
                    # One rank failed: its peers may be blocked in a collective; give them
                    # a moment to fail too, then report the first error.
                    _drain(results, outcomes, world_size, grace=3.0)
                    break
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if not p.is_alive() and r not in outcomes
                ]
                if dead and results.empty():
                    time.sleep(0.5)
                    _drain(results, outcomes, world_size, grace=0.5)
                    dead = [r for r in dead if r not in outcomes]
                    if dead:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise DistributedTestError(
                            f"ranks {dead} exited without a result (exit codes {codes})"
                            + _first_error(outcomes)
                        ) from None
    finally:
        # Ranks that all returned are left to exit on their own (tearing down their groups,
        # and writing coverage data when measured); after a failure or a timeout the rest may
        # be stuck in a collective, so they are killed at once.
        grace = time.monotonic() + (EXIT_GRACE if len(outcomes) == world_size else 0.0)
        for p in procs:
            p.join(timeout=max(0.0, grace - time.monotonic()))
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
    errors = {r: payload for r, (s, payload) in outcomes.items() if s == "error"}
    if errors:
        rank = _root_cause(errors)
        others = sorted(set(errors) - {rank})
        also = f" (ranks {others} failed after it)" if others else ""
        text = errors[rank][0]
        raise DistributedTestError(f"rank {rank} of {world_size} failed{also}:\n{text}")
    return [outcomes[r][1] for r in range(world_size)]


def _root_cause(errors: dict[int, tuple[str, bool]]) -> int:
    """The failing rank whose error is not just a peer's failure seen through a socket
    (each error is its traceback and whether the rank found it secondary,
    :func:`gnnpar.launch.is_secondary`; dicts keep arrival order, so ties go to the first to
    fail)."""
    for rank, (_, secondary) in errors.items():
        if not secondary:
            return rank
    return next(iter(errors))


def _drain(results: mp.Queue, outcomes: dict, world_size: int, grace: float) -> None:
    end = time.monotonic() + grace
    while len(outcomes) < world_size and time.monotonic() < end:
        try:
            rank, status, payload = results.get(timeout=max(0.05, end - time.monotonic()))
            outcomes[rank] = (status, payload)
        except queue.Empty:
            break


def _first_error(outcomes: dict) -> str:
    errs = {r: p for r, (s, p) in outcomes.items() if s == "error"}
    if not errs:
        return ""
    rank = _root_cause(errs)
    return f"\nrank {rank} failed first:\n{errs[rank][0]}"
