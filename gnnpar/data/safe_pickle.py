"""Loading pickles that may only build a fixed set of harmless classes.

Unpickling calls whatever callable the file names, so a pickle can run arbitrary code. The
:class:`RestrictedUnpickler` resolves globals only from an explicit allow-list and refuses
everything else *before* anything is called.
"""

from __future__ import annotations

import collections
import importlib
import pickle
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO

from gnnpar.errors import UserError, first_line

__all__ = [
    "RestrictedUnpickler",
    "UnsafePickleError",
    "load_pickle",
    "numpy_reconstruct",
    "planetoid_globals",
]


class UnsafePickleError(pickle.UnpicklingError, UserError):
    """A pickle asked for a class or function outside the allow-list."""


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
            raise UnsafePickleError(
                f"refusing to unpickle {module}.{name}: only "
                + ", ".join(sorted({f"{m}.{n}" for m, n in self._allowed}))
                + " are allowed"
            ) from None


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
