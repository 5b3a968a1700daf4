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
on it directly.

**ScaleGNN 4D.** With several processes, the subgraph is a smaller Â trained by the
full-graph 3D layer (:class:`~gnnpar.models.fullgraph.parallelize.Parallel3DGNN`): a
:class:`SubgraphSource` presents the sample as a :class:`~gnnpar.sparse.source.ShardSource`,
from which every rank of the x × y × z group reads only its own blocks of Â (built from the
rows of its row range, no communication) and only the feature rows its first layer needs;
:meth:`Parallel3DGNN.set_source` swaps it in every step. Data groups draw different samples
(batch ``index = step * data + data_rank``) and their gradients are averaged by
:func:`gnnpar.shard.shard`.

**Normalisation** (unbiased for uniform sampling of ``b`` of ``N`` vertices without
replacement, GraphSAINT's estimators with the exact inclusion probabilities
``P(v ∈ S) = b / N`` and ``P(u ∈ S | v ∈ S) = (b − 1) / (N − 1)``, so no pre-sampling):

- aggregation: the subgraph keeps the **full graph's** normalised entries ``Â_vu`` (degrees
  of the whole graph, known to every rank), each edge between two distinct sampled vertices
  scaled by ``(N − 1) / (b − 1)`` and self loops unscaled, so that for a sampled ``v``
  ``E[Σ_{u ∈ S} Â'_vu x_u | v ∈ S] = Σ_u Â_vu x_u`` (:func:`edge_scale`);
- loss: a sampled training node weighs ``N / (b · |V_train|)``, so the weighted sum of the
  subgraph's losses is, in expectation, the mean loss over all training nodes
  (:func:`loss_scale`).

Together the gradient of a linear aggregation layer is unbiased; through nonlinear layers,
as in GraphSAINT, only approximately.
"""

from __future__ import annotations

import torch

from gnnpar.errors import UserError
from gnnpar.graph import Graph
from gnnpar.sampling import compiled
from gnnpar.sampling.block import Block, MiniBatch
from gnnpar.sampling.neighbor import all_positions, use_numba
from gnnpar.sampling.rng import derive_key, random_bits, uniform_below
from gnnpar.sparse import csr
from gnnpar.sparse.csr import CSRBlock
from gnnpar.sparse.source import num_classes_of, root_block

__all__ = [
    "SubgraphSource",
    "VertexSampler",
    "edge_scale",
    "induced_block",
    "loss_scale",
    "uniform_subset",
]

_TRAIN = 0x5CA1E  # salt of the training draws


def edge_scale(num_nodes: int, size: int) -> float:
    """``(N − 1) / (b − 1)``: the factor of an edge between two distinct vertices of a
    uniform ``b``-subset of ``N`` (1 over the whole graph)."""
    if size < 2 or size > num_nodes:
        raise UserError(f"a vertex sample needs 2..{num_nodes} vertices, got {size}")
    return (num_nodes - 1) / (size - 1)


def loss_scale(num_nodes: int, size: int, num_train: int) -> float:
    """``N / (b · |V_train|)``: the weight of a sampled training node's loss."""
    return num_nodes / (size * max(int(num_train), 1))


def uniform_subset(key: int, num_nodes: int, size: int) -> torch.Tensor:
    """``size`` distinct ids uniform in ``[0, num_nodes)``, sorted; a function of ``key``.

    Draws ids by hashing counters ``0, 1, 2, ...`` and keeps the first ``size`` distinct ones
    (by symmetry a uniform ``size``-subset); for ``size > num_nodes / 4`` it sorts one hash
    per node instead.
    """
    if size < 0 or size > num_nodes:
        raise UserError(f"cannot draw {size} distinct nodes out of {num_nodes}")
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
        and use_numba("auto", indptr, indices, nodes)
    ):  # the compiled loop: the same block in one pass
        out, local, eids = compiled.induced(indptr, indices, nodes)
        return Block(nodes, b, out, local, eids)
    start = indptr.index_select(0, rows)
    deg = indptr.index_select(0, rows + 1) - start
    pos = all_positions(start, deg)
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
            raise UserError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if batch_size > self.num_nodes:
            raise UserError(f"batch_size {batch_size} exceeds the {self.num_nodes} nodes")
        if num_layers < 1:
            raise UserError(f"num_layers must be >= 1, got {num_layers}")
        self.batch_size, self.num_layers = batch_size, num_layers
        self.row_start = int(row_start)
        self.col_ids = None if col_ids is None else torch.as_tensor(col_ids, dtype=torch.int64)
        self.seed = int(seed)

    def nodes(self, key: int) -> torch.Tensor:
        """The sampled vertices of ``key`` (sorted global ids), identical on every rank."""
        return uniform_subset(key, self.num_nodes, self.batch_size)

    @property
    def batches_per_epoch(self) -> int:
        """Samples per epoch: about as many as cover the graph's nodes once."""
        return max(1, round(self.num_nodes / self.batch_size))

    def batch(self, epoch: int, index: int) -> MiniBatch:
        """Sample ``index`` of ``epoch``: its vertices as the seeds, no blocks (the 4D model
        builds its own from a :class:`SubgraphSource`). A function of the seed, epoch and
        index only, so every rank that asks for the same index gets the same vertices."""
        nodes = self.nodes(derive_key(self.seed, _TRAIN, epoch, index))
        batch = MiniBatch(nodes, [])
        batch.stats["subgraph_nodes"] = float(nodes.numel())
        return batch

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


