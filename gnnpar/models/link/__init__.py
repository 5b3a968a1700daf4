"""Link prediction: an encoder embeds the nodes, a decoder scores node pairs
(:mod:`~gnnpar.models.link.task`, ``gnnpar train link``).

- :mod:`~gnnpar.models.link.decoders`: dot, MLP and DistMult decoders; BCE and margin losses;
- :mod:`~gnnpar.models.link.encoders`: the PyG encoder of full-graph training and
  :class:`~gnnpar.models.link.encoders.LinkModel` (encoder + decoder as one module);
- :mod:`~gnnpar.models.link.task`: the task (mini-batch on edge batches, or full graph on the
  x × y × z grid) and its config.

The edge split is :mod:`gnnpar.graph.edge_split`; edge batches and negatives are
:mod:`gnnpar.sampling.edge` and :mod:`gnnpar.sampling.negative`; the scores
:func:`gnnpar.train.metrics.link_scores`.
"""
