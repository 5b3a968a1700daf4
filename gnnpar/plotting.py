"""What the library's plots share: units picked from the data and plainly labelled axes.

The plots of ``gnnpar report``, ``gnnpar plan --plot`` and ``gnnpar-partition compare --plot``
draw on :class:`matplotlib.figure.Figure` objects made here, not through ``pyplot``: no
backend is switched and no global figure list grows, and the functions that build them can
return them for a caller (or a test) to look at before they are saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gnnpar.atomic import atomic_write

__all__ = [
    "byte_unit",
    "format_bytes",
    "new_figure",
    "plain_axis",
    "save_figure",
    "time_unit",
]

# Decimal units, as the planner's tables print them (MB = 10**6 bytes).
_DECIMAL = (("B", 1.0), ("kB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12))
# Binary units, as the partitioner's tables print them (MiB = 2**20 bytes).
_BINARY = (("B", 1.0), ("KiB", 2.0**10), ("MiB", 2.0**20), ("GiB", 2.0**30), ("TiB", 2.0**40))


def byte_unit(largest: float, binary: bool = False) -> tuple[str, float]:
    """The unit to show byte counts up to ``largest`` in, and its size in bytes.

    The largest unit of which ``largest`` is at least one: ``3e7 -> ("MB", 1e6)``,
    ``2.5e9 -> ("GB", 1e9)``; with ``binary``, KiB, MiB, GiB, ...
    """
    units = _BINARY if binary else _DECIMAL
    chosen = units[0]
    for name, size in units:
        if abs(largest) >= size:
            chosen = (name, size)
    return chosen


def format_bytes(n: float, binary: bool = False) -> str:
    """A byte count to 3 significant digits in its own unit: ``256412 -> '256 kB'``."""
    name, size = byte_unit(n, binary)
    return f"{n / size:.3g} {name}"


def time_unit(largest: float) -> tuple[str, float]:
    """The unit to show durations up to ``largest`` seconds in: ``("ms", 1e-3)`` below a
    second, else ``("s", 1.0)``."""
    return ("ms", 1e-3) if abs(largest) < 1.0 else ("s", 1.0)


def new_figure(width: float, height: float) -> Any:
    """A figure that lays itself out (titles, rotated tick labels and legends fit)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def plain_axis(axis: Any) -> None:
    """Label ``axis`` (``ax.xaxis`` or ``ax.yaxis``) with plain numbers.

    A linear axis gets no offset or scientific notation (no ``1e7`` in the corner: the
    caller scales the values into a unit); a log axis keeps matplotlib's choice of which
    ticks to label but writes ``5`` or ``0.3`` rather than ``5×10^0`` or ``3×10^-1``.
    """
    from matplotlib.ticker import LogFormatter, ScalarFormatter
    from numpy import format_float_positional

    class _PlainLog(LogFormatter):
        def __call__(self, x: float, pos: int | None = None) -> str:
            if not super().__call__(x, pos):  # a tick matplotlib leaves unlabelled
                return ""
            return format_float_positional(x, precision=3, fractional=False, trim="-")

    if axis.get_scale() == "log":
        axis.set_major_formatter(_PlainLog(base=10))
        axis.set_minor_formatter(_PlainLog(base=10, labelOnlyBase=False))
    else:
        formatter = ScalarFormatter(useOffset=False)
        formatter.set_scientific(False)
        axis.set_major_formatter(formatter)


def save_figure(fig: Any, path: str | Path, dpi: int = 120) -> Path:
    """Write ``fig`` to ``path`` whole or not at all (format from the suffix; PNG if none)."""
    path = Path(path)
    fmt = path.suffix[1:] or "png"
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=fmt))
    return path
