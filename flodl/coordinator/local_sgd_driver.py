"""The coordinator's local-SGD driver: windows, reduces, ElChe and the divergence guard.

A window opens with per-rank counts from ElChe; when every rank has reached its count the driver
orders a reduce (AverageNow); once every rank has acknowledged it, the divergence guard reads the
round, ElChe gets the window's timings and the guard's verdict, and the next window opens. With
overlapped rounds the next window opens with the AverageNow instead, and the acks (so the guard's and
ElChe's reading of the round) come in while it trains; its own round waits for them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from flodl.checkpoints.disk import Point
from flodl.coordinator.commit import CheckpointCommitter
from flodl.coordinator.ledger import EpochLedger
from flodl.coordinator.roster import Roster
from flodl.counting import shown_epoch
from flodl.links.messages import (
    AverageNow,
    ChunkReport,
    EpochSlice,
    EvalResult,
    ExtendPartition,
    Message,
    Reached,
    Regrouped,
    RoundAck,
)
from flodl.links.transport import Mailbox
from flodl.metrics.aggregate import RoundCost
from flodl.metrics.timeline import Timeline
from flodl.rounds.elche import ElChe, round_overhead_ms
from flodl.rounds.epochs_done import EpochsDone
from flodl.rounds.guard import ConvergenceGuard, DivergenceReport
from flodl.rounds.orders import Average, Dispatch, Instruction, WindowReport
from flodl.rounds.planner import LocalSgdPlanner
from flodl.rounds.supply import SUSPECT_BEATS, Supplied, top_up

log = logging.getLogger("flodl")


class LocalSgdDriver:
    def __init__(
        self,
        planner: LocalSgdPlanner,
        elche: ElChe,
        guard: ConvergenceGuard,
        ledger: EpochLedger,
        outbox: Mailbox,
        timeline: Timeline,
        roster: Roster,
        committer: CheckpointCommitter | None = None,
        checkpoint_every_s: float | None = None,
        supplied: Supplied | None = None,
    ) -> None:
        """`roster`: who is in (the planner's and ElChe's members follow its changes).
        `checkpoint_every_s`: a checkpoint at the first round boundary this long after the last one (or the
        run's start). `supplied`: async under survive, the members kept training while a silent one holds
        up a round (rounds/supply.py)."""
        self.supplied = supplied
        self.timeline = timeline
        self.roster = roster
        self.committer = committer
        self.checkpoint_every_s = checkpoint_every_s
        self._last_checkpoint = time.monotonic()
        # Said once: a checkpoint by time waited for the last one on disk.
        self._said_disk_pace = False
        # Where the round in flight checkpoints (None: not a checkpoint round).
        self._checkpoint_at: Point | None = None
        # A stop that saves: no window opens after the segment it cut.
        self._stopping = False
        self.planner = planner
        self.elche = elche
        self.guard = guard
        self.ledger = ledger
        self.outbox = outbox
        # Epochs completed whose eval is not decided yet, and those decided.
        self._undecided_evals: set[int] = set()
        self._decided_evals = EpochsDone(ledger.first_epoch)
        self._round_costs: dict[int, RoundCost] = {}
        # Rounds every member acknowledged.
        self.rounds_closed = 0

    @property
    def done(self) -> bool:
        return self.planner.finished

    def begin(self) -> None:
        self._open_window()

    def state(self) -> dict[str, Any]:
        return {"planner": self.planner.state(), "elche": self.elche.state(), "guard": self.guard.state()}

    def on_chunk(self, chunk: ChunkReport) -> bool:
        """The rank trained one slice it was handed, whole; False: the rank was cut before this report was
        read, and its slice was handed to another (the report must not count)."""
        return self.planner.on_chunk(chunk.rank, EpochSlice(chunk.epoch, chunk.offset, chunk.samples))

    def counts_eval(self, result: EvalResult) -> bool:
        """Not the eval of a round a membership change cut (it is run again)."""
        return result.generation == self.roster.generation

    # --- the roster's changes ----------------------------------------------------------------------------

    def on_cut(self, ranks: list[int]) -> None:
        """The others form a group without `ranks`, a round they cut is run again among them, and their
        untrained batches go to them. A sharded group leaves whole: each drop's instructions supersede the
        last's (a round redone once more is the same round; one the change itself fires is no redo), so the
        members hear of one change."""
        instructions: list[Instruction] = []
        in_flight = self.planner.averaging
        if len(ranks) > 1:
            self._lose_in_step(ranks)
        for rank in ranks:
            instructions = self.planner.drop(rank) or instructions
            self.elche.retire(rank)
        if not in_flight:
            instructions = [replace(i, redo=False) if isinstance(i, Average) else i for i in instructions]
        redo = next((a for a in instructions if isinstance(a, Average) and a.redo), None)
        if redo is not None:
            self._round_costs = {}
            self.timeline.round_redone(redo.round)
            for epoch in redo.evaluate_epochs:  # its evals so far came from the cut round
                self.ledger.expect_eval(epoch, True, ranks=len(self.roster.members))
        # The members share the first one's state again while no round has closed (a death while the ranks
        # started may have cut the start's own broadcast).
        cut_round = redo.round if redo is not None else None
        self.roster.send_regroup([], cut_round, shares_state=self.rounds_closed == 0)
        self._carry(instructions)

    def _lose_in_step(self, ranks: list[int]) -> None:
        """A sharded group leaving: what a member trained in step with the others and died before reporting
        is not handed out again (its others' reports of those steps stand); lost with the group, as their
        reported steps since the last round are, and left out of its epoch's record."""
        for part in self.planner.holders.trained_in_step(ranks):
            batches = part.size // self.planner.batch_size
            log.warning(
                "ranks %s: %d batch(es) of epoch %d trained and not reported before their group left: lost "
                "with it, not in the epoch's samples",
                ranks,
                batches,
                shown_epoch(part.epoch),
            )
            if self.ledger.lose_batches(part.epoch, batches):
                self.on_epoch_complete(part.epoch)

    def on_regrouped(self, message: Regrouped) -> None:
        """A member formed the group (the roster times the change; the rounds need nothing of it)."""

    def _admit_joiners(self) -> None:
        """At a round's end: the restarted ranks waiting take part from the next window on, and receive the
        first member's state as the group forms."""
        joining = self.roster.admit_joiners()
        for rank in joining:
            self.planner.admit(rank)
            self.elche.admit(rank)
        self.roster.send_regroup(joining)

    def on_epoch_complete(self, epoch: int) -> None:
        self.planner.on_epoch_complete(epoch)
        if epoch not in self._decided_evals:  # a segment's final round decides its epochs, reported or not
            self._undecided_evals.add(epoch)

    def on_epoch_emitted(self, epoch: int) -> None:
        pass

    def tick(self) -> None:
        # Checkpoints by time are taken at round boundaries (_checkpoint_due).
        if self.supplied is not None:
            self.keep_supplied(self.supplied, time.perf_counter())

    def keep_supplied(self, supplied: Supplied, now: float) -> None:
        """While a member has not been heard from for a few heartbeats (frozen, cut off: it is cut at the
        timeout), the window's round waits for it (fired, the others would wait inside its collective), and
        the members that reached their count are handed more and train on. Heard again, the round fires."""
        planner, monitor = self.planner, self.roster.monitor
        silent = frozenset(
            r for r in planner.members if monitor.silence_of(r, now) > SUSPECT_BEATS * supplied.beat_s
        )
        # Nobody heard: this host is behind on its reading, not every member gone.
        if silent == planner.members:
            silent = frozenset()
        held, planner.suspects = planner.suspects, silent
        if not (silent and planner.window_open and not planner.averaging):
            supplied.clear()
            if held and not silent:
                self._carry(planner.average_if_reached())
            return
        for rank in sorted(planner.reached.keys() - silent):
            ms = self.elche.smoothed_ms(rank)
            if ms is None or not supplied.due(rank, now):
                continue
            dispatch = top_up(planner, rank, supplied.batches(ms))
            if dispatch is None:
                return  # the segment has no more to spare
            supplied.handed(rank, now, sum(s.size for s in dispatch.slices) // planner.batch_size, ms)
            self._carry([dispatch])

    boundary = "round (the window in flight, or the next, ends with it)"

    def stop_saving(self) -> None:
        self._stopping = True
        if self.planner.window_open:  # the window in flight is the last: its round is final and checkpoints
            self.planner.end_segment_here()
        else:
            self.planner.cut_segment()  # the next window is the last

    def expect_checkpoint(self, point: Point, step: int) -> None:
        raise RuntimeError(f"an unplanned checkpoint part under local SGD: {point}")

    def stop(self) -> int:
        # The last epoch gets its eval as a run's last epoch does: where the run has one (eval data, and
        # eval_every > 0). A run without asked it of the ranks, which have none to run, and waited for good.
        evaluates = self.planner.epochs - 1 in self.planner.eval_epochs
        last = self.planner.stop()
        if evaluates and last not in self._decided_evals:
            self.planner.want_eval(last)
        return last

    def on_message(self, message: Message) -> None:
        if isinstance(message, Reached):
            self.planner.suspects -= {message.rank}  # heard from
            self._carry(self.planner.on_reached(WindowReport(message.rank, message.steps, message.busy_ms)))
        elif isinstance(message, RoundAck):
            if message.generation != self.roster.generation:
                return  # a round the membership change cut: it is run again
            self.timeline.round_acked(message.round, message.rank, message.divergence, message.steps)
            self._round_costs[message.rank] = RoundCost(
                message.payload_bytes, message.round_ms, message.steps_during_round, message.comm_ms
            )
            if self.planner.on_ack(message):
                self.ledger.close_round(message.round, self._round_costs)
                self._round_costs = {}
                self.rounds_closed += 1
                self.roster.on_good_round(message.generation)
                if not message.skipped:  # a skip is the same on every rank: nobody moved
                    self._feed_round()
                if self._checkpoint_at is not None and self.committer is not None:
                    self.committer.expect_parts(self._checkpoint_at, self.planner.members)
                    self.committer.on_checkpoint_round(self._checkpoint_at, self.state(), self.ledger)
                    self._checkpoint_at = None
                    self._last_checkpoint = time.monotonic()
                if self.done:
                    self.ledger.release()
                    return
                if self._stopping and self.planner.segment_done:
                    return  # its checkpoint commits, then the coordinator stops the ranks
                if self.planner.segment_done:
                    self.planner.next_segment()
                if self.roster.joiners:
                    self._admit_joiners()
                if self.planner.window_open:  # overlapped: the window after this round is open already
                    self._carry(self.planner.average_if_reached())
                else:
                    self._next_window()
        else:
            raise RuntimeError(f"unexpected message under local SGD: {message!r}")

    def _checkpoint_due(self) -> bool:
        """A checkpoint by time: the window about to open ends its segment. Not while a part of the last one
        is still being written: the ranks would wait for it at the next (the disk sets the pace, not
        training)."""
        every = self.checkpoint_every_s
        if every is None or self.committer is None or self.planner.cut_requested:
            return False
        if time.monotonic() - self._last_checkpoint < every:
            return False
        if self.committer.writing:
            if not self._said_disk_pace:
                self._said_disk_pace = True
                log.info(
                    "a checkpoint by time waits for the last one's parts to be on disk (they take longer "
                    "than checkpoint_every_s=%g s): checkpoints are taken as often as the disk allows",
                    every,
                )
            return False
        return True

    def _feed_round(self) -> None:
        """The guard reads the round's divergence; ElChe gets the window's timings and the verdict."""
        acks = self.planner.window_acks()
        reports = self.planner.window_reports()
        report = DivergenceReport([a.divergence for a in acks])
        action = self.guard.report(report, k_max=max(a.steps for a in acks))
        self.elche.report_timing(
            [r.busy_ms for r in reports],
            [r.steps for r in reports],
            reduce_ms=round_overhead_ms([a.round_ms for a in acks], [a.idle_ms for a in acks]),
        )
        for change in self.elche.apply_verdict(action.verdict, action.factor):
            log.info("anchor %d -> %d (%s)", change.old, change.new, change.reason)
            self.timeline.anchor_changed(change.old, change.new, change.reason)

    def _next_window(self) -> None:
        """Open the window after a round (a checkpoint by time may make it its segment's last)."""
        if self._checkpoint_due():
            self.planner.cut_segment()
        self._open_window()

    def _open_window(self) -> None:
        self._carry(self.planner.open_window(self.elche.counts(), self.elche.overshoot))

    def _carry(self, instructions: list[Instruction]) -> None:
        for instruction in instructions:
            if isinstance(instruction, Dispatch):
                self.outbox.send(
                    instruction.rank, ExtendPartition(list(instruction.slices), instruction.target)
                )
            else:
                average = instruction
                # A round run again keeps its ledger entry and its timeline line, and its evals, unless the
                # cut made it the last: then every epoch not decided yet is decided now.
                if not average.redo or average.final:
                    self._decide_evals(average)
                if not average.redo:
                    self.ledger.open_round(average.round)
                    self.timeline.round_started(average.round, average.evaluate_epochs)
                self._checkpoint_at = self._point(average.checkpoint_at)
                point = self._checkpoint_at
                order = AverageNow(
                    average.round,
                    list(average.evaluate_epochs),
                    average.final,
                    None if point is None else point.epoch,
                    self.roster.generation,
                    None if point is None else point.into,
                )
                for rank in sorted(self.roster.members):
                    self.outbox.send(rank, order)
                if self.planner.overlapping:  # the round's communication runs while the next window trains
                    self._next_window()

    def _decide_evals(self, average: Average) -> None:
        """Epochs settled since the last reduce learn whether they get an eval (this round's)."""
        deciding = {e for e in self._undecided_evals if e < self.planner.settled_end}
        if average.final:  # every epoch of the segment not decided yet is decided now
            segment = range(self._decided_evals.end, self.planner.whole_epochs_end)
            deciding |= {e for e in segment if e not in self._decided_evals}
        for epoch in deciding:
            self.ledger.expect_eval(epoch, epoch in average.evaluate_epochs, ranks=len(self.roster.members))
            self._decided_evals.add(epoch)
        self._undecided_evals -= deciding

    def _point(self, checkpoint_at: tuple[int, int | None] | None) -> Point | None:
        """The planner's checkpoint place as a checkpoint's point: inside an epoch, in samples into it."""
        if checkpoint_at is None:
            return None
        epoch, batches = checkpoint_at
        return Point(epoch, None if batches is None else batches * self.planner.batch_size)
