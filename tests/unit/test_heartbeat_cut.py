"""A rank started apart ends itself once the run's host cut it: its heartbeat thread reads the cut after each
beat, so a process heard again after a partition ends even while its training thread waits in a collective
with peers that went on without it (links/heartbeat.py, job/rank_threads.py)."""

from __future__ import annotations

import threading

from torch.distributed import HashStore, PrefixStore

from flodl.coordinator.survivors import post_cut, was_cut
from flodl.links.heartbeat import HeartbeatSender
from flodl.links.transport import COORDINATOR, Mailbox, inbox

WAIT_S = 30.0  # an upper bound for the events below, never a pace


def test_the_heartbeat_ends_a_process_once_its_incarnation_is_cut_and_not_before() -> None:
    root = HashStore()
    mailbox = Mailbox(PrefixStore("flodl/run/", root), 1)
    post_cut(mailbox.store, 1, 0)  # the process before this one (incarnation 0) was cut: not this one
    ended = threading.Event()
    sender = HeartbeatSender(1, mailbox, 0.01, lambda: 7, lambda store: was_cut(store, 1, 1), ended.set)
    sender.start()
    try:
        # It beats on, uncut, for as long as it takes the coordinator's inbox to hold a few of its beats.
        for _ in range(3):
            mailbox.store.queue_pop(inbox(COORDINATOR))
        assert not ended.is_set() and sender.is_alive()
        post_cut(mailbox.store, 1, 1)
        assert ended.wait(WAIT_S)
        sender.join(WAIT_S)
        assert not sender.is_alive()
    finally:
        sender.stop()


def test_without_a_cut_to_read_the_heartbeat_only_beats() -> None:
    mailbox = Mailbox(PrefixStore("flodl/run/", HashStore()), 2)
    ended = threading.Event()
    sender = HeartbeatSender(2, mailbox, 0.01, lambda: 0, None, ended.set)
    sender.start()
    post_cut(mailbox.store, 2, 0)
    for _ in range(3):
        mailbox.store.queue_pop(inbox(COORDINATOR))
    sender.stop()
    assert not ended.is_set()


def test_the_first_beat_is_sent_before_start_returns() -> None:
    """A rank frozen at its first step must have been heard: the coordinator holds a rank it never heard
    from to the start's bound (launch.timeout_s), not the heartbeat timeout. The first beat goes from the
    caller's thread, before the rank trains (a chaos freeze trial waited out its 180 s for a cut when the
    first beat waited an interval; a thread's first beat could still come after a busy rank's first steps)."""
    mailbox = Mailbox(PrefixStore("flodl/run/", HashStore()), 3)
    sender = HeartbeatSender(3, mailbox, 3600.0, lambda: 0)
    sender.start()
    try:
        assert mailbox.store.queue_len(inbox(COORDINATOR)) == 1
    finally:
        sender.stop()
