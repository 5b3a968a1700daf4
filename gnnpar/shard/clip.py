"""Gradient-norm clipping: the factor, applied in place or inside a fused optimizer step.

Clipping multiplies every gradient by ``min(1, max_norm / norm)``: one more pass over all of
them before the optimizer reads them again. torch's fused Adam, AdamW and SGD kernels divide
each gradient by their ``grad_scale`` as they read it (the hook
:class:`torch.amp.GradScaler` uses), so :func:`clipped_step` hands them the inverse factor
there instead and the pass goes (about 7 ms a step for 35M float32 gradients on one core).
The kernel writes the clipped gradient back, so ``.grad`` after the step is what it would
have been; float64 gradients are clipped in place (the kernel's scale is float32).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

#: Added to the norm before dividing (as torch's clip_grad_norm_).
EPS = 1e-6


#: :func:`exact_square_sum`'s fixed point: this many binary digits of this many bits each.
DIGITS, DIGIT_BITS = 3, 24


def exact_square_sum(grads: Iterable[torch.Tensor], top: int) -> torch.Tensor:
    """The sum of the squares of every element of ``grads``, exactly, as int64 digits: each
    square (taken in float64) is a fraction of ``2**top`` (which must exceed every square),
    cut into its first :data:`DIGITS` binary digits of :data:`DIGIT_BITS` bits, and the
    digits are summed as integers — so the sum is the same in any order and over any split of
    the elements (ZeRO shards of another data size), unlike a float sum. Bits below
    ``2**(top - 72)`` of each square are dropped; a digit's sum stays below 2**63 for up to
    2**39 elements. Returns the digit sums, to be added over ranks as integers;
    :func:`digits_value` turns them into the float sum."""
    out = torch.zeros(DIGITS, dtype=torch.int64)
    for g in grads:
        q = torch.ldexp(g.detach().to(torch.float64).square(), torch.tensor(float(-top)))
        for i in range(DIGITS):
            q = q * 2.0**DIGIT_BITS  # exact: a power of two
            digit = q.floor()
            out[i] += digit.to(torch.int64).sum().cpu()
            q = q - digit  # exact: the fraction below the digit
    return out


def digits_value(digits: torch.Tensor, top: int) -> torch.Tensor:
    """The float64 value of :func:`exact_square_sum`'s digit sums (the same on every rank
    that holds the same integers)."""
    value = sum(float(d) * 2.0 ** (top - DIGIT_BITS * (i + 1)) for i, d in enumerate(digits))
    return torch.tensor(value, dtype=torch.float64)


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / norm)``: what clipping to ``max_norm`` multiplies gradients by."""
    return (max_norm / (norm + EPS)).clamp(max=1.0)


def scale_grads_(params: Iterable[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply the gradient of every parameter that has one by ``factor``, in place (one
    foreach multiply per device and dtype)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for (device, dtype), grads in groups.items():
        torch._foreach_mul_(grads, factor.to(device, dtype))


def scales_in_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` can apply a gradient factor itself: a torch optimizer
    whose every group runs the fused kernel, none already given a scale (a grad scaler's),
    over gradients of at most 32 bits."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if getattr(optimizer, "grad_scale", None) is not None:
        return False
    for group in optimizer.param_groups:
        if not group.get("fused"):
            return False
        for p in group["params"]:
            if p.grad is not None and p.grad.element_size() > 4:
                return False
    return True


def clipped_step(
    optimizer: torch.optim.Optimizer,
    params: Iterable[torch.Tensor],
    norm: torch.Tensor,
    max_norm: float,
) -> None:
    """``optimizer.step()`` on the gradients of ``params`` clipped to a global norm of
    ``max_norm``, given their ``norm`` (the same on every rank). Inside the step where it can
    (:func:`scales_in_step`), else in place before it; no clipping (``max_norm`` ≤ 0 or a
    factor of 1) costs nothing either way."""
    factor = clip_factor(norm, max_norm) if max_norm > 0 else None
    if factor is None or float(factor) == 1.0:
        optimizer.step()
        return
    if not scales_in_step(optimizer):
        scale_grads_(params, factor)
        optimizer.step()
        return
    device = optimizer.param_groups[0]["params"][0].device
    # the kernel divides by grad_scale and skips the step where found_inf is set
    optimizer.grad_scale = (1.0 / factor).to(device, torch.float32)
    optimizer.found_inf = torch.zeros((), dtype=torch.float32, device=device)
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf
