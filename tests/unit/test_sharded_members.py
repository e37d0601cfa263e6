"""Survive by groups on the window planner (pure), against simulated groups: a group's members step together
(each step a collective of the group, and under async a vote before it), so every window must hand them
alike, a round's reports of a slice's trained start too. A group leaves whole when one of its ranks dies: what
a member trained in step with the others and had not reported is lost with it (Holders.trained_in_step, as
the driver takes it), the rest of what it held is handed to the others; it comes back whole at a round's end.
Under async each member is handed up to its count plus the overshoot across epochs, a round fires once every
member reached its count, and the members hold their overshoot into it. The properties: before every step a
group's members hold as many batches (else the group hangs in a collective), and every batch of every epoch
is reported trained once or lost in step once."""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from flodl.links.messages import EpochSlice, RoundAck
from flodl.rounds.group_pace import even_in_groups, whole_groups
from flodl.rounds.orders import Average, Dispatch, WindowReport
from flodl.rounds.planner import LocalSgdPlanner
from tests.helpers.planner_batches import Batch, all_batches, expand


@dataclass
class Member:
    """A live rank: trains its queue in step with its group, and says what it did through an outbox the
    coordinator reads at its own moments (in order)."""

    rank: int
    batch_size: int
    queue: deque[EpochSlice] = field(default_factory=deque)
    head_done: int = 0  # batches of the head slice trained and not reported
    steps: int = 0  # since its last round
    target: int | None = None
    ordered: bool = False  # holds an Average it has not acknowledged
    outbox: deque[tuple[str, object]] = field(default_factory=deque)

    def queued(self) -> int:
        return sum(s.size for s in self.queue) // self.batch_size - self.head_done

    def report_head(self) -> None:
        """Its head slice's trained part (all of it, or its start as a round takes its snapshot)."""
        head, trained = self.queue.popleft(), self.head_done * self.batch_size
        if trained < head.size:
            self.queue.appendleft(EpochSlice(head.epoch, head.offset + trained, head.size - trained))
        self.head_done = 0
        self.outbox.append(("chunk", EpochSlice(head.epoch, head.offset, trained)))

    def step(self) -> None:
        self.head_done += 1
        self.steps += 1
        if self.head_done * self.batch_size == self.queue[0].size:
            self.report_head()
        if self.target is not None and self.steps >= self.target:
            self.outbox.append(("reached", self.steps))
            self.target = None


