"""Parameter offload at ZeRO stage 3 (:mod:`gnnpar.shard.offload`, :mod:`gnnpar.shard.zero3`):
the parameters' chunks live in the file tier, are read ahead of their gathers
(``prefetch_depth``) and their pages are given back after use.

- **Bit for bit through the trainer** (one world of 4 ranks, float32): ``gnnpar train gpt``'s
  task on ``data=2,x=2`` at stage 3 with full activation checkpointing, with the file tier
  and ``prefetch_depth = 2``, ends with the same parameters, ``torch.equal``, as the run in
  memory; so does a 1F1B pipeline ``pipe=2,data=2`` (2 micro-batches, stage 3) on the file
  tier, and ``gnnpar train sage --model gcn`` on 4 data ranks at stage 3 with the host tier
  and with the file tier (``prefetch_depth = 0``: every read on demand). The file runs read
  units ahead (their reads counted) and give pages back.
- **Resident pages**: a stack of 8 linear layers of 1,024 (8.4M float32 parameters, 25 MB of
  master and Adam state per rank on 4 ranks) trains 2 steps at stage 3 on the file tier; the
  pages of the tier's mappings still resident afterwards (``/proc/self/smaps``, the mappings
  of the rank's offload folder) are at most the partial edge pages, 2 per mapped tensor,
  while the tier wrote and read every byte of them. Without the release they would be all of
  it. So are they after a checkpoint is saved from the files and loaded back into them. The
  bytes the tier copied out of and into its files equal a formula written out in the test.
- **One line**: a pipeline's chunk whose offload folder is in use raises the folder's own
  error (naming it), not a grid error.
- **Depth**: with ``prefetch_depth = d`` the pre-forward hook of a unit after the first finds
  ``min(d, units from it to the end)`` gathers in flight, its own among them (d = 0, 1, 3).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import gnnpar
from gnnpar import checkpoint
from gnnpar.models.gpt.task import GPTTaskConfig
from gnnpar.models.minibatch.task import MiniBatchConfig
from gnnpar.shard import shard
from gnnpar.shard.offload import FileTier, OffloadError
from gnnpar.testing import run_distributed
from gnnpar.train.spec import build_task

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind.\n" * 300
WIDTH, LAYERS = 1024, 8


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)


def _trained(dp) -> dict:
    """This rank's trained parameters (every chunk's, for a pipeline: one sharded model per
    chunk) and what its file tiers counted."""
    out = {"state": {}, "ahead": 0, "released": 0}
    for d in getattr(dp, "dps", [dp]):
        out["state"].update({k: v.numpy().copy() for k, v in d.full_state_dict().items()})
        if d.offload is not None and d.offload.kind == "file":
            out["ahead"] += d.offload.reads["ahead"]
            out["released"] += d.offload.released
    return out


def _gpt(text: str, out: str, steps: int = 3, **kw) -> dict:
    base = dict(
        data=text, vocab_size=300, n_layer=3, n_head=2, n_embd=16, block_size=8, batch_size=8,
        steps=steps, warmup=0, dtype="float32", sample_tokens=0, val_batches=1, zero_stage=3,
        out=out, bias=False,
    )  # fmt: skip
    task = build_task("gpt", GPTTaskConfig(**{**base, **kw}))
    for step in range(steps):
        task.train_step(step)
    out = _trained(task.dp)
    gnnpar.release(task.grid)
    return out


def _gcn(root: str, out: str, **kw) -> dict:
    base = dict(
        dataset="sbm", dataset_options="num_nodes=90,feat_dim=128", root=root, out=out,
        dtype="float32", epochs=2, batch_size=16, hidden=128, fanouts="4,3", prefetch=0,
        eval_every=0, partition_method="metis", model="gcn", zero_stage=3,
    )  # fmt: skip
    task = build_task("sage", MiniBatchConfig(**{**base, **kw}))
    for epoch in range(2):
        task.train_step(epoch)
    out = _trained(task.model)
    gnnpar.release(task.grid)
    return out


def _resident_in(folder: Path) -> int:
    """Resident bytes of this process's mappings of files in ``folder``."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's line
            inside = len(head) >= 6 and head[5].startswith(str(folder))
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def _resident_after_steps(folder: str) -> tuple[int, int, int, int]:
    grid = gnnpar.init(data=4)
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    dp = shard(net, grid, 3, units=list(net), offload="file", offload_dir=folder, prefetch=2)
    opt = dp.attach(torch.optim.AdamW(dp.parameters(), lr=1e-3))
    x = torch.randn(4, WIDTH)
    for _ in range(2):
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    tier = dp.offload
    out = (_resident_in(tier.dir), tier.file_bytes(), len(tier._files), tier.released,
           dict(tier.traffic))  # fmt: skip
    # a checkpoint reads every file through the mappings, a load writes them
    ckpt = checkpoint.save(f"{folder}/ckpt", 2, grid, dp, opt)
    saved = _resident_in(tier.dir)
    checkpoint.load(ckpt, grid, dp, opt)
    out = (*out, saved, _resident_in(tier.dir))
    dp.remove()
    gnnpar.release(grid)
    return out


