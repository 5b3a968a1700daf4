"""Learnt input rows for a typed graph's featureless nodes, sharded as the features are.

A featureless node type (ogbn-mag's authors, institutions and fields) has no input features:
its rows of the padded ``feat`` are zero (:mod:`gnnpar.graph.typed`). With ``featureless =
"learn"`` every such node gets a learnt input row of the features' width F instead, as
ogbn-mag's R-GCN baselines learn an embedding per node, and as the mini-batch models do
(:class:`~gnnpar.models.hetero.input.TypedInput`). The table is never whole on a rank: each
holds the featureless rows of its own input block (its rows of the shards' node order ×
its feature columns, the block :meth:`input_features` reads), replaces those rows of the
block with them, and gets their gradient from the first layer's input gradient. No
collective is added beyond that gradient (the first layer's input gradient, which a model
without learnt inputs skips).

**In a checkpoint** the table is one full tensor, ``inputs.embedding`` (M × F: the graph's M
featureless nodes in the shards' order 0), with ``inputs.node_ids`` (M: each row's original
node id), both cut like the parameter and kept beside the plain state dict (the checkpoint
meta's ``inputs``, :class:`~gnnpar.checkpoint.state.ModelLayout`): a user's model still loads
its consolidated state dict with ``strict=True``. A resume, on any grid, checks the stored
ids against its own shards' (shards of another node order are one error naming the
checkpoint); :func:`consolidated_embeddings` gives each featureless type's table in its
type-local order.

**Initial values** depend on the node and the column alone (a counter-based draw keyed by
the seed, uniform on [-√3, √3): variance 1, ``nn.Embedding``'s scale), so every grid starts
from the same table.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from gnnpar import comm
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid
from gnnpar.sampling.rng import derive_key, random_unit

__all__ = [
    "EMBEDDING",
    "FEATURELESS",
    "NODE_IDS",
    "InputEmbedding",
    "consolidated_embeddings",
    "featureless_mask",
    "featureless_nodes",
    "initial_rows",
    "with_inputs",
]

#: The checkpoint's names of the table and of its rows' node ids (beside the state dict).
EMBEDDING = "inputs.embedding"
NODE_IDS = "inputs.node_ids"
#: What a featureless type's input rows are: ``zero`` (as stored), ``learn`` (a table).
FEATURELESS = ("zero", "learn")
#: Salt of the initial values' key (one stream of its own beside dropout and sampling).
_INIT = 0x1E4B


def featureless_mask(types: Any, ids: torch.Tensor) -> torch.Tensor:
    """Whether each original node id of ``ids`` is a featureless type's (``types``: the
    graph's :class:`~gnnpar.graph.typed.TypeSchema`)."""
    dims = torch.tensor(types.feat_dims, dtype=torch.int64)
    return dims[types.node_type_of(ids.to(torch.int64))] == 0


def featureless_nodes(types: Any) -> int:
    """How many nodes of ``types`` (a schema, or None) are a featureless type's."""
    if types is None:
        return 0
    return sum(types.num_nodes(t) for t, d in enumerate(types.feat_dims) if d == 0)


