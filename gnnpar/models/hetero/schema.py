"""What the typed models need to know of a typed graph: its node types (id ranges, feature
widths) and relations, from a :class:`~gnnpar.graph.typed.GraphTypes` or its manifest meta."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gnnpar.errors import UserError
from gnnpar.graph.typed import GraphTypes, Relation

__all__ = ["TypeSchema"]


@dataclasses.dataclass(frozen=True)
class TypeSchema:
    """A typed graph's schema.

    Attributes:
        node_types: the node type names, in id order.
        offsets: original-id offsets (type ``t`` owns ``[offsets[t], offsets[t + 1])``).
        feat_dims: the real feature width of each type (0: featureless).
        relations: the canonical relations, in edge-type order.
        target: the labelled node type, or None.
    """

    node_types: tuple[str, ...]
    offsets: tuple[int, ...]
    feat_dims: tuple[int, ...]
    relations: tuple[Relation, ...]
    target: str | None = None

    @classmethod
    def of(cls, types: GraphTypes | Mapping[str, Any] | TypeSchema) -> TypeSchema:
        """The schema of a GraphTypes, of its :meth:`~GraphTypes.meta`, or itself."""
        if isinstance(types, TypeSchema):
            return types
        meta = types.meta() if isinstance(types, GraphTypes) else types
        if not isinstance(meta, Mapping):
            raise UserError(f"typed models need a GraphTypes or its meta, got {type(meta)}")
        try:
            schema = cls(
                node_types=tuple(meta["node_types"]),
                offsets=tuple(int(o) for o in meta["offsets"]),
                feat_dims=tuple(int(d) for d in meta["feat_dims"]),
                relations=tuple(tuple(r) for r in meta["relations"]),  # type: ignore[misc]
                target=meta.get("target"),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(f"malformed typed-graph meta ({err!r})") from None
        n = len(schema.node_types)
        if len(schema.offsets) != n + 1 or len(schema.feat_dims) != n:
            raise UserError("typed-graph meta needs one offset per node type plus one and one "
                            "feature width per node type")  # fmt: skip
        for rel in schema.relations:
            if len(rel) != 3 or rel[0] not in schema.node_types or rel[2] not in schema.node_types:
                raise UserError(f"relation {rel!r} is not (src type, name, dst type) of known "
                                "types")  # fmt: skip
        return schema

    @property
    def num_types(self) -> int:
        """Number of node types."""
        return len(self.node_types)

    @property
    def num_relations(self) -> int:
        """Number of relations."""
        return len(self.relations)

    def num_nodes(self, t: int) -> int:
        """Number of nodes of type index ``t``."""
        return self.offsets[t + 1] - self.offsets[t]

    @property
    def ends(self) -> tuple[tuple[int, int], ...]:
        """``(src type, dst type)`` index pair of every relation."""
        idx = self.node_types.index
        return tuple((idx(r[0]), idx(r[2])) for r in self.relations)
