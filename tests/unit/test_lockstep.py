"""Sync's lock-step plan under fault_tolerance=survive (flodl/coordinator/lockstep.py): the rest of an epoch
after a cut, shared by the members left, trains every untrained pick once; the ledger waits for what the
reporting members trained."""

from __future__ import annotations

import random

import pytest
import torch

from flodl.config.layout import Layout
from flodl.coordinator.lockstep import (
    LockstepPlan,
    Segment,
    laid_out,
    opening_segment,
    regrouped,
    rest_of,
)
from flodl.data.partition import epoch_permutation
from flodl.links.messages import EpochSlice

STEP = 8


def picks_of(segment: Segment, rank: int, first: int = 0, last: int | None = None) -> list[int]:
    """The permutation positions `rank` trains in steps [first, last) of `segment`."""
    positions = [p for piece in segment.shares[rank] for p in range(piece.offset, piece.offset + piece.size)]
    return positions[first * STEP : (segment.steps if last is None else last) * STEP]


def test_an_epoch_opens_as_equal_whole_step_slices():
    segment = opening_segment(3, 1000, [2, 0, 1], STEP, generation=4)
    assert segment.members == (0, 1, 2) and segment.steps == 41 and segment.first_step == 0
    assert segment.shares[1] == (EpochSlice(3, 328, 328),)
    assert segment.dropped == 1000 - 3 * 328


def test_the_rest_after_a_cut_is_every_untrained_pick_shared_by_the_members_left():
    segment = opening_segment(0, 1000, [0, 1, 2], STEP, generation=0)
    rest = rest_of(segment, 10, [0, 2], STEP, generation=1)
    assert rest.members == (0, 2) and rest.first_step == 10 and rest.generation == 1
    untrained = [p for r in (0, 1, 2) for p in picks_of(segment, r, first=10)]
    shared = picks_of(rest, 0) + picks_of(rest, 2)
    assert len(set(shared)) == len(shared), "no pick twice"
    assert set(shared) <= set(untrained)
    assert len(untrained) - len(shared) == rest.dropped < 2 * STEP  # less than one global step left over
    # A member keeps its own untrained picks first: its read-ahead stays useful.
    assert picks_of(rest, 0)[: 31 * STEP] == picks_of(segment, 0, first=10)


def test_cuts_one_after_another_never_train_a_pick_twice_nor_lose_more_than_a_step_each():
    rng = random.Random(7)
    for _ in range(200):
        total, members = rng.randint(50, 3000), sorted(rng.sample(range(6), rng.randint(2, 6)))
        segment = opening_segment(0, total, members, STEP, generation=0)
        trained: list[int] = []
        lost = segment.dropped
        generation = 0
        while len(members) > 1 and segment.steps:
            k = rng.randint(0, segment.steps)
            trained += [p for r in members for p in picks_of(segment, r, last=k)]
            members = sorted(set(members) - {rng.choice(members)})
            generation += 1
            segment = rest_of(segment, k, members, STEP, generation)
            assert segment.dropped < len(members) * STEP
            lost += segment.dropped
        trained += [p for r in members for p in picks_of(segment, r)]
        assert len(set(trained)) == len(trained), "no pick twice"
        assert set(trained) <= set(range(total)) and len(trained) + lost == total


def test_the_ledger_waits_for_what_the_members_still_in_trained():
    plan = LockstepPlan(1000, STEP)
    plan.open(0, [0, 1, 2], generation=0)
    assert plan.expected_batches(0) == 3 * 41
    rest = plan.cut_short(0, 10, [0, 2], generation=1)
    # Ranks 0 and 2 report the 10 steps they trained with rank 1 (whose 10 are never reported), then the rest.
    assert plan.expected_batches(0) == 2 * 10 + 2 * rest.steps
    assert not plan.on_report(0, 0, 1), "a cut member's late report of the cut segment does not count"
    assert plan.on_report(0, 1, 0)


def test_a_member_that_finished_the_segment_before_it_died_counts_if_it_said_so():
    plan = LockstepPlan(1000, STEP)
    segment = plan.open(4, [0, 1, 2], generation=2)
    assert plan.on_report(4, 2, 1)  # rank 1 reported the whole epoch, then died
    plan.cut_short(4, segment.steps, [0, 2], generation=3)
    assert plan.expected_batches(4) == 3 * segment.steps
    with pytest.raises(ValueError, match="no such plan"):
        plan.on_report(5, 0, 0)
    plan.open(5, [0, 2], generation=3)
    plan.forget_before(5)  # epoch 4 was emitted: a report of it that comes now does not count
    assert not plan.on_report(4, 2, 0)
    assert plan.current_generation(4) is None and plan.current_generation(5) == 3


def test_shares_are_slices_of_the_epoch_s_one_permutation():
    segment = rest_of(opening_segment(1, 200, [0, 1, 2], STEP, 0), 3, [0, 1], STEP, 1)
    permutation = epoch_permutation(200, seed=0, epoch=1)
    picks = torch.cat([permutation[s.offset : s.offset + s.size] for r in (0, 1) for s in segment.shares[r]])
    assert len(picks.unique()) == len(picks)


def _steps(segment: Segment, step: int) -> list[set[int]]:
    """Per step of `segment`, the picks every member trains in it (a global step)."""
    positions = {
        rank: [p for piece in segment.shares[rank] for p in range(piece.offset, piece.offset + piece.size)]
        for rank in segment.members
    }
    return [
        {p for rank in segment.members for p in positions[rank][k * step : (k + 1) * step]}
        for k in range(segment.steps)
    ]


def test_keep_global_batch_keeps_every_global_step_whole_on_fewer_or_more_ranks() -> None:
    saved = opening_segment(2, 1000, [0, 1, 2, 3], STEP, generation=0)  # 4 ranks, 31 steps of 4 x 8
    for members, step in (([0, 1], 2 * STEP), ([0], 4 * STEP)):
        # The rest from step 5, on 2 ranks of 2 micro-batches or 1 of 4: the saved run's global steps.
        rest = regrouped(saved, 5, members, step, generation=1)
        assert rest.steps == saved.steps - 5 and rest.first_step == 5
        assert _steps(rest, step) == _steps(saved, STEP)[5:]
        # An epoch opened so: as the 4 ranks would open it.
        fresh = laid_out(2, 1000, members, step, generation=0, layout=Layout(4, STEP, kept=True))
        assert _steps(fresh, step) == _steps(saved, STEP) and fresh.dropped == saved.dropped
    # And back to the 4 ranks from 2 of 2 micro-batches: the same steps again.
    two = regrouped(saved, 3, [0, 1], 2 * STEP, generation=1)
    assert _steps(regrouped(two, 4, [0, 1, 2, 3], STEP, generation=2), STEP) == _steps(saved, STEP)[7:]
    with pytest.raises(ValueError, match="make no 3 equal steps"):
        regrouped(saved, 5, [0, 1, 2], 8, generation=1)
