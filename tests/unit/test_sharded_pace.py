"""Cadence across sharded groups: every member of a group trains as many batches in each window, the
epoch's tail too (a member left with fewer would hang its group's FSDP2 collectives), and every batch of
the epoch's whole groups once (rounds/group_pace.py, ElChe's counts, the planner)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.links.messages import RoundAck
from flodl.rounds.elche import ElChe, ElCheSettings
from flodl.rounds.group_pace import even_in_groups, whole_groups
from flodl.rounds.orders import Average, Dispatch, WindowReport
from flodl.rounds.planner import LocalSgdPlanner
from flodl.rounds.verdict import Verdict
from tests.helpers.planner_batches import Batch, all_batches, expand


def test_a_group_gets_its_slowest_members_count():
    assert even_in_groups([7, 3, 5, 9], 2) == [3, 3, 5, 5]
    assert even_in_groups([7, 3, 5, 9], 4) == [3, 3, 3, 3]
    assert even_in_groups([7, 3, 5, 9], 1) == [7, 3, 5, 9]
    assert even_in_groups([0, 4], 2) == [0, 0]  # a member without a count holds its group back
    with pytest.raises(ValueError, match="groups of 2"):
        even_in_groups([1, 2, 3], 2)


def test_an_epoch_of_whole_groups_leaves_out_the_last_batches():
    assert [whole_groups(n, 2) for n in (0, 1, 2, 7, 8)] == [0, 0, 2, 6, 8]
    assert whole_groups(7, 1) == 7


def test_elche_paces_each_group_at_its_slowest_member():
    el = ElChe(ElCheSettings(world_size=4, anchor=10, group_size=2), epoch_batches=1000)
    for _ in range(6):  # rank 1 and rank 3 are twice as slow as rank 0; rank 2 is the fastest
        el.report_timing([20.0, 40.0, 10.0, 40.0], [10, 10, 10, 10])
    counts = el.counts()
    assert counts[0] == counts[1] and counts[2] == counts[3]
    # Group 0 marches at rank 1's pace (the anchor's count), group 1 at rank 3's.
    assert counts == [el.anchor] * 4
    el.report_timing([20.0, 20.0, 10.0, 10.0], [10, 10, 10, 10])  # both of group 1 now twice as fast
    for _ in range(5):
        el.report_timing([20.0, 20.0, 10.0, 10.0], [10, 10, 10, 10])
    assert el.counts() == [el.anchor, el.anchor, 2 * el.anchor, 2 * el.anchor]


def run_cadence(k: int, groups: int, batches: int, epochs: int, anchor: int, rng: random.Random) -> None:
    """A cadence run as the coordinator drives it: ElChe's counts from speeds drawn each window (a
    member's speed its own), the planner's windows, the ranks' reports and acks."""
    world = k * groups
    bpe = whole_groups(batches, k)  # batches >= k: a batch for each of a group
    el = ElChe(ElCheSettings(world_size=world, anchor=anchor, group_size=k), epoch_batches=bpe)
    planner = LocalSgdPlanner(
        world_size=world,
        batches_per_epoch=bpe,
        batch_size=2,
        epochs=epochs,
        is_async=False,
        eval_epochs=frozenset(),
    )
    trained: Counter[Batch] = Counter()
    in_epoch: Counter[int] = Counter()
    windows = 0
    while not planner.finished:
        windows += 1
        assert windows <= bpe * epochs + 1, "the run did not end"
        dispatches = planner.open_window(el.counts(), el.overshoot)
        assert all(isinstance(d, Dispatch) for d in dispatches)
        given = {
            d.rank: [b for s in d.slices for b in expand(s, 2)] for d in dispatches if isinstance(d, Dispatch)
        }
        for g in range(groups):  # the property: a group's members train alike, the tail's window too
            sizes = {len(given[r]) for r in range(g * k, (g + 1) * k)}
            assert len(sizes) == 1, (g, [len(given[r]) for r in range(world)])
        ms = [rng.uniform(1.0, 8.0) for _ in range(world)]
        average = []
        for rank in rng.sample(range(world), world):
            for batch in given[rank]:
                trained[batch] += 1
                in_epoch[batch[0]] += 1
                if in_epoch[batch[0]] == bpe:
                    planner.on_epoch_complete(batch[0])
            steps = len(given[rank])
            average += planner.on_reached(WindowReport(rank, steps, steps * ms[rank]))
        assert len(average) == 1 and isinstance(average[0], Average)
        for rank in range(world):
            planner.on_ack(RoundAck(rank, average[0].round, len(given[rank]), False, 0.0, 0.0, 0))
        el.report_timing(
            [len(given[r]) * ms[r] for r in range(world)],
            [len(given[r]) for r in range(world)],
            reduce_ms=rng.choice([0.0, 50.0]),
        )
        el.apply_verdict(Verdict.STABLE)
    assert set(trained) == all_batches(epochs, bpe) and set(trained.values()) == {1}


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(1, 4),
    groups=st.integers(1, 4),
    batches=st.integers(1, 80),
    epochs=st.integers(1, 3),
    anchor=st.integers(1, 12),
    rng=st.randoms(use_true_random=False),
)
def test_cadence_windows_are_even_in_each_group(k, groups, batches, epochs, anchor, rng):
    run_cadence(k, groups, max(batches, k), epochs, anchor, rng)
