"""Files that appear whole or not at all, and the ``latest`` pointer of checkpoint folders.

Every writer in gnnpar that a crash could interrupt goes through :func:`atomic_write`: the
content goes to a temporary file in the destination's folder, which is renamed over the
destination only when complete (a rename within one file system is atomic), so a reader
sees the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(dest: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` and rename the result to ``dest``; on any error the temporary
    file is removed and the error raised, ``dest`` untouched."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        # mkstemp creates 0600; give the file the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(dest: str | os.PathLike, doc: Any, indent: int | None = None) -> None:
    """:func:`atomic_write` of ``doc`` as JSON."""
    atomic_write(dest, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=indent)))


def mark_latest(directory: str | os.PathLike, folder: str | os.PathLike) -> None:
    """Point ``directory/latest`` at the checkpoint ``folder`` (a child of ``directory``)."""
    atomic_write(
        Path(directory) / "latest", lambda tmp: Path(tmp).write_text(Path(folder).name + "\n")
    )
