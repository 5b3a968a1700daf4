"""R-GCN's sparse operators: one row-normalised adjacency per relation of a typed graph.

A typed graph (:mod:`gnnpar.graph.typed`) is a homogeneous graph whose every edge carries a
relation (:attr:`GraphTypes.edge_type`, aligned with the CSR). Relation r's operator is

    Â_r[v, u] = Σ_{edges u→v of r} w / Σ_{edges u'→v of r} w        (``"mean-per-relation"``)

over the whole node range (a node that no edge of r reaches has an empty row): the weighted
mean of v's in-neighbours by r, PyG's ``RGCNConv(aggr="mean")`` on an unweighted graph
(duplicate edges count as often as they occur, as there). Every operator is an N × N matrix
of the same node ids, so one node permutation serves them all: the shards
(:mod:`gnnpar.models.fullgraph.shards`) and :class:`RelationMemorySource` permute each Â_r
with the same P and P₂ as the root operator and the features.

The R-GCN layer (:class:`~gnnpar.models.fullgraph.model.RGCNLayer`) is then the multi-operator
layer of every grid algorithm, with the operators (Â_1, …, Â_R, identity)
(:func:`gnnpar.models.fullgraph.parallelize.operator_blocks`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gnnpar.errors import UserError
from gnnpar.graph import Graph, weights_or_ones
from gnnpar.graph.typed import relation_name
from gnnpar.sparse import csr
from gnnpar.sparse.csr import CSRBlock
from gnnpar.sparse.kernels import LocalSpMM
from gnnpar.sparse.source import MemorySource

__all__ = [
    "RELATION_NORM",
    "RelationMemorySource",
    "relation_adjacencies",
    "relation_memory_source",
    "relation_spmms",
]

#: The ``norm`` of a shard folder or source that holds one Â_r per relation.
RELATION_NORM = "mean-per-relation"

#: One operator in CSR: (indptr, indices, values) of an N × N matrix.
CSR = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _typed(graph: Graph) -> None:
    if graph.types is None:
        raise UserError(
            f"graph {graph.name!r} has no node types or relations: an R-GCN reads a typed "
            "graph (gnnpar.graph.typed_graph, or a typed dataset such as mag-synth)"
        )


def relation_adjacencies(graph: Graph, dtype: torch.dtype | None = None) -> list[CSR]:
    """Each relation's row-normalised adjacency Â_r (module docstring) as N × N CSR
    ``(indptr, indices, values)``, in the graph's node ids; values in ``dtype`` (default:
    the edge weights', or the float features' as :meth:`~gnnpar.graph.Graph.row_normalize`
    uses). Rows keep the graph's order of their edges."""
    _typed(graph)
    out = []
    for r in range(graph.types.num_relations):  # each relation's graph, row-normalised
        rel = graph.keep_edges(graph.types.edge_type == r)
        if dtype is not None:
            rel.edge_weight = weights_or_ones(rel).to(dtype)
        mean = rel.row_normalize()
        out.append((mean.indptr, mean.indices, mean.edge_weight))
    return out


def relation_spmms(graph: Graph, dtype: torch.dtype | None = None) -> list[LocalSpMM]:
    """Â_1 … Â_R as local SpMMs over the whole graph: the ``adj`` of a serial R-GCN
    (:class:`~gnnpar.models.fullgraph.model.FullGraphGNN` of kind ``"rgcn"``)."""
    n = graph.num_nodes
    return [
        LocalSpMM(CSRBlock(indptr, indices, values, (n, n)))
        for indptr, indices, values in relation_adjacencies(graph, dtype)
    ]


class RelationMemorySource(MemorySource):
    """A :class:`~gnnpar.sparse.source.MemorySource` of R-GCN's operators: one normalised
    adjacency per relation (:func:`relation_adjacencies`), permuted with the same
    ``permutations`` as the root operator, the features and the node data. It has no single
    adjacency (:meth:`adjacency` refuses); :meth:`relation_adjacency` gives relation r's
    blocks, :attr:`relations` names them. The ``norm`` is :data:`RELATION_NORM`."""

    def __init__(
        self,
        operators: Sequence[CSR],
        features: torch.Tensor,
        node_data: Mapping[str, torch.Tensor],
        relations: Sequence[str] | None = None,
        permutations: tuple[torch.Tensor, torch.Tensor] | None = None,
        dtype: torch.dtype | None = None,
    ):
        n = int(features.shape[0])
        if not operators:
            raise UserError("an R-GCN source needs at least one relation's operator")
        for k, (indptr, _, _) in enumerate(operators):
            if indptr.numel() != n + 1:
                raise UserError(
                    f"relation {k}'s operator has {indptr.numel() - 1} rows for {n} nodes"
                )
        dtype = dtype or features.dtype
        empty = torch.zeros(n + 1, dtype=torch.int64)
        none = (empty, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=dtype))
        super().__init__(*none, features, dict(node_data), permutations, dtype, norm=RELATION_NORM)
        self.norm_where = "RelationMemorySource"
        #: The relations' names (``src___rel___dst``), one per operator.
        self.relations = list(relations or (f"relation{k}" for k in range(len(operators))))
        if len(self.relations) != len(operators):
            raise UserError(f"{len(self.relations)} relation names for {len(operators)} operators")
        self._rel_adj = [
            (
                csr.permute(ip, ix, v.to(dtype), self.perm[1], self.perm[0]),
                csr.permute(ip, ix, v.to(dtype), self.perm[0], self.perm[1]),
            )
            for ip, ix, v in operators
        ]

    @property
    def num_relations(self) -> int:
        """Number of relations (operators besides the root)."""
        return len(self._rel_adj)

    def adjacency(self, parity: int, rows: tuple[int, int], cols: tuple[int, int]) -> CSRBlock:
        """Refused: an R-GCN source holds one operator per relation."""
        raise UserError(
            f"{self.norm_where} holds one adjacency per relation ({RELATION_NORM!r}): read "
            "relation_adjacency(r, ...), or give a gcn/sage/gat/gin model another source"
        )

    def relation_adjacency(
        self, relation: int, parity: int, rows: tuple[int, int], cols: tuple[int, int]
    ) -> CSRBlock:
        """Block of relation ``relation``'s Â_r in the order pair of ``parity`` (0: rows in
        order 1, columns in order 0; 1: the other way round), as :meth:`adjacency` of an
        untyped source."""
        a = self._rel_adj[relation][parity]
        return csr.select(a.indptr, a.indices, a.values, rows, cols)


def relation_memory_source(
    graph: Graph,
    permutations: tuple[torch.Tensor, torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
) -> RelationMemorySource:
    """The :class:`RelationMemorySource` of a typed ``graph``: its relations' operators,
    its (padded) features ``ndata["feat"]`` and its other node data (label, masks)."""
    _typed(graph)
    if graph.feat is None:
        raise UserError(f"graph {graph.name!r} has no node features ('feat')")
    data = {k: v for k, v in graph.ndata.items() if k != "feat" and v.shape[0] == graph.num_nodes}
    names = [relation_name(r) for r in graph.types.relations]
    ops = relation_adjacencies(graph, dtype)
    source = RelationMemorySource(ops, graph.feat, data, names, permutations, dtype)
    if graph.types.node_ids is None:  # node v is original id v: its type follows
        source.types = graph.types.schema
    return source
