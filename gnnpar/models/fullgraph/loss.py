"""Masked losses and scores over logits sharded by class columns and node rows.

Single-label: cross-entropy and accuracy. Multi-label (``N x C`` 0/1 targets, one binary
task per column): binary cross-entropy with logits, whose per-entry terms need no
communication but the final sum; its scores (ROC-AUC) need every evaluated row at once, so
:func:`gather_masked` collects the masked rows' logits on every rank (for evaluation).

The logits block on a rank covers rows ``[r0, r1)`` (split over ``row_axis``) and classes
``[c0, c1)`` (split over ``class_axis``); ranks of any other axis hold replicas. Only
per-row statistics cross the class axis (max, sum of exponentials, target logit), and only a
scalar crosses the row axis, so no rank ever sees the whole logit matrix.

Both compute in at least float32: bfloat16 or float16 logits (mixed precision) are widened
first, so the loss, its softmax gradient and the arg-max (class ids above 256 are not
bfloat16 numbers) are float32; the gradient returns to the logits' dtype through the cast.
"""

from __future__ import annotations

import torch

from gnnpar import comm
from gnnpar.grid import ProcessGrid

_LOW = (torch.bfloat16, torch.float16)


def _widened(logits: torch.Tensor) -> torch.Tensor:
    """Low-precision logits in float32 (differentiable); others unchanged."""
    return logits.float() if logits.dtype in _LOW else logits


def _reduce(t: torch.Tensor, grid: ProcessGrid, axis: str | None, op: str = "sum"):
    # axis None: that dimension is not sharded (e.g. classes in 1D), nothing to reduce.
    return t if axis is None else comm.all_reduce(t, grid, axis, op=op)


class _ShardedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, mask, grid, class_axis, row_axis, col_start, total):  # noqa: D102
        with torch.no_grad():
            row_max = (
                logits.max(dim=1).values
                if logits.shape[1]
                else logits.new_full((logits.shape[0],), -torch.inf)
            )
            row_max = _reduce(row_max.clone(), grid, class_axis, "max")
            shifted = logits - row_max[:, None]
            exp = shifted.exp()
            sum_exp = _reduce(exp.sum(dim=1), grid, class_axis)
            local = labels - col_start
            mine = (local >= 0) & (local < logits.shape[1])
            target = torch.zeros_like(row_max)
            idx = mine.nonzero(as_tuple=True)[0]
            target[idx] = shifted[idx, local[idx]]
            target = _reduce(target, grid, class_axis)
            per_row = sum_exp.log() - target
            maskf = mask.to(logits.dtype)
            loss = comm.all_reduce((per_row * maskf).sum().reshape(1), grid, row_axis) / total
        ctx.save_for_backward(exp / sum_exp[:, None], local, mine, maskf)
        ctx.total = total
        return loss.reshape(())

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        softmax, local, mine, maskf = ctx.saved_tensors
        g = softmax.clone()
        idx = mine.nonzero(as_tuple=True)[0]
        g[idx, local[idx]] -= 1.0
        g *= (maskf * grad / ctx.total)[:, None]
        return g, None, None, None, None, None, None, None


def _masked_rows(mask: torch.Tensor, grid: ProcessGrid, row_axis: str, total: int | None) -> int:
    """The global count of masked rows (``total`` when given, else one all-reduce over the
    row axis), at least 1: what a masked mean divides by."""
    if total is None:
        total = int(comm.all_reduce(mask.sum().reshape(1).to(torch.float64), grid, row_axis).item())
    return max(int(total), 1)


