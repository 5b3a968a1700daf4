"""A Llama-class decoder in plain PyTorch: RMSNorm, rotary positions (RoPE), SwiGLU and
grouped-query attention (GQA), with an untied output head by default.

Like :mod:`gnnpar.models.gpt.model`, nothing here knows about parallelism;
:func:`gnnpar.tensor.parallelize` applies it from the outside through the chains the blocks
declare:

- **Attention** has one fused projection ``qkv`` laid out **by key-value head**: for each of
  the ``n_kv_head`` groups, its ``n_head / n_kv_head`` query heads, then its key head, then
  its value head. Splitting that output contiguously over the tensor-parallel axis of the
  heads gives each rank whole groups, so a rank's queries meet their own keys and values with
  no communication. The rule: where ``n_kv_head`` divides the size of that axis (x when
  only x > 1; the communication model picks x or y, see :func:`gnnpar.tensor.plan_styles`)
  the heads are split so; where it does not, that attention is left unsplit by heads: its
  projections stay tensor-parallel (weights split, outputs gathered) and every rank of the
  axis computes every head (:func:`~gnnpar.tensor.parallelize` warns once). Megatron instead
  repeats only the key-value heads over the axis; that is not done here.
- **SwiGLU**'s gate and up projections are one column-parallel ``gate_up`` (two fused
  parts, each split over the axis) chained into one row-parallel ``down`` projection.
- **RoPE** rotates queries and keys by each token's position, given to ``forward`` (a
  context-parallel rank passes those of the chunks it holds), so it composes with ring
  attention, and with generation's KV cache: keys are cached after their rotation, at their
  absolute position, and the cache holds this rank's key-value heads before the repeat of
  grouped-query attention.

:mod:`gnnpar.models.gpt.hf_llama` maps Hugging Face ``LlamaForCausalLM`` weights to these
and back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from gnnpar.errors import UserError
from gnnpar.models.gpt.model import (
    CausalLM,
    GPTConfig,
    KVCache,
    TransformerBlock,
    attend_with_cache,
    size_field,
)
from gnnpar.models.gpt.moe import mlp_or_moe
from gnnpar.recompute import recompute

#: Whether torch's scaled_dot_product_attention takes ``enable_gqa`` (torch 2.5 on).
_SDPA_GQA = tuple(int(n) for n in torch.__version__.split(".")[:2]) >= (2, 5)

__all__ = [
    "Llama",
    "LlamaAttention",
    "LlamaBlock",
    "LlamaConfig",
    "RMSNorm",
    "SwiGLU",
    "apply_rope",
    "rope_tables",
]


@dataclasses.dataclass
class LlamaConfig(GPTConfig):
    """Sizes of a :class:`Llama`: :class:`~gnnpar.models.gpt.model.GPTConfig`'s (``bias``
    and ``tie_weights`` off by default, as in Llama) and its own."""

    n_kv_head: int = size_field(0, "key-value heads of grouped-query attention (0: n_head)")
    ffn_hidden: int = size_field(0, "SwiGLU hidden width (0: 8/3 n_embd rounded up to 64)")
    rope_theta: float = size_field(10000.0, "RoPE base")
    norm_eps: float = size_field(1e-5, "RMSNorm epsilon")
    bias: bool = size_field(False, "biases in the projections")
    tie_weights: bool = size_field(False, "output head tied to the token embedding")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_kv_head == 0:
            self.n_kv_head = self.n_head
        if self.ffn_hidden == 0:
            self.ffn_hidden = 64 * math.ceil(8 * self.n_embd / 3 / 64)
        for name in ("n_kv_head", "ffn_hidden"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise UserError(f"LlamaConfig.{name} must be a positive integer, got {v!r}")
        if self.n_head % self.n_kv_head:
            raise UserError(
                f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}"
            )
        if (self.n_embd // self.n_head) % 2:
            raise UserError(f"RoPE needs an even head width, not {self.n_embd // self.n_head}")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise UserError("LlamaConfig.rope_theta and norm_eps must be positive")

    @property
    def head_dim(self) -> int:
        """Features per attention head."""
        return self.n_embd // self.n_head


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed as Hugging Face's Llama does: in
    float32 (or float64 for float64 input), the scale applied after casting back."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        work = x.to(torch.promote_types(x.dtype, torch.float32))
        work = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * work.to(x.dtype)


def rope_tables(
    pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of shape ``(T, head_dim)`` for positions ``pos (T,)``: the angle of
    feature pair ``i`` is ``pos / theta**(2i/head_dim)``, each table the two halves repeated
    (Hugging Face's layout), computed in float32 (float64 for float64 runs)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=pos.device).to(work)
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    angles = pos.to(work)[:, None] * inv_freq[None, :]
    both = torch.cat([angles, angles], dim=-1)
    return both.cos().to(dtype), both.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x (B, heads, T, head_dim)`` by the tables of :func:`rope_tables`."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class LlamaAttention(nn.Module):
    """Causal grouped-query attention with RoPE; ``qkv`` is laid out by key-value head (see
    the module docstring), so a rank holding some groups computes them alone.

    ``attention``, ``recompute_core`` and ``kv_cache`` are those of
    :class:`~gnnpar.models.gpt.model.CausalSelfAttention` (the cache holds keys after RoPE,
    one per key-value head)."""

    recompute_core = False
    kv_cache: KVCache | None = None
    #: The heads that must divide the chain's out axis are the key-value heads; where they
    #: do not, the attention's heads are not split (every rank of the axis computes them).
    tensor_parallel_chain = MappingProxyType(
        {"first": "qkv", "second": "o_proj", "heads": "n_kv_head", "unsplit_otherwise": True}
    )
    ring_attention = True

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.head_dim
        self.group = cfg.n_head // cfg.n_kv_head  # query heads per key-value head
        out = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
        self.qkv = nn.Linear(cfg.n_embd, out, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.attention: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # noqa: D102
        b, t, _ = x.shape
        d, r = self.head_dim, self.group
        groups = self.qkv(x).view(b, t, -1, (r + 2) * d)  # this rank's key-value groups
        q, k, v = groups.split([r * d, d, d], dim=-1)
        q = q.reshape(b, t, -1, d).transpose(1, 2)  # query head g·r + i belongs to group g
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_cache is not None:  # cached per key-value head, repeated after
            expand = (lambda kv: kv.repeat_interleave(r, dim=1)) if r > 1 else None
            y = attend_with_cache(self, q, k, v, expand)
        else:
            if r > 1 and (self.attention is not None or not _SDPA_GQA):
                k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
            y = recompute(self._core, q, k, v, enabled=self.recompute_core)
        return self.resid_drop(self.o_proj(y.transpose(1, 2).reshape(b, t, -1)))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.attention is not None:
            return self.attention(q, k, v)
        p = self.dropout if self.training else 0.0
        # fewer key-value heads than queries: torch's own grouped-query attention keeps
        # them unrepeated for backward
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, **gqa)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) · up(x))``, gate and up fused into one projection."""

    tensor_parallel_chain = MappingProxyType({"first": "gate_up", "second": "down", "fused": 2})

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.n_embd, 2 * cfg.ffn_hidden, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.drop(self.down(F.silu(gate) * up))


class LlamaBlock(TransformerBlock):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.ln1 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.ln2 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = mlp_or_moe(cfg, lambda: SwiGLU(cfg))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # noqa: D102
        x = x + self.attn(self.ln1(x), cos, sin)
        return x + self.mlp(self.ln2(x))


class Llama(CausalLM):
    """The language model: ``forward(ids (B, T)) → logits (B, T, vocab_size)``. Weights start
    as Hugging Face's Llama does: normal(0, 0.02) matrices, zero biases, unit norms."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    # The two steps a pipeline chunk runs too (on a module with the same attributes).
    def embed(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The blocks' input: token embeddings (positions enter through RoPE)."""
        return self.drop(self.wte(ids))

    def block_args(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """What every block takes besides its input: the RoPE tables of ``pos``."""
        cfg = self.config
        return rope_tables(pos, cfg.n_embd // cfg.n_head, cfg.rope_theta, dtype)
