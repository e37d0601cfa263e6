"""Ctrl-C and preemption: the first SIGINT, SIGTERM or SIGUSR1 any rank gets stops every rank the same way.

SIGUSR1 is what Slurm jobs are commonly told to send ahead of their time limit (`--signal=USR1@120`).

A launcher (torchrun's agent, the elastic launcher) forwards the signal it gets to every rank; Ctrl-C in a
terminal reaches every process of the job; Slurm signals every task. A signal sent to one rank alone reaches
its peers through the store: that rank posts it, and every peer's `StopWatch` raises it in its own process.

A stop that saves (`save_on_stop`: checkpoints on, `stop_grace_s` > 0): the first signal raises nothing.
The rank's `StopWatch` posts the request in the store and tells the coordinator (`StopRequested`), which has
the ranks save a checkpoint at the next boundary where one can be taken and then shuts them down with the
signal; sync's ranks agree on the step themselves (`agree_step`: the first proposal in the store wins).
If the run has not stopped within the grace budget, the rank posts a stop for every rank and stops at once,
as without saving. Sync's checkpoints by time travel the same way: the coordinator posts the n-th request
(`post_checkpoint_request`), each rank's watch hands it to the worker, whose members agree on its step.

Python runs a signal's handler in the main thread only, between bytecodes: a rank whose main thread waits in
native code (gloo's or NCCL's wait on a frozen peer, a device sync) would not take its stop until that call
returns. A rank's signal watch (`watch_signals`) hears every signal at once, through the wakeup fd, and a
stop the main thread has not raised within `_STUCK_S` ends the process from there."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

from flodl.links.threads import wait_ended
from flodl.links.transport import Mailbox

log = logging.getLogger("flodl")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# The shell's convention, 128 + the signal: how a stopped rank exits.
STOP_EXIT_CODES = frozenset(128 + signum for signum in STOP_SIGNALS)
_STOP_KEY = "stop"
# A stop that saves: requested (the signal's number), and sync's agreed step.
_REQUEST_KEY = "stop_request"
_STEP_KEY = "stop_step"
# Sync's checkpoints by time: how many were requested, and each one's agreed step.
_CHECKPOINT_KEY = "checkpoint_request"
_WATCH_S = 0.25
_received: int | None = None
# Set once this process saves on a stop: the first signal is carried out by its StopWatch.
_save_requested: threading.Event | None = None
# The next signal raises Stopped whatever came before (a stop that could not save, or a peer's stop).
_force = False
# A stop decided, not raised yet in the main thread; and whether one was (later signals then change nothing).
_unraised: int | None = None
_claimed = False
# The rank's part is done (back in torch's launcher, which catches no Stopped): a stop signal leaves at once.
_done = False
# The handler and the signal watch decide each signal once, whichever sees it first.
_lock = threading.RLock()
# Past this, a stop the main thread has not raised means it sits in native code: the signal watch ends it.
_STUCK_S = 1.0
_pipe: tuple[int, int] | None = None
# The running StopWatch, whose store tells the peers of a stop the signal watch carries out.
_watch: StopWatch | None = None


class Stopped(BaseException):
    """Raised in the main thread by the first stop signal. A BaseException, as KeyboardInterrupt is, so that
    no `except Exception` on the way takes it for an error and carries on."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal (130 for SIGINT, 143 for SIGTERM, 138 for SIGUSR1)."""
        return 128 + self.signum


def catch_stop_signals() -> None:
    """From now on the first stop signal raises Stopped in the main thread. Later ones are ignored:
    a launcher forwards the signal a terminal already sent, and a second one must not break the stop.
    A stop saves only once this rank says so (`save_on_stop`): a sweep's next job in this process starts
    without the last one's."""
    global _save_requested, _force, _unraised, _claimed, _done
    _save_requested, _force, _unraised, _claimed, _done = None, False, None, False, False
    owner = os.getpid()

    def handler(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:  # a forked child (a DataLoader worker): what it would do without us
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        with _lock:
            _take(signum)
            stop = _claim()
        if stop is not None and _done:
            leave_now(128 + stop)
        if stop is not None:
            raise Stopped(stop)

    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)


def _take(signum: int) -> None:
    """What a stop signal means here (under `_lock`): a stop to raise (`_unraised`), a stop that saves handed
    to the StopWatch, or nothing (a later signal)."""
    global _received, _force, _unraised
    if _claimed:
        return
    if _done:
        _unraised = signum
    elif _force:
        _force = False
        _unraised = _received or signum
    elif _received is None:
        _received = signum
        if _save_requested is not None:  # the StopWatch carries it out: the ranks save, then stop
            _save_requested.set()
        else:
            _unraised = signum


