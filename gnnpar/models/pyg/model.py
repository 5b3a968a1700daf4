"""What a user's PyG model may hold, and how its modules get their parallel forward.

:func:`check_model` refuses, in one line naming the class, where it sits and what is
supported, any module that cannot run on a graph share; :func:`install_forwards` gives each
supported convolution and norm its parallel forward (:mod:`.layers`) in place, as an
instance attribute, so its parameters, its ``state_dict`` keys and its class are untouched,
and :func:`remove_forwards` takes them away again. :func:`build_user_model` makes a model
from the ``module:factory`` the command line names.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gnnpar.errors import UserError
from gnnpar.models.pyg.layers import (
    forwards,
    graph_layer_norm,
    operators_of,
    pyg_nn,
    refusal,
    unused_parameters,
)


def _row_wise() -> tuple[type, ...]:
    """Modules that run as they are on a rank's node rows (no communication)."""
    geo = pyg_nn()
    return (
        nn.Linear, geo.Linear, nn.LayerNorm, nn.Dropout, nn.Identity, nn.Sequential,
        nn.ModuleList, nn.ModuleDict, geo.BatchNorm, geo.JumpingKnowledge, geo.MLP,
        nn.ReLU, nn.ELU, nn.GELU, nn.LeakyReLU, nn.PReLU, nn.SiLU, nn.Tanh, nn.Sigmoid,
        nn.Softplus, nn.LogSoftmax, nn.Softmax,
    )  # fmt: skip


#: What :func:`parallelize_pyg` takes, by name (for the refusal of anything else).
SUPPORTED = (
    "GCNConv", "SAGEConv (mean, max)", "GATConv", "GATv2Conv", "GINConv", "SGConv", "APPNP",
    "GCN2Conv", "RGCNConv (mean; bases or blocks)",
    "RGATConv (additive, across relations; bases)", "Linear", "BatchNorm / BatchNorm1d",
    "LayerNorm (graph, node)", "MLP", "JumpingKnowledge (cat, max, lstm)", "Dropout",
    "activations", "Sequential / ModuleList",
)  # fmt: skip


def _own_class(module: nn.Module) -> bool:
    """A class of the user's (not torch's nor PyG's): a container whose forward is theirs."""
    root = type(module).__module__.split(".")[0]
    return root not in ("torch", "torch_geometric")


def _allowed_inside(parent: nn.Module | None, module: nn.Module) -> bool:
    """The LSTM and attention of ``JumpingKnowledge(mode="lstm")`` work per node."""
    jk = pyg_nn().JumpingKnowledge
    return isinstance(parent, jk) and isinstance(module, (nn.LSTM, nn.Linear))


def check_model(model: nn.Module) -> None:
    """Every module of ``model`` is supported (:data:`SUPPORTED`, or a class of the user's
    own), with options that can run: otherwise one UserError naming the class, where it
    sits in the model and what is supported."""
    if not isinstance(model, nn.Module):
        raise UserError(f"the model must be a torch.nn.Module, got {type(model).__name__}")
    _check_tree(model, "", None)


def _check_tree(module: nn.Module, path: str, parent: nn.Module | None) -> None:
    where = f"'{path}'" if path else "the model itself"
    geo, parallel = pyg_nn(), forwards()
    if isinstance(module, geo.MessagePassing) and type(module) not in parallel:
        raise UserError(
            f"{type(module).__name__} at {where} is a message-passing layer gnnpar has no "
            f"parallel form of; supported: {', '.join(SUPPORTED)}"
        )
    known = isinstance(module, (*parallel, *_row_wise(), geo.LayerNorm))
    if not known and not _own_class(module) and not _allowed_inside(parent, module):
        raise UserError(
            f"{type(module).__name__} at {where} is not supported by parallelize_pyg; "
            f"supported: {', '.join(SUPPORTED)}"
        )
    why = refusal(module)
    if why is not None:
        raise UserError(f"{why}: not supported by parallelize_pyg (at {where})")
    if isinstance(module, geo.MessagePassing):
        # a convolution's own parts run inside its parallel forward; GINConv's MLP is the user's
        children = [("nn", module.nn)] if isinstance(module, geo.GINConv) else []
    else:
        children = list(module.named_children())
    for name, child in children:
        _check_tree(child, f"{path}.{name}" if path else name, module)


def typed_model(model: nn.Module) -> bool:
    """Whether ``model`` reads a typed graph's relations (it holds an RGCNConv or an
    RGATConv): it is called as ``model(x, edge_index, edge_type)``."""
    geo = pyg_nn()
    return any(isinstance(m, (geo.RGCNConv, geo.RGATConv)) for m in model.modules())


