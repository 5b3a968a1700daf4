"""Link decoders (a score per node pair from the pair's two embeddings) and link losses.

- :class:`DotDecoder`: ``<h_s, h_d>`` (no parameters; PyG's and DGL's link examples);
- :class:`MLPDecoder`: an MLP on ``h_s ⊙ h_d`` (OGB's ``LinkPredictor``);
- :class:`DistMultDecoder`: ``<h_s, r, h_d>`` with a learned diagonal relation ``r`` per
  relation type (for typed relations; one relation on a homogeneous graph).

Every decoder maps ``(h_src (..., d), h_dst (..., d))`` to scores of shape ``(...)``, so a
positive's ``k`` negatives are scored by broadcasting ``h_src[:, None]`` against
``h_neg (b, k, d)``. The losses return **sums** over the pairs (a data-parallel trainer
divides by the global batch): :func:`bce_sum` (positives labelled 1, negatives 0) and
:func:`margin_sum` (``max(0, margin - s_pos + s_neg)`` over every positive-negative pair).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gnnpar.errors import UserError

__all__ = [
    "DECODERS",
    "LOSSES",
    "DistMultDecoder",
    "DotDecoder",
    "MLPDecoder",
    "bce_sum",
    "make_decoder",
    "margin_sum",
]

DECODERS = ("dot", "mlp", "distmult")
LOSSES = ("bce", "margin")


class DotDecoder(nn.Module):
    """``score = <h_s, h_d>``."""

    def forward(self, h_src: torch.Tensor, h_dst: torch.Tensor) -> torch.Tensor:
        """Scores of the pairs (broadcast over leading dimensions)."""
        return (h_src * h_dst).sum(-1)


class MLPDecoder(nn.Module):
    """``score = MLP(h_s ⊙ h_d)``: ``layers`` Linear layers (ReLU between), the last to
    ``out`` (1: a score per pair, squeezed; C: one logit per class of edge classification)."""

    def __init__(self, dim: int, hidden: int, layers: int = 2, out: int = 1) -> None:
        super().__init__()
        if layers < 1:
            raise UserError(f"the MLP decoder needs at least 1 layer, got {layers}")
        self.out = out
        widths = [dim] + [hidden] * (layers - 1) + [out]
        self.lins = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False))

    def forward(self, h_src: torch.Tensor, h_dst: torch.Tensor) -> torch.Tensor:
        """Scores of the pairs (broadcast over leading dimensions)."""
        h = h_src * h_dst
        for i, lin in enumerate(self.lins):
            h = lin(h)
            if i < len(self.lins) - 1:
                h = torch.relu(h)
        return h.squeeze(-1) if self.out == 1 else h


class DistMultDecoder(nn.Module):
    """``score = Σ h_s · r_rel · h_d``: one learned diagonal per relation (initialised to
    ones, so it starts as the dot product)."""

    def __init__(self, dim: int, relations: int = 1) -> None:
        super().__init__()
        if relations < 1:
            raise UserError(f"DistMult needs at least 1 relation, got {relations}")
        self.relation = nn.Parameter(torch.ones(relations, dim))

    def forward(
        self, h_src: torch.Tensor, h_dst: torch.Tensor, rel: torch.Tensor | int = 0
    ) -> torch.Tensor:
        """Scores of the pairs of relation ``rel`` (an int, or one per pair)."""
        r = self.relation[rel]
        if isinstance(rel, torch.Tensor) and h_src.dim() > r.dim():
            r = r.view(*r.shape[:-1], *([1] * (h_src.dim() - r.dim())), r.shape[-1])
        return (h_src * r * h_dst).sum(-1)


def make_decoder(name: str, dim: int, hidden: int, layers: int = 2, out: int = 1) -> nn.Module:
    """The decoder ``name`` (one of :data:`DECODERS`) for embeddings of width ``dim``;
    ``out`` > 1 (edge classification) only for ``mlp``."""
    if out != 1 and name != "mlp":
        raise UserError(f"edge labels need the mlp decoder (one output per class), not {name!r}")
    if name == "dot":
        return DotDecoder()
    if name == "mlp":
        return MLPDecoder(dim, hidden, layers, out)
    if name == "distmult":
        return DistMultDecoder(dim)
    raise UserError(f"unknown decoder {name!r}: one of {', '.join(DECODERS)}")


def bce_sum(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy with logits, summed: positives labelled 1, negatives 0."""
    return F.binary_cross_entropy_with_logits(
        pos, torch.ones_like(pos), reduction="sum"
    ) + F.binary_cross_entropy_with_logits(neg, torch.zeros_like(neg), reduction="sum")


def margin_sum(pos: torch.Tensor, neg: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
    """``Σ max(0, margin - s_pos + s_neg)`` over each positive (b,) and its negatives
    (b, k)."""
    return torch.relu(margin - pos[:, None] + neg.view(pos.shape[0], -1)).sum()
