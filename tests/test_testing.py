"""The test helpers themselves: run_distributed's results and failure modes, grid_shapes,
reserved_port."""

from __future__ import annotations

import errno
import math
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest

from gnnpar.grid import factorizations
from gnnpar.testing import DistributedTestError, grid_shapes, reserved_port, run_distributed


def _echo(scale: int, env_name: str) -> tuple[int, int, str, str]:
    rank = int(os.environ["RANK"])
    return (
        rank * scale,
        int(os.environ["WORLD_SIZE"]),
        os.environ[env_name],
        os.environ["GNNPAR_TIMEOUT"],
    )


def test_results_come_back_in_rank_order_with_the_environment():
    out = run_distributed(_echo, 3, 10, env_name="EXTRA", timeout=30, env={"EXTRA": "on"})
    assert out == [(0, 3, "on", "30"), (10, 3, "on", "30"), (20, 3, "on", "30")]
    with pytest.raises(ValueError, match="world_size must be at least 1, got 0"):
        run_distributed(_echo, 0, 1, "EXTRA")


def _rank_one_sleeps(seconds: float) -> str:
    if os.environ["RANK"] == "1":
        time.sleep(seconds)
    return "done"


def test_a_world_that_outlives_its_timeout_names_the_ranks_still_running():
    start = time.monotonic()
    with pytest.raises(
        DistributedTestError,
        match=r"world of 3 timed out after 2s; ranks still "
        r"running: \[1\]",
    ):
        run_distributed(_rank_one_sleeps, 3, 60.0, timeout=2)
    assert time.monotonic() - start < 20  # the sleeper was killed, not waited for


def _rank_one_exits(code: int) -> str:
    if os.environ["RANK"] == "1":
        os._exit(code)
    time.sleep(0.2)
    return "done"


def test_a_rank_that_dies_without_a_result_is_reported_with_its_exit_code():
    with pytest.raises(
        DistributedTestError,
        match=r"ranks \[1\] exited without a result "
        r"\(exit codes \{1: 7\}\)",
    ):
        run_distributed(_rank_one_exits, 2, 7, timeout=60)


def _root_cause_late() -> None:
    """Rank 0 fails first with what a peer's crash looks like through a socket; rank 1's own
    error, the root cause, arrives later."""
    if os.environ["RANK"] == "0":
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")
    time.sleep(0.5)
    raise ValueError("the real bug on rank 1")


def _plain_failure() -> None:
    if os.environ["RANK"] == "2":
        raise KeyError("only rank 2")


def test_the_root_cause_rank_is_reported_not_the_first_consequence():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_root_cause_late, 2, timeout=60)
    msg = str(info.value)
    assert msg.startswith("rank 1 of 2 failed (ranks [0] failed after it):"), msg
    assert "ValueError: the real bug on rank 1" in msg and "Connection closed" not in msg
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_plain_failure, 3, timeout=60)
    msg = str(info.value)
    assert msg.startswith("rank 2 of 3 failed:\n") and "KeyError: 'only rank 2'" in msg, msg


def test_a_reserved_port_is_held_from_other_processes_but_a_store_can_serve_on_it():
    import torch.distributed as dist

    with reserved_port(10000, 60000) as port:
        assert 10000 <= port < 60000
        # what lost the race before: another socket binding it, or port 0 handing it out
        for host in ("127.0.0.1", ""):
            with socket.socket() as other, pytest.raises(OSError) as err:
                other.bind((host, port))
            assert err.value.errno == errno.EADDRINUSE
        others = [socket.socket() for _ in range(200)]
        try:
            for other in others:
                other.bind(("127.0.0.1", 0))
            assert port not in {o.getsockname()[1] for o in others}
        finally:
            for other in others:
                other.close()
        # rank 0's rendezvous store still binds it and serves
        store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
        client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=10))
        store.set("key", "value")
        assert client.get("key") == b"value"
        del client, store
    with pytest.raises(RuntimeError, match=r"no free port in \[1, 2\) among"):
        with reserved_port(1, 2):
            pass


def test_grid_shapes_cover_every_factorisation_of_powers_of_two_and_one_of_the_rest():
    for world in (1, 2, 4, 8):
        for axes in (("x", "y", "z"), ("data", "x", "y", "z"), ("data",), ("x", "y")):
            shapes = grid_shapes(world, axes)
            assert len(shapes) == len(factorizations(world, len(axes)))
            assert len({tuple(s.values()) for s in shapes}) == len(shapes)
            assert all(list(s) == list(axes) and math.prod(s.values()) == world for s in shapes)
    assert grid_shapes(8)[0] == {"x": 1, "y": 1, "z": 8}
    x3, y3, z3 = ({"x": 3, "y": 1, "z": 1}, {"x": 1, "y": 3, "z": 1}, {"x": 1, "y": 1, "z": 3})
    assert grid_shapes(3) == [x3, y3, z3]
    x3y2, y3z2, z3x2 = (
        {"x": 3, "y": 2, "z": 1},
        {"x": 1, "y": 3, "z": 2},
        {"x": 2, "y": 1, "z": 3},
    )
    assert grid_shapes(6) == [x3y2, y3z2, z3x2]
    assert grid_shapes(7, ("x", "y")) == [{"x": 7, "y": 1}, {"x": 1, "y": 7}]
    assert grid_shapes(5, ("data",)) == [{"data": 5}]
    with pytest.raises(ValueError, match="world must be at least 1"):
        grid_shapes(0)


def test_every_curated_mutant_still_applies():
    """Each mutant's original line occurs exactly once in its file: a refactor that moves the
    code must move the mutant too, or ``make mutants`` silently checks less than it says."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    root = Path(__file__).resolve().parent.parent
    mutants = tomllib.loads((root / "tests" / "mutants" / "mutants.toml").read_text())["mutant"]
    stale = [
        f"{m['id']} ({m['file']}: found {(root / m['file']).read_text().count(m['original'])}x)"
        for m in mutants
        if (root / m["file"]).read_text().count(m["original"]) != 1
    ]
    assert not stale, "mutants whose original line is gone or ambiguous: " + ", ".join(stale)