def _claim() -> int | None:
    """The stop decided and not raised yet, taken by whoever raises it (or leaves on it)."""
    global _unraised, _claimed
    with _lock:
        stop, _unraised = _unraised, None
        _claimed = _claimed or stop is not None
        return stop


def watch_signals() -> None:
    """A rank's signal watch (main thread only): a stop its main thread has not raised within `_STUCK_S`
    (it waits in native code, which runs no handler) ends the process: its exit handlers run, its peers
    are told (while a StopWatch runs), and it exits 128 + the signal."""
    global _pipe
    if _pipe is None:
        _pipe = os.pipe()
        os.set_blocking(_pipe[1], False)
        thread = threading.Thread(target=_follow_signals, args=(_pipe[0],), name="flodl-signals", daemon=True)
        thread.start()
        os.register_at_fork(after_in_child=_forget_pipe)
    signal.set_wakeup_fd(_pipe[1], warn_on_full_buffer=False)


def _forget_pipe() -> None:
    """A forked child (a DataLoader worker) writes no signal of its own into its parent's watch."""
    global _pipe
    if _pipe is not None:
        signal.set_wakeup_fd(-1)
        for fd in _pipe:
            os.close(fd)
        _pipe = None


def _follow_signals(fd: int) -> None:
    while True:
        for signum in os.read(fd, 64):  # the wakeup fd: a byte per signal, whatever the main thread does
            if signum in STOP_SIGNALS:
                _follow(signum)


def _follow(signum: int) -> None:
    with _lock:
        _take(signum)
    deadline = time.monotonic() + _STUCK_S
    while _unraised is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    stop = _claim()
    if stop is None:  # the main thread raised it (or nothing is to be raised)
        return
    name = signal.Signals(stop).name
    log.warning(
        "%s came while the main thread was in native code: it took no handler in %g s, leaving now",
        name,
        _STUCK_S,
    )
    if _watch is not None:
        post(_watch.mailbox, stop)
    leave_now(128 + stop)


def part_done() -> None:
    """The rank's part is done, and nothing of flodl's catches Stopped now (a self-launched rank waits in
    torch's launcher for the others): from now on a stop signal ends the process at once."""
    global _done
    _done = True


def end_process(code: int) -> NoReturn:
    """End this process at once, without exit handlers or the interpreter's teardown: its training thread may
    wait in a collective with a silent peer, which nothing but the collective's timeout would release. (Tests
    that run ranks as threads replace it where it is called: tests/helpers/in_process.py.)"""
    logging.shutdown()
    os._exit(code)


def leave_now(code: int) -> NoReturn:
    """Run the exit handlers (logs, stage files) and end the process without the interpreter's teardown of
    torch and gloo, which can take seconds."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def agent_takes_every_stop_signal() -> None:
    """In torchrun's process: its agent forwards SIGINT and SIGTERM to its ranks, waits for them and raises
    SignalException; SIGUSR1 would end it at once, the ranks orphaned. From now on it takes SIGUSR1 the same
    way (torch installs its own handlers for the others when it starts). flodl's own launcher needs none:
    its stop handlers take SIGUSR1 (and its exit code), and the agent's shutdown on the way out sends the
    ranks SIGTERM, on which they save and stop the same way."""
    from torch.distributed.elastic.multiprocessing import SignalException

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SignalException(f"process {os.getpid()} got signal {signum}", sigval=signal.Signals(signum))

    signal.signal(signal.SIGUSR1, handler)


def received() -> int | None:
    """The stop signal this process got, if any."""
    return _received


def save_on_stop() -> threading.Event:
    """From now on the first stop signal saves before it stops (the returned event is set when it comes)."""
    global _save_requested
    _save_requested = threading.Event()
    if _received is not None:  # it came while the rank started: carry it out now
        _save_requested.set()
    return _save_requested


def stop_now(signum: int) -> None:
    """Raise Stopped in this process's main thread (from any thread), whatever signal came before."""
    global _force
    _force = True
    os.kill(os.getpid(), signum)


def agree_step(mailbox: Mailbox, proposal: int, request: int | None = None) -> int:
    """The step every rank saves after (sync): the first rank's proposal in the store; for the stop, or for
    the checkpoint by time `request`."""
    key = _STEP_KEY if request is None else f"{_CHECKPOINT_KEY}/{request}"
    return int(mailbox.store.compare_set(key, "", str(proposal)).decode())


