"""Typed run configuration: dataclasses filled from defaults, then a TOML file, then flags.

Every task (``gcn``, ``sage``, ``gpt``) has one flat dataclass made of shared parts:
:class:`TrainerConfig` (what every task has: run folder, seed, precision, evaluation and
checkpoint cadence, ...), :class:`DataParallelConfig` (what tasks with a data axis have: the
ZeRO stage, FCDP, the gradient-reduction dtype, gradient accumulation) and the task's own
fields. :func:`add_flags` turns the fields into command-line flags (``--hidden 16``,
``--no-permute``), grouped by part; :func:`resolve` merges defaults ← ``--config FILE`` ←
flags and checks every key and type, so a typo or a wrong type is one clear error naming the
key.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

from gnnpar.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


class ConfigError(UserError):
    """A configuration that cannot be used (unknown key, wrong type, bad value)."""


class UnknownKeyError(ConfigError):
    """A key the config does not have; the message names where it was given."""


#: The values an option takes: a tuple, or a function that returns one (for a tuple defined
#: in a module that imports torch, which this one does not import).
Choices = tuple[str, ...] | Callable[[], tuple[str, ...]]


def option(default: Any, help: str, choices: Choices | None = None) -> Any:  # noqa: A002
    """A config field with its ``--help`` text. ``choices``: the values it takes, the very
    tuple its config's check validates it against (``--help`` shows them as ``{a,b,c}``)."""
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = choices
    return dataclasses.field(default=default, metadata=metadata)


def redefault(cls: type, name: str, default: Any) -> Any:
    """A config field of ``cls`` again, with the same help and choices and another default
    (a task whose default differs from the shared part's)."""
    metadata = cls.__dataclass_fields__[name].metadata
    return option(default, metadata["help"], metadata.get("choices"))


def defined_in(module: str, name: str) -> Callable[[], tuple[str, ...]]:
    """Choices that are the tuple ``module.name``, read when first needed (``--help``, a
    check), so that this module need not import ``module``."""

    def read() -> tuple[str, ...]:
        return getattr(importlib.import_module(module), name)

    return read


def choices_of(cls: Any, name: str) -> tuple[str, ...] | None:
    """The values field ``name`` of a config class (or instance) takes, as its option
    declares them; None for a field that takes any value of its type."""
    found = cls.__dataclass_fields__[name].metadata.get("choices")
    return found() if callable(found) else found


def choice_words(cls: Any, name: str) -> str:
    """The choices of field ``name`` as words, ``gcn, sage, gat or gin`` (a task's help
    names its models and samplers from the values its config checks)."""
    *rest, last = choices_of(cls, name)
    return f"{', '.join(rest)} or {last}" if rest else last


MASTER_DTYPES = ("float32", "float64")
PRECISIONS = ("none", "bf16", "fp16")
DEVICES = ("auto", "cuda", "cpu")
REDUCE_DTYPES = ("fp32", "bf16", "fp16")


def _at_least(cfg: Any, minimum: int, *keys: str) -> None:
    for key in keys:
        value = getattr(cfg, key)
        if value < minimum:
            raise ConfigError(f"config key '{key}' must be at least {minimum}, got {value}")


#: Ranges of numeric options that some tasks have, by key: (lowest, highest, whether the
#: lowest is allowed, whether the highest is allowed). Every float option must also be finite.
RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "lr": (0.0, math.inf, True, False),
    "min_lr": (0.0, math.inf, True, False),
    "lr_gamma": (0.0, 1.0, False, True),
    "weight_decay": (0.0, math.inf, True, False),
    "beta2": (0.0, 1.0, True, False),
    "grad_clip": (0.0, math.inf, True, False),
    "temperature": (0.0, math.inf, False, False),
    "val_fraction": (0.0, 1.0, True, False),
    "dropout": (0.0, 1.0, True, False),
}


def _interval(low: float, high: float, low_in: bool, high_in: bool) -> str:
    """``[0, 1)``, ``>= 0``, ``> 0``: how an error message shows a range."""
    if math.isinf(high):
        return f"{'>=' if low_in else '>'} {low:g}"
    return f"in {'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"


