"""A stop under local SGD through the coordinator's driver (flodl/coordinator/local_sgd_driver.py) and its
ledger: the run ends at the next epoch boundary with every epoch up to it emitted, and its last epoch gets an
eval as a run's last does: none where the run has none (a task without eval data, or eval_every=0), so the
ledger waits for none (it waited for good for the eval the ranks never send, and the run never ended)."""

from __future__ import annotations

import random
from collections import deque

import pytest
from torch.distributed import HashStore

from flodl.coordinator.driver import EpochSchedule
from flodl.coordinator.ledger import EpochLedger
from flodl.coordinator.local_sgd_driver import LocalSgdDriver
from flodl.coordinator.roster import Roster
from flodl.links.heartbeat import HeartbeatMonitor
from flodl.links.messages import (
    AverageNow,
    ChunkReport,
    EvalResult,
    ExtendPartition,
    Message,
    Reached,
    RoundAck,
    decode,
)
from flodl.links.transport import Mailbox, inbox
from flodl.metrics.timeline import Timeline
from flodl.rounds.elche import ElChe, ElCheSettings
from flodl.rounds.guard import make_guard
from flodl.rounds.planner import LocalSgdPlanner

WORLD, EPOCHS, BATCH, PICKS = 2, 50, 4, 32  # 8 batches an epoch across the ranks


class Run:
    """A local-SGD run of fake ranks driven as Coordinator._handle drives its driver, each next event (a rank
    reading its inbox, the coordinator reading its own) drawn from `rng`. A rank trains what it is handed at
    once (a ChunkReport a slice, Reached at its target), acknowledges each round, and reports an eval when
    asked only if the task has eval data (the worker skips it otherwise)."""

    def __init__(self, schedule: EpochSchedule, is_async: bool, stop_after: int, rng: random.Random) -> None:
        self.schedule, self.stop_after, self.rng = schedule, stop_after, rng
        self.store = HashStore()
        outbox = Mailbox(self.store, "coordinator")
        bpe = PICKS // BATCH
        self.ledger = EpochLedger(EPOCHS, WORLD, bpe, local_sgd=True)
        planner = LocalSgdPlanner(WORLD, bpe, BATCH, EPOCHS, is_async, schedule.eval_epochs())
        elche = ElChe(ElCheSettings(world_size=WORLD, anchor=3, is_async=is_async), epoch_batches=bpe)
        roster = Roster(WORLD, outbox, HeartbeatMonitor(WORLD, timeout_s=10.0, started=0.0))
        self.driver = LocalSgdDriver(
            planner, elche, make_guard("none", None, False), self.ledger, outbox, Timeline(WORLD), roster
        )
        self.inbox: deque[Message] = deque()  # the coordinator's
        self.steps = [0] * WORLD  # each rank's since its last round
        self.targets: list[int | None] = [None] * WORLD
        self.emitted: list[int] = []
        self.last: int | None = None
        self.averages: list[AverageNow] = []

    def pending(self, rank: int) -> int:
        return self.store.queue_len(inbox(rank))

    def run(self) -> None:
        self.driver.begin()
        while True:
            ready = [r for r in range(WORLD) if self.pending(r)] + (["coordinator"] if self.inbox else [])
            if not ready:
                return
            who = self.rng.choice(ready)
            if who == "coordinator":
                self.handle(self.inbox.popleft())
            else:
                assert isinstance(who, int)
                self.rank_reads(who, decode(self.store.queue_pop(inbox(who), block=False)))

    def rank_reads(self, rank: int, message: Message) -> None:
        if isinstance(message, ExtendPartition):
            self.targets[rank] = message.target
            for part in message.slices:
                batches = part.size // BATCH
                self.steps[rank] += batches
                chunk = ChunkReport(rank, part.epoch, batches, part.size, 0.5, 1.0, 0.0, offset=part.offset)
                self.inbox.append(chunk)
            self.reach(rank)
        elif isinstance(message, AverageNow):
            if rank == 0:
                self.averages.append(message)
            ack = RoundAck(rank, message.round, self.steps[rank], False, 0.01, 1.0, queued=0)
            self.steps[rank], self.targets[rank] = 0, None
            self.inbox.append(ack)
            if self.schedule.has_eval:
                for epoch in message.evaluate_epochs:
                    self.inbox.append(EvalResult(rank, epoch, {"loss": 1.0}, 4))
        else:
            raise AssertionError(f"rank {rank} got {message!r}")

    def reach(self, rank: int) -> None:
        target = self.targets[rank]
        if target is not None and self.steps[rank] >= target:
            self.targets[rank] = None
            self.inbox.append(Reached(rank, self.steps[rank], 1.0))

    def handle(self, message: Message) -> None:
        if isinstance(message, ChunkReport):
            assert self.driver.on_chunk(message)
            if self.ledger.add_chunk(message):
                self.driver.on_epoch_complete(message.epoch)
        elif isinstance(message, EvalResult):
            assert self.driver.counts_eval(message)
            self.ledger.add_eval(message)
        else:
            self.driver.on_message(message)
        for metrics in self.ledger.emit_ready():
            self.emitted.append(metrics.epoch)
            if metrics.epoch == self.stop_after and self.last is None:  # a callback's run.stop
                self.last = self.driver.stop()
                self.ledger.end_after(self.last)


@pytest.mark.parametrize(
    ("has_eval", "eval_every"),
    [(False, 1), (True, 0), (True, 4)],
    ids=["no eval data", "eval_every=0", "eval_every=4"],
)
@pytest.mark.parametrize("policy", ["cadence", "async"])
@pytest.mark.parametrize("seed", range(12))
def test_a_stopped_run_ends_with_its_last_epoch_evaluated_as_a_runs_last_is(
    has_eval: bool, eval_every: int, policy: str, seed: int
) -> None:
    rng = random.Random(seed)
    schedule = EpochSchedule(EPOCHS, WORLD, PICKS, BATCH, eval_every, has_eval)
    run = Run(schedule, policy == "async", stop_after=rng.randrange(6), rng=rng)
    run.run()
    assert run.last is not None and run.last >= run.stop_after
    assert run.driver.done
    assert run.emitted == list(range(run.last + 1)), (run.emitted, run.last)
    assert [a.final for a in run.averages].count(True) == 1 and run.averages[-1].final
    # Each epoch's eval asked once at most; the last's (async: maybe before the final round) only where the
    # run evaluates, and no other outside the run's wanted ones.
    asked = [e for a in run.averages for e in a.evaluate_epochs]
    assert len(asked) == len(set(asked)), asked
    evaluates = has_eval and eval_every > 0
    assert (run.last in asked) == evaluates, asked
    assert set(asked) <= set(schedule.eval_epochs()) | {run.last}, asked
