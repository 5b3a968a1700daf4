"""Tensor packs: named tensors as their raw bytes one after another, with the layout (each
name's dtype, shape and byte offset) kept apart, in JSON.

A snapshot is written inside the training step (:mod:`gnnpar.checkpoint.snapshot`), so its
file must cost no more than the copy of its bytes: a pack is written straight from the
tensors' memory (no serialiser, no archive, no intermediate buffer), hashed as it is
written, and read back by mapping the file and viewing each tensor in place. Nothing in it is
ever unpickled: the reader takes only the dtypes it knows, and offsets and sizes that lie
inside the file.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import xxhash

from gnnpar.checkpoint.validate import is_size
from gnnpar.verified import CHECKSUM, FormatError

__all__ = ["filled", "load_pack", "mapped", "save_pack"]

#: Each tensor's bytes start at a multiple of this (any dtype's alignment, a cache line).
ALIGN = 64
#: The dtypes a pack holds, by the name its layout gives.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_NAMES: dict[torch.dtype, str] = {d: name for name, d in DTYPES.items()}
_PAD = bytes(ALIGN)


def save_pack(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    written: Callable[[str, torch.Tensor], None] | None = None,
) -> tuple[dict, dict]:
    """Write ``tensors`` (any device; copied to the host only when not there) into ``path``;
    return their layout (name → ``{"dtype", "shape", "offset"}``) and the file's entry (its
    size and XXH3-64 checksum, as :meth:`gnnpar.verified.Manifest.verify` checks it). An
    existing file is overwritten in place, its pages reused, and cut to the pack's size.
    ``written(name, flat host tensor)`` is called right after each tensor's bytes are
    written, while they are still in cache (a snapshot hashes each entry there)."""
    layout: dict[str, dict[str, Any]] = {}
    h = xxhash.xxh3_64()
    at = 0
    fd = _open_in_place(path)
    try:
        for name, tensor in tensors.items():
            dtype = _NAMES.get(tensor.dtype)
            if dtype is None:
                raise ValueError(f"a tensor pack cannot hold {name!r} of dtype {tensor.dtype}")
            flat = tensor.detach().reshape(-1).to("cpu").contiguous()
            data = flat.view(torch.uint8).numpy()
            pad = -at % ALIGN
            if pad:
                _write_all(fd, _PAD[:pad])
                h.update(_PAD[:pad])
                at += pad
            layout[name] = {"dtype": dtype, "shape": list(tensor.shape), "offset": at}
            _write_all(fd, data)
            h.update(data)
            at += data.nbytes
            if written is not None:
                written(name, flat)
        os.ftruncate(fd, at)
    finally:
        os.close(fd)
    return layout, {"size": at, CHECKSUM: h.hexdigest()}


def _write_all(fd: int, data: Any) -> None:
    """All of ``data`` to ``fd`` (one call writes a regular file whole, but need not)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def load_pack(path: str | os.PathLike, layout: Any) -> dict[str, torch.Tensor]:
    """The tensors of the pack ``path`` as ``layout`` describes them, viewed in the file's
    pages (mapped copy-on-write: writable, never written back). FormatError naming the file
    when the layout is malformed or points outside it. The file's checksum is the caller's
    to check (:meth:`gnnpar.verified.Manifest.verify`)."""
    if not isinstance(layout, dict):
        raise FormatError(f"{path}: the pack's layout is not a table")
    try:
        buf = mapped(path)
    except OSError as err:
        raise FormatError(f"{path}: cannot read the tensor pack ({err.strerror})") from None
    size, out = len(buf), {}
    for name, doc in layout.items():
        dtype, shape, offset = _entry(path, name, doc)
        numel = math.prod(shape)
        nbytes = numel * dtype.itemsize
        if offset % ALIGN or offset + nbytes > size:
            raise FormatError(f"{path}: {name!r} lies outside the file ({size} bytes)")
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
        out[name] = raw.view(dtype).reshape(shape)
    return out


def _entry(path: Any, name: Any, doc: Any) -> tuple[torch.dtype, list[int], int]:
    """One layout entry, checked: its dtype, shape and offset."""
    ok = (
        isinstance(name, str)
        and isinstance(doc, dict)
        and isinstance(doc.get("dtype"), str)
        and doc["dtype"] in DTYPES
        and isinstance(doc.get("shape"), list)
        and all(is_size(n) for n in doc["shape"])
        and is_size(doc.get("offset"))
    )
    if not ok:
        raise FormatError(f"{path}: malformed layout entry {name!r}")
    return DTYPES[doc["dtype"]], doc["shape"], doc["offset"]


def mapped(path: str | os.PathLike) -> memoryview:
    """The bytes of ``path``, mapped copy-on-write and never written back: read in place (on
    a tmpfs, memory already), not copied into this process; writable, as
    ``torch.frombuffer`` wants it. OSError as ``open`` raises it."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return memoryview(bytearray())
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))


@contextlib.contextmanager
def filled(path: str | os.PathLike, size: int) -> Iterator[memoryview]:
    """A writable map of the file ``path`` cut to ``size`` bytes, over the file's own pages
    (an existing file's reused, faulted in up front): what is written into it is the file, with
    no buffer between (a snapshot's copy received straight into its file). Every export of
    the view (a tensor over it) must be gone when the block ends. OSError as ``open`` raises
    it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        os.ftruncate(fd, size)
        if size == 0:
            yield memoryview(bytearray())
            return
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # Linux: no fault a page
        with mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
            with memoryview(m) as view:
                yield view
    finally:
        os.close(fd)


def _open_in_place(path: str | os.PathLike) -> int:
    """``path`` opened for writing without truncating it: an existing file's pages are
    overwritten, not freed and allocated again (the writer cuts it to size when done)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
