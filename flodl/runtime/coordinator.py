"""The coordinator: a thread in rank 0 that plans the ranks' work and aggregates what they report.

It owns the epoch ledger and the sinks; a policy driver decides what to send. Under sync the per-step
collective is DDP's, so the sync driver only hands each rank its slice of each epoch, one epoch ahead.
The local-SGD driver (cadence / async) decides when ranks average (see `local_sgd_driver.py`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from flodl.data.partition import equal_slices
from flodl.metrics.sinks import Sink
from flodl.metrics.timeline import Timeline
from flodl.runtime.ledger import EpochLedger
from flodl.runtime.messages import EvalResult, Exiting, Message, Metrics, Progress, Shutdown, StartEpoch
from flodl.runtime.transport import InboxReader, Mailbox

# Sync plans are sent this many epochs ahead of the one being aggregated, so no rank waits for a plan.
PLAN_LOOKAHEAD = 1
_WAIT_S = 0.5


@dataclass(frozen=True)
class EpochSchedule:
    epochs: int
    world_size: int
    total_picks: int
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


class Driver(Protocol):
    """A policy's decisions: what to send when the run starts and as reports arrive."""

    def begin(self) -> None: ...

    def on_message(self, message: Message) -> None: ...

    def on_epoch_complete(self, epoch: int) -> None: ...

    def on_epoch_emitted(self, epoch: int) -> None: ...

    @property
    def done(self) -> bool: ...


class SyncDriver:
    def __init__(self, schedule: EpochSchedule, ledger: EpochLedger, outbox: Mailbox) -> None:
        self.schedule = schedule
        self.ledger = ledger
        self.outbox = outbox
        self.slices = equal_slices(schedule.total_picks, schedule.world_size, schedule.batch_size)

    def begin(self) -> None:
        for epoch in range(min(self.schedule.epochs, PLAN_LOOKAHEAD + 1)):
            self._plan(epoch)

    def on_message(self, message: Message) -> None:
        raise CoordinatorError(f"unexpected message under policy=sync: {message!r}")

    def on_epoch_complete(self, epoch: int) -> None:
        pass

    def on_epoch_emitted(self, epoch: int) -> None:
        if epoch + PLAN_LOOKAHEAD + 1 < self.schedule.epochs:
            self._plan(epoch + PLAN_LOOKAHEAD + 1)

    @property
    def done(self) -> bool:
        return True  # nothing to wait for beyond the ledger

    def _plan(self, epoch: int) -> None:
        evaluate = self.schedule.evaluates_after(epoch)
        self.ledger.expect_eval(epoch, evaluate)
        for rank, part in enumerate(self.slices):
            self.outbox.send(rank, StartEpoch(epoch, part.offset, part.size, evaluate))


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
    ) -> None:
        super().__init__(name="flodl-coordinator", daemon=True)
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
            # The run starts now, not when the sinks were set up.
            self.ledger.started_at = self.timeline.started = time.perf_counter()
            self.driver.begin()
            while not (self.driver.done and self.ledger.all_emitted):
                if self.stop_requested.is_set():
                    raise CoordinatorError("stopped while waiting for rank reports")
                message = self.reader.next_message(_WAIT_S)
                if message is not None:
                    self._handle(message)
            for rank in range(self.ledger.world_size):
                self.outbox.send(rank, Shutdown())
            self.timeline.save(self.run_dir)
        except BaseException as err:  # surfaced to rank 0's main thread through self.error
            self.error = err
        finally:
            for sink in self.sinks:
                sink.close()
            self.reader.stop(self.outbox)

    def _handle(self, message: Message) -> None:
        if isinstance(message, Metrics):
            self.timeline.chunk(message.rank, message.epoch, message.wall_ms, message.batches)
            if self.ledger.add_chunk(message):
                self.driver.on_epoch_complete(message.epoch)
        elif isinstance(message, EvalResult):
            self.ledger.add_eval(message)
        elif isinstance(message, Progress):
            for sink in self.sinks:
                sink.progress(message)
        elif isinstance(message, Exiting):
            raise CoordinatorError(f"rank {message.rank} exited before the run finished")
        else:
            self.driver.on_message(message)
        for metrics in self.ledger.emit_ready():
            self.timeline.epoch_done(metrics.epoch)
            for sink in self.sinks:
                sink.emit(metrics)
            self.driver.on_epoch_emitted(metrics.epoch)