def _depths() -> dict:
    """Per prefetch depth: the units in flight when each unit's pre-forward hook runs."""
    from gnnpar.shard import zero3

    grid = gnnpar.init(data=4)
    out = {}
    for depth in (0, 1, 3):
        torch.manual_seed(0)
        net = nn.Sequential(*(nn.Linear(8, 8) for _ in range(5)))
        dp = shard(net, grid, 3, units=list(net), prefetch=depth)
        seen: list[int] = []
        pre = zero3.Stage3._pre

        def spy(self, unit, seen=seen, pre=pre):
            seen.append(sum(1 for u in self.units if u.pending))
            pre(self, unit)

        zero3.Stage3._pre = spy
        try:
            for _ in range(2):  # the first forward records the order
                seen.clear()
                net(torch.ones(2, 8)).sum().backward()
        finally:
            zero3.Stage3._pre = pre
        out[depth] = list(seen)
        dp.remove()
    gnnpar.release(grid)
    return out


def _world(root: str, out: str) -> dict:
    rank = int(os.environ["RANK"])
    text = f"{root}/text.txt"
    scratch = f"{out}/offload"
    gpt_full = dict(grid="data=2,x=2", activation_checkpointing="full")
    pipe = dict(grid="pipe=2,data=2", grad_accum=2, schedule="1f1b")

    def file(name: str) -> dict:
        # a folder per run: an earlier task's tier may live on until it is collected
        return dict(offload="file", offload_dir=f"{scratch}/{name}")

    res = {
        "gpt": _gpt(text, out, **gpt_full),
        "gpt file": _gpt(text, out, **gpt_full, **file("gpt"), prefetch_depth=2),
        "pipe": _gpt(text, out, **pipe),
        "pipe file": _gpt(text, out, **pipe, **file("pipe")),
        "gcn": _gcn(root, out),
        "gcn host": _gcn(root, out, offload="host"),
        "gcn file": _gcn(root, out, **file("gcn"), prefetch_depth=0),
    }
    # a pipeline's chunk meets an offload folder in use: the folder's own one-line error
    held = FileTier(torch.device("cpu"), f"{scratch}/held", rank)
    try:
        _gpt(text, out, **pipe, offload="file", offload_dir=f"{scratch}/held")
        res["busy"] = "no error"
    except OffloadError as err:
        res["busy"] = str(err)
    held.close()
    res["resident"] = _resident_after_steps(f"{scratch}/resident")
    res["depths"] = _depths()
    res["rank"] = rank
    return res


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("param_offload")
    (tmp / "data").mkdir()
    (tmp / "data" / "text.txt").write_text(TEXT)
    return run_distributed(_world, 4, str(tmp / "data"), str(tmp / "run"), timeout=900)


def _equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all((a[k] == b[k]).all() for k in a)


@pytest.mark.parametrize(
    "plain, offloaded", [("gpt", "gpt file"), ("pipe", "pipe file"), ("gcn", "gcn host"),
                         ("gcn", "gcn file")]
)  # fmt: skip
def test_offloaded_parameters_train_bit_for_bit_as_in_memory(world, plain, offloaded):
    for res in world:
        assert _equal(res[offloaded]["state"], res[plain]["state"]), (res["rank"], offloaded)
    if offloaded != "gcn host":  # the file tier gave pages back on every rank
        assert all(res[offloaded]["released"] > 0 for res in world)
    if offloaded == "gpt file":  # depth 2: most chunks were read before their gathers
        assert all(res[offloaded]["ahead"] > 0 for res in world)
    if offloaded == "gcn file":  # depth 0: nothing read ahead
        assert all(res[offloaded]["ahead"] == 0 for res in world)


def test_the_file_tier_keeps_no_mapped_pages_resident_after_a_step(world):
    for res in world:
        resident, mapped, tensors, released, traffic, saved, loaded = res["resident"]
        # the formula: master + 2 Adam moments of the rank's chunks, 4 bytes an element
        chunk = LAYERS * -(-(WIDTH * WIDTH + WIDTH) // 4) * 4
        assert mapped == 3 * chunk
        # per step, each unit's chunk is read for its forward gather and again for its
        # backward one (a linear layer saves its weight for its input's gradient), but the
        # first layer's (its input needs none); the step reads the master and the moments
        # (none before the first step) and writes all three back
        params = 2 * (chunk + chunk * (LAYERS - 1) // LAYERS)
        assert traffic == {"read": params + chunk + 3 * chunk, "written": 2 * 3 * chunk}
        assert released >= 2 * mapped  # every byte read and written at least once a step
        edges = 2 * mmap.PAGESIZE * tensors
        assert resident <= edges and saved <= edges and loaded <= edges, (
            resident, saved, loaded, mapped)  # fmt: skip


def test_an_offload_folder_in_use_is_named_through_a_pipeline(world):
    for res in world:
        busy = res["busy"]
        assert busy.startswith("offload folder ") and "in use by this process" in busy, busy
        assert "\n" not in busy and "grid" not in busy


def test_prefetch_depth_sets_the_gathers_in_flight(world):
    units = 6  # the Sequential (root) and its 5 layers
    for res in world:
        depths = res["depths"]
        for d, seen in depths.items():
            # the root's hook runs first: nothing in flight; then unit i finds its own
            # gather and the d - 1 after it, started by the unit before it
            want = [0] + [min(d, units - i) for i in range(1, units)]
            assert seen == want, (d, seen, want)
