"""Text generation with a KV cache, for our GPT and Llama, plain or tensor-parallel.

:func:`generate` runs the prompt through the model once, each attention layer keeping the
keys and values it computed (a :class:`~gnnpar.models.gpt.model.KVCache` set as the layer's
``kv_cache``); then each new token runs alone through the blocks, at its absolute position,
and attends over the cached keys and values of the positions before it. A tensor-parallel
model (:func:`gnnpar.tensor.parallelize`) caches on each rank only the heads it holds (its
piece of the fused q/k/v projection), so the cache is split over the ranks as the heads are;
its head keeps the logits split over the vocabulary, and :func:`full_logits_of` gathers them
for sampling. Llama's keys are cached after RoPE, one per key-value head.

Sampling: greedy (the arg-max, ties to the lowest id), or a draw from the softmax of the
logits divided by ``temperature``, restricted to the ``top_k`` likeliest tokens and to the
smallest set of likeliest tokens whose probability reaches ``top_p`` (nucleus sampling).
Every rank of a tensor-parallel group draws with its own ``generator`` (give each the same
seed) and takes the token of the group's first rank (a broadcast per token), so the ranks
never disagree, whatever the rounding of their logits.

A sequence may grow to the model's ``block_size`` with the cache; past it, each new token is
a forward of the last ``block_size`` tokens from position 0 without the cache, as
:func:`gnnpar.models.gpt.model.generate` (the trainer's end-of-run sample, no cache) does
throughout, so both give the same tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from gnnpar import comm
from gnnpar.errors import UserError
from gnnpar.grid import ProcessGrid
from gnnpar.models.gpt.model import KVCache, model_sizes

__all__ = [
    "check_sampling",
    "full_logits_of",
    "generate",
    "kv_caches",
    "sample_next",
    "tensor_grid",
]


def check_sampling(
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> None:
    """Refuse sampling options that cannot work, in one line (a UserError)."""
    if not greedy and not temperature > 0:
        raise UserError(f"temperature must be positive, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise UserError(f"top_k must be a positive integer, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise UserError(f"top_p must lie in (0, 1], got {top_p}")


def sample_next(
    logits: torch.Tensor,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The next token ``(B, 1)`` (on the host) from last-position logits ``(B, V)`` over the
    whole vocabulary: their arg-max with ``greedy``, else a draw (with ``generator``) from
    the softmax of ``logits / temperature`` restricted to the ``top_k`` likeliest tokens (ties
    with the k-th kept) and then to the smallest set of likeliest tokens whose probability
    reaches ``top_p`` (at least one)."""
    check_sampling(greedy, temperature, top_k, top_p)
    if greedy:
        return logits.argmax(dim=-1, keepdim=True).cpu()
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(ordered, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # the mass of the likelier tokens
        drop = before >= top_p  # the first token has none before it: always kept
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator)


