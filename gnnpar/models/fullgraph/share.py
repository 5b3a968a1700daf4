"""One rank's share of the graph for a user's own model (:mod:`gnnpar.models.fullgraph.pyg`):
node rows split over the whole tensor grid, the adjacency cut in 2D, features whole.

A user's ``forward`` does row-wise things between its convolutions (residuals, ``torch.cat``
of layers, ``log_softmax``, LayerNorm per node), so every node tensor between modules keeps
one layout, the same at every layer: this rank's **rows** of all the features. The rows are
cut in two levels: N into ``x`` chunks (chunk ``a``: the *columns* this rank's adjacency
block reads), each of those into ``y·z`` sub-chunks (sub-chunk ``c``: the rows this rank
holds). The rank at (a, c) holds:

- node rows: sub-chunk c of chunk a (``rows``), every feature;
- the adjacency block: rows ``X`` = sub-chunk c of every chunk a′ (the rows the ranks of
  its x group hold, in x order) × columns chunk a (``cols``).

An aggregation ``Â·H`` is then::

    Hc  = all-gather_yz(H)                 (chunk a of H: the block's columns)
    P   = Â_block · Hc                     (partial sums of the rows X over the x group)
    OUT = reduce-scatter_x(P)              (this rank's rows)

and its backward the adjoints (reduce-scatter over y·z, all-gather over x). Attention
(GAT, GATv2) also all-gathers the destination rows' values over x and sums the softmax's
row statistics over x, where a row's columns are spread. On a 1×1×p grid this is CAGNET's 1D
(H gathered whole); on x = p each rank's block is a column stripe (outer products summed).

The values each convolution reads are derived here once from the shards' ``"raw"``
adjacency (A + I, edge weights as they are): ``"gcn"`` D^-1/2 (A + I) D^-1/2 with the
weighted in-degrees (PyG's ``gcn_norm``; the degrees of the rows X summed over x, those of
the columns gathered over y·z), ``"mean"`` and ``"sum"`` over the neighbours without self
loops (edge weights ignored, as PyG's SAGEConv and GINConv ignore them), ``"attention"``
the structure with one self loop per node. A graph's own self loops count as self loops.

Every collective is described by a :class:`~gnnpar.models.fullgraph.schedule.Step` of the op
that sends it, recorded as the op runs (:attr:`GraphShare.steps`): the model's
``expected_bytes()`` and the tests' measured bytes meet there.
"""

from __future__ import annotations

import torch

from gnnpar import comm
from gnnpar.comm import chunk_offsets, chunk_sizes
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid
from gnnpar.models.fullgraph.layout import chunk
from gnnpar.models.fullgraph.relations import RELATION_NORM
from gnnpar.models.fullgraph.schedule import Step, step
from gnnpar.sparse import attention, csr
from gnnpar.sparse.csr import CSRBlock
from gnnpar.sparse.kernels import LocalSpMM, spmm
from gnnpar.sparse.source import ShardSource

#: The axis splitting the adjacency's columns, and the one splitting its rows.
COL_AXIS, ROW_AXIS = "x", "yz"
#: The axis the node rows (and so the gradients of replicated parameters) are split over.
NODE_AXIS = "tensor"
#: The adjacency values a convolution may ask :meth:`GraphShare.operator` for.
#: ``"relations"``: every relation's Â_r (a typed graph's shards: RGCNConv, RGATConv).
OPERATORS = ("gcn", "mean", "sum", "attention", "relations")


def share_sizes(n: int, x: int, yz: int, a: int, c: int) -> dict[str, object]:
    """Where the pieces of the rank at (``a`` over x, ``c`` over y·z) lie, for ``n`` nodes on
    an ``x`` × ``yz`` split: its ``rows``, its block's ``cols``, the y·z gather's ``sub_sizes``
    and the x group's ``row_ranges`` (the rows X, in x order)."""
    cols = chunk(n, x, a)
    sub_sizes = chunk_sizes(cols[1] - cols[0], yz)
    start = cols[0] + chunk_offsets(sub_sizes)[c]
    ranges = []
    for other in range(x):
        lo, hi = chunk(n, x, other)
        s = chunk(hi - lo, yz, c)
        ranges.append((lo + s[0], lo + s[1]))
    return {
        "rows": (start, start + sub_sizes[c]),
        "cols": cols,
        "sub_sizes": sub_sizes,
        "row_ranges": ranges,
    }


