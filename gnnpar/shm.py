"""Same-host shared-memory transport for large CPU collectives.

gloo moves a CPU tensor between processes of one host through TCP loopback: a copy into the
kernel, a copy out of it, and the protocol's work, all on the cores that also compute. When
every rank of a group runs on one host, a collective can instead write each rank's input once
into a segment that all of them map, and read what it needs once (a 32 MB-per-rank all-gather
on 2 ranks takes about a tenth of gloo's time).

One :class:`Channel` serves one process group. Every collective on it walks its buffer in
windows that fit the segment (at most :func:`max_bytes`, default 16 MiB, so the transport's
memory is bounded whatever the tensor), and each window runs

1. a *sync*: every peer has finished reading the previous window, so the segment may be
   overwritten;
2. each rank writes its input into its slot of the segment;
3. a sync: every slot is written;
4. each rank reads what it needs. Sums run over the slots in group order, so the result is
   deterministic and bit-identical on every rank (replicas stay equal).

A sync is a one-element gloo all-reduce over the group, which gives the memory ordering on any
CPU, and turns a dead or slow peer into the same error and timeout as every gloo collective.
The segment is created under :func:`shm_dir` with its space reserved up front (so a full
``/dev/shm`` is an error at creation, never a crash at first write), mapped by every rank and
unlinked at once, so nothing is left behind even if a rank is killed. It grows to the largest
window seen; every rank agrees on each growth, and a group where the segment cannot be
made falls back to gloo for good, on every rank alike.

Only groups whose ranks share one host use it (checked by exchanging each host's boot id and
name), only for blocking collectives (:mod:`gnnpar.comm` keeps async ones on gloo, whose
threads overlap them with compute) of CPU tensors of at least :func:`min_bytes`
(``GNNPAR_SHM_MIN_BYTES``, default 256 KiB; smaller ones cost more in syncs than they
save), and never when ``GNNPAR_SHM=0``.
Traffic accounting is unchanged: :mod:`gnnpar.comm` counts the bytes of the collective, not of
the transport.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import socket
from collections.abc import MutableMapping

import torch
import torch.distributed as dist

from gnnpar.chunking import chunk_offsets, chunk_sizes
from gnnpar.errors import UserError

DEFAULT_MIN_BYTES = 256 * 1024
DEFAULT_MAX_BYTES = 16 << 20
_ALIGN = 64
#: The collectives the transport carries.
_SEGMENT_SLOTS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def shm_dir() -> str:
    """Where segments are created: ``GNNPAR_SHM_DIR``, default ``/dev/shm`` (a RAM file
    system; another folder works but pages through its disk)."""
    return os.environ.get("GNNPAR_SHM_DIR", "/dev/shm")


def enabled() -> bool:
    """Whether the transport may be used at all (``GNNPAR_SHM`` is not ``0``)."""
    return os.environ.get("GNNPAR_SHM", "1") != "0"


def _env_bytes(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"{name} must be a byte count, got {raw!r}") from None
    if value < minimum:
        raise UserError(f"{name} must be at least {minimum}, got {value}")
    return value


def min_bytes() -> int:
    """Smallest collective (bytes of its largest buffer) that goes through shared memory
    (``GNNPAR_SHM_MIN_BYTES``, default 256 KiB)."""
    return _env_bytes("GNNPAR_SHM_MIN_BYTES", DEFAULT_MIN_BYTES, 0)


def max_bytes() -> int:
    """Largest segment of a group (``GNNPAR_SHM_MAX_BYTES``, default 16 MiB): larger
    collectives move through it in windows, so the transport's memory stays bounded."""
    return _env_bytes("GNNPAR_SHM_MAX_BYTES", DEFAULT_MAX_BYTES, 1)


