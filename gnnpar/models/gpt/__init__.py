"""The GPT workload (``gnnpar train gpt``): the plain model (:mod:`.model`), Hugging Face
GPT-2's pipeline chunks (:mod:`.hf_gpt2`), both as pipelines (:mod:`.pipeline`), and the task
(:mod:`.task`)."""

from gnnpar.models.gpt.model import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
