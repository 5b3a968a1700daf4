"""Negative destinations for link prediction, drawn with counter-based random numbers.

:class:`NegativeSampler` corrupts the destination of positive pairs ``(src, dst)``: for each
positive it returns ``k`` destinations ``neg`` such that ``(src, neg)`` serves as a negative
pair. Methods:

- ``"uniform"``: every node equally likely;
- ``"degree"``: probability proportional to ``degree ** 0.75`` (word2vec's and DGL's
  unigram distribution), by inverse CDF over a float64 cumulative table;
- ``"candidates"``: hard negatives, uniform among the valid entries of the source's row of
  an ``(num_nodes, C)`` candidate table (``-1`` pads); a source without any falls back to
  uniform.

Fixed negatives of a dataset (ogbl-citation2's per-source negatives) need no sampler:
:func:`per_source` picks their rows, and :func:`load_candidates` reads a hard-negative table
from a ``.npy`` file.

**The random-number contract.** Every random number is a pure function of ``(seed, key,
id, round, counter)`` (:mod:`gnnpar.sampling.rng`), and a negative one of those and the
positive's source, where ``id`` is the positive's global id (its index in the split's
training array), never the rank or the position in the batch. The same
positive therefore gets the same negatives whichever process, batch or batch order draws it.
Precisely, with ``key_r = derive_key(seed, key, r)``:

- round ``r = 0`` is the first draw: negative ``j`` of positive ``i`` uses counter ``j`` of
  ``random_bits(key_0, ids, ...)`` (counters ``2j`` and ``2j + 1``, one 53-bit uniform, for
  ``"degree"``);
- with exclusion (``exclude`` given), a negative that is the source itself or a true edge
  ``src -> neg`` is redrawn in round ``r = 1, 2, ..., rounds`` from the same counters of
  ``key_r``, until it is neither; one still hitting after round ``rounds`` is kept, and the
  number of those is :attr:`NegativeSampler.last_hits`.

Since a negative's redraws depend only on its own history, the result does not depend on
which other positives share the batch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from gnnpar.errors import UserError
from gnnpar.graph.edge_split import edge_keys
from gnnpar.sampling.rng import derive_key, random_bits, uniform_below

__all__ = ["METHODS", "NegativeSampler", "load_candidates", "per_source"]

#: The sampling methods of :class:`NegativeSampler`.
METHODS = ("uniform", "degree", "candidates")
#: The unigram exponent of ``"degree"`` (word2vec, DGL).
DEGREE_POWER = 0.75
_MAX_NODES = 2**31 - 1  # uniform_below's bound


def _in_range(degrees: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor | None:
    """``degrees`` with every node outside ``[lo, hi)`` at 0 (never drawn)."""
    if degrees is None or (lo == 0 and hi >= degrees.numel()):
        return degrees
    out = torch.zeros_like(torch.as_tensor(degrees))
    out[lo:hi] = torch.as_tensor(degrees)[lo:hi]
    return out


def _is_int(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


class NegativeSampler:
    """Draws ``k`` negative destinations per positive pair (module docstring).

    Args:
        num_nodes: the nodes destinations are drawn from, ``[0, num_nodes)``.
        method: ``"uniform"``, ``"degree"`` or ``"candidates"``.
        k: negatives per positive.
        degrees: ``(num_nodes,)`` non-negative degrees, for ``"degree"`` (e.g. a graph's
            ``in_degrees()``); a node of degree 0 is never drawn.
        candidates: ``(num_nodes, C)`` int64 candidate destinations per source node, ``-1``
            for padding (anywhere in a row), for ``"candidates"``.
        exclude: ``(indptr, indices)`` of the true graph in CSR form, rows the destinations
            (a :class:`~gnnpar.graph.Graph`'s ``indptr`` and ``indices``). A draw ``neg``
            for source ``src`` is redrawn while ``neg == src`` or the edge ``src -> neg``
            exists (row ``neg`` lists ``src``). For an undirected task pass a symmetric
            graph. None: no redraws.
        seed: selects an independent stream of random numbers.
        rounds: redraw rounds with ``exclude`` (>= 0).
        dst_range: ``(lo, hi)``: draw destinations from ``[lo, hi)`` only (a typed graph's
            destination type, :mod:`gnnpar.graph.typed`), uniformly or by the degrees in
            that range; None: every node.

    Attributes:
        last_hits: how many negatives of the last :meth:`sample` are still the source or a
            true edge after the redraw rounds (0 without ``exclude``).
    """

    def __init__(
        self,
        num_nodes: int,
        method: str = "uniform",
        k: int = 1,
        *,
        degrees: torch.Tensor | None = None,
        candidates: torch.Tensor | None = None,
        exclude: tuple[torch.Tensor, torch.Tensor] | None = None,
        seed: int = 0,
        rounds: int = 8,
        dst_range: tuple[int, int] | None = None,
    ):
        if not _is_int(num_nodes) or not 1 <= num_nodes <= _MAX_NODES:
            raise UserError(
                f"negative sampling: num_nodes must be in [1, 2**31), got {num_nodes!r}"
            )
        if method not in METHODS:
            raise UserError(f"negative sampling method {method!r}: one of {', '.join(METHODS)}")
        if not _is_int(k) or k < 1:
            raise UserError(f"negative sampling: k must be a positive integer, got {k!r}")
        if not _is_int(rounds) or rounds < 0:
            raise UserError(f"negative sampling: rounds must be an integer >= 0, got {rounds!r}")
        if not _is_int(seed):
            raise UserError(f"negative sampling: seed must be an integer, got {seed!r}")
        if degrees is not None and method != "degree":
            raise UserError(f"negative sampling: degrees are for method 'degree', not {method!r}")
        if candidates is not None and method != "candidates":
            raise UserError(
                f"negative sampling: a candidates table is for method 'candidates', not {method!r}"
            )
        self.num_nodes = int(num_nodes)
        lo, hi = (0, self.num_nodes) if dst_range is None else (int(x) for x in dst_range)
        if not 0 <= lo < hi <= self.num_nodes:
            raise UserError(
                f"negative sampling: dst_range {dst_range} must lie in [0, {num_nodes}]"
            )
        if dst_range is not None and method == "candidates":
            raise UserError("negative sampling: a dst_range is for methods uniform and degree")
        #: Destinations are drawn from ``[dst_lo, dst_hi)``.
        self.dst_lo, self.dst_hi = lo, hi
        self.method = method
        self.k = int(k)
        self.seed = int(seed)
        self.rounds = int(rounds)
        self.last_hits = 0
        self._cdf: torch.Tensor | None = None
        self._table: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._keys: torch.Tensor | None = None
        if method == "degree":
            self._cdf = _degree_cdf(_in_range(degrees, lo, hi), self.num_nodes)
        if method == "candidates":
            self._table, self._counts = _compact(candidates, self.num_nodes)
        if exclude is not None:
            self._keys = _exclusion_keys(exclude, self.num_nodes)

    @property
    def device(self) -> torch.device:
        """Where the sampler's tables are (and its draws are computed)."""
        for t in (self._cdf, self._table, self._keys):
            if t is not None:
                return t.device
        return torch.device("cpu")

    def to(self, device: torch.device | str) -> NegativeSampler:
        """Move the sampler's tables to ``device`` (in place); returns the sampler."""
        for name in ("_cdf", "_table", "_counts", "_keys"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self

    def sample(self, src: torch.Tensor, ids: torch.Tensor, key: int) -> torch.Tensor:
        """``(len(src), k)`` int64 negative destinations (on the sampler's :attr:`device`)
        for the positives whose sources are ``src`` and whose global ids are ``ids``.

        ``key`` names the draw (e.g. ``derive_key(epoch, step)`` or one key per epoch);
        the result depends only on ``(seed, key)`` and each positive's ``(src, id)``.
        """
        device = self.device
        src = _as_ids(src, "sources").to(device)
        ids = _as_ids(ids, "positive ids").to(device)
        if src.shape != ids.shape:
            raise ValueError(
                f"sources and positive ids differ in length: {src.numel()} and {ids.numel()}"
            )
        if src.numel() and (int(src.min()) < 0 or int(src.max()) >= self.num_nodes):
            raise ValueError(f"sources name a node outside [0, {self.num_nodes})")
        out = self._draw(src, ids, derive_key(self.seed, key, 0))  # (m, k)
        if self._keys is None:
            self.last_hits = 0
            return out
        bad = self._hits(src[:, None], out)
        for r in range(1, self.rounds + 1):
            rows = torch.nonzero(bad.any(1), as_tuple=True)[0]
            if rows.numel() == 0:
                break
            fresh = self._draw(src[rows], ids[rows], derive_key(self.seed, key, r))
            sub = bad[rows]
            out[rows] = torch.where(sub, fresh, out[rows])
            bad[rows] = sub & self._hits(src[rows, None], out[rows])
        self.last_hits = int(bad.sum())
        return out

    def _draw(self, src: torch.Tensor, ids: torch.Tensor, key: int) -> torch.Tensor:
        """One round's ``(m, k)`` draws from ``key``'s counters."""
        k = self.k
        if self.method == "degree":
            bits = random_bits(key, ids, 2 * k)  # (2k, m)
            unit = ((bits[0::2] << 21) | (bits[1::2] >> 11)).to(torch.float64) * 2.0**-53
            cdf = self._cdf
            target = unit.t().contiguous() * cdf[-1]
            return torch.searchsorted(cdf, target, right=True).clamp_(max=self.num_nodes - 1)
        bits = random_bits(key, ids, k).t().contiguous()  # (m, k)
        if self.method == "uniform":
            return uniform_below(bits, self.dst_hi - self.dst_lo).add_(self.dst_lo)
        counts = self._counts[src]  # (m,)
        if self._table.shape[1] == 0:
            return uniform_below(bits, self.num_nodes)
        bound = torch.where(counts > 0, counts, self.num_nodes)[:, None]
        pick = uniform_below(bits, bound)
        hard = self._table[src[:, None], pick.clamp(max=self._table.shape[1] - 1)]
        return torch.where(counts[:, None] > 0, hard, pick)

    def _hits(self, src: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        """Whether each ``neg`` is its source or a true edge ``src -> neg``."""
        keys = self._keys
        bad = neg == src
        if keys.numel():
            want = edge_keys(src.expand_as(neg), neg, self.num_nodes)
            at = torch.searchsorted(keys, want).clamp_(max=keys.numel() - 1)
            bad |= keys[at] == want
        return bad


def per_source(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a fixed ``(E, K)`` negative table (a dataset's per-source negatives:
    row ``i`` holds positive ``i``'s negative destinations), on the table's device."""
    if table.dim() != 2:
        raise ValueError(f"a per-source negative table must be (E, K), got {tuple(table.shape)}")
    ids = _as_ids(ids, "positive ids").to(table.device)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.shape[0]):
        raise ValueError(f"positive ids outside the table's rows [0, {table.shape[0]})")
    return table.index_select(0, ids)


def load_candidates(path: str | Path, num_nodes: int | None = None) -> torch.Tensor:
    """A hard-negative candidate table from a ``.npy`` file: ``(num_nodes, C)`` integer
    node ids, ``-1`` for padding, as an int64 tensor. Objects are refused
    (``allow_pickle=False``). With ``num_nodes``, the row count and the ids are checked
    against it. One UserError line naming the file otherwise."""
    path = Path(path)
    try:
        arr = np.load(path, allow_pickle=False, mmap_mode=None)
    except FileNotFoundError:
        raise UserError(f"{path}: no such hard-negative candidates file") from None
    except (OSError, ValueError, EOFError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"{path}: not a readable .npy array of candidates ({reason})") from None
    if not isinstance(arr, np.ndarray):
        raise UserError(f"{path}: holds several arrays; a candidates file is one .npy array")
    if not np.issubdtype(arr.dtype, np.integer):
        raise UserError(f"{path}: candidates must be integer node ids, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise UserError(f"{path}: candidates must be (num_nodes, C), got shape {arr.shape}")
    if num_nodes is not None and arr.shape[0] != num_nodes:
        raise UserError(f"{path}: {arr.shape[0]} rows of candidates for {num_nodes} nodes")
    if arr.size:
        low, high = int(arr.min()), int(arr.max())
        if low < -1 or (num_nodes is not None and high >= num_nodes):
            bad = low if low < -1 else high
            top = "num_nodes" if num_nodes is None else str(num_nodes)
            raise UserError(f"{path}: candidate id {bad} outside [0, {top}) (-1 pads)")
    return torch.from_numpy(np.ascontiguousarray(arr.astype(np.int64, copy=False)))


# ---------------------------------------------------------------------------- helpers


def _as_ids(t: torch.Tensor, what: str) -> torch.Tensor:
    t = torch.as_tensor(t)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex() or t.dim() != 1:
        raise ValueError(f"{what} must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
    return t.to(torch.int64)


def _degree_cdf(degrees: torch.Tensor | None, num_nodes: int) -> torch.Tensor:
    """The float64 cumulative sum of ``degrees ** 0.75``."""
    if degrees is None:
        raise UserError("negative sampling method 'degree' needs degrees (one per node)")
    d = torch.as_tensor(degrees)
    if d.dtype == torch.bool or d.is_complex() or tuple(d.shape) != (num_nodes,):
        raise UserError(
            f"negative sampling: degrees must be ({num_nodes},) numbers, got {d.dtype} "
            f"{tuple(d.shape)}"
        )
    d = d.to(torch.float64)
    if not bool(torch.isfinite(d).all()) or bool((d < 0).any()):
        raise UserError("negative sampling: degrees must be finite and non-negative")
    cdf = torch.cumsum(d.pow(DEGREE_POWER), 0)
    if not float(cdf[-1]) > 0:
        raise UserError("negative sampling: every degree is 0, no node can be drawn")
    return cdf


def _compact(candidates: torch.Tensor | None, num_nodes: int):
    """The table with each row's valid ids first (in their order), and the valid counts."""
    if candidates is None:
        raise UserError("negative sampling method 'candidates' needs a candidates table")
    c = torch.as_tensor(candidates)
    if c.dtype != torch.int64 or c.dim() != 2 or c.shape[0] != num_nodes:
        raise UserError(
            f"negative sampling: candidates must be an int64 ({num_nodes}, C) table, got "
            f"{c.dtype} {tuple(c.shape)}"
        )
    if c.numel() and (int(c.min()) < -1 or int(c.max()) >= num_nodes):
        raise UserError(
            f"negative sampling: candidates name node {int(c.max())} or {int(c.min())} "
            f"outside [0, {num_nodes}) (-1 pads)"
        )
    valid = c >= 0
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    return torch.gather(c, 1, order), valid.sum(1)


def _exclusion_keys(exclude, num_nodes: int) -> torch.Tensor:
    """Sorted edge keys (:func:`~gnnpar.graph.edge_split.edge_keys`) of a CSR graph."""
    try:
        indptr, indices = exclude
    except (TypeError, ValueError):
        raise UserError("negative sampling: exclude must be a pair (indptr, indices)") from None
    indptr, indices = torch.as_tensor(indptr), torch.as_tensor(indices)
    ok = all(t.dim() == 1 and t.dtype in (torch.int32, torch.int64) for t in (indptr, indices))
    if not ok or indptr.numel() != num_nodes + 1 or int(indptr[-1]) != indices.numel():
        raise UserError(
            f"negative sampling: exclude must be a CSR graph of {num_nodes} nodes (indptr of "
            f"{num_nodes + 1} and indices of indptr[-1] int64 ids), got {tuple(indptr.shape)} "
            f"and {tuple(indices.shape)}"
        )
    if int(indptr[0]) != 0 or bool((indptr.diff() < 0).any()):
        raise UserError("negative sampling: exclude's indptr must start at 0 and not decrease")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= num_nodes):
        raise UserError(f"negative sampling: exclude's indices leave [0, {num_nodes})")
    indptr, indices = indptr.to(torch.int64), indices.to(torch.int64)
    rows = torch.repeat_interleave(
        torch.arange(num_nodes, device=indptr.device), indptr.diff(), output_size=indices.numel()
    )
    keys = edge_keys(indices, rows, num_nodes)
    if keys.numel() > 1 and not bool((keys[1:] >= keys[:-1]).all()):
        keys = torch.sort(keys).values  # not coalesced: sort once
    return keys
