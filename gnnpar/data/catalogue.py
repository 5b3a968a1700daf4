"""The dataset catalogue and :func:`load`, the one entry point from a name or a folder."""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gnnpar.allocation import check_room
from gnnpar.data.karate import karate
from gnnpar.data.mag import (
    OGBN_MAG,
    is_ogb_typed_folder,
    mag_synth,
    mag_synth_bytes,
    ogbn_mag,
    read_ogb_typed,
)
from gnnpar.data.ogb import is_ogb_folder, ogb, ogbn, ogbn_datasets
from gnnpar.data.ogbl import is_ogbl_folder, ogbl, ogbl_datasets, read_ogbl
from gnnpar.data.planetoid import planetoid, planetoid_names
from gnnpar.data.rmat import rmat
from gnnpar.data.sbm import sbm
from gnnpar.data.storage import is_graph_folder, load_graph, read_meta, read_source
from gnnpar.data.structure import apply_structure, split_structure
from gnnpar.errors import UserError
from gnnpar.graph import Graph

__all__ = [
    "CatalogueEntry",
    "catalogue",
    "get_entry",
    "default_root",
    "build",
    "load",
    "load_path",
    "graph_record",
    "source_record",
]

ENV_VAR = "GNNPAR_DATA"


@dataclass(frozen=True)
class CatalogueEntry:
    """One named dataset.

    Attributes:
        name: the catalogue name, e.g. ``"sbm"``.
        description: one line for ``gnnpar data list``.
        defaults: the keyword arguments the builder accepts, with their defaults.
        builder: ``builder(root, **kwargs) -> Graph``; ``root`` is the data root.
        needs_files: whether the dataset is read from files under the root (not generated).
        metric: what the trainer reports on it (``acc``, or ``rocauc`` for a multi-label
            dataset; see :func:`gnnpar.train.metrics.metric_for`; for a link-prediction
            benchmark its split's :attr:`~gnnpar.graph.edge_split.EdgeSplit.metric`).
    """

    name: str
    description: str
    defaults: Mapping[str, Any]
    builder: Callable[..., Graph]
    needs_files: bool = False
    metric: str = "acc"

    def resolve_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The defaults updated with ``kwargs``; unknown keys raise ValueError."""
        unknown = sorted(set(kwargs) - set(self.defaults))
        if unknown:
            raise UserError(
                f"unknown option(s) {', '.join(unknown)} for dataset {self.name!r}; known: "
                f"{', '.join(self.defaults) or 'none'}"
            )
        return {**self.defaults, **kwargs}


def _defaults_of(func: Callable[..., Any], skip: tuple[str, ...] = ()) -> Mapping[str, Any]:
    params = inspect.signature(func).parameters.values()
    return MappingProxyType(
        {p.name: p.default for p in params if p.default is not p.empty and p.name not in skip}
    )


def _generated(
    func: Callable[..., Graph], bytes_needed: Callable[..., int] | None = None
) -> Callable[..., Graph]:
    """A generator as a builder; ``bytes_needed(**kwargs)``, a lower bound of the memory
    it allocates, is checked against the memory available first (one line naming the
    options instead of an allocation traceback for ``num_nodes=1e13``)."""

    def builder(root: Path, **kwargs: Any) -> Graph:
        if bytes_needed is not None:
            shown = ", ".join(f"{k}={v}" for k, v in kwargs.items())
            check_room(bytes_needed(**kwargs), f"{func.__name__} with {shown}")
        return func(**kwargs)

    return builder


def _sbm_bytes(num_nodes: int, feat_dim: int, avg_degree: float, **_: Any) -> int:
    """At least what :func:`sbm` holds: float32 features, and each edge twice as int64
    (the edge list and the CSR)."""
    return int(4 * num_nodes * max(feat_dim, 0) + 32 * num_nodes * max(avg_degree, 0))


def _rmat_bytes(scale: int, edge_factor: int, feat_dim: int, **_: Any) -> int:
    """At least what :func:`rmat` holds for its ``2**scale`` nodes and
    ``edge_factor * 2**scale`` draws (features, the drawn and the symmetric edges)."""
    n = 2 ** max(int(scale), 0)
    return int(4 * n * max(feat_dim, 0) + 48 * n * max(edge_factor, 0))


def _planetoid_builder(name: str) -> Callable[..., Graph]:
    def builder(root: Path, **kwargs: Any) -> Graph:
        return planetoid(_find_planetoid(root, name), name=name, **kwargs)

    return builder


def _find_planetoid(root: Path, name: str) -> Path:
    candidates = [root / "planetoid", root / name, root / name / "raw", root]
    for folder in candidates:
        if (folder / f"ind.{name}.graph").is_file():
            return folder
    raise FileNotFoundError(
        f"no ind.{name}.* files under {root} (looked in "
        f"{', '.join(str(c) for c in candidates)}); put the Planetoid files in "
        f"{root / 'planetoid'} or pass root="
    )


def _ogbn_builder(name: str) -> Callable[..., Graph]:
    def builder(root: Path, **kwargs: Any) -> Graph:
        return ogbn(root, name, **kwargs)

    return builder


def _ogbn_entries() -> list[CatalogueEntry]:
    """The OGB node-property benchmarks, read from their unpacked archives."""
    from gnnpar.data.sizes import gcn_datasets

    sizes = gcn_datasets()
    defaults = _defaults_of(ogbn, skip=("root", "name"))
    entries = []
    for name, spec in ogbn_datasets().items():
        size = sizes[name]
        kind = "binary tasks" if spec.metric == "rocauc" else "classes"
        feat = (
            "node features: mean of incident edge features"
            if name == "ogbn-proteins"
            else f"{size['features']} features"
        )
        description = (
            f"OGB {spec.what}: {size['nodes']:,} nodes, {spec.num_classes} {kind}, {feat}; "
            f"symmetrised, official {spec.split!r} split, metric {spec.metric} "
            f"(needs the OGB archive under <root>/{name})"
        )
        entries.append(
            CatalogueEntry(
                name, description, defaults, _ogbn_builder(name), True, metric=spec.metric
            )
        )
    return entries


def _ogbl_builder(name: str) -> Callable[..., Graph]:
    def builder(root: Path, **kwargs: Any) -> Graph:
        return ogbl(root, name, **kwargs)

    return builder


def _ogbl_entries() -> list[CatalogueEntry]:
    """The OGB link-property benchmarks, read from their unpacked archives: each loads as
    its split's message-passing graph with the split as ``graph.edge_split``."""
    defaults = _defaults_of(ogbl, skip=("root", "name"))
    entries = []
    for name, spec in ogbl_datasets().items():
        negatives = "per-source negatives" if spec.protocol == "per-source" else "negative pairs"
        description = (
            f"OGB {spec.what}, link prediction: {spec.nodes:,} nodes, {spec.edges:,} edges, "
            f"{spec.features} features; official {spec.split!r} split, {negatives}, "
            f"metric {spec.metric} (needs the OGB archive under <root>/{name})"
        )
        entries.append(
            CatalogueEntry(
                name, description, defaults, _ogbl_builder(name), True, metric=spec.metric
            )
        )
    return entries


