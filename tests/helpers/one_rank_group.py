"""survive's group of one rank (flodl/worker/group.py's SurvivingGroup) over a real one-rank gloo group and a
real store inbox, and a worker's answers to its changes, recorded."""

from __future__ import annotations

from datetime import timedelta

import torch

from flodl.links.group import loopback_store
from flodl.links.membership import AveragingGroup
from flodl.links.messages import Message, Regroup, Regrouped
from flodl.links.transport import InboxReader, Mailbox
from flodl.worker.group import SurvivingGroup


class Member:
    """A worker's answers to its group's changes, recorded; the first `failing` settles raise."""

    rank = 0

    def __init__(self, failing: int = 0) -> None:
        self.failing = failing
        self.calls: list[str] = []
        self.reports: list[Message] = []

    def report(self, message: Message) -> None:
        self.reports.append(message)

    def let_go(self, change: Regroup) -> None:
        self.calls.append(f"let go for {change.generation}")

    def settle(self, group: AveragingGroup, change: Regroup | None) -> None:
        self.calls.append(f"settle {group.generation}")
        if self.failing:
            self.failing -= 1
            raise RuntimeError("a member died while the group formed")

    def regrouped(self, change: Regroup, formed: Regrouped) -> None:
        self.calls.append(f"regrouped {formed.generation}")


def surviving(incarnation: int = 0) -> tuple[SurvivingGroup, Mailbox]:
    store = loopback_store(0, None, timedelta(seconds=20))
    coordinator = Mailbox.connect("127.0.0.1", store.port, "ns", "coordinator", 10.0)
    reader = InboxReader(Mailbox.connect("127.0.0.1", store.port, "ns", 0, 10.0))
    membership = AveragingGroup(store, "gloo", 0, torch.device("cpu"), 5.0)
    group = SurvivingGroup(
        membership, reader, world_size=1, incarnation=incarnation, joining=incarnation > 0, wait_s=10.0
    )
    reader.start()
    return group, coordinator
