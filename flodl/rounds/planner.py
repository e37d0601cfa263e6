"""Window planning for local SGD (cadence / async), as pure decisions.

The coordinator feeds events (a rank reached its count, a rank acknowledged a reduce) and carries out
the instructions returned (dispatch batches, average now, finish). Averaging fires on counts, never on wall
time. Batches are handed out from one cursor over the epochs: batch i of epoch e is picks
`[i*b, (i+1)*b)` of that epoch's shared permutation, so no batch is trained twice or skipped.

- cadence: a window gives rank r exactly `counts[r]` batches; one window in flight; the last window of
  an epoch splits what is left in proportion to the counts (epoch barrier).
- async: rank r is kept supplied up to `counts[r] + overshoot` batches per window and may run into the
  next epoch; the reduce fires once every rank has done `counts[r]`. A segment's tail is split so that what
  each rank then holds is in proportion to its count.

Checkpoints cut the run into segments: the cursor stops at a segment's end, every rank trains out its queue,
and the segment's last reduce is exact (no EASGD blend), so every rank holds the same consensus when the
checkpoint is taken. The next segment opens once that reduce is acknowledged. A segment ends after a barrier
epoch, at a step threshold inside an epoch (every `checkpoint_every_batches` batches handed out, counted
from the run's start), or with the window after `cut_segment` (a checkpoint by time, or a stop that saves).

Overlapped rounds (`overlap`, cadence only): the window after a round opens as the round starts, so its
communication runs while that window trains; the round's acks arrive during it, and the next round waits for
them (one round in flight at a time). The segment's last round is not overlapped: every rank waits for it.

Membership (fault_tolerance=survive): only members get windows, are waited for and acknowledge rounds
(who holds what: rounds/holders.py). A rank that dies is dropped: the slices it was handed and had not
reported trained (`on_chunk`: a rank reports a slice's trained start as a round takes its snapshot) are
handed out again, and a round in flight is redone among the members. Its trained slices stay trained: their
effect died with it, their batches count in the epoch. A restarted rank gets its first window next time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from flodl.links.messages import EpochSlice, RoundAck
from flodl.rounds.cursor import Cursor
from flodl.rounds.epochs_done import EpochsDone
from flodl.rounds.holders import Holders
from flodl.rounds.orders import Average, Dispatch, Instruction, WindowReport
from flodl.rounds.split import balanced_split, proportional_split


@dataclass
class LocalSgdPlanner:
    world_size: int
    batches_per_epoch: int
    batch_size: int
    epochs: int
    is_async: bool
    # Which epochs want an eval (eval_every and the last epoch).
    eval_epochs: frozenset[int]
    # Epochs after which every rank holds the consensus for a checkpoint.
    barrier_epochs: frozenset[int] = frozenset()
    # Where a resumed run starts: its first epoch, and the batches of it a checkpoint inside it had trained.
    first_epoch: int = 0
    first_batch: int = 0
    # A checkpoint every this many batches handed out (counted from the run's start; None: by epochs only).
    checkpoint_every_batches: int | None = None
    # Overlapped rounds (cadence): the next window opens as a round that is not a segment's last starts.
    overlap: bool = False
    # Ranks 0..first_members-1 get the first window; the seats past them wait for ranks that join (None: all).
    first_members: int | None = None
    cursor: Cursor = field(init=False)
    round: int = 0
    targets: list[int] = field(init=False)
    queued: list[int] = field(init=False)
    # Per rank: the steps it carried out of its last round into the next window (RoundAck.steps_during_round).
    carried: list[int] = field(init=False)
    reached: dict[int, WindowReport] = field(default_factory=dict)
    # The Reached reports of the window the round in flight (or the last one) averages.
    averaged: dict[int, WindowReport] = field(default_factory=dict)
    acks: dict[int, RoundAck] = field(default_factory=dict)
    # The epochs every batch of which was trained. Async ranks can finish a later epoch before an earlier
    # one; an epoch's eval waits for the epochs before it (settled_end).
    completed: EpochsDone = field(init=False)
    evaluated_epochs: set[int] = field(default_factory=set)
    # The wanted epochs (eval_epochs) not evaluated yet, in order: what is due is always a prefix.
    _evals_left: list[int] = field(init=False, repr=False)
    averaging: bool = False
    final_round: bool = False
    # Who takes part, and what each holds untrained.
    holders: Holders = field(init=False)
    # A window is open between its dispatch and its Average: a round fires once per window.
    window_open: bool = False
    # The round in flight (what a drop redoes).
    in_flight: Average | None = None
    # Whether the segment being handed out ends with a checkpoint, and whether the next window ends it.
    checkpoint_at_end: bool = field(init=False)
    # barrier_epochs in order, for the next one after a segment's start.
    _barrier_order: tuple[int, ...] = field(init=False, repr=False)
    cut_requested: bool = False
    # Async under survive: members gone silent (rounds/supply.py); the round waits for them to speak or be
    # cut rather than fire into a collective they would hold up.
    suspects: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.overlap and self.is_async:
            raise ValueError("overlapped rounds are cadence's: an async window's overshoot is its rank's own")
        self._barrier_order = tuple(sorted(self.barrier_epochs))
        self.completed = EpochsDone(self.first_epoch)
        self._evals_left = sorted(e for e in self.eval_epochs if e >= self.first_epoch)
        start = (self.first_epoch, self.first_batch)
        end, self.checkpoint_at_end = self._segment_end(start)
        self.cursor = Cursor(self.batches_per_epoch, end, *start)
        self.targets = [0] * self.world_size
        self.queued = [0] * self.world_size
        self.carried = [0] * self.world_size
        self.holders = Holders(self.world_size, self.batch_size, self.first_members)

    @property
    def members(self) -> set[int]:
        """The ranks that get windows and take part in rounds (every rank until one is dropped)."""
        return self.holders.members

    @property
    def joining(self) -> set[int]:
        return self.holders.joining

    @property
    def returned(self) -> list[EpochSlice]:
        return self.holders.returned

    @property
    def exhausted(self) -> bool:
        """Nothing left to hand out in the segment: the cursor is at its end and no slice was returned."""
        return self.cursor.exhausted() and not self.returned

    def open_window(self, counts: list[int], overshoot: int) -> list[Instruction]:
        """Hand out the next window's batches for the given per-rank counts (members only)."""
        ranks = self.holders.open_window()
        epoch: int | None = None  # async: returned slices of any epoch
        if self.is_async:
            allocation = [max(counts[r] + overshoot - self.queued[r], 0) for r in ranks]
            left = self.cursor.left_in_segment() + self.holders.returned_batches()
            if sum(allocation) > left:
                # The segment's tail, which every rank trains out before its exact round: what each then holds
                # in proportion to its count (its speed), so they finish together. Shared by what each asked
                # for, the overshoot (the same for every rank) would hand the slow ones more than their share.
                allocation = balanced_split(left, [counts[r] for r in ranks], [self.queued[r] for r in ranks])
        else:
            allocation = [counts[r] for r in ranks]
            epoch, left = self._cadence_epoch()
            if sum(allocation) >= left:  # the epoch's last window: split the remainder
                allocation = proportional_split(left, allocation)
        taken = []
        for rank, want in zip(ranks, allocation, strict=True):
            returned = self.holders.take_returned(max(want, 0), epoch)
            # Returned slices first. Cadence's allocation sums to at most `left`, so it reaches the cursor
            # only when the cursor is in the window's epoch.
            rest = want - self._batches(returned)
            slices = returned + self.cursor.take(rest, self.batch_size, cross_epochs=self.is_async)
            given = self._batches(slices)
            self.queued[rank] += given
            self.holders.hand(rank, slices)
            taken.append((rank, slices, given))
        if self.cut_requested:  # this window ends the segment, with a checkpoint
            self.cursor.end, self.checkpoint_at_end = self.cursor.position, True
            self.cut_requested = False
        # Targets once every rank is served: a later rank's take may run the data out, and then every rank,
        # earlier ones too, must train all it holds before this round, so that it is the exact last one.
        # A target counts steps since the last round, so the steps a rank carried out of it count too.
        exhausted = self.exhausted
        instructions: list[Instruction] = []
        for rank, slices, given in taken:
            holds = self.queued[rank] + self.carried[rank]
            if exhausted:
                self.targets[rank] = holds
            else:  # async: the count; cadence: what it was given
                self.targets[rank] = min(counts[rank], holds) if self.is_async else given
            instructions.append(Dispatch(rank, slices, self.targets[rank]))
        # Every member reports Reached, even with a target of 0 (an epoch tail can leave a rank idle).
        self.reached = {}
        self.window_open = True
        return instructions

    def on_reached(self, report: WindowReport) -> list[Instruction]:
        if report.rank not in self.members:  # sent before it was dropped, or before its first window
            return []
        self.reached[report.rank] = report
        return self._maybe_average()

    def on_chunk(self, rank: int, part: EpochSlice) -> bool:
        """The rank trained `part` (Holders.trained); False: the report must not count."""
        return self.holders.trained(rank, part)

    def on_epoch_complete(self, epoch: int) -> None:
        self.completed.add(epoch)

    @property
    def settled_end(self) -> int:
        """The first epoch not settled: every batch of the epochs before it has been trained."""
        return self.completed.end

    def want_eval(self, epoch: int) -> None:
        """`epoch` gets an eval too, unless it had one (the last epoch of a run that stops early)."""
        if epoch not in self.evaluated_epochs and epoch not in self._evals_left:
            bisect.insort(self._evals_left, epoch)

    def on_ack(self, ack: RoundAck) -> bool:
        """Record one rank's reduce; True once every member has acknowledged the round."""
        if ack.rank not in self.members:  # a dropped rank's late ack
            return False
        self.acks[ack.rank] = ack
        if not self.overlap:  # overlapped, what it holds is the next window's (see _maybe_average)
            self.queued[ack.rank] = ack.queued
            self.carried[ack.rank] = ack.steps_during_round
        if not self.members <= self.acks.keys():
            return False
        self.averaging = False
        return True

    def drop(self, rank: int) -> list[Instruction]:
        """The rank is gone. What it held untrained goes back to be handed out again; a round in flight is
        redone among the members (same number, marked `redo`); a window whose other members have all
        reached averages now."""
        if not self.holders.drop(rank):  # admitted and gone before its first window: it held nothing
            return []
        self.reached.pop(rank, None)
        self.acks.pop(rank, None)
        self.queued[rank] = self.targets[rank] = self.carried[rank] = 0
        if self.averaging:
            assert self.in_flight is not None
            # Overlapped acks leave what a rank holds as it was (see on_ack).
            acked = frozenset() if self.overlap else frozenset(self.acks)
            return [self._average(self.in_flight.evaluate_epochs, redo=True, acked=acked)]
        return self._maybe_average()

    def admit(self, rank: int) -> None:
        """A restarted rank (a fresh process, nothing queued) takes part from the next window on: a member
        at once between a round's end and the next window, else once that window opens (the window and
        round in progress are not its business)."""
        self.holders.admit(rank, busy=self.window_open or self.averaging)

    @property
    def segment_done(self) -> bool:
        """The segment's last reduce is acknowledged: every rank holds the same consensus."""
        return self.final_round and not self.averaging

    @property
    def finished(self) -> bool:
        return self.segment_done and self.cursor.end == (self.epochs, 0)

    @property
    def whole_epochs_end(self) -> int:
        """The first epoch the segment does not train whole: those before it are trained at its end."""
        return self.cursor.end[0]

    def next_segment(self) -> None:
        """Open the segment after a completed one (the caller opens its first window)."""
        self.cursor.end, self.checkpoint_at_end = self._segment_end(self.cursor.end)
        self.final_round = False

    def cut_segment(self) -> None:
        """The next window to open is the segment's last, and a checkpoint follows its exact round (one by
        time, or a stop that saves)."""
        self.cut_requested = True

    def end_segment_here(self) -> None:
        """The window open now is the segment's last (nothing more is handed out), and a checkpoint follows
        the exact round after which every member trained out what it holds (a stop that saves)."""
        self.cursor.end, self.checkpoint_at_end = self.cursor.position, True

    def stop(self) -> int:
        """End the run at the first epoch boundary the cursor has not passed (every batch handed out is still
        trained, and the last reduce is exact); return the last epoch."""
        end = self.cursor.epoch + (1 if self.cursor.batch else 0)
        self.epochs = end
        if (end, 0) < self.cursor.end:
            self.cursor.end, self.checkpoint_at_end = (end, 0), end - 1 in self.barrier_epochs
        self.barrier_epochs = frozenset(e for e in self.barrier_epochs if e < end)
        self._barrier_order = tuple(sorted(self.barrier_epochs))
        return end - 1

    def _segment_end(self, start: tuple[int, int]) -> tuple[tuple[int, int], bool]:
        """Where the segment that opens at `start` ends, and whether a checkpoint is taken there: after the
        next barrier epoch, at the next step threshold, or at the run's end (a checkpoint if its last epoch
        is a barrier)."""
        # The first barrier epoch not behind `start` (a scan of every epoch, per segment, cost a long run's
        # coordinator most of its time between windows).
        after = bisect.bisect_left(self._barrier_order, start[0])
        ends = [((self._barrier_order[after] + 1, 0), True)] if after < len(self._barrier_order) else []
        ends.append(((self.epochs, 0), self.epochs - 1 in self.barrier_epochs))
        every = self.checkpoint_every_batches
        if every is not None:
            handed = start[0] * self.batches_per_epoch + start[1]
            epoch, batch = divmod((handed // every + 1) * every, self.batches_per_epoch)
            ends.append(((epoch, batch), True))
        end = min(position for position, _ in ends)
        return end, any(checkpoint for position, checkpoint in ends if position == end)

    def _checkpoint_point(self) -> tuple[int, int | None]:
        """The segment's end as a checkpoint's place: (epoch, None) after an epoch, else (epoch, batches of
        it handed out)."""
        epoch, batch = self.cursor.end
        return (epoch - 1, None) if batch == 0 else (epoch, batch)

    def state(self) -> dict[str, Any]:
        """What a resumed planner needs beyond its settings (taken between segments). Every wanted epoch
        before the segment's end had its eval in the segment's final round: only those past it are kept."""
        past = sorted(e for e in self.evaluated_epochs if e >= self.whole_epochs_end)
        return {"round": self.round, "evaluated_epochs": past}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state` (a checkpoint's; first_epoch is where it resumes)."""
        self.round = int(state["round"])
        self.evaluated_epochs = set(state["evaluated_epochs"])
        self._evals_left = [e for e in self._evals_left if e not in self.evaluated_epochs]

    def window_acks(self) -> list[RoundAck]:
        return [self.acks[r] for r in sorted(self.members)]

    def window_reports(self) -> list[WindowReport]:
        """The Reached reports of the window the last round averaged (overlapped: not the one open now)."""
        return [self.averaged[r] for r in sorted(self.members)]

    @property
    def overlapping(self) -> bool:
        """A round is in flight that the next window need not wait for (overlapped, not a segment's last)."""
        return self.overlap and self.averaging and not self.final_round

    def average_if_reached(self) -> list[Instruction]:
        """The round of a window reached already starts now: overlapped, once the round before is
        acknowledged; async, once the suspects it waited on spoke again."""
        return self._maybe_average()

    def _take_evals_before(self, end: int) -> tuple[int, ...]:
        """The wanted epochs before `end` not evaluated yet, now marked evaluated."""
        due = tuple(self._evals_left[: bisect.bisect_left(self._evals_left, end)])
        del self._evals_left[: len(due)]
        self.evaluated_epochs.update(due)
        return due

    def _batches(self, slices: tuple[EpochSlice, ...]) -> int:
        return sum(s.size for s in slices) // self.batch_size

    def _cadence_epoch(self) -> tuple[int, int]:
        """Cadence's window epoch (the oldest returned slice's, else the cursor's) and its batches left."""
        epoch = self.returned[0].epoch if self.returned else self.cursor.epoch
        left = self.holders.returned_batches(epoch)
        return epoch, left + (self.cursor.left_in_epoch() if self.cursor.epoch == epoch else 0)

    def _maybe_average(self) -> list[Instruction]:
        if self.averaging or not self.window_open or not self.members <= self.reached.keys():
            return []
        if self.suspects & self.members:
            return []
        self.averaging, self.window_open = True, False
        self.averaged = self.reached
        if self.overlap:  # cadence: every member trained all it was handed (its target is its window)
            for rank in self.members:
                self.queued[rank] = self.carried[rank] = 0
        self.round += 1
        return [self._average((), redo=False)]

    def _average(self, carried: tuple[int, ...], redo: bool, acked: frozenset[int] = frozenset()) -> Average:
        """The order for the round `self.round` among the members: `carried` (a redo's evals, already
        decided) and the wanted epochs due now; final when nothing is left to hand out and every member
        trains all it holds before it. `acked`: the members whose ack of the round a redo repeats counted
        what each holds after it (queued): final only if that is nothing."""
        self.acks = {}
        self.final_round = self.exhausted and all(
            self.queued[r] == 0 if r in acked else self.queued[r] + self.carried[r] <= self.targets[r]
            for r in self.members
        )
        # The final round evaluates every wanted epoch left; another, those settled. A redo keeps the evals
        # of its round (the driver decided them then), and adds only those left if it became the final.
        if self.final_round:
            due = self._take_evals_before(self.whole_epochs_end)
        else:
            due = () if redo else self._take_evals_before(self.settled_end)
        checkpoint = self._checkpoint_point() if self.final_round and self.checkpoint_at_end else None
        evaluate = tuple(sorted({*carried, *due}))
        self.in_flight = Average(self.round, evaluate, self.final_round, checkpoint, redo)
        return self.in_flight
