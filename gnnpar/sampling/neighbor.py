"""Uniform neighbour sampling on a CSR graph, in pure PyTorch.

For every destination node ``v`` of a hop and a fan-out ``k``:

- without replacement (the default): ``min(k, deg(v))`` distinct in-edges of ``v``, every
  subset of that size equally likely (Floyd's algorithm, vectorised over nodes: ``k`` rounds
  of a few tensor operations, at most ``O(k^2)`` work per node whatever its degree);
- with replacement: ``k`` in-edges drawn independently (none if ``deg(v) = 0``);
- ``k = -1``: every in-edge.

The random numbers are a hash of ``(batch key, hop, node key, draw)``
(:mod:`gnnpar.sampling.rng`): the neighbours of a node depend on nothing else, not on the
rest of the batch, the thread or the process. The node key is the node id unless
``node_keys`` says otherwise (the distributed sampler passes original ids, so partition
owners draw exactly what a single process draws on the whole graph).

Sampled ids are relabelled so that each block's destinations come first among its sources,
and the other sources follow in order of first appearance (as DGL's ``to_block``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from gnnpar.errors import MissingPackageError, UserError
from gnnpar.graph import Graph
from gnnpar.sampling import compiled
from gnnpar.sampling.block import Block, MiniBatch
from gnnpar.sampling.rng import derive_key, random_bits
from gnnpar.sampling.typed import RelationRows, typed_fields

__all__ = [
    "NeighborSampler",
    "Relabeler",
    "as_node_ids",
    "parse_fanouts",
    "sample_rows",
]

_MAX_DEGREE = 2**31 - 1
BACKENDS = ("auto", "torch", "numba")


def use_numba(backend: str, *tensors: torch.Tensor) -> bool:
    """Whether to run the compiled kernels: ``auto`` uses them when numba is installed and
    the tensors are on the CPU."""
    if backend not in BACKENDS:
        raise UserError(f"unknown sampling backend {backend!r}; use one of {BACKENDS}")
    if backend == "torch":
        return False
    if backend == "numba" and not compiled.available():
        raise MissingPackageError(
            "the numba sampling backend needs numba: pip install 'gnnpar[fast]'"
        )
    return compiled.available() and all(t.device.type == "cpu" for t in tensors)


def parse_fanouts(fanouts: Sequence[int] | str) -> list[int]:
    """Fan-outs as a list of ints, from a sequence or a string like ``"15,10"``.

    Raises:
        ValueError: an empty list, or an entry that is neither ``-1`` nor positive.
    """
    if isinstance(fanouts, str):
        parts = [p.strip() for p in fanouts.split(",") if p.strip()]
        try:
            values: list[Any] = [int(p) for p in parts]
        except ValueError:
            raise UserError(
                f"fan-outs must be comma-separated integers such as '15,10', got {fanouts!r}"
            ) from None
    else:
        values = list(fanouts)
    if not values:
        raise UserError("the fan-out list is empty: give one fan-out per layer, e.g. [15, 10]")
    out = []
    for i, f in enumerate(values):
        if isinstance(f, bool) or not isinstance(f, int) and not hasattr(f, "__index__"):
            raise UserError(f"fan-out {i} must be an integer, got {f!r}")
        f = int(f)
        if f < 1 and f != -1:
            raise UserError(
                f"fan-out {i} is {f}: use a positive number of neighbours, or -1 for all"
            )
        out.append(f)
    return out


def as_node_ids(ids: Any, num_nodes: int, what: str = "seeds") -> torch.Tensor:
    """``ids`` as a 1-D int64 tensor of node ids in ``[0, num_nodes)``; ValueError otherwise."""
    t = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(ids)
    if t.dtype == torch.bool:
        if t.dim() != 1 or t.numel() != num_nodes:
            raise ValueError(f"a boolean {what} mask must have shape ({num_nodes},)")
        return torch.nonzero(t, as_tuple=True)[0]
    if t.is_floating_point() or t.is_complex():
        raise ValueError(f"{what} must be integer node ids, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    t = t.to(torch.int64)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_nodes):
        bad = int(t.min()) if int(t.min()) < 0 else int(t.max())
        raise ValueError(f"{what} contain node id {bad}, outside [0, {num_nodes})")
    return t


def all_positions(start: torch.Tensor, deg: torch.Tensor) -> torch.Tensor:
    """Concatenated ``start[i] + arange(deg[i])``."""
    total = int(deg.sum())
    offsets = torch.zeros(deg.numel() + 1, dtype=torch.int64, device=deg.device)
    torch.cumsum(deg, 0, out=offsets[1:])
    return torch.arange(total, dtype=torch.int64, device=deg.device) + torch.repeat_interleave(
        start - offsets[:-1], deg, output_size=total
    )


def _floyd(bits: torch.Tensor, deg: torch.Tensor, k: int) -> torch.Tensor:
    """Floyd's algorithm for every row at once: ``(k, m)`` distinct offsets in
    ``[0, deg)`` per row, for rows with ``deg >= k``. Consumes ``bits`` (it is overwritten).

    Round ``i`` draws ``t`` uniform in ``[0, j]`` with ``j = deg - k + i`` and keeps ``t``, or
    ``j`` if ``t`` was already taken; the ``k`` picks are a uniform ``k``-subset of
    ``[0, deg)``. Membership is a 64-bit mask per row for rows of degree at most 64 and a
    comparison with the earlier picks for the others.

    The mask rounds are the hot loop, four integer operations on ``m`` numbers each: with
    ``hit = mask & (1 << t)`` (``1 << t`` if ``t`` is taken, else 0), the round adds
    ``1 << t`` and ``hit << (j - t)``, which is ``1 << j`` exactly when ``t`` was taken.
    """
    m = deg.numel()
    ramp = torch.arange(k, dtype=torch.int64, device=deg.device)[:, None]
    gap = torch.add(ramp, deg - (k - 1))  # j + 1
    t = bits.mul_(gap).bitwise_right_shift_(32)  # uniform in [0, j]
    gap -= t
    gap -= 1  # j - t: a taken t moves up by this much
    wide = deg > 64
    num_wide = int(wide.sum())
    if num_wide < m:
        # shifts by 64 or more give 0: harmless for wide rows, redone below
        one = torch.ones((), dtype=torch.int64, device=deg.device)
        bit_t = torch.bitwise_left_shift(one, t)
        hits = torch.zeros_like(t)
        mask = bit_t[0].clone()
        for i in range(1, k):
            hit = torch.bitwise_and(mask, bit_t[i], out=hits[i])
            mask |= bit_t[i]
            mask |= torch.bitwise_left_shift(hit, gap[i])
        taken = hits.bitwise_right_shift_(t)  # 1 where t was taken, else 0
    else:
        taken = torch.zeros_like(t)
    if num_wide:
        rows = torch.nonzero(wide, as_tuple=True)[0]
        tw, jw = t[:, rows], t[:, rows] + gap[:, rows]
        picks = torch.empty_like(tw)
        taken_w = torch.zeros(tw.shape, dtype=torch.int64, device=deg.device)
        picks[0] = tw[0]
        for i in range(1, k):
            taken_w[i] = (picks[:i] == tw[i]).any(0)
            picks[i] = torch.where(taken_w[i].bool(), jw[i], tw[i])
        taken[:, rows] = taken_w
    return t.addcmul_(taken, gap)  # t, or j where t was taken


def sample_rows(
    indptr: torch.Tensor,
    rows: torch.Tensor,
    fanout: int,
    *,
    replace: bool = False,
    key: int | torch.Tensor = 0,
    row_keys: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``fanout`` entries of each CSR row ``rows[i]``.

    Args:
        indptr: CSR offsets of the graph.
        rows: the rows (destination nodes) to sample, int64.
        fanout: entries per row; ``-1`` takes every entry.
        replace: draw with replacement.
        key: the random key of this draw (see :func:`~gnnpar.sampling.rng.derive_key`),
            or one key per row.
        row_keys: the id hashed for each row (default: ``rows``).
        backend: ``"torch"`` (tensor operations), ``"numba"`` (compiled loops, the same
            result bit for bit) or ``"auto"`` (numba when it is installed).

    Returns:
        ``(counts, positions)``: the number of entries taken in each row, and their
        positions in the CSR ``indices`` array, row by row.
    """
    start = indptr.index_select(0, rows)
    deg = indptr.index_select(0, rows + 1) - start
    m = rows.numel()
    if fanout < 0:
        return deg, all_positions(start, deg)
    if m == 0:
        return deg, torch.zeros(0, dtype=torch.int64, device=rows.device)
    k = fanout
    if int(deg.max()) > _MAX_DEGREE:
        raise UserError(f"sampling supports degrees below 2**31, got {int(deg.max())}")
    if use_numba(backend, indptr, rows):
        return compiled.sample_rows(
            indptr, rows, k, replace, key, rows if row_keys is None else row_keys
        )
    bits = random_bits(key, rows if row_keys is None else row_keys, k)  # (k, m)
    ramp = torch.arange(k, dtype=torch.int64, device=rows.device)
    if replace:
        picks = bits.mul_(deg).bitwise_right_shift_(32)
        counts = torch.where(deg > 0, k, 0)
        full = bool((deg > 0).all())
    else:
        short = deg <= k
        counts = deg.clamp(max=k)
        full = not bool(short.any())
        if full:
            picks = _floyd(bits, deg, k)
        else:
            # short rows take offsets 0..deg-1: with deg raised to k their j is the round
            # index; their garbage picks are replaced by that index
            picks = _floyd(bits, deg.clamp(min=k), k)
            torch.where(short, ramp[:, None], picks, out=picks)
    # row-major (m, k) CSR positions: the transpose and the row starts in one operation
    out = torch.empty((m, k), dtype=torch.int64, device=rows.device)
    torch.add(picks.t(), start[:, None], out=out)
    if full:  # every row has k entries
        return counts, out.view(-1)
    return counts, out.masked_select(ramp < counts[:, None])


