"""Instruction-style fine-tuning data: prompt/response pairs from a JSONL file, trained with
the loss on the response tokens only.

The file holds one JSON object per line with string fields ``prompt`` and ``response``
(blank lines are skipped; anything else is one error naming the file and line). Each
example becomes ``prompt ids + response ids (+ the end-of-sequence id)``, cut to
``block_size + 1`` tokens and padded after its end; its targets are the next tokens, with
:data:`IGNORE` wherever the target is a prompt token or padding, so only responses are
learnt.

:class:`InstructionBatches` serves them by step like :class:`~gnnpar.data.text.TokenBlocks`
(a seeded permutation per epoch, each data shard its slice of the global batch), and says
how many response tokens a shard holds on average (:meth:`InstructionBatches.expected_tokens`)
so that the loss of a step is the mean over every response token of the global batch,
however the batch is split.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from gnnpar.data.text import Tokenized
from gnnpar.errors import UserError

__all__ = ["IGNORE", "InstructionBatches", "InstructionSet", "read_instructions"]

#: The target of a position that carries no loss (torch's ``ignore_index``).
IGNORE = -100


@dataclasses.dataclass
class InstructionSet(Tokenized):
    """Tokenised prompt/response pairs: each example's ids and the length of its prompt."""

    name: str
    tokenizer: object
    examples: list[np.ndarray]
    prompt_lengths: list[int]

    @property
    def tokens(self) -> np.ndarray:
        """Every example's ids and its prompt length, end to end (what a run's data
        fingerprint covers)."""
        parts = [np.asarray([n, len(e)], dtype=np.int64) for n, e in zip(
            self.prompt_lengths, self.examples, strict=True)]  # fmt: skip
        return np.concatenate([*parts, *self.examples]) if self.examples else np.zeros(0)

    def split(self, val_fraction: float) -> tuple[list[int], list[int]]:
        """(training, validation) example indices: the last ``val_fraction`` held out."""
        if not 0.0 <= val_fraction < 1.0:
            raise UserError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        cut = int(len(self.examples) * (1.0 - val_fraction))
        return list(range(cut)), list(range(cut, len(self.examples)))


def read_instructions(path: str | Path, tokenizer: object) -> InstructionSet:
    """The prompt/response pairs of the JSONL file ``path``, encoded with ``tokenizer`` (one
    line naming the file and line for what is not a pair)."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read the instruction file ({err})") from None
    eos = _eos_id(tokenizer)
    examples, prompts = [], []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{no}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or not all(
            isinstance(row.get(k), str) for k in ("prompt", "response")
        ):
            raise UserError(f"{path}:{no}: expected an object with string 'prompt' and 'response'")
        prompt = tokenizer.encode(row["prompt"]).ids
        response = tokenizer.encode(row["response"]).ids + ([eos] if eos is not None else [])
        if not response:
            raise UserError(f"{path}:{no}: the response has no tokens")
        examples.append(np.asarray(prompt + response, dtype=np.int64))
        prompts.append(len(prompt))
    if not examples:
        raise UserError(f"{path}: no prompt/response pairs")
    return InstructionSet(str(path), tokenizer, examples, prompts)


def _eos_id(tokenizer: object) -> int | None:
    """The tokenizer's end-of-sequence id, where it has one by a usual name."""
    for name in ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>"):
        found = tokenizer.token_to_id(name)
        if found is not None:
            return int(found)
    return None


class InstructionBatches:
    """Fixed-length sequences of some examples of an :class:`InstructionSet`, served by
    step: :meth:`batch` returns ``(inputs, targets)`` of this shard, ``(batch_size /
    num_shards, block_size)`` int64, targets :data:`IGNORE` outside the responses."""

    def __init__(
        self,
        data: InstructionSet,
        indices: list[int],
        block_size: int,
        batch_size: int,
        shard: int = 0,
        num_shards: int = 1,
        seed: int = 0,
    ):
        if batch_size % num_shards:
            raise UserError(
                f"global batch of {batch_size} examples does not divide over {num_shards} shards"
            )
        if len(indices) < batch_size:
            raise UserError(
                f"{data.name}: {len(indices)} examples, fewer than a batch of {batch_size}"
            )
        self.block_size, self.batch_size = block_size, batch_size
        self.shard, self.num_shards, self.seed = shard, num_shards, seed
        n = len(indices)
        self.inputs = torch.zeros((n, block_size), dtype=torch.int64)
        self.targets = torch.full((n, block_size), IGNORE, dtype=torch.int64)
        for row, i in enumerate(indices):
            ids = torch.from_numpy(data.examples[i][: block_size + 1])
            k = ids.numel() - 1
            self.inputs[row, : k + 1 if k < block_size else k] = ids[: min(k + 1, block_size)]
            keep = torch.arange(1, k + 1) >= data.prompt_lengths[i]  # target j+1: a response id
            self.targets[row, :k] = torch.where(keep, ids[1:], IGNORE)
        self.tokens = torch.from_numpy(np.concatenate([data.examples[i] for i in indices]))

    @property
    def num_examples(self) -> int:
        """Examples served."""
        return self.inputs.shape[0]

    @property
    def steps_per_epoch(self) -> int:
        """Steps before the examples are reshuffled."""
        return self.num_examples // self.batch_size

    def _chosen(self, step: int) -> torch.Tensor:
        epoch, k = divmod(step, self.steps_per_epoch)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(self.num_examples, generator=g)
        return perm[k * self.batch_size : (k + 1) * self.batch_size]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This shard's part of the global batch of ``step``."""
        per = self.batch_size // self.num_shards
        mine = self._chosen(step)[self.shard * per : (self.shard + 1) * per]
        return self.inputs[mine], self.targets[mine]

    def expected_tokens(self, step: int, pieces: int) -> float:
        """The response tokens of ``step``'s global batch over ``pieces`` equal shares: what
        each share's summed loss is divided by, so that the shares' mean is the mean over
        every response token of the batch."""
        count = int((self.targets[self._chosen(step)] != IGNORE).sum())
        if count == 0:
            raise UserError(f"the batch of step {step} has no response token within block_size")
        return count / pieces
