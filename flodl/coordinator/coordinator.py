"""The coordinator: a thread in rank 0 that plans the ranks' work and aggregates what they report.

It owns the epoch ledger and the sinks; a policy driver decides what to send. Under sync the per-step
collective is DDP's, so the sync driver only hands each rank its slice of each epoch, one epoch ahead (none
ahead under fault_tolerance=survive).
The local-SGD driver (cadence / async) decides when ranks average (see `local_sgd_driver.py`).
Under fault_tolerance=survive either driver also cuts and admits members.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from flodl.checkpoint import MODEL_FILE
from flodl.coordinator.commit import CheckpointCommitter
from flodl.coordinator.hooks import CallbackError, Hooks
from flodl.coordinator.ledger import EpochLedger
from flodl.coordinator.local_sgd_driver import LocalSgdDriver
from flodl.coordinator.lockstep import LockstepPlan, Segment
from flodl.coordinator.survivors import MembershipChange, SurviveSettings, post_cut, root_store
from flodl.counting import shown_epoch
from flodl.metrics.sinks import Sink
from flodl.metrics.timeline import Timeline
from flodl.wire.heartbeat import HeartbeatMonitor
from flodl.wire.membership import ExitReader
from flodl.wire.messages import (
    ChunkReport,
    EvalResult,
    Exiting,
    FirstStep,
    Heartbeat,
    Joined,
    Message,
    ModelSaved,
    Progress,
    Regroup,
    Regrouped,
    Saved,
    SaveModel,
    Shutdown,
    StartEpoch,
)
from flodl.wire.transport import InboxReader, Mailbox

log = logging.getLogger("flodl")

# Sync plans are sent this many epochs ahead of the one being aggregated, so no rank waits for a plan.
# Under fault_tolerance=survive none are: a restarted rank is then admitted at the next epoch boundary, and
# the members wait a coordinator round trip (milliseconds) between epochs.
PLAN_LOOKAHEAD = 1
_WAIT_S = 0.5


@dataclass(frozen=True)
class EpochSchedule:
    epochs: int
    world_size: int
    total_picks: int
    # Samples per rank per optimizer step (batch_size x grad_accum): what the plans are cut in.
    batch_size: int
    eval_every: int
    has_eval: bool

    def evaluates_after(self, epoch: int) -> bool:
        if not self.has_eval or self.eval_every == 0:
            return False
        return (epoch + 1) % self.eval_every == 0 or epoch == self.epochs - 1

    def eval_epochs(self) -> frozenset[int]:
        return frozenset(e for e in range(self.epochs) if self.evaluates_after(e))


class CoordinatorError(RuntimeError):
    pass


class RankHung(CoordinatorError):
    """A rank went silent for longer than heartbeat_timeout_s."""


class TooFewRanks(CoordinatorError):
    """fault_tolerance=survive: fewer members than min_ranks are left (the run ended at a consensus)."""


class Driver(Protocol):
    """A policy's decisions: what to send when the run starts and as reports arrive."""

    def begin(self) -> None: ...

    def state(self) -> dict[str, Any]:
        """What a resumed driver needs (taken at a checkpoint)."""
        ...

    def on_message(self, message: Message) -> None: ...

    def on_epoch_complete(self, epoch: int) -> None: ...

    def on_chunk(self, chunk: ChunkReport) -> bool:
        """Whether the chunk counts (survive: not a cut rank's late report)."""
        ...

    def counts_eval(self, result: EvalResult) -> bool:
        """Whether the eval counts (survive: not one of a round, or a plan, that a change cut)."""
        ...

    @property
    def generation(self) -> int:
        """The averaging group's generation (fault_tolerance=survive; 0 otherwise)."""
        ...

    def on_epoch_emitted(self, epoch: int) -> None: ...

    def stop(self) -> int:
        """Hand out no work past the current epoch boundary; return the last epoch any rank trains."""
        ...

    @property
    def done(self) -> bool: ...

    @property
    def members(self) -> set[int]:
        """The ranks that train and average (every rank, unless fault_tolerance=survive cut one)."""
        ...

    @property
    def holders(self) -> set[int]:
        """The members that hold the run's latest model (not one admitted and still waiting for it)."""
        ...


