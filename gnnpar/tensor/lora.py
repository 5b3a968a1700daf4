"""LoRA: low-rank adapters on chosen projections of a plain or tensor-parallel model.

``add_lora(model, targets, rank, alpha)`` gives each targeted Linear two small layers,
``lora_A`` (in → rank) and ``lora_B`` (rank → out), and adds ``alpha / rank · B(A(x))`` to its
output (Hu et al. 2021); every other parameter of the model is frozen. On a
tensor-parallel model (:func:`gnnpar.tensor.parallelize`) the adapters are tensor-parallel
:class:`~gnnpar.tensor.Linear` layers laid out like the projection they adapt: ``A`` takes
the projection's input as it arrives (its in axis, split or not) and gives its ``rank``
outputs whole; ``B`` splits them again and gives its outputs in the projection's layout
(its out axis, the fused parts of a q/k/v or gate/up projection included), so the update
adds to the projection's output where it lies, with no other re-layout. The rank must be at
least the size of the projection's in axis (each rank holds some of ``B``'s inputs).

``A`` starts as PEFT's default (Kaiming-uniform) and ``B`` at zero, so the adapted model
starts equal to the base; both are drawn from a generator seeded by ``seed`` and the
projection's name, the same full tensors on any grid.

Sharding (:func:`gnnpar.shard.shard`) keeps frozen parameters out of the optimizer and out
of every gradient collective; with ``ShardedModel.checkpoint_trainable_only`` checkpoints
hold the adapters alone. :func:`merge_lora` folds them into the base weights of a plain
state dict.
"""

from __future__ import annotations

import fnmatch
import math
import zlib
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from gnnpar.errors import UserError
from gnnpar.tensor.layers import Linear

__all__ = ["LORA_KEYS", "add_lora", "lora_targets", "merge_lora"]

#: The state-dict key parts of the adapters (``<projection>.lora_A.weight``).
LORA_KEYS = ("lora_A", "lora_B")


def lora_targets(model: nn.Module, targets: Iterable[str]) -> list[str]:
    """The names of the Linear layers of ``model`` whose name, or last name part, matches
    one of ``targets`` (fnmatch patterns such as ``qkv`` or ``blocks.*.mlp.down``)."""
    patterns = list(targets)
    found = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Linear, Linear)) or any(k in name for k in LORA_KEYS):
            continue
        last = name.rpartition(".")[2]
        if any(fnmatch.fnmatchcase(n, p) for p in patterns for n in (name, last)):
            found.append(name)
    unmatched = [p for p in patterns if not any(
        fnmatch.fnmatchcase(n, p) for f in found for n in (f, f.rpartition(".")[2]))]  # fmt: skip
    if unmatched:
        raise UserError(
            f"LoRA target {unmatched[0]!r} matches no Linear layer of {type(model).__name__}"
        )
    return found


def _seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _adapters(base: nn.Module, rank: int) -> tuple[nn.Module, nn.Module]:
    """``(A, B)`` for ``base``: plain layers for a plain Linear, tensor-parallel ones in its
    layout for a parallel one."""
    dtype = base.weight.dtype
    if isinstance(base, Linear):
        kw = {"bias": False, "transpose": base.transpose, "dtype": dtype, "init_weights": False}
        a = Linear(base.in_features, rank, base.grid, scatter_input=base.scatter_input,
                   gather_output=True, **kw)  # fmt: skip
        b = Linear(rank, base.out_features, base.grid, scatter_input=True,
                   gather_output=base.gather_output, fused=base.fused, **kw)  # fmt: skip
        return a, b
    device = base.weight.device
    a = nn.Linear(base.in_features, rank, bias=False, device=device, dtype=dtype)
    b = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=dtype)
    return a, b


def _load(layer: nn.Module, full: torch.Tensor) -> None:
    if isinstance(layer, Linear):
        layer.load_full(full)
    else:
        with torch.no_grad():
            layer.weight.copy_(full)


def _add_update(module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
    """The forward hook: the projection's output plus its low-rank update (of its input,
    given by position or as ``input=``)."""
    x = args[0] if args else kwargs["input"]
    return out + module.lora_B(module.lora_A(x)) * module.lora_scale


def add_lora(
    model: nn.Module, targets: Iterable[str], rank: int, alpha: float, seed: int = 0
) -> list[str]:
    """Give the Linear layers of ``model`` matching ``targets`` (see :func:`lora_targets`)
    rank-``rank`` adapters scaled by ``alpha / rank``, freeze every other parameter, and
    return the adapted layers' names. Every rank of a parallel model must call it alike."""
    if not isinstance(rank, int) or rank < 1:
        raise UserError(f"LoRA rank must be a positive integer, got {rank!r}")
    if not alpha > 0:
        raise UserError(f"LoRA alpha must be positive, got {alpha!r}")
    names = lora_targets(model, targets)
    done = [n for n in names if getattr(model.get_submodule(n), "lora_A", None) is not None]
    if done:  # checked before anything changes: the model is left as it was
        raise UserError(f"{done[0]} already has LoRA adapters")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        base = model.get_submodule(name)
        a, b = _adapters(base, rank)
        gen = torch.Generator().manual_seed(_seed(seed, name))
        full_a = torch.empty(rank, base.in_features, dtype=torch.float64)
        nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=gen)
        _load(a, full_a.to(base.weight.dtype))
        _load(b, torch.zeros(base.out_features, rank, dtype=base.weight.dtype))
        base.lora_A, base.lora_B = a, b
        base.lora_scale = alpha / rank
        base.register_forward_hook(_add_update, with_kwargs=True)
    return names


def merge_lora(
    state: Mapping[str, torch.Tensor], scale: float, base: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """A plain state dict with every adapter pair folded into its projection:
    ``W + scale · B @ A`` for each ``<name>.lora_A.weight`` / ``<name>.lora_B.weight`` (the
    base weights from ``base`` where ``state`` lacks them: a checkpoint of adapters only),
    the adapters themselves left out."""
    out = {**(base or {}), **{k: v for k, v in state.items() if not _is_adapter(k)}}
    pairs = sorted(k.removesuffix(".lora_A.weight") for k in state if k.endswith(".lora_A.weight"))
    for name in pairs:
        key = f"{name}.weight"
        if key not in out or f"{name}.lora_B.weight" not in state:
            raise UserError(f"LoRA adapters of {name!r} have no base weight {key!r} to merge into")
        a, b = state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"]
        w = out[key]
        out[key] = (w.double() + scale * (b.double() @ a.double())).to(w.dtype)
    return out


def _is_adapter(key: str) -> bool:
    return any(f".{k}." in f".{key}" for k in LORA_KEYS)
