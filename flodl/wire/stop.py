"""Ctrl-C and preemption: the first SIGINT or SIGTERM any rank gets stops every rank the same way.

A launcher (torchrun's agent, the elastic launcher) forwards the signal it gets to every rank; Ctrl-C in a
terminal reaches every process of the job; Slurm signals every task. A signal sent to one rank alone reaches
its peers through the store: that rank posts it, and every peer's `StopWatch` raises it in its own process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from types import FrameType

from flodl.wire.transport import Mailbox

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The shell's convention, 128 + the signal: how a stopped rank exits.
STOP_EXIT_CODES = frozenset(128 + signum for signum in STOP_SIGNALS)
_STOP_KEY = "stop"
_WATCH_S = 0.25
_received: int | None = None


class Stopped(BaseException):
    """Raised in the main thread by the first stop signal. A BaseException, as KeyboardInterrupt is, so that
    no `except Exception` on the way takes it for an error and carries on."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum


def catch_stop_signals() -> None:
    """From now on the first SIGINT or SIGTERM raises Stopped in the main thread. Later ones are ignored:
    a launcher forwards the signal a terminal already sent, and a second one must not break the stop."""

    owner = os.getpid()

    def handler(signum: int, frame: FrameType | None) -> None:
        global _received
        if os.getpid() != owner:  # a forked child (a DataLoader worker): what it would do without us
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if _received is None:
            _received = signum
            raise Stopped(signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)


def received() -> int | None:
    """The stop signal this process got, if any."""
    return _received


def post(mailbox: Mailbox, signum: int) -> None:
    """Tell every peer this rank stops on `signum` (the store may already be gone)."""
    with contextlib.suppress(Exception):
        mailbox.store.set(_STOP_KEY, str(signum))


def posted(mailbox: Mailbox) -> int | None:
    """The stop signal a peer posted, if any: a rank failing because its peer left asks this first."""
    try:
        return int(mailbox.store.get(_STOP_KEY)) if mailbox.store.check([_STOP_KEY]) else None
    except Exception:
        return None


class StopWatch(threading.Thread):
    """Raises a peer's posted stop signal in this process, so a rank that is not waiting on that peer (local
    SGD trains alone between rounds) stops within a fraction of a second too."""

    def __init__(self, mailbox: Mailbox) -> None:
        super().__init__(name="flodl-stop-watch", daemon=True)
        self.mailbox = mailbox
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(_WATCH_S):
            if _received is not None:
                return
            try:
                found = self.mailbox.store.check([_STOP_KEY])
            except Exception:  # the store is gone: the run is over or failing, and says so elsewhere
                return
            signum = posted(self.mailbox) if found else None
            if signum is not None:
                os.kill(os.getpid(), signum)  # the main thread's handler takes it as its own
                return

    def stop(self) -> None:
        """Stop and wait: a thread left inside a store call when the process exits aborts it."""
        self.stopped.set()
        self.join(timeout=10)
