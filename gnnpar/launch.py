"""Start N local processes through PyTorch's own launcher (the code behind torchrun)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence


def under_launcher() -> bool:
    """Whether this process already runs under torchrun (or another env:// launcher)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


def launch_local(
    nprocs: int,
    module_argv: Sequence[str],
    max_restarts: int = 0,
    module: str = "gnnpar.cli",
    script: str | None = None,
) -> int:
    """Run ``python -m module *module_argv`` (or ``python script *module_argv``) on
    ``nprocs`` local processes under ``torch.distributed.run --standalone``; return the
    launcher's exit code."""
    if nprocs < 1:
        raise ValueError(f"--nprocs must be at least 1, got {nprocs}")
    target = [script] if script is not None else ["-m", module]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nprocs}",
        f"--max-restarts={max_restarts}",
        *target,
        *module_argv,
    ]
    env = dict(os.environ)
    # Ranks share the cores: one intra-op thread each unless the user chose otherwise.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The launcher logs a warning per rank about OMP_NUM_THREADS; keep the console readable.
    env.setdefault("LOGLEVEL", "ERROR")
    return subprocess.call(cmd, env=env)


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
