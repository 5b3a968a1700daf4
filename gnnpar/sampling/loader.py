"""A mini-batch loader over seed nodes: shuffling, batching, data gathering and prefetching.

:class:`NodeLoader` cuts the seeds into batches (shuffled per epoch from ``seed``), asks a
sampler for each batch's blocks, gathers the input features and the seed labels, and hands
out :class:`~gnnpar.sampling.block.MiniBatch` objects. With ``prefetch > 0`` a background
thread prepares batch ``i + 1`` (sampling and feature gathering) while batch ``i`` trains;
with a CUDA ``device`` the batch is pinned in that thread and copied asynchronously.

Batches are **global**: each epoch orders every seed of the run by a hash of ``(seed, epoch,
key)`` — a seed's key is its original node id — and cuts that order into batches of
``batch_size``. A data-parallel rank's loader knows every key (``all_keys``) but holds only its
own seeds (``keys``): its part of global batch ``i`` is those of its seeds that fall in it. So
the global batches, their random keys and (with a model that keys its dropout by node) the
whole training run are the same on one rank or many, however the seeds are partitioned; a
run resumed on another number of ranks continues at the same global position.

Everything random is a function of ``(seed, epoch, batch index)``, so an epoch is the same
whether or not it is prefetched, and :meth:`NodeLoader.state_dict` (epoch and position in the
epoch) is enough to resume exactly where a run stopped::

    loader = NodeLoader(sampler, train_ids, batch_size=1024, features=feat, labels=label)
    for epoch in range(10):
        for batch in loader:              # one epoch; the loader then moves to the next
            logits = model(batch.blocks, batch.x)
            loss = F.cross_entropy(logits, batch.y)
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from gnnpar.comm import chunk_sizes
from gnnpar.errors import UserError
from gnnpar.sampling.block import MiniBatch
from gnnpar.sampling.neighbor import as_node_ids
from gnnpar.sampling.rng import derive_key, random_bits

__all__ = [
    "NodeLoader",
    "Sampler",
    "SubgraphLoader",
    "SubgraphSampler",
    "batch_sizes",
    "prefetched",
]

_PERMUTATION = 0x5EED  # salts that keep the streams of the loader apart
_BATCH = 0xB47C


class Sampler(Protocol):
    """What :class:`NodeLoader` needs from a sampler."""

    def sample(self, seeds: torch.Tensor, key: int | None = None) -> MiniBatch:
        """Blocks for ``seeds`` drawn with random key ``key``."""


DataSource = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


def batch_sizes(num_seeds: int, batch_size: int, drop_last: bool) -> list[int]:
    """Sizes of the (global) batches of one epoch: ``batch_size`` each, the last one smaller
    (or dropped with ``drop_last``)."""
    full, rest = divmod(num_seeds, batch_size)
    return [batch_size] * full + ([rest] if rest and not drop_last else [])


def _gather(source: DataSource | None, ids: torch.Tensor) -> torch.Tensor | None:
    if source is None:
        return None
    if isinstance(source, torch.Tensor):
        return source.index_select(0, ids)
    return source(ids)


def prefetched(make: Callable[[int], Any], indices: range, depth: int) -> Iterator[Any]:
    """``make(i)`` for every ``i`` of ``indices``, in order, prepared up to ``depth`` ahead by
    a background thread; an error of ``make`` is raised here, and stopping early stops it."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for i in indices:
                if stop.is_set():
                    return
                item = make(i)
                while not stop.is_set():
                    try:
                        slots.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as err:  # noqa: BLE001 - handed to the consumer
            slots.put(err)

    worker = threading.Thread(target=produce, name="gnnpar-prefetch", daemon=True)
    worker.start()
    try:
        for _ in indices:
            item = slots.get()
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while worker.is_alive():
            try:
                slots.get(timeout=0.05)
            except queue.Empty:
                pass
        worker.join()


