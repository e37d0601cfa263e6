"""The stop handler in one process (flodl/links/stop.py): a sweep's jobs run one after another in the
launcher's process, so what one job set up for its stop must not carry over to the next."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from flodl.links import stop
from flodl.links.stop import (
    STOP_SIGNALS,
    Stopped,
    StopWatch,
    agent_takes_every_stop_signal,
    catch_stop_signals,
    save_on_stop,
)
from flodl.links.threads import wait_ended
from flodl.links.transport import Mailbox


@pytest.fixture
def handlers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's signal handlers and the module's state put back afterwards, once the test's stop
    watches ended: one still running could signal the process after that, when nothing takes it."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    monkeypatch.setattr(stop, "_received", None)
    monkeypatch.setattr(stop, "_save_requested", None)
    try:
        yield
        for thread in threading.enumerate():
            if isinstance(thread, StopWatch):
                assert wait_ended(thread, timeout=60)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _signal_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler runs at the next bytecode: Stopped is raised long before this ends


def test_a_rank_that_saves_on_a_stop_takes_the_signal_to_its_watch(handlers: None) -> None:
    catch_stop_signals()
    requested = save_on_stop()
    os.kill(os.getpid(), signal.SIGTERM)
    assert requested.wait(5) and stop.received() == signal.SIGTERM  # no Stopped: the watch carries it out


def test_sigusr1_stops_as_sigterm_does_with_its_own_exit_code(handlers: None) -> None:
    catch_stop_signals()
    with pytest.raises(Stopped) as stopped:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(5)
    assert stopped.value.exit_code == 138 and str(stopped.value) == "SIGUSR1"


def test_torchruns_agent_takes_sigusr1_as_it_takes_sigterm(handlers: None) -> None:
    from torch.distributed.elastic.multiprocessing import SignalException

    agent_takes_every_stop_signal()
    with pytest.raises(SignalException) as raised:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(5)
    assert raised.value.sigval == signal.SIGUSR1  # flodl-torchrun exits 128 + it


def _watch_until_stopped(
    save_s: float | None, grace_s: float, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> str:
    """This process's own stop that saves, watched over a real store: what the watch gave up for. The watch
    stops the rank once and ends: a second signal, sent after the rank's stop, would find the handler gone
    (seen in CI under load: it killed the test's worker)."""
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    # The watch talks over a client of its own, as a rank's does.
    client = TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta(seconds=30))
    catch_stop_signals()
    saving = save_on_stop()
    os.kill(os.getpid(), signal.SIGTERM)  # taken by the watch, not raised
    stops: list[int] = []
    stop_now = stop.stop_now
    monkeypatch.setattr(stop, "stop_now", lambda signum: (stops.append(signum), stop_now(signum)))
    watch = StopWatch(Mailbox(client, 0), saving, grace_s=grace_s, save_s=lambda: save_s)
    with caplog.at_level(logging.WARNING, logger="flodl"), pytest.raises(Stopped):
        watch.start()
        wait_ended(watch, timeout=60)
        time.sleep(5)  # the watch's stop is raised here at the latest, at the next bytecode
    assert wait_ended(watch, timeout=60)
    assert stops == [signal.SIGTERM]
    assert store.get("stop") == str(int(signal.SIGTERM)).encode()  # posted for every peer
    return caplog.text


def test_a_stop_whose_last_checkpoint_took_longer_than_the_budget_gives_up_at_once(
    handlers: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _watch_until_stopped(save_s=45.0, grace_s=30.0, caplog=caplog, monkeypatch=monkeypatch)
    reason = "this rank's last checkpoint took 45 s, more than stop_grace_s=30"
    assert f"the stop could not save ({reason})" in text


def test_a_stop_that_reaches_no_checkpoint_within_the_budget_gives_up_then(
    handlers: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing saves here: there is no coordinator.
    text = _watch_until_stopped(save_s=None, grace_s=0.1, caplog=caplog, monkeypatch=monkeypatch)
    assert "the stop could not save (no checkpoint within stop_grace_s=0.1)" in text


def test_the_next_job_in_the_same_process_stops_at_once_again(handlers: None) -> None:
    catch_stop_signals()
    save_on_stop()  # one job saved on a stop, and ended without one
    catch_stop_signals()  # the sweep's next job, without checkpoints
    with pytest.raises(Stopped):
        _signal_self()


def test_a_stop_that_saves_stops_at_once_when_the_store_is_gone(handlers: None) -> None:
    """The run's store went away while this rank's stop waited for its checkpoint (the host died, torchrun's
    agent was killed): nothing can be saved any more, so the rank stops now, not after stop_grace_s (seen
    as an orphaned rank under load: its watch returned quietly and it trained on)."""
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta(seconds=30))
    catch_stop_signals()
    saving = save_on_stop()
    os.kill(os.getpid(), signal.SIGTERM)  # taken by the watch, not raised
    watch = StopWatch(Mailbox(client, 0), saving, grace_s=3600.0, save_s=lambda: None)
    with pytest.raises(Stopped):
        watch.start()
        while not store.check([stop._REQUEST_KEY]):  # the watch posted this rank's request
            time.sleep(0.01)
        del store  # the server goes with its owner: the watch's next look fails
        wait_ended(watch, timeout=60)
        time.sleep(5)  # the watch's stop is raised here at the latest, at the next bytecode
    assert wait_ended(watch, timeout=60)


def test_a_rank_takes_its_own_stop_request_before_the_coordinator_hears_of_it(handlers: None) -> None:
    """Once the coordinator has the request, the rank that sent it has agreed where it saves (sync's step)
    and marks the parts it saves from then on as the stop's: a rank whose watch thread was slow to get back
    to it trained past checkpoints that would have been the stop's (seen under load: the stop saved at the
    run's end)."""
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", store.port, None, False, timeout=timedelta(seconds=30))
    catch_stop_signals()
    saving = save_on_stop()
    os.kill(os.getpid(), signal.SIGTERM)  # taken by the watch, not raised
    order: list[str] = []
    announced = threading.Event()

    def announce(signum: int) -> None:
        order.append("announced")
        announced.set()

    def on_request() -> bool:
        order.append("took the request")
        return True

    watch = StopWatch(Mailbox(client, 0), saving, announce, on_request, grace_s=3600.0, save_s=lambda: None)
    watch.start()
    try:
        assert announced.wait(30)
    finally:
        watch.stop()
    assert order == ["took the request", "announced"]
