"""The process grid: shapes, coordinates, group membership, placement, errors."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import gnnpar
from gnnpar.grid import GridError, axes_of, default_shape, factorizations
from gnnpar.testing import grid_shapes, run_distributed

AXES4 = ("data", "x", "y", "z")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _check_grid(world: int, data: int, x: int, y: int, z: int) -> None:
    """Build one grid, check its coordinates and every group, then release it."""
    grid = gnnpar.init(data=data, x=x, y=y, z=z)
    me = dist.get_rank()
    if grid.world_size != world or grid.global_rank != me:
        raise AssertionError(f"bad world/rank for {grid.describe()}")
    c = grid.coords()
    if me != c["x"] + x * (c["y"] + y * (c["z"] + z * c["data"])):
        raise AssertionError(f"rank order is not x-fastest: {c} on rank {me}")
    if grid.rank_of(**c) != me:
        raise AssertionError("rank_of does not invert coords")
    for axis in ("x", "y", "z", "data", "tensor", "world", "xy", "xz", "yz"):
        members = grid.ranks(axis)
        if me not in members or len(members) != grid.size(axis):
            raise AssertionError(f"{axis}: {members} for rank {me}")
        if members[grid.rank(axis)] != me:
            raise AssertionError(f"{axis}: rank index {grid.rank(axis)} not at {me}")
        fixed = {"x", "y", "z", "data"} - set(axes_of(axis))
        for m in members:
            cm = grid.coords(m)
            if any(cm[a] != c[a] for a in fixed):
                raise AssertionError(f"{axis}: member {m} differs on a fixed axis")
        group = grid.group(axis)
        if grid.size(axis) == 1:
            if group is not None:
                raise AssertionError(f"{axis}: size-1 axis has a group")
            continue
        if dist.get_process_group_ranks(group) != sorted(members):
            raise AssertionError(f"{axis}: group ranks differ from grid.ranks")
        t = torch.tensor([float(me)])
        gnnpar.comm.all_reduce(t, grid, axis)
        if t.item() != float(sum(members)):
            raise AssertionError(f"{axis}: all_reduce gave {t.item()}, not {sum(members)}")
    gnnpar.release(grid)


def _check_every_factorization(world: int) -> int:
    checked = 0
    threads = None
    for shape in grid_shapes(world, AXES4):
        if checked == 1:  # the world group and its threads exist from here on
            threads = _threads()
        _check_grid(world, *(shape[a] for a in AXES4))
        checked += 1
    # Released grids leave no threads behind once dropped (each gloo group holds several).
    if threads is not None and _threads() > threads + 2:
        raise AssertionError(f"{_threads() - threads} threads left after releasing every grid")
    return checked


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_every_factorization_builds(world):
    counts = run_distributed(_check_every_factorization, world, world, timeout=300)
    assert counts == [len(grid_shapes(world, AXES4))] * world


def test_world_of_one_without_torch_distributed(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    grid = gnnpar.init()
    assert not dist.is_initialized()
    assert grid.shape == {"x": 1, "y": 1, "z": 1, "data": 1}
    assert grid.group("x") is None and grid.ranks("tensor") == [0]
    assert grid.backend == "gloo" and grid.device.type == "cpu"
    t = torch.arange(3.0)
    assert gnnpar.comm.all_reduce(t, grid, "x") is t
    msg = r"x\*y\*z = 2\*1\*1 = 2 does not divide the world size 1"
    with pytest.raises(GridError, match=msg):
        gnnpar.init(x=2)


def test_unknown_axis_and_bad_sizes(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    grid = gnnpar.init()
    with pytest.raises(GridError, match="unknown grid axis 'w'"):
        grid.size("w")
    with pytest.raises(GridError, match="must be a positive integer"):
        gnnpar.init(x=0)
    with pytest.raises(GridError, match="cannot move tensors"):
        gnnpar.init(backend="nccl", device="cpu")


def _mismatch() -> str:
    try:
        gnnpar.init(data=1, x=3)
    except GridError as e:
        return str(e)
    return "no error"


def test_grid_not_matching_world_names_both_numbers():
    msgs = run_distributed(_mismatch, 2)
    assert all("1*3*1*1 = 3 does not match the world size 2" in m for m in msgs), msgs


def _placement() -> dict:
    grid = gnnpar.init(data=2, x=2, ranks_per_node=2)
    return {
        "x": grid.is_intra_node("x"),
        "data": grid.is_intra_node("data"),
        "world": grid.is_intra_node("world"),
        "node": grid.node(),
    }


def test_intra_node_groups():
    out = run_distributed(_placement, 4)
    assert [o["node"] for o in out] == [0, 0, 1, 1]
    assert all(o["x"] and not o["data"] and not o["world"] for o in out)


def test_default_shape_gives_factors_of_two_to_x_y_z_in_turn():
    assert default_shape(1) == {"x": 1, "y": 1, "z": 1, "data": 1}
    assert default_shape(4) == {"x": 2, "y": 2, "z": 1, "data": 1}
    assert default_shape(16) == {"x": 2, "y": 2, "z": 2, "data": 2}
    assert default_shape(6) == {"x": 2, "y": 1, "z": 1, "data": 3}


def test_factorizations_count():
    assert len(factorizations(8)) == 20
    assert len(factorizations(1)) == 1
    assert all(a * b * c * d == 12 for a, b, c, d in factorizations(12))
