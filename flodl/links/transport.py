"""Mailboxes over the rendezvous TCPStore: one inbox per rank plus one for the coordinator.

Messages are pushed to `queue_push` keys under a per-run prefix; tensors never travel here (they
go through collectives). A reader thread per inbox blocks on `queue_pop` with its own store client
(a blocking pop holds the client's connection) and hands messages to the training loop through a
local queue, so checking for control messages between steps costs no network round trip.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import DistStoreError, PrefixStore, Store, TCPStore

from flodl.links.messages import Message, Shutdown, decode, encode
from flodl.links.threads import wait_ended

COORDINATOR = "coordinator"
# A blocking pop logs a warning each time it times out: readers wait long and are woken by a message.
_READER_WAIT_S = 300.0
# How long a loop waits for its next message before it looks at its own clocks (heartbeats, deadlines,
# stop requests) again: the coordinator's loop and an idle worker's.
INBOX_WAIT_S = 0.5


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

    def wait(self, timeout_s: float) -> Message | None:
        """Block until a message arrives, or return None after `timeout_s`."""
        self.store.set_timeout(timedelta(seconds=timeout_s))
        try:
            return decode(self.store.queue_pop(inbox(self.owner), block=True))
        except DistStoreError:
            return None


# The reason of the Shutdown a reader sends itself to end its wait (InboxReader.stop).
STOPPED_LOCALLY = "stopped locally"


class InboxReader(threading.Thread):
    """Moves this rank's messages from the store into a local queue, so a training loop can check for
    control messages between steps without a network round trip."""

    def __init__(self, mailbox: Mailbox) -> None:
        super().__init__(name=f"flodl-inbox-{mailbox.owner}", daemon=True)
        self.mailbox = mailbox
        self.messages: queue.Queue[Message | None] = queue.Queue()  # None: a wake-up
        self.error: BaseException | None = None
        # Called on the reader's thread as each message arrives, before the training loop sees it (survive:
        # a Regroup must release a collective the training thread is blocked in).
        self.on_arrival: Callable[[Message], None] | None = None
        # Messages the training loop took early and gave back (they come before the queue's).
        self._held: deque[Message] = deque()
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            while True:
                message = self.mailbox.wait(_READER_WAIT_S)
                if _stale_wake(message) and not self._stopping.is_set():
                    continue  # an earlier process of this rank's own (see stop), left in the store
                if message is not None:
                    if self.on_arrival is not None:  # first: the loop must not act on it before this did
                        self.on_arrival(message)
                    self.messages.put(message)
                    if isinstance(message, Shutdown):
                        return
        except BaseException as err:  # surfaced through next_message
            self.error = err

    def wake(self) -> None:
        """End a `next_message` wait now (it returns None): something other than a message is ready."""
        self.messages.put(None)

    def next_message(self, timeout_s: float | None) -> Message | None:
        """The next message: None at once (timeout_s=None), after timeout_s if there is none, or on `wake`."""
        if self.error is not None:
            raise RuntimeError(f"inbox of rank {self.mailbox.owner} failed: {self.error}") from self.error
        if self._held:
            return self._held.popleft()
        try:
            if timeout_s is None:
                return self.messages.get_nowait()
            return self.messages.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def hold(self, messages: list[Message]) -> None:
        """Give back messages taken while waiting for another: `next_message` returns them first, in order."""
        self._held.extend(messages)

    def stop(self, waker: Mailbox) -> None:
        """End the reader early (an error path): wake its blocking pop with a Shutdown from `waker`."""
        if self.is_alive():
            self._stopping.set()
            waker.send(self.mailbox.owner, Shutdown(reason=STOPPED_LOCALLY))
            wait_ended(self, timeout=10)


def _stale_wake(message: Message | None) -> bool:
    """A reader's own wake that its process ended before reading (the process left it in the rank's inbox,
    e.g. cut and ended at once after a partition): no message to the process that reads the inbox now."""
    return isinstance(message, Shutdown) and message.reason == STOPPED_LOCALLY
