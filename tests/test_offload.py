"""Offload tiers of :func:`gnnpar.shard.shard` (``offload="host"`` and ``"file"``) against
the plain run, in one world of 8 ranks.

- **Equality**: the small model of ``tests/test_shard.py`` (odd sizes, float64) trains 3
  AdamW steps at stages 1, 2 and 3 on data = 2 (z = 4) and data = 4 (z = 2) with each tier;
  every parameter after every step equals the serial model's to |a − b| ≤ 1e-12·(1 + |b|)
  (``tests/test_shard.py`` holds the plain sharded run to the same serial model); stage 3
  with mixed precision (float32 compute, float64 masters) equals its own plain run.
- **Anonymous memory** (the reason for the file tier): on data = 8 a stack of 4 linear
  layers of width 512 (131,584 float64 parameters per rank) trains 2 steps at stage 3 with
  and without the file tier. The rank's RssAnon (``/proc/self/status``, after
  ``malloc_trim``) grows less with the file tier by the bytes it maps, written out here::

      drop = master + exp_avg + exp_avg_sq = 3 · Σ_units chunk · 8 bytes

  (chunk = the unit's trainable parameters padded to a multiple of 8, over 8), to 15 %
  (measured: 3.15–3.18 MB against 3.15 MB). glibc's mmap threshold is fixed for this part,
  so that freed tensors leave RssAnon.
- **Resume**: stage 3 with the file tier on data = 4 saves a checkpoint after 2 steps; a new
  model, also on the file tier, loads it (the optimizer state goes back into files) and its
  third step equals 3 uninterrupted plain steps.
- **The planner** (:func:`gnnpar.models.gpt.planning.largest_gpt`): given the per-rank memory that
  the device parts of a 4-layer GPT (width 24, 8 heads, 9 positions, vocabulary 37) take at
  data = 8, stage 3, file tier, the deepest GPT that fits is 4 layers; that model then
  trains here, and the file tier maps the bytes the memory model moved off the device
  (12 bytes a parameter: float32 master and two Adam moments, over 8 ranks), plus at most
  the padding of its 5 units (≤ 7 elements each).
- **On an accelerator** (the simulated device of :mod:`gnnpar.virtual_device`, one
  process): with either tier the masters and the optimizer state are host tensors while the
  model computes on the device, no operation mixes the two, and 2 steps equal the plain
  host run; without offload the masters are on the device.
- **The folder**: a folder in use is refused, a stale one (its process gone) is cleaned,
  a folder that cannot be created is named in one line; options that do not combine are
  refused.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gnnpar
from gnnpar import checkpoint
from gnnpar.models.gpt.cost import GPTProblem
from gnnpar.models.gpt.memory import gpt_memory
from gnnpar.models.gpt.model import GPT, Block, GPTConfig
from gnnpar.models.gpt.planning import largest_gpt
from gnnpar.plan import local_machine
from gnnpar.plan.memory import USABLE_FRACTION, device_bytes
from gnnpar.shard import MixedPrecision, by_type, shard
from gnnpar.shard.offload import OffloadError
from gnnpar.testing import run_distributed
from gnnpar.virtual_device import simulated_device
from tests.test_shard import TOL, _batch, _err, _loss, _net, _opt, _rows, _serial

WIDTH, LAYERS, RSS_DATA = 512, 4, 8
RSS_TOL = 0.15
M_MMAP_THRESHOLD = -3  # mallopt parameter of glibc's malloc.h
PLAN_SIZES = {"vocab_size": 37, "block_size": 9, "n_embd": 24, "n_head": 8}
PLAN_LAYERS = 4


def _state_err(state: dict, ref: dict) -> float:
    return max(_err(state[k], ref[k]) for k in ref)


def _train(grid, stage, offload, folder, steps=3, mp=None, start=None, first=0):
    """``steps`` AdamW steps; the full state dict after each."""
    net = _net()
    kw = {"offload_dir": folder} if offload == "file" else {}
    dp = shard(net, grid, stage, units="blocks.*", mixed_precision=mp, offload=offload, **kw)
    opt = dp.attach(_opt("adamw", dp.parameters()))
    if start is not None:
        checkpoint.load(start, grid, dp, opt)
    out = []
    for step in range(first, steps):
        x, y = _batch(step)
        _loss(net(x[_rows(grid)]), y[_rows(grid)], grid).backward()
        opt.step()
        opt.zero_grad()
        out.append(dp.full_state_dict())
    return out, dp, opt


def _rss_anon() -> int:
    """This process's anonymous resident bytes, once garbage (the sharded model holds
    reference cycles) is collected and glibc has returned its free heap pages."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def _anon_growth(grid, offload: str, folder: str) -> tuple[int, int]:
    """RssAnon growth over shard() and 2 steps at stage 3, and the bytes the tier maps."""
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))).double()
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    before = _rss_anon()
    kw = {"offload_dir": folder} if offload == "file" else {}
    dp = shard(net, grid, 3, units=list(net), offload=offload, **kw)
    opt = dp.attach(torch.optim.AdamW(dp.parameters(), lr=1e-3))
    for _ in range(2):
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    grown = _rss_anon() - before
    mapped = dp.memory(opt)["file"]
    dp.remove()
    del dp, opt, net
    return grown, mapped


