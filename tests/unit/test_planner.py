"""Local-SGD window planner (cadence / async) and the proportional split, driven by fake ranks."""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.links.messages import EpochSlice, RoundAck
from flodl.rounds.orders import Average, Dispatch, WindowReport
from flodl.rounds.planner import LocalSgdPlanner
from flodl.rounds.split import balanced_split, proportional_split
from tests.helpers.planner_batches import Batch, all_batches, expand, settled

# --- a coordinator with fake ranks ---------------------------------------------------------------


@dataclass
class FakeRank:
    """Trains its queue in order; reports Reached once `steps` (since the last reduce) >= target."""

    rank: int
    queue: deque[Batch] = field(default_factory=deque)
    steps: int = 0
    # None: nothing to report (already reported this window, or no window open).
    target: int | None = None


@dataclass
class WindowLog:
    counts: list[int]
    overshoot: int
    # What each rank had queued at the previous ack (the planner's view when the window opens).
    queued_at_ack: list[int]
    # The steps each rank carried out of the previous round into this window (RoundAck.steps_during_round).
    carried_at_ack: list[int]
    # Batches handed out before this window (the cursor, as a global batch index).
    cursor_before: int
    dispatches: list[Dispatch]
    average: Average | None = None
    # Epochs completed when the Average was returned.
    completed_at_average: frozenset[int] = frozenset()
    # Batches handed out once every rank was served, and what each rank still held untrained at the Average.
    cursor_after: int = 0
    queued_at_average: list[int] = field(default_factory=list)


def given_batches(dispatch: Dispatch, batch_size: int) -> int:
    return sum(s.size for s in dispatch.slices) // batch_size


class Simulator:
    """Drives a LocalSgdPlanner the way the coordinator does, with fake ranks.

    `counts` are cycled one vector per window. Async ranks may train up to `max_extra` steps past
    their target while the Average is on its way, up to `max_carried` steps while the round is in flight
    (the cpu backend: those count toward the next window), and up to `max_after_ack` steps between their
    ack and the next window's dispatch; the interleaving of ranks is drawn from `rng`.
    """

    def __init__(
        self,
        *,
        world_size: int,
        batches_per_epoch: int,
        batch_size: int,
        epochs: int,
        is_async: bool,
        counts: list[list[int]],
        overshoot: int = 0,
        eval_epochs: frozenset[int] | set[int] = frozenset(),
        max_extra: int = 0,
        max_after_ack: int = 0,
        max_carried: int = 0,
        rng: random.Random | None = None,
    ) -> None:
        self.world_size = world_size
        self.bpe = batches_per_epoch
        self.batch_size = batch_size
        self.epochs = epochs
        self.is_async = is_async
        self.counts = counts
        self.overshoot = overshoot
        self.eval_epochs = frozenset(eval_epochs)
        self.max_extra = max_extra if is_async else 0
        self.max_after_ack = max_after_ack if is_async else 0
        self.max_carried = max_carried if is_async else 0
        self.rng = rng or random.Random(0)
        self.planner = LocalSgdPlanner(
            world_size=world_size,
            batches_per_epoch=batches_per_epoch,
            batch_size=batch_size,
            epochs=epochs,
            is_async=is_async,
            eval_epochs=self.eval_epochs,
        )
        self.ranks = [FakeRank(r) for r in range(world_size)]
        self.dispatched: Counter[Batch] = Counter()
        self.trained: Counter[Batch] = Counter()
        self.trained_in_epoch: Counter[int] = Counter()
        self.completed: list[int] = []
        self.windows: list[WindowLog] = []
        self.queued_at_ack = [0] * world_size
        self.carried_at_ack = [0] * world_size
        self.reports = 0

    @property
    def total(self) -> int:
        return self.bpe * self.epochs

    # -- rank side --

    def step(self, rank: FakeRank) -> None:
        batch = rank.queue.popleft()
        self.trained[batch] += 1
        rank.steps += 1
        epoch = batch[0]
        self.trained_in_epoch[epoch] += 1
        if self.trained_in_epoch[epoch] == self.bpe:  # every batch of the epoch trained
            self.completed.append(epoch)
            self.planner.on_epoch_complete(epoch)

    def report_if_reached(self, rank: FakeRank) -> Average | None:
        if rank.target is None or rank.steps < rank.target:
            return None
        rank.target = None
        self.reports += 1
        instructions = self.planner.on_reached(WindowReport(rank.rank, rank.steps, float(rank.steps)))
        if self.reports < self.world_size:
            assert instructions == [], f"averaged after {self.reports}/{self.world_size} reports"
            return None
        assert len(instructions) == 1 and isinstance(instructions[0], Average), instructions
        return instructions[0]

    # -- coordinator side --

    def run_window(self) -> WindowLog:
        counts = list(self.counts[len(self.windows) % len(self.counts)])
        queued, carried = list(self.queued_at_ack), list(self.carried_at_ack)
        log = WindowLog(counts, self.overshoot, queued, carried, sum(self.dispatched.values()), [])
        self.windows.append(log)
        instructions = self.planner.open_window(counts, self.overshoot)
        assert [type(a) for a in instructions] == [Dispatch] * self.world_size, instructions
        assert [a.rank for a in instructions] == list(range(self.world_size))
        log.dispatches = list(instructions)
        for dispatch in instructions:
            rank = self.ranks[dispatch.rank]
            for piece in dispatch.slices:
                for batch in expand(piece, self.batch_size):
                    self.dispatched[batch] += 1
                    rank.queue.append(batch)
            rank.target = dispatch.target
            if not self.is_async:  # cadence: the rank holds exactly its window, nothing else
                assert len(rank.queue) == dispatch.target

        self.reports = 0
        average = None
        for rank in self.rng.sample(self.ranks, len(self.ranks)):  # a target already met reports at once
            average = self.report_if_reached(rank) or average
        extra = [self.rng.randint(0, self.max_extra) for _ in self.ranks]
        while average is None:
            waiting = [r for r in self.ranks if r.target is not None]
            stuck = [r.rank for r in waiting if not r.queue]
            assert not stuck, f"ranks {stuck} can never reach their target"
            busy = waiting + [r for r in self.ranks if r.target is None and extra[r.rank] > 0 and r.queue]
            rank = self.rng.choice(busy)
            if rank.target is None:
                extra[rank.rank] -= 1  # async overshoot past the target, before the Average
            self.step(rank)
            average = self.report_if_reached(rank)
        log.average = average
        log.completed_at_average = frozenset(self.completed)
        log.cursor_after = sum(self.dispatched.values())
        log.queued_at_average = [len(r.queue) for r in self.ranks]

        for rank in self.ranks:  # the Average is on its way: an async rank keeps training
            while extra[rank.rank] > 0 and rank.queue:
                extra[rank.rank] -= 1
                self.step(rank)
        order = self.rng.sample(self.ranks, len(self.ranks))
        for i, rank in enumerate(order):
            assert not self.planner.finished, "finished before every rank acked"
            snapshot = rank.steps  # what the round averages; steps while it is in flight are carried
            for _ in range(self.rng.randint(0, self.max_carried)):
                if rank.queue:
                    self.step(rank)
            carried = rank.steps - snapshot
            ack = RoundAck(
                rank.rank, 0, snapshot, False, 0.0, 0.0, len(rank.queue), steps_during_round=carried
            )
            self.queued_at_ack[rank.rank] = len(rank.queue)
            self.carried_at_ack[rank.rank] = carried
            rank.steps = carried
            assert self.planner.on_ack(ack) is (i == self.world_size - 1)
        assert self.planner.finished is average.final
        for rank in self.ranks:  # async: training goes on until the next window's dispatch
            for _ in range(self.rng.randint(0, self.max_after_ack)):
                if rank.queue:
                    self.step(rank)
        return log

    def run(self, max_windows: int) -> list[WindowLog]:
        while not self.planner.finished:
            assert len(self.windows) < max_windows, "the run did not terminate"
            self.run_window()
        return self.windows


