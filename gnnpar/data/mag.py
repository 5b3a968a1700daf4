"""Typed (heterogeneous) academic graphs: OGB's **ogbn-mag** and **mag-synth**, a small
synthetic graph of the same schema whose paper classes only relations reveal.

Both are typed graphs (:mod:`gnnpar.graph.typed`) with ogbn-mag's schema: node types
``author``, ``field_of_study``, ``institution``, ``paper`` (in this order, OGB's), relations
``author___affiliated_with___institution``, ``author___writes___paper``,
``paper___cites___paper``, ``paper___has_topic___field_of_study`` and, with ``reverse=True``
(the default, as everyone trains ogbn-mag), their reverses (:func:`with_reverses`):
``institution___rev_affiliated_with___author``, ``paper___rev_writes___author``,
``field_of_study___rev_has_topic___paper``, while ``cites`` is made symmetric in place (every
citation both ways, duplicates merged, as PyG's ``ToUndirected`` and DGL's ``AddReverse``
do), so messages reach papers from every type. Only papers have features; the target type
is ``paper``, with its label, the split masks and its publication ``year`` (``ndata["year"]``,
0 on the other types).

**ogbn-mag** layout (as OGB's ``mag.zip`` unpacks, read by OGB's ``read_csv_heterograph_raw``
and PyG's ``OGB_MAG``; every table headerless unless said)::

    <root>/raw/num-node-dict.csv.gz          a header of node types, then one line of counts
    <root>/raw/triplet-type-list.csv.gz      optional: one "src,rel,dst" line per relation
                                             (without it: the folders under raw/relations)
    <root>/raw/relations/<src>___<rel>___<dst>/edge.csv.gz
                                             one "src,dst" line per edge, type-local ids
    <root>/raw/relations/<...>/num-edge-list.csv.gz   optional: the edge count (checked)
    <root>/raw/relations/<...>/edge_reltype.csv.gz    not read (the relation's index)
    <root>/raw/node-feat/<type>/node-feat.csv.gz      optional: a line of floats per node
    <root>/raw/node-feat/<type>/node_year.csv.gz      optional: one year per node (also
                                             accepted at raw/node_year/<type>/node_year.csv.gz)
    <root>/raw/node-label/<type>/node-label.csv.gz    one class id per node, one type only
    <root>/raw/nodetype-has-label.csv.gz     not read (the node-label folders say it)
    <root>/split/<scheme>/<type>/{train,valid,test}.csv.gz   the target type's node ids
    <root>/split/<scheme>/nodetype-has-split.csv.gz         not read

Plain ``.csv`` files are accepted in place of ``.csv.gz``; nothing is unpickled or
downloaded. Every damaged file (truncated, a row too short, not numbers, ids out of range,
counts that disagree) is one :class:`~gnnpar.errors.UserError` line naming it.
:func:`ogbn_mag` finds the folder under a data root (``<root>/ogbn-mag``, ``<root>/ogbn_mag``
or ``<root>/mag``); :func:`read_ogb_typed` reads any folder of this layout (also what
:func:`gnnpar.data.load` does with a path to one).

**mag-synth** (:func:`mag_synth`): each paper's class is a *community*; every author,
institution and field of study belongs to one community (balanced, shuffled). A paper's
authors, fields and cited papers are drawn from its class's community with probability
``homophily`` (else from a uniformly drawn community), an author's institution from the
author's community likewise; a paper's own features are ``feature_signal`` times its class's
mean (drawn from N(0, I)) plus N(0, I) noise: a weak hint. So a relational model (R-GCN
reading which fields, authors and institutions a paper has) classifies papers far better
than an MLP on their features. The split is by year, as ogbn-mag's ``time`` split: years are
uniform in 2010..2019; papers before 2018 train, 2018 validates, 2019 tests (80 / 10 / 10 %).
Everything is determined by ``seed`` (a :class:`torch.Generator`).
"""

