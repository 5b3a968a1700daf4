"""A checkpoint's layout, checked against itself before anything is read into a model.

The manifest's checksum catches a changed file and its meta checksum an edited value; this
module catches a layout that is consistent with its checksums but not with itself (an editor
who recomputed them, or a writer bug): every tensor has a known dtype and a shape of
non-negative sizes, every stored chunk names a listed file and a known tensor and lies inside
it, the distinct chunks of a tensor cover it without overlapping, and each stored entry holds
the elements its chunks address and (from version 2) the values its digest describes. Each
failure is one :class:`~gnnpar.verified.FormatError` naming the file.
"""

from __future__ import annotations

import math
import os
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any

import torch
import xxhash

from gnnpar.checkpoint.chunks import Chunk, overlap_volume
from gnnpar.checkpoint.protocol import READABLE, SCHEMA
from gnnpar.verified import MANIFEST, FormatError, Manifest, read_manifest

__all__ = [
    "check_header",
    "check_layout",
    "check_stored",
    "entry_digest",
    "has_digest",
    "is_size",
    "read_checkpoint",
    "stored_chunk",
]


def read_checkpoint(folder: str | os.PathLike) -> Manifest:
    """The manifest of the step folder ``folder``, read (:func:`gnnpar.verified.read_manifest`)
    and its layout checked (:func:`check_layout`)."""
    manifest = read_manifest(folder, SCHEMA, READABLE, sealed=False)
    check_header(manifest)
    check_layout(manifest)
    return manifest


def check_header(manifest: Manifest) -> None:
    """FormatError unless the manifest's step is a count (an int >= 0) and, in a step
    folder (``step-NNNNNN``), the one its name says, and the fields that describe the run
    have their types: ``grid`` axis sizes and ``world_size`` positive counts, ``aliases``
    names to names, ``info`` a table (a resealed manifest may hold anything)."""
    meta, where = manifest.meta, manifest.folder / MANIFEST
    step = meta.get("step")
    if not is_size(step):
        raise FormatError(f"{where}: the step must be a whole number >= 0, got {step!r}")
    name = manifest.folder.name
    named = name.removeprefix("step-")
    if name.startswith("step-") and named.isdigit() and int(named) != step:
        raise FormatError(f"{where}: says step {step}, but its folder is {name}")
    grid, world = meta.get("grid"), meta.get("world_size")
    if not isinstance(grid, dict) or not all(
        isinstance(a, str) and is_size(v) and v >= 1 for a, v in grid.items()
    ):
        raise FormatError(f"{where}: the grid must map axes to sizes, got {grid!r}")
    if not (is_size(world) and world >= 1):
        raise FormatError(f"{where}: world_size must be a count >= 1, got {world!r}")
    aliases = meta.get("aliases", {})
    if not isinstance(aliases, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
    ):
        raise FormatError(f"{where}: the aliases must map names to names")
    if not isinstance(meta.get("info") or {}, dict):
        raise FormatError(f"{where}: the info field must be a table")


def is_size(v: Any) -> bool:
    """Whether a value read from a file is a size or an offset: an int (not a bool) >= 0."""
    return type(v) is int and v >= 0


def _dtype(name: Any) -> torch.dtype | None:
    value = getattr(torch, name, None) if isinstance(name, str) and name else None
    return value if isinstance(value, torch.dtype) else None


def stored_chunk(doc: Any, where: Path) -> Chunk:
    """A stored chunk ``[key, offsets, sizes, at, transposed]`` with the right types."""
    ok = isinstance(doc, list) and len(doc) == 5
    if ok:
        key, offsets, sizes, at, transposed = doc
        ok = (
            isinstance(key, str)
            and isinstance(offsets, list)
            and isinstance(sizes, list)
            and len(offsets) == len(sizes)
            and all(is_size(v) for v in (*offsets, *sizes, at))
            and transposed in (0, 1)
        )
    if not ok:
        raise FormatError(f"{where}: malformed stored chunk {str(doc)[:80]}")
    return Chunk.from_json(doc)


def check_layout(manifest: Manifest) -> None:
    """FormatError unless the manifest's ``tensors`` and ``pieces`` describe every tensor
    exactly (see the module docstring)."""
    where = manifest.folder / MANIFEST
    # version 2 on: every stored entry has a digest (a table missing whole is no exception)
    digests = manifest.meta.get("digests", {}) if manifest.version >= 2 else None
    tensors, pieces = manifest.meta.get("tensors"), manifest.meta.get("pieces")
    if not isinstance(tensors, dict) or not isinstance(pieces, dict):
        raise FormatError(f"{where}: the meta lacks its 'tensors' or 'pieces' table")
    shapes: dict[str, list[int]] = {}
    for key, spec in tensors.items():
        shape = spec.get("shape") if isinstance(spec, dict) else None
        if not isinstance(shape, list) or not all(is_size(s) for s in shape):
            raise FormatError(f"{where}: tensor {key!r} has no valid shape ({shape!r})")
        if _dtype(spec.get("dtype")) is None:
            raise FormatError(f"{where}: tensor {key!r} has an unknown dtype {spec.get('dtype')!r}")
        shapes[key] = shape
    chunks: dict[str, list[Chunk]] = {key: [] for key in tensors}
    for file, entries in pieces.items():
        if file not in manifest.files or not isinstance(entries, dict):
            raise FormatError(f"{where}: pieces of {file!r}, a file the manifest does not list")
        for entry, docs in entries.items():
            if not isinstance(docs, list):
                raise FormatError(f"{where}: entry {entry!r} of {file!r} lists no chunks")
            if digests is not None and not has_digest(digests, file, entry):
                raise FormatError(f"{where}: entry {entry!r} of {file!r} has no digest")
            for doc in docs:
                c = stored_chunk(doc, where)
                shape = shapes.get(c.key)
                inside = (
                    shape is not None
                    and len(c.offsets) == len(shape)
                    and all(o + s <= n for o, s, n in zip(c.offsets, c.sizes, shape, strict=True))
                )
                if not inside or (c.transposed and len(c.sizes) != 2):
                    raise FormatError(
                        f"{where}: a chunk of {file!r} lies outside tensor {c.key!r} "
                        f"(shape {shape})"
                    )
                chunks[c.key].append(c)
    for key, shape in shapes.items():
        _check_cover(key, shape, chunks[key], where)
    _check_keys(manifest.meta, shapes, where)


