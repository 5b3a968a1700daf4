"""Sharded data parallelism: bucketed gradient sync, ZeRO-1/2/3 and the FCDP cache.

Public surface::

    from gnnpar.shard import shard, by_type, MixedPrecision, FCDP
    dp = shard(model, grid, stage=3, units=by_type(Block))     # in place; returns a handle
    opt = dp.attach(torch.optim.AdamW(dp.parameters(), lr=1e-3))
    loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    with dp.no_sync(): ...                                     # gradient accumulation
    save_checkpoint(dir, dp, opt, step)                        # per-rank shards
    load_checkpoint(latest_checkpoint(dir), dp, opt)           # any data size or stage
    full = consolidate(folder)                                 # one plain state dict, offline

See :mod:`gnnpar.shard.api` for the stages, :mod:`gnnpar.shard.zero3` for stage 3 and FCDP,
:mod:`gnnpar.shard.checkpoint` for the checkpoint format.
"""

from gnnpar.shard.api import ShardedModel, by_numel, by_type, shard
from gnnpar.shard.checkpoint import (
    consolidate,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
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
    "consolidate",
    "latest_checkpoint",
    "load_checkpoint",
    "node_groups",
    "save_checkpoint",
    "shard",
]
