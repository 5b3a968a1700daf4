"""``parallelize(model, grid)``: make a plain model tensor-parallel from the outside.

Every ``nn.Linear``, ``nn.Embedding`` and GPT-2 ``Conv1D`` (from ``transformers``) is replaced,
in place, by a :class:`~gnnpar.tensor.Linear` or :class:`~gnnpar.tensor.Embedding` holding
this rank's piece of the same values. Nothing global is patched: only attributes of the
model's own modules change.

**Chains.** Inside an attention block (fused q/k/v projection → heads → output projection)
and an MLP block (up projection → activation → down projection) the two layers are *chained*:
the first keeps its output split over its out axis and the second, with the opposite
``transpose``, takes that split input as it is, so nothing is re-laid-out between them and
every head and activation stays on one rank. Known blocks are those whose class declares its
rule (``tensor_parallel_chain``: our GPT's :class:`~gnnpar.models.gpt.model.CausalSelfAttention`
and :class:`~gnnpar.models.gpt.model.MLP`) and GPT-2's ``GPT2Attention`` and ``GPT2MLP``;
:class:`Chain` names others. Which layer of a chain is
transposed is chosen by the communication model (ring bytes per rank): with only x > 1 this
gives Megatron's column-then-row layout (one all-reduce over x forward, one backward).

**Head and loss.** The output head (``lm_head``) keeps its logits split over the vocabulary
(``Plan.loss_parallel``); compute the loss with :func:`gnnpar.tensor.cross_entropy` and the
head. A head tied to the token embedding stays tied: both layers share one sharded parameter.

**Deferred initialisation.** A model built on the meta device gets only this rank's pieces,
equal to those of the eager seeded build (:mod:`gnnpar.tensor.deferred`).

**Everything else** (a Linear or Embedding outside any chain) runs in easy mode with
``transpose`` alternating in module order. ``Plan.skip`` leaves modules alone; a chain whose
partner is skipped falls back to easy mode.

**Sequence parallelism** (``Plan.sequence_parallel``, :mod:`gnnpar.tensor.sequence`): between
the chains every x rank holds its share of the sequence. Every chain is laid out with its
first layer's out axis x (the column layer: it gathers the sequence) and its second's in axis
x (the row layer: it reduce-scatters it), as is the head; with only x > 1 that is the layout
the byte model picks anyway. ``Plan.decompose`` runs those gathers and reduce-scatters as
point-to-point steps overlapping the matmuls (:mod:`gnnpar.tensor.overlap`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections.abc import Callable, Mapping
from types import MappingProxyType

from torch import nn

from gnnpar.comm import ring_bytes
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid
from gnnpar.tensor.deferred import (
    InitProgram,
    allocate,
    materialize,
    named_tensors,
    record_init,
)
from gnnpar.tensor.layers import Embedding, Linear, PrefetchChain, ShardedModule
from gnnpar.tensor.sequence import AXIS as SEQUENCE_AXIS
from gnnpar.tensor.sequence import SequenceSplit
from gnnpar.tensor.sequence import install as install_sequence_parallel

__all__ = ["Chain", "LayerStyle", "Plan", "parallelize", "plan_styles"]


@dataclasses.dataclass(frozen=True)
class LayerStyle:
    """How one module is made parallel: its ``transpose``, whether it takes full input
    features (``scatter_input``) and gives full output features (``gather_output``), and
    how many fused parts its outputs have."""

    transpose: bool = False
    scatter_input: bool = True
    gather_output: bool = True
    fused: int = 1
    #: sequence parallelism: "gather" (input split over the sequence), "scatter" (output
    #: split over it) or "none" (:data:`gnnpar.tensor.layers.SEQUENCE_ROLES`)
    sequence: str = "none"


@dataclasses.dataclass(frozen=True)
class Chain:
    """Two layers of a block that chain without re-layout.

    ``block`` is an fnmatch pattern over module names (e.g. ``"layers.*.attn"``); ``first``
    and ``second`` are attribute names inside each matching block. ``fused`` is the number of
    equal parts of the first layer's output (3 for a fused q/k/v projection); ``heads`` names
    the block attribute holding the number of attention heads, which must divide over the
    first layer's out axis; ``split_attr`` names a block attribute holding the size of one
    fused part, which is set to this rank's size (GPT-2's ``split_size``).
    ``unsplit_otherwise``: where the heads do not divide, the block's layers run in easy mode
    (weights split, outputs gathered; every rank computes every head) rather than the grid
    being refused (Llama's grouped-query attention with fewer key-value heads than ranks).
    """

    block: str
    first: str
    second: str
    fused: int = 1
    heads: str | None = None
    split_attr: str | None = None
    unsplit_otherwise: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    """What :func:`parallelize` does.

    Attributes:
        skip: fnmatch patterns of module names to leave as they are.
        styles: explicit :class:`LayerStyle` per module name, overriding the defaults.
        chains: extra :class:`Chain` rules (known GPT blocks are found on their own).
        chain: chain attention and MLP layers (False: every layer in easy mode).
        head: name of the output head (default: a module named ``lm_head``).
        loss_parallel: keep the head's logits split over the vocabulary.
        prefetch: start each layer's z all-gather during the previous layer.
        sequence_parallel: split the sequence over x between the chains (Megatron-LM's
            sequence parallelism, :mod:`gnnpar.tensor.sequence`); needs blocks that declare
            their chains (our GPT and Llama).
        decompose: with ``sequence_parallel``, decompose each layer's sequence all-gather
            and reduce-scatter into point-to-point steps that overlap its matmul
            (:mod:`gnnpar.tensor.overlap`).
    """

    skip: tuple[str, ...] = ()
    styles: Mapping[str, LayerStyle] = dataclasses.field(
        default_factory=lambda: MappingProxyType({})
    )
    chains: tuple[Chain, ...] = ()
    chain: bool = True
    head: str | None = None
    loss_parallel: bool = True
    prefetch: bool = True
    sequence_parallel: bool = False
    decompose: bool = False


def _known_chains(model: nn.Module) -> list[tuple[str, Chain]]:
    """(block name, rule) for the blocks that declare their rule (a class attribute
    ``tensor_parallel_chain``: the :class:`Chain` fields but ``block``, as our GPT's attention
    and MLP do) and for transformers' GPT-2 blocks (by class name: they declare nothing)."""
    out = []
    for name, m in model.named_modules():
        cls = type(m)
        declared = getattr(cls, "tensor_parallel_chain", None)
        hf = cls.__module__.startswith("transformers.")
        if declared is not None:
            out.append((name, Chain(name, **declared)))
        elif hf and cls.__name__ == "GPT2Attention" and not getattr(m, "is_cross_attention", 0):
            out.append(
                (
                    name,
                    Chain(name, "c_attn", "c_proj", 3, heads="num_heads", split_attr="split_size"),
                )
            )
        elif hf and cls.__name__ == "GPT2MLP":
            out.append((name, Chain(name, "c_fc", "c_proj")))
    return out


def _is_conv1d(m: nn.Module) -> bool:
    cls = type(m)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")


def _candidates(model: nn.Module, skip: tuple[str, ...]) -> dict[str, nn.Module]:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, ShardedModule) or not name:
            continue
        if isinstance(m, (nn.Linear, nn.Embedding)) or _is_conv1d(m):
            if not any(fnmatch.fnmatchcase(name, pat) for pat in skip):
                out[name] = m
    return out


