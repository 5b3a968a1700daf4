"""GraphSAINT subgraph samplers (Zeng et al., ICLR 2020) with the paper's normalisation.

Every training step is one subgraph: a node set drawn by a sampler, and the subgraph it
induces (:func:`~gnnpar.sampling.vertex.induced_block`), used by every layer. Three samplers:

- :class:`SaintNodeSampler`: ``budget`` nodes drawn with replacement, ``P(u)`` proportional
  to ``||Â_{:,u}||²`` (Â the mean-aggregation matrix, ``Â_{vu} = 1 / deg(v)``; the paper)
  or to ``deg(u)`` (the authors' code);
- :class:`SaintEdgeSampler`: ``budget`` edges drawn with replacement, ``P(u -> v)``
  proportional to ``1 / deg(u) + 1 / deg(v)``; the subgraph is induced by their ends;
- :class:`SaintWalkSampler`: ``budget`` roots uniform over the nodes, each walking
  ``walk_length`` steps to uniform in-neighbours.

**Normalisation** (the paper's section 3.2), estimated by pre-sampling ``presample``
subgraphs and counting how often every node (``C_v``) and edge (``C_{u,v}``) appears:

- aggregation: edge ``u -> v`` of a subgraph carries ``Â_{vu} / α_{u,v}`` with
  ``α_{u,v} = C_{u,v} / C_v``, so that a node's aggregated input is, in expectation over
  subgraphs that hold it, its full-graph mean;
- loss: training node ``v`` of a subgraph weighs ``1 / (|V_train| p_v)`` with
  ``p_v = C_v / presample``, so that the weighted sum of a subgraph's losses is, in
  expectation, the mean loss over all training nodes.

Counts below 1 (never pre-sampled) are taken as 1. Every draw is a counter-based hash of
``(seed, epoch, index)`` (:mod:`gnnpar.sampling.rng`): a subgraph is reproducible from its
seed, whatever the process or thread.
"""

from __future__ import annotations

from typing import Any

import torch

from gnnpar.errors import UserError
from gnnpar.graph import Graph
from gnnpar.sampling.block import MiniBatch
from gnnpar.sampling.rng import derive_key, random_bits, random_unit, uniform_below
from gnnpar.sampling.vertex import induced_block

__all__ = [
    "NODE_PROBABILITIES",
    "SaintEdgeSampler",
    "SaintNodeSampler",
    "SaintSampler",
    "SaintWalkSampler",
    "subgraph_batch",
]

_PRESAMPLE = 0x5A1E  # salts that keep pre-sampling and training draws apart
_TRAIN = 0x7A15


