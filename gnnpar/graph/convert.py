"""Converters between :class:`~gnnpar.graph.Graph` and other graph libraries and files.

The API is on :class:`Graph` (``Graph.from_pyg``, ``graph.to_dgl()``, ...); this module holds
the code. Every converter keeps the edges (``src -> dst``), the edge weights, every node-data
array (``feat``, ``label``, the split masks, any other) and the number of classes where the
other side has a place for it:

============  =============================  ==========================================
library       node data                      number of classes
============  =============================  ==========================================
PyG ``Data``  ``x``, ``y``, other keys as is  ``data.num_classes`` (an int attribute)
DGL           ``g.ndata`` (same keys)         not stored (pass ``num_classes=``)
networkx      node attributes                 ``g.graph["num_classes"]``
scipy         none (structure only)           none
edge list     none (structure only)           none
============  =============================  ==========================================

**Heterogeneous graphs** (a PyG ``HeteroData``, a DGL graph with several node types or
relations) convert to and from typed graphs (:mod:`gnnpar.graph.typed`): ``from_pyg`` and
``from_dgl`` return one, and ``to_pyg`` and ``to_dgl`` of a graph with
:attr:`~gnnpar.graph.Graph.types` return a ``HeteroData`` / DGL heterograph
(:mod:`gnnpar.graph.convert_typed`: the target type, the type order, the canonical edge
order). Link-prediction splits of them are refused with one UserError
(:data:`HETEROGENEOUS`).

**Link-prediction splits** (:mod:`gnnpar.graph.edge_split`: a message-passing graph with its
:attr:`~gnnpar.graph.Graph.edge_split`): :func:`from_pyg_link_split` takes the three outputs
of PyG's ``RandomLinkSplit``; :func:`from_dgl_link` and :func:`to_dgl_link` hold a split as
boolean edge masks of one DGL graph (``edata["train_mask"]`` etc.).

**The edge-list text format** (:func:`write_edge_list`, :func:`read_edge_list`): one edge
per line, ``src dst`` or ``src dst weight``, separated by blanks or tabs, node ids are
integers in ``[0, num_nodes)``; ``#`` starts a comment; a comment line ``# nodes: N`` gives
the number of nodes (otherwise the largest id + 1: trailing isolated nodes need it).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gnnpar.errors import MissingPackageError, UserError
from gnnpar.graph import convert_typed, edge_split
from gnnpar.graph.convert_typed import to_dgl_hetero, to_pyg_hetero
from gnnpar.graph.edge_split import EdgeSplit, edge_keys

if TYPE_CHECKING:
    from gnnpar.graph import Graph

__all__ = [
    "HETEROGENEOUS",
    "as_graph",
    "is_heterogeneous",
    "from_dgl",
    "from_edge_list",
    "from_dgl_link",
    "from_networkx",
    "from_pyg",
    "from_pyg_link_split",
    "from_scipy",
    "read_edge_list",
    "to_dgl",
    "to_dgl_hetero",
    "to_dgl_link",
    "to_edge_list",
    "to_networkx",
    "to_pyg",
    "to_pyg_hetero",
    "to_scipy",
]

#: The message of a refused heterogeneous link split (after what it is).
HETEROGENEOUS = (
    "link splits of heterogeneous graphs are not supported yet (give one node and one edge type)"
)
# Well-known node-data keys and their PyG attribute names.
_PYG_NAMES = MappingProxyType({"feat": "x", "label": "y"})
_NODES_LINE = re.compile(r"^\s*#\s*nodes:\s*(\d+)\s*$")


def _graph_class() -> type[Graph]:
    from gnnpar.graph import Graph

    return Graph


def _weights_or_ones(graph: Graph) -> torch.Tensor:
    from gnnpar.graph import weights_or_ones  # the package imports this module

    return weights_or_ones(graph)


def with_classes(graph: Graph, num_classes: Any) -> Graph:
    """``graph`` with ``num_classes`` stored (when it is an int and there are labels)."""
    if isinstance(num_classes, torch.Tensor) and num_classes.numel() == 1:
        num_classes = int(num_classes)
    if isinstance(num_classes, (int, np.integer)) and not isinstance(num_classes, bool):
        if graph.label is not None:
            graph.num_classes = int(num_classes)
    return graph


# ------------------------------------------------------------------ scipy
def to_scipy(graph: Graph) -> Any:
    """``scipy.sparse.csr_matrix`` with ``A[i, j]`` = weight of edge ``j -> i``.

    Duplicate edges stay as separate stored entries (scipy sums them in arithmetic).
    """
    import scipy.sparse as sp

    w = _weights_or_ones(graph).numpy()
    return sp.csr_matrix(
        (w, graph.indices.numpy(), graph.indptr.numpy()), shape=(graph.num_nodes, graph.num_nodes)
    )


def from_scipy(
    mat: Any,
    ndata: Mapping[str, torch.Tensor] | None = None,
    name: str = "graph",
    weighted: bool | None = None,
    num_classes: int | None = None,
) -> Graph:
    """From a square scipy sparse matrix (``A[i, j]`` = weight of edge ``j -> i``).

    ``weighted=None`` keeps the values as ``edge_weight`` unless they are all 1.
    """
    import scipy.sparse as sp

    if not sp.issparse(mat):
        raise TypeError(f"expected a scipy sparse matrix, got {type(mat).__name__}")
    if mat.shape[0] != mat.shape[1]:
        raise UserError(f"adjacency must be square, got shape {mat.shape}")
    csr = sp.csr_matrix(mat)
    data = np.asarray(csr.data)
    if weighted is None:
        weighted = not bool(np.all(data == 1))
    weight = None
    if weighted:
        floating = np.issubdtype(data.dtype, np.floating)
        weight = torch.from_numpy(data.copy() if floating else data.astype(np.float32))
    return _graph_class()(
        torch.from_numpy(csr.indptr.astype(np.int64)),
        torch.from_numpy(csr.indices.astype(np.int64)),
        csr.shape[0],
        weight,
        ndata,
        name,
        num_classes=num_classes,
    )


# ------------------------------------------------------------------ PyG
def to_pyg(graph: Graph) -> Any:
    """A ``torch_geometric.data.Data``: ``edge_index[0]`` = sources, ``[1]`` = destinations.

    ``feat`` becomes ``x``, ``label`` becomes ``y``; other node data keep their names;
    weights go to ``edge_weight``; the number of classes (with labels) to ``num_classes``.
    A typed graph (``graph.types`` set) becomes a ``HeteroData`` (:func:`to_pyg_hetero`).
    """
    from torch_geometric.data import Data

    if graph.types is not None:
        return to_pyg_hetero(graph)

    src, dst = graph.edges()
    data = Data(edge_index=torch.stack([src, dst]), num_nodes=graph.num_nodes)
    taken = {"edge_index", "edge_weight", "num_nodes", "num_classes"}
    for key, value in graph.ndata.items():
        pyg_key = _PYG_NAMES.get(key, key)
        if pyg_key in taken:
            raise ValueError(f"ndata[{key!r}] would overwrite PyG attribute {pyg_key!r}")
        taken.add(pyg_key)
        data[pyg_key] = value
    if graph.edge_weight is not None:
        data.edge_weight = graph.edge_weight
    if graph.label is not None:
        data.num_classes = graph.num_classes
    return data


def is_heterogeneous(data: Any) -> bool:
    """Whether ``data`` is a PyG ``HeteroData`` (False without PyG)."""
    try:
        from torch_geometric.data import HeteroData
    except ImportError:
        return False
    return isinstance(data, HeteroData)


def _homogeneous_only(what: str, **typed: Any) -> None:
    """Refuse the typed-graph arguments (``target`` ...) given for a homogeneous graph."""
    given = [k for k, v in typed.items() if v is not None]
    if given:
        raise UserError(f"{given[0]}= applies to heterogeneous graphs only, not to a {what}")


def from_pyg(
    data: Any,
    name: str = "graph",
    num_classes: int | None = None,
    target: str | None = None,
    node_types: Sequence[str] | None = None,
    relations: Sequence[Sequence[str]] | None = None,
) -> Graph:
    """From a ``torch_geometric.data.Data``, or a ``HeteroData`` as a typed graph
    (:func:`gnnpar.graph.convert_typed.from_pyg_hetero`; ``target``, ``node_types`` and
    ``relations`` apply to it only).

    ``x``/``y`` become ``feat``/``label``; other node-level tensors keep their names;
    ``edge_weight`` (or a 1-D ``edge_attr``) becomes the edge weight; ``num_classes`` (the
    argument, else an int ``data.num_classes``) is stored with the labels.
    """
    if is_heterogeneous(data):
        return convert_typed.from_pyg_hetero(data, name, num_classes, target, node_types, relations)
    _homogeneous_only("PyG Data", target=target, node_types=node_types, relations=relations)
    edge_index = getattr(data, "edge_index", None)
    if edge_index is None:
        raise UserError("PyG data has no edge_index")
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise UserError(f"edge_index must have shape (2, E), got {tuple(edge_index.shape)}")
    num_nodes = int(data.num_nodes)
    weight = getattr(data, "edge_weight", None)
    if weight is None:
        attr = getattr(data, "edge_attr", None)
        if attr is not None and (attr.dim() == 1 or (attr.dim() == 2 and attr.shape[1] == 1)):
            weight = attr.reshape(-1)
    back = {v: k for k, v in _PYG_NAMES.items()}
    ndata = {}
    for key in data.keys():
        value = data[key]
        if key in ("edge_index", "edge_weight", "edge_attr", "num_nodes", "num_classes"):
            continue
        if (
            isinstance(value, torch.Tensor)
            and value.dim() >= 1
            and value.shape[0] == num_nodes
            and data.is_node_attr(key)
        ):
            ndata[back.get(key, key)] = value
    graph = _graph_class().from_edges(edge_index[0], edge_index[1], num_nodes, weight, ndata, name)
    if num_classes is None and "num_classes" in data.keys():
        num_classes = data["num_classes"]
    return with_classes(graph, num_classes)


# ------------------------------------------------------------------ DGL
def import_dgl(caller: str) -> Any:
    """The ``dgl`` module, or an ImportError saying how to install it."""
    try:
        import dgl
    except ImportError as err:  # DGL is optional and heavy
        raise MissingPackageError(
            f"Graph.{caller} needs DGL, which is not installed: pip install 'gnnpar[dgl]' "
            "(dgl==1.1.3)"
        ) from err
    return dgl


def to_dgl(graph: Graph, edge_weight_key: str = "w") -> Any:
    """A ``dgl.DGLGraph`` with the same edges (CSR order), ``ndata`` and weights in
    ``edata[edge_weight_key]``; of a typed graph (``graph.types`` set), a heterograph
    (:func:`to_dgl_hetero`). DGL graphs hold no class count: pass it back to
    :func:`from_dgl`. Needs the optional ``dgl`` package."""
    dgl = import_dgl("to_dgl")
    if graph.types is not None:
        return to_dgl_hetero(graph, edge_weight_key)
    src, dst = graph.edges()
    g = dgl.graph((src, dst), num_nodes=graph.num_nodes)
    for key, value in graph.ndata.items():
        g.ndata[key] = value
    if graph.edge_weight is not None:
        g.edata[edge_weight_key] = graph.edge_weight
    return g


def from_dgl(
    g: Any,
    edge_weight_key: str = "w",
    name: str = "graph",
    num_classes: int | None = None,
    target: str | None = None,
    node_types: Sequence[str] | None = None,
    relations: Sequence[Sequence[str]] | None = None,
) -> Graph:
    """From a ``dgl.DGLGraph``; one with several node types or relations as a typed graph
    (:func:`gnnpar.graph.convert_typed.from_dgl_hetero`; ``target``, ``node_types`` and
    ``relations`` apply to it only). ``edata[edge_weight_key]`` becomes the weight,
    ``ndata`` the node data (a uint8 0/1 ``*_mask``, as ``dgl.save_graphs`` stores masks,
    as bool)."""
    import_dgl("from_dgl")
    if convert_typed.is_dgl_heterograph(g):
        return convert_typed.from_dgl_hetero(
            g, edge_weight_key, name, num_classes, target, node_types, relations
        )
    _homogeneous_only(
        "homogeneous DGL graph", target=target, node_types=node_types, relations=relations
    )
    src, dst = g.edges()
    weight = g.edata[edge_weight_key] if edge_weight_key in g.edata else None
    ndata = {key: mask_as_bool(key, g.ndata[key]) for key in g.ndata}
    graph = _graph_class().from_edges(src, dst, g.num_nodes(), weight, ndata, name)
    return with_classes(graph, num_classes)


def mask_as_bool(key: str, value: torch.Tensor) -> torch.Tensor:
    """A ``*_mask`` that ``dgl.save_graphs`` stored as uint8 (it cannot store bool) as bool."""
    if key.endswith("_mask") and value.dtype == torch.uint8 and bool((value <= 1).all()):
        return value.to(torch.bool)
    return value


# ------------------------------------------------------------------ link prediction
#: PyG's attributes of a link split's labelled pairs: they are not node data.
_PYG_LINK_KEYS = ("edge_label", "edge_label_index", "pos_edge_label", "pos_edge_label_index",
                  "neg_edge_label", "neg_edge_label_index")  # fmt: skip


def _labelled_pairs(data: Any, which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positives (2, P), negatives (2, M))`` of one ``RandomLinkSplit`` output: its
    ``edge_label_index`` split by ``edge_label`` (1 positive, 0 negative), or its
    ``pos_edge_label_index`` / ``neg_edge_label_index`` (``split_labels=True``)."""
    if is_heterogeneous(data):
        raise UserError(f"PyG HeteroData ({which}): {HETEROGENEOUS}")
    pos = getattr(data, "pos_edge_label_index", None)
    if pos is not None:
        neg = getattr(data, "neg_edge_label_index", None)
        neg = torch.zeros(2, 0, dtype=torch.int64) if neg is None else neg
    else:
        index = getattr(data, "edge_label_index", None)
        label = getattr(data, "edge_label", None)
        if index is None or label is None:
            raise UserError(
                f"PyG {which} data has no edge_label_index and edge_label (nor "
                "pos_edge_label_index): pass the outputs of RandomLinkSplit"
            )
        if label.dim() != 1 or label.numel() != index.shape[-1]:
            raise UserError(
                f"PyG {which} data: edge_label has shape {tuple(label.shape)} for "
                f"{index.shape[-1]} pairs in edge_label_index"
            )
        positive, negative = label == 1, label == 0
        if not bool((positive | negative).all()):
            raise UserError(
                f"PyG {which} data: edge_label holds values other than 0 and 1 (a link "
                "split's labels are 1 for an edge, 0 for a negative pair)"
            )
        pos, neg = index[:, positive], index[:, negative]
    for what, t in (("positive", pos), ("negative", neg)):
        if t.dim() != 2 or t.shape[0] != 2:
            raise UserError(f"PyG {which} data: {what} pairs must be (2, E), got {tuple(t.shape)}")
    return pos.to(torch.int64).contiguous(), neg.to(torch.int64).contiguous()


