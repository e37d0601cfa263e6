"""A rank's inbox reader (links/transport.py): the wake a reader sends itself to stop is its own; one an
earlier process of the rank left in the store (it ended before reading it: cut, after a partition) is no
message to the process reading the inbox now."""

from __future__ import annotations

from torch.distributed import HashStore, PrefixStore

from flodl.links.messages import AverageNow, Shutdown
from flodl.links.transport import COORDINATOR, STOPPED_LOCALLY, InboxReader, Mailbox

WAIT_S = 30.0  # an upper bound for the events below, never a pace


def test_an_earlier_process_s_own_wake_is_skipped_and_a_reader_s_own_stop_still_ends_it() -> None:
    store = PrefixStore("flodl/run/", HashStore())
    host = Mailbox(store, COORDINATOR)
    host.send(1, Shutdown(reason=STOPPED_LOCALLY))  # the last process of rank 1 woke itself, then ended
    order = AverageNow(3, [], False, None, 2, None)
    host.send(1, order)
    reader = InboxReader(Mailbox(store, 1))
    reader.start()
    try:
        assert reader.next_message(WAIT_S) == order
        assert reader.is_alive()
        reader.stop(host)  # its own wake ends it
        assert not reader.is_alive()
        assert reader.next_message(None) == Shutdown(reason=STOPPED_LOCALLY)
    finally:
        reader.stop(host)


def test_the_run_s_shutdown_ends_the_reader() -> None:
    store = PrefixStore("flodl/run/", HashStore())
    host = Mailbox(store, COORDINATOR)
    reader = InboxReader(Mailbox(store, 2))
    reader.start()
    host.send(2, Shutdown(reason="done"))
    assert reader.next_message(WAIT_S) == Shutdown(reason="done")
    reader.join(WAIT_S)
    assert not reader.is_alive()
