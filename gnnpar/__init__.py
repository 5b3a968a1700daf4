"""gnnpar: distributed training for graph neural networks on huge graphs and for transformers
too big for one device, on torch.distributed."""

from gnnpar import comm
from gnnpar.grid import ProcessGrid, init, release, reshape, shutdown

__all__ = ["ProcessGrid", "comm", "init", "release", "reshape", "shutdown"]
__version__ = "0.1.0"
