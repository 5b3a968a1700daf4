"""``gnnpar report RUN_DIR``: plots and a summary of a run's metrics.

Writes ``RUN_DIR/plots/{loss,accuracy,throughput,bytes}.png`` from ``metrics.jsonl`` (the
plots whose metrics the run has) and returns a text summary.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from gnnpar.fmt import significant
from gnnpar.train.metrics import read_metrics
from gnnpar.train.progress import metric_text


def _series(records: list[dict], unit: str) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
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
    raise ValueError("the metrics file has no epoch or step records")


def write_report(run_dir: str | Path) -> str:
    """Draw the run's plots into ``run_dir/plots`` and return a summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    written = []

    def plot(name: str, keys: list[str], ylabel: str, logy: bool = False) -> None:
        keys = [k for k in keys if series.get(k)]
        if not keys:
            return
        fig, ax = plt.subplots(figsize=(6, 4))
        for k in keys:
            xs, ys = zip(*series[k], strict=True)
            ax.plot(
                xs, ys, label=k.replace("bytes:", "axis "), marker="." if len(xs) < 60 else None
            )
        for i, r in enumerate(resumes):  # where the run came back from a checkpoint
            label = "resumed" if i == 0 else None
            ax.axvline(r.get("step", 0), color="grey", linestyle="--", linewidth=1, label=label)
        ax.set_xlabel(unit)
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"{run_dir.name}: {name}")
        fig.tight_layout()
        target = out / f"{name}.png"
        fig.savefig(target, dpi=110)
        plt.close(fig)
        written.append(target)

    plot("loss", ["loss"], "training loss", logy=True)
    plot("accuracy", ["train_acc", "val_acc", "test_acc"], "accuracy")
    throughput = [k for k in ("tokens_per_s", "seeds_per_s") if series.get(k)]
    if throughput:
        plot("throughput", throughput, "per second")
    elif series.get("seconds"):
        series["steps_per_s"] = [(x, 1.0 / v) for x, v in series["seconds"] if v > 0]
        plot("throughput", ["steps_per_s"], f"{unit}s per second")
    plot(
        "bytes",
        sorted(k for k in series if k.startswith("bytes:")),
        f"bytes per {unit} (this rank)",
    )

    last = {k: v[-1][1] for k, v in series.items()}
    lines = [f"run {run_dir}: {len(series.get('loss', []))} {unit}s recorded"]
    for k in ("loss", "train_acc", "val_acc", "test_acc", "tokens_per_s", "seeds_per_s"):
        if k in last:
            lines.append(f"  final {k:<13} {metric_text(k, last[k])}")
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
