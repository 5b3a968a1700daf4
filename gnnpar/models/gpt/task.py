"""GPT training with data × 3D tensor parallelism and sharded data parallelism (the ``gpt``
task): our GPT or Hugging Face's GPT-2, :func:`gnnpar.tensor.parallelize` over x × y × z,
then :func:`gnnpar.shard.shard` over the data axis (ZeRO stage 0–3, FCDP, mixed precision);
with a ``pipe`` axis in the grid, the model (ours or GPT-2) runs as a pipeline of that many stages
(:mod:`gnnpar.pipeline`; ``schedule`` gpipe, 1f1b or interleaved, the ``grad_accum``
micro-batches pushed through it), each stage tensor-parallel and sharded as above; with a
``context`` axis (our GPT only), each sequence is split over that many ranks and attention runs
as a ring (:mod:`gnnpar.tensor.context`), gradients averaged over context and data together.

The global batch of ``batch_size`` sequences of a step is split over the data and z axes
(each (data, z) coordinate holds ``batch_size / (data·z)`` of them; the x and y ranks of a
coordinate hold the same) and, with ``grad_accum = A``, each rank's share into A
micro-batches whose gradients accumulate before one optimizer step. The batch of step ``i`` is
a pure function of ``i`` and the seed, so the loss curve does not depend on the grid and
restoring the model and optimizer resumes exactly. With no ``grid`` or no ``zero_stage`` the
task runs what ``gnnpar plan gpt`` recommends for the same model on this machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from gnnpar import comm
from gnnpar.data.instruct import InstructionBatches, InstructionSet
from gnnpar.errors import UserError, first_line
from gnnpar.fmt import count
from gnnpar.grid import ProcessGrid, parse_grid_spec
from gnnpar.models.gpt.model import GPTConfig, generate, model_sizes, set_activation_checkpointing
from gnnpar.models.gpt.moe import aux_losses, set_aux_loss_scale
from gnnpar.recompute import MODES
from gnnpar.shard.clip import clipped_step
from gnnpar.train import schedule
from gnnpar.train.config import (
    ConfigError,
    DataParallelConfig,
    RecomputeConfig,
    ScheduleConfig,
    TrainerConfig,
    defined_in,
    option,
    redefault,
)
from gnnpar.train.loop import BaseTask, resumes
from gnnpar.train.metrics import global_mean
from gnnpar.train.precision import (
    LossScaler,
    compute_dtype,
    full_precision,
    master_dtype,
    shard_policy,
)
from gnnpar.train.progress import Progress
from gnnpar.train.spec import GridPlan
from gnnpar.verified import FormatError

__all__ = ["GPTTask", "GPTTaskConfig", "build_model", "load_pretrained", "parallel_model"]

MODELS = ("gpt", "llama", "hf-gpt2")
PEFT = ("none", "lora")
#: ``compile_backend`` values: inductor generates kernels; aot_eager traces the same graphs
#: (Dynamo, AOT autograd) and runs them with eager kernels, no code generated.
COMPILE_BACKENDS = ("inductor", "aot_eager")
#: ``tp_overlap``: how sequence parallelism's collectives meet the matmuls (gnnpar.tensor.overlap)
TP_OVERLAP = ("none", "decompose")
#: Every projection inside the blocks, per model: LoRA's default targets.
LORA_DEFAULT_TARGETS = {
    "gpt": ("qkv", "proj", "fc"),
    "llama": ("qkv", "o_proj", "gate_up", "down"),
    "hf-gpt2": ("c_attn", "c_proj", "c_fc"),
}
#: Our own models (plain PyTorch, our blocks): activation checkpointing and context work.
OURS = ("gpt", "llama")
#: The axes besides data that split a global batch (or its micro-batches) over ranks.
BATCH_AXES = ("z", "context", "expert", "pipe")


@dataclasses.dataclass
class GPTTaskConfig(RecomputeConfig, ScheduleConfig, DataParallelConfig, TrainerConfig, GPTConfig):
    """Options of ``gnnpar train gpt`` (and ``--config FILE`` keys)."""

    planner_picks_stage: ClassVar[bool] = True  # no zero_stage: the planner's pick

    model: str = option(
        "gpt", "gpt (ours), llama (ours: RMSNorm, RoPE, SwiGLU, GQA) or hf-gpt2 "
        "(transformers' GPT2LMHeadModel)", MODELS
    )  # fmt: skip
    bias: bool | None = option(
        None, "biases in linear layers and norms (default: gpt yes, llama no)"
    )
    tie_weights: bool | None = option(
        None, "output head tied to the token embedding (default: gpt yes, llama no)"
    )
    peft: str = option(
        "none", "parameter-efficient fine-tuning of the pretrained model: lora (adapters "
        "trained, the base frozen: out of the optimizer, the gradient collectives and the "
        "checkpoints) or none (full fine-tuning)", PEFT
    )  # fmt: skip
    lora_rank: int = option(8, "lora: rank of the adapters")
    lora_alpha: float = option(16.0, "lora: the update is scaled by lora_alpha / lora_rank")
    lora_targets: str | None = option(
        None, "lora: projections to adapt, comma-separated names or patterns (default: every "
        "projection of the blocks: llama qkv,o_proj,gate_up,down; gpt qkv,proj,fc; hf-gpt2 "
        "c_attn,c_proj,c_fc)"
    )  # fmt: skip
    n_kv_head: int = option(0, "llama: key-value heads of grouped-query attention (0: n_head)")
    ffn_hidden: int = option(0, "llama: SwiGLU hidden width (0: 8/3 n_embd rounded up to 64)")
    rope_theta: float = option(10000.0, "llama: RoPE base")
    norm_eps: float = option(1e-5, "llama: RMSNorm epsilon")
    model_config: str | None = option(
        None, "hf-gpt2: a GPT2Config as a JSON file or k=v,k=v (sizes it does not give come "
        "from the size options)"
    )  # fmt: skip
    pretrained: str | None = option(
        None, "hf-gpt2 or llama: start from a folder in Hugging Face layout (config.json, "
        "model.safetensors or pytorch_model.bin, and tokenizer.json or vocab.json + "
        "merges.txt); the text is encoded with its tokenizer; llama takes its sizes from it"
    )  # fmt: skip
    data: str = option("shakespeare", "text: shakespeare (built in), a file or a folder of .txt")
    vocab_size: int = option(2048, "BPE vocabulary trained on the data")
    block_size: int = option(128, "tokens per sequence (context length)")
    batch_size: int = option(16, "sequences per step over all data and z ranks")
    steps: int = option(300, "optimizer steps")
    lr: float = option(1e-3, "peak AdamW learning rate")
    lr_schedule: str = redefault(ScheduleConfig, "lr_schedule", "cosine")
    min_lr: float = redefault(ScheduleConfig, "min_lr", 1e-4)
    warmup: int = redefault(ScheduleConfig, "warmup", 20)
    weight_decay: float = option(0.1, "AdamW weight decay of the matrices")
    beta2: float = option(0.99, "AdamW beta2")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0: off)")
    grid: str | None = option(
        None,
        "grid such as data=2,x=2, pipe=2,data=2,x=2 or context=2,x=2 (default: the "
        "planner's pick with zero_stage)",
    )
    schedule: str = option(
        "1f1b",
        "pipeline schedule with a pipe axis: gpipe, 1f1b or interleaved (the "
        "micro-batches are grad_accum)",
        defined_in("gnnpar.pipeline.schedule", "SCHEDULES"),
    )
    virtual_stages: int = option(2, "interleaved schedule: model chunks per pipe rank")
    pipe_split: str = option(
        "layers",
        "pipeline stages by layer count (layers) or by cost",
        defined_in("gnnpar.models.gpt.pipeline", "SPLITS"),
    )
    val_fraction: float = option(0.05, "held-out end of the token stream")
    val_batches: int = option(4, "global batches per validation")
    sample_tokens: int = option(100, "tokens sampled at the end (0: none)")
    prompt: str = option("ROMEO:\n", "prompt of the sample")
    temperature: float = option(0.8, "sampling temperature")
    top_k: int | None = option(50, "sample from the k likeliest tokens")
    out: str = option("runs/gpt", "run folder: metrics.jsonl, checkpoints/, plots/")
    eval_every: int = option(100, "validate every N steps (0: only at the end)")
    seed: int = option(1337, "seed of the weights, the batches and the sample")
    compile: bool = option(
        False, "torch.compile each transformer block's forward (gpt, llama); the "
        "collectives of tensor-parallel layers and ZeRO-3's hooks stay eager (gnnpar.compile)"
    )  # fmt: skip
    compile_backend: str = option(
        "inductor", "torch.compile backend of --compile: inductor (generated kernels) or "
        "aot_eager (the same traced graphs run by eager kernels: no code generation)"
    )  # fmt: skip
    sequence_parallel: bool = option(
        False, "gpt, llama: between the tensor-parallel layers each x rank holds 1/x of the "
        "sequence (norms, dropout, residual stream): Megatron's sequence parallelism"
    )  # fmt: skip
    tp_overlap: str = option(
        "none", "with sequence_parallel: decompose runs each layer's sequence all-gather and "
        "reduce-scatter as point-to-point steps overlapping its matmul", TP_OVERLAP
    )  # fmt: skip

    def __post_init__(self) -> None:
        pass  # the model's own checks run in check(), as config errors naming the key

    def check(self) -> None:
        """Reject values that cannot work, naming the key."""
        self.check_trainer()
        self.check_data_parallel()
        self.check_schedule()
        self.check_recompute(MODES)
        if self.model not in MODELS:
            raise ConfigError(f"config key 'model' must be one of {', '.join(MODELS)}")
        if self.activation_checkpointing != "none" and self.model not in OURS:
            raise ConfigError(
                "config key 'activation_checkpointing' needs model = gpt or llama (our "
                f"blocks), not {self.model}"
            )
        if self.compile and self.model not in OURS:
            raise ConfigError(
                f"config key 'compile' needs model = gpt or llama (our blocks), not {self.model}"
            )
        if self.compile_backend not in COMPILE_BACKENDS:
            raise ConfigError(
                f"config key 'compile_backend' must be one of {', '.join(COMPILE_BACKENDS)}"
            )
        if self.pretrained and self.model == "gpt":
            raise ConfigError("config key 'pretrained' needs model = hf-gpt2 or llama")
        if self.peft not in PEFT:
            raise ConfigError(f"config key 'peft' must be one of {', '.join(PEFT)}")
        if self.peft != "none" and not self.pretrained:
            raise ConfigError(
                f"config key 'peft' ({self.peft}) needs 'pretrained': the model to fine-tune"
            )
        if self.lora_rank < 1 or not self.lora_alpha > 0:
            raise ConfigError("config keys 'lora_rank' and 'lora_alpha' must be positive")
        self.check_moe()
        self.check_reduce_order()
        self.check_sequence_parallel()
        if self.n_kv_head < 0 or self.ffn_hidden < 0:
            raise ConfigError("config keys 'n_kv_head' and 'ffn_hidden' must be 0 or positive")
        if self.model == "llama" and not self.pretrained:
            try:
                self.llama_config(self.vocab_size)
            except UserError as err:
                raise ConfigError(f"llama sizes: {err}") from None
        for key in ("steps", "batch_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, key) < 1:
                raise ConfigError(f"config key '{key}' must be positive")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"config key 'n_embd' ({self.n_embd}) must be a multiple of n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("config key 'dropout' must be in [0, 1)")
        if self.grid is None:
            self.check_pipeline(1)  # the names: a bad schedule is an error with any grid
        else:
            shape = parse_grid_spec(self.grid)
            self.check_pipeline(shape.get("pipe", 1))
            self.check_context(shape)

    def check_sequence_parallel(self) -> None:
        """Reject ``sequence_parallel`` and ``tp_overlap`` where they cannot work, naming the
        key."""
        if self.tp_overlap not in TP_OVERLAP:
            raise ConfigError(f"config key 'tp_overlap' must be one of {', '.join(TP_OVERLAP)}")
        if self.tp_overlap != "none" and not self.sequence_parallel:
            raise ConfigError(
                f"config key 'tp_overlap' ({self.tp_overlap}) needs sequence_parallel"
            )
        if not self.sequence_parallel:
            return
        pipe = parse_grid_spec(self.grid).get("pipe", 1) if self.grid else 1
        for bad, why in (
            (self.model not in OURS, f"model = gpt or llama, not {self.model}"),
            (pipe > 1, "no pipe axis"),
            (self.peft != "none", f"peft = none, not {self.peft}"),
            (bool(self.moe_experts), "moe_experts = 0"),
            (self.compile, "compile off"),
        ):
            if bad:
                raise ConfigError(f"config key 'sequence_parallel' needs {why}")

    def check_reduce_order(self) -> None:
        """``reduce_order = tree`` needs a grid given in full whose data axis alone splits the
        batch (no z, context, expert or pipe axis), naming the key."""
        if self.reduce_order != "tree":
            return
        if not self.grid:
            raise ConfigError(
                "config key 'reduce_order' = tree needs a 'grid' (the planner's pick may "
                "split the batch over z)"
            )
        shape = parse_grid_spec(self.grid)
        others = [f"{a}={n}" for a, n in shape.items() if a in BATCH_AXES and n > 1]
        if others:
            raise ConfigError(
                f"config key 'reduce_order' = tree needs a grid whose data axis alone splits "
                f"the batch; 'grid' has {', '.join(others)}"
            )

    def check_moe(self) -> None:
        """Reject mixture-of-experts options (and an expert axis) that cannot work, naming
        the key."""
        from gnnpar.models.gpt.moe import check_moe_sizes

        expert = parse_grid_spec(self.grid).get("expert", 1) if self.grid else 1
        try:
            check_moe_sizes(self.moe_experts, self.moe_top_k, self.moe_capacity, self.moe_aux_loss)
        except UserError as err:
            raise ConfigError(f"config keys 'moe_*': {err}") from None
        if not self.moe_experts:
            if expert > 1:
                raise ConfigError(
                    f"config key 'grid': an expert axis (expert={expert}) needs moe_experts > 0"
                )
            return
        if self.model not in OURS:
            raise ConfigError(
                f"config key 'moe_experts' needs model = gpt or llama, not {self.model}"
            )
        if self.pretrained:
            raise ConfigError("config key 'moe_experts' does not combine with 'pretrained'")
        if self.moe_experts % expert:
            raise ConfigError(
                f"config key 'moe_experts' ({self.moe_experts}) must be a multiple of the "
                f"grid's expert={expert} (each expert rank holds as many experts)"
            )

    def check_context(self, shape: dict[str, int]) -> None:
        """Reject a context axis that cannot work, naming the key."""
        c = shape.get("context", 1)
        if c == 1:
            return
        if self.model not in OURS:
            raise ConfigError("config key 'grid': a context axis needs model = gpt or llama")
        if shape.get("pipe", 1) > 1:
            raise ConfigError("config key 'grid': a context axis does not combine with pipe")
        if self.dropout > 0:
            raise ConfigError("config key 'dropout' must be 0 with a context axis")
        if self.moe_experts:  # capacity counts a whole sequence's tokens on one rank
            raise ConfigError(
                "config key 'moe_experts': a mixture of experts needs no context axis"
            )
        if self.block_size % (2 * c):
            raise ConfigError(
                f"config key 'block_size' ({self.block_size}) must be a multiple of "
                f"2·context = {2 * c} (each context rank holds two equal chunks)"
            )

    def check_pipeline(self, pipe: int) -> None:
        """Reject pipeline options that cannot work with ``pipe`` stages, naming the key."""
        from gnnpar.models.gpt.pipeline import SPLITS
        from gnnpar.pipeline.schedule import SCHEDULES, ScheduleError, check_sizes

        if self.schedule not in SCHEDULES:
            raise ConfigError(f"config key 'schedule' must be one of {', '.join(SCHEDULES)}")
        if self.pipe_split not in SPLITS:
            raise ConfigError(f"config key 'pipe_split' must be one of {', '.join(SPLITS)}")
        if pipe == 1:
            return
        virtual = self.pipeline_virtual
        try:
            check_sizes(self.schedule, pipe, self.grad_accum, virtual)
        except ScheduleError as err:
            raise ConfigError(f"config keys 'schedule'/'grad_accum': {err}") from None
        # GPT-2's layers may come from model_config or pretrained: checked when it is built
        sized = self.model == "gpt" or not (self.model_config or self.pretrained)
        if sized and self.n_layer < pipe * virtual:
            raise ConfigError(
                f"config key 'n_layer' ({self.n_layer}) must be at least pipe x virtual "
                f"stages = {pipe * virtual}"
            )

    @property
    def pipeline_virtual(self) -> int:
        """Model chunks per pipe rank: ``virtual_stages`` for the interleaved schedule."""
        return self.virtual_stages if self.schedule == "interleaved" else 1

    def gpt_config(self, vocab_size: int) -> GPTConfig:
        """Our GPT's sizes, with the tokenizer's vocabulary."""
        return GPTConfig(**self._sizes(GPTConfig, vocab_size))

    def llama_config(self, vocab_size: int) -> Any:
        """Our Llama's sizes, with the tokenizer's vocabulary (a pretrained folder's
        ``config.json`` gives them instead: :func:`build_model`)."""
        from gnnpar.models.gpt.llama import LlamaConfig

        return LlamaConfig(**self._sizes(LlamaConfig, vocab_size))

    def _sizes(self, cls: type, vocab_size: int) -> dict[str, Any]:
        """The fields of the model config ``cls`` from the options; ``bias`` and
        ``tie_weights`` left unset take the model's defaults."""
        names = [f.name for f in dataclasses.fields(cls)]
        sizes = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        return {**sizes, "vocab_size": vocab_size}


