"""Edge mini-batches for link prediction: seed edges → one set of blocks over both endpoints
and the negatives, with the seed edges (and their reverses) carrying no message.

:class:`EdgeSampler` is a sampler in the :class:`~gnnpar.sampling.loader.Sampler` sense whose
"seeds" are **edge ids** (columns of the split's ``train`` pairs), so the one
:class:`~gnnpar.sampling.NodeLoader` orders, batches, shares over data-parallel ranks,
prefetches and checkpoints edge batches exactly as it does node batches (give it
``num_nodes=`` the number of edges). For the batch of edge ids ``e``:

1. the positives ``(src[e], dst[e])`` and ``k`` negative destinations per positive from the
   :class:`~gnnpar.sampling.negative.NegativeSampler` (keyed by the edge id, so a positive's
   negatives do not depend on the batch or the rank);
2. the distinct endpoints of all of them are the seeds of one neighbour sample
   (:class:`~gnnpar.sampling.NeighborSampler`) whose blocks leave out the CSR positions of
   ``src→dst`` and, with ``exclude="reverse"``, of ``dst→src`` (DGL's ``reverse_id``): a target
   edge never carries a message in its own batch, so the model cannot read the answer;
3. :attr:`MiniBatch.pairs <gnnpar.sampling.MiniBatch.pairs>` (2, b) and
   :attr:`~gnnpar.sampling.MiniBatch.neg` (b, k) index the seeds' output rows.
"""

from __future__ import annotations

from typing import Any

import torch

from gnnpar.errors import UserError
from gnnpar.graph import Graph
from gnnpar.graph.edge_split import edge_keys
from gnnpar.sampling.block import MiniBatch
from gnnpar.sampling.neighbor import NeighborSampler
from gnnpar.sampling.rng import derive_key

__all__ = ["EXCLUDE", "EdgeSampler", "graph_keys", "sorted_edge_keys"]

#: What a batch's target edges take out of its message passing.
EXCLUDE = ("reverse", "self", "none")
_NEGATIVES = 0x4E45  # salt of the negatives' key


def graph_keys(graph: Graph) -> torch.Tensor:
    """The sorted :func:`~gnnpar.graph.edge_split.edge_keys` of a coalesced graph's edges in
    CSR order (position ``i`` is edge id ``i``); UserError for a graph with repeated edges
    or unsorted rows (coalesce it first)."""
    keys = edge_keys(*graph.edges(), graph.num_nodes)
    if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):
        raise UserError(
            f"{graph.name}: link prediction needs a coalesced graph (sorted rows, no repeated "
            "edges): use graph.coalesce()"
        )
    return keys


