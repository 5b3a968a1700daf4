"""In-memory snapshots (REFT): the checkpoint of a step kept in node-local shared memory, with
a copy on the next node, so that a restart loses (almost) no steps and reads no disk.

Every ``snapshot_every`` steps each rank writes its pieces of the model and of the optimizer
state (the same pieces a checkpoint holds, :func:`gnnpar.checkpoint.store.rank_pieces`, but
all of them: a rank restores from its own file alone), its RNG state and the task's position
into its node's snapshot folder, a tmpfs (``/dev/shm``: memory that outlives the worker
process, not the node), as a tensor pack (:mod:`gnnpar.checkpoint.pack`: the bytes, straight
from the tensors, hashed as they are written) and its record. That is the part the step waits
for, and it is done before the step is logged: **a killed process loses no step that was
logged.** A background thread then sends both to the rank's *peer* (the rank with the same
local rank on the next node, over a gloo group of its own), which writes the copy into its
own node's folder::

    <snapshot_dir>/<run id>/node-<N>/step-<S>/rank-<R>.bin    rank R's tensors at step S
                                              rank-<R>.json   its record, written last

Node N's folder holds its own ranks' files and the copies of the previous node's ranks'.
Each file is written under a temporary name and renamed; the record, written last, names
the run, the step, the rank and the grid and carries the file's size, checksum and layout
and each entry's digest: a torn write (no record, or a file that does not match it),
another run's file, or another step's is refused with a warning and the next source tried.
Each rank keeps its newest :data:`KEEP` snapshots (of its own and of the copies it holds).

:func:`restore` (collective, at a restart on the same grid): every rank lists its snapshots
whose records check out (this run, step, rank and grid, a file of the recorded size) — its
own, and the copies it holds of its predecessor's — the ranks agree on the newest step every
rank can be given, a rank whose own copy is gone (its node was replaced) receives the copy
its peer holds, and each verifies its file (checksum and digests) and loads it through the
checkpoint loader (:func:`~gnnpar.checkpoint.store.plan_restore`); when a rank's file fails
the verification, every rank agrees on the next older step instead. The trainer compares
that step with the newest disk checkpoint and takes the fresher.

On one node (``ranks_per_node`` = world size) there is no peer: the node-local copy outlives
a killed process, not a lost node. ``--ranks-per-node`` simulates several nodes on one host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gnnpar import comm
from gnnpar.atomic import atomic_write, os_error_message
from gnnpar.checkpoint.pack import filled, load_pack, mapped, save_pack
from gnnpar.checkpoint.protocol import CheckpointError
from gnnpar.checkpoint.state import model_layout
from gnnpar.checkpoint.store import LOCAL, apply_restore, plan_restore, rank_pieces
from gnnpar.checkpoint.validate import check_stored, entry_digest, has_digest, stored_chunk
from gnnpar.failpoints import failpoint
from gnnpar.grid import ProcessGrid
from gnnpar.verified import FormatError, Manifest

__all__ = [
    "KEEP",
    "SCHEMA",
    "Restored",
    "SnapshotWriter",
    "default_root",
    "restore",
]

SCHEMA = "gnnpar.snapshot"
VERSION = 2  # 1: a torch.save file, written in the background
#: Snapshots each rank keeps of its own, and of the copies it holds.
KEEP = 2
#: Candidate steps a rank reports at a restore (own and held, :data:`KEEP` each).
_SLOTS = 2 * KEEP


def default_root() -> Path:
    """``/dev/shm/gnnpar-snapshots`` where there is a ``/dev/shm`` (tmpfs: memory), else a
    folder in the temporary directory."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / "gnnpar-snapshots"


def _stem(rank: int) -> str:
    return f"rank-{rank:05d}"


def _data(rank: int) -> str:
    """Rank ``rank``'s tensor file (a pack) in a step folder."""
    return f"{_stem(rank)}.bin"