class SyncDriver:
    """Sync: each epoch's plan, `lookahead` epochs ahead. Under fault_tolerance=survive also who is in: a cut
    member's untrained picks are planned again for the others once they agreed where they are
    (flodl/coordinator/lockstep.py), and a restarted rank is admitted between two epochs."""

    def __init__(
        self,
        schedule: EpochSchedule,
        ledger: EpochLedger,
        outbox: Mailbox,
        first_epoch: int,
        committer: CheckpointCommitter | None = None,
        lookahead: int = PLAN_LOOKAHEAD,
    ) -> None:
        """`committer`: the checkpoints (None: checkpoint_every is off); its due epochs are the ones whose
        plan asks for the ranks' parts. `lookahead`: epochs planned beyond the one being aggregated."""
        self.schedule = schedule
        self.lookahead = lookahead
        self.ledger = ledger
        self.outbox = outbox
        self.committer = committer
        self.first_epoch = first_epoch
        self.planned = first_epoch - 1
        self.stopped = False
        self.plan = LockstepPlan(schedule.total_picks, schedule.batch_size)
        # fault_tolerance=survive: the group's generation and members, restarted ranks waiting for the next
        # epoch boundary, those admitted but not yet in a formed group, and those the coordinator has not
        # looked at yet (see LocalSgdDriver).
        self.generation = 0
        self.members = set(range(schedule.world_size))
        self.joiners: set[int] = set()
        self.unformed: set[int] = set()
        self.admitted: list[int] = []
        # The newest group whose first step went through (its first good round; -1: none yet). Sync hears of
        # no other round: its steps are the ranks' own all-reduces.
        self.good_round_generation = -1
        # A cut's generation whose rest is still to be planned (once its members agreed where they are).
        self._replan: int | None = None

    def begin(self) -> None:
        for epoch in range(
            self.first_epoch, min(self.schedule.epochs, self.first_epoch + self.lookahead + 1)
        ):
            self._plan(epoch)

    def state(self) -> dict[str, Any]:
        return {}  # the epoch is all a sync run needs, and the checkpoint records it

    def on_message(self, message: Message) -> None:
        if isinstance(message, FirstStep):
            if message.generation == self.generation:
                self.good_round_generation = message.generation
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

    def stop(self) -> int:
        # The epochs already sent are trained by every rank (their StartEpoch is queued on each).
        self.stopped = True
        return self.planned

    @property
    def done(self) -> bool:
        """Every epoch is planned (nothing else to wait for beyond the ledger; no admission ahead)."""
        return self.stopped or self.planned >= self.schedule.epochs - 1

    def _plan(self, epoch: int) -> None:
        if self.joiners:
            self._admit_joiners()
        self.planned = epoch
        self._send(self.plan.open(epoch, self.members, self.generation))

    def _send(self, segment: Segment) -> None:
        """Send `segment` to its members: its epoch waits for their eval, checkpoint parts and batches."""
        epoch = segment.epoch
        evaluate = self.schedule.evaluates_after(epoch)
        checkpoint = self.committer is not None and epoch in self.committer.remaining
        self.ledger.expect_eval(epoch, evaluate, ranks=len(segment.members))
        if checkpoint and self.committer is not None:
            self.committer.expect_parts(epoch, segment.members)
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
            )
            self.outbox.send(rank, order)

    # --- fault_tolerance=survive ------------------------------------------------------------------------

    def cut(self, rank: int) -> None:
        """`rank` is gone: the others abort the step in flight and form a group without it; once they
        agreed where they are (their Regrouped), the rest is planned for them."""
        self.generation += 1
        self._replan = self.generation
        self.members.discard(rank)
        self.joiners.discard(rank)
        self.unformed.discard(rank)
        # A restarted rank admitted but not yet in a group joins this one (its own admission is overtaken).
        order = Regroup(self.generation, sorted(self.members), sorted(self.unformed), shares_state=True)
        for member in sorted(self.members):
            self.outbox.send(member, order)

    @property
    def holders(self) -> set[int]:
        return self.members - self.unformed

    def join(self, rank: int) -> None:
        """A restarted rank is admitted with the next epoch planned."""
        self.joiners.add(rank)

    def _admit_joiners(self) -> None:
        self.generation += 1
        self.members |= self.joiners
        self.unformed |= self.joiners
        self.admitted.extend(sorted(self.joiners))
        order = Regroup(
            self.generation, sorted(self.members), sorted(self.joiners), shares_state=True, in_order=True
        )
        self.joiners = set()
        for member in sorted(self.members):
            self.outbox.send(member, order)

    def on_regrouped(self, message: Regrouped) -> None:
        if message.generation != self.generation:
            return
        self.unformed.discard(message.rank)
        if message.position is not None and self._replan == self.generation:
            self._replan = None
            self._plan_rest(*message.position)

    def _plan_rest(self, epoch: int, step: int) -> None:
        """The members agreed they trained `step` steps of `epoch` (nothing yet: epoch -1): plan the rest of
        it and the epochs planned after it for them."""
        if epoch < self.first_epoch:
            epoch, step = self.first_epoch, 0
        if epoch <= self.planned and step == self.plan.last_segment(epoch).end_step:
            epoch, step = epoch + 1, 0  # that epoch is trained: its eval and checkpoint may not be
        if step > 0:
            rest = self.plan.cut_short(epoch, step, self.members, self.generation)
            log.info(
                "epoch %d: the members trained %d steps of it; its rest goes to ranks %s, %d steps each "
                "(%d picks that make no whole step dropped)",
                shown_epoch(epoch), step, list(rest.members), rest.steps, rest.dropped,
            )  # fmt: skip
            self._send(rest)
        else:
            previous = epoch - 1
            if self.first_epoch <= previous <= self.planned and previous >= self.ledger.next_to_emit:
                # Trained, but a member may have died before its eval or checkpoint part: again, by everyone.
                end = self.plan.last_segment(previous).end_step
                self._send(self.plan.cut_short(previous, end, self.members, self.generation))
            if epoch <= self.planned:
                self._send(self.plan.open(epoch, self.members, self.generation))
        for later in range(epoch + 1, self.planned + 1):
            self._send(self.plan.open(later, self.members, self.generation))


