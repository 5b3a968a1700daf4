"""ScaleGNN's communication-free uniform vertex sampling.

Each step draws ``batch_size`` distinct vertices uniformly at random from the whole graph;
the mini-batch is the subgraph they induce, used by every layer (all sampled vertices are
destinations of every block, as in ScaleGNN and GraphSAINT's node sampler). The draw is a
pure function of ``(key, counter)`` (:mod:`gnnpar.sampling.rng`), so every rank derives the
same vertex set from a shared seed **without any communication**, and each builds only its
own share of the rows of the induced adjacency:

- a contiguous range of the sampled vertices (``share=(rank, world)``, ScaleGNN's row split
  over a process axis), or
- the sampled vertices it owns in a partition (``owned=(start, stop)``, for parts written by
  :mod:`partitioners`, whose rows hold every in-edge of the owned nodes).

A share is a :class:`~gnnpar.sampling.Block` whose destinations are the share's vertices and
whose sources are all sampled vertices (the share first, then the others in id order). In a
single process the share is everything and the block is square, so a multi-layer model runs
on it directly; with several shares, each layer's outputs must be exchanged between shares
(ScaleGNN does that inside its 3D matrix products).
"""

from __future__ import annotations

import torch

from gnnpar.graph import Graph
from gnnpar.sampling import compiled
from gnnpar.sampling.block import Block, MiniBatch
from gnnpar.sampling.neighbor import _all_positions, _use_numba
from gnnpar.sampling.rng import random_bits, uniform_below

__all__ = ["VertexSampler", "induced_block", "uniform_subset"]


