"""Cutting a sequential model into contiguous pipeline stages, by layer count or by cost.

The embedding always goes with the first stage and the head and loss with the last;
:func:`split_layers` decides which transformer blocks each virtual stage holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from gnnpar.errors import UserError

__all__ = ["gpt_layer_costs", "split_layers"]


def split_layers(
    n_layers: int,
    parts: int,
    costs: Sequence[float] | None = None,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
) -> list[range]:
    """``parts`` contiguous ranges covering ``range(n_layers)``, each non-empty.

    Without ``costs``: by layer count, the first ``n_layers % parts`` ranges one layer longer.
    With ``costs`` (one per layer): the split whose most expensive part is cheapest, the
    first part also paying ``first_extra`` (the embedding) and the last ``last_extra`` (the
    head and loss); ties go to the split that puts layers earliest.
    """
    if not isinstance(parts, int) or parts < 1:
        raise UserError(f"the number of stages must be a positive integer, got {parts!r}")
    if n_layers < parts:
        raise UserError(f"{n_layers} layers cannot fill {parts} pipeline stages (one each)")
    if costs is None:
        base, extra = divmod(n_layers, parts)
        out, start = [], 0
        for i in range(parts):
            stop = start + base + (1 if i < extra else 0)
            out.append(range(start, stop))
            start = stop
        return out
    if len(costs) != n_layers:
        raise ValueError(f"{len(costs)} layer costs for {n_layers} layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def cost(i: int, j: int, k: int) -> float:  # layers i..j-1 as part k
        extra = (first_extra if k == 0 else 0.0) + (last_extra if k == parts - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    # best[k][j]: the least maximum over parts 0..k covering layers 0..j-1
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(parts)]
    cut = [[0] * (n_layers + 1) for _ in range(parts)]
    for j in range(1, n_layers + 1):
        best[0][j] = cost(0, j, 0)
    for k in range(1, parts):
        for j in range(k + 1, n_layers + 1):
            for i in range(k, j):
                value = max(best[k - 1][i], cost(i, j, k))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds, j = [n_layers], n_layers
    for k in range(parts - 1, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def gpt_layer_costs(
    n_layer: int, n_embd: int, block_size: int, vocab_size: int
) -> tuple[list[float], float, float]:
    """Multiply-adds per token of each GPT block (``12·h² + 2·T·h``: projections, MLP and
    attention scores), of the embedding (none: a lookup) and of the head (``h·V``), as the
    ``costs``, ``first_extra`` and ``last_extra`` of :func:`split_layers`."""
    block = 12.0 * n_embd * n_embd + 2.0 * block_size * n_embd
    return [block] * n_layer, 0.0, float(n_embd) * vocab_size
