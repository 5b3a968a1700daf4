"""Deferred initialisation: a model built on the meta device gets only this rank's pieces, with
the values an eager seeded build would have given them.

Eager construction (``torch.manual_seed(s); GPT(cfg)``) draws random numbers twice per
parameter or more: once in each module's constructor (``nn.Linear.reset_parameters``, GPT-2's
``Conv1D``), then again in the model's own init pass (our GPT's ``_init_weights``, Hugging
Face's ``post_init``), in an order that only running the code shows. So the code is run:
:func:`record_init` builds the model once more on fake tensors (no memory is allocated) and
records every aten operation it performs, in order. :meth:`InitProgram.replay` then executes
the record on real tensors with the global generator, which reproduces every draw bit for bit,
and hands each parameter's final value to a callback that keeps this rank's slice.

Memory stays near the pieces. An operation that writes a whole tensor without reading it
(``normal_``, ``uniform_``, ``zero_``, ``fill_``, ``copy_`` ...) ends the life of its previous
value, so each value lives only from such a write to its last use: the constructor's draws are
made in a temporary and dropped at once (they only advance the generator), and a parameter's
final value lives from its last write until it is sliced. With the usual initialisers that is
one full parameter at a time.

:func:`gnnpar.tensor.parallelize` uses this for a model on the meta device; the draws come from
the global generator when it runs, so seed just before, as for an eager build.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from gnnpar.grid import ProcessGrid
from gnnpar.tensor.state import sharded_parameters

__all__ = ["InitProgram", "allocate", "materialize", "record_init"]

_aten = torch.ops.aten
#: Operations that write every element of their first argument without reading it.
OVERWRITES = frozenset(
    {
        _aten.normal_.default,
        _aten.uniform_.default,
        _aten.zero_.default,
        _aten.fill_.Scalar,
        _aten.fill_.Tensor,
        _aten.copy_.default,
        _aten.random_.default,
        getattr(_aten.random_, "from"),  # a Python keyword as an overload name
        _aten.random_.to,
        _aten.exponential_.default,
        _aten.bernoulli_.float,
        _aten.log_normal_.default,
        _aten.cauchy_.default,
        _aten.geometric_.default,
    }
)


def _fake_type() -> type:
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


def _key(t: torch.Tensor) -> int:
    # The storage's identity: views, detach() and nn.Parameter share it. The recorder keeps
    # every fake tensor alive, so no address is reused while a program exists.
    return t.untyped_storage()._cdata


def _covers_storage(t: torch.Tensor) -> bool:
    nbytes = t.untyped_storage().nbytes()
    return t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() == nbytes


@dataclasses.dataclass(frozen=True)
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    out: Any


@dataclasses.dataclass(frozen=True)
class _Named:
    """Where named tensors (a parameter and its ties) lie in one recorded storage."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[_Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append(_Op(func, args, kwargs, out))
        return out


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )


def _tie_groups(pairs: dict[str, Any]) -> set[tuple[str, ...]]:
    groups: dict[Any, list[str]] = defaultdict(list)
    for name, ident in pairs.items():
        groups[ident].append(name)
    return {tuple(sorted(g)) for g in groups.values() if len(g) > 1}