def window_bound(sim: Simulator) -> int:
    # Cadence: every window hands out >= 1 batch. Async: every window but the final trains >= 1.
    return sim.total if not sim.is_async else sim.total + 1


# --- per-window checks ---------------------------------------------------------------------------


def check_cadence_window(log: WindowLog, bpe: int, batch_size: int) -> None:
    epoch, start = divmod(log.cursor_before, bpe)
    left = bpe - start
    given = [given_batches(d, batch_size) for d in log.dispatches]
    if sum(log.counts) < left:
        assert given == log.counts
    else:  # the epoch's last window: the remainder, in proportion to the counts
        assert given == proportional_split(left, log.counts)
        assert sum(given) == left
    position = start
    for dispatch, n in zip(log.dispatches, given, strict=True):
        assert dispatch.target == n
        assert len(dispatch.slices) == (1 if n else 0)
        for piece in dispatch.slices:  # one epoch, contiguous in cursor order
            assert piece == EpochSlice(epoch, position * batch_size, n * batch_size)
        position += n


def check_async_window(log: WindowLog, total: int, bpe: int, batch_size: int) -> None:
    cursor = log.cursor_before
    wants = [max(0, c + log.overshoot - q) for c, q in zip(log.counts, log.queued_at_ack, strict=True)]
    if sum(wants) > total - cursor:  # the tail: what each rank then holds in proportion to its count
        wants = balanced_split(total - cursor, log.counts, log.queued_at_ack)
    for dispatch, n in zip(log.dispatches, wants, strict=True):
        batches = [b for piece in dispatch.slices for b in expand(piece, batch_size)]
        assert batches == [divmod(g, bpe) for g in range(cursor, cursor + n)]
        # One slice per epoch touched (a slice never straddles an epoch boundary).
        assert [s.epoch for s in dispatch.slices] == sorted({e for e, _ in batches})
        cursor += n
    # Targets are set once every rank is served: when any rank's take ran the data out, all train out.
    for rank, dispatch in enumerate(log.dispatches):
        holds = log.queued_at_ack[rank] + log.carried_at_ack[rank] + given_batches(dispatch, batch_size)
        expected = holds if cursor == total else min(log.counts[rank], holds)
        assert dispatch.target == expected, (rank, log)


def check_evals(sim: Simulator) -> None:
    """At each Average: every settled wanted epoch not yet evaluated (a completed epoch waits for the ones
    before it; final: every wanted one left), so each wanted epoch gets exactly one eval."""
    evaluated: set[int] = set()
    for log in sim.windows:
        assert log.average is not None
        if log.average.final:
            due = sorted(sim.eval_epochs - evaluated)
        else:
            due = sorted(e for e in sim.eval_epochs - evaluated if e < settled(log.completed_at_average))
        assert log.average.evaluate_epochs == tuple(due), (log, evaluated)
        evaluated |= set(due)
    assert evaluated == sim.eval_epochs


