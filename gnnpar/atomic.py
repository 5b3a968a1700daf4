"""Files that appear whole or not at all, and the ``latest`` pointer of checkpoint folders.

Every writer in gnnpar that a crash could interrupt goes through :func:`atomic_write`: the
content goes to a temporary file in the destination's folder, which is renamed over the
destination only when complete (a rename within one file system is atomic), so a reader
sees the old file or the new one, never a torn one.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: What an OS error means for the path it names, by errno (else its own strerror).
_REASONS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "not writable (read-only file system)",
    errno.EACCES: "not writable (permission denied)",
    errno.EPERM: "not writable (operation not permitted)",
}


def os_error_message(err: OSError, path: str | os.PathLike | None = None) -> str:
    """One line for an OS error: the path (``path``, else the error's own) and what is wrong
    with it ("disk full", "not writable (read-only file system)", its strerror)."""
    if err.errno is None:
        return str(err)
    reason = _REASONS.get(err.errno, (err.strerror or str(err)).lower())
    where = path if path is not None else err.filename
    return f"{where}: {reason}" if where is not None else reason


def naming(err: OSError, path: str | os.PathLike) -> OSError:
    """``err`` again, naming ``path`` (a write's error names no file, or a temporary one)."""
    if err.errno is None:
        return err
    out = type(err)(err.errno, err.strerror, str(path))
    out.__cause__ = err
    return out


def check_writable(folder: str | os.PathLike) -> None:
    """Raise an :class:`OSError` naming ``folder`` (or the first of its parents that exists,
    where it would be made) unless a file can be created there; nothing is left behind."""
    path = Path(folder)
    probe = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not probe.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(probe))
    try:
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".gnnpar-write-check.")
    except OSError as err:
        raise naming(err, probe) from None
    os.close(fd)
    os.unlink(tmp)


def atomic_write(
    dest: str | os.PathLike, write: Callable[[str], None], reuse: Path | None = None
) -> None:
    """Call ``write(tmp_path)`` and rename the result to ``dest``; on any error the temporary
    file is removed and the error raised (an :class:`OSError` naming ``dest``), ``dest``
    untouched. ``reuse``: a file no longer needed, on the same file system, that becomes the
    temporary file (a writer that overwrites it in place reuses its pages: on a tmpfs,
    allocating and clearing fresh pages costs several times the copy into them)."""
    dest = Path(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    except OSError as err:
        raise naming(err, dest) from None
    os.close(fd)
    if reuse is not None:
        try:
            os.replace(reuse, tmp)
        except OSError:
            pass  # gone, or elsewhere: the empty temporary file serves
    try:
        write(tmp)
        # mkstemp creates 0600; give the file the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, dest)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise naming(err, dest) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_folder(dest: str | os.PathLike, fill: Callable[[Path], None]) -> Path:
    """Call ``fill(tmp_folder)`` and rename the folder to ``dest`` (a ``dest`` already there
    is replaced); on any error the temporary folder is removed and the error raised."""
    import shutil

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        fill(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def write_json(dest: str | os.PathLike, doc: Any, indent: int | None = None) -> None:
    """:func:`atomic_write` of ``doc`` as JSON."""
    atomic_write(dest, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=indent)))


def mark_latest(directory: str | os.PathLike, folder: str | os.PathLike) -> None:
    """Point ``directory/latest`` at the checkpoint ``folder`` (a child of ``directory``)."""
    atomic_write(
        Path(directory) / "latest", lambda tmp: Path(tmp).write_text(Path(folder).name + "\n")
    )