# --------------------------------------------------------------------------- the models
def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def hf_config(cfg: GPTTaskConfig, vocab_size: int):
    """The ``GPT2Config`` of the run: the pretrained folder's, or one with the size options,
    then ``model_config`` (a JSON file, or ``k=v,k=v``) on top."""
    from transformers import GPT2Config

    if cfg.pretrained:
        path = Path(cfg.pretrained) / "config.json"
        if not path.is_file():
            raise ConfigError(f"pretrained folder {cfg.pretrained} has no config.json")
        hf = GPT2Config.from_json_file(str(path))
    else:
        hf = GPT2Config(
            vocab_size=vocab_size, n_positions=cfg.block_size, n_embd=cfg.n_embd,
            n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            tie_word_embeddings=cfg.tie_weights is not False,
        )  # fmt: skip
    spec = cfg.model_config
    if spec and Path(spec).is_file():
        try:
            updates = json.loads(Path(spec).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"model_config {spec}: not a JSON file ({err})") from None
    elif spec:
        updates = {}
        for pair in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = pair.partition("=")
            if not sep:
                raise ConfigError(f"config key 'model_config': '{pair}' is not key=value")
            updates[key.strip()] = _parse_value(value.strip())
    else:
        updates = {}
    for key, value in updates.items():
        if not hasattr(hf, key):
            raise ConfigError(f"config key 'model_config': GPT2Config has no field '{key}'")
        setattr(hf, key, value)
    return hf