def check_run(sim: Simulator) -> None:
    everything = all_batches(sim.epochs, sim.bpe)
    assert set(sim.dispatched) == everything and set(sim.dispatched.values()) == {1}
    assert set(sim.trained) == everything and set(sim.trained.values()) == {1}
    assert all(not r.queue for r in sim.ranks)
    assert sorted(sim.completed) == list(range(sim.epochs))
    averages = [w.average for w in sim.windows]
    assert [a.round for a in averages] == list(range(1, len(averages) + 1))
    assert [a.final for a in averages] == [False] * (len(averages) - 1) + [True]
    assert sim.windows[-1].completed_at_average == frozenset(range(sim.epochs))
    assert sim.planner.finished
    for log in sim.windows:
        if sim.is_async:
            check_async_window(log, sim.total, sim.bpe, sim.batch_size)
        else:
            check_cadence_window(log, sim.bpe, sim.batch_size)
    check_evals(sim)


@st.composite
def runs(draw, is_async: bool) -> Simulator:
    world_size = draw(st.integers(1, 4))
    epochs = draw(st.integers(1, 4))
    counts = draw(
        st.lists(
            st.lists(st.integers(1, 20), min_size=world_size, max_size=world_size), min_size=1, max_size=6
        )
    )
    return Simulator(
        world_size=world_size,
        batches_per_epoch=draw(st.integers(1, 60)),
        batch_size=draw(st.integers(1, 8)),
        epochs=epochs,
        is_async=is_async,
        counts=counts,
        overshoot=draw(st.integers(0, 5)) if is_async else 0,
        eval_epochs=draw(st.frozensets(st.integers(0, epochs - 1))),
        max_extra=draw(st.integers(0, 5)),
        max_after_ack=draw(st.integers(0, 3)),
        max_carried=draw(st.integers(0, 3)),
        rng=draw(st.randoms(use_true_random=False)),
    )


# --- 1. coverage ---------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(sim=runs(is_async=False))
def test_cadence_trains_every_batch_exactly_once(sim):
    sim.run(window_bound(sim))
    check_run(sim)


@settings(max_examples=300, deadline=None)
@given(sim=runs(is_async=True))
def test_async_trains_every_batch_exactly_once(sim):
    sim.run(window_bound(sim))
    check_run(sim)


@pytest.mark.parametrize("is_async", [False, True])
def test_one_rank_one_batch_one_epoch(is_async):
    sim = Simulator(
        world_size=1, batches_per_epoch=1, batch_size=3, epochs=1, is_async=is_async, counts=[[5]]
    )
    sim.run(2)
    check_run(sim)
    assert sim.windows[0].dispatches == [Dispatch(0, (EpochSlice(0, 0, 3),), 1)]
    assert sim.windows[0].average == Average(1, (), True)


@pytest.mark.parametrize("is_async", [False, True])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_stop_ends_the_run_at_an_epoch_boundary_with_every_handed_out_batch_trained_once(is_async, data):
    sim = data.draw(runs(is_async=is_async))
    before = data.draw(st.integers(1, 3))
    while not sim.planner.finished and len(sim.windows) < before:
        sim.run_window()
    if sim.planner.finished:  # a stop asked once the run is over changes nothing
        assert sim.planner.stop() == sim.epochs - 1 and sim.planner.finished
        return
    handed_out = set(sim.dispatched)
    last = sim.planner.stop()
    sim.run(2 * window_bound(sim))
    kept = all_batches(last + 1, sim.bpe)
    assert handed_out <= kept  # nothing handed out is dropped, so no rank trains past the stop
    assert set(sim.dispatched) == kept and set(sim.dispatched.values()) == {1}
    assert set(sim.trained) == kept and set(sim.trained.values()) == {1}
    assert all(not r.queue for r in sim.ranks) and sorted(sim.completed) == list(range(last + 1))
    assert [w.average.final for w in sim.windows].count(True) == 1 and sim.windows[-1].average.final
    # The stop lands at the first boundary past what was handed out: a later one would train more.
    assert last == max(e for e, _ in handed_out)


# --- 2. cadence windows --------------------------------------------------------------------------


def test_cadence_hands_out_counts_then_splits_the_epoch_tail():
    sim = Simulator(
        world_size=3, batches_per_epoch=10, batch_size=4, epochs=2, is_async=False, counts=[[2, 3, 1]]
    )
    sim.run(10)
    check_run(sim)
    first, second, third = sim.windows[:3]
    assert first.dispatches == [
        Dispatch(0, (EpochSlice(0, 0, 8),), 2),
        Dispatch(1, (EpochSlice(0, 8, 12),), 3),
        Dispatch(2, (EpochSlice(0, 20, 4),), 1),
    ]
    # 4 batches left, counts sum to 6: split 4 by [2, 3, 1] -> [1.33, 2, 0.67] -> [1, 2, 1].
    assert second.dispatches == [
        Dispatch(0, (EpochSlice(0, 24, 4),), 1),
        Dispatch(1, (EpochSlice(0, 28, 8),), 2),
        Dispatch(2, (EpochSlice(0, 36, 4),), 1),
    ]
    # The next epoch starts on a window of its own (the epoch barrier).
    assert third.dispatches[0] == Dispatch(0, (EpochSlice(1, 0, 8),), 2)
    assert len(sim.windows) == 4
    assert [w.average.final for w in sim.windows] == [False, False, False, True]


