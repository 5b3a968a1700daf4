"""The plot of ``gnnpar plan ... --plot``: predicted step time of the best shapes.

One stacked bar (compute, communication) per grid shape that fits, best first; with ``top``,
only the ``top`` best, as the table prints them.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from gnnpar.fmt import time_unit
from gnnpar.plan.inputs import PlanError
from gnnpar.plan.rank import Candidate, shape_label
from gnnpar.plotting import new_figure, plain_axis, save_figure

__all__ = ["plan_figure", "plot_candidates"]

# Without ``top``, at most this many shapes: more bars than this cannot be told apart.
_MAX_BARS = 40


def _bar_label(c: Candidate, stages: bool) -> str:
    """The shape, and its ZeRO stage where the shapes differ in stage (GPT plans)."""
    return f"{shape_label(c.shape)} Z{c.stage}" if stages else shape_label(c.shape)


def plan_figure(cands: list[Candidate], title: str, top: int | None = None) -> Any:
    """Predicted step time (compute + communication) of the shapes that fit, best first: the
    ``top`` best (all up to 40 without it), as a matplotlib figure."""
    if top is not None and top < 1:
        raise PlanError(f"the number of shapes to plot must be at least 1, got {top}")
    fitting = [c for c in cands if c.fits][: _MAX_BARS if top is None else top]
    if not fitting:
        raise PlanError("no shape fits: nothing to plot")
    stages = len({c.stage for c in fitting}) > 1
    tname, tsize = time_unit(max(c.step_seconds for c in fitting))
    comp = [c.compute_seconds / tsize for c in fitting]
    comm = [c.comm_seconds / tsize for c in fitting]
    width = max(6.0, 0.32 * len(fitting) + 3)
    fig = new_figure(width, 4.5)
    ax = fig.subplots()
    xs = list(range(len(fitting)))
    ax.bar(xs, comp, label="compute", color="#4c72b0")
    ax.bar(xs, comm, bottom=comp, label="communication", color="#dd8452")
    few = len(fitting) <= 6  # few enough for level tick labels
    labels = [_bar_label(c, stages) for c in fitting]
    ax.set_xticks(xs, labels, rotation=0 if few else 75, fontsize=8 if few else 7)
    ax.set_xlabel(
        "grid shape (d = data, x y z = tensor axes" + (", Z = ZeRO stage" if stages else "")
        + "), best first"
    )  # fmt: skip
    ax.set_ylabel(f"predicted step time ({tname})")
    plain_axis(ax.yaxis)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=2, frameon=False)
    # About 13 characters per inch at this size: wrap rather than cut the title off.
    fig.suptitle(textwrap.fill(title, int(width * 13)), fontsize=9)
    return fig


def plot_candidates(
    cands: list[Candidate], path: str | Path, title: str, top: int | None = None
) -> None:
    """Draw :func:`plan_figure` into ``path`` (whole or not at all; format from the suffix)."""
    save_figure(plan_figure(cands, title, top), path)
