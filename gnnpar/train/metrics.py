"""Per-step metrics as JSON lines in the run folder (rank 0 writes)."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from gnnpar.atomic import naming


def global_mean(value: Any, grid: Any, axes: tuple[str, ...] = ("z", "data")) -> float:
    """Mean of a per-rank scalar tensor over the grid ``axes`` (the batch axes: every rank
    gets the mean over the global batch)."""
    import torch

    from gnnpar import comm

    v = value.detach().to(torch.float64).reshape(1).to(grid.device)
    for axis in axes:
        comm.all_reduce(v, grid, axis, op="avg")
    return float(v)


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


class MetricsLog:
    """Append-only JSONL log; each record gets a wall-clock time stamp. With
    ``tensorboard_dir``, the numbers of every step record also go to TensorBoard."""

    def __init__(
        self, path: str | Path, enabled: bool = True, tensorboard_dir: str | Path | None = None
    ):
        self.path = Path(path)
        self.enabled = enabled
        self._tb = None
        if enabled:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._end_torn_line()
            except OSError as err:
                raise naming(err, self.path) from None
            if tensorboard_dir is not None:
                self._tb = _summary_writer(Path(tensorboard_dir))

    def _end_torn_line(self) -> None:
        # A run killed mid-write leaves a partial last line; start the next record on a
        # line of its own so that only the torn one is lost.
        if self.path.is_file() and self.path.stat().st_size:
            with open(self.path, "rb+") as f:
                f.seek(-1, 2)
                if f.read(1) != b"\n":
                    f.write(b"\n")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (a line of JSON)."""
        if not self.enabled:
            return
        record = {"time": time.time(), **record}
        try:
            self._append(json.dumps(record) + "\n")
        except OSError as err:  # a full disk, a folder made read-only during the run
            raise naming(err, self.path) from None
        if self._tb is not None:
            self._write_scalars(record)

    def _append(self, line: str) -> None:
        with open(self.path, "a") as f:
            f.write(line)

    def _write_scalars(self, record: dict[str, Any]) -> None:
        step = next((record[k] for k in ("step", "epoch") if k in record), None)
        if step is None or "event" in record:
            return
        for key, value in scalars(record).items():
            self._tb.add_scalar(key, value, step)
        self._tb.flush()

    def close(self) -> None:
        """Flush and close the TensorBoard writer, if any."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers as flat names: ``loss``, ``bytes/x/all_reduce``, ..."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("time", "step", "epoch"):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
        elif key == "bytes" and isinstance(value, dict):
            for axis, kinds in value.items():
                for kind, n in kinds.items():
                    out[f"bytes/{axis}/{kind}"] = float(n)
    return out


def _summary_writer(logdir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:  # torch's writer needs the tensorboard package
        raise RuntimeError(
            "--tensorboard needs the tensorboard package: pip install tensorboard"
        ) from err
    return SummaryWriter(log_dir=str(logdir))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics file (a torn last line from a crash is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
