"""Overlapped rounds in the window planner (cadence): the next window opens as a round starts, the round's
acks come in while it trains, and its own round waits for them; the last round of each segment is waited
for. Driven by fake ranks whose acks land at random points of the next window, against the same run with
rounds waited for."""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.links.messages import EpochSlice, RoundAck
from flodl.rounds.orders import Average, Dispatch, Instruction, WindowReport
from flodl.rounds.planner import LocalSgdPlanner
from tests.helpers.planner_batches import Batch, all_batches, expand, settled


@dataclass
class Rank:
    rank: int
    queue: deque[Batch] = field(default_factory=deque)
    # Steps since its last snapshot (the window's), and the target it reports Reached at.
    steps: int = 0
    target: int | None = None
    # The round it has begun and not acknowledged yet, and the steps that round averages.
    in_flight: int | None = None
    sent: int = 0


@dataclass
class Run:
    """A cadence run's planner driven the way LocalSgdDriver drives it, each event drawn from `rng`."""

    overlap: bool
    world: int
    bpe: int
    batch_size: int
    epochs: int
    counts: list[list[int]]
    eval_epochs: frozenset[int]
    barrier_epochs: frozenset[int]
    every: int | None
    rng: random.Random
    planner: LocalSgdPlanner = field(init=False)
    ranks: list[Rank] = field(init=False)
    windows: list[list[Dispatch]] = field(default_factory=list)
    averages: list[Average] = field(default_factory=list)
    # Per round: whether the next window opened before its acks, and the epochs completed at its Average.
    opened_early: list[bool] = field(default_factory=list)
    completed_at: list[frozenset[int]] = field(default_factory=list)
    trained: Counter[Batch] = field(default_factory=Counter)
    completed: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.planner = LocalSgdPlanner(
            self.world,
            self.bpe,
            self.batch_size,
            self.epochs,
            False,
            self.eval_epochs,
            self.barrier_epochs,
            checkpoint_every_batches=self.every,
            overlap=self.overlap,
        )
        self.ranks = [Rank(r) for r in range(self.world)]

    def carry(self, instructions: list[Instruction]) -> None:
        for instruction in instructions:
            if isinstance(instruction, Dispatch):
                rank = self.ranks[instruction.rank]
                for piece in instruction.slices:
                    rank.queue.extend(expand(piece, self.batch_size))
                rank.target = instruction.target
                self.windows[-1].append(instruction)
            else:
                self.begin_round(instruction)
        for rank in self.ranks:  # a target of 0 (an epoch tail) is reached at once
            self.report_if_reached(rank)

    def open_window(self) -> None:
        counts = self.counts[len(self.windows) % len(self.counts)]
        self.windows.append([])
        self.carry(self.planner.open_window(counts, 0))

    def begin_round(self, average: Average) -> None:
        assert all(r.in_flight is None for r in self.ranks), "a round began before the last was acked"
        assert all(not r.queue for r in self.ranks), "cadence: every rank trained its window"
        self.averages.append(average)
        self.completed_at.append(frozenset(self.completed))
        for rank in self.ranks:
            rank.in_flight, rank.sent, rank.steps = average.round, rank.steps, 0
        early = self.planner.overlapping
        assert early is (self.overlap and not average.final)
        self.opened_early.append(early)
        if early:
            self.open_window()

    def report_if_reached(self, rank: Rank) -> None:
        if rank.target is not None and rank.steps >= rank.target:
            rank.target = None
            self.carry(self.planner.on_reached(WindowReport(rank.rank, rank.steps, float(rank.steps))))

    def step(self, rank: Rank) -> None:
        epoch, batch = rank.queue.popleft()
        self.trained[(epoch, batch)] += 1
        rank.steps += 1
        if sum(n for (e, _), n in self.trained.items() if e == epoch) == self.bpe:
            self.completed.add(epoch)
            self.planner.on_epoch_complete(epoch)
        self.report_if_reached(rank)

    def ack(self, rank: Rank) -> None:
        ack = RoundAck(
            rank.rank, 0, rank.sent, False, 0.0, 0.0, len(rank.queue), steps_during_round=rank.steps
        )
        rank.in_flight = None
        if not self.planner.on_ack(ack):
            return
        if self.planner.finished:
            return
        if self.planner.segment_done:
            self.planner.next_segment()
        if self.planner.window_open:
            self.carry(self.planner.average_if_reached())
        else:
            self.open_window()

    def run(self) -> None:
        self.open_window()
        for _ in range(10 * self.bpe * self.epochs + 100):
            if self.planner.finished:
                return
            # A rank finishes its round when it is done or has nothing left to train (the window's end).
            acks = [r for r in self.ranks if r.in_flight is not None]
            steps = [r for r in self.ranks if r.queue]
            event = self.rng.choice([*(("ack", r) for r in acks), *(("step", r) for r in steps)])
            if event[0] == "ack":
                self.ack(event[1])
            else:
                self.step(event[1])
        pytest.fail("the run did not finish")


