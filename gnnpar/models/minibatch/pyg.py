"""A user's PyG model in mini-batch training (``gnnpar train sage --model FILE:FACTORY``).

**Training** runs the plain model, unchanged, on each batch's sampled subgraph, as PyG's
``NeighborLoader`` feeds it: the union of the batch's blocks (every sampled edge once, its
nodes those of ``blocks[0]``, whose first rows are the seeds), then the seeds' rows of its
output (:func:`subgraph_logits`). Data parallelism, ZeRO and gradient accumulation are the
task's, as for the built-in models.

**Evaluation** is exact full-neighbour inference: with local sampling the whole graph on
every rank; with distributed sampling each rank runs the model on its part through a
:class:`PartShare` (the parallel forwards of :mod:`gnnpar.models.pyg.layers`), which
before each aggregation fetches the halo nodes' rows from their owners, as DistDGL's
layer-wise inference does for its own models.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gnnpar import comm
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid
from gnnpar.models.pyg.model import parallel_forwards
from gnnpar.sampling.distributed import LocalPart, request_rows
from gnnpar.sparse import attention, csr
from gnnpar.sparse.kernels import LocalSpMM, spmm


def subgraph_edges(blocks: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(2, E)`` source → destination positions among ``blocks[0]``'s source nodes: every
    edge of every block once (the sampled subgraph PyG's loaders give a model), and on a
    typed graph's blocks each edge's relation (None on an untyped graph's): every
    (source, destination, relation) once, so that two relations between one pair stay two
    edges."""
    nodes = blocks[0].src_nodes
    order = torch.argsort(nodes)
    sorted_nodes = nodes[order]
    typed = blocks[0].edge_type is not None
    pairs, relations = [], []
    for block in blocks:
        src = block.src_nodes[block.indices]
        dst = block.src_nodes[block.dst_index()]
        pos = order[torch.searchsorted(sorted_nodes, torch.stack([src, dst]))]
        pairs.append(pos)
        if typed:
            relations.append(block.edge_type)
    both = torch.cat(pairs, dim=1)
    n = nodes.numel()
    key = both[1] * n + both[0]  # sorted by destination, then source (then relation)
    if not typed:
        unique = torch.unique(key)
        return torch.stack([unique % n, unique // n]), None
    rel = torch.cat(relations)
    count = int(rel.max()) + 1 if rel.numel() else 1
    unique = torch.unique(key * count + rel)
    pair = unique // count
    return torch.stack([pair % n, pair // n]), unique % count


def subgraph_inputs(
    blocks: list[Any], device: torch.device, relational: bool = False
) -> tuple[torch.Tensor, ...]:
    """The graph arguments of a user's model on the batch's sampled subgraph, on
    ``device``: ``(edge_index,)``, or with ``relational`` (an R-GCN or RGAT of the user's,
    its factory taking ``num_relations``) ``(edge_index, edge_type)``."""
    edge_index, edge_type = subgraph_edges(blocks)
    args = (edge_index,) if not relational else (edge_index, _relations_of(edge_type))
    return tuple(t.to(device) for t in args)


def graph_inputs(graph: Any, device: torch.device, relational: bool = False) -> tuple:
    """The graph arguments of a user's model on the whole graph, as :func:`subgraph_inputs`:
    every edge (source, destination: PyG's order) and, ``relational``, its relation."""
    edge_index = torch.stack(graph.edges())
    if not relational:
        return (edge_index.to(device),)
    types = graph.types
    edge_type = _relations_of(None if types is None else types.edge_type)
    return edge_index.to(device), edge_type.to(device)


def _relations_of(edge_type: torch.Tensor | None) -> torch.Tensor:
    """``edge_type``, or one UserError where an untyped graph has none to give."""
    if edge_type is None:
        raise UserError(
            "a relational model (its factory takes num_relations) needs a typed graph's "
            "relations; this graph has none"
        )
    return edge_type


def subgraph_logits(
    model: nn.Module, blocks: list[Any], x: torch.Tensor, relational: bool = False
) -> torch.Tensor:
    """The seeds' rows of ``model(x, edge_index)`` (``relational``: ``model(x, edge_index,
    edge_type)``) on the batch's sampled subgraph."""
    return model(x, *subgraph_inputs(blocks, x.device, relational))[: blocks[-1].num_dst]


def full_graph_logits(
    model: nn.Module,
    graph: Any,
    device: torch.device,
    relational: bool = False,
    features: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every node's logits from the whole graph (local sampling: each rank holds it), of
    ``features`` (default: the graph's ``feat``; in the run's compute dtype)."""
    x = graph.feat if features is None else features
    return model(x.to(device), *graph_inputs(graph, device, relational))


class PartShare:
    """One part's share for full-neighbour inference (no gradients): rows = the owned
    nodes, the block = their every in-edge (sources owned, then halo), the halo rows fetched
    from their owners before each aggregation (:func:`request_rows`, collective over
    ``axis``). The adjacency values follow :class:`~gnnpar.models.fullgraph.share.GraphShare`
    (PyG's normalisations, one self loop where a node has none); on a typed graph's parts
    each relation's mean adjacency Â_r too, of the block's edges as they are (RGCNConv and
    RGATConv read them, self loops and all)."""

    checkpointing = False

    def __init__(self, part: LocalPart, grid: ProcessGrid, axis: str, dtype: torch.dtype):
        self.part, self.grid, self.axis, self.dtype = part, grid, axis, dtype
        block = part.local_block()
        n = part.num_owned
        self.num_nodes = int(part.meta["num_nodes"])
        self.num_block_rows = n
        self.halo = part.halo_nodes
        self.owner = part.owner(self.halo)
        rows, cols = block.dst_index(), block.indices
        weight = block.weight if block.weight is not None else torch.ones(rows.numel())
        loops = block.src_nodes[cols] == part.start + rows  # owned sources come first
        missing = torch.ones(n, dtype=torch.bool)
        missing[rows[loops]] = False
        own = torch.arange(n)[missing]
        self._rows = torch.cat([rows, own])
        self._cols = torch.cat([cols, own])
        self._weight = torch.cat([weight.to(dtype), torch.ones(own.numel(), dtype=dtype)])
        self._loops = torch.cat([loops, torch.ones(own.numel(), dtype=torch.bool)])
        self._shape = (n, block.num_src)
        self._ops: dict[str, LocalSpMM] = {}
        self._attention: attention.Edges | None = None
        self._edges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        #: A typed part's edges with their relations, from which each Â_r's block is cut.
        self._typed = None if block.edge_type is None else (rows, cols, block.edge_type)
        self._relation_blocks: list[csr.CSRBlock] = []
        self._relation_ops: list[LocalSpMM] = []

    def _row_means(self, rows: torch.Tensor) -> torch.Tensor:
        """Each edge's value of a mean over its row's edges: 1 / the row's count of them."""
        ones = torch.ones(rows.numel(), dtype=self.dtype)
        count = torch.zeros(self.num_block_rows, dtype=self.dtype).index_add_(0, rows, ones)
        return 1.0 / count.clamp(min=1.0)[rows]

    def _relations(self, relations: int) -> list[csr.CSRBlock]:
        """Each relation's Â_r block (the mean over the row's in-edges of r), built once,
        checked against the ``relations`` a convolution has."""
        if self._typed is None:
            raise UserError(
                "a relational convolution reads each relation's adjacency; the parts hold an "
                "untyped graph"
            )
        have = self.part.types.num_relations
        if relations != have:
            raise UserError(f"the convolution has num_relations={relations}, the graph {have}")
        if not self._relation_blocks:
            rows, cols, relation = self._typed
            for r in range(relations):
                keep = relation == r
                mine = rows[keep]
                block = csr.from_coo(mine, cols[keep], self._row_means(mine), self._shape)
                self._relation_blocks.append(block)
        return self._relation_blocks

    def relation_partials(self, hc: torch.Tensor, relations: int) -> list[torch.Tensor]:  # noqa: D102
        if not self._relation_ops:
            self._relation_ops = [LocalSpMM(b) for b in self._relations(relations)]
        return [spmm(op, hc) for op in self._relation_ops]

    def relation_edges(self, relations: int) -> list[tuple[torch.Tensor, torch.Tensor]]:  # noqa: D102
        return [(csr.coo_rows(b), b.indices) for b in self._relations(relations)]

    def _values(self, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, cols, w = self._rows, self._cols, self._weight
        if kind == "attention":
            return rows, cols, w
        if kind == "gcn":
            deg = torch.zeros(self.num_block_rows, dtype=self.dtype).index_add_(0, rows, w)
            deg_src = self.gather_cols(deg[:, None])[:, 0]
            inv, inv_src = deg.pow(-0.5), deg_src.pow(-0.5)
            inv[deg == 0], inv_src[deg_src == 0] = 0.0, 0.0
            return rows, cols, inv[rows] * w * inv_src[cols]
        keep = ~self._loops
        rows, cols = rows[keep], cols[keep]
        if kind == "sum":
            return rows, cols, torch.ones(rows.numel(), dtype=self.dtype)
        return rows, cols, self._row_means(rows)

    def prepare(self, kinds: list[str]) -> None:
        """Derive the values of ``kinds`` now (collective: the halo's degrees)."""
        for kind in kinds:
            if kind == "relations":  # built on first use, when the convolution's count is known
                continue
            rows, cols, values = self._values(kind)
            block = csr.from_coo(rows, cols, values, self._shape)
            if kind == "attention":
                self._attention = attention.Edges(block)
            self._ops[kind] = LocalSpMM(block)
            self._edges[kind] = (csr.coo_rows(block), block.indices)

    def edges(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        return self._edges[kind]

    def gather_cols(self, h: torch.Tensor, what: str = "") -> torch.Tensor:  # noqa: D102
        halo = request_rows(self.halo, self.owner, h.contiguous(), self.part.start, self.grid,
                            self.axis)  # fmt: skip
        return torch.cat([h, halo])

    def gather_rows(self, v: torch.Tensor, what: str = "") -> torch.Tensor:  # noqa: D102
        return v

    def scatter_rows(self, p: torch.Tensor, what: str = "") -> torch.Tensor:  # noqa: D102
        return p

    def propagate(self, kind: str, h: torch.Tensor, what: str = "") -> torch.Tensor:  # noqa: D102
        return spmm(self._ops[kind], self.gather_cols(h))

    def softmax(self, e: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return attention.edge_softmax(e, rows, self.num_block_rows)

    def attention_edges(self) -> attention.Edges:  # noqa: D102
        return self._attention

    def neighbour_max(self, h: torch.Tensor) -> torch.Tensor:  # noqa: D102
        rows, cols = self._edges["mean"]
        vals = self.gather_cols(h)[cols]
        top = h.new_full((self.num_block_rows, h.shape[1]), -torch.inf)
        top = top.scatter_reduce(0, rows[:, None].expand_as(vals), vals, "amax")
        return torch.where(torch.isinf(top), torch.zeros_like(top), top)

    def node_sum(self, t: torch.Tensor, what: str) -> torch.Tensor:  # noqa: D102
        return comm.all_reduce(t.contiguous(), self.grid, self.axis)


@torch.no_grad()
def part_logits(
    model: nn.Module,
    part: LocalPart,
    grid: ProcessGrid,
    axis: str = "data",
    relational: bool = False,
) -> torch.Tensor:
    """The owned nodes' logits of ``model`` over the whole partitioned graph (collective);
    ``relational``: ``model(x, edge_index, edge_type)``, both graph arguments the share."""
    features = part.ndata["feat"][: part.num_owned]
    share = PartShare(part, grid, axis, features.dtype)
    was_training = model.training
    model.eval()
    try:
        with parallel_forwards(model, share) as kinds:
            share.prepare(kinds)
            return model(features, share, share) if relational else model(features, share)
    finally:
        model.train(was_training)
