"""One run per run folder: an advisory lock on ``OUT/.lock`` that dies with its holder.

Two ``gnnpar train`` runs into the same ``--out`` at once used to both finish and leave a
mixed folder (one's config, the other's best checkpoint). The process that owns a run holds
an exclusive ``flock`` on the folder's lock file for the run's whole life: the launching
process of ``gnnpar train --nprocs N`` (across restart attempts; its ranks are told so by
:data:`LOCKED_ENV`), else the run's rank 0. The kernel releases the lock when the holder
exits, however it exits (a SIGKILL included), so a stale lock never blocks a later run; the
file stays, holding the last holder's pid, host and start time for the message.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from gnnpar.atomic import naming
from gnnpar.errors import UserError

__all__ = ["LOCKED_ENV", "LOCK_FILE", "RunFolderInUseError", "check_free", "run_lock"]

#: The lock file in a run folder.
LOCK_FILE = ".lock"
#: Set for ranks whose launching process holds the run folder's lock.
LOCKED_ENV = "GNNPAR_RUN_LOCKED"


class RunFolderInUseError(UserError):
    """Another run holds the run folder's lock."""


def check_free(out: str | os.PathLike) -> None:
    """RunFolderInUseError if another process holds ``out``'s lock now (a check before
    launch, so that a second run is refused before its other checks; the run itself takes
    the lock with :func:`run_lock`)."""
    if (Path(out) / LOCK_FILE).is_file():
        with run_lock(out):
            pass


@contextlib.contextmanager
def run_lock(out: str | os.PathLike) -> Iterator[None]:
    """Hold the run folder ``out``'s lock (made if missing) for the ``with`` block;
    RunFolderInUseError (one line naming the folder and the holder) if another process
    holds it. Without ``fcntl`` (not POSIX) there is no lock."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    path = Path(out) / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")  # noqa: SIM115 - held open for the run's life
    except OSError as err:
        raise naming(err, path) from None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise RunFolderInUseError(
                f"run folder {out} is in use by another run ({holder}): wait for it to "
                "finish, or choose another --out"
            ) from None
        handle.seek(0)
        handle.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {started}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # releases the lock