def uniform_subset(key: int, num_nodes: int, size: int) -> torch.Tensor:
    """``size`` distinct ids uniform in ``[0, num_nodes)``, sorted; a function of ``key``.

    Draws ids by hashing counters ``0, 1, 2, ...`` and keeps the first ``size`` distinct ones
    (by symmetry a uniform ``size``-subset); for ``size > num_nodes / 4`` it sorts one hash
    per node instead.
    """
    if size < 0 or size > num_nodes:
        raise ValueError(f"cannot draw {size} distinct nodes out of {num_nodes}")
    if size == num_nodes:
        return torch.arange(num_nodes, dtype=torch.int64)
    if 4 * size > num_nodes:
        h = random_bits(key, torch.arange(num_nodes, dtype=torch.int64), 2)
        order = torch.argsort(h[0] * (1 << 31) + (h[1] >> 1))  # 63 random bits per node
        return torch.sort(order[:size]).values
    drawn = torch.zeros(0, dtype=torch.int64)
    counter = 0
    while True:
        extra = max(16, size - drawn.numel() + size // 8)
        counters = torch.arange(counter, counter + extra, dtype=torch.int64)
        counter += extra
        new = uniform_below(random_bits(key, counters, 1)[0], num_nodes)
        drawn = torch.cat([drawn, new])
        uniq, inverse = torch.unique(drawn, return_inverse=True)
        if uniq.numel() >= size:
            first = torch.full((uniq.numel(),), drawn.numel(), dtype=torch.int64)
            first.scatter_reduce_(0, inverse, torch.arange(drawn.numel()), "amin")
            return torch.sort(drawn[torch.sort(first).values[:size]]).values


def induced_block(
    indptr: torch.Tensor,
    indices: torch.Tensor,
    nodes: torch.Tensor,
    lo: int = 0,
    hi: int | None = None,
    row_start: int = 0,
    col_ids: torch.Tensor | None = None,
) -> Block:
    """The block of the subgraph induced by the sorted global ids ``nodes``, for the
    destinations ``nodes[lo:hi]`` (default: all of them, a square block).

    Sources are the destinations first, then the other ``nodes`` in id order; an edge is
    kept when both ends are in ``nodes``. ``indptr``/``indices`` hold the rows of the
    destinations (row ``v - row_start`` for global id ``v``; ``col_ids`` maps local column
    ids to global ones). ``edge_ids`` are the kept edges' CSR positions (None with
    ``col_ids``).
    """
    b = nodes.numel()
    hi = b if hi is None else hi
    num_rows = indptr.numel() - 1
    dst = nodes[lo:hi]
    rows = dst - row_start
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
        raise ValueError("the share holds vertices whose rows this process does not have")
    if (
        lo == 0
        and hi == b
        and row_start == 0
        and col_ids is None
        and _use_numba("auto", indptr, indices, nodes)
    ):  # the compiled loop: the same block in one pass
        out, local, eids = compiled.induced(indptr, indices, nodes)
        return Block(nodes, b, out, local, eids)
    start = indptr.index_select(0, rows)
    deg = indptr.index_select(0, rows + 1) - start
    pos = _all_positions(start, deg)
    nbr = indices.index_select(0, pos)
    if col_ids is not None:
        nbr = col_ids.index_select(0, nbr)
    # position of every neighbour among ``nodes`` through a dense map up to the largest
    # sampled id (one gather per edge, where a binary search costs log b), -1 if absent
    top = int(nodes[-1]) + 1 if b else 0
    where = torch.full((top + 1,), -1, dtype=torch.int64)
    where[nodes] = torch.arange(b, dtype=torch.int64)
    at = where.index_select(0, nbr.clamp(max=top))
    keep = at >= 0
    offsets = torch.zeros(dst.numel() + 1, dtype=torch.int64)
    torch.cumsum(deg, 0, out=offsets[1:])
    kept_before = torch.zeros(pos.numel() + 1, dtype=torch.int64)
    torch.cumsum(keep, 0, out=kept_before[1:])
    out_indptr = kept_before.index_select(0, offsets)  # kept edges before every row
    at = at[keep]
    # sources: the share [lo, hi) first, then the sampled vertices before it, then after
    if lo == 0 and hi == b:  # the whole set: sources are ``nodes`` as they are
        local = at
    else:
        local = torch.where(at < lo, at + (hi - lo), torch.where(at < hi, at - lo, at))
    src = torch.cat([dst, nodes[:lo], nodes[hi:]])
    return Block(src, dst.numel(), out_indptr, local, pos[keep] if col_ids is None else None)


class VertexSampler:
    """Uniform vertex sampling with induced-subgraph blocks (ScaleGNN).

    Args:
        graph: the rows this process holds: a :class:`~gnnpar.graph.Graph` or
            ``(indptr, indices)``; for a partition, the part's local CSR.
        batch_size: vertices per step.
        num_layers: blocks per mini-batch (the same induced block for every layer).
        num_nodes: vertices of the whole graph (default: the rows of ``graph``).
        row_start: global id of the first row of ``graph`` (a part's first owned id).
        col_ids: global id of every local column id (a part's ``local_to_global``).
        seed: default random seed.
    """

    def __init__(
        self,
        graph: Graph | tuple[torch.Tensor, torch.Tensor],
        batch_size: int,
        num_layers: int,
        num_nodes: int | None = None,
        row_start: int = 0,
        col_ids: torch.Tensor | None = None,
        seed: int = 0,
    ):
        if isinstance(graph, Graph):
            indptr, indices = graph.indptr, graph.indices
        else:
            indptr, indices = graph
        self.indptr = torch.as_tensor(indptr, dtype=torch.int64)
        self.indices = torch.as_tensor(indices, dtype=torch.int64)
        self.num_rows = self.indptr.numel() - 1
        self.num_nodes = self.num_rows if num_nodes is None else int(num_nodes)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if batch_size > self.num_nodes:
            raise ValueError(f"batch_size {batch_size} exceeds the {self.num_nodes} nodes")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.batch_size, self.num_layers = batch_size, num_layers
        self.row_start = int(row_start)
        self.col_ids = None if col_ids is None else torch.as_tensor(col_ids, dtype=torch.int64)
        self.seed = int(seed)

    def nodes(self, key: int) -> torch.Tensor:
        """The sampled vertices of ``key`` (sorted global ids), identical on every rank."""
        return uniform_subset(key, self.num_nodes, self.batch_size)

    def sample(
        self,
        key: int,
        share: tuple[int, int] | None = None,
        owned: tuple[int, int] | None = None,
    ) -> MiniBatch:
        """This process's share of the mini-batch of ``key`` (no communication).

        ``share=(rank, world)`` takes a contiguous ``1/world`` of the sampled vertices;
        ``owned=(start, stop)`` the sampled vertices with global ids in that range; neither
        takes all of them. The rows of the share's vertices must be held here.
        """
        from gnnpar.comm import chunk_offsets, chunk_sizes

        nodes = self.nodes(key)
        b = nodes.numel()
        if share is not None and owned is not None:
            raise ValueError("give share= or owned=, not both")
        if share is not None:
            rank, world = share
            if not 0 <= rank < world:
                raise ValueError(f"share rank {rank} is outside 0..{world - 1}")
            sizes = chunk_sizes(b, world)
            lo = chunk_offsets(sizes)[rank]
            hi = lo + sizes[rank]
        elif owned is not None:
            lo = int(torch.searchsorted(nodes, owned[0]))
            hi = int(torch.searchsorted(nodes, owned[1]))
        else:
            lo, hi = 0, b
        block = induced_block(
            self.indptr, self.indices, nodes, lo, hi, self.row_start, self.col_ids
        )
        dst = block.dst_nodes
        batch = MiniBatch(dst, [block] * self.num_layers)
        batch.stats["sample_bytes"] = 0.0
        return batch

    def __repr__(self) -> str:
        return f"VertexSampler(num_nodes={self.num_nodes}, batch_size={self.batch_size})"
