"""``shard(model, grid, stage=...)``: sharded data parallelism applied to a plain model.

Like PyTorch's FSDP2 ``fully_shard``, :func:`shard` works in place on a model the caller
built (the same values on every rank), unit by unit: the caller names the units (each
transformer block, say) or a policy picks them; the model itself is always the outermost
unit and owns every parameter no other unit holds. It returns a :class:`ShardedModel`, a
handle that gives the optimizer its parameters and offers ``no_sync``, gradient clipping,
full state dicts and memory figures. The model stays callable as before.

Typical use::

    dp = shard(model, grid, stage=3, units=by_type(Block), mixed_precision=MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    opt = dp.attach(torch.optim.AdamW(dp.parameters(), lr=3e-4))
    for x, y in batches:             # x, y: this rank's part of the batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()              # gradients are reduced while backward runs
        opt.step()                   # steps this rank's shard; stages 1-2 then all-gather
        opt.zero_grad()

Stages (docs/sharding.md): 0 bucketed all-reduce; 1 optimizer state sharded; 2 + gradients; 3 +
parameters; ``fcdp=FCDP()`` on stage 3 caches what forward gathered. Tensor-parallel models
(:func:`gnnpar.tensor.parallelize`) compose: their parameter pieces are sharded further along
the data axis, and gradients that the tensor layers replicate over z are also summed over z.

The optimizer must update each element from that element's own gradient and state (SGD,
Adam, AdamW, RMSprop, Adagrad, ... — every ``torch.optim`` optimizer except L-BFGS and
others that need whole tensors), because from stage 1 on each rank steps only its chunk.
Which parameters are trainable is fixed when :func:`shard` is called.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from gnnpar import comm
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid, fold_context, fold_replicas
from gnnpar.shard.buckets import GradBuckets, build_buckets
from gnnpar.shard.clip import clip_factor, digits_value, exact_square_sum, scale_grads_
from gnnpar.shard.config import FCDP, OFFLOAD_MODES, STAGES, MixedPrecision
from gnnpar.shard.flat import FlatGroup, Slot
from gnnpar.shard.groups import NodeGroups, node_groups, split_by_node
from gnnpar.shard.offload import HostTier, make_tier
from gnnpar.shard.powersgd import PowerSGD
from gnnpar.shard.zero3 import Stage3, Unit, cast_floats

#: The prefix of PowerSGD's state among a rank's own tensors (:meth:`ShardedModel.rank_state`).
POWERSGD = "powersgd."

__all__ = ["ShardedModel", "UnitSpec", "by_numel", "by_type", "shard"]

UnitSpec = Sequence["nn.Module | str"] | Callable[[str, nn.Module], bool] | str | nn.Module | None
DEFAULT_BUCKET_BYTES = 25 << 20


def by_type(*types: type) -> Callable[[str, nn.Module], bool]:
    """A unit policy: every module that is an instance of one of ``types``."""
    if not types or not all(isinstance(t, type) for t in types):
        raise ValueError(f"by_type needs module classes, got {types!r}")
    return lambda name, module: isinstance(module, types)


def by_numel(min_params: int) -> Callable[[str, nn.Module], bool]:
    """A unit policy: every module holding at least ``min_params`` parameters of its own
    subtree (outer modules first take what they hold, as FSDP's size-based policy)."""
    if not isinstance(min_params, int) or min_params < 1:
        raise UserError(f"min_params must be a positive integer, got {min_params!r}")
    return lambda name, module: sum(p.numel() for p in module.parameters()) >= min_params


def _select_units(model: nn.Module, units: UnitSpec) -> list[tuple[str, nn.Module]]:
    names = {id(m): n for n, m in model.named_modules()}
    out: list[tuple[str, nn.Module]] = [("", model)]
    if isinstance(units, (str, nn.Module)):
        units = [units]
    chosen: list[tuple[str, nn.Module]] = []
    if units is None:
        pass
    elif callable(units) and not isinstance(units, (list, tuple)):
        chosen = [(n, m) for n, m in model.named_modules() if n and units(n, m)]
    else:
        for spec in units:
            if isinstance(spec, str):
                hits = [(n, m) for n, m in model.named_modules() if n and _name_matches(n, spec)]
                if not hits:
                    raise UserError(f"unit pattern {spec!r} matches no submodule of the model")
                chosen.extend(hits)
            elif isinstance(spec, nn.Module):
                if id(spec) not in names:
                    raise UserError(f"unit {type(spec).__name__} is not a submodule of the model")
                if spec is not model:
                    chosen.append((names[id(spec)], spec))
            else:
                raise ValueError(f"units must be modules, name patterns or a policy, got {spec!r}")
    # the experts of a mixture of experts are units of their own: they shard and reduce over
    # other ranks (those with the same experts) than the rest of the model
    chosen += [(n, m) for n, m in model.named_modules() if n and _holds_experts(m)]
    seen = {id(model)}
    for n, m in chosen:
        if id(m) not in seen:
            seen.add(id(m))
            out.append((n, m))
    return out


def _holds_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds this rank's experts of a mixture of experts (it declares
    ``expert_parallel``, as :class:`gnnpar.tensor.experts.LocalExperts` does)."""
    return bool(getattr(type(module), "expert_parallel", False))


def _expert_unit_names(model: nn.Module, unit_names: list[str]) -> set[str]:
    """The units whose module holds experts or lies inside a module that does."""
    holders = [n for n, m in model.named_modules() if n and _holds_experts(m)]
    return {u for u in unit_names if u and any(u == h or u.startswith(h + ".") for h in holders)}


def _name_matches(name: str, pattern: str) -> bool:
    """fnmatch per dotted component: ``"blocks.*"`` matches ``blocks.0`` but not
    ``blocks.0.attn``."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(
        fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats, strict=True)
    )


