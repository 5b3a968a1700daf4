"""Loading pickles that may only build a fixed set of harmless classes.

Unpickling calls whatever callable the file names, so a pickle can run arbitrary code. The
:class:`RestrictedUnpickler` resolves globals only from an explicit allow-list and refuses
everything else *before* anything is called.

:func:`load_torch_file` reads a ``torch.save`` file (a zip archive: ``data.pkl`` and one raw
member per tensor storage) the same way, with our own allow-list rather than
``torch.load(weights_only=True)``'s: importing ``torch_geometric`` widens torch's
process-wide weights-only allow-list (``add_safe_globals``) with classes whose constructors
do real work (``ClusterData`` partitions a graph and writes files, ``DeviceMesh`` sets up
process groups), and a pickle may call any allowed class with arguments of its choosing.
:func:`pyg_globals` is exactly what a PyG ``Data`` or ``HeteroData`` pickle names.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import pickle
import sys
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO

from gnnpar.errors import UserError, first_line

__all__ = [
    "PYG_CLASSES",
    "RestrictedUnpickler",
    "UnsafePickleError",
    "load_pickle",
    "load_torch_file",
    "numpy_reconstruct",
    "planetoid_globals",
    "pyg_globals",
]

#: The PyG classes a pickled ``Data`` or ``HeteroData`` is made of (``module.name``): the
#: graph, its stores, and the two attribute classes each graph records (as values, never
#: called while loading). Their constructors and ``__setstate__`` only store attributes.
PYG_CLASSES = (
    "torch_geometric.data.data.Data",
    "torch_geometric.data.data.DataEdgeAttr",
    "torch_geometric.data.data.DataTensorAttr",
    "torch_geometric.data.hetero_data.HeteroData",
    "torch_geometric.data.graph_store.EdgeAttr",
    "torch_geometric.data.feature_store.TensorAttr",
    "torch_geometric.data.storage.BaseStorage",
    "torch_geometric.data.storage.GlobalStorage",
    "torch_geometric.data.storage.NodeStorage",
    "torch_geometric.data.storage.EdgeStorage",
)
#: The storage classes ``torch.save`` names (one per dtype) and their dtypes' names.
_STORAGE_DTYPES = MappingProxyType(
    {
        "DoubleStorage": "float64",
        "FloatStorage": "float32",
        "HalfStorage": "float16",
        "BFloat16Storage": "bfloat16",
        "LongStorage": "int64",
        "IntStorage": "int32",
        "ShortStorage": "int16",
        "CharStorage": "int8",
        "ByteStorage": "uint8",
        "BoolStorage": "bool",
    }
)


class UnsafePickleError(pickle.UnpicklingError, UserError):
    """A pickle asked for a class or function outside the allow-list."""


def _refuse(module: str, name: str, allowed: Mapping[tuple[str, str], Any]) -> UnsafePickleError:
    """The error for a global outside ``allowed`` (it names the global first)."""
    return UnsafePickleError(
        f"refusing to unpickle {module}.{name}: only "
        + ", ".join(sorted({f"{m}.{n}" for m, n in allowed}))
        + " are allowed"
    )


def numpy_reconstruct() -> Any:
    """numpy's ``multiarray._reconstruct`` (under numpy 2's or numpy 1's module name)."""
    # numpy 2 moved numpy.core to numpy._core; old pickles still name numpy.core.
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            return importlib.import_module(module)._reconstruct
        except (ImportError, AttributeError):
            continue
    raise ImportError("cannot find numpy's multiarray._reconstruct")


