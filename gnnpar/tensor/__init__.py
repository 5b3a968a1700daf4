"""Dense tensor parallelism for transformers (AxoNN's 3D algorithm), composed with data
parallelism into a 4D grid.

Public surface::

    from gnnpar import tensor
    model = tensor.parallelize(GPT(cfg), grid)        # in place; plain model in, parallel out
    logits = model(ids)                                # logits split over the vocabulary
    dp = gnnpar.shard.shard(model, grid, stage=0)      # the data (and z) axis reduction
    loss = tensor.cross_entropy(logits, targets, model.lm_head)
    loss.backward()                                    # gradients reduced during backward
    dp.clip_grad_norm_(1.0)
    full = tensor.full_state_dict(model, grid)         # loads into the plain model

    with torch.device("meta"):                          # deferred: no full model anywhere
        model = GPT(cfg)
    torch.manual_seed(seed)
    tensor.parallelize(model, grid)    # only this rank's pieces, = GPT(cfg) sliced, bit for bit

A whole GPT run is ``gnnpar train gpt`` (:mod:`gnnpar.models.gpt.task`).

Layers (:class:`Linear`, :class:`Embedding`) can also be used directly, in easy or expert
mode; :class:`ShardLayout` says where every piece of a parameter lives.
"""

from gnnpar.tensor.deferred import InitProgram, record_init
from gnnpar.tensor.layers import (
    Embedding,
    Linear,
    PrefetchChain,
    ShardedModule,
    cross_entropy,
    vocab_parallel_cross_entropy,
)
from gnnpar.tensor.layout import ShardLayout
from gnnpar.tensor.parallelize import Chain, LayerStyle, Plan, parallelize, plan_styles
from gnnpar.tensor.state import (
    full_state_dict,
    gather_full,
    load_full_state_dict,
    local_numel,
    sharded_parameters,
)

__all__ = [
    "Chain",
    "Embedding",
    "InitProgram",
    "LayerStyle",
    "Linear",
    "Plan",
    "PrefetchChain",
    "ShardLayout",
    "ShardedModule",
    "cross_entropy",
    "full_state_dict",
    "gather_full",
    "load_full_state_dict",
    "local_numel",
    "parallelize",
    "plan_styles",
    "record_init",
    "sharded_parameters",
    "vocab_parallel_cross_entropy",
]
