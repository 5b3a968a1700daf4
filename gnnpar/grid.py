"""The process grid: pipe × data × context × expert × x × y × z, rank order, and every
sub-group.

Rank order follows AxoNN: x varies fastest, then y, then z, then expert, then context, then
data, then pipe::

    rank = x + X * (y + Y * (z + Z * (expert + E * (context + C * (data + D * pipe)))))

so a grid without a pipe, context or expert axis (size 1) numbers its ranks as the 4D grid
always did, and each pipeline stage is a block of consecutive ranks (its tensor and data groups
stay inside it). The context axis (:mod:`gnnpar.tensor.context`: the sequence split over ranks)
sits just below data, so ``context + C·data`` is a data coordinate of size C·D in the same rank
order: :func:`fold_context` gives that view. The expert axis (:mod:`gnnpar.tensor.experts`: a
mixture-of-experts layer's experts split over ranks, tokens sent to them by all-to-all) sits just
below context and next to the tensor axes, so its all-to-all stays on few nodes; its ranks see
different tokens, as data ranks do, and hold the same parameters outside the experts:
:func:`fold_replicas` folds expert, context and data into one data coordinate, the view over
which sharded data parallelism reduces the gradients of every parameter but the experts' (those
reduce over :func:`fold_context`'s data axis).

Every sub-group along every axis (and the combined ``"tensor"`` axis, x·y·z) is created once,
on every rank, in the same order, because ``torch.distributed.new_group`` is collective. The
grid is an immutable object that is passed along; nothing is stored in module globals.

A grid also works without ``torch.distributed``: in a single process with no rendezvous
environment, ``init()`` returns a world of one whose groups are all trivial.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import socket
from collections.abc import Mapping, Sequence
from datetime import timedelta
from types import MappingProxyType

import torch
import torch.distributed as dist

from gnnpar import shm
from gnnpar.errors import UserError, first_line
from gnnpar.fmt import count
from gnnpar.launch import (
    LAUNCHER_NAMES,
    Launch,
    LaunchError,
    detect_launch,
    node_layout,
    stacks_on_request,
)

#: The grid axes, fastest-varying first.
AXES: tuple[str, ...] = ("x", "y", "z", "expert", "context", "data", "pipe")
#: Axis names that denote a combination of axes.
COMBINED_AXES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "tensor": ("x", "y", "z"),
        "world": ("x", "y", "z", "expert", "context", "data", "pipe"),
        # the ranks that hold the same experts and see different tokens (fold_context)
        "context_data": ("context", "data"),
        # the ranks that hold the same parameters outside the experts (fold_replicas)
        "replicas": ("expert", "context", "data"),
        "xy": ("x", "y"),
        "xz": ("x", "z"),
        "yz": ("y", "z"),
    }
)
#: Seconds a collective waits for a peer unless ``timeout`` or ``$GNNPAR_TIMEOUT`` says.
DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "GNNPAR_TIMEOUT"


def default_timeout_s() -> float:
    """``$GNNPAR_TIMEOUT`` (seconds) if set, else :data:`DEFAULT_TIMEOUT_S`; read when a
    grid is built, so a launcher or a test can set it. GridError naming the variable if it
    is not a positive number."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None or not text.strip():
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise GridError(f"${TIMEOUT_ENV} must be a positive number of seconds, got {text!r}")
    return seconds


class GridError(UserError):
    """A grid that cannot be built (sizes that do not match the world, bad axis names)."""


def axes_of(axis: str) -> tuple[str, ...]:
    """The base axes that ``axis`` names (``"tensor"`` → x, y, z)."""
    if axis in AXES:
        return (axis,)
    if axis in COMBINED_AXES:
        return COMBINED_AXES[axis]
    known = ", ".join([*AXES, *COMBINED_AXES])
    raise GridError(f"unknown grid axis {axis!r}; known axes: {known}")


