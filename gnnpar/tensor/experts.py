"""Expert parallelism: a mixture of experts' experts split over the grid's ``expert`` axis, the
tokens sent to them and back by all-to-all.

:func:`expert_parallel` works in place on a plain model (built eagerly or on the meta device),
before :func:`gnnpar.tensor.parallelize`: in every layer that declares ``mixture_of_experts``
(:class:`gnnpar.models.gpt.moe.MoE`), it keeps only this rank's ``E / P`` experts (``P`` the
expert axis size; rank ``r`` holds experts ``r·E/P … (r+1)·E/P − 1``) in a
:class:`LocalExperts`, named by their global index so that state-dict keys are the plain
model's, and sets the layer's dispatch to :class:`AllToAllDispatch`. Each expert may then be made
tensor-parallel like any MLP, and :func:`gnnpar.shard.shard` shards and reduces the experts
over the ranks that hold the same ones (context × data), everything else over expert ×
context × data. Expert ranks see different tokens, as data ranks do.

**Dispatch** of one layer, on each rank: the rows it routed, sorted by expert, go in one
all-to-all to the ranks holding their experts (a small all-to-all of the counts first, ``E/P``
integers per peer); each local expert runs once on the rows it got from every rank; the outputs
travel back by the reverse all-to-all, in the order they came. Backward is the same two
all-to-alls with the splits swapped. Bytes per rank over ``expert`` (``D`` features, ``e``
bytes per element; ``s_j`` rows this rank sends to rank j, ``q_j`` rows it receives from j;
``j`` ranging over the other ranks)::

    forward   counts: 8·(P−1)·E/P      dispatch: Σ s_j·D·e      combine: Σ q_j·D·e
    backward  combine: Σ q_j·D·e       dispatch: Σ s_j·D·e

A rank that holds no tokens for an expert still calls it (on zero rows): every rank of a tensor
group and of a sharded unit then runs the same collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gnnpar import comm
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid

__all__ = ["AllToAllDispatch", "LocalExperts", "expert_parallel", "local_range", "plain_keys"]


class LocalExperts(nn.ModuleDict):
    """This rank's experts of one layer, keyed by their global index (``"4"``, ``"5"``), so
    their state-dict keys are those of the plain model's ``experts.4…``. Calling it runs each
    expert on its input, in index order. ``absent`` names the experts other ranks hold."""

    #: :func:`gnnpar.shard.shard` shards these over the ranks with the same experts.
    expert_parallel = True

    def __init__(self, experts: dict[int, nn.Module], num_experts: int):
        super().__init__({str(i): m for i, m in sorted(experts.items())})
        self.num_experts = num_experts
        self.absent = tuple(str(i) for i in range(num_experts) if i not in experts)

    def forward(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:  # noqa: D102
        return [expert(x) for expert, x in zip(self.values(), inputs, strict=True)]


def local_range(num_experts: int, grid: ProcessGrid) -> range:
    """The global indices of the experts this rank holds."""
    p = grid.size("expert")
    if num_experts % p:
        raise UserError(
            f"{num_experts} experts do not divide over expert={p} ranks: use an expert axis "
            "that divides the experts"
        )
    per = num_experts // p
    return range(grid.rank("expert") * per, (grid.rank("expert") + 1) * per)


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks of the expert axis (``send`` rows to each, ``recv`` from each);
    backward sends the gradients back with the splits swapped."""

    @staticmethod
    def forward(ctx, rows, grid, send, recv):  # noqa: D102
        ctx.grid, ctx.send, ctx.recv = grid, send, recv
        return comm.all_to_all(rows, grid, "expert", send, recv)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        back = comm.all_to_all(g.contiguous(), ctx.grid, "expert", ctx.recv, ctx.send)
        return back, None, None, None


class AllToAllDispatch:
    """The dispatch of one MoE layer over the grid's ``expert`` axis (see the module
    docstring): ``(experts, rows sorted by expert, counts per expert) → outputs``."""

    def __init__(self, grid: ProcessGrid, num_experts: int):
        self.grid = grid
        self.num_experts = num_experts
        self.local = len(local_range(num_experts, grid))
        #: The last call's rows sent to and received from each expert rank (bytes, tests).
        self.last_sent: list[int] = []
        self.last_received: list[int] = []
        #: The last call's rows per local expert (from every rank).
        self.last_rows: list[int] = []

    def __call__(
        self, experts: nn.Module, rows: torch.Tensor, counts: Sequence[int]
    ) -> torch.Tensor:
        grid, p, per = self.grid, self.grid.size("expert"), self.local
        by_peer = torch.tensor(list(counts), dtype=torch.int64).view(p, per)
        send = by_peer.sum(1).tolist()
        # what each peer routed to each of this rank's experts: (P, E/P), peers in order
        got = comm.all_to_all(by_peer.to(grid.device), grid, "expert", [1] * p, [1] * p)
        got = got.view(p, per).cpu()
        recv = got.sum(1).tolist()
        self.last_sent, self.last_received = send, recv
        arrived = _AllToAll.apply(rows, grid, send, recv)  # peer-major, expert within
        # regroup peer-major rows expert-major: each expert runs once on all its rows
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), got.reshape(-1).cumsum(0)[:-1]])
        starts = starts.view(p, per)
        order = torch.cat(
            [
                torch.arange(int(starts[j, e]), int(starts[j, e] + got[j, e]))
                for e in range(per)
                for j in range(p)
            ]
        ).to(rows.device)
        self.last_rows = got.sum(0).tolist()
        outs = experts(list(arrived.index_select(0, order).split(self.last_rows)))
        done = torch.cat(outs) if outs else arrived
        back = torch.empty_like(done).index_copy(0, order, done) if len(order) else done
        return _AllToAll.apply(back, grid, recv, send)


def expert_parallel(model: nn.Module, grid: ProcessGrid) -> nn.Module:
    """Keep only this rank's experts of every mixture-of-experts layer of ``model`` and route
    tokens to the others' by all-to-all over ``expert`` (see the module docstring); in place,
    returns ``model``. Works on the meta device (before deferred initialisation). Every layer's
    experts are kept in a :class:`LocalExperts`, also on a grid without an expert axis (all of
    them, and the dispatch stays local), so sharding treats them alike on every grid."""
    for layer in model.modules():
        if not getattr(type(layer), "mixture_of_experts", False):
            continue
        experts = layer.experts
        if isinstance(experts, LocalExperts):
            raise UserError("expert_parallel: this model's experts are already split")
        n = len(experts)
        mine = local_range(n, grid)
        layer.experts = LocalExperts({i: experts[i] for i in mine}, n)
        if grid.size("expert") > 1:
            layer.dispatch = AllToAllDispatch(grid, n)
    return model


def plain_keys(model: nn.Module, keys: Sequence[str]) -> list[str]:
    """``keys`` (state-dict keys of ``model``, which holds some experts) with the keys of the
    experts other ranks hold put in: the plain model's keys, in its order (what a checkpoint
    names, on every rank alike). Every expert of a layer has the same keys as the first one
    this rank holds, under its own index."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LocalExperts) and m.absent}
    if not layers:
        return list(keys)
    out: list[str] = []
    done: set[str] = set()
    for key in keys:
        name = next((n for n in layers if key.startswith(n + ".")), None)
        if name is None:
            out.append(key)
            continue
        if name in done:
            continue
        done.add(name)
        layer = layers[name]
        first = next(iter(layer.keys()))
        template = [k[len(f"{name}.{first}.") :] for k in keys if k.startswith(f"{name}.{first}.")]
        out += [f"{name}.{i}.{t}" for i in range(layer.num_experts) for t in template]
    return out
