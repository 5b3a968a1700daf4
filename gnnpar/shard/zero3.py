"""Stage 3: parameters sharded, each unit gathered just before it runs and released after;
and FCDP, which caches what forward gathered so that backward need not gather it again.

Each unit owns up to two :class:`~gnnpar.shard.flat.FlatGroup` s: its trainable parameters
and its frozen ones. Outside its forward a unit holds only this rank's chunks; its modules do
not have the parameter attributes at all (reading one raises ``AttributeError``).

**Forward.** A pre-forward hook all-gathers the unit's chunks over the data axis (or takes the
gather that the previous unit prefetched) and sets every parameter attribute to a view of the
gathered buffer (for a trainable parameter, a fresh autograd leaf aliasing it). It then
starts the gathers of the next ``prefetch_depth`` units (the order is recorded during each
forward and used by the next; 0: none). The post-forward hook removes the attributes and
frees the buffer's memory (the leaves' gradient accumulators keep the leaves, which alias it,
until backward).

**Saved tensors.** Autograd would keep the gathered buffer alive until backward by saving the
weights that, e.g., a matmul needs. While the model's forward runs, a
``saved_tensors_hooks`` pair replaces every saved tensor that lives in a gathered buffer by a
small reference (unit, offset, shape, strides), and backward resolves it by gathering the unit
again — in backward order, ``prefetch_depth`` units ahead. Only units that had something saved are
gathered again, so a unit whose backward needs no parameter (an embedding lookup) costs no
second gather.

**Recompute** (activation checkpointing, :mod:`gnnpar.recompute`). A checkpointed unit keeps
nothing for backward, so it has no saved references; backward calls its module again, and
the pre-forward hook, seeing that it runs inside backward, gathers the unit then (as a
backward gather: FCDP's cache serves it) without prefetching the next unit of forward order.
The post-forward hook of that run keeps the buffer (the recomputed tensors view it) until the
unit's gradients have all arrived, as a resolved saved reference would. The bytes are those
of stage 3 without recompute: the recompute's gather is the backward gather.

**Offloaded parameters** (an offload tier, :mod:`gnnpar.shard.offload`). The trainable chunk
a gather sends is the tier's :meth:`~gnnpar.shard.offload.HostTier.fetch`: with the file
tier, a copy read out of its file. Those reads run in the tier's background thread
``prefetch_depth`` units ahead of the gathers (forward order, then backward order; a
recomputed unit reads the units before it), so a unit's chunk is usually in memory by the
time its gather starts; reads nobody took are dropped at the end of backward.

**Gradients.** As soon as autograd has accumulated a parameter's gradient (a post-accumulate
hook on its leaf), the hook takes it. When the unit's last one has arrived, the unit is
released, the gradients are laid end to end in one flat buffer (the freed parameter buffer
when it has the right dtype), its tail that needs it is
z-reduced (tensor-parallel composition), it is divided by ``data·z`` and reduce-scattered over
the data axis, asynchronously. Reduce-scatters that have finished are handed over
while backward goes on (one at most stays in flight); at the end of backward the last is
waited for, and the chunks become the gradients of the master pieces. Parameters that got no
gradient count as zero. Under ``no_sync`` the flat gradients accumulate locally instead.

**FCDP.** With :class:`~gnnpar.shard.FCDP`, the post-forward hook keeps the gathered trainable
buffer — whole, or this rank's 1/k node-local slice for k data ranks per node — in a cache, on
the device while ``device_budget_bytes`` allows and in host memory beyond. Backward rebuilds
the unit from the cache: with slices, an all-gather inside the node (axis label
``"data.intra"``); with whole copies, nothing. The second all-gather over the whole data axis,
which crosses nodes, is skipped. Frozen parameters are cached whole the first time they are
gathered and never communicated again.

Bytes per step for Ψ parameters (padded) of e bytes, p data ranks, k per node::

    stage 3   all-gather  Ψe·(p−1)/p forward + Ψe·(p−1)/p backward; reduce-scatter Ψe·(p−1)/p
    FCDP      all-gather  Ψe·(p−1)/p forward; intra-node Ψe·(k−1)/k backward; reduce-scatter
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from gnnpar import comm
from gnnpar.grid import ProcessGrid
from gnnpar.recompute import in_backward
from gnnpar.shard.config import FCDP, MixedPrecision
from gnnpar.shard.flat import FlatGroup, Slot
from gnnpar.shard.groups import INTRA, NodeGroups
from gnnpar.shard.offload import HostTier
from gnnpar.shard.quantize import gather_quantized, reduce_scatter_quantized

__all__ = ["Stage3", "Unit"]

KINDS = ("trainable", "frozen")
#: Reduce-scatters allowed in flight during backward (each holds a unit's full gradient).
MAX_INFLIGHT_REDUCTIONS = 1


class _Ready:
    """A finished result with the interface of :class:`gnnpar.comm.Handle`."""

    def __init__(self, value: torch.Tensor):
        self.value = value

    def wait(self) -> torch.Tensor:
        return self.value

    def is_completed(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A saved tensor that lives in a unit's gathered buffer."""

    unit: Unit
    kind: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class Unit:
    """A module whose parameters are gathered and released together."""

    def __init__(self, index: int, name: str, module: nn.Module, runtime: Stage3):
        self.index = index
        self.name = name
        self.module = module
        self.runtime = runtime
        self.groups: dict[str, FlatGroup] = {}
        self.full: dict[str, torch.Tensor] = {}
        self.pending: dict[str, Any] = {}
        self.cache: dict[str, tuple[torch.Tensor, str]] = {}
        self.grad: torch.Tensor | None = None  # flat gradient (accumulated under no_sync)
        self.arrived: list = []  # (slot, gradient) received during this backward
        self.depth = 0
        self.saved: set[str] = set()
        self.seen_in_backward = False

    def __repr__(self) -> str:
        return f"Unit({self.name or '<root>'})"


