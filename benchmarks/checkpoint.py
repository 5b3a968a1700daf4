"""Checkpoint benchmark: gnnpar's checkpoint format beside torch DCP on the same model.

The model is ``benchmarks/sharding.py``'s stack of GPT blocks (10 blocks of width 768, 70.9M
parameters by default) on 4 CPU ranks over gloo, after one AdamW step (so the optimizer
state exists): ours sharded with ``gnnpar.shard`` stage 3, the peer with FSDP2
``fully_shard``. In the same world, interleaved, ``--repeats`` times:

- **ours**: ``gnnpar.checkpoint.save`` (every rank writes its ZeRO pieces, checksums them;
  rank 0 writes the manifest), ``gnnpar.checkpoint.load`` into a fresh sharded model and
  optimizer (every rank verifies the checksum of the files it reads; also timed with
  ``verify="size"``), and the load onto another grid (2 ranks of stage 1 reading the
  4-rank stage-3 checkpoint: a real reshard);
- **DCP**: ``torch.distributed.checkpoint.save`` of the FSDP2 model's and optimizer's
  sharded state dicts (``get_state_dict``), and ``load`` + ``set_state_dict`` back.

Each figure is the median over repeats of the slowest rank (a checkpoint is done when every
rank is), with the spread (min–max); bytes on disk are the files' sizes. Files go to a
temporary folder on the local disk (``--dir`` to choose), so the page cache takes most of the
writing: the figures compare the work each format does, not a disk.

    python benchmarks/checkpoint.py            # 70.9M parameters, 4 ranks, 5 repeats
    python benchmarks/checkpoint.py --quick    # a small model, 2 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.sharding import BlockStack  # noqa: E402
from gnnpar.models.gpt.model import Block  # noqa: E402
from gnnpar.testing import run_distributed  # noqa: E402

OUT = ROOT / "benchmarks" / "out"


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _step(model, opt, cfg, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg["batch"], cfg["seq"], cfg["width"], generator=g)
    F.mse_loss(model(x), torch.zeros_like(x)).backward()
    opt.step()
    opt.zero_grad()


def _timed(grid, fn) -> float:
    """Seconds of ``fn`` on the slowest rank (barriers around it)."""
    from gnnpar import comm

    comm.barrier(grid)
    t0 = time.perf_counter()
    fn()
    comm.barrier(grid)
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    comm.all_reduce(t, grid, "world", op="max")
    return float(t)


def _rank(cfg: dict[str, Any], folder: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gnnpar
    from gnnpar import checkpoint
    from gnnpar.shard import by_type, shard

    grid = gnnpar.init()
    rank, world = grid.global_rank, grid.world_size
    shape = (cfg["width"], cfg["blocks"], cfg["heads"], cfg["seq"])

    def ours():
        torch.manual_seed(0)
        model = BlockStack(*shape)
        dp = shard(model, grid, 3, units=by_type(Block))
        return model, dp, dp.attach(torch.optim.AdamW(dp.parameters(), lr=1e-4))

    def fsdp():
        torch.manual_seed(0)
        model = BlockStack(*shape)
        mesh = init_device_mesh("cpu", (world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    model, dp, opt = ours()
    _step(model, opt, cfg, rank)
    fmodel, fopt = fsdp()
    _step(fmodel, fopt, cfg, rank)
    numel = sum(p.numel() for p in BlockStack(*shape).parameters())
    root = Path(folder)
    times: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    saved = (dp, opt, fmodel, fopt)
    for rep in range(cfg["repeats"]):
        mine, theirs = root / f"ours-{rep}", root / f"dcp-{rep}"
        for name, seconds in _repeat(grid, mine, theirs, cfg, saved, ours, fsdp, sizes).items():
            times.setdefault(name, []).append(seconds)
    # equality: the loaded model equals the saved one (ours), rank by rank
    _, check_dp, check_opt = ours()
    checkpoint.load(root / "ours-0", grid, check_dp, check_opt)
    equal = all(
        torch.equal(a, b) for a, b in zip(check_dp.parameters(), dp.parameters(), strict=True)
    )
    return {"rank": rank, "times": times, "sizes": sizes, "numel": numel, "equal": equal}


def _repeat(grid, mine: Path, theirs: Path, cfg, saved, ours, fsdp, sizes) -> dict[str, float]:
    """One interleaved round: our save, DCP's save, our loads, DCP's load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from gnnpar import checkpoint

    dp, opt, fmodel, fopt = saved
    out = {"ours_save": _timed(grid, lambda: checkpoint.save(mine, 1, grid, dp, opt))}

    def dcp_save():
        msd, osd = get_state_dict(fmodel, fopt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(theirs))

    out["dcp_save"] = _timed(grid, dcp_save)
    sizes.update(ours=_size(mine), dcp=_size(theirs))
    _, dp2, opt2 = ours()
    out["ours_load"] = _timed(grid, lambda: checkpoint.load(mine, grid, dp2, opt2))
    _, dp3, opt3 = ours()
    out["ours_load_size_only"] = _timed(
        grid, lambda: checkpoint.load(mine, grid, dp3, opt3, verify="size")
    )
    fm2, fo2 = fsdp()
    _step(fm2, fo2, cfg, grid.global_rank)  # creates the optimizer state that load fills

    def dcp_load():
        msd, osd = get_state_dict(fm2, fo2)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(theirs))
        set_state_dict(fm2, fo2, model_state_dict=state["model"], optim_state_dict=state["optim"])

    out["dcp_load"] = _timed(grid, dcp_load)
    if grid.global_rank == 0:
        shutil.rmtree(theirs, ignore_errors=True)
    return out


