"""A mixture of experts (MoE) in place of a transformer block's MLP, in plain PyTorch.

Each token's router scores pick its ``top_k`` experts (softmax over the experts; with
``top_k > 1`` the chosen weights are renormalised to sum to one, as GShard and Mixtral do); the
token's output is the weighted sum of those experts' outputs. Experts are the model's own MLP
(GPT: GELU; Llama: SwiGLU), so tensor parallelism chains inside each expert as in a dense block.

**Capacity.** With ``capacity_factor`` c > 0 each expert takes at most ``ceil(c·T·k/E)`` of a
sequence's ``T·k`` assignments (``E`` experts): first choices before second ones, then in token
order; an assignment past that is dropped (the token keeps its residual). Capacity is counted
per sequence, so which tokens drop does not depend on how sequences are spread over ranks: a
parallel run makes the serial model's decisions. ``capacity_factor = 0`` drops nothing.

**Load balancing.** The auxiliary loss of Switch Transformer, per sequence and averaged over
the batch: ``E · Σ_e f_e · P_e`` with ``f_e`` the fraction of the sequence's assignments that
chose expert ``e`` and ``P_e`` its mean router probability; it is smallest when both are
uniform. The layer keeps it in ``aux_loss`` and, in training, adds ``aux_loss_scale`` times its
gradient in backward (:func:`attach_aux_loss`: the loss need not carry it, so pipeline stages
need nothing), the scale set by the trainer (:func:`set_aux_loss_scale`).

**Dispatch.** The routed rows, sorted by expert, go through ``dispatch(experts, rows,
counts)``; the default runs the experts here. :func:`gnnpar.tensor.experts.expert_parallel`
keeps only a rank's experts and sets an all-to-all dispatch over the grid's ``expert`` axis.
This file never imports torch.distributed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gnnpar.errors import UserError

__all__ = [
    "MoE",
    "ExpertList",
    "Router",
    "Routing",
    "attach_aux_loss",
    "aux_losses",
    "local_dispatch",
    "route",
    "set_aux_loss_scale",
]

Dispatch = Callable[[nn.Module, torch.Tensor, Sequence[int]], torch.Tensor]


@dataclasses.dataclass
class Routing:
    """Where a batch's tokens go: the kept assignments sorted by expert (then by priority).

    ``token``: flat index (into the batch's ``B·T`` tokens) of each assignment's token;
    ``weight``: its gate weight; ``counts``: kept assignments per expert; ``chosen``: all
    assignments per expert before capacity; ``aux``: the load-balancing loss."""

    token: torch.Tensor
    weight: torch.Tensor
    counts: list[int]
    chosen: list[int]
    aux: torch.Tensor


def route(logits: torch.Tensor, top_k: int, capacity_factor: float) -> Routing:
    """The routing of ``logits (B, T, E)``: see the module docstring."""
    b, t, e = logits.shape
    probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(-1)
    top_w, top_i = probs.topk(top_k, dim=-1)  # (B, T, k)
    if top_k > 1:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    # choice-major order within each sequence: every first choice has priority over seconds
    expert = top_i.transpose(1, 2).reshape(b, top_k * t)
    weight = top_w.transpose(1, 2).reshape(b, top_k * t)
    onehot = F.one_hot(expert, e)  # (B, kT, E)
    position = onehot.cumsum(1).gather(2, expert.unsqueeze(-1)).squeeze(-1) - 1
    keep = torch.ones_like(expert, dtype=torch.bool)
    if capacity_factor > 0:
        keep = position < math.ceil(capacity_factor * t * top_k / e)
    chosen_frac = onehot.sum(1).to(probs.dtype) / (top_k * t)  # (B, E)
    aux = e * (chosen_frac * probs.mean(1)).sum(-1).mean()
    token = torch.arange(t, device=logits.device).repeat(top_k)  # position in the sequence
    token = token + t * torch.arange(b, device=logits.device).unsqueeze(1)  # (B, kT)
    kept_expert = expert[keep]
    order = torch.sort(kept_expert, stable=True).indices
    counts = torch.bincount(kept_expert, minlength=e)
    return Routing(
        token=token[keep][order],
        weight=weight[keep][order],
        counts=counts.tolist(),
        chosen=onehot.sum((0, 1)).tolist(),
        aux=aux,
    )


class _AuxLossGradient(torch.autograd.Function):
    """Identity on ``x`` that gives ``aux`` the gradient ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x, aux, scale):  # noqa: D102
        ctx.scale, ctx.aux_shape = scale, aux.shape
        ctx.aux_dtype = aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        daux = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=g.device)
        return g, daux, None


