"""`Graph`: a CSR adjacency plus node data, with validation and converters.

Convention: row ``i`` of the CSR lists the *in*-neighbours (sources) of node ``i``, so
``A[i, j] != 0`` iff there is an edge ``j -> i`` and ``A @ H`` aggregates messages at the
destinations. ``indptr`` and ``indices`` are ``torch.int64`` tensors; ``edge_weight`` (optional)
is a float tensor aligned with ``indices``; ``ndata`` maps names to tensors with one row per node.

Every transform returns a new ``Graph``; node data tensors are shared with the input, not
copied. Building from an edge list sorts by destination once (``torch.sort``) and never loops
over edges in Python.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gnnpar.allocation import check_room
from gnnpar.errors import UserError

if TYPE_CHECKING:
    from gnnpar.graph.edge_split import EdgeSplit
    from gnnpar.graph.typed import GraphTypes

__all__ = [
    "Graph",
    "content_fingerprint",
    "invert_permutation",
    "is_multilabel",
    "stable_sort",
    "tensor_bytes",
]

_REDUCTIONS = ("sum", "max", "mean")
_SPLIT_MASKS = ("train_mask", "val_mask", "test_mask")


def _as_num_classes(value: Any) -> int | None:
    """``None`` or a non-negative int, else ValueError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise UserError(f"num_classes must be a non-negative int or None, got {value!r}")
    return int(value)


