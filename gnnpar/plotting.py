"""What the library's plots share: figures, plainly labelled axes, and (from
:mod:`gnnpar.fmt`) units picked from the data.

The plots of ``gnnpar report``, ``gnnpar plan --plot`` and ``gnnpar-partition compare --plot``
draw on :class:`matplotlib.figure.Figure` objects made here, not through ``pyplot``: no
backend is switched and no global figure list grows, and the functions that build them can
return them for a caller (or a test) to look at before they are saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gnnpar.atomic import atomic_write

__all__ = ["new_figure", "plain_axis", "save_figure"]

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