class Coordinator(threading.Thread):
    def __init__(
        self,
        reader: InboxReader,
        outbox: Mailbox,
        ledger: EpochLedger,
        driver: Driver,
        sinks: list[Sink],
        timeline: Timeline,
        run_dir: Path,
        monitor: HeartbeatMonitor,
        committer: CheckpointCommitter | None,
        hooks: Hooks,
        save_on_hang: Callable[[], None] | None = None,
        survive: SurviveSettings | None = None,
    ) -> None:
        """`survive`: fault_tolerance=survive (under any policy: the sync or the local-SGD driver, each of
        which knows the members); None: a rank's death ends the run."""
        super().__init__(name="flodl-coordinator", daemon=True)
        self.survive = survive
        # survive: each rank's current process (0: the first), the change being carried out, and why the
        # run ended short of ranks (an error once model.pt is written).
        self.incarnations: dict[int, int] = {}
        # The exits the self-launch supervisor posts (each one cut at once).
        self._exits = ExitReader(root_store(outbox.store)) if survive is not None else None
        # Restarted ranks waiting for admission: when they said so, and their start-up time.
        self.joined: dict[int, tuple[float, float]] = {}
        self.changes: list[MembershipChange] = []
        self.too_few: TooFewRanks | None = None
        self.hooks = hooks
        # Why the run ends before its last epoch (a callback asked).
        self.stopped: str | None = None
        # Wall-clock times (time.time()) the coordinator started and finished the run.
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.monitor = monitor
        # Writes the consensus rank 0 holds when a peer goes silent (None: it holds none worth saving).
        self.save_on_hang = save_on_hang
        # Commits checkpoints (None: checkpoint_every is off).
        self.committer = committer
        self.timeline = timeline
        self.run_dir = run_dir
        self.reader = reader
        self.outbox = outbox
        self.ledger = ledger
        self.driver = driver
        self.sinks = sinks
        self.error: BaseException | None = None
        self.stop_requested = threading.Event()

    def run(self) -> None:
        try:
            self.reader.start()
            self.hooks.run_start()
            # The run starts now, not when the sinks were set up.
            self.ledger.started_at = self.timeline.started = time.perf_counter()
            self.started_at = time.time()
            self.driver.begin()
            self.monitor.started = time.perf_counter()
            while not (self.driver.done and self.ledger.all_emitted and self._checkpoints_committed):
                if self.stop_requested.is_set():
                    raise CoordinatorError("stopped while waiting for rank reports")
                message = self.reader.next_message(_WAIT_S)
                if message is not None:
                    self._handle(message)
                self._check_heartbeats(time.perf_counter())
                if self._exits is not None:
                    self._check_exits()
            self.ended_at = time.time()
            if self.survive is not None:
                self._follow_changes(run_ended=True)
            self._save_model()
            self._shut_down(self.stopped or "done")
            self.timeline.save(self.run_dir)
        except BaseException as err:  # surfaced to rank 0's main thread through self.error
            if isinstance(err, CallbackError):  # every rank stops at its next message, naming the callback
                self._shut_down(str(err))
            self.error = err
            try:  # the run stops (Ctrl-C, preemption, a failure): keep the timeline up to here
                self.timeline.save(self.run_dir, plot=False)
            except Exception as save_err:
                log.warning("could not save the timeline: %s: %s", type(save_err).__name__, save_err)
        finally:
            for sink in self.sinks:
                sink.close()
            self.reader.stop(self.outbox)
        if isinstance(self.error, RankHung):
            # The ranks' training threads wait in collectives with the silent rank, which would hold them for
            # the whole collective timeout: end this process now; the launcher stops the others.
            log.error("%s", self.error)
            if self.save_on_hang is not None:  # bounded: nothing may keep this process from ending
                saver = threading.Thread(target=self.save_on_hang, name="flodl-save-on-hang", daemon=True)
                saver.start()
                saver.join(timeout=30)
            logging.shutdown()
            os._exit(1)

    def _save_model(self) -> None:
        """The run's end: every member holds the final model; the first writes it as model.pt (a member cut
        meanwhile hands it to the next one)."""
        path = self.run_dir / MODEL_FILE
        asked: int | None = None
        while True:
            holders = sorted(self.driver.holders)
            if not holders:
                raise CoordinatorError("no member holding the final model is left to write it")
            if asked not in holders:
                asked = holders[0]
                self.outbox.send(asked, SaveModel(str(path)))
            if self.stop_requested.is_set():
                raise CoordinatorError("stopped while the final model was written")
            message = self.reader.next_message(_WAIT_S)
            if isinstance(message, ModelSaved) and message.rank == asked:
                return
            if isinstance(message, Exiting) and message.rank == asked and self.survive is None:
                raise CoordinatorError(
                    f"rank {asked} exited before it wrote the final model: {message.reason}"
                )
            rank = getattr(message, "rank", None)
            if rank is not None:
                self.monitor.heard(rank, time.perf_counter())
            self._check_heartbeats(time.perf_counter())
            if self._exits is not None:
                self._check_exits()

    def _shut_down(self, reason: str) -> None:
        # Every rank's inbox, the cut ones' too: a restarted rank waiting to be admitted ends with the run.
        for rank in range(self.ledger.world_size):
            self.outbox.send(rank, Shutdown(reason))

    @property
    def last_epoch(self) -> int:
        return self.ledger.epochs - 1

    def _stop_if_asked(self) -> None:
        reason = self.hooks.run.stop_reason
        if reason is None or self.stopped is not None:
            return
        last = self._stop_at_consensus(reason)
        log.info("the run stops after epoch %d: %s", shown_epoch(last), reason)

    # --- fault_tolerance=survive ------------------------------------------------------------------------

    def _cut(self, rank: int, why: str, exited_at: float | None = None) -> None:
        """`rank` is gone: the others go on without it, or the run ends if too few are left. `exited_at`: when
        its supervisor saw its process end (unix seconds), if that is how it is known."""
        assert self.survive is not None
        driver = self._survivors()
        post_cut(self.outbox.store, rank, self.incarnations.get(rank, 0))
        timings = {"silent_s": self.monitor.silence_of(rank, time.perf_counter())}
        if exited_at is not None:  # how long after the death the cut came
            timings["after_exit_s"] = time.time() - exited_at
        self.ledger.membership_event("rank_cut", rank, timings)
        self.monitor.forget(rank)
        driver.cut(rank)
        members = sorted(driver.members)
        log.warning("rank %d is out (%s); the run goes on with ranks %s", rank, why, members)
        self.changes.append(MembershipChange("cut", rank, driver.generation, members, why))
        if len(members) < self.survive.min_ranks and self.too_few is None:
            self.too_few = TooFewRanks(
                f"only {len(members)} rank(s) left ({members}) after rank {rank} was cut ({why}); "
                f"min_ranks={self.survive.min_ranks}: the run stops at its next consensus"
            )
            self._stop_at_consensus(str(self.too_few))

    def _on_joined(self, message: Joined) -> None:
        """A restarted rank: its old process is gone for certain; it is admitted at the next round's end."""
        if self.survive is None:
            raise CoordinatorError(f"rank {message.rank} restarted, but fault_tolerance is not survive")
        if self._exits is not None:  # its supervisor posted the old process's end before it started this one
            self._check_exits()
        driver = self._survivors()
        if message.rank in driver.members:
            self._cut(message.rank, f"restarted as incarnation {message.incarnation}")
        self.incarnations[message.rank] = message.incarnation
        self.joined[message.rank] = (time.perf_counter(), message.startup_s)
        if self.too_few is None and not driver.done:
            log.info("rank %d (incarnation %d) waits to be admitted", message.rank, message.incarnation)
            driver.join(message.rank)

    def _follow_changes(self, run_ended: bool = False) -> None:
        """Admissions the driver made, first good rounds after a change, and each finished change's line
        (`run_ended`: every change's, finished or not)."""
        driver = self._survivors()
        while driver.admitted:
            rank = driver.admitted.pop(0)
            self.monitor.watch(rank, time.perf_counter())
            members = sorted(driver.members)
            joined_at, startup_s = self.joined.pop(rank)
            change = MembershipChange(
                "admitted", rank, driver.generation, members, f"incarnation {self.incarnations[rank]}",
                startup_s=startup_s,
            )  # fmt: skip
            change.waited_s = change.started - joined_at
            self.changes.append(change)
            self.ledger.membership_event(
                "rank_admitted", rank, {"startup_s": startup_s, "waited_s": change.waited_s}
            )
        for change in self.changes:
            change.on_good_round(driver.good_round_generation)
        # In order; a change the next one overtook (its group never formed, or no round closed in it) too.
        while self.changes and (self.changes[0].done or len(self.changes) > 1 or run_ended):
            change = self.changes.pop(0)
            log.warning("%s", change.line(run_ended and len(self.changes) == 0))
            self.timeline.membership_changed(change.event())

    def _survivors(self) -> LocalSgdDriver | SyncDriver:
        assert isinstance(self.driver, LocalSgdDriver | SyncDriver), "survive: a driver that knows members"
        return self.driver

    def _stop_at_consensus(self, reason: str) -> int:
        """End the run at the next epoch boundary (its last round is exact); the last epoch trained."""
        last = self.driver.stop()
        self.ledger.end_after(last)
        if self.committer is not None:
            self.committer.remaining = {e for e in self.committer.remaining if e <= last}
        self.stopped = reason
        return last

    @property
    def _checkpoints_committed(self) -> bool:
        return self.committer is None or not self.committer.remaining

    def last_checkpoint(self) -> str:
        committed = self.committer.committed if self.committer is not None else None
        return (
            str(committed.path) if committed is not None else "none (checkpoint_every is off or none was due)"
        )

    def _check_exits(self) -> None:
        """survive: cut at once the members whose process ended, as their supervisor saw it (an earlier
        incarnation's exit is old news: its restart is here already)."""
        assert self._exits is not None
        for ended in self._exits.new():
            rank = ended["rank"]
            if rank in self._survivors().members and ended["incarnation"] == self.incarnations.get(rank, 0):
                self._cut(rank, f"its process ended: {ended['cause']}", exited_at=ended["at"])

    def _check_heartbeats(self, now: float) -> None:
        silent = self.monitor.silent(now)
        if self.survive is not None:  # the coordinator's process trains nothing: any rank may be cut
            for rank in silent:
                self._cut(rank, f"no heartbeat for {self.monitor.silence_of(rank, now):.1f} s")
            return
        if silent:
            described = "; ".join(self.monitor.describe(rank, now) for rank in silent)
            raise RankHung(
                f"{described} (heartbeat_timeout_s={self.monitor.timeout_s:g}); stopping the job. "
                f"Last checkpoint: {self.last_checkpoint()}"
            )

    def _handle(self, message: Message) -> None:
        rank = getattr(message, "rank", None)
        if rank is not None:
            self.monitor.heard(rank, time.perf_counter(), getattr(message, "step", None))
        if isinstance(message, Heartbeat):
            return
        if isinstance(message, Saved):
            assert self.committer is not None, "a Saved report without checkpoints"
            self.committer.on_saved(message.epoch, message.rank)
        elif isinstance(message, ChunkReport):
            if self.driver.on_chunk(message):  # else a cut rank's late report: its slice went to another
                self.timeline.chunk(message.rank, message.epoch, message.wall_ms, message.batches)
                if self.ledger.add_chunk(message):
                    self.driver.on_epoch_complete(message.epoch)
        elif isinstance(message, EvalResult):
            if self.driver.counts_eval(message):  # else: the eval of a round that was cut
                self.ledger.add_eval(message)
        elif isinstance(message, Joined):
            self._on_joined(message)
        elif isinstance(message, Regrouped):
            for change in self.changes:
                if change.generation == message.generation:
                    change.on_formed(message.rank, message.release_ms, message.form_ms)
            self._survivors().on_regrouped(message)
        elif isinstance(message, Progress):
            for sink in self.sinks:
                sink.progress(message)
        elif isinstance(message, Exiting):
            why = f": {message.reason}" if message.reason else ""
            if self.survive is None:
                raise CoordinatorError(f"rank {message.rank} exited before the run finished{why}")
            if message.rank in self._survivors().members:
                self._cut(message.rank, f"exiting{why}")
        else:
            self.driver.on_message(message)
        for metrics in self.ledger.emit_ready():
            self.timeline.epoch_done(metrics.epoch)
            for sink in self.sinks:
                sink.emit(metrics)
            self.hooks.epoch_end(metrics.epoch, metrics.as_record())
            self._stop_if_asked()
            self.driver.on_epoch_emitted(metrics.epoch)
        if self.committer is not None:
            for checkpoint in self.committer.poll(self.ledger, self.driver.state()):
                self.hooks.checkpoint(checkpoint.epoch, checkpoint.path)
                self._stop_if_asked()
        if self.survive is not None:  # last: planning the next epoch may have admitted a rank (sync)
            self._follow_changes()
