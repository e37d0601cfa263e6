"""The sync driver: each epoch's slices, `lookahead` epochs ahead (none ahead under fault_tolerance=survive).

Under sync the per-step collective is DDP's, so the driver only hands each member its share of each epoch
(flodl/coordinator/lockstep.py). Under survive a cut stops the members where they are; once they agreed
where that is (their Regrouped), `replan_after_cut` says what is left to plan, and a restarted rank is
admitted with the next epoch planned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flodl.checkpoints.disk import Point
from flodl.coordinator.commit import CheckpointCommitter
from flodl.coordinator.driver import CoordinatorError, EpochSchedule
from flodl.coordinator.ledger import EpochLedger
from flodl.coordinator.lockstep import (
    KeptBatch,
    LockstepPlan,
    Segment,
    checkpoint_steps,
    rest_of,
    segment_from_state,
    segment_state,
)
from flodl.coordinator.roster import Roster
from flodl.counting import shown_epoch
from flodl.links.messages import ChunkReport, EvalResult, FirstStep, Message, Regrouped, StartEpoch
from flodl.links.stop import post_checkpoint_request
from flodl.links.transport import Mailbox

log = logging.getLogger("flodl")

# Sync plans are sent this many epochs ahead of the one being aggregated, so no rank waits for a plan.
# Under fault_tolerance=survive none are: a restarted rank is then admitted at the next epoch boundary, and
# the members wait a coordinator round trip (milliseconds) between epochs.
PLAN_LOOKAHEAD = 1


@dataclass(frozen=True)
class Replan:
    """What is planned for the members once they agreed where a cut left them."""

    # The epoch the cut ended short and the step of it the members reached: its rest is shared by them.
    rest_of: tuple[int, int] | None
    # An epoch trained to its end (and its last step) whose eval and checkpoint parts are asked of the members
    # again: a member may have died before its own.
    again: tuple[int, int] | None
    # The epochs planned afresh for the members (those planned already, after the cut one).
    fresh: range


def replan_after_cut(
    position: tuple[int, int], first_epoch: int, planned: int, next_to_emit: int, end_steps: Mapping[int, int]
) -> Replan:
    """The members agreed they trained `position` = (epoch, steps of it); (-1, _): nothing yet in this run.
    `planned`: the last epoch planned; `next_to_emit`: the ledger's oldest epoch not emitted; `end_steps`: the
    step each planned epoch's latest segment ends at. Pure."""
    epoch, step = position
    if epoch < first_epoch:
        epoch, step = first_epoch, 0
    if epoch <= planned and step == end_steps[epoch]:
        epoch, step = epoch + 1, 0  # that epoch is trained: its eval and checkpoint may not be
    if step > 0:
        return Replan(rest_of=(epoch, step), again=None, fresh=range(epoch + 1, planned + 1))
    previous = epoch - 1
    trained_whole = first_epoch <= previous <= planned and previous >= next_to_emit
    again = (previous, end_steps[previous]) if trained_whole else None
    return Replan(rest_of=None, again=again, fresh=range(epoch, planned + 1))


