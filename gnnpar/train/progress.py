"""What a training run shows on the console, in one place: the launcher's line, rank 0's
preparation stages with the time each took, the two start lines (what is trained on what,
and on which grid), then the progress bar (or, with ``quiet``, a log line every tenth of
the run). Other ranks stay silent: their :class:`Progress` is disabled.

Lines go to stdout, as the final ``done:`` line does; the bar goes to stderr, as tqdm's do.
Rates and times are written to three significant digits (:func:`gnnpar.fmt.significant`),
losses and accuracies to four decimals (:func:`metric_text`).

A quiet run of ``gnnpar train gcn --nprocs 2 --quiet`` reads::

    starting 2 ranks ...
    2 ranks started in 3.08 s
    loading sbm ... 0.00582 s
    cutting shards into runs/gcn/shards/sbm-b42a7359d4 ... 0.199 s
    building the model ... 1.10 s
    gcn on sbm: 2,000 nodes, 19,874 edges, 32 features, 4 classes; run folder runs/gcn
    grid data=1 x=2 y=1 z=1 (chosen by the planner) on 2 ranks (gloo, cpu)
    epoch 1/5 loss=1.9119
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from gnnpar.fmt import count, significant

__all__ = ["Progress", "graph_sizes", "metric_text", "metrics_text", "rate_text", "start_lines"]

#: Set by the launching process for its local ranks: when it started them (``time.time()``).
LAUNCHED_AT_ENV = "GNNPAR_LAUNCHED_AT"
#: tqdm's default layout with the rate written by :func:`rate_text` (``{rate3}``).
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate3}{postfix}]"


def is_rate_or_time(key: str) -> bool:
    """Whether a metric is a rate (``tokens_per_s``) or a time (``seconds``): those are
    written to three significant digits."""
    return key.endswith("_per_s") or key == "seconds" or key.endswith("_seconds")


def metric_text(key: str, value: Any) -> str:
    """One metric's value as shown: rates and times to three significant digits, other
    floats (loss, accuracy) to four decimals, anything else as it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if is_rate_or_time(key):
        return significant(value)
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def metrics_text(metrics: Mapping[str, Any]) -> str:
    """``loss=1.9119 seeds_per_s=1160``: metrics as ``key=value`` (see :func:`metric_text`)."""
    return " ".join(f"{k}={metric_text(k, v)}" for k, v in metrics.items())


def rate_text(rate: float | None, unit: str) -> str:
    """A bar's rate: ``3.92 epoch/s``, or ``1.13 s/epoch`` below one per second."""
    if not rate:
        return f"? {unit}/s"
    if rate >= 1:
        return f"{significant(rate)} {unit}/s"
    return f"{significant(1 / rate)} s/{unit}"


class _Bar(tqdm):
    """tqdm with its rate written to three significant digits (tqdm writes two decimals)."""

    @property
    def format_dict(self) -> dict[str, Any]:
        d = super().format_dict
        if "initial" not in d:  # a disabled bar's placeholder
            return d
        rate = d.get("rate")
        if rate is None and d.get("elapsed"):
            rate = (d["n"] - d["initial"]) / d["elapsed"]
        return {**d, "rate3": rate_text(rate, d["unit"])}


def graph_sizes(
    nodes: int,
    edges: int,
    features: int,
    classes: int,
    extra: str | None = None,
    multilabel: bool = False,
) -> str:
    """``2,000 nodes, 19,874 edges, 16 features, 4 classes`` (``112 binary tasks`` for
    multi-label targets; then ``extra``, if given)."""
    parts = [
        count(nodes, "node"),
        count(edges, "edge"),
        count(features, "feature"),
        count(classes, "binary task") if multilabel else count(classes, "class", "classes"),
    ]
    return ", ".join([*parts, *([extra] if extra else [])])


