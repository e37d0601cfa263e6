"""A sharded group's members agree that a round stands before its eval (flodl/worker/group_evals.py): the
verdict from the members' votes, and the vote itself over a real gloo group of 2 members in 2 threads (the
same group's members in 2 processes of a run: tests/runs/test_sharded_survive.py)."""

from __future__ import annotations

import pytest

from flodl.worker.group_evals import GroupEvals, Verdict, Votes, verdict
from tests.helpers.gloo_pair import gloo_pair, together


@pytest.mark.parametrize(
    ("generation", "votes", "said"),
    [
        (4, Votes(True, 4, 4), Verdict.STANDS),  # finished for every member, in one generation
        (4, Votes(False, 4, 4), Verdict.CUT),  # cut for one (this one, or another: left as it leaves it)
        # A member behind (its round of generation 3 overtaken by the change this one formed): it leaves its
        # round as cut and catches up; this one votes again once that one ran it in generation 4.
        (4, Votes(True, 3, 4), Verdict.AGAIN),
        (4, Votes(False, 3, 4), Verdict.AGAIN),
        (3, Votes(True, 3, 4), Verdict.CUT),
        (3, Votes(False, 2, 4), Verdict.CUT),  # behind the newest, whatever the oldest
    ],
)
def test_a_round_stands_only_finished_for_every_member_in_one_generation(
    generation: int, votes: Votes, said: Verdict
) -> None:
    assert verdict(generation, votes) is said


def _members(timeout_s: float = 30.0) -> list[GroupEvals]:
    """The votes of 2 members over one real gloo group."""
    return [GroupEvals(group) for group in gloo_pair(timeout_s)]


def test_the_members_vote_whether_the_round_stands_and_one_behind_catches_up() -> None:
    first, second = _members()
    assert together([lambda: first.stands(True, 1), lambda: second.stands(True, 1)]) == [True, True]
    # Cut for one of them (its collective failed, or it voted as its cut round's eval came): for both.
    assert together([lambda: first.stands(True, 1), lambda: second.stands(False, 1)]) == [False, False]

    # The second's round ran in generation 2, which the first never formed: a newer change overtook it. The
    # first leaves it as cut and, caught up, runs the round again in 3; the second waits for it there.
    def caught_up() -> tuple[bool, bool]:
        return first.stands(True, 2), first.stands(True, 3)

    assert together([caught_up, lambda: second.stands(True, 3)]) == [(False, True), True]


def test_a_member_the_vote_cannot_reach_leaves_the_round_cut() -> None:
    first, _ = _members(timeout_s=1.0)  # the second never votes: its group is leaving
    assert first.stands(True, 1) is False