class Relabeler:
    """Maps sampled global ids to block-local ids: destinations first, then new sources in
    order of first appearance.

    Keeps one scratch array of ``num_nodes`` entries, guarded by a lock so one relabeler can
    serve several threads. Entries are stamped with a call counter that decreases, so stale
    entries of earlier calls never win the minimum and nothing needs clearing.
    """

    _STAMPS = 1 << 30

    def __init__(self, num_nodes: int, backend: str = "auto"):
        use_numba(backend)  # checks the name
        self.backend = backend
        self.num_nodes = int(num_nodes)
        self._scratch: torch.Tensor | None = None
        self._stamp = 0
        self._lock = threading.Lock()

    def __call__(
        self, dst: torch.Tensor, nbr: torch.Tensor, check_unique: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src_nodes, local)``: the block's sources and the local id of every ``nbr``."""
        return self.relabel(torch.cat([dst, nbr]), dst.numel(), check_unique)

    def relabel(
        self, ids: torch.Tensor, num_dst: int, check_unique: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like calling the relabeler with ``ids[:num_dst]`` as destinations and the rest
        as sampled neighbours."""
        n = ids.numel()
        if n >= 1 << 32:
            raise UserError(f"cannot relabel {n} ids at once (at most 2**32)")
        with self._lock:
            if self._scratch is None or self._scratch.device != ids.device:
                self._scratch = torch.full(
                    (self.num_nodes,),
                    torch.iinfo(torch.int64).max,
                    dtype=torch.int64,
                    device=ids.device,
                )
                self._stamp = 0
            self._stamp += 1
            if self._stamp >= self._STAMPS:
                self._scratch.fill_(torch.iinfo(torch.int64).max)
                self._stamp = 1
            tag = (self._STAMPS - self._stamp) << 32
            if use_numba(self.backend, ids):
                src, local, dup = compiled.relabel(self._scratch, tag, ids, num_dst)
                if check_unique and dup >= 0:
                    raise ValueError(
                        f"seed nodes must be distinct; node {dup} appears more than once"
                    )
                return src, local
            vals = torch.arange(tag, tag + n, dtype=torch.int64, device=ids.device)
            mark = self._scratch
            # first occurrence of every id (a min: the same whatever the thread count)
            mark.scatter_reduce_(0, ids, vals, "amin", include_self=True)
            first = mark.index_select(0, ids)
        is_first = first == vals
        rank = torch.cumsum(is_first, 0)
        first -= tag
        local = rank.index_select(0, first)
        local -= 1
        m = num_dst
        if check_unique and m and int(rank[m - 1]) != m:
            dup = int(ids[:m][local[:m] != torch.arange(m, device=ids.device)][0])
            raise ValueError(f"seed nodes must be distinct; node {dup} appears more than once")
        # every occurrence writes its own id into its local slot: duplicates write the same
        src_nodes = torch.empty(int(rank[-1]) if n else 0, dtype=torch.int64, device=ids.device)
        src_nodes.scatter_(0, local, ids)
        return src_nodes, local[m:]


def _without(
    counts: torch.Tensor, pos: torch.Tensor, excluded: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts, pos)`` of a row-by-row sample without the positions marked in
    ``excluded`` (a boolean mask over the CSR positions)."""
    drop = excluded.index_select(0, pos)
    if not bool(drop.any()):
        return counts, pos
    keep = ~drop
    rows = torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=pos.numel())
    return torch.bincount(rows[keep], minlength=counts.numel()), pos[keep]


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=out[1:])
    return out


