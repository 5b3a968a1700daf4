"""The link workload's encoders: a model that maps a graph to one embedding per node.

Mini-batch training uses the block models of :mod:`gnnpar.models.minibatch.model`
(:class:`~gnnpar.models.minibatch.model.BlockGNN`), full-graph training a plain PyG model
(:class:`PyGEncoder`, or the user's own), which :func:`~gnnpar.models.fullgraph.pyg.parallelize_pyg`
puts on the x × y × z grid. :class:`LinkModel` holds an encoder and a decoder as one module,
so data parallelism, ZeRO and checkpoints see one model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gnnpar.errors import UserError

__all__ = ["ENCODERS", "FULL_TYPED_ENCODERS", "TYPED_ENCODERS", "LinkModel", "PyGEncoder"]

#: The built-in encoders (a ``module:factory`` names the user's own PyG model); ``rgcn`` and
#: ``hgt`` encode a typed graph (:mod:`gnnpar.models.hetero` in minibatch mode; ``rgcn``
#: also full-graph, as PyG ``RGCNConv`` layers).
ENCODERS = ("sage", "gcn", "gat", "rgcn", "hgt")
#: The encoders of typed graphs.
TYPED_ENCODERS = ("rgcn", "hgt")
#: The typed encoders that train full-graph too.
FULL_TYPED_ENCODERS = ("rgcn",)


class PyGEncoder(nn.Module):
    """A stack of PyG convolutions (``GCNConv``, ``SAGEConv``, ``GATConv``, or on a typed
    graph ``RGCNConv`` with ``num_relations``): dropout, convolution, ReLU (none after the
    last), as :class:`~gnnpar.models.minibatch.model.BlockGNN`. An R-GCN's ``forward`` takes
    the edge types too."""

    def __init__(
        self, kind: str, in_channels: int, hidden: int, out_channels: int, layers: int = 2,
        dropout: float = 0.0, heads: int = 4, num_relations: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        from torch_geometric.nn import GATConv, GCNConv, RGCNConv, SAGEConv

        if kind not in ENCODERS or (kind in TYPED_ENCODERS and kind not in FULL_TYPED_ENCODERS):
            raise UserError(f"no full-graph PyG encoder {kind!r}: one of sage, gcn, gat, rgcn")
        if (kind == "rgcn") != (num_relations is not None):
            raise UserError("an rgcn encoder needs num_relations (and only an rgcn encoder)")
        dims = [in_channels] + [hidden] * (layers - 1) + [out_channels]
        convs: list[nn.Module] = []
        for i in range(layers):
            last = i == layers - 1
            if kind == "rgcn":
                convs.append(RGCNConv(dims[i], dims[i + 1], num_relations))
            elif kind == "gcn":
                convs.append(GCNConv(dims[i], dims[i + 1]))
            elif kind == "sage":
                convs.append(SAGEConv(dims[i], dims[i + 1]))
            else:
                h = 1 if last else heads
                if dims[i + 1] % h:
                    raise UserError(f"GAT width {dims[i + 1]} is not divisible by {h} heads")
                convs.append(GATConv(dims[i], dims[i + 1] // h, heads=h))
        self.convs = nn.ModuleList(convs)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, edge_index: Any, edge_type: Any = None) -> torch.Tensor:
        """Every node's embedding (this rank's rows, when parallelized); ``edge_type``: an
        R-GCN's relation of each edge."""
        for i, conv in enumerate(self.convs):
            x = F.dropout(x, self.dropout, self.training)
            x = conv(x, edge_index) if edge_type is None else conv(x, edge_index, edge_type)
            if i < len(self.convs) - 1:
                x = torch.relu(x)
        return x


class LinkModel(nn.Module):
    """An encoder and a decoder as one module, so that data parallelism, ZeRO-3's gathers
    (every call enters through the root module) and checkpoints see one model.

    ``model(*inputs)`` is the encoder's output; ``model(*inputs, src=, dst=)`` scores pairs
    of its rows: ``src`` (b,) against ``dst`` (b, m), giving (b, m) scores; with
    ``embeddings=h`` the encoder is skipped and ``h``'s rows are scored."""

    def __init__(self, encoder: nn.Module, decoder: nn.Module) -> None:
        super().__init__()
        self.encoder, self.decoder = encoder, decoder

    def forward(
        self,
        *inputs: Any,
        src: torch.Tensor | None = None,
        dst: torch.Tensor | None = None,
        embeddings: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The encoder's output, or the scores of the pairs ``(src[i], dst[i, j])``."""
        h = self.encoder(*inputs, **kwargs) if embeddings is None else embeddings
        if src is None or dst is None:
            return h
        src, dst = src.to(h.device), dst.to(h.device)  # ids may come from the host
        return self.decoder(h.index_select(0, src)[:, None, :], h[dst])

    def prepare(self, batch: Any) -> Any:
        """The encoder's preparation of a sampled batch (a loader's ``prepare``, run in its
        prefetch thread: a block encoder's operators), or None."""
        prepare = getattr(self.encoder, "prepare", None)
        return None if prepare is None else prepare(batch)

    @property
    def num_layers(self) -> int:
        """The encoder's layers (for layer-wise inference of a block encoder)."""
        return self.encoder.num_layers

    def forward_layer(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One layer of a block encoder (layer-wise inference)."""
        return self.encoder.forward_layer(*args, **kwargs)
