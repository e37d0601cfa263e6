"""Liveness: each rank beats every few seconds; the coordinator names a rank that went silent.

A beat comes from a thread of its own, so it says "this process is alive and scheduled", not "it is
training": a rank waiting in a collective for a slow peer keeps beating, while a frozen process (stopped,
swapped out, its host gone) does not. Any message from a rank counts as a beat too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from flodl.wire.messages import Heartbeat
from flodl.wire.transport import COORDINATOR, Mailbox


def beat_interval(timeout_s: float) -> float:
    """A quarter of the timeout, so one late beat never trips it; between 0.2 s and 10 s."""
    return min(max(timeout_s / 4, 0.2), 10.0)


@dataclass
class HeartbeatMonitor:
    """When each rank was last heard from (pure: the caller passes the clock)."""

    world_size: int
    timeout_s: float
    started: float
    last_seen: dict[int, float] = field(default_factory=dict)
    last_step: dict[int, int] = field(default_factory=dict)

    def heard(self, rank: int, now: float, step: int | None = None) -> None:
        self.last_seen[rank] = now
        if step is not None:
            self.last_step[rank] = step

    def silent(self, now: float) -> list[int]:
        """Ranks not heard from for longer than the timeout (from the start, for one never heard)."""
        return [
            rank
            for rank in range(self.world_size)
            if now - self.last_seen.get(rank, self.started) > self.timeout_s
        ]

    def describe(self, rank: int, now: float) -> str:
        quiet = now - self.last_seen.get(rank, self.started)
        step = self.last_step.get(rank)
        where = f" (last reported step {step})" if step is not None else ""
        return f"rank {rank} stopped responding: no heartbeat for {quiet:.0f} s{where}"


class HeartbeatSender(threading.Thread):
    """Sends this rank's beats on its own store connection until stopped."""

    def __init__(self, rank: int, mailbox: Mailbox, interval_s: float, step: Callable[[], int]) -> None:
        super().__init__(name=f"flodl-heartbeat-{rank}", daemon=True)
        self.rank = rank
        self.mailbox = mailbox
        self.interval_s = interval_s
        self.step = step
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.mailbox.send(COORDINATOR, Heartbeat(self.rank, self.step()))
            except Exception:  # the store is gone: the run is over or failing, and says so elsewhere
                return

    def stop(self) -> None:
        """Stop and wait: a thread left inside a store call when the process exits aborts it."""
        self.stopped.set()
        self.join(timeout=30)
