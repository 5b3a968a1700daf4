"""Sequence parallelism (Megatron-LM's, Korthikanti et al. 2022) over the grid's x axis.

With tensor parallelism alone, everything between the blocks' tensor-parallel layers — the
residual stream, the layer norms, the dropouts — is replicated over x: every x rank holds every
token. With sequence parallelism each x rank holds ``1/x`` of the tokens there instead (the
sequence dimension, ``-2`` of every activation, cut by :func:`~gnnpar.chunking.chunk_sizes`:
balanced, the first ranks one larger), so that memory falls with x:

- **column layer** (the first of a chain, out axis x): its input arrives split over the
  sequence and is all-gathered along it before the matmul; backward reduce-scatters the
  input gradient along the sequence instead of all-reducing it;
- **row layer** (the second, in axis x): its partial output is reduce-scattered along the
  sequence instead of all-reduced; backward all-gathers the output gradient along it;
- **entry**: the embeddings give sequence shards (ids over x: their partial rows
  reduce-scattered instead of all-reduced; features over x: one all-to-all from "my
  features of every token" to "every feature of my tokens" instead of the all-gather);
- **exit**: the head is a column layer: it gathers the final norm's shard.

Per chain, the forward all-reduce becomes an all-gather plus a reduce-scatter, and so does
the backward one: the same ring bytes. The head's and a tied embedding's likewise; an
embedding with features over x moves ``2(x−1)/x²`` of its output instead of ``(x−1)/x``.
The norms' parameters now see only their rank's tokens: their gradients are all-reduced over x
(one collective per norm in backward, a few kilobytes). The sequence split of each step
composes with the context axis (it cuts each rank's chunks further), with data, z and
every ZeRO stage, and with activation checkpointing. With y > 1 every chain is laid out with x
as its column layer's out axis (y splits the features, as it would anyway): the sequence is
split over x only.

**Without touching the model.** :func:`~gnnpar.tensor.parallelize` with
``Plan(sequence_parallel=True)`` installs it through module hooks (:func:`install`):

- each chain block (attention, MLP) gets a forward pre-hook that hands its input shard to the
  block's first layer and calls the block with a stand-in of the full sequence's shape (a
  NaN tensor expanded from one element, no memory): the model reads the sequence length from
  its input (``b, t, _ = x.shape``) and passes that input to its first layer, which gathers the
  real shard. A block must hand its input to its first layer as it is; anything else it does
  with the values shows NaN;
- each module with parameters outside the chain blocks (the norms) gets its parameters
  replaced, during its forward, by views whose gradient is all-reduced over x;
- each dropout module draws its mask from a generator seeded by the global one and the x
  rank, so the shards of one sequence get independent masks (with the global generator left
  as every rank leaves it: one draw).

Where the layout does not fit (heads that do not split over x, a Linear outside the chains,
transformers' GPT-2 whose model reshapes to the whole sequence, a pipe axis, LoRA) it is
refused in one line.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from gnnpar import comm
from gnnpar.chunking import chunk_offsets, chunk_sizes
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid
from gnnpar.recompute import in_backward

__all__ = ["AXIS", "SequenceSplit", "features_to_sequence", "install"]

#: The axis that splits the sequence: Megatron's tensor-parallel axis (x when only x > 1).
AXIS = "x"


@dataclasses.dataclass(eq=False)
class SequenceSplit:
    """How many tokens of each sequence each rank of ``axis`` holds between the blocks:
    ``length`` is the current forward's sequence (this rank's chunks under context
    parallelism), set by the model's entry (the sequence-parallel embeddings); rank ``j``
    holds ``chunk_sizes(length, p)[j]`` of it."""

    grid: ProcessGrid
    axis: str = AXIS
    length: int | None = None

    def begin(self, length: int) -> list[int]:
        """The model's entry: record ``length`` and return every rank's share."""
        self.length = int(length)
        return self.sizes(self.length)

    def sizes(self, length: int) -> list[int]:
        """Every rank's share of a sequence of ``length`` tokens."""
        return chunk_sizes(length, self.grid.size(self.axis))

    def shard_sizes(self, local: int, who: str) -> list[int]:
        """Every rank's share of the current sequence, checking that this rank's is
        ``local`` (what ``who`` received)."""
        if self.length is None:
            raise UserError(
                f"{who}: sequence parallelism has no sequence length: the model's entry (a "
                "sequence-parallel Embedding) has not run; set SequenceSplit.length"
            )
        sizes = self.sizes(self.length)
        mine = sizes[self.grid.rank(self.axis)]
        if local != mine:
            raise UserError(
                f"{who}: got {local} tokens, but this rank holds {mine} of the {self.length} "
                f"that the model's entry split over {self.axis}={self.grid.size(self.axis)}"
            )
        return sizes