def _io(m: nn.Module) -> tuple[int, int]:
    """(in features, out features) of a Linear, Conv1D or Embedding (num → rows)."""
    if isinstance(m, nn.Embedding):
        return m.embedding_dim, m.num_embeddings
    if _is_conv1d(m):
        return m.weight.shape[0], m.weight.shape[1]
    return m.in_features, m.out_features


def _ar(p: int) -> float:
    return ring_bytes("all_reduce", 1.0, p)


def _ag(p: int) -> float:
    return ring_bytes("all_gather", 1.0, p)


def _chain_cost(h: int, m: int, o: int, a: int, b: int) -> float:
    """Bytes per token of a chain h → m → o whose first layer has in axis of size ``a`` and
    out axis of size ``b`` (the second layer the reverse), forward and backward."""
    forward = _ar(a) * m / b + _ar(b) * o / a + _ag(a) * o
    backward = _ar(a) * m / b + _ar(b) * h / a + _ag(a) * h
    return forward + backward


def _head_cost(h: int, v: int, a: int, b: int) -> float:
    """Bytes per token of a head h → v (logits kept split) with in axis ``a``, out axis ``b``."""
    return _ar(a) * v / b + _ar(b) * h / a + _ag(a) * h


def _embedding_cost(d: int, a: int, b: int) -> float:
    """Bytes per token of an embedding of width d, features over ``a``, ids over ``b``."""
    return _ar(b) * d / a + _ag(a) * d


