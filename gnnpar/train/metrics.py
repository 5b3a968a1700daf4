"""Per-step metrics as JSON lines in the run folder (rank 0 writes)."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


class MetricsLog:
    """Append-only JSONL log; each record gets a wall-clock time stamp."""

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (a line of JSON)."""
        if not self.enabled:
            return
        record = {"time": time.time(), **record}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics file (a torn last line from a crash is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
