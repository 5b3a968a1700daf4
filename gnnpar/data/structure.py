"""The structure options every dataset takes: symmetrise it, add or remove self loops.

They are dataset options like any other (``--dataset-options to_undirected=true,
self_loops=remove``, a trainer's ``dataset_options``, ``gnnpar data import``), for every
catalogue name, graph folder and imported file, and are applied after the dataset is
built or read:

- ``to_undirected`` (default: not given): ``true`` adds the reverse of every edge
  (:meth:`Graph.to_undirected`: coalesced, weights of both directions merged with max);
  ``false`` keeps the edges as they are and says that a directed graph is meant;
- ``self_loops`` (default ``keep``): ``add`` gives every node one (:meth:`Graph.add_self_loops`),
  ``remove`` drops them all.

A directed graph trained without ``to_undirected`` gets one warning line
(:func:`directed_warning`): GCN and GraphSAGE layers aggregate over in-edges only, so
messages then flow one way, which is rarely what a user of an undirected dataset wants.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gnnpar.errors import UserError
from gnnpar.graph import Graph

__all__ = [
    "SELF_LOOPS",
    "STRUCTURE_DEFAULTS",
    "apply_structure",
    "check_structure",
    "directed_folder_warning",
    "directed_warning",
    "split_structure",
]

#: The structure options and their defaults (the type of each default is the option's).
STRUCTURE_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {"to_undirected": False, "self_loops": "keep"}
)
SELF_LOOPS = ("keep", "add", "remove")


def split_structure(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the dataset's own options, the structure options given)``, each a new dict."""
    own = {k: v for k, v in options.items() if k not in STRUCTURE_DEFAULTS}
    structure = {k: v for k, v in options.items() if k in STRUCTURE_DEFAULTS}
    check_structure(structure)
    return own, structure


def check_structure(structure: Mapping[str, Any]) -> None:
    """One ValueError naming the option for a value of the wrong kind."""
    undirected = structure.get("to_undirected", False)
    if not isinstance(undirected, bool):
        raise UserError(f"option to_undirected: expected true or false, got {undirected!r}")
    loops = structure.get("self_loops", "keep")
    if loops not in SELF_LOOPS:
        raise UserError(
            f"option self_loops: expected one of {', '.join(SELF_LOOPS)}, got {loops!r}"
        )


def apply_structure(graph: Graph, structure: Mapping[str, Any]) -> Graph:
    """``graph`` symmetrised and with its self loops added or removed, as ``structure``
    says (the graph itself when it says nothing)."""
    check_structure(structure)
    if structure.get("to_undirected", False):
        graph = graph.to_undirected()
    loops = structure.get("self_loops", "keep")
    if loops == "add":
        graph = graph.add_self_loops()
    elif loops == "remove":
        graph = graph.remove_self_loops()
    return graph


def directed_warning(graph: Graph, structure: Mapping[str, Any]) -> str | None:
    """The one-line warning for training ``graph`` as it is, or None: when it is directed
    and ``to_undirected`` was not given at all (``to_undirected=false`` means: directed on
    purpose)."""
    if "to_undirected" in structure or graph.is_symmetric():
        return None
    return _directed_message(graph.name)


def directed_folder_warning(folder: str | Path, structure: Mapping[str, Any]) -> str | None:
    """:func:`directed_warning` for a graph folder, read in pieces
    (:func:`~gnnpar.data.storage.is_symmetric_folder`): for a graph too large to load."""
    from gnnpar.data.storage import is_symmetric_folder, read_meta

    if "to_undirected" in structure or is_symmetric_folder(folder):
        return None
    return _directed_message(read_meta(folder)["name"])


def _directed_message(name: str) -> str:
    return (
        f"graph {name!r} is directed and layers aggregate over in-edges only; pass "
        "--dataset-options to_undirected=true to symmetrise it (to_undirected=false to keep "
        "it directed without this warning)"
    )