def gradient_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of ``model`` a forward gives a gradient (those a parallel
    run sums over the grid): every one but those a layer never reads
    (:func:`~gnnpar.models.pyg.layers.unused_parameters`)."""
    unused = set()
    for module in model.modules():
        for name in unused_parameters(module):
            unused.add(id(getattr(module, name)))
    return [p for p in model.parameters() if p.requires_grad and id(p) not in unused]


def install_forwards(model: nn.Module, share: Any) -> list[str]:
    """Give every supported convolution and norm of ``model`` its parallel forward on
    ``share`` (checked first, :func:`check_model`); returns the adjacency values the
    convolutions read (:data:`~gnnpar.models.fullgraph.share.OPERATORS`)."""
    check_model(model)
    kinds: list[str] = []
    parallel, layer_norm = forwards(), pyg_nn().LayerNorm
    for module in model.modules():
        forward = parallel.get(type(module))
        if isinstance(module, layer_norm) and module.mode == "graph":
            forward = graph_layer_norm
        if forward is None:
            continue
        kinds += [k for k in operators_of(module) if k not in kinds]
        module._gnnpar_share = share
        module.forward = forward.__get__(module)
    return kinds


def remove_forwards(model: nn.Module) -> None:
    """Undo :func:`install_forwards`: every module runs its class's own forward again."""
    for module in model.modules():
        if "_gnnpar_share" in module.__dict__:
            del module._gnnpar_share
            module.__dict__.pop("forward", None)


@contextmanager
def parallel_forwards(model: nn.Module, share: Any) -> Iterator[list[str]]:
    """:func:`install_forwards` for the duration of a ``with`` block."""
    try:
        yield install_forwards(model, share)
    finally:
        remove_forwards(model)


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """torch's generators (the host's, and ``device``'s if a GPU) seeded with ``seed`` for a
    ``with`` block and restored after: a user model's dropout masks are then a function of
    the seed (the same step draws the same masks after a resume)."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


# --------------------------------------------------------------------------- factories
def is_user_model(model: str) -> bool:
    """Whether a task's ``model`` names a user's factory (``module:factory``)."""
    return ":" in model


def check_model_option(model: str, builtin: tuple[str, ...], options: str | None) -> None:
    """A task's ``model`` is one of its ``builtin`` names or a ``module:factory`` whose
    ``model_options`` (only for those) parse: ConfigError naming the key otherwise."""
    from gnnpar.train.config import ConfigError

    if model not in builtin and not is_user_model(model):
        raise ConfigError(
            f"config key 'model' must be one of {', '.join(builtin)} or module:factory, "
            f"got {model!r}"
        )
    if not is_user_model(model):
        if options:
            raise ConfigError(
                "config key 'model_options' is for a module:factory model; the built-in "
                "models take their own keys (hidden, layers, heads...)"
            )
        return
    try:
        factory_options(options)
    except UserError as err:
        raise ConfigError(f"config key 'model_options': {err}") from None


def factory_options(text: str | None) -> dict[str, Any]:
    """A factory's keyword arguments from ``model_options`` (``k=v,k=v``)."""
    from gnnpar.data.options import parse_options, split_options

    return parse_options(split_options(text))


def load_factory(target: str) -> Callable[..., nn.Module]:
    """The function ``module:factory`` names (``module`` importable, or a ``.py`` file),
    one UserError otherwise."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"model {target!r}: give module:factory (e.g. mymodels:appnp)")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise UserError(f"model {target!r}: no file {path}")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"model {target!r}: cannot import {module_name} ({err})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"model {target!r}: {module_name} has no function {attr!r}")
    return factory


def factory_takes_relations(target: str) -> bool:
    """Whether the factory ``target`` names takes ``num_relations``: its model reads a typed
    graph's relations (an R-GCN or an RGAT), on shards of one adjacency per relation."""
    try:
        params = inspect.signature(load_factory(target)).parameters
    except (TypeError, ValueError):  # a callable without a signature
        return False
    return "num_relations" in params


def build_user_model(
    target: str,
    in_channels: int,
    out_channels: int,
    options: dict[str, Any],
    num_relations: int | None = None,
) -> nn.Module:
    """``factory(in_channels=..., out_channels=..., **options)`` of ``target``, checked
    (:func:`check_model`); one UserError naming the target if the call fails. A factory
    that takes ``num_relations`` (:func:`factory_takes_relations`) is given the graph's
    ``num_relations``; a UserError when the graph has none."""
    factory = load_factory(target)
    if factory_takes_relations(target):
        if not num_relations:
            raise UserError(
                f"model {target!r} reads a typed graph's relations (its factory takes "
                "num_relations), and the dataset has none"
            )
        options = {**options, "num_relations": num_relations}
    try:
        model = factory(in_channels=in_channels, out_channels=out_channels, **options)
    except TypeError as err:
        raise UserError(f"model {target!r}: {err}") from None
    check_model(model)
    return model
