"""The sizes of well-known graphs, the one home of the benchmarks' numbers: the catalogue
describes its OGB entries with them and the planner plans for them by name."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["gcn_datasets"]


def gcn_datasets() -> Mapping[str, dict[str, int]]:
    """Sizes of well-known graphs (OGB's numbers: undirected edges)."""
    return MappingProxyType(
        {
            "ogbn-arxiv": {"nodes": 169_343, "edges": 1_166_243, "features": 128, "classes": 40},
            "ogbn-products": {
                "nodes": 2_449_029,
                "edges": 61_859_140,
                "features": 100,
                "classes": 47,
            },
            "ogbn-proteins": {
                "nodes": 132_534,
                "edges": 39_561_252,
                "features": 8,
                "classes": 112,
            },
            "ogbn-papers100M": {
                "nodes": 111_059_956,
                "edges": 1_615_685_872,
                "features": 128,
                "classes": 172,
            },
            "reddit": {"nodes": 232_965, "edges": 57_307_946, "features": 602, "classes": 41},
        }
    )
