"""Message-flow blocks: one bipartite graph per GNN layer, and the mini-batch that holds them.

A :class:`Block` connects the *source* nodes of a layer (whose input representations are
read) to its *destination* nodes (whose outputs are computed). Following DGL and PyG, the
destination nodes come first among the sources: ``src_nodes[:num_dst] == dst_nodes``, so a
layer finds the destinations' own input as ``h_src[:num_dst]``.

Edges are stored as a CSR over destinations (``indptr`` of length ``num_dst + 1``, ``indices``
= local source ids), the project's convention (row ``i`` lists the in-neighbours of
destination ``i``). The same edges in PyG's layout are :attr:`Block.edge_index`
(``[0]`` = local sources, ``[1]`` = local destinations) with :attr:`Block.size`
``(num_src, num_dst)``, ready for ``SAGEConv((x_src, x_dst), edge_index, size)``;
:meth:`Block.to_dgl` builds a ``dgl.create_block``.

Blocks of a mini-batch are ordered like DGL's: ``blocks[0]`` consumes the input features
(its sources are :attr:`MiniBatch.input_nodes`), ``blocks[-1]`` produces the seeds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from gnnpar.errors import MissingPackageError
from gnnpar.sparse.csr import CSRBlock
from gnnpar.sparse.kernels import LocalSpMM

__all__ = ["AGGREGATIONS", "Block", "MiniBatch", "aggregation_operator"]

#: The aggregations :meth:`Block.operator` builds: each edge weighs ``1 / in-degree`` (the
#: mean of a destination's in-neighbours, 0 without any) or 1 (their sum).
AGGREGATIONS = ("mean", "sum")


def aggregation_operator(
    kept: dict[tuple[str, torch.dtype], LocalSpMM],
    indptr: torch.Tensor,
    indices: torch.Tensor,
    shape: tuple[int, int],
    kind: str,
    dtype: torch.dtype,
) -> LocalSpMM:
    """The CSR (``indptr``, ``indices``) of ``shape`` (destinations × sources) as a sparse
    operator of ``dtype`` for the aggregation ``kind`` (:data:`AGGREGATIONS`), built once
    and kept in ``kept`` (its owner's cache, keyed by ``(kind, dtype)``)."""
    op = kept.get((kind, dtype))
    if op is not None:
        return op
    if kind == "mean":
        deg = indptr[1:] - indptr[:-1]
        inv = 1.0 / deg.clamp(min=1).to(dtype)
        values = torch.repeat_interleave(inv, deg, output_size=indices.numel())
    elif kind == "sum":
        values = torch.ones(indices.numel(), dtype=dtype, device=indices.device)
    else:
        raise ValueError(f"unknown aggregation {kind!r}; use one of {AGGREGATIONS}")
    op = kept[(kind, dtype)] = LocalSpMM(CSRBlock(indptr, indices, values, shape), autotune=False)
    return op


@dataclasses.dataclass
class Block:
    """One layer of a sampled computation graph.

    Attributes:
        src_nodes: global ids of the source nodes, ``(num_src,)`` int64; the first
            ``num_dst`` are the destination nodes.
        num_dst: number of destination nodes.
        indptr: ``(num_dst + 1,)`` int64 CSR offsets over destinations.
        indices: ``(num_edges,)`` int64 local source id of every edge, row by row.
        edge_ids: position of every edge in the sampled graph's CSR (``indices`` array), or
            None where that has no meaning (distributed sampling).
        src_keys: the id every source node is known by for counter-based randomness (its
            original id before a partition relabelled it), or None when it is ``src_nodes``.
            Dropout masks keyed by it are the same however the graph is partitioned.
        edge_weight: each edge's coefficient in a mean aggregation, replacing ``1 /
            in-degree`` (a subgraph sampler's normalisation, e.g. GraphSAINT's), or None.
        weight: the graph's weight of every sampled edge (a weighted graph's, recorded by
            the samplers), or None for an unweighted graph; the layers of
            :mod:`gnnpar.models.minibatch.model` read it.
        edge_type: a typed graph's (:mod:`gnnpar.graph.typed`) relation index of every
            edge, or None for an untyped graph.
        node_type: a typed graph's node-type index of every source node, or None.

    The block's aggregation operators (:meth:`operator`) are built once and kept with it, so
    a loader's prefetch thread can build them, transposes included, while the previous
    batch trains (:meth:`prepare_operators`); moving the block drops them.
    """

    src_nodes: torch.Tensor
    num_dst: int
    indptr: torch.Tensor
    indices: torch.Tensor
    edge_ids: torch.Tensor | None = None
    src_keys: torch.Tensor | None = None
    edge_weight: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    edge_type: torch.Tensor | None = None
    node_type: torch.Tensor | None = None
    _operators: dict[tuple[str, torch.dtype], LocalSpMM] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    # ------------------------------------------------------------------ sizes and views
    @property
    def num_src(self) -> int:
        """Number of source nodes (destinations included)."""
        return int(self.src_nodes.numel())

    @property
    def num_edges(self) -> int:
        """Number of sampled edges."""
        return int(self.indices.numel())

    @property
    def keys(self) -> torch.Tensor:
        """:attr:`src_keys`, or the source ids where no other key is known."""
        return self.src_nodes if self.src_keys is None else self.src_keys

    @property
    def dst_nodes(self) -> torch.Tensor:
        """Global ids of the destination nodes (a view of ``src_nodes``)."""
        return self.src_nodes[: self.num_dst]

    @property
    def size(self) -> tuple[int, int]:
        """``(num_src, num_dst)``: the ``size`` argument of PyG's message passing."""
        return (self.num_src, self.num_dst)

    def in_degrees(self) -> torch.Tensor:
        """Sampled in-degree of every destination."""
        return self.indptr[1:] - self.indptr[:-1]

    def dst_index(self) -> torch.Tensor:
        """Local destination of every edge (the CSR row), in edge order."""
        return torch.repeat_interleave(
            torch.arange(self.num_dst, dtype=torch.int64, device=self.indptr.device),
            self.in_degrees(),
            output_size=self.num_edges,
        )

    @property
    def edge_index(self) -> torch.Tensor:
        """``(2, num_edges)``: local sources in row 0, local destinations in row 1 (PyG)."""
        return torch.stack([self.indices, self.dst_index()])

    # ------------------------------------------------------------------ operators
    def operator(self, kind: str, dtype: torch.dtype) -> LocalSpMM:
        """The block's edges as a sparse (num_dst × num_src) operator of ``dtype`` for the
        aggregation ``kind`` (:data:`AGGREGATIONS`), built on first use and kept."""
        shape = (self.num_dst, self.num_src)
        return aggregation_operator(self._operators, self.indptr, self.indices, shape, kind, dtype)

    def prepare_operators(self, kind: str, dtype: torch.dtype, transpose: bool) -> None:
        """Build :meth:`operator` ``(kind, dtype)`` now and, with ``transpose``, its
        transpose (what backward multiplies by when the sources' rows need a gradient)."""
        op = self.operator(kind, dtype)
        if transpose:
            op.T  # noqa: B018 - built and kept by the operator

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Check shapes and index ranges; raise ValueError naming the problem."""
        if self.indptr.numel() != self.num_dst + 1:
            raise ValueError(
                f"block indptr has {self.indptr.numel()} entries, expected num_dst + 1 = "
                f"{self.num_dst + 1}"
            )
        if self.num_dst > self.num_src:
            raise ValueError(f"block has {self.num_dst} destinations but {self.num_src} sources")
        if int(self.indptr[-1]) != self.num_edges or int(self.indptr[0]) != 0:
            raise ValueError("block indptr must start at 0 and end at the number of edges")
        if self.num_edges and (
            int(self.indices.min()) < 0 or int(self.indices.max()) >= self.num_src
        ):
            raise ValueError(f"block indices must lie in [0, {self.num_src})")
        if bool((self.in_degrees() < 0).any()):
            raise ValueError("block indptr is not non-decreasing")

    # ------------------------------------------------------------------ devices
    def _map(self, fn: Any) -> Block:
        """The block with ``fn`` applied to each of its tensors."""
        return Block(**{
            f.name: fn(v) if isinstance(v, torch.Tensor) else v
            for f in dataclasses.fields(self)
            if f.init
            for v in (getattr(self, f.name),)
        })  # fmt: skip

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Block:
        """The block with its tensors on ``device``."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Block:
        """The block with its tensors in page-locked memory (for fast, async host-to-GPU)."""
        return self._map(lambda t: t.pin_memory())

    # ------------------------------------------------------------------ converters
    def to_dgl(self) -> Any:
        """A DGL block (``dgl.create_block``) with ``srcdata[dgl.NID]``,
        ``dstdata[dgl.NID]`` and, when known, ``edata[dgl.EID]``. Needs ``dgl``."""
        try:
            import dgl
        except ImportError as err:
            raise MissingPackageError(
                "Block.to_dgl needs DGL, which is not installed: pip install 'gnnpar[dgl]'"
            ) from err
        b = dgl.create_block(
            (self.indices, self.dst_index()),
            num_src_nodes=self.num_src,
            num_dst_nodes=self.num_dst,
            device=self.indices.device,
        )
        b.srcdata[dgl.NID] = self.src_nodes
        b.dstdata[dgl.NID] = self.dst_nodes
        if self.edge_ids is not None:
            b.edata[dgl.EID] = self.edge_ids
        return b

    def __repr__(self) -> str:
        return f"Block(num_src={self.num_src}, num_dst={self.num_dst}, num_edges={self.num_edges})"


@dataclasses.dataclass
class MiniBatch:
    """A sampled mini-batch: seeds, blocks (input layer first) and, once gathered, data.

    Attributes:
        seeds: global ids of the output nodes (``blocks[-1].dst_nodes``).
        blocks: one :class:`Block` per layer, ``blocks[0]`` reading the input features.
        x: input features of :attr:`input_nodes` (set by a loader), or None.
        y: labels of the seeds (set by a loader), or None.
        epoch, index: where the batch comes from (set by a loader): the global batch.
        micro: which micro-batch of the global batch it is (gradient accumulation).
        global_size: seeds of the global batch this one is part of, over all ranks (set by
            a loader; the mean loss of the global batch divides by it).
        seed_weight: the weight of each seed's loss, where a subgraph sampler sets it (0 for
            seeds that are not training nodes; GraphSAINT's loss normalisation), else None.
        stats: counters of the batch (sampling and fetch bytes, cache hits, timings).
        pairs: link prediction (:class:`~gnnpar.sampling.edge.EdgeSampler`): ``(2, b)`` the
            positive pairs' source and destination as rows of the seeds' outputs, else None.
        neg: ``(b, k)`` each positive's negative destinations as rows of the outputs.
        edge_ids: ``(b,)`` the positives' ids (their columns of the split's ``train``).
        prepared: what a loader's ``prepare`` made of the batch where it was sampled (kept
            as it is when the batch moves), or None.
    """

    seeds: torch.Tensor
    blocks: list[Block]
    x: torch.Tensor | None = None
    y: torch.Tensor | None = None
    epoch: int = 0
    index: int = 0
    micro: int = 0
    global_size: int | None = None
    seed_weight: torch.Tensor | None = None
    stats: dict[str, float] = dataclasses.field(default_factory=dict)
    pairs: torch.Tensor | None = None
    neg: torch.Tensor | None = None
    edge_ids: torch.Tensor | None = None
    prepared: Any = None

    @property
    def input_nodes(self) -> torch.Tensor:
        """Global ids of the nodes whose features the first layer reads."""
        return self.blocks[0].src_nodes if self.blocks else self.seeds

    @property
    def num_seeds(self) -> int:
        """Number of output nodes."""
        return int(self.seeds.numel())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MiniBatch:
        """The batch with blocks, features and labels on ``device``."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return dataclasses.replace(
            self,
            seeds=move(self.seeds),
            blocks=[b.to(device, non_blocking) for b in self.blocks],
            x=move(self.x),
            y=move(self.y),
            seed_weight=move(self.seed_weight),
            pairs=move(self.pairs),
            neg=move(self.neg),
        )

    def pin_memory(self) -> MiniBatch:
        """The batch in page-locked host memory."""

        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        return dataclasses.replace(
            self,
            seeds=pin(self.seeds),
            blocks=[b.pin_memory() for b in self.blocks],
            x=pin(self.x),
            y=pin(self.y),
            seed_weight=pin(self.seed_weight),
            pairs=pin(self.pairs),
            neg=pin(self.neg),
        )
