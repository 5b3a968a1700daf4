"""Device memory of one rank during a GPT step (rank 0, which holds the largest chunks):
:func:`gpt_memory`. The parameters, gradients and optimizer state are
:func:`gnnpar.plan.memory.sharded_state`'s.

Per rank, with ``e`` bytes per element:

- ``parameters`` (e each), ``gradients`` (e each), ``optimizer`` (Adam's two moments in
  float32, plus float32 master weights when e < 4); the data-axis ``stage`` divides the
  optimizer state (≥ 1), the gradients (≥ 2) and the parameters (3, plus two gathered blocks
  — the running one and the prefetched next — and one block's full gradient before its
  reduce-scatter) by the data size, as :mod:`gnnpar.shard` does. Stages 1–2 also hold this
  rank's float32 master chunk (a copy even when e = 4) and its reduced float32 gradient
  chunk, and stage 1 keeps the full gradient buffers;
- ``gathered``: with z > 1, every matrix's z-gathered block (``z`` times the local piece),
  which autograd keeps from the layer's forward to its backward;
- ``activations``: Megatron's per-layer count (Korthikanti et al., 2022) for tensor
  parallelism without the attention-score term (our attention goes through
  ``scaled_dot_product_attention``, whose fused kernels keep no score matrix):
  ``tokens · h · (10 + 24/t)`` bytes at 2 bytes per element, ``t`` the size of the axis that
  splits the heads, scaled by e/2; plus float32 logits and their softmax for this rank's
  vocabulary chunk. ``tokens`` are this rank's: its sequences (the batch over data and z)
  times its part of each (the sequence over context: context parallelism is this model's
  sequence parallelism, every activation split, the tensor-parallel ones not);
- with ``offload`` (stages 1–3, :mod:`gnnpar.shard.offload`) the ``optimizer`` part (Adam's
  moments and the float32 master chunk) — and at stage 3 with e = 4 the parameter chunk,
  which is the master itself — leave the device: ``"host"`` bytes (host memory) or
  ``"file"`` bytes (memory-mapped files: page cache, not anonymous memory). These parts are
  not device memory (:func:`device_bytes`).
- ``ring`` (context > 1): what ring attention holds beyond that in the busiest layer's
  backward: the travelling key/value block, its gradients and the received copies (8 blocks
  of this rank's keys' size), the saved log-sum-exp (one float per query and head), and one
  tile of a chunk pair's score matrices (scores, probabilities and their gradient: 3 · L²
  per head and sequence, L = T/(2C), computed a slice of sequences·heads at a time so that
  one tile holds at most ``TILE_BYTES``, or one L × L matrix when that is larger).

Sequence parallelism (``sequence_parallel``, :mod:`gnnpar.tensor.sequence`): the norms, the
dropouts and the residual stream hold ``1/t`` of the tokens, so of the replicated ``10`` only
the column layers' gathered inputs (``4``: the q/k/v and MLP inputs, which the layers keep
for their weight gradients) stay whole: ``tokens · h · (4 + 30/t)``; Llama's norms (``4h``)
are divided by t too. With ``"full"`` checkpointing each kept block input is a shard
(``tokens · h / t``). Megatron re-gathers those inputs in backward to divide them too (its
``34/t``), at one more all-gather per layer; ours keep the bytes of plain tensor parallelism.

Activation checkpointing (``activation_checkpointing`` of the problem, :mod:`gnnpar.recompute`):
``"full"`` keeps of each block only its input (``tokens · h``), plus, while backward
recomputes it, one block's full activations. ``"selective"`` (GPT) drops the attention core's score,
softmax and dropout tensors, which the count above already leaves out (the fused kernels keep
none), so it predicts no saving: it pays off where attention runs unfused (the CPU's math
kernel with dropout) or the sequence is long.

Not counted: allocator fragmentation, communication buffers, the CUDA context (about 0.5–1
GB per GPU). The planner keeps 10% of device memory free for them (``usable``).
"""

from __future__ import annotations

from collections.abc import Mapping

from gnnpar.models.gpt.cost import (
    GPTProblem,
    ShardedLayer,
    batch_per_rank,
    expert_params,
    gpt_layout,
    local_params,
    lora_params,
    seq_per_rank,
)
from gnnpar.plan.comm_model import grid_shape
from gnnpar.plan.memory import sharded_state
from gnnpar.tensor.context import TILE_BYTES

__all__ = ["gpt_memory"]


