"""Balanced chunking: the sizes and offsets of ``parts`` near-equal chunks of ``n`` items,
the one convention every split in gnnpar follows (the collectives of :mod:`gnnpar.comm`,
the shared-memory transport, tensor-parallel and full-graph layouts)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["chunk_offsets", "chunk_sizes"]


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Balanced sizes of ``parts`` chunks of ``n`` items: the first ``n % parts`` get one more
    (the convention of ``torch.tensor_split``)."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def chunk_offsets(sizes: Sequence[int]) -> list[int]:
    """Start offset of each chunk given the chunk sizes."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out
