"""Typed (heterogeneous) graphs: node types, canonical relations, features per node type.

A typed graph is a :class:`~gnnpar.graph.Graph` — its **homogeneous view**, on which every
partitioner, sampler and schedule already works — with a :class:`GraphTypes` riding on
:attr:`Graph.types <gnnpar.graph.Graph.types>` (as DGL and DistDGL keep a heterograph: one
id space, a type per node and a relation per edge):

- **nodes** are numbered type after type: type ``t``'s node ``i`` (its *type-local id*) is
  node ``offsets[t] + i`` of the homogeneous graph (:meth:`GraphTypes.global_ids`);
- **relations** are canonical triples ``(source type, relation, destination type)``; each
  edge's relation index is :attr:`GraphTypes.edge_type`, aligned with ``Graph.indices``
  (the CSR rows are destinations, as everywhere in gnnpar);
- **features** differ per node type: ``ndata["feat"]`` holds each node's own features
  left-aligned and zero-padded to the widest type's width, and :attr:`GraphTypes.feat_dims`
  says how many columns each type really has (``0``: a featureless type, for which models
  learn an embedding per node, as for ogbn-mag's authors, institutions and fields);
- **labels and masks** are those of the homogeneous graph, set on the :attr:`target
  <GraphTypes.target>` type's nodes only (label ``-1`` and masks ``False`` elsewhere), so
  node classification on a type is node classification on the homogeneous view.

A graph derived by relabelling nodes (a partition's :meth:`~gnnpar.graph.Graph.permute`, a
:meth:`~gnnpar.graph.Graph.subgraph`) keeps its types with :attr:`GraphTypes.node_ids`, the
original id of each of its nodes, from which a node's type and type-local id follow.

:func:`typed_graph` builds one from per-relation edge lists; :mod:`gnnpar.data.storage`
stores it (``types/edge_type.npy`` and the manifest's ``meta.types``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gnnpar.errors import UserError

if TYPE_CHECKING:
    from gnnpar.graph import Graph

__all__ = ["GraphTypes", "Relation", "TypeSchema", "relation_name", "typed_graph"]

#: A canonical relation: (source node type, relation name, destination node type).
Relation = tuple[str, str, str]
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def relation_name(rel: Relation) -> str:
    """``src___rel___dst``, how OGB names a relation's folder (and how we print one)."""
    return "___".join(rel)


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise UserError(f"{what} {name!r} must be a name of letters, digits, _ . -")
    return name


