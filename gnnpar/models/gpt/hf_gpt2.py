"""Hugging Face GPT-2 (``transformers``' ``GPT2LMHeadModel``) as pipeline chunks.

:class:`HFGPT2Chunk` is the GPT-2 twin of :class:`~gnnpar.models.gpt.model.GPTChunk`: consecutive
``transformer.h`` blocks, with the token and position embeddings before them on the first
stage and ``ln_f`` and the head after them on the last, under the model's own state-dict keys
(``transformer.h.3.attn.c_attn.weight``), and a head tied to the embedding borrowing its
weight from :class:`~gnnpar.pipeline.runtime.TiedWeight` each step.

The blocks are called one by one, as ``GPT2Model.forward`` calls them, but without it: the
causal mask it would build is made here, as the 4-D additive float mask (0 where a position
may attend, the dtype's minimum elsewhere) that every attention implementation taking a mask
accepts (eager adds it, SDPA passes it on), without the version-specific mask helpers.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from gnnpar.errors import UserError

__all__ = ["HFGPT2Chunk", "causal_mask", "check_hf_gpt2", "is_hf_gpt2"]

#: Attention implementations that take the additive mask (flash attention takes none).
MASKED_ATTENTION = ("eager", "sdpa")


def is_hf_gpt2(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` GPT-2 with a language-model head."""
    cls = type(model)
    return cls.__module__.startswith("transformers.") and hasattr(model, "transformer")


def check_hf_gpt2(model: nn.Module) -> None:
    """Raise one line if this ``transformers`` version's GPT-2 cannot run as chunks: its
    blocks must take ``attention_mask`` and its attention must accept an additive mask."""
    block = model.transformer.h[0]
    if "attention_mask" not in inspect.signature(block.forward).parameters:
        raise UserError(
            f"{type(block).__name__}.forward of this transformers version takes no "
            "attention_mask: HF GPT-2 cannot run as a pipeline"
        )
    # the one private field read: which attention the model was built with
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in MASKED_ATTENTION:
        raise UserError(
            f"HF GPT-2 attention '{impl}' takes no additive causal mask: build the model with "
            f"attn_implementation in {', '.join(MASKED_ATTENTION)} to run it as a pipeline"
        )


def causal_mask(t: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``(1, 1, t, t)`` additive causal mask: 0 on and below the diagonal, the dtype's
    minimum above it (what ``GPT2Model`` gives eager attention)."""
    mask = torch.full((t, t), torch.finfo(dtype).min, dtype=dtype, device=device)
    return mask.triu(1)[None, None]


class HFGPT2Chunk(nn.Module):
    """Consecutive blocks of a ``GPT2LMHeadModel`` (plain or made parallel) as one pipeline
    stage: ``forward(ids or hidden states) → hidden states, or logits on the last``."""

    def __init__(
        self, model: nn.Module, layers: range, first: bool, last: bool, tie: object = None
    ):
        super().__init__()
        self.config = model.config
        self.first, self.last = first, last
        self.layers = layers
        body = model.transformer
        self.transformer = nn.Module()  # the model's key prefix, holding only this stage
        if first:
            t = self.transformer
            t.wte, t.wpe, t.drop = body.wte, body.wpe, body.drop
        self.transformer.h = nn.ModuleDict({str(i): body.h[i] for i in layers})
        if last:
            self.transformer.ln_f, self.lm_head = body.ln_f, model.lm_head
        self.tie = tie if model.config.tie_word_embeddings and first != last else None
        if self.tie is not None and last:
            # the first stage owns the shared weight; this one borrows it for each step
            del self.lm_head._parameters["weight"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        body = self.transformer
        if self.first:
            t = x.shape[-1]
            if t > self.config.n_positions:
                raise UserError(
                    f"sequence of {t} tokens is longer than n_positions={self.config.n_positions}"
                )
            if self.tie is not None:
                self.tie.watch(body.wte.weight)
            pos = torch.arange(t, device=x.device)[None]
            x = body.drop(body.wte(x) + body.wpe(pos))
        mask = causal_mask(x.shape[1], x.dtype, x.device)
        for block in body.h.values():
            out = block(x, attention_mask=mask)
            x = out[0] if isinstance(out, tuple) else out  # older versions return a tuple
        if not self.last:
            return x
        if self.tie is not None:
            self.lm_head.weight = self.tie.leaf
        return self.lm_head(body.ln_f(x))