def attach_aux_loss(x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged; backward through it also back-propagates ``scale · aux`` (the
    auxiliary loss joins the gradient wherever ``x`` flows, whichever loss ends the graph)."""
    if scale == 0 or not aux.requires_grad:
        return x
    return _AuxLossGradient.apply(x, aux, scale)


class Router(nn.Module):
    """The router's scores ``x · Wᵀ`` over the experts, normal(0, 0.02) weights. Not an
    ``nn.Linear``: tensor parallelism leaves it whole on every rank, so every rank of a
    tensor group routes alike."""

    def __init__(self, n_embd: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, n_embd))
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return F.linear(x, self.weight)


class ExpertList(nn.ModuleList):
    """The experts, called once per MoE forward with one input per expert (so that a sharded
    container is gathered once: :func:`gnnpar.shard.shard` makes the experts a unit)."""

    def forward(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:  # noqa: D102
        return [expert(x) for expert, x in zip(self, inputs, strict=True)]


def local_dispatch(experts: nn.Module, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Run every expert on its rows (``rows`` sorted by expert, ``counts`` per expert)."""
    outs = experts(list(rows.split(list(counts))))
    return torch.cat(outs) if outs else rows


class MoE(nn.Module):
    """``num_experts`` experts built by ``make_expert`` behind a top-k router (see the module
    docstring); a drop-in for a block's MLP: ``(…, n_embd) → (…, n_embd)``."""

    #: :func:`gnnpar.tensor.experts.expert_parallel` finds the layers by this attribute.
    mixture_of_experts = True

    def __init__(
        self,
        n_embd: int,
        num_experts: int,
        make_expert: Callable[[], nn.Module],
        top_k: int = 2,
        capacity_factor: float = 1.25,
    ):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor = capacity_factor
        self.router = Router(n_embd, num_experts)
        self.experts = ExpertList(make_expert() for _ in range(num_experts))
        self.dispatch: Dispatch = local_dispatch
        #: Gradient weight of the auxiliary loss in backward (set by the trainer).
        self.aux_loss_scale = 0.0
        #: The last forward's auxiliary loss and routing (for metrics and tests).
        self.aux_loss: torch.Tensor | None = None
        self.last_routing: Routing | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        shape, d = x.shape, x.shape[-1]
        seqs = x.reshape(-1, shape[-2] if x.dim() > 1 else 1, d)
        r = route(self.router(seqs), self.top_k, self.capacity_factor)
        self.aux_loss, self.last_routing = r.aux.detach(), r
        flat = seqs.reshape(-1, d)
        out_rows = self.dispatch(self.experts, flat.index_select(0, r.token), r.counts)
        gated = out_rows * r.weight.to(out_rows.dtype).unsqueeze(-1)
        y = torch.zeros_like(flat).index_add(0, r.token, gated)
        if self.training and torch.is_grad_enabled():
            y = attach_aux_loss(y, r.aux, self.aux_loss_scale)
        return y.reshape(shape)

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, "
            f"capacity_factor={self.capacity_factor}"
        )


def check_moe_sizes(experts: int, top_k: int, capacity: float, aux_loss: float) -> None:
    """UserError naming the first mixture-of-experts size that cannot work."""
    if experts < 0:
        raise UserError(f"moe_experts must be 0 (a dense MLP) or positive, got {experts}")
    if experts and not 1 <= top_k <= experts:
        raise UserError(f"moe_top_k={top_k} must lie in 1..moe_experts={experts}")
    if capacity < 0 or aux_loss < 0:
        raise UserError("moe_capacity and moe_aux_loss must be 0 or positive")


def mlp_or_moe(cfg: Any, make_mlp: Callable[[], nn.Module]) -> nn.Module:
    """A block's MLP: ``make_mlp()``, or a :class:`MoE` of such experts when
    ``cfg.moe_experts`` > 0."""
    if not getattr(cfg, "moe_experts", 0):
        return make_mlp()
    return MoE(cfg.n_embd, cfg.moe_experts, make_mlp, cfg.moe_top_k, cfg.moe_capacity)


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every MoE layer of ``model``, in module order."""
    return [m for m in model.modules() if getattr(type(m), "mixture_of_experts", False)]


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Set every MoE layer's auxiliary-loss gradient weight (the loss coefficient times
    whatever the trainer's loss is multiplied by before backward)."""
    for m in moe_layers(model):
        m.aux_loss_scale = float(scale)


def aux_losses(model: nn.Module) -> torch.Tensor | None:
    """The mean auxiliary loss of the last forward over the MoE layers (None without any)."""
    values = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(values).mean() if values else None