def _as_index(x: Any, what: str) -> torch.Tensor:
    """Convert ``x`` to a 1-D int64 tensor, refusing non-integer dtypes."""
    if isinstance(x, torch.Tensor):
        t = x
    elif isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.integer):
            raise UserError(f"{what} must have an integer dtype, got numpy {x.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(x.astype(np.int64, copy=False)))
    elif isinstance(x, Sequence) and len(x) == 0:
        t = torch.zeros(0, dtype=torch.int64)
    else:
        t = torch.as_tensor(x)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise UserError(f"{what} must have an integer dtype, got {t.dtype}")
    if t.dim() != 1:
        raise UserError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    return t.to(torch.int64)


def _as_weight(x: Any, num: int | None = None, what: str = "edge_weight") -> torch.Tensor:
    """Convert ``x`` to a 1-D float tensor (integer weights become float32)."""
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if not t.is_floating_point():
        t = t.to(torch.float32)
    if t.dim() != 1:
        raise UserError(f"{what} must be 1-D, got shape {tuple(t.shape)}")
    if num is not None and t.numel() != num:
        raise UserError(f"{what} has {t.numel()} entries but there are {num} edges")
    return t


def _as_tensor(x: Any, key: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    raise TypeError(f"ndata[{key!r}] must be a torch.Tensor or numpy array, got {type(x).__name__}")


def _check_node_ids(ids: torch.Tensor, num_nodes: int, what: str) -> None:
    """Raise ValueError if any id in ``ids`` is negative or ``>= num_nodes``."""
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        pos = int(torch.nonzero(ids < 0)[0, 0])
        raise UserError(f"{what} contain a negative node id {lo} (first at position {pos})")
    if hi >= num_nodes:
        pos = int(torch.nonzero(ids >= num_nodes)[0, 0])
        raise UserError(
            f"{what} contain node id {hi} (first bad one at position {pos}), but num_nodes is "
            f"{num_nodes}: ids must lie in [0, {num_nodes})"
        )


def _take(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` along dim 0; ``index_select`` is ~3x faster than advanced indexing."""
    return values.index_select(0, index)


def _segment_sum(values: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    return torch.zeros(num_rows, dtype=values.dtype, device=values.device).index_add_(
        0, rows, values
    )


def _indptr_from_counts(counts: torch.Tensor) -> torch.Tensor:
    indptr = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=indptr[1:])
    return indptr


def _sort_values(keys: torch.Tensor) -> torch.Tensor:
    """Sorted copy of an int64 tensor. numpy's SIMD sort is several times faster than
    ``torch.sort`` on CPU, and we only need the values here."""
    if keys.device.type == "cpu":
        return torch.from_numpy(np.sort(keys.numpy()))
    return torch.sort(keys).values


def stable_sort(keys: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted keys, permutation)``, stable, for keys in ``[0, bound)``.

    On CPU, sorts the composite ``key << log2(E) | position`` by value: unique keys make any sort
    stable, and the position falls out as the permutation.
    """
    e = keys.numel()
    bits = max(e - 1, 1).bit_length()
    if keys.device.type == "cpu" and bound << bits < 2**63:
        composite = _sort_values((keys << bits) | torch.arange(e, dtype=torch.int64))
        return composite >> bits, composite & ((1 << bits) - 1)
    return torch.sort(keys, stable=True)


def _csr_from_coo(
    rows: torch.Tensor, cols: torch.Tensor, weight: torch.Tensor | None, num_nodes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stable sort by row: the order of edges inside each row is their input order."""
    rows_sorted, order = stable_sort(rows, num_nodes)
    counts = torch.bincount(rows_sorted, minlength=num_nodes)
    weight = None if weight is None else _take(weight, order)
    return _indptr_from_counts(counts), _take(cols, order), weight


def _coalesce_coo(
    rows: torch.Tensor,
    cols: torch.Tensor,
    weight: torch.Tensor | None,
    num_nodes: int,
    reduce: str = "sum",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """CSR with sorted columns and duplicates merged (weights combined with ``reduce``)."""
    if reduce not in _REDUCTIONS:
        raise ValueError(f"reduce must be one of {_REDUCTIONS}, got {reduce!r}")
    if num_nodes > 3_037_000_499:  # num_nodes**2 must fit in int64 for the sort key
        raise UserError(f"coalesce supports at most 3,037,000,499 nodes, got {num_nodes}")
    keys = rows * num_nodes + cols
    if weight is None:
        keys, order = _sort_values(keys), None
    else:
        keys, order = torch.sort(keys)
    first = torch.ones(keys.numel(), dtype=torch.bool, device=keys.device)
    if keys.numel() > 1:
        first[1:] = keys[1:] != keys[:-1]
    unique = keys[first]
    new_weight = None
    if weight is not None:
        group = torch.cumsum(first, 0) - 1
        w = _take(weight, order)
        out = torch.zeros(unique.numel(), dtype=w.dtype, device=w.device)
        if reduce == "sum":
            new_weight = out.index_add_(0, group, w)
        else:
            op = "amax" if reduce == "max" else "mean"
            new_weight = out.scatter_reduce_(0, group, w, op, include_self=False)
    new_rows = torch.div(unique, num_nodes, rounding_mode="floor")
    counts = torch.bincount(new_rows, minlength=num_nodes)
    return _indptr_from_counts(counts), unique - new_rows * num_nodes, new_weight


def weights_or_ones(graph: Graph) -> torch.Tensor:
    """The edge weights, or ones in the dtype of float features (float32 by default)."""
    if graph.edge_weight is not None:
        return graph.edge_weight
    feat = graph.feat
    dtype = feat.dtype if feat is not None and feat.is_floating_point() else torch.float32
    return torch.ones(graph.num_edges, dtype=dtype, device=graph.indices.device)


def is_multilabel(label: torch.Tensor | None) -> bool:
    """Whether ``label`` is an ``N x C`` matrix of 0/1 targets (C > 1 binary tasks, as
    ogbn-proteins) rather than one class id per node."""
    return label is not None and label.dim() == 2 and label.shape[1] > 1


def invert_permutation(perm: torch.Tensor) -> torch.Tensor:
    """Return ``inv`` with ``inv[perm[i]] = i``."""
    perm = _as_index(perm, "perm")
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), dtype=torch.int64, device=perm.device)
    return inv


def tensor_bytes(t: torch.Tensor) -> Iterator[np.ndarray]:
    """A tensor's bytes (none for an empty one) as :func:`content_fingerprint` reads an
    array's pieces."""
    t = t.detach().cpu().contiguous()
    if t.numel():
        yield t.reshape(-1).view(torch.uint8).numpy()


def content_fingerprint(num_nodes: int, arrays: Iterable[tuple[str, str, list, Iterable]]) -> str:
    """:meth:`Graph.fingerprint` from its parts: ``(name, dtype, shape, byte pieces)`` of
    every array in the fingerprint's order (``indptr``, ``indices``, ``edge_weight``, then
    ``ndata/<key>`` by key), the bytes given piece by piece, so a graph too large for memory
    (written to disk in chunks) gets the fingerprint it would have in memory."""
    import xxhash

    h = xxhash.xxh3_64()
    h.update(f"nodes {num_nodes};".encode())
    for name, dtype, shape, pieces in arrays:
        h.update(f"{name} {dtype} {list(shape)};".encode())
        for piece in pieces:
            h.update(piece)
    return h.hexdigest()


class Graph:
    """A directed graph in CSR form (rows = destinations) with per-node data.

    Args:
        indptr: ``num_nodes + 1`` row offsets (int64; numpy arrays and lists are accepted).
        indices: source node of each edge, row by row (int64).
        num_nodes: number of nodes; defaults to ``len(indptr) - 1``.
        edge_weight: optional float weight per edge, aligned with ``indices``.
        ndata: node data, e.g. ``feat`` (N x F), ``label`` (N), ``train_mask`` (N, bool).
        name: a label used in messages and on-disk metadata.
        validate: run the full O(E) checks of :meth:`validate` (cheap shape and dtype checks
            always run).
        num_classes: the number of classes of ``label`` when known (every dataset loader
            sets it): labels must then lie in ``[0, num_classes)`` or be negative
            (unlabelled). ``None`` infers it from the labels (:attr:`num_classes`).

    Raises:
        ValueError: with the problem and the numbers involved, for any malformed input.

    Example::

        >>> g = Graph.from_edges([0, 1, 2], [1, 2, 0])   # 0 -> 1, 1 -> 2, 2 -> 0
        >>> g.indptr.tolist(), g.indices.tolist()          # row i lists sources of i
        ([0, 1, 2, 3], [2, 0, 1])
    """

    def __init__(
        self,
        indptr: Any,
        indices: Any,
        num_nodes: int | None = None,
        edge_weight: Any = None,
        ndata: Mapping[str, torch.Tensor] | None = None,
        name: str = "graph",
        validate: bool = True,
        num_classes: int | None = None,
    ) -> None:
        self._num_classes = _as_num_classes(num_classes)
        self.indptr = _as_index(indptr, "indptr")
        self.indices = _as_index(indices, "indices")
        if num_nodes is None:
            if self.indptr.numel() == 0:
                raise UserError("indptr is empty: it needs num_nodes + 1 entries (at least [0])")
            num_nodes = self.indptr.numel() - 1
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, np.integer)):
            raise UserError(f"num_nodes must be an int, got {num_nodes!r}")
        if num_nodes < 0:
            raise UserError(f"num_nodes must be >= 0, got {num_nodes}")
        self.num_nodes = int(num_nodes)
        self.edge_weight = None if edge_weight is None else _as_weight(edge_weight)
        self.ndata: dict[str, torch.Tensor] = {
            str(k): _as_tensor(v, k) for k, v in (ndata or {}).items()
        }
        self.name = str(name)
        #: Link prediction's train / val / test edges when this is the message-passing
        #: graph of a split (:mod:`gnnpar.graph.edge_split`), else None.
        self.edge_split: EdgeSplit | None = None
        #: Node types and relations when this is a typed graph's homogeneous view
        #: (:mod:`gnnpar.graph.typed`), else None.
        self.types: GraphTypes | None = None
        self._check_shapes()
        if validate:
            self.validate()

    # ------------------------------------------------------------------ basic properties
    @property
    def num_edges(self) -> int:
        """Number of stored edges (nonzeros of the adjacency)."""
        return self.indices.numel()

    @property
    def feat(self) -> torch.Tensor | None:
        return self.ndata.get("feat")

    @property
    def label(self) -> torch.Tensor | None:
        return self.ndata.get("label")

    @property
    def train_mask(self) -> torch.Tensor | None:
        return self.ndata.get("train_mask")

    @property
    def val_mask(self) -> torch.Tensor | None:
        return self.ndata.get("val_mask")

    @property
    def test_mask(self) -> torch.Tensor | None:
        return self.ndata.get("test_mask")

    @property
    def num_classes(self) -> int:
        """Classes in ``label``: the stored value when set (by a dataset loader, a graph
        folder or assignment), else inferred: ``max + 1`` for class ids (negative ids mean
        unlabelled), the number of columns for a multi-label (N x C) label; 0 without
        labels."""
        if self._num_classes is not None:
            return self._num_classes
        y = self.label
        if y is None or y.numel() == 0:
            return 0
        if is_multilabel(y):
            return int(y.shape[1])
        return max(int(y.max()) + 1, 0)

    @num_classes.setter
    def num_classes(self, value: int | None) -> None:
        """Store the number of classes (``None`` infers it again); the labels are checked
        against it, ValueError naming the first node outside ``[0, value)``."""
        previous, self._num_classes = self._num_classes, _as_num_classes(value)
        try:
            self._check_labels()
        except ValueError:
            self._num_classes = previous
            raise

    @property
    def is_multilabel(self) -> bool:
        """Whether ``label`` is multi-label (:func:`is_multilabel`)."""
        return is_multilabel(self.label)

    def check_trainable(self) -> None:
        """What a node-classification trainer needs, one UserError naming what is missing:
        ``feat``, ``label`` and ``train_mask``, at least one training node, a class id
        (not "unlabelled") for every training node, and no empty ``val_mask`` or
        ``test_mask`` (model selection and the final report are computed on them)."""
        check_trainable_data(self.name, self.ndata)

    def fingerprint(self) -> str:
        """Digest of the graph's content (structure, weights and every node-data array with
        its key, dtype and shape; not its name): what a derived artefact — a partition, a
        shard folder — records to name the graph it was made from. XXH3-64, 16 hex digits;
        it reads every byte once (about 15 GB/s)."""
        arrays = [("indptr", self.indptr), ("indices", self.indices)]
        if self.edge_weight is not None:
            arrays.append(("edge_weight", self.edge_weight))
        arrays += [(f"ndata/{k}", self.ndata[k]) for k in sorted(self.ndata)]
        if self.types is not None:
            arrays += self.types.fingerprint_items()
        return content_fingerprint(
            self.num_nodes,
            (
                (name, str(t.dtype).removeprefix("torch."), list(t.shape), tensor_bytes(t))
                for name, t in arrays
            ),
        )

    def record(self) -> dict[str, Any]:
        """What a derived artefact records about the graph it was made from: its
        :meth:`fingerprint`, name, sizes and number of classes (None without labels)."""
        return {
            "fingerprint": self.fingerprint(),
            "name": self.name,
            "num_nodes": self.num_nodes,
            "num_edges": self.num_edges,
            "num_classes": self.num_classes if self.label is not None else None,
        }

    def in_degrees(self) -> torch.Tensor:
        """Number of in-edges of every node (the CSR row lengths)."""
        return self.indptr[1:] - self.indptr[:-1]

    def out_degrees(self) -> torch.Tensor:
        """Number of out-edges of every node."""
        return torch.bincount(self.indices, minlength=self.num_nodes)

    def rows(self) -> torch.Tensor:
        """Destination (row) of every edge, in CSR order."""
        return torch.repeat_interleave(
            torch.arange(self.num_nodes, dtype=torch.int64, device=self.indptr.device),
            self.in_degrees(),
            output_size=self.num_edges,
        )

    def edges(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(src, dst)`` of every edge, in CSR order."""
        return self.indices, self.rows()

    # ------------------------------------------------------------------ validation
    def _check_shapes(self) -> None:
        n = self.num_nodes
        if self.indptr.numel() != n + 1:
            raise UserError(
                f"indptr has length {self.indptr.numel()}, expected num_nodes + 1 = {n + 1}"
            )
        if int(self.indptr[0]) != 0:
            raise UserError(f"indptr[0] must be 0, got {int(self.indptr[0])}")
        if int(self.indptr[-1]) != self.indices.numel():
            raise UserError(
                f"indptr[-1] ({int(self.indptr[-1])}) must equal len(indices) "
                f"({self.indices.numel()})"
            )
        if self.edge_weight is not None and self.edge_weight.numel() != self.num_edges:
            raise UserError(
                f"edge_weight has {self.edge_weight.numel()} entries but the graph has "
                f"{self.num_edges} edges"
            )
        for key, value in self.ndata.items():
            if value.dim() == 0 or value.shape[0] != n:
                rows = "a scalar" if value.dim() == 0 else f"{value.shape[0]} rows"
                raise UserError(f"ndata[{key!r}] has {rows} but the graph has {n} nodes")

    def validate(self) -> None:
        """Check the whole structure; raise ValueError naming the first problem found."""
        for what, t in (("indptr", self.indptr), ("indices", self.indices)):
            if t.dtype != torch.int64:
                raise UserError(f"{what} must be torch.int64, got {t.dtype}")
        self._check_shapes()
        steps = self.indptr[1:] - self.indptr[:-1]
        if steps.numel() and int(steps.min()) < 0:
            i = int(torch.nonzero(steps < 0)[0, 0])
            raise UserError(
                f"indptr is not monotone non-decreasing: indptr[{i}] = {int(self.indptr[i])} > "
                f"indptr[{i + 1}] = {int(self.indptr[i + 1])}"
            )
        _check_node_ids(self.indices, self.num_nodes, "indices")
        self._validate_data()
        if getattr(self, "types", None) is not None:
            self.types.validate(self, f"{self.name}'s types")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_edges(
        cls,
        src: Any,
        dst: Any,
        num_nodes: int | None = None,
        edge_weight: Any = None,
        ndata: Mapping[str, torch.Tensor] | None = None,
        name: str = "graph",
        *,
        coalesce: bool = False,
    ) -> Graph:
        """Build from edge lists ``src[k] -> dst[k]``; CSR rows are the destinations.

        Edges keep their input order inside each row and duplicates are kept, unless
        ``coalesce=True``, which gives the result of :meth:`coalesce` with a single sort.
        ``num_nodes`` defaults to ``max id + 1``.
        """
        src = _as_index(src, "src")
        dst = _as_index(dst, "dst")
        if src.numel() != dst.numel():
            raise UserError(f"src has {src.numel()} entries but dst has {dst.numel()}")
        weight = None if edge_weight is None else _as_weight(edge_weight, src.numel())
        if num_nodes is None:
            num_nodes = 0 if src.numel() == 0 else int(torch.maximum(src.max(), dst.max())) + 1
        # the CSR's row pointers and counts: 16 bytes a node, before any is allocated (an id
        # of 3e9 in a two-line edge list once grew the process to 21 GB until it was killed)
        check_room(16 * (int(num_nodes) + 1), f"a graph of {int(num_nodes):,} nodes")
        _check_node_ids(src, num_nodes, "src")
        _check_node_ids(dst, num_nodes, "dst")
        if coalesce:
            indptr, indices, weight = _coalesce_coo(dst, src, weight, num_nodes, "sum")
        else:
            indptr, indices, weight = _csr_from_coo(dst, src, weight, num_nodes)
        graph = cls(indptr, indices, num_nodes, weight, ndata, name, validate=False)
        graph._validate_data()
        return graph

    def _validate_data(self) -> None:
        """Finite weights and float node data, class-id labels within ``num_classes`` and
        disjoint split masks (the checks that do not concern topology)."""
        if self.edge_weight is not None and not bool(torch.isfinite(self.edge_weight).all()):
            bad = int((~torch.isfinite(self.edge_weight)).sum())
            raise UserError(f"edge_weight contains {bad} non-finite values (NaN or inf)")
        for key, value in self.ndata.items():
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                bad = int((~torch.isfinite(value)).sum())
                raise UserError(f"ndata[{key!r}] contains {bad} non-finite values (NaN or inf)")
        self._check_labels()
        self._check_masks()

    def _check_labels(self) -> None:
        """Class ids are integers, below ``num_classes`` when it is stored; a multi-label
        (N x C) label has ``num_classes`` columns."""
        y = self.label
        if y is None:
            return
        k = self._num_classes
        if self.is_multilabel:
            if k is not None and k != y.shape[1]:
                raise UserError(
                    f"ndata['label'] has {y.shape[1]} columns (multi-label) but num_classes is {k}"
                )
            bad = (y != 0) & (y != 1)
            if bool(bad.any()):
                node, task = (int(i) for i in torch.nonzero(bad)[0])
                raise UserError(
                    f"ndata['label'][{node}, {task}] = {y[node, task].item()!r}: a multi-label "
                    "(N x C) label holds 0 or 1 in every entry"
                )
            return
        ids = y.reshape(-1)
        if ids.is_floating_point() or ids.is_complex():
            if ids.is_floating_point() and not bool((ids == torch.round(ids)).all()):
                node = int(torch.nonzero(ids != torch.round(ids))[0, 0])
                raise UserError(
                    f"ndata['label'] holds fractional class ids (node {node}: "
                    f"{ids[node].item()!r}): class ids must be integers"
                )
            raise UserError(
                f"ndata['label'] is {ids.dtype}: class ids must have an integer dtype "
                "(cast them, e.g. label.long())"
            )
        if k is not None and ids.numel() and bool((ids >= k).any()):
            node = int(torch.nonzero(ids >= k)[0, 0])
            raise UserError(
                f"ndata['label'][{node}] = {int(ids[node])} is not a class of this {k}-class "
                f"graph: labels must lie in [0, {k}) (negative = unlabelled)"
            )

    def _check_masks(self) -> None:
        """``train_mask``, ``val_mask``, ``test_mask``: 1-D, boolean (or 0/1), disjoint."""
        masks = {}
        for key in _SPLIT_MASKS:
            m = self.ndata.get(key)
            if m is None:
                continue
            if m.dim() != 1:
                raise UserError(f"ndata[{key!r}] must be 1-D, got shape {tuple(m.shape)}")
            if m.dtype != torch.bool:
                if m.is_floating_point() or m.is_complex() or bool(((m != 0) & (m != 1)).any()):
                    raise UserError(f"ndata[{key!r}] must be boolean (or 0/1), got {m.dtype}")
            masks[key] = m.to(torch.bool)
        names = list(masks)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                both = masks[a] & masks[b]
                if bool(both.any()):
                    node = int(torch.nonzero(both)[0, 0])
                    raise UserError(
                        f"node {node} is in both {a} and {b} ({int(both.sum())} nodes are): "
                        "the split masks must be disjoint"
                    )

    def _derive(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        edge_weight: torch.Tensor | None,
        ndata: Mapping[str, torch.Tensor] | None = None,
        num_nodes: int | None = None,
        relabelled: bool = False,
    ) -> Graph:
        """A graph with new topology built by our own (trusted) code: skip the O(E) checks.
        A link-prediction split is kept where the node ids are (the transforms of one graph's
        edges), dropped where they change (a subgraph)."""
        graph = Graph(
            indptr,
            indices,
            self.num_nodes if num_nodes is None else num_nodes,
            edge_weight,
            self.ndata if ndata is None else ndata,
            self.name,
            validate=False,
            num_classes=self._num_classes,
        )
        if num_nodes is None:
            graph.edge_split = self.edge_split
        if self.types is not None and indices is self.indices and num_nodes is None:
            graph.types = self.types  # the same edges (a reweighting)
        elif self.types is not None and not relabelled:
            raise UserError(
                f"{self.name} is a typed graph: this transform would lose each edge's "
                "relation (build the typed graph with the edges it needs instead)"
            )
        return graph

    # ------------------------------------------------------------------ topology transforms
    def coalesce(self) -> Graph:
        """Sort column indices in every row and merge duplicate edges (weights summed).

        An unweighted graph stays unweighted: duplicates are simply dropped.
        """
        indptr, indices, weight = _coalesce_coo(
            self.rows(), self.indices, self.edge_weight, self.num_nodes, "sum"
        )
        return self._derive(indptr, indices, weight)

    def to_undirected(self, reduce: str = "max") -> Graph:
        """Add the reverse of every edge; the result is coalesced.

        Weights of an edge and its reverse (and of duplicates) are merged with ``reduce``
        (``"max"``, ``"sum"`` or ``"mean"``). The default ``"max"`` leaves a graph that is
        already symmetric unchanged.
        """
        src, dst = self.edges()
        weight = self.edge_weight
        if weight is not None:
            weight = torch.cat([weight, weight])
        indptr, indices, weight = _coalesce_coo(
            torch.cat([dst, src]), torch.cat([src, dst]), weight, self.num_nodes, reduce
        )
        return self._derive(indptr, indices, weight)

    def is_symmetric(self) -> bool:
        """True when every edge ``u -> v`` has a reverse ``v -> u`` (weights ignored; on a
        typed graph whatever the relations)."""
        a = self.homogeneous().coalesce()
        b = Graph.from_edges(*reversed(self.edges()), num_nodes=self.num_nodes).coalesce()
        return torch.equal(a.indptr, b.indptr) and torch.equal(a.indices, b.indices)

    def keep_edges(self, keep: torch.Tensor) -> Graph:
        """The graph with only the edges where the boolean ``keep`` (one per edge, CSR
        order) is True, in their order; weights, node data and a typed graph's relations
        kept (a link-prediction split is not: its edges may be gone)."""
        if keep.dtype != torch.bool or keep.shape != (self.num_edges,):
            raise UserError(f"keep must be a boolean mask of the {self.num_edges} edges")
        kept_before = torch.zeros(self.num_edges + 1, dtype=torch.int64, device=keep.device)
        torch.cumsum(keep, 0, out=kept_before[1:])
        weight = None if self.edge_weight is None else self.edge_weight[keep]
        graph = Graph(kept_before[self.indptr], self.indices[keep], self.num_nodes, weight,
                      self.ndata, self.name, validate=False,
                      num_classes=self._num_classes)  # fmt: skip
        if self.types is not None:
            kept = torch.nonzero(keep, as_tuple=True)[0]
            graph.types = dataclasses.replace(
                self.types, edge_type=self.types.edge_type.index_select(0, kept)
            )
        return graph

    def homogeneous(self) -> Graph:
        """The graph without its types (:attr:`types`): the same arrays, not copied. Itself
        for an untyped graph."""
        if self.types is None:
            return self
        graph = self._derive(self.indptr, self.indices, self.edge_weight)
        graph.types = None
        return graph

    def has_self_loops(self) -> bool:
        return bool((self.indices == self.rows()).any())

    def remove_self_loops(self) -> Graph:
        """Drop every edge ``i -> i``."""
        keep = self.indices != self.rows()
        # New row offsets: number of kept edges before each old offset.
        kept_before = torch.zeros(self.num_edges + 1, dtype=torch.int64, device=keep.device)
        torch.cumsum(keep, 0, out=kept_before[1:])
        weight = None if self.edge_weight is None else self.edge_weight[keep]
        return self._derive(kept_before[self.indptr], self.indices[keep], weight)

    def add_self_loops(self, weight: float = 1.0) -> Graph:
        """Add a self loop with ``weight`` to every node that has none.

        Existing self loops are kept as they are (PyG's ``add_remaining_self_loops``), so for a
        graph without self loops the adjacency becomes ``A + weight * I``. The new loop is the
        last entry of its row. An unweighted graph gets edge weights only if ``weight != 1``.
        """
        n, deg, dev = self.num_nodes, self.in_degrees(), self.indices.device
        rows = self.rows()
        has_loop = torch.zeros(n, dtype=torch.bool, device=dev)
        has_loop[rows[self.indices == rows]] = True
        add = (~has_loop).to(torch.int64)
        new_indptr = _indptr_from_counts(deg + add)
        # Old entry j of row i moves by the number of loops inserted in rows before i.
        shift = new_indptr[:-1] - self.indptr[:-1]
        old_pos = torch.arange(self.num_edges, device=dev) + torch.repeat_interleave(
            shift, deg, output_size=self.num_edges
        )
        loop_nodes = torch.nonzero(add, as_tuple=True)[0]
        loop_pos = new_indptr[loop_nodes + 1] - 1
        total = int(new_indptr[-1])
        indices = torch.empty(total, dtype=torch.int64, device=dev)
        indices[old_pos] = self.indices
        indices[loop_pos] = loop_nodes
        new_weight = None
        if self.edge_weight is not None or weight != 1.0:
            old_w = self.edge_weight
            if old_w is None:
                old_w = torch.ones(self.num_edges, dtype=torch.float32, device=dev)
            new_weight = torch.empty(total, dtype=old_w.dtype, device=dev)
            new_weight[old_pos] = old_w
            new_weight[loop_pos] = weight
        return self._derive(new_indptr, indices, new_weight)

    def gcn_norm(self, add_self_loops: bool = True) -> Graph:
        """Symmetric GCN normalisation ``D^-1/2 (A + I) D^-1/2`` stored in ``edge_weight``.

        ``D`` holds the weighted row sums (in-degrees) of ``A + I``; nodes of degree 0 get 0.
        Self loops are added with :meth:`add_self_loops` (existing ones are kept).
        """
        g = self.add_self_loops() if add_self_loops else self
        w = weights_or_ones(g)
        rows = g.rows()
        deg = _segment_sum(w, rows, g.num_nodes)
        inv_sqrt = deg.pow(-0.5)
        inv_sqrt[~torch.isfinite(inv_sqrt)] = 0.0
        norm = _take(inv_sqrt, rows) * w * _take(inv_sqrt, g.indices)
        return g._derive(g.indptr, g.indices, norm)

    def weighted_self_loops(self) -> Graph:
        """``A + I`` with the edge weights as they are (1 on an unweighted graph) and a self
        loop of weight 1 where a node has none: the adjacency GAT and GIN read (the
        ``"raw"`` normalisation of :func:`gnnpar.sparse.prepare_shards`)."""
        g = self.add_self_loops()
        return g._derive(g.indptr, g.indices, weights_or_ones(g))

    def row_normalize(self) -> Graph:
        """Scale every row to sum to 1 (mean aggregation, ``D^-1 A``); empty rows stay empty."""
        w = weights_or_ones(self)
        rows = self.rows()
        inv = 1.0 / _segment_sum(w, rows, self.num_nodes)
        inv[~torch.isfinite(inv)] = 0.0
        return self._derive(self.indptr, self.indices, w * _take(inv, rows))

    def subgraph(self, nodes: Any) -> Graph:
        """The subgraph induced by ``nodes``, relabelled in the given order.

        New node ``k`` is old node ``nodes[k]`` (a boolean mask of length ``num_nodes`` is
        also accepted, meaning the selected nodes in increasing id order). ``ndata`` is sliced
        accordingly. Edges keep their relative order inside each row.
        """
        nodes = self._node_selection(nodes).to(self.indices.device)
        n, k, dev = self.num_nodes, nodes.numel(), self.indices.device
        counts = torch.bincount(nodes, minlength=n)
        if k and int(counts.max()) > 1:
            dup = int(torch.nonzero(counts > 1)[0, 0])
            raise ValueError(f"subgraph nodes contain node {dup} {int(counts[dup])} times")
        new_id = torch.full((n,), -1, dtype=torch.int64, device=dev)
        new_id[nodes] = torch.arange(k, dtype=torch.int64, device=dev)
        starts = _take(self.indptr, nodes)
        deg = self.indptr[nodes + 1] - starts
        gathered_ptr = _indptr_from_counts(deg)
        total = int(gathered_ptr[-1])
        pos = torch.arange(total, dtype=torch.int64, device=dev) + torch.repeat_interleave(
            starts - gathered_ptr[:-1], deg, output_size=total
        )
        cols = _take(new_id, _take(self.indices, pos))
        keep = cols >= 0
        kept_before = torch.zeros(total + 1, dtype=torch.int64, device=dev)
        torch.cumsum(keep, 0, out=kept_before[1:])
        weight = None if self.edge_weight is None else _take(self.edge_weight, pos)[keep]
        ndata = {key: _take(value, nodes) for key, value in self.ndata.items()}
        graph = self._derive(
            kept_before[gathered_ptr], cols[keep], weight, ndata, num_nodes=k, relabelled=True
        )
        if self.types is not None:
            graph.types = self.types.relabelled(nodes, pos[keep])
        return graph

    def _node_selection(self, nodes: Any) -> torch.Tensor:
        if isinstance(nodes, (torch.Tensor, np.ndarray)) and nodes.dtype in (torch.bool, np.bool_):
            mask = torch.as_tensor(nodes)
            if mask.dim() != 1 or mask.numel() != self.num_nodes:
                raise ValueError(
                    f"a boolean node mask must have shape ({self.num_nodes},), got "
                    f"{tuple(mask.shape)}"
                )
            return torch.nonzero(mask, as_tuple=True)[0]
        nodes = _as_index(nodes, "nodes")
        _check_node_ids(nodes, self.num_nodes, "nodes")
        return nodes

    def permute(self, perm: Any) -> Graph:
        """Relabel nodes: **new node ``i`` is old node ``perm[i]``**.

        Equivalently ``A_new = A[perm][:, perm]`` (``P A P^T`` with ``P[i, perm[i]] = 1``) and
        ``new.ndata[k] == old.ndata[k][perm]``, the same convention as tensor indexing. To
        send old node ``v`` to new id ``new_id[v]`` instead, pass
        ``invert_permutation(new_id)``.
        """
        perm = _as_index(perm, "perm")
        n = self.num_nodes
        if perm.numel() != n:
            raise ValueError(f"perm has {perm.numel()} entries but the graph has {n} nodes")
        _check_node_ids(perm, n, "perm")
        counts = torch.bincount(perm, minlength=n)
        if n and not bool((counts == 1).all()):
            v = int(torch.nonzero(counts != 1)[0, 0])
            raise ValueError(
                f"perm is not a permutation of 0..{n - 1}: node {v} appears {int(counts[v])} times"
            )
        return self.subgraph(perm)

    # ------------------------------------------------------------------ misc
    def to(self, device: str | torch.device) -> Graph:
        """Move topology, weights and node data to ``device``."""
        weight = None if self.edge_weight is None else self.edge_weight.to(device)
        graph = Graph(
            self.indptr.to(device),
            self.indices.to(device),
            self.num_nodes,
            weight,
            {k: v.to(device) for k, v in self.ndata.items()},
            self.name,
            validate=False,
            num_classes=self._num_classes,
        )
        graph.edge_split = self.edge_split
        graph.types = None if self.types is None else self.types.to(device)
        return graph

    def to_torch_sparse(self, layout: torch.layout = torch.sparse_csr) -> torch.Tensor:
        """The weighted adjacency as a torch sparse tensor (``sparse_csr`` or ``sparse_coo``)."""
        w = weights_or_ones(self)
        shape = (self.num_nodes, self.num_nodes)
        if layout == torch.sparse_csr:
            with warnings.catch_warnings():  # "sparse CSR support is in beta"
                warnings.simplefilter("ignore", UserWarning)
                return torch.sparse_csr_tensor(
                    self.indptr, self.indices, w, shape, check_invariants=False
                )
        if layout == torch.sparse_coo:
            src, dst = self.edges()
            return torch.sparse_coo_tensor(
                torch.stack([dst, src]), w, shape, check_invariants=False
            )
        raise ValueError(f"layout must be torch.sparse_csr or torch.sparse_coo, got {layout}")

    def __repr__(self) -> str:
        data = ", ".join(
            f"{k}: {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
            for k, v in self.ndata.items()
        )
        return (
            f"Graph(name={self.name!r}, num_nodes={self.num_nodes}, num_edges={self.num_edges}, "
            f"weighted={self.edge_weight is not None}, ndata={{{data}}})"
        )

    # ------------------------------------------------------------------ converters
    # The code lives in gnnpar.graph.convert (one module for every other library and file).
    def to_scipy(self) -> Any:
        """``scipy.sparse.csr_matrix`` with ``A[i, j]`` = weight of edge ``j -> i``
        (:func:`gnnpar.graph.convert.to_scipy`)."""
        from gnnpar.graph import convert

        return convert.to_scipy(self)

    @classmethod
    def from_scipy(
        cls,
        mat: Any,
        ndata: Mapping[str, torch.Tensor] | None = None,
        name: str = "graph",
        weighted: bool | None = None,
        num_classes: int | None = None,
    ) -> Graph:
        """From a square scipy sparse matrix (``A[i, j]`` = weight of edge ``j -> i``);
        ``weighted=None`` keeps the values unless they are all 1
        (:func:`gnnpar.graph.convert.from_scipy`)."""
        from gnnpar.graph import convert

        return convert.from_scipy(mat, ndata, name, weighted, num_classes)

    def to_pyg(self) -> Any:
        """A ``torch_geometric.data.Data`` (``feat`` -> ``x``, ``label`` -> ``y``, masks,
        weights, ``num_classes``; :func:`gnnpar.graph.convert.to_pyg`)."""
        from gnnpar.graph import convert

        return convert.to_pyg(self)

    @classmethod
    def from_pyg(
        cls,
        data: Any,
        name: str = "graph",
        num_classes: int | None = None,
        target: str | None = None,
        node_types: Sequence[str] | None = None,
        relations: Sequence[Any] | None = None,
    ) -> Graph:
        """From a ``torch_geometric.data.Data``, or a ``HeteroData`` as a typed graph
        (``target``, ``node_types``, ``relations``: :func:`gnnpar.graph.convert.from_pyg`)."""
        from gnnpar.graph import convert

        return convert.from_pyg(data, name, num_classes, target, node_types, relations)

    def to_dgl(self, edge_weight_key: str = "w") -> Any:
        """A ``dgl.DGLGraph`` with the same edges, ``ndata`` and weights in
        ``edata[edge_weight_key]`` (:func:`gnnpar.graph.convert.to_dgl`). Needs ``dgl``."""
        from gnnpar.graph import convert

        return convert.to_dgl(self, edge_weight_key)

    @classmethod
    def from_dgl(
        cls,
        g: Any,
        edge_weight_key: str = "w",
        name: str = "graph",
        num_classes: int | None = None,
        target: str | None = None,
        node_types: Sequence[str] | None = None,
        relations: Sequence[Any] | None = None,
    ) -> Graph:
        """From a ``dgl.DGLGraph``, a heterograph as a typed graph (``target``,
        ``node_types``, ``relations``: :func:`gnnpar.graph.convert.from_dgl`)."""
        from gnnpar.graph import convert

        return convert.from_dgl(g, edge_weight_key, name, num_classes, target, node_types,
                                relations)  # fmt: skip

    def to_networkx(self, node_attrs: bool = True, weight_key: str = "weight") -> Any:
        """A ``networkx.DiGraph`` (``MultiDiGraph`` with duplicate edges) with node data as
        node attributes (:func:`gnnpar.graph.convert.to_networkx`)."""
        from gnnpar.graph import convert

        return convert.to_networkx(self, node_attrs, weight_key)

    @classmethod
    def from_networkx(
        cls,
        g: Any,
        node_attrs: Iterable[str] | None = None,
        weight_key: str | None = "weight",
        ndata: Mapping[str, torch.Tensor] | None = None,
        name: str | None = None,
    ) -> Graph:
        """From a networkx graph; an undirected one gets both directions of every edge
        (:func:`gnnpar.graph.convert.from_networkx`)."""
        from gnnpar.graph import convert

        return convert.from_networkx(g, node_attrs, weight_key, ndata, name)

    def to_edge_list(self, path: str | Path | None = None) -> np.ndarray:
        """Edges as an ``(E, 2)`` int64 array of ``(src, dst)`` rows; with ``path``, also
        written as an edge-list text file (:func:`gnnpar.graph.convert.to_edge_list`)."""
        from gnnpar.graph import convert

        return convert.to_edge_list(self, path)

    @classmethod
    def from_edge_list(
        cls,
        edges: np.ndarray | str | Path,
        num_nodes: int | None = None,
        edge_weight: Any = None,
        ndata: Mapping[str, torch.Tensor] | None = None,
        name: str = "graph",
    ) -> Graph:
        """From an ``(E, 2)`` array of ``(src, dst)`` rows or an edge-list text file
        (``src dst [weight]`` per line, ``#`` comments, ``# nodes: N``;
        :func:`gnnpar.graph.convert.from_edge_list`)."""
        from gnnpar.graph import convert

        return convert.from_edge_list(edges, num_nodes, edge_weight, ndata, name)


def check_node_data(
    num_nodes: int, ndata: Mapping[str, Any], num_classes: int | None = None
) -> None:
    """The checks :meth:`Graph.validate` makes of node data, on node data alone (a graph
    folder read without its edges): shapes, finite floats, class-id labels within
    ``num_classes``, boolean disjoint split masks. UserError naming the first problem."""
    empty = torch.zeros(int(num_nodes) + 1, dtype=torch.int64)
    graph = Graph(empty, empty[:0], num_nodes, ndata=ndata, validate=False, num_classes=num_classes)
    graph._validate_data()


def check_trainable_data(name: str, ndata: Mapping[str, torch.Tensor]) -> None:
    """:meth:`Graph.check_trainable` on node data alone (``feat`` need only be present):
    what a check of a graph folder too large to load reads."""
    for key in ("feat", "label", "train_mask"):
        if key not in ndata:
            raise UserError(f"graph {name!r} has no node data {key!r}")
    train = ndata["train_mask"].to(torch.bool)
    if not bool(train.any()):
        raise UserError(
            f"graph {name!r} has no training nodes (train_mask is all False): nothing to train on"
        )
    for key, used in (("val_mask", "model selection"), ("test_mask", "the final report")):
        if key in ndata and not bool(ndata[key].to(torch.bool).any()):
            raise UserError(
                f"graph {name!r} has an empty {key.split('_')[0]} split ({key} is all False): "
                f"{used} would be computed on no nodes; give it nodes, or drop {key}"
            )
    y = ndata["label"]
    if y.dim() == 1 and bool((y[train] < 0).any()):
        node = int(torch.nonzero(train & (y < 0))[0, 0])
        label = int(y[node])
        raise UserError(f"graph {name!r}: training node {node} is unlabelled (label {label})")
