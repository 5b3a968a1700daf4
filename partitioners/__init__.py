"""Graph partitioning that stands on its own: methods, an on-disk format, quality metrics.

Quick start::

    import partitioners

    part = partitioners.partition(graph, 4, method="metis", seed=0, balance=["nodes", "train"])
    partitioners.write(graph, part, "out/citeseer-4", halo=1)
    p0 = partitioners.load_part("out/citeseer-4", 0)   # reads manifest.json and part-0/ only

Modules: :mod:`~partitioners.assignment` (``partition``, ``Partition``),
:mod:`~partitioners.simple` (random, range, hash), :mod:`~partitioners.metis`,
:mod:`~partitioners.streaming` (LDG, Fennel), :mod:`~partitioners.blocks` (2D blocks and
Plexus permutations for SpMM), :mod:`~partitioners.format` (the folder layout, loading),
:mod:`~partitioners.writer`, :mod:`~partitioners.metrics`, :mod:`~partitioners.cli`,
:mod:`~partitioners.typed` (typed graphs: per-type balance, the default for them).
"""

from partitioners import blocks, metrics, typed
from partitioners.assignment import METHODS, Partition, partition
from partitioners.csr import CSR, as_csr
from partitioners.format import (
    PartData,
    PartitionFormatError,
    PartitionSourceError,
    check_source,
    load_meta,
    load_node_map,
    load_part,
)
from partitioners.writer import write

__all__ = [
    "CSR",
    "METHODS",
    "PartData",
    "Partition",
    "PartitionFormatError",
    "PartitionSourceError",
    "as_csr",
    "blocks",
    "check_source",
    "load_meta",
    "load_node_map",
    "load_part",
    "metrics",
    "partition",
    "typed",
    "write",
]