@st.composite
def runs(draw, overlap: bool) -> Run:
    world = draw(st.integers(1, 3))
    epochs = draw(st.integers(1, 4))
    bpe = draw(st.integers(1, 30))
    return Run(
        overlap=overlap,
        world=world,
        bpe=bpe,
        batch_size=draw(st.integers(1, 4)),
        epochs=epochs,
        counts=draw(st.lists(st.lists(st.integers(1, 12), min_size=world, max_size=world), min_size=1)),
        eval_epochs=draw(st.frozensets(st.integers(0, epochs - 1))),
        barrier_epochs=draw(st.frozensets(st.integers(0, epochs - 1))),
        every=draw(st.none() | st.integers(1, 2 * bpe * world)),
        rng=draw(st.randoms(use_true_random=False)),
    )


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_overlapped_rounds_hand_out_what_waited_rounds_do_and_train_every_batch_once(data):
    overlapped = data.draw(runs(overlap=True))
    overlapped.run()
    everything = all_batches(overlapped.epochs, overlapped.bpe)
    assert set(overlapped.trained) == everything and set(overlapped.trained.values()) == {1}
    averages = overlapped.averages
    assert [a.round for a in averages] == list(range(1, len(averages) + 1))
    # The next window opened with every round but a segment's last, before any of its acks.
    assert overlapped.opened_early == [not a.final for a in averages]
    assert averages[-1].final
    # Each wanted epoch is evaluated once, on a round whose snapshot holds all of it.
    evaluated = [e for a in averages for e in a.evaluate_epochs]
    assert sorted(evaluated) == sorted(overlapped.eval_epochs)
    for average, completed in zip(averages, overlapped.completed_at, strict=True):
        assert all(e < settled(completed) for e in average.evaluate_epochs), (average, completed)

    # The same run with every round waited for: the same windows, rounds, evals and checkpoints.
    waited = Run(
        False,
        overlapped.world,
        overlapped.bpe,
        overlapped.batch_size,
        overlapped.epochs,
        overlapped.counts,
        overlapped.eval_epochs,
        overlapped.barrier_epochs,
        overlapped.every,
        random.Random(data.draw(st.integers(0, 1000))),
    )
    waited.run()
    assert waited.windows == overlapped.windows
    assert waited.averages == averages
    assert not any(waited.opened_early)


def test_the_window_after_a_round_opens_before_its_acks_and_its_own_round_waits_for_them():
    planner = LocalSgdPlanner(2, 8, 1, 1, False, frozenset({0}), overlap=True)
    first = planner.open_window([2, 2], 0)
    assert planner.on_reached(WindowReport(0, 2, 2.0)) == []
    assert planner.on_reached(WindowReport(1, 2, 3.0)) == [Average(1, (), False)]
    assert planner.overlapping
    second = planner.open_window([1, 3], 0)  # the driver opens it at once
    assert second == [Dispatch(0, (EpochSlice(0, 4, 1),), 1), Dispatch(1, (EpochSlice(0, 5, 3),), 3)]
    assert [d.slices[0].offset for d in first] == [0, 2]
    # Both reach the second window before round 1's acks: its round waits for them.
    assert planner.on_reached(WindowReport(0, 1, 1.0)) == []
    assert planner.on_reached(WindowReport(1, 3, 3.0)) == []
    assert not planner.on_ack(RoundAck(0, 0, 2, False, 0.1, 0.0, queued=1, steps_during_round=1))
    assert planner.on_ack(RoundAck(1, 0, 2, False, 0.2, 0.0, queued=0, steps_during_round=3))
    # The guard and ElChe read round 1's window, not the one open since.
    assert [r.busy_ms for r in planner.window_reports()] == [2.0, 3.0]
    planner.on_epoch_complete(0)
    # What the acks said was queued is the second window's: it is not carried into the next.
    assert planner.average_if_reached() == [Average(2, (0,), True)]
    assert not planner.overlapping  # the last round is waited for
    assert planner.average_if_reached() == []