def backend_for_device(device: torch.device | str) -> str:
    """The collective backend that serves tensors on ``device`` (NCCL for CUDA, else gloo)."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def backend_for_choice(choice: str) -> str | None:
    """The backend of a user's device choice (the trainer's ``device`` key): ``"auto"`` →
    None (:func:`init` picks NCCL when a GPU is present, else gloo), ``"cuda"`` → NCCL,
    ``"cpu"`` → gloo."""
    if choice == "auto":
        return None
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise GridError("device 'cuda' was asked for, but torch sees no GPU here")
        return "nccl"
    if choice == "cpu":
        return "gloo"
    raise GridError(f"unknown device {choice!r}; use auto, cuda or cpu")


def device_for_backend(backend: str, local_rank: int = 0) -> torch.device:
    """The device whose tensors ``backend`` moves: ``cuda:local_rank`` for NCCL, else CPU
    (or, inside :func:`gnnpar.virtual_device.simulated_device`, the simulated accelerator).

    This is the one place that decides a run's device; nothing else names "cpu" or "cuda".
    """
    from gnnpar import virtual_device

    if backend == "nccl":
        return torch.device("cuda", local_rank)
    if virtual_device.active():
        return virtual_device.VIRTUAL
    return torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class GridShape:
    """A grid's shape and rank arithmetic without any process groups (for planning and for
    computing other ranks' layouts)."""

    x: int = 1
    y: int = 1
    z: int = 1
    data: int = 1
    global_rank: int = 0
    pipe: int = 1
    context: int = 1
    expert: int = 1

    @property
    def shape(self) -> dict[str, int]:
        """Sizes of the axes, by name (``pipe``, ``context`` and ``expert`` only when above 1,
        so a grid without them describes itself as it always did)."""
        out = {"x": self.x, "y": self.y, "z": self.z, "data": self.data}
        for a in ("expert", "context", "pipe"):
            if getattr(self, a) > 1:
                out[a] = getattr(self, a)
        return out

    @property
    def world_size(self) -> int:
        """Number of processes in the grid."""
        return self.x * self.y * self.z * self.expert * self.context * self.data * self.pipe

    def _size_of(self, axis: str) -> int:
        return getattr(self, axis)

    def size(self, axis: str) -> int:
        """Number of ranks in a group along ``axis``."""
        out = 1
        for a in axes_of(axis):
            out *= self._size_of(a)
        return out

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """Grid coordinates of ``rank`` (default: ``global_rank``)."""
        rank = self.global_rank if rank is None else rank
        if not 0 <= rank < self.world_size:
            raise GridError(f"rank {rank} is outside a grid of {count(self.world_size, 'rank')}")
        out = {}
        for a in AXES:
            out[a] = rank % self._size_of(a)
            rank //= self._size_of(a)
        return out

    def sizes(self) -> dict[str, int]:
        """Sizes of every axis, by name, pipe, context and expert included (1 when absent)."""
        return {a: self._size_of(a) for a in AXES}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessGrid(GridShape):
    """An immutable pipe × data × context × expert × x × y × z grid of processes with one group
    per axis.

    Build one with :func:`gnnpar.init`. Query it by axis name (``"x"``, ``"y"``, ``"z"``,
    ``"expert"``, ``"context"``, ``"data"``, ``"pipe"``, or the combinations ``"tensor"`` =
    x·y·z, ``"world"``, ``"context_data"``, ``"replicas"`` = expert·context·data, ``"xy"``,
    ``"xz"``, ``"yz"``): :meth:`group`,
    :meth:`rank`, :meth:`size`, :meth:`ranks`. Shape and rank
    arithmetic (``shape``, ``world_size``, ``size``, ``coords``) come from
    :class:`GridShape`.
    """

    backend: str
    device: torch.device
    ranks_per_node: int
    timeout: timedelta
    groups: Mapping[str, dist.ProcessGroup | None] = dataclasses.field(repr=False)
    owns_process_group: bool = dataclasses.field(default=False, repr=False)
    # Traffic recorders opened by gnnpar.comm.record(); the list object is owned by this grid.
    recorders: list = dataclasses.field(default_factory=list, repr=False, compare=False)
    # Shared-memory channels of this grid's groups (gnnpar.shm), created on first use.
    channels: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def distributed(self) -> bool:
        """Whether the grid runs on torch.distributed (False for a plain single process)."""
        return dist.is_available() and dist.is_initialized()

    # ------------------------------------------------------------------------ coordinates
    def rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates; missing axes default to this rank's."""
        mine = self.coords()
        for a, v in coords.items():
            if a not in AXES:
                raise GridError(f"unknown grid axis {a!r}; axes are {', '.join(AXES)}")
            if not 0 <= v < self._size_of(a):
                raise GridError(f"coordinate {a}={v} is outside an axis of size {self._size_of(a)}")
            mine[a] = v
        return rank_at(self.sizes(), mine)

    def rank(self, axis: str) -> int:
        """This rank's index within its group along ``axis`` (x fastest within combinations)."""
        c = self.coords()
        idx, stride = 0, 1
        for a in axes_of(axis):
            idx += c[a] * stride
            stride *= self._size_of(a)
        return idx

    def ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """Global ranks of the group along ``axis`` that contains ``rank`` (default: this one),
        ordered by their index within the group."""
        return _group_members(self.sizes(), axes_of(axis), self.coords(rank))

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """This rank's process group along ``axis``; ``None`` where the group has one rank
        (collectives over it are no-ops) or when running without torch.distributed."""
        axes_of(axis)
        return self.groups.get(axis)

    # ---------------------------------------------------------------------------- placement
    def is_intra_node(self, axis: str) -> bool:
        """Whether every rank of this rank's ``axis`` group sits on the same node, where a node
        holds ``ranks_per_node`` consecutive ranks."""
        members = self.ranks(axis)
        return len({r // self.ranks_per_node for r in members}) == 1

    def node(self, rank: int | None = None) -> int:
        """Index of the node hosting ``rank``."""
        rank = self.global_rank if rank is None else rank
        return rank // self.ranks_per_node

    def describe(self) -> str:
        """One line naming the shape, backend and device."""
        pipe = f"pipe={self.pipe} " if self.pipe > 1 else ""
        context = f"context={self.context} " if self.context > 1 else ""
        expert = f"expert={self.expert} " if self.expert > 1 else ""
        return (
            f"grid {pipe}data={self.data} {context}{expert}x={self.x} y={self.y} z={self.z} "
            f"({count(self.world_size, 'rank')}, {self.backend}, {self.device}, "
            f"{count(self.ranks_per_node, 'rank')}/node)"
        )


def rank_at(shape: Mapping[str, int], coords: Mapping[str, int]) -> int:
    """The global rank at ``coords`` (x fastest, pipe slowest; absent axes count as 0)."""
    rank, stride = 0, 1
    for a in AXES:
        rank += coords.get(a, 0) * stride
        stride *= shape.get(a, 1)
    return rank


def _group_members(
    shape: Mapping[str, int], axes: Sequence[str], coords: Mapping[str, int]
) -> list[int]:
    """Ranks that share every coordinate of ``coords`` except those of ``axes``."""
    free = [range(shape.get(a, 1)) for a in axes]
    out = []
    # itertools.product varies the last axis fastest; reverse so the first named axis is.
    for combo in itertools.product(*reversed(free)):
        c = dict(coords)
        for a, v in zip(reversed(axes), combo, strict=True):
            c[a] = v
        out.append(rank_at(shape, c))
    return out


def _all_group_rank_lists(shape: Mapping[str, int], axes: Sequence[str]) -> list[list[int]]:
    """Every group along ``axes`` in a fixed order (the same on all ranks)."""
    fixed = [a for a in AXES if a not in axes]
    out = []
    for combo in itertools.product(*(range(shape.get(a, 1)) for a in reversed(fixed))):
        coords = {a: 0 for a in AXES}
        coords.update(dict(zip(reversed(fixed), combo, strict=True)))
        out.append(_group_members(shape, axes, coords))
    return out


#: The order of :func:`_resolve_sizes`' result.
_SIZE_ORDER = ("data", "x", "y", "z", "pipe", "context", "expert")


def _resolve_sizes(
    world: int,
    data: int | None,
    x: int,
    y: int,
    z: int,
    pipe: int = 1,
    context: int = 1,
    expert: int = 1,
) -> tuple[int, ...]:
    named_sizes = (("x", x), ("y", y), ("z", z), ("data", data), ("pipe", pipe))
    for name, v in (*named_sizes, ("context", context), ("expert", expert)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise GridError(f"grid axis {name} must be a positive integer, got {v!r}")
    # the axes other than data, slowest first, naming pipe, context and expert only when present
    optional = (("pipe", pipe), ("context", context), ("expert", expert))
    others = [(n, v) for n, v in optional if v > 1]
    others += [("x", x), ("y", y), ("z", z)]
    fixed = x * y * z * pipe * context * expert
    names = "*".join(n for n, _ in others)
    values = "*".join(str(v) for _, v in others)
    if data is None:
        if world % fixed:
            raise GridError(f"{names} = {values} = {fixed} does not divide the world size {world}")
        data = world // fixed
    if data * fixed != world:
        lead = [n for n, _ in others[:-3]]
        label = "*".join([*lead, "data", "x", "y", "z"])
        nums = "*".join([*(str(v) for _, v in others[:-3]), str(data), str(x), str(y), str(z)])
        raise GridError(
            f"grid {label} = {nums} = {data * fixed} does not match the world size {world}"
        )
    return data, x, y, z, pipe, context, expert


def fit_shape(world: int, shape: Mapping[str, int]) -> dict[str, int]:
    """The full shape (every axis) that ``shape`` (some axes, as :func:`parse_grid_spec`
    gives) takes on ``world`` ranks, data filling the rest; a :class:`GridError` when it does
    not fit (checked before ranks launch)."""
    unknown = sorted(set(shape) - set(AXES))
    if unknown:
        raise GridError(f"unknown grid axis {unknown[0]!r}; axes are {', '.join(AXES)}")
    sizes = _resolve_sizes(
        world,
        shape.get("data"),
        shape.get("x", 1),
        shape.get("y", 1),
        shape.get("z", 1),
        shape.get("pipe", 1),
        shape.get("context", 1),
        shape.get("expert", 1),
    )
    return dict(zip(_SIZE_ORDER, sizes, strict=True))


def _restart_safe_store(timeout: timedelta) -> dict:
    """Under torchrun's shared agent store, a rendezvous store of this restart attempt only.

    After ``--max-restarts`` brings the ranks back, torchrun (2.4 and later) hands them the
    same TCP store as the failed attempt, still holding the dead ranks' gloo addresses, so
    the new ranks connect to closed ports ("connectFullMesh failed ... Connection refused").
    Prefixing every key with the restart count gives each attempt a clean namespace.
    Outside that case, an empty dict: ``init_process_group`` reads ``env://`` as usual.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"gnnpar/attempt-{attempt}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


def _backend_and_device(
    backend: str | None, device: torch.device | str | None, local_rank: int
) -> tuple[str, torch.device]:
    """Backend and device, each following the other (gloo ↔ CPU, NCCL ↔ CUDA); with neither
    given, the ``GNNPAR_DEVICE`` environment variable's choice (``auto``, ``cuda``, ``cpu``;
    see :func:`backend_for_choice`), and for ``auto`` NCCL on ``cuda:local_rank`` when a GPU
    is present."""
    if backend is None and device is None:
        backend = backend_for_choice(os.environ.get("GNNPAR_DEVICE", "auto"))
    if backend is None and device is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend is None:
        backend = backend_for_device(device)
    if device is None:
        device = device_for_backend(backend, local_rank)
    device = torch.device(device)
    if backend_for_device(device) != backend:
        raise GridError(f"backend {backend!r} cannot move tensors on device {device}")
    return backend, device


def _join_torchrun(
    backend: str | None, device: torch.device | str | None, timeout: timedelta
) -> tuple[str, torch.device, bool]:
    """Join torchrun's env rendezvous (or stay a plain process): backend, device, and whether
    this call started torch.distributed."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend, device = _backend_and_device(backend, device, local_rank)
    owns = False
    if dist.is_available() and not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) > 1 or "MASTER_ADDR" in os.environ:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group(
                backend=backend, timeout=timeout, **_restart_safe_store(timeout)
            )
            owns = True
    return backend, device, owns


def _launch_store(launch: Launch, timeout: timedelta) -> dist.TCPStore:
    """The rendezvous store of a Slurm or MPI launch, served by rank 0."""
    where = f"{launch.master_addr}:{launch.master_port}"
    try:
        return dist.TCPStore(
            host_name=launch.master_addr,
            port=launch.master_port,
            world_size=launch.world_size,
            is_master=launch.rank == 0,
            timeout=timeout,
        )
    except (RuntimeError, OSError) as e:
        # torch's message runs on with C++ frames: its first line says what went wrong
        first = first_line(e)
        who = f"{LAUNCHER_NAMES[launch.launcher]} rank {launch.rank} of {launch.world_size}"
        if launch.rank == 0 and _address_in_use(e):
            # the bind fails at once; the other ranks wait for this one until their timeout
            # (or until the launcher, e.g. srun --kill-on-bad-exit, stops them)
            raise LaunchError(
                f"{who} could not serve the rendezvous on {where}: address already in use "
                f"(another process holds port {launch.master_port}); export MASTER_PORT=<a "
                "free port> for every rank (the same one), e.g. in the job script"
            ) from None
        doing = "serve the rendezvous on" if launch.rank == 0 else "reach rank 0 at"
        raise LaunchError(
            f"{who} could not {doing} {where} ({first}); set MASTER_ADDR / MASTER_PORT"
        ) from None


def _address_in_use(err: BaseException) -> bool:
    """Whether the rendezvous server could not bind its port because another process holds
    it. torch raises a ``DistNetworkError`` for every socket failure of its store and keeps
    no errno (its message names it: "name: EADDRINUSE, message: address already in use"),
    so this is the one place that reads that error's text; a plain OSError of the bind (an
    older store) has the errno."""
    if getattr(err, "errno", None) == errno.EADDRINUSE:
        return True
    text = str(err).lower()
    return "eaddrinuse" in text or "address already in use" in text


def _hosts_via_store(store: dist.Store, rank: int, world: int) -> list[str]:
    """Every rank's host name, exchanged through the rendezvous store (before any process
    group exists, so before the device is known)."""
    store.set(f"gnnpar/host/{rank}", socket.gethostname())
    return [store.get(f"gnnpar/host/{r}").decode() for r in range(world)]


def _join_launch(
    launch: Launch, backend: str | None, device: torch.device | str | None, timeout: timedelta
) -> tuple[str, torch.device, bool, int]:
    """Join a Slurm step or MPI launch: backend, device, whether this call started
    torch.distributed, and the ranks per node the launcher implies."""
    local_rank, per_node = launch.local_rank, launch.ranks_per_node
    owns = False
    if launch.world_size > 1 and dist.is_available() and not dist.is_initialized():
        store = _launch_store(launch, timeout)
        if local_rank is None or per_node is None:
            hosts = _hosts_via_store(store, launch.rank, launch.world_size)
            local_rank, per_node = node_layout(hosts, launch.rank)
        backend, device = _backend_and_device(backend, device, _gpu_index(local_rank))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
        )
        owns = True
    elif local_rank is None or per_node is None:
        if dist.is_available() and dist.is_initialized():  # a later grid in the same world
            hosts = [""] * dist.get_world_size()
            dist.all_gather_object(hosts, socket.gethostname())
            local_rank, per_node = node_layout(hosts, dist.get_rank())
        else:
            local_rank, per_node = 0, 1
    if not owns:
        backend, device = _backend_and_device(backend, device, _gpu_index(local_rank))
    return backend, device, owns, per_node


