"""``gnnpar ckpt consolidate DIR OUT``: one full state dict from a sharded checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_ckpt_commands"]


def _consolidate(args: argparse.Namespace) -> int:
    import torch

    from gnnpar.atomic import atomic_write
    from gnnpar.shard.checkpoint import consolidate

    src = Path(args.dir)
    if not src.exists():
        raise FileNotFoundError(f"no checkpoint at {src}")
    out = Path(args.out)
    if out.exists() and not args.force:
        raise FileExistsError(f"{out} exists; pass --force to overwrite it")
    state = consolidate(src)
    atomic_write(out, lambda tmp: torch.save(state, tmp))
    numel = sum(t.numel() for t in state.values())
    print(f"wrote {out}: {len(state)} tensors, {numel:,} numbers")
    return 0


def add_ckpt_commands(subparsers: Any) -> None:
    """Register ``gnnpar ckpt consolidate`` on an argparse sub-parsers object."""
    ckpt = subparsers.add_parser("ckpt", help="sharded checkpoints")
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True)
    p = sub.add_parser(
        "consolidate",
        help="write one full (plain-model) state dict from a sharded checkpoint",
        description=(
            "Read a checkpoint written by gnnpar.shard.save_checkpoint (a step folder, or a "
            "run directory whose newest complete step is used) and write the full state dict "
            "of the plain model with torch.save. Needs no process group."
        ),
    )
    p.add_argument("dir", help="checkpoint step folder or the directory holding step folders")
    p.add_argument("out", help="output file (.pt)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.set_defaults(func=_consolidate)
