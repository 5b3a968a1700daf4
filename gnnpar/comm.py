"""The one door to torch.distributed: collectives, their autograd pairs, and byte accounting.

Every collective takes the :class:`~gnnpar.grid.ProcessGrid` and an axis name, and

- is a no-op (no communication, no bytes) when the axis group has one rank;
- records the bytes this rank moves, per axis and per kind, into every recorder opened with
  :func:`record` on that grid;
- has an async form (``async_op=True`` returns a :class:`Handle` whose ``wait()`` gives the
  result);
- turns a failure or timeout of a peer into a :class:`CommError` that names the collective,
  the axis, its ranks and this rank, instead of a hang.

Bytes are counted with the ring costs of docs/grid.md, per rank, for a group of p ranks and a full
buffer of V bytes: all-gather and reduce-scatter (p−1)/p·V, all-reduce 2(p−1)/p·V, broadcast
(p−1)/p·V (the average each rank receives), all-to-all the bytes this rank sends to others,
and a point-to-point :func:`send` its tensor's bytes (on the sender; :func:`recv` counts
nothing, so each message is counted once; :func:`exchange`, a send and a receive posted
together, counts its send).
Uneven all-gathers and reduce-scatters are padded to the largest piece (as FSDP does), and the
padded bytes are what is counted, because they are what moves.

Differentiable pairs (``torch.autograd.Function``), each the adjoint of the other:

============================  =================  ==================
function                      forward            backward
============================  =================  ==================
:func:`copy_to`               identity           all-reduce
:func:`reduce_from`           all-reduce         identity
:func:`gather_from`           all-gather         reduce-scatter
:func:`scatter_to`            reduce-scatter     all-gather
:func:`split_to`              keep own chunk     all-gather
:func:`gather_replicated`     all-gather         keep own chunk
============================  =================  ==================

``reduce_from`` and ``gather_replicated`` assume (as Megatron's do) that what follows them is
replicated across the group, so each rank's incoming gradient is the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from gnnpar import shm
from gnnpar.chunking import chunk_offsets, chunk_sizes
from gnnpar.fmt import count
from gnnpar.grid import ProcessGrid

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p")
_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}
#: The order of a sum over a group: ``ring``, the backend's (or the shared-memory channel's)
#: own, which depends on the group's size; ``tree``, a fixed pairwise tree over the group's
#: ranks in index order (see :func:`tree_sum`).
ORDERS = ("ring", "tree")


def _all_gather_single(out, inp, group, async_op):
    # torch 2.13 renamed all_gather_into_tensor; keep working on both sides of the rename.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter_single(out, inp, group, async_op):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


class CommError(RuntimeError):
    """A collective failed (a peer died, timed out, or disagreed on shapes)."""


# --------------------------------------------------------------------------- accounting
@dataclasses.dataclass
class Traffic:
    """Bytes and call counts per (axis, kind), recorded inside a :func:`record` block."""

    nbytes: dict[tuple[str, str], int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    ncalls: dict[tuple[str, str], int] = dataclasses.field(default_factory=lambda: defaultdict(int))

    def add(self, axis: str, kind: str, nbytes: int) -> None:
        """Count one collective of ``kind`` over ``axis`` that moved ``nbytes``."""
        self.nbytes[(axis, kind)] += int(nbytes)
        self.ncalls[(axis, kind)] += 1

    def bytes(self, axis: str | None = None, kind: str | None = None) -> int:
        """Total bytes, optionally only over ``axis`` and/or of ``kind``."""
        return sum(
            v
            for (a, k), v in self.nbytes.items()
            if (axis is None or a == axis) and (kind is None or k == kind)
        )

    def calls(self, axis: str | None = None, kind: str | None = None) -> int:
        """Number of collectives, optionally only over ``axis`` and/or of ``kind``."""
        return sum(
            v
            for (a, k), v in self.ncalls.items()
            if (axis is None or a == axis) and (kind is None or k == kind)
        )

    def by_axis(self) -> dict[str, int]:
        """Bytes per axis."""
        out: dict[str, int] = defaultdict(int)
        for (a, _), v in self.nbytes.items():
            out[a] += v
        return dict(out)

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{axis: {kind: bytes}}``, ready for JSON."""
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for (a, k), v in sorted(self.nbytes.items()):
            out[a][k] = v
        return dict(out)


