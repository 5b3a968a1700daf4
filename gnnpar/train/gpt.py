"""GPT training with 4D hybrid parallelism (the ``gpt`` task): data × 3D tensor parallelism.

The model, data and step are :mod:`gnnpar.tensor.train`'s; this module adapts them to the
trainer (progress, metrics, checkpoints, ``--resume``). The batch of step ``i`` is a pure
function of ``i`` and the seed, so restoring the model and optimizer resumes exactly.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from gnnpar.grid import parse_grid_spec
from gnnpar.tensor import train as gpt_train
from gnnpar.train.config import ConfigError


@dataclasses.dataclass
class GPTRunConfig(gpt_train.GPTTrainConfig):
    """Options of ``gnnpar train gpt``: the GPT run's plus the trainer's."""

    out: str = "runs/gpt"
    eval_every: int = 100
    checkpoint_every: int = 0
    quiet: bool = False
    overwrite: bool = False
    tensorboard: bool = False

    def check(self) -> None:
        """Reject values that cannot work, naming the key."""
        for key in ("steps", "batch_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}' must be positive")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"config key 'n_embd' ({self.n_embd}) must be a multiple of n_head "
                f"({self.n_head})"
            )
        parse_grid_spec(self.grid)

    def train_config(self) -> gpt_train.GPTTrainConfig:
        """The run's fields, without the trainer's (which it handles itself)."""
        names = {f.name for f in dataclasses.fields(gpt_train.GPTTrainConfig)}
        values = {k: v for k, v in dataclasses.asdict(self).items() if k in names}
        values.update(progress=False, ckpt_dir=None, resume=False, val_every=0)
        return gpt_train.GPTTrainConfig(**values)


def planned_grid(cfg: gpt_train.GPTTrainConfig) -> Any:
    """The grid :mod:`gnnpar.plan` predicts fastest for this model on this machine (used when
    no ``grid`` is given)."""
    import torch

    import gnnpar
    from gnnpar.plan import GPTProblem, choose_gpt_grid, local_machine

    world = gnnpar.init()
    problem = GPTProblem(
        layers=cfg.n_layer,
        hidden=cfg.n_embd,
        heads=cfg.n_head,
        seq=cfg.block_size,
        batch=cfg.batch_size,
        vocab=cfg.vocab_size,
        bias=cfg.bias,
        tie=cfg.tie_weights,
        element_size=getattr(torch, cfg.dtype).itemsize,
    )
    # A GPU node holds the launcher's ranks per node, one GPU each (the CPU box: every core).
    gpus_per_node = world.ranks_per_node if world.backend == "nccl" else None
    machine = local_machine(world.backend, gpus_per_node)
    shape = choose_gpt_grid(problem, world.world_size, machine)
    gnnpar.release(world)
    return gnnpar.init(**shape)


class GPTTask:
    """The ``gpt`` task: one optimizer step per trainer step."""

    unit = "step"

    def __init__(self, cfg: GPTRunConfig):
        self.cfg = cfg
        grid = None if cfg.grid else planned_grid(cfg)
        self.session = gpt_train.setup(cfg.train_config(), grid)
        self.grid = self.session.grid
        self.num_steps = cfg.steps
        self.tokens_per_step = cfg.batch_size * cfg.block_size
        self.model = self.session.model
        self.optimizer = self.session.optimizer

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step; loss is the mean over the whole batch."""
        start = time.perf_counter()
        loss, norm = gpt_train.train_step(self.session, step)
        seconds = time.perf_counter() - start
        return {"loss": loss, "grad_norm": norm, "tokens_per_s": self.tokens_per_step / seconds}

    def evaluate(self, step: int) -> dict[str, float]:
        """Validation loss."""
        return {"val_loss": gpt_train.evaluate(self.session)}

    def finish(self) -> str:
        """A short generated sample (the same on every rank)."""
        return gpt_train.sample(self.session)

    def extra_state(self) -> dict[str, Any]:
        """Nothing beyond the model and optimizer: the batch of a step is a pure function of
        the step and the seed."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Nothing to restore (see :meth:`extra_state`)."""

    def describe(self) -> dict[str, Any]:
        """The run's task and model sizes (recorded in its checkpoints)."""
        c = self.cfg
        return {
            "task": "gpt",
            "model": "gpt",
            "n_layer": c.n_layer,
            "n_head": c.n_head,
            "n_embd": c.n_embd,
            "block_size": c.block_size,
            "vocab_size": self.session.corpus.vocab_size,
        }