def _slot_room(slots: int) -> int:
    """Bytes of one of ``slots`` 64-byte aligned slots that fit :func:`max_bytes`."""
    return max(_ALIGN, max_bytes() // slots // _ALIGN * _ALIGN)


def segment_bytes(kind: str, full_bytes: float, p: int) -> int:
    """Bytes of the segment a collective of ``kind`` over ``p`` ranks on a full buffer of
    ``full_bytes`` (the all-gather's output, the reduce-scatter's input, the all-reduced
    tensor) makes its group map: 0 where gloo carries it (below :func:`min_bytes`, or the
    transport is off). Every rank of the group maps, and reads, all of it (the planner's
    memory model counts it)."""
    full = int(full_bytes)
    if p <= 1 or not enabled() or full < min_bytes() or kind not in _SEGMENT_SLOTS:
        return 0
    if kind == "broadcast":
        return min(_aligned(full), _slot_room(1))
    per_slot = full // p if kind == "all_gather" else full
    return p * min(_aligned(per_slot), _slot_room(p))


def _host_id() -> int:
    """A number that two processes share exactly when they share a host's ``/dev/shm``."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b""
    digest = hashlib.sha256(boot + b"|" + socket.gethostname().encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of the balanced chunks :func:`gnnpar.comm.chunk_sizes` gives."""

    sizes = chunk_sizes(n, parts)
    return [(o, o + s) for o, s in zip(chunk_offsets(sizes), sizes, strict=True)]


class Channel:
    """The shared segment of one process group, and the collectives that use it."""

    def __init__(self, group: dist.ProcessGroup, size: int, rank: int, token: int):
        self.group = group
        self.size = size
        self.rank = rank
        self.token = token
        self.usable = True
        self._generation = 0
        self._map: mmap.mmap | None = None
        self._bytes = torch.empty(0, dtype=torch.uint8)
        self._flag = torch.zeros(1, dtype=torch.int32)

    # ------------------------------------------------------------------ segment and syncs
    def sync(self) -> None:
        """Wait until every rank of the group reaches this point."""
        dist.all_reduce(self._flag, group=self.group)

    def _ensure(self, nbytes: int) -> bool:
        """Make the segment hold ``nbytes``; every rank calls it with the same size and gets
        the same answer."""
        if nbytes <= self._bytes.numel():
            return True
        self._generation += 1
        path = os.path.join(shm_dir(), f"gnnpar-{self.token & (2**64 - 1):016x}-{self._generation}")
        capacity = max(nbytes, min(2 * self._bytes.numel(), max_bytes()))
        ok = torch.ones(1, dtype=torch.int32)
        new_map = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, capacity)  # ENOSPC now, not SIGBUS later
                new_map = mmap.mmap(fd, capacity)
            finally:
                os.close(fd)
        except OSError:
            ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        # Every rank has mapped (or failed) by now: the name is no longer needed.
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        if not int(ok):
            self.usable = False
            return False
        self._map = new_map
        self._bytes = torch.frombuffer(new_map, dtype=torch.uint8)
        return True

    def _elems(self, offset: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        """``n`` elements of ``dtype`` at byte ``offset`` of the segment."""
        size = torch.empty(0, dtype=dtype).element_size()
        return self._bytes[offset : offset + n * size].view(dtype)

    def _window(self, need: int, esize: int, per_slot: int = 1, slots: int | None = None) -> int:
        """Elements per window: ``slots`` (default p) 64-byte aligned slots of
        ``per_slot``·window elements fit :func:`max_bytes` (at least one element each)."""
        room = _slot_room(slots or self.size)
        return max(1, min(need, room // (per_slot * esize)))

    def _begin(self, nbytes: int) -> bool:
        self.sync()  # every peer is done reading the last window
        return self._ensure(nbytes)

    # ------------------------------------------------------------------------ collectives
    # Each collective walks its buffer in windows that fit the segment; a window starts with
    # the sync that lets it overwrite the last one. Only the first window can grow the
    # segment, so a fallback to gloo (False) happens before anything was written.
    def all_gather(self, out: torch.Tensor, send: torch.Tensor) -> bool:
        """``out`` (p pieces of ``send``'s shape, concatenated) gets every rank's ``send``.
        Returns False (nothing done) where the group fell back to gloo."""
        src, dst = _as_bytes(send), _as_bytes(out)
        piece = src.numel()
        w = self._window(piece, 1)
        stride = _aligned(w)
        for o in range(0, piece, w):
            n = min(w, piece - o)
            if not self._begin(self.size * stride):
                return False
            self._bytes[self.rank * stride : self.rank * stride + n].copy_(src[o : o + n])
            self.sync()
            for r in range(self.size):
                dst[r * piece + o : r * piece + o + n].copy_(
                    self._bytes[r * stride : r * stride + n]
                )
        return True

    def reduce_scatter(self, out: torch.Tensor, send: torch.Tensor) -> bool:
        """``out`` gets chunk ``rank`` (of p equal chunks of the flat ``send``) of the sum of
        every rank's ``send``, summed in group order."""
        p, src, dst = self.size, send.reshape(-1), out.reshape(-1)
        chunk = dst.numel()
        w = self._window(chunk, src.element_size(), per_slot=p)
        stride = _aligned(p * w * src.element_size())
        for o in range(0, chunk, w):
            n = min(w, chunk - o)
            if not self._begin(p * stride):
                return False
            slot = self._elems(self.rank * stride, p * w, src.dtype)
            for c in range(p):  # slot r holds, per destination c, its part of c's chunk
                slot[c * w : c * w + n].copy_(src[c * chunk + o : c * chunk + o + n])
            self.sync()
            for r in range(p):
                part = self._elems(r * stride, p * w, src.dtype)[self.rank * w : self.rank * w + n]
                if r == 0:
                    dst[o : o + n].copy_(part)
                else:
                    dst[o : o + n].add_(part)
        return True

    def all_reduce(self, tensor: torch.Tensor, op: str) -> bool:
        """Reduce ``tensor`` in place (``op``: sum, max, min, product) over the group.

        Per window, rank r reduces chunk r over the slots in group order and writes it back
        over chunk r of its own slot (which no other rank reads); after a sync every rank
        copies chunk c from slot c. Every element is reduced once, so all ranks hold the same
        bits, and the segment holds p inputs, nothing more. On 2 ranks each rank reduces the
        whole window itself instead (in the same order, so to the same bits): it reads no
        more than the chunked way and saves a sync and two copies.
        """
        p, flat = self.size, tensor.reshape(-1)
        total = flat.numel()
        w = self._window(total, flat.element_size())
        stride = _aligned(w * flat.element_size())
        for o in range(0, total, w):
            n = min(w, total - o)
            if not self._begin(p * stride):
                return False
            mine = self._elems(self.rank * stride, n, flat.dtype)
            mine.copy_(flat[o : o + n])
            self.sync()
            if p == 2:
                first, second = self._elems(0, n, flat.dtype), self._elems(stride, n, flat.dtype)
                _combine_into(flat[o : o + n], first, second, op)
                continue
            bounds = _chunk_bounds(n, p)
            lo, hi = bounds[self.rank]
            acc = self._elems(0, n, flat.dtype)[lo:hi].clone()
            for r in range(1, p):
                _combine(acc, self._elems(r * stride, n, flat.dtype)[lo:hi], op)
            mine[lo:hi].copy_(acc)
            self.sync()
            for r, (a, b) in enumerate(bounds):
                flat[o + a : o + b].copy_(self._elems(r * stride, n, flat.dtype)[a:b])
        return True

    def broadcast(self, tensor: torch.Tensor, src_index: int) -> bool:
        """Copy the tensor of the rank with group index ``src_index`` into every rank's."""
        flat = _as_bytes(tensor)
        total = flat.numel()
        w = self._window(total, 1, slots=1)
        for o in range(0, total, w):
            n = min(w, total - o)
            if not self._begin(_aligned(w)):
                return False
            if self.rank == src_index:
                self._bytes[:n].copy_(flat[o : o + n])
            self.sync()
            if self.rank != src_index:
                flat[o : o + n].copy_(self._bytes[:n])
        return True


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def _combine(acc: torch.Tensor, part: torch.Tensor, op: str) -> None:
    if op == "sum":
        acc.add_(part)
    elif op == "product":
        acc.mul_(part)
    elif op == "max":
        torch.maximum(acc, part, out=acc)
    else:
        torch.minimum(acc, part, out=acc)


def _combine_into(out: torch.Tensor, first: torch.Tensor, second: torch.Tensor, op: str) -> None:
    """``out = first op second`` (what :func:`_combine` gives ``first`` updated by
    ``second``, bit for bit)."""
    if op == "sum":
        torch.add(first, second, out=out)
    else:
        out.copy_(first)
        _combine(out, second, op)


def channel(
    channels: MutableMapping[int, Channel],
    group: dist.ProcessGroup,
    device: torch.device,
    nbytes: int,
) -> Channel | None:
    """The channel of ``group`` for a collective whose largest buffer has ``nbytes``, or
    ``None`` when gloo should carry it.

    ``channels`` is the grid's own map (one channel per group). The first large collective
    on a group creates its channel collectively: a shared token from the group's first rank
    and the check that every rank shares this host.
    """
    if device.type != "cpu" or nbytes < min_bytes() or not enabled():
        return None
    key = id(group)
    chan = channels.get(key)
    if chan is None:
        size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        token = torch.tensor([int.from_bytes(os.urandom(8), "little", signed=True)])
        dist.broadcast(token, src=dist.get_global_rank(group, 0), group=group)
        hosts = [torch.empty(1, dtype=torch.int64) for _ in range(size)]
        dist.all_gather(hosts, torch.tensor([_host_id()]), group=group)
        chan = Channel(group, size, rank, int(token))
        chan.usable = all(int(h) == int(hosts[0]) for h in hosts)
        channels[key] = chan
    return chan if chan.usable else None


def release(channels: MutableMapping[int, Channel]) -> None:
    """Drop a grid's channels (their segments are unmapped once no tensor views them)."""
    channels.clear()
