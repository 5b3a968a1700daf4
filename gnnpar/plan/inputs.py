"""What the planner is given, checked: :class:`PlanError` (one line naming the problem), the
checks every workload's problem runs on its sizes, and counts such as ``20B``."""

from __future__ import annotations

import re

from gnnpar.errors import UserError

__all__ = ["PlanError", "checkpointing", "parse_count", "positive"]


class PlanError(UserError):
    """Input the planner cannot use; the message names the problem (one line)."""


def positive(name: str, value: object) -> None:
    """PlanError unless ``value`` is a positive integer (``name`` says which)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{name} must be a positive integer, got {value!r}")


def checkpointing(mode: object, allowed: tuple[str, ...]) -> None:
    """PlanError unless the activation checkpointing ``mode`` is one of ``allowed``."""
    if mode not in allowed:
        raise PlanError(f"activation_checkpointing must be {' or '.join(allowed)}, got {mode!r}")


_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """``"20B"`` → 20_000_000_000, ``"1.3b"``, ``"350M"``, ``"4096"``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbBtT]?)\s*", str(text))
    if not m:
        raise PlanError(f"cannot read {text!r} as a count such as 20B, 350M or 4096")
    return round(float(m.group(1)) * _SUFFIX[m.group(2).lower()])
