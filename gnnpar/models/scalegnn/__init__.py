"""ScaleGNN's 4D mini-batch workload (``gnnpar train sage --sampler vertex``): uniform vertex
samples trained with the full-graph 3D layers and data parallelism (:mod:`.task`)."""
