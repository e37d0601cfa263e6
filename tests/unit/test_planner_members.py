"""The window planner's members (fault_tolerance=survive): a dropped rank's untrained slices handed out
again, rounds redone among the members, restarted ranks admitted; by hand and against simulated ranks."""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.links.messages import EpochSlice, RoundAck
from flodl.rounds.orders import Average, Dispatch, WindowReport
from flodl.rounds.planner import LocalSgdPlanner
from flodl.rounds.supply import top_up
from tests.helpers.planner_batches import Batch, all_batches, expand, settled


def reach(planner: LocalSgdPlanner, rank: int, steps: int) -> list:
    return planner.on_reached(WindowReport(rank, steps, float(steps)))


def ack(planner: LocalSgdPlanner, rank: int, queued: int = 0) -> bool:
    return planner.on_ack(RoundAck(rank, 0, 1, False, 0.0, 0.0, queued))


def train(planner: LocalSgdPlanner, dispatch: Dispatch) -> None:
    """The rank trains every slice of its dispatch and reports each."""
    for part in dispatch.slices:
        assert planner.on_chunk(dispatch.rank, part)


# --- by hand -------------------------------------------------------------------------------------


def test_a_rank_dropped_mid_window_returns_what_it_had_not_reported_and_the_round_goes_on_without_it():
    planner = LocalSgdPlanner(3, 12, 1, 1, False, frozenset())
    first = planner.open_window([2, 2, 2], 0)
    assert [d.slices for d in first] == [(EpochSlice(0, 2 * r, 2),) for r in range(3)]
    for dispatch in first[:2]:
        train(planner, dispatch)
        assert reach(planner, dispatch.rank, 2) == []
    # Rank 2 dies before reporting its slice: the two others have reached, so the round fires now.
    assert planner.drop(2) == [Average(1, (), False)]
    assert planner.members == {0, 1}
    assert not ack(planner, 0)
    assert ack(planner, 1)  # every member acked
    assert [a.rank for a in planner.window_acks()] == [0, 1]
    assert [r.rank for r in planner.window_reports()] == [0, 1]
    # Its slice comes first, counted in rank 0's allocation; rank 2 gets nothing (ElChe gives it 0).
    assert planner.open_window([3, 2, 0], 0) == [
        Dispatch(0, (EpochSlice(0, 4, 2), EpochSlice(0, 6, 1)), 3),
        Dispatch(1, (EpochSlice(0, 7, 2),), 2),
    ]


def test_a_sharded_group_leaving_keeps_what_a_member_trained_in_step_and_did_not_report():
    # 4 ranks as 2 groups of 2, batches of 1, windows of 2 batches a rank, each handed as one slice.
    planner = LocalSgdPlanner(4, 40, 1, 1, False, frozenset())
    window = planner.open_window([2, 2, 2, 2], 0)
    for dispatch in window:  # the first window, trained and reported by every rank
        train(planner, dispatch)
    planner.open_window([2, 2, 2, 2], 0)  # a second: ranks 8-15, as slices of 2
    # Rank 3 reported its slice, rank 2 died after the same steps, before its report: it trained them too.
    assert planner.on_chunk(3, EpochSlice(0, 14, 2))
    assert planner.holders.trained_in_step([2, 3]) == [EpochSlice(0, 12, 2)]
    for rank in (2, 3):
        planner.drop(rank)
    assert planner.returned == []  # nothing the group trained is handed out again, nothing uneven left
    assert planner.holders.trained_in_step([0, 1]) == []  # in step already: nothing taken


def test_a_dropped_rank_keeps_what_it_reported_trained_and_its_partial_slice_returns_whole():
    planner = LocalSgdPlanner(2, 20, 2, 1, True, frozenset())
    planner.open_window([2, 2], 2)  # rank 1: picks [8, 16) as one slice
    assert planner.on_chunk(0, EpochSlice(0, 0, 8))
    assert reach(planner, 0, 4) == []
    assert planner.drop(1) == [Average(1, (), False)]  # rank 1 had trained part of its slice: lost
    assert planner.returned == [EpochSlice(0, 8, 8)]
    assert planner.on_chunk(1, EpochSlice(0, 8, 8)) is False  # its report came too late: not counted
    assert ack(planner, 0)
    assert planner.open_window([1, 0], 1) == [Dispatch(0, (EpochSlice(0, 8, 4),), 1)]
    assert planner.returned == [EpochSlice(0, 12, 4)]  # a returned slice splits where the allocation ends


