"""Async under survive: while a round waits on a silent member, the members that reached their count are
handed more of the segment (rounds/supply.py), by the coordinator's driver on its tick."""

from __future__ import annotations

import pytest
from torch.distributed import HashStore

from flodl.coordinator.ledger import EpochLedger
from flodl.coordinator.local_sgd_driver import LocalSgdDriver
from flodl.coordinator.roster import Roster
from flodl.links.heartbeat import HeartbeatMonitor
from flodl.links.messages import AverageNow, EpochSlice, ExtendPartition, Reached, RoundAck, decode
from flodl.links.transport import Mailbox, inbox
from flodl.metrics.timeline import Timeline
from flodl.rounds.elche import ElChe, ElCheSettings
from flodl.rounds.guard import make_guard
from flodl.rounds.orders import Average, Dispatch, WindowReport
from flodl.rounds.planner import LocalSgdPlanner
from flodl.rounds.supply import SUSPECT_BEATS, Supplied, top_up


def reach(planner: LocalSgdPlanner, rank: int, steps: int) -> list:
    return planner.on_reached(WindowReport(rank, steps, float(steps)))


def test_a_member_that_reached_is_handed_the_next_batches_and_the_round_then_weighs_what_it_did():
    planner = LocalSgdPlanner(3, 10, 2, 2, True, frozenset())
    planner.open_window([2, 2, 2], 1)  # picks [0, 18): 3 batches a rank, one batch of epoch 0 left
    assert top_up(planner, 0, 4) is None  # not reached: its count is what it still trains to
    assert reach(planner, 0, 2) == []
    assert top_up(planner, 0, 4) == Dispatch(0, (EpochSlice(0, 18, 2), EpochSlice(1, 0, 6)), None)
    assert planner.queued[0] == 7
    assert reach(planner, 1, 2) == []
    # Rank 2 stays silent until it is cut: the round fires among the others, and no more top-ups come.
    assert planner.drop(2) == [Average(1, (), False)]
    assert top_up(planner, 1, 4) is None


def test_a_top_up_that_takes_the_segment_s_last_batches_makes_the_next_round_the_exact_last():
    planner = LocalSgdPlanner(2, 10, 1, 1, True, frozenset())
    planner.open_window([3, 3], 0)  # 4 batches left
    assert reach(planner, 0, 3) == []
    assert top_up(planner, 0, 100) == Dispatch(0, (EpochSlice(0, 6, 4),), None)
    assert planner.exhausted and top_up(planner, 0, 1) is None
    # Rank 0 holds 4 past its count: this round is not the last; the next window holds both to all they hold.
    assert reach(planner, 1, 3) == [Average(1, (), False)]
    planner.on_ack(RoundAck(0, 0, 1, False, 0.0, 0.0, 4))
    planner.on_ack(RoundAck(1, 0, 1, False, 0.0, 0.0, 0))
    assert [(d.slices, d.target) for d in planner.open_window([3, 3], 0)] == [((), 4), ((), 0)]


def test_cadence_windows_are_never_topped_up():
    planner = LocalSgdPlanner(2, 20, 1, 1, False, frozenset())
    planner.open_window([3, 3], 0)
    assert reach(planner, 0, 3) == []
    assert top_up(planner, 0, 2) is None


def test_a_top_up_is_due_once_less_than_a_heartbeat_of_work_is_left():
    supplied = Supplied(beat_s=0.25)
    assert supplied.due(0, now=10.0)
    assert supplied.batches(ms_per_batch=2.0) == round(SUSPECT_BEATS * 250 / 2.0)
    supplied.handed(0, now=10.0, batches=250, ms_per_batch=2.0)  # work until 10.5
    assert not supplied.due(0, now=10.2) and supplied.due(0, now=10.3)
    supplied.handed(0, now=10.3, batches=100, ms_per_batch=2.0)  # on top of what it holds: until 10.7
    assert supplied.until[0] == pytest.approx(10.7)
    supplied.clear()
    assert supplied.due(0, now=10.3)


class Coordinator:
    """The local-SGD driver of 3 async ranks under survive, its roster's heartbeats on a clock we set."""

    def __init__(self) -> None:
        self.store = HashStore()
        outbox = Mailbox(self.store, "coordinator")
        self.planner = LocalSgdPlanner(3, 200, 1, 5, True, frozenset())
        self.elche = ElChe(ElCheSettings(world_size=3, anchor=3, is_async=True), epoch_batches=200)
        self.monitor = HeartbeatMonitor(3, timeout_s=2.0, started=0.0)
        roster = Roster(3, outbox, self.monitor)
        self.supplied = Supplied(beat_s=0.25)
        self.driver = LocalSgdDriver(
            self.planner,
            self.elche,
            make_guard("none", None, False),
            EpochLedger(5, 3, 200, local_sgd=True),
            outbox,
            Timeline(3),
            roster,
            supplied=self.supplied,
        )

    def read(self, rank: int) -> list[ExtendPartition]:
        messages = []
        while self.store.queue_len(inbox(rank)):
            messages.append(decode(self.store.queue_pop(inbox(rank), block=False)))
        return messages

    def tick(self, now: float, silent: tuple[int, ...] = ()) -> None:
        """The driver's tick at `now`, every member but `silent` heard just before it."""
        for rank in set(range(3)) - set(silent):
            self.monitor.heard(rank, now)
        self.driver.keep_supplied(self.supplied, now)