class Stage3:
    """The runtime of stage 3 and FCDP over a list of units (the root, the model, first)."""

    def __init__(
        self,
        grid: ProcessGrid,
        units: list[Unit],
        mp: MixedPrecision | None,
        compute_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        fcdp: FCDP | None,
        nodes: NodeGroups | None,
        prefetch: int,
        order: str = "ring",
        quantized_weights: bool = False,
        quantized_grads: tuple[NodeGroups, list[int]] | None = None,
        tier: HostTier | None = None,
    ):
        self.grid = grid
        #: where the trainable chunks live (None: on the device, in the chunks themselves)
        self.tier = tier
        self.reduce_order = order  # of the data axis's sum (gnnpar.comm.ORDERS)
        #: qwZ: the parameter all-gathers move int8 blocks (gnnpar.shard.quantize)
        self.quantized_weights = quantized_weights
        #: qgZ: the node groups and data indices of the int4 hierarchical reduction, or None
        self.quantized_grads = quantized_grads
        self.units = units
        self.mp = mp
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.fcdp = fcdp
        self.nodes = nodes
        #: units whose gathers start ahead of the running one (0: none)
        self.prefetch = int(prefetch)
        self.scale = grid.size("data") * grid.size("z")
        self.divisor = self.scale  # the average's; scale drops data when the loss has it
        self.sync = True
        self.order: list[Unit] = []
        self._next_fw: dict[int, Unit] = {}
        self._recording: list[Unit] = []
        self._live: dict[int, tuple[Unit, str, torch.Tensor]] = {}
        self._pending_rs: list[tuple[FlatGroup, Any]] = []
        self._in_backward = False
        self._saved_hooks = None
        self._bw_order: list[Unit] = []
        self.cache_bytes = {"device": 0, "host": 0}
        self._hooks: list = []

    # ------------------------------------------------------------------------ hooks
    def register(self) -> None:
        """Install the forward hooks on every unit's module."""
        root = self.units[0]
        self._hooks.append(
            root.module.register_forward_pre_hook(self._root_pre, prepend=True, with_kwargs=True)
        )
        for unit in self.units:
            self._hooks.append(
                unit.module.register_forward_pre_hook(lambda m, a, u=unit: self._pre(u))
            )
            self._hooks.append(
                unit.module.register_forward_hook(
                    lambda m, a, o, u=unit: self._post(u), always_call=True
                )
            )
        self._hooks.append(root.module.register_forward_hook(self._root_post, always_call=True))

    def remove_hooks(self) -> None:
        """Detach every hook."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _root_pre(self, module, args, kwargs):
        self._recording = []
        if torch.is_grad_enabled():
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
            for unit in self.units:
                unit.saved = set()
        if self.mp is not None and self.mp.cast_forward_inputs and self.mp.param_dtype:
            cast = self.mp.param_dtype
            args, kwargs = cast_floats((args, kwargs), cast)
            return args, kwargs
        return None

    def _root_post(self, module, args, output):
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        if self._recording:
            self.order = self._recording
            self._next_fw = {}
            for a, b in zip(self.order, self.order[1:], strict=False):
                self._next_fw.setdefault(id(a), b)
        self._recording = []
        for unit in self.units:  # prefetched but never used: finish and drop
            for kind in list(unit.pending):
                if unit.depth == 0:
                    unit.pending.pop(kind).wait()
        if self.tier is not None:
            self.tier.forget_reads()
            if torch.is_grad_enabled():  # backward's first units, in backward order
                first = [u for u in reversed(self.order) if u.saved]
                self._read_ahead(_distinct(first)[: self.prefetch])
        if self.mp is not None and self.mp.output_dtype is not None:
            return cast_floats(output, self.mp.output_dtype)
        return None

    def _pre(self, unit: Unit) -> None:
        recompute = in_backward()
        if not recompute:
            self._recording.append(unit)
        unit.depth += 1
        if unit.depth > 1:
            return  # re-entered (a module called twice): already installed
        if recompute:
            self._begin_backward()
            self._poll_reductions()
        for kind in unit.groups:
            self._materialize(unit, kind, backward=recompute)
        self._install(unit)
        if recompute:
            # backward recomputes the units before this one, in reverse forward order
            if unit in self.order:
                before = self.order[: self.order.index(unit)]
                self._read_ahead(_distinct(reversed(before))[: self.prefetch])
            return
        ahead = self._forward_after(unit, 2 * self.prefetch)
        for nxt in ahead[: self.prefetch]:
            if nxt.depth == 0:
                for kind in nxt.groups:
                    self._start(nxt, kind, backward=False)
        self._read_ahead(ahead[self.prefetch :])

    def _forward_after(self, unit: Unit, n: int) -> list[Unit]:
        """Up to ``n`` distinct units that follow ``unit`` in the recorded forward order."""
        out: list[Unit] = []
        nxt = self._next_fw.get(id(unit))
        while nxt is not None and nxt is not unit and nxt not in out and len(out) < n:
            out.append(nxt)
            nxt = self._next_fw.get(id(nxt))
        return out

    def _read_ahead(self, units: list[Unit]) -> None:
        """Start the tier's background reads of these units' trainable chunks."""
        if self.tier is None:
            return
        for unit in units:
            group = unit.groups.get("trainable")
            if group is not None and "trainable" not in unit.full:
                self.tier.prefetch(group)

    def _post(self, unit: Unit) -> None:
        unit.depth = max(0, unit.depth - 1)
        if unit.depth:
            return
        self._uninstall(unit)
        if in_backward():
            return  # a recompute: its tensors view the buffer until the gradients arrive
        if self.fcdp is not None:
            self._cache(unit)
        full = unit.full.get("trainable")
        if full is not None and torch.is_grad_enabled():
            # The leaves' gradient accumulators hold the leaves until backward, and the
            # leaves alias this buffer: free its memory explicitly, unless the buffer is
            # the master chunk itself (one data rank) or kept by the cache.
            ptr = full.untyped_storage().data_ptr()
            keep = {unit.groups["trainable"].master.untyped_storage().data_ptr()}
            keep |= {t.untyped_storage().data_ptr() for t, _ in unit.cache.values()}
            if ptr not in keep:
                full.untyped_storage().resize_(0)
        self._drop(unit)

    # ------------------------------------------------------------------ gather / release
    def _start(self, unit: Unit, kind: str, backward: bool) -> None:
        """Start getting ``kind`` of ``unit`` (no-op if it is held or on its way)."""
        if kind in unit.full or kind in unit.pending:
            return
        cached = unit.cache.get(kind)
        if cached is not None and (kind == "frozen" or backward):
            tensor, _ = cached
            tensor = tensor.to(self.grid.device, non_blocking=True)
            if self.fcdp.cache == "slice" and kind == "trainable" and self.nodes.local_size > 1:
                unit.pending[kind] = comm.all_gather(tensor, self.nodes, INTRA, async_op=True)
            else:
                unit.pending[kind] = _Ready(tensor)
            return
        group = unit.groups[kind]
        if self.tier is not None and kind == "trainable":
            send = self.tier.fetch(group, self.compute_dtype)
        else:
            send = group.send(self.compute_dtype)
        if self.quantized_weights:
            unit.pending[kind] = gather_quantized(send, group.grid, "data", send.dtype, True)
            return
        unit.pending[kind] = comm.all_gather(send, group.grid, "data", async_op=True)

    def _materialize(self, unit: Unit, kind: str, backward: bool) -> torch.Tensor:
        if kind not in unit.full:
            self._start(unit, kind, backward)
            unit.full[kind] = unit.pending.pop(kind).wait()
        return unit.full[kind]

    def _install(self, unit: Unit) -> None:
        for kind, group in unit.groups.items():
            full = unit.full[kind]
            self._live[full.untyped_storage().data_ptr()] = (unit, kind, full)
            track = kind == "trainable" and torch.is_grad_enabled()
            for slot, view in zip(group.slots, group.views(full), strict=False):
                if track:
                    # A fresh autograd leaf aliasing the gathered buffer; its gradient goes
                    # into the unit's flat gradient as soon as autograd has accumulated it.
                    view = view.detach().requires_grad_(True)
                    view.register_post_accumulate_grad_hook(
                        lambda t, u=unit, s=slot: self._on_param_grad(u, s, t)
                    )
                for module, attr in slot.refs:
                    module.__dict__[attr] = view

    def _uninstall(self, unit: Unit) -> None:
        for kind, group in unit.groups.items():
            full = unit.full.get(kind)
            if full is not None:
                self._live.pop(full.untyped_storage().data_ptr(), None)
            for slot in group.slots:
                for module, attr in slot.refs:
                    module.__dict__.pop(attr, None)

    def _drop(self, unit: Unit, kinds: tuple[str, ...] = KINDS) -> None:
        for kind in kinds:
            unit.full.pop(kind, None)

    # ------------------------------------------------------------------------- FCDP
    def _cache(self, unit: Unit) -> None:
        """Keep what forward gathered (see the module docstring)."""
        fc = self.fcdp
        for kind, full in unit.full.items():
            if kind == "frozen":
                if "frozen" not in unit.cache:
                    self._store(unit, kind, full, whole=True)
            elif torch.is_grad_enabled():
                k = self.nodes.local_size
                if fc.cache == "slice" and k > 1:
                    part = full.numel() // k
                    sl = full[self.nodes.local_rank * part : (self.nodes.local_rank + 1) * part]
                    self._store(unit, kind, sl, whole=False)
                else:
                    self._store(unit, kind, full, whole=True)

    def _store(self, unit: Unit, kind: str, t: torch.Tensor, whole: bool) -> None:
        self._uncache(unit, kind)
        nbytes = t.numel() * t.element_size()
        on_device = self.cache_bytes["device"] + nbytes <= self.fcdp.device_budget_bytes
        if on_device:
            kept = t if whole else t.clone()
            where = "device"
        else:
            pin = self.fcdp.pin_memory and t.device.type == "cuda"
            if t.device.type == "cpu" and whole:
                kept = t  # already in host memory
            else:
                kept = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                kept.copy_(t, non_blocking=pin)
            where = "host"
        unit.cache[kind] = (kept, where)
        self.cache_bytes[where] += nbytes

    def _uncache(self, unit: Unit, kind: str) -> None:
        old = unit.cache.pop(kind, None)
        if old is not None:
            self.cache_bytes[old[1]] -= old[0].numel() * old[0].element_size()

    # --------------------------------------------------------------------- saved tensors
    def _pack(self, t: torch.Tensor) -> Any:
        if not self._live:
            return t
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return t
        entry = self._live.get(key)
        if entry is None:
            return t
        unit, kind, full = entry
        if t.dtype != full.dtype or t.device != full.device:
            return t
        unit.saved.add(kind)
        offset = t.storage_offset() - full.storage_offset()
        return _Ref(unit, kind, tuple(t.shape), tuple(t.stride()), offset)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Ref):
            return packed
        unit = packed.unit
        self._begin_backward()
        self._poll_reductions()
        full = self._materialize(unit, packed.kind, backward=True)
        if not unit.seen_in_backward:
            unit.seen_in_backward = True
            self._prefetch_backward(unit)
        return full.as_strided(packed.shape, packed.stride, packed.offset)

    def _prefetch_backward(self, unit: Unit) -> None:
        if not self.prefetch:
            return
        # The gather queues behind the reduce-scatter in flight on the same group anyway:
        # finish that first, so its input is freed before the gather's output is allocated.
        while self._pending_rs:
            group, handle = self._pending_rs.pop(0)
            group.set_grad(handle.wait(), owned=True)
        order = self._bw_order
        try:
            i = order.index(unit)
        except ValueError:
            return
        ahead = [u for u in order[i + 1 :] if not u.seen_in_backward][: 2 * self.prefetch]
        for nxt in ahead[: self.prefetch]:
            for kind in nxt.saved:
                self._start(nxt, kind, backward=True)
        self._read_ahead([u for u in ahead[self.prefetch :] if "trainable" in u.saved])

    # ------------------------------------------------------------------------- backward
    def _begin_backward(self) -> None:
        if self._in_backward:
            return
        self._in_backward = True
        self._bw_order = []
        for u in reversed(self.order):
            if u.saved and u not in self._bw_order:
                self._bw_order.append(u)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _poll_reductions(self) -> None:
        """Hand over the reduce-scatters that have finished, freeing their inputs early."""
        while self._pending_rs and self._pending_rs[0][1].is_completed():
            group, handle = self._pending_rs.pop(0)
            group.set_grad(handle.wait(), owned=True)

    def _on_param_grad(self, unit: Unit, slot: Slot, leaf: torch.Tensor) -> None:
        """One parameter's gradient is ready: take it from its leaf; when the unit's last one
        has arrived, free the unit's parameters, lay the gradients end to end and
        reduce-scatter them."""
        self._begin_backward()
        unit.arrived.append((slot, leaf.grad))
        leaf.grad = None
        if len(unit.arrived) == len(unit.groups["trainable"].slots):
            spare = self._spare(unit)
            self._drop(unit)  # backward needs these parameters no more
            self._uncache(unit, "trainable")
            self._collect(unit, spare)
            if self.sync:
                self._reduce(unit)

    def _spare(self, unit: Unit) -> torch.Tensor | None:
        """The unit's gathered trainable buffer, if nothing else uses it and it can hold the
        flat gradient (same dtype and size): the gradient may then overwrite it instead of
        taking new memory."""
        full = unit.full.get("trainable")
        group = unit.groups["trainable"]
        dtype = self.reduce_dtype or group.master.dtype
        if full is None or unit.grad is not None or unit.depth:
            return None
        if full.dtype != dtype or full.numel() != group.padded or full.storage_offset():
            return None
        st = full.untyped_storage()
        if st.nbytes() != full.numel() * full.element_size():
            return None
        others = {group.master.untyped_storage().data_ptr()}
        others |= {t.untyped_storage().data_ptr() for t, _ in unit.cache.values()}
        return None if st.data_ptr() in others else full

    def _collect(self, unit: Unit, spare: torch.Tensor | None = None) -> None:
        """Lay the gradients that arrived into the unit's flat gradient: into ``spare`` (the
        freed parameter buffer), or added into the gradient accumulated so far, or into a new
        buffer."""
        group = unit.groups["trainable"]
        if unit.grad is None and spare is not None:
            arrived = {id(slot) for slot, _ in unit.arrived}
            spare[group.numel :].zero_()
            for slot in group.slots:
                if id(slot) not in arrived:
                    spare[slot.offset : slot.offset + slot.numel].zero_()
            unit.grad = spare
            write = "copy_"
        else:
            if unit.grad is None:
                dtype = self.reduce_dtype or group.master.dtype
                unit.grad = torch.zeros(group.padded, dtype=dtype, device=self.grid.device)
            write = "add_"
        while unit.arrived:
            slot, grad = unit.arrived.pop()
            part = unit.grad[slot.offset : slot.offset + slot.numel].view(slot.shape)
            getattr(part, write)(grad)
            del grad

    def _reduce(self, unit: Unit) -> None:
        """Launch the reduce-scatter of the unit's flat gradient (after its z-reduction)."""
        self._poll_reductions()
        group = unit.groups["trainable"]
        g, unit.grad = unit.grad, None
        if group.z_start < group.numel and self.grid.size("z") > 1:
            comm.all_reduce(g[group.z_start : group.numel], self.grid, "z")
        if self.scale != 1:
            g.div_(self.scale)
        # Bound the reduce-scatters in flight: each holds a whole unit's gradient.
        while len(self._pending_rs) >= MAX_INFLIGHT_REDUCTIONS:
            done, h = self._pending_rs.pop(0)
            done.set_grad(h.wait(), owned=True)
        if self.quantized_grads is not None:  # blocking: two all-to-alls and their sums
            nodes, index = self.quantized_grads
            self._pending_rs.append((group, _Ready(reduce_scatter_quantized(g, nodes, index))))
            return
        handle = comm.reduce_scatter(g, group.grid, "data", async_op=True, order=self.reduce_order)
        self._pending_rs.append((group, handle))

    def _end_of_backward(self) -> None:
        try:
            for unit in self.units:
                # A unit some of whose parameters got no gradient (unused in this forward):
                # the missing ones count as zero. Every rank runs the same graph, so every
                # rank launches these in the same order.
                if unit.arrived:
                    self._collect(unit)
                if self.sync and unit.grad is not None:
                    self._reduce(unit)
            for group, handle in self._pending_rs:
                group.set_grad(handle.wait(), owned=True)
        finally:
            self._pending_rs.clear()
            if self.tier is not None:
                self.tier.forget_reads()  # the step is about to change every chunk
            for unit in self.units:
                for kind in list(unit.pending):
                    unit.pending.pop(kind).wait()
                if unit.depth == 0:
                    self._drop(unit)
                    self._uncache(unit, "trainable")
                unit.seen_in_backward = False
            self._in_backward = False

    # ------------------------------------------------------------------------- helpers
    def gather_all(self) -> None:
        """Gather and install every unit (for :meth:`ShardedModel.gathered`)."""
        for unit in self.units:
            unit.depth += 1
            if unit.depth == 1:
                for kind in unit.groups:
                    self._materialize(unit, kind, backward=False)
                self._install(unit)

    def release_all(self) -> None:
        """Undo :meth:`gather_all`."""
        for unit in self.units:
            unit.depth = max(0, unit.depth - 1)
            if unit.depth == 0:
                self._uninstall(unit)
                self._drop(unit)


def _distinct(units) -> list[Unit]:
    """``units`` without repeats, in order."""
    out: list[Unit] = []
    for u in units:
        if u not in out:
            out.append(u)
    return out


def cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating tensor inside tuples, lists and dicts cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(cast_floats(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [cast_floats(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj
