"""The prefetcher: a bounded background pipeline that assembles the plan's next batches ahead of the step.

At most `depth` batches past the worker's position are assembled or being assembled (depth 0: none, every
batch is loaded on demand). `take(position)` hands over the batch at that plan position when it is ready,
waits when it is being assembled, and otherwise says None (the caller loads it itself). What an assembled
batch is (host tensors, or device tensors with a ready event) is the `assemble` callable's business.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from flodl.data.advice import PlannedBatch, ReadPlan

log = logging.getLogger(__name__)

# Depth of the plain host queue on CPU-only machines.
CPU_DEPTH = 4


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Prefetcher:
    def __init__(
        self, plan: ReadPlan, assemble: Callable[[PlannedBatch], Any], depth: int, setup: Callable[[], None]
    ) -> None:
        self.plan = plan
        self.assemble = assemble
        self.depth = depth
        self._setup = setup
        self._cond = plan.changed  # one lock for the plan and the pipeline: no ordering hazards
        self._ready: dict[int, Any] = {}
        self._busy: int | None = None
        self._next = plan.position()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="flodl-prefetch", daemon=True)
        self._thread.start()

    def set_depth(self, depth: int) -> None:
        with self._cond:
            self.depth = depth
            self._cond.notify_all()

    def take(self, position: int, wait: bool = False) -> Any | None:
        """The assembled batch at `position`, or None when the caller must assemble it. `wait`: unless the
        pipeline is off or stopped, wait for it to assemble `position` (which must be the plan's next)."""
        with self._cond:
            for stale in [p for p in self._ready if p < position]:
                del self._ready[stale]
            while position not in self._ready and (self._busy == position or (wait and self._running())):
                self._cond.wait(0.5)
            self._next = max(self._next, position + 1)
            ready = self._ready.pop(position, None)
        if isinstance(ready, _Failed):
            raise ready.error
        return ready

    def _running(self) -> bool:
        return self.depth > 0 and not self._stop and self._thread.is_alive()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _claim(self) -> tuple[int, PlannedBatch] | None:
        """Under the lock: the next position to assemble, waiting until one is due; None when stopping."""
        while not self._stop:
            self._next = max(self._next, self.plan.position())
            planned = self.plan.get(self._next)
            if planned is not None and self._next < self.plan.position() + self.depth:
                self._busy = self._next
                self._next += 1
                return self._busy, planned
            self._cond.wait(0.5)
        return None

    def _run(self) -> None:
        try:
            self._setup()
            self._loop()
        except Exception:  # prefetch is an optimisation: take() keeps answering None, loads go on demand
            log.exception("prefetch thread stopped; batches are loaded on demand")

    def _loop(self) -> None:
        while True:
            with self._cond:
                claimed = self._claim()
            if claimed is None:
                return
            position, planned = claimed
            try:
                result: Any = self.assemble(planned)
            except BaseException as err:  # handed to the training thread, which raises it
                result = _Failed(err)
            with self._cond:
                if position >= self.plan.position():
                    self._ready[position] = result
                self._busy = None
                self._cond.notify_all()