def test_the_driver_tops_up_the_members_that_reached_only_while_one_it_waits_on_is_silent():
    c = Coordinator()
    c.elche.report_timing([8.0, 8.0, 8.0], [4, 4, 4])  # 2 ms a batch each
    c.driver.begin()
    counts = {r: c.read(r)[0].target for r in range(3)}
    for rank in (0, 1):
        c.driver.on_message(Reached(rank, counts[rank], 1.0))
    for rank in range(3):
        c.monitor.heard(rank, 1.0)
    c.tick(1.0 + SUSPECT_BEATS * 0.25 - 0.01, silent=(2,))  # rank 2 is late, not silent yet: they wait
    assert [c.read(r) for r in range(3)] == [[], [], []]
    c.tick(1.0 + SUSPECT_BEATS * 0.25 + 0.01, silent=(2,))
    topped = {r: c.read(r) for r in range(3)}
    assert topped[2] == []
    for rank in (0, 1):
        (message,) = topped[rank]
        assert message.target is None  # slices only: their counts are reached
        assert sum(s.size for s in message.slices) == c.supplied.batches(2.0)
    c.tick(
        1.0 + SUSPECT_BEATS * 0.25 + 0.05, silent=(2,)
    )  # a heartbeat's work is still left: nothing more yet
    assert [c.read(r) for r in range(3)] == [[], [], []]
    # Rank 2 speaks again (it was slow, not gone) and reaches: the round fires, the top-ups stop.
    c.monitor.heard(2, 1.6)
    c.driver.on_message(Reached(2, counts[2], 1.0))
    assert all(isinstance(c.read(r)[-1], AverageNow) for r in range(3))
    c.tick(5.0)
    assert [c.read(r) for r in range(3)] == [[], [], []] and c.supplied.until == {}


def test_a_round_waits_for_a_member_that_reached_and_went_silent_and_the_others_train_on():
    """A member that reached its count and then froze: firing the round would hold every other member inside
    its collective until the cut. The round waits instead, the others are topped up, and it fires once the
    silent one speaks again or is cut."""
    for ending in ("heard again", "cut"):
        c = Coordinator()
        c.elche.report_timing([8.0, 8.0, 8.0], [4, 4, 4])  # 2 ms a batch each
        c.driver.begin()
        counts = {r: c.read(r)[0].target for r in range(3)}
        c.driver.on_message(Reached(2, counts[2], 1.0))  # rank 2 reaches first, then goes silent
        for rank in range(3):
            c.monitor.heard(rank, 1.0)
        late = 1.0 + SUSPECT_BEATS * 0.25 + 0.01
        c.tick(late, silent=(2,))
        for rank in (0, 1):
            c.driver.on_message(Reached(rank, counts[rank], 1.0))
        assert [c.read(r) for r in range(3)] == [[], [], []]  # every count reached, no round yet
        c.tick(late + 0.5, silent=(2,))
        topped = {r: c.read(r) for r in range(3)}
        assert topped[2] == [] and all(len(topped[r]) == 1 and topped[r][0].target is None for r in (0, 1))
        if ending == "heard again":
            c.tick(late + 0.6)
            assert all(isinstance(c.read(r)[-1], AverageNow) for r in range(3))
        else:
            c.driver.on_cut([2])
            orders = {r: c.read(r) for r in (0, 1)}
            assert all(any(isinstance(m, AverageNow) for m in orders[r]) for r in (0, 1))
        assert c.planner.averaging


def test_a_host_that_hears_nobody_holds_no_round():
    """Every member silent at once is this host behind on its reading (a busy box), not every member frozen:
    the round fires as it would."""
    c = Coordinator()
    c.elche.report_timing([8.0, 8.0, 8.0], [4, 4, 4])
    c.driver.begin()
    counts = {r: c.read(r)[0].target for r in range(3)}
    for rank in range(3):
        c.monitor.heard(rank, 1.0)
    c.driver.keep_supplied(c.supplied, 5.0)
    for rank in range(3):
        c.driver.on_message(Reached(rank, counts[rank], 1.0))
    assert all(isinstance(c.read(r)[-1], AverageNow) for r in range(3))
