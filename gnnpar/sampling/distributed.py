"""Distributed mini-batch sampling and feature fetching over the parts of a partition folder.

Each rank of a data-parallel group owns one part written by :mod:`partitioners` (nodes
relabelled so part ``k`` owns the id range ``node_ranges[k]``; with ``halo_hops = 1`` an owned
node's CSR row holds every in-edge). Ids in this module are those new, global ids.

**Sampling** (:class:`DistNeighborSampler`): every hop is one round of all-to-alls over the
group's axis. The frontier nodes are sent to their owners together with the batch's random
key; each owner samples the rows it holds with :func:`~gnnpar.sampling.neighbor.sample_rows`,
hashing each node's *original* id, and replies with the sampled neighbours. Because the draw
of a node is a function of ``(key, hop, original id)`` and the rows keep the input order of
in-edges, the blocks are **exactly** those a single process draws on the whole graph for the
same seeds and key (after mapping ids with the folder's ``node_map``). A weighted graph's
owners send each sampled edge's weight with it (one more column of the same all-to-all), so
the blocks record :attr:`~gnnpar.sampling.Block.weight` as a single process's do.

**Features** (:class:`FeatureFetcher`): input nodes owned by this rank are read locally; an
optional cache holds the rows of the remote nodes with the most edges into this part; the
rest are requested from their owners with one all-to-all of ids and one of rows. The fetcher
counts requests, cache hits and bytes.

Both only call :mod:`gnnpar.comm`. A prefetching loader runs them in a background thread:
give them a grid of their own (``gnnpar.init`` again makes fresh process groups), so that
their collectives never interleave with the training thread's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gnnpar import comm
from gnnpar.errors import UserError
from gnnpar.fmt import count
from gnnpar.graph.typed import GraphTypes
from gnnpar.grid import ProcessGrid
from gnnpar.sampling.block import Block, MiniBatch
from gnnpar.sampling.inference import BlockModel
from gnnpar.sampling.neighbor import (
    Relabeler,
    as_node_ids,
    parse_fanouts,
    sample_rows,
)
from gnnpar.sampling.rng import derive_key
from gnnpar.sampling.typed import RelationRows

__all__ = [
    "DistNeighborSampler",
    "FeatureFetcher",
    "LocalPart",
    "distributed_inference",
    "fetch_rows",
    "request_rows",
]


def _tensor(a: Any) -> torch.Tensor:
    """A torch tensor of a (possibly read-only, memory-mapped) numpy array."""
    arr = np.asarray(a)
    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = np.array(arr)
    return torch.from_numpy(arr)


@dataclasses.dataclass
class LocalPart:
    """One rank's part, as torch tensors.

    Attributes:
        part_id, num_parts, num_nodes: this part, the number of parts, nodes in the graph.
        starts: ``num_parts + 1`` offsets; part ``k`` owns ids ``starts[k] .. starts[k+1]-1``.
        indptr, indices: local CSR (local ids: owned nodes, then halo nodes).
        local_to_global: global id of every local node.
        orig_ids: original (pre-partition) id of every local node.
        ndata: node data of the owned nodes.
        halo_hops: 1 when owned rows hold every in-edge.
        edge_weight: the weight of every local edge (aligned with ``indices``), or None for
            an unweighted graph.
        edge_type: the relation index of every local edge (aligned with ``indices``) of a
            typed graph (:mod:`gnnpar.graph.typed`), or None for an untyped one.
        types: a typed graph's :class:`~gnnpar.graph.typed.GraphTypes` *of the part*: the
            schema (node types, offsets, relations, target), ``edge_type`` as above and
            ``node_ids`` the original id of every local node, so
            ``types.node_type_of(types.original_ids(local))`` is the type of local nodes
            ``local`` (and ``local_ids_of`` their type-local ids); None when untyped.
    """

    part_id: int
    num_parts: int
    num_nodes: int
    starts: torch.Tensor
    indptr: torch.Tensor
    indices: torch.Tensor
    local_to_global: torch.Tensor
    orig_ids: torch.Tensor
    ndata: dict[str, torch.Tensor]
    halo_hops: int = 1
    edge_weight: torch.Tensor | None = None
    #: the partition folder's meta (its ``source`` names the graph it was cut from)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    edge_type: torch.Tensor | None = None
    types: GraphTypes | None = None

    @classmethod
    def load(cls, folder: str | Path, part_id: int, verify: str | bool = "checksum") -> LocalPart:
        """Read part ``part_id`` of a partition folder, verifying only its own files against
        the manifest (``verify``: ``"checksum"`` or ``"size"``; see
        :func:`partitioners.load_part`)."""
        import partitioners

        p = partitioners.load_part(folder, part_id, mmap=False, verify=verify)
        starts = torch.tensor(
            [r[0] for r in p.meta["node_ranges"]] + [p.meta["node_ranges"][-1][1]],
            dtype=torch.int64,
        )
        edge_type = types = None
        if p.edge_type is not None:
            edge_type = _tensor(p.edge_type).to(torch.int64)
            node_ids = _tensor(p.type_ids).to(torch.int64)
            types = GraphTypes.from_arrays(
                {"edge_type": edge_type, "node_ids": node_ids}, p.meta.get("types"), str(folder)
            )
        return cls(
            part_id=p.part_id,
            num_parts=p.num_parts,
            num_nodes=int(p.meta["num_nodes"]),
            starts=starts,
            indptr=_tensor(p.indptr).to(torch.int64),
            indices=_tensor(p.indices).to(torch.int64),
            local_to_global=_tensor(p.local_to_global).to(torch.int64),
            orig_ids=_tensor(p.orig_ids).to(torch.int64),
            ndata={k: _tensor(v) for k, v in p.ndata.items()},
            halo_hops=int(p.meta["halo_hops"]),
            edge_weight=None if p.edge_weight is None else _tensor(p.edge_weight),
            meta=p.meta,
            edge_type=edge_type,
            types=types,
        )

    @property
    def start(self) -> int:
        """First owned global id."""
        return int(self.starts[self.part_id])

    @property
    def stop(self) -> int:
        """One past the last owned global id."""
        return int(self.starts[self.part_id + 1])

    @property
    def num_owned(self) -> int:
        """Number of owned nodes."""
        return self.stop - self.start

    @property
    def owned_nodes(self) -> torch.Tensor:
        """Global ids of the owned nodes."""
        return torch.arange(self.start, self.stop, dtype=torch.int64)

    @property
    def halo_nodes(self) -> torch.Tensor:
        """Global ids of the halo nodes (increasing)."""
        return self.local_to_global[self.num_owned :]

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """The part that owns every global id."""
        return torch.searchsorted(self.starts, ids, right=True) - 1

    def local_block(self) -> Block:
        """The part as a block: destinations = owned nodes, sources = owned then halo
        nodes, every in-edge of the owned nodes (needs ``halo_hops = 1``)."""
        if self.halo_hops != 1:
            raise UserError("the part has no halo (halo_hops = 0): write the folder with halo=1")
        n = self.num_owned
        edges = int(self.indptr[n])
        w = None if self.edge_weight is None else self.edge_weight[:edges]
        block = Block(
            self.local_to_global, n, self.indptr[: n + 1], self.indices[:edges], weight=w,
            src_keys=None if self.types is None else self.orig_ids,
        )  # fmt: skip
        if self.types is not None:  # a typed part: relations of its edges, types of its nodes
            block.edge_type = self.edge_type[:edges]
            block.node_type = self.types.node_type_of(self.orig_ids)
        return block


def _check_group(part: LocalPart, grid: ProcessGrid, axis: str) -> None:
    if grid.size(axis) != part.num_parts or grid.rank(axis) != part.part_id:
        raise UserError(
            f"part {part.part_id} of {part.num_parts} does not fit rank {grid.rank(axis)} of "
            f"the {count(grid.size(axis), 'rank')} on axis {axis!r}: each rank must load the "
            "part with its own index, and there must be one part per rank"
        )


def _group_by_owner(
    ids: torch.Tensor, owner: torch.Tensor, parts: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(order, ids[order], counts)``: ids sorted by owner (stably), with counts per owner."""
    order = torch.sort(owner, stable=True).indices
    counts = torch.bincount(owner, minlength=parts)
    return order, ids.index_select(0, order), counts.tolist()


