"""Converters between typed graphs (:mod:`gnnpar.graph.typed`) and PyG ``HeteroData`` / DGL
heterographs. :func:`gnnpar.graph.convert.from_pyg`, ``from_dgl``, ``to_pyg`` and ``to_dgl``
dispatch here for a heterogeneous graph, or a :class:`~gnnpar.graph.Graph` with ``types``.

What goes where:

=============  ===================================  ============================
typed graph    PyG ``HeteroData``                   DGL heterograph
=============  ===================================  ============================
types, counts  ``node_types``, ``num_nodes``        ``ntypes``, ``num_nodes(t)``
relations      ``edge_types``, ``edge_index``       ``canonical_etypes``
features       ``data[t].x``                        ``g.nodes[t].data["feat"]``
target data    ``y``, masks, other keys             ``label``, masks, others
edge weights   ``edge_weight`` (1-D ``edge_attr``)  ``edata[edge_weight_key]``
classes        ``data.num_classes``                 not stored: ``num_classes=``
=============  ===================================  ============================

- **Node types and relations** are numbered in the order the source lists them: a
  ``HeteroData``'s insertion order, a DGL graph's (DGL sorts both by name). ``node_types=``
  and ``relations=`` renumber them (to get back a graph's own order after a trip through
  DGL: ``from_dgl(g, node_types=graph.types.node_types, relations=graph.types.relations)``).
- **The target** (the type whose labels and masks the graph keeps) is the one type with
  labels (``y``/``label``; with none, the one type with masks or other node data); with
  several, ``target=`` picks it. Node data other than features on any other type has no
  place in a typed graph: refused, unless ``target=`` was given (then it is left behind).
- **Edges** keep their multiplicity, but not their order: within a relation, a converted
  graph lists them by (destination, source) type-local id, duplicates in their original
  order (the CSR's own order). A round trip therefore gives back each relation's edges
  sorted that way, identical after the first trip.
- **Features** come back ``feat_dims[t]`` columns wide (the homogeneous view pads them);
  all the typed features of a source must share one dtype.
- A relabelled typed graph (a permutation: ``types.node_ids`` set) converts as the graph
  it permutes; a subgraph (not every original node present) is refused.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gnnpar.allocation import check_room
from gnnpar.errors import UserError
from gnnpar.graph.typed import Relation, relation_name, typed_graph

if TYPE_CHECKING:
    from gnnpar.graph import Graph

__all__ = [
    "from_dgl_hetero",
    "from_pyg_hetero",
    "is_dgl_heterograph",
    "to_dgl_hetero",
    "to_pyg_hetero",
]

# gnnpar node-data keys and their PyG names (as convert._PYG_NAMES)
_PYG_NAMES = MappingProxyType({"feat": "x", "label": "y"})
_MASKS = ("train_mask", "val_mask", "test_mask")
# DGL's own bookkeeping keys (dgl.NID / dgl.NTYPE, dgl.EID / dgl.ETYPE): not node data
_DGL_RESERVED = frozenset({"_ID", "_TYPE"})
# PyG attributes a node or edge store holds that are not node (edge) data
_PYG_TAKEN = frozenset({"num_nodes", "edge_index", "edge_weight"})


@dataclasses.dataclass
class TypedParts:
    """A typed graph as per-type and per-relation pieces: what both libraries hold.

    Attributes:
        num_nodes: node type → count, in type order.
        node_data: node type → gnnpar key (``feat``, ``label``, masks, others) → array.
        edges: relation → ``(src, dst)`` type-local ids, in relation order.
        weights: relation → edge weights (empty: an unweighted graph).
    """

    num_nodes: dict[str, int]
    node_data: dict[str, dict[str, torch.Tensor]]
    edges: dict[Relation, tuple[torch.Tensor, torch.Tensor]]
    weights: dict[Relation, torch.Tensor]


# ---------------------------------------------------------------------- parts -> Graph
def _ordered(given: Sequence[Any], order: Sequence[Any] | None, what: str) -> list[Any]:
    """``given`` renumbered as ``order`` (a permutation of it) says."""
    if order is None:
        return list(given)
    order = [tuple(o) if not isinstance(o, str) else o for o in order]
    if sorted(map(str, order)) != sorted(map(str, given)) or len(set(order)) != len(order):
        raise UserError(f"{what} {order} must list each of the graph's {what} {list(given)} once")
    return order


def _choose_target(
    node_data: Mapping[str, Mapping[str, torch.Tensor]], target: str | None
) -> str | None:
    if target is not None:
        if target not in node_data:
            raise UserError(f"target {target!r} is not a node type ({', '.join(node_data)})")
        return target
    labelled = [t for t, d in node_data.items() if "label" in d]
    if not labelled:
        labelled = [t for t, d in node_data.items() if set(d) - {"feat"}]
    if len(labelled) > 1:
        raise UserError(
            f"node types {', '.join(labelled)} all have labels or node data: pass target= "
            "(the node type to keep them of)"
        )
    return labelled[0] if labelled else None


def _features(parts: TypedParts) -> dict[str, torch.Tensor]:
    feats = {t: d["feat"] for t, d in parts.node_data.items() if "feat" in d}
    for t, x in feats.items():
        if x.dim() != 2:
            raise UserError(f"features of node type {t} must be 2-D, got shape {tuple(x.shape)}")
    dtypes = {t: x.dtype for t, x in feats.items()}
    if len(set(dtypes.values())) > 1:
        shown = ", ".join(f"{t} {str(d).removeprefix('torch.')}" for t, d in dtypes.items())
        raise UserError(f"node features differ in dtype ({shown}): cast them to one")
    return feats


def _target_data(parts: TypedParts, target: str | None, explicit: bool) -> dict[str, torch.Tensor]:
    """The target type's node data besides features; refuses other types' (unless the
    target was chosen explicitly: then they are left behind)."""
    for t, data in parts.node_data.items():
        extra = sorted(set(data) - {"feat"})
        if t != target and extra and not explicit:
            where = f"off its target type {target}" if target else "without a target type"
            raise UserError(
                f"node type {t} has node data {extra[0]!r}, which a typed graph cannot hold "
                f"{where}: pass target= (other types' node data is then left behind)"
            )
    if target is None:
        return {}
    return {k: v for k, v in parts.node_data[target].items() if k != "feat"}


def _weights(parts: TypedParts, relations: list[Relation]) -> torch.Tensor | None:
    if not parts.weights:
        return None
    missing = [r for r in relations if r not in parts.weights]
    if missing:
        raise UserError(
            f"relation {relation_name(missing[0])} has no edge weights but "
            f"{relation_name(next(iter(parts.weights)))} has: weight every relation or none"
        )
    for rel in relations:
        w, count = parts.weights[rel], parts.edges[rel][0].numel()
        if w.dim() != 1 or w.numel() != count:
            raise UserError(
                f"edge weights of relation {relation_name(rel)} must have shape ({count},), "
                f"got {tuple(w.shape)}"
            )
    return torch.cat([parts.weights[r].cpu() for r in relations])


def _cpu(ids: Any) -> torch.Tensor:
    """Edge ids on the CPU, where typed_graph builds the graph (it checks their dtype)."""
    return torch.as_tensor(ids).cpu()


def _with_weights(
    graph: Graph, parts: TypedParts, relations: list[Relation], weight: torch.Tensor
) -> Graph:
    """``graph`` (as :func:`typed_graph` built it from ``parts``) with the edge weights in
    its CSR order: (destination, relation, source), stable."""
    from gnnpar.graph import Graph

    types = graph.types

    def original(rel: Relation, side: int) -> torch.Tensor:  # side 0: sources, 1: destinations
        start = types.offsets[types.type_index(rel[2 * side])]
        return _cpu(parts.edges[rel][side]).long() + start

    src = torch.cat([original(r, 0) for r in relations])
    dst = torch.cat([original(r, 1) for r in relations])
    etype = torch.repeat_interleave(
        torch.arange(len(relations)), torch.tensor([parts.edges[r][0].numel() for r in relations])
    )
    order = torch.from_numpy(np.lexsort((src.numpy(), etype.numpy(), dst.numpy())))
    if not (torch.equal(graph.indices, src[order]) and torch.equal(types.edge_type, etype[order])):
        raise RuntimeError("typed_graph's CSR order is not (destination, relation, source)")
    out = Graph(
        graph.indptr, graph.indices, graph.num_nodes, weight[order], graph.ndata, graph.name
    )
    out.types = types
    return out


def from_parts(
    parts: TypedParts,
    name: str = "graph",
    num_classes: Any = None,
    target: str | None = None,
    node_types: Sequence[str] | None = None,
    relations: Sequence[Sequence[str]] | None = None,
) -> Graph:
    """The typed graph of ``parts`` (module docstring: the target, the orders)."""
    from gnnpar.graph.convert import mask_as_bool, with_classes  # convert imports this module

    types = _ordered(list(parts.num_nodes), node_types, "node types")
    rels = _ordered(list(parts.edges), relations, "relations")
    chosen = _choose_target(parts.node_data, target)
    ndata = _target_data(parts, chosen, explicit=target is not None)
    total = sum(parts.num_nodes.values())
    check_room(16 * (total + 1), f"a graph of {total:,} nodes")
    ndata = {key: mask_as_bool(key, value) for key, value in ndata.items()}
    graph = typed_graph(
        {t: parts.num_nodes[t] for t in types},
        {r: tuple(_cpu(ids) for ids in parts.edges[r]) for r in rels},
        _features(parts),
        chosen,
        ndata,
        name,
    )
    weight = _weights(parts, rels)
    if weight is not None:
        graph = _with_weights(graph, parts, rels, weight)
    return with_classes(graph, num_classes)


# ---------------------------------------------------------------------- Graph -> parts
def _original_rows(graph: Graph) -> torch.Tensor:
    """``rows[i]``: the node of ``graph`` holding original id ``i`` (a relabelled graph must
    hold every original node once)."""
    types, dev = graph.types, graph.indices.device
    total = types.offsets[-1]
    if types.node_ids is None:
        return torch.arange(total, device=dev)
    ids = types.node_ids
    rows = torch.full((total,), -1, dtype=torch.int64, device=dev)
    rows[ids] = torch.arange(ids.numel(), device=dev)
    if ids.numel() != total or bool((rows < 0).any()):
        raise UserError(
            f"{graph.name} holds {ids.numel()} nodes of a typed graph of {total} (a subgraph): "
            "only a whole typed graph, or a permutation of one, converts"
        )
    return rows


def typed_parts(graph: Graph) -> TypedParts:
    """``graph``'s pieces in original ids: each type's features ``feat_dims[t]`` wide, the
    target's other node data, each relation's edges (and weights) in (destination, source)
    order."""
    types = graph.types
    if types is None:
        raise UserError(f"{graph.name} is not a typed graph (Graph.types is None)")
    rows = _original_rows(graph)
    extra = [k for k in graph.ndata if k != "feat"]
    if extra and types.target is None:
        raise UserError(f"{graph.name}: ndata {extra[0]!r} needs a target node type to go on")
    num_nodes, node_data = {}, {}
    for t, ntype in enumerate(types.node_types):
        mine = rows[types.offsets[t] : types.offsets[t + 1]]
        num_nodes[ntype] = mine.numel()
        data = {}
        if types.feat_dims[t]:
            data["feat"] = graph.ndata["feat"][mine, : types.feat_dims[t]].contiguous()
        if ntype == types.target:
            data.update({k: graph.ndata[k][mine] for k in extra})
        node_data[ntype] = data
    edges, weights = _relation_edges(graph)
    return TypedParts(num_nodes, node_data, edges, weights)


def _relation_edges(
    graph: Graph,
) -> tuple[dict[Relation, tuple[torch.Tensor, torch.Tensor]], dict[Relation, torch.Tensor]]:
    types = graph.types
    src, dst = (types.original_ids(v) for v in graph.edges())
    s, d = types.local_ids_of(src), types.local_ids_of(dst)
    et = types.edge_type
    keys = (s.cpu().numpy(), d.cpu().numpy(), et.cpu().numpy())
    order = torch.from_numpy(np.lexsort(keys)).to(s.device)
    counts = types.relation_counts()
    s_parts, d_parts = s[order].split(counts), d[order].split(counts)
    edges = {r: (s_parts[i], d_parts[i]) for i, r in enumerate(types.relations)}
    weights = {}
    if graph.edge_weight is not None:
        w_parts = graph.edge_weight[order].split(counts)
        weights = {r: w_parts[i] for i, r in enumerate(types.relations)}
    return edges, weights


# ---------------------------------------------------------------------- PyG
def _pyg_count(store: Any, ntype: str) -> int:
    if "num_nodes" in store:
        return int(store["num_nodes"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyG warns when it cannot infer the count
        n = store.num_nodes
    if n is None:
        raise UserError(f"PyG node type {ntype} has no num_nodes (set data[{ntype!r}].num_nodes)")
    return int(n)


def _pyg_node_data(store: Any, ntype: str, n: int) -> dict[str, torch.Tensor]:
    back = {v: k for k, v in _PYG_NAMES.items()}
    data = {}
    for key in store.keys():
        value = store[key]
        if key == "num_nodes" or not isinstance(value, torch.Tensor) or value.dim() < 1:
            continue
        ours = back.get(key, key)
        if value.shape[0] != n:
            if ours in ("feat", "label", *_MASKS):
                raise UserError(
                    f"PyG node type {ntype}: {key} has {value.shape[0]} rows for {n} nodes"
                )
            continue  # not node-level (as from_pyg skips it on a Data)
        data[ours] = value
    return data


def _pyg_relation(data: Any, rel: Relation, types: list[str]) -> tuple[tuple, torch.Tensor | None]:
    for end in (rel[0], rel[2]):
        if end not in types:
            raise UserError(
                f"PyG relation {relation_name(rel)} names node type {end!r}, which the "
                "HeteroData does not list"
            )
    store = data[rel]
    index = store["edge_index"] if "edge_index" in store else None
    if not isinstance(index, torch.Tensor):
        raise UserError(f"PyG relation {relation_name(rel)} has no edge_index")
    if index.dim() != 2 or index.shape[0] != 2:
        raise UserError(
            f"PyG relation {relation_name(rel)}: edge_index must have shape (2, E), got "
            f"{tuple(index.shape)}"
        )
    weight = store["edge_weight"] if "edge_weight" in store else None
    attr = store["edge_attr"] if "edge_attr" in store else None
    if weight is None and isinstance(attr, torch.Tensor) and attr.dim() in (1, 2):
        if attr.dim() == 1 or attr.shape[1] == 1:
            weight = attr.reshape(-1)
    return (index[0], index[1]), weight


def pyg_parts(data: Any) -> TypedParts:
    """The pieces of a PyG ``HeteroData``."""
    types = list(data.node_types)
    num_nodes = {t: _pyg_count(data[t], t) for t in types}
    node_data = {t: _pyg_node_data(data[t], t, num_nodes[t]) for t in types}
    edges, weights = {}, {}
    for rel in data.edge_types:
        rel = tuple(rel)
        edges[rel], weight = _pyg_relation(data, rel, types)
        if weight is not None:
            weights[rel] = weight
    return TypedParts(num_nodes, node_data, edges, weights)


def from_pyg_hetero(
    data: Any,
    name: str = "graph",
    num_classes: int | None = None,
    target: str | None = None,
    node_types: Sequence[str] | None = None,
    relations: Sequence[Sequence[str]] | None = None,
) -> Graph:
    """The typed graph of a PyG ``HeteroData`` (module docstring): ``x`` → features,
    the target's ``y``/masks/other node data, ``edge_weight`` (or a 1-D ``edge_attr``) →
    weights, ``num_classes`` (the argument, else an int ``data.num_classes``)."""
    if num_classes is None:
        num_classes = getattr(data, "num_classes", None)  # a global attribute, if set
    return from_parts(pyg_parts(data), name, num_classes, target, node_types, relations)


def to_pyg_hetero(graph: Graph) -> Any:
    """A PyG ``HeteroData`` of a typed graph: per type ``num_nodes`` and ``x`` (its real
    width; none for a featureless type), the target's ``y``, masks and other node data,
    per relation ``edge_index`` in type-local ids ((destination, source) order) and
    ``edge_weight``; ``num_classes`` with labels."""
    from torch_geometric.data import HeteroData

    parts = typed_parts(graph)
    data = HeteroData()
    for ntype, n in parts.num_nodes.items():
        data[ntype].num_nodes = n
        for key, value in parts.node_data[ntype].items():
            pyg_key = _PYG_NAMES.get(key, key)
            if pyg_key in _PYG_TAKEN:
                raise UserError(f"ndata[{key!r}] would overwrite PyG attribute {pyg_key!r}")
            data[ntype][pyg_key] = value
    for rel, (src, dst) in parts.edges.items():
        data[rel].edge_index = torch.stack([src, dst])
        if rel in parts.weights:
            data[rel].edge_weight = parts.weights[rel]
    if graph.label is not None:
        data.num_classes = graph.num_classes
    return data


# ---------------------------------------------------------------------- DGL
def is_dgl_heterograph(g: Any) -> bool:
    """Whether a DGL graph has several node types or relations (one of each: homogeneous)."""
    return len(g.ntypes) != 1 or len(g.canonical_etypes) != 1


def dgl_parts(g: Any, edge_weight_key: str = "w") -> TypedParts:
    """The pieces of a DGL heterograph (DGL's ``_ID``/``_TYPE`` bookkeeping left out)."""
    num_nodes = {t: int(g.num_nodes(t)) for t in g.ntypes}
    node_data = {
        t: {k: v for k, v in g.nodes[t].data.items() if k not in _DGL_RESERVED} for t in g.ntypes
    }
    edges, weights = {}, {}
    for rel in g.canonical_etypes:
        src, dst = g.edges(etype=rel, order="eid")
        edges[tuple(rel)] = (src.to(torch.int64), dst.to(torch.int64))
        if edge_weight_key in g.edges[rel].data:
            weights[tuple(rel)] = g.edges[rel].data[edge_weight_key]
    return TypedParts(num_nodes, node_data, edges, weights)


def from_dgl_hetero(
    g: Any,
    edge_weight_key: str = "w",
    name: str = "graph",
    num_classes: int | None = None,
    target: str | None = None,
    node_types: Sequence[str] | None = None,
    relations: Sequence[Sequence[str]] | None = None,
) -> Graph:
    """The typed graph of a DGL heterograph (module docstring): ``feat`` → features, the
    target's ``label``/masks (a uint8 0/1 mask, as ``dgl.save_graphs`` stores one, as
    bool)/other node data, ``edata[edge_weight_key]`` → weights. DGL holds no class count:
    pass ``num_classes``."""
    parts = dgl_parts(g, edge_weight_key)
    return from_parts(parts, name, num_classes, target, node_types, relations)


def to_dgl_hetero(graph: Graph, edge_weight_key: str = "w") -> Any:
    """A DGL heterograph of a typed graph: per type its nodes, ``ndata["feat"]`` (its real
    width; none for a featureless type), the target's label, masks and other node data; per
    relation its edges in type-local ids ((destination, source) order) and
    ``edata[edge_weight_key]``. DGL lists types and relations sorted by name, and holds no
    class count (module docstring)."""
    from gnnpar.graph.convert import import_dgl

    dgl = import_dgl("to_dgl")
    parts = typed_parts(graph)
    if not parts.edges:
        raise UserError(f"{graph.name} has no relations: a DGL heterograph needs at least one")
    g = dgl.heterograph(dict(parts.edges), num_nodes_dict=parts.num_nodes, idtype=torch.int64)
    for ntype, data in parts.node_data.items():
        for key, value in data.items():
            g.nodes[ntype].data[key] = value
    for rel, weight in parts.weights.items():
        g.edges[rel].data[edge_weight_key] = weight
    return g