def test_the_start_of_a_slice_reported_at_a_round_stays_trained_when_its_rank_dies():
    # Async: rank 1 holds picks [8, 16) as one slice. A round fires with 2 of its 4 batches trained: the rank
    # reports those as a chunk (they are in the round's snapshot), and its death hands out only the 2 after
    # them (before: the whole slice, its averaged half trained twice).
    planner = LocalSgdPlanner(2, 20, 2, 1, True, frozenset())
    planner.open_window([2, 2], 2)
    assert planner.on_chunk(0, EpochSlice(0, 0, 8))
    assert reach(planner, 0, 4) == []
    assert reach(planner, 1, 2) == [Average(1, (), False)]
    assert planner.on_chunk(1, EpochSlice(0, 8, 4))
    assert ack(planner, 1, queued=2) is False
    assert ack(planner, 0)
    assert planner.drop(1) == []
    assert planner.returned == [EpochSlice(0, 12, 4)]
    # The rest is one slice too: reported whole by the rank that trains it.
    assert planner.open_window([2, 0], 0) == [Dispatch(0, (EpochSlice(0, 12, 4),), 2)]
    assert planner.on_chunk(0, EpochSlice(0, 12, 4))


def test_a_report_of_a_slice_s_start_or_rest_keeps_the_rest_held_and_nothing_else_is_accepted():
    planner = LocalSgdPlanner(1, 8, 1, 1, True, frozenset())
    planner.open_window([6], 0)  # picks [0, 6)
    assert planner.on_chunk(0, EpochSlice(0, 0, 2))
    assert planner.on_chunk(0, EpochSlice(0, 2, 1))
    for wrong in (EpochSlice(0, 4, 2), EpochSlice(0, 3, 4), EpochSlice(1, 3, 1)):
        with pytest.raises(ValueError, match="does not hold"):
            planner.on_chunk(0, wrong)
    assert planner.on_chunk(0, EpochSlice(0, 3, 3))
    with pytest.raises(ValueError, match="does not hold"):
        planner.on_chunk(0, EpochSlice(0, 3, 3))


def test_a_rank_dropped_while_a_round_is_in_flight_has_it_redone_among_the_members():
    planner = LocalSgdPlanner(3, 4, 1, 2, False, frozenset({0}))
    window = planner.open_window([1, 1, 2], 0)
    for dispatch in window:
        train(planner, dispatch)
    planner.on_epoch_complete(0)
    for rank in (0, 1):
        assert reach(planner, rank, window[rank].target) == []
    assert reach(planner, 2, 2) == [Average(1, (0,), False)]
    assert not ack(planner, 0)
    assert planner.drop(1) == [Average(1, (0,), False, redo=True)]
    assert planner.acks == {}  # rank 0's ack was for the aborted round
    assert planner.averaging and not ack(planner, 2)
    assert ack(planner, 0)
    assert [a.rank for a in planner.window_acks()] == [0, 2]


def test_a_redo_is_final_once_nobody_holds_anything_and_keeps_its_checkpoint():
    """Async: rank 1 trained its overshoot while the round was in flight, then died; nothing is left."""
    planner = LocalSgdPlanner(2, 4, 1, 1, True, frozenset({0}), barrier_epochs=frozenset({0}))
    first = planner.open_window([1, 1], 1)
    assert [d.target for d in first] == [2, 2]  # the data ran out: targets are everything queued
    train(planner, first[0])
    assert reach(planner, 0, 2) == []
    assert planner.on_chunk(1, first[1].slices[0])
    planner.on_epoch_complete(0)
    assert reach(planner, 1, 2) == [Average(1, (0,), True, checkpoint_at=(0, None))]
    assert planner.drop(1) == [Average(1, (0,), True, checkpoint_at=(0, None), redo=True)]
    assert ack(planner, 0) and planner.finished


