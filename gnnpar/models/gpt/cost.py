"""The GPT's cost model: what the planner plans (:class:`GPTProblem`, with the built-in sizes
of :func:`gpt_sizes`), the sharded layers as :func:`gnnpar.tensor.parallelize` lays them out
(:func:`gpt_layout`), the collectives of one optimizer step of
:func:`gnnpar.tensor.train.train_step` (:func:`gpt_collectives`: embeddings, every 3D
tensor-parallel ``Linear``, the vocabulary-parallel loss, the data/z gradient reduction, the
gradient-norm and loss all-reduces, and with a context axis the ring attention's
point-to-point sends), byte for byte what :mod:`gnnpar.comm` measures (tests check every grid
of 8 ranks), and the step's compute time (:func:`gpt_compute_seconds`). Memory:
:mod:`.memory`; pipelines, ranking and the plan the trainer runs: :mod:`.planning`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch

from gnnpar.grid import GridShape
from gnnpar.models.gpt.model import GPTConfig
from gnnpar.plan.comm_model import Collective, Infeasible, collective, grid_shape
from gnnpar.plan.compute import gemm_seconds, stream_seconds
from gnnpar.plan.inputs import PlanError, checkpointing, positive
from gnnpar.plan.machines import Machine
from gnnpar.shard.config import OFFLOAD_MODES
from gnnpar.shard.quantize import BLOCK as QUANT_BLOCK
from gnnpar.tensor.layout import ShardLayout

__all__ = [
    "PLAN_OFFLOAD_MODES",
    "GPTProblem",
    "Routed",
    "ShardedLayer",
    "balanced_routing",
    "expert_params",
    "batch_per_rank",
    "context_collectives",
    "gpt_collectives",
    "gpt_compute_seconds",
    "gpt_layout",
    "gpt_sizes",
    "local_params",
    "lora_params",
    "meta_gpt",
    "moe_collectives",
    "seq_per_rank",
]


#: The offload values the planner takes: the trainer's (:data:`gnnpar.shard.config.OFFLOAD_MODES`)
#: and ``"auto"``, the smallest tier that fits each candidate, in the order none, host, file
#: (:func:`gnnpar.models.gpt.planning.choose_offload`). The trainer and
#: :func:`gnnpar.shard.shard` take a tier, never ``"auto"``.
PLAN_OFFLOAD_MODES: tuple[str, ...] = (*OFFLOAD_MODES, "auto")


@dataclasses.dataclass(frozen=True)
class GPTProblem:
    """A GPT training step (the ``gpt`` task): ``batch`` sequences of the model's
    ``block_size`` tokens per step over all ranks, pre-norm blocks with fused q/k/v, a 4×
    MLP, learned positions and a head tied to the token embedding (``tie_weights``).

    ``model`` is the one description of the GPT's sizes, the
    :class:`~gnnpar.models.gpt.model.GPTConfig`
    the model and the task use too; ``layers``, ``hidden``, ``heads``, ``seq``, ``vocab``,
    ``bias`` and ``tie`` read it in the planner's words. ``element_size`` is the bytes of
    parameters, gradients and activations (2: bf16 with fp32 master weights and Adam state, as
    at scale; 4: float32). ``stage`` is the data-axis sharding (:mod:`gnnpar.shard`): 0
    replicates everything, 1 shards optimizer state, 2 also gradients, 3 also parameters.
    ``grad_clip`` includes the gradient-norm all-reduce of the trainer. ``micro_batches``
    (the trainer's ``grad_accum``), ``schedule`` and ``virtual`` describe the pipeline a grid
    with a ``pipe`` axis runs (:mod:`gnnpar.pipeline`; ``virtual`` counts only for the
    interleaved schedule; ``schedule`` None: no pipelines). ``activation_checkpointing``:
    ``"full"`` recomputes each block in backward, ``"selective"`` its attention core
    (:mod:`gnnpar.recompute`). ``offload`` (the trainer's option,
    :mod:`gnnpar.shard.offload`): ``"host"`` or ``"file"`` moves the optimizer's masters and
    state off the device, at stage 3 the parameter chunk too (stages 1–3 only; the ranking
    skips stage 0 then); ``"auto"`` (the planner's only, :data:`PLAN_OFFLOAD_MODES`) gives
    each candidate the smallest tier that fits it. ``prefetch_depth`` (≥ 0): the units whose
    parameter gathers stage 3 starts ahead of the running one, so ``1 + prefetch_depth``
    gathered units are alive (and, with the file tier, as many read buffers).
    """

    model: GPTConfig
    batch: int = 1024
    element_size: int = 2
    stage: int = 0
    grad_clip: bool = True
    name: str = ""
    micro_batches: int = 1
    schedule: str | None = "1f1b"
    virtual: int = 2
    activation_checkpointing: str = "none"
    offload: str = "none"
    #: LoRA fine-tuning (the trainer's ``peft = "lora"``): the adapters' rank on every
    #: projection of the blocks, 0 for full training. The base is frozen: no gradients, no
    #: optimizer state, no gradient collectives for it.
    lora_rank: int = 0
    #: Megatron's sequence parallelism (the trainer's ``sequence_parallel``,
    #: :mod:`gnnpar.tensor.sequence`): the activations between the chains split over x
    #: (:func:`~gnnpar.models.gpt.memory.gpt_memory`); the bytes are plain tensor
    #: parallelism's (an all-reduce's are an all-gather's and a reduce-scatter's).
    sequence_parallel: bool = False
    #: ZeRO++ at stage 3 (:mod:`gnnpar.shard.quantize`): qwZ's parameter all-gathers move
    #: int8 codes and a float32 scale per 256 elements; qgZ's gradient reduction moves int4
    #: codes and the scales — priced as a reduce-scatter of those bytes over data (the same
    #: bytes per rank as its in-node and across-node all-to-alls together).
    quantized_weights: bool = False
    quantized_grads: bool = False
    #: Stage 3's gathers started ahead of the running unit (``prefetch_depth`` of
    #: :mod:`gnnpar.shard`): ``1 + prefetch_depth`` gathered units alive
    #: (:func:`~gnnpar.plan.memory.sharded_state`).
    prefetch_depth: int = 1

    def __post_init__(self) -> None:
        checkpointing(self.activation_checkpointing, ("none", "full", "selective"))
        for key in ("batch", "element_size", "micro_batches", "virtual"):
            positive(key, getattr(self, key))
        if self.stage not in (0, 1, 2, 3):
            raise PlanError(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.offload not in PLAN_OFFLOAD_MODES:
            raise PlanError(f"offload must be one of {PLAN_OFFLOAD_MODES}, got {self.offload!r}")
        depth = self.prefetch_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise PlanError(f"prefetch_depth must be an integer >= 0, got {depth!r}")

    @classmethod
    def sized(
        cls,
        layers: int,
        hidden: int,
        heads: int,
        seq: int = 2048,
        vocab: int = 50304,
        bias: bool = True,
        tie: bool = True,
        **kwargs,
    ) -> GPTProblem:
        """A problem from sizes in the planner's words (``layers``, ``hidden``, ...)."""
        for key, value in (("layers", layers), ("hidden", hidden), ("heads", heads)):
            positive(key, value)
        if hidden % heads:
            raise PlanError(f"hidden {hidden} is not a multiple of heads {heads}")
        model = GPTConfig(
            vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=hidden,
            bias=bias, tie_weights=tie,
        )  # fmt: skip
        return cls(model, **kwargs)

    @property
    def layers(self) -> int:  # noqa: D102
        return self.model.n_layer

    @property
    def hidden(self) -> int:  # noqa: D102
        return self.model.n_embd

    @property
    def heads(self) -> int:  # noqa: D102
        return self.model.n_head

    @property
    def seq(self) -> int:  # noqa: D102
        return self.model.block_size

    @property
    def vocab(self) -> int:  # noqa: D102
        return self.model.vocab_size

    @property
    def bias(self) -> bool:  # noqa: D102
        return self.model.bias

    @property
    def tie(self) -> bool:  # noqa: D102
        return self.model.tie_weights

    @property
    def llama(self) -> bool:
        """Whether the model is our Llama (RMSNorm, SwiGLU, GQA, no learned positions)."""
        from gnnpar.models.gpt.llama import LlamaConfig

        return isinstance(self.model, LlamaConfig)

    @property
    def mlp_width(self) -> int:
        """Outputs of the MLP's first projection: GPT's 4h, Llama's gate and up (2 × ffn)."""
        return 2 * self.model.ffn_hidden if self.llama else 4 * self.hidden

    @property
    def norm_elements(self) -> int:
        """Elements of one norm: weight and bias of a LayerNorm with biases, else a weight."""
        return (2 if self.bias and not self.llama else 1) * self.hidden

    @property
    def experts(self) -> int:
        """Experts per block of a mixture of experts (0: a dense MLP)."""
        return getattr(self.model, "moe_experts", 0)

    @property
    def mlp_params(self) -> int:
        """Parameters of one MLP (one expert's, with a mixture of experts)."""
        h = self.hidden
        if self.llama:
            f = self.model.ffn_hidden
            return 3 * f * h + ((2 * f + h) if self.bias else 0)
        return 8 * h * h + (5 * h if self.bias else 0)

    @property
    def num_params(self) -> int:
        """Parameters of the model (a tied head counted once; every expert)."""
        h, v = self.hidden, self.vocab
        moe = (self.experts - 1) * self.mlp_params + self.experts * h if self.experts else 0
        if self.llama:
            kv, f = self.model.n_kv_head, self.model.ffn_hidden
            qkv = (self.heads + 2 * kv) * (h // self.heads)
            block = qkv * h + h * h + 3 * f * h + 2 * h + moe
            if self.bias:
                block += qkv + h + 2 * f + h
            return self.layers * block + v * h * (1 if self.tie else 2) + h
        # 12h² of matrices; biases 9h and two LayerNorms (weight and bias: 4h), or 2h
        block = 12 * h * h + (13 * h if self.bias else 2 * h) + moe
        head = 0 if self.tie else v * h
        final_norm = (2 if self.bias else 1) * h
        return self.layers * block + v * h + self.seq * h + head + final_norm


def gpt_sizes() -> Mapping[str, dict[str, int]]:
    """GPT shapes by parameter count (GPT-3 family; 20B as GPT-NeoX-20B; 40B and 80B
    chosen here with head width 128)."""
    return MappingProxyType(
        {
            "125M": {"layers": 12, "hidden": 768, "heads": 12},
            "350M": {"layers": 24, "hidden": 1024, "heads": 16},
            "1.3B": {"layers": 24, "hidden": 2048, "heads": 16},
            "2.7B": {"layers": 32, "hidden": 2560, "heads": 20},
            "6.7B": {"layers": 32, "hidden": 4096, "heads": 32},
            "13B": {"layers": 40, "hidden": 5120, "heads": 40},
            "20B": {"layers": 44, "hidden": 6144, "heads": 64},
            "40B": {"layers": 48, "hidden": 8192, "heads": 64},
            "80B": {"layers": 80, "hidden": 9216, "heads": 72},
            "175B": {"layers": 96, "hidden": 12288, "heads": 96},
        }
    )


@dataclasses.dataclass(frozen=True)
class ShardedLayer:
    """One sharded layer of the GPT as :func:`gnnpar.tensor.parallelize` lays it out."""

    name: str
    kind: str  # "linear" or "embedding"
    layout: ShardLayout
    transpose: bool
    scatter_input: bool
    gather_output: bool
    tokens: str  # "batch" (B·T tokens of this rank), "positions" (T) or "routed" (an expert's)
    bias: ShardLayout | None
    count: int
    tied_to: str | None = None

    @property
    def expert(self) -> bool:
        """Whether the layer is one of a mixture of experts' experts (this rank's)."""
        return self.tokens == "routed"


@dataclasses.dataclass(frozen=True)
class Routed:
    """What one mixture-of-experts layer routed on a rank: the rows each of its experts ran
    on (``rows``, one entry per expert this rank holds) and the rows it sent to and received
    from the other expert ranks (``sent``, ``received``)."""

    rows: tuple[int, ...]
    sent: int
    received: int


def balanced_routing(problem: GPTProblem, g: GridShape) -> Routed:
    """One layer's :class:`Routed` when the router spreads every rank's ``top_k`` choices
    evenly over the experts and drops nothing (the planner's assumption): each of a rank's
    ``E/P`` experts gets ``tokens·k/E`` rows from each of the ``P`` expert ranks."""
    tokens = batch_per_rank(problem, g) * seq_per_rank(problem, g)
    k, p = problem.model.moe_top_k, g.expert
    per = problem.experts // p
    moved = tokens * k * (p - 1) / p
    return Routed((tokens * k * p / problem.experts,) * per, moved, moved)


def _expert_index(name: str) -> int | None:
    """The global expert index in a layer name (``blocks.0.mlp.experts.3.fc`` → 3)."""
    parts = name.split(".")
    if "experts" in parts[:-1]:
        return int(parts[parts.index("experts") + 1])
    return None


def meta_gpt(problem: GPTProblem) -> torch.nn.Module:
    """A one-block GPT of ``problem``'s widths on the meta device (no memory): what
    :func:`gpt_layout` lays out. Build it once when laying out many shapes."""
    from gnnpar.models.gpt.llama import Llama
    from gnnpar.models.gpt.model import GPT

    with torch.device("meta"):
        kind = Llama if problem.llama else GPT
        return kind(dataclasses.replace(problem.model, n_layer=1))


def gpt_layout(
    problem: GPTProblem, shape: Mapping[str, int], model: torch.nn.Module | None = None
) -> list[ShardedLayer]:
    """The sharded layers of one GPT (block 0 stands for all ``layers`` blocks), with the
    styles :func:`gnnpar.tensor.plan_styles` chooses on this shape; raises
    :class:`Infeasible` when the shape cannot hold the model (heads or features that do
    not split). ``model`` is :func:`meta_gpt` of the problem (built when not given)."""
    from gnnpar.tensor.parallelize import plan_styles

    g = grid_shape(shape, None)
    model = meta_gpt(problem) if model is None else model
    try:
        styles = plan_styles(model, g)["styles"]
    except ValueError as err:
        raise Infeasible(str(err)) from None
    mods = dict(model.named_modules())
    out = []
    for name, style in styles.items():
        m = mods[name]
        expert = _expert_index(name)
        if expert is not None and problem.experts % g.expert:
            raise Infeasible(f"{problem.experts} experts do not divide over expert={g.expert}")
        if expert is not None and expert >= problem.experts // g.expert:
            continue  # another expert rank's (rank 0 holds the first E/P: all have one shape)
        in_axis, out_axis = ("y", "x") if style.transpose else ("x", "y")
        count = problem.layers if name.startswith("blocks.") else 1
        try:
            if isinstance(m, torch.nn.Embedding):
                lay = ShardLayout.matrix(m.num_embeddings, m.embedding_dim, g, out_axis, in_axis)
                kind, bias = "embedding", None
            else:
                lay = ShardLayout.matrix(
                    m.out_features, m.in_features, g, out_axis, in_axis, style.fused
                )
                kind = "linear"
                bias = None
                if m.bias is not None:
                    bias = ShardLayout.vector(m.out_features, g, out_axis, style.fused)
        except ValueError as err:
            raise Infeasible(f"{name}: {err}") from None
        tied = "lm_head" if (problem.tie and name == "wte") else None
        out.append(
            ShardedLayer(
                name,
                kind,
                lay,
                style.transpose,
                style.scatter_input,
                style.gather_output,
                "positions" if name == "wpe" else "batch" if expert is None else "routed",
                bias,
                count,
                tied,
            )
        )
    return out


def batch_per_rank(problem: GPTProblem, g: GridShape) -> int:
    """Sequences each rank holds (the batch is split over data, expert and z)."""
    shards = g.data * g.expert * g.z
    if problem.batch % shards:
        what = "data*expert*z" if g.expert > 1 else "data*z"
        raise Infeasible(f"batch {problem.batch} does not divide over {what} = {shards}")
    return problem.batch // shards


def seq_per_rank(problem: GPTProblem, g: GridShape) -> int:
    """Tokens of each sequence a rank holds (the sequence is split over context)."""
    if g.context > 1 and problem.seq % (2 * g.context):
        raise Infeasible(
            f"sequence of {problem.seq} does not cut into 2·context = {2 * g.context} chunks"
        )
    return problem.seq // g.context


def _folded(
    g: GridShape, coords: Mapping[str, int], experts: bool = False
) -> tuple[GridShape, dict[str, int]]:
    """The grid and coordinates :mod:`gnnpar.shard` sees: for a mixture of experts' experts
    (``experts``) :func:`gnnpar.grid.fold_context`, for every other parameter
    :func:`gnnpar.grid.fold_replicas` (expert and context folded into data)."""
    folded = ("context",) if experts else ("expert", "context")
    c = dict(coords)
    index, stride = 0, 1
    for a in (*folded, "data"):
        index += c[a] * stride
        stride *= g.size(a)
        c[a] = 0
    c["data"] = index
    sizes = {a: 1 for a in folded}
    return dataclasses.replace(g, data=stride, **sizes), c


def context_collectives(problem: GPTProblem, g: GridShape, heads_parts: int) -> list[Collective]:
    """The ring attention's point-to-point sends of one step (:mod:`gnnpar.tensor.context`):
    per layer, forward (C−1) hops of this rank's keys and values, backward (C−1) hops of them
    and C hops of their gradients; ``heads_parts`` ranks split the heads."""
    from gnnpar.tensor.context import ring_bytes as context_ring_bytes

    c = g.context
    if c == 1:
        return []
    keys = (
        batch_per_rank(problem, g) * (problem.heads // heads_parts) * seq_per_rank(problem, g)
        * (problem.hidden // problem.heads) * problem.element_size
    )  # fmt: skip
    forward, backward = context_ring_bytes(keys, c)
    return [
        Collective("context", "p2p", c, forward, "ring attention: keys and values", problem.layers),
        Collective("context", "p2p", c, backward, "ring attention backward: keys, values and "
                   "their gradients", problem.layers),
    ]  # fmt: skip


def _module_collectives(
    m: ShardedLayer,
    g: GridShape,
    coords: Mapping[str, int],
    tokens: int,
    e: int,
    forward_only: bool = False,
) -> list[Collective]:
    """One sharded layer's collectives, forward and backward (``forward_only``: the forward's,
    which a recompute runs again)."""
    lay = m.layout
    r, c = coords[lay.row_axis], coords[lay.col_axis]
    rs, cs = lay.row_sizes(), lay.col_sizes()
    po, pi, pz = lay.row_parts, lay.col_parts, lay.depth
    z_full = pz * lay.shard_numel(r, c) * e
    out: list[Collective] = []
    if m.kind == "linear" and po * pi * pz == 1:
        return out
    i_ax, o_ax, n = lay.col_axis, lay.row_axis, m.count
    out += collective("z", "all_gather", pz, z_full, f"{m.name} gather W over z", n)
    if m.kind == "embedding":
        out += collective(o_ax, "all_reduce", po, tokens * cs[c] * e, f"{m.name} lookup", n)
        if m.gather_output:
            out += collective(i_ax, "all_gather", pi, pi * max(cs) * tokens * e, f"{m.name} out", n)
        out += collective("z", "reduce_scatter", pz, z_full, f"{m.name} dW over z", n)
        return out
    out += collective(i_ax, "all_reduce", pi, tokens * rs[r] * e, f"{m.name} Y = X·Wᵀ", n)
    if m.gather_output:
        gathered = po * max(rs) * tokens * e
        out += collective(o_ax, "all_gather", po, gathered, f"{m.name} gather Y", n)
    if forward_only:
        return out
    out += collective(o_ax, "all_reduce", po, tokens * cs[c] * e, f"{m.name} dX", n)
    out += collective("z", "reduce_scatter", pz, z_full, f"{m.name} dW over z", n)
    if m.scatter_input:
        gathered = pi * max(cs) * tokens * e
        out += collective(i_ax, "all_gather", pi, gathered, f"{m.name} gather dX", n)
    return out


def _layer_params(
    problem: GPTProblem, mods: list[ShardedLayer], coords: Mapping[str, int]
) -> tuple[int, int]:
    """(matrix elements, bias elements) of the sharded layers ``mods`` on this rank."""
    matrix = vector = 0
    for m in mods:
        lay = m.layout
        if m.name != "lm_head" or not problem.tie:
            matrix += lay.shard_numel(coords[lay.row_axis], coords[lay.col_axis]) * m.count
        if m.bias is not None:
            vector += m.bias.row_sizes()[coords[m.bias.row_axis]] * m.count
    return matrix, vector


def local_params(
    problem: GPTProblem, mods: list[ShardedLayer], coords: Mapping[str, int]
) -> tuple[int, int]:
    """(matrix elements, other elements) this rank stores (tied matrices once; with a
    mixture of experts, this rank's experts and every router)."""
    matrix, vector = _layer_params(problem, mods, coords)
    vector += problem.norm_elements * (2 * problem.layers + 1)
    vector += problem.experts * problem.hidden * problem.layers  # routers, whole everywhere
    return matrix, vector


def expert_params(
    problem: GPTProblem, mods: list[ShardedLayer], coords: Mapping[str, int]
) -> tuple[int, int]:
    """(matrix elements, bias elements) of this rank's experts (part of
    :func:`local_params`): sharded over context × data only (:func:`gnnpar.shard.shard`)."""
    return _layer_params(problem, [m for m in mods if m.expert], coords)


def lora_params(problem: GPTProblem, mods: list[ShardedLayer], coords: Mapping[str, int]) -> int:
    """Adapter elements this rank stores (0 without LoRA), as :mod:`gnnpar.tensor.lora` lays
    them out for each projection of the blocks: ``A`` (rank × in) with the projection's
    input split and its rank rows over the out axis, ``B`` (out × rank) with the
    projection's output split and its rank columns over the in axis, each also split over z
    like any matrix."""
    from gnnpar.comm import chunk_sizes

    r = problem.lora_rank
    if r == 0:
        return 0
    total = 0
    for m in mods:
        if m.kind != "linear" or not m.name.startswith("blocks."):
            continue
        lay = m.layout
        rows = lay.row_sizes()[coords[lay.row_axis]]
        cols = lay.col_sizes()[coords[lay.col_axis]]
        a = chunk_sizes(r, lay.row_parts)[coords[lay.row_axis]] * cols
        b = rows * chunk_sizes(r, lay.col_parts)[coords[lay.col_axis]]
        total += (-(-a // lay.depth) + -(-b // lay.depth)) * m.count
    return total


def _routing(
    problem: GPTProblem, g: GridShape, routed: Sequence[Routed] | None
) -> list[tuple[Routed, int]]:
    """(routing, layers it stands for): every layer's measured one, or the balanced one."""
    if not problem.experts:
        return []
    if routed is not None:
        return [(r, 1) for r in routed]
    return [(balanced_routing(problem, g), problem.layers)]


def moe_collectives(
    problem: GPTProblem, g: GridShape, routing: list[tuple[Routed, int]]
) -> list[Collective]:
    """The all-to-alls of the mixture of experts (:mod:`gnnpar.tensor.experts`): per layer
    the counts (``E/P`` integers per peer) and the routed rows out and back, forward and
    backward (and forward again under full activation checkpointing)."""
    p = g.expert
    if p == 1:
        return []
    passes = 3 if problem.activation_checkpointing == "full" else 2  # row trips
    counts = 2 if problem.activation_checkpointing == "full" else 1
    row = problem.hidden * problem.element_size
    out = []
    for r, n in routing:
        nbytes = (
            counts * 8 * (p - 1) * (problem.experts // p) + passes * (r.sent + r.received) * row
        )
        out.append(
            Collective("expert", "all_to_all", p, round(nbytes), "MoE dispatch and combine", n)
        )
    return out


def gpt_collectives(
    problem: GPTProblem,
    shape: Mapping[str, int],
    coords: Mapping[str, int] | None = None,
    layout: list[ShardedLayer] | None = None,
    routed: Sequence[Routed] | None = None,
) -> list[Collective]:
    """Collectives of one GPT optimizer step on the rank at ``coords`` (default rank 0);
    ``layout`` is :func:`gpt_layout` of the shape (computed when not given). With a mixture
    of experts, ``routed`` is what each layer routed on that rank (default: the balanced
    routing of :func:`balanced_routing`)."""
    g = grid_shape(shape, None)
    coords = g.coords(0) if coords is None else dict(coords)
    mods = gpt_layout(problem, shape) if layout is None else layout
    b_loc, t_loc = batch_per_rank(problem, g), seq_per_rank(problem, g)
    e = problem.element_size
    routing = _routing(problem, g, routed)
    out: list[Collective] = []
    for m in mods:
        tokens = t_loc if m.tokens == "positions" else b_loc * t_loc
        runs = [(m, tokens)]
        if m.expert:  # this expert's rows, per layer routing
            local = _expert_index(m.name)
            runs = [(dataclasses.replace(m, count=n), r.rows[local]) for r, n in routing]
        for mm, rows in runs:
            out += _module_collectives(mm, g, coords, rows, e)
            if problem.activation_checkpointing == "full" and m.name.startswith("blocks."):
                again = _module_collectives(mm, g, coords, rows, e, forward_only=True)
                out += [dataclasses.replace(c, what=f"recompute: {c.what}") for c in again]
    out += moe_collectives(problem, g, routing)
    qkv = next(m for m in mods if m.name.endswith("attn.qkv"))
    out += context_collectives(problem, g, qkv.layout.row_parts)
    head = next(m for m in mods if m.name == "lm_head")
    p = head.layout.row_parts
    ce = max(e, 4)  # the loss works in float32 at least
    tokens = b_loc * t_loc
    out += collective(head.layout.row_axis, "all_reduce", p, tokens * ce, "loss max")
    out += collective(head.layout.row_axis, "all_reduce", p, 2 * tokens * ce, "loss sums")
    # expert and context ranks reduce their gradients with the data ranks (bytes count under
    # "data"); a mixture of experts' experts only with the ranks holding the same ones
    fg, fcoords = _folded(g, coords)
    out += _gradient_sync(problem, mods, fg, fcoords)
    if problem.experts:
        eg, ecoords = _folded(g, coords, experts=True)
        out += _gradient_sync(problem, mods, eg, ecoords, experts=True)
    if problem.grad_clip:
        if problem.stage > 0 or problem.experts:  # data (or expert) ranks hold other parts
            out += collective("data", "all_reduce", fg.data, 8, "grad norm over data (float64)")
        out += collective("tensor", "all_reduce", g.size("tensor"), 8, "grad norm (float64)")
    means = 2 if problem.experts else 1  # the loss, and the auxiliary loss
    for axis in ("z", "expert", "context", "data"):
        out += collective(axis, "all_reduce", g.size(axis), 8, "loss mean (float64)", means)
    return out


def _gradient_sync(
    problem: GPTProblem,
    mods: list[ShardedLayer],
    g: GridShape,
    coords: Mapping[str, int],
    experts: bool = False,
) -> list[Collective]:
    """:mod:`gnnpar.shard`'s gradient reduction (stage 0): every gradient all-reduced over
    data, those the tensor layers replicate over z (not the matrices) first summed over z;
    stages 1–3 replace the data-axis all-reduce with ZeRO's reduce-scatter and all-gathers.
    ``experts``: that of a mixture of experts' experts alone (``g`` their view), else that of
    every other parameter."""
    e = problem.element_size
    matrix, other = expert_params(problem, mods, coords)
    if not experts:
        every, rest = local_params(problem, mods, coords)
        matrix, other = every - matrix, rest - other
    if problem.lora_rank:  # only the adapters' gradients travel (they are matrices)
        matrix, other = lora_params(problem, mods, coords), 0
    buckets: dict[tuple[str, ...], int] = {}
    for axes, n in ((("data",), matrix), (("z", "data"), other)):
        key = tuple(a for a in axes if g.size(a) > 1)
        if key:
            buckets[key] = buckets.get(key, 0) + n
    out: list[Collective] = []
    # bytes an element of stage 3's gathers and gradient reduction moves (ZeRO++ quantizes)
    stage3 = problem.stage == 3
    ge = 1 + 4 / QUANT_BLOCK if stage3 and problem.quantized_weights else e
    re = 0.5 + 4 / QUANT_BLOCK if stage3 and problem.quantized_grads else e
    for axes, n in buckets.items():
        for a in axes:
            if a == "data" and problem.stage > 0:
                what = "ZeRO gradient reduce-scatter"
                out += collective(a, "reduce_scatter", g.data, n * re, what)
                out += collective(a, "all_gather", g.data, n * ge, "ZeRO parameter all-gather")
                if stage3:
                    out += collective(a, "all_gather", g.data, n * ge, "ZeRO-3 backward re-gather")
            else:
                out += collective(a, "all_reduce", g.size(a), n * e, f"gradient sync over {a}")
    return out


def _linear_seconds(m: ShardedLayer, tokens: int, e: int, machine: Machine) -> float:
    """Forward and backward GEMMs of one Linear on rank 0's block (r × c)."""
    r, c = m.layout.block_shape(0, 0)
    return 3 * gemm_seconds(tokens, c, r, e, machine)


def gpt_compute_seconds(
    problem: GPTProblem,
    shape: Mapping[str, int],
    machine: Machine,
    layout: list[ShardedLayer] | None = None,
) -> dict[str, float]:
    """Seconds of one GPT optimizer step on rank 0: ``{"gemm", "attention",
    "elementwise", "optimizer"}`` (``layout``: :func:`gpt_layout` of the shape). Activation
    checkpointing adds the recompute: the blocks' forward (full) or the attention core's
    (selective)."""
    g: GridShape = grid_shape(shape, None)
    mods = gpt_layout(problem, shape) if layout is None else layout
    b_loc = batch_per_rank(problem, g)
    e, h, t = problem.element_size, problem.hidden, problem.seq
    t_loc = seq_per_rank(problem, g)  # with context, each rank's queries meet all T keys
    tokens = b_loc * t_loc
    out = {"gemm": 0.0, "attention": 0.0, "elementwise": 0.0, "optimizer": 0.0}
    full = problem.activation_checkpointing == "full"
    local = 0
    routed = balanced_routing(problem, g) if problem.experts else None
    for m in mods:
        local += m.layout.shard_numel(0, 0) * m.count
        if m.kind == "linear":
            # the blocks' forward GEMMs (a third of forward + backward) run again
            again = 4 / 3 if full and m.name.startswith("blocks.") else 1
            rows = routed.rows[_expert_index(m.name)] if m.expert else tokens
            out["gemm"] += again * _linear_seconds(m, rows, e, machine) * m.count
    by_name = {m.name.split(".", 2)[-1]: m for m in mods}
    fc = next(m for m in mods if m.name.endswith(".gate_up" if problem.llama else ".fc"))
    qkv, head = by_name["attn.qkv"], by_name["lm_head"]
    h_heads = h / qkv.layout.row_parts  # features of the heads this rank holds
    # causal attention (flash: the masked half skipped), forward + backward ≈ 3 × forward
    # (full and selective recompute run the forward's third once more)
    passes = 3 if problem.activation_checkpointing == "none" else 4
    attn_flops = passes * 2.0 * b_loc * t_loc * t * h_heads
    out["attention"] = problem.layers * attn_flops / (machine.gemm_tflops * 1e12)
    # norms, residuals, dropout: full width on every rank; GELU on this rank's 4h chunk
    # (full recompute: the forward's half once more)
    mlp = problem.mlp_width / fc.layout.row_parts
    if problem.experts:  # each token's activation runs in top_k experts
        mlp *= problem.model.moe_top_k
    per_layer = tokens * (24 * h + 16 * mlp) * e * (1.5 if full else 1)
    loss = tokens * problem.vocab / head.layout.row_parts * 4 * 4
    out["elementwise"] = stream_seconds(problem.layers * per_layer + loss, machine)
    shard = g.data * g.context if problem.stage >= 1 else 1  # context ranks shard too
    out["optimizer"] = stream_seconds(28 * local / shard, machine)
    share = machine.compute_share(g.world_size)
    return {k: v / share for k, v in out.items()}
