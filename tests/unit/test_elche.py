"""ElChe cadence balancer: counts, election, phases, growth, nudges, max_batch_diff, state."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.rounds.elche import (
    AnchorChange,
    ElChe,
    ElCheSettings,
    Phase,
    Verdict,
    round_overhead_ms,
)

STABLE_REPORTS = 5  # calibrations to reach Phase.STABLE


def make(world: int = 2, **kw) -> ElChe:
    epoch_batches = kw.pop("epoch_batches", None)
    anchor_rank = kw.pop("anchor_rank", None)
    return ElChe(ElCheSettings(world_size=world, **kw), anchor_rank, epoch_batches)


def feed(el: ElChe, ms: list[float], times: int = 1, reduce_ms: float = 0.0, n: int = 10) -> None:
    """Report `times` windows where rank r ran `n` batches at ms[r] ms/batch."""
    for _ in range(times):
        el.report_timing([m * n for m in ms], [n if m > 0 else 0 for m in ms], reduce_ms)


def to_stable(el: ElChe, ms: list[float]) -> None:
    feed(el, ms, times=STABLE_REPORTS)
    assert el.phase is Phase.STABLE


# --- batch counts ------------------------------------------------------------------------------


def test_cold_start_counts_are_equal_anchor():
    el = make(world=3, anchor=7)
    assert el.counts() == [7, 7, 7]
    assert el.anchor_rank is None and el.phase is Phase.PROBE


def test_counts_follow_speed_ratio():
    el = make(anchor=10)
    feed(el, [10.0, 30.0])
    assert el.anchor_rank == 1
    assert el.counts() == [30, 10]
    assert el.smoothed_ms(0) == pytest.approx(10.0)


def test_speed_ratio_is_capped_at_64():
    el = make(anchor=10)
    feed(el, [1.0, 1000.0])
    assert el.counts() == [640, 10]


def test_counts_round_half_up():
    el = make(anchor=5)
    feed(el, [20.0, 30.0])  # 5 * 1.5 = 7.5 -> 8 (Python's banker's round would give 8 too; 2.5 below)
    assert el.counts() == [8, 5]
    el = make(anchor=1)
    feed(el, [20.0, 50.0])  # 1 * 2.5 = 2.5 -> 3, not 2
    assert el.counts() == [3, 1]


def test_dead_zone_ignores_a_three_percent_change_but_not_ten():
    el = make(anchor=10)
    feed(el, [10.0, 30.0], times=5)
    assert el.counts() == [30, 10]
    feed(el, [10.3, 30.0], times=5)  # target round(10*30/10.3) = 29: a 1-batch (3%) move is chatter
    assert el.counts() == [30, 10]
    feed(el, [11.0, 30.0], times=5)  # the window mean walks 10.3 -> 11: the move lands at 28 (target 27
    assert el.counts() == [28, 10]  # is then within 5% of it)


def test_counts_never_exceed_the_epoch_cap():
    el = make(anchor=10, epoch_batches=25)
    assert el.counts() == [10, 10]
    feed(el, [10.0, 30.0])
    assert el.window_cap_binding
    assert el.counts() == [19, 6]  # [30, 10] scaled by 25/40, floored to [18, 6], remainder to the largest
    assert sum(el.counts()) == 25
    el.epoch_batches = None
    assert el.counts() == [30, 10]
    el = make(world=3, anchor=1, epoch_batches=3)
    feed(el, [1.0, 3.0, 4.0])  # [4, 1, 1] scaled floors to [2, 1, 1]: the excess comes off the largest
    assert el.counts() == [1, 1, 1]


def test_no_overshoot_outside_async():
    el = make(anchor=10)
    feed(el, [10.0, 30.0])
    assert el.overshoot == 0


def test_idle_window_is_not_a_calibration():
    el = make()
    el.report_timing([0.0, 0.0], [0, 0], reduce_ms=5.0)
    assert el.calibration_count == 0 and el.phase is Phase.PROBE
    feed(el, [10.0, 30.0])
    for _ in range(5):
        el.report_timing([0.0, 0.0], [0, 0], reduce_ms=5.0)
    assert el.calibration_count == 1 and el.smoothed_ms(1) == pytest.approx(30.0)  # nor a zero report


def test_five_zero_reports_clear_a_rank_window():
    el = make(anchor=10)
    feed(el, [10.0, 30.0])
    feed(el, [10.0, 0.0], times=4)
    assert el.smoothed_ms(1) == pytest.approx(30.0)
    feed(el, [10.0, 0.0])
    assert el.smoothed_ms(1) is None


# --- election ----------------------------------------------------------------------------------


def test_slowest_rank_is_elected_and_small_differences_do_not_flip_it():
    el = make(world=3, anchor=10)
    feed(el, [10.0, 30.0, 20.0])
    assert el.anchor_rank == 1
    to_stable(el, [10.0, 30.0, 20.0])
    feed(el, [10.0, 30.0, 32.0], times=5)  # 32 < 30 * 1.10: within the dominance margin
    assert el.anchor_rank == 1
    feed(el, [10.0, 30.0, 34.0], times=5)  # 34 > 33
    assert el.anchor_rank == 2
    assert el.counts()[2] == 10


def test_first_pick_within_the_band_is_the_lowest_index():
    el = make(world=3, anchor=10)
    feed(el, [27.0, 30.0, 10.0])  # 27 >= 0.85 * 30: both in the slow cohort
    assert el.anchor_rank == 0
    assert el.counts() == [10, 9, 27]


def test_election_is_held_until_stable():
    el = make(anchor=10)
    feed(el, [10.0, 30.0])
    feed(el, [60.0, 30.0], times=3)  # rank 0 now far slower, but Warmup holds the pick
    assert el.phase is Phase.WARMUP and el.anchor_rank == 1
    feed(el, [60.0, 30.0])  # 5th calibration -> Stable
    feed(el, [60.0, 30.0])
    assert el.anchor_rank == 0


def test_pinned_anchor_without_readings_is_replaced_after_a_full_window():
    el = make(world=3, anchor=10, anchor_rank=2)
    feed(el, [10.0, 30.0, 0.0], times=4)
    assert el.anchor_rank == 2 and el.calibration_count == 0
    feed(el, [10.0, 30.0, 0.0])
    assert el.anchor_rank == 1 and el.calibration_count == 1


# --- phases ------------------------------------------------------------------------------------


def test_phases_advance_probe_warmup_stable_mature():
    el = make()
    seen = []
    for _ in range(21):
        seen.append(el.phase)
        feed(el, [10.0, 30.0])
    seen.append(el.phase)
    # index = calibrations so far
    assert seen[0] is Phase.PROBE
    assert set(seen[1:5]) == {Phase.WARMUP}
    assert set(seen[5:20]) == {Phase.STABLE}
    assert set(seen[20:]) == {Phase.MATURE}


# --- growth ------------------------------------------------------------------------------------


def test_growth_commits_only_on_stable():
    el = make(anchor=10)
    to_stable(el, [10.0, 10.0])
    feed(el, [10.0, 10.0], reduce_ms=100.0)  # overhead 100/200 = 0.5 -> x2 (capped)
    assert el.proposed_anchor == 20
    assert el.apply_verdict(Verdict.SUPPRESS_GROWTH) == []
    assert el.anchor == 10 and el.proposed_anchor is None and not el.growth_enabled
    el = make(anchor=10)
    to_stable(el, [10.0, 10.0])
    feed(el, [10.0, 10.0], reduce_ms=100.0)
    assert el.apply_verdict(Verdict.STABLE) == [AnchorChange(10, 20, "grow")]
    assert el.anchor == 20 and el.counts() == [20, 20] and el.proposed_anchor is None
    feed(el, [10.0, 10.0], reduce_ms=1000.0)
    assert el.proposed_anchor == 40
    feed(el, [10.0, 10.0])  # a proposal lives for one window only
    assert el.proposed_anchor is None and el.apply_verdict(Verdict.STABLE) == []


def test_growth_proposal_formula():
    target = 0.16
    el = make(anchor=10, overhead_target=target)
    to_stable(el, [5.0, 10.0])
    feed(el, [5.0, 10.0], reduce_ms=25.0)  # the anchor is rank 1, at 10 ms/batch
    overhead = 25.0 / (10 * 10.0 + 25.0)
    expected = math.ceil(10 * min(overhead / target, 2.0))
    assert 10 < expected < 20  # the uncapped branch
    assert el.proposed_anchor == expected == 13


def test_no_proposal_below_target_or_on_first_report_and_warmup_needs_twice_the_target():
    el = make(anchor=10)
    feed(el, [10.0, 10.0], reduce_ms=1000.0)
    assert el.proposed_anchor is None  # first report never proposes
    feed(el, [10.0, 10.0], reduce_ms=8.0)  # overhead ~0.074: above target, below 2x in Warmup
    assert el.phase is Phase.WARMUP and el.proposed_anchor is None
    feed(el, [10.0, 10.0], reduce_ms=15.0)  # ~0.13 > 0.10
    assert el.proposed_anchor == 20
    el.apply_verdict(Verdict.STABLE)
    feed(el, [10.0, 10.0], times=3)
    feed(el, [10.0, 10.0], reduce_ms=5.0)  # 5 / 205 < 0.05
    assert el.phase is Phase.STABLE and el.proposed_anchor is None


def test_growth_clamps_to_max_anchor_and_respects_min_anchor():
    el = make(anchor=10, max_anchor=15)
    to_stable(el, [10.0, 10.0])
    feed(el, [10.0, 10.0], reduce_ms=100.0)
    assert el.proposed_anchor == 15
    el.apply_verdict(Verdict.STABLE)
    feed(el, [10.0, 10.0], reduce_ms=100.0)
    assert el.proposed_anchor is None and el.anchor == 15
    assert make(anchor=10, min_anchor=30).anchor == 30  # the floor lifts the initial anchor
    assert make(anchor=10, min_anchor=30, max_anchor=20).anchor == 20
    el = make(anchor=10, min_anchor=4)
    assert el.anchor == 10
    assert el.settings.floor == 4


def test_growth_suppressed_while_the_window_cap_binds():
    el = make(anchor=10, epoch_batches=15)
    to_stable(el, [10.0, 10.0])
    assert el.window_cap_binding
    feed(el, [10.0, 10.0], reduce_ms=100.0)
    assert el.proposed_anchor is None


def test_growth_latch_rearms_after_five_stables():
    el = make(anchor=10)
    to_stable(el, [10.0, 10.0])
    el.apply_verdict(Verdict.SUPPRESS_GROWTH)
    for _ in range(4):
        feed(el, [10.0, 10.0], reduce_ms=100.0)
        assert el.proposed_anchor is None
        assert el.apply_verdict(Verdict.STABLE) == []
    assert not el.growth_enabled
    feed(el, [10.0, 10.0], reduce_ms=100.0)
    el.apply_verdict(Verdict.STABLE)  # 5th consecutive Stable re-arms (no proposal was staged yet)
    assert el.growth_enabled and el.anchor == 10
    feed(el, [10.0, 10.0], reduce_ms=100.0)
    assert el.apply_verdict(Verdict.STABLE) == [AnchorChange(10, 20, "grow")]


def test_interrupted_stable_streak_does_not_rearm():
    el = make(anchor=10)
    to_stable(el, [10.0, 10.0])
    el.apply_verdict(Verdict.SUPPRESS_GROWTH)
    for _ in range(4):
        el.apply_verdict(Verdict.STABLE)
    el.apply_verdict(Verdict.SUPPRESS_GROWTH)
    for _ in range(4):
        el.apply_verdict(Verdict.STABLE)
    assert not el.growth_enabled


# --- nudge down --------------------------------------------------------------------------------


def test_nudge_down_reaches_one_ignoring_min_anchor():
    el = make(anchor=10)  # min_anchor = 10
    assert el.nudge_anchor_down(0.5) == AnchorChange(10, 5, "nudge_down")
    assert el.counts() == [5, 5]
    assert el.nudge_anchor_down(0.01) == AnchorChange(5, 1, "nudge_down")  # factor clamped to 0.1
    assert el.anchor == 1
    assert el.nudge_anchor_down(0.5) is None  # ceil(0.5) = 1: no change
    assert el.nudge_anchor_down(float("nan")) is None


def test_nudge_factor_clamped_to_0_1_and_1():
    el = make(anchor=100)
    assert el.nudge_anchor_down(0.0) == AnchorChange(100, 10, "nudge_down")
    assert el.nudge_anchor_down(3.0) is None and el.anchor == 10


def test_nudge_down_verdict_drops_the_proposal_and_rescales_counts():
    el = make(anchor=10)
    to_stable(el, [10.0, 30.0])
    feed(el, [10.0, 30.0], reduce_ms=1000.0)
    assert el.proposed_anchor == 20
    assert el.apply_verdict(Verdict.NUDGE_DOWN, factor=0.5) == [AnchorChange(10, 5, "nudge_down")]
    assert el.counts() == [15, 5]
    assert el.apply_verdict(Verdict.STABLE) == []  # the stale pre-nudge proposal is gone
    assert el.anchor == 5 and not el.growth_enabled


# --- max_batch_diff ----------------------------------------------------------------------------


def test_max_batch_diff_zero_is_lockstep():
    el = make(anchor=10, max_batch_diff=0)
    to_stable(el, [10.0, 30.0])
    assert el.counts() == [10, 10]
    feed(el, [10.0, 30.0], reduce_ms=1000.0)
    el.apply_verdict(Verdict.STABLE)
    assert el.anchor == 20 and el.counts() == [20, 20]
    el.apply_verdict(Verdict.NUDGE_DOWN, factor=0.5)
    assert el.counts() == [10, 10]


def test_finite_max_batch_diff_limits_each_update():
    el = make(anchor=10, max_batch_diff=4)
    seen = []
    for _ in range(6):
        feed(el, [10.0, 30.0])
        seen.append(el.counts())
    assert seen == [[14, 10], [18, 10], [22, 10], [26, 10], [30, 10], [30, 10]]


# --- async overshoot --------------------------------------------------------------------------


def test_async_auto_overshoot_climbs_to_15_and_resets_on_nudge():
    el = make(anchor=10, is_async=True)
    assert el.overshoot == 3
    for i in range(1, 20):
        el.apply_verdict(Verdict.STABLE)
        assert el.overshoot == min(3 + i, 15)
    el.apply_verdict(Verdict.SUPPRESS_GROWTH)
    assert el.overshoot == 15
    el.apply_verdict(Verdict.NUDGE_DOWN, factor=0.5)
    assert el.overshoot == 3


def test_explicit_max_overshoot_stays_fixed():
    el = make(is_async=True, max_overshoot=7)
    for verdict in [Verdict.STABLE] * 5 + [Verdict.NUDGE_DOWN, Verdict.STABLE]:
        el.apply_verdict(verdict)
        assert el.overshoot == 7


# --- checkpoint state --------------------------------------------------------------------------


def _drive(el: ElChe, steps: int, start: int) -> list[tuple]:
    trace = []
    for i in range(start, start + steps):
        ms = [10.0 + (i % 3), 30.0 + 2 * (i % 4), 12.0 if i % 5 else 0.0]
        feed(el, ms, reduce_ms=40.0 + (i % 7) * 10)
        verdict = [Verdict.STABLE, Verdict.STABLE, Verdict.SUPPRESS_GROWTH, Verdict.NUDGE_DOWN][i % 4]
        changes = el.apply_verdict(verdict, factor=0.7)
        trace.append((el.counts(), el.overshoot, el.anchor, el.anchor_rank, el.phase, changes))
    return trace


def test_state_round_trip_restores_identical_future_behaviour():
    kw = dict(world_size=3, anchor=8, is_async=True, max_batch_diff=50)
    original = ElChe(ElCheSettings(**kw), epoch_batches=400)
    _drive(original, 9, 0)
    state = json.loads(json.dumps(original.state()))
    assert state["phase"] == "stable" and state["calibration_count"] == 9
    resumed = ElChe.from_state(ElCheSettings(**kw), state, epoch_batches=400)
    assert resumed.state() == original.state()
    assert _drive(resumed, 15, 9) == _drive(original, 15, 9)


def test_state_of_another_world_carries_the_cadence_over_and_measures_every_rank_afresh():
    kw = dict(anchor=8, is_async=True, max_batch_diff=50)
    original = ElChe(ElCheSettings(world_size=3, **kw), epoch_batches=400)
    _drive(original, 9, 0)
    state = json.loads(json.dumps(original.state()))
    assert original.anchor != 8 or original.phase != Phase.PROBE  # the run moved on from its start
    for world in (2, 5):
        resized = ElChe.from_state(ElCheSettings(world_size=world, **kw), state, epoch_batches=400)
        assert (resized.anchor, resized.phase, resized.calibration_count) == (
            original.anchor,
            original.phase,
            original.calibration_count,
        )
        assert resized.overshoot == original.overshoot and resized.growth_enabled == original.growth_enabled
        # No rank keeps a speed: each starts at the anchor's count, the anchor rank elected again.
        assert resized.members == set(range(world)) and resized.anchor_rank is None
        assert [resized.smoothed_ms(r) for r in range(world)] == [None] * world
        assert resized.counts() == [original.anchor] * world


def test_settings_validation():
    with pytest.raises(ValueError):
        ElCheSettings(world_size=0)
    with pytest.raises(ValueError):
        ElCheSettings(world_size=2, max_batch_diff=-1)
    assert ElCheSettings(world_size=2, overhead_target=0.9).target == 0.5
    assert ElCheSettings(world_size=2, overhead_target=0.001).target == 0.01


# --- properties --------------------------------------------------------------------------------

ms_lists = st.lists(st.floats(0.05, 5000.0, allow_nan=False), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(ms=ms_lists, anchor=st.integers(1, 200))
def test_counts_properties(ms, anchor):
    el = make(world=len(ms), anchor=anchor)
    feed(el, ms)
    counts = el.counts()
    assert all(c >= 1 for c in counts)
    b = el.anchor_rank
    assert counts[b] == anchor
    assert ms[b] >= max(ms) * 0.85 - 1e-9  # the anchor comes from the slow cohort
    slowest = ms.index(max(ms))
    if all(m < max(ms) * 0.85 for i, m in enumerate(ms) if i != slowest):
        assert b == slowest
    for i in range(len(ms)):
        for j in range(len(ms)):
            if ms[i] < ms[j]:
                assert counts[i] >= counts[j]  # faster never gets fewer
        assert counts[i] <= anchor * 64


@settings(max_examples=200, deadline=None)
@given(ms=ms_lists, anchor=st.integers(1, 200), cap=st.integers(1, 3000))
def test_epoch_cap_property(ms, anchor, cap):
    cap = max(cap, len(ms))  # with more ranks than batches the floor of 1 wins, as in the original
    el = make(world=len(ms), anchor=anchor, epoch_batches=cap)
    feed(el, ms, times=2)
    counts = el.counts()
    assert sum(counts) <= cap and all(c >= 1 for c in counts)


# --- what a round costs the anchor ---------------------------------------------------------------


def test_round_overhead_is_the_reduce_when_the_control_plane_is_free():
    # Both ranks idled about as long as the reduce held them: the reduce is the cost.
    assert round_overhead_ms([2.0, 3.0], [2.5, 3.5]) == 3.0


def test_round_overhead_counts_message_latency_the_reduce_time_misses():
    # The reduce took 1 ms but each window lost 8-9 ms to messages and dispatch: 8 ms (the least idle).
    assert round_overhead_ms([1.0, 1.0], [9.0, 8.0]) == 8.0


def test_waiting_for_a_slow_peer_is_not_counted_as_round_overhead():
    # Rank 0 waited 40 ms for rank 1; rank 1's own window lost 5 ms: the anchor amortizes 5, not 40.
    assert round_overhead_ms([1.0, 1.0], [40.0, 5.0]) == 5.0


def test_round_overhead_needs_one_entry_per_rank():
    with pytest.raises(ValueError, match="one round time and one idle time per rank"):
        round_overhead_ms([1.0, 2.0], [3.0])


def test_idle_overhead_grows_the_anchor_where_the_reduce_time_alone_would_not():
    quiet, chatty = make(anchor=10), make(anchor=10)
    for el in (quiet, chatty):
        to_stable(el, [10.0, 10.0])
    # 10 ms steps x anchor 10 = 100 ms windows; the reduce takes 1 ms (1%), the whole round 20 ms (~17%).
    feed(quiet, [10.0, 10.0], reduce_ms=round_overhead_ms([1.0, 1.0], [1.0, 1.0]))
    feed(chatty, [10.0, 10.0], reduce_ms=round_overhead_ms([1.0, 1.0], [20.0, 22.0]))
    assert quiet.proposed_anchor is None
    assert chatty.proposed_anchor is not None and chatty.proposed_anchor > 10


# --- members (fault_tolerance=survive) ---------------------------------------------------------


def feed_members(el: ElChe, ms: dict[int, float], times: int = 1, n: int = 10) -> None:
    """Report windows as the driver does: one entry per member, in rank order."""
    assert sorted(ms) == sorted(el.members)
    for _ in range(times):
        el.report_timing([ms[r] * n for r in sorted(ms)], [n] * len(ms))


def test_a_retired_rank_gets_nothing_and_the_others_keep_their_balance():
    el = make(world=3, anchor=10)
    feed(el, [10.0, 20.0, 40.0])
    assert el.counts() == [40, 20, 10]
    el.retire(1)
    assert el.members == {0, 2}
    assert el.counts() == [40, 0, 10]
    feed_members(el, {0: 10.0, 2: 40.0}, times=3)
    assert el.counts() == [40, 0, 10]
    with pytest.raises(ValueError, match="one entry per rank"):
        el.report_timing([100.0, 200.0, 400.0], [10, 10, 10])


def test_retiring_the_slowest_rank_hands_the_anchor_to_the_slowest_left():
    el = make(world=3, anchor=10)
    to_stable(el, [10.0, 20.0, 40.0])
    assert el.anchor_rank == 2
    el.retire(2)
    assert el.anchor_rank == 1
    assert el.counts() == [20, 10, 0]  # balanced on rank 1 now: the window is half as long
    feed_members(el, {0: 10.0, 1: 20.0}, times=3)
    assert el.counts() == [20, 10, 0] and el.anchor_rank == 1


def test_a_pinned_anchor_that_is_retired_is_replaced_at_once():
    el = make(world=3, anchor=10, anchor_rank=2)
    feed(el, [10.0, 20.0, 40.0])
    el.retire(2)
    assert el.anchor_rank == 1 and el.counts() == [20, 10, 0]


def test_an_admitted_rank_starts_at_the_anchor_s_count_then_gets_its_own():
    el = make(world=3, anchor=10)
    feed(el, [10.0, 20.0, 40.0])
    el.retire(0)
    feed_members(el, {1: 20.0, 2: 40.0})
    el.admit(0)
    assert el.members == {0, 1, 2}
    # No speed yet: the share every rank has before its first reading, not 0 and not everything.
    assert el.counts() == [10, 20, 10]
    assert el.smoothed_ms(0) is None  # the old process's speed is not the new one's
    feed_members(el, {0: 5.0, 1: 20.0, 2: 40.0})
    assert el.counts() == [80, 20, 10]
    with pytest.raises(ValueError, match="already a member"):
        el.admit(0)


def test_timing_can_name_its_ranks_when_a_member_was_admitted_after_the_window_opened():
    el = make(world=3, anchor=10)
    feed(el, [10.0, 20.0, 40.0])
    el.retire(0)
    el.admit(0)  # the window that is closing was trained by ranks 1 and 2 only
    el.report_timing([200.0, 400.0], [10, 10], ranks=[1, 2])
    assert el.counts() == [10, 20, 10] and el.smoothed_ms(0) is None
    el.retire(1)
    with pytest.raises(ValueError, match="no members"):
        el.report_timing([100.0, 200.0], [10, 10], ranks=[1, 2])


def test_the_epoch_cap_is_shared_by_the_members_only():
    el = make(world=3, anchor=10, epoch_batches=25)
    feed(el, [10.0, 30.0, 30.0])
    el.retire(2)
    assert el.counts() == [19, 6, 0]


def test_the_last_member_is_never_retired():
    el = make(world=2)
    el.retire(0)
    with pytest.raises(ValueError, match="last member"):
        el.retire(1)
    with pytest.raises(ValueError, match="not a member"):
        el.retire(0)


def test_a_resumed_job_starts_with_every_rank_it_launches_a_cut_one_measured_afresh():
    """The saved members were the old job's processes: a resume's members are the ranks it starts with. One
    cut before the checkpoint starts at the anchor's count, the others keep their balance."""
    kw = dict(world_size=3, anchor=8)
    el = ElChe(ElCheSettings(**kw))
    feed(el, [10.0, 20.0, 40.0])
    el.retire(1)
    state = json.loads(json.dumps(el.state()))
    assert state["members"] == [0, 2] and el.counts() == [32, 0, 8]
    resumed = ElChe.from_state(ElCheSettings(**kw), state)
    assert resumed.members == {0, 1, 2} and resumed.counts() == [32, 8, 8]
    assert resumed.smoothed_ms(1) is None
    feed(resumed, [10.0, 20.0, 40.0])
    assert resumed.counts() == [32, 16, 8]
    del state["members"]  # a state saved before members existed: every rank was one
    assert ElChe.from_state(ElCheSettings(**kw), state).members == {0, 1, 2}


def test_a_job_started_with_fewer_ranks_than_seats_leaves_the_rest_to_joiners():
    """Seats past the first members get no counts until a rank joins in one (launch.max_ranks)."""
    el = ElChe(ElCheSettings(world_size=4, anchor=8), first_members=2)
    assert el.members == {0, 1} and el.counts() == [8, 8, 0, 0]
    el.admit(3)
    assert el.members == {0, 1, 3} and el.counts() == [8, 8, 0, 8]
    resumed = ElChe.from_state(ElCheSettings(world_size=4, anchor=8), el.state(), first_members=3)
    assert resumed.members == {0, 1, 2} and resumed.counts() == [8, 8, 8, 0]
