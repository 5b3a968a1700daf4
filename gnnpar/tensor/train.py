"""GPT training with 4D hybrid parallelism (data × x × y × z), as a reusable function.

:func:`train_gpt` runs a whole job from a :class:`GPTTrainConfig` and returns its results;
the pieces it is made of (:func:`setup`, :func:`train_step`, :func:`evaluate`,
:func:`sample`, :func:`lr_at`) are public so a script can write its own loop
(``examples/train_gpt.py`` does).

The batch is split over the data and z axes: a global batch of ``batch_size`` blocks per
step, each (data, z) coordinate holding ``batch_size / (data·z)`` of them (the x and y ranks
of one coordinate hold the same blocks). The global batch, the model's initial values and
therefore the loss curve do not depend on the grid for a given seed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import gnnpar
from gnnpar import checkpoint, comm
from gnnpar.grid import ProcessGrid, parse_grid_spec
from gnnpar.nn.gpt import GPT, GPTConfig
from gnnpar.tensor.layers import Linear, cross_entropy
from gnnpar.tensor.parallelize import parallelize
from gnnpar.tensor.state import clip_grad_norm_, local_numel, sharded_parameters, sync_gradients

__all__ = [
    "GPTTrainConfig",
    "Session",
    "evaluate",
    "lr_at",
    "sample",
    "setup",
    "train_gpt",
    "train_step",
]


@dataclasses.dataclass
class GPTTrainConfig:
    """Everything a GPT training run needs. Sizes of the batch are global (all ranks)."""

    data: str = "shakespeare"  # "shakespeare", a text file or a folder of them
    vocab_size: int = 2048  # BPE vocabulary trained on the data
    block_size: int = 128
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    batch_size: int = 16  # blocks per step, over all data and z ranks
    steps: int = 300
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 20
    weight_decay: float = 0.1
    beta2: float = 0.99
    grad_clip: float = 1.0
    grid: str = ""  # e.g. "data=2,x=2"; empty: every rank on the data axis
    seed: int = 1337
    val_fraction: float = 0.05
    val_every: int = 0  # 0: only at the end
    val_batches: int = 4
    ckpt_dir: str | None = None
    ckpt_every: int = 0  # 0: only at the end (when ckpt_dir is set)
    resume: bool = False
    sample_tokens: int = 100
    prompt: str = "ROMEO:\n"
    temperature: float = 0.8
    top_k: int | None = 50
    dtype: str = "float32"
    progress: bool = True

    def model_config(self, vocab_size: int) -> GPTConfig:
        """The :class:`GPTConfig` of this run for a tokenizer of ``vocab_size`` ids."""
        return GPTConfig(
            vocab_size=vocab_size,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=self.dropout,
            bias=self.bias,
            tie_weights=self.tie_weights,
        )


@dataclasses.dataclass
class Session:
    """A run set up by :func:`setup`: the grid, data, model and optimizer."""

    config: GPTTrainConfig
    grid: ProcessGrid
    corpus: Any
    train: Any
    val: Any
    model: GPT
    optimizer: torch.optim.Optimizer
    num_params: int

    @property
    def head(self) -> torch.nn.Module:
        """The output layer (needed to read its vocabulary-sharded logits)."""
        return self.model.lm_head


def lr_at(config: GPTTrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to ``min_lr`` at the last step."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    span = max(1, config.steps - config.warmup)
    progress = min(1.0, (step - config.warmup) / span)
    return config.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (config.lr - config.min_lr)


def _optimizer(model: torch.nn.Module, config: GPTTrainConfig) -> torch.optim.Optimizer:
    # Decay matrices (full shape 2-D, however they are stored), not biases or norms.
    layouts = {id(getattr(m, n)): lay for m, n, lay in sharded_parameters(model).values()}
    decay, rest, seen = [], [], set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        lay = layouts.get(id(p))
        ndim = len(lay.shape) if lay is not None else p.dim()
        (decay if ndim >= 2 else rest).append(p)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, config.beta2))


def setup(config: GPTTrainConfig, grid: ProcessGrid | None = None) -> Session:
    """Initialise the grid (unless given), load the data (rank 0 first, so the tokenizer is
    trained once), build the GPT from ``config.seed`` and make it parallel."""
    from gnnpar.data.text import TokenBlocks, load_corpus

    if grid is None:
        grid = gnnpar.init(**parse_grid_spec(config.grid))
    dtype = getattr(torch, config.dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must name a floating torch dtype, got {config.dtype!r}")
    if grid.global_rank == 0:
        corpus = load_corpus(config.data, config.vocab_size)
    comm.barrier(grid)
    if grid.global_rank != 0:
        corpus = load_corpus(config.data, config.vocab_size)
    train_tokens, val_tokens = corpus.split(config.val_fraction)
    shards = grid.size("data") * grid.size("z")
    shard = grid.rank("z") + grid.size("z") * grid.rank("data")
    if config.batch_size % shards:
        raise ValueError(
            f"batch_size {config.batch_size} does not divide over data*z = {shards} ranks"
        )
    train = TokenBlocks(
        train_tokens, config.block_size, config.batch_size, shard, shards, config.seed
    )
    val = TokenBlocks(
        val_tokens, config.block_size, config.batch_size, shard, shards, config.seed + 1
    )
    torch.manual_seed(config.seed)
    plain = GPT(config.model_config(corpus.vocab_size)).to(dtype)
    num_params = plain.num_params()
    model = parallelize(plain, grid)
    return Session(config, grid, corpus, train, val, model, _optimizer(model, config), num_params)


def _global_mean(value: torch.Tensor, grid: ProcessGrid) -> float:
    """Mean of a per-rank scalar over the batch axes (data and z)."""
    v = value.detach().to(torch.float64).reshape(1).clone()
    comm.all_reduce(v, grid, "z", op="avg")
    comm.all_reduce(v, grid, "data", op="avg")
    return float(v)


def train_step(s: Session, step: int) -> tuple[float, float]:
    """One optimizer step on the batch of ``step``; returns (global mean loss, gradient norm
    before clipping)."""
    for group in s.optimizer.param_groups:
        group["lr"] = lr_at(s.config, step)
    s.model.train()
    x, y = s.train.batch(step)
    x, y = x.to(s.grid.device), y.to(s.grid.device)
    loss = cross_entropy(s.model(x), y, s.head)
    s.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    sync_gradients(s.model, s.grid)
    if s.config.grad_clip > 0:
        norm = float(clip_grad_norm_(s.model, s.config.grad_clip, s.grid))
    else:
        norm = float("nan")
    s.optimizer.step()
    return _global_mean(loss, s.grid), norm


@torch.no_grad()
def evaluate(s: Session, batches: int | None = None) -> float:
    """Mean validation loss over ``batches`` global batches (default ``val_batches``)."""
    s.model.eval()
    n = s.config.val_batches if batches is None else batches
    total = 0.0
    for i in range(n):
        x, y = s.val.batch(i)
        x, y = x.to(s.grid.device), y.to(s.grid.device)
        total += _global_mean(cross_entropy(s.model(x), y, s.head), s.grid)
    s.model.train()
    return total / max(n, 1)


def _full_logits(head: torch.nn.Module, grid: ProcessGrid):
    if isinstance(head, Linear) and not head.gather_output and grid.size(head.out_axis) > 1:
        return lambda lg: comm.all_gather(
            lg.contiguous(), grid, head.out_axis, dim=-1, sizes=head.out_sizes
        )
    return None


@torch.no_grad()
def sample(s: Session, prompt: str | None = None, tokens: int | None = None) -> str:
    """Text generated from ``prompt`` (every rank runs the model; every rank draws the same
    tokens from the same seeded generator)."""
    c = s.config
    prompt = c.prompt if prompt is None else prompt
    ids = s.corpus.encode(prompt) or [0]
    idx = torch.tensor([ids], dtype=torch.int64, device=s.grid.device)
    g = torch.Generator().manual_seed(c.seed)
    s.model.eval()
    out = s.model.generate(
        idx,
        c.sample_tokens if tokens is None else tokens,
        temperature=c.temperature,
        top_k=c.top_k,
        generator=g,
        full_logits=_full_logits(s.head, s.grid),
    )
    s.model.train()
    return s.corpus.decode(out[0])


def train_gpt(
    config: GPTTrainConfig,
    grid: ProcessGrid | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """Train a GPT as ``config`` says; return ``{"losses", "final_loss", "val_loss",
    "val_losses", "tokens_per_s", "num_params", "local_params", "grid", "sample",
    "checkpoint", "time_s"}`` (the same on every rank).

    ``on_step(step, metrics)`` is called on every rank after each optimizer step with
    ``loss``, ``grad_norm``, ``lr`` and ``tokens_per_s`` (for a caller's own progress
    display or metrics log; set ``config.progress=False`` to drop the built-in bar)."""
    from tqdm import tqdm

    s = setup(config, grid)
    grid, rank0 = s.grid, s.grid.global_rank == 0
    start = 0
    if config.resume and config.ckpt_dir:
        found = checkpoint.load(config.ckpt_dir, grid, s.model, s.optimizer)
        start = found.step if found is not None else 0
    tokens_per_step = config.batch_size * config.block_size
    losses: list[float] = []
    val_losses: list[tuple[int, float]] = []
    ckpt: Path | None = None
    bar = tqdm(
        range(start, config.steps),
        initial=start,
        total=config.steps,
        disable=not (config.progress and rank0),
        dynamic_ncols=True,
        desc=f"gpt {grid.describe().split(' (')[0]}",
    )
    t0 = time.perf_counter()
    timed_from, timed_steps = None, 0
    for step in bar:
        loss, norm = train_step(s, step)
        losses.append(loss)
        if step > start:  # the first step pays for warm-up; leave it out of the rate
            timed_steps += 1
        else:
            timed_from = time.perf_counter()
        rate = tokens_per_step * timed_steps / max(time.perf_counter() - timed_from, 1e-9)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}")
        if on_step is not None:
            metrics = {"loss": loss, "grad_norm": norm, "lr": lr_at(config, step)}
            on_step(step, {**metrics, "tokens_per_s": rate})
        done = step + 1
        if config.val_every and done % config.val_every == 0 and done < config.steps:
            val_losses.append((done, evaluate(s)))
        if config.ckpt_dir and config.ckpt_every and done % config.ckpt_every == 0:
            ckpt = checkpoint.save(config.ckpt_dir, done, grid, s.model, s.optimizer)
    bar.close()
    elapsed = time.perf_counter() - t0
    rate = (
        tokens_per_step * timed_steps / max(time.perf_counter() - timed_from, 1e-9)
        if timed_from is not None and timed_steps
        else float("nan")
    )
    val = evaluate(s)
    val_losses.append((config.steps, val))
    if config.ckpt_dir and (ckpt is None or not ckpt.name.endswith(f"{config.steps:06d}")):
        ckpt = checkpoint.save(config.ckpt_dir, config.steps, grid, s.model, s.optimizer)
    text = sample(s) if config.sample_tokens > 0 else ""
    tail = losses[-10:]
    return {
        "losses": losses,
        "final_loss": sum(tail) / len(tail) if tail else float("nan"),
        "val_loss": val,
        "val_losses": val_losses,
        "tokens_per_s": rate,
        "num_params": s.num_params,
        "local_params": local_numel(s.model),
        "grid": {"data": grid.data, "x": grid.x, "y": grid.y, "z": grid.z},
        "sample": text,
        "checkpoint": str(ckpt) if ckpt is not None else None,
        "time_s": elapsed,
    }
