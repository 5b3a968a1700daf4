"""A plain GPT in the style of nanoGPT: token and position embeddings, pre-norm blocks of
causal self-attention and an MLP, a final norm and an (optionally tied) output head.

Nothing here knows about parallelism; :func:`gnnpar.tensor.parallelize` applies it from the
outside. Two habits make that possible: attention splits its fused projection with
``chunk(3, dim=-1)`` and counts heads from the tensor (``view(B, T, -1, head_dim)``), so the
same code runs on a rank that holds only some of the heads; and ``forward`` returns logits,
leaving the loss to the caller (which may hold the logits split over the vocabulary).
Context parallelism (:mod:`gnnpar.tensor.context`) likewise only sets each attention's
``attention`` function and calls ``forward`` with the global positions of a rank's tokens;
generation (:mod:`gnnpar.models.gpt.generation`) sets each attention's ``kv_cache`` (a
:class:`KVCache`) and calls ``forward`` with the new tokens and their positions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gnnpar.errors import UserError
from gnnpar.models.gpt.moe import check_moe_sizes, mlp_or_moe
from gnnpar.recompute import MODES, check_mode, recompute

__all__ = [
    "GPT",
    "GPTChunk",
    "MLP",
    "Block",
    "CausalLM",
    "CausalSelfAttention",
    "TransformerBlock",
    "GPTConfig",
    "KVCache",
    "attend_with_cache",
    "cached_attention",
    "generate",
    "model_sizes",
    "run_blocks",
    "set_activation_checkpointing",
]


def size_field(default, help: str):  # noqa: A002 - mirrors dataclasses.field
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class GPTConfig:
    """Sizes of a :class:`GPT` (also the GPT task's and the planner's one description)."""

    vocab_size: int = size_field(4096, "token ids (the tokenizer's vocabulary)")
    block_size: int = size_field(256, "tokens per sequence (context length)")
    n_layer: int = size_field(6, "transformer blocks")
    n_head: int = size_field(6, "attention heads")
    n_embd: int = size_field(384, "model width")
    dropout: float = size_field(0.0, "dropout probability")
    bias: bool = size_field(True, "biases in linear layers and layer norms")
    tie_weights: bool = size_field(True, "output head tied to the token embedding")
    moe_experts: int = size_field(
        0, "mixture of experts: experts per block in place of the MLP (0: a dense MLP)"
    )
    moe_top_k: int = size_field(2, "mixture of experts: experts each token is sent to")
    moe_capacity: float = size_field(
        1.25, "mixture of experts: capacity factor, each expert takes at most capacity x "
        "T x top_k / experts of a sequence's assignments (0: no token dropped)"
    )  # fmt: skip
    moe_aux_loss: float = size_field(0.01, "mixture of experts: weight of the load-balancing loss")

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise UserError(f"GPTConfig.{name} must be a positive integer, got {v!r}")
        check_moe_sizes(self.moe_experts, self.moe_top_k, self.moe_capacity, self.moe_aux_loss)
        if self.n_embd % self.n_head:
            raise UserError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout must lie in [0, 1), got {self.dropout}")


class KVCache:
    """The keys and values one attention layer has computed, for generation: ``(B, heads,
    positions, head_dim)`` each, ``heads`` being the heads this rank holds (all of them in a
    plain model, this rank's in a tensor-parallel one), for positions ``0..length-1``.

    :meth:`extend` stores the keys and values of the next positions and returns those of
    every position so far; storage is allocated for ``capacity`` positions at the first call
    (at least as many as it brings) and grows when more come.
    """

    def __init__(self, capacity: int | None = None):
        """``capacity``: positions to allocate for at the first :meth:`extend` (default:
        as many as it brings)."""
        self.capacity = capacity
        self.length = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store ``k`` and ``v`` ``(B, heads, T, head_dim)`` at positions ``length ..
        length+T-1``; return the keys and values of positions ``0 .. length+T-1`` and the
        number of positions stored before (where the new ones start)."""
        past, t = self.length, k.shape[2]
        if self._keys is None:
            size = max(self.capacity or 0, t)
            self._keys = k.new_empty((*k.shape[:2], size, k.shape[3]))
            self._values = v.new_empty((*v.shape[:2], size, v.shape[3]))
        elif k.shape[:2] != self._keys.shape[:2] or k.shape[3] != self._keys.shape[3]:
            raise ValueError(
                f"KVCache holds keys of shape {tuple(self._keys.shape)}, got {tuple(k.shape)}"
            )
        if past + t > self._keys.shape[2]:
            more = past + t - self._keys.shape[2]
            self._keys = torch.cat([self._keys, k.new_empty((*k.shape[:2], more, k.shape[3]))], 2)
            self._values = torch.cat(
                [self._values, v.new_empty((*v.shape[:2], more, v.shape[3]))], 2
            )
        self._keys[:, :, past : past + t] = k
        self._values[:, :, past : past + t] = v
        self.length = past + t
        if past == 0:  # the same tensors as without a cache: the same attention, bit for bit
            return k, v, 0
        return self._keys[:, :, : self.length], self._values[:, :, : self.length], past

    def reset(self) -> None:
        """Forget every position (the storage is kept for the next sequence)."""
        self.length = 0


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, dropout_p: float = 0.0
) -> torch.Tensor:
    """Causal attention of ``T`` queries at positions ``past .. past+T-1`` over the keys and
    values of positions ``0 .. past+T-1`` (``(B, heads, ·, head_dim)`` each): query ``i``
    sees the keys up to its own position. With ``past = 0`` it is the plain causal attention
    (the same call as without a cache), with one query an attention over every key."""
    t, n = q.shape[-2], k.shape[-2]
    if n != past + t:
        raise ValueError(f"{t} queries after {past} positions need {past + t} keys, got {n}")
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if t == 1:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    mask = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(diagonal=past)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused q/k/v projection.

    ``attention``, when set, replaces the causal scaled-dot-product attention of
    ``(B, heads, T, head_dim)`` queries, keys and values (context parallelism sets a ring).
    With ``recompute_core`` that attention core (scores, softmax, dropout, weighted sum)
    keeps nothing for backward and runs again there (selective activation checkpointing; a
    ring runs its K/V passes again). ``kv_cache``, when set (generation: a :class:`KVCache`),
    keeps the keys and values of every position seen, and each call's tokens are the next
    positions: they attend over the cached ones and their own (:func:`cached_attention`).
    """

    recompute_core = False
    #: Generation's :class:`KVCache` of this layer, or None (no cache: whole sequences).
    kv_cache: KVCache | None = None
    #: How :func:`gnnpar.tensor.parallelize` chains q/k/v into the output projection.
    tensor_parallel_chain = MappingProxyType(
        {"first": "qkv", "second": "proj", "fused": 3, "heads": "n_head"}
    )
    #: :func:`gnnpar.tensor.context.context_parallel` may set ``attention`` to a ring.
    ring_attention = True

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.attention: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        b, t, _ = x.shape
        q, k, v = (
            part.view(b, t, -1, self.head_dim).transpose(1, 2)
            for part in self.qkv(x).chunk(3, dim=-1)
        )
        if self.kv_cache is not None:
            y = attend_with_cache(self, q, k, v)
        else:
            y = recompute(self._core, q, k, v, enabled=self.recompute_core)
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.resid_drop(self.proj(y))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.attention is not None:
            return self.attention(q, k, v)
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


def attend_with_cache(
    attn: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    expand: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``attn``'s attention with its ``kv_cache``: the new keys and values are stored, then
    ``q`` attends over every cached position (``expand`` applied to keys and values first:
    grouped-query attention's repeat). A ring (context parallelism) cannot run on a cache."""
    if attn.attention is not None:
        raise ValueError(
            "a KV cache needs plain attention, not a ring: generate inside "
            "gnnpar.tensor.context.plain_attention(model)"
        )
    k, v, past = attn.kv_cache.extend(k, v)
    if expand is not None:
        k, v = expand(k), expand(v)
    return cached_attention(q, k, v, past, attn.dropout if attn.training else 0.0)