def _check_sequence_plan(model: nn.Module, plan: Plan) -> bool:
    """Whether the plan asks for sequence parallelism; a one-line error where it cannot work."""
    if plan.decompose and not plan.sequence_parallel:
        raise UserError(
            "Plan.decompose needs Plan.sequence_parallel: the collectives it decomposes are "
            "sequence parallelism's all-gather and reduce-scatter"
        )
    if not plan.sequence_parallel:
        return False
    if not plan.chain:
        raise UserError("Plan.sequence_parallel needs Plan.chain=True (column and row layers)")
    for name, m in model.named_modules():
        if type(m).__module__.startswith("transformers."):
            raise UserError(
                f"Plan.sequence_parallel: {name or 'the model'} is transformers' "
                f"{type(m).__name__}, which reshapes to the whole sequence; it needs blocks "
                "that declare tensor_parallel_chain (our GPT and Llama)"
            )
    return True


def plan_styles(model: nn.Module, grid: ProcessGrid, plan: Plan | None = None) -> dict:
    """The :class:`LayerStyle` that :func:`parallelize` gives each module, by name, the
    chain rules it applies and why the blocks whose heads do not split were left unchained
    (``{"styles": ..., "chains": [(block, Chain), ...], "unsplit": [reason, ...]}``)."""
    plan = plan or Plan()
    cands = _candidates(model, plan.skip)
    x, y = grid.size("x"), grid.size("y")
    seq = _check_sequence_plan(model, plan) and x > 1
    styles: dict[str, LayerStyle] = {}
    applied: list[tuple[str, Chain]] = []
    unsplit: list[str] = []  # blocks whose heads do not split: every rank computes them all

    # Chains first: known blocks, then the plan's rules.
    rules = _known_chains(model) if plan.chain else []
    if plan.chain:
        names = dict(model.named_modules())
        for rule in plan.chains:
            rules += [(n, rule) for n in names if fnmatch.fnmatchcase(n, rule.block)]
    blocks = dict(model.named_modules())
    for block, rule in rules:
        first, second = f"{block}.{rule.first}", f"{block}.{rule.second}"
        if first not in cands or second not in cands or first in styles or second in styles:
            continue
        h, m = _io(cands[first])
        _, o = _io(cands[second])
        # sequence parallelism: the column layer (out axis x) first, whatever the byte model
        transpose = seq or _chain_cost(h, m, o, y, x) < _chain_cost(h, m, o, x, y)
        out_axis = "x" if transpose else "y"
        if rule.heads is not None:
            heads = getattr(blocks[block], rule.heads)
            p = grid.size(out_axis)
            if heads % p:
                why = f"attention block {block!r}: {rule.heads}={heads} does not divide over "
                if seq:
                    raise UserError(
                        f"{why}{out_axis}={p}; sequence parallelism needs its heads split over "
                        "x: choose an x that divides them"
                    )
                if not rule.unsplit_otherwise:
                    raise UserError(
                        f"{why}{out_axis}={p}; choose another grid or pass Plan(chain=False)"
                    )
                unsplit.append(f"{why}{out_axis}={p}")
                continue
        roles = ("gather", "scatter") if seq else ("none", "none")
        styles[first] = LayerStyle(transpose, True, False, rule.fused, roles[0])
        styles[second] = LayerStyle(not transpose, False, True, 1, roles[1])
        applied.append((block, rule))

    # Ties: modules sharing one weight must share one layout.
    by_weight: dict[int, list[str]] = {}
    for name, m in _all_weighted(model):
        by_weight.setdefault(id(m.weight), []).append(name)
    ties = {tuple(v) for v in by_weight.values() if len(v) > 1}
    for group in ties:
        inside = [n for n in group if n in cands]
        if inside and len(inside) != len(group):
            left = sorted(set(group) - set(inside))
            raise UserError(
                f"modules {list(group)} share one weight, but {left} would be left alone; "
                "skip all of them or none"
            )

    head = plan.head
    if head is None:
        heads = [n for n in cands if n == "lm_head" or n.endswith(".lm_head")]
        head = heads[0] if heads else None
    if seq and (head is None or head not in cands or head in styles):
        raise UserError(
            "sequence parallelism needs an output head to gather the sequence (a Linear named "
            "lm_head, or Plan.head) that is in the plan"
        )
    if head is not None and head in cands and head not in styles:
        if isinstance(cands[head], nn.Embedding):
            raise UserError(f"the head {head!r} is an Embedding, not a Linear")
        h, v = _io(cands[head])
        transpose = seq or _head_cost(h, v, y, x) < _head_cost(h, v, x, y)
        role = "gather" if seq else "none"
        styles[head] = LayerStyle(transpose, True, not plan.loss_parallel, 1, role)
        for group in ties:
            if head in group:
                for other in group:
                    if other != head and isinstance(cands.get(other), nn.Embedding):
                        styles[other] = LayerStyle(transpose, sequence="scatter" if seq else "none")

    flip = False
    for name, m in cands.items():
        if name in styles:
            continue
        if isinstance(m, nn.Embedding):
            d, _ = _io(m)
            transpose = _embedding_cost(d, y, x) < _embedding_cost(d, x, y)
            styles[name] = LayerStyle(transpose, sequence="scatter" if seq else "none")
        else:
            if seq:
                raise UserError(
                    f"sequence parallelism: {name!r} is a Linear outside the chains and not the "
                    "head, and would see a shard of the sequence; leave it out (Plan.skip)"
                )
            styles[name] = LayerStyle(flip)
            flip = not flip

    for name, style in plan.styles.items():
        if name not in cands:
            raise UserError(
                f"plan gives a style for {name!r}, which is not a Linear or "
                "Embedding of this model (or is skipped)"
            )
        styles[name] = style
    # A tied group must agree on transpose after overrides.
    for group in ties:
        ts = {styles[n].transpose for n in group if n in styles}
        if len(ts) > 1:
            raise UserError(f"modules {list(group)} share one weight but differ in transpose")
    return {"styles": styles, "chains": applied, "unsplit": unsplit}


