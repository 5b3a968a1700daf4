"""Pipeline schedules as programs: each pipe rank's ordered list of computations and messages.

A model cut into ``S = p·v`` consecutive *virtual stages* runs on ``p`` pipe ranks; rank ``r``
holds the ``v`` chunks ``c = 0 … v−1``, chunk ``c`` being virtual stage ``c·p + r`` (Megatron's
interleaved placement; ``v = 1`` is the plain pipeline). A step pushes ``m`` micro-batches
through it. Three schedules order the forward (``F``) and backward (``B``) passes:

- ``gpipe``: every forward, then every backward; a rank holds up to ``m`` micro-batches'
  activations.
- ``1f1b``: ``p − r − 1`` warm-up forwards, then one forward and one backward in turn, then
  the remaining backwards; at most ``min(p − r, m)`` in flight (PipeDream-Flush).
- ``interleaved``: 1F1B over the ``m·v`` chunk passes with ``v ≥ 2`` chunks per rank (needs
  ``m`` divisible by ``p``); the bubble shrinks ``v``-fold, at the price of ``v``-fold
  messages; ``(p − r − 1)·2 + (v − 1)·p`` warm-up passes.

The bubble (idle fraction of a rank when every pass of a chunk costs the same) is
:func:`bubble_fraction`: ``(p − 1)/(m·v + p − 1)``.

:func:`program` turns an order into :class:`Op` lists that also name every message
(activations forward, their gradients back, and for a tied embedding the shared weight at
the start of a step and its gradient at the end). The runtime (:mod:`gnnpar.pipeline.runtime`)
executes exactly these lists with non-blocking sends and blocking receives; :func:`verify`
simulates the same semantics and proves a program free of deadlock (every rank finishes) with
each channel's messages received in the order they were sent (what NCCL needs), and reports
the peak number of micro-batch activations each rank holds.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from gnnpar.errors import UserError

__all__ = [
    "SCHEDULES",
    "Op",
    "ScheduleError",
    "bubble_fraction",
    "check_sizes",
    "compute_order",
    "peak_bound",
    "program",
    "simulate",
    "verify",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved")
#: Message kinds, in the order of their tag blocks.
MESSAGES = ("act", "grad", "weight", "tie")


class ScheduleError(UserError):
    """A schedule that cannot run: bad sizes, or a program that would deadlock."""


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of a rank's program: ``F``/``B`` of micro-batch ``mb`` on chunk ``chunk``, or
    ``send``/``recv`` of a message of kind ``what`` (act, grad, weight, tie) to or from pipe
    rank ``peer`` with ``tag``."""

    kind: str
    mb: int = -1
    chunk: int = -1
    what: str = ""
    peer: int = -1
    tag: int = -1


