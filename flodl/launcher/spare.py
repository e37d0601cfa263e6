"""A rank's process started ahead of need, so that a survive restart does not wait for its imports.

A spawned rank imports torch, flodl and the task's code before it trains: seconds (most of a restart's
start-up on a GPU machine, whose torch import alone takes several). While restarts are left, the supervisor
keeps one process started the ranks' way that has imported what the ranks import (the job names it: the
ranks' body, torch's compiler, the task's targets) and waits to be told which rank it is; a rank started
again becomes that process, and the next spare starts in the background. A forked rank has the supervisor's
imports already: no spare.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

from flodl.config.targets import locate


class Spare:
    """One process that has done a rank's imports and waits (`become`) to run as a rank."""

    def __init__(
        self, context: ForkContext | SpawnContext | ForkServerContext, imports: tuple[str, ...]
    ) -> None:
        receive, self._send = context.Pipe(duplex=False)
        self.process = context.Process(target=_wait_to_become, args=(receive, imports), name="flodl-spare")
        self.process.start()
        receive.close()

    @property
    def alive(self) -> bool:
        return self.process.exitcode is None

    def become(self, target: Callable[..., None], args: tuple[Any, ...], name: str) -> BaseProcess:
        """The spare's process, now `name` running `target(*args)` (its imports done or not yet)."""
        self._send.send((target, args))
        self._send.close()
        self.process.name = name
        return self.process

    def discard(self) -> None:
        self._send.close()  # a spare still importing ends on its own at the closed pipe; this is quicker
        self.process.kill()
        self.process.join()
        self.process.close()


def _wait_to_become(receive: Any, imports: tuple[str, ...]) -> None:
    # A stop is the supervisor's to act on: it ends the spare itself, or the spare ends at the closed pipe.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    for path in imports:
        with contextlib.suppress(Exception):  # the rank imports it again, and says what failed
            locate(path)
    try:
        target, args = receive.recv()
    except EOFError:  # the supervisor is gone or needs no rank
        return
    receive.close()
    target(*args)
