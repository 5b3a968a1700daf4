"""``gnnpar report RUN_DIR``: plots and a summary of a run's metrics.

Writes ``RUN_DIR/plots/{loss,accuracy,throughput,bytes}.png`` from ``metrics.jsonl`` (the
plots whose metrics the run has) and returns a text summary. :func:`report_figures` builds
the same plots as figures without writing them.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from gnnpar.errors import UserError
from gnnpar.fmt import byte_unit, format_bytes, significant
from gnnpar.plotting import new_figure, plain_axis, save_figure
from gnnpar.train.metrics import read_metrics
from gnnpar.train.progress import metric_text

__all__ = ["report_figures", "write_report"]

Series = dict[str, list[tuple[float, float]]]

# Throughput metrics the tasks record (all ranks together), with what they count.
_THROUGHPUT = (("tokens_per_s", "tokens/s"), ("seeds_per_s", "training seeds/s"))
_SPLITS = (("train", "train"), ("val", "validation"), ("test", "test"))
# The score a run evaluates (its dataset's metric), the title and the y axis of its figure.
_SCORES = (
    ("acc", "accuracy", "accuracy (fraction correct)"),
    ("rocauc", "ROC-AUC", "ROC-AUC (mean over tasks)"),
)
# The metrics whose last value the summary prints.
_FINAL = (
    "loss",
    "val_loss",
    "train_acc",
    "val_acc",
    "test_acc",
    "val_rocauc",
    "test_rocauc",
    "tokens_per_s",
    "seeds_per_s",
)
# Grid axes in the order the trainer names them; other axes follow, sorted.
_AXIS_ORDER = ("data", "x", "y", "z", "tensor")


def _series(records: list[dict], unit: str) -> Series:
    out: Series = defaultdict(list)
    for r in records:
        if unit not in r:
            continue
        x = r[unit]
        for k, v in r.items():
            if isinstance(v, (int, float)) and k not in (unit, "time"):
                out[k].append((x, float(v)))
        for axis, kinds in (r.get("bytes") or {}).items():
            out[f"bytes:{axis}"].append((x, float(sum(kinds.values()))))
    return out


def _bytes_by_kind(records: list[dict], unit: str) -> dict[tuple[str, str], list[float]]:
    """Bytes per record of each (grid axis, collective kind), e.g. ``("y", "all_reduce")``."""
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in records:
        if unit in r:
            for axis, kinds in (r.get("bytes") or {}).items():
                for kind, n in kinds.items():
                    out[(axis, kind)].append(float(n))
    return out


def _surviving(records: list[dict], unit: str) -> tuple[list[dict], int]:
    """The records of the run's final timeline: a ``resume`` from step k drops the records
    past k that the interrupted attempt wrote (the resumed one writes them again); also
    returns how many were dropped (work redone)."""
    kept: list[dict] = []
    dropped = 0
    for r in records:
        if r.get("event") == "resume":
            before = len(kept)
            kept = [k for k in kept if unit not in k or k[unit] <= r.get("step", 0)]
            dropped += before - len(kept)
        kept.append(r)
    return kept, dropped


def _unit(records: list[dict]) -> str:
    for key in ("epoch", "step"):
        if any(key in r for r in records):
            return key
    raise UserError("the metrics file has no epoch or step records")


def _is_flat(values: list[float]) -> bool:
    """Whether a series holds one value throughout (bytes per step usually do)."""
    return max(values) - min(values) <= 1e-9 * max(abs(v) for v in values)


def _axis_key(axis: str) -> tuple[int, str]:
    return (_AXIS_ORDER.index(axis) if axis in _AXIS_ORDER else len(_AXIS_ORDER), axis)


def _timeline(unit: str, resumes: list[dict], title: str) -> tuple[Any, Any]:
    """A figure and axes for metrics over ``unit``s, the resumes marked."""
    from matplotlib.ticker import MaxNLocator

    fig = new_figure(6, 4)
    ax = fig.subplots()
    for i, r in enumerate(resumes):  # where the run came back from a checkpoint
        label = "resumed" if i == 0 else None
        ax.axvline(r.get("step", 0), color="grey", linestyle="--", linewidth=1, label=label)
    ax.set_xlabel(unit)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no "epoch 2.5"
    ax.grid(alpha=0.3)
    ax.set_title(title)
    return fig, ax


def _draw(ax: Any, points: list[tuple[float, float]], label: str, **style: Any) -> None:
    xs, ys = zip(*points, strict=True)
    style.setdefault("marker", "." if len(xs) < 60 else None)
    ax.plot(xs, ys, label=label, **style)


def _loss_figure(series: Series, unit: str, resumes: list[dict], name: str) -> Any:
    """Training loss, and the validation loss where the run evaluated one."""
    if not series.get("loss"):
        return None
    fig, ax = _timeline(unit, resumes, f"{name}: loss")
    _draw(ax, series["loss"], "train loss")
    if series.get("val_loss"):
        _draw(ax, series["val_loss"], "validation loss", marker="o", linewidth=2)
    ax.set_ylabel("loss (log scale)")
    ax.set_yscale("log")
    plain_axis(ax.yaxis)
    ax.legend()
    return fig


def _accuracy_figure(series: Series, unit: str, resumes: list[dict], name: str) -> Any:
    """The evaluated score on each split: accuracy, or ROC-AUC for multi-label targets
    (the file keeps its name, ``accuracy.png``)."""
    for metric, title, ylabel in _SCORES:
        present = [(f"{split}_{metric}", label) for split, label in _SPLITS]
        present = [(k, label) for k, label in present if series.get(k)]
        if present:
            fig, ax = _timeline(unit, resumes, f"{name}: {title}")
            for k, label in present:
                _draw(ax, series[k], label)
            ax.set_ylabel(ylabel)
            ax.legend()
            return fig
    return None


def _throughput(series: Series, unit: str) -> tuple[list[tuple[float, float]], str] | None:
    """The run's throughput series and what it counts per second: the task's own metric
    (tokens/s, training seeds/s), else whole {unit}s per second from their duration."""
    for key, label in _THROUGHPUT:
        if series.get(key):
            return series[key], label
    rates = [(x, 1.0 / v) for x, v in series.get("seconds", []) if v > 0]
    return (rates, f"{unit}s/s") if rates else None


def _throughput_figure(series: Series, unit: str, resumes: list[dict], name: str) -> Any:
    found = _throughput(series, unit)
    if found is None:
        return None
    points, label = found
    fig, ax = _timeline(unit, resumes, f"{name}: throughput")
    _draw(ax, points, label)
    ax.set_ylabel(f"throughput ({label})")
    ax.set_ylim(bottom=0)
    plain_axis(ax.yaxis)
    ax.legend()
    return fig


def _bytes_bars(by_kind: dict[tuple[str, str], list[float]], unit: str, name: str) -> Any:
    """Grouped bars: per grid axis, one bar per collective kind, each labelled."""
    axes = sorted({a for a, _ in by_kind}, key=_axis_key)
    kinds = sorted({k for _, k in by_kind})
    values = {key: v[0] for key, v in by_kind.items()}
    uname, usize = byte_unit(max(values.values()))
    fig = new_figure(max(6, 0.6 * len(axes) * len(kinds) + 3), 4)
    ax = fig.subplots()
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        xs = [j + (i - (len(kinds) - 1) / 2) * width for j, a in enumerate(axes)]
        ys = [values.get((a, kind), 0.0) for a in axes]
        bars = ax.bar(xs, [y / usize for y in ys], width, label=kind)
        ax.bar_label(bars, [format_bytes(y) if y else "" for y in ys], fontsize=8)
    ax.set_xticks(range(len(axes)), [f"axis {a}" for a in axes])
    positive = [v for v in values.values() if v > 0]
    if positive and max(positive) >= 100 * min(positive):  # a small kind stays visible
        ax.set_yscale("log")
        ax.set_ylabel(f"{uname} per {unit}, this rank (log scale)")
    else:
        ax.set_ylabel(f"{uname} per {unit}, this rank")
    ax.margins(y=0.15)  # room for the bar labels
    plain_axis(ax.yaxis)
    ax.set_xlabel("grid axis")
    ax.set_xlim(-0.6, len(axes) - 0.4)
    ax.legend(title="collective", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"{name}: bytes sent per {unit} (the same every {unit})")
    return fig


def _bytes_lines(series: Series, unit: str, resumes: list[dict], name: str) -> Any:
    """Bytes per grid axis over the run (for runs where they change)."""
    keys = sorted((k for k in series if k.startswith("bytes:")), key=lambda k: _axis_key(k[6:]))
    uname, usize = byte_unit(max(v for k in keys for _, v in series[k]))
    fig, ax = _timeline(unit, resumes, f"{name}: bytes sent per {unit}")
    for k in keys:
        _draw(ax, [(x, v / usize) for x, v in series[k]], f"axis {k[6:]}")
    ax.set_ylabel(f"{uname} per {unit}, this rank")
    plain_axis(ax.yaxis)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def _bytes_figure(
    records: list[dict], series: Series, unit: str, resumes: list[dict], name: str
) -> Any:
    by_kind = _bytes_by_kind(records, unit)
    if not by_kind or not any(v for vs in by_kind.values() for v in vs):
        return None
    if all(_is_flat(v) for v in by_kind.values()):
        return _bytes_bars(by_kind, unit, name)
    return _bytes_lines(series, unit, resumes, name)


def report_figures(records: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The plots of a run's (surviving) metrics records as matplotlib figures, by file stem:
    ``loss`` (train and validation loss), ``accuracy``, ``throughput``, ``bytes`` (per grid
    axis and collective). Plots whose metrics the records lack are left out."""
    unit = _unit(records)
    series = _series(records, unit)
    resumes = [r for r in records if r.get("event") == "resume"]
    figures = {
        "loss": _loss_figure(series, unit, resumes, name),
        "accuracy": _accuracy_figure(series, unit, resumes, name),
        "throughput": _throughput_figure(series, unit, resumes, name),
        "bytes": _bytes_figure(records, series, unit, resumes, name),
    }
    return {stem: fig for stem, fig in figures.items() if fig is not None}


