"""A sharded group's members under fault_tolerance=survive (shard_group=k > 1): they agree that a round stands
for every one of them before its eval, and under async before every blend.

A round averages each shard among the ranks holding its shard index, one collective per index; an eval of
the consensus is a collective of the group (each forward gathers the parameters inside it). A death in
another group cuts the round for the members of the dead rank's shard index while those of another index
may finish it: a member that finished would enter the eval, and wait there on one that went to wait for the
change instead. So before the eval of a round, and as a round with an eval is cut for it, every member
votes over the group (one all-reduce of three integers on a gloo group of the group's ranks): whether the
round finished for it, and the generation it ran the round in. The round stands only if it finished for
every member in one generation; a member behind the others (a change it has not formed yet overtook its
round) leaves it as cut and catches up with the change, while those ahead vote again once it runs the round
in their generation (`verdict`).

Under async the same cut leaves a blend round finished for one member and cut for the other, eval or not: a
member keeping the blend would run the round's redo with no steps of its window while the other runs it with
all of them (the group's shards averaged at two weights, its learning-rate clock split). So its members vote
on every round: one that stood for every member is kept by each, one that did not goes back on each.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist


class Verdict(Enum):
    STANDS = "stands"  # the round finished for every member, in one generation: evaluate it together
    CUT = "cut"  # it was cut for a member (this one, or one in step with it): leave it as cut
    AGAIN = "again"  # a member is behind, its round cut by a change this one formed: vote once it is here


@dataclass(frozen=True)
class Votes:
    """What the group's votes add up to: whether the round finished for every member, and the oldest and the
    newest generation they ran it in."""

    finished: bool
    oldest: int
    newest: int


def verdict(generation: int, votes: Votes) -> Verdict:
    """This member's verdict on its round, run in `generation`, from the members' `votes`."""
    if votes.oldest == votes.newest:
        return Verdict.STANDS if votes.finished else Verdict.CUT
    return Verdict.AGAIN if generation == votes.newest else Verdict.CUT


class GroupEvals:
    """The votes of one sharded group's members before a round's eval, over `process_group` (gloo, the
    group's ranks)."""

    def __init__(self, process_group: dist.ProcessGroup) -> None:
        self.process_group = process_group

    def stands(self, finished: bool, generation: int) -> bool:
        """Whether the round, `finished` here or not in `generation`, stands for every member. A member the
        vote cannot reach is leaving (the roster cuts a group whole): the round is cut here then."""
        while True:
            try:
                votes = self._vote(finished, generation)
            except RuntimeError:
                return False
            said = verdict(generation, votes)
            if said is not Verdict.AGAIN:
                return said is Verdict.STANDS

    def _vote(self, finished: bool, generation: int) -> Votes:
        # MIN of each: every member finished, the oldest generation, the newest one (negated).
        vote = torch.tensor([int(finished), generation, -generation], dtype=torch.int64)
        dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=self.process_group)
        finished_all, oldest, newest = vote.tolist()
        return Votes(bool(finished_all), oldest, -newest)
