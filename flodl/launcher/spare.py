"""A rank's process started ahead of need, so that a survive restart does not wait for its imports.

A spawned rank imports torch and flodl before it can say a word: seconds (most of a restart's start-up on a
GPU machine, whose torch import alone takes several). While restarts are left, the supervisor keeps one
process started the ranks' way that has imported the ranks' module and torch's compiler (which a rank's
first optimizer step imports), and waits to be told which rank it is; a rank started again becomes that
process, and the next spare starts in the background. A forked rank has the supervisor's imports already:
no spare.
"""

from __future__ import annotations

import importlib
import signal
from collections.abc import Callable
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

# What a rank imports lazily that takes long: torch's compiler, on the first optimizer step.
_LATER_IMPORTS = ("torch._dynamo",)


class Spare:
    """One process that has done a rank's imports and waits (`become`) to run as a rank."""

    def __init__(self, context: ForkContext | SpawnContext | ForkServerContext, module: str) -> None:
        receive, self._send = context.Pipe(duplex=False)
        self.process = context.Process(target=_wait_to_become, args=(receive, module), name="flodl-spare")
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


def _wait_to_become(receive: Any, module: str) -> None:
    # A stop is the supervisor's to act on: it ends the spare itself, or the spare ends at the closed pipe.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    for name in (module, *_LATER_IMPORTS):
        importlib.import_module(name)
    try:
        target, args = receive.recv()
    except EOFError:  # the supervisor is gone or needs no rank
        return
    receive.close()
    target(*args)