def test_cadence_window_never_crosses_an_epoch_even_with_large_counts():
    sim = Simulator(
        world_size=2, batches_per_epoch=3, batch_size=2, epochs=3, is_async=False, counts=[[20, 20]]
    )
    sim.run(3)
    check_run(sim)
    for epoch, log in enumerate(sim.windows):
        # split 3 by [20, 20] -> [1.5, 1.5]: the tie goes to rank 0.
        assert log.dispatches == [
            Dispatch(0, (EpochSlice(epoch, 0, 4),), 2),
            Dispatch(1, (EpochSlice(epoch, 4, 2),), 1),
        ]


def test_cadence_tail_smaller_than_world_leaves_ranks_idle():
    sim = Simulator(
        world_size=4, batches_per_epoch=6, batch_size=1, epochs=1, is_async=False, counts=[[1, 1, 1, 1]]
    )
    sim.run(2)
    check_run(sim)
    tail = sim.windows[1]
    assert tail.dispatches == [
        Dispatch(0, (EpochSlice(0, 4, 1),), 1),
        Dispatch(1, (EpochSlice(0, 5, 1),), 1),
        Dispatch(2, (), 0),
        Dispatch(3, (), 0),
    ]
    assert tail.average == Average(2, (), True)


def test_cadence_idle_ranks_report_with_zero_steps():
    planner = LocalSgdPlanner(4, 2, 1, 1, False, frozenset({0}))
    instructions = planner.open_window([3, 3, 3, 3], 0)
    assert [a.target for a in instructions] == [1, 1, 0, 0]
    assert planner.on_reached(WindowReport(2, 0, 0.0)) == []
    assert planner.on_reached(WindowReport(3, 0, 0.0)) == []
    assert planner.on_reached(WindowReport(0, 1, 1.0)) == []
    planner.on_epoch_complete(0)
    assert planner.on_reached(WindowReport(1, 1, 1.0)) == [Average(1, (0,), True)]


@settings(max_examples=200, deadline=None)
@given(
    bpe=st.integers(1, 60),
    world_size=st.integers(1, 4),
    data=st.data(),
)
def test_cadence_last_window_follows_proportional_split(bpe, world_size, data):
    counts = data.draw(st.lists(st.integers(1, 20), min_size=world_size, max_size=world_size))
    sim = Simulator(
        world_size=world_size, batches_per_epoch=bpe, batch_size=1, epochs=1, is_async=False, counts=[counts]
    )
    sim.run(bpe)
    last = sim.windows[-1]
    left = bpe - last.cursor_before
    assert 0 < left <= sum(counts)
    assert [d.target for d in last.dispatches] == proportional_split(left, counts)
    for log in sim.windows[:-1]:
        assert [d.target for d in log.dispatches] == counts


# --- 3. async windows ----------------------------------------------------------------------------


def test_async_window_by_hand():
    """2 ranks, 5 batches per epoch, 2 epochs, counts [2, 3], overshoot 1; ranks train just their target."""
    planner = LocalSgdPlanner(2, 5, 2, 2, True, frozenset({0, 1}))
    first = planner.open_window([2, 3], 1)
    assert first == [
        Dispatch(0, (EpochSlice(0, 0, 6),), 2),  # 2 + 1 batches, target 2
        Dispatch(1, (EpochSlice(0, 6, 4), EpochSlice(1, 0, 4)), 3),  # runs into epoch 1
    ]
    assert planner.on_reached(WindowReport(1, 3, 1.0)) == []
    assert planner.on_reached(WindowReport(0, 2, 1.0)) == [Average(1, (), False)]
    assert not planner.on_ack(RoundAck(0, 0, 2, False, 0.0, 0.0, queued=1))
    assert planner.on_ack(RoundAck(1, 0, 3, False, 0.0, 0.0, queued=1))
    assert not planner.finished

    second = planner.open_window([2, 3], 1)
    # They ask for 2 + 1 - 1 and 3 + 1 - 1 batches; 3 are left, shared in proportion (1 and 2), not to the
    # first asker; the data ran out: every target is all the rank holds.
    assert second == [
        Dispatch(0, (EpochSlice(1, 4, 2),), 2),
        Dispatch(1, (EpochSlice(1, 6, 4),), 3),
    ]
    planner.on_epoch_complete(0)  # rank 0 trained (0, 2)
    assert planner.on_reached(WindowReport(1, 3, 1.0)) == []
    planner.on_epoch_complete(1)
    # Every rank trained all it held: this is the last reduce.
    assert planner.on_reached(WindowReport(0, 2, 1.0)) == [Average(2, (0, 1), True)]
    assert not planner.on_ack(RoundAck(1, 0, 3, False, 0.0, 0.0, queued=0))
    assert not planner.finished
    assert planner.on_ack(RoundAck(0, 0, 2, False, 0.0, 0.0, queued=0))
    assert planner.finished


def test_async_allocation_subtracts_queued_and_never_goes_negative():
    planner = LocalSgdPlanner(2, 100, 1, 1, True, frozenset())
    assert [a.target for a in planner.open_window([10, 4], 2)] == [10, 4]
    assert planner.on_reached(WindowReport(0, 10, 1.0)) == []
    assert len(planner.on_reached(WindowReport(1, 4, 1.0))) == 1
    planner.on_ack(RoundAck(0, 0, 10, False, 0.0, 0.0, queued=2))
    planner.on_ack(RoundAck(1, 0, 5, False, 0.0, 0.0, queued=1))
    # Rank 0: counts drop to 1, 1 + 0 - 2 < 0 -> nothing new; target min(1, 2).
    # Rank 1: 6 + 0 - 1 = 5 new, picks [18, 23); target min(6, 6).
    assert planner.open_window([1, 6], 0) == [
        Dispatch(0, (), 1),
        Dispatch(1, (EpochSlice(0, 18, 5),), 6),
    ]


