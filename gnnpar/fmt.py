"""How gnnpar writes numbers for people: rates and times to three significant digits,
counts with the noun in the right number (``1 rank``, ``2 ranks``), large counts with a
suffix (``20.3B``), and bytes and durations in a unit picked from the value (``256 kB``).

Every console line, progress bar, summary, plan title and plot label formats through these
functions, so a number reads the same everywhere (``19900 tokens_per_s`` rather than
``19917.2351``). (``partitioners`` keeps its own ``human_bytes``: that package does not
depend on gnnpar.)
"""

from __future__ import annotations

import math
import re

from gnnpar.errors import UserError

__all__ = [
    "byte_unit",
    "count",
    "format_bytes",
    "format_count",
    "parse_bytes",
    "significant",
    "time_unit",
]


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


def format_count(n: float) -> str:
    """A count to 3 significant digits with the suffix :func:`parse_count` reads:
    ``10_612_000 -> "10.6M"``, ``1.3e9 -> "1.3B"``, ``20_260_000_000 -> "20.3B"``."""
    for suffix, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        # Rounded to 3 digits, 999,950 is 1.00M, not 1e+03k: compare after rounding.
        if float(f"{n / size:.3g}") >= 1:
            return f"{float(f'{n / size:.3g}'):g}{suffix}"
    return f"{float(f'{n:.3g}'):g}"


# Decimal units, as the planner's tables print them (MB = 10**6 bytes).
_DECIMAL = (("B", 1.0), ("kB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12))
# Binary units, as the partitioner's tables print them (MiB = 2**20 bytes).
_BINARY = (("B", 1.0), ("KiB", 2.0**10), ("MiB", 2.0**20), ("GiB", 2.0**30), ("TiB", 2.0**40))


def byte_unit(largest: float, binary: bool = False) -> tuple[str, float]:
    """The unit to show byte counts up to ``largest`` in, and its size in bytes.

    The largest unit of which ``largest`` is at least one: ``3e7 -> ("MB", 1e6)``,
    ``2.5e9 -> ("GB", 1e9)``; with ``binary``, KiB, MiB, GiB, ...
    """
    units = _BINARY if binary else _DECIMAL
    chosen = units[0]
    for name, size in units:
        if abs(largest) >= size:
            chosen = (name, size)
    return chosen


def parse_bytes(text: str | int) -> int:
    """A byte count people write: ``"4GB"`` or ``"4G"`` (4·10⁹), ``"4GiB"`` (4·2³⁰),
    ``"512MB"``, ``"1e9"``, ``123``. ValueError naming the text otherwise."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(?:([kKmMgGtT])(i?)[bB]?|[bB]?)\s*", str(text))
    try:
        value = float(match.group(1)) if match else math.nan
    except ValueError:
        value = math.nan
    if math.isnan(value):
        raise UserError(f"not a byte count: {text!r} (write e.g. 4GB, 512MiB or 1e9)")
    if match.group(2):
        base = 1024.0 if match.group(3) else 1000.0
        value *= base ** ("kmgt".index(match.group(2).lower()) + 1)
    if not math.isfinite(value) or value < 1:
        raise UserError(f"a byte count must be positive, got {text!r}")
    return int(value)


def format_bytes(n: float, binary: bool = False) -> str:
    """A byte count to 3 significant digits in its own unit: ``256412 -> '256 kB'``."""
    name, size = byte_unit(n, binary)
    return f"{n / size:.3g} {name}"


def time_unit(largest: float) -> tuple[str, float]:
    """The unit to show durations up to ``largest`` seconds in: ``("ms", 1e-3)`` below a
    second, else ``("s", 1.0)``."""
    return ("ms", 1e-3) if abs(largest) < 1.0 else ("s", 1.0)