def check_numbers(cfg: Any) -> None:
    """Reject a non-finite float option (``nan``, ``inf``) and a value outside the range
    :data:`RANGES` gives its key, naming the key."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not isinstance(value, float):
            continue
        if not math.isfinite(value):
            raise ConfigError(f"config key '{f.name}' must be a finite number, got {value}")
        if f.name in RANGES:
            low, high, low_in, high_in = RANGES[f.name]
            above = value > low or (low_in and value == low)
            below = value < high or (high_in and value == high)
            if not (above and below):
                raise ConfigError(
                    f"config key '{f.name}' must be {_interval(*RANGES[f.name])}, got {value:g}"
                )


def one_of(cfg: Any, key: str, allowed: tuple[str, ...]) -> None:
    """ConfigError naming ``key`` unless ``cfg``'s value of it is one of ``allowed``."""
    if getattr(cfg, key) not in allowed:
        raise ConfigError(
            f"config key '{key}' must be one of {', '.join(allowed)}, got {getattr(cfg, key)!r}"
        )


@dataclasses.dataclass
class TrainerConfig:
    """Options every task has: the trainer's, the seed and the precision."""

    out: str = option("runs/run", "run folder: metrics.jsonl, checkpoints/, plots/")
    seed: int = option(0, "seed of the weights and of every random choice")
    dtype: str = option(
        "float32", "master precision of parameters and optimizer state", MASTER_DTYPES
    )
    mixed_precision: str = option(
        "none", "compute precision: none, bf16 or fp16 (parameters and compute in it, masters "
        "in dtype)", PRECISIONS,
    )  # fmt: skip
    eval_every: int = option(10, "evaluate every N epochs or steps (0: only at the end)")
    checkpoint_every: int = option(
        0, "also checkpoint every N epochs or steps (one is always written at the end)"
    )
    keep_checkpoints: int = option(2, "newest checkpoints kept in the run folder (0: all)")
    snapshot_every: int = option(
        0, "also keep the state of every N epochs or steps in node-local shared memory, "
        "copied to a rank on the next node; a restart resumes from it (0: off)"
    )  # fmt: skip
    snapshot_dir: str | None = option(
        None, "where snapshots live (default /dev/shm/gnnpar-snapshots: memory)"
    )
    resume: bool = option(False, "continue from the newest usable checkpoint, on any grid")
    other_data: bool = option(
        False, "with resume: continue a checkpoint trained on other data (fine-tuning; "
        "recorded in metrics.jsonl) instead of refusing it"
    )  # fmt: skip
    overwrite: bool = option(False, "start again in a run folder that holds a run")
    quiet: bool = option(False, "log lines instead of a progress bar")
    tensorboard: bool = option(False, "also write TensorBoard scalars to OUT/tensorboard")
    ranks_per_node: int | None = option(None, "ranks per node (default: the launcher's)")
    device: str = option(
        "auto", "where tensors live: auto (the local rank's GPU with NCCL when there is one, "
        "else the CPU with gloo), cuda or cpu", DEVICES,
    )  # fmt: skip
    skip_nonfinite: int = option(
        0, "steps whose loss is NaN or infinite that are skipped (undone, counted as "
        "skipped_steps in the metrics) before the run stops with an error"
    )  # fmt: skip
    timeout: float | None = option(
        None, "seconds a collective waits for a peer before the run stops with an error "
        "naming it (default: $GNNPAR_TIMEOUT, else 600)"
    )  # fmt: skip

    def check_trainer(self) -> None:
        """Reject trainer values that cannot work, naming the key."""
        one_of(self, "device", DEVICES)
        one_of(self, "dtype", MASTER_DTYPES)
        one_of(self, "mixed_precision", PRECISIONS)
        _at_least(
            self, 0, "eval_every", "checkpoint_every", "keep_checkpoints", "skip_nonfinite",
            "snapshot_every",
        )  # fmt: skip
        if self.ranks_per_node is not None:
            _at_least(self, 1, "ranks_per_node")
        if not 0 <= self.seed < 2**63:  # what every generator (torch, numpy) accepts
            raise ConfigError(f"config key 'seed' must lie in [0, 2**63), got {self.seed}")
        if self.timeout is not None and not self.timeout > 0:
            raise ConfigError(f"config key 'timeout' must be > 0 seconds, got {self.timeout:g}")


