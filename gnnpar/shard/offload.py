"""Offload tiers: the optimizer's master weights, its state and its step off the device.

``shard(..., offload="host")`` (ZeRO-Offload): every trainable master chunk is allocated in
host memory (pinned when the device is a GPU); the reduced gradient chunks are copied there,
the optimizer's state is created there (torch optimizers allocate it like the parameter) and
the optimizer step runs on the host; the updated masters travel back to the device in the
parameter all-gathers, which send ``master.to(device, dtype)``. On a CPU-only run host and
device are the same memory, so this tier saves nothing there by construction.

``shard(..., offload="file", offload_dir=...)`` (ZeRO-Infinity style): the trainable master
chunks and every per-element optimizer state tensor live in memory-mapped files in this
rank's folder ``<offload_dir>/rank<R>/``, so they are file-backed pages (page cache that the
kernel writes back and may evict), not anonymous memory: the rank's RssAnon drops by their
size (Adam: 3 × the master bytes). The step runs one flat group (a gradient bucket at stages
1–2, a unit at stage 3) at a time: a background thread copies the next group's master and
state from the files into working buffers while the current group is stepped, and writes
each stepped group back (then the working buffers are freed), so at most three groups'
worth of master and state are anonymous during a step and none between steps.

**Parameters at stage 3** (ZeRO-Infinity's parameter offload). A stage-3 unit's master chunk
is its parameters' only stored copy, so with a tier the parameters live there too: the
all-gather of a unit sends :meth:`HostTier.fetch`'s chunk — on a GPU a copy to the device (from
pinned memory, asynchronous), with the file tier a copy read out of the file into an
anonymous working buffer, freed once the gather has it. :meth:`FileTier.prefetch` starts that
read in the background thread: stage 3 reads the units ``prefetch_depth`` ahead of those it
gathers (:mod:`gnnpar.shard.zero3`), so the disk works while the current unit computes. A read
whose chunk changed since (a step, a checkpoint load) is taken again.

**Pages released after use.** A mapped page that was read or written stays in the process's
resident set (``RssFile``) until the kernel reclaims it. The file tier gives back the pages of
every range it has finished with — a unit's chunk once read, a group's master and state once
the step wrote them back, a bucket's masters once gathered, the initial values once written,
every file once a checkpoint or snapshot has read it or a load has written it — with
``madvise(MADV_DONTNEED)``: the data stays in the page cache (dirty pages are written back),
but the rank's resident set stays at its working buffers, whatever the size of the files.

The reduced gradient chunk lives in host memory with either tier, as in ZeRO-Offload and
ZeRO-Infinity (:meth:`gnnpar.shard.flat.FlatGroup.set_grad` moves it to the master's memory).

Folder rules: ``<offload_dir>/rank<R>/`` holds ``owner.json`` (process id and host, written
through a temporary name) and, while each is being created and mapped, a data file (unlinked
once mapped: the mapping keeps its blocks until the tensor is freed, so a run that crashes
leaves no data behind). A rank folder left by a run whose process has
ended (finished or crashed) is removed when a run starts; one whose owner process is still
alive (this one included: two ``shard()`` calls on one folder), or that another host wrote,
is refused (:class:`OffloadError`, naming the folder). The folder is removed when the tier
is closed (:meth:`ShardedModel.remove`, or when it is garbage-collected or the process
exits normally); the mappings stay valid until their tensors are freed. The data files are
scratch space, not artefacts: checkpoints (:mod:`gnnpar.checkpoint`) read the masters and
state through the mappings and write them into the checkpoint folder as usual; loading
writes into the mappings, and the optimizer state it creates is moved into files.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import errno
import functools
import json
import mmap
import os
import shutil
import socket
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gnnpar.atomic import os_error_message, write_json
from gnnpar.errors import UserError
from gnnpar.shard.flat import FlatGroup

__all__ = ["FileTier", "HostTier", "OffloadError", "make_tier"]

OWNER = "owner.json"
MADV_DONTNEED = 4  # <sys/mman.h> on Linux


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise``, or None where there is none (the pages are then left to the
    kernel)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def drop_resident_pages(t: torch.Tensor) -> int:
    """Take the whole pages under ``t`` out of this process's resident set
    (``MADV_DONTNEED``); returns the bytes released. Only for a view of a shared file
    mapping, whose pages keep their data in the page cache: on anonymous memory this would
    zero it (:meth:`FileTier.release` checks)."""
    fn = _madvise()
    if fn is None or not t.numel():
        return 0
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, end // page * page
    if hi <= lo or fn(lo, hi - lo, MADV_DONTNEED) != 0:
        return 0
    return hi - lo


class OffloadError(UserError):
    """A problem with the offload folder (one line, naming it)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HostTier:
    """Masters (and so the optimizer's state and step) in host memory."""

    kind = "host"
    chunked_step = False  # the optimizer's own step, unchanged

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"

    def master(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed master chunk of ``numel`` elements in host memory."""
        return torch.zeros(numel, dtype=dtype, pin_memory=self.pin)

    def adopt(self, optimizer: torch.optim.Optimizer, groups: list[FlatGroup]) -> None:
        """Take over state an optimizer received from outside (a checkpoint load)."""

    def file_bytes(self) -> int:
        """Bytes this rank holds in files."""
        return 0

    def fetch(self, group: FlatGroup, dtype: torch.dtype | None) -> torch.Tensor:
        """``group``'s master chunk on the device in ``dtype``, for its all-gather (from pinned
        memory, the copy to a GPU is asynchronous: the collective is queued behind it)."""
        return group.master.to(self.device, dtype or group.master.dtype, non_blocking=self.pin)

    def prefetch(self, group: FlatGroup) -> None:
        """Start getting what :meth:`fetch` will return (nothing to do in host memory)."""

    def forget_reads(self) -> None:
        """Drop reads :meth:`prefetch` started that nobody took."""

    def release(self, t: torch.Tensor) -> None:
        """Give back the resident pages of ``t`` if it lives in a file of this tier."""

    def release_all(self) -> None:
        """Give back the resident pages of every file of this tier."""


class FileTier(HostTier):
    """Masters and per-element optimizer state in memory-mapped files (module docstring)."""

    kind = "file"
    chunked_step = True  # the step goes through :meth:`step`

    def __init__(self, device: torch.device, folder: str | os.PathLike, rank: int):
        super().__init__(device)
        self.folder = Path(folder)
        self.dir = self.folder / f"rank{rank}"
        self._claim()
        self._files: dict[int, torch.Tensor] = {}  # storage pointer -> file-backed tensor
        self._state: dict[tuple[int, str], torch.Tensor] = {}  # (id(param), key) -> file tensor
        self._count = 0
        self._reads: dict[int, concurrent.futures.Future] = {}  # id(group) -> (version, chunk)
        #: bytes given back to the kernel (:meth:`release`), and the chunks :meth:`fetch`
        #: found read ahead or had to read on demand: for tests and benchmarks
        self.released = 0
        self.reads = {"ahead": 0, "on_demand": 0}
        #: bytes this tier copied out of its files and into them (the step's and the
        #: parameter reads'), counted when each copy is queued
        self.traffic = {"read": 0, "written": 0}
        # One thread: reads queue behind the writes of the last step, so none reads a
        # chunk that is still being written.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offload")
        self._finalizer = weakref.finalize(self, _cleanup, self._pool, self.dir)

    # ------------------------------------------------------------------------ folder
    def _claim(self) -> None:
        owner = self.dir / OWNER
        try:
            if self.dir.exists():
                try:
                    doc = json.loads(owner.read_text())
                    pid, host = int(doc["pid"]), str(doc["host"])
                except (OSError, ValueError, KeyError, TypeError):
                    pid, host = -1, ""
                if host and host != socket.gethostname():
                    raise OffloadError(
                        f"offload folder {self.dir} belongs to a run on host {host}; remove "
                        "it or give another offload_dir"
                    )
                if _alive(pid):
                    who = "this process" if pid == os.getpid() else f"process {pid}"
                    raise OffloadError(
                        f"offload folder {self.dir} is in use by {who}; give another "
                        "offload_dir"
                    )
                shutil.rmtree(self.dir)  # a finished or crashed run's scratch files
            self.dir.mkdir(parents=True)
            write_json(owner, {"pid": os.getpid(), "host": socket.gethostname()})
        except OSError as err:
            raise OffloadError(f"offload folder {os_error_message(err, self.dir)}") from None

    def _file(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed file-backed tensor (``MAP_SHARED``: writes go to the file's pages)."""
        path = self.dir / f"{name}.bin"
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        try:
            with open(path, "wb") as f:
                try:  # reserve the blocks now: a full disk fails here, not as a fault later
                    os.posix_fallocate(f.fileno(), 0, max(nbytes, 1))
                except OSError as err:
                    if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # not supported here
                        raise
                    f.truncate(max(nbytes, 1))
            t = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
            # The mapping keeps the file's blocks; unlinked now, a crashed run leaves no data
            # behind (only its folder and owner.json, which the next run removes).
            path.unlink()
        except OSError as err:
            raise OffloadError(f"offload file {os_error_message(err, path)}") from None
        if numel:
            self._files[t.untyped_storage().data_ptr()] = t
        return t

    def master(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed master chunk in a file of this rank's folder."""
        self._count += 1
        return self._file(f"master{self._count}", numel, dtype)

    def file_bytes(self) -> int:
        """Bytes of the mapped files (masters and optimizer state)."""
        return _nbytes(*self._files.values())

    def _in_file(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._files

    def release(self, t: torch.Tensor) -> None:
        """Give back the resident pages of ``t`` (a view of one of this tier's files; other
        tensors are left alone)."""
        if self._in_file(t):
            self.released += drop_resident_pages(t)

    def release_all(self) -> None:
        """Give back the resident pages of every mapped file (after a checkpoint read or
        wrote the masters and the state through the mappings)."""
        for t in list(self._files.values()):
            self.release(t)

    # ------------------------------------------------------------- parameters (stage 3)
    def _read_chunk(self, group: FlatGroup) -> tuple[int, torch.Tensor]:
        """(Background or not.) The master chunk copied out of its file into host memory
        (pinned for a GPU), and the version it was read at; the file's pages are given
        back."""
        version = group.version
        with torch.no_grad():
            out = torch.empty_like(group.master, pin_memory=self.pin).copy_(group.master)
        self.release(group.master)
        return version, out

    def prefetch(self, group: FlatGroup) -> None:
        """Start reading ``group``'s chunk in the background thread (once)."""
        if id(group) not in self._reads and group.master.numel():
            self.traffic["read"] += group.nbytes()
            self._reads[id(group)] = self._pool.submit(self._read_chunk, group)

    def fetch(self, group: FlatGroup, dtype: torch.dtype | None) -> torch.Tensor:
        """``group``'s chunk in a working buffer on the device, in ``dtype``: from the
        background read if one was started and the chunk has not changed since, else read
        now (the copy to the device and the cast run here, in the caller's thread)."""
        read = self._reads.pop(id(group), None)
        chunk = None
        if read is not None:
            version, chunk = read.result()
            if version != group.version:
                chunk = None
        self.reads["ahead" if chunk is not None else "on_demand"] += 1
        if chunk is None:
            self.traffic["read"] += group.nbytes()
            chunk = self._read_chunk(group)[1]
        return chunk.to(self.device, dtype or chunk.dtype, non_blocking=self.pin)

    def forget_reads(self) -> None:
        """Wait for and drop the background reads nobody took (their buffers are freed)."""
        reads, self._reads = self._reads, {}
        for read in reads.values():
            read.result()

    def _state_file(self, param: torch.Tensor, key: str, like: torch.Tensor) -> torch.Tensor:
        tag = (id(param), key)
        t = self._state.get(tag)
        if t is None or t.shape != like.shape or t.dtype != like.dtype:
            self._count += 1
            t = self._file(f"state{self._count}.{key}", like.numel(), like.dtype).view(like.shape)
            self._state[tag] = t
        return t

    # ------------------------------------------------------------------------ state
    @staticmethod
    def _per_element(param: torch.Tensor, items: dict) -> list[tuple[str, torch.Tensor]]:
        return [
            (k, v)
            for k, v in items.items()
            if isinstance(v, torch.Tensor) and v.shape == param.shape and param.dim() > 0
        ]

    def adopt(self, optimizer: torch.optim.Optimizer, groups: list[FlatGroup]) -> None:
        """Move per-element state that is not in a file (loaded from a checkpoint) into
        this rank's files."""
        with torch.no_grad():
            for g in groups:
                for piece in g.pieces:
                    st = optimizer.state.get(piece.param)
                    if not st:
                        continue
                    for k, v in self._per_element(piece.param, st):
                        if not self._in_file(v):
                            f = self._state_file(piece.param, k, v)
                            f.copy_(v)
                            st[k] = f

    # ------------------------------------------------------------------------ step
    def step(
        self,
        optimizer: torch.optim.Optimizer,
        inner: Callable,
        groups: list[FlatGroup],
        closure: Callable | None = None,
    ) -> Any:
        """Step ``groups`` one at a time with ``inner`` (the optimizer's own step): read the
        next group from the files in the background, step the current one in working
        buffers, write it back in the background."""
        chunks = [g for g in groups if g.pieces]
        saved = [grp["params"] for grp in optimizer.param_groups]
        reads: dict[int, concurrent.futures.Future] = {}
        writes: collections.deque = collections.deque()
        loss = None
        pool = self._pool
        try:
            if chunks:
                reads[0] = pool.submit(self._read, self._read_plan(optimizer, chunks[0]))
            for i, g in enumerate(chunks):
                work = reads.pop(i).result()
                if i + 1 < len(chunks):
                    plan = self._read_plan(optimizer, chunks[i + 1])
                    reads[i + 1] = pool.submit(self._read, plan)
                while writes and writes[0].done():
                    self._rebind(optimizer, writes.popleft().result())
                self._bind(optimizer, g, work)
                ids = {id(piece.param) for piece in g.pieces}
                for grp, params in zip(optimizer.param_groups, saved, strict=True):
                    grp["params"] = [p for p in params if id(p) in ids]
                out = inner(closure) if i == 0 else inner()
                loss = out if i == 0 else loss
                writes.append(pool.submit(self._write, self._write_plan(optimizer, g, work)))
        finally:
            for grp, params in zip(optimizer.param_groups, saved, strict=True):
                grp["params"] = params
            for f in reads.values():
                f.result()
            while writes:
                self._rebind(optimizer, writes.popleft().result())
        return loss

    def _read_plan(self, optimizer: torch.optim.Optimizer, g: FlatGroup) -> tuple:
        state = []
        for piece in g.pieces:
            st = optimizer.state.get(piece.param) or {}
            state += [(piece.param, k, v) for k, v in self._per_element(piece.param, st)]
        self.traffic["read"] += _nbytes(g.master, *(v for *_, v in state))
        return g.master, state

    def _read(self, plan: tuple) -> tuple:
        """(Background.) Working copies of a group's master and file-backed state."""
        master, state = plan
        with torch.no_grad():
            out = master.clone(), [(p, k, v.clone()) for p, k, v in state]
        for t in (master, *(v for _, _, v in state)):
            self.release(t)
        return out

    @staticmethod
    def _bind(optimizer: torch.optim.Optimizer, g: FlatGroup, work: tuple) -> None:
        master, state = work
        for piece in g.pieces:
            piece.param.data = master[piece.chunk_offset : piece.chunk_offset + piece.numel]
        for p, k, v in state:
            optimizer.state[p][k] = v

    def _write_plan(self, optimizer: torch.optim.Optimizer, g: FlatGroup, work: tuple) -> tuple:
        state = []
        for piece in g.pieces:
            for k, v in self._per_element(piece.param, optimizer.state.get(piece.param) or {}):
                state.append((piece.param, k, v, self._state_file(piece.param, k, v)))
        self.traffic["written"] += _nbytes(g.master, *(f for *_, f in state))
        return g, work[0], state

    def _write(self, plan: tuple) -> tuple:
        """(Background.) Copy a stepped group's master and state into its files, and give
        their pages back (the page cache keeps them until they are written out)."""
        g, master, state = plan
        with torch.no_grad():
            g.master.copy_(master)
            for _, _, v, f in state:
                f.copy_(v)
        self.release(g.master)
        for *_, f in state:
            self.release(f)
        return g, [(p, k, f) for p, k, _, f in state]

    @staticmethod
    def _rebind(optimizer: torch.optim.Optimizer, done: tuple) -> None:
        """Point a written group's pieces and state back at the files (the working buffers
        are then freed)."""
        g, state = done
        for piece in g.pieces:
            piece.param.data = g.master[piece.chunk_offset : piece.chunk_offset + piece.numel]
        for p, k, f in state:
            optimizer.state[p][k] = f

    def close(self) -> None:
        """Stop the background thread and remove this rank's folder."""
        self._finalizer()


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _cleanup(pool: concurrent.futures.ThreadPoolExecutor, folder: Path) -> None:
    pool.shutdown(wait=True)
    shutil.rmtree(folder, ignore_errors=True)


def make_tier(
    offload: str, offload_dir: str | os.PathLike | None, device: torch.device, rank: int
) -> HostTier | None:
    """The tier of ``offload`` (None for ``"none"``)."""
    if offload == "host":
        return HostTier(device)
    if offload == "file":
        return FileTier(device, offload_dir, rank)
    return None
