"""Datasets: a catalogue of named graphs, readers for common layouts, and gnnpar's own
on-disk format.

Main entry points::

    from gnnpar.data import load, catalogue, save_graph, load_graph
    g = load("sbm")                       # a catalogue name (see catalogue())
    g = load("path/to/folder")            # gnnpar, Planetoid or OGB folder
    save_graph(g, "datasets/sbm")         # atomic; memory-mappable .npy files
    g = load_graph("datasets/sbm")

The default data root is ``./datasets`` (``$GNNPAR_DATA`` overrides it).
"""

from gnnpar.data.catalogue import (
    CatalogueEntry,
    build,
    catalogue,
    default_root,
    get_entry,
    load,
    load_path,
)
from gnnpar.data.karate import karate
from gnnpar.data.ogb import ogb, ogbn
from gnnpar.data.planetoid import planetoid
from gnnpar.data.rmat import rmat
from gnnpar.data.safe_pickle import UnsafePickleError, load_pickle
from gnnpar.data.sbm import sbm
from gnnpar.data.splits import per_class_split, random_split
from gnnpar.data.storage import load_graph, read_meta, save_graph

__all__ = [
    "CatalogueEntry",
    "UnsafePickleError",
    "build",
    "catalogue",
    "default_root",
    "get_entry",
    "karate",
    "load",
    "load_graph",
    "load_path",
    "load_pickle",
    "ogb",
    "ogbn",
    "per_class_split",
    "planetoid",
    "random_split",
    "read_meta",
    "rmat",
    "save_graph",
    "sbm",
]
