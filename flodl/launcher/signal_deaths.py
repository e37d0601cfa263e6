"""The ranks a signal killed, seen by the launcher as they die, before torch's elastic agent reaps them.

The agent reports one failed rank: the first it finds exited. When a rank is killed (SIGKILL, the OOM killer)
and a peer then fails on the connection it lost, both may be gone by the agent's next look (every 0.1 s), and
it may report the peer; the killed rank's exit status is then reaped unseen, and the peer would be blamed. A
thread of the launcher holds a pidfd of each rank (the ranks record their process ids at their start,
flodl/job/failures.py: record_pid), wakes as one dies and looks at its exit status with waitid's WNOWAIT,
which leaves the child for the agent to reap. A thread, not a SIGCHLD handler: a handler would be inherited
by forked ranks, and its signal would interrupt the system calls of their native code.

The agent kills too, once it has a failure: SIGTERM to every rank left (a flodl rank takes it as a stop and
exits by itself, unless it had finished its part), and SIGKILL 30 s later to one that did not leave. Neither
began the failure: a SIGTERM death is not kept, nor a death seen well after the first failure a rank recorded.
Where there are no pidfds (Linux before 5.3, other systems) it sees nothing, and the agent's report stands.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from pathlib import Path
from types import TracebackType

from flodl.job import failures
from flodl.launcher.rank_exit import signal_name

# How often the ranks' process id records are read again (a rank records its own once it starts).
_RECORDS_EVERY_S = 0.2
# A rank killed before a peer failed on its loss is seen within milliseconds of its death; the agent's
# SIGKILL comes 30 s after its SIGTERM.
_BEGAN_WITHIN_S = 5.0


class SignalDeaths:
    """While entered: the ranks of run `run` (its uid) in `run_dir` that a signal killed, by attempt."""

    def __init__(self, run_dir: Path, run: str) -> None:
        self._run_dir = run_dir
        self._run = run
        # (attempt, rank) -> the signal's name, and when it was seen (time.time())
        self._killed: dict[tuple[int, int], tuple[str, float]] = {}
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> SignalDeaths:
        if hasattr(os, "pidfd_open") and hasattr(os, "P_PIDFD"):
            self._thread = threading.Thread(target=self._watch, name="flodl-rank-deaths", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        watched: dict[int, tuple[int, int]] = {}  # pidfd -> (attempt, rank)
        opened: set[int] = set()  # the process ids given a pidfd
        try:
            while not self._done.is_set():
                for pid, attempt_rank in failures.rank_pids(self._run_dir, self._run).items():
                    if pid not in opened:
                        opened.add(pid)
                        with contextlib.suppress(OSError):  # gone and reaped already
                            watched[os.pidfd_open(pid)] = attempt_rank
                ended, _, _ = select.select(list(watched), [], [], _RECORDS_EVERY_S)
                for fd in ended:
                    self._look(fd, watched.pop(fd))
                    os.close(fd)
        finally:
            for fd in watched:
                os.close(fd)

    def _look(self, pidfd: int, attempt_rank: tuple[int, int]) -> None:
        try:
            ended = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already, or not this process's child
            return
        if ended is None or ended.si_code not in (os.CLD_KILLED, os.CLD_DUMPED):
            return
        if ended.si_status != signal.SIGTERM:
            self._killed[attempt_rank] = (signal_name(ended.si_status), time.time())

    def began(self, attempt: int, first_record: float | None) -> dict[int, str]:
        """The rank -> signal name of each rank of attempt `attempt` that a signal killed before the failure
        a rank first recorded (at `first_record`, time.time(); None: no rank recorded one)."""
        latest = float("inf") if first_record is None else first_record + _BEGAN_WITHIN_S
        return {
            rank: name
            for (seen_attempt, rank), (name, seen) in self._killed.items()
            if seen_attempt == attempt and seen <= latest
        }
