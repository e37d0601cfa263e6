"""The coordinator: a thread in the run's host that plans the ranks' work and aggregates what they report.

It owns the epoch ledger and the sinks; a policy driver decides what to send (`sync_driver.py`: each rank's
slice of each epoch, the per-step collective being DDP's; `local_sgd_driver.py`: when ranks average), and the
roster who is in (`roster.py`: under fault_tolerance=survive it cuts and admits members).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from flodl.checkpoints.disk import MODEL_FILE, Point
from flodl.coordinator.commit import CheckpointCommitter
from flodl.coordinator.driver import CoordinatorError, Driver
from flodl.coordinator.hooks import CallbackError, Hooks
from flodl.coordinator.ledger import EpochLedger
from flodl.coordinator.roster import RankHung, Roster
from flodl.counting import shown_epoch
from flodl.links.heartbeat import HeartbeatMonitor
from flodl.links.messages import (
    ChunkReport,
    EvalResult,
    Exiting,
    Heartbeat,
    Joined,
    Message,
    ModelSaved,
    Progress,
    Regrouped,
    Saved,
    SaveModel,
    Shutdown,
    StopRequested,
)
from flodl.links.stop import end_process
from flodl.links.transport import COORDINATOR, INBOX_WAIT_S, InboxReader, Mailbox
from flodl.metrics.sinks import Sink
from flodl.metrics.timeline import Timeline

# How long the loop waits for a message before it looks at the posted exits (and heartbeats, checkpoints by
# time) again: while the members wait at a round for a dead rank, nothing else wakes it, and each of those
# seconds is every member's (INBOX_WAIT_S, 0.5 s, made a kill's cut 0.41 s after it at the median on one GPU).
EXITS_WAIT_S = 0.1

log = logging.getLogger("flodl")
# How long a failed run waits for the parts its ranks still write (its hosting rank's, their Saved).
_LAST_PARTS_S = 30.0


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
        roster: Roster,
        save_on_hang: Callable[[], None] | None = None,
        gathers_model: bool = False,
    ) -> None:
        """`roster`: who is in (the driver's too); a rank lost ends the run, or is cut (survive).
        `gathers_model`: the model is sharded (shard_group > 1): every member gathers it for model.pt."""
        super().__init__(name="flodl-coordinator", daemon=True)
        self.roster = roster
        roster.attach(driver, self._stop_at_consensus, self.last_checkpoint)
        self.hooks = hooks
        # Why the run ends before its last epoch (a callback asked).
        self.stopped: str | None = None
        # Wall-clock times (time.time()) the coordinator started and finished the run.
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.monitor = monitor
        # Writes the consensus rank 0 holds when a peer goes silent (None: it holds none worth saving).
        self.save_on_hang = save_on_hang
        self.gathers_model = gathers_model
        # Commits checkpoints (None: checkpoints are off); a commit done wakes the loop to take it in.
        self.committer = committer
        if committer is not None:
            committer.on_sealed = reader.wake
        self.timeline = timeline
        self.run_dir = run_dir
        self.reader = reader
        self.outbox = outbox
        self.ledger = ledger
        self.driver = driver
        self.sinks = sinks
        self.error: BaseException | None = None
        self.stop_requested = threading.Event()
        # A stop that saves: the signal a rank got, and whether its own checkpoint is committed (the
        # committer knows which one that is: one taken before the request may commit after it).
        self.stop_signal: int | None = None
        self._stop_saved = False
        # A stop signal the run's host apart got (flodl-coordinator), for the loop to act on.
        self._host_signal: int | None = None
        # Set by the rank in this process that hosts the run (rank 0 under fault_tolerance=none) once it said
        # Saved for its last parts: a failed run waits for it before it commits them. None: a host apart.
        self.hosting_rank_done: threading.Event | None = None

    def run(self) -> None:
        try:
            self.reader.start()
            self.hooks.run_start()
            # The run starts now, not when the sinks were set up.
            self.timeline.start(self.run_dir)
            self.ledger.started_at = self.timeline.started
            self.started_at = time.time()
            self.driver.begin()
            self.monitor.started = time.perf_counter()
            while not (self._stop_saved or self._run_complete):
                if self.stop_requested.is_set():
                    raise CoordinatorError("stopped while waiting for rank reports")
                message = self.reader.next_message(EXITS_WAIT_S)
                if message is not None:
                    self._handle(message)
                else:
                    self._take_checkpoints()
                if self._host_signal is not None:
                    self._on_host_stop(self._host_signal)
                self.driver.tick()
                self._check_heartbeats(time.perf_counter())
                self.roster.check_exits()
            self.ended_at = time.time()
            if self._stop_saved:
                assert self.stop_signal is not None
                self._shut_down(f"stopped by {signal.Signals(self.stop_signal).name}", self.stop_signal)
                self.timeline.close(self.run_dir, plot=False)
                return
            self.roster.follow_changes(run_ended=True)
            self._save_model()
            self._shut_down(self.stopped or "done")
            self.timeline.close(self.run_dir)
        except BaseException as err:  # surfaced to rank 0's main thread through self.error
            if isinstance(err, CallbackError):  # every rank stops at its next message, naming the callback
                self._shut_down(str(err))
            self.error = err
            self._commit_what_is_written()
            try:  # the run stops (Ctrl-C, preemption, a failure): keep the timeline up to here
                self.timeline.close(self.run_dir, plot=False)
            except Exception as save_err:
                log.warning("could not write the timeline: %s: %s", type(save_err).__name__, save_err)
        finally:
            if self.committer is not None:
                self.committer.close()
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
            end_process(1)

    def _save_model(self) -> None:
        """The run's end: every member holds the final model; the first writes it as model.pt (a member cut
        meanwhile hands it to the next one). A sharded model: every member is asked, to gather it together
        for the first."""
        path = self.run_dir / MODEL_FILE
        asked: int | None = None
        while True:
            holders = sorted(self.roster.holders)
            if not holders:
                raise CoordinatorError("no member holding the final model is left to write it")
            if asked not in holders:
                asked = holders[0]
                for member in holders if self.gathers_model else [asked]:
                    self.outbox.send(member, SaveModel(str(path)))
            if self.stop_requested.is_set():
                raise CoordinatorError("stopped while the final model was written")
            message = self.reader.next_message(INBOX_WAIT_S)
            if isinstance(message, ModelSaved) and message.rank == asked:
                return
            if isinstance(message, Exiting) and message.rank == asked:
                self.roster.on_writer_exiting(message)
            rank = getattr(message, "rank", None)
            if rank is not None:
                self.monitor.heard(rank, time.perf_counter())
            self._check_heartbeats(time.perf_counter())
            self.roster.check_exits()

    @property
    def _run_complete(self) -> bool:
        return self.driver.done and self.ledger.all_emitted and self._checkpoints_committed

    def _shut_down(self, reason: str, signum: int | None = None) -> None:
        # Every seat's inbox, the cut ones' too: a rank waiting to be admitted ends with the run.
        for rank in self.roster.seats:
            self.outbox.send(rank, Shutdown(reason, signum))

    def stop_from_host(self, signum: int) -> None:
        """The run's host apart (flodl-coordinator) got a stop signal: the run stops as on a member's, whether
        the ranks got it too or not. Any thread."""
        self._host_signal = signum
        self.reader.wake()

    def _on_stop_requested(self, message: StopRequested) -> None:
        """A rank got a stop signal: the ranks save a checkpoint at the next boundary, then stop."""
        if self.stop_signal is not None or self.committer is None:
            return  # asked already (every rank may get the signal); without checkpoints ranks stop at once
        if not self.roster.takes_stop_from(message.rank):
            name = signal.Signals(message.signum).name
            log.info("rank %d got %s but is no member of the run (cut): the run goes on", message.rank, name)
            return
        self._stop_saving(message.signum, f"rank {message.rank}")

    def _on_host_stop(self, signum: int) -> None:
        self._host_signal = None
        if self.stop_signal is not None:
            return
        if self.committer is None:  # nothing to save: the ranks are told to stop now (they may not know)
            self.stop_signal, self._stop_saved = signum, True
            return
        self._stop_saving(signum, "the run's host")

    def _stop_saving(self, signum: int, who: str) -> None:
        assert self.committer is not None
        self.stop_signal = signum
        self.committer.stop_requested()
        self.driver.stop_saving()
        log.info(
            "%s got %s: the ranks save a checkpoint at the next %s, then stop",
            who,
            signal.Signals(signum).name,
            self.driver.boundary,
        )

    @property
    def last_epoch(self) -> int:
        return self.ledger.epochs - 1

    def _stop_if_asked(self) -> None:
        reason = self.hooks.run.stop_reason
        if reason is None or self.stopped is not None:
            return
        last = self._stop_at_consensus(reason)
        log.info("the run stops after epoch %d: %s", shown_epoch(last), reason)

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
        return self.committer is None or not (self.committer.remaining or self.committer.sealing)

    def last_checkpoint(self) -> str:
        committed = self.committer.committed if self.committer is not None else None
        return str(committed.path) if committed is not None else "none (checkpoints are off or none was due)"

    def _check_heartbeats(self, now: float) -> None:
        silent = self.monitor.silent(now)
        if silent:
            self.roster.on_silent(silent, now)

    def _take_checkpoints(self) -> None:
        """Commit the checkpoints whose parts are in; take in those committed since the last look."""
        if self.committer is None:
            return
        for checkpoint in self.committer.poll(self.ledger):
            self.hooks.checkpoint(checkpoint.epoch, checkpoint.path)
            self._stop_if_asked()
        if self.stop_signal is not None and self.committer.stop_saved:
            self._stop_saved = True

    def _on_saved(self, message: Saved) -> None:
        assert self.committer is not None, "a Saved report without checkpoints"
        point = Point(message.epoch, message.into)
        if message.step is not None and point not in self.committer.expected:  # a stop's, unplanned
            self.driver.expect_checkpoint(point, message.step)
        self.committer.on_saved(point, message.rank, message.chunks, self.ledger, message.after_stop)

    def _commit_what_is_written(self) -> None:
        """The run failed: a checkpoint whose every part was written before it still counts (a NaN a few
        steps after a checkpoint must not lose it). A rank that fails says Saved for the parts it wrote
        before it goes (the rank in this process, if any, as its part ends: `hosting_rank_done`): take in
        those said so far, up to a Shutdown this sends itself after them, and commit each checkpoint now
        whole. Not for a silent rank: its part never comes."""
        committer = self.committer
        if committer is None or not committer.writing or isinstance(self.error, RankHung):
            return
        try:
            if self.hosting_rank_done is not None:
                self.hosting_rank_done.wait(_LAST_PARTS_S)
            self.outbox.send(COORDINATOR, Shutdown(reason="the run failed: its last parts are in"))
            while not isinstance(message := self.reader.next_message(_LAST_PARTS_S), Shutdown | None):
                if isinstance(message, Saved):
                    self._on_saved(message)
            committer.poll(self.ledger, wait_sealed=True)
        except Exception as err:
            log.warning("the checkpoints written before the failure are not committed: %s", err)

    def _handle(self, message: Message) -> None:
        rank = getattr(message, "rank", None)
        if rank is not None:
            self.monitor.heard(rank, time.perf_counter(), getattr(message, "step", None))
        if isinstance(message, Heartbeat):
            return
        if isinstance(message, Saved):
            self._on_saved(message)
        elif isinstance(message, StopRequested):
            self._on_stop_requested(message)
        elif isinstance(message, ChunkReport):
            if self.driver.on_chunk(message):  # else a cut rank's late report: its slice went to another
                self.timeline.chunk(message.rank, message.epoch, message.wall_ms, message.batches)
                if self.ledger.add_chunk(message):
                    self.driver.on_epoch_complete(message.epoch)
        elif isinstance(message, EvalResult):
            if self.driver.counts_eval(message):  # else: the eval of a round that was cut
                self.ledger.add_eval(message)
        elif isinstance(message, Joined):
            self.roster.on_joined(message)
        elif isinstance(message, Regrouped):
            self.roster.on_regrouped(message)
            self.driver.on_regrouped(message)
        elif isinstance(message, Progress):
            for sink in self.sinks:
                sink.progress(message)
        elif isinstance(message, Exiting):
            self.roster.on_exiting(message)
        else:
            self.driver.on_message(message)
        for metrics in self.ledger.emit_ready():
            self.timeline.epoch_done(metrics.epoch)
            for sink in self.sinks:
                sink.emit(metrics)
            self.hooks.epoch_end(metrics.epoch, metrics.as_record())
            self._stop_if_asked()
            self.driver.on_epoch_emitted(metrics.epoch)
        self._take_checkpoints()
        self.roster.follow_changes()  # last: planning the next epoch may have admitted a rank (sync)