@dataclasses.dataclass
class DataParallelConfig:
    """Options of the tasks with a data axis (``sage``, ``gpt``): :mod:`gnnpar.shard`."""

    zero_stage: int | None = option(
        None, "data-axis sharding: 0 all-reduce (DDP), 1 optimizer state, 2 + gradients, "
        "3 + parameters (default: the planner's pick for gpt, 0 for sage)"
    )  # fmt: skip
    fcdp: bool = option(False, "FCDP on stage 3: keep gathered parameters for backward")
    reduce_dtype: str | None = option(
        None, "dtype of the gradient reduction: fp32, bf16 or fp16 (default: fp32 with "
        "mixed precision, else the master dtype)", REDUCE_DTYPES,
    )  # fmt: skip
    grad_accum: int = option(
        1, "micro-batches per step: the batch is split and gradients accumulated"
    )
    reduce_order: str = option(
        "ring", "order of the data axis's gradient sums: ring (the backend's) or tree (a "
        "fixed pairwise tree, the same bytes: the gradient does not depend on the data size "
        "while data x grad_accum stays the same power of two; grad_accum <= 2)",
        defined_in("gnnpar.comm", "ORDERS"),
    )  # fmt: skip
    quantized_weights: bool = option(
        False, "ZeRO++ qwZ (zero_stage 3): parameter all-gathers move int8 blocks of 256 "
        "with a float32 scale each"
    )  # fmt: skip
    quantized_grads: bool = option(
        False, "ZeRO++ qgZ (zero_stage 3): the gradient reduce-scatter is an int4 all-to-all "
        "inside each node, then across nodes (ranks_per_node)"
    )  # fmt: skip
    powersgd_rank: int = option(
        0, "PowerSGD (torch's communication hook: rank-r factors, error feedback) on the "
        "data axis's all-reduce, zero_stage 0 (0: off)"
    )  # fmt: skip
    offload: str = option(
        "none", "where the optimizer's master weights, state and step live (ZeRO stage 1-3): "
        "none (the device), host (host memory) or file (memory-mapped files in offload_dir)",
        defined_in("gnnpar.shard.config", "OFFLOAD_MODES"),
    )  # fmt: skip
    offload_dir: str | None = option(
        None, "folder of offload = file (default OUT/offload; each rank uses rank<R>/ in it, "
        "one left by an ended run is removed)"
    )  # fmt: skip
    prefetch_depth: int = option(
        1, "ZeRO-3: units whose parameter gathers start ahead of the running one (0: none); "
        "with offload, their chunks are read from the tier that many units further ahead"
    )  # fmt: skip

    #: Whether a missing ``zero_stage`` is the planner's choice (gpt) rather than 0.
    planner_picks_stage: ClassVar[bool] = False

    def check_data_parallel(self) -> None:
        """Reject data-parallel values that cannot work, naming the key."""
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(
                f"config key 'zero_stage' must be 0, 1, 2 or 3, got {self.zero_stage}"
            )
        if self.fcdp and self.zero_stage not in (None, 3):
            raise ConfigError(
                "config key 'fcdp' needs zero_stage = 3 (parameters sharded), not "
                f"{self.zero_stage}"
            )
        if self.reduce_dtype is not None:
            one_of(self, "reduce_dtype", REDUCE_DTYPES)
        _at_least(self, 1, "grad_accum")
        from gnnpar.comm import ORDERS
        from gnnpar.shard.config import OFFLOAD_MODES

        one_of(self, "reduce_order", ORDERS)
        # the gpt task's planner takes stage 3 for a quantized run it picks the stage of
        picked = self.zero_stage is None and self.planner_picks_stage
        _at_least(self, 0, "powersgd_rank")
        if self.powersgd_rank and (self.zero_stage or 0) != 0:
            raise ConfigError(
                "config key 'powersgd_rank' compresses zero_stage 0's all-reduce (every rank "
                f"keeps the whole gradient), not stage {self.zero_stage}"
            )
        if self.powersgd_rank and self.reduce_order == "tree":
            raise ConfigError(
                "config key 'powersgd_rank' does not combine with reduce_order = tree"
            )
        for key in ("quantized_weights", "quantized_grads"):
            if getattr(self, key) and self.zero_stage != 3 and not picked:
                raise ConfigError(
                    f"config key '{key}' quantizes ZeRO-3's collectives: it needs "
                    f"zero_stage = 3, not {self.zero_stage}"
                )
            if getattr(self, key) and self.reduce_order == "tree":
                raise ConfigError(
                    f"config key '{key}' does not combine with reduce_order = tree (its "
                    "blocks, and so its rounding, depend on the data size)"
                )
        if self.reduce_order == "tree" and self.grad_accum > 2:
            # a rank's own sum of more micro-batches runs in sequence, not in the tree
            raise ConfigError(
                f"config key 'grad_accum' ({self.grad_accum}) must be 1 or 2 with "
                "reduce_order = tree (a rank's own sum of more micro-batches is no tree)"
            )

        one_of(self, "offload", OFFLOAD_MODES)
        if self.offload != "none" and self.zero_stage == 0:
            raise ConfigError(
                f"config key 'offload' = {self.offload} needs zero_stage 1, 2 or 3 (sharded "
                "optimizer state), not 0"
            )
        if self.offload_dir is not None and self.offload != "file":
            raise ConfigError("config key 'offload_dir' is only used with offload = file")
        _at_least(self, 0, "prefetch_depth")
        if self.prefetch_depth != 1 and self.zero_stage != 3 and not picked:
            raise ConfigError(
                f"config key 'prefetch_depth' sets how far ZeRO-3 gathers ahead: it needs "
                f"zero_stage = 3, not {self.zero_stage}"
            )

    def shard_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`gnnpar.shard.shard` that these options set (the
        stage, the units and the mixed-precision policy are the task's to give)."""
        from gnnpar.shard.config import FCDP

        return {
            "fcdp": FCDP() if self.fcdp else None,
            "offload": self.offload,
            "offload_dir": self.offload_folder(),
            "reduce_order": self.reduce_order,
            "quantized_weights": self.quantized_weights,
            "quantized_grads": self.quantized_grads,
            "powersgd_rank": self.powersgd_rank,
            "prefetch": self.prefetch_depth,
        }

    def offload_folder(self) -> str | None:
        """The folder of the file tier: ``offload_dir``, default ``OUT/offload``."""
        if self.offload != "file":
            return None
        return self.offload_dir or str(Path(self.out) / "offload")


@dataclasses.dataclass
class ScheduleConfig:
    """Learning-rate schedule of every task: a warm-up, then constant, step or cosine.

    The formulas: :mod:`gnnpar.train.schedule`."""

    lr_schedule: str = option(
        "constant", "after the warm-up: constant, step (times lr_gamma every lr_step_every) "
        "or cosine (decay to min_lr at the end)",
        defined_in("gnnpar.train.schedule", "SCHEDULES"),
    )  # fmt: skip
    warmup: int = option(0, "linear warm-up epochs or steps (0: none)")
    min_lr: float = option(0.0, "learning rate at the end of the cosine decay")
    lr_step_every: int = option(10, "step schedule: epochs or steps between decays")
    lr_gamma: float = option(0.5, "step schedule: factor of each decay, in (0, 1]")

    def check_schedule(self) -> None:
        """Reject schedule values that cannot work, naming the key."""
        from gnnpar.train.schedule import SCHEDULES

        one_of(self, "lr_schedule", SCHEDULES)
        _at_least(self, 0, "warmup")
        _at_least(self, 1, "lr_step_every")
        lr = getattr(self, "lr", None)
        if self.lr_schedule == "cosine" and lr is not None and self.min_lr > lr:
            raise ConfigError(
                f"config key 'min_lr' ({self.min_lr:g}) must not exceed 'lr' ({lr:g}) for the "
                "cosine schedule"
            )


@dataclasses.dataclass
class SelectionConfig:
    """Best-validation model selection (gcn, sage): the best model is kept and reported."""

    early_stop: int = option(
        0, "stop after N evaluations without a better validation metric (0: never)"
    )

    def check_selection(self) -> None:
        """Reject selection values that cannot work, naming the key."""
        _at_least(self, 0, "early_stop")


@dataclasses.dataclass
class RecomputeConfig:
    """Activation checkpointing (gcn, gpt): :mod:`gnnpar.recompute`."""

    activation_checkpointing: str = option(
        "none", "recompute activations in backward instead of keeping them: none, full "
        "(each layer or block again from its input) or selective (gpt: the attention core)",
        defined_in("gnnpar.recompute", "MODES"),
    )  # fmt: skip

    def check_recompute(self, allowed: tuple[str, ...]) -> None:
        """Reject a mode that is not one of ``allowed`` (the task's), naming the key."""
        one_of(self, "activation_checkpointing", allowed)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of an annotation such as ``int``, ``str | None``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported config annotation {tp}")
        return args[0], True
    return tp, False


def _coerce(key: str, value: Any, tp: Any) -> Any:
    base, optional = _base_type(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"config key '{key}' must be a {base.__name__}, got nothing")
    if base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return _to_float(key, value)
    elif base is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported config type {base}")
    raise ConfigError(
        f"config key '{key}' must be a {base.__name__}, got {type(value).__name__} {value!r}"
    )


def _to_float(key: str, value: float) -> float:
    try:
        return float(value)
    except OverflowError:
        raise ConfigError(f"config key '{key}' is too large for a float: {value}") from None


def from_mapping(cls: type, values: dict[str, Any], where: str = "config") -> Any:
    """An instance of ``cls`` from ``values``; unknown keys and wrong types are errors."""
    types_ = _field_types(cls)
    unknown = sorted(set(values) - set(types_))
    if unknown:
        raise UnknownKeyError(
            f"unknown key '{unknown[0]}' in {where}; known keys: {', '.join(sorted(types_))}"
        )
    out = {k: _coerce(k, v, types_[k]) for k, v in values.items()}
    obj = cls(**out)
    check_numbers(obj)
    check = getattr(obj, "check", None)
    if check is not None:
        check()
    return obj


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file into a flat dict (a single top-level table named like the task, e.g.
    ``[gcn]``, is also accepted)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    tables = [k for k, v in data.items() if isinstance(v, dict)]
    if len(tables) == 1 and len(data) == 1:
        data = data[tables[0]]
    return data


def _owner(cls: type, name: str) -> type:
    """The most basic dataclass in ``cls``'s hierarchy that declares field ``name``."""
    owner = cls
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}) and dataclasses.is_dataclass(klass):
            owner = klass
    return owner