def _ogbn_mag_entry() -> CatalogueEntry:
    """OGB's heterogeneous ogbn-mag, read from its unpacked archive as a typed graph."""
    spec = OGBN_MAG

    def builder(root: Path, **kwargs: Any) -> Graph:
        return ogbn_mag(root, **kwargs)

    description = (
        f"OGB MAG academic graph, typed: {spec.nodes:,} nodes (paper, author, institution, "
        f"field_of_study), {spec.edges:,} edges in 4 relations (+ reverses), "
        f"{spec.num_classes} paper venues, {spec.features} paper features; official "
        f"{spec.split!r} split, metric {spec.metric} (needs the OGB archive under "
        f"<root>/{spec.name})"
    )
    defaults = _defaults_of(ogbn_mag, skip=("root",))
    return CatalogueEntry(spec.name, description, defaults, builder, True, metric=spec.metric)


def catalogue() -> list[CatalogueEntry]:
    """All named datasets (a new list on every call)."""
    planetoid_defaults = _defaults_of(planetoid, skip=("root", "name"))
    entries = [
        CatalogueEntry(
            "karate",
            "Zachary's karate club: 34 nodes, 2 classes (networkx)",
            _defaults_of(karate),
            _generated(karate),
        ),
        CatalogueEntry(
            "sbm",
            "stochastic block model with class-correlated features (synthetic, learnable)",
            _defaults_of(sbm),
            _generated(sbm, _sbm_bytes),
        ),
        CatalogueEntry(
            "rmat",
            "Graph500 R-MAT power-law graph, random features and labels (synthetic, scaling)",
            _defaults_of(rmat),
            _generated(rmat, _rmat_bytes),
        ),
        CatalogueEntry(
            "mag-synth",
            "mag-like typed graph: papers, authors, institutions, fields of study, 4 relations "
            "+ reverses; paper classes that relations reveal, features a weak hint (synthetic)",
            _defaults_of(mag_synth),
            _generated(mag_synth, mag_synth_bytes),
        ),
    ]
    for name, what in (
        ("cora", "Cora citation graph, Planetoid split: 2,708 nodes, 7 classes"),
        ("citeseer", "CiteSeer citation graph, Planetoid split: 3,327 nodes, 6 classes"),
        ("pubmed", "PubMed citation graph, Planetoid split: 19,717 nodes, 3 classes"),
    ):
        entries.append(
            CatalogueEntry(
                name,
                f"{what} (needs ind.{name}.* files under <root>/planetoid)",
                planetoid_defaults,
                _planetoid_builder(name),
                needs_files=True,
            )
        )
    return entries + _ogbn_entries() + [_ogbn_mag_entry()] + _ogbl_entries()