def post_checkpoint_request(mailbox: Mailbox, request: int) -> None:
    """The coordinator asks sync's ranks for a checkpoint by time: its `request`-th."""
    mailbox.store.set(_CHECKPOINT_KEY, str(request))


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
    SGD trains alone between rounds) stops within a fraction of a second too. With a stop that saves
    (`saving`), it also carries out this rank's own signal: posts the request and tells the coordinator
    (`announce`), calls `on_request` once a request is posted by any rank (False: this rank cannot reach a
    boundary in time), and stops every rank once `grace_s` passed without the run's end, or at once when
    this rank's last checkpoint (`save_s`: seconds, None before the first) took longer than that.
    `on_checkpoint` gets each checkpoint by time the coordinator requests (sync), by number."""

    def __init__(
        self,
        mailbox: Mailbox,
        saving: threading.Event | None = None,
        announce: Callable[[int], None] | None = None,
        on_request: Callable[[], bool] | None = None,
        grace_s: float = 0.0,
        on_checkpoint: Callable[[int], None] | None = None,
        save_s: Callable[[], float | None] | None = None,
    ) -> None:
        super().__init__(name="flodl-stop-watch", daemon=True)
        self.mailbox = mailbox
        self.saving = saving
        self.announce = announce
        self.on_request = on_request
        self.grace_s = grace_s
        self.stopped = threading.Event()
        self._deadline: float | None = None
        self._answered = False
        self.on_checkpoint = on_checkpoint
        self.save_s = save_s
        self._checkpoints_seen = 0

    def start(self) -> None:
        global _watch
        _watch = self
        super().start()

    def run(self) -> None:
        while not self.stopped.wait(_WATCH_S):
            if _received is not None and self.saving is None:
                return  # the main thread stops on it
            try:
                found = self.mailbox.store.check([_STOP_KEY])
                signum = posted(self.mailbox) if found else None
                if signum is None and self.saving is not None:
                    self._carry_out_saving_stop()
                if signum is None and self.on_checkpoint is not None:
                    self._follow_checkpoint_requests(self.on_checkpoint)
            except Exception:  # the store is gone: the run is over or failing, and says so elsewhere
                if self._deadline is not None:  # a stop that saves can save nothing now: it stops at once
                    stop_now(_received or signal.SIGTERM)
                return
            if signum is not None:
                stop_now(signum)  # the main thread's handler takes it as its own
                return
            if self.stopped.is_set():  # it gave up: a second signal would reach a process already stopping
                return
            if self._deadline is not None and time.monotonic() > self._deadline:
                self._give_up(f"no checkpoint within stop_grace_s={self.grace_s:g}")
                return

    def _carry_out_saving_stop(self) -> None:
        assert self.saving is not None
        if self.saving.is_set() and self._deadline is None:  # this rank's own signal
            signum = _received or signal.SIGTERM
            self._deadline = time.monotonic() + self.grace_s
            self.mailbox.store.set(_REQUEST_KEY, str(signum))
            # Taken here before the coordinator hears of it: once it has, this rank has agreed where it saves
            # (sync's step) and marks the parts it saves from then on as the stop's.
            if (self._answered or self._answer()) and self.announce is not None:
                self.announce(signum)
        if not self._answered and self.mailbox.store.check([_REQUEST_KEY]):
            self._answer()

    def _answer(self) -> bool:
        """Take the posted request (once); False: this rank cannot save for it, and every rank stops now."""
        self._answered = True
        took = self.save_s() if self.save_s is not None else None
        if took is not None and took > self.grace_s:  # waiting out the budget would only lose time
            budget = f"stop_grace_s={self.grace_s:g}"
            self._give_up(f"this rank's last checkpoint took {took:.3g} s, more than {budget}")
            return False
        if self.on_request is not None and not self.on_request():
            self._give_up("this rank was past the agreed step before it learned it")
            return False
        return True

    def _follow_checkpoint_requests(self, on_checkpoint: Callable[[int], None]) -> None:
        if not self.mailbox.store.check([_CHECKPOINT_KEY]):
            return
        latest = int(self.mailbox.store.get(_CHECKPOINT_KEY))
        for request in range(self._checkpoints_seen + 1, latest + 1):
            on_checkpoint(request)
        self._checkpoints_seen = max(self._checkpoints_seen, latest)

    def _give_up(self, why: str) -> None:
        """The stop cannot save: every rank stops now, naming the last checkpoint."""
        signum = _received or int(self.mailbox.store.get(_REQUEST_KEY))
        log.warning("the stop could not save (%s): stopping now", why)
        post(self.mailbox, signum)
        self.stopped.set()
        stop_now(signum)

    def stop(self) -> None:
        """Stop and wait: a thread left inside a store call when the process exits aborts it. A stop signal
        from now on stops at once: no watch is left to carry out one that saves."""
        global _watch, _save_requested
        self.stopped.set()
        wait_ended(self, timeout=10)
        with _lock:
            _watch = None if _watch is self else _watch
            _save_requested = None if _save_requested is self.saving else _save_requested