def sharded_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    grid: ProcessGrid,
    class_axis: str | None,
    row_axis: str,
    col_start: int,
    total: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy over the masked rows of the whole (sharded) logit matrix; the same
    scalar on every rank. ``total`` is the global count of masked rows (computed with one
    all-reduce when not given); float32 for low-precision logits."""
    total = _masked_rows(mask, grid, row_axis, total)
    return _ShardedCrossEntropy.apply(
        _widened(logits), labels.long(), mask, grid, class_axis, row_axis, col_start, total
    )


@torch.no_grad()
def sharded_argmax(
    logits: torch.Tensor, grid: ProcessGrid, class_axis: str | None, col_start: int
) -> torch.Tensor:
    """Each row's arg-max class over all class shards (ties to the lowest class id, as
    ``torch.argmax``), as a float tensor of class ids on every rank of ``class_axis``."""
    logits = _widened(logits)
    n_rows = logits.shape[0]
    if logits.shape[1]:
        best, arg = logits.max(dim=1)
        arg = arg.to(logits.dtype) + col_start
    else:
        best = logits.new_full((n_rows,), -torch.inf)
        arg = logits.new_full((n_rows,), float("inf"))
    best_all = _reduce(best.clone(), grid, class_axis, "max")
    # Among shards holding the maximum, the lowest class id wins (as torch.argmax does).
    cand = torch.where(best == best_all, arg, torch.full_like(arg, float("inf")))
    return _reduce(cand, grid, class_axis, "min")


@torch.no_grad()
def sharded_accuracy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    grid: ProcessGrid,
    class_axis: str | None,
    row_axis: str,
    col_start: int,
) -> float:
    """Fraction of masked rows whose arg-max class (:func:`sharded_argmax`) equals the
    label."""
    pred = sharded_argmax(logits, grid, class_axis, col_start)
    maskb = mask.bool()
    counts = torch.tensor(
        [float((pred[maskb] == labels[maskb].to(pred.dtype)).sum()), float(maskb.sum())],
        dtype=torch.float64,
        device=logits.device,
    )
    counts = comm.all_reduce(counts, grid, row_axis)
    return float(counts[0] / counts[1]) if counts[1] > 0 else 0.0


def _local_bce_sum(logits: torch.Tensor, targets: torch.Tensor, maskf: torch.Tensor):
    """Sum over the masked rows of this block of ``softplus(x) - y x`` (BCE with logits)."""
    per_entry = torch.nn.functional.binary_cross_entropy_with_logits(
        logits, targets.to(logits.dtype), reduction="none"
    )
    return (per_entry * maskf[:, None]).sum()


class _ShardedBCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, mask, grid, class_axis, row_axis, count):  # noqa: D102
        maskf = mask.to(logits.dtype)
        with torch.no_grad():
            total = _local_bce_sum(logits, targets, maskf).reshape(1)
            total = comm.all_reduce(_reduce(total, grid, class_axis), grid, row_axis)
        ctx.save_for_backward(logits, targets, maskf)
        ctx.count = count
        return (total / count).reshape(())

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        logits, targets, maskf = ctx.saved_tensors
        # d/dx of the mean: (sigmoid(x) - y) / count on masked rows; each block is its own.
        g = (torch.sigmoid(logits) - targets.to(logits.dtype)) * maskf[:, None]
        return g * (grad / ctx.count), None, None, None, None, None, None


def sharded_bce_with_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    grid: ProcessGrid,
    class_axis: str | None,
    row_axis: str,
    num_tasks: int,
    col_start: int,
    total: int | None = None,
) -> torch.Tensor:
    """Mean binary cross-entropy with logits over every (masked row, task) entry of the
    whole (sharded) logit matrix, as ``F.binary_cross_entropy_with_logits`` on the gathered
    masked rows; the same scalar on every rank. ``targets`` holds this block's rows with
    all ``num_tasks`` columns (0/1); this rank's columns start at ``col_start``. ``total``
    is the global count of masked rows (one all-reduce when not given); float32 for
    low-precision logits."""
    cols = targets[:, col_start : col_start + logits.shape[1]]
    count = _masked_rows(mask, grid, row_axis, total) * num_tasks
    return _ShardedBCE.apply(_widened(logits), cols, mask, grid, class_axis, row_axis, count)


@torch.no_grad()
def gather_masked(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    grid: ProcessGrid,
    class_axis: str | None,
    row_axis: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked rows of the whole logit matrix (all classes) and their labels, on every
    rank, in row-block order: two all-gathers of only the masked rows (for a score such as
    ROC-AUC that needs all of them at once, at evaluation)."""
    keep = mask.bool()
    rows = _widened(logits)[keep]
    if class_axis is not None:
        widths = comm.gather_sizes(rows.shape[1], grid, class_axis)
        rows = comm.all_gather(rows.contiguous(), grid, class_axis, dim=1, sizes=widths)
    counts = comm.gather_sizes(rows.shape[0], grid, row_axis)
    gathered = comm.all_gather(rows.contiguous(), grid, row_axis, sizes=counts)
    targets = comm.all_gather(labels[keep].contiguous(), grid, row_axis, sizes=counts)
    return gathered, targets
