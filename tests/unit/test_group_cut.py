"""Survive by groups on the coordinator (docs/sharded-groups.md#survive-by-groups): the local-SGD driver and
the surviving roster of 4 cadence ranks as 2 groups of 2, a rank of group 1 exiting in a window. Its group
leaves in one change; what its dead rank trained in step with the other and had not reported is lost with
the group, not handed out again, so what is handed out keeps the group left even (its members step
together); a round the change fires is a fresh one, not a redo."""

from __future__ import annotations

from torch.distributed import HashStore

from flodl.coordinator.ledger import EpochLedger
from flodl.coordinator.local_sgd_driver import LocalSgdDriver
from flodl.coordinator.roster import SurvivingRoster
from flodl.coordinator.survivors import SurviveSettings
from flodl.links.heartbeat import HeartbeatMonitor
from flodl.links.messages import (
    AverageNow,
    ChunkReport,
    Exiting,
    ExtendPartition,
    Reached,
    Regroup,
    RoundAck,
    decode,
)
from flodl.links.transport import Mailbox, inbox
from flodl.metrics.timeline import Timeline
from flodl.rounds.elche import ElChe, ElCheSettings
from flodl.rounds.guard import make_guard
from flodl.rounds.planner import LocalSgdPlanner

WORLD, K, EPOCH = 4, 2, 40  # batches of one sample: 40 batches an epoch


class Coordinator:
    def __init__(self) -> None:
        self.store = HashStore()
        outbox = Mailbox(self.store, "coordinator")
        self.planner = LocalSgdPlanner(WORLD, EPOCH, 1, 2, False, frozenset())
        elche = ElChe(ElCheSettings(world_size=WORLD, anchor=3, group_size=K), epoch_batches=EPOCH)
        self.ledger = EpochLedger(2, WORLD, EPOCH, local_sgd=True)
        timeline = Timeline(WORLD)
        monitor = HeartbeatMonitor(WORLD, timeout_s=2.0, started=0.0)
        settings = SurviveSettings(1, WORLD, K)
        self.roster = SurvivingRoster(WORLD, outbox, monitor, self.ledger, timeline, settings)
        guard = make_guard("none", None, False)
        self.driver = LocalSgdDriver(self.planner, elche, guard, self.ledger, outbox, timeline, self.roster)
        self.roster.attach(self.driver, lambda reason: 1, lambda: "none")

    def read(self, rank: int) -> list:
        messages = []
        while self.store.queue_len(inbox(rank)):
            messages.append(decode(self.store.queue_pop(inbox(rank), block=False)))
        return messages

    def trains(self, rank: int, window: ExtendPartition) -> None:
        """`rank` trains its window and reports each slice, then that it reached its count."""
        for part in window.slices:
            self.report(rank, part.epoch, part.offset, part.size)
        self.driver.on_message(Reached(rank, window.target, 1.0))

    def report(self, rank: int, epoch: int, offset: int, size: int) -> None:
        chunk = ChunkReport(rank, epoch, size, size, 0.0, 1.0, 0.0, offset=offset)
        assert self.driver.on_chunk(chunk)
        if self.ledger.add_chunk(chunk):
            self.driver.on_epoch_complete(epoch)


def test_a_group_leaving_keeps_its_step_even_and_the_round_it_fires_is_fresh() -> None:
    c = Coordinator()
    c.driver.begin()
    windows = {r: c.read(r)[0] for r in range(WORLD)}
    assert {w.target for w in windows.values()} == {3}  # a group's members: one count
    for rank in (0, 1):
        c.trains(rank, windows[rank])
    # Rank 3 trained its window and said so; rank 2 trained the same steps with it and died before its word.
    c.trains(3, windows[3])
    c.roster.on_exiting(Exiting(2, "killed"))
    assert c.roster.members == {0, 1}
    for rank in (0, 1):  # one change, and the round the others' counts were waiting for: fresh, no redo
        regroup, average = c.read(rank)
        assert isinstance(regroup, Regroup) and regroup.members == [0, 1] and regroup.cut_round is None
        assert isinstance(average, AverageNow) and average.round == 1
    # Rank 2's slice was trained in step with rank 3's: lost with the group, not handed out again.
    assert c.planner.returned == []
    for rank in (0, 1):
        c.driver.on_message(_ack(rank))
    handed = {r: sum(s.size for m in c.read(r) for s in m.slices) for r in (0, 1)}
    assert handed[0] == handed[1] > 0, handed


def _ack(rank: int) -> RoundAck:
    return RoundAck(rank, 1, 3, False, 0.0, 0.0, 0, generation=1)