# ------------------------------------------------------------------- features → sequence
class _FeaturesToSequence(torch.autograd.Function):
    """``(…, T, h_r)`` (this rank's features of every token) → ``(…, s_r, h)`` (every feature
    of this rank's tokens): one all-to-all; backward the reverse one."""

    @staticmethod
    def forward(ctx, x, grid, axis, feats, seqs):  # noqa: D102
        ctx.grid, ctx.axis, ctx.feats, ctx.seqs = grid, axis, feats, seqs
        return _features_to_sequence(x, grid, axis, feats, seqs)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        out = _sequence_to_features(g, ctx.grid, ctx.axis, ctx.feats, ctx.seqs)
        return out, None, None, None, None


def _features_to_sequence(x, grid, axis, feats, seqs):
    me = grid.rank(axis)
    lead = x.shape[:-2]
    offsets = chunk_offsets(seqs)
    pieces = [x.narrow(-2, o, s).reshape(-1) for o, s in zip(offsets, seqs, strict=True)]
    n = math.prod(lead)
    out = comm.all_to_all(
        torch.cat(pieces), grid, axis, [p.numel() for p in pieces],
        [n * seqs[me] * f for f in feats],
    )  # fmt: skip
    parts = torch.split(out, [n * seqs[me] * f for f in feats])
    return torch.cat([p.view(*lead, seqs[me], f) for p, f in zip(parts, feats, strict=True)], -1)


def _sequence_to_features(g, grid, axis, feats, seqs):
    me = grid.rank(axis)
    lead = g.shape[:-2]
    offsets = chunk_offsets(feats)
    pieces = [g.narrow(-1, o, f).reshape(-1) for o, f in zip(offsets, feats, strict=True)]
    n = math.prod(lead)
    out = comm.all_to_all(
        torch.cat(pieces), grid, axis, [p.numel() for p in pieces],
        [n * s * feats[me] for s in seqs],
    )  # fmt: skip
    parts = torch.split(out, [n * s * feats[me] for s in seqs])
    return torch.cat([p.view(*lead, s, feats[me]) for p, s in zip(parts, seqs, strict=True)], -2)


def features_to_sequence(
    x: torch.Tensor, grid: ProcessGrid, axis: str, feats: list[int], seqs: list[int]
) -> torch.Tensor:
    """This rank's ``feats[r]`` features of every token of ``x (…, T, ·)`` in, every feature
    of its ``seqs[r]`` tokens out (``feats`` and ``seqs``: every rank's shares); differentiable
    (the backward is the reverse all-to-all)."""
    if grid.group(axis) is None:
        return x
    return _FeaturesToSequence.apply(x, grid, axis, list(feats), list(seqs))


# --------------------------------------------------------------------------------- hooks
class _BlockEntry:
    """Forward pre-hook of a chain block: its input shard goes to its first layer, the block
    runs on a stand-in of the full sequence's shape (see the module docstring)."""

    def __init__(self, name: str, first: nn.Module, split: SequenceSplit):
        self.name, self.first, self.split = name, first, split
        self.length: int | None = None  # the forward's, for a recompute in backward

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        if not args or not isinstance(args[0], torch.Tensor):
            raise UserError(
                f"sequence parallelism: {self.name} must take its input as the first "
                "positional argument"
            )
        x = args[0]
        if x.dim() < 2:
            raise UserError(
                f"sequence parallelism: {self.name} got {tuple(x.shape)}, without a sequence "
                "(dimension -2)"
            )
        if in_backward() and self.length is not None:
            length = self.length  # a recompute: the length of the forward it repeats
        else:
            if self.split.length is None:
                self.split.shard_sizes(x.shape[-2], self.name)  # raises: no length yet
            length = self.split.length
            if torch.is_grad_enabled():
                self.length = length
        sizes = self.split.sizes(length)
        mine = sizes[self.split.grid.rank(self.split.axis)]
        if x.shape[-2] != mine:
            raise UserError(
                f"sequence parallelism: {self.name} got {tuple(x.shape)}, but this rank holds "
                f"{mine} of the {length} tokens (dimension -2)"
            )
        shape = (*x.shape[:-2], length, x.shape[-1])
        stand_in = x.new_full((1,) * x.dim(), float("nan")).expand(shape)
        self.first._sequence_input = (stand_in, x)
        return (stand_in, *args[1:])