def start_lines(task: Any, out: str | Path) -> list[str]:
    """The two lines rank 0 prints before the first step: what is trained on what (the
    task's ``summary()``) and where the run folder is; the grid, who chose it (the task's
    ``grid_choice``) and the ranks, backend and device."""
    grid = task.grid
    summary, choice = task.summary(), task.grid_choice
    context = f" context={grid.context}" if getattr(grid, "context", 1) > 1 else ""
    context += f" expert={grid.expert}" if getattr(grid, "expert", 1) > 1 else ""
    shape = f"grid data={grid.data}{context} x={grid.x} y={grid.y} z={grid.z}"
    if getattr(grid, "pipe", 1) > 1:
        shape = f"grid pipe={grid.pipe} {shape.removeprefix('grid ')}"
    where = f"{count(grid.world_size, 'rank')} ({grid.backend}, {grid.device})"
    return [
        f"{summary}; run folder {out}",
        f"{shape}{f' ({choice})' if choice else ''} on {where}",
    ]


class Progress:
    """The console of a run on this process: everything is printed when ``enabled`` (rank
    0), nothing otherwise. ``quiet`` swaps the progress bar for log lines. ``stream``:
    where lines go (default: ``sys.stdout`` at the time of printing)."""

    def __init__(self, enabled: bool = True, quiet: bool = False, stream: TextIO | None = None):
        self.enabled = enabled
        self.quiet = quiet
        self._stream = stream

    @classmethod
    def for_this_process(cls, quiet: bool = False) -> Progress:
        """Enabled on rank 0 (or in a process outside any launch), before any process
        group exists: the rank comes from the launcher's environment."""
        from gnnpar.launch import rank_and_world

        return cls(enabled=rank_and_world()[0] == 0, quiet=quiet)

    @property
    def stream(self) -> TextIO:
        """Where lines go."""
        return self._stream if self._stream is not None else sys.stdout

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def line(self, text: str) -> None:
        """Print one line (when enabled)."""
        if self.enabled:
            self._write(text + "\n")

    def launching(self, nprocs: int) -> dict[str, str]:
        """The launching process's line before it starts ``nprocs`` local ranks; returns
        the variables that let rank 0 say how long they took (:meth:`ranks_started`)."""
        self.line(f"starting {count(nprocs, 'rank')} ...")
        return {LAUNCHED_AT_ENV: repr(time.time())}

    def ranks_started(self, environ: Mapping[str, str] | None = None) -> None:
        """Rank 0 of a local launch: how long the ranks took to start, each importing torch
        (the longest wait before anything else can be said). Nothing after a restart."""
        from gnnpar.launch import rank_and_world, restart_count

        env = os.environ if environ is None else environ
        try:
            launched = float(env.get(LAUNCHED_AT_ENV, ""))
        except ValueError:  # not a local launch of gnnpar's
            return
        if restart_count(env) == 0:
            world = rank_and_world()[1]
            self.line(f"{count(world, 'rank')} started in {significant(time.time() - launched)} s")

    @contextlib.contextmanager
    def stage(self, text: str) -> Iterator[list[str]]:
        """A slow preparation step: ``text ...`` when it starts and, on the same line, the
        seconds it took when it ends (``failed`` if it raised, so that the error starts a
        line of its own). What the step appends to the list it is given follows the seconds
        (``... 4.71 s, compiled``): what it turned out to do."""
        notes: list[str] = []
        if not self.enabled:
            yield notes
            return
        self._write(f"{text} ...")
        start = time.perf_counter()
        try:
            yield notes
        except BaseException:
            self._write(" failed\n")
            raise
        after = "".join(f", {note}" for note in notes)
        self._write(f" {significant(time.perf_counter() - start)} s{after}\n")

    def bar(
        self, total: int, initial: int = 0, unit: str = "it", show: bool = True, **kwargs: Any
    ) -> tqdm:
        """A progress bar on stderr; a disabled one when quiet, not enabled or not ``show``
        (``kwargs``: tqdm's, such as ``desc`` and ``leave``)."""
        return _Bar(
            total=total,
            initial=initial,
            unit=unit,
            disable=not (self.enabled and show) or self.quiet,
            dynamic_ncols=True,
            bar_format=BAR_FORMAT,
            **kwargs,
        )

    def log_step(self, unit: str, done: int, total: int, metrics: Mapping[str, Any]) -> None:
        """With ``quiet``, a log line every tenth of the run: ``epoch 3/10 loss=0.5123``."""
        if self.quiet and done % max(1, total // 10) == 0:
            text = metrics_text(metrics)
            self.line(f"{unit} {done}/{total}{' ' + text if text else ''}")
