"""Sync by sharded groups under fault_tolerance=survive (shard_group=k > 1): torchft's fault-tolerant HSDP.

Under survive a process's world is its sharded group alone (flodl/job/assembly.py `make_group`), so FSDP2
shards the model over the group: each step's gradients are reduce-scattered inside it (their mean over the
group's micro-batches). Across the groups, each rank averages its reduce-scattered gradient shard with the
same shard of every other group in, over the averaging group of its shard index (flodl/links/membership.py),
in place of HSDP's all-reduce over the job's 2-D mesh: FSDP2's all-reduce hook, after each unit's
reduce-scatter and before the shard's `.grad` takes it, so clipping and the optimizer step see the mean
gradient of every group's micro-batches. Every group trains as many micro-batches a step (the sync driver
hands each member equal whole steps), so the mean of the groups' means is HSDP's mean of the global batch.

A member's death cuts the averaging groups: an all-reduce that failed, or that the change released, leaves
its rank's gradient short, while its group's other members' all-reduces (another shard index) may have gone
through. A group steps whole or not at all: a failure is noted, not raised inside the backward pass (the
group's next reduce-scatter would wait for the member that left it), and before the optimizer step the
group's members vote (one integer, MAX, over a gloo group of theirs): a failure anywhere in the group fails
the step on every member, which raises it to the sync worker's survive path (the Regroup, then the members
agree by shard index where they are: the furthest gives its state). So a group's members are always at one
step, and every shard index agrees on the same one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from flodl.averaging.shards import gathered_units
from flodl.sharding.fsdp import is_sharded


class GroupGradients:
    """The gradient averaging across groups of a rank whose model is sharded over its group: hooked into
    each FSDP2 unit of `model` and before each step of `optimizer`; `vote`: a gloo group of the rank's
    sharded group; `settle`: how a collective of the averaging group is waited for (a cut releases it)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        vote: dist.ProcessGroup,
        settle: Callable[[dist.Work], object],
    ) -> None:
        self.model, self.vote, self.settle = model, vote, settle
        self.group: dist.ProcessGroup | None = None
        # The first failure of the step in flight (None: its averaging went through so far).
        self.failure: BaseException | None = None
        self._ballot = torch.zeros(1, dtype=torch.int64)
        for unit in gathered_units(model):
            unit.set_all_reduce_hook(self._average)
        optimizer.register_step_pre_hook(self._before_step)

    def on(self, group: dist.ProcessGroup) -> nn.Module:
        """Average over `group` (the shard index's members, formed for a change) from the next step on; what
        the rank trains through: the sharded model itself (the sync worker's wrap)."""
        self.group, self.failure = group, None
        return self.model

    def _average(self, shard: Tensor) -> None:
        """A unit's reduce-scattered gradient shard, averaged in place with the same shard of every group."""
        if self.failure is not None:  # the step failed already: nothing more of it goes out
            return
        assert self.group is not None, "a step before the first group was formed"
        try:
            work = dist.all_reduce(shard, group=self.group, async_op=True)
            assert work is not None  # async_op: torch hands back the work
            self.settle(work)
            shard.div_(self.group.size())
        except Exception as err:  # the group was cut: its members vote it down before the step
            self.failure = err

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The group's members step together or not at all: a failure raised on every member."""
        failure, self.failure = self.failure, None
        self._ballot.fill_(int(failure is not None))
        dist.all_reduce(self._ballot, op=dist.ReduceOp.MAX, group=self.vote)
        if failure is not None:
            raise failure
        if self._ballot.item():
            raise RuntimeError("a member of its sharded group lost the step's averaging across groups")


def held(model: nn.Module, buffers: Iterable[Tensor]) -> list[Tensor]:
    """`model`'s parameters, then `buffers`, as this rank holds them, detached: a sharded parameter as its
    local shard (writing to which writes the shard). First no unit keeps a gathered copy: the root after an
    eval holds its gathered parameters as the module's (the whole tensors, not the shards), and its next
    forward would compute from that copy, not from what is written to the shards."""
    if is_sharded(model):
        for unit in gathered_units(model):
            unit.reshard()
    tensors = [t.detach() for t in [*model.parameters(), *buffers]]
    return [getattr(t, "to_local", lambda t=t: t)() for t in tensors]
