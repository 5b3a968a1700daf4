"""Compute time on the busiest rank (rank 0 holds the largest chunks): the roofline every
workload's cost model prices its operations with (:func:`gemm_seconds`,
:func:`stream_seconds`), and this machine's measured rates.

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

import torch

from gnnpar.plan.machines import Machine
from gnnpar.sparse.csr import CSRBlock
from gnnpar.sparse.kernels import LocalSpMM

__all__ = ["gemm_seconds", "measure_local_rates", "stream_seconds"]


def gemm_seconds(m: float, k: float, n: float, e: int, machine: Machine) -> float:
    flops = 2.0 * m * k * n
    moved = (m * k + k * n + m * n) * e
    return max(flops / (machine.gemm_tflops * 1e12), moved / (machine.mem_gbps * 1e9))


def stream_seconds(nbytes: float, machine: Machine) -> float:
    return nbytes / (machine.mem_gbps * 1e9)


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