class SubgraphSource:
    """A uniform vertex sample as a :class:`~gnnpar.sparse.source.ShardSource`: the smaller
    Â the full-graph layers train on (positions are the sample's sorted ids, one order).

    Each request reads only what it names: :meth:`adjacency` builds the block from the
    sampled rows of its row range (:func:`induced_block`) with the full graph's normalised
    values scaled by :func:`edge_scale`; :meth:`features` gathers the block's feature rows.

    Args:
        indptr, indices, values: the whole graph's normalised adjacency (CSR, row ``v``
            holds ``Â_{v,:}``; self loops, if the normalisation has them, included).
        features: every node's input features (``N × F``).
        node_data: ``label`` and masks of every node.
        nodes: the sample (sorted global ids); all nodes give the full graph, unscaled.
        num_classes: classes of the task (default: from the labels).
    """

    def __init__(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        values: torch.Tensor,
        features: torch.Tensor,
        node_data: dict[str, torch.Tensor],
        nodes: torch.Tensor,
        num_classes: int | None = None,
    ):
        self.indptr, self.indices, self.values = indptr, indices, values
        total = indptr.numel() - 1
        self.nodes = torch.as_tensor(nodes, dtype=torch.int64)
        self.num_nodes = int(self.nodes.numel())
        self.scale = edge_scale(total, self.num_nodes)
        self._features, self._node_data = features, node_data
        self.feat_dim = int(features.shape[1])
        if num_classes is None:
            num_classes = num_classes_of(node_data.get("label"))
        self.num_classes = int(num_classes)

    def adjacency(self, parity: int, rows: tuple[int, int], cols: tuple[int, int]) -> CSRBlock:
        """Block ``rows × cols`` (sample positions) of the scaled induced Â (both parities
        are the same order)."""
        lo, hi = rows
        blk = induced_block(self.indptr, self.indices, self.nodes, lo, hi)
        # local source ids (the share first, then the sample before it, then after) back to
        # positions in the sample
        local, width = blk.indices, hi - lo
        pos = torch.where(local < width, local + lo, torch.where(local < hi, local - width, local))
        dst = torch.repeat_interleave(
            torch.arange(width), blk.indptr[1:] - blk.indptr[:-1], output_size=local.numel()
        )
        keep = (pos >= cols[0]) & (pos < cols[1])
        dst, pos, eids = dst[keep], pos[keep], blk.edge_ids[keep]
        loops = pos == dst + lo
        vals = self.values.index_select(0, eids)
        vals = torch.where(loops, vals, vals * self.scale)
        shape = (width, cols[1] - cols[0])
        return csr.from_coo(dst, pos - cols[0], vals, shape, lo, cols[0])

    def root(self, parity: int, rows: tuple[int, int], cols: tuple[int, int]) -> CSRBlock:
        """Block of the identity (the root operator; the sample has one order)."""
        ident = torch.arange(self.num_nodes)
        return root_block(ident, ident, rows, cols, self.values.dtype)

    def features(self, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """Features of the sampled nodes at ``rows``, columns ``cols`` (only those rows)."""
        ids = self.nodes[rows[0] : rows[1]]
        return self._features.index_select(0, ids)[:, cols[0] : cols[1]].clone()

    def node_ids(self, order: int, rows: tuple[int, int]) -> torch.Tensor:
        """Global ids of the sampled nodes at ``rows``."""
        return self.nodes[rows[0] : rows[1]].clone()

    def node_data(self, name: str, order: int, rows: tuple[int, int]) -> torch.Tensor:
        """Labels or a mask of the sampled nodes at ``rows``."""
        if name not in self._node_data:
            raise KeyError(f"the graph has no node data {name!r}")
        return self._node_data[name].index_select(0, self.nodes[rows[0] : rows[1]])