class NeighborSampler:
    """Multi-hop uniform neighbour sampler producing message-flow blocks.

    Args:
        graph: a :class:`~gnnpar.graph.Graph` (a weighted one's blocks record their edges'
            weights, :attr:`Block.weight`), or ``(indptr, indices)`` of a CSR whose row
            ``i`` lists the in-neighbours of node ``i``.
        fanouts: one fan-out per layer, **in hop order**: ``fanouts[0]`` neighbours of each
            seed, then ``fanouts[1]`` of each of those, ... (PyG's ``num_neighbors`` order;
            DGL's ``NeighborSampler`` lists them input layer first). ``-1`` takes all
            neighbours. A string such as ``"15,10"`` is accepted.
        replace: sample with replacement.
        seed: the default random seed (a batch key derived from it is used when
            :meth:`sample` gets no key).
        node_keys: the id hashed for each node (default: the node id, or a relabelled typed
            graph's original ids); e.g. the original ids of a relabelled graph, so that its
            samples equal the original graph's. Blocks record them (:attr:`Block.keys`).
        backend: ``"auto"`` (compiled loops when numba is installed), ``"torch"`` or
            ``"numba"``: the samples are the same bit for bit.
        per_relation: on a typed graph (:mod:`gnnpar.graph.typed`), draw each layer's
            fan-out per relation (the default, DGL's rule; a layer may then be a mapping
            relation → fan-out, :func:`~gnnpar.sampling.typed.parse_relation_fanouts`), or
            over all relations together (False). Blocks of a typed graph carry each edge's
            relation and each source's node type (:attr:`Block.edge_type`,
            :attr:`Block.node_type`).

    Example::

        >>> sampler = NeighborSampler(graph, [10, 5])
        >>> batch = sampler.sample(torch.tensor([0, 7, 3]), key=derive_key(0, 1))
        >>> [b.num_dst for b in batch.blocks]    # input layer first
        [..., 3]
    """

    def __init__(
        self,
        graph: Graph | tuple[torch.Tensor, torch.Tensor],
        fanouts: Sequence[int] | str,
        replace: bool = False,
        seed: int = 0,
        node_keys: torch.Tensor | None = None,
        backend: str = "auto",
        per_relation: bool = True,
    ):
        weight, types = None, None
        if isinstance(graph, Graph):
            indptr, indices, weight = graph.indptr, graph.indices, graph.edge_weight
            types = graph.types
        else:
            indptr, indices = graph
        #: The typed graph's types (None: untyped); its blocks carry edge and node types.
        self.types = types
        #: The graph's edge weights (None: unweighted); each block records its edges'.
        self.weight = weight
        self.indptr = torch.as_tensor(indptr, dtype=torch.int64)
        self.indices = torch.as_tensor(indices, dtype=torch.int64)
        if self.indptr.dim() != 1 or self.indptr.numel() < 1:
            raise ValueError("indptr must be a 1-D tensor with num_nodes + 1 entries")
        self.num_nodes = self.indptr.numel() - 1
        if int(self.indptr[-1]) != self.indices.numel():
            raise ValueError(
                f"indptr ends at {int(self.indptr[-1])} but there are {self.indices.numel()} "
                "indices"
            )
        self._relation_rows: RelationRows | None = None
        if types is not None and per_relation:
            self._relation_rows = RelationRows(self.indptr, types.edge_type, types, fanouts)
        #: One fan-out per layer (a typed layer's largest relation fan-out).
        self.fanouts = (parse_fanouts(fanouts) if self._relation_rows is None else
                        self._relation_rows.fanouts)  # fmt: skip
        self.replace = bool(replace)
        self.seed = int(seed)
        if node_keys is None and types is not None and types.node_ids is not None:
            node_keys = types.node_ids  # a relabelled typed graph: its original ids
        if node_keys is not None:
            node_keys = torch.as_tensor(node_keys, dtype=torch.int64)
            if node_keys.shape != (self.num_nodes,):
                raise ValueError(
                    f"node_keys must have shape ({self.num_nodes},), got {tuple(node_keys.shape)}"
                )
        self.node_keys = node_keys
        self.backend = backend
        self.relabel = Relabeler(self.num_nodes, backend)
        self._mask: torch.Tensor | None = None
        self._exclusion_lock = threading.Lock()

    @property
    def num_layers(self) -> int:
        """Number of blocks per mini-batch."""
        return len(self.fanouts)

    def sample(
        self, seeds: Any, key: int | None = None, exclude: torch.Tensor | None = None
    ) -> MiniBatch:
        """Sample the blocks of the distinct ``seeds``; ``key`` fixes the random draw
        (default: derived from the sampler's seed). ``exclude``: sorted CSR positions (edge
        ids) that carry no message in this batch (link prediction's target edges and their
        reverses): drawn like the others, then dropped, so a node next to one gets one
        neighbour fewer where it was drawn (the draws of every other edge are unchanged)."""
        seeds = as_node_ids(seeds, self.num_nodes)
        key = derive_key(self.seed) if key is None else int(key)
        if exclude is not None and exclude.numel():  # one mask over the CSR positions
            with self._exclusion_lock:  # marked for this batch, cleared after
                mask = self._exclusion_mask()
                mask.index_fill_(0, exclude, True)
                try:
                    return self._sample(seeds, key, mask)
                finally:
                    mask.index_fill_(0, exclude, False)
        return self._sample(seeds, key, None)

    def _exclusion_mask(self) -> torch.Tensor:
        if self._mask is None or self._mask.device != self.indices.device:
            self._mask = torch.zeros(self.indices.numel(), dtype=torch.bool,
                                     device=self.indices.device)  # fmt: skip
        return self._mask

    def _sample(self, seeds: torch.Tensor, key: int, excluded: torch.Tensor | None) -> MiniBatch:
        frontier = seeds
        blocks = []
        for hop, fanout in enumerate(self.fanouts):
            row_keys = None if self.node_keys is None else self.node_keys[frontier]
            counts, pos = self._draw(frontier, hop, fanout, derive_key(key, hop), row_keys)
            if excluded is not None:
                counts, pos = _without(counts, pos, excluded)
            m = frontier.numel()
            ids = torch.empty(m + pos.numel(), dtype=torch.int64, device=self.indices.device)
            ids[:m] = frontier
            torch.index_select(self.indices, 0, pos, out=ids[m:])
            src, local = self.relabel.relabel(ids, m, check_unique=hop == 0)
            keys = None if self.node_keys is None else self.node_keys.index_select(0, src)
            w = None if self.weight is None else self.weight.index_select(0, pos)
            block = Block(src, frontier.numel(), _indptr(counts), local, pos, keys, None, w)
            if self.types is not None:
                block.edge_type, block.node_type = typed_fields(self.types, pos, src)
            blocks.append(block)
            frontier = src
        blocks.reverse()
        return MiniBatch(seeds, blocks)

    def _draw(
        self, frontier: torch.Tensor, hop: int, fanout: int, key: int, row_keys: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(counts, CSR positions)`` of one hop's draw (per relation on a typed graph)."""

        def sample(indptr: torch.Tensor, rows: torch.Tensor, k: int, keys: Any) -> Any:
            return sample_rows(indptr, rows, k, replace=self.replace, key=key,
                               row_keys=keys, backend=self.backend)  # fmt: skip

        if self._relation_rows is None:
            return sample(self.indptr, frontier, fanout, row_keys)
        keys = frontier if row_keys is None else row_keys
        return self._relation_rows.draw(frontier, hop, sample, keys)

    @property
    def relation_fanouts(self) -> list[list[int]] | None:
        """Per layer, each relation's fan-out (None: one fan-out over all edges)."""
        return None if self._relation_rows is None else self._relation_rows.layers

    def __repr__(self) -> str:
        return (
            f"NeighborSampler(num_nodes={self.num_nodes}, fanouts={self.fanouts}, "
            f"replace={self.replace})"
        )