def _step_dir(node_dir: Path, step: int) -> Path:
    return node_dir / f"step-{step:06d}"


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where a rank's snapshots live: its node's folder, its peer (the rank on the next node
    that holds a copy of its snapshots) and its predecessor (whose copies it holds)."""

    node_dir: Path
    peer: int | None
    predecessor: int | None

    @classmethod
    def of(cls, root: Path, run_id: str, grid: ProcessGrid) -> _Placement:
        rank, world, per_node = grid.global_rank, grid.world_size, grid.ranks_per_node
        node_dir = root / run_id / f"node-{grid.node():03d}"
        if per_node >= world:
            return cls(node_dir, None, None)
        return cls(node_dir, (rank + per_node) % world, (rank - per_node) % world)


def _record(
    run_id: str, step: int, rank: int, grid: ProcessGrid, file: dict, meta: dict[str, Any]
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "run": run_id,
        "step": step,
        "rank": rank,
        "grid": grid.shape,
        "world_size": grid.world_size,
        "file": file,
        **meta,
    }


def _write_tensors(
    folder: Path, rank: int, write: Callable[[str], None], reuse: Path | None = None
) -> None:
    """Rank ``rank``'s tensor file in ``folder``, written by ``write(tmp_path)`` over
    ``reuse`` when given (a pruned snapshot's file: :func:`_prune`)."""
    atomic_write(folder / _data(rank), write, reuse)


def _write_record(folder: Path, rank: int, record: dict[str, Any], step: int) -> None:
    """Rank ``rank``'s record, after its tensor file: a file without one is a torn write."""
    failpoint("snapshot", step, record["writer"])  # a chaos run's kill mid-snapshot
    text = json.dumps(record)
    atomic_write(folder / f"{_stem(rank)}.json", lambda tmp: Path(tmp).write_text(text))


def _spare(node_dir: Path, rank: int) -> Path:
    """Where rank ``rank``'s pruned tensor file waits, outside every step folder, for the next
    snapshot to overwrite it in place (:func:`~gnnpar.atomic.atomic_write`'s ``reuse``)."""
    return node_dir / f".spare-{_data(rank)}"


def _prune(node_dir: Path, rank: int, keep_from: int) -> None:
    """Remove rank ``rank``'s files of the steps before ``keep_from`` (and a step folder
    left empty); one tensor file is kept aside as the rank's spare (:func:`_spare`)."""
    stem = _stem(rank)
    for folder in node_dir.glob("step-*"):
        step = _step_number(folder)
        if step is None or step >= keep_from:
            continue
        (folder / f"{stem}.json").unlink(missing_ok=True)  # first: never a complete-looking half
        try:
            os.replace(folder / _data(rank), _spare(node_dir, rank))
        except OSError:
            pass  # none there
        try:
            folder.rmdir()
        except OSError:
            pass  # other ranks' files are still there


def _step_number(folder: Path) -> int | None:
    try:
        return int(folder.name.removeprefix("step-"))
    except ValueError:
        return None


class SnapshotWriter:
    """Takes a rank's snapshots (see the module docstring); one per rank, made on every rank
    of ``grid`` together (it creates a gloo group for the copies to peers)."""

    def __init__(self, root: str | os.PathLike, run_id: str, grid: ProcessGrid):
        self.root = Path(root)
        self.run_id = run_id
        self.grid = grid
        self.place = _Placement.of(self.root, run_id, grid)
        # the copies to peers travel on a group of their own, from the writer thread
        self._group = None
        if grid.distributed and self.place.peer is not None:
            self._group = dist.new_group(backend="gloo", timeout=grid.timeout)
        self._background = _Background()
        self._steps: list[int] = []  # own snapshots written, oldest first
        #: Seconds the last :meth:`take` held the training loop (waiting for the previous
        #: snapshot, then copying to host memory), and the last background write's seconds.
        self.last_wait_s = 0.0
        self.last_copy_s = 0.0
        self.last_write_s = 0.0

    def take(
        self,
        step: int,
        model: Any,
        optimizer: torch.optim.Optimizer | None,
        extra: Mapping[str, Any],
        local: Mapping[str, torch.Tensor],
    ) -> None:
        """Snapshot the state after ``step``: write this rank's file and record now (once
        this returns, the snapshot outlives the process), and its copy to the peer in the
        background (a failed earlier copy is raised here, naming its file)."""
        t0 = time.perf_counter()
        self.wait()
        t1 = time.perf_counter()
        rank = self.grid.global_rank
        layout, pieces, tensors, groups = rank_pieces(self.grid, model, optimizer)
        blob, entries = {}, {}
        stored = [p for p in pieces if p.chunks]
        for p in stored:  # host tensors as they are (no copy); a device's, copied to host
            blob[p.name] = p.tensor.detach().reshape(-1).to("cpu")
            entries[p.name] = [c.to_json() for c in p.chunks]
        for name, t in local.items():
            blob[LOCAL + name] = t.detach().to("cpu")
        folder = _step_dir(self.place.node_dir, step)
        try:
            packed: dict[str, Any] = {}
            chunks = {p.name: p.chunks for p in stored}
            digests: dict[str, str] = {}

            def digest(name: str, flat: torch.Tensor) -> None:
                if name in chunks:  # each entry hashed while its bytes are in cache
                    digests[name] = entry_digest(chunks[name], flat)

            def write(tmp: str) -> None:
                packed["layout"], packed["file"] = save_pack(tmp, blob, digest)

            _write_tensors(folder, rank, write, _spare(self.place.node_dir, rank))
            meta = {
                "pieces": entries,
                "tensors": {k: v.to_json() for k, v in tensors.items()},
                "keys": layout.keys,
                "aliases": layout.aliases,
                **({"inputs": layout.inputs} if layout.inputs else {}),
                "optimizer": {"param_groups": groups} if groups is not None else None,
                "local": sorted(local),
                "extra": json.loads(json.dumps(dict(extra))),  # a copy, as JSON will read it
                "layout": packed["layout"],
                "digests": digests,
                "writer": rank,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"
                ),
            }
            if layout.after_read is not None:
                layout.after_read()
            record = _record(self.run_id, step, rank, self.grid, packed["file"], meta)
            _write_record(folder, rank, record, step)
        except OSError as err:
            raise CheckpointError(os_error_message(err) + " (writing a snapshot)") from None
        self.last_wait_s, self.last_copy_s = t1 - t0, time.perf_counter() - t1
        self._background.start(self._share, step, record)

    def _share(self, step: int, record: dict[str, Any]) -> None:
        """The background half of a snapshot: the copy to the peer (and the predecessor's
        copy received and written), then the snapshots past :data:`KEEP` removed."""
        t0 = time.perf_counter()
        rank = self.grid.global_rank
        folder = _step_dir(self.place.node_dir, step)
        pred = self.place.predecessor
        try:
            if self.place.peer is not None:
                data = mapped(folder / _data(rank))
                got: dict[str, Any] = {}

                def receive(tmp: str) -> None:  # the predecessor's copy, straight into its file
                    with contextlib.ExitStack() as files:
                        got.update(self._exchange(data, record, files, tmp))

                _write_tensors(folder, pred, receive, _spare(self.place.node_dir, pred))
                got["writer"] = rank  # the copy's holder
                _write_record(folder, pred, got, step)
        except OSError as err:
            raise CheckpointError(os_error_message(err) + " (writing a snapshot)") from None
        self._steps.append(step)
        if len(self._steps) > KEEP:
            oldest = self._steps[-KEEP]
            _prune(self.place.node_dir, rank, oldest)
            if self.place.predecessor is not None:
                _prune(self.place.node_dir, self.place.predecessor, oldest)
        self.last_write_s = time.perf_counter() - t0

    def _exchange(
        self, data: memoryview, record: dict[str, Any], files: contextlib.ExitStack, into: str
    ) -> dict[str, Any]:
        """Send this rank's snapshot to its peer and receive its predecessor's into the file
        ``into`` (mapped on ``files``, which closes it); its record."""
        _, got = _send_receive(
            data,
            record,
            self.place.peer,
            self.place.predecessor,
            self._group,
            into=lambda size: files.enter_context(filled(into, size)),
        )
        return got

    def wait(self) -> None:
        """Wait for the copy being sent (its error, if it failed, is raised here)."""
        self._background.wait()

    def close(self, wait: bool = True) -> None:
        """Finish the pending copy; without ``wait`` (a run that failed: its peer may be
        gone), leave it to end with the process, which does not wait for it."""
        if not wait:
            return
        self.wait()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None