class InitProgram:
    """The operations an eager construction performs, recorded by :func:`record_init`, and
    where each parameter and buffer of the built model lies in them.

    ``shapes`` maps every parameter and buffer name (ties under each name) to its shape.
    """

    def __init__(self, ops: list[_Op], named: dict[str, torch.Tensor]):
        self._ops = ops
        self.shapes = {name: tuple(t.shape) for name, t in named.items()}
        self._ties = _tie_groups({name: _key(t) for name, t in named.items()})
        views: dict[tuple, list[str]] = defaultdict(list)
        for name, t in named.items():
            views[(_key(t), tuple(t.shape), tuple(t.stride()), t.storage_offset())].append(name)
        self._named: dict[int, list[_Named]] = defaultdict(list)
        for (key, shape, stride, offset), names in views.items():
            self._named[key].append(_Named(tuple(names), shape, stride, offset))

    def check_fits(self, model: nn.Module) -> None:
        """Raise ValueError unless ``model`` has the same parameters and buffers (names,
        shapes and ties) as the recorded one, but those under submodules it left to other
        ranks (:func:`absent_prefixes`)."""
        have = {name: tuple(t.shape) for name, t in named_tensors(model)}
        absent = absent_prefixes(model)
        want = {n: s for n, s in self.shapes.items() if not n.startswith(absent)}
        if have != want:
            diff = sorted(set(have.items()) ^ set(want.items()))[:4]
            raise ValueError(
                "the model built to record its initialisation differs from the model to "
                f"initialise (name, shape): {diff}; pass init= a function that builds this model"
            )
        ties = _tie_groups({name: id(t) for name, t in named_tensors(model)})
        if ties != self._ties:
            raise ValueError(
                f"the model ties {sorted(ties)}, the recorded build ties {sorted(self._ties)}"
            )

    def _schedule(self) -> tuple[dict[int, list], dict[int, list]]:
        """Per operation index: the storages to allocate fresh before it (a whole overwrite
        starts a new value) and the values whose life ends after it (with whether it is the
        storage's last value)."""
        fake = _fake_type()
        fresh: dict[int, list] = defaultdict(list)
        ends: dict[int, list] = defaultdict(list)
        last: dict[int, int] = {}
        for i, op in enumerate(self._ops):
            leaves = [t for t in tree_leaves((op.args, op.kwargs, op.out)) if isinstance(t, fake)]
            target = op.args[0] if op.func in OVERWRITES and op.args else None
            if isinstance(target, fake) and _covers_storage(target):
                k = _key(target)
                others = [t for t in tree_leaves((op.args[1:], op.kwargs)) if isinstance(t, fake)]
                if all(_key(t) != k for t in others):
                    if k in last:
                        ends[last[k]].append((k, False))  # its old value is never read again
                    nbytes = target.untyped_storage().nbytes()
                    fresh[i].append((k, nbytes // target.element_size(), target.dtype))
            for t in leaves:
                last[_key(t)] = i
        for k, i in last.items():
            ends[i].append((k, True))
        return fresh, ends

    @torch.no_grad()
    def replay(self, deliver: Callable[[tuple[str, ...], torch.Tensor], None]) -> None:
        """Execute the record on real CPU tensors, drawing from the global generator, and call
        ``deliver(names, value)`` once per parameter or buffer (tied names together) with its
        final value, which is freed when ``deliver`` returns."""
        fresh, ends = self._schedule()
        store: dict[int, torch.Tensor] = {}
        for i, op in enumerate(self._ops):
            for k, numel, dtype in fresh.get(i, ()):
                store[k] = torch.empty(numel, dtype=dtype)
            _execute(op, store)
            for k, final in ends.get(i, ()):
                value = store.pop(k)
                if final:
                    for n in self._named.get(k, ()):
                        deliver(n.names, torch.as_strided(value, n.shape, n.stride, n.offset))
                del value


def _execute(op: _Op, store: dict[int, torch.Tensor]) -> None:
    """Run one recorded operation on the real tensors in ``store`` (by storage), adding the
    storages it creates. A function of its own so that no local outlives the operation: a
    reference left in a loop variable would keep a freed value's memory alive."""
    fake = _fake_type()

    def real(a: Any) -> Any:
        if not isinstance(a, fake):
            return a
        base = store[_key(a)]
        if base.dtype != a.dtype:
            raise ValueError(
                f"cannot replay an initialisation that views {base.dtype} memory as {a.dtype}"
            )
        return torch.as_strided(base, a.shape, a.stride(), a.storage_offset())

    args, kwargs = tree_map(real, (op.args, op.kwargs))
    out = op.func(*args, **kwargs)
    for f, r in zip(tree_leaves(op.out), tree_leaves(out), strict=True):
        if isinstance(f, fake) and _key(f) not in store:
            store[_key(f)] = r


def record_init(build: Callable[[], nn.Module]) -> InitProgram:
    """Run ``build()`` (an eager construction such as ``lambda: GPT(cfg)``) on fake tensors,
    allocating nothing, and return what it did as an :class:`InitProgram`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    recorder = _Recorder()
    # The build is recorded as it would run alone: a dispatch mode already active (a
    # simulated device, a profiler) must neither see nor reinterpret its fake operations.
    with _disable_current_modes(), FakeTensorMode(allow_non_fake_inputs=True), recorder:
        model = build()
    fake = _fake_type()
    named = dict(named_tensors(model))
    odd = [name for name, t in named.items() if not isinstance(t, fake)]
    if odd:
        raise ValueError(f"the recorded build made {odd[:3]} outside the recording")
    return InitProgram(recorder.ops, named)


def absent_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Name prefixes (``"blocks.0.mlp.experts.5."``) of the submodules that ``model`` left to
    other ranks: a module declares them in ``absent``, names of its children that the eager
    build has and this rank does not (expert parallelism's
    :class:`~gnnpar.tensor.experts.LocalExperts`). Their values are still replayed (the draws
    of the generator stay in step) and dropped."""
    out = []
    for name, m in model.named_modules():
        for child in getattr(m, "absent", ()):
            out.append(f"{name}.{child}." if name else f"{child}.")
    return tuple(out)


def materialize(model: nn.Module, program: InitProgram, grid: ProcessGrid) -> None:
    """Give every parameter and buffer of ``model`` (parallel or not, on the meta device) its
    value by replaying ``program``: a sharded parameter gets this rank's piece (read from the
    full value box by box), anything else its full value, on ``grid.device`` and in the dtype
    the model holds. Ties stay ties."""
    sharded = sharded_parameters(model)
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(old) -> (old kept alive, new)
    absent = absent_prefixes(model)

    def deliver(names: tuple[str, ...], value: torch.Tensor) -> None:
        for name in names:
            if absent and name.startswith(absent):
                continue  # another rank's: its draws were made, its value is not kept
            if name in sharded:
                module, pname, layout = sharded[name]
                piece = getattr(module, pname)
                if id(piece) not in done:
                    r, c, d = layout.coords(grid)
                    transposed = module.stored_transposed(pname)
                    layout.read_piece(value.__getitem__, piece.data, r, c, d, transposed)
                    done[id(piece)] = (piece, piece)
                continue
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            is_param = attr in module._parameters
            old = module._parameters[attr] if is_param else module._buffers[attr]
            if id(old) not in done:
                new = value.to(device=grid.device, dtype=old.dtype, copy=True)
                if is_param:
                    new = nn.Parameter(new, requires_grad=old.requires_grad)
                done[id(old)] = (old, new)
            if is_param:
                module._parameters[attr] = done[id(old)][1]
            else:
                module._buffers[attr] = done[id(old)][1]

    program.replay(deliver)
    left = [name for name, t in named_tensors(model) if t.is_meta]
    if left:
        raise ValueError(f"replaying the initialisation left {left[:3]} on the meta device")


def allocate(model: nn.Module, grid: ProcessGrid) -> None:
    """Give every parameter of ``model`` still on the meta device uninitialised memory of its
    shape and dtype on ``grid.device`` (ties stay ties), for a caller that loads every value
    next (a restore): no initialisation is recorded or replayed. A model with buffers is
    refused (ValueError): no checkpoint holds a non-persistent buffer's value."""
    buffers = [name for name, b in model.named_buffers() if b.is_meta]
    if buffers:
        raise ValueError(
            f"cannot leave {buffers[:3]} to a restore: buffers need their initial values"
        )
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, old in list(module._parameters.items()):
            if old is None or not old.is_meta:
                continue
            if id(old) not in made:
                new = torch.empty(old.shape, dtype=old.dtype, device=grid.device)
                made[id(old)] = nn.Parameter(new, requires_grad=old.requires_grad)
            module._parameters[attr] = made[id(old)]
