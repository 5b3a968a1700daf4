"""Sharded data parallelism: bucketed gradient sync, ZeRO-1/2/3 and the FCDP cache.

Public surface::

    from gnnpar.shard import shard, by_type, MixedPrecision, FCDP
    dp = shard(model, grid, stage=3, units=by_type(Block))     # in place; returns a handle
    opt = dp.attach(torch.optim.AdamW(dp.parameters(), lr=1e-3))
    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    with dp.no_sync(): ...                                     # gradient accumulation
    checkpoint.save(dir, step, grid, dp, opt)                  # gnnpar.checkpoint: any grid,
    checkpoint.load(dir, grid, dp, opt)                        # any data size or stage

See :mod:`gnnpar.shard.api` for the stages, :mod:`gnnpar.shard.zero3` for stage 3 and FCDP;
checkpoints of a :class:`ShardedModel` go through :mod:`gnnpar.checkpoint` like every other.
"""

from gnnpar.shard.api import ShardedModel, by_numel, by_type, shard
from gnnpar.shard.config import FCDP, STAGES, MixedPrecision
from gnnpar.shard.groups import INTER, INTRA, NodeGroups, node_groups

__all__ = [
    "FCDP",
    "INTER",
    "INTRA",
    "STAGES",
    "MixedPrecision",
    "NodeGroups",
    "ShardedModel",
    "by_numel",
    "by_type",
    "node_groups",
    "shard",
]
