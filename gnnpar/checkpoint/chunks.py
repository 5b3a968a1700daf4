"""The global layout: which elements of which full tensor a rank's local tensor holds.

A rank stores *pieces*: flat local tensors (a tensor-parallel weight block flattened and split
over z, a ZeRO shard of a flat group, a full-graph weight block, a replicated bias, ...).
Whatever the parallelism, a piece is described by a list of :class:`Chunk` s. A chunk says:
the box ``[offsets, offsets + sizes)`` of the full tensor ``key`` lies, row-major, at flat
positions ``[at, at + numel)`` of the piece (with ``transposed``, a 2-D box is stored as its
transpose). That is torch DCP's chunk (offsets + sizes of a full tensor) plus the position in
the piece, which lets one flat piece hold several boxes, of several tensors, and cut a box
anywhere — exactly what flattening and sharding along a flat axis produce.

Everything here is pure index arithmetic on small lists (no tensors are scanned), so planning
a load of any checkpoint onto any grid costs microseconds per chunk.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["Chunk", "box_range", "concat", "copy_overlap", "overlap_volume", "restrict"]


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Box ``offsets``..``offsets + sizes`` of full tensor ``key``, stored row-major at flat
    positions ``at``..``at + numel`` of a piece (as the transpose of the box when
    ``transposed``; 2-D boxes only)."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    at: int
    transposed: bool = False

    @property
    def numel(self) -> int:
        """Elements of the box."""
        return math.prod(self.sizes)

    def to_json(self) -> list[Any]:
        """Compact JSON form ``[key, offsets, sizes, at, transposed]``."""
        return [self.key, list(self.offsets), list(self.sizes), self.at, int(self.transposed)]

    @classmethod
    def from_json(cls, doc: Sequence[Any]) -> Chunk:
        """Inverse of :meth:`to_json`."""
        key, offsets, sizes, at, transposed = doc
        return cls(str(key), tuple(offsets), tuple(sizes), int(at), bool(transposed))

    def shifted(self, delta: int) -> Chunk:
        """The same box at ``at + delta``."""
        return dataclasses.replace(self, at=self.at + delta)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The box as a tensor of shape ``sizes`` viewing the flat piece ``flat``."""
        part = flat[self.at : self.at + self.numel]
        if self.transposed:
            return part.view(tuple(reversed(self.sizes))).t()
        return part.view(self.sizes)


def _flat_boxes(sizes: Sequence[int], a: int, b: int) -> list[tuple[tuple[int, ...], ...]]:
    """Sub-boxes (offsets, sizes), relative to a box of ``sizes``, whose row-major
    concatenation is elements ``[a, b)`` of the box's row-major flattening (at most
    ``2·ndim − 1`` of them)."""
    if a >= b:
        return []
    if not sizes:
        return [((), ())]
    inner = math.prod(sizes[1:])
    rest = tuple(sizes[1:])
    r0, o0 = divmod(a, inner)
    r1, o1 = divmod(b, inner)
    out: list[tuple[tuple[int, ...], ...]] = []
    if r0 == r1:
        for off, sz in _flat_boxes(rest, o0, o1):
            out.append(((r0, *off), (1, *sz)))
        return out
    if o0:
        for off, sz in _flat_boxes(rest, o0, inner):
            out.append(((r0, *off), (1, *sz)))
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * len(rest)), (r1 - r0, *rest)))
    if o1:
        for off, sz in _flat_boxes(rest, 0, o1):
            out.append(((r1, *off), (1, *sz)))
    return out


def box_range(
    key: str,
    offsets: Sequence[int],
    sizes: Sequence[int],
    a: int,
    b: int,
    at: int = 0,
    transposed: bool = False,
) -> list[Chunk]:
    """Chunks of elements ``[a, b)`` of the row-major flattening of box ``offsets``/``sizes``
    of ``key`` (of its transpose with ``transposed``), placed from ``at`` on."""
    stored = tuple(reversed(sizes)) if transposed else tuple(sizes)
    b = min(b, math.prod(stored))
    out = []
    pos = at
    for off, sz in _flat_boxes(stored, max(a, 0), b):
        if transposed:
            off, sz = tuple(reversed(off)), tuple(reversed(sz))
        full_off = tuple(o + p for o, p in zip(offsets, off, strict=True))
        chunk = Chunk(key, full_off, tuple(sz), pos, transposed)
        out.append(chunk)
        pos += chunk.numel
    return out


def concat(
    boxes: Iterable[tuple[str, Sequence[int], Sequence[int]]],
    a: int = 0,
    b: int | None = None,
    transposed: bool = False,
) -> list[Chunk]:
    """Chunks of a piece that is elements ``[a, b)`` of several boxes ``(key, offsets,
    sizes)`` flattened and laid end to end (``b=None``: to the end). Positions past the boxes
    (padding) hold no chunk."""
    out: list[Chunk] = []
    start = 0
    for key, offsets, sizes in boxes:
        n = math.prod(sizes)
        lo, hi = max(a, start), n + start if b is None else min(b, n + start)
        if lo < hi:
            out += box_range(key, offsets, sizes, lo - start, hi - start, lo - a, transposed)
        start += n
    return out


def restrict(chunks: Iterable[Chunk], a: int, b: int) -> list[Chunk]:
    """The chunks of positions ``[a, b)`` of a piece, placed from 0 (a slice of a piece, such
    as the part of a parameter a ZeRO rank owns)."""
    out: list[Chunk] = []
    for c in chunks:
        lo, hi = max(a, c.at), min(b, c.at + c.numel)
        if lo >= hi:
            continue
        if lo == c.at and hi == c.at + c.numel:
            out.append(c.shifted(-a))
            continue
        out += box_range(c.key, c.offsets, c.sizes, lo - c.at, hi - c.at, lo - a, c.transposed)
    return out


def _intersection(t: Chunk, s: Chunk) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(p, q) for p, q in zip(t.offsets, s.offsets, strict=True))
    hi = tuple(
        min(p + m, q + n) for p, m, q, n in zip(t.offsets, t.sizes, s.offsets, s.sizes, strict=True)
    )
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, hi


def overlap_volume(t: Chunk, s: Chunk) -> int:
    """Elements that chunks ``t`` and ``s`` (of the same key) both cover."""
    if t.key != s.key:
        return 0
    box = _intersection(t, s)
    return 0 if box is None else math.prod(h - low for low, h in zip(*box, strict=True))


def _slices(lo: tuple[int, ...], hi: tuple[int, ...], origin: tuple[int, ...]) -> tuple:
    return tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, origin, strict=True))


def copy_overlap(dst: torch.Tensor, t: Chunk, src: torch.Tensor, s: Chunk) -> int:
    """Copy the elements chunk ``s`` of flat piece ``src`` shares with chunk ``t`` of flat
    piece ``dst`` into ``dst``; return how many."""
    if t.key != s.key:
        return 0
    box = _intersection(t, s)
    if box is None:
        return 0
    lo, hi = box
    tgt = t.view(dst)[_slices(lo, hi, t.offsets)]
    got = s.view(src)[_slices(lo, hi, s.offsets)]
    tgt.copy_(got)
    return math.prod(h - low for low, h in zip(lo, hi, strict=True))
