"""A plain GPT in the style of nanoGPT: token and position embeddings, pre-norm blocks of
causal self-attention and an MLP, a final norm and an (optionally tied) output head.

Nothing here knows about parallelism; :func:`gnnpar.tensor.parallelize` applies it from the
outside. Two habits make that possible: attention splits its fused projection with
``chunk(3, dim=-1)`` and counts heads from the tensor (``view(B, T, -1, head_dim)``), so the
same code runs on a rank that holds only some of the heads; and ``forward`` returns logits,
leaving the loss to the caller (which may hold the logits split over the vocabulary).
Context parallelism (:mod:`gnnpar.tensor.context`) likewise only sets each attention's
``attention`` function and calls ``forward`` with the global positions of a rank's tokens.
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
from gnnpar.recompute import MODES, check_mode, recompute

__all__ = [
    "GPT",
    "GPTChunk",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "TransformerBlock",
    "GPTConfig",
    "generate",
    "model_sizes",
    "run_blocks",
    "set_activation_checkpointing",
]


def _size(default, help: str):  # noqa: A002 - mirrors dataclasses.field
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass
class GPTConfig:
    """Sizes of a :class:`GPT` (also the GPT task's and the planner's one description)."""

    vocab_size: int = _size(4096, "token ids (the tokenizer's vocabulary)")
    block_size: int = _size(256, "tokens per sequence (context length)")
    n_layer: int = _size(6, "transformer blocks")
    n_head: int = _size(6, "attention heads")
    n_embd: int = _size(384, "model width")
    dropout: float = _size(0.0, "dropout probability")
    bias: bool = _size(True, "biases in linear layers and layer norms")
    tie_weights: bool = _size(True, "output head tied to the token embedding")

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise UserError(f"GPTConfig.{name} must be a positive integer, got {v!r}")
        if self.n_embd % self.n_head:
            raise UserError(f"n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout must lie in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused q/k/v projection.

    ``attention``, when set, replaces the causal scaled-dot-product attention of
    ``(B, heads, T, head_dim)`` queries, keys and values (context parallelism sets a ring).
    With ``recompute_core`` that attention core (scores, softmax, dropout, weighted sum)
    keeps nothing for backward and runs again there (selective activation checkpointing; a
    ring runs its K/V passes again).
    """

    recompute_core = False
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
        y = recompute(self._core, q, k, v, enabled=self.recompute_core)
        y = y.transpose(1, 2).reshape(b, t, -1)
        return self.resid_drop(self.proj(y))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.attention is not None:
            return self.attention(q, k, v)
        p = self.dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


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
        self.mlp = MLP(cfg)

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


class GPT(nn.Module):
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

    def num_params(self) -> int:
        """Number of parameters (tied ones once)."""
        return sum(p.numel() for p in self.parameters())

    # The two steps a pipeline chunk runs too (on a module with the same attributes).
    def embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The blocks' input: token plus position embeddings."""
        return self.drop(self.wte(ids) + self.wpe(pos))

    def block_args(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """What every block takes besides its input: nothing."""
        return ()

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
    tokens; see :meth:`GPT.generate`."""
    if temperature <= 0:
        raise UserError(f"temperature must be positive, got {temperature}")
    for _ in range(max_new_tokens):
        logits = model(ids[:, -block_size:])[:, -1, :]
        if full_logits is not None:
            logits = full_logits(logits)
        logits = logits.float() / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(ids.device)
        ids = torch.cat([ids, nxt], dim=1)
    return ids