def test_a_redo_is_not_final_while_a_member_that_acked_the_round_still_holds_batches():
    """Async: rank 0 acked the round holding its overshoot batch, then rank 1 (which trained the segment's
    last batches) died. The redo must not be final: rank 0 would end the run holding a batch no one trains
    (found by the simulated members below: batch 22 of 27 never trained)."""
    planner = LocalSgdPlanner(2, 10, 1, 1, True, frozenset())
    first = planner.open_window([4, 1], 1)
    assert [d.target for d in first] == [4, 1] and sum(planner.queued) == 7
    assert reach(planner, 1, 1) == []
    rest = top_up(planner, 1, 5)  # the segment's last 3 batches
    assert rest is not None and planner.exhausted
    for part in first[1].slices + rest.slices:
        assert planner.on_chunk(1, part)
    assert reach(planner, 0, 4) == [Average(1, (), False)]  # rank 0 still holds one batch
    assert not ack(planner, 0, queued=1)
    assert planner.drop(1) == [Average(1, (), False, redo=True)]
    assert ack(planner, 0, queued=1)
    # The next window holds rank 0 to the batch it holds: that round is the exact last.
    assert [(d.slices, d.target) for d in planner.open_window([4, 4], 1)] == [((), 1)]


def test_a_drop_while_others_train_returns_nothing_and_the_last_member_cannot_go():
    planner = LocalSgdPlanner(3, 30, 1, 1, False, frozenset())
    planner.open_window([2, 2, 2], 0)
    assert reach(planner, 0, 2) == []
    assert planner.drop(2) == []
    assert planner.drop(0) == []  # rank 0 had reached; rank 1 still trains
    assert planner.members == {1}
    with pytest.raises(RuntimeError, match="last member"):
        planner.drop(1)
    with pytest.raises(ValueError, match="not a member"):
        planner.drop(2)


def test_the_data_is_not_exhausted_while_returned_slices_wait():
    planner = LocalSgdPlanner(2, 4, 1, 1, False, frozenset({0}))
    first = planner.open_window([2, 2], 0)
    assert [d.target for d in first] == [2, 2] and planner.cursor.exhausted()
    train(planner, first[0])
    assert reach(planner, 0, 2) == []
    # Rank 1 dies with its window untrained: not the final round; its slices come back.
    assert planner.drop(1) == [Average(1, (), False)]
    assert not planner.exhausted
    assert ack(planner, 0) and not planner.finished
    assert planner.open_window([2, 0], 0) == [Dispatch(0, (EpochSlice(0, 2, 2),), 2)]
    assert planner.exhausted
    train(planner, Dispatch(0, (EpochSlice(0, 2, 2),), 2))
    planner.on_epoch_complete(0)
    assert reach(planner, 0, 2) == [Average(2, (0,), True)]
    assert ack(planner, 0) and planner.finished


def test_cadence_hands_out_an_epoch_s_returned_slices_before_the_next_epoch():
    planner = LocalSgdPlanner(2, 4, 1, 2, False, frozenset())
    first = planner.open_window([2, 2], 0)  # the whole of epoch 0; the cursor moves to epoch 1
    train(planner, first[0])
    assert reach(planner, 0, 2) == []
    assert planner.drop(1) == [Average(1, (), False)]
    assert ack(planner, 0)
    # Epoch 0's tail first, alone: a cadence window never crosses an epoch.
    assert planner.open_window([5, 0], 0) == [Dispatch(0, (EpochSlice(0, 2, 2),), 2)]


def test_async_hands_out_returned_slices_first_and_may_mix_epochs():
    planner = LocalSgdPlanner(2, 4, 1, 3, True, frozenset())
    first = planner.open_window([2, 2], 1)
    assert [d.slices for d in first] == [(EpochSlice(0, 0, 3),), (EpochSlice(0, 3, 1), EpochSlice(1, 0, 2))]
    train(planner, first[0])
    assert reach(planner, 0, 2) == []
    assert planner.drop(1) == [Average(1, (), False)]
    assert ack(planner, 0)
    assert planner.open_window([4, 0], 1) == [
        Dispatch(0, (EpochSlice(0, 3, 1), EpochSlice(1, 0, 2), EpochSlice(1, 2, 2)), 4)
    ]