def request_rows(
    ids: torch.Tensor,
    owner: torch.Tensor,
    table: torch.Tensor,
    start: int,
    grid: ProcessGrid,
    axis: str,
) -> torch.Tensor:
    """Rows of ``ids`` from their owners (collective over ``axis``).

    Every rank passes the global ids it wants and their owners; each rank serves requests
    from ``table``, its owned rows (row ``i`` = global id ``start + i``). Two all-to-alls
    (ids, then rows) plus one of counts.
    """
    with torch.no_grad():
        return fetch_rows(table, ids, owner, start, grid, axis)


def _without_pairs(
    counts: torch.Tensor,
    pos: torch.Tensor,
    local: torch.Tensor,
    orig_ids: torch.Tensor,
    row_keys: torch.Tensor,
    exclude: torch.Tensor,
    num_nodes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row-by-row sample (``counts`` per row, CSR ``pos``, local source ids) without the
    messages whose original (source, destination) pair is in ``exclude`` (sorted keys)."""
    rows = torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=pos.numel())
    keys = row_keys.index_select(0, rows) * num_nodes + orig_ids.index_select(0, local)
    at = torch.searchsorted(exclude, keys).clamp_(max=exclude.numel() - 1)
    keep = exclude.index_select(0, at) != keys
    if bool(keep.all()):
        return counts, pos, local
    return torch.bincount(rows[keep], minlength=counts.numel()), pos[keep], local[keep]


class _FetchRows(torch.autograd.Function):
    """:func:`fetch_rows`: forward as :func:`request_rows`; backward sends each row's
    gradient back to its owner, which sums the gradients of a row asked for several times."""

    @staticmethod
    def forward(ctx, table, ids, owner, start, grid, axis):  # noqa: D102
        p = grid.size(axis)
        order, send, counts = _group_by_owner(ids, owner, p)
        recv_counts = comm.exchange_counts(counts, grid, axis)
        wanted = comm.all_to_all(send, grid, axis, counts, recv_counts)
        rows = table.index_select(0, wanted - start)
        back = comm.all_to_all(rows, grid, axis, recv_counts, counts)
        out = torch.empty_like(back)
        out[order] = back
        ctx.save_for_backward(order, wanted)
        ctx.meta = (counts, recv_counts, start, grid, axis, table.shape)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        order, wanted = ctx.saved_tensors
        counts, recv_counts, start, grid, axis, shape = ctx.meta
        sent = comm.all_to_all(grad.index_select(0, order).contiguous(), grid, axis, counts,
                               recv_counts)  # fmt: skip
        out = torch.zeros(shape, dtype=grad.dtype, device=grad.device)
        out.index_add_(0, wanted - start, sent)
        return out, None, None, None, None, None


def fetch_rows(
    table: torch.Tensor,
    ids: torch.Tensor,
    owner: torch.Tensor,
    start: int,
    grid: ProcessGrid,
    axis: str,
) -> torch.Tensor:
    """:func:`request_rows` with its adjoint: the rows of ``ids`` from their owners'
    ``table`` (row ``i`` = global id ``start + i``), differentiable with respect to
    ``table``. Forward: one all-to-all of counts, one of ids, one of rows; backward: one of
    gradients (the same row splits, reversed), summed into the owners' rows."""
    return _FetchRows.apply(table, ids, owner, int(start), grid, axis)


class DistNeighborSampler:
    """Neighbour sampling across the parts of a partition, one all-to-all round per hop.

    Args:
        part: this rank's :class:`LocalPart` (``halo_hops = 1``).
        fanouts: one per layer, in hop order (as :class:`~gnnpar.sampling.NeighborSampler`).
        grid: the grid whose ``axis`` groups the ranks that hold the parts.
        axis: the grid axis (default ``"data"``).
        replace: sample with replacement.
        seed: default random seed.
        per_relation: a typed part's (:attr:`LocalPart.types`) fan-outs per relation, as
            :class:`~gnnpar.sampling.NeighborSampler` draws them (the owners draw each
            relation's share; a hop may map relations to fan-outs); False: over all relations.
            Blocks of a typed part carry each edge's relation and each source's node type.

    :meth:`sample` is collective: every rank of the axis calls it the same number of times
    (a rank with no seeds passes an empty tensor). Byte counts of the rounds go to
    ``batch.stats["sample_bytes"]``.
    """

    def __init__(
        self,
        part: LocalPart,
        fanouts: Sequence[int] | str,
        grid: ProcessGrid,
        axis: str = "data",
        replace: bool = False,
        seed: int = 0,
        per_relation: bool = True,
    ):
        _check_group(part, grid, axis)
        if part.halo_hops != 1:
            raise UserError("distributed sampling needs parts written with halo=1")
        self.part = part
        n = part.num_owned
        self._relation_rows: RelationRows | None = None
        if part.types is not None and per_relation:  # the owned rows' edges, per relation
            edges = part.edge_type[: int(part.indptr[n])]
            self._relation_rows = RelationRows(part.indptr[: n + 1], edges, part.types, fanouts)
        self.fanouts = (parse_fanouts(fanouts) if self._relation_rows is None else
                        self._relation_rows.fanouts)  # fmt: skip
        self.grid, self.axis = grid, axis
        self.replace = bool(replace)
        self.seed = int(seed)
        self.num_nodes = part.num_nodes
        self.relabel = Relabeler(part.num_nodes)
        self._indptr = part.indptr[: n + 1]
        self._row_keys = part.orig_ids[:n]

    @property
    def num_layers(self) -> int:
        """Number of blocks per mini-batch."""
        return len(self.fanouts)

    def _draw(
        self, rows: torch.Tensor, hop: int, fanout: int, keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The owner's draw of its ``rows`` (one key per row): per relation on a typed part."""
        row_keys = self._row_keys.index_select(0, rows)

        def sample(indptr: torch.Tensor, r: torch.Tensor, k: int, hashed: torch.Tensor) -> Any:
            return sample_rows(indptr, r, k, replace=self.replace, key=keys, row_keys=hashed)

        if self._relation_rows is None:
            return sample(self._indptr, rows, fanout, row_keys)
        return self._relation_rows.draw(rows, hop, sample, row_keys)

    def _hop(
        self,
        frontier: torch.Tensor,
        fanout: int,
        key: int,
        exclude: torch.Tensor | None = None,
        hop: int = 0,
    ) -> tuple[torch.Tensor, ...]:
        """Counts, original ids of every frontier node, and sampled neighbours (global ids,
        original ids and, for a weighted graph, the edges' weights (else None), row by row).
        The owners send the original ids with their answers, so every node of a batch is
        known by its original id (for grid-independent dropout)."""
        grid, axis, part = self.grid, self.axis, self.part
        p = grid.size(axis)
        order, send, counts = _group_by_owner(frontier, part.owner(frontier), p)
        header = torch.tensor([[c, key] for c in counts], dtype=torch.int64).reshape(p, 2)
        got = comm.all_to_all(header, grid, axis, [1] * p, [1] * p)
        recv_counts, recv_keys = got[:, 0].tolist(), got[:, 1]
        wanted = comm.all_to_all(send, grid, axis, counts, recv_counts)
        # Owner side: sample the rows asked for, each requester with its own key.
        rows = wanted - part.start
        by_requester = torch.repeat_interleave(torch.arange(p), torch.tensor(recv_counts))
        n_out, pos = self._draw(rows, hop, fanout, recv_keys.index_select(0, by_requester))
        local = part.indices.index_select(0, pos)
        if exclude is not None and exclude.numel():  # drop the batch's target edges
            n_out, pos, local = _without_pairs(
                n_out, pos, local, part.orig_ids, self._row_keys.index_select(0, rows), exclude,
                self.num_nodes,
            )  # fmt: skip
        columns = [
            part.local_to_global.index_select(0, local),
            part.orig_ids.index_select(0, local),
        ]
        if part.edge_weight is not None:  # the weight's float64 bits ride in an int64 column
            columns.append(part.edge_weight.index_select(0, pos).double().view(torch.int64))
        if part.types is not None:  # each edge's relation, in the last column
            columns.append(part.edge_type.index_select(0, pos))
        nbr = torch.stack(columns, 1)
        seg = torch.zeros(p, dtype=torch.int64).index_add_(0, by_requester, n_out)
        # Requester side: counts (and original ids) per frontier node, then the lists.
        answer = torch.stack([n_out, self._row_keys.index_select(0, rows)], 1)
        got = comm.all_to_all(answer, grid, axis, recv_counts, counts)
        got_counts, got_keys = got[:, 0].contiguous(), got[:, 1]
        mine = torch.zeros(p, dtype=torch.int64).index_add_(
            0, torch.repeat_interleave(torch.arange(p), torch.tensor(counts)), got_counts
        )
        got_nbr = comm.all_to_all(nbr, grid, axis, seg.tolist(), mine.tolist())
        # Back to frontier order: frontier node order[g] has the g-th list.
        offsets = torch.cumsum(got_counts, 0) - got_counts
        f_counts = torch.empty_like(got_counts)
        f_counts[order] = got_counts
        f_keys = torch.empty_like(got_keys)
        f_keys[order] = got_keys
        f_offsets = torch.empty_like(offsets)
        f_offsets[order] = offsets
        total = int(f_counts.sum())
        ptr = torch.cumsum(f_counts, 0) - f_counts
        positions = torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(
            f_offsets - ptr, f_counts, output_size=total
        )
        got_nbr = got_nbr.index_select(0, positions)
        weight = None
        if part.edge_weight is not None:
            weight = got_nbr[:, 2].contiguous().view(torch.float64).to(part.edge_weight.dtype)
        etype = None if part.types is None else got_nbr[:, -1].contiguous()
        return (f_counts, f_keys, got_nbr[:, 0].contiguous(), got_nbr[:, 1].contiguous(),
                weight, etype)  # fmt: skip

    def sample(
        self, seeds: Any, key: int | None = None, exclude: torch.Tensor | None = None
    ) -> MiniBatch:
        """Blocks of the distinct global ``seeds`` (collective; see the class docstring).
        ``exclude``: sorted :func:`~gnnpar.graph.edge_split.edge_keys` of original-id pairs
        (source, destination) that carry no message (link prediction's target edges; every
        rank passes the same set): the owners draw as usual, then drop them, as
        :meth:`NeighborSampler.sample <gnnpar.sampling.NeighborSampler.sample>` does."""
        seeds = as_node_ids(seeds, self.num_nodes)
        key = derive_key(self.seed) if key is None else int(key)
        frontier = seeds
        blocks = []
        with comm.record(self.grid) as traffic:
            for hop, fanout in enumerate(self.fanouts):
                counts, f_keys, nbr, nbr_keys, w, etype = self._hop(
                    frontier, fanout, derive_key(key, hop), exclude, hop
                )
                src, local = self.relabel(frontier, nbr, check_unique=hop == 0)
                indptr = torch.zeros(counts.numel() + 1, dtype=torch.int64)
                torch.cumsum(counts, 0, out=indptr[1:])
                keys = torch.empty(src.numel(), dtype=torch.int64)
                keys[: frontier.numel()] = f_keys
                keys[local] = nbr_keys
                block = Block(src, frontier.numel(), indptr, local, src_keys=keys, weight=w)
                if etype is not None:  # a typed part: each edge's relation, each source's type
                    block.edge_type = etype
                    block.node_type = self.part.types.node_type_of(keys)
                blocks.append(block)
                frontier = src
        blocks.reverse()
        batch = MiniBatch(seeds, blocks)
        batch.stats["sample_bytes"] = float(traffic.bytes(axis=self.axis))
        return batch


class FeatureFetcher:
    """Rows of a node-data table (``feat`` by default) for any global ids, over the parts.

    Owned rows are read locally, cached remote rows from the cache, the rest fetched from
    their owners (collective: every rank calls :meth:`fetch` the same number of times).

    Args:
        part: this rank's part; ``part.ndata[key]`` holds the owned rows.
        grid, axis: the ranks holding the parts.
        cache_size: remote rows to cache. The candidates are the halo nodes, ranked by how
            many edges they send into this part (their out-degree towards it: the nodes the
            first hops request most), ties by id. Building the cache is collective.
        key: which node data to serve.

    :attr:`stats` counts, over the :meth:`fetch` calls, ``requests`` (ids asked for),
    ``local`` (owned), ``remote`` (not owned), ``hits`` (remote ids served by the cache),
    ``fetched`` (rows requested from owners) and ``bytes`` (what this rank sent: its id
    requests, the rows it served, and the counts, as :mod:`gnnpar.comm` counts them).
    Filling the cache is counted apart, in :attr:`cache_bytes`.
    """

    def __init__(
        self,
        part: LocalPart,
        grid: ProcessGrid,
        axis: str = "data",
        cache_size: int = 0,
        key: str = "feat",
    ):
        _check_group(part, grid, axis)
        if key not in part.ndata:
            raise UserError(f"the part has no node data {key!r} (it has {sorted(part.ndata)})")
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 0:
            raise UserError(f"cache_size must be an integer >= 0, got {cache_size!r}")
        self.part, self.grid, self.axis, self.key = part, grid, axis, key
        self.table = part.ndata[key]
        self.stats: dict[str, int] = dict.fromkeys(
            ("requests", "local", "remote", "hits", "fetched", "bytes"), 0
        )
        self.cache_ids = self._cache_candidates(cache_size)
        self.cache_rows, self.cache_bytes = self._fetch_remote(self.cache_ids)

    def _cache_candidates(self, size: int) -> torch.Tensor:
        part = self.part
        n = part.num_owned
        if size == 0:
            return torch.zeros(0, dtype=torch.int64)
        local = part.indices[: int(part.indptr[n])]
        freq = torch.bincount(local, minlength=part.local_to_global.numel())[n:]
        halo = part.halo_nodes
        # most edges first; ties by increasing id (halo ids are increasing already)
        order = torch.sort(-freq, stable=True).indices[:size]
        return torch.sort(halo.index_select(0, order)).values

    def _fetch_remote(self, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        with comm.record(self.grid) as traffic:
            rows = request_rows(
                ids, self.part.owner(ids), self.table, self.part.start, self.grid, self.axis
            )
        return rows, traffic.bytes(axis=self.axis)

    @property
    def cache_size(self) -> int:
        """Rows held in the cache."""
        return int(self.cache_ids.numel())

    def hit_rate(self) -> float:
        """Cache hits over remote requests so far (0 when nothing remote was asked)."""
        return self.stats["hits"] / self.stats["remote"] if self.stats["remote"] else 0.0

    def fetch(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the global ``ids`` (collective)."""
        ids = ids.to(torch.int64)
        part = self.part
        out = torch.empty((ids.numel(), *self.table.shape[1:]), dtype=self.table.dtype)
        owned = (ids >= part.start) & (ids < part.stop)
        local_at = torch.nonzero(owned, as_tuple=True)[0]
        out[local_at] = self.table.index_select(0, ids[local_at] - part.start)
        remote_at = torch.nonzero(~owned, as_tuple=True)[0]
        remote = ids[remote_at]
        hit = torch.zeros(remote.numel(), dtype=torch.bool)
        if self.cache_ids.numel() and remote.numel():
            slot = torch.searchsorted(self.cache_ids, remote).clamp(max=self.cache_ids.numel() - 1)
            hit = self.cache_ids[slot] == remote
            out[remote_at[hit]] = self.cache_rows.index_select(0, slot[hit])
        miss_at = remote_at[~hit]
        out[miss_at], nbytes = self._fetch_remote(ids[miss_at])
        self.stats["bytes"] += nbytes
        self.stats["fetched"] += int(miss_at.numel())
        self.stats["requests"] += int(ids.numel())
        self.stats["local"] += int(local_at.numel())
        self.stats["remote"] += int(remote.numel())
        self.stats["hits"] += int(hit.sum())
        return out

    __call__ = fetch


@torch.no_grad()
def distributed_inference(
    model: BlockModel,
    part: LocalPart,
    features: torch.Tensor,
    grid: ProcessGrid,
    axis: str = "data",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Layer-wise full-neighbour inference over the parts: the outputs of this rank's owned
    nodes. Before each layer the halo rows of the previous layer's outputs are fetched from
    their owners (collective over ``grid``, whose device holds the exchanged rows: the
    host for the sampler's gloo grid). The model runs on ``device`` (default: the grid's);
    each layer's input crosses to the model's device once, its output back once."""
    _check_group(part, grid, axis)
    device = grid.device if device is None else torch.device(device)
    block = part.local_block().to(device)
    halo = part.halo_nodes
    owner = part.owner(halo)
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        h = features.to(grid.device)
        for i in range(model.num_layers):
            h_halo = request_rows(halo, owner, h, part.start, grid, axis)
            out = model.forward_layer(i, block, torch.cat([h, h_halo]).to(device))
            h = out if i == model.num_layers - 1 else out.to(grid.device)
        return h
    finally:
        if was_training:
            model.train()