def _whole_graph(message: Graph, extra: list[torch.Tensor], symmetric: bool) -> Graph:
    """The graph a split was cut from: the message-passing edges and the ``extra`` positive
    pairs (both directions when the message graph is symmetric), duplicates merged."""
    src, dst = message.edges()
    pairs = [torch.stack([src, dst]), *extra]
    if symmetric:
        pairs += [p.flip(0) for p in extra]
    both = torch.cat(pairs, dim=1)
    whole = _graph_class().from_edges(
        both[0], both[1], message.num_nodes, ndata=message.ndata, name=message.name,
        coalesce=True,
    )  # fmt: skip
    return with_classes(whole, message.num_classes if message.label is not None else None)


def from_pyg_link_split(
    train_data: Any, val_data: Any, test_data: Any, name: str = "graph"
) -> Graph:
    """The message-passing graph and :class:`~gnnpar.graph.edge_split.EdgeSplit` of the three
    outputs of PyG's ``RandomLinkSplit``.

    The graph is ``train_data`` as :func:`from_pyg` converts it (``edge_index``: the edges
    that carry messages; node data, weights). The split's positives are each part's
    ``edge_label_index`` pairs whose ``edge_label`` is 1, its negatives (validation and
    test: protocol ``"pairs"``) those whose label is 0 (with ``split_labels=True``: the
    ``pos_``/``neg_edge_label_index`` pairs); training negatives are dropped (a trainer draws
    its own). Metric ``rocauc``; ``source`` records the message-passing graph with every
    validation and test positive added (both directions when it is symmetric).
    """
    for which, data in (("train", train_data), ("val", val_data), ("test", test_data)):
        if is_heterogeneous(data):
            raise UserError(f"PyG HeteroData ({which}): {HETEROGENEOUS}")
    sizes = {int(d.num_nodes) for d in (train_data, val_data, test_data)}
    if len(sizes) != 1:
        raise UserError(
            f"the three PyG link split parts have {sorted(sizes)} nodes: pass the outputs "
            "of one RandomLinkSplit"
        )
    train, _ = _labelled_pairs(train_data, "train")
    val, val_neg = _labelled_pairs(val_data, "val")
    test, test_neg = _labelled_pairs(test_data, "test")
    plain = copy.copy(train_data)  # shallow: the tensors are shared, not copied
    for key in _PYG_LINK_KEYS:
        if key in plain.keys():
            del plain[key]
    graph = from_pyg(plain, name=name)
    symmetric = graph.is_symmetric()
    graph.edge_split = EdgeSplit(
        train, val, test, val_neg, test_neg, protocol="pairs", metric="rocauc",
        source=_whole_graph(graph, [val, test], symmetric).record(),
        how={"method": "pyg", "transform": "RandomLinkSplit", "symmetric": symmetric},
    )  # fmt: skip
    graph.edge_split.validate(graph.num_nodes, "PyG link split")
    return graph


