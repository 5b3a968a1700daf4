"""Compute time of one training step on the busiest rank (rank 0 holds the largest chunks).

Each GEMM costs ``max(flops / gemm rate, bytes / memory bandwidth)`` (a roofline: small or
skinny products are bound by memory), each SpMM ``max(2·nnz·width / SpMM rate, bytes /
memory bandwidth)``; element-wise passes (activations, norms, residuals, the loss softmax,
the optimizer) are memory-bound. Every rate is divided by the share of a device a rank
gets (:meth:`Machine.compute_share`: 8 ranks on 2 cores each get a quarter of one).

What this ignores: kernel-launch and Python overheads per operation, cache effects, the
speed of different SpMM kernels on different sparsity patterns, and overlap of compute
with communication (the planner adds the two).

:func:`measure_local_rates` times a GEMM and an SpMM on this machine (one thread), so the
CPU box can be described by what it actually does.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from gnnpar.grid import GridShape
from gnnpar.plan.comm_model import (
    ShardedLayer,
    batch_per_rank,
    gcn_local_layers,
    gpt_layout,
    grid_shape,
    seq_per_rank,
)
from gnnpar.plan.machines import Machine
from gnnpar.plan.problems import GCNProblem, GPTProblem
from gnnpar.sparse.csr import CSRBlock
from gnnpar.sparse.kernels import LocalSpMM

__all__ = ["gcn_compute_seconds", "gpt_compute_seconds", "measure_local_rates"]


def _gemm(m: float, k: float, n: float, e: int, machine: Machine) -> float:
    flops = 2.0 * m * k * n
    moved = (m * k + k * n + m * n) * e
    return max(flops / (machine.gemm_tflops * 1e12), moved / (machine.mem_gbps * 1e9))


def _stream(nbytes: float, machine: Machine) -> float:
    return nbytes / (machine.mem_gbps * 1e9)


def gcn_compute_seconds(
    problem: GCNProblem, shape: Mapping[str, int], machine: Machine
) -> dict[str, float]:
    """Seconds of one full-graph epoch on rank 0: ``{"spmm", "gemm", "elementwise"}``.
    Nonzeros are assumed spread evenly over blocks (Plexus's permutation gets within 1%)."""
    e, ops = problem.element_size, problem.num_ops
    out = {"spmm": 0.0, "gemm": 0.0, "elementwise": 0.0}
    g = grid_shape(shape)
    for i, lay, rows, cols, fin, fout, nnz in gcn_local_layers(problem, shape):
        spmm_flops = 2.0 * nnz * fin * ops
        spmm_bytes = ops * (nnz * (8 + e) + (rows + cols) * fin * e)
        one = max(spmm_flops / (machine.spmm_gflops * 1e9), _stream(spmm_bytes, machine))
        passes = 2 if (i > 0 or problem.input_grad) else 1
        out["spmm"] += passes * one
        out["gemm"] += 3 * _gemm(rows, ops * fin, fout, e, machine)
        out["elementwise"] += _stream(8 * rows * fout * e, machine)
        out["elementwise"] += _stream(28 * ops * fin * fout / g.size(lay.depth), machine)
    share = machine.compute_share(g.world_size)
    return {k: v / share for k, v in out.items()}


def _linear_seconds(m: ShardedLayer, tokens: int, e: int, machine: Machine) -> float:
    """Forward and backward GEMMs of one Linear on rank 0's block (r × c)."""
    r, c = m.layout.block_shape(0, 0)
    return 3 * _gemm(tokens, c, r, e, machine)


def gpt_compute_seconds(
    problem: GPTProblem,
    shape: Mapping[str, int],
    machine: Machine,
    layout: list[ShardedLayer] | None = None,
) -> dict[str, float]:
    """Seconds of one GPT optimizer step on rank 0: ``{"gemm", "attention",
    "elementwise", "optimizer"}`` (``layout``: :func:`gpt_layout` of the shape)."""
    g: GridShape = grid_shape(shape, None)
    mods = gpt_layout(problem, shape) if layout is None else layout
    b_loc = batch_per_rank(problem, g)
    e, h, t = problem.element_size, problem.hidden, problem.seq
    t_loc = seq_per_rank(problem, g)  # with context, each rank's queries meet all T keys
    tokens = b_loc * t_loc
    out = {"gemm": 0.0, "attention": 0.0, "elementwise": 0.0, "optimizer": 0.0}
    local = 0
    for m in mods:
        local += m.layout.shard_numel(0, 0) * m.count
        if m.kind == "linear":
            out["gemm"] += _linear_seconds(m, tokens, e, machine) * m.count
    by_name = {m.name.split(".", 2)[-1]: m for m in mods}
    qkv, fc, head = by_name["attn.qkv"], by_name["mlp.fc"], by_name["lm_head"]
    h_heads = h / qkv.layout.row_parts  # features of the heads this rank holds
    # causal attention (flash: the masked half skipped), forward + backward ≈ 3 × forward
    attn_flops = 3 * 2.0 * b_loc * t_loc * t * h_heads
    out["attention"] = problem.layers * attn_flops / (machine.gemm_tflops * 1e12)
    # norms, residuals, dropout: full width on every rank; GELU on this rank's 4h chunk
    per_layer = tokens * (24 * h + 16 * 4 * h / fc.layout.row_parts) * e
    loss = tokens * problem.vocab / head.layout.row_parts * 4 * 4
    out["elementwise"] = _stream(problem.layers * per_layer + loss, machine)
    shard = g.data * g.context if problem.stage >= 1 else 1  # context ranks shard too
    out["optimizer"] = _stream(28 * local / shard, machine)
    share = machine.compute_share(g.world_size)
    return {k: v / share for k, v in out.items()}


def measure_local_rates(seconds: float = 0.5, size: int = 256) -> dict[str, float]:
    """This process's GEMM rate (TFLOP/s), SpMM rate (GFLOP/s, a random sparse matrix with
    16 nonzeros per row times 64 columns) and streaming bandwidth (GB/s), in float32 with
    the current thread count. Each is timed for about ``seconds``."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)

    def rate(fn, work: float) -> float:
        fn()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 3:
            fn()
            n += 1
        return work * n / (time.perf_counter() - start)

    gemm = rate(lambda: a @ b, 2.0 * size**3) / 1e12
    rows, per_row, width = 4096, 16, 64
    gen = torch.Generator().manual_seed(0)
    cols = torch.randint(0, rows, (rows * per_row,), generator=gen)
    crow = torch.arange(0, rows * per_row + 1, per_row)
    # the layers' own kernel (autotuned at the first product, in rate's warm-up call)
    sp = LocalSpMM(CSRBlock(crow, cols, torch.rand(rows * per_row), (rows, rows)))
    dense = torch.randn(rows, width)
    spmm = rate(lambda: sp.mm(dense), 2.0 * rows * per_row * width) / 1e9
    big = torch.randn(1 << 22)
    stream = rate(lambda: big.mul_(1.0), 2.0 * big.numel() * 4) / 1e9
    return {"gemm_tflops": gemm, "spmm_gflops": spmm, "mem_gbps": stream}
