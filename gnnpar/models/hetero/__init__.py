"""Typed (heterogeneous) GNNs on message-flow blocks (:mod:`gnnpar.graph.typed` graphs):

- :class:`TypedInput` (:mod:`.input`): per node type a linear of its features, or an
  embedding per node for a featureless type;
- :class:`RGCNConv` (:mod:`.rgcn`) and :class:`HGTConv` (:mod:`.hgt`): PyG's layers of the
  same names on a typed block (equal outputs with the same parameters);
- :class:`TypedGNN` (:mod:`.model`): input, typed layers, classifier;
- :class:`TypedBlock` (:mod:`.index`): a block's nodes by type and edges by relation, built
  once per block for its layers; :class:`~gnnpar.graph.typed.TypeSchema`: what the models
  read of a graph's types.
"""

from gnnpar.graph.typed import TypeSchema
from gnnpar.models.hetero.hgt import HGTConv
from gnnpar.models.hetero.index import RelationCSR, TypedBlock, TypeGroups
from gnnpar.models.hetero.input import TypedInput
from gnnpar.models.hetero.model import TypedGNN, is_unit
from gnnpar.models.hetero.rgcn import RGCNConv

__all__ = [
    "HGTConv",
    "RGCNConv",
    "RelationCSR",
    "TypeGroups",
    "TypeSchema",
    "TypedBlock",
    "TypedGNN",
    "TypedInput",
    "is_unit",
]
