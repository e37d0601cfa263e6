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

Under fault_tolerance=survive each member also reads a membership change (a Regroup) at its own moment, and
an admission's joiners take their shards from the members holding them as each forms the change: a member
that formed it while its other stepped on would leave the group admitted with shards a step apart. So the
vote carries the generation each member formed, and the members step only in one: one behind forms the
change it was sent (no vote while it does), and they vote again.

With backend=cpu a round runs on the host averager's thread while the members train on, and each member's
thread ends at its own moment (each shard index's round is its own). A member adopting the consensus a step
before its other would leave the group's model half blended for that step. So the vote also carries whether
a member's round is done (or none is in flight: it adopted its round when it had nothing to train), and
once one member's is, every member adopts its round before the step the vote was for, waiting for its thread
if need be: every member adopts at the same step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class GroupSteps:
    """The votes of one sharded group's members, over `process_group` (gloo, the group's ranks); `generation`:
    the group generation this member formed (survive; 0 for good in a fixed world)."""

    def __init__(self, process_group: dist.ProcessGroup, generation: Callable[[], int] = lambda: 0) -> None:
        self.process_group = process_group
        self.generation = generation
        self._vote = torch.zeros(4, dtype=torch.int64)
        # The group stopped for a round whose AverageNow has not reached this member yet.
        self.held = False
        # After a vote: a member's round on the host averager's thread is done, so each adopts its own now.
        self.adopts = False

    def may_step(self, round_done: bool = True) -> bool:
        """Before a step: whether every member takes it (False: one holds an AverageNow, and this member is
        held until its own arrives; or one formed a change another has not, and they vote again).
        `round_done`: this member's round in flight is done, or none is (then `adopts`)."""
        self.held, oldest, newest, self.adopts = self._vote_for(False, round_done)
        return not self.held and oldest == newest

    def before_round(self, has_batches: bool) -> None:
        """Before beginning a round: a member with batches left stops its peers' next step (unless the group
        already stopped for this round)."""
        if has_batches and not self.held:
            self._vote_for(True)
        self.held = False

    def _vote_for(self, stop: bool, round_done: bool = True) -> tuple[bool, int, int, bool]:
        """All-reduced (MAX): whether any member stops, the oldest and the newest generation formed, and
        whether any member's round is done."""
        generation = self.generation()
        self._vote.copy_(torch.tensor([int(stop), -generation, generation, int(round_done)]))
        dist.all_reduce(self._vote, op=dist.ReduceOp.MAX, group=self.process_group)
        stopped, oldest, newest, done = self._vote.tolist()
        return bool(stopped), -oldest, newest, bool(done)
