"""Shared pieces of the folder-reader fuzz tests: damage a copy of a folder, read it, and
hold the result to "one clear error naming the copy, or exactly what was written"."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st

Reader = Callable[[Path], dict[str, torch.Tensor]]


def check_outcome(folder: Path, read: Reader, want: dict[str, torch.Tensor], mutate) -> None:
    """Copy ``folder``, ``mutate(copy)``, ``read(copy)``: either a ValueError (FormatError
    and CheckpointError are ValueErrors) of one line naming the copy, or ``want`` exactly."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(shutil.copytree(folder, Path(tmp) / folder.name))
        mutate(copy)
        try:
            got = read(copy)
        except ValueError as err:
            message = str(err)
            assert "\n" not in message and str(copy) in message, message
            return
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def truncate(data: Any, name: str) -> Callable[[Path], None]:
    """A mutation that cuts file ``name`` to a drawn shorter length."""

    def mutate(copy: Path) -> None:
        raw = (copy / name).read_bytes()
        (copy / name).write_bytes(raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)))])

    return mutate


def flip_bit(data: Any, name: str) -> Callable[[Path], None]:
    """A mutation that flips one drawn bit of file ``name``."""

    def mutate(copy: Path) -> None:
        raw = bytearray((copy / name).read_bytes())
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
        (copy / name).write_bytes(bytes(raw))

    return mutate