def _all_weighted(model: nn.Module):
    for name, m in model.named_modules(remove_duplicate=False):
        if name and isinstance(getattr(m, "weight", None), nn.Parameter):
            if isinstance(m, (nn.Linear, nn.Embedding)) or _is_conv1d(m):
                yield name, m


def _init_program(
    model: nn.Module, init: Callable[[], nn.Module] | InitProgram | None
) -> InitProgram | None:
    """The recorded initialisation of a model on the meta device (None for a built one)."""
    tensors = [t for _, t in named_tensors(model)]
    on_meta = [t.is_meta for t in tensors]
    if not any(on_meta):
        if init is not None:
            raise ValueError("init= is for a model on the meta device; this one is built")
        return None
    if not all(on_meta):
        raise ValueError(
            "the model is partly on the meta device: build it all there (deferred) or not at all"
        )
    if init is None:
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(
                f"{type(model).__name__} is on the meta device and has no .config to rebuild it "
                "from; pass init= a function that builds it eagerly, e.g. lambda: Model(...)"
            )
        init = lambda: type(model)(config)  # noqa: E731
    program = init if isinstance(init, InitProgram) else record_init(init)
    program.check_fits(model)
    return program


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def parallelize(
    model: nn.Module,
    grid: ProcessGrid,
    plan: Plan | None = None,
    *,
    init: Callable[[], nn.Module] | InitProgram | None = None,
    values: bool = True,
) -> nn.Module:
    """Make ``model`` tensor-parallel on ``grid``, in place, and return it (moved to the
    grid's device). Every rank must call it on a model with the same values (build it with
    the same seed): each rank keeps its pieces. See the module docstring for what is chosen;
    :func:`plan_styles` shows it without changing the model.

    **Deferred initialisation.** A model built on the meta device (``with
    torch.device("meta"): GPT(cfg)``) gets only this rank's pieces, with the values that
    ``GPT(cfg)`` built eagerly from the global generator's current state would have, bit for
    bit (seed just before, as for an eager build; see :mod:`gnnpar.tensor.deferred`).
    ``init`` builds the model eagerly, to record its initialisation on fake tensors (default
    ``type(model)(model.config)``, which fits our GPT and Hugging Face models), or is an
    :class:`~gnnpar.tensor.deferred.InitProgram` already recorded. ``values=False`` leaves
    such a model's pieces uninitialised, recording and replaying nothing
    (:func:`~gnnpar.tensor.deferred.allocate`): for a caller that loads every parameter
    next, as a restart's restore does (it saves the build's largest cost).
    """
    plan = plan or Plan()
    program = _init_program(model, init) if values else None
    deferred = not values and any(t.is_meta for _, t in named_tensors(model))
    decided = plan_styles(model, grid, plan)
    styles: dict[str, LayerStyle] = decided["styles"]
    if decided["unsplit"] and grid.global_rank == 0:
        n = len(decided["unsplit"])
        more = f" (and {n - 1} more blocks)" if n > 1 else ""
        warnings.warn(
            f"{decided['unsplit'][0]}{more}: their heads are not split, every rank of the "
            "axis computes all of them",
            stacklevel=2,
        )
    cands = _candidates(model, plan.skip)
    made: dict[str, ShardedModule] = {}
    shared: dict[int, ShardedModule] = {}
    split = SequenceSplit(grid)  # shared by the model's sequence-parallel layers
    names_in_order = [n for n in cands if n in styles]
    for name in names_in_order:
        old, style = cands[name], styles[name]
        seq = {"sequence": style.sequence}
        if style.sequence != "none":
            seq["sequence_split"] = split
        if isinstance(old, nn.Embedding):
            new: ShardedModule = Embedding.from_embedding(
                old,
                grid,
                transpose=style.transpose,
                gather_output=style.gather_output,
                load=program is None and not deferred,
                **seq,
            )
        else:
            if style.sequence != "none":
                seq["decompose"] = plan.decompose
            new = Linear.from_linear(
                old,
                grid,
                weight_format="in_out" if _is_conv1d(old) else "out_in",
                transpose=style.transpose,
                scatter_input=style.scatter_input,
                gather_output=style.gather_output,
                fused=style.fused,
                load=program is None and not deferred,
                **seq,
            )
        key = id(old.weight)
        if key in shared:
            if shared[key].weight_layout != new.weight_layout:
                raise ValueError(f"{name!r} shares its weight with a layer of another layout")
            new.weight = shared[key].weight
        else:
            shared[key] = new
        made[name] = new
    for name, new in made.items():
        _set(model, name, new)
    for block, rule in decided["chains"]:
        if rule.split_attr is not None:
            first = made[f"{block}.{rule.first}"]
            setattr(
                model.get_submodule(block), rule.split_attr, first.local_out_features // rule.fused
            )
    if program is not None:
        materialize(model, program, grid)
    elif deferred:
        allocate(model, grid)
    model.to(grid.device)
    if plan.sequence_parallel and grid.size(SEQUENCE_AXIS) > 1:
        blocks = [(b, made[f"{b}.{rule.first}"]) for b, rule in decided["chains"]]
        for b, rule in decided["chains"]:  # a Plan.styles override may have undone a role
            for attr, role in ((rule.first, "gather"), (rule.second, "scatter")):
                if made[f"{b}.{attr}"].sequence != role:
                    raise UserError(
                        f"sequence parallelism: {b}.{attr} must have sequence={role!r} "
                        "(its LayerStyle in Plan.styles)"
                    )
        install_sequence_parallel(model, grid, blocks, split)
    if plan.prefetch and grid.size("z") > 1 and made:
        PrefetchChain([made[n] for n in names_in_order])
    return model