def sorted_edge_keys(graph: Graph) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys, positions)``: the :func:`~gnnpar.graph.edge_split.edge_keys` of every edge,
    sorted, and the CSR position of each; for a graph whose CSR is not in key order or
    repeats a pair (a typed graph: one pair in two relations, rows ordered by relation)."""
    keys, positions = torch.sort(edge_keys(*graph.edges(), graph.num_nodes), stable=True)
    return keys, positions


class EdgeSampler:
    """Blocks of a batch of seed edges (module docstring).

    Args:
        sampler: the neighbour sampler of the message-passing graph.
        pairs: ``(2, E)`` the training positives (edge id = column).
        negatives: draws ``(b, k)`` negative destinations (``sample(src, ids, key)``), or
            None for none (edge classification on labelled pairs).
        keys: :func:`graph_keys` of a local sampler's graph (the CSR positions to exclude
            are found in it), or :func:`sorted_edge_keys` of one that is not coalesced (every
            edge of an excluded pair leaves, in each relation of a typed graph), or None for
            a :class:`~gnnpar.sampling.DistNeighborSampler`, whose part owners drop the
            excluded pairs by their original ids.
        exclude: ``"reverse"`` (the edge and its reverse), ``"self"`` (the edge) or
            ``"none"`` (nothing: leaks the target, for ablations only).
        node_map: the sampler's id of every node by original id (a partition's global ids),
            or None when they are the same; ``pairs`` and the negatives are original ids.
    """

    def __init__(
        self,
        sampler: NeighborSampler,
        pairs: torch.Tensor,
        negatives: Any | None,
        keys: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
        exclude: str = "reverse",
        node_map: torch.Tensor | None = None,
    ) -> None:
        if exclude not in EXCLUDE:
            raise UserError(f"exclude {exclude!r}: one of {', '.join(EXCLUDE)}")
        if pairs.dim() != 2 or pairs.shape[0] != 2:
            raise UserError(f"pairs must be (2, E), got {tuple(pairs.shape)}")
        self.sampler, self.pairs, self.negatives = sampler, pairs, negatives
        self.positions: torch.Tensor | None = None
        if isinstance(keys, tuple):
            keys, self.positions = keys
        self.keys, self.exclude, self.node_map = keys, exclude, node_map
        self.node_count = sampler.num_nodes
        #: The loader's id bound: edge ids lie in ``[0, num_nodes)``.
        self.num_nodes = int(pairs.shape[1])

    #: :class:`~gnnpar.sampling.NodeLoader` passes the global batch's edge ids (``batch=``).
    reads_global_batch = True

    def excluded(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """Sorted CSR positions of ``src→dst`` (and ``dst→src`` with ``"reverse"``) where
        they are edges of the graph; for a distributed sampler (no ``keys``), the sorted
        original-id pair keys themselves."""
        if self.exclude == "none" or (self.keys is not None and self.keys.numel() == 0):
            return torch.zeros(0, dtype=torch.int64)
        n = self.node_count
        wanted = edge_keys(src, dst, n)
        if self.exclude == "reverse":
            wanted = torch.cat([wanted, edge_keys(dst, src, n)])
        if self.keys is None:
            return torch.unique(wanted)
        if self.positions is not None:  # every position of a repeated key
            lo = torch.searchsorted(self.keys, wanted)
            count = torch.searchsorted(self.keys, wanted, right=True) - lo
            total = int(count.sum())
            first = torch.repeat_interleave(lo, count, output_size=total)
            ramp = torch.arange(total) - torch.repeat_interleave(
                torch.cumsum(count, 0) - count, count, output_size=total
            )
            return torch.unique(self.positions.index_select(0, first + ramp))
        pos = torch.searchsorted(self.keys, wanted).clamp_(max=self.keys.numel() - 1)
        return torch.unique(pos[self.keys.index_select(0, pos) == wanted])

    def sample(
        self, seeds: torch.Tensor, key: int | None = None, batch: torch.Tensor | None = None
    ) -> MiniBatch:
        """The blocks of the edges ``seeds`` (edge ids), with ``pairs``, ``neg`` and
        ``edge_ids`` set; the batch's ``seeds`` are the distinct endpoint nodes. ``batch``:
        the edge ids of the whole global batch, whose every edge is excluded from message
        passing (default: ``seeds``)."""
        key = derive_key(self.sampler.seed) if key is None else int(key)
        ids = seeds.to(torch.int64)
        every = ids if batch is None else batch.to(torch.int64)
        src, dst = self.pairs[0].index_select(0, ids), self.pairs[1].index_select(0, ids)
        b = ids.numel()
        if self.negatives is not None:
            neg = self.negatives.sample(src, ids, derive_key(key, _NEGATIVES))
        else:
            neg = torch.zeros((b, 0), dtype=torch.int64)
        ends = torch.cat([src, dst, neg.reshape(-1)])
        if self.node_map is not None:
            ends = self.node_map.index_select(0, ends)
        nodes, where = torch.unique(ends, return_inverse=True)
        excluded = self.excluded(self.pairs[0][every], self.pairs[1][every])
        batch = self.sampler.sample(nodes, key, exclude=excluded)
        batch.pairs = torch.stack([where[:b], where[b : 2 * b]])
        batch.neg = where[2 * b :].view(b, neg.shape[1])
        batch.edge_ids = ids
        return batch

    def __repr__(self) -> str:
        return f"EdgeSampler(edges={self.num_nodes}, exclude={self.exclude!r}, {self.sampler!r})"
