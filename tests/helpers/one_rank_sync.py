"""A one-rank SyncWorker's surroundings in one process (tests/unit/test_sync_stop_parts.py,
test_sharded_sync_survive.py): what it reports to the coordinator, and a checkpointer whose parts are on disk
at once."""

from __future__ import annotations

from flodl.checkpoints.disk import Point
from flodl.links.messages import Message, Saved


class Reports:
    """What the worker reports to the coordinator."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send(self, rank: int, message: Message) -> None:
        self.sent.append(message)


class PartsAtOnce:
    """A checkpointer whose parts are on disk at once: each is said Saved at the worker's next look."""

    def __init__(self) -> None:
        self.receipts: list[Saved] = []

    def save(self, point: Point, state: object, receipt: Saved, first_member: bool = True) -> None:
        self.receipts.append(receipt)

    def written(self) -> list[Saved]:
        taken, self.receipts = self.receipts, []
        return taken