def graph_csr(
    graph: Graph | tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """A graph's (or an ``(indptr, indices)`` pair's) CSR as int64 tensors."""
    indptr, indices = (graph.indptr, graph.indices) if isinstance(graph, Graph) else graph
    indptr = torch.as_tensor(indptr, dtype=torch.int64)
    indices = torch.as_tensor(indices, dtype=torch.int64)
    if indptr.dim() != 1 or indptr.numel() < 2 or int(indptr[-1]) != indices.numel():
        raise ValueError("the graph's CSR must have num_nodes + 1 offsets ending at its edges")
    return indptr, indices


def graph_weight(graph: Any) -> torch.Tensor | None:
    """A weighted :class:`~gnnpar.graph.Graph`'s edge weights (float64), else None."""
    w = graph.edge_weight if isinstance(graph, Graph) else None
    return None if w is None else w.to(torch.float64)


def train_mask_of(graph: Any, train_mask: Any, num_nodes: int) -> torch.Tensor:
    """The training mask (default: the graph's ``train_mask``, else every node)."""
    if train_mask is None and isinstance(graph, Graph):
        train_mask = graph.ndata.get("train_mask")
    if train_mask is None:
        return torch.ones(num_nodes, dtype=torch.bool)
    mask = torch.as_tensor(train_mask).to(torch.bool)
    if mask.shape != (num_nodes,):
        raise ValueError(f"train_mask must have shape ({num_nodes},), got {tuple(mask.shape)}")
    return mask


def weighted_draw(key: int, cdf: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` indices drawn with replacement from the distribution whose cumulative sums
    are ``cdf`` (float64, ending at the total); draw ``i`` depends only on ``(key, i)``."""
    u = random_unit(key, torch.arange(count, dtype=torch.int64)) * float(cdf[-1])
    return torch.searchsorted(cdf, u, right=True).clamp(max=cdf.numel() - 1)


def subgraph_batch(
    indptr: torch.Tensor,
    indices: torch.Tensor,
    nodes: torch.Tensor,
    num_layers: int,
    seed_weight: torch.Tensor,
    edge_weight: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
) -> MiniBatch:
    """The mini-batch of the subgraph induced by ``nodes`` (sorted ids): every node is a
    seed, the same block serves every layer. ``seed_weight``, ``edge_weight`` (a
    normalisation) and ``weight`` (the graph's edge weights) are per node and per CSR edge of
    the whole graph; the batch gets the subgraph's entries."""
    block = induced_block(indptr, indices, nodes)
    if edge_weight is not None:
        block.edge_weight = edge_weight.index_select(0, block.edge_ids)
    if weight is not None:
        block.weight = weight.index_select(0, block.edge_ids)
    batch = MiniBatch(nodes, [block] * num_layers)
    batch.seed_weight = seed_weight.index_select(0, nodes)
    batch.stats["subgraph_nodes"] = float(nodes.numel())
    batch.stats["subgraph_edges"] = float(block.num_edges)
    return batch


class SaintSampler:
    """The shared part of the GraphSAINT samplers: pre-sampling, normalisation, batches.

    Subclasses define :meth:`nodes` (the node set of a random key).

    Args:
        graph: a :class:`~gnnpar.graph.Graph` or ``(indptr, indices)`` (row ``v`` lists
            the in-neighbours of ``v``).
        num_layers: blocks per mini-batch (the same induced block for every layer).
        train_mask: the nodes whose loss counts (default: the graph's ``train_mask``).
        presample: subgraphs drawn to estimate the normalisation (at least 1).
        seed: the random seed of pre-sampling and training draws.
    """

    def __init__(
        self,
        graph: Graph | tuple[torch.Tensor, torch.Tensor],
        num_layers: int,
        *,
        train_mask: Any = None,
        presample: int = 50,
        seed: int = 0,
    ):
        self.indptr, self.indices = graph_csr(graph)
        self.weight = graph_weight(graph)
        self.num_nodes = self.indptr.numel() - 1
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise UserError(f"num_layers must be an integer >= 1, got {num_layers!r}")
        if isinstance(presample, bool) or not isinstance(presample, int) or presample < 1:
            raise UserError(f"presample must be an integer >= 1, got {presample!r}")
        self.num_layers, self.presample, self.seed = num_layers, presample, int(seed)
        self.train_mask = train_mask_of(graph, train_mask, self.num_nodes)
        self.degree = self.indptr[1:] - self.indptr[:-1]
        self._normalise()

    # ------------------------------------------------------------------ to define
    def nodes(self, key: int) -> torch.Tensor:
        """The sorted, distinct node ids of the subgraph of ``key``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ normalisation
    def _normalise(self) -> None:
        """Pre-sample ``presample`` subgraphs; set the per-node loss weights and per-edge
        aggregation weights (the paper's λ and α, from the counts)."""
        node_count = torch.zeros(self.num_nodes, dtype=torch.float64)
        edge_count = torch.zeros(self.indices.numel(), dtype=torch.float64)
        sizes = 0
        for r in range(self.presample):
            nodes = self.nodes(derive_key(self.seed, _PRESAMPLE, r))
            block = induced_block(self.indptr, self.indices, nodes)
            node_count[nodes] += 1.0
            edge_count[block.edge_ids] += 1.0
            sizes += nodes.numel()
        self.node_count, self.edge_count = node_count, edge_count
        self.mean_nodes = sizes / self.presample
        c_v = node_count.clamp(min=1.0)
        num_train = max(int(self.train_mask.sum()), 1)
        # loss: 1 / (|V_train| p_v), p_v = C_v / rounds
        self.loss_weight = torch.where(
            self.train_mask, self.presample / (c_v * num_train), torch.zeros(())
        )
        # aggregation: Â_vu / α_uv with Â_vu = 1 / deg(v) (a weighted graph's: w_vu / Σ_u
        # w_vu, the full-graph weighted mean) and α_uv = C_uv / C_v (row v)
        row = torch.repeat_interleave(
            torch.arange(self.num_nodes), self.degree, output_size=self.indices.numel()
        )
        if self.weight is None:
            inv_deg = 1.0 / self.degree.clamp(min=1).to(torch.float64)
            self.edge_weight = (inv_deg * c_v)[row] / edge_count.clamp(min=1.0)
        else:
            total = torch.zeros(self.num_nodes, dtype=torch.float64).index_add(0, row, self.weight)
            inv = torch.where(total != 0, 1.0 / total, 0.0)
            self.edge_weight = self.weight * (inv * c_v)[row] / edge_count.clamp(min=1.0)

    @property
    def batches_per_epoch(self) -> int:
        """Subgraphs per epoch: about as many as cover the graph's nodes once."""
        return max(1, round(self.num_nodes / max(self.mean_nodes, 1.0)))

    # ------------------------------------------------------------------ batches
    def sample(self, key: int) -> MiniBatch:
        """The normalised subgraph mini-batch of ``key``."""
        nodes = self.nodes(int(key))
        return subgraph_batch(
            self.indptr, self.indices, nodes, self.num_layers, self.loss_weight, self.edge_weight
        )

    def batch(self, epoch: int, index: int) -> MiniBatch:
        """Subgraph ``index`` of ``epoch`` (a function of the seed, epoch and index)."""
        return self.sample(derive_key(self.seed, _TRAIN, epoch, index))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_nodes={self.num_nodes}, presample={self.presample}, "
            f"mean_nodes={self.mean_nodes:.1f})"
        )


def _check_budget(budget: Any, what: str) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise UserError(f"{what} must be an integer >= 1, got {budget!r}")
    return budget


NODE_PROBABILITIES = ("norm", "degree")


class SaintNodeSampler(SaintSampler):
    """GraphSAINT's node sampler: ``budget`` draws with replacement, ``P(u)`` by
    ``probability``:

    - ``"norm"`` (the paper's section 3.4): ``P(u) ∝ ||Â_{:,u}||²``, the sum of
      ``1 / deg(v)²`` over the nodes ``v`` that aggregate ``u``. A node whose neighbours
      all have a high degree is then rare (a leaf of a hub of degree 99 weighs 1 / 99²),
      and its loss weight ``1 / p_v`` large: on CiteSeer the training nodes' inclusion
      probabilities at 830 draws span 0.0008 to 0.88;
    - ``"degree"`` (what the authors' code and PyG's ``GraphSAINTNodeSampler`` draw):
      ``P(u) ∝ deg(u)``, which is ``||A_{:,u}||²`` of the unnormalised adjacency.

    Nodes of weight 0 (isolated ones) get the smallest positive weight, so that every
    node can be drawn. See :class:`SaintSampler` for the other arguments.
    """

    def __init__(
        self, graph: Any, num_layers: int, budget: int, probability: str = "norm", **kwargs: Any
    ):
        self.budget = _check_budget(budget, "budget")
        if probability not in NODE_PROBABILITIES:
            raise UserError(
                f"probability must be one of {', '.join(NODE_PROBABILITIES)}, got {probability!r}"
            )
        self.probability = probability
        indptr, indices = graph_csr(graph)
        degree = indptr[1:] - indptr[:-1]
        if probability == "degree":
            norm = degree.to(torch.float64)
        else:
            deg = degree.clamp(min=1).to(torch.float64)
            row = torch.repeat_interleave(
                torch.arange(indptr.numel() - 1), degree, output_size=indices.numel()
            )
            # ||Â_{:,u}||² = sum over the rows v that hold u of 1 / deg(v)²
            norm = torch.zeros(indptr.numel() - 1, dtype=torch.float64)
            norm.index_add_(0, indices, (1.0 / deg**2)[row])
        norm = torch.where(norm > 0, norm, norm[norm > 0].min() if bool((norm > 0).any()) else 1.0)
        self._cdf = torch.cumsum(norm, 0)
        super().__init__(graph, num_layers, **kwargs)

    def nodes(self, key: int) -> torch.Tensor:
        """The distinct nodes of ``budget`` weighted draws."""
        return torch.unique(weighted_draw(key, self._cdf, self.budget))


class SaintEdgeSampler(SaintSampler):
    """GraphSAINT's edge sampler: ``budget`` edges drawn with replacement,
    ``P(u -> v) ∝ 1 / deg(u) + 1 / deg(v)``; the subgraph is induced by their ends.

    See :class:`SaintSampler` for the other arguments.
    """

    def __init__(self, graph: Any, num_layers: int, budget: int, **kwargs: Any):
        self.budget = _check_budget(budget, "budget")
        indptr, indices = graph_csr(graph)
        if indices.numel() == 0:
            raise UserError("the edge sampler needs a graph with edges")
        deg = indptr[1:] - indptr[:-1]
        self._row = torch.repeat_interleave(
            torch.arange(indptr.numel() - 1), deg, output_size=indices.numel()
        )
        inv = 1.0 / deg.clamp(min=1).to(torch.float64)
        self._cdf = torch.cumsum(inv[self._row] + inv[indices], 0)
        self._cols = indices
        super().__init__(graph, num_layers, **kwargs)

    def nodes(self, key: int) -> torch.Tensor:
        """The distinct ends of ``budget`` weighted edge draws."""
        edges = weighted_draw(key, self._cdf, self.budget)
        return torch.unique(torch.cat([self._row[edges], self._cols[edges]]))


class SaintWalkSampler(SaintSampler):
    """GraphSAINT's random-walk sampler: ``budget`` roots uniform over the nodes, each
    walking ``walk_length`` steps to a uniform in-neighbour (a node without any stays).

    See :class:`SaintSampler` for the other arguments.
    """

    def __init__(
        self, graph: Any, num_layers: int, budget: int, walk_length: int = 2, **kwargs: Any
    ):
        self.budget = _check_budget(budget, "budget (roots)")
        if isinstance(walk_length, bool) or not isinstance(walk_length, int) or walk_length < 0:
            raise UserError(f"walk_length must be an integer >= 0, got {walk_length!r}")
        self.walk_length = walk_length
        super().__init__(graph, num_layers, **kwargs)

    def nodes(self, key: int) -> torch.Tensor:
        """The distinct nodes visited by the walks."""
        walkers = torch.arange(self.budget, dtype=torch.int64)
        here = uniform_below(random_bits(derive_key(key, 0), walkers, 1)[0], self.num_nodes)
        visited = [here]
        for step in range(1, self.walk_length + 1):
            deg = self.degree.index_select(0, here)
            pick = uniform_below(random_bits(derive_key(key, step), walkers, 1)[0], deg)
            pos = (self.indptr.index_select(0, here) + pick).clamp(max=self.indices.numel() - 1)
            nxt = self.indices.index_select(0, pos) if self.indices.numel() else here
            here = torch.where(deg > 0, nxt, here)
            visited.append(here)
        return torch.unique(torch.cat(visited))
