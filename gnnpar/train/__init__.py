"""Training: config, loop, checkpoints, metrics and the tasks; :func:`fit` trains a graph
held in a Python script."""

from gnnpar.train.fit import fit

__all__ = ["fit"]
