"""A sharded group's members under async (shard_group=k > 1): they step together, so they agree before each
step whether to take it or to stop for a round.

Each FSDP2 forward and backward is a collective of the group, and a round a collective of the ranks holding
one shard index: a member that began a round while its peer took one more step would hang both. Under
cadence a window ends at its count, the same for every member. Under async a rank trains on past its count
(the overshoot) until the round's AverageNow reaches it, and each member reads its inbox at its own moment.
So before each step it has batches for, and before beginning a round with batches left, a member votes
over the group (a one-element all-reduce on a gloo group of the group's ranks, no device read): it wants
the step, or it holds an AverageNow. Any AverageNow stops the step for every member; those that did not
have it yet wait for it (the coordinator sends it to every rank) and begin the round without voting again.

A member votes whenever it holds batches, under its count too: its peers may not have their window's
target yet (each reads its ExtendPartition at its own moment), so "past the count" is not a moment the
members agree on, and every vote of one member meets the same vote of the others: the members hold as many
batches at every vote (the planner hands a group's members alike, and they trained alike).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GroupSteps:
    """The votes of one sharded group's members, over `process_group` (gloo, the group's ranks)."""

    def __init__(self, process_group: dist.ProcessGroup) -> None:
        self.process_group = process_group
        self._vote = torch.zeros(1, dtype=torch.int32)
        # The group stopped for a round whose AverageNow has not reached this member yet.
        self.held = False

    def may_step(self) -> bool:
        """Before a step: whether every member takes it (False: one holds an AverageNow; this member is
        held until its own arrives)."""
        self.held = self._stop_asked(False)
        return not self.held

    def before_round(self, has_batches: bool) -> None:
        """Before beginning a round: a member with batches left stops its peers' next step (unless the group
        already stopped for this round)."""
        if has_batches and not self.held:
            self._stop_asked(True)
        self.held = False

    def _stop_asked(self, mine: bool) -> bool:
        self._vote.fill_(int(mine))
        dist.all_reduce(self._vote, op=dist.ReduceOp.MAX, group=self.process_group)
        return bool(self._vote.item())
