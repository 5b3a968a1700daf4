"""Models written as plain PyTorch; parallelism is applied from outside."""

from gnnpar.nn.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
