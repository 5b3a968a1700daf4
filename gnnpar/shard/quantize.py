"""ZeRO++'s quantized collectives for stage 3: qwZ (weights) and qgZ (gradients).

**Blocks.** A flat tensor is cut into blocks of :data:`BLOCK` = 256 elements (the last one
padded with zeros); each block has one float32 scale, its largest magnitude over the largest
code, and its elements are stored as the nearest code: int8 codes in [−127, 127]
(:func:`quantize`), or int4 codes in [−7, 7] packed two to a byte (``bits=4``). Dequantizing
multiplies back, so an element's error is at most half its block's scale: a block of small
values keeps its own fine scale, whatever the rest of the tensor holds.

**qwZ** (:func:`gather_quantized`): each rank quantizes its shard to int8 and the data axis
all-gathers codes and scales — 1 + 4/256 bytes an element instead of 2 (bf16) or 4 (fp32) —
and every rank dequantizes every shard, its own too, so all ranks compute with the same
weights. The optimizer still steps the full-precision masters.

**qgZ** (:func:`reduce_scatter_quantized`), the paper's hierarchical all-to-all: the gradient is
reordered so that slice j holds the shards of every node's j-th rank, quantized to int4 and
exchanged inside the node (an all-to-all over ``data.intra``); each rank dequantizes and adds
its k received slices (a fixed pairwise tree), quantizes the sum again and exchanges it across
nodes (an all-to-all over ``data.inter``, one piece per node: 1/k of the gradient), then adds
the pieces into its own shard. Across nodes a rank sends (N−1)/N · Ψ/k · (1/2 + 4/256) bytes for
N nodes of k ranks — against (N−1)/N · Ψ/k · e for a hierarchical reduce-scatter in the
gradient's dtype, an eighth of float32's (a quarter of fp16's, as the paper states).
"""

from __future__ import annotations

import torch

from gnnpar import comm
from gnnpar.chunking import chunk_sizes
from gnnpar.grid import ProcessGrid
from gnnpar.shard.groups import INTER, INTRA, NodeGroups

__all__ = ["BLOCK", "dequantize", "gather_quantized", "quantize", "reduce_scatter_quantized"]

#: Elements per quantization block (one float32 scale each).
BLOCK = 256
_TOP = {8: 127, 4: 7}


def _padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def quantize(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape, flattened) as block codes and scales: int8 codes (``bits=8``, one a
    byte) or int4 codes packed two to a byte (``bits=4``, uint8, low nibble first, stored as
    code + 8), and one float32 scale per block of :data:`BLOCK`."""
    top = _TOP[bits]
    flat = x.reshape(-1).to(torch.float32)
    blocks = torch.zeros(_padded(flat.numel()), dtype=torch.float32, device=x.device)
    blocks[: flat.numel()] = flat
    blocks = blocks.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1) / top
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[:, None]).clamp_(-top, top).to(torch.int8)
    if bits == 8:
        return codes.reshape(-1), scales
    nibbles = (codes + 8).to(torch.uint8).reshape(-1, 2)
    return nibbles[:, 0] | (nibbles[:, 1] << 4), scales


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, n: int, dtype: torch.dtype, bits: int = 8
) -> torch.Tensor:
    """The first ``n`` values of :func:`quantize`'s ``codes`` and ``scales``, in ``dtype``."""
    if bits == 4:
        low = (codes & 15).to(torch.int8) - 8
        high = (codes >> 4).to(torch.int8) - 8
        codes = torch.stack([low, high], dim=1).reshape(-1)
    values = codes.to(torch.float32).view(-1, BLOCK) * scales[:, None]
    return values.reshape(-1)[:n].to(dtype)


def gather_quantized(
    shard: torch.Tensor, grid: ProcessGrid, axis: str, dtype: torch.dtype, async_op: bool = False
) -> torch.Tensor | comm.Handle:
    """qwZ: the all-gather of every rank's equal ``shard`` along ``axis`` as int8 blocks
    (codes and scales, two all-gathers in flight together); the result, in ``dtype``, is what
    a plain all-gather of the dequantized shards would give, on every rank."""
    n = shard.numel()
    codes, scales = quantize(shard, 8)
    p = grid.size(axis)
    got_codes = comm.all_gather(codes, grid, axis, async_op=True)
    got_scales = comm.all_gather(scales, grid, axis, async_op=True)

    def finish() -> torch.Tensor:
        c = got_codes.wait().view(p, -1)
        s = got_scales.wait().view(p, -1)
        return torch.cat([dequantize(c[r], s[r], n, dtype) for r in range(p)])

    handle = comm.Handle(None, finish, f"quantized all_gather over '{axis}'")
    return handle if async_op else handle.wait()


def _exchange(pieces: list[torch.Tensor], grid: NodeGroups, axis: str) -> list[torch.Tensor]:
    """int4 all-to-all of ``pieces`` (piece i to the rank with index i in the ``axis``
    group; all of one size): what every rank sent this one, dequantized, in rank order."""
    n = pieces[0].numel()
    quantized = [quantize(t, 4) for t in pieces]
    codes = comm.all_to_all(torch.stack([c for c, _ in quantized]), grid, axis)
    scales = comm.all_to_all(torch.stack([s for _, s in quantized]), grid, axis)
    return [dequantize(c, s, n, torch.float32, 4) for c, s in zip(codes, scales, strict=True)]


def reduce_scatter_quantized(
    flat: torch.Tensor, nodes: NodeGroups, data_index: list[int]
) -> torch.Tensor:
    """qgZ: this rank's shard of the sum of every data rank's ``flat`` (equal shards, one
    per data rank), by the hierarchical int4 all-to-all of the module docstring, in the
    gradient's dtype. ``data_index[i]`` is the data index of the i-th global rank of this
    rank's data group laid out as (node, rank in node): ``nodes``' sub-groups."""
    k, n_nodes = nodes.local_size, nodes.nodes
    p = k * n_nodes
    size = chunk_sizes(flat.numel(), p)[0]
    if flat.numel() != p * size:
        raise ValueError(f"qgZ needs {p} equal shards; got {flat.numel()} elements")
    shards = flat.view(p, size)
    # slice j: the shards of every node's j-th rank, node by node
    slices = [torch.cat([shards[data_index[m * k + j]] for m in range(n_nodes)]) for j in range(k)]
    inside = _exchange(slices, nodes, INTRA) if k > 1 else [slices[0].float()]
    partial = comm.tree_sum(torch.stack(inside)).view(n_nodes, size)
    across = _exchange(list(partial.unbind(0)), nodes, INTER) if n_nodes > 1 else [partial[0]]
    return comm.tree_sum(torch.stack(across)).to(flat.dtype)