def test_an_admitted_rank_joins_at_the_next_window_with_nothing_queued():
    planner = LocalSgdPlanner(2, 20, 1, 1, False, frozenset())
    planner.open_window([2, 2], 0)
    assert reach(planner, 0, 2) == []
    assert planner.drop(1) == [Average(1, (), False)]
    planner.admit(1)  # while the round is in flight: the round is not its business
    assert planner.members == {0}
    assert reach(planner, 1, 0) == []  # not a member yet: nothing to report
    assert ack(planner, 0)
    assert planner.open_window([2, 3], 0) == [
        Dispatch(0, (EpochSlice(0, 2, 2),), 2),  # rank 1's old slice [2, 4) first
        Dispatch(1, (EpochSlice(0, 4, 3),), 3),
    ]
    assert planner.members == {0, 1}
    with pytest.raises(ValueError, match="already a member"):
        planner.admit(1)


def test_a_rank_admitted_between_rounds_is_a_member_at_once():
    """The driver admits at a round's end, then tells the group who is in (planner.members) and opens the
    next window."""
    planner = LocalSgdPlanner(2, 20, 1, 1, True, frozenset())
    planner.open_window([2, 2], 0)
    assert reach(planner, 0, 2) == []
    assert planner.drop(1) == [Average(1, (), False)]
    assert ack(planner, 0)
    planner.admit(1)
    assert planner.members == {0, 1} and planner.joining == set()
    assert [(d.rank, d.target) for d in planner.open_window([2, 3], 0)] == [(0, 2), (1, 3)]


def test_an_admitted_rank_that_dies_before_its_first_window_held_nothing():
    planner = LocalSgdPlanner(2, 20, 1, 1, False, frozenset())
    planner.open_window([2, 2], 0)
    assert reach(planner, 0, 2) == []
    assert planner.drop(1) == [Average(1, (), False)]
    planner.admit(1)
    assert planner.drop(1) == []
    assert ack(planner, 0)
    assert [d.rank for d in planner.open_window([2, 2], 0)] == [0]


def test_a_chunk_the_rank_was_not_handed_is_an_error():
    planner = LocalSgdPlanner(1, 4, 1, 1, False, frozenset())
    planner.open_window([2], 0)
    with pytest.raises(ValueError, match="does not hold"):
        planner.on_chunk(0, EpochSlice(0, 2, 2))


# --- simulated ranks: speeds, drops and admits at random moments ---------------------------------


@dataclass
class Process:
    """A live rank: trains its queue slice by slice and reports each slice once it is trained."""

    rank: int
    queue: deque[EpochSlice] = field(default_factory=deque)
    # Batches of the head slice trained so far (lost with the process).
    head_done: int = 0
    steps: int = 0
    target: int | None = None
    # An Average it has not acknowledged.
    ordered: bool = False

    def queued(self, batch_size: int) -> int:
        return sum(s.size for s in self.queue) // batch_size - self.head_done


