"""Sizes are checked before they are allocated: a declared or implied size (a node id of
3e9 in a two-line edge list, a ``num_nodes`` of 2**40 in a file, ``num_nodes=1e13`` among a
generator's options) is compared with the memory the machine has available, so that it
becomes one line naming the number instead of a process that grows until the kernel
kills it, or an allocation traceback.
"""

from __future__ import annotations

from pathlib import Path

from gnnpar.errors import UserError
from gnnpar.fmt import format_bytes

__all__ = ["AllocationError", "available_bytes", "check_room"]

_MEMINFO = Path("/proc/meminfo")


class AllocationError(UserError):
    """A size that needs more memory than the machine has available."""


def available_bytes() -> int | None:
    """The memory available for a new allocation now (Linux's ``MemAvailable``), or None
    where the system does not say."""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_room(nbytes: int, what: str) -> None:
    """AllocationError (one line: ``what``, the bytes needed and those available) when
    ``nbytes`` exceeds the memory available now; nothing where that is unknown."""
    room = available_bytes()
    if room is not None and nbytes > room:
        raise AllocationError(
            f"{what} needs at least {format_bytes(nbytes, binary=True)} of memory; "
            f"{format_bytes(room, binary=True)} is available"
        )
