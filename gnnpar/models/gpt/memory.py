"""Device memory of one rank during a GPT step (rank 0, which holds the largest chunks):
:func:`gpt_memory`. The parameters, gradients and optimizer state are
:func:`gnnpar.plan.memory.sharded_state`'s.

Per rank, with ``e`` bytes per element:

- ``parameters`` (e each), ``gradients`` (e each), ``optimizer`` (Adam's two moments in
  float32, plus float32 master weights when e < 4); the data-axis ``stage`` divides the
  optimizer state (≥ 1), the gradients (≥ 2) and the parameters (3, plus ``1 +
  prefetch_depth`` gathered blocks — the running one and those prefetched, two at the
  default depth 1 — and one block's full gradient before its reduce-scatter) by the data
  size, as :mod:`gnnpar.shard` does. Stages 1–2 also hold this rank's float32 master chunk
  (a copy even when e = 4) and its reduced float32 gradient chunk, and stage 1 keeps the
  full gradient buffers (the table of :mod:`gnnpar.plan.memory`);
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
- with ``offload`` ``"host"`` or ``"file"`` (stages 1–3, :mod:`gnnpar.shard.offload`), for
  the trainable parameters (``n`` of them on this rank over ``d`` data ranks, ``P`` in the
  largest unit, ``D`` = ``prefetch_depth``; with LoRA only the adapters, the frozen base
  stays; a mixture of experts' experts over their own ``d``):

  - the ``optimizer`` part (Adam's moments and the float32 master chunk, ``12n/d``) leaves
    the device for the tier's part: ``host`` (host memory) or ``file`` (memory-mapped files:
    page cache, not anonymous memory). At stage 3 the parameter chunk leaves too, for any
    e: at e = 4 it is the master itself (moved: 8n/d + 4n/d), at e < 4 no e-byte chunk is
    stored at all (the gathers send the float32 master cast, a transient copy), so its
    ``n·e/d`` is dropped;
  - the reduced gradient chunk is float32 host memory with either tier
    (:meth:`~gnnpar.shard.flat.FlatGroup.set_grad` moves it to the master's memory): ``4n/d``
    in ``host``, off the device's ``gradients`` (stage 3 counts it there as ``n·e/d``);
  - ``file`` adds a device part ``offload_buffers``: at stage 3 the read buffers of the
    ``1 + D`` units whose chunks are read from their files ahead of their gathers (float32,
    ``4P/d`` each), and the chunked optimizer step's working set, three groups' master and
    moments: ``(1 + D)·4P/d + 3·(P/d)·(4 + 8)``, each term at most all the units (``(1 +
    D)·P`` and ``3P`` capped at ``n``, for a model of few units). At stages 1–2 the step's
    working set only, with ``P`` (a block's parameters) in place of the largest gradient
    bucket: a bucket never crosses a unit, so a block's are at most ``P``; an embedding
    larger than a block, a bucket of its own, is not counted. These buffers are anonymous
    memory: device memory on the CPU box, host memory on a GPU node, where counting them on
    the device is an upper bound.

  So at stage 3 (either e): ``parameters (1 + D)·P·e``, ``gradients P·e``, ``optimizer 0``,
  ``host 4n/d`` (host tier: ``+ 12n/d``), ``file 12n/d`` (file tier), ``offload_buffers
  (1 + D)·4P/d + 36P/d`` (file tier). ``host`` and ``file`` are not device memory
  (:func:`~gnnpar.plan.memory.device_bytes`); where a machine states its host memory,
  :func:`~gnnpar.plan.memory.memory_shortfall` holds the node's ranks' ``host`` bytes to it.
  ``"auto"`` is the planner's choice among these tiers
  (:func:`gnnpar.models.gpt.planning.choose_offload`), not a tier: give one.
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
from gnnpar.plan.inputs import PlanError
from gnnpar.plan.memory import sharded_state
from gnnpar.tensor.context import TILE_BYTES

__all__ = ["gpt_memory"]


def _offload(
    out: dict[str, float], problem: GPTProblem, n: float, d: int, per_unit: float
) -> dict[str, float]:
    """Apply ``problem.offload``'s tier to ``out``, the :func:`sharded_state` of ``n``
    trainable elements over ``d`` data ranks whose largest unit has ``per_unit`` (in place),
    and return the parts the tier adds: ``host``, ``file``, ``offload_buffers`` (see the
    module docstring)."""
    e, stage, tier = problem.element_size, problem.stage, problem.offload
    extra: dict[str, float] = {}
    if tier != "none" and stage >= 1:
        moved = out["optimizer"]
        if stage >= 3 and e >= 4:  # the parameter chunk is the master
            moved += n * e / d
            out["parameters"] -= n * e / d
        elif stage >= 3:  # no e-byte chunk is kept: the gathers send the master, cast
            out["parameters"] -= n * e / d
        out["optimizer"] = 0.0
        extra[tier] = moved
        # the reduced gradient chunk: float32 (the master's dtype), in host memory
        out["gradients"] -= n * e / d if stage >= 3 else n * 4 / d
        extra["host"] = extra.get("host", 0.0) + n * 4 / d
        if tier == "file":  # units' chunks, at most all of them (a model of few units)
            ahead = min((1 + problem.prefetch_depth) * per_unit, n) if stage >= 3 else 0.0
            extra["offload_buffers"] = ahead * 4 / d + min(3 * per_unit, n) / d * (4 + 8)
    return extra


def _merged(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """Two groups' parts added, but ``offload_buffers``: the larger (the step and the reads
    hold the largest units' chunks, whichever group they belong to)."""
    out = {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {**a, **b}}
    if "offload_buffers" in out:
        out["offload_buffers"] = max(a.get("offload_buffers", 0.0), b.get("offload_buffers", 0.0))
    return out


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
    activations between the chains over x as well. PlanError for ``offload="auto"``, which
    is the planner's choice of a tier, not one."""
    if problem.offload not in ("none", "host", "file"):
        raise PlanError(
            f"offload {problem.offload!r} is the planner's choice, not a tier: "
            "give gpt_memory none, host or file"
        )
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
    depth = problem.prefetch_depth

    def state(count: float, ranks: int, unit: float) -> tuple[dict, dict]:
        """One group's sharded state and the parts its offload tier adds."""
        own = sharded_state(count, e, problem.stage, ranks, unit, depth)
        return own, _offload(own, problem, count, ranks, unit)

    adapters = lora_params(problem, mods, coords)
    if adapters:
        # the frozen base: its parameters only, sharded and gathered like any at stage 3
        # (on the device: the tiers hold trainable masters); the adapters carry the
        # gradients and the optimizer's state
        out, tiers = state(adapters, d, adapters / max(1, problem.layers))
        out["parameters"] += sharded_state(n, e, problem.stage, d, per_block, depth)["parameters"]
    else:
        out, tiers = state(n - experts, d, per_block)
        if experts:  # a unit of their own per layer, gathered (stage 3) like a block
            own, own_tiers = state(experts, g.data * g.context, experts / max(1, problem.layers))
            out, tiers = _merged(out, own), _merged(tiers, own_tiers)
    out = {k: out[k] for k in ("parameters", "gradients", "optimizer")}
    out.update(gathered=0.0, activations=0.0)
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
    out.update(tiers)  # host, file and offload_buffers, with an offload tier
    return out
