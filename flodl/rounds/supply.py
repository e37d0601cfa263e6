"""Async under survive: a window whose round waits on a silent member keeps the others supplied.

A frozen member, or one cut off the network, is cut only once `heartbeat_timeout_s` has passed; until then
the round cannot fire (it waits for every member's count), and the members that reached theirs train their
overshoot and wait. Local SGD needs no such wait: a member that reached is handed more of the segment, a
couple of heartbeats' worth of its steps at a time, and trains on. A member that reached its count and then
went silent would hold every other inside the round's collective: the round waits for it too (the planner's
`suspects`, set by the driver). The round then averages what each did
(weighted by its steps), once the silent member is cut or heard from again. The batches come from the same
cursor, each handed out once; where a top-up takes the segment's last, the next window holds every member to
all it holds, and its round is the segment's exact last (planner.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flodl.rounds.orders import Dispatch
from flodl.rounds.planner import LocalSgdPlanner

# Heartbeats a member may miss before the others are kept supplied (a late beat costs only a top-up).
SUSPECT_BEATS = 2


def top_up(planner: LocalSgdPlanner, rank: int, batches: int) -> Dispatch | None:
    """`batches` more of the segment for `rank`, a member that reached its count in the open window (async);
    None where the window does not wait on the others' counts (closed, or its round fired), or where the
    segment has nothing left."""
    waits = planner.window_open and not planner.averaging and rank in planner.reached
    batches = min(batches, planner.cursor.left_in_segment())
    if not planner.is_async or not waits or batches <= 0:
        return None
    slices = planner.cursor.take(batches, planner.batch_size, cross_epochs=True)
    planner.queued[rank] += batches
    planner.holders.hand(rank, slices)
    return Dispatch(rank, slices, None)


@dataclass
class Supplied:
    """Until when each member is supplied while a window waits on a silent one (pure: the caller passes the
    clock). A top-up is due once less than a heartbeat of a member's work is left."""

    beat_s: float
    until: dict[int, float] = field(default_factory=dict)

    def due(self, rank: int, now: float) -> bool:
        return self.until.get(rank, now) - now < self.beat_s

    def batches(self, ms_per_batch: float) -> int:
        """A top-up: SUSPECT_BEATS heartbeats of steps at the member's speed."""
        return max(1, round(SUSPECT_BEATS * self.beat_s * 1000 / ms_per_batch))

    def handed(self, rank: int, now: float, batches: int, ms_per_batch: float) -> None:
        self.until[rank] = max(self.until.get(rank, now), now) + batches * ms_per_batch / 1000

    def clear(self) -> None:
        """The wait is over (the window's round fired, or nobody is silent)."""
        self.until.clear()