def _seeded_state(grid: ProcessGrid, seed: int) -> tuple:
    """Seed the host generator (and the grid's device's) with ``seed``; return what was there."""
    dev = grid.device
    cuda = dev.type == "cuda"
    saved = (torch.get_rng_state(), torch.cuda.get_rng_state(dev) if cuda else None)
    torch.random.default_generator.manual_seed(seed)
    if cuda:
        with torch.cuda.device(dev):
            torch.cuda.manual_seed(seed)
    return saved


def _restore_state(grid: ProcessGrid, saved: tuple) -> None:
    torch.set_rng_state(saved[0])
    if saved[1] is not None:
        torch.cuda.set_rng_state(saved[1], grid.device)


class _ShardDropout:
    """Forward pre- and post-hook of a dropout module: its mask comes from a generator seeded
    by one draw of the global generator (the same draw on every rank) mixed with the x rank,
    and the global generators are put back after it."""

    def __init__(self, grid: ProcessGrid, axis: str):
        self.grid, self.axis = grid, axis

    def pre(self, module: nn.Module, args: tuple) -> None:
        if not (module.training and module.p > 0):
            return
        draw = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        seed = (draw * 1_000_003 + self.grid.rank(self.axis) + 1) % (2**63)
        module._sequence_rng = _seeded_state(self.grid, seed)

    def post(self, module: nn.Module, args: tuple, out: object) -> None:
        saved = module.__dict__.pop("_sequence_rng", None)
        if saved is not None:
            _restore_state(self.grid, saved)


class _ReducedGrad(torch.autograd.Function):
    """Views of parameters forward; their gradients all-reduced over ``axis`` backward (one
    collective for all of them)."""

    @staticmethod
    def forward(ctx, grid, axis, *params):  # noqa: D102
        ctx.grid, ctx.axis = grid, axis
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, ctx.grid, ctx.axis)
        parts = flat.split([g.numel() for g in grads])
        return (None, None, *(f.view_as(g) for f, g in zip(parts, grads, strict=True)))


class _ShardParameters:
    """Forward pre- and post-hook of a module with parameters that runs on sequence shards
    (a norm): during its forward its parameters are :class:`_ReducedGrad` views, so their
    gradients — partial sums over this rank's tokens — are summed over x."""

    def __init__(self, grid: ProcessGrid, axis: str, names: dict[int, tuple[str, ...]]):
        self.grid, self.axis = grid, axis
        self.names = names  # id(module) → its parameters' names, as parallelize left them

    def pre(self, module: nn.Module, args: tuple) -> None:
        if not torch.is_grad_enabled():
            return
        # where each lives now: the instance dict first (ZeRO-3 installs its gathered leaves
        # there, as attribute lookup finds them first), else _parameters
        own = {}
        for name in self.names[id(module)]:
            where = module.__dict__ if name in module.__dict__ else module._parameters
            p = where.get(name)
            if p is not None and p.requires_grad:
                own[name] = (where, p)
        if not own:
            return
        views = _ReducedGrad.apply(self.grid, self.axis, *(p for _, p in own.values()))
        module._sequence_params = own  # put back after its forward
        for (where, _), name, view in zip(own.values(), own, views, strict=True):
            where[name] = view

    def post(self, module: nn.Module, args: tuple, out: object) -> None:
        own = module.__dict__.pop("_sequence_params", None)
        for name, (where, p) in (own or {}).items():
            where[name] = p


def install(
    model: nn.Module,
    grid: ProcessGrid,
    blocks: list[tuple[str, nn.Module]],
    split: SequenceSplit,
) -> list:
    """Install sequence parallelism's hooks on ``model`` (see the module docstring):
    ``blocks`` are the chain blocks, by name, each with its first (column) layer. Returns the
    hook handles."""
    from gnnpar.tensor.layers import ShardedModule

    handles = []
    inside = tuple(f"{name}." for name, _ in blocks)
    for name, first in blocks:
        entry = _BlockEntry(name, first, split)
        handles.append(model.get_submodule(name).register_forward_pre_hook(entry))
    dropout = _ShardDropout(grid, split.axis)
    names: dict[int, tuple[str, ...]] = {}
    params = _ShardParameters(grid, split.axis, names)
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            handles.append(m.register_forward_pre_hook(dropout.pre))
            handles.append(m.register_forward_hook(dropout.post, always_call=True))
        elif (
            not isinstance(m, ShardedModule)
            and not name.startswith(inside)
            and any(p is not None for p in m._parameters.values())
        ):
            names[id(m)] = tuple(n for n, p in m._parameters.items() if p is not None)
            handles.append(m.register_forward_pre_hook(params.pre))
            handles.append(m.register_forward_hook(params.post, always_call=True))
    return handles