def initial_rows(
    node_ids: torch.Tensor, cols: tuple[int, int], seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """The initial table rows of ``node_ids``, columns ``cols``: entry (v, j) a function of
    ``(seed, v, j)`` alone, uniform on [-√3, √3)."""
    width = cols[1] - cols[0]
    col = torch.arange(cols[0], cols[1], dtype=torch.int64)
    keys = (node_ids.to(torch.int64)[:, None] * (1 << 20) + col[None, :]).reshape(-1)
    unit = random_unit(derive_key(seed, _INIT), keys).view(node_ids.numel(), width)
    return ((unit * 2.0 - 1.0) * 3.0**0.5).to(dtype)


class InputEmbedding(nn.Module):
    """This rank's rows of the featureless nodes' table: those of its input block ``rows``
    (positions in the shards' order 0) × ``cols`` (feature columns) of ``source``
    (a :class:`~gnnpar.sparse.source.ShardSource` that records its ``types``).
    :meth:`forward` puts them in the block's featureless rows."""

    def __init__(
        self,
        source: Any,
        rows: tuple[int, int],
        cols: tuple[int, int],
        seed: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        types = getattr(source, "types", None)
        if types is None:
            raise UserError(
                "learnt featureless rows need the shards' node types, which these shards do "
                "not record (a typed graph's shards written by this gnnpar do): prepare them "
                "again"
            )
        ids = source.node_ids(0, (0, source.num_nodes))  # every position's node
        mask = featureless_mask(types, ids)
        if not bool(mask.any()):
            raise UserError(
                "the graph has no featureless node type: there are no input rows to learn "
                "(featureless=zero)"
            )
        mine = mask[rows[0] : rows[1]]
        #: Which rows of the input block are featureless (positions in the block).
        self.positions = torch.nonzero(mine, as_tuple=True)[0].to(device)
        #: Their original node ids (loaded over on resume, then checked: :meth:`check_ids`).
        self.node_ids = ids[rows[0] : rows[1]][mine].clone()
        self._own_ids = self.node_ids.clone()
        #: (M, F): the whole table's shape; this rank's box starts at ``offset``.
        self.shape = (int(mask.sum()), int(source.feat_dim))
        self.offset = (int(mask[: rows[0]].sum()), cols[0])
        self.weight = nn.Parameter(initial_rows(self.node_ids, cols, seed, dtype).to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (the input block) with its featureless rows replaced by the table's."""
        return x.index_put((self.positions,), self.weight.to(x.dtype))

    def pieces(self, write: bool) -> list[Any]:
        """The checkpoint pieces: the rows (``inputs.embedding``), and their node ids
        (``inputs.node_ids``, written by the ranks of the first feature columns)."""
        from gnnpar.checkpoint.chunks import concat
        from gnnpar.checkpoint.state import MODEL, Piece

        rows, width = self.weight.shape
        box = (MODEL + EMBEDDING, self.offset, (rows, width))
        ids_box = (MODEL + NODE_IDS, (self.offset[0],), (rows,))
        return [
            Piece(EMBEDDING, self.weight.detach(), concat([box]), write),
            Piece(NODE_IDS, self.node_ids, concat([ids_box]), write and self.offset[1] == 0),
        ]

    def tensors(self) -> dict[str, Any]:
        """The full tensors' specs (checkpoint names ``model/inputs.*``)."""
        from gnnpar.checkpoint.state import MODEL, TensorSpec

        return {
            MODEL + EMBEDDING: TensorSpec.of(self.shape, self.weight.dtype),
            MODEL + NODE_IDS: TensorSpec.of(self.shape[:1], torch.int64),
        }

    def check_ids(self, grid: ProcessGrid) -> None:
        """After a load (collective): the loaded rows are this run's nodes, in its shards'
        order, on every rank; one error naming the ids' tensor otherwise."""
        bad = torch.tensor([0 if torch.equal(self.node_ids, self._own_ids) else 1])
        bad = comm.all_reduce(bad.to(grid.device), grid, "world", op="max")
        self.node_ids.copy_(self._own_ids)
        if int(bad.item()):
            from gnnpar.checkpoint.protocol import CheckpointError

            raise CheckpointError(
                f"checkpoint tensor {NODE_IDS!r}: the learnt featureless rows follow another "
                "node order than these shards' (another permutation or seed): resume with "
                "the shards the run was trained on"
            )


def with_inputs(layout: Any, inputs: InputEmbedding | None, grid: ProcessGrid) -> Any:
    """``layout`` (a :class:`~gnnpar.checkpoint.state.ModelLayout`) with the learnt rows of
    ``inputs`` (if any): their pieces, written once over the data axis, the table's
    optimizer state following them, and their ids checked after a load."""
    if inputs is None:
        return layout
    from gnnpar.checkpoint.state import writes

    write = writes(grid, ("x", "y", "z"))  # every rank's input block is its own
    pieces = inputs.pieces(write)
    layout.pieces += pieces
    layout.tensors.update(inputs.tensors())
    layout.inputs += [EMBEDDING, NODE_IDS]
    layout.params[id(inputs.weight)] = (pieces[0].chunks, write)
    before = layout.after_load

    def after_load() -> None:
        if before is not None:
            before()
        inputs.check_ids(grid)

    layout.after_load = after_load
    return layout


def consolidated_embeddings(path: str | os.PathLike, types: Any) -> dict[str, torch.Tensor]:
    """Each featureless node type's learnt table, ``(nodes of the type, F)`` in type-local
    order, from the checkpoint at ``path`` (``types``: the graph's
    :class:`~gnnpar.graph.typed.TypeSchema`)."""
    from gnnpar.checkpoint import consolidate_inputs

    stored = consolidate_inputs(path)
    if EMBEDDING not in stored or NODE_IDS not in stored:
        raise UserError(f"checkpoint {path} holds no learnt featureless rows")
    table, ids = stored[EMBEDDING], stored[NODE_IDS]
    out = {}
    for t, name in enumerate(types.node_types):
        if types.feat_dims[t]:
            continue
        lo, hi = types.offsets[t], types.offsets[t + 1]
        mine = (ids >= lo) & (ids < hi)
        rows = torch.empty(hi - lo, table.shape[1], dtype=table.dtype)
        rows[ids[mine] - lo] = table[mine]
        out[name] = rows
    return out
