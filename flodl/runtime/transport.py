"""Mailboxes over the rendezvous TCPStore: one inbox per rank plus one for the coordinator.

Messages are pushed to `queue_push` keys under a per-run prefix; tensors never travel here (they
go through collectives). Each thread that receives owns its own store client, because a blocking
pop holds the client's connection.
"""

from __future__ import annotations

import time
from datetime import timedelta

from torch.distributed import PrefixStore, QueueEmptyError, Store, TCPStore

from flodl.runtime.messages import Message, decode, encode

COORDINATOR = "coordinator"
# A blocking pop logs a warning each time it times out, so waits poll with a growing backoff.
_POLL_MIN_S = 0.001
_POLL_MAX_S = 0.02


def inbox(rank: int | str) -> str:
    return f"inbox/{rank}"


class Mailbox:
    def __init__(self, store: Store, owner: int | str) -> None:
        self.store = store
        self.owner = owner

    @classmethod
    def connect(cls, host: str, port: int, namespace: str, owner: int | str, timeout_s: float) -> Mailbox:
        client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(PrefixStore(f"flodl/{namespace}/", client), owner)

    def send(self, to: int | str, message: Message) -> None:
        self.store.queue_push(inbox(to), encode(message))

    def poll(self) -> Message | None:
        try:
            return decode(self.store.queue_pop(inbox(self.owner), block=False))
        except QueueEmptyError:
            return None

    def receive(self, timeout_s: float) -> Message | None:
        """The next message, or None after `timeout_s` with nothing received."""
        deadline = time.monotonic() + timeout_s
        pause = _POLL_MIN_S
        while True:
            message = self.poll()
            if message is not None or time.monotonic() >= deadline:
                return message
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