@contextlib.contextmanager
def _hf_weights(folder: Path) -> Iterator[dict[str, Any]]:
    """The weights of a pretrained folder, lazily: safetensors slices (read box by box) or a
    memory-mapped ``pytorch_model.bin`` (never unpickling anything but tensors)."""
    safe = folder / "model.safetensors"
    binary = folder / "pytorch_model.bin"
    if safe.is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(safe), framework="pt") as f:
                yield {k: f.get_slice(k) for k in f.keys()}  # noqa: SIM118 - not a dict
        except SafetensorError as err:  # a damaged header or a truncated slice, when read
            reason = first_line(err, 200)
            raise FormatError(f"{safe}: not a readable safetensors file ({reason})") from None
    elif binary.is_file():
        from gnnpar.verified import load_tensors

        yield load_tensors(binary)
    else:
        raise ConfigError(
            f"pretrained folder {folder} has no model.safetensors or pytorch_model.bin"
        )


def build_model(cfg: GPTTaskConfig, vocab_size: int) -> tuple[nn.Module, type]:
    """The plain model on the meta device (its structure and sizes, no memory:
    :func:`parallel_model` gives each rank its pieces) and its block class (the unit of
    sharding)."""
    if cfg.model == "gpt":
        from gnnpar.models.gpt.model import GPT, Block

        with torch.device("meta"):
            return GPT(cfg.gpt_config(vocab_size)), Block
    if cfg.model == "llama":
        from gnnpar.models.gpt.llama import Llama, LlamaBlock

        sizes = _pretrained_llama(cfg) if cfg.pretrained else cfg.llama_config(vocab_size)
        with torch.device("meta"):
            return Llama(sizes), LlamaBlock
    from transformers import GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    hf = hf_config(cfg, vocab_size)
    with torch.device("meta"):  # imports stay outside: a module-level tensor must be real
        return GPT2LMHeadModel(hf), GPT2Block


