"""2D blocks of a sparse adjacency and the permutations that balance them (Plexus).

A distributed SpMM cuts the adjacency ``Â`` (n x n) into an ``R x C`` grid of blocks; the
slowest block sets the pace, so what matters is the **nnz imbalance**: the largest block's
nonzero count over the mean (1.0 is perfect). Real graphs number their hubs close together,
so the grid of the raw matrix is badly lumpy; relabelling the nodes fixes that.

**Permutation convention** (the same as ``gnnpar.graph.Graph.permute`` and tensor indexing): a
permutation is an int64 vector ``perm`` where *new position ``i`` holds old item
``perm[i]``*. Its matrix ``P`` has ``P[i, perm[i]] = 1``, so ``P @ x == x[perm]`` and
``P @ Â @ Q.T == Â[perm][:, q]``. :func:`invert_permutation` gives the other direction
(``inv[perm[i]] = i``: old id -> new position), the "position array" encoding of the same
matrix ``P`` that scatter-style code uses (entry ``(i, j)`` of ``Â`` moves to
``(inv_p[i], inv_q[j])``).

**Plexus double permutation.** Two permutations ``P`` and ``P2`` give two matrices,

- ``Â1 = P · Â · P2ᵀ  = Â[P][:, P2]`` used on even layers (0, 2, ...),
- ``Â2 = P2 · Â · Pᵀ  = Â[P2][:, P]`` used on odd layers (1, 3, ...),

and they compose without any re-layout between layers, because ``P2ᵀ P2 = Pᵀ P = I``::

    Â1 · (P2 · H) = P  · (Â · H)     # even layer: input in P2 order, output in P order
    Â2 · (P  · H) = P2 · (Â · H)     # odd layer:  input in P order,  output in P2 order

So the input features are stored in ``P2`` order (``X[P2]``), layer outputs alternate
between ``P`` and ``P2`` order, and labels and masks are kept in both orders
(``y[P]`` for a network with an odd number of layers, ``y[P2]`` otherwise). With ``Â1`` cut
into an ``R x C`` grid (row blocks of ``P`` order, column blocks of ``P2`` order), ``Â2`` is
cut ``C x R`` with the *same* node blocks; for a symmetric ``Â``, ``Â2 = Â1ᵀ`` and the two
grids have the same imbalance.

:func:`double_permutation` draws ``P`` and ``P2`` at random, as Plexus does.
:func:`balanced_permutation` returns a pair with the same contract whose blocks are
balanced on purpose: heavy nodes are placed one by one by their per-block weight vectors,
light ones dealt to the lightest blocks, alternately for ``P`` (rows of ``Â1``, columns of
``Â2``) and ``P2``; inside each block the nodes are shuffled or, with
``within="locality"``, kept in a locality order (reverse Cuthill-McKee) so the local SpMM
gathers stay cache-friendly. When one pair must serve several grid shapes (Plexus rotates its 3D
grid axes every layer), balance on a grid that refines them all, e.g. ``R = C =
lcm(X, Y, Z)``: merging adjacent blocks of a balanced grid keeps it balanced.

Blocks follow :func:`block_ranges`: ``n`` rows cut into ``parts`` contiguous ranges whose
sizes differ by at most one, the larger ones first (``numpy.array_split``'s rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gnnpar.errors import UserError
from partitioners.csr import csr_rows

__all__ = [
    "BlockCSR",
    "BlockGrid",
    "balanced_permutation",
    "block2d",
    "block_of",
    "block_ranges",
    "double_permutation",
    "invert_permutation",
    "locality_order",
    "nnz_imbalance",
    "permute_csr",
]


def block_ranges(n: int, parts: int) -> np.ndarray:
    """Offsets (length ``parts + 1``) cutting ``range(n)`` into ``parts`` contiguous blocks.

    Block ``b`` is ``[offsets[b], offsets[b + 1])``; sizes differ by at most one and the first
    ``n % parts`` blocks get the extra item, as ``numpy.array_split`` does.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    base, extra = divmod(n, parts)
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:extra] += 1
    offsets = np.zeros(parts + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return offsets


def block_of(offsets: np.ndarray) -> np.ndarray:
    """For every position ``0..n-1``, the block it falls in under ``offsets``."""
    sizes = np.diff(offsets)
    return np.repeat(np.arange(sizes.shape[0], dtype=np.int64), sizes)


def invert_permutation(perm: np.ndarray) -> np.ndarray:
    """``inv`` with ``inv[perm[i]] = i`` (old id -> new position)."""
    perm = np.asarray(perm, dtype=np.int64)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.shape[0], dtype=np.int64)
    return inv


