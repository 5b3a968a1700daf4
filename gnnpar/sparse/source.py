"""Where a rank's shards of a full graph come from: memory (tests, small graphs) or disk.

Both sources present the graph in the two orders of Plexus's double permutation. Permutations
follow the project's convention (that of ``Graph.permute`` and :mod:`partitioners.blocks`):
position ``i`` of an order holds original node ``perm[i]``. With P and P₂ (order 0 uses P₂,
order 1 uses P):

- the input features are stored in order 0;
- even layers multiply by Â₁ = P·Â·P₂ᵀ (order 0 → order 1), odd layers by Â₂ = P₂·Â·Pᵀ
  (order 1 → order 0), so no data is re-laid-out between layers;
- labels and masks exist in both orders; the output order is ``num_layers % 2``.

A source returns only the requested blocks; :class:`MemorySource` holds the whole graph (it is
meant for one process or for tests), :class:`gnnpar.models.fullgraph.shards.DiskSource` reads only
the
requested rows and blocks from memory-mapped files.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from gnnpar.errors import UserError
from gnnpar.graph import is_multilabel
from gnnpar.sparse import csr
from gnnpar.sparse.csr import CSRBlock


class ShardSource(Protocol):
    """What the parallel full-graph model reads its shards from."""

    num_nodes: int
    feat_dim: int
    num_classes: int
    #: The adjacency the blocks hold (``"gcn"``, ``"mean"``, ``"raw"``, or
    #: ``"mean-per-relation"`` for a typed graph's R-GCN; the one a model kind reads:
    #: :func:`gnnpar.models.fullgraph.model.norm_of`), or None where the source does not
    #: record it. A typed source also has ``num_relations`` and
    #: ``relation_adjacency(relation, parity, rows, cols)``, one Â_r per relation, in place
    #: of :meth:`adjacency` (:mod:`gnnpar.models.fullgraph.relations`).
    norm: str | None
    #: Where :attr:`norm` comes from, for the error of a model that needs another.
    norm_where: str
    #: A typed graph's schema (:class:`~gnnpar.graph.typed.TypeSchema`: which original ids
    #: are a featureless type's), or None where the source has no types or does not record
    #: them.
    types: Any

    def adjacency(self, parity: int, rows: tuple[int, int], cols: tuple[int, int]) -> CSRBlock:
        """Block of Â₁ (parity 0) or Â₂ (parity 1)."""

    def root(self, parity: int, rows: tuple[int, int], cols: tuple[int, int]) -> CSRBlock:
        """Block of the permutation that maps order ``parity`` to order ``1 - parity``."""

    def features(self, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """Input features (order 0) of positions ``rows``, feature columns ``cols``."""

    def node_ids(self, order: int, rows: tuple[int, int]) -> torch.Tensor:
        """Original node ids at positions ``rows`` of ``order``."""

    def node_data(self, name: str, order: int, rows: tuple[int, int]) -> torch.Tensor:
        """``label`` or a mask (``train_mask``...) at positions ``rows`` of ``order``."""


PERMUTATIONS = ("random", "balanced", "balanced-local", "symmetric", "none")
"""Names :func:`make_permutations` accepts."""


def make_permutations(
    method: str, indptr: torch.Tensor, indices: torch.Tensor, seed: int, blocks: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, P₂) by ``method``: ``"random"`` (Plexus's double permutation), ``"balanced"``
    (degree-aware, balancing a ``blocks`` × ``blocks`` grid, nodes shuffled inside each
    block), ``"balanced-local"`` (the same blocks, hence the same balance, with each block's
    nodes in a locality order for faster local SpMMs; best when the runtime grid's blocks
    are unions of the file blocks) or ``"none"`` (identity)."""
    from partitioners import blocks as pb

    n = indptr.numel() - 1
    if method == "none":
        ident = torch.arange(n)
        return ident, ident
    if method == "random":
        p, p2 = pb.double_permutation(n, seed)
    elif method == "symmetric":
        p = pb.double_permutation(n, seed)[0]
        p2 = p.copy()
    elif method in ("balanced", "balanced-local"):
        within = "locality" if method == "balanced-local" else "shuffle"
        p, p2 = pb.balanced_permutation(
            indptr.numpy(), indices.numpy(), blocks, blocks, seed, within=within
        )
    else:
        raise UserError(f"unknown permutation {method!r}; use one of {', '.join(PERMUTATIONS)}")
    return torch.as_tensor(p, dtype=torch.int64), torch.as_tensor(p2, dtype=torch.int64)