def with_default(help_text: str, default: Any) -> str:
    """A flag's help with its default, said once: ``"hidden width (default: 16)"``. Nothing
    is added for a ``None`` default or a help that already says what its default is
    (``"grid such as x=2 (default: the planner's)"``)."""
    if default is None or "(default" in help_text:
        return help_text
    return f"{help_text} (default: {default})"


#: A Sphinx role (:class:, :py:func:, ...) with its target; an inline literal.
_ROLE = re.compile(r":(?:[a-z]+:)+`([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``")


def _role_text(match: re.Match[str]) -> str:
    target = match.group(1)
    if "<" in target:  # :ref:`title <target>`
        return target.split("<")[0].strip()
    return target[1:].rsplit(".", 1)[-1] if target.startswith("~") else target


def plain_text(text: str) -> str:
    """A docstring's text as a terminal should show it: a Sphinx role (:class:, :func:, ...)
    becomes its target (only the last name after a ``~``), an inline literal its text."""
    return _LITERAL.sub(r"\1", _ROLE.sub(_role_text, text))


def _group_title(klass: type) -> str:
    """A config part's ``--help`` title: its docstring's first line, as plain text, without
    a closing pointer to a module's documentation (``: :mod:`gnnpar.shard```)."""
    line = (klass.__doc__ or klass.__name__).split("\n")[0].rstrip(".")
    return plain_text(re.sub(r":\s*:mod:`[^`]+`$", "", line))