@dataclasses.dataclass(frozen=True)
class TypeSchema:
    """A typed graph's schema: its node types (original-id ranges, feature widths), its
    relations and its target type; what the typed models read (:mod:`gnnpar.models.hetero`).
    :class:`GraphTypes` is a schema with each edge's relation.

    Attributes:
        node_types: the node type names, in id order.
        offsets: ``len(node_types) + 1`` original-id offsets: type ``t`` owns the original
            ids ``[offsets[t], offsets[t + 1])``.
        relations: the canonical relations; an edge's relation is its index in this list.
        feat_dims: the real feature width of each node type (0: no features).
        target: the node type that carries labels and masks, or None.
    """

    node_types: tuple[str, ...]
    offsets: tuple[int, ...]
    relations: tuple[Relation, ...]
    feat_dims: tuple[int, ...]
    target: str | None = None

    @classmethod
    def of(cls, types: TypeSchema | Mapping[str, Any], where: str = "typed graph") -> TypeSchema:
        """The schema of ``types`` (a schema, a :class:`GraphTypes`, or the ``meta()`` a
        folder stores), checked (:meth:`check`)."""
        if isinstance(types, TypeSchema):
            return types if type(types) is TypeSchema else types.schema  # type: ignore[attr-defined]
        if not isinstance(types, Mapping):
            raise UserError(f"{where}: a typed graph's schema is a table, got {type(types)}")
        try:
            schema = cls(
                node_types=tuple(types["node_types"]),
                offsets=tuple(int(o) for o in types["offsets"]),
                relations=tuple(tuple(r) for r in types["relations"]),  # type: ignore[misc]
                feat_dims=tuple(int(d) for d in types["feat_dims"]),
                target=types.get("target"),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(f"{where}: meta field 'types' is malformed ({err!r})") from None
        schema.check(where)
        return schema

    def check(self, where: str = "types") -> None:
        """One UserError naming the field: names, offsets, relations (of known types, none
        twice), feature widths, the target."""
        for name in self.node_types:
            _check_name(name, f"{where}: node type")
        if len(set(self.node_types)) != len(self.node_types) or not self.node_types:
            raise UserError(f"{where}: node types must be distinct and at least one")
        offs = self.offsets
        if (
            len(offs) != len(self.node_types) + 1
            or offs[0] != 0
            or any(b < a for a, b in zip(offs, offs[1:], strict=False))
        ):
            raise UserError(
                f"{where}: offsets {list(offs)} must start at 0, never decrease and have one "
                "entry per node type plus one"
            )
        for r in self.relations:
            if len(r) != 3:
                raise UserError(f"{where}: relation {r!r} is not (src type, name, dst type)")
            for end in (r[0], r[2]):
                if end not in self.node_types:
                    raise UserError(f"{where}: relation {relation_name(r)} names no type {end!r}")
            _check_name(r[1], f"{where}: relation name")
        if len(set(self.relations)) != len(self.relations):
            raise UserError(f"{where}: a relation is listed twice")
        if len(self.feat_dims) != self.num_types or any(d < 0 for d in self.feat_dims):
            raise UserError(f"{where}: feat_dims needs one width >= 0 per node type")
        if self.target is not None:
            self.type_index(self.target)

    def meta(self) -> dict[str, Any]:
        """What a folder's manifest records of the schema (:meth:`of` reads it back)."""
        return {
            "node_types": list(self.node_types),
            "offsets": list(self.offsets),
            "relations": [list(r) for r in self.relations],
            "feat_dims": list(self.feat_dims),
            "target": self.target,
        }

    # ------------------------------------------------------------------ sizes and lookups
    @property
    def num_types(self) -> int:
        """Number of node types."""
        return len(self.node_types)

    @property
    def num_relations(self) -> int:
        """Number of relations."""
        return len(self.relations)

    def num_nodes(self, t: int) -> int:
        """Number of nodes of the type of index ``t`` (in the original graph)."""
        return self.offsets[t + 1] - self.offsets[t]

    def num_nodes_of(self, ntype: str) -> int:
        """Number of nodes of type ``ntype`` (in the original graph)."""
        return self.num_nodes(self.type_index(ntype))

    def id_range(self, ntype: str) -> tuple[int, int]:
        """``(lo, hi)``: type ``ntype`` owns the original ids ``[lo, hi)``."""
        t = self.type_index(ntype)
        return self.offsets[t], self.offsets[t + 1]

    @property
    def ends(self) -> tuple[tuple[int, int], ...]:
        """``(source type, destination type)`` indices of every relation."""
        idx = self.node_types.index
        return tuple((idx(r[0]), idx(r[2])) for r in self.relations)

    def type_index(self, ntype: str) -> int:
        """Index of the node type ``ntype``; one UserError naming the known types."""
        try:
            return self.node_types.index(ntype)
        except ValueError:
            raise UserError(
                f"no node type {ntype!r}; the graph has {', '.join(self.node_types)}"
            ) from None

    def relation_index(self, rel: str | Sequence[str]) -> int:
        """Index of a relation given as a triple, ``src___rel___dst`` or an unambiguous
        relation name."""
        if isinstance(rel, str) and "___" in rel:
            rel = tuple(rel.split("___"))
        if not isinstance(rel, str):
            triple = tuple(rel)
            if triple in self.relations:
                return self.relations.index(triple)  # type: ignore[arg-type]
            raise UserError(f"no relation {relation_name(triple)}; {self._listing()}")
        hits = [i for i, r in enumerate(self.relations) if r[1] == rel]
        if len(hits) != 1:
            why = "no" if not hits else "more than one"
            raise UserError(f"{why} relation named {rel!r}; {self._listing()}")
        return hits[0]

    def _listing(self) -> str:
        return "the graph has " + ", ".join(relation_name(r) for r in self.relations)

    def node_type_of(self, original: torch.Tensor) -> torch.Tensor:
        """Type index of each node given by its **original** id."""
        bounds = torch.tensor(self.offsets[1:-1], dtype=torch.int64, device=original.device)
        return torch.bucketize(original, bounds, right=True)

    def local_ids_of(self, original: torch.Tensor) -> torch.Tensor:
        """Type-local id of each node given by its **original** id."""
        starts = torch.tensor(self.offsets[:-1], dtype=torch.int64, device=original.device)
        return original - starts.index_select(0, self.node_type_of(original))

    def global_ids(self, ntype: str, local: torch.Tensor) -> torch.Tensor:
        """The original ids of type ``ntype``'s nodes ``local``."""
        return local.to(torch.int64) + self.offsets[self.type_index(ntype)]

    def target_only(self, pred: torch.Tensor) -> torch.Tensor:
        """``pred`` (a row per node, original order) with -1 on every row outside the
        target type (which alone has classes; in place); unchanged without a target."""
        if self.target is not None:
            lo, hi = self.id_range(self.target)
            pred[:lo] = -1
            pred[hi:] = -1
        return pred


@dataclasses.dataclass(frozen=True, eq=False)
class GraphTypes(TypeSchema):
    """The types of a typed graph's homogeneous view (module docstring): its
    :class:`TypeSchema` and each edge's relation.

    Attributes:
        edge_type: ``(num_edges,)`` int64 relation index of every edge, aligned with the
            graph's ``indices``.
        node_ids: ``(num_nodes,)`` int64 original id of every node of a relabelled graph
            (a permutation or a subgraph), or None where node ``v`` is original id ``v``.
    """

    edge_type: torch.Tensor = dataclasses.field(kw_only=True)
    node_ids: torch.Tensor | None = dataclasses.field(default=None, kw_only=True)

    @property
    def schema(self) -> TypeSchema:
        """The schema alone."""
        return TypeSchema(self.node_types, self.offsets, self.relations, self.feat_dims,
                          self.target)  # fmt: skip

    def original_ids(self, nodes: torch.Tensor) -> torch.Tensor:
        """The original ids of the graph's ``nodes``."""
        return nodes if self.node_ids is None else self.node_ids.index_select(0, nodes)

    def relation_counts(self) -> list[int]:
        """Number of edges of each relation."""
        return torch.bincount(self.edge_type, minlength=self.num_relations).tolist()

    # ------------------------------------------------------------------ derived views
    def relabelled(self, nodes: torch.Tensor, edges: torch.Tensor) -> GraphTypes:
        """The types of the graph on ``nodes`` (new node ``k`` is node ``nodes[k]``) whose
        edges are this graph's ``edges`` (CSR positions, in their new order)."""
        return dataclasses.replace(
            self,
            edge_type=self.edge_type.index_select(0, edges),
            node_ids=self.original_ids(nodes),
        )

    def to(self, device: str | torch.device) -> GraphTypes:
        """The same types with their arrays on ``device``."""
        ids = None if self.node_ids is None else self.node_ids.to(device)
        return dataclasses.replace(self, edge_type=self.edge_type.to(device), node_ids=ids)

    # ------------------------------------------------------------------ storage
    def arrays(self) -> dict[str, torch.Tensor]:
        """The arrays a graph folder stores (``types/<key>.npy``)."""
        out = {"edge_type": self.edge_type}
        if self.node_ids is not None:
            out["node_ids"] = self.node_ids
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, torch.Tensor], meta: Any, where: str) -> GraphTypes:
        """The types stored as ``arrays`` and ``meta`` (as :meth:`arrays` and :meth:`meta`
        give them); ``where`` names the folder in errors."""
        if "edge_type" not in arrays:
            raise UserError(f"{where}: a typed graph needs the array types/edge_type")
        schema = TypeSchema.of(meta, where)
        return cls(*dataclasses.astuple(schema), edge_type=arrays["edge_type"],
                   node_ids=arrays.get("node_ids"))  # fmt: skip

    def validate(self, graph: Graph, where: str = "types") -> None:
        """One UserError naming the field and the problem: names, offsets, relations (known
        types, no duplicate), feature widths against ``ndata["feat"]``, ``edge_type``
        against the edges, every edge's endpoints of its relation's types, and labels and
        masks only on the target type."""
        self.check(where)
        self.check_shapes(graph, where)
        self._validate_nodes(graph, where)
        self._validate_edges(graph, where)
        self._validate_node_data(graph, where)

    def check_shapes(self, graph: Graph, where: str = "types") -> None:
        """The O(1) part of :meth:`validate`: the node count, and the dtypes and shapes of
        ``edge_type`` and ``node_ids`` against the graph's."""
        total = self.offsets[-1]
        if self.node_ids is None and graph.num_nodes != total:
            raise UserError(
                f"{where}: the types count {total} nodes, the graph has {graph.num_nodes}"
            )
        ids = self.node_ids
        if ids is not None and (ids.dtype != torch.int64 or ids.shape != (graph.num_nodes,)):
            raise UserError(f"{where}: node_ids must be int64 of shape ({graph.num_nodes},)")
        et = self.edge_type
        if et.dtype != torch.int64 or et.shape != (graph.num_edges,):
            raise UserError(
                f"{where}: edge_type must be int64 of shape ({graph.num_edges},), got "
                f"{et.dtype} {tuple(et.shape)}"
            )

    def _validate_nodes(self, graph: Graph, where: str) -> None:
        ids, total = self.node_ids, self.offsets[-1]
        if ids is not None and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= total):
            raise UserError(f"{where}: node_ids must lie in [0, {total})")

    def _validate_edges(self, graph: Graph, where: str) -> None:
        et = self.edge_type
        if not et.numel():
            return
        if int(et.min()) < 0 or int(et.max()) >= self.num_relations:
            raise UserError(f"{where}: edge_type must lie in [0, {self.num_relations})")
        src, dst = graph.edges()
        ends = torch.tensor(
            [[self.type_index(r[0]), self.type_index(r[2])] for r in self.relations],
            dtype=torch.int64,
        ).to(et.device)
        for side, nodes in ((0, src), (1, dst)):
            got = self.node_type_of(self.original_ids(nodes))
            bad = got != ends[et, side]
            if bool(bad.any()):
                e = int(torch.nonzero(bad)[0, 0])
                rel = self.relations[int(et[e])]
                end = "source" if side == 0 else "destination"
                raise UserError(
                    f"{where}: edge {e} of relation {relation_name(rel)} has a {end} of type "
                    f"{self.node_types[int(got[e])]}"
                )

    def _validate_node_data(self, graph: Graph, where: str) -> None:
        feat = graph.ndata.get("feat")
        widest = max(self.feat_dims)
        if feat is None and widest:
            raise UserError(f"{where}: feat_dims {list(self.feat_dims)} but no ndata 'feat'")
        if feat is not None and (feat.dim() != 2 or feat.shape[1] != widest):
            raise UserError(
                f"{where}: ndata 'feat' must have {widest} columns (the widest type), got "
                f"{tuple(feat.shape)}"
            )
        keys = [k for k in ("label", "train_mask", "val_mask", "test_mask") if k in graph.ndata]
        if not keys:
            return
        if self.target is None:
            raise UserError(f"{where}: ndata {keys[0]!r} needs a target node type")
        off_target = self.node_type_of(self.original_ids(torch.arange(graph.num_nodes))) != (
            self.type_index(self.target)
        )
        for key in keys:
            value = graph.ndata[key][off_target]
            bad = (value >= 0) if key == "label" else value.bool()
            if value.numel() and bool(bad.reshape(bad.shape[0], -1).any(1).any()):
                raise UserError(
                    f"{where}: ndata {key!r} is set on nodes outside the target type "
                    f"{self.target!r} (labels must be -1 and masks False there)"
                )

    def fingerprint_items(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` the graph's fingerprint adds for its types (the schema goes in
        as a byte tensor, so two graphs with other names or offsets differ)."""
        schema = repr(self.meta()).encode()
        items = [("types/schema", torch.frombuffer(bytearray(schema), dtype=torch.uint8))]
        return items + [(f"types/{k}", v) for k, v in self.arrays().items()]


def _index(values: Any, what: str) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(values) if not isinstance(values, torch.Tensor) else values)
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise UserError(f"{what} must be a 1-D integer array, got {t.dtype} {tuple(t.shape)}")
    return t.to(torch.int64)


def typed_graph(
    num_nodes: Mapping[str, int],
    edges: Mapping[Relation, tuple[Any, Any]],
    features: Mapping[str, torch.Tensor] | None = None,
    target: str | None = None,
    ndata: Mapping[str, torch.Tensor] | None = None,
    name: str = "graph",
    num_classes: int | None = None,
) -> Graph:
    """A typed graph from per-type node counts and per-relation edge lists.

    Args:
        num_nodes: node type → number of nodes, in the order the types are numbered.
        edges: canonical relation ``(src type, name, dst type)`` → ``(src, dst)`` type-local
            ids of its edges (an edge ``src -> dst`` carries a message to ``dst``). Kept as
            given: duplicates stay, and a relation's reverse is a relation of its own.
        features: node type → ``(num_nodes_of_type, F_t)`` features; types left out have
            none (models learn an embedding for them).
        target: the node type the ``ndata`` arrays (``label``, masks) describe.
        ndata: the target type's node data, first dimension its node count; stored on the
            homogeneous view with label ``-1`` and masks ``False`` on every other type.
        name, num_classes: as for :class:`~gnnpar.graph.Graph`.

    The CSR orders each destination's edges by relation, then by source id.
    """
    from gnnpar.graph import Graph, stable_sort

    node_types = tuple(_check_name(t, "node type") for t in num_nodes)
    counts = [int(num_nodes[t]) for t in node_types]
    if any(c < 0 for c in counts):
        raise UserError(f"node counts must be >= 0, got {dict(num_nodes)}")
    offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(counts)]))
    n = offsets[-1]
    relations = tuple(tuple(r) for r in edges)
    src_parts, dst_parts, type_parts = [], [], []
    for i, rel in enumerate(relations):
        if len(rel) != 3 or rel[0] not in node_types or rel[2] not in node_types:
            raise UserError(f"relation {rel!r} must be (src type, name, dst type) of known types")
        s, d = (_index(a, f"relation {relation_name(rel)}'s {w}") for a, w in
                zip(edges[rel], ("sources", "destinations"), strict=True))  # fmt: skip
        if s.shape != d.shape:
            raise UserError(f"relation {relation_name(rel)}: sources and destinations differ "
                            f"in length ({s.numel()} vs {d.numel()})")  # fmt: skip
        for ids, end in ((s, rel[0]), (d, rel[2])):
            limit = counts[node_types.index(end)]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
                raise UserError(
                    f"relation {relation_name(rel)}: ids of type {end} must lie in [0, {limit})"
                )
        src_parts.append(s + offsets[node_types.index(rel[0])])
        dst_parts.append(d + offsets[node_types.index(rel[2])])
        type_parts.append(torch.full((s.numel(),), i, dtype=torch.int64))
    src = torch.cat(src_parts) if src_parts else torch.zeros(0, dtype=torch.int64)
    dst = torch.cat(dst_parts) if dst_parts else torch.zeros(0, dtype=torch.int64)
    etype = torch.cat(type_parts) if type_parts else torch.zeros(0, dtype=torch.int64)
    # CSR order (dst, relation, src): two stable sorts, least significant key first
    _, order = stable_sort(src, max(n, 1))
    _, by_type = stable_sort(etype[order], max(len(relations), 1))
    order = order[by_type]
    _, by_dst = stable_sort(dst[order], max(n, 1))
    order = order[by_dst]
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(dst, minlength=n), 0, out=indptr[1:])
    feats = dict(features or {})
    for t in feats:
        if t not in node_types:
            raise UserError(f"features for unknown node type {t!r}")
    dims = tuple(int(feats[t].shape[1]) if t in feats else 0 for t in node_types)
    data: dict[str, torch.Tensor] = {}
    if feats:
        dtype = next(iter(feats.values())).dtype
        feat = torch.zeros(n, max(dims), dtype=dtype)
        for t, x in feats.items():
            k = node_types.index(t)
            if x.dim() != 2 or x.shape[0] != counts[k]:
                raise UserError(
                    f"features of {t} must have shape ({counts[k]}, F), got {tuple(x.shape)}"
                )
            feat[offsets[k] : offsets[k + 1], : dims[k]] = x.to(dtype)
        data["feat"] = feat
    if ndata:
        if target is None:
            raise UserError("ndata needs a target node type")
        k = node_types.index(_check_target(target, node_types))
        for key, value in ndata.items():
            value = torch.as_tensor(value)
            if value.shape[0] != counts[k]:
                raise UserError(
                    f"ndata {key!r} must have {counts[k]} rows (the {target} nodes), got "
                    f"{value.shape[0]}"
                )
            fill = -1 if key == "label" else 0
            full = torch.full((n, *value.shape[1:]), fill, dtype=value.dtype)
            full[offsets[k] : offsets[k + 1]] = value
            data[key] = full
    elif target is not None:
        _check_target(target, node_types)
    graph = Graph(indptr, src[order], n, None, data, name, num_classes=num_classes)
    graph.types = GraphTypes(node_types, offsets, relations, dims, target, edge_type=etype[order])
    graph.types.validate(graph, name)
    return graph


def _check_target(target: str, node_types: tuple[str, ...]) -> str:
    if target not in node_types:
        raise UserError(f"target {target!r} is not a node type ({', '.join(node_types)})")
    return target
