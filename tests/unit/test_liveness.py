"""Ranks started apart hold a connection to the run's host (flodl/links/liveness.py): its close without a bye
is the rank's death, posted as a supervisor posts it (a SIGKILLed rank apart: tests/runs/test_survive.py)."""

from __future__ import annotations

import socket
import threading
import time

from torch.distributed import HashStore

from flodl.links.liveness import Liveness, LivenessListener
from flodl.links.membership import ExitReader

WAIT_S = 30.0


def exits_within(reader: ExitReader, count: int) -> list[dict]:
    """The exits posted, once `count` of them are (or the wait is over)."""
    found: list[dict] = []
    deadline = time.monotonic() + WAIT_S
    while len(found) < count and time.monotonic() < deadline:
        found += reader.new()
        time.sleep(0.01)
    return found


def test_a_connection_closed_without_a_bye_is_posted_as_its_rank_s_exit_and_a_bye_is_not():
    store = HashStore()
    listener = LivenessListener(store, "127.0.0.1")
    listener.start()
    reader = ExitReader(store)
    try:
        planned = Liveness.to_host(store, "127.0.0.1", 0, 0)
        died = Liveness.to_host(store, "127.0.0.1", 1, 3)
        assert planned is not None and died is not None
        stranger = socket.create_connection(("127.0.0.1", int(store.get("flodl/liveness"))))
        stranger.close()  # said nothing: no rank's
        planned.bye()
        planned.close()
        died.close()
        (posted,) = exits_within(reader, 1)
        assert (posted["rank"], posted["incarnation"]) == (1, 3)
        assert "connection to the run's host closed" in posted["cause"]
    finally:
        listener.stop()
    # The listener ended after the batch that held the death, and the others closed no later than it did.
    assert reader.new() == []


def test_a_host_that_does_not_listen_gets_no_connection():
    """A self-launch supervisor reaps its ranks itself: no listener, and the rank does not wait for one."""
    assert Liveness.to_host(HashStore(), "127.0.0.1", 0, 0) is None


def test_the_host_outlives_the_ranks_still_connected():
    """The run's host waits for its ranks' ends before it goes (their last reads of its store would fail)."""
    store = HashStore()
    listener = LivenessListener(store, "127.0.0.1")
    listener.start()
    try:
        rank = Liveness.to_host(store, "127.0.0.1", 0, 0)
        assert rank is not None
        deadline = time.monotonic() + WAIT_S
        while not listener.connected() and time.monotonic() < deadline:  # its hello read
            time.sleep(0.01)
        waiting = threading.Thread(target=listener.wait_quiet, args=(WAIT_S,))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive()  # the rank is still there
        rank.bye()
        rank.close()
        waiting.join(WAIT_S)
        assert not waiting.is_alive()
    finally:
        listener.stop()
