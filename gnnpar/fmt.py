"""How gnnpar writes numbers for people: rates and times to three significant digits, and
counts with the noun in the right number (``1 rank``, ``2 ranks``).

Every console line, progress bar and summary formats through these two functions, so a
rate reads the same everywhere (``19900 tokens_per_s`` rather than ``19917.2351``).
"""

from __future__ import annotations

import math

__all__ = ["count", "significant"]


def significant(value: float, digits: int = 3) -> str:
    """``value`` rounded to ``digits`` significant digits, in plain notation for everyday
    magnitudes: ``19917.2`` → ``"19900"``, ``14.95`` → ``"15.0"``, ``0.012345`` →
    ``"0.0123"``; below 1e-4 or from 1e15 in scientific notation (``"1.23e-05"``).
    NaN and infinities are written as Python writes them."""
    if digits < 1:
        raise ValueError(f"digits must be at least 1, got {digits}")
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    # Round first: rounding can carry into the next power of ten (999.7 -> 1000).
    rounded = float(f"{value:.{digits}g}")
    exponent = math.floor(math.log10(abs(rounded)))
    if exponent < -4 or exponent >= 15:
        return f"{rounded:.{digits - 1}e}"
    return f"{rounded:.{max(0, digits - 1 - exponent)}f}"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` in the right number: ``count(1, "rank")`` → ``"1 rank"``,
    ``count(19874, "edge")`` → ``"19,874 edges"`` (``plural`` for nouns that do not take an
    s: ``count(4, "class", "classes")``)."""
    word = noun if n == 1 else (plural or f"{noun}s")
    return f"{n:,} {word}"