def check_sizes(schedule: str, p: int, m: int, v: int) -> None:
    """Reject a (schedule, stages, micro-batches, virtual stages) combination that cannot
    run, naming the option."""
    if schedule not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {schedule!r}; use {', '.join(SCHEDULES)}")
    for name, value in (("pipe", p), ("grad_accum", m), ("virtual_stages", v)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")
    if schedule == "interleaved":
        if v < 2:
            raise ScheduleError("the interleaved schedule needs virtual_stages >= 2")
        if m % p:
            raise ScheduleError(
                f"the interleaved schedule needs grad_accum ({m}) divisible by pipe ({p})"
            )
    elif v != 1:
        raise ScheduleError(f"virtual_stages > 1 needs the interleaved schedule, not {schedule}")


def compute_order(schedule: str, p: int, m: int, v: int, rank: int) -> list[tuple[str, int, int]]:
    """The ``(F|B, micro-batch, chunk)`` passes of pipe rank ``rank`` in order."""
    check_sizes(schedule, p, m, v)
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    total = m * v

    def mb_of(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def chunk_of(k: int) -> int:
        return (k % (p * v)) // p

    forwards = [("F", mb_of(k), chunk_of(k)) for k in range(total)]
    backwards = [("B", mb_of(k), v - 1 - chunk_of(k)) for k in range(total)]
    warm = p - rank - 1 if schedule == "1f1b" else (p - rank - 1) * 2 + (v - 1) * p
    warm = min(warm, total)
    order = forwards[:warm]
    for i in range(total - warm):
        order += [forwards[warm + i], backwards[i]]
    return order + backwards[total - warm :]


def peak_bound(schedule: str, p: int, m: int, v: int, rank: int) -> int:
    """The most chunk passes whose activations pipe rank ``rank`` holds at once (forward done,
    backward not yet): ``m`` for GPipe, ``min(p − r, m)`` for 1F1B, and
    ``min((p − r − 1)·2 + (v − 1)·p + 1, m·v)`` for the interleaved schedule (each of
    its passes holds one chunk, ``1/v`` of the rank's layers)."""
    check_sizes(schedule, p, m, v)
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - rank, m)
    return min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v)


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a step with ``p`` stages, ``m`` micro-batches and ``v`` virtual
    stages per rank, every pass of a chunk taking the same time: ``(p−1)/(m·v + p−1)``."""
    return (p - 1) / (m * v + p - 1)


def _tag(what: str, stage: int, mb: int, stages: int, m: int) -> int:
    return (MESSAGES.index(what) * stages + stage) * m + mb


def program(
    schedule: str,
    p: int,
    m: int,
    v: int = 1,
    *,
    tied: bool = False,
    forward_only: bool = False,
) -> list[list[Op]]:
    """Every pipe rank's program (index = pipe rank). ``tied``: the first virtual stage's
    embedding is the last one's head weight; rank 0 sends it to rank ``p − 1`` first, and
    rank ``p − 1`` sends the gradient it accumulated back before rank 0's last backward of
    chunk 0 (at the end of its program, so that on the channel to rank 0 it comes after
    every gradient rank 0 waits for first). ``forward_only``: the forwards alone
    (evaluation, any number of micro-batches), in GPipe order."""
    check_sizes(schedule, p, p if forward_only else m, v)
    if forward_only and (not isinstance(m, int) or m < 1):
        raise ScheduleError(f"micro-batches must be a positive integer, got {m!r}")
    stages = p * v
    out = []
    for r in range(p):
        if forward_only:
            order = [("F", i, c) for c in range(v) for i in range(m)]
        else:
            order = compute_order(schedule, p, m, v, r)
        ops: list[Op] = []
        if tied and p > 1 and r == 0:
            ops.append(Op("send", what="weight", peer=p - 1, tag=_tag("weight", 0, 0, stages, m)))
        if tied and p > 1 and r == p - 1:
            ops.append(Op("recv", what="weight", peer=0, tag=_tag("weight", 0, 0, stages, m)))
        last_b = {c: max(i for i, (k, _, cc) in enumerate(order) if k == "B" and cc == c)
                  for c in range(v)} if not forward_only else {}  # fmt: skip
        for i, (kind, mb, c) in enumerate(order):
            s = c * p + r
            if kind == "F":
                if s > 0:
                    tag = _tag("act", s, mb, stages, m)
                    ops.append(Op("recv", mb, c, "act", (s - 1) % p, tag))
                ops.append(Op("F", mb, c))
                if s < stages - 1:
                    tag = _tag("act", s + 1, mb, stages, m)
                    ops.append(Op("send", mb, c, "act", (s + 1) % p, tag))
                continue
            if s < stages - 1:
                ops.append(Op("recv", mb, c, "grad", (s + 1) % p, _tag("grad", s, mb, stages, m)))
            if tied and p > 1 and s == 0 and i == last_b[0]:
                ops.append(Op("recv", what="tie", peer=p - 1, tag=_tag("tie", 0, 0, stages, m)))
            ops.append(Op("B", mb, c))
            if s > 0:
                tag = _tag("grad", s - 1, mb, stages, m)
                ops.append(Op("send", mb, c, "grad", (s - 1) % p, tag))
        if tied and p > 1 and r == p - 1 and not forward_only:
            # last: on the channel to rank 0 it follows every gradient rank 0 waits for
            ops.append(Op("send", what="tie", peer=0, tag=_tag("tie", 0, 0, stages, m)))
        out.append(ops)
    return out


def verify(programs: list[list[Op]]) -> list[int]:
    """Run ``programs`` (from :func:`program`) on a model of the runtime: sends never block,
    a receive blocks until its message is the oldest one on its (sender, receiver) channel.
    Returns each rank's peak count of chunk passes holding activations; raises
    :class:`ScheduleError` when the programs deadlock, a receive would take another message
    than the one it expects, or a rank sends what nobody receives."""
    p = len(programs)
    channels: dict[tuple[int, int], deque[int]] = {}
    pc = [0] * p
    held = [0] * p
    peak = [0] * p
    while True:
        moved = False
        for r in range(p):
            while pc[r] < len(programs[r]):
                op = programs[r][pc[r]]
                if op.kind == "recv":
                    queue = channels.get((op.peer, r))
                    if not queue:
                        break
                    if queue[0] != op.tag:
                        raise ScheduleError(
                            f"rank {r} waits for message {op.tag} ({op.what}, micro-batch "
                            f"{op.mb}) from rank {op.peer}, but message {queue[0]} comes first"
                        )
                    queue.popleft()
                elif op.kind == "send":
                    channels.setdefault((r, op.peer), deque()).append(op.tag)
                elif op.kind == "F":
                    held[r] += 1
                    peak[r] = max(peak[r], held[r])
                elif op.kind == "B":
                    held[r] -= 1
                pc[r] += 1
                moved = True
        if all(pc[r] == len(programs[r]) for r in range(p)):
            break
        if not moved:
            stuck = [
                f"rank {r} at {programs[r][pc[r]]}" for r in range(p) if pc[r] < len(programs[r])
            ]
            raise ScheduleError(f"the schedule deadlocks: {'; '.join(stuck)}")
    left = {k: list(q) for k, q in channels.items() if q}
    if left:
        raise ScheduleError(f"messages sent but never received: {left}")
    return peak


def simulate(
    programs: list[list[Op]], forward_s: float, backward_s: float, latency_s: float = 0.0
) -> tuple[float, list[float]]:
    """Replay ``programs`` on a timeline: every forward of a chunk takes ``forward_s``,
    every backward ``backward_s``, every message arrives ``latency_s`` after it is sent.
    Returns the step's seconds and each rank's idle fraction; with ``latency_s = 0`` and
    equal chunks the idle fraction is :func:`bubble_fraction` (checked by the tests)."""
    verify(programs)
    p = len(programs)
    clock, busy, pc = [0.0] * p, [0.0] * p, [0] * p
    arrival: dict[tuple[int, int, int], float] = {}
    while any(pc[r] < len(programs[r]) for r in range(p)):
        for r in range(p):
            while pc[r] < len(programs[r]):
                op = programs[r][pc[r]]
                if op.kind == "recv":
                    key = (op.peer, r, op.tag)
                    if key not in arrival:
                        break
                    clock[r] = max(clock[r], arrival[key])
                elif op.kind == "send":
                    arrival[(r, op.peer, op.tag)] = clock[r] + latency_s
                else:
                    cost = forward_s if op.kind == "F" else backward_s
                    clock[r] += cost
                    busy[r] += cost
                pc[r] += 1
    step = max(clock)
    return step, [1.0 - b / step for b in busy]