class GroupsSim:
    """Drives a LocalSgdPlanner as the local-SGD driver does for sharded groups, one event at a time in an
    order drawn from `rng`: a group steps, a member acknowledges its round, the coordinator reads a member's
    next message, a group dies, a dead group comes back."""

    def __init__(
        self,
        *,
        k: int,
        groups: int,
        batches: int,
        batch_size: int,
        epochs: int,
        is_async: bool,
        overshoot: int,
        speeds: list[int],
        deaths: int,
        churn: float,
        rng: random.Random,
    ) -> None:
        self.k, self.world, self.batch_size, self.epochs = k, k * groups, batch_size, epochs
        self.bpe = whole_groups(batches, k)
        self.overshoot, self.speeds, self.deaths, self.churn, self.rng = overshoot, speeds, deaths, churn, rng
        self.planner = LocalSgdPlanner(self.world, self.bpe, batch_size, epochs, is_async, frozenset())
        self.live = {r: Member(r, batch_size) for r in range(self.world)}
        self.waiting: set[int] = set()  # dead groups restarted, admitted at the next round's end
        self.reported: Counter[Batch] = Counter()
        self.lost: Counter[Batch] = Counter()  # trained in step by a member that died before reporting them
        self.in_epoch: Counter[int] = Counter()
        self.averages: list[Average] = []
        self.generation = 0  # one more at each change

    def group(self, g: int) -> list[Member]:
        return [self.live[r] for r in range(g * self.k, (g + 1) * self.k) if r in self.planner.members]

    def member_groups(self) -> list[int]:
        return sorted({r // self.k for r in self.planner.members})

    # -- the coordinator's side --

    def open_window(self) -> None:
        counts = [self.rng.randint(1, 8) for _ in range(self.world)]
        instructions = self.planner.open_window(even_in_groups(counts, self.k), self.overshoot)
        for g in self.member_groups():  # the property: a group's members are handed alike
            mine = [d for d in instructions if isinstance(d, Dispatch) and d.rank // self.k == g]
            assert len({(sum(s.size for s in d.slices), d.target) for d in mine}) == 1, instructions
        for dispatch in instructions:
            assert isinstance(dispatch, Dispatch)
            member = self.live[dispatch.rank]
            member.queue.extend(dispatch.slices)
            member.target = dispatch.target
            if member.steps >= dispatch.target:  # an epoch's tail can leave a member nothing to train
                member.outbox.append(("reached", member.steps))
                member.target = None

    def carry(self, instructions: list) -> None:
        for average in instructions:
            assert isinstance(average, Average)
            self.averages.append(average)
            for member in (self.live[r] for r in sorted(self.planner.members)):
                member.ordered = True
                if member.head_done:  # the round's snapshot midway through a slice
                    member.report_head()

    def read(self, member: Member) -> None:
        kind, what = member.outbox.popleft()
        if kind == "chunk":
            assert isinstance(what, EpochSlice)
            if self.planner.on_chunk(member.rank, what):
                self.count(expand(what, self.batch_size), self.reported)
        elif kind == "reached":
            assert isinstance(what, int)
            self.carry(self.planner.on_reached(WindowReport(member.rank, what, float(what))))
        else:  # an ack of a round a change cut is stale: the round is run again (the driver's generation)
            queued, generation = what
            if generation == self.generation and self.planner.on_ack(
                RoundAck(member.rank, 0, 0, False, 0.0, 0.0, queued)
            ):
                self.round_closed()

    def count(self, batches: list[Batch], into: Counter[Batch]) -> None:
        into.update(batches)
        for epoch, _ in batches:
            self.in_epoch[epoch] += 1
            if self.in_epoch[epoch] == self.bpe:
                self.planner.on_epoch_complete(epoch)

    def round_closed(self) -> None:
        if self.planner.finished:
            return
        if self.planner.segment_done:
            self.planner.next_segment()
        for rank in sorted(self.waiting):  # a restarted group, admitted whole at the round's end
            self.planner.admit(rank)
        self.waiting = set()
        self.open_window()

    def die(self, g: int) -> None:
        """A rank of group `g` died: the group is cut in one change (LocalSgdDriver.on_cut)."""
        ranks = list(range(g * self.k, (g + 1) * self.k))
        self.deaths -= 1
        self.generation += 1
        for rank in ranks:  # what they said and was not read yet dies with them
            self.live.pop(rank)
        for part in self.planner.holders.trained_in_step(ranks):
            self.count(expand(part, self.batch_size), self.lost)
        in_flight, instructions = self.planner.averaging, []
        for rank in ranks:
            instructions = self.planner.drop(rank) or instructions
        if not in_flight:  # a round the change itself fires is no redo
            instructions = [replace(a, redo=False) for a in instructions]
        self.carry(instructions)

    def restart(self, g: int) -> None:
        for rank in range(g * self.k, (g + 1) * self.k):
            self.live[rank] = Member(rank, self.batch_size)
            self.waiting.add(rank)

    # -- the ranks' side --

    def step(self, g: int) -> None:
        members = self.group(g)
        # The property: before each step every member holds as many batches (its group's vote meets theirs).
        assert len({m.queued() for m in members}) == 1, [(m.rank, m.queued()) for m in members]
        for member in members:
            member.step()

    def ack(self, member: Member) -> None:
        member.ordered, member.steps = False, 0
        member.outbox.append(("ack", (member.queued(), self.generation)))

    def run(self, max_events: int) -> None:
        self.open_window()
        for _ in range(max_events):
            if self.planner.finished:
                return
            groups = self.member_groups()
            events = [(self.read, m) for m in self.live.values() if m.outbox and m.rank not in self.waiting]
            events += [(self.ack, m) for m in self.live.values() if m.ordered]
            for g in groups:  # a group steps while none of its members holds a round's order
                members = self.group(g)
                if not any(m.ordered for m in members) and any(m.queue for m in members):
                    events += [(self.step, g)] * self.speeds[g]
            churn = []
            if self.deaths and len(groups) > 1:
                churn += [(self.die, g) for g in groups]
            dead = {r // self.k for r in range(self.world) if r not in self.live}
            churn += [(self.restart, g) for g in sorted(dead)]
            if churn and self.rng.random() < self.churn:
                event, arg = self.rng.choice(churn)
            else:
                assert events, "no member can make progress"
                event, arg = self.rng.choice(events)
            event(arg)
        raise AssertionError("the run did not finish")


@st.composite
def group_runs(draw, is_async: bool) -> GroupsSim:
    k, groups = draw(st.integers(2, 3)), draw(st.integers(2, 3))
    return GroupsSim(
        k=k,
        groups=groups,
        batches=draw(st.integers(k, 40)),
        batch_size=draw(st.integers(1, 3)),
        epochs=draw(st.integers(1, 3)),
        is_async=is_async,
        overshoot=draw(st.integers(0, 4)) if is_async else 0,
        speeds=draw(st.lists(st.integers(1, 4), min_size=groups, max_size=groups)),
        deaths=draw(st.integers(0, 3)),
        churn=draw(st.sampled_from([0.01, 0.05, 0.2])),
        rng=random.Random(draw(st.integers(0, 2**32))),
    )


@settings(max_examples=200, deadline=None)
@given(data=st.data(), is_async=st.booleans())
def test_groups_leave_and_come_back_whole_with_every_batch_once(data, is_async) -> None:
    sim = data.draw(group_runs(is_async=is_async))
    sim.run(max_events=200_000)
    everything = all_batches(sim.epochs, sim.bpe)
    assert set(sim.reported) | set(sim.lost) == everything
    assert not set(sim.reported) & set(sim.lost)
    assert set(sim.reported.values()) | set(sim.lost.values()) == {1}
    assert sim.planner.finished and sim.averages[-1].final
    assert all(not m.queue for m in sim.live.values() if m.rank in sim.planner.members)