def test_async_exhaustion_by_a_later_rank_drains_every_rank_in_the_same_window():
    """Rank 0 takes what is left of epoch 0, rank 1 runs the data out: both train out before the round."""
    sim = Simulator(
        world_size=2,
        batches_per_epoch=3,
        batch_size=1,
        epochs=2,
        is_async=True,
        counts=[[1, 1]],
        overshoot=2,
        eval_epochs={0, 1},
    )
    sim.run(1)
    check_run(sim)
    (only,) = sim.windows
    assert only.dispatches == [
        Dispatch(0, (EpochSlice(0, 0, 3),), 3),  # rank 1's take ran the data out: rank 0 trains all too
        Dispatch(1, (EpochSlice(1, 0, 3),), 3),
    ]
    # The first round is the exact last one: nobody's steps are blended into a round before it.
    assert only.average == Average(1, (0, 1), True)


@settings(max_examples=200, deadline=None)
@given(sim=runs(is_async=True))
def test_async_drains_once_the_data_runs_out(sim):
    sim.run(window_bound(sim))
    exhausted = [w for w in sim.windows if w.cursor_before == sim.total]
    for log in exhausted:  # opened with no data left: every target is everything queued
        assert all(d.slices == () for d in log.dispatches)
        assert [d.target for d in log.dispatches] == log.queued_at_ack
    # Once the data is gone it takes at most one more window to drain.
    assert len(exhausted) <= 1
    assert sim.windows[-1].average.final
    assert not any(w.average.final for w in sim.windows[:-1])


@settings(max_examples=300, deadline=None)
@given(
    speeds=st.tuples(st.integers(1, 12), st.integers(1, 12)),
    batches_per_epoch=st.integers(1, 40),
    epochs=st.integers(1, 3),
    overshoot=st.integers(0, 6),
    max_extra=st.integers(0, 6),
    max_carried=st.integers(0, 6),
    rng=st.randoms(use_true_random=False),
)
def test_async_last_round_weighs_every_rank_s_steps_since_the_round_before(
    speeds, batches_per_epoch, epochs, overshoot, max_extra, max_carried, rng
):
    """Two ranks at many speed pairs (ElChe's counts follow the speeds): the window whose dispatch runs the
    data out ends in the exact last round, taken once every rank has trained all it held, so its gamma
    weights count every step since the round before and no step is left to a blended round. Steps a rank
    carried out of the round before (trained while it was in flight) count toward that window, so they do
    not shorten what it trains before the last round."""
    sim = Simulator(
        world_size=2,
        batches_per_epoch=batches_per_epoch,
        batch_size=1,
        epochs=epochs,
        is_async=True,
        counts=[list(speeds)],
        overshoot=overshoot,
        max_extra=max_extra,
        max_carried=max_carried,
        rng=rng,
    )
    sim.run(window_bound(sim))
    check_run(sim)
    ran_out = next(i for i, w in enumerate(sim.windows) if w.cursor_after == sim.total)
    assert ran_out == len(sim.windows) - 1, "a round after the data ran out was not the last"
    assert sim.windows[-1].queued_at_average == [0, 0], "a rank still held batches at the last round"


@settings(max_examples=100, deadline=None)
@given(sim=runs(is_async=True))
def test_async_slices_may_cross_epochs(sim):
    sim.run(window_bound(sim))
    for log in sim.windows:
        for dispatch in log.dispatches:
            epochs = [s.epoch for s in dispatch.slices]
            if epochs:  # consecutive epochs, in order
                assert epochs == list(range(epochs[0], epochs[0] + len(epochs)))
            for inner in dispatch.slices[1:]:  # a later slice starts its epoch
                assert inner.offset == 0
            for outer in dispatch.slices[:-1]:  # an earlier slice ends its epoch
                assert outer.offset + outer.size == sim.bpe * sim.batch_size


def test_async_crosses_epochs_in_one_dispatch():
    planner = LocalSgdPlanner(1, 2, 4, 3, True, frozenset())
    assert planner.open_window([4], 1) == [
        Dispatch(0, (EpochSlice(0, 0, 8), EpochSlice(1, 0, 8), EpochSlice(2, 0, 4)), 4)
    ]


# --- 4. averaging once per window ----------------------------------------------------------------


def test_average_waits_for_every_rank_and_fires_once():
    planner = LocalSgdPlanner(3, 30, 1, 1, False, frozenset())
    for expected_round in (1, 2, 3):
        planner.open_window([2, 2, 2], 0)
        assert planner.on_reached(WindowReport(2, 2, 1.0)) == []
        assert planner.on_reached(WindowReport(2, 2, 1.0)) == []  # the same rank twice is still one
        assert planner.on_reached(WindowReport(0, 2, 1.0)) == []  # last but one
        assert planner.on_reached(WindowReport(1, 2, 1.0)) == [Average(expected_round, (), False)]
        assert planner.on_reached(WindowReport(1, 2, 1.0)) == []  # a late duplicate: no second Average
        for r in range(3):
            planner.on_ack(RoundAck(r, 0, 2, False, 0.0, 0.0, queued=0))
        assert not planner.finished