def _unit_of(module_name: str, unit_names: list[str]) -> str:
    best = ""
    for u in unit_names:
        if u and (module_name == u or module_name.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def _common_unit(names: list[str], unit_names: list[str]) -> str:
    """The innermost unit that contains every one of ``names`` (module names)."""
    owners = {_unit_of(n, unit_names) for n in names}
    if len(owners) == 1:
        return owners.pop()
    best = ""
    for u in unit_names:
        if u and all(o == u or o.startswith(u + ".") for o in owners) and len(u) > len(best):
            best = u
    return best


def _collect_slots(
    model: nn.Module, grid: ProcessGrid, z_reduce: bool = True
) -> tuple[list[Slot], dict[int, list]]:
    """Every parameter once (in registration order), and the module names holding each
    (``z_reduce``: whether gradients the tensor layers leave partial are summed over z)."""
    layouts: dict[int, tuple[Any, nn.Module, str]] = {}
    from gnnpar.tensor.state import sharded_parameters

    for module, pname, layout in sharded_parameters(model).values():
        layouts[id(getattr(module, pname))] = (layout, module, pname)
    slots: dict[int, Slot] = {}
    holders: dict[int, list[str]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module._parameters.items():
            if p is None:
                continue
            key = f"{mname}.{pname}" if mname else pname
            slot = slots.get(id(p))
            if slot is None:
                lay = layouts.get(id(p))
                layout, owner, attr = lay if lay is not None else (None, None, "")
                partial = layout is None or layout.kind != "matrix"
                slot = Slot(
                    key,
                    [],
                    p.shape,
                    p.dtype,
                    p.requires_grad,
                    z_reduce=z_reduce and grid.size("z") > 1 and partial,
                    param=p,
                    layout=layout,
                    owner=owner,
                    owner_attr=attr,
                )
                slots[id(p)] = slot
                holders[id(p)] = []
            if (module, pname) not in [(m, a) for m, a in slot.refs]:
                slot.refs.append((module, pname))
            if key not in slot.aliases:
                slot.aliases.append(key)
            holders[id(p)].append(mname)
    return list(slots.values()), holders


def _uniform_dtype(slots: list[Slot], what: str) -> torch.dtype:
    dtypes = {s.dtype for s in slots}
    if len(dtypes) > 1:
        names = {str(d): next(s.name for s in slots if s.dtype == d) for d in dtypes}
        raise UserError(
            f"{what} mixes parameter dtypes {names}; give a MixedPrecision policy or convert "
            "the model to one dtype"
        )
    return dtypes.pop()


def _storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


class ShardedModel:
    """The handle :func:`shard` returns (see the module docstring). Calling it calls the
    model."""

    def __init__(
        self,
        module: nn.Module,
        grid: ProcessGrid,
        stage: int,
        slots: list[Slot],
        unit_names: list[str],
        keys: list[str],
        mp: MixedPrecision | None,
        fcdp: FCDP | None,
        nodes: NodeGroups | None,
        offload: HostTier | None = None,
    ):
        self.module = module
        #: The view over which every parameter but the experts is sharded and reduced
        #: (:func:`gnnpar.grid.fold_replicas`); the experts' view is ``expert_grid``.
        self.grid = fold_replicas(grid)
        self.expert_grid = fold_context(grid)
        self.stage = stage
        self.slots = slots
        self.unit_names = unit_names
        self.mixed_precision = mp
        self.fcdp = fcdp
        self.nodes = nodes
        self._keys = keys
        self.buckets: GradBuckets | None = None
        self.stage3: Stage3 | None = None
        self.offload = offload
        self._hooks: list = []
        self._attached = 0
        self._optimizers: list[torch.optim.Optimizer] = []
        self._stepping = False  # inside an offload tier's chunked step
        self._loss_divided = False
        #: The order of the data axis's gradient sums and of the norm (``shard``'s argument).
        self.reduce_order = "ring"
        #: Checkpoints hold the trainable parameters alone (PEFT: the frozen base comes from
        #: where it was loaded, not from every checkpoint).
        self.checkpoint_trainable_only = False
        # checkpoint_layout's index arithmetic, which depends on the sharding alone: a
        # snapshot every step asks for the layout every step
        self._stored_memo: dict[Any, Any] = {}

    # ---------------------------------------------------------------------- basics
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __repr__(self) -> str:
        return (
            f"ShardedModel(stage={self.stage}, units={len(self.unit_names)}, "
            f"params={self.numel:,}, data={self.grid.size('data')}"
            + (", fcdp" if self.fcdp else "")
            + (f", offload={self.offload.kind}" if self.offload else "")
            + ")"
        )

    @property
    def numel(self) -> int:
        """Parameters of the model this rank sees before data sharding (ties once)."""
        return sum(s.numel for s in self.slots)

    @property
    def padded_numel(self) -> int:
        """Ψ as the collectives move it: every flat group padded to a multiple of the data
        size (stages 1–3), trainable and frozen together; for stage 0 the trainable ones."""
        return sum(g.padded if self.stage else g.numel for g in self._groups())

    def _groups(self, kinds: tuple[str, ...] = ("trainable", "frozen")) -> list[FlatGroup]:
        if self.stage3 is not None:
            return [u.groups[k] for u in self.stage3.units for k in kinds if k in u.groups]
        if self.buckets is not None and "trainable" in kinds:
            return [b.group for b in self.buckets.buckets]
        return []

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` for every trainable parameter the optimizer should step on
        this rank: this rank's pieces (1-D views of its master chunk) from stage 1 on or with
        mixed precision; the model's own parameters at stage 0 without it. Names are the
        model's state-dict keys, so param groups can be built by name."""
        groups = self._groups(("trainable",))
        if self.stage == 0 and (not groups or not groups[0].master.numel()):
            for s in self.slots:
                if s.trainable:
                    yield s.name, s.param
            return
        for g in groups:
            for piece in g.pieces:
                yield piece.slot.name, piece.param

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of :meth:`named_parameters`."""
        for _, p in self.named_parameters():
            yield p

    def piece_index(self) -> dict[int, tuple[Slot, int, int]]:
        """``id(parameter)`` → (slot, start, stop) for every optimizer parameter: which
        elements of the flattened model parameter it holds."""
        out = {}
        groups = self._groups(("trainable",))
        if self.stage == 0 and (not groups or not groups[0].master.numel()):
            for s in self.slots:
                if s.trainable:
                    out[id(s.param)] = (s, 0, s.numel)
            return out
        for g in groups:
            for piece in g.pieces:
                out[id(piece.param)] = (piece.slot, piece.start, piece.stop)
        return out

    # ------------------------------------------------------------------ optimizer glue
    def attach(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Register a step post-hook on ``optimizer`` that brings the model's parameters up
        to date right after each step (stages 1–2: all-gather; stage 0 with mixed precision:
        copy). Without it this happens at the start of the next forward, on the ranks whose
        masters changed (see :meth:`sync_params`). Returns ``optimizer``."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"attach needs a torch.optim.Optimizer, got {type(optimizer)}")
        own = {id(p) for p in self.parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in own:
                    raise ValueError(
                        "the optimizer holds a parameter that is not one of this "
                        "ShardedModel's parameters(); build it from dp.parameters()"
                    )
        self._hooks.append(
            optimizer.register_step_post_hook(
                lambda *a: None if self._stepping else self.sync_params(force=True)
            )
        )
        if self.offload is not None and self.offload.chunked_step:
            self._chunk_steps(optimizer)
        self._attached += 1
        self._optimizers.append(optimizer)
        return optimizer

    def _chunk_steps(self, optimizer: torch.optim.Optimizer) -> None:
        """Route ``optimizer.step`` through the offload tier, one flat group at a time; the
        parameters are brought up to date once, after the last group."""
        inner = optimizer.step
        tier = self.offload

        def step(closure=None):
            self._stepping = True
            try:
                loss = tier.step(optimizer, inner, self._groups(("trainable",)), closure)
            finally:
                self._stepping = False
            self.sync_params(force=True)
            return loss

        optimizer.step = step

    def sync_params(self, force: bool = False) -> None:
        """Bring the model's parameters up to date with the masters (collective at stages
        1–2; nothing to do at stage 3, which gathers on use). Without ``force`` only when
        this rank's masters changed since the last gather — every rank must then agree, which
        holds when each rank owns elements of every bucket; an attached optimizer gathers
        unconditionally after each step instead, on every rank alike."""
        if self.buckets is not None and (force or self.buckets.stale()):
            self.buckets.gather_params()

    def _sync_before_forward(self) -> None:
        if not self._attached:  # no optimizer hook: catch a step that happened since
            self.sync_params()

    @property
    def loss_divided_by_data(self) -> bool:
        """Whether the caller's loss is already divided by the data size, so the gradient
        reduction only sums over data (default False: it divides, averaging). Dividing the
        loss is free (its backward's first scalar op carries it); dividing the gradients
        is a pass over all of them. Set before the first backward of a step."""
        return self._loss_divided

    @loss_divided_by_data.setter
    def loss_divided_by_data(self, value: bool) -> None:
        rt = self.buckets or self.stage3
        if rt is not None:
            rt.scale = rt.divisor // self.grid.size("data") if value else rt.divisor
        self._loss_divided = bool(value)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside the block; the first
        backward outside reduces the sum. At stages 2–3 the local sum is a full-size
        gradient, as in FSDP."""
        rt = self.buckets or self.stage3
        old = rt.sync
        rt.sync = False
        try:
            yield
        finally:
            rt.sync = old

    @contextlib.contextmanager
    def gathered(self) -> Iterator[nn.Module]:
        """At stage 3, gather every unit and put the parameter attributes back for the
        duration of the block (read-only use: inspection, generation); yields the model."""
        if self.stage3 is None:
            yield self.module
            return
        with torch.no_grad():
            self.stage3.gather_all()
        try:
            yield self.module
        finally:
            self.stage3.release_all()

    # ---------------------------------------------------------------------- gradients
    def view_of(self, slot: Slot) -> ProcessGrid:
        """The grid view whose data axis ``slot`` is sharded and reduced over."""
        return self.expert_grid if slot.expert else self.grid

    def _replication(self, slot: Slot) -> int:
        """How many ranks of a data and tensor group hold each element of ``slot``'s pieces
        as this rank does (each element counts once in a norm)."""
        repl = self.grid.size("tensor")
        if slot.layout is not None:
            for a in set(slot.layout.split_axes):
                repl //= self.grid.size(a)
        if self.stage == 0 and self.has_experts:  # whole on every rank of its data axis
            repl *= self.view_of(slot).size("data")
        return repl

    @property
    def has_experts(self) -> bool:
        """Whether some parameters are a mixture of experts' experts (see :func:`shard`)."""
        return any(s.expert for s in self.slots)

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Norm of the full model's gradient (each element counted once), the same on every
        rank. Call after backward. With ``reduce_order="tree"`` the 2-norm is summed exactly
        (:func:`~gnnpar.shard.clip.exact_square_sum`), so it does not depend on how the data
        axis shards the gradient either."""
        if self.reduce_order == "tree" and norm_type == 2.0:
            return self._exact_grad_norm()
        total = torch.zeros((), dtype=torch.float64, device=self.grid.device)
        index = self.piece_index()
        inf = norm_type == float("inf")
        # one foreach norm per (replication, device, dtype): a per-tensor loop cost five
        # small ops for each of a GPT's 124 gradients
        groups: dict[tuple, list[torch.Tensor]] = {}
        for p in self.parameters():
            if p.grad is None or not p.grad.numel():
                continue
            g = p.grad.detach()
            key = (self._replication(index[id(p)][0]), g.device, g.dtype)
            groups.setdefault(key, []).append(g)
        for (repl, _, _), grads in groups.items():
            # each piece's norm in its own dtype (as torch's clip_grad_norm_; a float64 copy
            # of every gradient cost a quarter of a 70M-parameter step), summed in float64
            pieces = torch.stack(torch._foreach_norm(grads, norm_type))
            pieces = pieces.to(total.device, torch.float64)  # host-offloaded gradients
            if inf:
                total = torch.maximum(total, pieces.max())
            else:
                total = total + pieces.pow(norm_type).sum() / repl
        op = "max" if inf else "sum"
        # the pieces differ over data from stage 1 on, and experts over expert at every stage
        if self.stage > 0 or self.has_experts:
            comm.all_reduce(total, self.grid, "data", op=op)
        comm.all_reduce(total, self.grid, "tensor", op=op)
        return total if inf else total.pow(1.0 / norm_type)

    def _exact_grad_norm(self) -> torch.Tensor:
        """The 2-norm from integer digit sums: the largest element (a max: exact in any
        order) sets the fixed point, every rank sums its squares' digits, the integers are
        added over data and tensor ranks, and a replicated piece's count is divided out."""
        index = self.piece_index()
        grads = [(p.grad, self._replication(index[id(p)][0])) for p in self.parameters()]
        grads = [(g, r) for g, r in grads if g is not None and g.numel()]
        top = torch.zeros((), dtype=torch.float64, device=self.grid.device)
        for g, _ in grads:
            top = torch.maximum(top, g.detach().abs().max().to(top.device, torch.float64))
        for axis in ("data", "tensor"):
            comm.all_reduce(top, self.grid, axis, op="max")
        if float(top) == 0.0:
            return top
        # the power of two above the largest square (frexp: top = m·2**e with m in [0.5, 1))
        exponent = 2 * int(torch.frexp(top).exponent)
        repls = sorted({r for _, r in grads})
        sums = [exact_square_sum([g for g, r in grads if r == repl], exponent) for repl in repls]
        totals = torch.stack(sums).to(self.grid.device)  # one row per replication count
        # stage 0's pieces are whole on every data rank: summed over tensor ranks only
        for axis in ("data", "tensor") if self.stage > 0 else ("tensor",):
            comm.all_reduce(totals, self.grid, axis)
        # every replica sums the same integers: each row divides exactly
        digits = (totals.cpu() // torch.tensor(repls)[:, None]).sum(0)
        return digits_value(digits, exponent).to(self.grid.device).sqrt()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so the full model's gradient norm is at most ``max_norm``;
        return the norm before clipping."""
        norm = self.grad_norm(norm_type)
        scale_grads_(self.parameters(), clip_factor(norm, max_norm))
        return norm

    # --------------------------------------------------------------------- state dicts
    def _local_full(self) -> dict[str, torch.Tensor]:
        """Every slot's tensor as this rank's tensor-parallel piece (gathered over data)."""
        out: dict[str, torch.Tensor] = {}
        groups = self._groups()
        covered = set()
        for g in groups:
            if g.master.numel() == 0:
                continue
            full = comm.all_gather(g.send(), g.grid, "data") if g.world > 1 else g.master
            for s, v in zip(g.slots, g.views(full.detach()), strict=False):
                out[s.name] = v.clone()
                covered.add(s.name)
        for s in self.slots:
            if s.name not in covered:
                out[s.name] = s.param.detach().clone()
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's state dict with every parameter whole (master values, gathered
        over data and, for tensor-parallel layers, over the tensor axes). Collective."""
        if self.has_experts and self.expert_grid.size("expert") > 1:
            raise UserError(
                "full_state_dict: the experts of this model live on different expert ranks; "
                "save a checkpoint and consolidate it instead (gnnpar ckpt consolidate)"
            )
        local = self._local_full()
        values: dict[str, torch.Tensor] = {}
        for s in self.slots:
            t = local[s.name]
            if s.layout is not None:
                from gnnpar.tensor.state import gather_full

                t = s.owner.to_full_format(s.owner_attr, gather_full(t, s.layout, self.grid))
            for key in s.aliases:
                values[key] = t
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        state = self.module.state_dict()
        out = {}
        for key in self._keys:
            if key in values:
                out[key] = values[key]
            elif key in state:
                out[key] = state[key].detach().clone()
            elif key in buffers:
                out[key] = buffers[key].detach().clone()
        return out

    def local_pieces(self) -> list[tuple[Slot, int, int, torch.Tensor, bool]]:
        """Every parameter element this rank stores: ``(slot, start, stop, values 1-D,
        replicated)``; ``replicated`` pieces are held whole by every data rank."""
        out = []
        covered = set()
        for g in self._groups():
            if g.master.numel() == 0:
                continue
            for s in g.slots:
                covered.add(s.name)
            rep = g.world == 1 and g.grid.size("data") > 1
            for piece in g.pieces:
                out.append((piece.slot, piece.start, piece.stop, piece.param.detach(), rep))
        for s in self.slots:
            if s.name not in covered:
                whole = self.view_of(s).size("data") > 1
                out.append((s, 0, s.numel, s.param.detach().reshape(-1), whole))
        return out

    def rank_state(self) -> dict[str, torch.Tensor]:
        """What this rank alone holds beyond the model and optimizer state, as named tensors
        that a checkpoint or snapshot keeps for a resume on the same grid: PowerSGD's
        compression state (``powersgd.*``), if it compresses."""
        compress = self._compression
        if compress is None:
            return {}
        own = compress.state_tensors(self._hook_shapes())
        return {POWERSGD + k: v for k, v in own.items()}

    def load_rank_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Continue from :meth:`rank_state` (of this rank, on this grid); state the run does
        not keep, or that the checkpoint did not keep, is left as it is, and PowerSGD's made
        for other buckets or another rank starts again (with a warning)."""
        compress = self._compression
        own = {k[len(POWERSGD) :]: v for k, v in tensors.items() if k.startswith(POWERSGD)}
        if compress is None or not own:
            return
        if not compress.load_state_tensors(own, self._hook_shapes()):
            warnings.warn(
                "the checkpoint's PowerSGD state was made for other gradient buckets or "
                "another powersgd_rank: the compression starts again",
                stacklevel=2,
            )

    @property
    def _compression(self) -> PowerSGD | None:
        """Stage 0's PowerSGD compression of the gradient buckets, or None."""
        return self.buckets.powersgd if self.buckets is not None else None

    def _hook_shapes(self) -> list[list[tuple[int, ...]]]:
        """Each gradient bucket's parameter shapes, as PowerSGD's hook sees them."""
        compress = self._compression
        return [[compress.shape_of(s) for s in b.group.slots] for b in self.buckets.buckets]

    def checkpoint_layout(self):
        """This rank's :class:`~gnnpar.checkpoint.state.ModelLayout`: the elements of every
        parameter it stores (its ZeRO pieces, of its tensor-parallel piece) and the buffers.
        Loading writes straight into the masters; :meth:`_refresh_params` then brings the
        model's parameters up to date (collective at stages 1–2)."""
        from gnnpar.checkpoint.state import (
            MODEL,
            ModelLayout,
            Piece,
            TensorSpec,
            replicated_piece,
            writes,
        )
        from gnnpar.tensor.experts import plain_keys

        if getattr(self.module, "tensor_grads_complete", False):
            # stage 0 without masters: the model's own parameters, described by the model
            return self.module.checkpoint_layout()
        saved, slot_tensors, slot_chunks = self._stored_slots()
        tensors = dict(slot_tensors)
        pieces = []
        params = {}
        by_values = {}
        for slot, start, stop, values, replicated in self.local_pieces():
            if slot.name not in slot_chunks:
                continue  # a frozen parameter of a trainable-only checkpoint
            mine, write = self._stored_piece(slot, start, stop, replicated, slot_chunks)
            name = f"{slot.name}[{start}:{stop}]"
            pieces.append(Piece(name, values, mine, write))
            by_values[(slot.name, start)] = (mine, write)
        for p, (slot, start, _) in self.piece_index().items():
            params[p] = by_values.get((slot.name, start), ([], False))
        persistent = set(self._keys)  # non-persistent buffers are rebuilt, not saved
        buffers = []
        for key, b in self.module.named_buffers():
            if key not in persistent:
                continue
            buffers.append(key)
            tensors[MODEL + key] = TensorSpec.of(b.shape, b.dtype)
            pieces.append(replicated_piece(key, key, b.detach(), writes(self.grid, ())))
        aliases = {a: s.name for s in saved for a in s.aliases if a != s.name}
        kept = {*buffers, *aliases, *(s.name for s in saved)}
        keys = plain_keys(self.module, [k for k in self._keys if k in kept])
        return ModelLayout(
            pieces, tensors, keys, aliases, params, self._refresh, self._release_offloaded
        )

    def _stored_slots(self) -> tuple[list[Slot], dict[str, Any], dict[str, Any]]:
        """The slots a checkpoint saves, their full tensors' specs and, by slot name, the
        chunks of the full tensor its (tensor-parallel) piece holds and the axes it is split
        over; worked out once per set of saved slots."""
        from gnnpar.checkpoint.chunks import concat
        from gnnpar.checkpoint.state import MODEL, TensorSpec

        saved = [s for s in self.slots if s.trainable or not self.checkpoint_trainable_only]
        key = ("slots", tuple(s.name for s in saved))
        if key in self._stored_memo:
            return self._stored_memo[key]
        tensors, slot_chunks = {}, {}
        for s in saved:
            if s.layout is not None:
                transposed = s.owner_attr == "weight" and (
                    getattr(s.owner, "weight_format", "") == "in_out"
                )
                shape = tuple(reversed(s.layout.shape)) if transposed else s.layout.shape
                r, c, d = s.layout.coords(self.grid)
                chunks = s.layout.chunks(MODEL + s.name, r, c, d, transposed)
                split = s.layout.split_axes
            else:
                shape, split = tuple(s.shape), ()
                chunks = concat([(MODEL + s.name, (0,) * len(shape), shape)])
            if s.expert:  # only this expert coordinate holds it
                split = (*split, "expert")
            tensors[MODEL + s.name] = TensorSpec.of(shape, s.dtype)
            slot_chunks[s.name] = (chunks, split)
        self._stored_memo[key] = (saved, tensors, slot_chunks)
        return saved, tensors, slot_chunks

    def _stored_piece(
        self, slot: Slot, start: int, stop: int, replicated: bool, slot_chunks: dict[str, Any]
    ) -> tuple[list[Any], bool]:
        """The chunks of elements ``start``..``stop`` of ``slot``'s piece and whether this
        rank writes them; worked out once per piece."""
        from gnnpar.checkpoint.chunks import restrict
        from gnnpar.checkpoint.state import writes

        key = ("piece", slot.name, start, stop, replicated)
        if key not in self._stored_memo:
            chunks, split = slot_chunks[slot.name]
            write = writes(self.view_of(slot), (*split, *(() if replicated else ("data",))))
            self._stored_memo[key] = (restrict(chunks, start, stop), write)
        return self._stored_memo[key]

    def _release_offloaded(self) -> None:
        """Give back the resident pages of the file tier's mappings (after a checkpoint read
        or wrote through them)."""
        if self.offload is not None:
            self.offload.release_all()

    def _refresh(self) -> None:
        """Bring the model's parameters up to date with the masters after they were written
        (a checkpoint load): all-gather at stages 1–2, drop stage 3's caches."""
        if self.offload is not None:  # loaded optimizer state goes where the tier keeps it
            for opt in self._optimizers:
                self.offload.adopt(opt, self._groups(("trainable",)))
        if self.stage3 is not None:
            for unit in self.stage3.units:
                self.stage3._uncache(unit, "frozen")
                self.stage3._uncache(unit, "trainable")
        elif self.buckets is not None:
            self.buckets.gather_params()
        self._release_offloaded()

    @torch.no_grad()
    def load_local(self, values: dict[str, torch.Tensor]) -> None:
        """Set every parameter from ``values`` (slot name → this rank's tensor-parallel
        piece, whole over data): masters, pieces and model parameters. No communication."""
        for s in self.slots:
            if s.name not in values:
                raise UserError(f"no value for parameter {s.name!r}")
            v = values[s.name]
            if tuple(v.shape) != tuple(s.shape) and v.numel() != s.numel:
                raise UserError(
                    f"{s.name}: got shape {tuple(v.shape)}, this rank holds {tuple(s.shape)}"
                )
        for g in self._groups():
            for piece in g.pieces:
                flat = values[piece.slot.name].reshape(-1)
                piece.param.copy_(flat[piece.start : piece.stop])
        if self.stage3 is None:
            for s in self.slots:
                s.param.copy_(values[s.name].reshape(s.shape))
            if self.buckets is not None:
                self.buckets._gathered_versions = [b.group.version for b in self.buckets.buckets]
        else:
            self._refresh()

    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor], strict: bool = True
    ) -> None:
        """Load a plain model's state dict: each rank keeps its pieces. No communication.
        With ``strict``, missing or unexpected keys raise ValueError before anything is
        written."""
        if strict:
            missing = sorted(set(self._keys) - set(state_dict))
            unexpected = sorted(set(state_dict) - set(self._keys))
            if missing or unexpected:
                raise UserError(
                    f"state dict does not match the model: missing keys {missing}, "
                    f"unexpected keys {unexpected}"
                )
        local = {}
        for s in self.slots:
            key = next((k for k in s.aliases if k in state_dict), None)
            if key is None:
                raise UserError(f"state dict has no entry for parameter {s.name!r}")
            src = state_dict[key]
            if s.layout is not None:
                src = s.owner.from_full_format(s.owner_attr, src)
                if tuple(src.shape) != tuple(s.layout.shape):
                    raise UserError(
                        f"{key}: full tensor has shape {tuple(src.shape)}, the layer expects "
                        f"{tuple(s.layout.shape)}"
                    )
                r, c, d = s.layout.coords(self.grid)
                src = s.layout.shard(src, r, c, d)
            if tuple(src.shape) != tuple(s.shape):
                raise UserError(
                    f"{key}: got shape {tuple(src.shape)}, the model holds {tuple(s.shape)}"
                )
            local[s.name] = src
        self.load_local(local)
        buffers = dict(self.module.named_buffers())
        with torch.no_grad():
            for key, b in buffers.items():
                if key in state_dict:
                    b.copy_(state_dict[key])

    # ------------------------------------------------------------------------ memory
    def memory(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients, optimizer state and the FCDP
        cache (tensor storage measured, shared storage once)."""
        groups = self._groups()
        params: list[torch.Tensor | None] = [g.master for g in groups]
        grads: list[torch.Tensor | None] = [p.grad for p in self.parameters()]
        if self.stage3 is None:
            params += [s.param for s in self.slots]
            grads += [s.param.grad for s in self.slots]
            if self.buckets is not None:
                grads += [b.buffer for b in self.buckets.buckets]
        else:
            grads += [u.grad for u in self.stage3.units]
        state: list[torch.Tensor | None] = []
        if optimizer is not None:
            for st in optimizer.state.values():
                state += [v for v in st.values() if isinstance(v, torch.Tensor)]
        out = {
            "params": _storage_bytes(params),
            "grads": _storage_bytes(grads),
            "optimizer": _storage_bytes(state),
        }
        if self.stage3 is not None:
            out["cache_device"] = self.stage3.cache_bytes["device"]
            out["cache_host"] = self.stage3.cache_bytes["host"]
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        # of which in memory-mapped files (the file offload tier): not anonymous memory
        out["file"] = self.offload.file_bytes() if self.offload is not None else 0
        return out

    def remove(self) -> None:
        """Detach every hook this handle installed (the model keeps its current form) and
        close the offload tier (its folder is removed; what is mapped stays readable)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.buckets is not None:
            self.buckets.remove_hooks()
        if self.stage3 is not None:
            self.stage3.remove_hooks()
        if self.offload is not None:
            for opt in self._optimizers:
                opt.__dict__.pop("step", None)  # the optimizer's own step again
            if self.offload.kind == "file":
                self.offload.close()


def shard(
    model: nn.Module,
    grid: ProcessGrid,
    stage: int = 3,
    *,
    units: UnitSpec = None,
    mixed_precision: MixedPrecision | None = None,
    fcdp: FCDP | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    prefetch: int = 1,
    offload: str = "none",
    offload_dir: str | os.PathLike | None = None,
    reduce_order: str = "ring",
    quantized_weights: bool = False,
    quantized_grads: bool = False,
    powersgd_rank: int = 0,
) -> ShardedModel:
    """Make ``model`` data-parallel over ``grid``'s data axis, in place.

    Args:
        model: a plain (or tensor-parallel) model with the same values on every rank.
        grid: the process grid; sharding is along its data axis (with expert and context
            folded in: see below).
        stage: 0 (bucketed all-reduce), 1 (+ optimizer state sharded), 2 (+ gradients),
            3 (+ parameters).
        units: which submodules are gathered and released together (stage 3) and where
            gradient buckets are cut (stages 0–2): a list of modules or module-name patterns
            (``"blocks.*"``; each ``*`` stays within one dotted component), or a policy
            ``(name, module) -> bool`` such as :func:`by_type`. The model is always the
            outermost unit.
        mixed_precision: a :class:`MixedPrecision` policy (default: none, every dtype stays).
        fcdp: an :class:`FCDP` configuration (stage 3 only).
        bucket_bytes: size of a gradient bucket at stages 0–2.
        prefetch: stage 3: how many units' gathers start ahead of the running one (0:
            none; ``True`` is 1); with the file tier, their chunks are read from the files
            that many units further ahead (:mod:`gnnpar.shard.offload`).
        offload: where the trainable master chunks, the optimizer's state and its step live
            (stages 1–3): ``"none"`` (the device), ``"host"`` (host memory, ZeRO-Offload) or
            ``"file"`` (memory-mapped files in ``offload_dir``; see
            :mod:`gnnpar.shard.offload`).
        offload_dir: the folder of the file tier (each rank uses ``rank<R>/`` in it).
        reduce_order: ``"ring"`` (the backend's collectives) or ``"tree"``: the data axis
            sums the gradients in a fixed pairwise tree over its ranks
            (:func:`gnnpar.comm.tree_sum`, the same bytes) and the gradient norm is summed
            exactly, so the reduced gradient, bit for bit, does not depend on the data size
            as long as data × micro-batches per rank stays the same power of two and each
            rank accumulates at most two micro-batches (a sum of two has no order). It needs
            z = 1 and no context or expert ranks: they split the batch too and sum before
            or with the data axis.
        quantized_weights: ZeRO++'s qwZ (stage 3): the parameter all-gathers move int8
            blocks of 256 with a float32 scale each (:mod:`gnnpar.shard.quantize`); forward
            and backward compute with the dequantized weights, the optimizer steps the
            full-precision masters.
        quantized_grads: ZeRO++'s qgZ (stage 3): the gradient reduce-scatter is the int4
            hierarchical all-to-all (inside each node, then across nodes: ``ranks_per_node``
            of the grid), in the gradient's dtype between the two.
        powersgd_rank: stage 0: each gradient bucket's all-reduce goes through torch's
            PowerSGD communication hook with matrices of this rank, error feedback and warm
            start, plain for the first two steps (:mod:`gnnpar.shard.powersgd`); 0 is off.

    **Context and experts.** Context ranks (:mod:`gnnpar.tensor.context`) and expert ranks
    (:mod:`gnnpar.tensor.experts`) hold the same parameters as data ranks and see other
    tokens, so every parameter is sharded and reduced over expert × context × data together
    (:func:`gnnpar.grid.fold_replicas`) — except a mixture of experts' experts (a module that
    declares ``expert_parallel``: each expert rank holds other experts), which form units of
    their own sharded and reduced over context × data (:func:`gnnpar.grid.fold_context`).
    Their gradients are divided by the same count as the others': the all-to-all that brought
    the tokens of every expert rank to them already summed those ranks' contributions.

    Every rank must call it (it creates process groups for FCDP). Returns the
    :class:`ShardedModel` handle.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"shard needs an nn.Module, got {type(model).__name__}")
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in STAGES:
        raise UserError(f"stage must be one of {STAGES}, got {stage!r}")
    if fcdp is not None and not isinstance(fcdp, FCDP):
        raise ValueError(f"fcdp must be an FCDP configuration, got {type(fcdp).__name__}")
    if fcdp is not None and stage != 3:
        raise UserError(f"FCDP builds on stage 3 (parameters sharded), not stage {stage}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise ValueError(
            f"mixed_precision must be a MixedPrecision policy, got {type(mixed_precision)}"
        )
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise UserError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
    if offload not in OFFLOAD_MODES:
        raise UserError(f"offload must be one of {OFFLOAD_MODES}, got {offload!r}")
    if offload != "none" and stage == 0:
        raise UserError(
            f"offload={offload!r} needs stage 1, 2 or 3 (sharded masters); stage 0 has none"
        )
    if (offload == "file") != (offload_dir is not None):
        raise UserError(
            "offload='file' needs offload_dir (the folder of its files)"
            if offload == "file"
            else f"offload_dir is only used with offload='file', not offload={offload!r}"
        )
    if not isinstance(prefetch, int) or prefetch < 0:  # True counts as 1
        raise UserError(f"prefetch must be a whole number of units >= 0, got {prefetch!r}")
    if getattr(model, "_gnnpar_sharded", False):
        raise ValueError("this model is already sharded; call shard() once per model")
    _check_reduce_order(reduce_order, grid)
    _check_quantized(stage, reduce_order, quantized_weights, quantized_grads)
    if powersgd_rank and (stage != 0 or reduce_order == "tree"):
        raise UserError(
            f"powersgd_rank compresses stage 0's all-reduce (every rank keeps the whole "
            f"approximate gradient), with reduce_order 'ring'; this is stage {stage}, "
            f"{reduce_order!r}"
        )
    # A model whose tensor-parallel layers deliver complete gradients (the full-graph 3D
    # layers reduce over x, y and z themselves) is only averaged over data, at stage 0: its
    # pieces are no ShardLayout that the other stages and full state dicts could cut.
    complete = bool(getattr(model, "tensor_grads_complete", False))
    if complete and (stage != 0 or mixed_precision is not None):
        raise UserError(
            f"{type(model).__name__} reduces its gradients over x, y and z itself: shard it "
            f"at stage 0 without a mixed-precision policy, not stage {stage}"
        )
    mp = mixed_precision
    unit_list = _select_units(model, units)
    unit_names = [n for n, _ in unit_list]
    keys = list(model.state_dict().keys())
    slots, holders = _collect_slots(model, grid, z_reduce=not complete)
    unit_of_slot = {id(s.param): _common_unit(holders[id(s.param)], unit_names) for s in slots}
    expert_units = _expert_unit_names(model, unit_names)
    for s in slots:
        s.expert = unit_of_slot[id(s.param)] in expert_units
    if fcdp is not None and expert_units:
        raise UserError("FCDP does not cache a mixture of experts' experts: use stage 3 alone")
    trainable = [s for s in slots if s.trainable]
    replicas = fold_replicas(grid)
    if quantized_grads and expert_units:
        raise UserError("quantized_grads does not reduce a mixture of experts' experts")
    nodes = node_groups(replicas) if fcdp is not None or quantized_grads else None
    tier = make_tier(offload, offload_dir, grid.device, grid.global_rank)
    alloc = tier.master if tier is not None else None

    dp = ShardedModel(model, grid, stage, slots, unit_names, keys, mp, fcdp, nodes, tier)
    dp.reduce_order = reduce_order
    if stage < 3:
        if mp is None and trainable:
            _uniform_dtype(trainable, "the model")
        reduce_dtype = mp.reduce() if mp else (trainable[0].dtype if trainable else torch.float32)
        master = None if (stage == 0 and mp is None) else (mp.master_dtype if mp else None)
        if stage > 0 and mp is None:
            master = reduce_dtype
        param_dtype = mp.param_dtype if mp is not None and mp.param_dtype else None
        index = {n: i for i, n in enumerate(unit_names)}
        unit_idx = {k: index[v] for k, v in unit_of_slot.items()}
        buckets = build_buckets(
            trainable,
            unit_idx,
            dp.view_of,
            stage,
            bucket_bytes,
            master,
            reduce_dtype,
            param_dtype or (trainable[0].dtype if trainable else reduce_dtype),
            alloc,
        )
        if param_dtype is not None:  # after the masters took the full-precision values
            with torch.no_grad():
                for s in slots:
                    s.param.data = s.param.data.to(param_dtype)
        scale = replicas.size("data") * (1 if complete else grid.size("z"))
        if powersgd_rank and expert_units:
            raise UserError("powersgd_rank does not compress a mixture of experts' experts")
        compress = PowerSGD(replicas, powersgd_rank) if powersgd_rank else None
        dp.buckets = GradBuckets(
            replicas, stage, buckets, scale, reduce_order, compress,
            tier.release if tier is not None else None,
        )  # fmt: skip

        def pre(module, args, kwargs):
            dp._sync_before_forward()
            if mp is not None and mp.cast_forward_inputs and mp.param_dtype is not None:
                return cast_floats((args, kwargs), mp.param_dtype)
            return None

        def post(module, args, output):
            if mp is not None and mp.output_dtype is not None:
                return cast_floats(output, mp.output_dtype)
            return None

        dp._hooks.append(model.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
        dp._hooks.append(model.register_forward_hook(post))
    else:
        rt = Stage3(
            replicas,
            [],
            mp,
            mp.compute() if mp else None,
            mp.reduce() if mp else None,
            fcdp,
            nodes,
            prefetch,
            reduce_order,
            quantized_weights,
            (nodes, _node_major(replicas)) if quantized_grads else None,
            tier,
        )
        for i, (name, module) in enumerate(unit_list):
            unit = Unit(i, name, module, rt)
            view = dp.expert_grid if name in expert_units else replicas
            p, r = view.size("data"), view.rank("data")
            mine = [s for s in slots if unit_of_slot[id(s.param)] == name]
            for kind, members in (
                ("trainable", [s for s in mine if s.trainable]),
                ("frozen", [s for s in mine if not s.trainable]),
            ):
                if not members:
                    continue
                if mp is None:
                    dtype = _uniform_dtype(members, f"unit {name or '<root>'}")
                else:
                    dtype = mp.master_dtype if kind == "trainable" else members[0].dtype
                    if kind == "frozen":
                        dtype = _uniform_dtype(members, f"frozen part of unit {name or '<root>'}")
                values = [s.param.detach() for s in members]
                train = kind == "trainable"
                unit.groups[kind] = FlatGroup(
                    members, p, r, dtype, grid.device, values, train, alloc if train else None
                )
                unit.groups[kind].grid = view
            rt.units.append(unit)
        # The model's parameters now live in the chunks: take them off the modules.
        for s in slots:
            for module, attr in s.refs:
                module._parameters.pop(attr, None)
        _split_prefetch_chains(model, unit_of_slot, slots)
        for s in slots:  # drop the last reference to the full parameters
            s.param = None
        rt.register()
        dp.stage3 = rt
    dp._release_offloaded()  # the initial values are in the files: their pages can go
    owned = [g for g in dp._groups(("trainable",)) if g.master.numel() or g.pieces]
    if owned and not any(g.pieces for g in owned):
        owned[0].add_empty_piece()  # this rank owns nothing; still give the optimizer a tensor
    model._gnnpar_sharded = True
    return dp


def _check_reduce_order(order: str, grid: ProcessGrid) -> None:
    """``reduce_order`` is one of :data:`gnnpar.comm.ORDERS`; a tree needs a grid where the
    data axis alone splits the batch."""
    if order not in comm.ORDERS:
        raise UserError(f"reduce_order must be one of {comm.ORDERS}, got {order!r}")
    if order != "tree":
        return
    others = {a: grid.size(a) for a in ("z", "context", "expert") if grid.size(a) > 1}
    if others:
        sizes = ", ".join(f"{a}={n}" for a, n in others.items())
        raise UserError(
            f"reduce_order='tree' needs a grid whose data axis alone splits the batch; this "
            f"one has {sizes} (they sum their gradients before or with the data axis)"
        )


def _check_quantized(stage: int, order: str, weights: bool, grads: bool) -> None:
    """qwZ and qgZ are stage 3's, and their blocks depend on the data size (no tree)."""
    for flag, name in ((weights, "quantized_weights"), (grads, "quantized_grads")):
        if not flag:
            continue
        if stage != 3:
            raise UserError(f"{name} quantizes stage 3's collectives; this is stage {stage}")
        if order == "tree":
            raise UserError(
                f"{name} does not combine with reduce_order='tree': its blocks, and so its "
                "rounding, depend on the data size"
            )


def _node_major(replicas: ProcessGrid) -> list[int]:
    """The data indices of this rank's data group, node by node (the layout of the node
    sub-groups, :func:`gnnpar.shard.groups.node_groups`)."""
    members = replicas.ranks("data")
    parts = split_by_node(members, replicas.ranks_per_node)
    return [members.index(r) for part in parts for r in part]


def _split_prefetch_chains(model: nn.Module, unit_of_slot: dict, slots: list[Slot]) -> None:
    """Keep a tensor-parallel layer's weight prefetch only toward layers of the same unit:
    a layer of another unit has no weight to prefetch until that unit is gathered."""
    from gnnpar.tensor.layers import PrefetchChain, ShardedModule

    unit_by_param = {id(s.param): unit_of_slot[id(s.param)] for s in slots}
    weight_of = {}
    for s in slots:
        for module, attr in s.refs:
            if isinstance(module, ShardedModule) and attr == "weight":
                weight_of[id(module)] = unit_by_param[id(s.param)]
    chains = {}
    for m in model.modules():
        if isinstance(m, ShardedModule) and m._chain is not None:
            chains[id(m._chain)] = m._chain
    for chain in chains.values():
        runs: list[list] = []
        for layer in chain.layers:
            u = weight_of.get(id(layer))
            if runs and weight_of.get(id(runs[-1][-1])) == u:
                runs[-1].append(layer)
            else:
                runs.append([layer])
        for run in runs:
            for layer in run:
                layer._chain, layer._pending = None, None
            if len(run) > 1:
                PrefetchChain(run)
