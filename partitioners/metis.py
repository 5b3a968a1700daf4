"""METIS k-way partitioning through the METIS library bundled with ``pymetis``.

METIS minimises the edge cut of an undirected graph subject to one balance constraint per
vertex-weight column ("multi-constraint" partitioning). DGL builds its constraints from
``balance_ntypes`` (one 0/1 column per node type; a train mask gives the two types *train*
and *not train*) and ``balance_edges`` (the in-degree, split by type); :func:`constraints`
builds the same columns from the names ``"nodes"``, ``"train"`` and ``"edges"``.

``pymetis.part_graph`` passes only one constraint to METIS whatever the length of its
weight array, so multi-constraint calls go straight to ``METIS_PartGraphKway`` in the shared
library pymetis ships (through ``ctypes``, zero-copy on int64 arrays). When that symbol is
unavailable we fall back to ``pymetis.part_graph`` for single-constraint problems and raise
for the others.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from gnnpar.errors import UserError
from partitioners.csr import CSR, symmetrize, to_numpy

__all__ = ["BALANCE_NAMES", "constraints", "metis_owner"]

BALANCE_NAMES = ("nodes", "train", "edges", "types")
_METIS_OK = 1
_METIS_ERRORS = {-2: "input error", -3: "out of memory", -4: "internal error"}
_METIS_NOPTIONS = 40


def constraints(
    graph: CSR,
    balance: Sequence[str],
    node_weight: Any = None,
    type_weights: tuple[Sequence[np.ndarray], Sequence[str]] | None = None,
) -> tuple[np.ndarray | None, list[str]]:
    """The METIS vertex-weight matrix (n x ncon, int64) for the requested balance.

    ``"types"`` (a typed graph) gives one column per node type and one for the target
    type's training nodes (``type_weights``: the columns and their names, from
    :func:`partitioners.typed.type_columns`), which also balances the node count.
    ``"train"`` splits nodes into training and non-training nodes and balances both counts
    (which also balances the node count); otherwise ``"nodes"`` (or ``node_weight``, which
    replaces the unit weight) is the first column. ``"edges"`` adds the in-degree, split by
    training / non-training nodes when ``"train"`` is also asked for, as DGL does. Columns
    that are all zero are dropped (METIS cannot balance them). Returns ``(None, names)`` for
    the plain unit-weight problem, which METIS handles without a weight array.
    """
    unknown = [b for b in balance if b not in BALANCE_NAMES]
    if unknown:
        raise UserError(f"unknown balance constraint(s) {unknown}; choose from {BALANCE_NAMES}")
    n = graph.num_nodes
    cols: list[np.ndarray] = []
    names: list[str] = []
    groups: list[tuple[str, np.ndarray | None]] = [("", None)]
    typed = "types" in balance
    if typed:
        if type_weights is None:
            raise UserError("balance 'types' needs a typed graph (gnnpar.graph.typed)")
        cols.extend(np.asarray(c, dtype=np.int64) for c in type_weights[0])
        names.extend(type_weights[1])
    if "train" in balance:
        mask = graph.train_mask()
        if mask is None:
            raise UserError("balance 'train' needs ndata['train_mask'], which the graph lacks")
        groups = [("train", mask), ("other", ~mask)]
        if not typed:  # the type columns hold the training nodes already
            for name, m in groups:
                cols.append(m.astype(np.int64))
                names.append(f"{name}_nodes")
    if node_weight is not None:
        w = to_numpy(node_weight)
        if w.ndim == 1:
            w = w[:, None]
        if w.ndim != 2 or w.shape[0] != n:
            raise UserError(f"node_weight must have shape ({n},) or ({n}, c), got {w.shape}")
        if not np.issubdtype(w.dtype, np.integer) or (w.size and int(w.min()) < 0):
            raise UserError("node_weight must hold non-negative integers (METIS weights)")
        for j in range(w.shape[1]):
            cols.append(w[:, j].astype(np.int64))
            names.append(f"weight{j}")
    elif "train" not in balance and not typed:
        cols.append(np.ones(n, dtype=np.int64))
        names.append("nodes")
    if "edges" in balance:
        deg = graph.in_degrees()
        for name, m in groups:
            cols.append(deg if m is None else np.where(m, deg, 0))
            names.append(f"{name}_edges" if name else "edges")
    keep = [j for j, c in enumerate(cols) if c.size and int(c.max()) > 0]
    cols = [cols[j] for j in keep]
    names = [names[j] for j in keep]
    if not cols or (names == ["nodes"]):
        return None, ["nodes"]
    return np.ascontiguousarray(np.stack(cols, axis=1)), names


def _library() -> tuple[Any, Any] | None:
    """``(ctypes library, option indices)`` of pymetis's METIS, or None if not reachable."""
    try:
        import pymetis._internal as internal

        lib = ctypes.CDLL(internal.__file__)
        fn = lib.METIS_PartGraphKway
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    if internal._idx_type_width() != 64:  # we pass int64 arrays
        return None
    return lib, internal.options_indices


