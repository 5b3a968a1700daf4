"""Best-validation model selection and early stopping, for the trainer loop.

A task that names a selection metric (``selection = ("val_acc", "max")``) has every
evaluation compared with the best so far: a strictly better one becomes the best (the loop
then saves the model as the run's ``best`` checkpoint), and with ``early_stop = N`` the run
stops after N evaluations in a row without one. The state is JSON, saved in every checkpoint,
so a resumed run selects and stops exactly as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gnnpar.errors import UserError

__all__ = ["Selection"]


@dataclasses.dataclass
class Selection:
    """The best evaluation so far and how many evaluations have not beaten it.

    ``metric``: the key of the evaluation compared (e.g. ``val_acc``); ``mode``: ``"max"``
    or ``"min"``; ``patience``: evaluations without improvement before :attr:`stopped`
    (0: never)."""

    metric: str
    mode: str = "max"
    patience: int = 0
    #: The step (1-based: epochs or steps done) of the best evaluation, None before one.
    best_step: int | None = None
    #: The best evaluation, every metric of it (e.g. the test accuracy of the best model).
    best: dict[str, float] = dataclasses.field(default_factory=dict)
    #: Evaluations since the best one.
    stale: int = 0
    #: Whether early stopping ended the run.
    stopped: bool = False

    def __post_init__(self) -> None:
        if self.mode not in ("max", "min"):
            raise UserError(f"selection mode must be max or min, got {self.mode!r}")

    def update(self, evaluation: dict[str, float], step: int) -> bool:
        """Compare the evaluation of ``step`` with the best; return whether it is the new
        best. An evaluation without the metric (a dataset without that split) changes
        nothing."""
        value = evaluation.get(self.metric)
        if value is None:
            return False
        old = self.best.get(self.metric)
        better = old is None or (value > old if self.mode == "max" else value < old)
        if better:
            self.best, self.best_step, self.stale = dict(evaluation), step, 0
            return True
        self.stale += 1
        if self.patience and self.stale >= self.patience:
            self.stopped = True
        return False

    def state(self) -> dict[str, Any]:
        """What a checkpoint records (JSON)."""
        return {
            "metric": self.metric,
            "best_step": self.best_step,
            "best": self.best,
            "stale": self.stale,
            "stopped": self.stopped,
        }

    def load(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` (a checkpoint of a run that selected by the same metric)."""
        if state.get("metric") != self.metric:
            return
        self.best_step = state.get("best_step")
        self.best = {k: float(v) for k, v in (state.get("best") or {}).items()}
        self.stale = int(state.get("stale", 0))
        self.stopped = bool(state.get("stopped", False))
