"""R-GCN (Schlichtkrull et al.) on a typed block, with PyG ``RGCNConv``'s semantics.

``h_v' = W_root h_v + b + Σ_r mean_{u ∈ N_r(v)} W_r h_u``: per relation the mean over that
relation's in-neighbours (0 where there are none). ``W_r`` is a full matrix, a combination
of ``num_bases`` shared bases, or ``num_blocks`` diagonal blocks. The parameters are PyG's
(``weight``, ``comp``, ``root``, ``bias``, same shapes and meaning): ``load_state_dict``
copies them either way.

Each relation's mean is one SpMM (:func:`~gnnpar.models.minibatch.model.block_mean`) on its
compact CSR (:class:`~gnnpar.models.hetero.index.RelationCSR`: only its destination type's
destinations and source type's sources), followed by the relation's matmul; or, when that
is cheaper (a narrower output), the matmul on the relation's sources first.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gnnpar.errors import UserError
from gnnpar.models.hetero.index import TypedBlock
from gnnpar.models.minibatch.model import block_mean

__all__ = ["RGCNConv"]


def _glorot(t: torch.Tensor) -> None:
    """PyG's ``glorot``: uniform in ``±sqrt(6 / (fan_in + fan_out))`` of the last two dims."""
    a = math.sqrt(6.0 / (t.size(-2) + t.size(-1)))
    with torch.no_grad():
        t.uniform_(-a, a)


class RGCNConv(nn.Module):
    """Relational graph convolution on a typed block (module docstring).

    Args:
        in_dim, out_dim: input and output widths.
        num_relations: number of relations (the block's ``edge_type`` values).
        num_bases: basis decomposition with this many bases, or None.
        num_blocks: block-diagonal decomposition with this many blocks (dividing both
            widths), or None.
        root_weight: add ``W_root h_v``.
        bias: add a learnt bias.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        num_relations: int,
        num_bases: int | None = None,
        num_blocks: int | None = None,
        root_weight: bool = True,
        bias: bool = True,
    ):
        super().__init__()
        if num_bases is not None and num_blocks is not None:
            raise UserError("give num_bases or num_blocks, not both")
        if num_blocks is not None and (
            num_blocks < 1 or in_dim % num_blocks or out_dim % num_blocks
        ):
            raise UserError(f"num_blocks {num_blocks} must divide in_dim {in_dim} and "
                            f"out_dim {out_dim}")  # fmt: skip
        if num_bases is not None and num_bases < 1:
            raise UserError(f"num_bases must be >= 1, got {num_bases}")
        self.in_dim, self.out_dim, self.num_relations = in_dim, out_dim, num_relations
        self.num_bases, self.num_blocks = num_bases, num_blocks
        if num_bases is not None:
            self.weight = nn.Parameter(torch.empty(num_bases, in_dim, out_dim))
            self.comp = nn.Parameter(torch.empty(num_relations, num_bases))
        elif num_blocks is not None:
            shape = (num_relations, num_blocks, in_dim // num_blocks, out_dim // num_blocks)
            self.weight = nn.Parameter(torch.empty(shape))
            self.register_parameter("comp", None)
        else:
            self.weight = nn.Parameter(torch.empty(num_relations, in_dim, out_dim))
            self.register_parameter("comp", None)
        self.root = nn.Parameter(torch.empty(in_dim, out_dim)) if root_weight else None
        self.bias = nn.Parameter(torch.zeros(out_dim)) if bias else None
        for p in (self.weight, self.comp, self.root):
            if p is not None:
                _glorot(p)

    def relation_weights(self) -> torch.Tensor:
        """Every relation's weight: ``(R, in, out)``, or ``(R, blocks, in/blocks,
        out/blocks)`` for the block-diagonal form."""
        if self.num_bases is None:
            return self.weight
        flat = self.comp @ self.weight.view(self.num_bases, -1)
        return flat.view(self.num_relations, self.in_dim, self.out_dim)

    def _transform(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``h @ W_r`` for one relation's weight ``w``."""
        if self.num_blocks is None:
            return h @ w
        b = self.num_blocks
        out = torch.einsum("abc,bcd->abd", h.reshape(-1, b, self.in_dim // b), w)
        return out.reshape(-1, self.out_dim)

    def forward(
        self,
        block: Any,
        h_src: torch.Tensor | list[torch.Tensor],
        typed: TypedBlock | None = None,
        grouped: bool = False,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Outputs of the block's destinations from its sources' ``h_src``. ``typed``: the
        block's :class:`~gnnpar.models.hetero.index.TypedBlock`, when already built.
        ``grouped``: ``h_src`` and the output are lists of each node type's rows
        (``typed.groups.sources(t)`` and ``destinations(t)``, by rank), not tensors in block
        order: nothing is regrouped, split or concatenated."""
        given = list(h_src) if grouped else [h_src]
        rows = sum(h.shape[0] for h in given if h.dim() == 2)
        if rows != block.num_src or any(h.dim() != 2 or h.shape[1] != self.in_dim for h in given):
            got = [tuple(h.shape) for h in given] if grouped else tuple(h_src.shape)
            raise UserError(f"h_src must have shape ({block.num_src}, {self.in_dim}), got {got}")
        if typed is None:
            known = block.node_type is not None and block.num_src
            num_types = int(block.node_type.max()) + 1 if known else 1
            typed = TypedBlock.build(block, num_types, self.num_relations)
        elif typed.num_relations != self.num_relations:
            raise UserError(f"the typed block has {typed.num_relations} relations, the layer "
                            f"{self.num_relations}")  # fmt: skip
        groups = typed.groups
        weights = self.relation_weights()
        by_type = list(h_src) if grouped else groups.split(h_src)
        if grouped and len(by_type) != groups.num_types:
            raise UserError(f"h_src holds {len(by_type)} types, the block {groups.num_types}")
        outs: list[torch.Tensor | None] = [None] * groups.num_types
        fi, fo = self.in_dim, self.out_dim
        for r, rel in enumerate(typed.relations):
            if rel is None:
                continue
            s, d = typed.ends[r]
            e = rel.num_edges
            if rel.num_src * fi * fo + e * fo < e * fi + rel.num_dst * fi * fo:
                agg = block_mean(rel, self._transform(by_type[s], weights[r]))
            else:
                agg = self._transform(block_mean(rel, by_type[s]), weights[r])
            outs[d] = agg if outs[d] is None else outs[d] + agg
        parts = [
            by_type[t].new_zeros(groups.dst_counts[t], fo) if o is None else o
            for t, o in enumerate(outs)
        ]
        if grouped:  # per type: its destinations are the head of its sources
            return [
                self._self_terms(part, by_type[t][:n])
                for t, (part, n) in enumerate(zip(parts, groups.dst_counts, strict=True))
            ]
        return self._self_terms(groups.merge(parts, dst=True), h_src[: block.num_dst])

    def _self_terms(self, out: torch.Tensor, h_dst: torch.Tensor) -> torch.Tensor:
        """``out + h_dst W_root + b`` (each where the layer has it)."""
        if self.root is not None:
            out = torch.addmm(out, h_dst, self.root)
        return out if self.bias is None else out + self.bias