def planetoid_globals() -> Mapping[tuple[str, str], Any]:
    """The globals the Planetoid ``ind.<name>.*`` files need: numpy arrays, scipy CSR
    matrices and a ``defaultdict(list)`` of adjacency lists. Keys are ``(module, name)``
    as written in the (Python 2) pickle."""
    import numpy as np
    import scipy.sparse as sp

    reconstruct = numpy_reconstruct()
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("collections", "defaultdict"): collections.defaultdict,
        ("__builtin__", "list"): list,
        ("builtins", "list"): list,
    }
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = reconstruct
    for module in ("scipy.sparse.csr", "scipy.sparse._csr"):
        allowed[(module, "csr_matrix")] = sp.csr_matrix
    return MappingProxyType(allowed)


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler whose ``find_class`` only returns objects from ``allowed``.

    Args:
        file: a binary file object.
        allowed: ``{(module, name): object}``; anything else raises :class:`UnsafePickleError`.
        encoding: how to decode Python 2 ``str`` objects (``latin1`` keeps numpy buffers
            intact).
    """

    def __init__(
        self, file: BinaryIO, allowed: Mapping[tuple[str, str], Any], encoding: str = "latin1"
    ) -> None:
        super().__init__(file, encoding=encoding)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise _refuse(module, name, self._allowed) from None


def load_pickle(path: str | Path, allowed: Mapping[tuple[str, str], Any] | None = None) -> Any:
    """Unpickle ``path`` with :class:`RestrictedUnpickler` (default allow-list:
    :func:`planetoid_globals`). Raises :class:`UnsafePickleError` naming the refused class,
    and a :class:`~gnnpar.errors.UserError` naming the file when it is not a whole pickle."""
    allowed = planetoid_globals() if allowed is None else allowed
    with open(path, "rb") as f:
        try:
            return RestrictedUnpickler(f, allowed).load()
        except UnsafePickleError as err:
            raise UnsafePickleError(f"{path}: {err}") from None
        except Exception as err:  # UnpicklingError, EOFError, ... for a truncated or damaged file
            raise UserError(f"{path}: not a readable pickle ({first_line(err)})") from None


# ---------------------------------------------------------------------- torch.save files
@dataclasses.dataclass(frozen=True)
class _StorageType:
    """What a storage class named in a torch file stands for: its dtype only (the class
    itself, if the pickle called it, would allocate a storage of any size it asks for)."""

    dtype: Any


@dataclasses.dataclass(frozen=True)
class _Storage:
    """One storage of a torch file: a flat tensor over its bytes."""

    flat: Any


def _rebuild_tensor(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
    metadata: Any = None,
) -> Any:  # fmt: skip
    """``torch._utils._rebuild_tensor_v2`` for our storages only: a view of ``storage``
    (torch checks the view lies inside it), no autograd hooks, no gradient."""
    del requires_grad, metadata  # data files hold no parameters
    if not isinstance(storage, _Storage) or hooks:
        raise UnsafePickleError("refusing to unpickle a tensor that is not a plain stored tensor")
    if not all(isinstance(v, int) for v in (offset, *size, *stride)):
        raise UserError("a tensor's offset, size and stride must be integers")
    return storage.flat.as_strided(tuple(size), tuple(stride), offset)


def _torch_globals() -> dict[tuple[str, str], Any]:
    """The torch names every tensor of a ``torch.save`` file needs, each standing for a
    harmless stand-in (:class:`_StorageType`, :func:`_rebuild_tensor`)."""
    import torch

    allowed: dict[tuple[str, str], Any] = {
        ("torch", name): _StorageType(getattr(torch, dtype))
        for name, dtype in _STORAGE_DTYPES.items()
    }
    allowed[("torch._utils", "_rebuild_tensor_v2")] = _rebuild_tensor
    allowed[("collections", "OrderedDict")] = collections.OrderedDict  # a tensor's hooks
    return allowed


def pyg_globals() -> Mapping[tuple[str, str], Any]:
    """What a ``torch.save``d PyG ``Data`` or ``HeteroData`` may name: :data:`PYG_CLASSES`
    and the stand-ins of torch's tensor names (needs ``torch_geometric``)."""
    allowed = _torch_globals()
    for dotted in PYG_CLASSES:
        module, _, name = dotted.rpartition(".")
        allowed[(module, name)] = getattr(importlib.import_module(module), name)
    return MappingProxyType(allowed)


