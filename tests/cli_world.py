"""Several multi-rank ``gnnpar`` commands on one world of forked ranks, instead of one
``--nprocs`` launch each.

A ``--nprocs N`` launch starts torchrun's agent and ``N`` fresh interpreters that each import
torch and gnnpar again: seconds per command on a shared 2-core machine, and a test that trains,
resumes on another grid and trains straight through pays that three times.
:func:`run_commands` starts one world with :func:`gnnpar.testing.run_distributed` instead, in
which every rank calls :func:`gnnpar.cli.main` with each command in turn: what every rank of a
``--nprocs`` launch runs (the launcher's variables set, ``--nprocs`` stripped, and
``GNNPAR_PREFLIGHT_DONE`` because the launching process ran the checks before launch). The
torch.distributed world is started once, before the first command, so that each command's
grid joins it and leaves it standing for the next. What this does not exercise is the launch
itself; tests/test_recovery.py, tests/test_cli.py, tests/test_compose.py, tests/test_gpt.py,
tests/test_launchers.py and the sage case of tests/test_checkpoint_train.py launch for real.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from gnnpar.launch import PREFLIGHT_DONE_ENV, strip_nprocs
from gnnpar.testing import run_distributed

#: A step: a command line (``gnnpar`` arguments), or ``("copy", src, dst)``: rank 0 copies a
#: run folder while the other ranks wait.
Step = Sequence[str] | tuple[str, Path, Path]


def _nprocs(argv: Sequence[str]) -> int | None:
    for i, a in enumerate(argv):
        if a == "--nprocs":
            return int(argv[i + 1])
        if a.startswith("--nprocs="):
            return int(a.split("=", 1)[1])
    return None


def _commands(steps: list[Step]) -> list[int]:
    import torch.distributed as dist

    from gnnpar.cli import main

    dist.init_process_group("gloo")  # the world every command's grid joins
    codes = []
    for step in steps:
        if step[0] == "copy":
            if dist.get_rank() == 0:
                shutil.copytree(step[1], step[2])
        else:
            codes.append(main(strip_nprocs(list(step))))
            if codes[-1] != 0:  # stop this world now, as a launch stops its ranks: the
                # others may wait in a collective of the command for this rank
                raise RuntimeError(f"exit code {codes[-1]} from gnnpar {' '.join(step)}")
        dist.barrier()
    return codes


def run_commands(world: int, steps: list[Step], timeout: float = 600) -> list[list[int]]:
    """Run ``steps`` in order on one world of ``world`` ranks; every rank's exit codes, one
    per command (a rank whose command exits non-zero fails the world at once, naming the
    command). A command that names ``--nprocs`` must name ``world``."""
    for step in steps:
        if step[0] != "copy" and _nprocs(step) not in (None, world):
            raise ValueError(f"{' '.join(step)}: --nprocs is not the world size {world}")
    return run_distributed(
        _commands, world, list(steps), timeout=timeout, env={PREFLIGHT_DONE_ENV: "1"}
    )