from __future__ import annotations

import gzip
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gnnpar.data.ogb import find_table, read_csv_table, read_edge_table
from gnnpar.errors import UserError
from gnnpar.graph import Graph
from gnnpar.graph.typed import Relation, relation_name, typed_graph

__all__ = [
    "MAG_NODE_TYPES",
    "MAG_RELATIONS",
    "OGBN_MAG",
    "OGBTypedDataset",
    "find_ogbn_mag",
    "is_ogb_typed_folder",
    "mag_synth",
    "mag_synth_bytes",
    "ogbn_mag",
    "read_ogb_typed",
    "with_reverses",
]

#: ogbn-mag's node types, in OGB's (sorted) order.
MAG_NODE_TYPES = ("author", "field_of_study", "institution", "paper")
#: ogbn-mag's relations as OGB ships them, in OGB's (sorted) order.
MAG_RELATIONS: tuple[Relation, ...] = (
    ("author", "affiliated_with", "institution"),
    ("author", "writes", "paper"),
    ("paper", "cites", "paper"),
    ("paper", "has_topic", "field_of_study"),
)
_YEARS = (2010, 2019)  # mag-synth's years; 2018 validates, 2019 tests
Edges = dict[Relation, tuple[torch.Tensor, torch.Tensor]]


# ---------------------------------------------------------------------- reverse relations
def _unique_pairs(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ``(src, dst)`` pairs, sorted by source then destination."""
    if not src.numel():
        return src, dst
    width = int(dst.max()) + 1
    keys = torch.unique(src * width + dst)
    return keys // width, keys % width


def with_reverses(edges: Mapping[Relation, tuple[Any, Any]]) -> Edges:
    """``edges`` with every relation's reverse: a relation ``(a, r, b)`` between two types
    gets ``(b, "rev_" + r, a)`` with each edge turned round (listed after all the given
    relations, in their order); a relation within one type (``cites``) gets its reverse
    edges added to it, duplicates merged. One UserError if a ``rev_`` name is taken."""
    out: Edges = {}
    reverses: Edges = {}
    for rel, (s, d) in edges.items():
        src, dst = torch.as_tensor(s, dtype=torch.int64), torch.as_tensor(d, dtype=torch.int64)
        if rel[0] == rel[2]:
            out[rel] = _unique_pairs(torch.cat([src, dst]), torch.cat([dst, src]))
        else:
            out[rel] = (src, dst)
            reverses[(rel[2], f"rev_{rel[1]}", rel[0])] = (dst, src)
    for rel, pair in reverses.items():
        if rel in out:
            raise UserError(f"cannot add the reverse {relation_name(rel)}: the graph has it")
        out[rel] = pair
    return out


# ---------------------------------------------------------------------- mag-synth
def _balanced(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A community in ``[0, k)`` for each of ``n`` items, balanced and shuffled."""
    return (torch.arange(n) % k)[torch.randperm(n, generator=gen)]


def _draw(
    want: torch.Tensor, pool: torch.Tensor, homophily: float, k: int, gen: torch.Generator
) -> torch.Tensor:
    """For each entry of ``want`` (a community), an item of ``pool`` (the items'
    communities): of that community with probability ``homophily``, else of a uniformly
    drawn one; uniform within the community."""
    other = torch.randint(0, k, want.shape, generator=gen)
    comm = torch.where(torch.rand(want.shape, generator=gen) < homophily, want, other)
    order = torch.argsort(pool, stable=True)
    count = torch.bincount(pool, minlength=k)
    start = torch.cumsum(count, 0) - count
    pick = (torch.rand(want.shape, generator=gen) * count[comm]).long()
    return order[start[comm] + torch.minimum(pick, count[comm] - 1)]


def _check_synth(
    sizes: Mapping[str, int], num_classes: int, homophily: float, signal: float
) -> None:
    for key, value in sizes.items():
        low = 0 if key == "citations_per_paper" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UserError(f"mag_synth: {key} must be an integer >= {low}, got {value!r}")
    pools = ("num_authors", "num_institutions", "num_fields")
    if num_classes < 1 or any(sizes[p] < num_classes for p in pools):
        raise UserError(
            f"mag_synth: need 1 <= num_classes <= num_authors, num_institutions and num_fields "
            f"(one community each), got num_classes={num_classes}, "
            + ", ".join(f"{p}={sizes[p]}" for p in pools)
        )
    if not 0.0 <= homophily <= 1.0 or signal < 0:
        raise UserError(
            f"mag_synth: homophily must lie in [0, 1] and feature_signal be >= 0, got "
            f"homophily={homophily}, feature_signal={signal}"
        )


def mag_synth(
    num_papers: int = 2000,
    num_authors: int = 1000,
    num_institutions: int = 40,
    num_fields: int = 80,
    num_classes: int = 8,
    feat_dim: int = 64,
    authors_per_paper: int = 3,
    fields_per_paper: int = 3,
    citations_per_paper: int = 4,
    homophily: float = 0.7,
    feature_signal: float = 0.1,
    reverse: bool = True,
    seed: int = 0,
) -> Graph:
    """A synthetic typed graph of ogbn-mag's schema whose paper classes relations reveal
    (the module docstring says how it is drawn).

    Args:
        num_papers, num_authors, num_institutions, num_fields: nodes of each type.
        num_classes: paper classes (= communities).
        feat_dim: the width of the papers' features (the other types have none).
        authors_per_paper, fields_per_paper, citations_per_paper: draws per paper
            (duplicates merged, self-citations dropped); each author has one institution.
        homophily: probability that a draw comes from the paper's (or author's) community.
        feature_signal: the scale of the class mean in a paper's features (noise is N(0, 1)).
        reverse: add the reverse relations (:func:`with_reverses`).
        seed: seeds everything.
    """
    sizes = {
        "num_papers": num_papers, "num_authors": num_authors,
        "num_institutions": num_institutions, "num_fields": num_fields, "feat_dim": feat_dim,
        "authors_per_paper": authors_per_paper, "fields_per_paper": fields_per_paper,
        "citations_per_paper": citations_per_paper, "num_classes": num_classes,
    }  # fmt: skip
    _check_synth(sizes, num_classes, homophily, feature_signal)
    gen = torch.Generator().manual_seed(int(seed))
    label = torch.randint(0, num_classes, (num_papers,), generator=gen)
    author_comm = _balanced(num_authors, num_classes, gen)
    institution_comm = _balanced(num_institutions, num_classes, gen)
    field_comm = _balanced(num_fields, num_classes, gen)
    papers = torch.arange(num_papers)

    def per_paper(count: int, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = papers.repeat_interleave(count)
        return rows, _draw(label[rows], pool, homophily, num_classes, gen)

    writes_paper, writes_author = per_paper(authors_per_paper, author_comm)
    topic_paper, topic_field = per_paper(fields_per_paper, field_comm)
    citing, cited = per_paper(citations_per_paper, label)
    affiliation = _draw(author_comm, institution_comm, homophily, num_classes, gen)
    keep = citing != cited
    edges: Edges = {
        MAG_RELATIONS[0]: (torch.arange(num_authors), affiliation),
        MAG_RELATIONS[1]: _unique_pairs(writes_author, writes_paper),
        MAG_RELATIONS[2]: _unique_pairs(citing[keep], cited[keep]),
        MAG_RELATIONS[3]: _unique_pairs(topic_paper, topic_field),
    }
    means = torch.randn(num_classes, feat_dim, generator=gen)
    feat = feature_signal * means[label] + torch.randn(num_papers, feat_dim, generator=gen)
    year = torch.randint(_YEARS[0], _YEARS[1] + 1, (num_papers,), generator=gen)
    ndata = {
        "label": label,
        "year": year,
        "train_mask": year < _YEARS[1] - 1,
        "val_mask": year == _YEARS[1] - 1,
        "test_mask": year == _YEARS[1],
    }
    counts = {"author": num_authors, "field_of_study": num_fields}
    counts.update(institution=num_institutions, paper=num_papers)  # MAG_NODE_TYPES' order
    return typed_graph(
        counts,
        with_reverses(edges) if reverse else edges,
        {"paper": feat},
        "paper",
        ndata,
        name="mag-synth",
        num_classes=num_classes,
    )


def mag_synth_bytes(
    num_papers: int,
    num_authors: int,
    num_institutions: int,
    num_fields: int,
    feat_dim: int,
    authors_per_paper: int,
    fields_per_paper: int,
    citations_per_paper: int,
    **_: Any,
) -> int:
    """At least what :func:`mag_synth` holds: the features, zero-padded over every node
    (float32), and every edge in both directions as int64 several times over (the drawn
    pairs, the edge lists, the CSR and the edge types)."""
    nodes = max(num_papers, 0) + max(num_authors, 0) + max(num_institutions, 0)
    nodes += max(num_fields, 0)
    per_paper = max(authors_per_paper, 0) + max(fields_per_paper, 0)
    edges = max(num_papers, 0) * (per_paper + max(citations_per_paper, 0)) + max(num_authors, 0)
    return int(4 * nodes * max(feat_dim, 0) + 2 * 48 * edges)


# ---------------------------------------------------------------------- the OGB layout
@dataclass(frozen=True)
class OGBTypedDataset:
    """One OGB heterogeneous node-property benchmark: its name, archive folder, split
    scheme, classes, metric and sizes (OGB's numbers, edges as shipped)."""

    name: str
    archive: str
    split: str
    num_classes: int
    metric: str
    nodes: int
    edges: int
    features: int

    @property
    def folders(self) -> tuple[str, str, str]:
        """Folder names looked up under a data root: ``ogbn-mag``, ``ogbn_mag``, ``mag``."""
        return (self.name, self.name.replace("-", "_"), self.archive)


#: ogbn-mag as OGB describes it.
OGBN_MAG = OGBTypedDataset("ogbn-mag", "mag", "time", 349, "acc", 1_939_743, 21_111_007, 128)


def is_ogb_typed_folder(path: str | Path) -> bool:
    """True if ``path`` has ``raw/num-node-dict.csv.gz`` (or ``.csv``) and ``raw/relations``."""
    raw = Path(path) / "raw"
    return find_table(raw, "num-node-dict") is not None and (raw / "relations").is_dir()


def _read_text(path: Path) -> str:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            return f.read().decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read ({err})") from None


def _lines(path: Path) -> list[list[str]]:
    return [
        [cell.strip().strip('"') for cell in line.split(",")]
        for line in _read_text(path).splitlines()
        if line.strip()
    ]


def _node_counts(raw: Path) -> dict[str, int]:
    """Node type -> count from ``num-node-dict``, in OGB's (sorted) order."""
    path = find_table(raw, "num-node-dict")
    if path is None:
        raise FileNotFoundError(f"{raw}/num-node-dict.csv.gz is missing")
    rows = _lines(path)
    if len(rows) != 2 or len(rows[0]) != len(rows[1]):
        raise UserError(
            f"{path}: expected a header of node types and one line of as many counts "
            f"(one graph), got {len(rows)} lines"
        )
    try:
        counts = {name: int(value) for name, value in zip(rows[0], rows[1], strict=True)}
    except ValueError as err:
        raise UserError(f"{path}: counts must be integers ({err})") from None
    if len(counts) != len(rows[0]) or any(v < 0 for v in counts.values()):
        raise UserError(f"{path}: node types must be distinct with counts >= 0")
    return dict(sorted(counts.items()))


def _relations(raw: Path, counts: Mapping[str, int]) -> list[Relation]:
    """The relations, from ``triplet-type-list`` or else the relation folders; sorted."""
    path = find_table(raw, "triplet-type-list")
    if path is not None:
        rows, where = _lines(path), str(path)
    else:
        folders = sorted(p.name for p in (raw / "relations").iterdir() if p.is_dir())
        rows, where = [f.split("___") for f in folders], str(raw / "relations")
    relations = []
    for row in rows:
        if len(row) != 3 or row[0] not in counts or row[2] not in counts:
            raise UserError(
                f"{where}: relation {'___'.join(row)!r} is not src___rel___dst of the node "
                f"types {', '.join(counts)}"
            )
        relations.append((row[0], row[1], row[2]))
    if not relations:
        raise UserError(f"{where}: lists no relation")
    return sorted(relations)


def _check_ids(ids: np.ndarray, limit: int, path: Path, what: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= limit):
        raise UserError(f"{path}: {what} ids must lie in [0, {limit})")


def _relation_edges(
    raw: Path, rel: Relation, counts: Mapping[str, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    folder = raw / "relations" / relation_name(rel)
    table, path = read_edge_table(folder, f"{folder}/edge.csv.gz is missing")
    _check_ids(table[:, 0], counts[rel[0]], path, f"source ({rel[0]})")
    _check_ids(table[:, 1], counts[rel[2]], path, f"destination ({rel[2]})")
    return torch.from_numpy(table[:, 0].copy()), torch.from_numpy(table[:, 1].copy())


def _node_table(path: Path, rows: int, dtype: type) -> np.ndarray:
    table = read_csv_table(path, dtype)
    if rows == 0 and table.size == 0:
        return table.reshape(0, table.shape[1])
    if len(table) != rows:
        raise UserError(f"{path}: {len(table)} rows for {rows} nodes")
    return table


def _features(raw: Path, counts: Mapping[str, int]) -> dict[str, torch.Tensor]:
    out = {}
    for ntype, n in counts.items():
        path = find_table(raw / "node-feat" / ntype, "node-feat")
        if path is not None:
            out[ntype] = torch.from_numpy(_node_table(path, n, np.float32))
    return out


def _labels(raw: Path, counts: Mapping[str, int]) -> tuple[str | None, torch.Tensor | None]:
    """The one labelled node type and its labels (NaN or negative: -1), or (None, None)."""
    found = {t: find_table(raw / "node-label" / t, "node-label") for t in counts}
    found = {t: p for t, p in found.items() if p is not None}
    if len(found) > 1:
        raise UserError(f"{raw / 'node-label'}: labels for {', '.join(found)}; one type only")
    if not found:
        return None, None
    (target, path), = found.items()  # fmt: skip
    table = _node_table(path, counts[target], np.float64)
    if table.shape[1] != 1:
        raise UserError(f"{path}: expected one label column, got {table.shape[1]}")
    y = table[:, 0]
    if np.any(np.isfinite(y) & (y != np.round(y))):
        raise UserError(f"{path}: class ids must be integers")
    y = np.where(np.isfinite(y) & (y >= 0), y, -1).astype(np.int64)
    return target, torch.from_numpy(y)


def _year(raw: Path, ntype: str, rows: int) -> torch.Tensor | None:
    path = find_table(raw / "node-feat" / ntype, "node_year")
    path = path or find_table(raw / "node_year" / ntype, "node_year")
    if path is None:
        return None
    table = _node_table(path, rows, np.int64)
    if table.shape[1] != 1:
        raise UserError(f"{path}: expected one year column, got {table.shape[1]}")
    return torch.from_numpy(table[:, 0].copy())


def _split(split_dir: Path, scheme: str | None, target: str, n: int) -> dict[str, torch.Tensor]:
    """The target type's masks from ``split/<scheme>/<target>/``; {} without ``split/``."""
    if not split_dir.is_dir():
        if scheme is not None:
            raise FileNotFoundError(f"split {scheme!r} requested but {split_dir} does not exist")
        return {}
    schemes = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
    if scheme is None and len(schemes) != 1:
        raise UserError(f"{split_dir} holds split schemes {schemes}: pass split=...")
    scheme = schemes[0] if scheme is None else scheme
    if scheme not in schemes:
        raise UserError(f"split {scheme!r} not found in {split_dir}; available: {schemes}")
    folder = split_dir / scheme / target
    masks = {}
    for part, key in (("train", "train_mask"), ("valid", "val_mask"), ("test", "test_mask")):
        path = find_table(folder, part)
        if path is None:
            raise FileNotFoundError(f"{folder}/{part}.csv.gz is missing")
        ids = read_csv_table(path, np.int64).reshape(-1)
        _check_ids(ids, n, path, f"{target} node")
        mask = torch.zeros(n, dtype=torch.bool)
        mask[torch.from_numpy(ids)] = True
        masks[key] = mask
    return masks


def read_ogb_typed(
    root: str | Path,
    split: str | None = None,
    reverse: bool = True,
    name: str | None = None,
    num_classes: int | None = None,
) -> Graph:
    """A typed graph from an OGB heterogeneous node-property folder (the module docstring
    says the layout).

    Args:
        root: the dataset folder (holding ``raw/`` and optionally ``split/``).
        split: the split scheme under ``split/``; ``None`` picks the only one.
        reverse: add the reverse relations (:func:`with_reverses`); ``False`` keeps the
            relations and edges exactly as listed.
        name: graph name; defaults to the folder name.
        num_classes: the number of classes; ``None`` records what the labels span.

    The node types are numbered in OGB's (sorted) order, the relations sorted, then their
    reverses. The labelled type is the target: its labels (-1 where unlabelled), its split
    masks and its ``year`` (when the folder has one) go on the target's nodes.
    """
    root = Path(root)
    raw = root / "raw"
    counts = _node_counts(raw)
    edges: Edges = {rel: _relation_edges(raw, rel, counts) for rel in _relations(raw, counts)}
    target, label = _labels(raw, counts)
    ndata: dict[str, torch.Tensor] = {}
    if target is not None and label is not None:
        ndata["label"] = label
        year = _year(raw, target, counts[target])
        if year is not None:
            ndata["year"] = year
        ndata.update(_split(root / "split", split, target, counts[target]))
    return typed_graph(
        counts,
        with_reverses(edges) if reverse else edges,
        _features(raw, counts),
        target,
        ndata,
        name=name or root.name,
        num_classes=num_classes,
    )


def find_ogbn_mag(root: str | Path) -> Path:
    """The ogbn-mag folder under the data root ``root``: the first of ``<root>/ogbn-mag``,
    ``<root>/ogbn_mag`` and ``<root>/mag`` that has the layout; FileNotFoundError listing
    them otherwise."""
    candidates = [Path(root) / folder for folder in OGBN_MAG.folders]
    for folder in candidates:
        if is_ogb_typed_folder(folder):
            return folder
    raise FileNotFoundError(
        f"no ogbn-mag archive under {root} (looked for raw/num-node-dict.csv.gz and "
        f"raw/relations/ in {', '.join(str(c) for c in candidates)}); unpack OGB's mag.zip there"
    )


def ogbn_mag(root: str | Path, reverse: bool = True) -> Graph:
    """OGB's ogbn-mag from its unpacked archive under the data root ``root``
    (:func:`find_ogbn_mag`): the official ``time`` split, 349 classes, target ``paper``,
    with the reverse relations unless ``reverse=False``."""
    spec = OGBN_MAG
    folder = find_ogbn_mag(root)
    return read_ogb_typed(folder, spec.split, reverse, name=spec.name, num_classes=spec.num_classes)