def _edge_mask(g: Any, key: str) -> torch.Tensor:
    """``g.edata[key]`` as a boolean vector (a 0/1 integer one, as ``dgl.save_graphs`` stores
    masks, too); UserError naming the key otherwise."""
    if key not in g.edata:
        raise UserError(f"DGL graph has no edge mask edata[{key!r}] (it has {list(g.edata)})")
    mask = g.edata[key]
    if mask.dim() != 1:
        raise UserError(f"DGL edata[{key!r}] must be a vector, got shape {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        if mask.is_floating_point() or not bool(((mask == 0) | (mask == 1)).all()):
            raise UserError(f"DGL edata[{key!r}] must be a boolean (or 0/1) edge mask")
        mask = mask.to(torch.bool)
    return mask


def _masked_pairs(
    src: torch.Tensor, dst: torch.Tensor, mask: torch.Tensor, num_nodes: int, undirected: bool
) -> torch.Tensor:
    """The masked edges as ``(2, E)`` pairs in edge order; ``undirected``: each unordered pair
    once, as its first masked edge lists it."""
    s, d = src[mask], dst[mask]
    if undirected and s.numel():
        keys = edge_keys(torch.minimum(s, d), torch.maximum(s, d), num_nodes)
        _, first = np.unique(keys.numpy(), return_index=True)
        keep = torch.from_numpy(np.sort(first))
        s, d = s[keep], d[keep]
    return torch.stack([s, d]).to(torch.int64)


def from_dgl_link(
    g: Any,
    train_key: str = "train_mask",
    val_key: str = "val_mask",
    test_key: str = "test_mask",
    seed: int = 0,
    edge_weight_key: str = "w",
    name: str = "graph",
    num_classes: int | None = None,
) -> Graph:
    """The message-passing graph and :class:`~gnnpar.graph.edge_split.EdgeSplit` of a
    homogeneous DGL graph whose boolean edge masks ``edata[train_key]``, ``edata[val_key]``
    and ``edata[test_key]`` split its edges (an edge in two masks is refused; an edge in
    none is neither a message edge nor a positive, but no negative either).

    The graph holds the training edges (their ``edata[edge_weight_key]`` as weights) and
    every node array. The positives are each mask's edges, in edge order; when the
    training edges are symmetric (an undirected graph) each unordered pair once, as its first
    masked edge lists it. Validation and test negatives (protocol ``"pairs"``, one per
    positive) are drawn from the non-edges of the whole graph, deterministically by
    ``seed``. Metric ``rocauc``; ``source`` records the whole DGL graph (every edge).
    """
    import_dgl("from_dgl_link")
    if len(g.ntypes) != 1 or len(g.etypes) != 1:
        raise UserError(
            f"DGL graph with node types {g.ntypes} and edge types {g.etypes}: {HETEROGENEOUS}"
        )
    src, dst = (t.to(torch.int64) for t in g.edges())
    n = int(g.num_nodes())
    keys = (train_key, val_key, test_key)
    masks = [_edge_mask(g, key) for key in keys]
    for i in range(3):
        for j in range(i + 1, 3):
            both = torch.nonzero(masks[i] & masks[j]).flatten()
            if both.numel():
                e = int(both[0])
                raise UserError(
                    f"DGL edge {e} ({int(src[e])} -> {int(dst[e])}) is in both "
                    f"edata[{keys[i]!r}] and edata[{keys[j]!r}]"
                )
    weight = g.edata[edge_weight_key] if edge_weight_key in g.edata else None
    ndata = {key: mask_as_bool(key, g.ndata[key]) for key in g.ndata}
    train_mask = masks[0]
    graph_cls = _graph_class()
    graph = graph_cls.from_edges(
        src[train_mask], dst[train_mask], n, None if weight is None else weight[train_mask],
        ndata, name,
    )  # fmt: skip
    graph = with_classes(graph, num_classes)
    whole = with_classes(graph_cls.from_edges(src, dst, n, weight, ndata, name), num_classes)
    symmetric = graph.is_symmetric()
    train, val, test = (_masked_pairs(src, dst, m, n, symmetric) for m in masks)
    true_keys = torch.unique(torch.cat([edge_keys(src, dst, n), edge_keys(dst, src, n)]))
    gen = torch.Generator().manual_seed(int(seed))
    # the sampler split_edges draws its negatives with (same package, not yet public)
    negatives = edge_split.negative_pairs(n, true_keys, val.shape[1] + test.shape[1], gen)
    graph.edge_split = EdgeSplit(
        train, val, test, negatives[:, : val.shape[1]], negatives[:, val.shape[1] :],
        protocol="pairs", metric="rocauc", source=whole.record(),
        how={"method": "dgl", "masks": list(keys), "seed": int(seed), "symmetric": symmetric,
             "negatives": "pairs", "num_negatives": 1},
    )  # fmt: skip
    graph.edge_split.validate(n, "DGL link split")
    return graph


def to_dgl_link(
    graph: Graph,
    train_key: str = "train_mask",
    val_key: str = "val_mask",
    test_key: str = "test_mask",
    edge_weight_key: str = "w",
) -> Any:
    """A ``dgl.DGLGraph`` holding ``graph`` (a message-passing graph) and its
    :attr:`~gnnpar.graph.Graph.edge_split` as boolean edge masks, the inverse of
    :func:`from_dgl_link`.

    Its edges: the training positives first (each must be an edge of ``graph``), then the
    rest of ``graph``'s edges (``edata[train_key]``); the validation positives
    (``edata[val_key]``), then the test positives (``edata[test_key]``), each followed by
    its reverse when ``graph`` is symmetric. Node data go to ``ndata``, weights to
    ``edata[edge_weight_key]`` (0 on validation and test edges). DGL masks hold no
    negatives: :func:`from_dgl_link` draws new ones. A split whose training positives are
    exactly one direction of each message edge (:func:`~gnnpar.graph.edge_split.split_edges`)
    comes back with the same positives, in the same order; a training positive listed twice
    (ogbl-collab's repeated pairs) is an edge listed twice here, and on an undirected graph
    comes back once.
    """
    dgl = import_dgl("to_dgl_link")
    split = graph.edge_split
    if split is None:
        raise UserError(
            f"{graph.name} has no edge split (Graph.edge_split): cut one with "
            "gnnpar.graph.edge_split.split_edges, or use to_dgl"
        )
    n = graph.num_nodes
    msrc, mdst = graph.edges()
    mkeys = edge_keys(msrc, mdst, n)
    order = torch.argsort(mkeys, stable=True)
    sorted_keys = mkeys[order]
    tkeys = edge_keys(split.train[0], split.train[1], n)
    pos = torch.searchsorted(sorted_keys, tkeys).clamp(max=max(mkeys.numel() - 1, 0))
    found = (
        sorted_keys[pos] == tkeys if mkeys.numel() else torch.zeros_like(tkeys, dtype=torch.bool)
    )
    if not bool(found.all()):
        i = int(torch.nonzero(~found)[0, 0])
        raise UserError(
            f"{graph.name}: training positive {int(split.train[0, i])} -> "
            f"{int(split.train[1, i])} is not an edge of the message-passing graph (DGL "
            "masks hold training positives as message edges only)"
        )
    first = order[pos]  # one message edge of each training positive
    rest = torch.ones(mkeys.numel(), dtype=torch.bool)
    rest[first] = False
    symmetric = graph.is_symmetric()
    held = [split.val, split.test]
    if symmetric:
        held = [torch.cat([p, p.flip(0)], dim=1) for p in held]
    index = torch.cat([first, torch.nonzero(rest).flatten()])
    src = torch.cat([msrc[index], held[0][0], held[1][0]])
    dst = torch.cat([mdst[index], held[0][1], held[1][1]])
    counts = (index.numel(), held[0].shape[1], held[1].shape[1])
    g = dgl.graph((src, dst), num_nodes=n)
    part = torch.repeat_interleave(torch.arange(3), torch.tensor(counts))
    for i, key in enumerate((train_key, val_key, test_key)):
        g.edata[key] = part == i
    for key, value in graph.ndata.items():
        g.ndata[key] = value
    if graph.edge_weight is not None:
        zeros = torch.zeros(counts[1] + counts[2], dtype=graph.edge_weight.dtype)
        g.edata[edge_weight_key] = torch.cat([graph.edge_weight[index], zeros])
    return g


# ------------------------------------------------------------------ networkx
def to_networkx(graph: Graph, node_attrs: bool = True, weight_key: str = "weight") -> Any:
    """A ``networkx.DiGraph`` on nodes ``0..N-1`` (a ``MultiDiGraph`` if there are
    duplicate edges). Weights go to ``weight_key``; node data become node attributes; the
    name and number of classes go to ``g.graph``."""
    import networkx as nx

    multi = graph.coalesce().num_edges != graph.num_edges
    g = nx.MultiDiGraph() if multi else nx.DiGraph()
    g.graph["name"] = graph.name
    if graph.label is not None:
        g.graph["num_classes"] = graph.num_classes
    g.add_nodes_from(range(graph.num_nodes))
    if node_attrs:
        for key, value in graph.ndata.items():
            nx.set_node_attributes(g, dict(enumerate(value.tolist())), key)
    src, dst = graph.edges()
    if graph.edge_weight is None:
        g.add_edges_from(zip(src.tolist(), dst.tolist(), strict=True))
    else:
        g.add_weighted_edges_from(
            zip(src.tolist(), dst.tolist(), graph.edge_weight.tolist(), strict=True),
            weight=weight_key,
        )
    return g


def from_networkx(
    g: Any,
    node_attrs: Iterable[str] | None = None,
    weight_key: str | None = "weight",
    ndata: Mapping[str, torch.Tensor] | None = None,
    name: str | None = None,
) -> Graph:
    """From a networkx graph. Nodes are numbered in ``g.nodes`` order; an undirected
    graph gets both directions of every edge. ``node_attrs`` lists node attributes to
    gather into ``ndata``; ``weight_key`` is used when every edge carries it;
    ``g.graph["num_classes"]`` is kept."""
    nodes = list(g.nodes)
    index = None if nodes == list(range(len(nodes))) else {v: i for i, v in enumerate(nodes)}
    edge_list = list(g.edges(data=True))
    src = [u for u, _, _ in edge_list]
    dst = [v for _, v, _ in edge_list]
    if index is not None:
        src = [index[u] for u in src]
        dst = [index[v] for v in dst]
    weight = None
    if weight_key is not None and edge_list and all(weight_key in d for *_, d in edge_list):
        weight = torch.tensor([float(d[weight_key]) for *_, d in edge_list])
    src_t = torch.tensor(src, dtype=torch.int64)
    dst_t = torch.tensor(dst, dtype=torch.int64)
    if not g.is_directed():
        loop = src_t == dst_t
        src_t, dst_t = torch.cat([src_t, dst_t[~loop]]), torch.cat([dst_t, src_t[~loop]])
        if weight is not None:
            weight = torch.cat([weight, weight[~loop]])
    data = dict(ndata or {})
    for attr in node_attrs or ():
        values = []
        for v in nodes:
            if attr not in g.nodes[v]:
                raise UserError(f"node {v!r} has no attribute {attr!r}")
            values.append(g.nodes[v][attr])
        data[attr] = _stack_values(values, attr)
    if name is None:
        name = str(g.graph.get("name") or "graph")
    graph = _graph_class().from_edges(src_t, dst_t, len(nodes), weight, data, name)
    return with_classes(graph, g.graph.get("num_classes"))


def _stack_values(values: list[Any], attr: str) -> torch.Tensor:
    """One tensor from per-node values (python numbers, lists or tensors)."""
    if values and all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack(values)
    try:
        return torch.tensor(values)
    except (TypeError, ValueError, RuntimeError) as err:
        raise UserError(f"node attribute {attr!r} cannot be turned into a tensor: {err}") from err


# ------------------------------------------------------------------ edge lists
def to_edge_list(graph: Graph, path: str | Path | None = None) -> np.ndarray:
    """Edges as an ``(E, 2)`` int64 array of ``(src, dst)`` rows, in CSR order.

    With ``path``, also write them in the edge-list text format (module docstring): a
    ``# NAME: N nodes, E edges`` line, ``# nodes: N``, then one ``src dst`` (``src dst
    weight`` if weighted) line per edge.
    """
    src, dst = graph.edges()
    edges = torch.stack([src, dst], dim=1).numpy()
    if path is not None:
        header = (
            f"{graph.name}: {graph.num_nodes} nodes, {graph.num_edges} edges\n"
            f"nodes: {graph.num_nodes}\nsrc dst"
        )
        if graph.edge_weight is None:
            np.savetxt(path, edges, fmt="%d", header=header)
        else:
            table = np.column_stack([edges.astype(np.float64), graph.edge_weight.numpy()])
            np.savetxt(path, table, fmt=["%d", "%d", "%.17g"], header=header + " weight")
    return edges


def read_edge_list(path: str | Path) -> tuple[np.ndarray, np.ndarray | None, int | None]:
    """``(edges (E, 2) int64, weights or None, num_nodes from '# nodes: N' or None)`` of an
    edge-list text file; ValueError naming the file for anything else."""
    num_nodes = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.lstrip().startswith("#"):
                break
            match = _NODES_LINE.match(line)
            if match:
                num_nodes = int(match.group(1))
    try:
        table = np.loadtxt(path, comments="#", ndmin=2, dtype=np.float64)
    except ValueError as err:
        raise UserError(f"{path}: not an edge list (src dst [weight] per line): {err}") from None
    if table.size == 0:
        table = table.reshape(0, 2)
    if table.shape[1] not in (2, 3):
        raise UserError(f"{path}: expected 2 or 3 columns (src dst [weight]), got {table.shape[1]}")
    ids = table[:, :2]
    if not np.all(ids == np.round(ids)):
        raise UserError(f"{path}: node ids must be integers")
    weight = table[:, 2].astype(np.float32) if table.shape[1] == 3 else None
    return ids.astype(np.int64), weight, num_nodes


def from_edge_list(
    edges: np.ndarray | str | Path,
    num_nodes: int | None = None,
    edge_weight: Any = None,
    ndata: Mapping[str, torch.Tensor] | None = None,
    name: str = "graph",
) -> Graph:
    """From an ``(E, 2)`` integer array of ``(src, dst)`` rows, or an edge-list text file
    (module docstring; its ``# nodes: N`` line, when given, sets ``num_nodes``)."""
    if isinstance(edges, (str, Path)):
        where = edges
        edges, weight, stated = read_edge_list(edges)
        if edge_weight is None:
            edge_weight = weight
        if num_nodes is None:
            num_nodes = stated
        try:
            return from_edge_list(edges, num_nodes, edge_weight, ndata, name)
        except UserError as err:
            raise UserError(f"{where}: {err}") from None
    edges = np.asarray(edges)
    if edges.ndim != 2 or edges.shape[1] != 2:
        raise UserError(f"edge list must have shape (E, 2), got {edges.shape}")
    return _graph_class().from_edges(edges[:, 0], edges[:, 1], num_nodes, edge_weight, ndata, name)


# ------------------------------------------------------------------ anything
def as_graph(obj: Any, name: str | None = None) -> Graph:
    """``obj`` as a :class:`Graph`: a Graph as it is, a PyG ``Data`` / ``HeteroData`` or a
    DGL graph converted (``name`` names a converted one, default ``"graph"``; a heterogeneous
    one becomes a typed graph); TypeError otherwise."""
    graph_cls = _graph_class()
    if isinstance(obj, graph_cls):
        return obj
    module = type(obj).__module__ or ""
    if module.startswith("torch_geometric"):
        return from_pyg(obj, name=name or "graph")
    if module.startswith("dgl"):
        return from_dgl(obj, name=name or "graph")
    raise TypeError(
        f"expected a gnnpar Graph, a PyG Data or a DGL graph, got {type(obj).__name__} "
        "(networkx, scipy and edge lists: see Graph.from_networkx, from_scipy, from_edge_list)"
    )