class MembershipSim:
    """Drives a LocalSgdPlanner the way the coordinator does, one event at a time in an order drawn from
    `rng`: a rank trains a batch (each rank at its own `speed`: its chance to be picked), a rank acks, a
    member dies, a dead rank is restarted and admitted."""

    def __init__(
        self,
        *,
        world_size: int,
        batches_per_epoch: int,
        batch_size: int,
        epochs: int,
        is_async: bool,
        overshoot: int,
        eval_epochs: frozenset[int],
        barrier_epochs: frozenset[int],
        speeds: list[int],
        drops: int,
        admits: int,
        churn: float,
        rng: random.Random,
    ) -> None:
        self.bpe, self.batch_size, self.epochs = batches_per_epoch, batch_size, epochs
        self.is_async, self.overshoot, self.eval_epochs = is_async, overshoot, eval_epochs
        self.barrier_epochs = barrier_epochs
        self.speeds, self.drops, self.admits, self.churn, self.rng = speeds, drops, admits, churn, rng
        self.planner = LocalSgdPlanner(
            world_size=world_size,
            batches_per_epoch=batches_per_epoch,
            batch_size=batch_size,
            epochs=epochs,
            is_async=is_async,
            eval_epochs=eval_epochs,
            barrier_epochs=self.barrier_epochs,
        )
        self.live = {r: Process(r) for r in range(world_size)}
        # Restarted ranks waiting for a round's end to be admitted (as the driver admits them).
        self.waiting: set[int] = set()
        self.dispatched: Counter[Batch] = Counter()
        self.reported: Counter[Batch] = Counter()
        # Batches in slices a rank held unreported when it died: each is handed out once more.
        self.lost: Counter[Batch] = Counter()
        self.reported_in_epoch: Counter[int] = Counter()
        self.completed: set[int] = set()
        self.averages: list[Average] = []
        self.evaluated: set[int] = set()

    # -- rank side --

    def train(self, proc: Process) -> None:
        proc.head_done += 1
        proc.steps += 1
        if proc.head_done * self.batch_size == proc.queue[0].size:  # a chunk: one whole slice
            self.report_head(proc)
        self.report_if_reached(proc)

    def report_head(self, proc: Process) -> None:
        """The rank reports what it trained of its head slice: all of it, or (a round's snapshot midway
        through it) its start, and keeps the rest."""
        head, trained = proc.queue.popleft(), proc.head_done * self.batch_size
        part = EpochSlice(head.epoch, head.offset, trained)
        if trained < head.size:
            proc.queue.appendleft(EpochSlice(head.epoch, head.offset + trained, head.size - trained))
        proc.head_done = 0
        assert self.planner.on_chunk(proc.rank, part)
        self.reported.update(expand(part, self.batch_size))
        self.reported_in_epoch[head.epoch] += trained // self.batch_size
        if self.reported_in_epoch[head.epoch] == self.bpe:
            self.completed.add(head.epoch)
            self.planner.on_epoch_complete(head.epoch)

    def report_if_reached(self, proc: Process) -> None:
        if proc.target is not None and proc.steps >= proc.target:
            proc.target = None
            self.carry(self.planner.on_reached(WindowReport(proc.rank, proc.steps, float(proc.steps))))

    def ack(self, proc: Process) -> None:
        proc.ordered = False
        proc.steps = 0
        done = self.planner.on_ack(RoundAck(proc.rank, 0, 0, False, 0.0, 0.0, proc.queued(self.batch_size)))
        assert done is not any(p.ordered for p in self.members())
        if done and not self.planner.finished:
            if self.planner.segment_done:
                self.planner.next_segment()
            for rank in sorted(self.waiting):
                self.planner.admit(rank)
                assert rank in self.planner.members
            self.waiting = set()
            self.open_window()

    # -- coordinator side --

    def members(self) -> list[Process]:
        return [self.live[r] for r in sorted(self.planner.members)]

    def open_window(self) -> None:
        joining = self.planner.members | self.planner.joining
        counts = [self.rng.randint(1, 8) if r in joining else 0 for r in range(len(self.speeds))]
        instructions = self.planner.open_window(counts, self.overshoot)
        assert all(isinstance(a, Dispatch) for a in instructions)
        assert [a.rank for a in instructions] == sorted(joining) == sorted(self.planner.members)
        if not self.is_async:  # a cadence window never crosses an epoch, returned slices or not
            assert len({s.epoch for d in instructions for s in d.slices}) <= 1
        for dispatch in instructions:
            proc = self.live[dispatch.rank]
            for part in dispatch.slices:
                self.dispatched.update(expand(part, self.batch_size))
            proc.queue.extend(dispatch.slices)
            proc.target = dispatch.target
        for proc in self.rng.sample(self.members(), len(instructions)):
            self.report_if_reached(proc)

    def carry(self, instructions: list) -> None:
        for average in instructions:
            assert isinstance(average, Average)
            previous = self.averages[-1] if self.averages else None
            if average.redo:  # the round in flight, again, among the members
                assert previous is not None and average.round == previous.round
                assert set(previous.evaluate_epochs) <= set(average.evaluate_epochs)
                if not average.final:  # the driver decided its evals with the round it redoes
                    assert average.evaluate_epochs == previous.evaluate_epochs
            else:
                assert average.round == (previous.round + 1 if previous else 1)
            new = set(average.evaluate_epochs) - (set(previous.evaluate_epochs) if average.redo else set())
            assert not new & self.evaluated, "an epoch evaluated twice"
            if not average.final:  # an eval waits until its epoch and every one before it are trained
                assert all(e < settled(self.completed) for e in new)
            self.evaluated |= new
            self.averages.append(average)
            for proc in self.members():
                proc.ordered = True
                if proc.head_done:  # the round's snapshot
                    self.report_head(proc)

    def drop(self, rank: int) -> None:
        proc = self.live.pop(rank)
        self.drops -= 1
        if rank in self.waiting:  # the planner never heard of this process
            self.waiting.discard(rank)
            return
        for part in proc.queue:  # the slices it had not reported, the part of one trained since a round too
            self.lost.update(expand(part, self.batch_size))
        self.carry(self.planner.drop(rank))

    def top_up(self, proc: Process) -> None:
        """Async: a member past its count is handed more while the round waits on another (a silent one)."""
        dispatch = top_up(self.planner, proc.rank, self.rng.randint(1, 4))
        if dispatch is not None:
            for part in dispatch.slices:
                self.dispatched.update(expand(part, self.batch_size))
            proc.queue.extend(dispatch.slices)

    def admit(self, rank: int) -> None:
        """Admitted now (during a window or a round: at the next window), or at the next round's end."""
        self.admits -= 1
        self.live[rank] = Process(rank)
        if self.rng.random() < 0.5:
            self.planner.admit(rank)
        else:
            self.waiting.add(rank)

    def run(self, max_events: int) -> None:
        self.open_window()
        for _ in range(max_events):
            if self.planner.finished:
                return
            churn = []
            if self.drops:  # never the last member: the driver stops the run before that (min_ranks)
                members = sorted(self.planner.members) if len(self.planner.members) > 1 else []
                churn += [(self.drop, r) for r in members + sorted(self.planner.joining | self.waiting)]
            if self.admits:
                churn += [(self.admit, r) for r in range(len(self.speeds)) if r not in self.live]
            acks = [(self.ack, p) for p in self.members() if p.ordered]
            steps = [
                (self.train, p)
                for p in self.members()
                if p.queue and (self.is_async or not p.ordered)
                for _ in range(self.speeds[p.rank])
            ]
            tops = [(self.top_up, p) for p in self.members() if p.rank in self.planner.reached]
            if churn and self.rng.random() < self.churn:
                event, arg = self.rng.choice(churn)
            elif tops and self.is_async and self.rng.random() < 0.1:
                event, arg = self.rng.choice(tops)
            else:
                assert acks or steps, "no member can make progress"
                event, arg = self.rng.choice(acks * 2 + steps)
            event(arg)
        raise AssertionError("the run did not finish")