@pytest.mark.parametrize("is_async", [False, True])
def test_acks_complete_the_round_only_with_every_rank(is_async):
    planner = LocalSgdPlanner(3, 2, 1, 1, is_async, frozenset())
    planner.open_window([1, 1, 1], 0)
    for r in range(3):
        planner.on_reached(WindowReport(r, 1 if r < 2 else 0, 1.0))
    assert not planner.on_ack(RoundAck(0, 0, 1, False, 0.0, 0.0, queued=0))
    assert not planner.on_ack(RoundAck(0, 0, 1, False, 0.0, 0.0, queued=0))  # a repeat is still one
    assert not planner.on_ack(RoundAck(2, 0, 0, False, 0.0, 0.0, queued=0))
    assert not planner.finished
    assert planner.on_ack(RoundAck(1, 0, 1, False, 0.0, 0.0, queued=0))
    assert planner.finished


@pytest.mark.parametrize("is_async", [False, True])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_rounds_count_windows(is_async, data):
    sim = data.draw(runs(is_async=is_async))
    sim.run(window_bound(sim))
    assert [w.average.round for w in sim.windows] == list(range(1, len(sim.windows) + 1))
    assert sim.planner.round == len(sim.windows)


# --- 5. eval decisions ---------------------------------------------------------------------------


