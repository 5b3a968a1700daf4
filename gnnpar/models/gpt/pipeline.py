"""Our GPT or HF GPT-2 as a pipeline: this rank's chunks, each sharded over the data axis,
and a step.

:func:`gpt_pipeline` takes the whole model (plain or tensor-parallel on the grid, the same
values on every rank), keeps the chunks of this pipe rank
(:class:`~gnnpar.models.gpt.model.GPTChunk`,
or :class:`~gnnpar.models.gpt.hf_gpt2.HFGPT2Chunk` for a ``transformers`` GPT2LMHeadModel,
split by :func:`~gnnpar.pipeline.stages.split_layers` by layer count or by cost) and shards
each with :func:`gnnpar.shard.shard`. One sharded model per chunk, because the data-parallel
reduction of a chunk runs in the backward of its own last micro-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from gnnpar import comm
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid
from gnnpar.models.gpt.hf_gpt2 import HFGPT2Chunk, check_hf_gpt2, is_hf_gpt2
from gnnpar.models.gpt.model import GPT, GPTChunk, model_sizes
from gnnpar.pipeline.runtime import Pipeline, StepResult, TiedWeight
from gnnpar.pipeline.stages import gpt_layer_costs, split_layers
from gnnpar.shard.clip import clip_factor, scale_grads_
from gnnpar.tensor.experts import plain_keys

__all__ = ["SPLITS", "GPTPipeline", "gpt_pipeline", "gpt_stage_layers"]

SPLITS = ("layers", "cost")


def gpt_stage_layers(model: nn.Module, stages: int, split: str = "layers") -> list[range]:
    """The blocks of each of ``stages`` virtual stages of our GPT or HF GPT-2: by layer count,
    or by cost (the head counted on the last stage)."""
    cfg = model_sizes(model)
    if split == "layers":
        return split_layers(cfg.n_layer, stages)
    if split == "cost":
        costs, first, last = gpt_layer_costs(
            cfg.n_layer, cfg.n_embd, cfg.block_size, cfg.vocab_size
        )
        return split_layers(cfg.n_layer, stages, costs, first, last)
    raise UserError(f"unknown pipeline split {split!r}; use {', '.join(SPLITS)}")


@dataclasses.dataclass
class GPTPipeline:
    """This pipe rank's part of a pipelined GPT."""

    grid: ProcessGrid
    chunks: list[GPTChunk | HFGPT2Chunk]
    #: One sharded model per chunk (what the optimizer steps and checkpoints save).
    dps: list[Any]
    pipeline: Pipeline
    layers: list[range]
    #: The whole model's state-dict keys, in order, and its tied keys (what checkpoints name).
    keys: list[str] = dataclasses.field(default_factory=list)
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def slots(self) -> list[Any]:
        """Every chunk's parameter slots (:class:`gnnpar.shard.flat.Slot`)."""
        return [s for dp in self.dps for s in dp.slots]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The optimizer's parameters of every chunk, by state-dict key."""
        for dp in self.dps:
            yield from dp.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of :meth:`named_parameters`."""
        for _, p in self.named_parameters():
            yield p

    def sync_params(self, force: bool = True) -> None:
        """After an optimizer step: bring every chunk's parameters up to date."""
        for dp in self.dps:
            dp.sync_params(force=force)

    def checkpoint_layout(self) -> Any:
        """This rank's :class:`~gnnpar.checkpoint.state.ModelLayout`: its chunks' pieces,
        named as in the whole model (so a checkpoint loads on any number of stages)."""
        from gnnpar.checkpoint.state import ModelLayout

        parts = [dp.checkpoint_layout() for dp in self.dps]
        pieces, tensors, params = [], {}, {}
        for part in parts:
            pieces += part.pieces
            tensors.update(part.tensors)
            params.update(part.params)

        def after_load() -> None:
            for part in parts:
                if part.after_load is not None:
                    part.after_load()

        return ModelLayout(pieces, tensors, list(self.keys), dict(self.aliases), params,
                           after_load)  # fmt: skip

    def grad_norm(self) -> torch.Tensor:
        """Norm of the whole model's gradient (every stage's; a tied weight once), the same
        on every rank."""
        total = torch.zeros((), dtype=torch.float64, device=self.grid.device)
        for dp in self.dps:
            total += dp.grad_norm().to(torch.float64) ** 2
        return comm.all_reduce(total.reshape(1), self.grid, "pipe").reshape(()).sqrt()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every stage's gradients so the whole model's gradient norm is at most
        ``max_norm``; return the norm before clipping."""
        norm = self.grad_norm()
        scale_grads_(self.parameters(), clip_factor(norm, max_norm))
        return norm

    def act_shape(self, micro_batch: int, rows: int, seq: int) -> tuple[int, int, int]:
        """Shape of the activations between stages: ``(rows, seq, n_embd)``."""
        return (rows, seq, self.chunks[0].config.n_embd)

    def step(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, float]],
        act_dtype: torch.dtype,
    ) -> StepResult:
        """Forward and backward of every micro-batch (``inputs[i]`` of shape (rows, seq), on
        every rank: the first stage reads them, the last the ``targets``)."""
        shapes = [self.act_shape(i, *inputs[i].shape) for i in range(len(inputs))]
        return self.pipeline.train_step(
            inputs,
            targets,
            loss_fn,
            lambda i: shapes[i],
            act_dtype,
            no_sync=lambda c: self.dps[c].no_sync(),
        )

    def forward(self, inputs: Sequence[torch.Tensor], act_dtype: torch.dtype) -> list[torch.Tensor]:
        """The last stage's outputs (logits) of every micro-batch, on the last pipe rank."""
        shapes = [self.act_shape(i, *inputs[i].shape) for i in range(len(inputs))]
        return self.pipeline.forward(inputs, lambda i: shapes[i], act_dtype)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every chunk's parameters gathered (ZeRO-3) for read-only use."""
        with contextlib.ExitStack() as stack:
            for dp in self.dps:
                stack.enter_context(dp.gathered())
            yield


