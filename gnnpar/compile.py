"""``torch.compile`` of a model's transformer blocks, in place, beside gnnpar's hooks.

:func:`compile_blocks` compiles each block's ``forward`` (torchtitan compiles each block the
same way), not the block module's call and not the model:

- **The module's hooks stay outside.** ZeRO-3 (:mod:`gnnpar.shard.zero3`) gathers a unit in
  a forward pre-hook of the block module and releases it in a forward post-hook; both run
  around the compiled ``forward`` as they ran around the eager one (``nn.Module.compile``
  would compile the hooks too, and a gather is no tensor program). The gradient buckets of
  stages 0–2 and ZeRO-3's gradient hand-over hang on the parameters' post-accumulate hooks,
  which autograd runs after the compiled backward has produced the gradients; ZeRO-3's
  saved-tensor hooks see what the compiled graph saves for backward (a view of a gathered
  buffer is saved by reference, as in eager mode).
- **Activation checkpointing composes.** Full recompute (``recompute_all``) checkpoints the
  block's call from outside (:func:`gnnpar.models.gpt.model.run_blocks`), so backward calls
  the compiled ``forward`` again, hooks and all; selective recompute checkpoints the attention
  core inside ``forward``, which the compiler traces as a checkpointed region of the graph.
- **What communicates runs eagerly, between compiled pieces.** A tensor-parallel layer
  (:class:`gnnpar.tensor.layers.ShardedModule`) on a grid with more than one rank over x, y
  and z calls collectives from its autograd functions, counts their bytes in Python
  (:func:`gnnpar.comm.record`) and prefetches the next layer's weight: its ``forward`` is
  wrapped in :func:`torch.compiler.disable`, so Dynamo breaks the graph there and compiles the
  pieces between the collectives (the norms and residual adds, the attention core with its
  reshapes, the MLP's activation). So does a context-parallel ring attention (the
  ``attention`` of a module whose class declares ``ring_attention``: point-to-point
  transfers), and a mixture-of-experts layer (a class declaring ``mixture_of_experts``:
  routing whose sizes depend on the data, an all-to-all with an expert axis). On one rank
  (x·y·z = 1) the tensor-parallel layers are plain ``F.linear`` calls and each block compiles
  to one graph, checked: ``fullgraph=True``.
- **Dropout draws eager's masks**: inductor's ``fallback_random`` keeps torch's own random
  operators, in the same order, so a compiled step equals the eager one given the same
  seed (and a recomputed block draws its forward's masks again).

All blocks of one class share one compiled function (Dynamo's cache is per code object,
guarded on the block's attributes): the blocks of a model compile once per shape, grad mode
and training flag. Shapes that change (validation batches, generation's growing sequences)
recompile once more with a dynamic size, unless ``dynamic=False``.

:func:`graph_breaks` lists where Dynamo breaks a block's graph (``torch._dynamo.explain``,
no code generated): what docs/training.md#compiled-blocks records for each mode.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from gnnpar.errors import UserError
from gnnpar.tensor.layers import ShardedModule

__all__ = ["GraphBreak", "compile_blocks", "eager_parts", "graph_breaks", "is_compiled"]

#: The attribute a compiled block carries (its class's compiled ``forward``).
_MARK = "_gnnpar_compiled"
#: Inductor options every block is compiled with (see the module docstring).
DEFAULT_OPTIONS = {"fallback_random": True}


@dataclasses.dataclass(frozen=True)
class GraphBreak:
    """One place where Dynamo broke a block's graph: ``where`` is the innermost frame of the
    caller's code (``file:line function``), ``reason`` the first line of Dynamo's reason."""

    reason: str
    where: str


def _communicates(module: nn.Module) -> bool:
    """Whether a tensor-parallel layer calls collectives in its forward (some of x, y, z
    has more than one rank; otherwise it is a plain ``F.linear``/``F.embedding``)."""
    grid = module.grid
    return grid.size("x") * grid.size("y") * grid.size("z") > 1


def eager_parts(block: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """``(name, module, attribute)`` of each callable inside ``block`` that must run eagerly
    (see the module docstring): ``attribute`` is ``"forward"`` for a module,
    ``"attention"`` for a ring attention. A mixture-of-experts layer is kept whole (nothing
    under it is listed again)."""
    skip: list[str] = []
    for name, m in block.named_modules():
        if any(name.startswith(s + ".") for s in skip):
            continue
        if getattr(type(m), "mixture_of_experts", False):
            skip.append(name)
            yield name, m, "forward"
        elif isinstance(m, ShardedModule) and _communicates(m):
            yield name, m, "forward"
        elif getattr(type(m), "ring_attention", False) and m.attention is not None:
            yield name, m, "attention"


def is_compiled(module: nn.Module) -> bool:
    """Whether :func:`compile_blocks` compiled ``module``'s forward."""
    return _MARK in module.__dict__


