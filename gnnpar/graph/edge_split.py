"""Link prediction's edge split: which edges train, validate and test a link predictor, and
the negatives its evaluation ranks them against.

An :class:`EdgeSplit` rides on the graph it belongs to (:attr:`Graph.edge_split
<gnnpar.graph.Graph.edge_split>`): that graph is the **message-passing graph** (the training
edges only, so validation and test edges, and their reverses, never carry messages), and the
split records the graph it was cut from (:attr:`EdgeSplit.source`, that graph's
:meth:`~gnnpar.graph.Graph.record`). A graph folder stores both
(:func:`gnnpar.data.storage.save_graph`: ``link/<key>.npy`` and the manifest's
``meta.link``).

Arrays (int64 node ids):

- ``train``, ``val``, ``test``: ``(2, E)`` positive pairs, sources in row 0, destinations
  in row 1 (an undirected graph lists each pair once);
- ``val_neg``, ``test_neg``: the evaluation negatives, in one of two protocols
  (:attr:`EdgeSplit.protocol`):

  - ``"pairs"``: ``(2, M)`` negative pairs shared by every positive (ogbl-collab, ogbl-ppa,
    a random split): a positive's rank is counted against all of them;
  - ``"per-source"``: ``(E, K)`` negative destinations of each positive's source
    (ogbl-citation2): a positive ``(s, d)`` is ranked against ``(s, neg[i, :])``.

:func:`split_edges` cuts a split from a graph (random, or by a node-time attribute), and
:attr:`EdgeSplit.metric` names the score a run selects its model by (``mrr``,
``hits@K`` or ``rocauc``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gnnpar.errors import UserError

if TYPE_CHECKING:
    from gnnpar.graph import Graph

__all__ = [
    "KEYS",
    "METRICS",
    "PROTOCOLS",
    "EdgeSplit",
    "edge_keys",
    "negative_pairs",
    "split_edges",
]

#: The arrays of a split, in storage order (``val_neg``/``test_neg`` may be absent).
KEYS = ("train", "val", "test", "val_neg", "test_neg", "train_label", "val_label", "test_label")
#: The positives' label arrays of an edge classification or regression split.
LABELS = ("train_label", "val_label", "test_label")
#: How evaluation negatives are laid out (module docstring).
PROTOCOLS = ("pairs", "per-source")
#: Scores a split may select models by (``hits@K`` for any K >= 1; ``acc`` for edge
#: classification, ``rmse`` for edge regression).
METRICS = ("mrr", "rocauc", "hits@K", "acc", "rmse")


def check_metric(metric: str, where: str = "metric") -> str:
    """``metric`` if it is one of :data:`METRICS` (``hits@K`` with an integer K >= 1)."""
    if metric in ("mrr", "rocauc", "acc", "rmse"):
        return metric
    head, _, k = metric.partition("@")
    if head == "hits" and k.isdigit() and int(k) >= 1:
        return metric
    raise UserError(f"{where} {metric!r}: one of mrr, rocauc, hits@K (K >= 1), acc, rmse")


def edge_keys(src: torch.Tensor, dst: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """One int64 key per directed pair, ``dst * num_nodes + src``: the order of a CSR graph
    whose rows are destinations and whose sources are sorted within each row (a coalesced
    :class:`~gnnpar.graph.Graph`), so a graph's keys are sorted and a pair is found by
    binary search."""
    return dst.to(torch.int64) * int(num_nodes) + src.to(torch.int64)


@dataclasses.dataclass
class EdgeSplit:
    """Train / validation / test edges of one graph (module docstring)."""

    train: torch.Tensor
    val: torch.Tensor
    test: torch.Tensor
    val_neg: torch.Tensor | None = None
    test_neg: torch.Tensor | None = None
    #: Edge classification / regression: one label per positive of each set, else None.
    train_label: torch.Tensor | None = None
    val_label: torch.Tensor | None = None
    test_label: torch.Tensor | None = None
    protocol: str = "pairs"
    metric: str = "mrr"
    #: The record (:meth:`Graph.record`) of the graph the split was cut from.
    source: dict[str, Any] | None = None
    #: How it was cut: method and options (JSON), e.g. ``{"method": "random", ...}``.
    how: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def label_kind(self) -> str | None:
        """``"classify"`` (int64 labels: a class per positive), ``"regress"`` (float
        labels) or None (link prediction: positives against negatives)."""
        if self.train_label is None:
            return None
        return "classify" if self.train_label.dtype == torch.int64 else "regress"

    @property
    def num_classes(self) -> int:
        """Classes of an edge classification split (largest label + 1), else 0."""
        if self.label_kind != "classify":
            return 0
        return int(max(int(getattr(self, k).max()) for k in LABELS if getattr(self, k).numel())) + 1

    def arrays(self) -> dict[str, torch.Tensor]:
        """The split's arrays by key (:data:`KEYS`), absent ones left out."""
        out = {k: getattr(self, k) for k in KEYS}
        return {k: v for k, v in out.items() if v is not None}

    def meta(self) -> dict[str, Any]:
        """What a graph folder's manifest records of the split (besides its arrays)."""
        return {
            "protocol": self.protocol,
            "metric": self.metric,
            "source": self.source,
            "how": self.how,
            "digest": self.digest(),
        }

    @classmethod
    def from_arrays(
        cls, arrays: Mapping[str, torch.Tensor], meta: Mapping[str, Any], where: str
    ) -> EdgeSplit:
        """The split stored as ``arrays`` and ``meta`` (as :meth:`arrays` and :meth:`meta`
        give them); ``where`` names the folder in errors."""
        missing = [k for k in ("train", "val", "test") if k not in arrays]
        if missing:
            raise UserError(f"{where}: the edge split has no {missing[0]!r} array")
        if not isinstance(meta, Mapping):
            raise UserError(f"{where}: meta field 'link' is not a table")
        split = cls(
            **{k: arrays.get(k) for k in KEYS},
            protocol=meta.get("protocol", "pairs"),
            metric=meta.get("metric", "mrr"),
            source=meta.get("source"),
            how=dict(meta.get("how") or {}),
        )
        recorded = meta.get("digest")
        if recorded is not None and recorded != split.digest():
            raise UserError(f"{where}: the edge split's arrays do not match its recorded digest")
        return split

    def validate(self, num_nodes: int, where: str = "edge split") -> None:
        """One UserError naming the array and the problem: shapes, dtypes, node ids within
        ``[0, num_nodes)``, the protocol and metric, and each negative set's shape."""
        if self.protocol not in PROTOCOLS:
            raise UserError(f"{where}: protocol {self.protocol!r}: one of {PROTOCOLS}")
        check_metric(self.metric, f"{where}: metric")
        self._validate_labels(where)
        for key, t in self.arrays().items():
            if key in LABELS:
                continue
            if t.dtype != torch.int64:
                raise UserError(f"{where}: array {key!r} has dtype {t.dtype}, expected int64")
            pairs = key in ("train", "val", "test") or self.protocol == "pairs"
            if pairs and (t.dim() != 2 or t.shape[0] != 2):
                raise UserError(f"{where}: array {key!r} must be (2, E), got {tuple(t.shape)}")
            if not pairs and (t.dim() != 2 or t.shape[0] != getattr(self, key[:-4]).shape[1]):
                raise UserError(
                    f"{where}: per-source negatives {key!r} must have one row per positive "
                    f"of {key[:-4]!r}, got {tuple(t.shape)}"
                )
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_nodes):
                raise UserError(
                    f"{where}: array {key!r} names node {int(t.max())} or {int(t.min())} "
                    f"outside [0, {num_nodes})"
                )
        if self.train.shape[1] == 0:
            raise UserError(f"{where}: no training edges")

    def _validate_labels(self, where: str) -> None:
        """All three label arrays or none; one label per positive; classes non-negative;
        the metric one of the labels' kind."""
        given = [k for k in LABELS if getattr(self, k) is not None]
        if not given:
            if self.metric in ("acc", "rmse"):
                raise UserError(f"{where}: metric {self.metric} needs edge labels")
            return
        if len(given) != len(LABELS):
            missing = next(k for k in LABELS if k not in given)
            raise UserError(f"{where}: the edge split has labels but no {missing!r} array")
        kinds = {getattr(self, k).dtype.is_floating_point for k in LABELS}
        if len(kinds) != 1 or (not kinds.pop() and self.train_label.dtype != torch.int64):
            raise UserError(f"{where}: edge labels must all be int64 (classes) or all float")
        for key in LABELS:
            t, pairs = getattr(self, key), getattr(self, key[: -len("_label")])
            if t.shape != (pairs.shape[1],):
                raise UserError(
                    f"{where}: array {key!r} must hold one label per positive "
                    f"({pairs.shape[1]}), got shape {tuple(t.shape)}"
                )
            if self.label_kind == "classify" and t.numel() and int(t.min()) < 0:
                raise UserError(f"{where}: array {key!r} has a negative class {int(t.min())}")
            if self.label_kind == "regress" and not bool(torch.isfinite(t).all()):
                raise UserError(f"{where}: array {key!r} has non-finite values")
        want = "acc" if self.label_kind == "classify" else "rmse"
        if self.metric != want:
            raise UserError(f"{where}: metric {self.metric!r} of an edge {self.label_kind} "
                            f"split must be {want}")  # fmt: skip

    def digest(self) -> str:
        """Digest of the arrays and protocol (XXH3-64 hex): what a run records, so a
        resume is refused on another split of the same graph."""
        from gnnpar.graph import content_fingerprint, tensor_bytes

        items = [(f"link/{k}", str(t.dtype), list(t.shape), tensor_bytes(t)) for k, t in
                 self.arrays().items()]  # fmt: skip
        items.append((f"protocol/{self.protocol}", "none", [], iter(())))
        return content_fingerprint(0, items)

    def record(self) -> dict[str, Any]:
        """What a run records of the split: digest, protocol, metric, sizes, its source."""
        return {
            "digest": self.digest(),
            "protocol": self.protocol,
            "metric": self.metric,
            "edges": {k: int(getattr(self, k).shape[1]) for k in ("train", "val", "test")},
            "source": (self.source or {}).get("fingerprint"),
        }