@contextlib.contextmanager
def record(grid: ProcessGrid) -> Iterator[Traffic]:
    """Record the bytes of every collective run on ``grid`` inside the block.

    >>> with comm.record(grid) as traffic:
    ...     comm.all_reduce(t, grid, "x")
    >>> traffic.bytes(axis="x", kind="all_reduce")
    """
    traffic = Traffic()
    grid.recorders.append(traffic)
    try:
        yield traffic
    finally:
        grid.recorders.remove(traffic)


def account(grid: ProcessGrid, axis: str, kind: str, nbytes: float) -> None:
    """Count ``nbytes`` this rank moved on ``axis`` in a collective of ``kind`` in the open
    recorders: every collective here, and those that run outside this module (a
    communication hook of torch's)."""
    for rec in grid.recorders:
        rec.add(axis, kind, round(nbytes))


def ring_bytes(kind: str, full_bytes: float, p: int) -> float:
    """Per-rank bytes of a ring collective over ``p`` ranks on a full buffer of ``full_bytes``."""
    if p <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (p - 1) / p * full_bytes
    if kind in ("all_gather", "reduce_scatter", "broadcast"):
        return (p - 1) / p * full_bytes
    raise ValueError(f"no ring formula for collective kind {kind!r}; kinds: {', '.join(KINDS)}")


# ------------------------------------------------------------------------------ handles
class Handle:
    """A collective in flight; ``wait()`` blocks until done and returns its result."""

    def __init__(self, work: object | None, finish: Callable[[], torch.Tensor], what: str):
        self._work = work
        self._finish = finish
        self._what = what
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """Wait for the collective and return its result (idempotent)."""
        if self._result is None:
            if self._work is not None:
                try:
                    self._work.wait()
                except RuntimeError as e:
                    raise CommError(f"{self._what} failed: {e}") from e
            self._result = self._finish()
        return self._result

    def is_completed(self) -> bool:
        """Whether the collective has finished (never blocks)."""
        return self._work is None or self._work.is_completed()


def _what(kind: str, grid: ProcessGrid, axis: str) -> str:
    return f"{kind} over grid axis '{axis}' (ranks {grid.ranks(axis)}) on rank {grid.global_rank}"


def _launch(
    kind: str,
    grid: ProcessGrid,
    axis: str,
    start: Callable[[], object],
    finish: Callable[[], torch.Tensor],
    async_op: bool,
) -> torch.Tensor | Handle:
    what = _what(kind, grid, axis)
    try:
        work = start()
    except RuntimeError as e:
        raise CommError(f"{what} failed: {e}") from e
    handle = Handle(work, finish, what)
    return handle if async_op else handle.wait()


def _shm_or_backend(
    grid: ProcessGrid,
    group: dist.ProcessGroup,
    largest: torch.Tensor,
    via_shm: Callable[[shm.Channel], bool],
    via_backend: Callable[[], object],
    async_op: bool,
) -> Callable[[], object]:
    """The start of a collective: through the group's shared-memory channel when it should
    carry it (a blocking collective of a CPU tensor of at least ``shm.min_bytes()`` on a
    group within one host; done when it returns, so no work handle), else through the
    backend (its async work). An async collective stays on the backend, whose threads
    overlap it with the caller's compute (gradient buckets, prefetched gathers): the
    transport runs in the caller's thread and would serialise them."""

    def start() -> object:
        if async_op:
            return via_backend()
        chan = shm.channel(grid.channels, group, largest.device, _nbytes(largest))
        if chan is not None and via_shm(chan):
            return None
        return via_backend()

    return start


def _done(result: torch.Tensor, async_op: bool) -> torch.Tensor | Handle:
    return Handle(None, lambda: result, "local") if async_op else result


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_device(tensor: torch.Tensor, grid: ProcessGrid, kind: str, axis: str) -> None:
    """Every collective moves tensors of ``grid.device``, in every world (a world of one
    sends nothing, so this is what catches a host tensor there before NCCL would)."""
    if tensor.device != grid.device:
        raise CommError(
            f"{_what(kind, grid, axis)}: tensor of shape {tuple(tensor.shape)} is on "
            f"{tensor.device}, the grid's device is {grid.device}"
        )


