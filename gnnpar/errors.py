"""The kinds of failure that gnnpar's commands tell apart, by type (never by message text).

- :class:`UserError`: a problem with what the user gave, fixed by giving something else.
  The command line prints its message as one line and exits with status 2.
- :class:`MissingPackageError`: a user error of the environment, an optional package that
  is not installed (also an ``ImportError``).
- :class:`PeerFailedError`: this rank stops because another rank failed; that rank reports
  the cause, this one only echoes it.

Anything else that reaches the command line (a plain ``ValueError``, ``TypeError``,
``KeyError``, ``RuntimeError`` from gnnpar or from a library it calls) is a bug: it is
reported with its traceback and exit status 1.

This module imports nothing from gnnpar (it is the bottom of the layer order) and nothing
outside the standard library, so every package, the torch-free ones included, can raise
these.
"""

from __future__ import annotations

__all__ = ["MissingPackageError", "PeerFailedError", "UserError", "first_line"]


def first_line(err: BaseException, limit: int | None = None) -> str:
    """The first line of ``err``'s message (its type's name when it has none), cut to
    ``limit`` characters: what a one-line error quotes of a library's multi-line one
    (torch's and DGL's run on with C++ frames)."""
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return line if limit is None else line[:limit]


class UserError(ValueError):
    """A problem with what the user gave that the one-line message fully explains.

    What qualifies: a flag or option value (out of range, unknown name, a size that does not
    divide, a combination that cannot run), a config key, a file or folder (missing,
    damaged, of another format or version, already there), a dataset (no training nodes,
    labels out of range, a graph of another shape than its shards), a grid that does not
    fit the world, the environment (a launcher's variables, a missing optional package).
    The message names what was given and, where it helps, what to give instead.

    What does not: an internal invariant that only a bug in gnnpar can break (two tensors
    our own code built disagree, a state that cannot happen). Those stay ``ValueError`` or
    ``RuntimeError``, and reach the user with their traceback.

    A subclass of ``ValueError``, which is what a bad value has always raised here: code
    that catches ``ValueError`` keeps working.
    """


class MissingPackageError(UserError, ImportError):
    """An optional package that this use needs is not installed; the message says which
    and how to install it."""


class PeerFailedError(RuntimeError):
    """This rank stops because another rank failed (that rank reports the error): the
    consequence of a failure, not its cause."""
