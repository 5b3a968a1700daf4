"""Sparse-dense matmuls: the local kernel and the distributed 1D, 2D and 3D algorithms."""

from gnnpar.sparse.csr import CSRBlock
from gnnpar.sparse.kernels import LocalSpMM, spmm
from gnnpar.sparse.layout import Layout3D, layout3d, roles
from gnnpar.sparse.parallel import Parallel3DGNN, parallelize_fullgraph
from gnnpar.sparse.source import MemorySource, make_permutations

__all__ = [
    "CSRBlock",
    "LocalSpMM",
    "Layout3D",
    "MemorySource",
    "Parallel3DGNN",
    "layout3d",
    "parallelize_fullgraph",
    "make_permutations",
    "roles",
    "spmm",
]