def parallel_model(
    plain: nn.Module, cfg: GPTTaskConfig, grid: ProcessGrid, values: bool = True
) -> nn.Module:
    """``plain`` (from :func:`build_model`, on the meta device) made tensor-parallel on
    ``grid`` with only this rank's pieces materialised: the values of the model built eagerly
    after ``torch.manual_seed(cfg.seed)`` (the initialisation is replayed, draw for draw, so
    the generator is left as that build leaves it), then the pretrained weights, read slice by
    slice. ``values=False``: the base model's pieces are left uninitialised and nothing is
    read, for a restore that loads every one of them (LoRA's adapters are still made)."""
    from gnnpar.tensor import Plan, parallelize

    torch.manual_seed(cfg.seed)
    if cfg.moe_experts:
        from gnnpar.tensor.experts import expert_parallel

        expert_parallel(plain, grid)  # this rank's experts only, before their pieces exist
    plan = Plan(sequence_parallel=cfg.sequence_parallel, decompose=cfg.tp_overlap == "decompose")
    model = parallelize(plain.to(master_dtype(cfg)), grid, plan, values=values)
    if cfg.pretrained and values:
        load_pretrained(model, Path(cfg.pretrained), grid)
    if cfg.peft == "lora":
        from gnnpar.tensor.lora import add_lora

        try:
            add_lora(model, lora_targets(cfg), cfg.lora_rank, cfg.lora_alpha, cfg.seed)
        except UserError as err:
            raise ConfigError(f"config keys 'lora_targets'/'lora_rank': {err}") from None
    return model


def lora_targets(cfg: GPTTaskConfig) -> tuple[str, ...]:
    """The projections LoRA adapts: ``lora_targets``, else every projection of the blocks."""
    if cfg.lora_targets:
        return tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())
    return LORA_DEFAULT_TARGETS[cfg.model]


def _pretrained_llama(cfg: GPTTaskConfig) -> Any:
    """The sizes of a pretrained Hugging Face Llama folder (its ``config.json``)."""
    from gnnpar.models.gpt.hf_llama import llama_config_from_hf, read_hf_config
    from gnnpar.models.gpt.llama import LlamaConfig

    folder = Path(cfg.pretrained)
    fields = llama_config_from_hf(read_hf_config(folder), str(folder / "config.json"))
    return LlamaConfig(**fields, dropout=cfg.dropout)


def load_pretrained(model: nn.Module, folder: Path, grid: ProcessGrid) -> None:
    """Read a Hugging Face GPT-2 or Llama folder's weights into the parallel ``model``: each
    rank reads only its pieces' boxes of each tensor."""
    from gnnpar.models.gpt.llama import Llama
    from gnnpar.tensor import load_full_state_dict

    if isinstance(model, Llama):
        from gnnpar.models.gpt.hf_llama import llama_state_from_hf

        with _hf_weights(folder) as state:
            ours = llama_state_from_hf(state, model.config, str(folder))
            load_full_state_dict(model, ours, grid, False)
        return
    with _hf_weights(folder) as state:
        state = {k.removeprefix("module."): v for k, v in state.items()}
        if not any(k.startswith("transformer.") for k in state):
            state = {f"transformer.{k}": v for k, v in state.items()}
        mine = set(model.state_dict(keep_vars=True))
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        missing = [k for k in mine - set(state) - tied if not k.endswith(".attn.bias")]
        unexpected = [
            k for k in set(state) - mine if not k.endswith((".attn.bias", ".masked_bias"))
        ]
        if missing or unexpected:
            raise ConfigError(
                f"pretrained folder {folder} does not fit its config: missing "
                f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}"
            )
        load_full_state_dict(model, {k: v for k, v in state.items() if k in mine}, grid, False)