def epoch_ends(sim: Simulator) -> list[int | None]:
    """Per window: the epoch whose last batch it handed out (cadence), else None."""
    ends: list[int | None] = []
    for log in sim.windows:
        after = log.cursor_before + sum(given_batches(d, sim.batch_size) for d in log.dispatches)
        ends.append(after // sim.bpe - 1 if after % sim.bpe == 0 else None)
    return ends


@pytest.mark.parametrize("counts", [[[3, 1]], [[2, 5], [1, 1], [7, 3]]])
def test_cadence_evaluates_each_epoch_at_its_last_window(counts):
    sim = Simulator(
        world_size=2,
        batches_per_epoch=11,
        batch_size=2,
        epochs=4,
        is_async=False,
        counts=counts,
        eval_epochs=set(range(4)),
    )
    sim.run(sim.total)
    check_run(sim)
    assert [w.average.evaluate_epochs for w in sim.windows] == [
        () if e is None else (e,) for e in epoch_ends(sim)
    ]
    assert [e for e in epoch_ends(sim) if e is not None] == [0, 1, 2, 3]


@pytest.mark.parametrize(("epochs", "wanted"), [(4, {1, 3}), (5, {1, 3}), (5, {0}), (3, set())])
def test_cadence_evaluates_only_the_wanted_epochs(epochs, wanted):
    sim = Simulator(
        world_size=3,
        batches_per_epoch=7,
        batch_size=1,
        epochs=epochs,
        is_async=False,
        counts=[[1, 2, 1]],
        eval_epochs=wanted,
    )
    sim.run(sim.total)
    check_run(sim)
    expected = [(e,) if e in wanted else () for e in epoch_ends(sim)]
    assert [w.average.evaluate_epochs for w in sim.windows] == expected


def test_async_two_wanted_epochs_between_reduces_both_get_the_round_s_eval():
    planner = LocalSgdPlanner(1, 2, 1, 6, True, frozenset({0, 1, 5}))
    assert planner.open_window([1], 4) == [
        Dispatch(0, (EpochSlice(0, 0, 2), EpochSlice(1, 0, 2), EpochSlice(2, 0, 1)), 1)
    ]
    assert planner.on_reached(WindowReport(0, 1, 1.0)) == [Average(1, (), False)]
    # The rank trains its overshoot before the Average arrives: epochs 0 and 1 complete.
    planner.on_epoch_complete(0)
    planner.on_epoch_complete(1)
    assert planner.on_ack(RoundAck(0, 0, 5, False, 0.0, 0.0, queued=0))
    assert planner.open_window([1], 4) == [
        Dispatch(0, (EpochSlice(2, 1, 1), EpochSlice(3, 0, 2), EpochSlice(4, 0, 2)), 1)
    ]
    planner.on_epoch_complete(2)
    assert planner.on_reached(WindowReport(0, 1, 1.0)) == [Average(2, (0, 1), False)]  # one eval, for both
    planner.on_epoch_complete(3)
    planner.on_epoch_complete(4)
    assert planner.on_ack(RoundAck(0, 0, 5, False, 0.0, 0.0, queued=0))
    assert planner.open_window([1], 4) == [Dispatch(0, (EpochSlice(5, 0, 2),), 2)]
    planner.on_epoch_complete(5)
    assert planner.on_reached(WindowReport(0, 2, 1.0)) == [Average(3, (5,), True)]
    assert planner.evaluated_epochs == {0, 1, 5}


@pytest.mark.parametrize(
    ("wanted", "expected"), [({0, 1, 2}, (0, 1, 2)), ({0, 1}, (0, 1)), ({0}, (0,)), (set(), ())]
)
def test_async_final_average_evaluates_every_wanted_epoch_left(wanted, expected):
    # One window takes the whole run: the final Average is the only chance to evaluate.
    planner = LocalSgdPlanner(1, 2, 1, 3, True, frozenset(wanted))
    assert planner.open_window([6], 0) == [
        Dispatch(0, (EpochSlice(0, 0, 2), EpochSlice(1, 0, 2), EpochSlice(2, 0, 2)), 6)
    ]
    for epoch in range(3):
        planner.on_epoch_complete(epoch)
    assert planner.on_reached(WindowReport(0, 6, 1.0)) == [Average(1, expected, True)]
    assert planner.evaluated_epochs == wanted


def test_final_average_evaluates_a_wanted_epoch_left_undecided():
    """An epoch completed before the final window but wanted, not yet evaluated: the final takes it."""
    planner = LocalSgdPlanner(1, 2, 1, 2, True, frozenset({0}))
    planner.open_window([1], 1)  # (0, 0), (0, 1); target 1
    assert planner.on_reached(WindowReport(0, 1, 1.0)) == [Average(1, (), False)]
    planner.on_epoch_complete(0)  # overshoot after the Average left
    planner.on_ack(RoundAck(0, 0, 2, False, 0.0, 0.0, queued=0))
    planner.open_window([2], 0)  # epoch 1 whole: the data runs out
    planner.on_epoch_complete(1)
    assert planner.on_reached(WindowReport(0, 2, 1.0)) == [Average(2, (0,), True)]


@pytest.mark.parametrize("is_async", [False, True])
def test_final_average_evaluates_without_waiting_for_completion_notices(is_async):
    """The final Average decides from the wanted set alone, not from which epochs were reported done."""
    planner = LocalSgdPlanner(1, 2, 1, 1, is_async, frozenset({0}))
    assert planner.open_window([2], 0) == [Dispatch(0, (EpochSlice(0, 0, 2),), 2)]
    assert planner.on_reached(WindowReport(0, 2, 1.0)) == [Average(1, (0,), True)]


def test_a_long_run_s_planner_keeps_only_the_epochs_not_settled():
    """Its bookkeeping of completed and wanted epochs does not grow with the run: each round's decisions
    once scanned every epoch since the run's start, and a long run's coordinator slowed with its length."""
    sim = Simulator(
        world_size=2,
        batches_per_epoch=3,
        batch_size=1,
        epochs=300,
        is_async=True,
        counts=[[2, 5], [4, 1]],
        overshoot=2,
        eval_epochs=set(range(300)),
        max_extra=3,
        max_carried=2,
    )
    unsettled = []
    while not sim.planner.finished:
        sim.run_window()
        unsettled.append(len(sim.planner.completed.past))
    check_run(sim)
    assert sim.planner.settled_end == 300 and sim.planner.completed.past == set()
    assert max(unsettled) <= 3  # an async rank runs ahead by at most its window and overshoot


def segment_by_hand(planner: LocalSgdPlanner, epoch: int, evaluate: tuple[int, ...]) -> None:
    """One rank trains `epoch` (2 batches) as one window and segment ending in a checkpoint."""
    assert planner.open_window([2], 0) == [Dispatch(0, (EpochSlice(epoch, 0, 2),), 2)]
    planner.on_epoch_complete(epoch)
    average = planner.on_reached(WindowReport(0, 2, 1.0))
    assert average == [Average(planner.round, evaluate, True, (epoch, None))]
    assert planner.on_ack(RoundAck(0, 0, 2, False, 0.0, 0.0, queued=0))


def test_a_checkpoint_keeps_no_eval_its_segment_decided_and_a_resumed_run_evaluates_only_what_is_left():
    every = frozenset(range(6))
    planner = LocalSgdPlanner(1, 2, 1, 6, False, every, barrier_epochs=every)
    for epoch in range(3):
        segment_by_hand(planner, epoch, (epoch,))
        # Every wanted epoch before the checkpoint had its eval: the state does not list them.
        assert planner.state() == {"round": epoch + 1, "evaluated_epochs": []}
        planner.next_segment()
    # Resumed after epoch 2: from this state, from one that listed every evaluated epoch (as checkpoints
    # did), and with an eval wanted for an epoch before the resume point (eval_every changed): epoch 3 next.
    for state in ({"round": 3, "evaluated_epochs": []}, {"round": 3, "evaluated_epochs": [0, 1, 2]}):
        resumed = LocalSgdPlanner(1, 2, 1, 6, False, every, barrier_epochs=every, first_epoch=3)
        resumed.restore(state)
        segment_by_hand(resumed, 3, (3,))


# --- 6. proportional_split -----------------------------------------------------------------------


def exact_split(total: int, weights: list[int]) -> list[int]:
    """Largest remainder in exact arithmetic, ties to the lower rank."""
    mass = sum(weights)
    shares = (
        [Fraction(total * w, mass) for w in weights]
        if mass
        else [Fraction(total, len(weights))] * len(weights)
    )
    parts = [int(x) for x in shares]
    order = sorted(range(len(weights)), key=lambda r: (parts[r] - shares[r], r))
    for r in order[: total - sum(parts)]:
        parts[r] += 1
    return parts


@pytest.mark.parametrize(
    ("total", "weights", "expected"),
    [
        (10, [1, 1], [5, 5]),
        (7, [2, 5], [2, 5]),
        (4, [2, 3, 1], [1, 2, 1]),
        (1, [1, 1], [1, 0]),  # tie: lower rank
        (2, [1, 1, 1], [1, 1, 0]),
        (2, [1, 3], [1, 1]),  # remainders 0.5 and 0.5
        (3, [1, 2, 1, 2], [1, 1, 0, 1]),
        (5, [2, 2, 2, 2], [2, 1, 1, 1]),
        (0, [3, 4], [0, 0]),
        (4, [0, 0, 0], [2, 1, 1]),  # all zero: even, extras to the lower ranks
        (3, [0, 0, 0], [1, 1, 1]),
        (3, [0, 5], [0, 3]),
        (5, [1.5, 0.5], [4, 1]),
    ],
)
def test_proportional_split_examples(total, weights, expected):
    assert proportional_split(total, weights) == expected


def test_proportional_split_rejects_a_negative_total():
    with pytest.raises(ValueError, match="negative"):
        proportional_split(-1, [1, 2])


@settings(max_examples=500, deadline=None)
@given(total=st.integers(0, 500), weights=st.lists(st.integers(0, 50), min_size=1, max_size=8))
def test_proportional_split_sums_and_is_proportional(total, weights):
    parts = proportional_split(total, weights)
    assert len(parts) == len(weights)
    assert sum(parts) == total
    assert all(p >= 0 for p in parts)
    mass = sum(weights)
    for part, w in zip(parts, weights, strict=True):
        share = Fraction(total * w, mass) if mass else Fraction(total, len(weights))
        assert abs(part - share) < 1
        if w == 0 and mass:
            assert part == 0


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 200), n=st.integers(1, 8), w=st.integers(0, 30))
def test_proportional_split_equal_weights_give_extras_to_lower_ranks(total, n, w):
    base, extra = divmod(total, n)
    assert proportional_split(total, [w] * n) == [base + 1] * extra + [base] * (n - extra)


