"""The ranks a signal killed, seen by the launcher as they die, before torch's elastic agent reaps them.

The agent reports one failed rank: the first it finds exited. When a rank is killed (SIGKILL, the OOM killer)
and a peer then fails on the connection it lost, both may be gone by the agent's next look, and it may report
the peer; the killed rank's exit status is then reaped unseen, and the peer would be blamed. A SIGCHLD
handler in the launcher's main thread looks at each rank's exit status as it dies (waitid with WNOWAIT,
which leaves the child for the agent to reap) and keeps the signal that killed it. The ranks record their
process ids at their start (flodl/job/failures.py: record_pid).

The agent kills too, once it has a failure: SIGTERM to every rank left (a flodl rank takes it as a stop and
exits by itself, unless it had finished its part), and SIGKILL 30 s later to one that did not leave. Neither
began the failure: a SIGTERM death is not kept, nor a death seen well after the first failure a rank recorded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from flodl.job import failures
from flodl.launcher.supervisor import signal_name

_KILLED = {os.CLD_KILLED, os.CLD_DUMPED}
# A rank killed before a peer failed on its loss is seen within milliseconds of that peer's record (the
# handler runs as the main thread gets the signal); the agent's SIGKILL comes 30 s after its SIGTERM.
_BEGAN_WITHIN_S = 5.0


class SignalDeaths:
    """While entered: the ranks of run `run` (its uid) in `run_dir` that a signal killed, by attempt. Outside
    the main thread (where no handler can be set), it sees none and the agent's report stands alone."""

    def __init__(self, run_dir: Path, run: str) -> None:
        self._run_dir = run_dir
        self._run = run
        # (attempt, rank) -> the signal's name, and when the handler saw the death (time.time())
        self._killed: dict[tuple[int, int], tuple[str, float]] = {}
        self._previous: Any = None

    def __enter__(self) -> SignalDeaths:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGCHLD, self._look)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGCHLD, self._previous)
            self._previous = None

    def _look(self, signum: int, frame: FrameType | None) -> None:
        for pid, attempt_rank in failures.rank_pids(self._run_dir, self._run).items():
            if attempt_rank in self._killed:
                continue
            with contextlib.suppress(ChildProcessError):  # reaped already, or not this process's child
                ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if ended is not None and ended.si_code in _KILLED and ended.si_status != signal.SIGTERM:
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
