"""Layer pieces every workload's models share: counter-based dropout (:mod:`~gnnpar.nn.dropout`).

The models themselves live with their workload, in :mod:`gnnpar.models`.
"""