def _planned(grid, folder: str) -> tuple[int, float, int]:
    """The planner's deepest GPT for the memory of a 4-layer one, trained one step on the
    file tier: (its layers, the bytes the memory model offloads, the bytes the tier maps)."""
    shape = {"data": RSS_DATA}
    problem = GPTProblem(
        GPTConfig(n_layer=1, **PLAN_SIZES), batch=8, element_size=4, schedule=None, offload="file"
    )

    def sized(layers: int) -> GPTProblem:
        model = dataclasses.replace(problem.model, n_layer=layers)
        return dataclasses.replace(problem, model=model, stage=3)

    budget = device_bytes(gpt_memory(sized(PLAN_LAYERS), shape)) / USABLE_FRACTION
    machine = dataclasses.replace(local_machine("gloo", RSS_DATA), memory_gb=budget / 1e9)
    best, cands = largest_gpt(problem, RSS_DATA, machine, (3,), shape)
    torch.manual_seed(0)
    net = GPT(best.model)
    dp = shard(net, grid, 3, units=by_type(Block), offload="file", offload_dir=folder)
    opt = dp.attach(torch.optim.AdamW(dp.parameters(), lr=1e-3))
    ids = torch.randint(0, PLAN_SIZES["vocab_size"], (1, PLAN_SIZES["block_size"] + 1))
    logits = net(ids[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    opt.step()
    mapped = dp.memory(opt)["file"]
    dp.remove()
    return best.layers, cands[0].memory["file"], mapped


def _world(folder: str) -> dict:
    out: dict = {}
    rank = int(os.environ["RANK"])
    for shape in ({"data": 2, "z": 4}, {"data": 4, "z": 2}):
        grid = gnnpar.init(**shape)
        tag = f"data={shape['data']}"
        # Against the one-process run (test_shard holds the plain sharded run to it too).
        ref = [_serial("adamw", s + 1) for s in range(3)]
        for stage in (1, 2, 3):
            for offload in ("host", "file"):
                got, dp, _ = _train(grid, stage, offload, folder)
                dp.remove()
                out[(tag, stage, offload)] = max(
                    _state_err(g, r) for g, r in zip(got, ref, strict=True)
                )
        if shape["data"] == 4:  # mixed precision and resume on the file tier
            mp = MixedPrecision(param_dtype=torch.float32, master_dtype=torch.float64)
            plain, _, _ = _train(grid, 3, "none", folder, mp=mp)
            got, dp, _ = _train(grid, 3, "file", folder, mp=mp)
            dp.remove()
            out["mp"] = max(_state_err(g, p) for g, p in zip(got, plain, strict=True))
            ckpt = os.path.join(folder, "ckpt")
            _, dp, opt = _train(grid, 3, "file", folder, steps=2)
            checkpoint.save(ckpt, 2, grid, dp, opt)
            dp.remove()
            got, dp, opt = _train(grid, 3, "file", folder, steps=3, start=ckpt, first=2)
            files = {t.untyped_storage().data_ptr() for t in dp.offload._files.values()}
            state = [v for st in opt.state.values() for v in st.values() if v.dim()]
            out["resumed_state_in_files"] = all(
                v.untyped_storage().data_ptr() in files for v in state
            ) and bool(state)
            dp.remove()
            out[(tag, "resume", "file")] = _state_err(got[-1], ref[-1])
        gnnpar.release(grid)
    grid = gnnpar.init(data=RSS_DATA)
    # A fixed mmap threshold (glibc's initial one; no dynamic raise after a large free):
    # freed tensors go back to the system, so RssAnon follows the live tensors.
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 << 10)
    _anon_growth(grid, "none", folder)  # warm-up: first-use allocations of both paths
    _anon_growth(grid, "file", folder)
    plain, _ = _anon_growth(grid, "none", folder)
    filed, mapped = _anon_growth(grid, "file", folder)
    # the formula, from the layer sizes alone: 3 tensors (master, 2 Adam moments) per element
    chunk = sum(-(-(WIDTH * WIDTH + WIDTH) // RSS_DATA) for _ in range(LAYERS))
    out["rss"] = (plain - filed, 3 * chunk * 8, mapped)
    out["plan"] = _planned(grid, folder)
    # the folder: in use by this process, stale (a process that has ended), not creatable
    net = _net()
    dp = shard(net, grid, 1, offload="file", offload_dir=folder)
    try:
        shard(_net(), grid, 1, offload="file", offload_dir=folder)
    except OffloadError as err:
        out["in_use"] = str(err)
    dp.remove()
    stale = Path(folder) / f"rank{rank}"
    stale.mkdir()
    (stale / "owner.json").write_text(json.dumps({"pid": 2**22 + 1, "host": os.uname()[1]}))
    (stale / "old.bin").write_bytes(b"x")
    dp = shard(_net(), grid, 1, offload="file", offload_dir=folder)
    out["stale_cleaned"] = not (stale / "old.bin").exists()
    dp.remove()
    out["folder_gone"] = not stale.exists()
    blocker = Path(folder) / f"file{rank}"
    blocker.write_text("")
    try:
        shard(_net(), grid, 1, offload="file", offload_dir=blocker)
    except OffloadError as err:
        out["not_creatable"] = str(err)
    gnnpar.release(grid)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    return run_distributed(_world, 8, str(tmp_path_factory.mktemp("offload")), timeout=300)


@pytest.mark.parametrize("data", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("offload", ["host", "file"])
def test_offload_trains_as_one_process(world, data, stage, offload):
    for rank, res in enumerate(world):
        err = res[(f"data={data}", stage, offload)]
        assert err <= TOL, f"rank {rank}: differs by {err}"


def test_file_tier_with_mixed_precision_and_resume(world):
    for rank, res in enumerate(world):
        assert res["mp"] <= TOL, f"rank {rank}: mixed precision differs by {res['mp']}"
        assert res[("data=4", "resume", "file")] <= TOL, rank
        assert res["resumed_state_in_files"], f"rank {rank}: loaded state is not in files"


def test_file_tier_takes_the_state_out_of_anonymous_memory(world):
    for rank, res in enumerate(world):
        drop, formula, mapped = res["rss"]
        assert mapped == formula, (rank, mapped, formula)
        assert abs(drop - formula) <= RSS_TOL * formula, (
            f"rank {rank}: RssAnon dropped by {drop} bytes, formula {formula}"
        )


def test_planner_largest_gpt_runs_and_offloads_what_it_predicts(world):
    for rank, res in enumerate(world):
        layers, predicted, mapped = res["plan"]
        assert layers == PLAN_LAYERS, (rank, layers)
        assert 0 <= mapped - predicted <= 12 * 7 * (PLAN_LAYERS + 1), (rank, mapped, predicted)


def test_offload_folder_rules(world):
    for rank, res in enumerate(world):
        assert res["in_use"].endswith("in use by this process; give another offload_dir")
        assert f"rank{rank}" in res["in_use"] and "\n" not in res["in_use"]
        assert res["stale_cleaned"] and res["folder_gone"]
        assert f"file{rank}" in res["not_creatable"] and "\n" not in res["not_creatable"]


def test_offload_options_that_do_not_combine():
    from gnnpar.models.gpt.task import GPTTaskConfig
    from gnnpar.models.minibatch.task import MiniBatchConfig
    from gnnpar.train.config import ConfigError

    with pytest.raises(ConfigError, match="'offload' = host needs zero_stage 1, 2 or 3"):
        GPTTaskConfig(offload="host", zero_stage=0).check()
    with pytest.raises(ConfigError, match="'offload' must be one of none, host, file"):
        GPTTaskConfig(offload="nvme").check()
    with pytest.raises(ConfigError, match="'offload_dir' is only used with offload = file"):
        GPTTaskConfig(offload_dir="x").check()
    with pytest.raises(ConfigError, match="sage runs stage 0 unless told"):
        MiniBatchConfig(offload="file").check()
    cfg = GPTTaskConfig(offload="file", out="runs/a")
    assert cfg.offload_folder() == str(Path("runs/a") / "offload")
    grid = gnnpar.init()
    with pytest.raises(ValueError, match="offload must be one of"):
        shard(_net(), grid, 3, offload="disk")
    with pytest.raises(ValueError, match="needs stage 1, 2 or 3"):
        shard(_net(), grid, 0, offload="host")
    with pytest.raises(ValueError, match="needs offload_dir"):
        shard(_net(), grid, 3, offload="file")
    with pytest.raises(ValueError, match="only used with offload='file'"):
        shard(_net(), grid, 3, offload="host", offload_dir="x")


def _device_run(offload: str, folder: str) -> tuple[dict, set[str]]:
    """2 steps at stage 3 on this process's grid: the state dict (on the host) and the
    device types of the masters and the optimizer state."""
    grid = gnnpar.init()
    net = _net()
    kw = {"offload_dir": folder} if offload == "file" else {}
    dp = shard(net, grid, 3, units="blocks.*", offload=offload, **kw)
    opt = dp.attach(_opt("adamw", dp.parameters()))
    for step in range(2):
        x, y = (t.to(grid.device) for t in _batch(step))
        _loss(net(x), y, grid).backward()
        opt.step()
        opt.zero_grad()
    where = {g.master.device.type for g in dp._groups(("trainable",))}
    where |= {v.device.type for st in opt.state.values() for v in st.values() if v.dim()}
    state = {k: v.cpu() for k, v in dp.full_state_dict().items()}
    dp.remove()
    return state, where


def test_offload_on_an_accelerator_steps_on_the_host(tmp_path):
    plain, _ = _device_run("none", str(tmp_path))
    with simulated_device():
        runs = {o: _device_run(o, str(tmp_path)) for o in ("none", "host", "file")}
    assert runs["none"][1] == {"lazy"}
    for offload in ("host", "file"):
        state, where = runs[offload]
        assert where == {"cpu"}, (offload, where)
        assert _state_err(state, plain) <= TOL, offload
