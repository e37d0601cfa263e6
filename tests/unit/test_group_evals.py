"""A sharded group's members agree that a round stands before its eval (flodl/worker/group_evals.py): the
verdict from the members' votes, and the vote itself over a real gloo group of 2 members in 2 threads (the
same group's members in 2 processes of a run: tests/runs/test_sharded_survive.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed import HashStore

from flodl.worker.group_evals import GroupEvals, Verdict, Votes, verdict


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
    """The votes of 2 members over one real gloo group (each formed in a thread of its own, together)."""
    store, groups = HashStore(), [None, None]

    def form(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))

    _together([lambda: form(0), lambda: form(1)])
    return [GroupEvals(group) for group in groups]  # type: ignore[arg-type]


def _together(calls: list[Callable[[], object]]) -> list[object]:
    """Each call in a thread of its own, at once: what each returned."""
    said: list[object] = [None] * len(calls)

    def run(i: int) -> None:
        said[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a member never came back from its vote"
    return said


def test_the_members_vote_whether_the_round_stands_and_one_behind_catches_up() -> None:
    first, second = _members()
    assert _together([lambda: first.stands(True, 1), lambda: second.stands(True, 1)]) == [True, True]
    # Cut for one of them (its collective failed, or it voted as its cut round's eval came): for both.
    assert _together([lambda: first.stands(True, 1), lambda: second.stands(False, 1)]) == [False, False]

    # The second's round ran in generation 2, which the first never formed: a newer change overtook it. The
    # first leaves it as cut and, caught up, runs the round again in 3; the second waits for it there.
    def caught_up() -> tuple[bool, bool]:
        return first.stands(True, 2), first.stands(True, 3)

    assert _together([caught_up, lambda: second.stands(True, 3)]) == [(False, True), True]


def test_a_member_the_vote_cannot_reach_leaves_the_round_cut() -> None:
    first, _ = _members(timeout_s=1.0)  # the second never votes: its group is leaving
    assert first.stands(True, 1) is False