@st.composite
def membership_runs(draw, is_async: bool) -> MembershipSim:
    world_size = draw(st.integers(2, 4))
    epochs = draw(st.integers(1, 3))
    return MembershipSim(
        world_size=world_size,
        batches_per_epoch=draw(st.integers(1, 30)),
        batch_size=draw(st.integers(1, 4)),
        epochs=epochs,
        is_async=is_async,
        overshoot=draw(st.integers(0, 4)) if is_async else 0,
        eval_epochs=draw(st.frozensets(st.integers(0, epochs - 1))),
        barrier_epochs=draw(st.frozensets(st.integers(0, epochs - 1))),
        speeds=draw(st.lists(st.integers(1, 6), min_size=world_size, max_size=world_size)),
        drops=draw(st.integers(0, 4)),
        admits=draw(st.integers(0, 3)),
        churn=draw(st.sampled_from([0.01, 0.05, 0.2])),
        rng=random.Random(draw(st.integers(0, 2**32))),  # many draws a run: a seed, not a data stream
    )


def check_membership_run(sim: MembershipSim) -> None:
    everything = all_batches(sim.epochs, sim.bpe)
    # Each batch is reported trained exactly once, the dead ranks' reports included; a batch is handed out
    # again only for each time a rank died holding it unreported.
    assert set(sim.reported) == everything and set(sim.reported.values()) == {1}
    assert set(sim.dispatched) == everything
    assert all(sim.dispatched[b] == 1 + sim.lost[b] for b in everything)
    assert sim.completed == set(range(sim.epochs))
    assert sim.planner.finished and sim.averages[-1].final
    # The last round was among the members, every one of which trained out its queue.
    assert [a.rank for a in sim.planner.window_acks()] == sorted(sim.planner.members)
    assert all(not p.queue for p in sim.members())
    assert sim.evaluated == sim.eval_epochs
    assert {a.checkpoint_at for a in sim.averages} - {None} == {(e, None) for e in sim.barrier_epochs}


@pytest.mark.parametrize("is_async", [False, True])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_members_come_and_go_and_every_batch_is_trained_once(is_async, data):
    sim = data.draw(membership_runs(is_async=is_async))
    sim.run(max_events=100_000)
    check_membership_run(sim)
