"""Waiting for a thread's end where a stop signal may interrupt the wait.

A stop raises Stopped in the main thread at its next bytecode, inside `Thread.join` too. Python before 3.13
then takes the joined thread for ended while it runs on: `is_alive()` says False and every later join returns
at once. A rank's way out after a stop still waits for its threads (the coordinator commits what is written
and keeps the timeline; a thread left inside a store call aborts the process as it exits), so the main
thread waits with `wait_ended`, which a stop leaves right."""

from __future__ import annotations

import threading
import time

# How often a wait looks again once a join cannot tell: on a rank's way out, where 10 ms is nothing.
_LOOK_S = 0.01


def wait_ended(thread: threading.Thread, timeout: float | None = None) -> bool:
    """Wait until `thread`'s body has returned (True) or `timeout` seconds passed (False). A thread never
    started has ended."""
    deadline = None if timeout is None else time.monotonic() + timeout
    # A thread leaves threading's list of active ones only as its body returns, whatever a join said.
    while thread in threading.enumerate():
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        if thread.is_alive():  # no join was interrupted: one wakes the moment the thread ends
            thread.join(left)
        else:  # an interrupted join took it for ended (or it is only starting): look again shortly
            time.sleep(_LOOK_S if left is None else min(_LOOK_S, left))
    return True