# ------------------------------------------------------------------------------- the grid
def plan_problem(cfg: GPTTaskConfig, sizes: GPTConfig | None = None) -> Any:
    """The planner's :class:`~gnnpar.models.gpt.cost.GPTProblem` for a run of ``cfg`` (the model's
    ``sizes``, default: the config's own), what the trainer and ``gnnpar plan gpt`` rank."""
    from gnnpar.models.gpt.cost import GPTProblem

    if sizes is None:
        sizes = (
            cfg.llama_config(cfg.vocab_size)
            if cfg.model == "llama"
            else cfg.gpt_config(cfg.vocab_size)
        )
    return GPTProblem(
        sizes,
        batch=cfg.batch_size,
        element_size=compute_dtype(cfg).itemsize,
        grad_clip=cfg.grad_clip > 0,
        micro_batches=cfg.grad_accum,
        schedule=cfg.schedule,
        virtual=cfg.virtual_stages,
        activation_checkpointing=cfg.activation_checkpointing,
        offload=cfg.offload,
        prefetch_depth=cfg.prefetch_depth,
        lora_rank=cfg.lora_rank if cfg.peft == "lora" else 0,
        sequence_parallel=cfg.sequence_parallel,
        quantized_weights=cfg.quantized_weights,
        quantized_grads=cfg.quantized_grads,
    )


def planned(cfg: GPTTaskConfig, sizes: GPTConfig, world: ProcessGrid) -> tuple[dict, int]:
    """The grid shape and ZeRO stage to run: the given ones, and what the planner predicts
    fastest on this machine for the rest (``gnnpar plan gpt`` for the same model)."""
    from gnnpar.models.gpt.planning import choose_gpt_plan
    from gnnpar.plan import local_machine

    shape = parse_grid_spec(cfg.grid) if cfg.grid else None
    stage = cfg.zero_stage
    if stage is None and (cfg.quantized_weights or cfg.quantized_grads):
        stage = 3  # ZeRO++ quantizes stage 3's collectives
    if stage is None and cfg.powersgd_rank:
        stage = 0  # PowerSGD compresses stage 0's all-reduce
    if shape is not None and stage is not None:
        return shape, stage
    problem = plan_problem(cfg, sizes)
    # A GPU node holds the launcher's ranks per node, one GPU each (the CPU box: every core).
    gpus_per_node = world.ranks_per_node if world.backend == "nccl" else None
    machine = local_machine(world.backend, gpus_per_node)
    return choose_gpt_plan(problem, world.world_size, machine, shape, stage)


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """What :func:`plan` read and built, for the task: the tokenised text, the plain model
    and its block class, and the ZeRO stage."""

    corpus: Any
    plain: nn.Module
    block: type
    stage: int


def plan(
    cfg: GPTTaskConfig, world: ProcessGrid, progress: Progress, corpus: Any = None
) -> GridPlan:
    """The grid and ZeRO stage of a ``gpt`` run (:func:`planned`), from the sizes of the
    plain model built for the text. ``corpus``: the tokenised text (default: ``cfg.data``
    read and tokenised; tests and benchmarks pass their own: anything with ``split``,
    ``encode``, ``decode`` and ``vocab_size`` like :class:`~gnnpar.data.text.TextCorpus`)."""
    corpus = corpus if corpus is not None else _load_corpus(cfg, world, progress)
    # seconds, mostly torch's lazy imports at the first module
    with progress.stage("building the model"):
        plain, block = build_model(cfg, corpus.vocab_size)
        shape, stage = planned(cfg, model_sizes(plain), world)
    return GridPlan(shape, _choice_text(cfg, stage), _Prepared(corpus, plain, block, stage))