class MLP(nn.Module):
    """Two projections with a GELU between: ``n_embd → 4·n_embd → n_embd``."""

    #: How :func:`gnnpar.tensor.parallelize` chains the two (a ``Chain`` of these fields).
    tensor_parallel_chain = MappingProxyType({"first": "fc", "second": "proj"})

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.drop(self.proj(F.gelu(self.fc(x))))


class TransformerBlock(nn.Module):
    """What every transformer block of our models is (GPT's, Llama's): with
    ``recompute_all`` the model that runs it keeps only its input for backward and runs it
    again there (full activation checkpointing: see :func:`run_blocks`); its attention
    (``attn``) has ``recompute_core``."""

    recompute_all = False


class Block(TransformerBlock):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = mlp_or_moe(cfg, lambda: MLP(cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def set_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Make every :class:`TransformerBlock` of ``model`` (plain, parallel or sharded: its
    modules are the same) recompute its activations in backward: ``"full"`` (the whole block),
    ``"selective"`` (the attention core) or ``"none"`` (see :mod:`gnnpar.recompute`)."""
    check_mode(mode, MODES)
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    if mode != "none" and not blocks:
        raise ValueError(
            f"activation checkpointing: {type(model).__name__} has no transformer block"
        )
    for block in blocks:
        block.recompute_all = mode == "full"
        block.attn.recompute_core = mode == "selective"
    return model


def run_blocks(blocks: Iterable[TransformerBlock], x: torch.Tensor, *args: Any) -> torch.Tensor:
    """``x`` through ``blocks`` in order, each also given ``args`` (Llama's RoPE tables); a
    block with ``recompute_all`` is called (hooks and all, so that a sharded block is
    gathered again) once more in backward."""
    for block in blocks:
        x = recompute(block, x, *args, enabled=block.recompute_all)
    return x


def model_sizes(model: nn.Module) -> GPTConfig:
    """The sizes of a plain GPT or GPT-2 as a :class:`GPTConfig` (what the planner and the
    pipeline's stage split read)."""
    if hasattr(model, "transformer"):  # GPT2LMHeadModel
        c = model.config
        return GPTConfig(
            vocab_size=c.vocab_size, block_size=c.n_positions, n_layer=c.n_layer,
            n_head=c.n_head, n_embd=c.n_embd, tie_weights=c.tie_word_embeddings,
        )  # fmt: skip
    return model.config


class CausalLM(nn.Module):
    """What our decoder-only models share (:class:`GPT`, and
    :class:`~gnnpar.models.gpt.llama.Llama`): ``forward(ids (B, T)) → logits (B, T,
    vocab_size)`` through the model's ``embed``, its ``blocks`` (each also given the model's
    ``block_args``), the final norm ``ln_f`` and the head ``lm_head``; and ``generate``."""

    config: GPTConfig

    def num_params(self) -> int:
        """Number of parameters (tied ones once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, ids: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``ids (B, T)``; ``pos`` are the tokens' positions in their sequences
        (default 0..T−1; a context-parallel rank passes those of the chunks it holds)."""
        t = ids.shape[-1]
        if t > self.config.block_size:
            raise UserError(
                f"sequence of {t} tokens is longer than block_size={self.config.block_size}"
            )
        if pos is None:
            pos = torch.arange(t, device=ids.device)
        x = self.embed(ids, pos)
        x = run_blocks(self.blocks, x, *self.block_args(pos, x.dtype))
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        full_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``ids (B, T)``.

        ``full_logits`` turns the model's last-position logits into logits over the whole
        vocabulary (for a model whose head keeps them split); ``generator`` makes sampling
        reproducible (and identical on ranks that must agree).
        """
        return generate(
            self,
            ids,
            max_new_tokens,
            self.config.block_size,
            temperature,
            top_k,
            generator,
            full_logits,
        )


class GPT(CausalLM):
    """The language model: ``forward(ids (B, T)) → logits (B, T, vocab_size)``.

    Weights start as in GPT-2: normal(0, 0.02), with the projections that write into the
    residual stream scaled by ``1/sqrt(2·n_layer)``; biases zero.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    # The two steps a pipeline chunk runs too (on a module with the same attributes).
    def embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The blocks' input: token plus position embeddings."""
        return self.drop(self.wte(ids) + self.wpe(pos))

    def block_args(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """What every block takes besides its input: nothing."""
        return ()


class GPTChunk(nn.Module):
    """Consecutive blocks of a :class:`GPT` or a :class:`~gnnpar.models.gpt.llama.Llama` as one
    pipeline stage: with ``first`` the embeddings before them, with ``last`` the final norm
    and head after them (the model's own ``embed`` and ``block_args`` run on the chunk).

    The chunk takes the modules of ``model`` (plain or made parallel), so its state-dict keys
    are the model's (``blocks.3.attn.qkv.weight``). A head tied to the embedding on a chunk
    without the embedding gets its weight for each step from ``tie`` (a
    :class:`~gnnpar.pipeline.runtime.TiedWeight`): its own copy is dropped, and the first
    chunk reports the weight it uses to ``tie``.
    """

    def __init__(
        self, model: nn.Module, layers: range, first: bool, last: bool, tie: object = None
    ):
        super().__init__()
        self.config = model.config
        self.first, self.last = first, last
        self.layers = layers
        self.kind = type(model)  # whose embed and block_args run here
        if first:
            self.wte, self.drop = model.wte, model.drop
            if hasattr(model, "wpe"):
                self.wpe = model.wpe
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
        self.tie = tie if model.config.tie_weights and first != last else None
        if self.tie is not None and last:
            # the first stage owns the shared weight; this one borrows it for each step
            del self.lm_head._parameters["weight"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        pos = torch.arange(x.shape[1], device=x.device)
        if self.first:
            t = x.shape[-1]
            if t > self.config.block_size:
                raise UserError(
                    f"sequence of {t} tokens is longer than block_size={self.config.block_size}"
                )
            if self.tie is not None:
                self.tie.watch(self.wte.weight)
            x = self.kind.embed(self, x, pos)
        x = run_blocks(self.blocks.values(), x, *self.kind.block_args(self, pos, x.dtype))
        if not self.last:
            return x
        if self.tie is not None:
            self.lm_head.weight = self.tie.leaf
        return self.lm_head(self.ln_f(x))


@torch.no_grad()
def generate(
    model: Callable[[torch.Tensor], torch.Tensor],
    ids: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    full_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Append ``max_new_tokens`` tokens sampled from any causal language model ``model``
    (ids ``(B, T)`` → logits ``(B, T, V)``) to ``ids``, feeding it the last ``block_size``
    tokens; see :meth:`GPT.generate`. Every step runs the whole sequence (no KV cache:
    :func:`gnnpar.models.gpt.generation.generate` keeps one); the token is drawn as
    :func:`~gnnpar.models.gpt.generation.sample_next` draws it."""
    from gnnpar.models.gpt.generation import check_sampling, sample_next

    check_sampling(temperature=temperature, top_k=top_k)
    for _ in range(max_new_tokens):
        logits = model(ids[:, -block_size:])[:, -1, :]
        if full_logits is not None:
            logits = full_logits(logits)
        nxt = sample_next(logits, temperature=temperature, top_k=top_k, generator=generator)
        ids = torch.cat([ids, nxt.to(ids.device)], dim=1)
    return ids
