"""Local sparse-dense kernels: CSR blocks, the one local SpMM (autotuned variants), graph
attention's local pieces, and where a rank's CSR blocks come from (:mod:`~gnnpar.sparse.source`).

The distributed full-graph layers built on them (1D, 2D, 3D) belong to the full-graph
workload, :mod:`gnnpar.models.fullgraph`.
"""

from gnnpar.sparse.csr import CSRBlock
from gnnpar.sparse.kernels import LocalSpMM, spmm
from gnnpar.sparse.source import MemorySource, make_permutations

__all__ = ["CSRBlock", "LocalSpMM", "MemorySource", "make_permutations", "spmm"]
