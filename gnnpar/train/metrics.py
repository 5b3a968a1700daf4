"""Evaluation scores of node classification, and per-step metrics as JSON lines in the run
folder (rank 0 writes).

Scores (:data:`SCORES`), each from logits (or scores) and labels of the evaluated nodes:

- ``acc``: the fraction of rows whose arg-max class is the label (single-label);
- ``f1_micro``, ``f1_macro``: F1 over all rows, and the mean of the per-class F1 over the
  classes that occur among the labels or predictions (scikit-learn's definitions);
- ``rocauc``: multi-label (``N x C`` 0/1 labels), OGB's evaluator: the mean over tasks of
  each task's ROC-AUC, over the tasks whose evaluated labels hold both a 0 and a 1.

A task reports the score :func:`metric_for` names for its labels, as ``{split}_{metric}``
(``test_acc``, ``test_rocauc``).

Link prediction (:func:`link_scores`), OGB's evaluators' semantics, from the scores of the
positive pairs and of their negatives in either protocol of
:mod:`gnnpar.graph.edge_split` (``"pairs"``: 1-D negatives shared by every positive;
``"per-source"``: an ``E x K`` row of negatives per positive):

- a positive's rank is 1 + the mean of the number of negatives scoring above it
  (optimistic) and of those scoring at least as high (pessimistic), so a tie counts one
  half: :func:`ranks_per_source`, :func:`ranks_against_shared`;
- ``mrr``: the mean of 1 / rank (:func:`mrr` is ogbl-citation2's);
- ``hits@K``: per source, the fraction of positives ranked K or better
  (:func:`hits_from_ranks`, ogbl-citation2's); against shared negatives, the fraction of
  positives scoring strictly above the K-th highest negative, 1.0 when there are fewer
  than K negatives (:func:`hits_at_k`, ogbl-collab's and ogbl-ppa's);
- ``rocauc``: the positives (label 1) against every negative (label 0).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from gnnpar.atomic import atomic_write, naming
from gnnpar.errors import MissingPackageError, UserError
from gnnpar.graph import is_multilabel
from gnnpar.graph.edge_split import check_metric


class UndefinedScoreError(UserError):
    """A score has no value on these rows (no rows; ROC-AUC: no task with both classes)."""


def metric_for(label: torch.Tensor) -> str:
    """The score a trainer reports for ``label``: ``rocauc`` for a multi-label ``N x C``
    label (C > 1), ``acc`` for class ids (OGB's choice for its node-property datasets)."""
    return "rocauc" if is_multilabel(label) else "acc"


def _predictions(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"expected N x C logits and N labels, got {tuple(logits.shape)} and "
            f"{tuple(labels.shape)}"
        )
    if logits.shape[0] == 0:
        raise UndefinedScoreError("no rows to score")
    return logits.argmax(1), labels.long()


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of rows whose arg-max class (ties to the lowest id) equals the label."""
    pred, labels = _predictions(logits, labels)
    return float((pred == labels).double().mean())


def _f1_counts(logits: torch.Tensor, labels: torch.Tensor):
    pred, labels = _predictions(logits, labels)
    k = max(int(logits.shape[1]), int(labels.max()) + 1)
    tp = torch.bincount(labels[pred == labels], minlength=k).double()
    predicted = torch.bincount(pred, minlength=k).double()
    actual = torch.bincount(labels, minlength=k).double()
    return tp, predicted - tp, actual - tp, (predicted + actual) > 0


def f1_micro(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """F1 of the pooled counts over every class (for one label per row, the accuracy)."""
    tp, fp, fn, _ = _f1_counts(logits, labels)
    return float(2 * tp.sum() / (2 * tp.sum() + fp.sum() + fn.sum()))


def f1_macro(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean per-class F1 over the classes present among the labels or the predictions."""
    tp, fp, fn, present = _f1_counts(logits, labels)
    f1 = 2 * tp[present] / (2 * tp[present] + fp[present] + fn[present])
    return float(f1.mean())


def _binary_auc(scores: torch.Tensor, truth: torch.Tensor) -> float:
    """ROC-AUC of one task from the Mann-Whitney rank sum; tied scores get their mean rank
    (a tie between a positive and a negative counts one half, as the ROC's trapezoids)."""
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    _, inverse, counts = torch.unique_consecutive(
        sorted_scores, return_inverse=True, return_counts=True
    )
    ends = torch.cumsum(counts, 0).double()  # 1-based rank of each tie group's last member
    mean_rank = ends - (counts.double() - 1) / 2
    ranks = torch.empty_like(mean_rank[inverse])
    ranks[order] = mean_rank[inverse]
    pos = truth == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def rocauc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """OGB's ROC-AUC for multi-label tasks: the mean, over the columns of the ``N x C`` 0/1
    ``labels`` that hold both a 0 and a 1, of each column's ROC-AUC for ``scores`` (logits
    or probabilities: only their order counts). Entries that are neither 0 nor 1 are
    unlabelled and left out. UndefinedScoreError when no column qualifies."""
    if scores.shape != labels.shape or scores.dim() != 2:
        raise ValueError(
            f"expected N x C scores and labels, got {tuple(scores.shape)} and "
            f"{tuple(labels.shape)}"
        )
    scores = scores.double()
    aucs = []
    for task in range(labels.shape[1]):
        truth = labels[:, task]
        known = (truth == 0) | (truth == 1)
        truth = truth[known]
        if bool((truth == 1).any()) and bool((truth == 0).any()):
            aucs.append(_binary_auc(scores[known, task], truth))
    if not aucs:
        raise UndefinedScoreError(
            "ROC-AUC is undefined: no task has both a positive and a negative evaluated label"
        )
    return sum(aucs) / len(aucs)


#: Every score by name: ``score(logits, labels) -> float``.
SCORES: Mapping[str, Callable[[torch.Tensor, torch.Tensor], float]] = MappingProxyType(
    {"acc": accuracy, "f1_micro": f1_micro, "f1_macro": f1_macro, "rocauc": rocauc}
)


# ---------------------------------------------------------------------------- link prediction


def _link_pos(pos: torch.Tensor) -> torch.Tensor:
    if pos.dim() != 1:
        raise ValueError(f"expected 1-D positive scores, got shape {tuple(pos.shape)}")
    if pos.numel() == 0:
        raise UndefinedScoreError("no positive pairs to score")
    return pos.detach().double()


def ranks_per_source(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """OGB's rank of each positive ``pos[i]`` among its own negatives ``neg[i, :]``
    (``E`` and ``E x K`` scores): ``1 + (optimistic + pessimistic) / 2``, where optimistic
    counts the negatives scoring above it and pessimistic those scoring at least as high."""
    pos = _link_pos(pos)
    if neg.dim() != 2 or neg.shape[0] != pos.shape[0]:
        raise ValueError(
            f"expected E x K negative scores for {pos.shape[0]} positives, got "
            f"{tuple(neg.shape)}"
        )
    neg = neg.detach().double()
    optimistic = (neg > pos[:, None]).sum(1)
    pessimistic = (neg >= pos[:, None]).sum(1)
    return 0.5 * (optimistic + pessimistic).double() + 1


def mrr(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """Mean reciprocal rank of each positive among its own negatives (ogbl-citation2's
    evaluator): ``pos`` ``(E,)``, ``neg`` ``(E, K)``; ranks as :func:`ranks_per_source`."""
    return float((1.0 / ranks_per_source(pos, neg)).mean())


def ranks_against_shared(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """OGB's rank (as :func:`ranks_per_source`) of each positive ``(E,)`` against all the
    shared negatives ``(M,)``, by binary search in the sorted negatives: ``O((E + M) log M)``
    time, no ``E x M`` matrix."""
    pos = _link_pos(pos)
    if neg.dim() != 1:
        raise ValueError(f"expected 1-D shared negative scores, got shape {tuple(neg.shape)}")
    ordered = torch.sort(neg.detach().double().to(pos.device)).values
    m = ordered.numel()
    optimistic = m - torch.searchsorted(ordered, pos, right=True)
    pessimistic = m - torch.searchsorted(ordered, pos, right=False)
    return 0.5 * (optimistic + pessimistic).double() + 1


def hits_from_ranks(ranks: torch.Tensor, k: int) -> float:
    """The fraction of ``ranks`` that are ``k`` or better (ogbl-citation2's ``hits@K``)."""
    if ranks.numel() == 0:
        raise UndefinedScoreError("no positive pairs to score")
    return float((ranks <= k).double().mean())


def hits_at_k(pos: torch.Tensor, neg: torch.Tensor, k: int) -> float:
    """ogbl-collab's and ogbl-ppa's ``hits@K``: the fraction of positives ``(E,)`` scoring
    strictly above the ``k``-th highest of the shared negatives ``(M,)``; 1.0 when there
    are fewer than ``k`` negatives."""
    pos = _link_pos(pos)
    if neg.dim() != 1:
        raise ValueError(f"expected 1-D shared negative scores, got shape {tuple(neg.shape)}")
    if k < 1:
        raise ValueError(f"hits@K needs K >= 1, got {k}")
    if neg.numel() < k:
        return 1.0
    kth = torch.topk(neg.detach().double().to(pos.device), k).values[-1]
    return float((pos > kth).double().mean())


#: The protocols :func:`link_scores` reads negatives in.
LINK_PROTOCOLS = ("pairs", "per-source")


def link_scores(
    pos: torch.Tensor, neg: torch.Tensor, protocol: str, metrics: Iterable[str]
) -> dict[str, float]:
    """Link-prediction ``metrics`` (each ``"mrr"``, ``"rocauc"`` or ``"hits@K"``) of the
    positive scores ``pos`` ``(E,)`` and negative scores ``neg``: ``(M,)`` shared by every
    positive for ``protocol="pairs"``, ``(E, K)`` per positive for ``"per-source"``
    (module docstring). UndefinedScoreError when there are no positives (``rocauc``: or no
    negatives)."""
    if protocol not in LINK_PROTOCOLS:
        raise UserError(f"link prediction protocol {protocol!r}: one of {LINK_PROTOCOLS}")
    names = [check_metric(m) for m in metrics]
    pairs = protocol == "pairs"
    if neg.dim() != (1 if pairs else 2):
        raise ValueError(
            f"protocol {protocol!r} takes {'1-D' if pairs else 'E x K'} negative scores, got "
            f"shape {tuple(neg.shape)}"
        )
    ranks = None
    out: dict[str, float] = {}
    for name in names:
        if name == "rocauc":
            p, n = _link_pos(pos), neg.detach().double().reshape(-1).to(pos.device)
            if n.numel() == 0:
                raise UndefinedScoreError("ROC-AUC is undefined: no negative pairs")
            truth = torch.cat([torch.ones_like(p), torch.zeros_like(n)])
            out[name] = _binary_auc(torch.cat([p, n]), truth)
            continue
        if name.startswith("hits@") and pairs:
            out[name] = hits_at_k(pos, neg, int(name[5:]))
            continue
        if ranks is None:
            ranks = ranks_against_shared(pos, neg) if pairs else ranks_per_source(pos, neg)
        if name == "mrr":
            out[name] = float((1.0 / ranks).mean())
        else:
            out[name] = hits_from_ranks(ranks, int(name[5:]))
    return out


def global_mean(
    value: Any, grid: Any, axes: tuple[str, ...] = ("z", "expert", "context", "data")
) -> float:
    """Mean of a per-rank scalar tensor over the grid ``axes`` (the batch axes: every rank
    gets the mean over the global batch)."""
    from gnnpar import comm

    v = value.detach().to(torch.float64).reshape(1).to(grid.device)
    for axis in axes:
        comm.all_reduce(v, grid, axis, op="avg")
    return float(v)


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def rss_mb() -> float | None:
    """Resident memory of this process now, in MiB (None where ``/proc`` is missing)."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * resource.getpagesize() / (1 << 20)


def memory_text(memory: Mapping[str, list[float]]) -> str:
    """``peak memory: 3,500 MiB (rank 1; ranks 3,356-3,500) over an idle baseline of 358
    MiB``: a :meth:`~gnnpar.train.loop.Trainer.rank_memory` record in one line."""
    peaks, baselines = memory["peak_rss_mb"], memory["baseline_rss_mb"]
    top = max(range(len(peaks)), key=peaks.__getitem__)
    spread = f"; ranks {min(peaks):,.0f}-{max(peaks):,.0f}" if len(peaks) > 1 else ""
    where = f" (rank {top}{spread})" if len(peaks) > 1 else ""
    known = [b for b in baselines if b == b]  # NaN: not measured
    base = f" over an idle baseline of {max(known):,.0f} MiB" if known else ""
    return f"peak memory: {peaks[top]:,.0f} MiB{where}{base}"


class MetricsLog:
    """Append-only JSONL log; each record gets a wall-clock time stamp. With
    ``tensorboard_dir``, the numbers of every step record also go to TensorBoard."""

    def __init__(
        self, path: str | Path, enabled: bool = True, tensorboard_dir: str | Path | None = None
    ):
        self.path = Path(path)
        self.enabled = enabled
        self._tb = None
        if enabled:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._end_torn_line()
            except OSError as err:
                raise naming(err, self.path) from None
            if tensorboard_dir is not None:
                self._tb = _summary_writer(Path(tensorboard_dir))

    def _end_torn_line(self) -> None:
        # A run killed mid-write leaves a partial last line; start the next record on a
        # line of its own so that only the torn one is lost.
        if self.path.is_file() and self.path.stat().st_size:
            with open(self.path, "rb+") as f:
                f.seek(-1, 2)
                if f.read(1) != b"\n":
                    f.write(b"\n")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (a line of JSON)."""
        if not self.enabled:
            return
        record = {"time": time.time(), **record}
        try:
            self._append(json.dumps(record) + "\n")
        except OSError as err:  # a full disk, a folder made read-only during the run
            raise naming(err, self.path) from None
        if self._tb is not None:
            self._write_scalars(record)

    def drop_after(self, unit: str, last: int) -> int:
        """Remove the records of ``unit`` (``"epoch"``, ``"step"``) beyond ``last``: a
        resumed run redoes them, so a killed attempt's would otherwise appear twice. The
        file is rewritten atomically (temporary name, then rename); lines that do not parse
        (a torn last line) are kept as they are. Returns the number removed."""
        if not self.enabled or not self.path.is_file():
            return 0
        try:
            lines = self.path.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
            kept = [line for line in lines if not _beyond(line, unit, last)]
            if len(kept) < len(lines):
                text = "".join(f"{line}\n" for line in kept)
                atomic_write(
                    self.path,
                    lambda tmp: Path(tmp).write_text(
                        text, encoding="utf-8", errors="surrogateescape"
                    ),
                )
        except OSError as err:
            raise naming(err, self.path) from None
        return len(lines) - len(kept)

    def _append(self, line: str) -> None:
        with open(self.path, "a") as f:
            f.write(line)

    def _write_scalars(self, record: dict[str, Any]) -> None:
        step = next((record[k] for k in ("step", "epoch") if k in record), None)
        if step is None or "event" in record:
            return
        for key, value in scalars(record).items():
            self._tb.add_scalar(key, value, step)
        self._tb.flush()

    def close(self) -> None:
        """Flush and close the TensorBoard writer, if any."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _beyond(line: str, unit: str, last: int) -> bool:
    """Whether a metrics line is a record whose ``unit`` is past ``last``."""
    try:
        record = json.loads(line)
    except ValueError:
        return False
    value = record.get(unit) if isinstance(record, dict) else None
    return isinstance(value, int) and not isinstance(value, bool) and value > last


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers as flat names: ``loss``, ``bytes/x/all_reduce``, ..."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("time", "step", "epoch"):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
        elif key == "bytes" and isinstance(value, dict):
            for axis, kinds in value.items():
                for kind, n in kinds.items():
                    out[f"bytes/{axis}/{kind}"] = float(n)
    return out


def _summary_writer(logdir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:  # torch's writer needs the tensorboard package
        raise MissingPackageError(
            "--tensorboard needs the tensorboard package: pip install tensorboard"
        ) from err
    return SummaryWriter(log_dir=str(logdir))


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics file (a torn last line from a crash is skipped; so is a
    line that is not a JSON object). UserError naming the file and line for bytes that are
    not UTF-8."""
    out = []
    for number, raw in enumerate(Path(path).read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise UserError(
                f"{path}: line {number} is not UTF-8 text (byte {err.start}); a metrics file "
                "holds JSON lines"
            ) from None
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