class GPTTask(BaseTask):
    """The ``gpt`` task: one optimizer step per trainer step."""

    unit = "step"

    @staticmethod
    def preflight(cfg: GPTTaskConfig, world_size: int) -> None:
        """Before launch: the ``data`` text exists and decodes as UTF-8 (one line naming the
        file and the byte offset otherwise); the built-in corpus's plays exist (its text is
        built where a rank needs it: not at all when its tokens are cached)."""
        from gnnpar.data.text import SHAKESPEARE, read_source, source_fingerprint

        if str(cfg.data) == SHAKESPEARE:
            source_fingerprint(cfg.data)
        else:
            read_source(cfg.data)

    def __init__(self, cfg: GPTTaskConfig, grid: ProcessGrid, plan: GridPlan, progress: Progress):
        """The task on ``grid``, the one :func:`plan` chose with the ZeRO stage
        (:func:`gnnpar.train.spec.build_task` builds both); ``progress``: where rank 0
        reports the slow preparation stages."""
        self.cfg = cfg
        self.grid = grid
        prepared: _Prepared = plan.prepared
        self.corpus, self.stage = prepared.corpus, prepared.stage
        plain = prepared.plain
        # seconds: every rank's pieces of the parallel model and the first optimizer's setup
        with progress.stage("sharding the model"):
            self._token_blocks()
            self.num_params = sum(p.numel() for p in plain.parameters())
            self.sizes = model_sizes(plain)
            # a resuming run loads every parameter: making their initial values first (a
            # recorded build replayed) was most of a restart's build; initialise() makes
            # them when there is nothing to load
            self.values_deferred = _values_restored(cfg, plain)
            self._build_model(plain, prepared.block, values=not self.values_deferred)
        #: Who chose the grid and the ZeRO stage, for the start lines.
        self.grid_choice = plan.choice
        self.scaler = LossScaler(cfg.mixed_precision == "fp16")
        self.num_steps = cfg.steps
        self.tokens_per_step = cfg.batch_size * cfg.block_size

    def _token_blocks(self) -> None:
        """This rank's share of every global batch, for training and validation."""
        from gnnpar.data.text import TokenBlocks

        cfg, grid = self.cfg, self.grid
        # expert ranks see other sequences, as data ranks do (expert below data in rank order)
        replicas = grid.size("expert") * grid.size("data")
        shards = replicas * grid.size("z")
        index = grid.rank("z") + grid.size("z") * (
            grid.rank("expert") + grid.size("expert") * grid.rank("data")
        )
        if cfg.batch_size % (shards * cfg.grad_accum):
            what = "data·expert·z" if grid.size("expert") > 1 else "data·z"
            raise ConfigError(
                f"config key 'batch_size' ({cfg.batch_size}) must divide into {what} = {shards} "
                f"shards of grad_accum = {cfg.grad_accum} micro-batches"
            )
        blocks = (cfg.block_size, cfg.batch_size, index, shards)
        #: With instruction data, the response tokens per share of the batch in hand (the
        #: summed loss is divided by it); None for a token stream (the plain mean).
        self._expected: float | None = None
        if isinstance(self.corpus, InstructionSet):
            train_idx, val_idx = self.corpus.split(cfg.val_fraction)
            try:
                self.train = InstructionBatches(self.corpus, train_idx, *blocks, cfg.seed)
                self.val = InstructionBatches(self.corpus, val_idx, *blocks, cfg.seed + 1)
            except UserError as err:
                raise ConfigError(
                    f"config keys 'data'/'val_fraction'/'batch_size': {err}"
                ) from None
            return
        train_tokens, val_tokens = self.corpus.split(cfg.val_fraction)
        self.train = TokenBlocks(train_tokens, *blocks, cfg.seed)
        self.val = TokenBlocks(val_tokens, *blocks, cfg.seed + 1)

    def _count_shares(self, batches: Any, step: int, micro: int) -> None:
        """Instruction data: the response tokens per share of ``step``'s batch, the batch
        split over data, z and context ranks and into ``micro`` micro-batches."""
        if isinstance(batches, InstructionBatches):
            grid = self.grid
            shares = grid.size("data") * grid.size("expert") * grid.size("z")
            shares *= grid.size("context") * micro
            self._expected = batches.expected_tokens(step, shares)

    def _ce(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of a share: the mean over its tokens, or with instruction data its
        response tokens' sum over the expected count (:meth:`_count_shares`)."""
        from gnnpar.tensor import cross_entropy

        if self._expected is None:
            return cross_entropy(logits, y, self.head)
        return cross_entropy(logits, y, self.head, reduction="sum") / self._expected

    def initialise(self) -> None:
        """The model built again with its initial values (and its optimizer on next use),
        where they were left to a restore that found nothing."""
        if not self.values_deferred:
            return
        plain, block = build_model(self.cfg, self.corpus.vocab_size)
        self._build_model(plain, block)
        self.__dict__.pop("optimizer", None)  # the cached one steps the old pieces
        self.values_deferred = False

    def _build_model(self, plain: nn.Module, block: type, values: bool = True) -> None:
        """This rank's pieces of the parallel model, sharded over the data axis; with a pipe
        axis, only this rank's stage (:mod:`gnnpar.pipeline`). AdamW comes on first use
        (:meth:`_make_optimizer`). ``values=False``: left uninitialised (see
        :func:`parallel_model`)."""
        from gnnpar.shard import by_type, shard
        from gnnpar.shard.offload import OffloadError
        from gnnpar.tensor.context import context_parallel

        cfg, grid = self.cfg, self.grid
        model = context_parallel(parallel_model(plain, cfg, grid, values), grid)
        if cfg.activation_checkpointing != "none":
            set_activation_checkpointing(model, cfg.activation_checkpointing)
        if cfg.compile:  # the blocks' forward; their hooks and collectives stay eager
            from gnnpar.compile import compile_blocks

            compile_blocks(model, block, backend=cfg.compile_backend)
        self.net = model
        self.head = model.lm_head

        def shard_fn(module: nn.Module):
            dp = shard(  # context and expert ranks reduce with the data ranks (shard's view)
                module,
                grid,
                self.stage,
                units=by_type(block),
                mixed_precision=shard_policy(cfg),
                **cfg.shard_options(),
            )
            # PEFT: checkpoints hold the adapters; the base is read again from `pretrained`
            dp.checkpoint_trainable_only = cfg.peft != "none"
            return dp

        self.pipeline = None
        if grid.size("pipe") > 1:
            from gnnpar.models.gpt.pipeline import gpt_pipeline

            try:  # a GPT-2 whose sizes came from its config, or a transformers it cannot run
                self.pipeline = gpt_pipeline(
                    model,
                    grid,
                    cfg.schedule,
                    cfg.grad_accum,
                    virtual=cfg.pipeline_virtual,
                    split=cfg.pipe_split,
                    shard_fn=shard_fn,
                    tie_dtype=compute_dtype(cfg),
                )
            except OffloadError:
                raise  # the offload folder's own error (it names the folder), not the grid's
            except UserError as err:
                raise ConfigError(f"config key 'grid': {err}") from None
            self.net = None  # the stages run through self.pipeline
            if not self.pipeline.pipeline.is_last:  # the head's sizes only, not its weight
                self.head._parameters.pop("weight", None)
            self.dp = self.model = self.pipeline
            return
        self.dp = shard_fn(model)
        self.model = self.dp  # what checkpoints save: masters and pieces, on any grid
        # the step's loss carries the mean over data ranks: no division of the gradients
        self.dp.loss_divided_by_data = True

    def _make_optimizer(self) -> torch.optim.Optimizer:
        if self.pipeline is None:
            return self.dp.attach(_adamw(self.dp, self.cfg))
        opt = _adamw(self.dp, self.cfg)
        # one optimizer over several sharded chunks: they catch up after each step
        opt.register_step_post_hook(lambda *a: self.pipeline.sync_params())
        return opt

    def data_record(self) -> dict[str, Any]:
        """The token stream trained on: its digest and the text's name."""
        return {"name": self.corpus.name, "fingerprint": self._token_digest}

    @functools.cached_property
    def _token_digest(self) -> str:
        """XXH3-64 of the token ids (computed on first use, once)."""
        import numpy as np
        import xxhash

        tokens = np.ascontiguousarray(self.corpus.tokens)  # no copy: it is contiguous
        return xxhash.xxh3_64_hexdigest(memoryview(tokens).cast("B"))

    def summary(self) -> str:
        """What the run trains on what: the model's size and the text's tokens."""
        cfg = self.cfg
        tokens = len(self.train.tokens) + len(self.val.tokens)
        vocab = self.corpus.vocab_size
        return (
            f"{cfg.model} ({count(self.num_params, 'parameter')}) on {cfg.data}: "
            f"{count(tokens, 'token')} ({len(self.val.tokens):,} held out), "
            f"vocabulary {vocab:,}"
        )

    # ------------------------------------------------------------------------ training
    def _logits(self, ids: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        if self.pipeline is not None:  # the last position, on every pipe rank
            grid = self.grid
            last = torch.empty(
                (ids.shape[0], 1, self.head.local_out_features),
                dtype=compute_dtype(self.cfg),
                device=grid.device,
            )
            outs = self.pipeline.forward([ids.to(grid.device)], compute_dtype(self.cfg))
            if outs:
                last.copy_(outs[0][:, -1:, :])
            return comm.broadcast(last, grid, "pipe", src=grid.size("pipe") - 1)
        if pos is not None:
            return self.net(ids.to(self.grid.device), pos=pos.to(self.grid.device))
        out = self.net(ids.to(self.grid.device))
        return out if isinstance(out, torch.Tensor) else out.logits

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean loss over this rank's tokens of the sequences ``x`` (targets ``y``): with a
        context axis, over the two chunks it holds (each rank holds as many tokens, so the
        mean over context and data ranks is the mean over the batch)."""
        from gnnpar.tensor.context import positions, split_sequence

        pos = None
        c = self.grid.size("context")
        if c > 1:
            r = self.grid.rank("context")
            pos = positions(x.shape[1], c, r)
            x, y = split_sequence(x, c, r), split_sequence(y, c, r)
        logits = full_precision(self._logits(x, pos))
        return self._ce(logits, y.to(self.grid.device))

    def _pipelined(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one step's micro-batches through the pipeline; the summed
        loss, on every pipe rank."""

        cfg, grid, m = self.cfg, self.grid, self.cfg.grad_accum

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, float]:
            loss = self._ce(full_precision(logits), target) / m
            return self.scaler.scale_loss(loss), float(loss.detach())

        xs = [t.to(grid.device) for t in x.chunk(m)]
        ys = [t.to(grid.device) for t in y.chunk(m)]
        for chunk in self.pipeline.chunks:
            chunk.train()
            # the auxiliary loss scaled as loss_fn scales the loss; reductions divide the rest
            set_aux_loss_scale(chunk, cfg.moe_aux_loss * self.scaler.scale / m)
        res = self.pipeline.step(xs, ys, loss_fn, compute_dtype(cfg))
        total = torch.tensor([res.loss], dtype=torch.float64, device=grid.device)
        return comm.all_reduce(total, grid, "pipe").cpu().reshape(())

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step on the global batch of ``step``, in ``grad_accum``
        micro-batches; the loss is the mean over the whole batch."""
        cfg, dp = self.cfg, self.dp
        start = time.perf_counter()
        lr = schedule.apply(self.optimizer, cfg, step, self.num_steps)
        x, y = self.train.batch(step)
        self._count_shares(self.train, step, cfg.grad_accum)
        total = torch.zeros((), dtype=torch.float64)
        micro = list(zip(x.chunk(cfg.grad_accum), y.chunk(cfg.grad_accum), strict=True))
        if self.pipeline is not None:
            total = self._pipelined(x, y)
            micro = []
        else:
            self.net.train()
            # the gradient of the mean over the global batch: over micro-batches and (the
            # reduction only sums, loss_divided_by_data) over the ranks it reduces over,
            # data and context ones (its grid folds context into data)
            divisor = cfg.grad_accum * dp.grid.size("data")
            # a mixture of experts' auxiliary loss joins backward as the loss is scaled
            set_aux_loss_scale(self.net, cfg.moe_aux_loss * self.scaler.scale / divisor)
        aux = torch.zeros((), dtype=torch.float64)
        for i, (xm, ym) in enumerate(micro):
            last = i == len(micro) - 1
            with contextlib.nullcontext() if last else dp.no_sync():
                loss = self._loss(xm, ym)
                self.scaler.scale_loss(loss / divisor).backward()
            total += loss.detach().to(torch.float64).cpu() / cfg.grad_accum
            if cfg.moe_experts:
                aux += aux_losses(self.net).to(torch.float64).cpu() / cfg.grad_accum
        self.scaler.unscale(dp.parameters())
        norm = dp.grad_norm()
        if self.scaler.update(float(norm)):
            # the clip inside the fused AdamW step where it can: no pass of its own
            clipped_step(self.optimizer, dp.parameters(), norm, cfg.grad_clip)
        self.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        out = {
            "loss": global_mean(total, self.grid),
            "grad_norm": float(norm),
            "lr": lr,
            "tokens_per_s": self.tokens_per_step / seconds,
        }
        if cfg.moe_experts and micro:  # the load-balancing loss, mean over blocks and batch
            out["moe_aux"] = global_mean(aux, self.grid)
        return out

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """Mean validation loss over ``val_batches`` global batches."""
        self._train_mode(False)
        total = 0.0
        for i in range(self.cfg.val_batches):
            x, y = self.val.batch(i)
            self._count_shares(self.val, i, 1 if self.pipeline is None else self.cfg.grad_accum)
            total += global_mean(self._val_loss(x, y), self.grid)
        self._train_mode(True)
        return {"val_loss": total / max(self.cfg.val_batches, 1)}

    @torch.no_grad()
    def finish(self) -> str:
        """A short generated sample (the same on every rank: one seeded generator)."""
        cfg = self.cfg
        if cfg.sample_tokens <= 0:
            return ""
        from gnnpar.models.gpt.generation import full_logits_of
        from gnnpar.tensor.context import plain_attention

        ids = torch.tensor([self.corpus.encode(cfg.prompt) or [0]], device=self.grid.device)
        full = full_logits_of(self.head)  # a head that keeps the vocabulary split: gathered
        self._train_mode(False)
        plain = contextlib.nullcontext() if self.net is None else plain_attention(self.net)
        with plain:  # every rank generates from whole sequences
            out = self._generate(ids, full)
        return self.corpus.decode(out[0])

    def _generate(self, ids: torch.Tensor, full: Any) -> torch.Tensor:
        cfg = self.cfg
        return generate(
            self._logits,
            ids,
            cfg.sample_tokens,
            self.sizes.block_size,
            cfg.temperature,
            cfg.top_k,
            torch.Generator().manual_seed(cfg.seed),
            full,
        )

    def _train_mode(self, on: bool) -> None:
        for module in self.pipeline.chunks if self.pipeline is not None else [self.net]:
            module.train(on)

    def _val_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of one validation batch (through the pipeline: the mean over its
        ``grad_accum`` micro-batches, on every pipe rank)."""
        if self.pipeline is None:
            return self._loss(x, y)

        grid, m = self.grid, self.cfg.grad_accum
        xs = [t.to(grid.device) for t in x.chunk(m)]
        outs = self.pipeline.forward(xs, compute_dtype(self.cfg))
        total = torch.zeros(1, dtype=torch.float64, device=grid.device)
        for logits, ym in zip(outs, y.chunk(m), strict=False):
            loss = self._ce(full_precision(logits), ym.to(grid.device))
            total += loss.detach().to(torch.float64) / m
        return comm.all_reduce(total, grid, "pipe").reshape(())

    # ------------------------------------------------------------------------ state
    def extra_state(self) -> dict[str, Any]:
        """The loss scaler's state (the batches are a pure function of the step) and the
        micro-batches of a global batch (data × grad_accum)."""
        micro = self.grid.size("data") * self.cfg.grad_accum
        return {"loss_scale": self.scaler.state(), "micro_batches": micro}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`extra_state`. With ``reduce_order = tree`` a resume on another data
        size keeps the run's micro-batches: ``grad_accum`` becomes micro-batches / data (so
        the gradients are summed in the same tree, bit for bit)."""
        self.scaler.load(state.get("loss_scale", {}))
        micro, data = state.get("micro_batches"), self.grid.size("data")
        if self.cfg.reduce_order != "tree" or micro in (None, data * self.cfg.grad_accum):
            return
        if micro % data or micro // data > 2:
            err = ConfigError(
                f"reduce_order = tree keeps the run's {micro} micro-batches a step: data = "
                f"{data} would need grad_accum = {micro / data:g} (1 or 2)"
            )
            err.same_on_every_rank = True
            raise err
        self.cfg.grad_accum = micro // data

    def _peft_record(self) -> dict[str, Any]:
        """What a PEFT checkpoint needs to be used without its run: the base folder and the
        adapters' settings (``gnnpar ckpt export-hf --merge``)."""
        cfg = self.cfg
        if cfg.peft == "none":
            return {}
        return {
            "peft": cfg.peft,
            "pretrained": str(Path(cfg.pretrained).resolve()),
            "lora_rank": cfg.lora_rank,
            "lora_alpha": cfg.lora_alpha,
            "lora_targets": ",".join(lora_targets(cfg)),
        }

    def describe(self) -> dict[str, Any]:
        """The run's task, model sizes and parallelism (recorded in its checkpoints)."""
        from gnnpar.models.gpt.hf_llama import LLAMA_SIZES

        s = self.sizes
        return {
            "task": "gpt",
            "model": self.cfg.model,
            "n_layer": s.n_layer,
            "n_head": s.n_head,
            "n_embd": s.n_embd,
            "block_size": s.block_size,
            "vocab_size": s.vocab_size,
            **({k: getattr(s, k) for k in LLAMA_SIZES} if self.cfg.model == "llama" else {}),
            **self._peft_record(),
            "zero_stage": self.stage,
            "mixed_precision": self.cfg.mixed_precision,
            **({"schedule": self.cfg.schedule} if self.pipeline is not None else {}),
        }


