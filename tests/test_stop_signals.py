"""The stop handler in one process (flodl/wire/stop.py): a sweep's jobs run one after another in the
launcher's process, so what one job set up for its stop must not carry over to the next."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from flodl.wire import stop
from flodl.wire.stop import (
    STOP_SIGNALS,
    Stopped,
    agent_takes_every_stop_signal,
    catch_stop_signals,
    save_on_stop,
)


@pytest.fixture
def handlers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's signal handlers and the module's state put back afterwards."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    monkeypatch.setattr(stop, "_received", None)
    monkeypatch.setattr(stop, "_save_requested", None)
    try:
        yield
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


def test_the_next_job_in_the_same_process_stops_at_once_again(handlers: None) -> None:
    catch_stop_signals()
    save_on_stop()  # one job saved on a stop, and ended without one
    catch_stop_signals()  # the sweep's next job, without checkpoints
    with pytest.raises(Stopped):
        _signal_self()