class SyncDriver:
    """Sync: each epoch's plan, `lookahead` epochs ahead, for the roster's members. A cut member's untrained
    picks are planned again for the others once they agreed where they are; a restarted rank is admitted
    between two epochs."""

    def __init__(
        self,
        schedule: EpochSchedule,
        ledger: EpochLedger,
        outbox: Mailbox,
        roster: Roster,
        first_epoch: int,
        committer: CheckpointCommitter | None = None,
        lookahead: int = PLAN_LOOKAHEAD,
        checkpoint_every_steps: int | None = None,
        resumed: dict[str, Any] | None = None,
        checkpoint_every_s: float | None = None,
        kept: KeptBatch | None = None,
    ) -> None:
        """`committer`: the checkpoints (None: checkpointing is off); its due epochs are the ones whose
        plan asks for the ranks' parts. `lookahead`: epochs planned beyond the one being aggregated.
        `checkpoint_every_steps`: a checkpoint inside an epoch at each multiple of it of the run's global
        steps. `resumed`: the driver's state of a checkpoint inside `first_epoch` (its rest).
        `checkpoint_every_s`: a checkpoint this long after the last request, at a step the ranks agree on.
        `kept` (keep_global_batch): the global step every membership trains, where it divides."""
        self.schedule = schedule
        self.lookahead = lookahead
        self.ledger = ledger
        self.outbox = outbox
        self.roster = roster
        self.committer = committer
        self.first_epoch = first_epoch
        self.planned = first_epoch - 1
        self.stopped = False
        self.plan = LockstepPlan(schedule.total_picks, schedule.batch_size, kept)
        # A cut's generation whose rest is still to be planned (once its members agreed where they are).
        self._replan: int | None = None
        self.checkpoint_every_steps = checkpoint_every_steps
        self.checkpoint_every_s = checkpoint_every_s
        self._checkpoint_requests = 0
        self._stop_saving = False
        self._last_request = time.monotonic()
        self._resumed_rest = resumed.get("rest") if resumed else None

    def begin(self) -> None:
        for epoch in range(
            self.first_epoch, min(self.schedule.epochs, self.first_epoch + self.lookahead + 1)
        ):
            self._plan(epoch)

    def state(self) -> dict[str, Any]:
        return {}  # the epoch is all a sync run needs, and the checkpoint records it

    def on_message(self, message: Message) -> None:
        if isinstance(message, FirstStep):  # sync's only round: its steps are the ranks' own all-reduces
            self.roster.on_good_round(message.generation)
            return
        raise CoordinatorError(f"unexpected message under policy=sync: {message!r}")

    def on_epoch_complete(self, epoch: int) -> None:
        pass

    def on_chunk(self, chunk: ChunkReport) -> bool:
        return self.plan.on_report(chunk.epoch, chunk.generation, chunk.rank)

    def counts_eval(self, result: EvalResult) -> bool:
        """The eval the epoch's latest plan asked for (one before a cut is asked again)."""
        return result.generation == self.plan.current_generation(result.epoch)

    def on_epoch_emitted(self, epoch: int) -> None:
        self.plan.forget_before(epoch)
        if epoch + self.lookahead + 1 < self.schedule.epochs and not self.stopped:
            self._plan(epoch + self.lookahead + 1)

    boundary = "step every rank agrees on"

    def tick(self) -> None:
        """A checkpoint by time is due: ask the ranks for it (they agree on its step, flodl/links/stop.py)."""
        every = self.checkpoint_every_s
        if every is None or self.committer is None or self.stopped or self._stop_saving:
            return
        if time.monotonic() - self._last_request >= every:
            self._checkpoint_requests += 1
            self._last_request = time.monotonic()
            post_checkpoint_request(self.outbox, self._checkpoint_requests)

    def stop_saving(self) -> None:
        """The ranks agree on the step themselves (flodl/links/stop.py), and say Saved with it; no checkpoint
        by time is asked after it (its agreed part would pass for the stop's)."""
        self._stop_saving = True

    def expect_checkpoint(self, point: Point, step: int) -> None:
        """A stop's checkpoint after `step` of `point.epoch`: the parts of the segment's members, and the rest
        of the epoch from there as the driver's state."""
        if self.committer is None or not self.plan.has(point.epoch):
            return  # the epoch is emitted and forgotten: the committer lets the point go
        segment = self.plan.segment(point.epoch)
        rest = rest_of(
            segment, step - segment.first_step, segment.members, segment.step_samples, segment.generation
        )
        self.committer.expect_parts(point, segment.members, {"rest": segment_state(rest)})

    def stop(self) -> int:
        # The epochs already sent are trained by every rank (their StartEpoch is queued on each).
        self.stopped = True
        return self.planned

    @property
    def done(self) -> bool:
        """Every epoch is planned (nothing else to wait for beyond the ledger; no admission ahead)."""
        return self.stopped or self.planned >= self.schedule.epochs - 1

    def _plan(self, epoch: int) -> None:
        roster = self.roster
        if roster.joiners:  # admitted where the members reach this Regroup: after the epochs planned before
            roster.send_regroup(roster.admit_joiners(), in_order=True)
        self.planned = epoch
        rest, self._resumed_rest = self._resumed_rest, None
        if rest is not None:  # resumed inside this epoch: the rest its checkpoint recorded
            segment = segment_from_state(rest, roster.generation)
            before = self.ledger.reported_batches(epoch), self.ledger.reported_samples(epoch)
            self._send(self.plan.resume(segment, roster.members, *before))
            return
        self._send(self.plan.open(epoch, roster.members, roster.generation))

    def _send(self, segment: Segment) -> None:
        """Send `segment` to its members: its epoch waits for their eval, checkpoint parts and batches."""
        epoch = segment.epoch
        evaluate = self.schedule.evaluates_after(epoch)
        checkpoint = self.committer is not None and epoch in self.committer.remaining
        self.ledger.expect_eval(epoch, evaluate, ranks=len(segment.members))
        if checkpoint and self.committer is not None:
            self.committer.expect_parts(Point(epoch), segment.members, self.state())
        inside = self._checkpoints_inside(segment)
        self.ledger.expect_batches(epoch, self.plan.expected_batches(epoch))
        if not (segment.steps or evaluate or checkpoint):
            return
        for rank in segment.members:
            order = StartEpoch(
                epoch,
                list(segment.shares[rank]),
                evaluate,
                checkpoint,
                segment.generation,
                segment.first_step,
                inside,
                segment.step_samples,
            )
            self.outbox.send(rank, order)

    def _checkpoints_inside(self, segment: Segment) -> list[list[int]]:
        """The checkpoints by steps inside `segment`, as [step of the epoch, samples of it trained]; the
        committer expects each with the rest of the epoch from there (the driver's state at it)."""
        every = self.checkpoint_every_steps
        if every is None or self.committer is None:
            return []
        plan, step_samples = self.plan, self.plan.step_samples
        before = plan.samples_before(segment.epoch)
        steps_per_epoch = plan.total_picks // (self.schedule.world_size * step_samples)
        inside = []
        for step in checkpoint_steps(segment, steps_per_epoch, every):
            trained = step - segment.first_step
            into = before + trained * len(segment.members) * segment.step_samples
            rest = rest_of(segment, trained, segment.members, segment.step_samples, segment.generation)
            self.committer.expect_parts(
                Point(segment.epoch, into), segment.members, {"rest": segment_state(rest)}
            )
            inside.append([step, into])
        return inside

    # --- the roster's changes ----------------------------------------------------------------------------

    def on_cut(self, ranks: list[int]) -> None:
        """The others abort the step in flight and form a group without `ranks`; once they agreed where they
        are (their Regrouped), the rest is planned for them. A restarted rank admitted but not yet in a group
        joins this one (its own admission is overtaken)."""
        self._replan = self.roster.generation
        if self.committer is not None:
            self.committer.cut(ranks)
        self.roster.send_regroup(sorted(self.roster.unformed))

    def on_regrouped(self, message: Regrouped) -> None:
        generation = self.roster.generation
        if message.generation == generation and message.position is not None and self._replan == generation:
            self._replan = None
            self._plan_rest((message.position[0], message.position[1]))

    def _say_kept(self, members: int, step: int) -> None:
        """keep_global_batch: whether the members keep the global step (by micro-batches) or it follows
        them."""
        kept = self.plan.kept
        if kept is None:
            return
        if members * step == kept.layout.global_batch:
            log.info(
                "keep_global_batch: %d members keep the global step of %d, %d samples each",
                members,
                step * members,
                step,
            )
        else:
            log.warning(
                "keep_global_batch: the global step of %d does not divide into whole micro-batches on %d "
                "members: it follows them (%d x %d), the learning rate scaled by lr_scale_ratio",
                kept.layout.global_batch,
                members,
                members,
                step,
            )

    def _plan_rest(self, position: tuple[int, int]) -> None:
        """Plan the rest of the cut epoch and the epochs planned after it for the members."""
        members, generation = self.roster.members, self.roster.generation
        end_steps = self.plan.end_steps()
        replan = replan_after_cut(
            position, self.first_epoch, self.planned, self.ledger.next_to_emit, end_steps
        )
        if replan.rest_of is not None:
            epoch, step = replan.rest_of
            rest = self.plan.cut_short(epoch, step, members, generation)
            log.info(
                "epoch %d: the members trained %d steps of it; its rest goes to ranks %s, %d steps of %d "
                "each (%d picks that make no whole step dropped)",
                shown_epoch(epoch),
                step,
                list(rest.members),
                rest.steps,
                rest.step_samples,
                rest.dropped,
            )
            self._say_kept(len(rest.members), rest.step_samples)
            self._send(rest)
        if replan.again is not None:
            self._send(self.plan.cut_short(*replan.again, members, generation))
        for epoch in replan.fresh:
            self._send(self.plan.open(epoch, members, generation))
