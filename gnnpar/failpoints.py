"""Failpoints: named places where a chaos run makes a rank fail on purpose.

A failure that lands at a chosen moment — in the middle of a snapshot's write, of a disk
checkpoint's, after a given step — is what recovery must survive, and a kill from outside
hits such a moment only by luck. ``$GNNPAR_FAILPOINTS`` lists the failures a run should
suffer, comma-separated, each ``place@step:rank:attempt=action``:

- ``place``: ``step`` (after the step's update, before anything is saved), ``snapshot``
  (a snapshot's tensor file written, its record not yet: a torn snapshot), ``logged``
  (the step logged, its snapshot taken), ``checkpoint`` (a disk checkpoint's rank file
  written, its manifest not yet);
- ``step``: the step (1-based, as the metrics count) at which it fires;
- ``rank``: the global rank that fails (default 0);
- ``attempt``: the launcher's restart count it fires in (default 0: the first start, so
  the restarted ranks go past it);
- ``action``: ``kill`` (SIGKILL itself, the default), ``stop`` (SIGSTOP itself: a hung
  rank, which its peers see only when their collective times out), ``exit`` (exit status
  1 without cleaning up) or ``lose-node`` (what the place gives as its node's loss — the
  trainer deletes the node's snapshot folder, the memory a lost node takes with it — then
  SIGKILL).

``GNNPAR_FAILPOINTS="snapshot@5:1,checkpoint@8:0:1,step@12:3:2=stop"`` kills rank 1 while it
writes the snapshot of step 5, then (first restart) rank 0 while it writes the checkpoint of
step 8, then (second restart) stops rank 3 after step 12. Without the variable,
:func:`failpoint` does nothing.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Callable, Mapping

from gnnpar.errors import UserError

__all__ = ["ENV", "PLACES", "Failpoint", "failpoint", "parse_failpoints"]

ENV = "GNNPAR_FAILPOINTS"
PLACES = ("step", "snapshot", "logged", "checkpoint")
ACTIONS = ("kill", "stop", "exit", "lose-node")


@dataclasses.dataclass(frozen=True)
class Failpoint:
    """One planned failure (see the module docstring)."""

    place: str
    step: int
    rank: int = 0
    attempt: int = 0
    action: str = "kill"


def parse_failpoints(text: str) -> list[Failpoint]:
    """The failpoints of a ``$GNNPAR_FAILPOINTS`` value; UserError naming the bad item."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        where, _, action = item.partition("=")
        place, _, numbers = where.partition("@")
        fields = numbers.split(":") if numbers else []
        try:
            values = [int(v) for v in fields]
        except ValueError:
            values = []
        if place not in PLACES or not 1 <= len(values) <= 3 or (action or "kill") not in ACTIONS:
            raise UserError(
                f"${ENV}: {item!r} is not place@step[:rank[:attempt]][=action] with place one "
                f"of {', '.join(PLACES)} and action one of {', '.join(ACTIONS)}"
            )
        out.append(Failpoint(place, *values, action=action or "kill"))  # type: ignore[arg-type]
    return out


def failpoint(
    place: str,
    step: int,
    rank: int,
    lose_node: Callable[[], None] | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Fail here as ``$GNNPAR_FAILPOINTS`` says, if it names this place, step and rank and
    this attempt (:func:`gnnpar.launch.restart_count`); otherwise return. ``lose_node``:
    what the ``lose-node`` action does before the kill."""
    env = os.environ if environ is None else environ
    text = env.get(ENV)
    if not text:
        return
    from gnnpar.launch import restart_count

    attempt = restart_count(env)
    for fp in parse_failpoints(text):
        if (fp.place, fp.step, fp.rank, fp.attempt) == (place, step, rank, attempt):
            if fp.action == "exit":
                os._exit(1)
            if fp.action == "lose-node" and lose_node is not None:
                lose_node()
            os.kill(os.getpid(), signal.SIGSTOP if fp.action == "stop" else signal.SIGKILL)