def add_flags(
    parser: argparse.ArgumentParser, cls: type, only: Iterable[str] | None = None
) -> None:
    """Add one flag per field of ``cls`` (default ``None``: unset flags do not override),
    in one ``--help`` group per part of the config, titled by its docstring (the task's own
    fields first); a field with choices shows them as its metavar (``{gcn,sage}``). ``only``
    names the fields to add (``gnnpar plan`` takes a few of a task's, spelled alike)."""
    groups: dict[type, Any] = {}
    wanted = None if only is None else set(only)
    fields = [f for f in dataclasses.fields(cls) if wanted is None or f.name in wanted]
    owners = {f.name: _owner(cls, f.name) for f in fields}
    for klass in [cls, *dict.fromkeys(o for o in owners.values() if o is not cls)]:
        groups[klass] = parser.add_argument_group(_group_title(klass))
    hints = _field_types(cls)  # once: resolving the annotations is most of the parser's time
    for f in fields:
        base, _ = _base_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = with_default(plain_text(f.metadata.get("help", "")), default)
        choices = choices_of(cls, f.name)
        group = groups[owners[f.name]]
        if base is bool:
            group.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                # None: unset flags do not override; it also keeps argparse from adding a
                # "(default: ...)" of its own (Python 3.10's BooleanOptionalAction does)
                default=None,
                help=help_text,
            )
        else:
            group.add_argument(
                flag,
                dest=f.name,
                type=base,
                default=None,
                # not argparse's choices=: the config's check refuses another value, naming
                # the key, alike for a flag and a --config file
                metavar="{" + ",".join(choices) + "}" if choices else base.__name__.upper(),
                help=help_text,
            )