def has_digest(digests: Any, file: str, entry: str) -> bool:
    """Whether the digest table ``digests`` (file → entry → digest) holds ``entry`` of
    ``file``'s (a table of any shape is read without error)."""
    table = digests.get(file) if isinstance(digests, dict) else None
    return isinstance(table, dict) and isinstance(table.get(entry), str)


def entry_digest(chunks: list[Any], flat: torch.Tensor) -> str:
    """XXH3-64 of what a stored entry means: for each of its chunks (:class:`Chunk` s or
    their JSON form), the full tensor's name, the box's offsets and sizes, and the box's
    values in the full tensor's row-major order. Where and how a box is stored (``at``,
    ``transposed``) changes the bytes read, so a layout edited after it was written (or
    written wrong) no longer matches the values it holds."""
    h = xxhash.xxh3_64()
    for c in chunks:
        chunk = c if isinstance(c, Chunk) else Chunk.from_json(c)
        h.update(_box_header(chunk).encode())
        if chunk.transposed:
            box = chunk.view(flat).contiguous().reshape(-1)
        else:  # stored row-major already: its bytes are a slice of the piece
            box = flat[chunk.at : chunk.at + chunk.numel].contiguous()
        h.update(box.view(torch.uint8).numpy())  # hashed in place, no copy of the bytes
    return h.hexdigest()


def _box_header(chunk: Chunk) -> str:
    """``json.dumps([key, offsets, sizes])``, without the encoder's per-call cost (a
    snapshot hashes every entry inside the training step)."""
    offsets = ", ".join(map(str, chunk.offsets))
    sizes = ", ".join(map(str, chunk.sizes))
    return f"[{encode_basestring_ascii(chunk.key)}, [{offsets}], [{sizes}]]"


def _check_keys(meta: dict[str, Any], shapes: dict[str, list[int]], where: Path) -> None:
    """``keys`` (the model's state-dict keys) are names whose tensors are stored, or tied
    names in ``aliases`` that point at such a key; ``inputs`` (optional) stored names that
    are not keys."""
    from gnnpar.checkpoint.state import MODEL

    keys, aliases = meta.get("keys"), meta.get("aliases")
    if not isinstance(keys, list) or not isinstance(aliases, dict):
        raise FormatError(f"{where}: the meta lacks its 'keys' or 'aliases'")
    for key in keys:
        target = aliases.get(key, key) if isinstance(key, str) else None
        if not isinstance(target, str) or target in aliases or MODEL + target not in shapes:
            raise FormatError(f"{where}: model key {key!r} names no stored tensor")
    inputs = meta.get("inputs", [])  # tensors kept beyond the state dict (optional)
    if not isinstance(inputs, list):
        raise FormatError(f"{where}: the meta's 'inputs' must be a list of tensor names")
    for key in inputs:
        if not isinstance(key, str) or key in keys or MODEL + key not in shapes:
            raise FormatError(f"{where}: input key {key!r} names no stored tensor of its own")


def _check_cover(key: str, shape: list[int], chunks: list[Chunk], where: Path) -> None:
    """The chunks of one tensor cover it: its distinct boxes (a replicated tensor, such as an
    optimizer's step count, is stored by several ranks as the same box) add up to its size
    and no two overlap."""
    chunks = list({(c.offsets, c.sizes): c for c in chunks}.values())
    total = sum(c.numel for c in chunks)
    if total != math.prod(shape):
        raise FormatError(
            f"{where}: the stored chunks of {key!r} hold {total} of its {math.prod(shape)} elements"
        )
    for i, a in enumerate(chunks):
        for b in chunks[i + 1 :]:
            if overlap_volume(a, b):
                raise FormatError(f"{where}: two stored chunks of {key!r} overlap")


def check_stored(
    manifest: Manifest, name: str, blob: dict[str, torch.Tensor], verify: str = "checksum"
) -> None:
    """FormatError unless the loaded file ``name`` holds every entry its pieces name, each
    a flat tensor long enough for the chunks stored in it and (``verify="checksum"``, a
    checkpoint of version 2 on) matching its :func:`entry_digest`."""
    digests = manifest.meta.get("digests", {}).get(name, {}) if manifest.version >= 2 else {}
    for entry, docs in manifest.meta["pieces"].get(name, {}).items():
        t = blob.get(entry)
        need = max((c[3] + math.prod(c[2]) for c in docs), default=0)
        if t is None or t.dim() != 1 or t.numel() < need:
            got = "nothing" if t is None else f"shape {list(t.shape)}"
            raise FormatError(
                f"{manifest.folder / name}: entry {entry!r} holds {got}, its chunks need "
                f"{need} elements"
            )
        if verify == "checksum" and entry in digests and entry_digest(docs, t) != digests[entry]:
            raise FormatError(
                f"{manifest.folder / name}: entry {entry!r} does not hold the values its "
                "layout and digest describe (the manifest was edited or written wrong)"
            )