def tree_sum(stack: torch.Tensor) -> torch.Tensor:
    """The sum of ``stack``'s rows (dim 0) in a fixed pairwise tree: rows 2i and 2i+1 first,
    then those sums pairwise, and so on (an odd last row waits a level). For a power-of-two
    group the tree over ranks continues the tree within them: ranks that each sum two
    micro-batches, then the pair sums over ranks, add exactly what twice as many ranks of one
    micro-batch each add, bit for bit."""
    parts = list(stack.unbind(0))
    while len(parts) > 1:
        pairs = [parts[i] + parts[i + 1] for i in range(0, len(parts) - 1, 2)]
        parts = pairs + parts[len(pairs) * 2 :]
    return parts[0]


def _check_order(order: str, kind: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"{kind}: unknown order {order!r}; use {' or '.join(ORDERS)}")


def _tree_reduce_scatter(
    send: torch.Tensor, group: dist.ProcessGroup, p: int
) -> tuple[Callable[[], object], Callable[[], torch.Tensor]]:
    """The start and finish of a reduce-scatter of ``send`` (``p`` equal row blocks, block i
    for rank i) in the fixed tree order: an all-to-all brings every rank's block of this rank
    (the ring's bytes: (p−1)/p of the buffer), then :func:`tree_sum` adds them in rank
    order."""
    received = torch.empty_like(send)

    def start() -> object:
        return dist.all_to_all_single(received, send, group=group, async_op=True)

    def finish() -> torch.Tensor:
        return tree_sum(received.view(p, send.shape[0] // p, *send.shape[1:]))

    return start, finish


# ---------------------------------------------------------------------------- collectives
def all_reduce(
    tensor: torch.Tensor,
    grid: ProcessGrid,
    axis: str,
    op: str = "sum",
    async_op: bool = False,
    order: str = "ring",
) -> torch.Tensor | Handle:
    """Reduce ``tensor`` in place over the ``axis`` group (``op``: sum, avg, max, min,
    product) and return it. ``avg`` is a sum then a division, which every backend supports.
    ``order="tree"`` (sum and avg) adds in the fixed order of :func:`tree_sum`, as a tree
    reduce-scatter then an all-gather: the ring's bytes, the result independent of how the
    backend schedules its ring."""
    _check_device(tensor, grid, "all_reduce", axis)
    _check_order(order, "all_reduce")
    group = grid.group(axis)
    if op not in _REDUCE_OPS and op != "avg":
        raise ValueError(f"unknown reduce op {op!r}; use sum, avg, max, min or product")
    if order == "tree" and op not in ("sum", "avg"):
        raise ValueError(f"all_reduce: order 'tree' is a sum; op {op!r} has no order")
    if group is None:
        return _done(tensor, async_op)
    p = grid.size(axis)
    if order == "tree":
        return _tree_all_reduce(tensor, grid, axis, op, async_op)
    account(grid, axis, "all_reduce", ring_bytes("all_reduce", _nbytes(tensor), p))
    red = getattr(dist.ReduceOp, _REDUCE_OPS.get(op, "SUM"))

    # gloo reduces a strided tensor's storage, not its view: move it through a dense copy.
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()

    def finish() -> torch.Tensor:
        if op == "avg":
            buf.div_(p)
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    start = _shm_or_backend(
        grid,
        group,
        buf,
        lambda chan: chan.all_reduce(buf, "sum" if op == "avg" else op),
        lambda: dist.all_reduce(buf, op=red, group=group, async_op=True),
        async_op,
    )
    return _launch("all_reduce", grid, axis, start, finish, async_op)


def _tree_all_reduce(
    tensor: torch.Tensor, grid: ProcessGrid, axis: str, op: str, async_op: bool
) -> torch.Tensor | Handle:
    """:func:`all_reduce` in tree order: the flat tensor padded to ``p`` equal pieces, a tree
    reduce-scatter, then an all-gather of the sums (blocking, inside the handle's wait)."""
    group, p = grid.group(axis), grid.size(axis)
    flat = tensor.reshape(-1)
    rows = -(-flat.numel() // p)
    send = torch.zeros(p * rows, dtype=tensor.dtype, device=tensor.device)
    send[: flat.numel()] = flat
    account(grid, axis, "all_reduce", ring_bytes("all_reduce", _nbytes(send), p))
    start, summed = _tree_reduce_scatter(send, group, p)

    def finish() -> torch.Tensor:
        mine = summed()
        if op == "avg":
            mine.div_(p)
        _all_gather_single(send, mine.contiguous(), group, False)
        tensor.copy_(send[: flat.numel()].view(tensor.shape))
        return tensor

    return _launch("all_reduce", grid, axis, start, finish, async_op)


def broadcast(
    tensor: torch.Tensor, grid: ProcessGrid, axis: str, src: int = 0, async_op: bool = False
) -> torch.Tensor | Handle:
    """Broadcast ``tensor`` in place from the rank with index ``src`` within the ``axis``
    group."""
    _check_device(tensor, grid, "broadcast", axis)
    group = grid.group(axis)
    if group is None:
        return _done(tensor, async_op)
    members = grid.ranks(axis)
    if not 0 <= src < len(members):
        raise ValueError(f"broadcast source {src} is outside axis '{axis}' of {len(members)}")
    account(grid, axis, "broadcast", ring_bytes("broadcast", _nbytes(tensor), len(members)))

    buf = tensor if tensor.is_contiguous() else tensor.contiguous()

    start = _shm_or_backend(
        grid,
        group,
        buf,
        lambda chan: chan.broadcast(buf, src),
        lambda: dist.broadcast(buf, src=members[src], group=group, async_op=True),
        async_op,
    )

    def finish() -> torch.Tensor:
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    return _launch("broadcast", grid, axis, start, finish, async_op)


def gather_sizes(n: int, grid: ProcessGrid, axis: str) -> list[int]:
    """Every rank's ``n`` along ``axis`` (one small all-gather; not counted as payload)."""
    if grid.group(axis) is None:
        return [n]
    t = torch.tensor([n], dtype=torch.int64, device=grid.device)
    out = torch.empty(grid.size(axis), dtype=torch.int64, device=grid.device)
    try:
        _all_gather_single(out, t, grid.group(axis), False)
    except RuntimeError as e:
        raise CommError(f"{_what('all_gather', grid, axis)} of sizes failed: {e}") from e
    return out.tolist()


def all_gather(
    tensor: torch.Tensor,
    grid: ProcessGrid,
    axis: str,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
    async_op: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor | Handle:
    """Concatenate every rank's ``tensor`` along ``dim``, in group order.

    With ``sizes`` (each rank's extent along ``dim``) the pieces may differ in size; they are
    padded to the largest for the transfer. Without it every piece must have the same shape.

    ``out``, when given, receives the transfer (its shape, dtype and device must be those of
    the result with every piece padded to the largest; ``dim`` 0 only): a caller that gathers
    the same shape again and again keeps one buffer instead of allocating the full tensor
    each time (a fresh large allocation costs its page faults on the host). The result is
    ``out`` itself, or a new tensor where the pieces differ in size.
    """
    _check_device(tensor, grid, "all_gather", axis)
    group = grid.group(axis)
    if group is None:
        return _done(tensor, async_op)
    p = grid.size(axis)
    me = grid.rank(axis)
    dim = dim % max(tensor.dim(), 1)
    moved = tensor.movedim(dim, 0) if dim else tensor
    if sizes is None:
        sizes = [moved.shape[0]] * p
    sizes = list(sizes)
    if len(sizes) != p or sizes[me] != moved.shape[0]:
        raise ValueError(
            f"all_gather over '{axis}': sizes {sizes} do not fit {count(p, 'rank')} with this rank "
            f"(index {me}) holding {moved.shape[0]} along dim {dim}"
        )
    rows = max(sizes)
    rest = moved.shape[1:]
    send = moved.contiguous()
    if rows != moved.shape[0]:
        send = torch.zeros((rows, *rest), dtype=tensor.dtype, device=tensor.device)
        send[: moved.shape[0]] = moved
    shape = (p * rows, *rest)
    if out is None:
        out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    elif (
        dim
        or tuple(out.shape) != shape
        or out.dtype != tensor.dtype
        or out.device != tensor.device
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"all_gather over '{axis}': out must be a contiguous {tensor.dtype} tensor of shape "
            f"{shape} on {tensor.device} gathering along dim 0; got {out.dtype} "
            f"{tuple(out.shape)} on {out.device} (dim {dim})"
        )
    account(grid, axis, "all_gather", ring_bytes("all_gather", _nbytes(out), p))

    def finish() -> torch.Tensor:
        full = out
        if any(s != rows for s in sizes):
            full = torch.cat([out[i * rows : i * rows + s] for i, s in enumerate(sizes)])
        return full.movedim(0, dim) if dim else full

    start = _shm_or_backend(
        grid,
        group,
        out,
        lambda chan: chan.all_gather(out, send),
        lambda: _all_gather_single(out, send, group, True),
        async_op,
    )
    return _launch("all_gather", grid, axis, start, finish, async_op)


def reduce_scatter(
    tensor: torch.Tensor,
    grid: ProcessGrid,
    axis: str,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
    async_op: bool = False,
    order: str = "ring",
) -> torch.Tensor | Handle:
    """Sum ``tensor`` over the ``axis`` group and keep this rank's chunk along ``dim``.

    ``sizes`` gives each rank's chunk; the default is :func:`chunk_sizes` (balanced, the first
    ranks one larger when the extent does not divide). ``order="tree"`` adds the ranks'
    chunks in the fixed order of :func:`tree_sum` (an all-to-all, the same bytes).
    """
    _check_device(tensor, grid, "reduce_scatter", axis)
    _check_order(order, "reduce_scatter")
    group = grid.group(axis)
    if group is None:
        return _done(tensor, async_op)
    p = grid.size(axis)
    me = grid.rank(axis)
    dim = dim % max(tensor.dim(), 1)
    moved = tensor.movedim(dim, 0) if dim else tensor
    n = moved.shape[0]
    sizes = chunk_sizes(n, p) if sizes is None else list(sizes)
    if len(sizes) != p or sum(sizes) != n:
        raise ValueError(
            f"reduce_scatter over '{axis}': sizes {sizes} do not split {n} rows over "
            f"{count(p, 'rank')}"
        )
    rows = max(sizes)
    rest = moved.shape[1:]
    if all(s == rows for s in sizes):
        send = moved.contiguous()
    else:
        send = torch.zeros((p * rows, *rest), dtype=tensor.dtype, device=tensor.device)
        for i, (o, s) in enumerate(zip(chunk_offsets(sizes), sizes, strict=True)):
            send[i * rows : i * rows + s] = moved[o : o + s]
    account(grid, axis, "reduce_scatter", ring_bytes("reduce_scatter", _nbytes(send), p))
    if order == "tree":
        start, summed = _tree_reduce_scatter(send, group, p)

        def finish() -> torch.Tensor:
            mine = summed()[: sizes[me]]
            return mine.movedim(0, dim) if dim else mine

        return _launch("reduce_scatter", grid, axis, start, finish, async_op)
    out = torch.empty((rows, *rest), dtype=tensor.dtype, device=tensor.device)

    def finish() -> torch.Tensor:
        mine = out[: sizes[me]]
        return mine.movedim(0, dim) if dim else mine

    start = _shm_or_backend(
        grid,
        group,
        send,
        lambda chan: chan.reduce_scatter(out, send),
        lambda: _reduce_scatter_single(out, send, group, True),
        async_op,
    )
    return _launch("reduce_scatter", grid, axis, start, finish, async_op)


def all_to_all(
    tensor: torch.Tensor,
    grid: ProcessGrid,
    axis: str,
    input_splits: Sequence[int] | None = None,
    output_splits: Sequence[int] | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """Send row block i of ``tensor`` (dim 0) to the rank with index i in the ``axis`` group.

    Without splits the rows divide evenly. With ``input_splits`` only, the output splits are
    first exchanged (a small all-to-all of counts).
    """
    _check_device(tensor, grid, "all_to_all", axis)
    group = grid.group(axis)
    if group is None:
        return _done(tensor, async_op)
    p = grid.size(axis)
    me = grid.rank(axis)
    n = tensor.shape[0]
    if input_splits is None:
        if n % p:
            raise ValueError(
                f"all_to_all over '{axis}': {n} rows do not divide over {count(p, 'rank')}; "
                "pass input_splits"
            )
        input_splits = [n // p] * p
        # every rank sends even rows: it receives as many from each (no counts exchanged)
        output_splits = input_splits if output_splits is None else output_splits
    input_splits = list(input_splits)
    if len(input_splits) != p or sum(input_splits) != n:
        raise ValueError(
            f"all_to_all over '{axis}': input_splits {input_splits} do not split {n} rows "
            f"over {count(p, 'rank')}"
        )
    if output_splits is None:
        output_splits = exchange_counts(input_splits, grid, axis)
    output_splits = list(output_splits)
    row_bytes = _nbytes(tensor) // n if n else 0
    if not row_bytes and tensor.dim():
        row_bytes = tensor.element_size() * int(torch.tensor(tensor.shape[1:]).prod().item())
    out = torch.empty(
        (sum(output_splits), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    sent = sum(s for i, s in enumerate(input_splits) if i != me)
    account(grid, axis, "all_to_all", sent * row_bytes)
    send = tensor.contiguous()
    return _launch(
        "all_to_all",
        grid,
        axis,
        lambda: dist.all_to_all_single(
            out, send, output_splits, input_splits, group=group, async_op=True
        ),
        lambda: out,
        async_op,
    )


def _peer(grid: ProcessGrid, axis: str, index: int, kind: str) -> int:
    """The global rank of ``index`` within this rank's ``axis`` group."""
    members = grid.ranks(axis)
    if not 0 <= index < len(members) or members[index] == grid.global_rank:
        raise ValueError(
            f"{_what(kind, grid, axis)}: peer index {index} is not another rank of the group "
            f"of {len(members)}"
        )
    return members[index]


def send(tensor: torch.Tensor, grid: ProcessGrid, axis: str, dst: int, tag: int = 0) -> Handle:
    """Send ``tensor`` to the rank with index ``dst`` within the ``axis`` group, without
    blocking: the returned handle's ``wait()`` (which returns ``tensor``) must be called
    before ``tensor`` is changed. ``tag`` tells apart messages between the same two ranks
    (gloo matches on it; NCCL matches in order, so both sides must agree on the order too)."""
    _check_device(tensor, grid, "p2p", axis)
    peer = _peer(grid, axis, dst, "send")
    send_buf = tensor.contiguous()
    account(grid, axis, "p2p", _nbytes(send_buf))
    what = f"send to rank {peer} over grid axis '{axis}' on rank {grid.global_rank}"
    try:
        work = dist.isend(send_buf, peer, group=grid.group(axis), tag=tag)
    except RuntimeError as e:
        raise CommError(f"{what} failed: {e}") from e
    return Handle(work, lambda: tensor, what)


def recv(
    shape: Sequence[int],
    dtype: torch.dtype,
    grid: ProcessGrid,
    axis: str,
    src: int,
    tag: int = 0,
) -> torch.Tensor:
    """Receive a tensor of ``shape`` and ``dtype`` from the rank with index ``src`` within the
    ``axis`` group (blocking; what :func:`send` with the same ``tag`` sent)."""
    peer = _peer(grid, axis, src, "recv")
    out = torch.empty(tuple(shape), dtype=dtype, device=grid.device)
    what = f"recv from rank {peer} over grid axis '{axis}' on rank {grid.global_rank}"
    try:
        dist.irecv(out, peer, group=grid.group(axis), tag=tag).wait()
    except RuntimeError as e:
        raise CommError(f"{what} failed: {e}") from e
    return out


class _Works:
    """Several point-to-point works waited for as one."""

    def __init__(self, works: Sequence[object]):
        self.works = list(works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def exchange(
    tensor: torch.Tensor,
    grid: ProcessGrid,
    axis: str,
    dst: int,
    src: int,
    shape: Sequence[int] | None = None,
    tag: int = 0,
) -> Handle:
    """Send ``tensor`` to the rank with index ``dst`` within the ``axis`` group and receive a
    tensor of ``shape`` (default: ``tensor``'s) and ``tensor``'s dtype from index ``src``,
    without blocking: the handle's ``wait()`` returns what arrived (``tensor`` must not
    change before it). One send and one receive posted together
    (``torch.distributed.batch_isend_irecv``), so that rings of them cannot deadlock on
    backends that run point-to-point operations in order (NCCL). Counted as :func:`send`
    counts: the bytes sent, kind ``p2p``, on ``axis``."""
    _check_device(tensor, grid, "p2p", axis)
    to, frm = _peer(grid, axis, dst, "send"), _peer(grid, axis, src, "recv")
    send_buf = tensor.contiguous()
    out = torch.empty(
        tuple(tensor.shape if shape is None else shape), dtype=tensor.dtype, device=tensor.device
    )
    account(grid, axis, "p2p", _nbytes(send_buf))
    group = grid.group(axis)
    what = (
        f"exchange with ranks {to} (send) and {frm} (recv) over grid axis '{axis}' on rank "
        f"{grid.global_rank}"
    )
    ops = [
        dist.P2POp(dist.isend, send_buf, to, group, tag),
        dist.P2POp(dist.irecv, out, frm, group, tag),
    ]
    try:
        works = dist.batch_isend_irecv(ops)
    except RuntimeError as e:
        raise CommError(f"{what} failed: {e}") from e
    return Handle(_Works(works), lambda: out, what)


def exchange_counts(counts: Sequence[int], grid: ProcessGrid, axis: str) -> list[int]:
    """All-to-all of one integer per peer: returns what each peer has for this rank."""
    if grid.group(axis) is None:
        return list(counts)
    t = torch.tensor(list(counts), dtype=torch.int64, device=grid.device)
    return all_to_all(t, grid, axis, [1] * len(counts), [1] * len(counts)).tolist()


def on_rank_zero(grid: ProcessGrid, work: Callable[[], object], failure: str) -> None:
    """Run ``work`` on global rank 0 while the other ranks wait (writing a folder every
    rank then reads): rank 0 raises its own error, every other rank a
    :class:`~gnnpar.errors.PeerFailedError` with ``failure``, instead of waiting for a
    collective rank 0 never reaches (collective over the world)."""
    from gnnpar.errors import PeerFailedError

    failed = torch.zeros(1, device=grid.device)
    if grid.global_rank == 0:
        try:
            work()
        except Exception:
            failed += 1
            all_reduce(failed, grid, "world")
            raise
    all_reduce(failed, grid, "world")
    if failed.item():
        raise PeerFailedError(failure)


def barrier(grid: ProcessGrid, axis: str = "world") -> None:
    """Wait until every rank of the ``axis`` group gets here."""
    group = grid.group(axis)
    if group is None:
        return
    try:
        dist.barrier(group=group)
    except RuntimeError as e:
        raise CommError(f"{_what('barrier', grid, axis)} failed: {e}") from e


# ------------------------------------------------------------------------ autograd pairs
class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid, axis):  # noqa: D102
        ctx.grid, ctx.axis = grid, axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return all_reduce(g.contiguous().clone(), ctx.grid, ctx.axis), None, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid, axis):  # noqa: D102
        return all_reduce(x.contiguous().clone(), grid, axis)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return g, None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid, axis, dim, sizes, out=None):  # noqa: D102
        ctx.grid, ctx.axis, ctx.dim, ctx.sizes = grid, axis, dim, sizes
        full = all_gather(x, grid, axis, dim=dim, sizes=sizes, out=out)
        # an alias, so the graph's history goes on it and not on the caller's buffer; it
        # shares the buffer's version counter, so a use saved past the next gather fails
        return full.detach() if full is out else full

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        out = reduce_scatter(g.contiguous(), ctx.grid, ctx.axis, dim=ctx.dim, sizes=ctx.sizes)
        return out, None, None, None, None, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid, axis, dim, sizes):  # noqa: D102
        n = x.shape[dim]
        ctx.grid, ctx.axis, ctx.dim = grid, axis, dim
        ctx.sizes = chunk_sizes(n, grid.size(axis)) if sizes is None else list(sizes)
        return reduce_scatter(x, grid, axis, dim=dim, sizes=ctx.sizes)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        out = all_gather(g.contiguous(), ctx.grid, ctx.axis, dim=ctx.dim, sizes=ctx.sizes)
        return out, None, None, None, None


class _SplitTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid, axis, dim, sizes):  # noqa: D102
        n = x.shape[dim]
        sizes = chunk_sizes(n, grid.size(axis)) if sizes is None else list(sizes)
        ctx.grid, ctx.axis, ctx.dim, ctx.sizes = grid, axis, dim, sizes
        me = grid.rank(axis)
        return x.narrow(dim, chunk_offsets(sizes)[me], sizes[me]).clone()

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        out = all_gather(g.contiguous(), ctx.grid, ctx.axis, dim=ctx.dim, sizes=ctx.sizes)
        return out, None, None, None, None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid, axis, dim, sizes):  # noqa: D102
        ctx.grid, ctx.axis, ctx.dim = grid, axis, dim
        ctx.sizes = sizes
        out = all_gather(x, grid, axis, dim=dim, sizes=sizes)
        if ctx.sizes is None:
            ctx.sizes = [x.shape[dim]] * grid.size(axis)
        # contiguous, as torch.cat's: gathered along the last dim the result is a permuted
        # view, and every later op that needs a contiguous input would copy it (a GPT's
        # residual stream starts here, and its layer norms copied it twice a block)
        return out.contiguous()

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        me = ctx.grid.rank(ctx.axis)
        start = chunk_offsets(ctx.sizes)[me]
        return g.narrow(ctx.dim, start, ctx.sizes[me]).clone(), None, None, None, None


def copy_to(x: torch.Tensor, grid: ProcessGrid, axis: str) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over ``axis`` backward."""
    return x if grid.group(axis) is None else _CopyTo.apply(x, grid, axis)


def reduce_from(x: torch.Tensor, grid: ProcessGrid, axis: str) -> torch.Tensor:
    """All-reduce (sum) over ``axis`` forward; identity backward."""
    return x if grid.group(axis) is None else _ReduceFrom.apply(x, grid, axis)


def all_reduce_both(x: torch.Tensor, grid: ProcessGrid, axis: str) -> torch.Tensor:
    """All-reduce (sum) over ``axis`` forward, and of the gradient backward: for a sum whose
    consumers differ from rank to rank (:func:`reduce_from` then :func:`copy_to`)."""
    return copy_to(reduce_from(x, grid, axis), grid, axis)


def _pair(
    fn: type[torch.autograd.Function],
    x: torch.Tensor,
    grid: ProcessGrid,
    axis: str,
    dim: int,
    sizes: Sequence[int] | None,
    *extra: object,
) -> torch.Tensor:
    if grid.group(axis) is None:
        return x
    return fn.apply(x, grid, axis, dim % x.dim(), None if sizes is None else list(sizes), *extra)


def gather_from(
    x: torch.Tensor,
    grid: ProcessGrid,
    axis: str,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-gather along ``dim`` forward; reduce-scatter of the gradient backward. ``out``:
    the buffer the gather may land in (see :func:`all_gather`); the caller must be done
    with the result before it reuses the buffer, and autograd keeps no reference to it."""
    if sizes is None and grid.group(axis) is not None:
        sizes = [x.shape[dim]] * grid.size(axis)
    return _pair(_GatherFrom, x, grid, axis, dim, sizes, out)


def scatter_to(
    x: torch.Tensor,
    grid: ProcessGrid,
    axis: str,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Reduce-scatter along ``dim`` forward; all-gather of the gradient backward."""
    return _pair(_ScatterTo, x, grid, axis, dim, sizes)


def split_to(
    x: torch.Tensor,
    grid: ProcessGrid,
    axis: str,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Keep this rank's chunk along ``dim`` forward (no communication); all-gather backward."""
    return _pair(_SplitTo, x, grid, axis, dim, sizes)


def gather_replicated(
    x: torch.Tensor,
    grid: ProcessGrid,
    axis: str,
    dim: int = 0,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """All-gather along ``dim`` forward (a contiguous result, as ``torch.cat``'s); keep this
    rank's chunk of the gradient backward."""
    return _pair(_GatherReplicated, x, grid, axis, dim, sizes)
