"""The typed node classifier on message-flow blocks: :class:`TypedInput`, then R-GCN or HGT
layers, then a linear classifier for the target type's classes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gnnpar.errors import UserError
from gnnpar.graph.typed import GraphTypes, TypeSchema
from gnnpar.models.hetero.hgt import HGTConv
from gnnpar.models.hetero.index import TypedBlock, block_node_types
from gnnpar.models.hetero.input import TypedInput
from gnnpar.models.hetero.rgcn import RGCNConv
from gnnpar.nn.dropout import index_dropout

__all__ = ["TypedGNN", "is_unit"]

_KINDS = ("rgcn", "hgt")


def is_unit(name: str, module: nn.Module) -> bool:
    """A unit policy (:func:`gnnpar.shard.shard`'s ``units``) for a :class:`TypedGNN`: its
    input, each typed layer and its classifier, each gathered on its own at ZeRO stage 3 (the
    classifier too: layer-wise inference calls it through :meth:`TypedGNN.forward_layer`,
    outside the model's own forward)."""
    if isinstance(module, (TypedInput, RGCNConv, HGTConv)):
        return True
    return isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] == "classifier"


class TypedGNN(nn.Module):
    """Typed node classification on blocks.

    Layer ``i`` (one block each): for ``i = 0`` the :class:`TypedInput` of the raw
    features; then dropout, the typed layer (R-GCN or HGT, ``hidden`` wide), ReLU; the last
    also dropout and the classifier (``Linear(hidden, num_classes)``). The outputs are
    logits for every destination of the last block (the seeds; those of the target type
    are the ones to read).

    Args:
        types: the graph's :class:`~gnnpar.graph.typed.GraphTypes` (or its meta).
        hidden: width of the input vectors and of every layer.
        num_classes: classes of the target type.
        num_layers: typed layers (and blocks a forward pass takes).
        kind: ``"rgcn"`` or ``"hgt"``.
        dropout: dropout probability on every layer's input and on the classifier's.
        heads: HGT's attention heads.
        num_bases, num_blocks: R-GCN's weight decomposition (see :class:`RGCNConv`).

    As :class:`~gnnpar.models.minibatch.model.BlockGNN`: ``forward(blocks, x)`` for
    training, ``forward_layer`` for layer-wise inference, and with a ``dropout_seed`` the
    mask of every element is a hash of (seed, layer, the node's key, feature).
    Blocks must be typed (``edge_type``, and ``node_type`` or keys that are original ids).
    """

    def __init__(
        self,
        types: GraphTypes | Mapping[str, Any] | TypeSchema,
        hidden: int,
        num_classes: int,
        num_layers: int = 2,
        kind: str = "rgcn",
        dropout: float = 0.5,
        heads: int = 1,
        num_bases: int | None = None,
        num_blocks: int | None = None,
    ):
        super().__init__()
        if kind not in _KINDS:
            raise UserError(f"unknown typed model {kind!r}; use one of {', '.join(_KINDS)}")
        if num_layers < 1:
            raise UserError(f"num_layers must be at least 1, got {num_layers}")
        if not 0.0 <= dropout < 1.0:
            raise UserError(f"dropout must be in [0, 1), got {dropout}")
        self.schema = TypeSchema.of(types)
        self.kind, self.dropout = kind, dropout
        self.input = TypedInput(self.schema, hidden)
        t, r = self.schema.num_types, self.schema.num_relations
        self.layers = nn.ModuleList(
            RGCNConv(hidden, hidden, r, num_bases, num_blocks)
            if kind == "rgcn"
            else HGTConv(hidden, hidden, t, r, heads)
            for _ in range(num_layers)
        )
        self.classifier = nn.Linear(hidden, num_classes)

    @property
    def num_layers(self) -> int:
        """Number of typed layers (and of blocks a forward pass takes)."""
        return len(self.layers)

    def typed_block(self, block: Any, dtype: torch.dtype | None = None) -> TypedBlock:
        """``block``'s nodes and edges grouped by type and relation, checked against the
        schema (what every layer on the block reads). With the activations' ``dtype``, an
        R-GCN's operators per relation are built too, transposes included (in a loader's
        prefetch thread: the step then only multiplies)."""
        types = block_node_types(block, self.schema)
        s = self.schema
        typed = TypedBlock.build(block, s.num_types, s.num_relations, s.ends, types)
        if dtype is not None and self.kind == "rgcn":
            typed.prepare_operators("mean", dtype)
        return typed

    def _drop(
        self, h: torch.Tensor, keys: Callable[[], torch.Tensor], seed: int | None, i: int
    ) -> torch.Tensor:
        """Dropout of ``h``, keyed by its rows' ``keys()`` (asked for only when it drops)."""
        if seed is None:
            return F.dropout(h, self.dropout, self.training)
        if not self.training or self.dropout == 0.0:
            return h
        return index_dropout(h, self.dropout, seed * 1009 + i, keys(), 0, self.training)

    def forward_layer(
        self,
        i: int,
        block: Any,
        h_src: torch.Tensor | None,
        dropout_seed: int | None = None,
        typed: TypedBlock | None = None,
        grouped: bool = False,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Layer ``i`` on ``block``: (layer 0: the typed input of the raw features
        ``h_src``), dropout, the typed layer, ReLU; after the last, dropout and the
        classifier. ``typed``: :meth:`typed_block` of ``block``, when already built.

        ``grouped`` (R-GCN): ``h_src`` (beyond layer 0) and the output are lists of each node
        type's rows (``typed.groups.sources(t)`` and ``destinations(t)``, by rank) instead
        of tensors in block order: a layer's grouped output is its successor's grouped input
        (the successor's sources are its destinations, and a stable grouping keeps their
        order), so :meth:`forward` regroups once, at the seeds, rather than at every layer,
        and no layer concatenates or splits its rows."""
        if not 0 <= i < self.num_layers:
            raise UserError(f"layer {i} of a {self.num_layers}-layer model")
        if grouped and self.kind != "rgcn":
            raise UserError("grouped rows are for R-GCN layers; HGT runs in block order")
        if typed is None:
            typed = self.typed_block(block)
        groups = typed.groups
        h = self.input(block, h_src, groups, grouped) if i == 0 else h_src
        layer = self.layers[i]
        if not grouped:
            h = self._drop(h, lambda: block.keys, dropout_seed, i)
            h = torch.relu(layer(block, h, typed))
            if i < self.num_layers - 1:
                return h
            h = self._drop(h, lambda: block.keys[: block.num_dst], dropout_seed, self.num_layers)
            return self.classifier(h)
        types = range(groups.num_types)
        h = [self._drop(h[t], _keys(block, groups.sources, t), dropout_seed, i) for t in types]
        h = [torch.relu(part) for part in layer(block, h, typed, grouped)]
        if i < self.num_layers - 1:
            return h
        last = self.num_layers
        return [
            self.classifier(
                self._drop(h[t], _keys(block, groups.destinations, t), dropout_seed, last)
            )
            for t in types
        ]

    def forward(
        self,
        blocks: list[Any],
        x: torch.Tensor | None,
        dropout_seed: int | None = None,
        typed: list[TypedBlock] | None = None,
    ) -> torch.Tensor:
        """Logits of the seeds (``blocks[-1]``'s destinations) from the features ``x`` of
        ``blocks[0]``'s sources (None for a graph without features). ``typed``: the blocks'
        :meth:`typed_block`, when built already (e.g. by the loader's prefetch thread)."""
        if len(blocks) != self.num_layers:
            raise UserError(f"the model has {self.num_layers} layers but got {len(blocks)} blocks")
        grouped = self.kind == "rgcn"  # rows grouped by type throughout (forward_layer)
        h = x
        for i, block in enumerate(blocks):
            t = self.typed_block(block) if typed is None else typed[i]
            h = self.forward_layer(i, block, h, dropout_seed, t, grouped)
        if not grouped:
            return h
        return t.groups.merge(h, dst=True)  # the seeds' order


def _keys(block: Any, rows: Callable[[int], torch.Tensor], t: int) -> Callable[[], torch.Tensor]:
    """The keys of type ``t``'s ``rows`` of ``block`` (the dropout masks' keys), when asked."""
    return lambda: block.keys.index_select(0, rows(t))
