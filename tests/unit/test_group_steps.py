"""A sharded group's members under async vote before each step (flodl/worker/group_steps.py), here over a
real gloo group of 2 members in 2 threads: they step together, stop together for a round's order, and step
only in one group generation (under survive, a member that formed a change its other has not read yet would
otherwise step on, and the two would share their shards with a group admitted a step apart)."""

from __future__ import annotations

from flodl.worker.group_steps import GroupSteps
from tests.helpers.gloo_pair import gloo_pair, together


def _members() -> tuple[list[GroupSteps], list[int]]:
    """The step votes of 2 members over one real gloo group, and the generation each formed (0 at first)."""
    generations = [0, 0]
    groups = gloo_pair()
    return [GroupSteps(groups[i], lambda i=i: generations[i]) for i in range(2)], generations


def test_the_members_step_together_and_stop_together_for_a_round() -> None:
    (first, second), _ = _members()
    assert together([first.may_step, second.may_step]) == [True, True]
    # The first holds a round's order and votes as it begins the round: the second is held until its own
    # arrives, and begins the round without voting again.
    assert together([lambda: first.before_round(True), second.may_step]) == [None, False]
    assert second.held and not first.held
    second.before_round(True)
    assert not second.held
    assert together([first.may_step, second.may_step]) == [True, True]


def test_the_members_step_only_in_one_generation() -> None:
    (first, second), generations = _members()
    generations[0] = 1  # the first formed a change (an admission) that the second has not read yet
    assert together([first.may_step, second.may_step]) == [False, False]
    assert not first.held and not second.held  # no round to wait for: the second forms the change
    generations[1] = 1
    assert together([first.may_step, second.may_step]) == [True, True]