def _values_restored(cfg: GPTTaskConfig, plain: nn.Module) -> bool:
    """Whether a restore will give ``plain`` (the model on the meta device) every value: the
    run resumes (:func:`~gnnpar.train.loop.resumes`), checkpoints the whole model (not
    LoRA's adapters alone) and the model has no buffers (which no checkpoint holds)."""
    return resumes(cfg) and cfg.peft == "none" and next(plain.buffers(), None) is None


def _adamw(dp, cfg: GPTTaskConfig) -> torch.optim.Optimizer:
    """AdamW on this rank's pieces, weight decay on the matrices (full tensors of two
    dimensions, however they are stored) and not on biases and norms."""
    matrices = set()
    for s in dp.slots:
        full = s.layout.shape if s.layout is not None else s.shape
        if len(full) >= 2:
            matrices.add(s.name)
    decay, rest = [], []
    for name, p in dp.named_parameters():
        (decay if name in matrices else rest).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    # torch's fused CPU kernel rounds a tensor's last elements (past its last full vector)
    # otherwise than the rest, so where the ZeRO shards cut the pieces would change the
    # update; the per-tensor and foreach kernels do not (reduce_order = tree promises that)
    fused = _has_fused_kernels([*decay, *rest]) and cfg.reduce_order != "tree"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.beta2), fused=fused or None)