def _check_perm(perm: np.ndarray | None, n: int, what: str) -> np.ndarray | None:
    if perm is None:
        return None
    perm = np.asarray(perm)
    if perm.shape != (n,):
        raise ValueError(f"{what} must have shape ({n},), got {perm.shape}")
    if n and (int(perm.min()) < 0 or int(perm.max()) >= n):
        raise ValueError(f"{what} holds ids outside [0, {n})")
    if n and not np.all(np.bincount(perm, minlength=n) == 1):
        raise ValueError(f"{what} is not a permutation of 0..{n - 1}")
    return perm.astype(np.int64, copy=False)


def nnz_imbalance(block_nnz: np.ndarray) -> float:
    """Max over mean of the per-block nonzero counts (1.0 is perfect; 1.0 for an empty grid)."""
    block_nnz = np.asarray(block_nnz)
    mean = float(block_nnz.mean()) if block_nnz.size else 0.0
    return float(block_nnz.max()) / mean if mean > 0 else 1.0


@dataclass
class BlockCSR:
    """One block of the grid as a local CSR.

    Row ``i`` of the block is row ``row_start + i`` of the permuted matrix; column ids in
    ``indices`` are local too (add ``col_start``). ``values`` is None for a pattern matrix.
    """

    indptr: np.ndarray
    indices: np.ndarray
    values: np.ndarray | None
    shape: tuple[int, int]
    row_start: int
    col_start: int

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])


@dataclass
class BlockGrid:
    """The ``R x C`` grid of a (permuted) sparse matrix.

    Attributes:
        nnz: ``(R, C)`` int64 nonzeros per block.
        row_offsets: ``R + 1`` row offsets of the blocks (:func:`block_ranges`).
        col_offsets: ``C + 1`` column offsets.
        blocks: ``blocks[r][c]`` as :class:`BlockCSR` when requested, else None.
    """

    nnz: np.ndarray
    row_offsets: np.ndarray
    col_offsets: np.ndarray
    blocks: list[list[BlockCSR]] | None = None

    @property
    def imbalance(self) -> float:
        """:func:`nnz_imbalance` of this grid."""
        return nnz_imbalance(self.nnz)


def block2d(
    indptr: np.ndarray,
    indices: np.ndarray,
    R: int,
    C: int,
    row_perm: np.ndarray | None = None,
    col_perm: np.ndarray | None = None,
    values: np.ndarray | None = None,
    num_cols: int | None = None,
    return_blocks: bool = False,
) -> BlockGrid:
    """Cut ``Â[row_perm][:, col_perm]`` into an ``R x C`` grid of blocks.

    Args:
        indptr, indices: CSR of ``Â`` (``n`` rows, ``num_cols`` columns, default ``n``).
        R, C: grid shape; row block ``r`` covers rows ``block_ranges(n, R)[r:r+2]`` of the
            permuted matrix, and likewise for columns.
        row_perm, col_perm: permutations in the module's convention (new position ``i``
            holds old row ``row_perm[i]``); None means identity.
        values: optional values aligned with ``indices``, carried into the blocks.
        return_blocks: also build every block's local CSR (rows sorted, columns sorted).

    Returns:
        A :class:`BlockGrid`; ``grid.nnz`` is the per-block count and ``grid.imbalance`` its
        max/mean.
    """
    indptr = np.asarray(indptr, dtype=np.int64)
    indices = np.asarray(indices, dtype=np.int64)
    n = indptr.shape[0] - 1
    m = n if num_cols is None else int(num_cols)
    if R < 1 or C < 1:
        raise UserError(f"grid shape must be at least 1 x 1, got {R} x {C}")
    row_perm = _check_perm(row_perm, n, "row_perm")
    col_perm = _check_perm(col_perm, m, "col_perm")
    row_off, col_off = block_ranges(n, R), block_ranges(m, C)
    # Block of every *old* row / column id: block of its new position.
    row_pos = np.arange(n, dtype=np.int64) if row_perm is None else invert_permutation(row_perm)
    col_pos = np.arange(m, dtype=np.int64) if col_perm is None else invert_permutation(col_perm)
    row_blk = block_of(row_off)[row_pos]
    col_blk = block_of(col_off)[col_pos]
    key = np.repeat(row_blk * C, np.diff(indptr))
    key += col_blk[indices]
    nnz = np.bincount(key, minlength=R * C).reshape(R, C).astype(np.int64)
    grid = BlockGrid(nnz, row_off, col_off)
    if return_blocks:
        grid.blocks = _split_blocks(indptr, indices, values, key, row_pos, col_pos, grid)
    return grid


