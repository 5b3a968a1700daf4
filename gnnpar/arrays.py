"""A numpy view of an array-like (numpy, torch or a sequence), with torch optional: the one
conversion the partitioners and the chunked graph reader share."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["to_numpy"]


def to_numpy(x: Any) -> np.ndarray:
    """A numpy view of ``x`` (torch tensors on CPU are shared, not copied).

    ``bfloat16`` tensors have no numpy dtype: they come back as their ``int16`` bit pattern
    viewed as ``uint16`` (callers that store them record the real dtype).
    """
    if isinstance(x, np.ndarray):
        return x
    try:
        import torch
    except ImportError:  # torch is optional for this package
        torch = None
    if torch is not None and isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(np.uint16)
        return t.contiguous().numpy()
    return np.asarray(x)
