"""The 3D tensor-parallel layers of AxoNN: :class:`Linear`, :class:`Embedding`, and a
cross-entropy over vocabulary-sharded logits.

**Linear.** The weight ``W`` (``out × in``, as ``nn.Linear``) is split on three axes: its
columns (input features) over the *in axis*, its rows (output features) over the *out axis*,
and the local block, flattened, over z (see :class:`~gnnpar.tensor.layout.ShardLayout`).
Without ``transpose`` the in axis is x and the out axis is y; ``transpose=True`` swaps them, so
that a transposed layer consumes exactly what a plain one produces.

Per rank, for ``B`` rows of input (the batch this rank holds; the batch is split over
``data × z`` by the caller)::

    forward   W_blk = all-gather(W_shard) over z           (prefetched by the previous layer)
              Y     = X_loc · W_blkᵀ, all-reduced over the in axis,  (+ bias chunk)
    backward  dX    = dY · W_blk, all-reduced over the out axis       (async, overlaps dW)
              dW    = dYᵀ · X_loc, reduce-scattered over z
              then the data-axis reduction (:func:`gnnpar.shard.shard`)

``X_loc`` holds this rank's chunk of input features; ``Y`` this rank's chunk of output
features, replicated over the in axis. In *easy mode* (the default) the layer takes and gives
full feature vectors: it keeps its chunk of the input (``scatter_input``; no communication
forward, an all-gather of ``dX`` over the in axis backward) and all-gathers the output over the
out axis (``gather_output``; backward keeps its chunk). In *expert mode* (``expert_mode=True``)
the caller hands over ``X_loc`` and receives ``Y`` as is, so that a plain layer followed by a
transposed one chains with no re-layout in between.

Bytes per rank (``e`` bytes per element; ``AR(p) = 2(p−1)/p``, ``AG(p) = RS(p) = (p−1)/p``;
``r × c`` the local block, ``L = ceil(r·c/z)``; ``i`` = in axis, ``o`` = out axis)::

    forward   z: AG(z)·z·L·e        i: AR(i)·B·r·e         o (gather_output): AG(o)·B·o_max·p_o·e
    backward  z: RS(z)·z·L·e        o: AR(o)·B·c·e         i (scatter_input): AG(i)·B·c_max·p_i·e

where ``o_max``/``c_max`` are the largest chunks (uneven chunks are padded to the largest for
transfer, as :mod:`gnnpar.comm` counts them).

**Embedding.** The same layout as ``Linear(embedding_dim → num_embeddings)``: rows (token ids)
over the out axis, columns (features) over the in axis, flattened over z, so an output head can
share (tie) its weight. A rank looks up the ids in its row range (zeros elsewhere), all-reduces
over the out axis and (``gather_output``) all-gathers the features over the in axis.

**Sequence parallelism** (``sequence``, :mod:`gnnpar.tensor.sequence`): a ``"gather"``
layer (out axis x) takes this rank's share of the sequence (dimension −2) and all-gathers it
along the sequence over x before its matmul, and backward reduce-scatters ``dX`` along it
instead of all-reducing it over x; a ``"scatter"`` layer (in axis x) reduce-scatters its
output along the sequence instead of all-reducing it, and backward all-gathers ``dY``. The
bytes over x are those of the all-reduces they replace. With ``decompose`` those gathers and
reduce-scatters run as point-to-point steps overlapping the matmul
(:mod:`gnnpar.tensor.overlap`), bit-equal to the collectives on the host.

**Prefetch.** :class:`PrefetchChain` links layers in forward order; when a layer runs it
starts the z all-gather of the next layer's weight, which then travels while this layer
computes. A prefetched weight is used only if the parameter has not changed since (its
version counter), so an optimizer step in between simply causes a fresh gather.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gnnpar import comm
from gnnpar.checkpoint.state import MODEL, Piece, writes
from gnnpar.comm import chunk_offsets, chunk_sizes
from gnnpar.errors import UserError
from gnnpar.grad_destination import grad_destination
from gnnpar.grid import ProcessGrid
from gnnpar.recompute import in_backward
from gnnpar.tensor.layout import ShardLayout
from gnnpar.tensor.overlap import gather_matmul, matmul_scatter
from gnnpar.tensor.sequence import AXIS as SEQ_AXIS
from gnnpar.tensor.sequence import SequenceSplit, features_to_sequence

__all__ = [
    "Embedding",
    "Linear",
    "PrefetchChain",
    "ShardedModule",
    "cross_entropy",
    "vocab_parallel_cross_entropy",
]

WEIGHT_FORMATS = ("out_in", "in_out")
#: A Linear's part in sequence parallelism (:mod:`gnnpar.tensor.sequence`): none, its input
#: arrives split over the sequence and is gathered (a column layer, the head), or its output
#: leaves split over the sequence, reduce-scattered (a row layer).
SEQUENCE_ROLES = ("none", "gather", "scatter")


def _axes(transpose: bool) -> tuple[str, str]:
    """(in axis, out axis) of a layer."""
    return ("y", "x") if transpose else ("x", "y")


# ----------------------------------------------------------------------- autograd kernels
class _GatherDepth(torch.autograd.Function):
    """All-gather of the z pieces of a weight forward (or a prefetched result), reduce-scatter
    of the gradient backward."""

    @staticmethod
    def forward(ctx, shard, grid, handle):  # noqa: D102
        ctx.grid = grid
        return handle.wait() if handle is not None else comm.all_gather(shard, grid, "z")

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return comm.reduce_scatter(g.contiguous(), ctx.grid, "z"), None, None


class _ParallelMatmul(torch.autograd.Function):
    """``Y = X·Wᵀ`` all-reduced over the in axis (+ bias); backward all-reduces ``dX`` over the
    out axis asynchronously while ``dW`` is computed."""

    @staticmethod
    def forward(ctx, x, w, b, grid, in_axis, out_axis, param=None):  # noqa: D102
        ctx.save_for_backward(x, w)
        ctx.grid, ctx.out_axis, ctx.has_bias = grid, out_axis, b is not None
        ctx.param = param  # ``w`` is a view of it: dW may go straight to its gradient bucket
        y = F.linear(x, w)
        if grid.group(in_axis) is not None:
            comm.all_reduce(y, grid, in_axis)
        if b is not None:
            y.add_(b)
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, w = ctx.saved_tensors
        dx = dw = db = handle = None
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(w)
            if ctx.grid.group(ctx.out_axis) is not None:
                handle = comm.all_reduce(dx, ctx.grid, ctx.out_axis, async_op=True)
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            dest = None if ctx.param is None else grad_destination(ctx.param)
            if dest is not None and dest.numel() == w.numel() and dest.dtype == dy2.dtype:
                dw = torch.matmul(dy2.t(), x2, out=dest.view(w.shape))
            else:
                dw = dy2.t().matmul(x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        if handle is not None:
            dx = handle.wait()
        return dx, dw, db, None, None, None, None


def _weight_grad(ctx, dy2: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``dW = dYᵀ·X`` (straight into the parameter's gradient bucket where it can go)."""
    x2 = x.reshape(-1, x.shape[-1])
    dest = None if ctx.param is None else grad_destination(ctx.param)
    if dest is not None and dest.numel() == w.numel() and dest.dtype == dy2.dtype:
        return torch.matmul(dy2.t(), x2, out=dest.view(w.shape))
    return dy2.t().matmul(x2)