def _split_blocks(
    indptr: np.ndarray,
    indices: np.ndarray,
    values: np.ndarray | None,
    key: np.ndarray,
    row_pos: np.ndarray,
    col_pos: np.ndarray,
    grid: BlockGrid,
) -> list[list[BlockCSR]]:
    R, C = grid.nnz.shape
    new_row = row_pos[csr_rows(indptr)]
    new_col = col_pos[indices]
    order = np.lexsort((new_col, new_row, key))
    new_row, new_col, key = new_row[order], new_col[order], key[order]
    vals = None if values is None else np.asarray(values)[order]
    bounds = np.zeros(R * C + 1, dtype=np.int64)
    np.cumsum(grid.nnz.reshape(-1), out=bounds[1:])
    blocks: list[list[BlockCSR]] = []
    for r in range(R):
        r0, r1 = int(grid.row_offsets[r]), int(grid.row_offsets[r + 1])
        row_blocks = []
        for c in range(C):
            c0, c1 = int(grid.col_offsets[c]), int(grid.col_offsets[c + 1])
            lo, hi = int(bounds[r * C + c]), int(bounds[r * C + c + 1])
            counts = np.bincount(new_row[lo:hi] - r0, minlength=r1 - r0)
            local_ptr = np.zeros(r1 - r0 + 1, dtype=np.int64)
            np.cumsum(counts, out=local_ptr[1:])
            row_blocks.append(
                BlockCSR(
                    local_ptr,
                    new_col[lo:hi] - c0,
                    None if vals is None else vals[lo:hi],
                    (r1 - r0, c1 - c0),
                    r0,
                    c0,
                )
            )
        blocks.append(row_blocks)
    return blocks