def write_report(run_dir: str | Path) -> str:
    """Draw the run's plots into ``run_dir/plots`` and return a summary."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl (is it a run folder?)")
    records = read_metrics(path)
    unit = _unit(records)
    records, redone = _surviving(records, unit)
    series = _series(records, unit)
    resumes = [r for r in records if r.get("event") == "resume"]
    out = run_dir / "plots"
    out.mkdir(exist_ok=True)
    written = [
        save_figure(fig, out / f"{stem}.png", dpi=110)
        for stem, fig in report_figures(records, run_dir.name).items()
    ]

    last = {k: v[-1][1] for k, v in series.items()}
    lines = [f"run {run_dir}: {len(series.get('loss', []))} {unit}s recorded"]
    for k in _FINAL:
        if k in last:
            lines.append(f"  final {k:<13} {metric_text(k, last[k])}")
    end = next((r for r in reversed(records) if r.get("event") == "end"), {})
    if "best_step" in end:  # the model the run reports: its best-validation one
        scores = " ".join(f"{k}={metric_text(k, end[k])}" for k in _FINAL if k in end)
        lines.append(f"  best model ({unit} {end['best_step']}): {scores}")
    if series.get("seconds"):
        secs = [v for _, v in series["seconds"]]
        lines.append(f"  mean seconds per {unit}: {significant(sum(secs) / len(secs))}")
    for k in sorted(k for k in last if k.startswith("bytes:")):
        lines.append(f"  bytes per {unit} on {k[6:]:<7} {last[k]:,.0f}")
    if resumes:
        lines.append(
            f"  resumed {len(resumes)} time(s) from a checkpoint ({redone} {unit}s redone)"
        )
    restarts = {r["attempt"] for r in records if r.get("attempt")}
    if restarts:
        lines.append(f"  restarted by the launcher {len(restarts)} time(s)")
    lines.extend(f"  wrote {p}" for p in written)
    return "\n".join(lines)
