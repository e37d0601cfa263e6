"""The coordinator: a thread in rank 0 that plans epochs and aggregates what the ranks report.

Under sync the per-step collective is DDP's, so the coordinator never sits on the step path: it
hands each rank its slice of the epoch one epoch ahead, collects the ranks' Metrics and EvalResults,
and turns them into EpochMetrics for the sinks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from flodl.data.partition import Slice, equal_slices
from flodl.metrics.aggregate import aggregate_epoch
from flodl.metrics.sinks import Sink
from flodl.runtime.messages import EvalResult, Exiting, Metrics, Shutdown, StartEpoch
from flodl.runtime.transport import Mailbox

# Plans sent ahead of the epoch being aggregated, so a rank never waits for its next plan.
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


class CoordinatorError(RuntimeError):
    pass


class Coordinator(threading.Thread):
    def __init__(self, mailbox: Mailbox, schedule: EpochSchedule, sinks: list[Sink]) -> None:
        super().__init__(name="flodl-coordinator", daemon=True)
        self.mailbox = mailbox
        self.schedule = schedule
        self.sinks = sinks
        self.error: BaseException | None = None
        self.stop_requested = threading.Event()
        self._reports: dict[int, tuple[list[Metrics], list[EvalResult]]] = {}

    def run(self) -> None:
        try:
            self._drive()
        except BaseException as err:  # surfaced to rank 0's main thread through self.error
            self.error = err
        finally:
            for sink in self.sinks:
                sink.close()

    def _drive(self) -> None:
        sched = self.schedule
        slices = equal_slices(sched.total_picks, sched.world_size, sched.batch_size)
        for epoch in range(min(sched.epochs, PLAN_LOOKAHEAD + 1)):
            self._plan(epoch, slices)
        for epoch in range(sched.epochs):
            chunks, evals = self._collect(epoch)
            if epoch + PLAN_LOOKAHEAD + 1 < sched.epochs:
                self._plan(epoch + PLAN_LOOKAHEAD + 1, slices)
            metrics = aggregate_epoch(epoch, chunks, evals)
            for sink in self.sinks:
                sink.emit(metrics)
        for rank in range(sched.world_size):
            self.mailbox.send(rank, Shutdown())

    def _plan(self, epoch: int, slices: list[Slice]) -> None:
        evaluate = self.schedule.evaluates_after(epoch)
        for rank, part in enumerate(slices):
            self.mailbox.send(rank, StartEpoch(epoch, part.offset, part.size, evaluate))

    def _collect(self, epoch: int) -> tuple[list[Metrics], list[EvalResult]]:
        """Wait until every rank has reported `epoch` (and its eval share, when one is due).

        Reports for later epochs that arrive early are kept for their turn.
        """
        world = self.schedule.world_size
        want_evals = world if self.schedule.evaluates_after(epoch) else 0
        chunks, evals = self._reports.setdefault(epoch, ([], []))
        while len(chunks) < world or len(evals) < want_evals:
            if self.stop_requested.is_set():
                raise CoordinatorError("stopped while waiting for rank reports")
            message = self.mailbox.receive(_WAIT_S)
            if isinstance(message, (Metrics, EvalResult)):
                if message.epoch < epoch:
                    raise CoordinatorError(
                        f"rank {message.rank} reported epoch {message.epoch} after it was aggregated"
                    )
                later_chunks, later_evals = self._reports.setdefault(message.epoch, ([], []))
                (later_chunks if isinstance(message, Metrics) else later_evals).append(message)
            elif isinstance(message, Exiting):
                raise CoordinatorError(f"rank {message.rank} exited during epoch {epoch}")
        return self._reports.pop(epoch)