def _ptr(a: np.ndarray | None) -> ctypes.c_void_p | None:
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def metis_owner(
    graph: CSR,
    num_parts: int,
    seed: int = 0,
    balance: Sequence[str] = ("nodes",),
    node_weight: Any = None,
    edge_weight: Any = None,
    ufactor: int = 30,
    niter: int = 10,
    ncuts: int = 1,
    recursive: bool = False,
    type_weights: tuple[Sequence[np.ndarray], Sequence[str]] | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Partition with METIS; returns ``(owner, info)``.

    The graph is made undirected first (``A + A^T`` without self loops; DGL does the same).
    ``edge_weight`` is ``None`` (unit weights), ``True`` (the graph's own weights) or an
    array aligned with ``graph.indices``; weights must be positive integers for METIS, so
    float weights are scaled so the smallest positive one becomes 1 and rounded.
    ``ufactor`` is the allowed imbalance in thousandths (30 = 3%, METIS's default).
    ``info`` holds METIS's objective (``edge_cut``, counting each undirected edge once) and
    the constraint names. ``type_weights`` are the columns of balance ``"types"`` (see
    :func:`constraints`); when METIS cannot take several constraints (no
    ``METIS_PartGraphKway`` reachable) they are left out (``info["types_fallback"]``), and
    the rebalancing that follows any method balances the types.
    """
    n = graph.num_nodes
    vwgt, names = constraints(graph, balance, node_weight, type_weights)
    weights = None
    if edge_weight is True:
        if graph.edge_weight is None:
            raise UserError("edge_weight=True but the graph has no edge weights")
        weights = to_numpy(graph.edge_weight)
    elif edge_weight is not None and edge_weight is not False:
        weights = to_numpy(edge_weight)
        if weights.shape != (graph.num_edges,):
            raise ValueError(
                f"edge_weight must have one entry per edge ({graph.num_edges}), got "
                f"shape {weights.shape}"
            )
    if weights is not None and np.any(weights <= 0):
        raise UserError("METIS edge weights must be positive")
    xadj, adjncy, adjwgt = symmetrize(graph.indptr, graph.indices, n, weights)
    if adjwgt is not None:
        adjwgt = _integer_weights(adjwgt)
    info: dict[str, Any] = {"constraints": names, "undirected_edges": int(adjncy.shape[0]) // 2}
    if num_parts == 1 or n == 0:
        info["edge_cut"] = 0
        return np.zeros(n, dtype=np.int64), info
    found = _library()
    if found is None and "types" in balance and vwgt is not None and vwgt.shape[1] > 1:
        plain = [b for b in balance if b != "types"] or ["nodes"]
        vwgt, names = constraints(graph, plain, node_weight)
        info.update(constraints=names, types_fallback=True)
    if found is None:
        owner, cut = _pymetis_fallback(xadj, adjncy, vwgt, adjwgt, num_parts, seed, recursive)
    else:
        lib, keys = found
        options = np.full(_METIS_NOPTIONS, -1, dtype=np.int64)
        lib.METIS_SetDefaultOptions(_ptr(options))
        options[keys.SEED] = seed % 2**31
        options[keys.UFACTOR] = ufactor
        options[keys.NITER] = niter
        options[keys.NCUTS] = ncuts
        options[keys.NUMBERING] = 0
        nvtxs = ctypes.c_int64(n)
        ncon = ctypes.c_int64(1 if vwgt is None else vwgt.shape[1])
        nparts = ctypes.c_int64(num_parts)
        objval = ctypes.c_int64(0)
        owner = np.zeros(n, dtype=np.int64)
        flat_vwgt = None if vwgt is None else np.ascontiguousarray(vwgt.reshape(-1))
        call = lib.METIS_PartGraphRecursive if recursive else lib.METIS_PartGraphKway
        call.restype = ctypes.c_int
        status = call(
            ctypes.byref(nvtxs),
            ctypes.byref(ncon),
            _ptr(xadj),
            _ptr(adjncy),
            _ptr(flat_vwgt),
            None,
            _ptr(adjwgt),
            ctypes.byref(nparts),
            None,
            None,
            _ptr(options),
            ctypes.byref(objval),
            _ptr(owner),
        )
        if status != _METIS_OK:
            raise RuntimeError(
                f"METIS failed ({_METIS_ERRORS.get(status, status)}) on {n} nodes, "
                f"{adjncy.shape[0] // 2} undirected edges, {num_parts} parts, "
                f"{int(ncon.value)} constraint(s)"
            )
        cut = int(objval.value)
    info["edge_cut"] = cut
    return owner, info


def _integer_weights(w: np.ndarray) -> np.ndarray:
    if np.issubdtype(w.dtype, np.integer):
        return w.astype(np.int64)
    smallest = float(w[w > 0].min()) if w.size else 1.0
    scaled = np.rint(w / smallest)
    if scaled.size and float(scaled.max()) > 2**40:
        raise UserError(
            f"edge weights span {float(scaled.max()):.3g}x their smallest value; too wide to "
            "turn into METIS integer weights"
        )
    return np.maximum(scaled, 1).astype(np.int64)


def _pymetis_fallback(
    xadj: np.ndarray,
    adjncy: np.ndarray,
    vwgt: np.ndarray | None,
    adjwgt: np.ndarray | None,
    num_parts: int,
    seed: int,
    recursive: bool,
) -> tuple[np.ndarray, int]:
    import pymetis

    if pymetis.zero_copy_dtype() == np.dtype(np.int32) and adjncy.shape[0] >= 2**31:
        raise UserError(
            f"this pymetis uses 32-bit METIS indices, too small for {adjncy.shape[0]} "
            "adjacency entries; install a pymetis built with 64-bit indices"
        )
    if vwgt is not None and vwgt.shape[1] > 1:
        raise UserError(
            "multi-constraint METIS needs METIS_PartGraphKway from pymetis's shared library, "
            "which could not be loaded; install a 64-bit pymetis or balance on one constraint"
        )
    options = pymetis.Options(seed=seed % 2**31)
    result = pymetis.part_graph(
        num_parts,
        pymetis.CSRAdjacency(xadj, adjncy),
        vweights=None if vwgt is None else vwgt[:, 0],
        eweights=adjwgt,
        recursive=recursive,
        options=options,
    )
    return np.asarray(result.vertex_part, dtype=np.int64), int(result.edge_cuts)