class _SequenceGatherMatmul(torch.autograd.Function):
    """A column layer under sequence parallelism: ``Y = all-gather(X)·Wᵀ`` along the sequence
    over x (all-reduced over the in axis, + bias); backward reduce-scatters ``dX`` along the
    sequence over x (overlapping ``dW`` when decomposed). See :mod:`gnnpar.tensor.overlap`."""

    @staticmethod
    def forward(ctx, x, w, b, grid, in_axis, sizes, decompose, param=None):  # noqa: D102
        y, full = gather_matmul(x, lambda c: F.linear(c, w), grid, SEQ_AXIS, -2, sizes, decompose)
        if grid.group(in_axis) is not None:
            comm.all_reduce(y, grid, in_axis)
        if b is not None:
            y.add_(b)
        ctx.save_for_backward(full, w)
        ctx.grid, ctx.sizes, ctx.decompose = grid, sizes, decompose
        ctx.has_bias, ctx.param = b is not None, param
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        full, w = ctx.saved_tensors
        dx = dw = db = pending = None
        if ctx.needs_input_grad[0]:
            pending = matmul_scatter(
                dy, lambda c: c.matmul(w), ctx.grid, SEQ_AXIS, -2, ctx.sizes, ctx.decompose
            )
        dy2 = dy.reshape(-1, dy.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = _weight_grad(ctx, dy2, full, w)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        if pending is not None:
            dx = pending.wait()
        return dx, dw, db, None, None, None, None, None


class _SequenceScatterMatmul(torch.autograd.Function):
    """A row layer under sequence parallelism: ``Y = reduce-scatter(X·Wᵀ)`` along the sequence
    over x (+ bias); backward all-gathers ``dY`` along the sequence over x into ``dX = dY·W``
    (all-reduced over the out axis) and ``dW`` (decomposed: the gather overlaps the
    products)."""

    @staticmethod
    def forward(ctx, x, w, b, grid, out_axis, sizes, decompose, param=None):  # noqa: D102
        mm = lambda c: F.linear(c, w)  # noqa: E731
        y = matmul_scatter(x, mm, grid, SEQ_AXIS, -2, sizes, decompose).wait()
        if b is not None:
            y = y + b
        ctx.save_for_backward(x, w)
        ctx.grid, ctx.out_axis, ctx.sizes, ctx.decompose = grid, out_axis, sizes, decompose
        ctx.has_bias, ctx.param = b is not None, param
        return y

    @staticmethod
    def backward(ctx, dy):  # noqa: D102
        x, w = ctx.saved_tensors
        dw = db = handle = None
        mm = lambda c: c.matmul(w)  # noqa: E731
        dx, dy_full = gather_matmul(dy, mm, ctx.grid, SEQ_AXIS, -2, ctx.sizes, ctx.decompose)
        if ctx.grid.group(ctx.out_axis) is not None:
            handle = comm.all_reduce(dx, ctx.grid, ctx.out_axis, async_op=True)
        dy2 = dy_full.reshape(-1, dy_full.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = _weight_grad(ctx, dy2, x, w)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        if handle is not None:
            dx = handle.wait()
        return dx, dw, db, None, None, None, None, None


# --------------------------------------------------------------------------- base class
class PrefetchChain:
    """Sharded layers in forward order; each one, when it runs, starts the z all-gather of the
    next one's weight. Built by :func:`gnnpar.tensor.parallelize` (``Plan.prefetch``)."""

    def __init__(self, layers: Sequence[ShardedModule]):
        self.layers = list(layers)
        for i, layer in enumerate(self.layers):
            layer._chain, layer._chain_pos = self, i

    def next_after(self, layer: ShardedModule) -> ShardedModule | None:
        """The layer that runs after ``layer``, if any."""
        i = layer._chain_pos + 1
        return self.layers[i] if i < len(self.layers) else None


class ShardedModule(nn.Module):
    """Base of the layers whose parameters are split over the grid. Each describes its
    parameters with :meth:`layouts` (name → :class:`ShardLayout`)."""

    grid: ProcessGrid
    weight_layout: ShardLayout

    def _init_sharding(self, grid: ProcessGrid) -> None:
        self.grid = grid
        self._chain: PrefetchChain | None = None
        self._chain_pos = -1
        self._pending: tuple[comm.Handle, int] | None = None

    def layouts(self) -> dict[str, ShardLayout]:
        """Layout of every sharded parameter, by local parameter name."""
        return {"weight": self.weight_layout}

    def to_full_format(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Turn a full tensor in layout order into the format of the original module's state
        dict (the identity unless the layer replaced a transposed-weight module)."""
        return full

    def from_full_format(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_full_format`."""
        return full

    def stored_transposed(self, name: str) -> bool:
        """Whether the original module's state dict holds parameter ``name`` as the transpose
        of its layout (what :meth:`to_full_format` undoes)."""
        return False

    def stored_piece(
        self, name: str, key: str, value: torch.Tensor, grid: ProcessGrid
    ) -> tuple[tuple[int, ...], Piece] | None:
        """How a checkpoint stores parameter ``name`` (saved under the plain state-dict
        ``key``): the full tensor's shape and this rank's piece of it, its chunks placed by
        the parameter's layout; None for a parameter this layer does not shard
        (:class:`gnnpar.checkpoint.state.ShardedParameters`)."""
        layout = self.layouts().get(name)
        if layout is None:
            return None
        transposed = self.stored_transposed(name)
        shape = tuple(reversed(layout.shape)) if transposed else layout.shape
        r, c, d = layout.coords(grid)
        chunks = layout.chunks(MODEL + key, r, c, d, transposed)
        return shape, Piece(key, value, chunks, writes(grid, layout.split_axes))

    # ------------------------------------------------------------------- z gather/prefetch
    def prefetch(self) -> None:
        """Start the z all-gather of this layer's weight now (no-op when z has one rank or a
        gather is already in flight)."""
        if self.grid.size("z") == 1 or self._pending is not None:
            return
        w = self.weight
        handle = comm.all_gather(w.detach(), self.grid, "z", async_op=True)
        self._pending = (handle, w._version)

    def _weight_block(self) -> torch.Tensor:
        """This rank's ``r × c`` weight block (gathered over z, prefetching the next layer)."""
        lay = self.weight_layout
        r, c, _ = lay.coords(self.grid)
        w = self.weight
        if lay.depth == 1:
            return w.view(lay.block_shape(r, c))
        handle = None
        if self._pending is not None:
            pending, version = self._pending
            self._pending = None
            if version == w._version:
                handle = pending
            else:
                pending.wait()  # stale: the weight changed since; finish it and gather anew
        full = _GatherDepth.apply(w, self.grid, handle)
        # a recompute in backward gathers each layer as it comes: layers after it ran already
        if self._chain is not None and not in_backward():
            nxt = self._chain.next_after(self)
            if nxt is not None:
                nxt.prefetch()
        return lay.unflatten(full, r, c)

    def _load_piece(self, param: torch.Tensor, layout: ShardLayout, full: torch.Tensor) -> None:
        r, c, d = layout.coords(self.grid)
        with torch.no_grad():
            param.copy_(layout.shard(full.to(param.dtype), r, c, d))


def _check_features(n: int, axis: str, grid: ProcessGrid, what: str) -> None:
    if n < grid.size(axis):
        raise UserError(
            f"cannot split {n} {what} over {axis}={grid.size(axis)}: some ranks would hold "
            "none; use a smaller axis or leave this module out of the plan"
        )


# ---------------------------------------------------------------------------------- Linear
class Linear(ShardedModule):
    """``y = x·Wᵀ + b`` with ``W`` split over x, y and z (see the module docstring).

    Args:
        in_features, out_features: full sizes, as for ``nn.Linear``.
        grid: the process grid.
        bias: whether to learn an additive bias (split over the out axis).
        transpose: swap the roles of x and y (in axis y, out axis x).
        expert_mode: the caller keeps the layout: inputs are this rank's chunk of input
            features and outputs its chunk of output features. Shorthand for
            ``scatter_input=False, gather_output=False``.
        scatter_input: input arrives with full features; keep this rank's chunk.
        gather_output: all-gather the output features over the out axis.
        fused: the output features are ``fused`` equal parts (e.g. 3 for a fused
            query/key/value projection), each split over the out axis separately.
        weight_format: ``"out_in"`` (``nn.Linear``) or ``"in_out"`` (GPT-2's ``Conv1D``): the
            orientation of the weight in full state dicts.
        init_weights: initialise the parameters (``False`` leaves them uninitialised, for a
            :meth:`load_full` that follows).
        sequence: the layer's part in sequence parallelism over x
            (:mod:`gnnpar.tensor.sequence`): ``"gather"`` (its input holds this rank's share
            of the sequence, dimension −2, gathered before the matmul; needs x as the out
            axis), ``"scatter"`` (its output leaves as this rank's share, reduce-scattered
            instead of all-reduced; needs x as the in axis) or ``"none"``.
        decompose: run the sequence gather or scatter as point-to-point steps overlapping
            the matmul (:mod:`gnnpar.tensor.overlap`); bit-equal to the collective on the host.
        sequence_split: the shared :class:`~gnnpar.tensor.sequence.SequenceSplit` of the model
            (a ``"gather"`` layer reads the current sequence length from it).

    The parameters are initialised as ``nn.Linear`` would initialise the full layer from the
    global random generator (the same seed gives the same full weight on any grid); this
    builds one full-size weight transiently.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        grid: ProcessGrid,
        bias: bool = True,
        *,
        transpose: bool = False,
        expert_mode: bool = False,
        scatter_input: bool | None = None,
        gather_output: bool | None = None,
        fused: int = 1,
        weight_format: str = "out_in",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        init_weights: bool = True,
        sequence: str = "none",
        decompose: bool = False,
        sequence_split: SequenceSplit | None = None,
    ):
        super().__init__()
        if weight_format not in WEIGHT_FORMATS:
            raise UserError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, int) or v < 1:
                raise UserError(f"{name} must be a positive integer, got {v!r}")
        self._init_sharding(grid)
        self.in_features, self.out_features = in_features, out_features
        self.transpose = transpose
        self.in_axis, self.out_axis = _axes(transpose)
        self.scatter_input = (not expert_mode) if scatter_input is None else scatter_input
        self.gather_output = (not expert_mode) if gather_output is None else gather_output
        self.fused = fused
        self.weight_format = weight_format
        _check_features(in_features, self.in_axis, grid, "input features")
        self._init_sequence(sequence, decompose, sequence_split)
        self.weight_layout = ShardLayout.matrix(
            out_features, in_features, grid, self.out_axis, self.in_axis, fused
        )
        self.bias_layout = ShardLayout.vector(out_features, grid, self.out_axis, fused)
        r, c, _ = self.weight_layout.coords(grid)
        device = grid.device if device is None else device
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.weight_layout.shard_numel(r, c), **kw))
        if bias:
            self.bias = nn.Parameter(torch.empty(self.bias_layout.shard_numel(r), **kw))
        else:
            self.register_parameter("bias", None)
        self.in_sizes = self.weight_layout.col_sizes()
        self.out_sizes = self.weight_layout.row_sizes()
        self._serial = grid.size(self.in_axis) * grid.size(self.out_axis) * grid.size("z") == 1
        if fused > 1:
            order = self.weight_layout.row_order().to(device)
            self.register_buffer("_unfuse", order, persistent=False)
        if init_weights:
            self.reset_parameters()

    def _init_sequence(self, sequence: str, decompose: bool, split: SequenceSplit | None) -> None:
        name = self._name()
        if sequence not in SEQUENCE_ROLES:
            raise UserError(f"{name}: sequence must be one of {SEQUENCE_ROLES}, got {sequence!r}")
        need = {"gather": ("out", self.out_axis), "scatter": ("in", self.in_axis)}.get(sequence)
        if need is not None and need[1] != SEQ_AXIS:
            raise UserError(
                f"{name}: sequence={sequence!r} needs {SEQ_AXIS} as the {need[0]} axis (the "
                f"sequence is split over {SEQ_AXIS}), but this layer's {need[0]} axis is "
                f"{need[1]} (transpose={self.transpose})"
            )
        if decompose and sequence == "none":
            raise UserError(
                f"{name}: decompose needs sequence='gather' or 'scatter': the collectives it "
                "decomposes are sequence parallelism's all-gather and reduce-scatter"
            )
        self.sequence, self.decompose = sequence, bool(decompose)
        if sequence == "none":
            split = None
        elif split is None:
            split = SequenceSplit(self.grid)
        self.sequence_split = split
        #: (stand-in, shard) that a chain block's entry hook hands over (sequence.install)
        self._sequence_input: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_linear(
        cls,
        module: nn.Module,
        grid: ProcessGrid,
        weight_format: str = "out_in",
        *,
        load: bool = True,
        **kwargs,
    ) -> Linear:
        """A parallel copy of ``module`` (an ``nn.Linear``, or with ``weight_format="in_out"``
        a GPT-2 ``Conv1D``): same sizes, dtype, device kind and values (``load=False``: the
        pieces are left uninitialised, for a module on the meta device)."""
        w = module.weight
        if weight_format == "in_out":
            in_f, out_f = w.shape
        else:
            out_f, in_f = w.shape
        layer = cls(
            in_f,
            out_f,
            grid,
            bias=module.bias is not None,
            weight_format=weight_format,
            dtype=w.dtype,
            init_weights=False,
            **kwargs,
        )
        if load:
            layer.load_full(w.detach(), None if module.bias is None else module.bias.detach())
        return layer

    def reset_parameters(self) -> None:
        """Initialise as ``nn.Linear`` does, from the full layer."""
        full = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        bias = None
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            bias = torch.empty(self.out_features, dtype=self.weight.dtype)
            nn.init.uniform_(bias, -bound, bound)
        self._load_layout_order(full, bias)

    def _load_layout_order(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._load_piece(self.weight, self.weight_layout, weight)
        if self.bias is not None:
            if bias is None:
                raise ValueError("this layer has a bias; pass one to load")
            self._load_piece(self.bias, self.bias_layout, bias)

    def load_full(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Keep this rank's piece of a full weight (in ``weight_format``) and bias."""
        self._load_layout_order(self.from_full_format("weight", weight), bias)

    def layouts(self) -> dict[str, ShardLayout]:  # noqa: D102
        out = {"weight": self.weight_layout}
        if self.bias is not None:
            out["bias"] = self.bias_layout
        return out

    def to_full_format(self, name: str, full: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if name == "weight" and self.weight_format == "in_out":
            return full.t().contiguous()
        return full

    def from_full_format(self, name: str, full: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if name == "weight" and self.weight_format == "in_out":
            return full.t()
        return full

    def stored_transposed(self, name: str) -> bool:  # noqa: D102
        return name == "weight" and self.weight_format == "in_out"

    @property
    def local_in_features(self) -> int:
        """Input features of this rank's chunk."""
        return self.in_sizes[self.grid.rank(self.in_axis)]

    @property
    def local_out_features(self) -> int:
        """Output features of this rank's chunk."""
        return self.out_sizes[self.grid.rank(self.out_axis)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if self._serial:
            return F.linear(x, self.weight.view(self.out_features, self.in_features), self.bias)
        grid = self.grid
        seq = self.sequence if grid.size(SEQ_AXIS) > 1 else "none"
        if seq != "none" and x.dim() < 2:
            raise UserError(
                f"{self._name()}: sequence={seq!r} needs inputs with a sequence (dimension -2), "
                f"got shape {tuple(x.shape)}"
            )
        if seq == "gather":
            pending, self._sequence_input = self._sequence_input, None
            if pending is not None and x is pending[0]:  # a chain block's stand-in
                sizes = self.sequence_split.sizes(x.shape[-2])
                x = pending[1]
            else:  # the shard itself (the head)
                sizes = self.sequence_split.shard_sizes(x.shape[-2], self._name())
        elif seq == "scatter":  # the whole sequence in, this rank's share of it out
            sizes = self.sequence_split.sizes(x.shape[-2])
        if self.scatter_input:
            if x.shape[-1] != self.in_features:
                raise ValueError(
                    f"{self._name()}: expected input with {self.in_features} features (easy "
                    f"mode), got shape {tuple(x.shape)}"
                )
            x = comm.split_to(x, grid, self.in_axis, dim=-1, sizes=self.in_sizes)
        elif x.shape[-1] != self.local_in_features:
            raise ValueError(
                f"{self._name()}: expected this rank's {self.local_in_features} of "
                f"{self.in_features} input features split over {self.in_axis} (expert mode), "
                f"got shape {tuple(x.shape)}"
            )
        w = self._weight_block()
        param = self.weight if self.weight_layout.depth == 1 else None  # else w is gathered
        if seq == "gather":
            args = (grid, self.in_axis, sizes, self.decompose, param)
            y = _SequenceGatherMatmul.apply(x, w, self.bias, *args)
        elif seq == "scatter":
            args = (grid, self.out_axis, sizes, self.decompose, param)
            y = _SequenceScatterMatmul.apply(x, w, self.bias, *args)
        else:
            y = _ParallelMatmul.apply(x, w, self.bias, grid, self.in_axis, self.out_axis, param)
        if self.gather_output:
            y = comm.gather_replicated(y, grid, self.out_axis, dim=-1, sizes=self.out_sizes)
            if self.fused > 1:
                y = y.index_select(-1, self._unfuse)
        return y

    def _name(self) -> str:
        return f"Linear({self.in_features}, {self.out_features})"

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, transpose={self.transpose}, "
            f"scatter_input={self.scatter_input}, gather_output={self.gather_output}"
            + (f", fused={self.fused}" if self.fused > 1 else "")
            + f", local={self.local_out_features}x{self.local_in_features}"
            + f"/z{self.grid.size('z')}"
            + (f", sequence={self.sequence}" if self.sequence != "none" else "")
            + (", decompose=True" if self.decompose else "")
        )


# ------------------------------------------------------------------------------- Embedding
class Embedding(ShardedModule):
    """A lookup table split like ``Linear(embedding_dim → num_embeddings)``: token ids over the
    out axis (y, or x with ``transpose``), features over the in axis, flattened over z.

    With ``gather_output`` (default) the output has all ``embedding_dim`` features, replicated
    over x and y; without, this rank's chunk of features (expert mode). Initialised as
    ``nn.Embedding`` (standard normal) from the full table. ``padding_idx``, ``max_norm`` and
    sparse gradients are not supported.

    With ``sequence="scatter"`` (sequence parallelism, :mod:`gnnpar.tensor.sequence`) the
    output holds this rank's share of the sequence (dimension −2, all features), and the call
    records the sequence's length in ``sequence_split``: ids over x reduce-scatter their
    partial rows along the sequence instead of all-reducing them; features over x go from
    this rank's features of every token to every feature of its tokens in one all-to-all.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        grid: ProcessGrid,
        *,
        transpose: bool = False,
        gather_output: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        init_weights: bool = True,
        sequence: str = "none",
        sequence_split: SequenceSplit | None = None,
    ):
        super().__init__()
        for name, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(v, int) or v < 1:
                raise UserError(f"{name} must be a positive integer, got {v!r}")
        self._init_sharding(grid)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.transpose = transpose
        self.in_axis, self.out_axis = _axes(transpose)
        self.gather_output = gather_output
        if sequence not in ("none", "scatter"):
            raise UserError(f"Embedding: sequence must be 'none' or 'scatter', got {sequence!r}")
        if sequence == "scatter" and not gather_output:
            raise UserError("Embedding: sequence='scatter' gives every feature: gather_output=True")
        self.sequence = sequence
        self.sequence_split = None
        if sequence == "scatter":
            self.sequence_split = sequence_split or SequenceSplit(grid)
        self.weight_layout = ShardLayout.matrix(
            num_embeddings, embedding_dim, grid, self.out_axis, self.in_axis
        )
        r, c, _ = self.weight_layout.coords(grid)
        device = grid.device if device is None else device
        self.weight = nn.Parameter(
            torch.empty(self.weight_layout.shard_numel(r, c), device=device, dtype=dtype)
        )
        self.row_sizes = self.weight_layout.row_sizes()
        self.col_sizes = self.weight_layout.col_sizes()
        if init_weights:
            self.reset_parameters()

    @classmethod
    def from_embedding(
        cls, module: nn.Embedding, grid: ProcessGrid, *, load: bool = True, **kwargs
    ) -> Embedding:
        """A parallel copy of ``module`` with the same values (``load=False``: uninitialised,
        for a module on the meta device)."""
        for attr, ok in (
            ("padding_idx", None),
            ("max_norm", None),
            ("sparse", False),
            ("scale_grad_by_freq", False),
        ):
            if getattr(module, attr, ok) != ok:
                raise UserError(
                    f"the parallel Embedding does not support {attr}="
                    f"{getattr(module, attr)!r}; leave this module out of the plan"
                )
        n, d = module.weight.shape
        layer = cls(n, d, grid, dtype=module.weight.dtype, init_weights=False, **kwargs)
        if load:
            layer.load_full(module.weight.detach())
        return layer

    def reset_parameters(self) -> None:
        """Initialise as ``nn.Embedding`` does (standard normal), from the full table."""
        full = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype)
        nn.init.normal_(full)
        self.load_full(full)

    def load_full(self, weight: torch.Tensor) -> None:
        """Keep this rank's piece of the full table."""
        self._load_piece(self.weight, self.weight_layout, weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # noqa: D102
        n = self.num_embeddings
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise UserError(
                f"Embedding({n}, {self.embedding_dim}): ids must lie in [0, {n}), got "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )
        w = self._weight_block()
        grid = self.grid
        r = grid.rank(self.out_axis)
        seq = self.sequence == "scatter" and grid.size(SEQ_AXIS) > 1
        sizes = self.sequence_split.begin(ids.shape[-1]) if seq else None
        if len(self.row_sizes) > 1:
            local = ids - chunk_offsets(self.row_sizes)[r]
            outside = (local < 0) | (local >= self.row_sizes[r])
            e = F.embedding(local.masked_fill(outside, 0), w)
            e = e.masked_fill(outside.unsqueeze(-1), 0.0)
            if seq and self.out_axis == SEQ_AXIS:  # partial rows: each rank sums its tokens'
                # contiguous: the residual stream starts here (else every norm copies it)
                e = comm.scatter_to(e, grid, SEQ_AXIS, dim=-2, sizes=sizes).contiguous()
            else:
                e = comm.reduce_from(e, grid, self.out_axis)
        else:
            e = F.embedding(ids, w)
        if seq and self.in_axis == SEQ_AXIS:  # my features of every token → my tokens
            return features_to_sequence(e, grid, SEQ_AXIS, self.col_sizes, sizes)
        if self.gather_output:
            e = comm.gather_replicated(e, grid, self.in_axis, dim=-1, sizes=self.col_sizes)
        return e

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, transpose={self.transpose}, "
            f"gather_output={self.gather_output}"
            + (f", sequence={self.sequence}" if self.sequence != "none" else "")
        )


# --------------------------------------------------------------------------- cross-entropy
def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    grid: ProcessGrid,
    axis: str,
    vocab_size: int,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of logits whose last dimension is this rank's chunk of ``vocab_size``
    classes, chunked over ``axis`` with :func:`~gnnpar.comm.chunk_sizes`.

    Two collectives over ``axis``: an all-reduce (max) of one number per token, and one
    all-reduce (sum) of two numbers per token. The result is replicated over ``axis``; the
    gradient is exact (softmax minus one-hot on every chunk). ``reduction``: ``"mean"`` over
    the targets that are not ``ignore_index``, ``"sum"`` or ``"none"``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    p, me = grid.size(axis), grid.rank(axis)
    sizes = chunk_sizes(vocab_size, p)
    local = sizes[me]
    if logits.shape[-1] != local:
        raise ValueError(
            f"logits hold {logits.shape[-1]} classes, but this rank's chunk of {vocab_size} "
            f"classes over {axis}={p} has {local}"
        )
    if tuple(logits.shape[:-1]) != tuple(targets.shape):
        raise ValueError(
            f"targets of shape {tuple(targets.shape)} do not match logits of shape "
            f"{tuple(logits.shape)}"
        )
    start = chunk_offsets(sizes)[me]
    lg = logits.reshape(-1, local)
    if lg.dtype in (torch.float16, torch.bfloat16):
        lg = lg.float()
    t = targets.reshape(-1)
    valid = t != ignore_index
    if bool(((t < 0) | (t >= vocab_size))[valid].any()):
        raise UserError(f"targets must lie in [0, {vocab_size}) or equal {ignore_index}")
    m = lg.detach().amax(-1)
    comm.all_reduce(m, grid, axis, op="max")
    z = lg - m.unsqueeze(-1)
    lt = t - start
    inside = valid & (lt >= 0) & (lt < local)
    picked = z.gather(1, lt.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1) * inside
    both = comm.reduce_from(torch.stack([z.exp().sum(-1), picked]), grid, axis)
    per_token = (both[0].log() - both[1]) * valid
    if reduction == "none":
        return per_token.view(targets.shape)
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / valid.sum().clamp(min=1)


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    head: nn.Module | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``logits (..., classes)`` against ``targets (...)``, whether the logits
    are full or split over the vocabulary by ``head``, the layer that produced them (a
    :class:`Linear` that keeps its output sharded). With a plain head (or none) this is
    ``F.cross_entropy``."""
    if isinstance(head, Linear) and not head.gather_output:
        if head.fused > 1:
            raise UserError("a fused output head cannot produce vocabulary-sharded logits")
        if head.grid.size(head.out_axis) > 1:
            return vocab_parallel_cross_entropy(
                logits,
                targets,
                head.grid,
                head.out_axis,
                head.out_features,
                ignore_index=ignore_index,
                reduction=reduction,
            )
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
    ).view(targets.shape if reduction == "none" else ())