class NodeLoader:
    """Iterate mini-batches of seed nodes through a sampler.

    Args:
        sampler: anything with ``sample(seeds, key) -> MiniBatch`` (a
            :class:`~gnnpar.sampling.NeighborSampler`, a distributed sampler, ...).
        seeds: this loader's seed node ids (int64) or a boolean mask.
        batch_size: seeds per global batch (at least 1), over all ranks.
        shuffle: a new seed order every epoch.
        drop_last: drop the last, smaller batch.
        seed: the seed of shuffling and sampling.
        features: node features, indexed by :attr:`MiniBatch.input_nodes` to give
            ``batch.x``: an ``(N, F)`` tensor, or a function of the ids (e.g. a distributed
            fetcher's ``fetch``).
        labels: the same for ``batch.y``, indexed by the seeds.
        prefetch: batches prepared ahead by a background thread (0: none).
        device: where batches go; ``None`` keeps them on the CPU.
        pin_memory: pin batches before the copy (default: when ``device`` is CUDA).
        num_nodes: the id bound for validating ``seeds`` (default: the sampler's
            ``num_nodes`` if it has one).
        keys: the key of each seed (default: its id): the id that orders it, normally its
            original node id before a partition relabelled it.
        all_keys: the keys of every seed of every rank (default: ``keys``, one process).
        micro_batches: cut every global batch into this many consecutive pieces, handed out
            one by one (gradient accumulation): each is sampled with its batch's random key,
            so a node gets the neighbours and dropout it would get in the whole batch.
        prepare: a function of each batch run where it is sampled (the prefetch thread), its
            result kept as :attr:`MiniBatch.prepared` (e.g. a model's per-block indexing,
            taken off the training step); None: nothing.

    Raises:
        ValueError: ``batch_size < 1``, ``prefetch < 0``, bad seeds, repeated keys, or keys
        missing from ``all_keys``.
    """

    def __init__(
        self,
        sampler: Sampler,
        seeds: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        features: DataSource | None = None,
        labels: DataSource | None = None,
        prefetch: int = 1,
        device: torch.device | str | None = None,
        pin_memory: bool | None = None,
        num_nodes: int | None = None,
        keys: torch.Tensor | None = None,
        all_keys: torch.Tensor | None = None,
        micro_batches: int = 1,
        prepare: Callable[[MiniBatch], Any] | None = None,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise UserError(f"prefetch must be an integer >= 0, got {prefetch!r}")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise UserError(f"micro_batches must be a positive integer, got {micro_batches!r}")
        self.micro_batches = micro_batches
        self.prepare = prepare
        bound = num_nodes if num_nodes is not None else getattr(sampler, "num_nodes", None)
        if bound is None:
            raise ValueError("pass num_nodes: the sampler does not say how many nodes there are")
        self.sampler = sampler
        self.seeds = as_node_ids(seeds, int(bound))
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.seed = int(seed)
        self.features = features
        self.labels = labels
        self.keys, self.all_keys, self._where = _keys(self.seeds, keys, all_keys)
        self.prefetch = prefetch
        self.device = None if device is None else torch.device(device)
        if pin_memory is None:
            pin_memory = self.device is not None and self.device.type == "cuda"
        self.pin_memory = bool(pin_memory)
        self.epoch = 0
        self.position = 0
        self._order: tuple[int, torch.Tensor] | None = None  # global_batch's epoch order

    # ------------------------------------------------------------------ epochs and state
    def __len__(self) -> int:
        """Batches (micro-batches) per epoch, the same on every rank."""
        return len(self.global_sizes()) * self.micro_batches

    def global_sizes(self) -> list[int]:
        """Seeds in each global batch of an epoch, over all ranks."""
        return batch_sizes(self.all_keys.numel(), self.batch_size, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch at the next iteration."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> dict[str, int]:
        """Where the loader stands: the epoch and the batches of it already handed out."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from :meth:`state_dict`; a different ``seed`` is refused."""
        if int(state["seed"]) != self.seed:
            raise UserError(
                f"loader state was saved with seed {state['seed']}, this loader has {self.seed}"
            )
        if not 0 <= int(state["position"]) <= len(self):
            raise UserError(f"loader position {state['position']} is outside 0..{len(self)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def batch_key(self, epoch: int, index: int) -> int:
        """The random key of global batch ``index`` of ``epoch`` (what the sampler
        receives; the same on every rank)."""
        return derive_key(self.seed, _BATCH, epoch, index)

    def epoch_positions(self, epoch: int) -> torch.Tensor:
        """Where each of ``all_keys`` stands in the global order of ``epoch``: by a 64-bit
        hash of (seed, epoch, key), ties by key; by key without ``shuffle``."""
        n = self.all_keys.numel()
        order = torch.argsort(self.all_keys, stable=True)
        if self.shuffle:
            bits = random_bits(derive_key(self.seed, _PERMUTATION, epoch), self.all_keys, 2)
            rank = (bits[0] << 32) | bits[1]
            order = order[torch.argsort(rank[order], stable=True)]
        position = torch.empty(n, dtype=torch.int64)
        position[order] = torch.arange(n, dtype=torch.int64)
        return position

    def global_batch(self, epoch: int, index: int) -> torch.Tensor:
        """The keys of every seed of global batch ``index`` of ``epoch``, over all ranks, in
        batch order (for a sampler whose batch depends on the whole global batch, such as
        link prediction's exclusion of every target edge: ``reads_global_batch``)."""
        cached = self._order
        if cached is None or cached[0] != epoch:
            order = torch.argsort(self.epoch_positions(epoch))
            cached = self._order = (epoch, self.all_keys.index_select(0, order))
        start = sum(self.global_sizes()[:index])
        return cached[1][start : start + self.global_sizes()[index]]

    def epoch_batches(self, epoch: int) -> list[torch.Tensor]:
        """This loader's seed ids in every global batch (every micro-batch) of ``epoch``,
        in order; some may be empty."""
        sizes = self.global_sizes()
        if not sizes:
            return []
        pos = self.epoch_positions(epoch).index_select(0, self._where)
        kept = pos < sum(sizes)
        pos, seeds = pos[kept], self.seeds[kept]
        by_pos = torch.argsort(pos)
        pos, seeds = pos[by_pos], seeds[by_pos]
        # cut points: every micro-batch of every global batch, by global position
        bounds = [0]
        for size in sizes:
            start = bounds[-1]
            for n in chunk_sizes(size, self.micro_batches):
                bounds.append(start + n)
                start += n
        unit = torch.bucketize(pos, torch.tensor(bounds[1:]), right=True)
        counts = torch.bincount(unit, minlength=len(bounds) - 1)
        return list(torch.split(seeds, counts.tolist()))

    # ------------------------------------------------------------------ making batches
    def make_batch(self, epoch: int, index: int, seeds: torch.Tensor) -> MiniBatch:
        """Sample and gather (micro-)batch ``index`` of ``epoch`` (what the prefetch thread
        runs)."""
        t0 = time.perf_counter()
        whole, micro = divmod(index, self.micro_batches)
        key = self.batch_key(epoch, whole)
        if getattr(self.sampler, "reads_global_batch", False):  # e.g. an EdgeSampler
            batch = self.sampler.sample(seeds, key=key, batch=self.global_batch(epoch, whole))
        else:
            batch = self.sampler.sample(seeds, key=key)
        t1 = time.perf_counter()
        batch.x = _gather(self.features, batch.input_nodes)
        batch.y = _gather(self.labels, batch.seeds)
        if self.prepare is not None:
            batch.prepared = self.prepare(batch)
        t2 = time.perf_counter()
        batch.epoch, batch.index, batch.micro = epoch, whole, micro
        batch.global_size = self.global_sizes()[whole]
        batch.stats.setdefault("sample_s", t1 - t0)
        batch.stats.setdefault("gather_s", t2 - t1)
        if self.pin_memory:
            batch = batch.pin_memory()
        return batch

    def _deliver(self, batch: MiniBatch) -> MiniBatch:
        if self.device is None:
            return batch
        return batch.to(self.device, non_blocking=self.pin_memory)

    def __iter__(self) -> Iterator[MiniBatch]:
        """The rest of the current epoch; at its end the loader moves to the next epoch."""
        epoch, start = self.epoch, self.position
        batches = self.epoch_batches(epoch)
        if self.prefetch == 0:
            for i in range(start, len(batches)):
                batch = self.make_batch(epoch, i, batches[i])
                self.position = i + 1
                yield self._deliver(batch)
        else:
            yield from self._prefetched(epoch, start, batches)
        if self.epoch == epoch and self.position >= len(batches):
            self.epoch, self.position = epoch + 1, 0

    def _prefetched(
        self, epoch: int, start: int, batches: list[torch.Tensor]
    ) -> Iterator[MiniBatch]:
        made = prefetched(
            lambda i: self.make_batch(epoch, i, batches[i]),
            range(start, len(batches)),
            self.prefetch,
        )
        for i, item in zip(range(start, len(batches)), made, strict=True):
            self.position = i + 1
            yield self._deliver(item)

    def __repr__(self) -> str:
        return (
            f"NodeLoader(seeds={self.seeds.numel()} of {self.all_keys.numel()}, "
            f"batch_size={self.batch_size}, "
            f"batches={len(self)}, shuffle={self.shuffle}, prefetch={self.prefetch})"
        )


def _keys(
    seeds: torch.Tensor, keys: torch.Tensor | None, all_keys: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys, all_keys, where): every seed's key, every rank's keys, and the index of each of
    this loader's keys in ``all_keys``."""
    keys = seeds if keys is None else torch.as_tensor(keys, dtype=torch.int64)
    if keys.shape != seeds.shape:
        raise ValueError(f"keys must have one entry per seed ({seeds.numel()}), got {keys.numel()}")
    all_keys = keys if all_keys is None else torch.as_tensor(all_keys, dtype=torch.int64)
    ordered, order = torch.sort(all_keys)
    if ordered.numel() > 1 and bool((ordered[1:] == ordered[:-1]).any()):
        dup = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
        raise ValueError(f"seed key {dup} appears more than once")
    at = torch.searchsorted(ordered, keys).clamp(max=max(ordered.numel() - 1, 0))
    if keys.numel() and (not ordered.numel() or bool((ordered[at] != keys).any())):
        raise ValueError("every seed's key must be among all_keys")
    return keys, all_keys, order[at] if keys.numel() else at


class SubgraphSampler(Protocol):
    """What :class:`SubgraphLoader` needs from a subgraph sampler (GraphSAINT, ClusterGCN)."""

    num_nodes: int
    batches_per_epoch: int

    def batch(self, epoch: int, index: int) -> MiniBatch:
        """Subgraph ``index`` of ``epoch``, a function of the sampler's seed."""


class SubgraphLoader:
    """Iterate a subgraph sampler's mini-batches: ``per_step`` subgraphs per step over all
    data ranks (default: one per rank), each rank taking ``per_step / ranks`` of them in a row.

    An epoch has ``ceil(batches / per_step)`` steps (``batches``: default the sampler's
    ``batches_per_epoch``); at step ``s`` rank ``r`` takes subgraphs ``s * per_step + r * k
    + j`` of the epoch for ``j < k = per_step / ranks`` (``batch.micro = j``: the trainer
    accumulates the ``k`` gradients before it steps), so every rank trains on samples of its
    own, and a step takes the same subgraphs on any number of ranks that divides
    ``per_step``. Features and labels are gathered for the subgraph's nodes. Like
    :class:`NodeLoader`, everything is a function of (seed, epoch, index): :meth:`state_dict`
    resumes exactly, prefetched or not.

    Args:
        sampler: has ``batch(epoch, index)``, ``num_nodes`` and ``batches_per_epoch``.
        features, labels: ``(N, ...)`` tensors or functions of the ids.
        rank, ranks: this data rank and the data ranks.
        batches: subgraphs per epoch over all ranks (default: the sampler's).
        per_step: subgraphs per step over all ranks, a multiple of ``ranks`` (default:
            ``ranks``, one per rank).
        prefetch: batches prepared ahead by a background thread (0: none).
        device: where batches go; ``None`` keeps them on the CPU.
        pin_memory: pin batches before the copy (default: when ``device`` is CUDA).
    """

    def __init__(
        self,
        sampler: SubgraphSampler,
        *,
        features: DataSource | None = None,
        labels: DataSource | None = None,
        rank: int = 0,
        ranks: int = 1,
        batches: int | None = None,
        per_step: int | None = None,
        prefetch: int = 1,
        device: torch.device | str | None = None,
        pin_memory: bool | None = None,
    ):
        if not 0 <= rank < ranks:
            raise ValueError(f"rank {rank} is outside 0..{ranks - 1}")
        per_step = ranks if per_step is None else per_step
        if isinstance(per_step, bool) or not isinstance(per_step, int) or per_step < 1:
            raise UserError(f"per_step must be an integer >= 1, got {per_step!r}")
        if per_step % ranks:
            raise UserError(f"per_step ({per_step}) must be a multiple of the {ranks} ranks")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise UserError(f"prefetch must be an integer >= 0, got {prefetch!r}")
        batches = sampler.batches_per_epoch if batches is None else batches
        if batches < 1:
            raise UserError(f"batches must be >= 1, got {batches}")
        self.sampler, self.features, self.labels = sampler, features, labels
        self.rank, self.ranks, self.prefetch = rank, ranks, prefetch
        #: Subgraphs per step over all ranks, and this rank's share of them.
        self.per_step, self.micro_batches = per_step, per_step // ranks
        self.steps = -(-batches // per_step) * self.micro_batches
        self.seed = int(getattr(sampler, "seed", 0))
        self.device = None if device is None else torch.device(device)
        if pin_memory is None:
            pin_memory = self.device is not None and self.device.type == "cuda"
        self.pin_memory = bool(pin_memory)
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Subgraphs per epoch on this rank (steps times its share), the same on every
        rank."""
        return self.steps

    set_epoch = NodeLoader.set_epoch
    state_dict = NodeLoader.state_dict
    load_state_dict = NodeLoader.load_state_dict
    _deliver = NodeLoader._deliver

    def make_batch(self, epoch: int, position: int) -> MiniBatch:
        """This rank's subgraph at ``position`` of ``epoch`` (step ``position // k``, its
        ``position % k``-th of ``k``), with its data gathered."""
        t0 = time.perf_counter()
        step, micro = divmod(position, self.micro_batches)
        index = step * self.per_step + self.rank * self.micro_batches + micro
        batch = self.sampler.batch(epoch, index)
        t1 = time.perf_counter()
        batch.x = _gather(self.features, batch.input_nodes)
        batch.y = _gather(self.labels, batch.seeds)
        batch.epoch, batch.index, batch.micro = epoch, index, micro
        batch.stats.setdefault("sample_s", t1 - t0)
        batch.stats.setdefault("gather_s", time.perf_counter() - t1)
        return batch.pin_memory() if self.pin_memory else batch

    def __iter__(self) -> Iterator[MiniBatch]:
        """The rest of the current epoch; at its end the loader moves to the next epoch."""
        epoch, start = self.epoch, self.position
        steps = range(start, self.steps)
        if self.prefetch == 0:
            made: Iterator[MiniBatch] = (self.make_batch(epoch, i) for i in steps)
        else:
            made = prefetched(lambda i: self.make_batch(epoch, i), steps, self.prefetch)
        for i, batch in zip(steps, made, strict=True):
            self.position = i + 1
            yield self._deliver(batch)
        if self.epoch == epoch and self.position >= self.steps:
            self.epoch, self.position = epoch + 1, 0

    def __repr__(self) -> str:
        return (
            f"SubgraphLoader({self.sampler!r}, steps={self.steps // self.micro_batches}, "
            f"per_step={self.per_step}, rank={self.rank} of {self.ranks}, "
            f"prefetch={self.prefetch})"
        )
