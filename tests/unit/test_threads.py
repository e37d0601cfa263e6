"""Waiting for a thread's end in the main thread, where a stop signal raises (flodl/links/threads.py)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

import pytest

from flodl.links.threads import wait_ended


class Interrupted(Exception):
    """What the test's signal raises in the main thread, as a stop's Stopped does."""


def _stack(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def _interrupt_once_waiting(main: int) -> None:
    """Signal the process once the main thread is inside `wait_ended` (not before: the signal would raise
    ahead of the wait)."""
    while not any(f.f_code is wait_ended.__code__ for f in _stack(sys._current_frames().get(main))):
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGUSR1)


def test_a_stop_that_interrupts_the_wait_leaves_the_thread_running_and_waited_for() -> None:
    release = threading.Event()
    worker = threading.Thread(target=release.wait, name="test-worker", daemon=True)
    worker.start()

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Thread(target=_interrupt_once_waiting, args=(threading.get_ident(),), daemon=True).start()
        with pytest.raises(Interrupted):
            wait_ended(worker)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    # Thread.join would now say it ended (Python < 3.13): the next wait is still a wait.
    assert not wait_ended(worker, timeout=0.05)
    release.set()
    assert wait_ended(worker, timeout=60) and not worker.is_alive()


def test_a_thread_never_started_has_ended() -> None:
    assert wait_ended(threading.Thread(target=lambda: None), timeout=0)