class _StorageReader:
    """The storages of one ``torch.save`` archive, each read once (tensors may share one)."""

    def __init__(self, archive: zipfile.ZipFile, prefix: str) -> None:
        self.archive, self.prefix = archive, prefix
        self.loaded: dict[str, _Storage] = {}

    def __call__(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UserError(f"a persistent id {str(pid)[:60]} that is not a tensor storage")
        _, kind, key, _, numel = pid
        if not isinstance(kind, _StorageType) or not isinstance(numel, int) or numel < 0:
            raise UnsafePickleError("refusing to unpickle a storage of an unknown kind")
        key = str(key)
        if key not in self.loaded:
            self.loaded[key] = self._read(key, kind.dtype, numel)
        return self.loaded[key]

    def _read(self, key: str, dtype: Any, numel: int) -> _Storage:
        import torch

        name = f"{self.prefix}data/{key}"
        try:
            info = self.archive.getinfo(name)
        except KeyError:
            raise UserError(f"the archive has no storage {name}") from None
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if info.file_size != nbytes:
            raise UserError(f"storage {name} holds {info.file_size} bytes, its tensor {nbytes}")
        if not numel:
            return _Storage(torch.empty(0, dtype=dtype))
        raw = bytearray(nbytes)  # read in place: one copy of the data in memory, not two
        with self.archive.open(info) as f, memoryview(raw) as view:
            done = 0
            while done < nbytes:
                got = f.readinto(view[done:])
                if not got:
                    raise UserError(f"storage {name} ends after {done} of {nbytes} bytes")
                done += got
        if dtype == torch.bool and int(torch.frombuffer(raw, dtype=torch.uint8).max()) > 1:
            raise UserError(f"storage {name} is boolean but holds bytes other than 0 and 1")
        return _Storage(torch.frombuffer(raw, dtype=dtype))


class _TorchUnpickler(pickle._Unpickler):  # the Python one: its opcodes can be guarded
    """An unpickler of a torch file's ``data.pkl``: globals from ``allowed`` only, storages
    from the archive, and no ``BUILD`` on a class (which would set the class's attributes
    for the whole process)."""

    def __init__(
        self, file: BinaryIO, allowed: Mapping[tuple[str, str], Any], storages: Callable
    ) -> None:
        super().__init__(file, encoding="ASCII")
        self._allowed, self._storages = allowed, storages

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise _refuse(module, name, self._allowed) from None

    def persistent_load(self, pid: Any) -> Any:
        return self._storages(pid)

    def _load_build(self) -> None:
        if isinstance(self.stack[-2], type):
            raise UnsafePickleError("refusing to unpickle a file that sets a class's attributes")
        pickle._Unpickler.load_build(self)

    dispatch = MappingProxyType({**pickle._Unpickler.dispatch, pickle.BUILD[0]: _load_build})


def _check_archive(archive: zipfile.ZipFile, path: str | Path, prefix: str) -> None:
    """Every member torch wrote stored, not compressed (what is read then takes no more
    memory than the file has bytes), and the byte order this machine's."""
    packed = [i.filename for i in archive.infolist() if i.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise UserError(f"{path}: {packed[0]} is compressed (torch.save stores its members)")
    order = b"little"  # what torch assumes of a file without the record
    if f"{prefix}byteorder" in archive.namelist():
        order = archive.read(f"{prefix}byteorder")[:16]
    if order != sys.byteorder.encode():
        raise UserError(f"{path}: a torch file of byte order {order!r}, not this machine's")


def load_torch_file(path: str | Path, allowed: Mapping[tuple[str, str], Any]) -> Any:
    """The object of a ``torch.save`` file (the zip format, torch's default since 1.6),
    unpickled with only the globals in ``allowed`` (``{(module, name): object}``, such as
    :func:`pyg_globals`); tensors come back on the CPU, sharing their file's storages as
    they did when saved.

    Raises :class:`UnsafePickleError` naming the first global outside ``allowed`` (before
    anything is called), and a UserError naming the file when it is not a whole torch file
    of this kind (a plain pickle, torch's legacy format, a big-endian file, a damaged one).
    """
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise UserError(
            f"{path}: not a torch.save file (a zip archive; plain pickles and torch's legacy "
            f"format are not read): {first_line(err)}"
        ) from None
    with archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise UserError(f"{path}: not a torch.save file (no single */data.pkl in the archive)")
        prefix = pickles[0].removesuffix("data.pkl")
        _check_archive(archive, path, prefix)
        try:
            with archive.open(pickles[0]) as f:
                return _TorchUnpickler(f, allowed, _StorageReader(archive, prefix)).load()
        except UnsafePickleError as err:
            raise UnsafePickleError(f"{path}: {err}") from None
        except Exception as err:  # UnpicklingError, EOFError, zip CRC errors, bad views...
            raise UserError(f"{path}: not a readable torch.save file ({first_line(err)})") from None
