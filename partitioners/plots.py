"""The plot of ``gnnpar-partition compare --plot``: one bar per method in four panels.

Edge cut, edge balance, partition time and peak memory, each with a labelled y axis in a
unit picked from the data; a panel whose values span an order of magnitude or more is drawn
on a log scale, so that no method's bar is lost beside a large one, and every bar carries its
value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gnnpar.fmt import byte_unit, time_unit
from gnnpar.plotting import new_figure, plain_axis, save_figure

__all__ = ["compare_figure", "write_compare_plot"]

_COLOR = "#4c72b0"
# A bar whose value a log axis cannot draw (zero) or that was not measured: a pale stub.
_STUB = "#c8d3e6"


def _panels(rows: list[dict[str, Any]]) -> list[tuple[str, str, list[float | None]]]:
    """(title, y label with its unit, one value per method) for each panel."""
    times = [r["time_s"] for r in rows]
    tname, tsize = time_unit(max((t for t in times if t is not None), default=0.0))
    peaks = [r["peak_bytes"] for r in rows]
    bname, bsize = byte_unit(max((p for p in peaks if p is not None), default=0), binary=True)
    return [
        ("edge cut (lower is better)", "cut edges (% of all edges)",
         [100 * r["edge_cut_fraction"] for r in rows]),
        ("edge balance (1 = even, lower is better)", "max / mean edges per part",
         [r["edge_balance"] for r in rows]),
        ("partition time", f"wall time ({tname})",
         [None if t is None else t / tsize for t in times]),
        ("peak memory", f"peak memory ({bname})",
         [None if p is None else p / bsize for p in peaks]),
    ]  # fmt: skip


def _spans_decades(values: list[float | None]) -> bool:
    """Whether the positive values span a factor of 10 or more (then a log scale)."""
    positive = [v for v in values if v is not None and v > 0]
    return len(positive) >= 2 and max(positive) >= 10 * min(positive)


def _value_label(v: float | None) -> str:
    if v is None:
        return "n/a"
    return "0" if v == 0 else f"{v:.3g}"


def _bar_panel(ax: Any, names: list[str], values: list[float | None], log: bool) -> None:
    """One bar per method, labelled with its value; zero or unmeasured values get a pale
    stub (on a log axis a zero bar would otherwise not be drawn at all)."""
    positive = [v for v in values if v is not None and v > 0]
    stub = min(positive) / 3 if log and positive else 0.0
    heights = [v if v is not None and (v > 0 or not log) else stub for v in values]
    colors = [_COLOR if v is not None and (v > 0 or not log) else _STUB for v in values]
    bars = ax.bar(names, heights, color=colors)
    ax.bar_label(bars, [_value_label(v) for v in values], fontsize=8)
    if log:
        ax.set_yscale("log")
        # Room below the smallest bar and above the largest one's label.
        ax.set_ylim((stub or min(positive)) / 2, max(positive) * 3)
    else:
        ax.margins(y=0.15)
    plain_axis(ax.yaxis)
    ax.tick_params(axis="x", rotation=30)


def compare_figure(rows: list[dict[str, Any]], title: str) -> Any:
    """The comparison as a matplotlib figure: ``rows`` are :meth:`Quality.as_dict` results,
    one per method."""
    names = [r["method"] for r in rows]
    fig = new_figure(9, 6.5)
    for ax, (name, ylabel, values) in zip(fig.subplots(2, 2).flat, _panels(rows), strict=True):
        log = _spans_decades(values)
        _bar_panel(ax, names, values, log)
        ax.set_title(name, fontsize=10)
        ax.set_ylabel(f"{ylabel}, log scale" if log else ylabel)
        ax.set_xlabel("method")
        if name.startswith("edge balance"):
            ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    fig.suptitle(title)
    return fig


def write_compare_plot(rows: list[dict[str, Any]], path: str | Path, title: str) -> None:
    """Draw :func:`compare_figure` into ``path`` (PNG, or the format its suffix names)."""
    save_figure(compare_figure(rows, title), path)