# ---------------------------------------------------------------------------- cutting


def _undirected_pairs(
    graph: Graph, selected: torch.Tensor | None = None
) -> tuple[torch.Tensor, bool]:
    """The graph's edges (those ``selected``, a boolean mask, if given) as pairs (2, E)
    without self loops: each unordered pair once (u < v) when they are symmetric, else every
    directed edge once; and whether they were symmetric."""
    src, dst = graph.edges()
    if selected is not None:
        src, dst = src[selected], dst[selected]
        n = graph.num_nodes
        forward = torch.unique(edge_keys(src, dst, n))
        symmetric = torch.equal(forward, torch.unique(edge_keys(dst, src, n)))
    else:
        symmetric = graph.is_symmetric()
    keep = src != dst
    src, dst = src[keep], dst[keep]
    if symmetric:
        lo, hi = torch.minimum(src, dst), torch.maximum(src, dst)
        keys = torch.unique(edge_keys(hi, lo, graph.num_nodes))  # (u < v) once
        n = graph.num_nodes
        return torch.stack([keys % n, keys // n]), True
    keys = torch.unique(edge_keys(src, dst, graph.num_nodes))
    n = graph.num_nodes
    return torch.stack([keys % n, keys // n]), False


def _order(graph: Graph, pairs: torch.Tensor, seed: int, time: str | None) -> torch.Tensor:
    """The pairs' order of the cut: a seeded permutation, or oldest first by the node
    attribute ``time`` (an edge's time: the later of its endpoints', e.g. the citing paper's
    year), ties broken by the seeded permutation."""
    gen = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(pairs.shape[1], generator=gen)
    if time is None:
        return perm
    if time not in graph.ndata:
        raise UserError(f"{graph.name}: no node attribute {time!r} to split by time")
    t = graph.ndata[time].reshape(graph.num_nodes, -1)[:, 0].to(torch.float64)
    edge_time = torch.maximum(t[pairs[0]], t[pairs[1]])[perm]
    return perm[torch.sort(edge_time, stable=True).indices]


def negative_pairs(
    num_nodes: int,
    true_keys: torch.Tensor,
    count: int,
    gen: torch.Generator,
    src_range: tuple[int, int] | None = None,
    dst_range: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``count`` distinct random pairs (no self loops) that are not edges (``true_keys``:
    sorted keys of every edge, both directions), sources in ``src_range`` and destinations
    in ``dst_range`` (``(lo, hi)``; default every node)."""
    s_lo, s_hi = src_range or (0, num_nodes)
    d_lo, d_hi = dst_range or (0, num_nodes)
    if count > (s_hi - s_lo) * (d_hi - d_lo) - min(s_hi - s_lo, d_hi - d_lo) - true_keys.numel():
        raise UserError(f"the graph has fewer than {count} non-edges to draw negatives from")
    found = torch.empty(0, dtype=torch.int64)
    while found.numel() < count:
        need = 2 * (count - found.numel()) + 16
        src = torch.randint(s_lo, s_hi, (need,), generator=gen)
        dst = torch.randint(d_lo, d_hi, (need,), generator=gen)
        keys = edge_keys(src, dst, num_nodes)
        pos = torch.searchsorted(true_keys, keys).clamp(max=max(true_keys.numel() - 1, 0))
        if true_keys.numel():
            is_edge = true_keys[pos] == keys
        else:
            is_edge = torch.zeros_like(keys, dtype=torch.bool)
        fresh = keys[(~is_edge) & (src != dst)]
        found = torch.cat([found, fresh])
        _, first = np.unique(found.numpy(), return_index=True)
        found = found[torch.from_numpy(np.sort(first))]
    found = found[:count]
    return torch.stack([found % num_nodes, found // num_nodes])


def _per_source_negatives(
    num_nodes: int,
    true_keys: torch.Tensor,
    sources: torch.Tensor,
    k: int,
    gen: torch.Generator,
    dst_range: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``(len(sources), k)`` random destinations per source (in ``dst_range``, default
    every node), none an edge of it (drawn with replacement among the non-edges; redrawn
    where they hit one)."""
    lo, hi = dst_range or (0, num_nodes)
    out = torch.randint(lo, hi, (sources.numel(), k), generator=gen)
    src = sources[:, None].expand_as(out)
    todo = torch.ones_like(out, dtype=torch.bool)  # only redrawn entries are checked again
    for _ in range(64):
        cand, s = out[todo], src[todo]
        keys = edge_keys(s, cand, num_nodes)
        pos = torch.searchsorted(true_keys, keys).clamp(max=max(true_keys.numel() - 1, 0))
        bad = (true_keys[pos] == keys) | (cand == s)
        if not bool(bad.any()):
            return out
        where = todo.nonzero(as_tuple=True)
        todo = torch.zeros_like(todo)
        todo[where[0][bad], where[1][bad]] = True
        out[todo] = torch.randint(lo, hi, (int(bad.sum()),), generator=gen)
    raise UserError("could not draw per-source negatives: some sources link to almost every node")


def split_edges(
    graph: Graph,
    val: float = 0.05,
    test: float = 0.1,
    seed: int = 0,
    time: str | None = None,
    negatives: str = "pairs",
    num_negatives: int = 1,
    metric: str | None = None,
    labels: torch.Tensor | None = None,
    relation: str | None = None,
    reverse_relation: str | None = None,
) -> Graph:
    """Cut a link-prediction split from ``graph``; returns the message-passing graph (the
    training edges, in both directions where ``graph`` is symmetric, node data kept) with
    the split as its :attr:`~gnnpar.graph.Graph.edge_split`.

    Args:
        graph: the whole graph (self loops are dropped from the candidate edges).
        val, test: fractions of the edges (each unordered pair once on a symmetric graph).
        seed: the permutation's and the negatives' seed.
        time: a node attribute ordering the edges in time (an edge's time is the later of
            its endpoints'): the latest edges test, the next validate; None: random.
        negatives: ``"pairs"`` (``num_negatives`` random non-edges per positive, shared by
            all) or ``"per-source"`` (``num_negatives`` corrupted destinations per positive).
        metric: the model-selection score (default ``rocauc`` for pairs, ``mrr`` per source;
            ``acc`` or ``rmse`` with ``labels``).
        labels: one label per edge of ``graph`` in its CSR order (:meth:`Graph.edges`): int64
            classes (edge classification) or floats (edge regression, e.g. the edge
            weights). Each positive takes its edge's label; no negatives are drawn.
        relation: a typed graph's (:mod:`gnnpar.graph.typed`) relation to predict: its
            edges are the candidates (each pair once where the relation is symmetric, as
            ``cites``), negatives are pairs of its source and destination types, and the
            val/test edges leave the message graph with their reverses in
            ``reverse_relation`` (default: the relation ``rev_<name>`` between the same
            types swapped, if there is one). The other relations all stay.
    """
    if not (0 <= val < 1 and 0 <= test < 1 and val + test < 1):
        raise UserError(f"edge split fractions val={val}, test={test}: each in [0, 1), sum < 1")
    if negatives not in PROTOCOLS:
        raise UserError(f"negatives {negatives!r}: one of {PROTOCOLS}")
    if num_negatives < 1:
        raise UserError(f"num_negatives must be >= 1, got {num_negatives}")
    kind = None if labels is None else "acc" if labels.dtype == torch.int64 else "rmse"
    metric = check_metric(metric or kind or ("rocauc" if negatives == "pairs" else "mrr"))
    if labels is not None and labels.shape != (graph.num_edges,):
        raise UserError(
            f"{graph.name}: edge labels must hold one value per edge ({graph.num_edges}), got "
            f"shape {tuple(labels.shape)}"
        )
    target = _target_relation(graph, relation, reverse_relation)
    pairs, symmetric = _undirected_pairs(graph, None if target is None else target.selected)
    m = pairs.shape[1]
    n_test, n_val = int(round(test * m)), int(round(val * m))
    if m - n_test - n_val < 1:
        raise UserError(f"{graph.name}: {m} edges leave none to train on")
    order = _order(graph, pairs, seed, time)
    train = pairs[:, order[: m - n_val - n_test]]
    val_pos = pairs[:, order[m - n_val - n_test : m - n_test]]
    test_pos = pairs[:, order[m - n_test :]]
    # negatives are non-edges of the whole graph (of the relation), in both directions
    src, dst = graph.edges()
    if target is not None:
        src, dst = src[target.selected], dst[target.selected]
    true_keys = torch.unique(torch.cat([edge_keys(src, dst, graph.num_nodes),
                                        edge_keys(dst, src, graph.num_nodes)]))  # fmt: skip
    ranges = {} if target is None else {"src_range": target.src, "dst_range": target.dst}
    gen = torch.Generator().manual_seed(int(seed) + 1)
    n = graph.num_nodes
    label_sets: list[torch.Tensor | None] = [None, None, None]
    if labels is not None:  # each positive's label is its edge's (the first of repeats)
        keys = edge_keys(src, dst, n)
        order_keys, by_key = torch.sort(keys, stable=True)
        label_sets = []
        for part in (train, val_pos, test_pos):
            at = torch.searchsorted(order_keys, edge_keys(part[0], part[1], n))
            label_sets.append(labels[by_key[at]])
        val_neg = test_neg = None
    elif negatives == "pairs":
        both = negative_pairs(n, true_keys, num_negatives * (n_val + n_test), gen, **ranges)
        val_neg, test_neg = both[:, : num_negatives * n_val], both[:, num_negatives * n_val :]
    else:
        dst_range = ranges.get("dst_range")
        val_neg = _per_source_negatives(n, true_keys, val_pos[0], num_negatives, gen, dst_range)
        test_neg = _per_source_negatives(n, true_keys, test_pos[0], num_negatives, gen, dst_range)
    if target is None:
        message = _message_graph(graph, train, symmetric)
    else:
        message = target.message_graph(torch.cat([val_pos, test_pos], 1), symmetric)
    message.edge_split = EdgeSplit(
        train, val_pos, test_pos, val_neg, test_neg, *label_sets, protocol=negatives,
        metric=metric, source=graph.record(),
        how={"method": "time" if time else "random", "val": val, "test": test, "seed": seed,
             "time": time, "negatives": negatives, "num_negatives": num_negatives,
             "symmetric": symmetric, "labels": kind,
             **({} if target is None else target.record())},
    )  # fmt: skip
    return message


def _message_graph(graph: Graph, train: torch.Tensor, symmetric: bool) -> Graph:
    """The graph of the training pairs (both directions when symmetric), same nodes and
    node data, unweighted or with the original weights of the kept edges."""
    from gnnpar.graph import Graph as GraphClass

    src, dst = train
    if symmetric:
        src, dst = torch.cat([src, dst]), torch.cat([dst, src])
    weight = None
    if graph.edge_weight is not None:  # look the kept edges' weights up in the sorted CSR
        whole = graph.coalesce()
        keys = edge_keys(*whole.edges(), whole.num_nodes)
        pos = torch.searchsorted(keys, edge_keys(src, dst, graph.num_nodes))
        weight = whole.edge_weight[pos]
    out = GraphClass.from_edges(
        src, dst, graph.num_nodes, weight, dict(graph.ndata), graph.name, coalesce=True
    )
    if graph.label is not None:
        out.num_classes = graph.num_classes
    return out


@dataclasses.dataclass
class _Target:
    """The relation a typed split predicts: its edges, its ends' id ranges, its reverse."""

    graph: Graph
    index: int
    reverse: int | None
    selected: torch.Tensor
    src: tuple[int, int]
    dst: tuple[int, int]

    def message_graph(self, held_out: torch.Tensor, symmetric: bool) -> Graph:
        """The typed graph without the ``held_out`` pairs of the relation (both directions
        where it is symmetric) and their reverses in the reverse relation."""
        g, n = self.graph, self.graph.num_nodes
        held = edge_keys(held_out[0], held_out[1], n)
        if symmetric:
            held = torch.cat([held, edge_keys(held_out[1], held_out[0], n)])
        held = torch.unique(held)
        src, dst = g.edges()
        et = g.types.edge_type
        drop = (et == self.index) & torch.isin(edge_keys(src, dst, n), held)
        if self.reverse is not None:
            drop |= (et == self.reverse) & torch.isin(edge_keys(dst, src, n), held)
        out = g.keep_edges(~drop)
        if g.label is not None:
            out.num_classes = g.num_classes
        return out

    def record(self) -> dict[str, Any]:
        """What the split's ``how`` records of the relation."""
        from gnnpar.graph.typed import relation_name

        rels = self.graph.types.relations
        rev = None if self.reverse is None else relation_name(rels[self.reverse])
        return {"relation": relation_name(rels[self.index]), "reverse_relation": rev}


def _target_relation(graph: Graph, relation: str | None, reverse: str | None) -> _Target | None:
    """The relation to predict on a typed graph (None for an untyped one, where naming one
    is an error)."""
    types = graph.types
    if types is None:
        if relation is not None or reverse is not None:
            raise UserError(f"{graph.name} has no relations (it is not a typed graph)")
        return None
    if relation is None:
        raise UserError(
            f"{graph.name} is a typed graph: name the relation to predict (relation=...)"
        )
    if types.node_ids is not None:
        raise UserError(f"{graph.name} is relabelled: split the original typed graph")
    r = types.relation_index(relation)
    s_type, _, d_type = types.relations[r]
    if reverse is not None:
        rev: int | None = types.relation_index(reverse)
        if types.relations[rev][::2] != (d_type, s_type):
            raise UserError(f"relation {reverse!r} does not run from {d_type} to {s_type}")
    else:
        name = "rev_" + types.relations[r][1]
        hits = [i for i, x in enumerate(types.relations) if x == (d_type, name, s_type)]
        rev = hits[0] if hits else None

    selected = types.edge_type == r
    return _Target(graph, r, rev, selected, types.id_range(s_type), types.id_range(d_type))