def _chain_prefetch(chunks: list[nn.Module], grid: ProcessGrid) -> None:
    """Each chunk's own z-prefetch chain (:class:`gnnpar.tensor.layers.PrefetchChain`): the
    model's chain runs through every stage, and a layer must not start gathering the weight of
    a layer that another stage runs (or that this one only borrows, a tied head)."""
    from gnnpar.tensor.layers import PrefetchChain, ShardedModule

    for chunk in chunks:
        layers = [m for m in chunk.modules() if isinstance(m, ShardedModule)]
        for m in layers:
            m._chain, m._chain_pos = None, -1
        own = [m for m in layers if "weight" in m._parameters]
        if grid.size("z") > 1 and own:
            PrefetchChain(own)


def gpt_pipeline(
    model: GPT | nn.Module,
    grid: ProcessGrid,
    schedule: str,
    micro_batches: int,
    *,
    virtual: int = 1,
    split: str = "layers",
    shard_fn: Callable[[nn.Module], Any] | None = None,
    tie_dtype: torch.dtype | None = None,
) -> GPTPipeline:
    """This rank's chunks of ``model`` (our :class:`GPT` or a ``transformers``
    GPT2LMHeadModel) on ``grid`` (pipe axis = stages) with a verified ``schedule``.
    ``shard_fn(chunk)`` shards a chunk over the data axis (default
    ``gnnpar.shard.shard(chunk, grid, 0, units=by_type(BLOCK))``, BLOCK the model's block
    class). ``tie_dtype``: the dtype of the tied weight between the first and last stage
    (default: the embedding's)."""
    from gnnpar.shard import by_type, shard

    p, r = grid.size("pipe"), grid.rank("pipe")
    keys = plain_keys(model, list(model.state_dict(keep_vars=True)))
    layers = gpt_stage_layers(model, p * virtual, split)
    if is_hf_gpt2(model):
        check_hf_gpt2(model)
        chunk_cls, block, wte = HFGPT2Chunk, type(model.transformer.h[0]), "transformer.wte"
    else:
        chunk_cls, block, wte = GPTChunk, type(model.blocks[0]), "wte"
    tied = model_sizes(model).tie_weights
    tie = None
    if tied and p > 1:
        w = model.get_submodule(wte).weight
        tie = TiedWeight(grid, w.shape, tie_dtype or w.dtype)
    chunks = []
    for c in range(virtual):
        s = c * p + r
        chunks.append(chunk_cls(model, layers[s], s == 0, s == p * virtual - 1, tie))
    _chain_prefetch(chunks, grid)
    if shard_fn is None:
        shard_fn = lambda chunk: shard(chunk, grid, 0, units=by_type(block))  # noqa: E731
    dps = [shard_fn(chunk) for chunk in chunks]
    pipeline = Pipeline(grid, dps, schedule, micro_batches, virtual, tie)
    aliases = {"lm_head.weight": f"{wte}.weight"} if tied else {}
    return GPTPipeline(grid, chunks, dps, pipeline, layers, keys, aliases)
