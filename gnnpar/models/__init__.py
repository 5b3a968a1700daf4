"""One package per workload: its plain model(s), its parallel form, its task and its train
spec (``spec.py``, listed by :mod:`gnnpar.train.spec`).

- :mod:`gnnpar.models.fullgraph`: full-graph GCN / GraphSAGE / GAT / GIN on 1D, 2D and 3D grids;
- :mod:`gnnpar.models.minibatch`: mini-batch GNNs on sampled blocks, one part per data rank;
- :mod:`gnnpar.models.scalegnn`: ScaleGNN's vertex sampling on the 3D full-graph layers;
- :mod:`gnnpar.models.gpt`: GPT (ours or Hugging Face GPT-2) on data × pipe × context × 3D.

A workload imports the engines (:mod:`gnnpar.sparse`, :mod:`gnnpar.tensor`,
:mod:`gnnpar.shard`, ...) and :mod:`gnnpar.train`; none of them imports a workload.
"""