def _reshard_rank(cfg: dict[str, Any], folder: str) -> float:
    """Load the 4-rank stage-3 checkpoint on this (smaller) world at stage 1."""
    import gnnpar
    from gnnpar import checkpoint
    from gnnpar.shard import by_type, shard

    grid = gnnpar.init()
    torch.manual_seed(1)
    model = BlockStack(cfg["width"], cfg["blocks"], cfg["heads"], cfg["seq"])
    dp = shard(model, grid, 1, units=by_type(Block))
    opt = dp.attach(torch.optim.AdamW(dp.parameters(), lr=1e-4))
    _step(model, opt, cfg, grid.global_rank)
    return _timed(grid, lambda: checkpoint.load(Path(folder) / "ours-0", grid, dp, opt))


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="a small model, 2 repeats")
    args = p.parse_args()
    cfg = {"width": args.width, "blocks": args.blocks, "heads": 12, "seq": 64, "batch": 2,
           "repeats": args.repeats}  # fmt: skip
    if args.quick:
        cfg.update(width=192, blocks=4, heads=4, repeats=2)
    base = Path(args.dir) if args.dir else None
    with tempfile.TemporaryDirectory(dir=base) as folder:
        env = {"OMP_NUM_THREADS": "1"}
        ranks = run_distributed(_rank, args.world, cfg, folder, timeout=3600, env=env)
        reshard = [
            run_distributed(_reshard_rank, args.world // 2, cfg, folder, timeout=1800, env=env)[0]
            for _ in range(cfg["repeats"])
        ]
    times = {k: _stats(v) for k, v in ranks[0]["times"].items()}
    times["ours_reshard_load"] = _stats(reshard)
    sizes = ranks[0]["sizes"]
    result = {
        "config": cfg,
        "world": args.world,
        "numel": ranks[0]["numel"],
        "times": times,
        "bytes": sizes,
        "loaded_equal": all(r["equal"] for r in ranks),
        "load_average": os.getloadavg(),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / ("checkpoint-quick.json" if args.quick else "checkpoint.json")).write_text(
        json.dumps(result, indent=1)
    )
    t = times
    print(
        f"Checkpoint of {ranks[0]['numel'] / 1e6:.1f}M parameters + AdamW state on {args.world} "
        f"ranks (gnnpar.shard stage 3 vs FSDP2), median of {cfg['repeats']} (min–max), "
        f"load average {os.getloadavg()[0]:.1f}\n"
    )
    print("| | gnnpar | torch DCP | gnnpar / DCP |")
    print("|---|---|---|---|")

    def row(name, a, b):
        ratio = f"{t[a]['median'] / t[b]['median']:.2f}×" if b else "—"
        peer = f"{t[b]['median']:.2f} s ({t[b]['min']:.2f}–{t[b]['max']:.2f})" if b else "—"
        print(f"| {name} | {t[a]['median']:.2f} s ({t[a]['min']:.2f}–{t[a]['max']:.2f}) "
              f"| {peer} | {ratio} |")  # fmt: skip

    row("save", "ours_save", "dcp_save")
    row("load (checksums verified)", "ours_load", "dcp_load")
    row("load (sizes only)", "ours_load_size_only", "dcp_load")
    row(f"load on {args.world // 2} ranks at stage 1 (reshard)", "ours_reshard_load", None)
    mb = 1e6
    print(f"| bytes on disk | {sizes['ours'] / mb:.1f} MB | {sizes['dcp'] / mb:.1f} MB "
          f"| {sizes['ours'] / sizes['dcp']:.3f}× |")  # fmt: skip
    print(f"\nloaded model equals the saved one on every rank: {result['loaded_equal']}")
    return 0 if result["loaded_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
