"""Liveness: each rank beats every few seconds; the coordinator names a rank that went silent.

A beat comes from a thread of its own, so it says "this process is alive and scheduled", not "it is
training": a rank waiting in a collective for a slow peer keeps beating, while a frozen process (stopped,
swapped out, its host gone) does not. Any message from a rank counts as a beat too.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.distributed import Store

from flodl.links.messages import Heartbeat
from flodl.links.threads import wait_ended
from flodl.links.transport import COORDINATOR, Mailbox


def beat_interval(timeout_s: float) -> float:
    """An eighth of the timeout, so a late beat never trips it and a silence is suspected well before it
    (rounds/supply.py); between 0.1 s and 1 s."""
    return min(max(timeout_s / 8, 0.1), 1.0)


@dataclass
class HeartbeatMonitor:
    """When each rank was last heard from (pure: the caller passes the clock)."""

    world_size: int
    timeout_s: float
    started: float
    last_seen: dict[int, float] = field(default_factory=dict)
    last_step: dict[int, int] = field(default_factory=dict)
    # Ranks not watched (survive: cut out, until admitted again).
    ignored: set[int] = field(default_factory=set)
    # How long a rank not heard from yet may take from the start (its task built, its first beat: ranks
    # started apart by hand start seconds apart); None: timeout_s. A rank that dies meanwhile is known by
    # its exit.
    startup_s: float | None = None

    def heard(self, rank: int, now: float, step: int | None = None) -> None:
        if rank in self.ignored:
            return
        self.last_seen[rank] = now
        if step is not None:
            self.last_step[rank] = step

    def silent(self, now: float) -> list[int]:
        """Ranks not heard from for longer than the timeout (from the start, for one never heard, longer
        than `startup_s`)."""
        return [
            rank
            for rank in range(self.world_size)
            if rank not in self.ignored and now - self.last_seen.get(rank, self.started) > self._limit(rank)
        ]

    def _limit(self, rank: int) -> float:
        if rank in self.last_seen or self.startup_s is None:
            return self.timeout_s
        return max(self.startup_s, self.timeout_s)

    def forget(self, rank: int) -> None:
        """Stop watching `rank` (it was cut out of the run)."""
        self.ignored.add(rank)
        self.last_seen.pop(rank, None)
        self.last_step.pop(rank, None)

    def watch(self, rank: int, now: float) -> None:
        """Watch `rank` again, as heard from `now` (it was admitted back)."""
        self.ignored.discard(rank)
        self.last_seen[rank] = now

    def silence_of(self, rank: int, now: float) -> float:
        return now - self.last_seen.get(rank, self.started)

    def describe(self, rank: int, now: float) -> str:
        quiet = self.silence_of(rank, now)
        step = self.last_step.get(rank)
        where = f" (last reported step {step})" if step is not None else ""
        return f"rank {rank} stopped responding: no heartbeat for {quiet:.0f} s{where}"


# Rank 0's beats, counted in the store: the other ranks watch rank 0, whose coordinator cannot name itself.
RANK0_BEATS = "beats/0"


class HeartbeatSender(threading.Thread):
    """Sends this rank's beats on its own store connection until stopped."""

    def __init__(
        self,
        rank: int,
        mailbox: Mailbox,
        interval_s: float,
        step: Callable[[], int],
        cut: Callable[[Store], bool] | None = None,
        on_cut: Callable[[], None] | None = None,
    ) -> None:
        """`cut`, read after each beat: whether the run's host cut this process out (a rank with no supervisor
        to end it, heard again after a partition or a freeze); then `on_cut`, at once, even while the
        training thread waits in a collective with peers that went on without it."""
        super().__init__(name=f"flodl-heartbeat-{rank}", daemon=True)
        self.rank = rank
        self.mailbox = mailbox
        self.interval_s = interval_s
        self.step = step
        self.cut, self.on_cut = cut, on_cut
        self.stopped = threading.Event()

    def start(self) -> None:
        """The first beat from the caller's thread, before it trains a step (a thread of a busy process may
        run later than a rank frozen at its first steps): the coordinator holds a rank it has not heard from
        yet to the start's bound (HeartbeatMonitor.startup_s), and the peers' watch on rank 0 starts from
        their own start. Then a beat every interval from the thread."""
        if self._beat():
            super().start()

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s) and self._beat():
            pass

    def _beat(self) -> bool:
        """One beat, and the cut read after it; False once the beats end (cut, or the store gone)."""
        try:
            self.mailbox.send(COORDINATOR, Heartbeat(self.rank, self.step()))
            if self.rank == 0:
                self._beat_count()
            if self.cut is not None and self.on_cut is not None and self.cut(self.mailbox.store):
                self.on_cut()
                return False
        except Exception:  # the store is gone: the run is over or failing, and says so elsewhere
            return False
        return True

    def _beat_count(self) -> None:
        with contextlib.suppress(Exception):
            self.mailbox.store.add(RANK0_BEATS, 1)

    def stop(self) -> None:
        """Stop and wait: a thread left inside a store call when the process exits aborts it."""
        self.stopped.set()
        wait_ended(self, timeout=30)


class Rank0Watch(threading.Thread):
    """Every other rank's watch on rank 0: a frozen rank 0 holds the coordinator, which names silent ranks,
    and the peers' collectives would wait out the collective timeout. A silence longer than the timeout since
    the last beat or this watch's start calls `on_silent`, once. The store is read by a thread of its own: a
    store hosted by the frozen rank 0 blocks its reads, which must not block the judgement."""

    def __init__(
        self, mailbox: Mailbox, timeout_s: float, interval_s: float, on_silent: Callable[[str], None]
    ) -> None:
        super().__init__(name="flodl-rank0-watch", daemon=True)
        self.mailbox = mailbox
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.on_silent = on_silent
        self.stopped = threading.Event()
        self.monitor = HeartbeatMonitor(1, timeout_s, time.perf_counter())

    def run(self) -> None:
        threading.Thread(target=self._read_beats, name="flodl-rank0-beats", daemon=True).start()
        while not self.stopped.wait(self.interval_s):
            now = time.perf_counter()
            if self.monitor.silent(now):
                self.on_silent(f"{self.monitor.describe(0, now)} (heartbeat_timeout_s={self.timeout_s:g})")
                return

    def _read_beats(self) -> None:
        last = 0
        while not self.stopped.wait(self.interval_s):
            try:
                beats = self.mailbox.store.add(RANK0_BEATS, 0)
            except Exception:  # the store timed out or is gone: no beat this time
                continue
            if beats != last:
                self.monitor.heard(0, time.perf_counter())
                last = beats

    def stop(self) -> None:
        self.stopped.set()
        wait_ended(self, timeout=30)
