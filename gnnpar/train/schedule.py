"""Learning-rate schedules of every task: linear warm-up, then constant, step or cosine decay.

The learning rate of a step is a pure function of the step, the run's length and the config
(:class:`~gnnpar.train.config.ScheduleConfig`), set on the optimizer before each optimizer
step by :func:`apply`. So a run resumed from a checkpoint (of the same config) continues its
schedule exactly, on any grid, with nothing to save beyond the step.

With ``warmup = W``, ``lr = L``, step ``s`` (0-based) of ``T``:

- warm-up (``s < W``): ``L·(s + 1)/W``;
- ``constant``: ``L``;
- ``step``: ``L·lr_gamma^⌊(s − W)/lr_step_every⌋`` (one decay every ``lr_step_every`` steps
  after the warm-up);
- ``cosine``: ``min_lr + ½(1 + cos(π·p))(L − min_lr)`` with ``p = min(1, (s − W)/max(1, T − W))``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["SCHEDULES", "apply", "lr_at"]

#: The names ``lr_schedule`` accepts.
SCHEDULES = ("constant", "step", "cosine")


def lr_at(cfg: Any, step: int, total: int) -> float:
    """The learning rate of ``step`` (0-based) of a run of ``total`` steps, for a config
    with ``lr`` and the :class:`~gnnpar.train.config.ScheduleConfig` keys."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    after = step - cfg.warmup
    if cfg.lr_schedule == "step":
        return cfg.lr * cfg.lr_gamma ** (after // cfg.lr_step_every)
    if cfg.lr_schedule == "cosine":
        progress = min(1.0, after / max(1, total - cfg.warmup))
        return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
    return cfg.lr


def apply(optimizer: torch.optim.Optimizer, cfg: Any, step: int, total: int) -> float:
    """Set every parameter group's learning rate to :func:`lr_at`; return it."""
    lr = lr_at(cfg, step, total)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
