"""Dense tensor parallelism for transformers (AxoNN's 3D algorithm), composed with data
parallelism into a 4D grid.

Public surface::

    from gnnpar import tensor
    model = tensor.parallelize(GPT(cfg), grid)        # in place; plain model in, parallel out
    logits = model(ids)                                # logits split over the vocabulary
    loss = tensor.cross_entropy(logits, targets, model.lm_head)
    loss.backward()
    tensor.sync_gradients(model, grid)                 # data (and z) axis reduction
    tensor.clip_grad_norm_(model, 1.0, grid)
    full = tensor.full_state_dict(model, grid)         # loads into the plain model
    result = tensor.train_gpt(tensor.GPTTrainConfig(grid="data=2,x=2"))  # a whole run

Layers (:class:`Linear`, :class:`Embedding`) can also be used directly, in easy or expert
mode; :class:`ShardLayout` says where every piece of a parameter lives.
"""

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
    clip_grad_norm_,
    full_state_dict,
    gather_full,
    grad_norm,
    load_full_state_dict,
    local_numel,
    sharded_parameters,
    sync_gradients,
)
from gnnpar.tensor.train import GPTTrainConfig, train_gpt

__all__ = [
    "Chain",
    "Embedding",
    "GPTTrainConfig",
    "LayerStyle",
    "Linear",
    "Plan",
    "PrefetchChain",
    "ShardLayout",
    "ShardedModule",
    "clip_grad_norm_",
    "cross_entropy",
    "full_state_dict",
    "gather_full",
    "grad_norm",
    "load_full_state_dict",
    "local_numel",
    "parallelize",
    "plan_styles",
    "sharded_parameters",
    "sync_gradients",
    "train_gpt",
    "vocab_parallel_cross_entropy",
]
