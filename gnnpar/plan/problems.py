"""What the planner plans for: a full-graph GCN (:class:`GCNProblem`) or a GPT
(:class:`GPTProblem`), with the dataset and model presets the command line knows."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from types import MappingProxyType

from gnnpar.models.gpt.model import GPTConfig

__all__ = [
    "GCNProblem",
    "GPTProblem",
    "MiniBatchProblem",
    "PlanError",
    "gpt_sizes",
    "parse_count",
]


class PlanError(ValueError):
    """Input the planner cannot use; the message names the problem (one line)."""


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{name} must be a positive integer, got {value!r}")


def _checkpointing(mode: object, allowed: tuple[str, ...]) -> None:
    if mode not in allowed:
        raise PlanError(f"activation_checkpointing must be {' or '.join(allowed)}, got {mode!r}")


@dataclasses.dataclass(frozen=True)
class GCNProblem:
    """A full-graph GCN (or GraphSAGE-mean, GAT, GIN) training run of ``layers`` layers.

    ``nnz`` is the number of nonzeros of the normalised adjacency Â (stored entries, self
    loops included); :meth:`from_edges` derives it from an undirected edge count as
    ``2·E + N``. ``element_size`` is the bytes of a feature, weight and activation (4:
    float32, as Plexus trains). ``input_grad`` asks for the gradient of the input features
    (the trainer does not need it). GAT (``model="gat"``): hidden layers have ``heads`` heads
    concatenated (a hidden width splits into them), the output layer ``out_heads`` averaged.
    ``activation_checkpointing`` ``"full"``: each layer keeps only its input and runs its
    forward again in backward (:mod:`gnnpar.recompute`).
    """

    nodes: int
    nnz: int
    features: int
    classes: int
    hidden: int = 128
    layers: int = 3
    model: str = "gcn"
    element_size: int = 4
    bias: bool = True
    input_grad: bool = False
    name: str = ""
    widths: tuple[int, ...] = ()
    heads: int = 8
    out_heads: int = 1
    activation_checkpointing: str = "none"

    def __post_init__(self) -> None:
        _checkpointing(self.activation_checkpointing, ("none", "full"))
        keys = ("nodes", "nnz", "features", "classes", "hidden", "layers", "element_size")
        for key in (*keys, "heads", "out_heads"):
            _positive(key, getattr(self, key))
        if self.model not in ("gcn", "sage", "gat", "gin"):
            raise PlanError(f"model must be gcn, sage, gat or gin, got {self.model!r}")
        if self.widths:
            for w in self.widths:
                _positive("width", w)
            w = self.widths
            if len(w) != self.layers + 1 or w[0] != self.features or w[-1] != self.classes:
                raise PlanError(
                    f"widths {list(w)} must run from features {self.features} to classes "
                    f"{self.classes} over {self.layers} layers"
                )

    @classmethod
    def from_widths(cls, nodes: int, nnz: int, widths: list[int], **kwargs: object) -> GCNProblem:
        """A problem whose layer boundaries have the given ``widths`` (features first,
        classes last; hidden widths may differ)."""
        if len(widths) < 2:
            raise PlanError(f"widths need at least an input and an output, got {widths}")
        hidden = widths[1] if len(widths) > 2 else widths[-1]
        return cls(
            nodes=nodes,
            nnz=nnz,
            features=widths[0],
            classes=widths[-1],
            hidden=hidden,
            layers=len(widths) - 1,
            widths=tuple(widths),
            **kwargs,
        )

    @classmethod
    def from_edges(cls, nodes: int, edges: int, **kwargs: object) -> GCNProblem:
        """A problem on a graph of ``edges`` undirected edges: Â holds both directions of
        each and a self loop per node (``nnz = 2·edges + nodes``)."""
        _positive("edges", edges)
        _positive("nodes", nodes)
        return cls(nodes=nodes, nnz=2 * edges + nodes, **kwargs)

    @property
    def dims(self) -> list[int]:
        """Feature widths of every layer boundary: features, hidden…, classes."""
        if self.widths:
            return list(self.widths)
        return [self.features] + [self.hidden] * (self.layers - 1) + [self.classes]

    def layer_heads(self, layer: int) -> tuple[int, int]:
        """GAT: (heads, features per head) of ``layer`` (hidden layers concatenate their
        heads, the output layer averages ``out_heads`` heads of the classes)."""
        dims = self.dims
        if layer == len(dims) - 2:
            return self.out_heads, dims[-1]
        if dims[layer + 1] % self.heads:
            raise PlanError(
                f"hidden width {dims[layer + 1]} does not split into {self.heads} heads"
            )
        return self.heads, dims[layer + 1] // self.heads

    @property
    def num_ops(self) -> int:
        """Sparse operators per layer (GraphSAGE-mean stacks the root term: 2)."""
        return 2 if self.model == "sage" else 1


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
    state off the device (stages 1–3 only; the ranking skips stage 0 then).
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

    def __post_init__(self) -> None:
        from gnnpar.shard.config import OFFLOAD_MODES

        _checkpointing(self.activation_checkpointing, ("none", "full", "selective"))
        for key in ("batch", "element_size", "micro_batches", "virtual"):
            _positive(key, getattr(self, key))
        if self.stage not in (0, 1, 2, 3):
            raise PlanError(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.offload not in OFFLOAD_MODES:
            raise PlanError(f"offload must be one of {OFFLOAD_MODES}, got {self.offload!r}")

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
            _positive(key, value)
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
    def num_params(self) -> int:
        """Parameters of the model (a tied head counted once)."""
        h, v = self.hidden, self.vocab
        # 12h² of matrices; biases 9h and two LayerNorms (weight and bias: 4h), or 2h
        block = 12 * h * h + (13 * h if self.bias else 2 * h)
        head = 0 if self.tie else v * h
        final_norm = (2 if self.bias else 1) * h
        return self.layers * block + v * h + self.seq * h + head + final_norm


@dataclasses.dataclass(frozen=True)
class MiniBatchProblem:
    """A mini-batch GraphSAGE run (the ``sage`` task with the neighbour sampler), in the
    task's words and with its defaults: ``batch_size`` seeds per global batch, one fan-out
    per layer (``fanouts``, seeds' hop first), ``prefetch`` batches sampled ahead,
    ``feature_cache`` remote feature rows cached per rank, ``stage`` the ZeRO stage of
    :mod:`gnnpar.shard`. ``edges`` is the stored CSR entries (in-edges; both directions of an
    undirected edge), ``train_nodes`` the training seeds (default: all nodes).
    ``degrees``: the graph's in-degree histogram as ``(degree, nodes)`` pairs, which the
    expected batch sizes read (:func:`degree_histogram`; default: every node of the mean
    degree, which over-counts the distinct nodes of a batch on a skewed graph)."""

    nodes: int
    edges: int
    features: int
    classes: int
    hidden: int = 64
    layers: int = 2
    fanouts: tuple[int, ...] = (10, 10)
    batch_size: int = 32
    train_nodes: int | None = None
    element_size: int = 4
    stage: int = 0
    prefetch: int = 1
    feature_cache: int = 0
    degrees: tuple[tuple[int, int], ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        for key in ("nodes", "features", "classes", "hidden", "layers", "batch_size"):
            _positive(key, getattr(self, key))
        _positive("element_size", self.element_size)
        for key in ("edges", "prefetch", "feature_cache"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PlanError(f"{key} must be an integer >= 0, got {value!r}")
        if len(self.fanouts) != self.layers:
            raise PlanError(
                f"fanouts {list(self.fanouts)} give {len(self.fanouts)} fan-outs for "
                f"{self.layers} layers: give one per layer"
            )
        for f in self.fanouts:
            if not isinstance(f, int) or isinstance(f, bool) or (f < 1 and f != -1):
                raise PlanError(f"a fan-out must be a positive integer or -1, got {f!r}")
        if self.stage not in (0, 1, 2, 3):
            raise PlanError(f"stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.train_nodes is not None and not 1 <= self.train_nodes <= self.nodes:
            raise PlanError(f"train_nodes must be in 1..{self.nodes}, got {self.train_nodes}")
        if self.degrees and sum(c for _, c in self.degrees) != self.nodes:
            raise PlanError(
                f"the degree histogram counts {sum(c for _, c in self.degrees)} nodes, "
                f"the problem has {self.nodes}"
            )

    @property
    def dims(self) -> list[int]:
        """Widths of every layer boundary: features, hidden…, classes."""
        return [self.features] + [self.hidden] * (self.layers - 1) + [self.classes]

    @property
    def seeds(self) -> int:
        """Training seeds over all ranks."""
        return self.nodes if self.train_nodes is None else self.train_nodes


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


_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """``"20B"`` → 20_000_000_000, ``"1.3b"``, ``"350M"``, ``"4096"``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbBtT]?)\s*", str(text))
    if not m:
        raise PlanError(f"cannot read {text!r} as a count such as 20B, 350M or 4096")
    return round(float(m.group(1)) * _SUFFIX[m.group(2).lower()])