def get_entry(name: str) -> CatalogueEntry | None:
    """The catalogue entry called ``name`` (case-insensitive), or None."""
    for entry in catalogue():
        if entry.name.lower() == name.lower():
            return entry
    return None


def default_root() -> Path:
    """``$GNNPAR_DATA`` if set, else ``datasets/`` under the current directory."""
    return Path(os.environ.get(ENV_VAR) or "datasets")


def source_record(name_or_path: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """What :func:`build` made, in the form stored in a graph folder's ``source`` field
    (the structure options, :mod:`gnnpar.data.structure`, under ``structure`` when given)."""
    own, structure = split_structure(kwargs)
    entry = get_entry(name_or_path)
    if entry is not None:
        record = {"dataset": entry.name, "kwargs": entry.resolve_kwargs(own)}
    else:
        record = {"path": str(Path(name_or_path).resolve()), "kwargs": own}
    if structure:
        record["structure"] = structure
    return json.loads(json.dumps(record))  # as it reads back from JSON (tuples become lists)


def load_path(path: str | Path, **kwargs: Any) -> Graph:
    """Load a folder: gnnpar format (``manifest.json``), Planetoid (``ind.<name>.*``; pass
    ``name=`` if it holds several datasets), OGB link layout (``split/<scheme>/train.pt``;
    :func:`gnnpar.data.ogbl.read_ogbl`, ``name=`` when the folder's name does not say which
    benchmark it is), OGB node layout (``raw/edge.csv.gz``) or OGB typed node layout
    (``raw/num-node-dict.csv.gz``, ogbn-mag's: :func:`gnnpar.data.mag.read_ogb_typed`). A
    graph folder of an older gnnpar (``meta.json``) is refused with one line: prepare it
    again."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"no dataset folder at {folder}")
    if is_graph_folder(folder):
        return load_graph(folder, **kwargs)
    names = planetoid_names(folder)
    if names:
        if "name" not in kwargs:
            if len(names) > 1:
                raise UserError(f"{folder} holds Planetoid datasets {names}: pass name=...")
            kwargs["name"] = names[0]
        return planetoid(folder, **kwargs)
    if is_ogbl_folder(folder):
        return read_ogbl(folder, **kwargs)
    if is_ogb_folder(folder):
        return ogb(folder, **kwargs)
    if is_ogb_typed_folder(folder):
        return read_ogb_typed(folder, **kwargs)
    raise UserError(
        f"{folder} is not a gnnpar graph folder (manifest.json), a Planetoid folder "
        "(ind.<name>.* files), an OGB link folder (split/<scheme>/train.pt), an OGB folder "
        "(raw/edge.csv.gz) or an OGB typed folder (raw/num-node-dict.csv.gz)"
    )


def build(name_or_path: str, root: str | Path | None = None, **kwargs: Any) -> Graph:
    """Make a dataset from its source (generator or raw files), never from a prepared copy.

    ``name_or_path`` is a catalogue name or a folder (see :func:`load_path`); the structure
    options (``to_undirected``, ``self_loops``: :mod:`gnnpar.data.structure`) are applied
    to what is built.
    """
    own, structure = split_structure(kwargs)
    entry = get_entry(name_or_path)
    if entry is None:
        if not Path(name_or_path).exists():
            names = ", ".join(e.name for e in catalogue())
            raise UserError(
                f"unknown dataset {name_or_path!r}: not a catalogue name ({names}) and no "
                "such folder"
            )
        graph = load_path(name_or_path, **own)
    else:
        root = default_root() if root is None else Path(root)
        graph = entry.builder(root, **entry.resolve_kwargs(own))
    return apply_structure(graph, structure)


def load(name_or_path: str, root: str | Path | None = None, **kwargs: Any) -> Graph:
    """Load a dataset by catalogue name or from a folder.

    For a catalogue name, a prepared copy at ``<root>/<name>`` (written by
    ``gnnpar data prepare``) is used when its recorded options equal the requested ones
    (defaults included); otherwise the dataset is built from its source. ``root`` defaults
    to :func:`default_root` (``$GNNPAR_DATA`` or ``./datasets``); file-based datasets
    (Planetoid) are looked up under it too. Keyword arguments go to the builder (or, for a
    folder, to its reader), except the structure options (``to_undirected``,
    ``self_loops``: :mod:`gnnpar.data.structure`), which every dataset takes.

    Example::

        g = load("sbm", num_nodes=10_000, seed=1)
        g = load("citeseer", root="../shared/datasets")
        g = load("datasets/my-graph")          # a folder written by save_graph
    """
    entry = get_entry(name_or_path)
    if entry is not None:
        root_path = default_root() if root is None else Path(root)
        prepared = _prepared_copy(root_path / entry.name, entry.name, kwargs)
        if prepared is not None:  # prepared with these structure options too
            return load_graph(prepared)
        own, structure = split_structure(kwargs)
        prepared = _prepared_copy(root_path / entry.name, entry.name, own) if structure else None
        if prepared is not None:
            return apply_structure(load_graph(prepared), structure)
    return build(name_or_path, root, **kwargs)


def _prepared_copy(folder: Path, name: str, kwargs: Mapping[str, Any]) -> Path | None:
    """``folder`` if it is a prepared copy of ``name`` made with ``kwargs`` (defaults
    included), else None; a folder of an older gnnpar is FormatError (prepare it again)."""
    if not is_graph_folder(folder):
        return None
    if read_meta(folder).get("source") != source_record(name, kwargs):
        return None
    return folder


def graph_record(name_or_path: str, root: str | Path | None = None, **kwargs: Any) -> dict:
    """What a derived artefact records about a dataset (``fingerprint``, ``name``,
    ``num_nodes``, ``num_edges``, ``num_classes``), read from the graph folder's manifest
    when there is one (a folder given without structure options, or a prepared copy made
    with these options) and otherwise computed from the loaded graph.
    FileNotFoundError/ValueError as :func:`load` for a missing dataset."""
    folder = stored_folder(name_or_path, root, **kwargs)
    if folder is not None:
        return read_source(folder)
    return load(name_or_path, root, **kwargs).record()


def stored_folder(name_or_path: str, root: str | Path | None = None, **kwargs: Any) -> Path | None:
    """The graph folder that holds the dataset exactly as ``kwargs`` make it (a folder given
    without structure options, or a catalogue entry's copy prepared with these options), or
    None when the dataset must be built or transformed to get it."""
    entry = get_entry(name_or_path)
    if entry is not None:
        root_path = default_root() if root is None else Path(root)
        return _prepared_copy(root_path / entry.name, entry.name, kwargs)
    if is_graph_folder(name_or_path) and not split_structure(kwargs)[1]:
        return Path(name_or_path)
    return None