def _vstack(blocks: list[CSRBlock]) -> CSRBlock:
    """Row blocks of one column range, stacked."""
    ptrs, offset = [torch.zeros(1, dtype=torch.int64)], 0
    for b in blocks:
        ptrs.append(b.indptr[1:] + offset)
        offset += b.nnz
    rows = sum(b.shape[0] for b in blocks)
    return CSRBlock(
        torch.cat(ptrs),
        torch.cat([b.indices for b in blocks]),
        torch.cat([b.values for b in blocks]),
        (rows, blocks[0].shape[1]),
        0,
        blocks[0].col_offset,
    )


class GraphShare:
    """This rank's share of the graph (see the module docstring), passed to a parallelized
    model's ``forward`` where the plain model takes ``edge_index``.

    ``source`` must present one node order (its shards cut with permutation ``symmetric``
    or ``none``) and the ``"raw"`` adjacency. ``dtype``: that of the derived values and of
    everything the share sends (the compute dtype: bfloat16 under mixed precision, where the
    degrees are still taken in float32)."""

    def __init__(
        self, grid: ProcessGrid, source: ShardSource, dtype: torch.dtype, device: torch.device
    ) -> None:
        norm = getattr(source, "norm", None)
        if norm not in (None, "raw", RELATION_NORM):
            raise UserError(
                f"{source.norm_where} is {norm!r}, but a PyG model reads the 'raw' adjacency "
                "(each convolution normalises it its own way): prepare the shards with norm='raw'"
            )
        #: The source holds each relation's Â_r (a typed graph's, for RGCNConv and RGATConv),
        #: no raw Â.
        self.typed = norm == RELATION_NORM
        self.grid, self.dtype, self.device = grid, dtype, device
        self.num_nodes = n = source.num_nodes
        self.px, self.pyz = grid.size(COL_AXIS), grid.size(ROW_AXIS)
        where = share_sizes(n, self.px, self.pyz, grid.rank(COL_AXIS), grid.rank(ROW_AXIS))
        self.rows: tuple[int, int] = where["rows"]
        self.cols: tuple[int, int] = where["cols"]
        self.sub_sizes: list[int] = where["sub_sizes"]
        self.row_ranges: list[tuple[int, int]] = where["row_ranges"]
        self.scatter_sizes = [hi - lo for lo, hi in self.row_ranges]
        ids0 = source.node_ids(0, self.rows)
        if not torch.equal(ids0, source.node_ids(1, self.rows)):
            raise UserError(
                f"{getattr(source, 'path', 'the source')}: its two node orders differ (a double "
                "permutation); a PyG model needs one order: cut the shards with permutation "
                "'symmetric' or 'none'"
            )
        #: Relations of a typed source (0 otherwise), each one operator.
        self.num_relations = source.num_relations if self.typed else 0
        self._relation_blocks = [
            _vstack([source.relation_adjacency(k, 0, r, self.cols) for r in self.row_ranges])
            for k in range(self.num_relations)
        ]
        self._relation_ops: list[LocalSpMM] = []
        self._relation_edges: list[tuple[torch.Tensor, torch.Tensor]] = []
        if not self.typed:
            raw = _vstack([source.adjacency(0, r, self.cols) for r in self.row_ranges])
            # the values are derived in at least float32 and cast to ``dtype`` once derived
            self._raw = raw.to(dtype=torch.float64 if dtype == torch.float64 else torch.float32)
            self._edge_rows = csr.coo_rows(self._raw)
            global_rows = torch.cat([torch.arange(lo, hi) for lo, hi in self.row_ranges])
            self._loops = global_rows[self._edge_rows] == self._raw.indices + self.cols[0]
        self._blocks: dict[str, CSRBlock] = {}
        self._ops: dict[str, LocalSpMM] = {}
        self._attention: attention.Edges | None = None
        self._edges: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        #: The collectives of the ops run since :meth:`start_recording`.
        self.steps: list[Step] = []
        #: Recompute each convolution in backward (activation checkpointing ``"full"``).
        self.checkpointing = False

    # --------------------------------------------------------------------------- values
    @property
    def num_block_rows(self) -> int:
        """Rows X of the adjacency block (those the x group holds)."""
        return sum(self.scatter_sizes)

    def prepare(self, kinds: list[str]) -> None:
        """Derive the values of ``kinds`` now (collective: degrees cross the grid), so that
        no later pass communicates for them."""
        for kind in kinds:
            if kind not in OPERATORS:
                raise ValueError(f"unknown operator {kind!r}; one of {OPERATORS}")
            if kind == "relations":
                self.relation_operators()
                continue
            if kind == "attention":
                self.attention_edges()
                continue
            self.operator(kind)
            self.edges(kind)

    def _block(self, kind: str) -> CSRBlock:
        if kind not in self._blocks:
            self._blocks[kind] = self._derive(kind)
        return self._blocks[kind]

    def _derive(self, kind: str) -> CSRBlock:
        if self.typed:
            raise UserError(
                f"the shards hold each relation's mean adjacency ({RELATION_NORM!r}), which "
                f"RGCNConv and RGATConv read; a convolution reading the {kind!r} values needs "
                "shards of norm 'raw'"
            )
        raw, rows = self._raw, self._edge_rows
        if kind == "attention":
            return raw
        if kind == "gcn":
            # PyG's gcn_norm: weighted in-degree of each destination, self loops included
            zeros = torch.zeros(raw.shape[0], dtype=raw.values.dtype)
            local = zeros.index_add_(0, rows, raw.values)
            deg_x = self._host_all_reduce(local)
            a = self.grid.rank(COL_AXIS)
            start = sum(self.scatter_sizes[:a])
            mine = deg_x[start : start + self.scatter_sizes[a]].contiguous()
            # the block is derived on the host; collectives move the grid device's tensors
            on_device = mine.to(self.grid.device)
            deg_cols = comm.all_gather(on_device, self.grid, ROW_AXIS, sizes=self.sub_sizes).cpu()
            inv_x, inv_c = deg_x.pow(-0.5), deg_cols.pow(-0.5)
            inv_x[deg_x == 0], inv_c[deg_cols == 0] = 0.0, 0.0
            values = inv_x[rows] * raw.values * inv_c[raw.indices]
            return CSRBlock(raw.indptr, raw.indices, values, raw.shape, 0, raw.col_offset)
        keep = ~self._loops
        ones = torch.ones(int(keep.sum()), dtype=raw.values.dtype)
        block = csr.from_coo(rows[keep], raw.indices[keep], ones, raw.shape, 0, raw.col_offset)
        if kind == "sum":
            return block
        count = torch.zeros(raw.shape[0], dtype=raw.values.dtype).index_add_(0, rows[keep], ones)
        count = self._host_all_reduce(count)
        scale = 1.0 / count.clamp(min=1.0)
        values = scale[csr.coo_rows(block)]
        return CSRBlock(block.indptr, block.indices, values, block.shape, 0, block.col_offset)

    def _host_all_reduce(self, local: torch.Tensor) -> torch.Tensor:
        """The sum of a host tensor over the x axis, through the grid's device."""
        if self.px == 1:
            return local
        return comm.all_reduce(local.to(self.grid.device), self.grid, COL_AXIS).cpu()

    def operator(self, kind: str) -> LocalSpMM:
        """The local SpMM of this rank's block with the values of ``kind`` (:data:`OPERATORS`),
        built once (collective the first time, see :meth:`prepare`)."""
        if kind not in self._ops:
            self._ops[kind] = LocalSpMM(self._block(kind).to(self.dtype, self.device))
        return self._ops[kind]

    def relation_operators(self) -> list[LocalSpMM]:
        """Each relation's local SpMM (its Â_r's block), built once; a UserError when the
        source has no relations (a relational convolution on an untyped graph's shards)."""
        blocks = self._relation_count(len(self._relation_blocks), "a relational convolution")
        if not self._relation_ops:
            self._relation_ops = [LocalSpMM(b.to(self.dtype, self.device)) for b in blocks]
        return self._relation_ops

    def relation_edges(self, relations: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each relation's edges in this rank's block, (row in X, column in ``cols``) on the
        device, built once (RGATConv's attention runs on them). ``relations``: how many the
        convolution has (a UserError unless the graph's number)."""
        blocks = self._relation_count(relations, "RGATConv")
        if not self._relation_edges:
            self._relation_edges = [
                (csr.coo_rows(b).to(self.device), b.indices.to(self.device)) for b in blocks
            ]
        return self._relation_edges

    def _relation_count(self, relations: int, conv: str) -> list[CSRBlock]:
        """The relations' blocks, checked against the ``relations`` a convolution has."""
        if not self.typed:
            raise UserError(
                f"{conv} reads each relation's adjacency: cut a typed graph's shards with norm "
                f"{RELATION_NORM!r}, not 'raw'"
            )
        if relations != len(self._relation_blocks):
            raise UserError(
                f"{conv} has num_relations={relations}, the graph "
                f"{len(self._relation_blocks)} relations"
            )
        return self._relation_blocks

    def relation_partials(self, hc: torch.Tensor, relations: int) -> list[torch.Tensor]:
        """Each relation's ``Â_r`` block times ``hc`` (the block's columns): partial sums
        over the rows X, to be summed over x (:meth:`scatter_rows`). ``relations``: how many
        the convolution has (a UserError unless the graph's number)."""
        self._relation_count(relations, "RGCNConv")
        return [spmm(op, hc) for op in self.relation_operators()]

    def attention_edges(self) -> attention.Edges:
        """The ``"attention"`` block's edges (one self loop per node) for the attention
        SpMM (:func:`gnnpar.sparse.attention.attend`), on the device; built once."""
        if self._attention is None:
            self._attention = attention.Edges(self._block("attention")).to(self.device)
        return self._attention

    def edges(self, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(row in X, column in ``cols``) of each edge of ``kind``'s block, on the device."""
        if kind not in self._edges:
            block = self._block(kind)
            self._edges[kind] = (
                csr.coo_rows(block).to(self.device),
                block.indices.to(self.device),
            )
        return self._edges[kind]

    # ---------------------------------------------------------------------- collectives
    def start_recording(self) -> None:
        """Forget the recorded steps: the next ops' collectives are recorded afresh."""
        self.steps = []

    def _record(
        self, axis: str, fw: str, bw: str | None, elements: int, what: str, itemsize: int
    ) -> None:
        """A collective of ``elements`` values of ``itemsize`` bytes, and its adjoint's."""
        group = self.grid.size(axis)
        self.steps += step("forward", axis, fw, group, elements, what, itemsize)
        if bw is not None:
            self.steps += step("backward", axis, bw, group, elements, what + " (gradient)",
                               itemsize)  # fmt: skip

    def _rows(self, t: torch.Tensor, axis: str, sizes: list[int], kinds: tuple[str, str],
              what: str) -> torch.Tensor:  # fmt: skip
        """``t`` in the share's dtype, its rows' collective over ``axis`` (``kinds``: forward,
        backward) recorded for pieces of ``sizes`` rows padded to the largest."""
        t = t.to(self.dtype)
        width = t[0].numel() if t.dim() > 1 else 1
        full = self.grid.size(axis) * max(sizes) * width
        self._record(axis, kinds[0], kinds[1] if t.requires_grad else None, full, what,
                     t.element_size())  # fmt: skip
        return t

    def gather_cols(self, h: torch.Tensor, what: str = "gather H") -> torch.Tensor:
        """This rank's rows of ``h`` → the rows of its block's columns (all-gather over y·z;
        backward: reduce-scatter)."""
        h = self._rows(h, ROW_AXIS, self.sub_sizes, ("all_gather", "reduce_scatter"), what)
        return comm.gather_from(h, self.grid, ROW_AXIS, sizes=self.sub_sizes)

    def gather_rows(self, v: torch.Tensor, what: str = "gather destination rows") -> torch.Tensor:
        """This rank's rows of ``v`` → the block's rows X (all-gather over x; backward:
        reduce-scatter)."""
        kinds = ("all_gather", "reduce_scatter")
        v = self._rows(v, COL_AXIS, self.scatter_sizes, kinds, what)
        return comm.gather_from(v, self.grid, COL_AXIS, sizes=self.scatter_sizes)

    def scatter_rows(self, p: torch.Tensor, what: str = "OUT = Â·H") -> torch.Tensor:
        """Partial sums over the block's rows X → this rank's rows, summed over x
        (reduce-scatter; backward: all-gather)."""
        kinds = ("reduce_scatter", "all_gather")
        p = self._rows(p, COL_AXIS, self.scatter_sizes, kinds, what)
        return comm.scatter_to(p, self.grid, COL_AXIS, sizes=self.scatter_sizes)

    def row_sum(self, s: torch.Tensor, what: str = "softmax row sum") -> torch.Tensor:
        """Per-row partial sums over the block's columns, summed over x (forward and the
        gradient backward)."""
        self._record(COL_AXIS, "all_reduce", "all_reduce" if s.requires_grad else None,
                     s.numel(), what, s.element_size())  # fmt: skip
        return comm.all_reduce_both(s, self.grid, COL_AXIS)

    def row_max(self, m: torch.Tensor, what: str = "softmax row max") -> torch.Tensor:
        """Per-row maxima over the block's columns, the maximum over x (no gradient)."""
        self._record(COL_AXIS, "all_reduce", None, m.numel(), what, m.element_size())
        return comm.all_reduce(m.contiguous(), self.grid, COL_AXIS, op="max") if self.px > 1 else m

    def node_sum(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """A sum over every node's row (BatchNorm statistics): over the whole tensor grid,
        forward and the gradient backward."""
        self._record(NODE_AXIS, "all_reduce", "all_reduce" if t.requires_grad else None,
                     t.numel(), what, t.element_size())  # fmt: skip
        return comm.all_reduce_both(t, self.grid, NODE_AXIS)

    # -------------------------------------------------------------------------- the ops
    def propagate(self, kind: str, h: torch.Tensor, what: str = "Â·H") -> torch.Tensor:
        """``Â·h`` for this rank's rows, ``Â`` with the values of ``kind``."""
        hc = self.gather_cols(h, f"gather H for {what}")
        return self.scatter_rows(spmm(self.operator(kind), hc), f"OUT = {what}")

    def softmax(self, e: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """PyG's ``softmax(e, index=rows)`` over each row's edges (``e``: edges × heads),
        a row's edges spread over the x group (:func:`gnnpar.sparse.attention.edge_softmax`
        with the row maximum and sum reduced over x)."""
        reduce = self.px > 1
        return attention.edge_softmax(
            e, rows, self.num_block_rows,
            self.row_max if reduce else None, self.row_sum if reduce else None,
        )  # fmt: skip

    def neighbour_max(self, h: torch.Tensor) -> torch.Tensor:
        """PyG's max aggregation over each row's neighbours (0 for a row with none), the
        gradient shared equally by the neighbours that attain the maximum (as
        ``scatter_reduce``'s ``amax``), over the whole graph."""
        hc = self.gather_cols(h, "gather H for max")
        return _NeighbourMax.apply(hc, self)


class _NeighbourMax(torch.autograd.Function):
    """Max over neighbours whose columns are spread over the x group: the maximum and the
    count of entries attaining it reduced over x, this rank's rows kept; backward gathers
    the rows' gradients over x and gives each attaining entry its share."""

    @staticmethod
    def forward(ctx, hc, share: GraphShare):  # noqa: D102
        rows, cols = share.edges("mean")
        n, width = share.num_block_rows, hc.shape[1]
        vals = hc[cols]
        idx = rows[:, None].expand_as(vals)
        top = hc.new_full((n, width), -torch.inf).scatter_reduce(0, idx, vals, "amax")
        top = share.row_max(top, "max aggregation")
        hits = (vals == top[rows]).to(hc.dtype)
        ties = hc.new_zeros(n, width).index_add(0, rows, hits)
        share._record(COL_AXIS, "all_reduce", None, ties.numel(), "max aggregation ties",
                      ties.element_size())  # fmt: skip
        if share.px > 1:
            ties = comm.all_reduce(ties, share.grid, COL_AXIS)
        out = torch.where(torch.isinf(top), torch.zeros_like(top), top)
        if ctx.needs_input_grad[0]:
            full = share.px * max(share.scatter_sizes) * width
            share.steps += step("backward", COL_AXIS, "all_gather", share.px, full,
                                "max aggregation (gradient)", hc.element_size())  # fmt: skip
        ctx.save_for_backward(hits, ties, rows, cols)
        ctx.share, ctx.num_cols = share, hc.shape[0]
        a = share.grid.rank(COL_AXIS)
        start = sum(share.scatter_sizes[:a])
        return out[start : start + share.scatter_sizes[a]].clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        hits, ties, rows, cols = ctx.saved_tensors
        share = ctx.share
        g = grad.contiguous()
        if share.px > 1:
            g = comm.all_gather(g, share.grid, COL_AXIS, sizes=share.scatter_sizes)
        share_of = hits * (g / ties.clamp(min=1.0))[rows]
        out = g.new_zeros(ctx.num_cols, g.shape[1]).index_add(0, cols, share_of)
        return out, None