def resolve(cls: type, args: argparse.Namespace, config_file: str | None) -> Any:
    """Defaults ← TOML file ← flags, as an instance of ``cls``."""
    values: dict[str, Any] = {}
    if config_file:
        values.update(load_toml(config_file))
        # validate the file on its own first, so its errors name the file
        where = f"config file {config_file}"
        try:
            from_mapping(cls, dict(values), where=where)
        except UnknownKeyError:
            raise  # it names the file already
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
    for f in dataclasses.fields(cls):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return from_mapping(cls, values)


def to_toml(obj: Any, table: str | None = None) -> str:
    """The configuration as TOML text (what ``--print-config`` shows), under ``[table]``
    when given (what a run folder's ``config.toml`` holds: the task's name as the table)."""
    lines = [f"[{table}]"] if table else []
    for k, v in dataclasses.asdict(obj).items():
        if v is None:
            lines.append(f"# {k} = (unset)")
        elif isinstance(v, bool):
            lines.append(f"{k} = {'true' if v else 'false'}")
        elif isinstance(v, str):
            # a JSON string is a TOML basic string (quotes, backslashes, controls escaped)
            lines.append(f"{k} = {json.dumps(v, ensure_ascii=False)}")
        else:
            lines.append(f"{k} = {v}")
    return "\n".join(lines) + "\n"


#: The file of a run folder that holds the run's resolved configuration.
RUN_CONFIG = "config.toml"


def write_run_config(out: str | Path, task: str, cfg: Any) -> None:
    """Write ``out/config.toml``: ``cfg`` under a ``[task]`` table, atomically (rank 0).
    ``gnnpar train TASK --config`` reads it back, and so do evaluate and predict."""
    from gnnpar.atomic import atomic_write

    text = to_toml(cfg, table=task)
    atomic_write(Path(out) / RUN_CONFIG, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def read_run_config(out: str | Path, tasks: dict[str, type]) -> tuple[str, Any]:
    """The task name and the config of the run in folder ``out`` (its ``config.toml``, as
    :func:`write_run_config` wrote it), checked like any config. ``tasks``: config class by
    task name. ConfigError naming the folder or the file otherwise."""
    folder = Path(out)
    path = folder / RUN_CONFIG
    if not folder.is_dir():
        raise ConfigError(f"run folder {folder} does not exist")
    if not path.is_file():
        raise ConfigError(f"{folder} holds no run: it has no {RUN_CONFIG}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None
    names = list(data)
    if len(names) != 1 or names[0] not in tasks or not isinstance(data[names[0]], dict):
        raise ConfigError(f"{path} must hold one table named after its task ({', '.join(tasks)})")
    task = names[0]
    return task, from_mapping(tasks[task], data[task], where=f"config file {path}")