@pytest.mark.parametrize(("total", "weights"), [(11, [15, 7]), (21, [5, 9]), (45, [7, 3])])
def test_proportional_split_ties_go_to_the_lower_rank_despite_float_rounding(total, weights):
    assert proportional_split(total, weights) == exact_split(total, weights)


def test_async_segment_tail_follows_the_counts_not_the_overshoot():
    """A segment of one 44-batch epoch, ElChe's counts [36, 8] (rank 0 4.5x as fast), overshoot 15: the tail
    goes by the counts. By what each asked for (51 and 23) the slow rank would get 14 and hold everyone up."""
    planner = LocalSgdPlanner(2, 44, 1, 1, True, frozenset({0}))
    assert [d.target for d in planner.open_window([36, 8], 15)] == [36, 8]


@pytest.mark.parametrize(
    ("total", "weights", "held", "expected"),
    [
        (44, [36, 8], [0, 0], [36, 8]),
        (10, [1, 1], [4, 0], [3, 7]),  # each then holds 7
        (10, [1, 1], [12, 0], [0, 10]),  # rank 0 holds more than its share: none for it
        (6, [3, 1, 2], [0, 2, 0], [4, 0, 2]),  # shares of 8: 4, 1.33, 2.67; rank 1 is over, 6 go 3.6 : 2.4
        (0, [2, 5], [3, 1], [0, 0]),
        (5, [0, 0], [0, 0], [3, 2]),  # no weights: even
    ],
)
def test_balanced_split_examples(total, weights, held, expected):
    assert balanced_split(total, weights, held) == expected


@settings(max_examples=500, deadline=None)
@given(
    total=st.integers(0, 300),
    ranks=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 40)), min_size=1, max_size=8),
)
def test_balanced_split_finishes_together(total, ranks):
    """No batch could move from one rank to another and end what they hold sooner: a rank given any is at
    most one batch past the others' finish (held / weight is the time to train out what a rank holds)."""
    weights, held = [w for w, _ in ranks], [h for _, h in ranks]
    parts = balanced_split(total, weights, held)
    assert sum(parts) == total and all(p >= 0 for p in parts)
    finish = [Fraction(h + p, w) for h, p, w in zip(held, parts, weights, strict=True)]
    for i, part in enumerate(parts):
        for j in range(len(parts)):
            if part > 0:
                assert finish[i] - Fraction(1, weights[i]) < finish[j] + Fraction(1, weights[j])


def test_async_eval_waits_for_every_earlier_epoch():
    """A fast rank can finish epochs 1 and 2 while the slow one still trains its share of epoch 0: their
    evals wait for a consensus that has seen epoch 0 too, and none is lost."""
    planner = LocalSgdPlanner(2, 2, 1, 6, True, frozenset(range(6)))
    assert planner.open_window([1, 3], 1) == [
        Dispatch(0, (EpochSlice(0, 0, 2),), 1),
        Dispatch(1, (EpochSlice(1, 0, 2), EpochSlice(2, 0, 2)), 3),
    ]
    planner.on_epoch_complete(1)
    planner.on_epoch_complete(2)
    assert planner.on_reached(WindowReport(1, 4, 1.0)) == []
    assert planner.settled_end == 0
    assert planner.on_reached(WindowReport(0, 1, 1.0)) == [Average(1, (), False)]
    planner.on_epoch_complete(0)  # rank 0 trains its overshoot while the round is in flight
    assert planner.settled_end == 3
    planner.on_ack(RoundAck(0, 0, 1, False, 0.0, 0.0, queued=0))
    planner.on_ack(RoundAck(1, 0, 4, False, 0.0, 0.0, queued=0))
    planner.open_window([1, 3], 0)
    assert planner.on_reached(WindowReport(1, 3, 1.0)) == []
    assert planner.on_reached(WindowReport(0, 1, 1.0)) == [Average(2, (0, 1, 2), False)]