def gpt_memory(
    problem: GPTProblem,
    shape: Mapping[str, int],
    layout: list[ShardedLayer] | None = None,
    *,
    sequence_parallel: bool | None = None,
) -> dict[str, float]:
    """Bytes on rank 0 of one GPT training step, by part (see the module docstring);
    ``layout`` is :func:`gpt_layout` of the shape (computed when not given);
    ``sequence_parallel`` (default: the problem's, if it has the field) splits the
    activations between the chains over x as well."""
    if sequence_parallel is None:
        sequence_parallel = bool(getattr(problem, "sequence_parallel", False))
    g = grid_shape(shape)
    mods = gpt_layout(problem, shape) if layout is None else layout
    coords = g.coords(0)
    matrix, other = local_params(problem, mods, coords)
    n = matrix + other
    e = problem.element_size
    # expert and context ranks shard with the data ranks (fold_replicas); a mixture of
    # experts' experts (this rank's) only with the context and data ranks (fold_context)
    d = g.data * g.context * g.expert
    experts = sum(expert_params(problem, mods, coords))
    per_block = (n - other - experts) / max(1, problem.layers)
    out = {**sharded_state(n - experts, e, problem.stage, d, per_block), "gathered": 0.0}
    if experts:  # a unit of their own per layer, gathered (stage 3) like a block
        per_layer = experts / max(1, problem.layers)
        own = sharded_state(experts, e, problem.stage, g.data * g.context, per_layer)
        out = {k: v + own.get(k, 0.0) for k, v in out.items()}
    out["activations"] = 0.0
    adapters = lora_params(problem, mods, coords)
    if adapters:
        # the frozen base: its parameters only, sharded and gathered like any at stage 3;
        # the adapters carry the gradients and the optimizer's state
        lora = sharded_state(adapters, e, problem.stage, d, adapters / max(1, problem.layers))
        base = sharded_state(n, e, problem.stage, d, per_block)["parameters"]
        out.update(
            parameters=base + lora["parameters"],
            gradients=lora["gradients"],
            optimizer=lora["optimizer"],
        )
    if g.z > 1:
        # every matrix's z-gathered block, saved by autograd from its forward to its backward
        out["gathered"] = matrix * g.z * e
    rows, t_loc = batch_per_rank(problem, g), seq_per_rank(problem, g)
    tokens = rows * t_loc
    qkv = next(m for m in mods if m.name.endswith("attn.qkv"))
    head = next(m for m in mods if m.name == "lm_head")
    t = qkv.layout.row_parts
    # sequence parallelism: the shards between the chains (norms, dropouts, residual) are 1/s
    s = g.x if sequence_parallel else 1
    if problem.llama:
        # two RMSNorms (input and normalised rows) and the projections' full-width inputs:
        # 6h; per head split: the rotated queries, the repeated keys and values, the
        # attention's output and its re-laid-out copy (5h), SwiGLU's gate, up, silu(gate)
        # and product (2 × its 2·ffn outputs)
        h = problem.hidden
        per_layer = tokens * (4 * h / s + 2 * h + (5 * h + 2 * problem.mlp_width) / t) * e
    else:
        # norms' inputs 4, dropout masks 2, the column layers' inputs 4 (Megatron's units)
        per_layer = tokens * problem.hidden * (6 / s + 4 + 24 / t) * e / 2
    if problem.lora_rank:  # each adapter's A output, which B keeps: rank per projection
        per_layer += tokens * problem.lora_rank * 4 * e
    if problem.experts:
        # a mixture of experts runs the MLP on top_k rows per token (its input and its split
        # activations once more per extra choice) and keeps the dispatched rows and the
        # experts' outputs for the gate's product: an estimate, not measured
        k, h = problem.model.moe_top_k, problem.hidden
        per_layer += tokens * ((k - 1) * (h + 2 * problem.mlp_width / t) + 2 * k * h) * e
    logits = 2 * tokens * head.layout.row_sizes()[0] * 4
    if problem.activation_checkpointing == "full":
        # each block's input, and one block's activations while backward recomputes it
        kept = problem.layers * tokens * problem.hidden * e / s
        out["activations"] = kept + per_layer + logits
    else:
        out["activations"] = problem.layers * per_layer + logits
    if g.context > 1:
        heads = problem.heads // t
        keys = tokens * heads * (problem.hidden // problem.heads) * e
        square = (t_loc // 2) ** 2 * e
        tile = min(rows * heads * square, max(TILE_BYTES // square, 1) * square)
        out["ring"] = float(8 * keys + tokens * heads * e + 3 * tile)
    if problem.offload != "none" and problem.stage >= 1:
        moved = out["optimizer"]
        if problem.stage >= 3 and e >= 4:  # the parameter chunk is the master
            moved += n * e / d
            out["parameters"] -= n * e / d
        out["optimizer"] = 0.0
        out[problem.offload] = moved
    return out