def _gpu_index(local_rank: int) -> int:
    """The GPU of ``local_rank``: a task bound to fewer GPUs (``srun --gpus-per-task=1``) sees
    its own as device 0."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return local_rank % count if count else local_rank


def init(
    data: int | None = None,
    x: int = 1,
    y: int = 1,
    z: int = 1,
    *,
    pipe: int = 1,
    context: int = 1,
    expert: int = 1,
    backend: str | None = None,
    device: torch.device | str | None = None,
    ranks_per_node: int | None = None,
    timeout: float | timedelta | None = None,
) -> ProcessGrid:
    """Build the process grid, initialising torch.distributed from the environment if needed.

    The launcher is recognised from the environment (:func:`gnnpar.launch.detect_launch`):
    torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``: its env rendezvous), a Slurm step
    (``srun``) or an MPI launch (Open MPI, MPICH/PMI); in a plain process it returns a world
    of one. ``data`` defaults to ``world // (pipe*context*x*y*z)``; ``pipe`` is the number of
    pipeline stages (:mod:`gnnpar.pipeline`), ``context`` the number of ranks a sequence is
    split over (:mod:`gnnpar.tensor.context`), ``expert`` the number of ranks a mixture of
    experts' experts are split over (:mod:`gnnpar.tensor.experts`). Backend and device follow
    each other:
    gloo ↔ CPU, NCCL ↔ CUDA; with neither given, CUDA and NCCL are used when a GPU is present,
    the local rank's GPU. ``ranks_per_node`` (default: the launcher's, e.g.
    ``LOCAL_WORLD_SIZE`` or Slurm's tasks per node, else the world size) tells which groups
    are intra-node; tests set it to simulate several nodes. ``timeout`` (seconds; default
    :func:`default_timeout_s`) bounds every collective, so a dead peer gives an error
    instead of a hang.
    """
    if timeout is None:
        timeout = timedelta(seconds=default_timeout_s())
    elif not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    launch = detect_launch()
    if launch is not None:
        stacks_on_request()  # kill -USR1: where a hung rank waits
    launched_per_node = None
    if launch is None or launch.launcher == "torchrun":
        backend, device, owns = _join_torchrun(backend, device, timeout)
    else:
        backend, device, owns, launched_per_node = _join_launch(launch, backend, device, timeout)
    # A grid of another backend than the world's (the mini-batch sampler's gloo groups on an
    # NCCL world) gets a world group of its own; every other axis is a new group anyway.
    own_world = False
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
        actual = str(dist.get_backend())
        own_world = backend not in actual
        if own_world and backend != "gloo":
            raise GridError(f"torch.distributed runs backend {actual!r}, not {backend!r}")
    else:
        world, rank = 1, 0

    try:
        sizes = _resolve_sizes(world, data, x, y, z, pipe, context, expert)
    except GridError as e:
        if launch is None:
            raise
        raise GridError(f"{e} (launched by {LAUNCHER_NAMES[launch.launcher]})") from None
    shape = dict(zip(_SIZE_ORDER, sizes, strict=True))
    if ranks_per_node is None:
        if launched_per_node is not None:
            ranks_per_node = launched_per_node
        else:
            ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if ranks_per_node < 1:
        raise GridError(f"ranks_per_node must be positive, got {ranks_per_node}")

    groups: dict[str, dist.ProcessGroup | None] = {}
    if world > 1:
        # an axis whose ranks another axis already spans shares its group (with y = z = 1,
        # "tensor" is "x"): every group costs threads and sockets, and time to create
        made: dict[tuple[str, ...], dist.ProcessGroup | None] = {}
        for axis in (*AXES, *COMBINED_AXES):
            axes = axes_of(axis)
            if axis == "world" and not own_world:
                groups[axis] = dist.group.WORLD
                continue
            spanning = tuple(a for a in axes if shape[a] > 1)
            if not spanning:
                continue
            if spanning in made:
                if made[spanning] is not None:
                    groups[axis] = made[spanning]
                continue
            made[spanning] = None
            # new_group is collective: every rank creates every group, in the same order.
            for members in _all_group_rank_lists(shape, axes):
                g = dist.new_group(members, timeout=timeout, backend=backend)
                if rank in members:
                    groups[axis] = made[spanning] = g
    return ProcessGrid(
        x=shape["x"],
        y=shape["y"],
        z=shape["z"],
        data=shape["data"],
        pipe=shape["pipe"],
        context=shape["context"],
        expert=shape["expert"],
        global_rank=rank,
        backend=backend,
        device=device,
        ranks_per_node=ranks_per_node,
        timeout=timeout,
        groups=MappingProxyType(groups),
        owns_process_group=owns,
    )


def fold_context(grid: ProcessGrid) -> ProcessGrid:
    """``grid`` as sharded data parallelism sees it: the context axis folded into data.

    Context ranks hold the same parameters and see different tokens of the same sequences,
    so their gradients are averaged like those of data ranks. The view has ``data = C·D`` and
    no context axis; because context sits just below data in the rank order, its data
    coordinate ``context + C·data`` names the same ranks, and its data groups are the grid's
    ``context_data`` groups. It shares the grid's groups, traffic recorders (bytes count under
    ``"data"``) and channels, and does not own torch.distributed. A grid without a context
    axis is its own view.
    """
    if grid.context == 1:
        return grid
    groups = {a: g for a, g in grid.groups.items() if a not in ("context", "data")}
    if "context_data" in grid.groups:
        groups["data"] = grid.groups["context_data"]
    return dataclasses.replace(
        grid,
        data=grid.data * grid.context,
        context=1,
        groups=MappingProxyType(groups),
        owns_process_group=False,
    )


def fold_replicas(grid: ProcessGrid) -> ProcessGrid:
    """``grid`` as sharded data parallelism sees the parameters outside a mixture of experts'
    experts: the expert and context axes folded into data.

    Expert, context and data ranks hold the same such parameters and see different tokens, so
    their gradients are averaged together. The view has ``data = E·C·D`` and neither an expert
    nor a context axis; the three axes are adjacent in the rank order (expert fastest), so its
    data coordinate ``expert + E·(context + C·data)`` names the same ranks, and its data groups
    are the grid's ``replicas`` groups. Like :func:`fold_context`, it shares the grid's groups,
    recorders and channels and does not own torch.distributed. A grid without expert and context
    axes is its own view.
    """
    if grid.expert == 1:
        return fold_context(grid)
    folded = ("expert", "context", "data", "context_data", "replicas")
    groups = {a: g for a, g in grid.groups.items() if a not in folded}
    if "replicas" in grid.groups:
        groups["data"] = grid.groups["replicas"]
    return dataclasses.replace(
        grid,
        data=grid.data * grid.context * grid.expert,
        context=1,
        expert=1,
        groups=MappingProxyType(groups),
        owns_process_group=False,
    )


def release(grid: ProcessGrid) -> None:
    """Destroy the sub-groups ``init`` created for ``grid`` (not the world group), freeing
    their communication threads and sockets; the grid cannot communicate afterwards.

    Call it before building another grid in the same world (benchmarks and tests that try
    several shapes): every gloo group holds threads, and hundreds of leftover groups slow
    the whole machine.
    """
    shm.release(grid.channels)
    if not (dist.is_available() and dist.is_initialized()):
        return
    seen: set[int] = set()
    for group in grid.groups.values():
        if group is None or group is dist.group.WORLD or id(group) in seen:
            continue
        seen.add(id(group))
        dist.destroy_process_group(group)


def reshape(
    grid: ProcessGrid,
    *,
    data: int | None = None,
    x: int = 1,
    y: int = 1,
    z: int = 1,
    pipe: int = 1,
    context: int = 1,
    expert: int = 1,
    ranks_per_node: int | None = None,
) -> ProcessGrid:
    """Release ``grid``'s sub-groups and build a grid of another shape over the same world.

    The new grid inherits ``grid``'s ownership of torch.distributed, so :func:`shutdown` of
    the new grid tears the world down when ``init`` started it (a world left standing at
    interpreter exit can abort a rank: gloo's threads outlive Python there).
    """
    release(grid)
    new = init(
        data=data,
        x=x,
        y=y,
        z=z,
        pipe=pipe,
        context=context,
        expert=expert,
        backend=grid.backend,
        device=grid.device,
        ranks_per_node=ranks_per_node,
        timeout=grid.timeout,
    )
    return dataclasses.replace(
        new, owns_process_group=new.owns_process_group or grid.owns_process_group
    )


def shutdown(grid: ProcessGrid) -> None:
    """Wait for every rank, destroy the grid's sub-groups, and tear down torch.distributed if
    ``init`` started it. Call it on every rank (the end of a run, not an error path)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # A rank that closes its sockets while a peer still completes the last collective
        # makes gloo abort that peer (SIGABRT): all leave together.
        dist.barrier()
    release(grid)
    if grid.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()


def parse_grid_spec(spec: str) -> dict[str, int]:
    """Parse ``"data=2,x=2,y=1,z=2"``, ``"pipe=2,data=2,x=2"`` or ``"context=2,x=2"`` (any
    subset of the axes) into keyword arguments of :func:`init`."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in AXES:
            raise GridError(
                f"bad grid spec {spec!r}: expected axis=size pairs such as 'x=2,y=2' with "
                f"axes {', '.join(AXES)}"
            )
        if name in out:
            raise GridError(f"bad grid spec {spec!r}: axis {name} given twice")
        try:
            out[name] = int(value)
        except ValueError:
            raise GridError(f"bad grid spec {spec!r}: {name}={value!r} is not an integer") from None
        if out[name] < 1:
            raise GridError(f"bad grid spec {spec!r}: {name} must be positive")
    return out


def default_shape(world: int) -> dict[str, int]:
    """A grid that exercises every axis it can: factors of two go to x, y, z in turn, and
    whatever remains to data."""
    shape = {"x": 1, "y": 1, "z": 1}
    rest = world
    for axis in ("x", "y", "z"):
        if rest % 2 == 0:
            shape[axis] = 2
            rest //= 2
    shape["data"] = rest
    return shape


def factorizations(world: int, axes: int = 4) -> list[tuple[int, ...]]:
    """Every ordered factorisation of ``world`` into ``axes`` positive factors."""
    if axes == 1:
        return [(world,)]
    out = []
    for f in range(1, world + 1):
        if world % f == 0:
            out.extend((f, *rest) for rest in factorizations(world // f, axes - 1))
    return out
