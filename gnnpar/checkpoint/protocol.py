"""The folder protocol of checkpoints: step folders, their completion, ``latest``, pruning.

::

    <directory>/step-000120/          one complete checkpoint
        rank-00000.pt ...             each rank's pieces (gnnpar.checkpoint.store)
        manifest.json                 written last: files with sizes and checksums, layout
    <directory>/latest                the name of the newest complete step folder
    <directory>/.tmp-step-000140/     a checkpoint being written (never read)

A step folder is written under ``.tmp-<name>``, its manifest last, and renamed into place, so
it appears whole or not at all; pruning deletes a folder's manifest before the rest, so a kill
mid-delete never leaves a folder that looks complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from gnnpar.atomic import mark_latest
from gnnpar.errors import UserError
from gnnpar.verified import MANIFEST, OlderFormatError

__all__ = [
    "SCHEMA",
    "READABLE",
    "VERSION",
    "CheckpointError",
    "candidates",
    "commit",
    "complete_steps",
    "incomplete_steps",
    "step_folder",
    "step_of",
    "temporary_folder",
]

SCHEMA = "gnnpar.checkpoint"
#: Version 2 added a digest of each stored entry's meaning (``meta["digests"]``); version 1
#: checkpoints still load, without that check.
VERSION = 2
READABLE = (1, 2)


class CheckpointError(UserError):
    """A checkpoint that cannot be used here: none usable, or one of another model."""


def step_folder(directory: str | os.PathLike, step: int) -> Path:
    """The folder of ``step`` under ``directory``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return Path(directory) / f"step-{step:06d}"


def temporary_folder(final: Path) -> Path:
    """Where ``final`` is written before it is renamed into place."""
    return final.parent / f".tmp-{final.name}"


def step_of(folder: Path) -> int | None:
    """The step a folder's name ``step-NNNNNN`` gives, or None for another name."""
    try:
        return int(folder.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return None


def complete_steps(directory: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints (a manifest) under ``directory``, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    steps = [step_of(d) for d in root.glob("step-*") if (d / MANIFEST).is_file()]
    return sorted(s for s in steps if s is not None)


def incomplete_steps(directory: str | os.PathLike) -> list[Path]:
    """Step folders under ``directory`` without a manifest (nor an older gnnpar's
    ``meta.json``), oldest first: a checkpoint is renamed into place only when complete, so
    each is damage (a deleted manifest, a removal cut short), never a write in progress."""
    root = Path(directory)
    if not root.is_dir() or is_checkpoint(root):
        return []
    found = [(step_of(d), d) for d in root.glob("step-*") if d.is_dir() and not is_checkpoint(d)]
    return [d for step, d in sorted((s, d) for s, d in found if s is not None)]


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a step folder (complete, or of an older format)."""
    return (path / MANIFEST).is_file() or (path / "meta.json").is_file()


def candidates(path: str | os.PathLike) -> list[Path]:
    """Step folders to try, newest first: ``path`` itself when it is one, else the complete
    checkpoints under it (``latest`` first). A directory holding only checkpoints of an
    older gnnpar is a FormatError; nothing at all gives an empty list."""
    path = Path(path)
    if is_checkpoint(path):
        return [path]
    steps = complete_steps(path)
    if not steps:
        old = [d for d in path.glob("step-*") if (d / "meta.json").is_file()]
        if old:
            raise OlderFormatError(
                f"{sorted(old)[-1]}: a checkpoint written by an older gnnpar (meta.json, no "
                f"{MANIFEST}); this version cannot read it"
            )
        return []
    folders = [step_folder(path, s) for s in reversed(steps)]
    pointer = path / "latest"
    if pointer.is_file():
        named = path / pointer.read_text().strip()
        if named in folders:
            folders.remove(named)
            folders.insert(0, named)
    return folders


def commit(tmp: Path, final: Path, keep: int) -> None:
    """Move the finished ``tmp`` folder to ``final``, point ``latest`` at it and keep the
    newest ``keep`` complete checkpoints (0: keep all). Rank 0 only."""
    if final.exists():
        (final / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(final)
    os.replace(tmp, final)
    mark_latest(final.parent, final)
    if keep > 0:
        for step in complete_steps(final.parent)[:-keep]:
            old = step_folder(final.parent, step)
            (old / MANIFEST).unlink(missing_ok=True)  # first: never a complete-looking half
            shutil.rmtree(old, ignore_errors=True)