class _Background:
    """One job at a time on a daemon thread. A failed run's process exits without waiting for
    it: a ``ThreadPoolExecutor``'s threads are joined at exit whatever ``shutdown(wait=False)``
    said, so an exchange stuck on a peer that will never answer held the exit, and so the
    restart, until the collectives' timeout."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, job: Callable[..., None], *args: Any) -> None:
        """Run ``job(*args)`` in the background (after :meth:`wait`)."""
        self.wait()

        def run() -> None:
            try:
                job(*args)
            except BaseException as err:  # noqa: BLE001 - raised again by wait()
                self._error = err

        self._thread = threading.Thread(target=run, name="snapshot", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the job; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _send_receive(
    data: Any,
    record: dict[str, Any] | None,
    to: int | None,
    frm: int | None,
    group: Any,
    into: Callable[[int], Any] | None = None,
) -> tuple[memoryview | None, dict[str, Any]] | None:
    """Send ``data`` (a buffer) and ``record`` to rank ``to`` and receive the same from
    ``frm`` (either may be None: one way only), point-to-point on ``group`` (None: the
    world): sizes first, then the bytes, then the record, none of them copied into one
    message. Returns what was received (None when nothing was): its bytes, in place, and its
    record; with ``into`` (a writable buffer of the given size, e.g. a file's map) the bytes
    are received there, and None is returned in their place."""
    sizes = got_sizes = None
    if to is not None:
        text = json.dumps(record).encode()
        sizes = torch.tensor([len(data), len(text)], dtype=torch.int64)
    if frm is not None:
        got_sizes = torch.empty(2, dtype=torch.int64)
    _exchange_pair(sizes, to, got_sizes, frm, group)
    out = got = None
    if to is not None:
        view = memoryview(data)
        out = [_as_bytes(bytearray(view) if view.readonly else view), _as_bytes(bytearray(text))]
    if frm is not None:
        n, text_size = (int(v) for v in got_sizes)
        payload = _as_bytes(into(n)) if into is not None else torch.empty(n, dtype=torch.uint8)
        got = [payload, torch.empty(text_size, dtype=torch.uint8)]
    for i in range(2):
        _exchange_pair(out and out[i], to, got and got[i], frm, group)
    if got is None:
        return None
    bytes_in = None if into is not None else memoryview(got[0].numpy())
    return bytes_in, json.loads(bytes(got[1].numpy()).decode())


def _as_bytes(buf: Any) -> torch.Tensor:
    """A uint8 tensor over ``buf`` (writable), no copy; empty when it is."""
    return (
        torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    )


def _exchange_pair(
    send: torch.Tensor | None, to: int | None, recv: torch.Tensor | None, frm: int | None, group
) -> None:
    reqs = []
    if send is not None:
        reqs.append(dist.isend(send, to, group=group))
    if recv is not None:
        reqs.append(dist.irecv(recv, frm, group=group))
    for r in reqs:
        r.wait()


# ----------------------------------------------------------------------------------- restore
@dataclasses.dataclass
class Restored:
    """What :func:`restore` loaded: the step, where from (``"memory"``: the rank's own node,
    ``"peer"``: some rank received its copy from the next node), ``extra`` and this rank's
    ``local`` tensors, as :class:`~gnnpar.checkpoint.LoadResult` gives them."""

    step: int
    source: str
    folder: Path
    extra: dict[str, Any]
    local: dict[str, torch.Tensor]
    grid: dict[str, int]


def _read_record(
    path: Path, run_id: str, rank: int, step: int, grid: ProcessGrid | None
) -> dict[str, Any]:
    """A snapshot record, checked (against ``grid`` unless None): FormatError naming the
    file and what is wrong."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(f"{path}: not a readable snapshot record ({err})") from None
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        raise FormatError(f"{path}: not a gnnpar snapshot record")
    if record.get("version") != VERSION:
        raise FormatError(f"{path}: snapshot version {record.get('version')!r}, not {VERSION}")
    for key, want, what in (
        ("run", run_id, "another run"),
        ("step", step, "another step"),
        ("rank", rank, "another rank"),
        ("grid", grid.shape if grid is not None else record.get("grid"), "another grid"),
    ):
        if record.get(key) != want:
            raise FormatError(f"{path}: a snapshot of {what} ({key} {record.get(key)!r})")
    keys = (
        "file", "layout", "pieces", "tensors", "digests", "keys", "aliases", "extra", "local",
        "grid",
    )  # fmt: skip
    for key in keys:
        if key not in record:
            raise FormatError(f"{path}: the record lacks its {key!r} field")
    return record


def _manifest(folder: Path, rank: int, record: dict[str, Any]) -> Manifest:
    """The one-file manifest of a rank's snapshot, as the checkpoint loader reads one."""
    name = _data(rank)
    where = folder / f"{_stem(rank)}.json"
    pieces = record["pieces"]
    if not isinstance(pieces, dict) or not all(isinstance(v, list) for v in pieces.values()):
        raise FormatError(f"{where}: malformed pieces")
    for docs in pieces.values():
        for doc in docs:
            stored_chunk(doc, where)
    digests = {name: record["digests"]}
    for entry in pieces:  # what ties the layout to the values: every entry has one
        if not has_digest(digests, name, entry):
            raise FormatError(f"{where}: entry {entry!r} has no digest")
    meta = {
        "step": record["step"],
        "grid": record["grid"],
        "world_size": record["world_size"],
        "keys": record["keys"],
        "aliases": record["aliases"],
        **({"inputs": record["inputs"]} if "inputs" in record else {}),
        "tensors": record["tensors"],
        "pieces": {name: pieces},
        "digests": digests,
        "local": {name: record["local"]},
        "optimizer": record.get("optimizer"),
        "extra": record["extra"],
    }
    return Manifest(folder, SCHEMA, 2, {name: record["file"]}, meta)


def _checked_record(
    folder: Path, rank: int, run_id: str, step: int, grid: ProcessGrid
) -> dict[str, Any]:
    """Rank ``rank``'s snapshot record in ``folder``, checked (:func:`_read_record`); a
    tensor file without one is a torn write."""
    stem = _stem(rank)
    if not (folder / f"{stem}.json").is_file():
        what = "a torn write" if (folder / _data(rank)).exists() else "missing"
        raise FormatError(f"{folder / _data(rank)}: no snapshot record ({what})")
    return _read_record(folder / f"{stem}.json", run_id, rank, step, grid)


def _verified(folder: Path, rank: int, run_id: str, step: int, grid: ProcessGrid):
    """``(manifest, tensors)`` of rank ``rank``'s snapshot in ``folder``, every check made
    (record, file size and checksum, each entry's digest); FormatError otherwise."""
    record = _checked_record(folder, rank, run_id, step, grid)
    manifest = _manifest(folder, rank, record)
    name = _data(rank)
    blob = load_pack(manifest.verify(name, "checksum"), record["layout"])
    check_stored(manifest, name, blob, "checksum")
    return manifest, blob


def _candidates(node_dir: Path, rank: int) -> list[int]:
    """Steps under ``node_dir`` with a file of ``rank`` (a record, or a tensor file
    without one: a torn write to warn about), newest first."""
    found, names = [], (f"{_stem(rank)}.json", _data(rank))
    for folder in node_dir.glob("step-*"):
        step = _step_number(folder)
        if step is not None and any((folder / name).exists() for name in names):
            found.append(step)
    return sorted(found, reverse=True)


def _usable(
    node_dir: Path, rank: int, run_id: str, grid: ProcessGrid, warn, skip: set[int]
) -> list[int]:
    """The newest :data:`KEEP` steps (none of ``skip``) whose snapshot of ``rank`` under
    ``node_dir`` has a record of this run, step, rank and grid and a file of the recorded
    size; the others are warned about. The checksums are checked of the one step loaded
    (:func:`_restore_same_grid`): reading every candidate cost each restart a fifth of a
    second."""
    good = []
    for step in _candidates(node_dir, rank):
        if step in skip:
            continue
        folder = _step_dir(node_dir, step)
        if _peek(folder / f"{_stem(rank)}.json", "grid") not in (None, grid.shape):
            continue  # another grid's snapshot: for the resharding restore, not a damage
        try:
            _sized(folder, rank, _checked_record(folder, rank, run_id, step, grid))
        except FormatError as err:
            warn(f"{err}; trying the next source")
            continue
        good.append(step)
        if len(good) == KEEP:
            break
    return good


def _sized(folder: Path, rank: int, record: dict[str, Any]) -> None:
    """FormatError unless the tensor file has the size its record gives."""
    path = folder / _data(rank)
    want = record["file"].get("size") if isinstance(record["file"], dict) else None
    try:
        size = path.stat().st_size
    except OSError:
        size = None
    if size != want:
        raise FormatError(f"{path}: {size} bytes, its record says {want}")


def _peek(path: Path, key: str) -> Any:
    """One field of a snapshot record, or None when it cannot be read."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return doc.get(key) if isinstance(doc, dict) else None


def _successor(rank: int, grid: ProcessGrid) -> int | None:
    per_node, world = grid.ranks_per_node, grid.world_size
    return None if per_node >= world else (rank + per_node) % world


def _agreed_step(table: torch.Tensor, grid: ProcessGrid, newer_than: int) -> int | None:
    """The newest step past ``newer_than`` for which every rank has its own snapshot or its
    successor holds a copy (``table[r]``: rank r's own steps, then the copies it holds)."""
    steps = sorted({int(v) for v in table.reshape(-1).tolist() if v >= 0}, reverse=True)
    for step in steps:
        if step <= newer_than:
            return None
        ok = True
        for r in range(grid.world_size):
            s = _successor(r, grid)
            if not (step in table[r, 0].tolist() or (s is not None and step in table[s, 1])):
                ok = False
                break
        if ok:
            return step
    return None


def _return_copies(
    table: torch.Tensor, step: int, grid: ProcessGrid, place: _Placement, run_id: str
) -> None:
    """Give every rank without its own snapshot of ``step`` the copy its successor holds:
    the holder sends it, the rank writes it into its own node's folder (collective)."""
    rank = grid.global_rank
    folder = _step_dir(place.node_dir, step)
    if step not in table[rank, 0].tolist():  # this rank's node lost it: its peer has a copy
        data, record = _send_receive(None, None, None, place.peer, None)
        record["writer"] = rank
        try:
            _write_tensors(folder, rank, lambda tmp: Path(tmp).write_bytes(data))
            _write_record(folder, rank, record, step)
        except OSError as err:
            raise CheckpointError(os_error_message(err) + " (restoring a snapshot)") from None
    pred = place.predecessor
    if pred is not None and step not in table[pred, 0].tolist():
        stem = _stem(pred)
        record = json.loads((folder / f"{stem}.json").read_text())
        _send_receive(mapped(folder / _data(pred)), record, pred, None, None)


def restore(
    root: str | os.PathLike,
    run_id: str,
    grid: ProcessGrid,
    model: Any,
    optimizer: torch.optim.Optimizer | None,
    *,
    newer_than: int = -1,
    strict: bool = True,
) -> Restored | None:
    """Load the newest snapshot every rank of ``grid`` can be given, if its step is past
    ``newer_than`` (the newest disk checkpoint's); None otherwise (collective).

    A snapshot of this grid is restored rank by rank (:func:`_restore_same_grid`); when there
    is none, one of another grid (the data axis shrank or grew) is resharded from the files
    this process can see (:func:`_restore_resharded`)."""
    rank = grid.global_rank

    def warn(text: str) -> None:
        print(f"warning: rank {rank}: {text}", file=sys.stderr, flush=True)

    req = _Request(Path(root), run_id, grid, model, optimizer, newer_than, strict, warn)
    found = _restore_same_grid(req)
    return found if found is not None else _restore_resharded(req)


@dataclasses.dataclass(frozen=True)
class _Request:
    """What :func:`restore` was asked (see its arguments), and how a rank warns."""

    root: Path
    run_id: str
    grid: ProcessGrid
    model: Any
    optimizer: torch.optim.Optimizer | None
    newer_than: int
    strict: bool
    warn: Callable[[str], None]


def _restore_same_grid(req: _Request) -> Restored | None:
    """Every rank loads its own snapshot file (received from its peer when its node lost
    it), of the newest step every rank can be given."""
    run_id, grid, warn, optimizer = req.run_id, req.grid, req.warn, req.optimizer
    place = _Placement.of(req.root, run_id, grid)
    rank = grid.global_rank

    failed: set[int] = set()  # steps whose file some rank found damaged
    while True:
        own = _usable(place.node_dir, rank, run_id, grid, warn, failed)
        held = []
        if place.predecessor is not None:
            held = _usable(place.node_dir, place.predecessor, run_id, grid, warn, failed)
        row = torch.full((2, KEEP), -1, dtype=torch.int64)
        row[0, : len(own)] = torch.tensor(own, dtype=torch.int64)
        row[1, : len(held)] = torch.tensor(held, dtype=torch.int64)
        table = comm.all_gather(row.to(grid.device), grid, "world").reshape(-1, 2, KEEP).cpu()
        step = _agreed_step(table, grid, req.newer_than)
        if step is None:
            return None
        own_ok = table[rank, 0].eq(step).any().item()
        folder = _step_dir(place.node_dir, step)
        if place.peer is not None:
            _return_copies(table, step, grid, place, run_id)
        try:  # every check, after the hand-over; every rank loads, or none does
            manifest, blob = _verified(folder, rank, run_id, step, grid)
            ok = 1
        except (FormatError, CheckpointError) as err:
            warn(f"{err}; trying the next source")
            ok = 0
        agreed = comm.all_reduce(torch.tensor([ok], device=grid.device), grid, "world", op="min")
        if int(agreed.item()):
            break
        failed.add(step)  # on every rank alike: the next round agrees on an older step
    layout = model_layout(req.model, grid)
    pairs, opt_where = plan_restore(manifest, layout, optimizer, req.strict)
    name = _data(rank)
    apply_restore(manifest, pairs, {name: blob}, layout, optimizer, opt_where)
    local = {n: blob[LOCAL + n].clone() for n in manifest.meta["local"].get(name, [])}
    received = comm.all_reduce(
        torch.tensor([0 if own_ok else 1], device=grid.device), grid, "world", op="max"
    )
    return Restored(
        step=step,
        source="peer" if int(received.item()) else "memory",
        folder=folder,
        extra=dict(manifest.meta["extra"]),
        local=local,
        grid=dict(manifest.meta["grid"]),
    )


def _visible(root: Path, run_id: str) -> dict[int, dict[int, list[Path]]]:
    """Every snapshot record this process can see under the run's folder (every node
    folder present here): step → old rank → the step folders holding it (own node first)."""
    found: dict[int, dict[int, list[Path]]] = {}
    for node_dir in sorted((root / run_id).glob("node-*")):
        for folder in node_dir.glob("step-*"):
            step = _step_number(folder)
            if step is None:
                continue
            for path in folder.glob("rank-*.json"):
                try:
                    old = int(path.stem.removeprefix("rank-"))
                except ValueError:
                    continue
                found.setdefault(step, {}).setdefault(old, []).append(folder)
    return found


def _union(step: int, copies: dict[int, list[Path]], run_id: str, warn) -> Manifest | None:
    """The manifest of every old rank's snapshot of ``step`` (one record each, the first
    copy that reads as this run's step), or None when a rank's is missing or the records
    disagree on the grid."""
    records: dict[int, tuple[Path, dict[str, Any]]] = {}
    manifests: dict[int, Manifest] = {}
    for old, folders in copies.items():
        for folder in folders:
            doc = _peek_record(folder / f"{_stem(old)}.json", run_id, old, step, warn)
            if doc is None:
                continue
            try:
                manifests[old] = _manifest(folder, old, doc)  # its chunks and digests
            except FormatError as err:
                warn(f"{err}; skipped")
                continue
            records[old] = (folder, doc)
            break
    if not records:
        return None
    first = records[min(records)][1]
    world = first.get("world_size")
    if sorted(records) != list(range(world if isinstance(world, int) else -1)):
        return None
    if any(doc.get("grid") != first.get("grid") for _, doc in records.values()):
        return None
    files, pieces, digests, local, tensors = {}, {}, {}, {}, {}
    for old, (_, doc) in records.items():
        one = manifests[old]
        name = _data(old)
        files[name] = doc["file"]
        pieces.update(one.meta["pieces"])
        digests.update(one.meta["digests"])
        local[name] = doc["local"]
        tensors.update(doc["tensors"])
    meta = {
        **{k: first[k] for k in ("step", "grid", "world_size", "keys", "aliases", "extra")},
        **({"inputs": first["inputs"]} if "inputs" in first else {}),
        "optimizer": first.get("optimizer"),
        "tensors": tensors,
        "pieces": pieces,
        "digests": digests,
        "local": local,
        "folders": {_data(old): str(folder) for old, (folder, _) in records.items()},
        "layouts": {_data(old): doc["layout"] for old, (_, doc) in records.items()},
    }
    return Manifest(_root_of(records), SCHEMA, 2, files, meta)


def _root_of(records: dict[int, tuple[Path, dict[str, Any]]]) -> Path:
    """The run's snapshot folder (for messages): two levels above a step folder."""
    return next(iter(records.values()))[0].parent.parent


def _peek_record(path: Path, run_id: str, rank: int, step: int, warn) -> dict | None:
    """:func:`_read_record` of any grid's record, None (warned) when it is refused."""
    try:
        return _read_record(path, run_id, rank, step, None)
    except FormatError as err:
        warn(f"{err}; skipped")
        return None


def _restore_resharded(req: _Request) -> Restored | None:
    """Load the newest snapshot of another grid whose every old rank's file this process
    can see and verify, through the checkpoint loader's resharding (each rank reads the
    files that overlap its pieces), when every rank can (collective). On one host every
    node's folder is visible; on a cluster a rank sees its own node's, which holds the
    previous node's copies too: two nodes shrinking to one see everything."""
    run_id, grid, warn, optimizer = req.run_id, req.grid, req.warn, req.optimizer
    visible = _visible(req.root, run_id)
    mine = -1
    chosen: tuple[Manifest, dict[str, dict[str, torch.Tensor]], list, list, Any] | None = None
    layout = model_layout(req.model, grid)
    for step in sorted(visible, reverse=True)[: 2 * KEEP]:
        if step <= req.newer_than:
            break
        manifest = _union(step, visible[step], run_id, warn)
        if manifest is None or manifest.meta["grid"] == grid.shape:
            continue
        try:
            pairs, opt_where = plan_restore(manifest, layout, optimizer, req.strict)
            blobs = {}
            for name in sorted({src.file for _, _, src, _ in pairs}):
                one = Manifest(
                    Path(manifest.meta["folders"][name]), SCHEMA, 2,
                    {name: manifest.files[name]},
                    {**manifest.meta, "pieces": {name: manifest.meta["pieces"][name]}},
                )  # fmt: skip
                path = one.verify(name, "checksum")
                blobs[name] = load_pack(path, manifest.meta["layouts"][name])
                check_stored(one, name, blobs[name], "checksum")
        except (FormatError, CheckpointError) as err:
            warn(f"{err}; trying the next source")
            continue
        mine, chosen = step, (manifest, blobs, pairs, opt_where, layout)
        break
    # every rank must have found the same step
    low = comm.all_reduce(torch.tensor([mine], device=grid.device), grid, "world", op="min")
    high = comm.all_reduce(torch.tensor([mine], device=grid.device), grid, "world", op="max")
    if int(low.item()) < 0 or int(low.item()) != int(high.item()) or chosen is None:
        return None
    manifest, blobs, pairs, opt_where, layout = chosen
    apply_restore(manifest, pairs, blobs, layout, optimizer, opt_where)
    return Restored(
        step=mine,
        source="memory",
        folder=manifest.folder,
        extra=dict(manifest.meta["extra"]),
        local={},  # rank-local state (RNG) means nothing on another grid
        grid=dict(manifest.meta["grid"]),
    )