def full_logits_of(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """For a model whose head (``lm_head``, a :class:`gnnpar.tensor.Linear` that keeps its
    output split: :func:`gnnpar.tensor.parallelize`'s) gives each rank a slice of the
    vocabulary, the function that gathers last-position logits ``(B, V_rank)`` into ``(B, V)``
    (a collective over the head's out axis); None where the logits are whole. ``model`` may
    also be the head itself (a pipeline's last stage holds only it)."""
    head = getattr(model, "lm_head", model)
    if getattr(head, "gather_output", True) is not False:
        return None
    grid, axis, sizes = head.grid, head.out_axis, head.out_sizes
    if grid.size(axis) == 1:
        return None
    return lambda logits: comm.all_gather(logits.contiguous(), grid, axis, dim=-1, sizes=sizes)


def tensor_grid(model: nn.Module) -> ProcessGrid | None:
    """The grid of ``model``'s tensor-parallel layers (None for a plain model)."""
    from gnnpar.tensor import ShardedModule

    return next((m.grid for m in model.modules() if isinstance(m, ShardedModule)), None)


def _cacheable(model: nn.Module) -> list[nn.Module]:
    """The attention modules of ``model`` that take a ``kv_cache``."""
    return [m for m in model.modules() if hasattr(type(m), "kv_cache")]


@contextlib.contextmanager
def kv_caches(model: nn.Module, capacity: int | None = None) -> Iterator[list[KVCache]]:
    """Within the block, every attention layer of ``model`` (our GPT's or Llama's) has a fresh
    :class:`~gnnpar.models.gpt.model.KVCache` (storage for ``capacity`` positions): call the
    model with the next tokens and their positions (``model(ids, pos=...)``, starting at 0).
    Afterwards the layers are as they were."""
    layers = _cacheable(model)
    if not layers:
        raise UserError(
            f"{type(model).__name__} has no attention layer that keeps a KV cache (our GPT "
            "and Llama do); generate with cache=False"
        )
    saved = [layer.kv_cache for layer in layers]
    for layer in layers:
        layer.kv_cache = KVCache(capacity)
    try:
        yield [layer.kv_cache for layer in layers]
    finally:
        for layer, old in zip(layers, saved, strict=True):
            layer.kv_cache = old


def _drop_caches(model: nn.Module) -> None:
    for layer in _cacheable(model):
        layer.kv_cache = None


def _device(model: nn.Module) -> torch.device:
    grid = tensor_grid(model)
    if grid is not None:
        return grid.device
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 1:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise UserError(f"ids must be a (batch, tokens) tensor of at least one token, got {shape}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise UserError(f"ids must be integer token ids, got {ids.dtype}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise UserError(f"token id {bad} is outside the vocabulary of {vocab_size} ids")


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    eos: int | None = None,
    cache: bool = True,
    return_logits: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Append up to ``max_new_tokens`` tokens to the prompts ``ids (B, T)`` and return the
    sequences ``(B, T + new)``; with ``return_logits``, also the last-position logits over
    the whole vocabulary that chose each new token, ``(B, new, V)`` in the model's dtype.

    ``model``: our :class:`~gnnpar.models.gpt.model.GPT` or
    :class:`~gnnpar.models.gpt.llama.Llama`, plain or made tensor-parallel (every rank of
    the grid calls this with the same prompts); it runs in eval mode (restored after) and
    with plain attention where context parallelism set a ring. ``greedy`` takes the
    likeliest token; otherwise ``temperature``, ``top_k`` and ``top_p`` shape the draw with
    ``generator`` (see :func:`sample_next`). ``eos``: a sequence that produces this id is
    done (later tokens of it are ``eos`` too) and generation stops when all are.
    ``cache=False`` runs every step over the whole sequence (also for a model whose
    attention keeps no cache, such as transformers' GPT-2)."""
    from gnnpar.tensor.context import plain_attention

    check_sampling(greedy, temperature, top_k, top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise UserError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be 0 or more, got {max_new_tokens}")
    sizes = model_sizes(model)
    _check_ids(ids, sizes.vocab_size)
    if eos is not None and not 0 <= eos < sizes.vocab_size:
        raise UserError(f"eos {eos} is outside the vocabulary of {sizes.vocab_size} ids")
    device = _device(model)
    ids = ids.to(device=device, dtype=torch.int64)
    grid = tensor_grid(model)
    agree = grid is not None and grid.size("tensor") > 1
    gather = full_logits_of(model)
    block = sizes.block_size
    steps: list[torch.Tensor] = []
    was_training = model.training
    model.eval()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(plain_attention(model))
            if cache and max_new_tokens:
                stack.enter_context(kv_caches(model, min(block, ids.shape[1] + max_new_tokens)))

            def last_logits(x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
                out = model(x) if pos is None else model(x, pos=pos)
                out = out if isinstance(out, torch.Tensor) else out.logits
                out = out[:, -1, :]
                return gather(out) if gather is not None else out

            done = torch.zeros(ids.shape[0], dtype=torch.bool, device=device)
            cached = cache  # the caches hold every position so far
            logits = None
            for _ in range(max_new_tokens):
                if logits is None:  # the prompt (its last block_size tokens), from position 0
                    logits = last_logits(ids[:, -block:])
                elif cached and ids.shape[1] <= block:  # one new position over the cache
                    pos = torch.tensor([ids.shape[1] - 1], device=device)
                    logits = last_logits(ids[:, -1:], pos)
                else:  # past block_size: the last block_size tokens, without the cache
                    if cached:
                        _drop_caches(model)
                        cached = False
                    logits = last_logits(ids[:, -block:])
                if return_logits:
                    steps.append(logits)
                nxt = sample_next(
                    logits, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
                    generator=generator,
                ).to(device)  # fmt: skip
                if agree:  # the group's first rank decides: no rank can drift off
                    comm.broadcast(nxt, grid, "tensor", src=0)
                if eos is not None:
                    nxt = nxt.masked_fill(done[:, None], eos)
                    done |= nxt[:, 0] == eos
                ids = torch.cat([ids, nxt], dim=1)
                if eos is not None and bool(done.all()):
                    break
    finally:
        model.train(was_training)
    if not return_logits:
        return ids
    if steps:
        return ids, torch.stack(steps, dim=1)
    return ids, torch.zeros((ids.shape[0], 0, sizes.vocab_size), device=device)