def inverse(perm: torch.Tensor) -> torch.Tensor:
    """Inverse permutation: ``inverse(perm)[perm[v]] == v``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), dtype=perm.dtype)
    return inv


class MemorySource:
    """All shards cut from an in-memory normalised adjacency and node data. ``norm``: which
    adjacency ``values`` hold (``"gcn"``, ``"mean"``, ``"raw"``), checked against the model
    by :func:`~gnnpar.models.fullgraph.parallelize_fullgraph` (None: not recorded, not checked)."""

    def __init__(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        values: torch.Tensor,
        features: torch.Tensor,
        node_data: dict[str, torch.Tensor],
        permutations: tuple[torch.Tensor, torch.Tensor] | None = None,
        dtype: torch.dtype | None = None,
        norm: str | None = None,
    ):
        n = indptr.numel() - 1
        self.norm, self.norm_where = norm, "MemorySource(norm=...)"
        self.types: Any = None  # a typed graph's schema (relation_memory_source sets it)
        if features.shape[0] != n:
            raise UserError(f"features have {features.shape[0]} rows for {n} nodes")
        dtype = dtype or features.dtype
        if permutations is None:
            ident = torch.arange(n)
            permutations = (ident, ident)
        p, p2 = permutations
        self.num_nodes = n
        self.feat_dim = int(features.shape[1])
        self.num_classes = num_classes_of(node_data.get("label"))
        # order o: inv[o][position] = node, perm[o][node] = position (order 0 uses P₂)
        self.inv = (p2, p)
        self.perm = (inverse(p2), inverse(p))
        vals = values.to(dtype)
        a1 = csr.permute(indptr, indices, vals, self.perm[1], self.perm[0])
        a2 = csr.permute(indptr, indices, vals, self.perm[0], self.perm[1])
        self._adj = (a1, a2)
        self._features = features.to(dtype)[self.inv[0]]
        self._node_data = {
            k: (v[self.inv[0]], v[self.inv[1]]) for k, v in node_data.items() if v is not None
        }
        self._dtype = dtype

    def adjacency(self, parity: int, rows: tuple[int, int], cols: tuple[int, int]) -> CSRBlock:
        """Block of Â₁ (parity 0) or Â₂ (parity 1)."""
        a = self._adj[parity]
        return csr.select(a.indptr, a.indices, a.values, rows, cols)

    def root(self, parity: int, rows: tuple[int, int], cols: tuple[int, int]) -> CSRBlock:
        """Block of the permutation from order ``parity`` to order ``1 - parity``."""
        return root_block(self.inv[1 - parity], self.perm[parity], rows, cols, self._dtype)

    def features(self, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """Input features in order 0."""
        return self._features[rows[0] : rows[1], cols[0] : cols[1]].clone()

    def node_ids(self, order: int, rows: tuple[int, int]) -> torch.Tensor:
        """Original ids at positions ``rows`` of ``order``."""
        return self.inv[order][rows[0] : rows[1]].clone()

    def node_data(self, name: str, order: int, rows: tuple[int, int]) -> torch.Tensor:
        """Labels or masks at positions ``rows`` of ``order``."""
        if name not in self._node_data:
            raise KeyError(f"the graph has no node data {name!r}")
        return self._node_data[name][order][rows[0] : rows[1]].clone()


def num_classes_of(label: torch.Tensor | None) -> int:
    """Classes of a label vector (its largest id + 1), or tasks of a multi-label (N × C)
    one (one binary task per column); 0 without labels."""
    if is_multilabel(label):
        return int(label.shape[1])
    return int(label.max()) + 1 if label is not None and label.numel() else 0


def root_block(
    out_inv: torch.Tensor,
    in_perm,
    rows: tuple[int, int],
    cols: tuple[int, int],
    dtype: torch.dtype,
    row_offset: int | None = None,
) -> CSRBlock:
    """Block ``rows × cols`` of the permutation matrix sending input position
    ``in_perm[v]`` to output position ``out_perm[v]`` (given the output order's inverse).
    ``in_perm`` is anything indexable by a tensor of ids."""
    ids = torch.as_tensor(out_inv[rows[0] : rows[1]]).long()
    src = torch.as_tensor(in_perm[ids]).long()
    local_rows = torch.arange(rows[1] - rows[0])
    keep = (src >= cols[0]) & (src < cols[1])
    return csr.from_coo(
        local_rows[keep],
        src[keep] - cols[0],
        torch.ones(int(keep.sum()), dtype=dtype),
        (rows[1] - rows[0], cols[1] - cols[0]),
        rows[0] if row_offset is None else row_offset,
        cols[0],
    )