def _has_fused_kernels(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel can step ``params``: plain tensors on the host or a
    CUDA device. On the host it is about 5× faster than the per-tensor loop torch picks by
    default there (70.8M parameters: 0.04 s against 0.23 s of CPU time a step, one thread),
    which is a tenth of a tensor-parallel GPT step; other devices keep torch's default."""
    return bool(params) and all(
        type(p) in (torch.Tensor, nn.Parameter) and p.device.type in ("cpu", "cuda") for p in params
    )


def _choice_text(cfg: GPTTaskConfig, stage: int) -> str:
    """Who chose the grid and the ZeRO stage (the planner chooses what was not given)."""
    if cfg.grid and cfg.zero_stage is not None:
        return f"ZeRO stage {stage}; both given"
    if cfg.grid:
        return f"ZeRO stage {stage} chosen by the planner"
    if cfg.zero_stage is not None:
        return f"chosen by the planner; ZeRO stage {stage} given"
    return f"ZeRO stage {stage}; both chosen by the planner"


def is_instruction_file(data: str) -> bool:
    """Whether ``data`` names instruction pairs (a ``.jsonl`` file) rather than text."""
    return str(data).endswith(".jsonl")


def _load_corpus(cfg: GPTTaskConfig, grid: ProcessGrid, progress: Progress):
    """The tokenised text (rank 0 first, so the tokenizer is trained or read once; it
    reports tokenizing on ``progress``)."""
    from gnnpar.data.text import load_corpus

    tokenizer = Path(cfg.pretrained) if cfg.pretrained else None
    if is_instruction_file(cfg.data):
        from gnnpar.data.instruct import read_instructions
        from gnnpar.data.text import load_tokenizer

        if tokenizer is None:
            raise ConfigError(
                f"config key 'data': {cfg.data} is instruction data; it needs 'pretrained' "
                "(the model to fine-tune and its tokenizer)"
            )
        with progress.stage("tokenizing the instructions"):
            return read_instructions(cfg.data, load_tokenizer(tokenizer))
    if grid.global_rank == 0:
        corpus = load_corpus(cfg.data, cfg.vocab_size, tokenizer=tokenizer, progress=progress.stage)
    comm.barrier(grid)
    if grid.global_rank != 0:
        corpus = load_corpus(cfg.data, cfg.vocab_size, tokenizer=tokenizer)
    return corpus
