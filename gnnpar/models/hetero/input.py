"""The input layer of a typed model: every node's own features to one hidden width."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gnnpar.errors import UserError
from gnnpar.graph.typed import GraphTypes, TypeSchema
from gnnpar.models.hetero.index import TypeGroups, block_node_types

__all__ = ["TypedInput"]


class TypedInput(nn.Module):
    """Hidden vectors of a block's source nodes from their (zero-padded) input features.

    A node type with features gets a ``Linear(feat_dims[t], hidden)`` on its real columns;
    a featureless type an ``Embedding(num_nodes_of_type, hidden)`` looked up by the node's
    type-local id (its original id, ``block.keys``, less its type's offset).
    ``encoders[t]`` is type ``t``'s module.

    Args:
        types: the graph's :class:`~gnnpar.graph.typed.GraphTypes` (or its meta).
        hidden: the output width.
    """

    def __init__(self, types: GraphTypes | Mapping[str, Any] | TypeSchema, hidden: int):
        super().__init__()
        self.schema = TypeSchema.of(types)
        if hidden < 1:
            raise UserError(f"hidden must be >= 1, got {hidden}")
        self.hidden = hidden
        self.encoders = nn.ModuleList(
            nn.Linear(d, hidden) if d else nn.Embedding(self.schema.num_nodes(t), hidden)
            for t, d in enumerate(self.schema.feat_dims)
        )

    def forward(
        self,
        block: Any,
        x: torch.Tensor | None,
        groups: TypeGroups | None = None,
        grouped: bool = False,
    ) -> torch.Tensor | list[torch.Tensor]:
        """``(num_src, hidden)`` for ``block``'s sources from their features ``x``
        (``(num_src, max feat_dims)``; None when no type has features). ``groups``: the
        block's sources by type, when already built; ``grouped``: a list instead, each type's
        rows (``groups.sources(t)``, by rank), never concatenated."""
        schema = self.schema
        if groups is None:
            types = block_node_types(block, schema)
            groups = TypeGroups.build(types, block.num_dst, schema.num_types)
        widest = max(schema.feat_dims, default=0)
        if widest and (x is None or x.dim() != 2 or x.shape != (block.num_src, widest)):
            got = None if x is None else tuple(x.shape)
            raise UserError(
                f"input features must have shape ({block.num_src}, {widest}), got {got}"
            )
        keys = block.keys
        parts = []
        for t, (enc, d) in enumerate(zip(self.encoders, schema.feat_dims, strict=True)):
            rows = groups.sources(t)
            if d:
                parts.append(enc(x[:, :d].index_select(0, rows)))
            else:
                parts.append(enc(keys.index_select(0, rows) - schema.offsets[t]))
        return parts if grouped else groups.merge(parts)