def _keep_eager(block: nn.Module) -> int:
    """Wrap every :func:`eager_parts` callable of ``block`` in ``torch.compiler.disable``
    (an instance attribute: the class and other models are untouched); how many."""
    n = 0
    for _, m, attr in eager_parts(block):
        setattr(m, attr, torch.compiler.disable(getattr(m, attr)))
        n += 1
    return n


def compile_blocks(
    model: nn.Module,
    blocks: type | tuple[type, ...],
    *,
    backend: str | Callable[..., Any] = "inductor",
    mode: str | None = None,
    dynamic: bool | None = None,
    options: dict[str, Any] | None = None,
) -> list[str]:
    """Compile the ``forward`` of every module of ``model`` that is an instance of
    ``blocks``, in place, and return their names (see the module docstring for what is
    compiled, what runs eagerly and why).

    Call it after the model is made parallel (:func:`gnnpar.tensor.parallelize`, context and
    expert parallelism, LoRA) and before or after :func:`gnnpar.shard.shard`: the eager parts
    are chosen from the grid the layers hold. ``backend``, ``mode`` and ``dynamic`` are
    ``torch.compile``'s; ``options`` are added to :data:`DEFAULT_OPTIONS` (inductor only).
    A block already compiled, or a model without any block of ``blocks``, is a
    :class:`~gnnpar.errors.UserError`.
    """
    types_ = blocks if isinstance(blocks, tuple) else (blocks,)
    if not types_ or not all(isinstance(t, type) for t in types_):
        raise UserError(f"compile_blocks needs module classes, got {blocks!r}")
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, types_)]
    # a block inside another block is compiled with it
    found = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found if o)]
    if not found:
        what = " or ".join(t.__name__ for t in types_)
        raise UserError(f"compile: {type(model).__name__} has no {what} block to compile")
    done = [n for n, m in found if is_compiled(m)]
    if done:
        raise UserError(f"compile: block {done[0] or '<root>'} is already compiled")
    opts = None
    if backend == "inductor":
        opts = {**DEFAULT_OPTIONS, **(options or {})}
    elif options:
        raise UserError(f"compile: options are inductor's, not for backend {backend!r}")
    compiled: dict[tuple[Any, bool], Callable[..., Any]] = {}
    for _, block in found:
        whole = _keep_eager(block) == 0  # nothing left out: one graph, or an error
        key = (type(block).forward, whole)
        if key not in compiled:
            compiled[key] = torch.compile(
                type(block).forward,
                fullgraph=whole,
                dynamic=dynamic,
                backend=backend,
                mode=mode,
                options=opts,
            )
        block.forward = types.MethodType(compiled[key], block)
        block.__dict__[_MARK] = compiled[key]
    return [n for n, _ in found]


def graph_breaks(block: nn.Module, *args: Any, **kwargs: Any) -> tuple[int, list[GraphBreak]]:
    """Dynamo's graphs and graph breaks of ``block``'s ``forward`` on ``args`` (its class's
    forward, with the eager parts of :func:`compile_blocks` in place when it compiled the
    block): ``(number of graphs, breaks)``. It traces only (no code is generated) but runs
    the block, collectives included: every rank of its groups must call it. The block's
    parameters must be in place (a ZeRO-3 unit: inside ``ShardedModel.gathered()``)."""
    out = torch._dynamo.explain(type(block).forward)(block, *args, **kwargs)
    breaks = []
    for r in out.break_reasons:
        frames = [f for f in r.user_stack if "/torch/" not in f.filename]
        f = frames[-1] if frames else r.user_stack[-1]
        where = f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
        breaks.append(GraphBreak(r.reason.strip().splitlines()[0], where))
    return out.graph_count, breaks
