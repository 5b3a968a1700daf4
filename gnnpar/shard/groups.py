"""Node-local sub-groups of the data axis, usable with every :mod:`gnnpar.comm` collective.

FCDP rebuilds a unit's parameters in backward with an all-gather *inside a node*. The grid
knows which ranks share a node (``ranks_per_node`` consecutive ranks), but it only builds
groups along its axes. :func:`node_groups` splits every data-axis group by node:

- the **intra-node** group of a rank holds the members of its data group on its node
  (axis label ``"data.intra"``);
- the **inter-node** group holds the members of its data group with the same index within
  their node, one per node (axis label ``"data.inter"``).

``torch.distributed.new_group`` is collective, so every rank creates every sub-group of every
data group, in the same order, once.

:class:`NodeGroups` answers the part of the :class:`~gnnpar.grid.ProcessGrid` interface that
the collectives of :mod:`gnnpar.comm` use (``group``, ``size``, ``rank``, ``ranks``,
``recorders``), so ``comm.all_gather(t, node_groups, "data.intra")`` works, and its bytes go
to the same :func:`gnnpar.comm.record` recorders as the grid's own axes, under the labels
above. Every other axis name is passed through to the grid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.distributed as dist

from gnnpar.errors import UserError
from gnnpar.fmt import count
from gnnpar.grid import ProcessGrid

__all__ = ["INTER", "INTRA", "NodeGroups", "data_groups", "node_groups", "split_by_node"]

INTRA = "data.intra"
INTER = "data.inter"


def data_groups(grid: ProcessGrid) -> list[list[int]]:
    """Every data-axis group of ``grid`` (global ranks in data order), in a fixed order that
    is the same on all ranks: x fastest, then y, then z."""
    out = []
    for z in range(grid.z):
        for y in range(grid.y):
            for x in range(grid.x):
                out.append([grid.rank_of(x=x, y=y, z=z, data=d) for d in range(grid.data)])
    return out


def split_by_node(members: list[int], ranks_per_node: int) -> list[list[int]]:
    """``members`` cut into lists of ranks on the same node (node = rank // ranks_per_node),
    nodes in order of first appearance; ValueError unless every node holds as many."""
    if ranks_per_node < 1:
        raise UserError(f"ranks_per_node must be positive, got {ranks_per_node}")
    nodes: dict[int, list[int]] = {}
    for r in members:
        nodes.setdefault(r // ranks_per_node, []).append(r)
    parts = list(nodes.values())
    sizes = {len(p) for p in parts}
    if len(sizes) != 1:
        raise UserError(
            f"the data group {members} does not spread evenly over nodes of "
            f"{count(ranks_per_node, 'rank')} (ranks per node: {[len(p) for p in parts]}); "
            "choose ranks_per_node so that each node holds the same number of data ranks"
        )
    return parts


@dataclasses.dataclass(frozen=True)
class NodeGroups:
    """This rank's intra- and inter-node sub-groups of its data group (see module docstring).

    ``local_size`` ranks of the data group share a node (``k``); ``nodes`` nodes hold the
    group (``data = nodes·k``). ``local_rank`` is this rank's index within its node,
    ``node_index`` the index of its node among the group's nodes.
    """

    grid: ProcessGrid
    intra_ranks: tuple[int, ...]
    inter_ranks: tuple[int, ...]
    groups: Mapping[str, dist.ProcessGroup | None] = dataclasses.field(repr=False)

    @property
    def local_size(self) -> int:
        """Data ranks per node (``k``)."""
        return len(self.intra_ranks)

    @property
    def nodes(self) -> int:
        """Nodes that the data group spans."""
        return len(self.inter_ranks)

    @property
    def local_rank(self) -> int:
        """This rank's index within its node's part of the data group."""
        return self.intra_ranks.index(self.grid.global_rank)

    @property
    def node_index(self) -> int:
        """Index of this rank's node among the nodes of its data group."""
        return self.inter_ranks.index(self.grid.global_rank)

    # --- the ProcessGrid interface that gnnpar.comm uses ---------------------------------
    @property
    def recorders(self) -> list:
        """The grid's traffic recorders (bytes of the sub-groups are counted there too)."""
        return self.grid.recorders

    @property
    def channels(self) -> dict:
        """The grid's shared-memory channels (:mod:`gnnpar.shm`), keyed by group."""
        return self.grid.channels

    @property
    def global_rank(self) -> int:
        """This process's global rank."""
        return self.grid.global_rank

    @property
    def device(self) -> torch.device:
        """The grid's device."""
        return self.grid.device

    def _members(self, axis: str) -> tuple[int, ...] | None:
        if axis == INTRA:
            return self.intra_ranks
        if axis == INTER:
            return self.inter_ranks
        return None

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of ``axis`` (``None`` for a group of one rank)."""
        if self._members(axis) is None:
            return self.grid.group(axis)
        return self.groups.get(axis)

    def size(self, axis: str) -> int:
        """Number of ranks in this rank's ``axis`` group."""
        members = self._members(axis)
        return self.grid.size(axis) if members is None else len(members)

    def rank(self, axis: str) -> int:
        """This rank's index in its ``axis`` group."""
        members = self._members(axis)
        return self.grid.rank(axis) if members is None else members.index(self.global_rank)

    def ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """Global ranks of this rank's ``axis`` group."""
        members = self._members(axis)
        if members is None:
            return self.grid.ranks(axis, rank)
        if rank is not None and rank != self.global_rank:
            raise ValueError("NodeGroups only knows the sub-groups of this rank")
        return list(members)


def node_groups(grid: ProcessGrid, ranks_per_node: int | None = None) -> NodeGroups:
    """Create the intra- and inter-node sub-groups of every data group (collective: every
    rank must call it, in the same place of the program) and return this rank's."""
    rpn = grid.ranks_per_node if ranks_per_node is None else ranks_per_node
    mine_intra: tuple[int, ...] = (grid.global_rank,)
    mine_inter: tuple[int, ...] = (grid.global_rank,)
    groups: dict[str, dist.ProcessGroup | None] = {}
    for members in data_groups(grid):
        parts = split_by_node(members, rpn)
        inter = [list(col) for col in zip(*parts, strict=True)]
        for label, lists in ((INTRA, parts), (INTER, inter)):
            for ranks in lists:
                if grid.global_rank in ranks:
                    if label == INTRA:
                        mine_intra = tuple(ranks)
                    else:
                        mine_inter = tuple(ranks)
                if len(ranks) > 1 and grid.distributed:
                    # new_group is collective: every rank creates every group, in order.
                    g = dist.new_group(ranks, timeout=grid.timeout, backend=grid.backend)
                    if grid.global_rank in ranks:
                        groups[label] = g
    return NodeGroups(grid, mine_intra, mine_inter, MappingProxyType(groups))
