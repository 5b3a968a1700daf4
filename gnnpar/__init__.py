"""gnnpar: distributed training for graph neural networks on huge graphs and for transformers
too big for one device, on torch.distributed.

The grid and the collectives are imported on first use (``gnnpar.init``, ``gnnpar.comm``),
so the torch-free parts (the verified-folder toolkit that :mod:`partitioners` writes its
format with) import without torch."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ProcessGrid", "comm", "init", "release", "reshape", "shutdown"]
__version__ = "0.1.0"

#: The public names and the module each comes from.
_LAZY = {
    "ProcessGrid": "gnnpar.grid",
    "init": "gnnpar.grid",
    "release": "gnnpar.grid",
    "reshape": "gnnpar.grid",
    "shutdown": "gnnpar.grid",
    "comm": "gnnpar.comm",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'gnnpar' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    return module if name == "comm" else getattr(module, name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