def permute_csr(
    indptr: np.ndarray,
    indices: np.ndarray,
    row_perm: np.ndarray,
    col_perm: np.ndarray,
    values: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """CSR of ``Â[row_perm][:, col_perm]`` (= ``P · Â · Qᵀ``); entries keep their row order."""
    indptr = np.asarray(indptr, dtype=np.int64)
    indices = np.asarray(indices, dtype=np.int64)
    n = indptr.shape[0] - 1
    row_perm = _check_perm(row_perm, n, "row_perm")
    col_pos = invert_permutation(col_perm)
    deg = np.diff(indptr)[row_perm]
    new_ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(deg, out=new_ptr[1:])
    # Entry t of new row i comes from old position indptr[row_perm[i]] + t.
    src = np.repeat(indptr[row_perm] - new_ptr[:-1], deg) + np.arange(int(new_ptr[-1]))
    new_values = None if values is None else np.asarray(values)[src]
    return new_ptr, col_pos[indices[src]], new_values


def double_permutation(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Plexus's two independent uniformly random permutations ``(P, P2)`` of ``n`` nodes."""
    rng = np.random.default_rng(seed)
    return rng.permutation(n), rng.permutation(n)


def _block_histograms(
    indptr: np.ndarray, indices: np.ndarray, blk: np.ndarray, groups: int
) -> np.ndarray:
    """``h[v, g]`` = number of entries of row ``v`` whose column lies in block ``g``."""
    n = indptr.shape[0] - 1
    key = np.repeat(np.arange(n, dtype=np.int64) * groups, np.diff(indptr))
    key += blk[indices]
    return np.bincount(key, minlength=n * groups).reshape(n, groups)


def _greedy_blocks(
    weights: np.ndarray, caps: np.ndarray, rng: np.random.Generator, heavy: int
) -> np.ndarray:
    """Assign items (rows of ``weights``) to blocks with exactly ``caps[b]`` items each.

    The ``heavy`` heaviest items go one by one to the open block whose largest cell stays
    smallest after adding them (the vector greedy); the rest, lightest last, are dealt in
    rounds to the open blocks in increasing order of their load.
    """
    n, _ = weights.shape
    nblocks = caps.shape[0]
    total = weights.sum(axis=1)
    shuffled = rng.permutation(n)  # random tie order among equal weights
    order = shuffled[np.argsort(-total[shuffled], kind="stable")]
    load = np.zeros((nblocks, weights.shape[1]), dtype=np.float64)
    remaining = caps.astype(np.int64).copy()
    blk = np.empty(n, dtype=np.int64)
    closed = remaining == 0  # blocks of size 0 (more blocks than nodes) never open
    heavy = min(heavy, n)
    for v in order[:heavy]:
        cand = load + weights[v]
        score = cand.max(axis=1) + cand.sum(axis=1) * 1e-9  # ties: lighter block
        score[closed] = np.inf
        b = int(np.argmin(score))
        load[b] = cand[b]
        blk[v] = b
        remaining[b] -= 1
        if remaining[b] == 0:
            closed[b] = True
    sums = load.sum(axis=1)
    tail = order[heavy:]
    pos = 0
    while pos < tail.shape[0]:
        open_blocks = np.flatnonzero(remaining > 0)
        # Deal `per` items to every open block this round, snake order, lightest first.
        left = tail.shape[0] - pos
        per = int(min(remaining[open_blocks].min(), 64, -(-left // open_blocks.shape[0])))
        ranked = open_blocks[np.argsort(sums[open_blocks], kind="stable")]
        snake = np.concatenate([ranked if i % 2 == 0 else ranked[::-1] for i in range(per)])
        items = tail[pos : pos + snake.shape[0]]
        targets = snake[: items.shape[0]]
        blk[items] = targets
        np.add.at(sums, targets, total[items])
        np.subtract.at(remaining, targets, 1)
        pos += items.shape[0]
    return blk


def _perm_from_blocks(
    blk: np.ndarray, rng: np.random.Generator, rank: np.ndarray | None = None
) -> np.ndarray:
    """A permutation listing block 0's nodes first, then block 1's, ...; inside each block
    the nodes are shuffled, or sorted by ``rank`` when it is given."""
    if rank is not None:
        return np.lexsort((rank, blk))
    shuffled = rng.permutation(blk.shape[0])
    return shuffled[np.argsort(blk[shuffled], kind="stable")]


def locality_order(indptr: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Rank of every node in a reverse Cuthill-McKee order of the symmetrised pattern of the
    square CSR (neighbours get nearby ranks: a breadth-first order from a low-degree node,
    each level sorted by degree; every connected component in turn)."""
    import scipy.sparse as sp
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    indptr = np.asarray(indptr, dtype=np.int64)
    n = indptr.shape[0] - 1
    pattern = np.ones(np.asarray(indices).shape[0], dtype=np.int8)
    mat = sp.csr_matrix((pattern, np.asarray(indices), indptr), shape=(n, n))
    order = reverse_cuthill_mckee((mat + mat.T).tocsr(), symmetric_mode=True)
    return invert_permutation(order.astype(np.int64))


def balanced_permutation(
    indptr: np.ndarray,
    indices: np.ndarray,
    R: int,
    C: int,
    seed: int = 0,
    rounds: int = 2,
    heavy: int | None = None,
    within: str = "shuffle",
) -> tuple[np.ndarray, np.ndarray]:
    """A degree-aware pair ``(P, P2)`` balancing ``Â1 = Â[P][:, P2]`` on an ``R x C`` grid
    and ``Â2 = Â[P2][:, P]`` on the ``C x R`` grid.

    The pair composes exactly like :func:`double_permutation`'s (see the module docstring):
    both are plain permutations, only chosen with the blocks in mind. Starting from a seeded
    random ``P2``, it alternates: place every node's row block (``P``) given the column
    blocks, then every node's column block (``P2``) given the row blocks; ``rounds`` such
    sweeps. Each placement is a capacity-exact greedy: the ``heavy`` heaviest nodes go one by
    one where the largest block stays smallest (their weight is a vector with one entry per
    block they touch, in both ``Â1`` and ``Â2``), the others are dealt to the lightest
    blocks. Inside a block, nodes are shuffled. Deterministic for a seed.

    Args:
        indptr, indices: CSR of the square ``Â`` (n x n).
        R, C: grid of ``Â1`` (``Â2`` uses ``C x R``).
        rounds: alternating sweeps (each places rows, then columns).
        heavy: how many nodes get the exact vector greedy (default ``min(n, 512 * (R + C))``).
        within: order inside each block, ``"shuffle"`` or ``"locality"``.
    """
    indptr = np.asarray(indptr, dtype=np.int64)
    indices = np.asarray(indices, dtype=np.int64)
    n = indptr.shape[0] - 1
    if R < 1 or C < 1:
        raise UserError(f"grid shape must be at least 1 x 1, got {R} x {C}")
    if rounds < 1:
        raise UserError(f"rounds must be >= 1, got {rounds}")
    if within not in ("shuffle", "locality"):
        raise UserError(f"within must be 'shuffle' or 'locality', got {within!r}")
    rng = np.random.default_rng(seed)
    if heavy is None:
        heavy = min(n, 512 * (R + C))
    row_off, col_off = block_ranges(n, R), block_ranges(n, C)
    t_indptr, t_indices = _transpose(indptr, indices, n)
    symmetric = np.array_equal(t_indptr, indptr) and _same_rows(
        indptr, indices, t_indptr, t_indices
    )
    P2 = rng.permutation(n)
    col_blk = block_of(col_off)[invert_permutation(P2)]
    row_blk = np.zeros(n, dtype=np.int64)
    for _ in range(rounds):
        row_blk = _greedy_blocks(
            _side_weights(indptr, indices, t_indptr, t_indices, col_blk, C, symmetric),
            np.diff(row_off),
            rng,
            heavy,
        )
        col_blk = _greedy_blocks(
            _side_weights(t_indptr, t_indices, indptr, indices, row_blk, R, symmetric),
            np.diff(col_off),
            rng,
            heavy,
        )
    rank = locality_order(indptr, indices) if within == "locality" else None
    return _perm_from_blocks(row_blk, rng, rank), _perm_from_blocks(col_blk, rng, rank)


def _side_weights(
    a_ptr: np.ndarray,
    a_idx: np.ndarray,
    b_ptr: np.ndarray,
    b_idx: np.ndarray,
    other_blk: np.ndarray,
    groups: int,
    symmetric: bool,
) -> np.ndarray:
    """Per-node weight vectors: row ``v`` of ``a`` and of ``b`` binned by the other side's
    blocks (``b`` is ``a``'s transpose; for a symmetric matrix one half is enough)."""
    first = _block_histograms(a_ptr, a_idx, other_blk, groups)
    if symmetric:
        return first
    return np.concatenate([first, _block_histograms(b_ptr, b_idx, other_blk, groups)], axis=1)


def _transpose(indptr: np.ndarray, indices: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR of ``Âᵀ`` with sorted rows."""
    import scipy.sparse as sp

    pattern = np.ones(indices.shape[0], dtype=np.int8)
    csc = sp.csr_matrix((pattern, indices, indptr), shape=(n, n)).tocsc()  # rows come sorted
    return csc.indptr.astype(np.int64, copy=False), csc.indices.astype(np.int64, copy=False)


def _same_rows(
    indptr: np.ndarray, indices: np.ndarray, t_indptr: np.ndarray, t_indices: np.ndarray
) -> bool:
    """Same pattern row by row (rows of the second CSR are sorted; the first may not be)."""
    import scipy.sparse as sp

    n = indptr.shape[0] - 1
    pattern = np.ones(indices.shape[0], dtype=np.int8)
    mat = sp.csr_matrix((pattern, indices.copy(), indptr.copy()), shape=(n, n))
    mat.sort_indices()
    return bool(np.array_equal(mat.indices, t_indices))
